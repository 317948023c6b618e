"""`launch doctor`: the click edge over launcher.health (launcher.health.doctor runs the check on
every node, one SSH session per node, all at once), then one table: a row per node, a
column per check, problems in red, warnings in yellow; `--json` prints the same as one JSON
document on stdout. Exit 0 when every node is healthy; else exit 1 and print the `--exclude`
list that leaves the failing nodes out (2 for a user error, as every `launch` command).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher.cli.options import SOURCE_OPTIONS, DryRunCommand, apply_options, build_config, find_cluster
from launcher.cli.render import err, setup_logging, user_errors
from launcher.cluster.topology import RANK_ORDERS
from launcher.core.program import stdin_env
from launcher.core.types import Workload
from launcher.health import CHECKS, FAIL, OK, WARN, Doctor, doctor_programs, run_doctor, to_json

__all__ = ["doctor", "render"]

_STYLE = {OK: "green", WARN: "yellow", FAIL: "red"}


def render(found: Doctor, console: Console) -> None:
    """The table on `console`, then one line per problem, the cluster's warnings, the rank order
    and, when a node failed, the --exclude list."""
    report, order = found.report, found.order
    table = Table(
        title=f"launch doctor: {len(report.nodes)} nodes" + (f", {report.machine_type}" if report.machine_type else ""),
        title_justify="left",
    )
    table.add_column("node")
    table.add_column("host")
    for col in CHECKS:
        table.add_column(col)
    for n in report.nodes:
        style = _STYLE.get(n.status, "")
        head = [f"[{style}]{n.rank}[/{style}]", escape(n.host + (f" ({n.name})" if n.name else ""))]
        if not n.reachable:
            table.add_row(*head, f"[red]unreachable: {escape(n.error)}[/red]", *[""] * (len(CHECKS) - 1))
            continue
        cells = []
        for col in CHECKS:
            c = n.checks[col]
            s = _STYLE.get(c.status)
            cells.append(f"[{s}]{escape(c.value)}[/{s}]" if s and c.status != OK else escape(c.value))
        table.add_row(*head, *cells)
    console.print(table)
    for n in report.nodes:
        if not n.reachable:
            console.print(f"[red]{escape(n.problems[0])}[/red]")
            continue
        for col in CHECKS:
            c = n.checks[col]
            style = "red" if c.status == FAIL else "yellow"
            for p in c.problems:
                console.print(f"[{style}]{escape(n.label)}: {escape(p)}[/{style}]")
    for w in report.warnings:
        console.print(f"[yellow]warning: {escape(w)}[/yellow]")
    console.print(f"[dim]{escape(order.message)}[/dim]")
    if report.healthy:
        console.print(f"[green]all {len(report.nodes)} nodes healthy[/green]")
    else:
        bad = report.exclude
        console.print(f"[red]{len(bad)} of {len(report.nodes)} nodes failed a check; leave them out with:[/red]")
        console.print(f"--exclude {','.join(bad)}", markup=False)


@click.command(cls=DryRunCommand)
@apply_options(SOURCE_OPTIONS)
@click.option(
    "--env",
    "env",
    multiple=True,
    metavar="KEY[=VALUE]",
    help="Set a variable on every node, as a launch would (e.g. PATH for --python's lookup); KEY alone "
    "passes this machine's value.",
)
@click.option("--image-os", type=click.Choice(["ubuntu", "cos"]), help="Interface naming of the image.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout instead of the table.")
@click.option(
    "--min-free-gb",
    type=float,
    default=10.0,
    show_default=True,
    help="Free space each node needs in its working directory and on its local SSDs.",
)
@click.option(
    "--rank-order",
    type=click.Choice(RANK_ORDERS),
    help="Which rank order to report: topology (default when every node has a physical host) or given.",
)
@user_errors
def doctor(as_json: bool, min_free_gb: float, rank_order: str | None, **o: Any) -> None:
    """Check every node's GPUs, NICs, network stack, versions, disk and clock (reading only)."""
    setup_logging()
    cluster = find_cluster(o)
    config = build_config(o, Workload("exec", ("true",)), cluster)
    if config.dry_run:
        programs = doctor_programs(cluster, config, config.image_os)  # --image-os, else the stack's bootImage
        env = stdin_env(config)
        if env:
            err.print(f"[dim]each node reads on stdin: {' '.join(f'{k}=<from --env, hidden>' for k, _ in env)}[/dim]")
        for n in cluster.nodes:
            click.echo(f"{n.host}\t{programs[n.rank]}")
        return
    with err.status(f"checking {len(cluster.nodes)} nodes…"):
        found = run_doctor(cluster, config, config.image_os, min_free_gb, rank_order)
    if as_json:
        click.echo(json.dumps(to_json(found), indent=2))
    else:
        render(found, Console(highlight=False, width=None if sys.stdout.isatty() else 250))
    if not found.report.healthy:
        raise SystemExit(1)
