"""`launch hosts`: the nodes in rank order, each checked over SSH for the startup script's ready
marker, and where it physically sits."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpufleet.contracts import READY_MARKER
from gpufleet.node_plan import Check, CheckKind
from launcher.cli.options import SOURCE_OPTIONS, DryRunCommand, apply_options, build_config, find_cluster
from launcher.cli.render import err, setup_logging, user_errors
from launcher.cluster.topology import node_physical_hosts, spread_warning
from launcher.core.launch import Launch
from launcher.core.types import Workload

__all__ = ["hosts"]


@click.command(cls=DryRunCommand, name="hosts")
@apply_options(SOURCE_OPTIONS)
@user_errors
def hosts(**o: Any) -> None:
    """List the nodes in rank order; check SSH and the startup script's ready marker."""
    setup_logging()
    cluster = find_cluster(o)
    config = build_config(o, Workload("exec", ("true",)), cluster)
    if config.dry_run:
        for n in cluster.nodes:
            click.echo(f"{n.rank}\t{n.host}\t{n.address}\t{n.name}")
        return
    with err.status(f"checking {len(cluster.nodes)} nodes…"):
        # Where each node sits, from its metadata server (or the API, for --label): doctor's topology.
        probes = Launch(cluster, config).probe(check_torch=False, extra=[Check(CheckKind.PHYSICAL_HOST)])
    places = node_physical_hosts(cluster, {r: p.facts for r, p in probes.items() if p.ok})
    table = Table()
    for col in ("node", "host", "address", "name", "ssh", "ready", "hostname", "block/subblock"):
        table.add_column(col)
    for n in cluster.nodes:
        p, place = probes[n.rank], places.get(n.host)
        ssh = "[green]ok[/green]" if p.ok else f"[red]{escape(p.error)}[/red]"
        ready = p.facts.get("ready", "-")
        ready = "[green]yes[/green]" if ready == "yes" else f"[yellow]{ready}[/yellow]"
        where = "/".join(x for x in (place.block, place.subblock) if x) if place else "-"
        table.add_row(str(n.rank), n.host, n.address, n.name, ssh, ready, p.facts.get("host", ""), where)
    # A pipe or file gets the whole table, not one squeezed into 80 columns.
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)
    spread = spread_warning(places)
    if spread:
        err.print(f"[yellow]warning: {escape(spread)}[/yellow]")
    err.print(f"[dim]ready marker: {READY_MARKER}[/dim]")
    if any(not p.ok for p in probes.values()):
        raise SystemExit(1)
