"""`launch doctor`: the click edge over launcher.doctor. One SSH session per node, all at once
(the launch's own check sessions, ended after the check), then one table: a row per node, a
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

from launcher.cli.options import SOURCE_OPTIONS, apply_options, build_config, find_cluster
from launcher.cli.render import err, setup_logging, user_errors
from launcher.cluster.topology import RANK_ORDERS, RankOrder, rank_order
from launcher.core.env import node_env
from launcher.core.prestart import CHECKS, FAIL, OK, WARN, expectation
from launcher.core.program import env_stdin, stdin_env
from launcher.core.types import Cluster, LaunchConfig, Workload
from launcher.doctor import Report, judge, node_script

__all__ = ["doctor", "run_doctor", "render"]

_STYLE = {OK: "green", WARN: "yellow", FAIL: "red"}


def _check_sessions(cluster: Cluster, config: LaunchConfig, scripts: dict[int, str]):
    """Each node's program in one SSH session, all at once (the launch's bounded handshakes),
    sent home once it has answered: {rank: Probe}."""
    from launcher.core.launch import Launch

    return Launch(cluster, config).ask(scripts, env_stdin(config))


def run_doctor(
    cluster: Cluster, config: LaunchConfig, image_os: str | None, min_free_gb: float, mode: str | None
) -> tuple[Report, RankOrder]:
    """Check every node and judge the answers; also the rank order a launch would use."""
    expect = expectation(cluster.machine_type, image_os, node_env(cluster, config))
    env = stdin_env(config)
    scripts = {n.rank: node_script(n, expect, config.python, config.workdir, env) for n in cluster.nodes}
    probes = _check_sessions(cluster, config, scripts)
    report = judge(
        cluster.nodes,
        {r: (p.facts if p.ok else None) for r, p in probes.items()},
        expect,
        errors={r: p.error for r, p in probes.items() if not p.ok},
        skews={r: p.skew_s for r, p in probes.items()},
        min_free_gb=min_free_gb,
    )
    hosts = {n.host: n.physical_host for n in report.nodes}
    order = rank_order(cluster, hosts, "given" if mode == "given" else None, "the metadata server")
    return report, order


def render(report: Report, order: RankOrder, console: Console) -> None:
    """The table on `console`, then one line per problem, the cluster's warnings, the rank order
    and, when a node failed, the --exclude list."""
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


def to_json(report: Report, order: RankOrder) -> dict:
    doc = report.to_json()
    doc["rank_order"] = {
        "topology": order.reordered,
        "message": order.message,
        "hosts": [n.host for n in order.cluster.nodes],
    }
    return doc


@click.command()
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
        expect = expectation(cluster.machine_type, o.get("image_os"), node_env(cluster, config))
        env = stdin_env(config)
        if env:
            err.print(f"[dim]each node reads on stdin: {' '.join(f'{k}=<from --env, hidden>' for k, _ in env)}[/dim]")
        for n in cluster.nodes:
            click.echo(f"{n.host}\t{node_script(n, expect, config.python, config.workdir, env)}")
        return
    with err.status(f"checking {len(cluster.nodes)} nodes…"):
        report, order = run_doctor(cluster, config, o.get("image_os"), min_free_gb, rank_order)
    if as_json:
        click.echo(json.dumps(to_json(report, order), indent=2))
    else:
        render(report, order, Console(highlight=False, width=None if sys.stdout.isatty() else 250))
    if not report.healthy:
        raise SystemExit(1)
