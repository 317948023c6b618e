"""`launch jobs`: the cluster's detached jobs, newest first, as a table or JSON lines, each with its
goodput, node-hours and cost so far (launcher.jobs.goodput), its idle spares (--spares), and below
the table one line per recovered failure: its time to train again, where the restore came from and
the spare swapped in. A job whose controller died while its
nodes still wait for one gets its controller started again (launcher.jobs.adopt). `--all` adds
every account's jobs on the nodes, attached ones too, as the nodes' holds say (launcher.jobs.holds):
who, which job, since when, on which nodes."""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher.cli.detached import STATE_STYLE, dry_run, node0, restart_orphans
from launcher.cli.options import SOURCE_OPTIONS, DryRunCommand, apply_options
from launcher.cli.render import user_errors
from launcher.core.holds import holds_script
from launcher.jobs.goodput import failure_lines, format_cost, goodput_of
from launcher.jobs.holds import cluster_holds
from launcher.jobs.record import JobRecord, list_script

__all__ = ["jobs"]


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _row(r: JobRecord) -> list[str]:
    dur = r.duration_s
    what = r.what if len(r.what) <= 48 else r.what[:47] + "…"
    g = goodput_of(r)
    return [
        r.id,
        escape(what),
        f"[{STATE_STYLE[r.state.value]}]{r.state.value}[/]",
        str(len(r.nodes)) + (f" (+{len(r.spares)} spare{'s' * (len(r.spares) != 1)})" if r.spares else ""),
        _when(r.started),
        "-" if dur is None else f"{dur:.0f} s",
        "-" if g.goodput_pct is None else f"{g.goodput_pct:.1f}%",
        f"{g.node_hours:.2f}",
        escape(format_cost(g)),
        "-" if r.exit is None else str(r.exit),
        escape(r.why + _recoveries(r)) if r.state.value in ("FAILED", "STOPPED", "RECOVERING") else "",
    ]


def _recoveries(r: JobRecord) -> str:
    n = len(r.recoveries)
    if not n or r.state.value == "RECOVERING":
        return ""
    return f" ({n} recover{'y' if n == 1 else 'ies'}; --json lists them)"


@click.command(cls=DryRunCommand, name="jobs")
@apply_options(SOURCE_OPTIONS)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job per line.")
@click.option(
    "--all",
    "every_account",
    is_flag=True,
    help="Also every account's jobs on the nodes (attached ones too): who, which job, since when, which nodes.",
)
@user_errors
def jobs(as_json: bool, every_account: bool, **o: Any) -> None:
    """List the cluster's detached jobs, newest first, with each one's goodput (productive share
    of its time on the nodes), node-hours and cost so far at on-demand / Spot list prices."""
    cluster, n0 = node0(o)
    steps = [("list the jobs (and start again any dead controller)", list_script())]
    if every_account:
        steps.append(("list every account's holds (on each node)", holds_script()))
    if dry_run(o, n0, steps):
        return
    records = n0.records()
    restart_orphans(n0, records)
    held = cluster_holds(cluster, n0.transport) if every_account else {}
    if as_json:
        for r in records:
            click.echo(json.dumps({**r.to_json(), "goodput": goodput_of(r).to_json()}))
        for h, nodes in held.items():
            click.echo(json.dumps({"held": {"account": h.account, "id": h.job, "since": h.since, "nodes": nodes}}))
        return
    table = Table()
    for col in ("id", "what", "state", "nodes", "started", "duration", "goodput", "node-h", "cost", "exit", "why"):
        table.add_column(col)
    for r in records:
        table.add_row(*_row(r))
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    out.print(table)
    for r in records:  # each recovered failure's account, and the spares swapped in for it
        for line in failure_lines(goodput_of(r)):
            out.print(f"job {r.id} {escape(line)}", soft_wrap=True)
    if every_account:
        on = Table(title="every account's jobs on the nodes")
        for col in ("account", "id", "since", "nodes"):
            on.add_column(col)
        for h, nodes in held.items():
            on.add_row(escape(h.account), escape(h.job), _when(h.since), escape(", ".join(nodes)))
        out.print(on)
