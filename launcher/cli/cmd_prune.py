"""`launch prune`: free the nodes' disks of what launches left there (launcher.code.prune)."""

from __future__ import annotations

from typing import Any

import click
from rich.markup import escape

from launcher.cli.options import SOURCE_OPTIONS, DryRunCommand, apply_options, find_cluster, ssh_config, trusted_ssh
from launcher.cli.render import err, setup_logging, user_errors
from launcher.code.prune import HostPrune, PruneRequest, prune
from launcher.code.snapshot import human_size
from launcher.core.transport import make_transport
from launcher.jobs.recovery import parse_duration

__all__ = ["prune_"]

_KIND = {
    "work": "job directory",
    "env": "environment",
    "code": "gpufleet code",
    "run output": "run output",
    "kept log": "kept log",
}


def _age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    days, hours = divmod(int(seconds) // 3600, 24)
    return f"unused {days}d{hours}h" if days else f"unused {hours}h{int(seconds) % 3600 // 60}m"


def _line(rank: int, item: dict, verb: str) -> str:
    what = f"{item['count']} stored files no snapshot uses" if item["kind"] == "objects" else item["path"]
    return f"node {rank}\t{verb}\t{_KIND.get(item['kind'], item['kind'])}\t{what}\t{human_size(item['bytes'])}"


def _summary(rank: int, a: HostPrune, removing: bool) -> str:
    going = a.going
    size = human_size(sum(i["bytes"] for i in going))
    verb = "freed" if removing else "would free"
    reasons: dict[str, int] = {}
    for i in a.kept:
        reasons[i["kept"]] = reasons.get(i["kept"], 0) + 1
    kept = "; ".join(f"kept {n}: {why}" for why, n in sorted(reasons.items()))
    free = f"{human_size(a.free)} free of {human_size(a.total)}"
    return (
        f"{a.label}: {verb} {size} in {len(going)} item{'s' * (len(going) != 1)}"
        + (f"; {kept}" if kept else "")
        + f"; {free}"
    )


@click.command(cls=DryRunCommand, name="prune")
@apply_options(SOURCE_OPTIONS)
@click.option(
    "--older-than",
    default="7d",
    show_default=True,
    metavar="DURATION",
    help="Remove only what no launch has used for this long (90s, 30m, 12h, 7d).",
)
@click.option("--list", "list_only", is_flag=True, help="Say what would be removed, and remove nothing.")
@user_errors
def prune_(older_than: str, list_only: bool, **o: Any) -> None:
    """Free the nodes' disks: remove the job directories, environments and code that launches
    left under ~/.gpufleet and that no launch has used for --older-than. Kept whatever its age:
    what a running process uses, and what a detached job that has not ended still needs (its
    records on the controller host say which). Never removed: job records, keys. One line per item on
    stdout, one summary per node on stderr."""
    setup_logging()
    request = PruneRequest(parse_duration(older_than, "--older-than"), remove=not list_only)
    cluster = find_cluster(o)
    transport = make_transport(cluster, trusted_ssh(o, cluster, ssh_config(o, cluster)), o.get("dry_run", False))
    if o.get("dry_run"):
        hosts = [*cluster.nodes, *([cluster.controller] if cluster.controller else [])]
        what = "list what is unused and unneeded" + ("" if list_only else ", then remove it (every node)")
        for host in hosts:
            # The program is node_prune.py's source text: named, not printed whole.
            click.echo(f"{host.host}\t{what}\tpython3 -S -c \"$(cat launcher/code/node_prune.py)\" scan")
        return
    with err.status(f"{'listing' if list_only else 'pruning'} {len(cluster.nodes)} nodes…"):
        answers = prune(cluster, transport, request)
    failed = False
    for rank, a in sorted(answers.items()):
        if rank < 0:  # the controller host: asked for its records only, never pruned
            continue
        if a.error:
            err.print(f"[red]{escape(a.label)}: could not be asked ({escape(a.error)}); nothing removed there[/red]")
            failed = True
            continue
        for item in a.going:
            click.echo(_line(rank, item, "removed" if not list_only else "would remove") + f"\t{_age(item['age_s'])}")
        err.print(escape(_summary(rank, a, not list_only)))
    if failed:
        raise SystemExit(1)
