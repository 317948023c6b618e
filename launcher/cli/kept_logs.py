"""`launch logs JOB_ID` for an attached launch (its run directory here holds its summary,
launch.json, or says that nodes kept their logs): every node's log is here, but for a launch
down a tree (`--fanout`) the nodes whose lines it did not show live (`--output rank0|failures`)
kept their whole output on the node (launcher.code.node_agent.Keep,
~/.gpufleet/logs/JOB/node-RANK.log). Those are read back down a tree of their own, one connection
from here, and copied to RUNS_DIR/JOB_ID/node-RANK.log."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from launcher.cli.options import find_cluster, ssh_config, trusted_ssh
from launcher.cli.render import setup_logging
from launcher.code.tree import DEFAULT_FANOUT
from launcher.core.output import kept_nodes
from launcher.core.transport import make_transport
from launcher.core.types import Cluster, Node, UserError

__all__ = ["kept_logs", "read_script"]

READ_TIMEOUT_S = 3600.0  # for every node's log to come back (a week's run may have GBs of them)


def read_script(job_id: str, log: str) -> str:
    """What a node runs to print its kept log `log` (JOB/node-RANK.log, under ~/.gpufleet/logs)."""
    return (
        f"f=\"$HOME\"/.gpufleet/logs/{shlex.quote(log)}; "
        f'[ -f "$f" ] || {{ echo "no log of job {job_id} on this node (removed by launch prune, or a new VM)" >&2; '
        'exit 3; }; cat -- "$f"'
    )


def kept_logs(o: dict[str, Any], job_id: str, node: int | None, follow: bool) -> bool:
    """Print the logs of `job_id` when it is an attached launch of this machine's (False
    otherwise: a detached job's, read from its controller host). Every node's lines prefixed with
    `[node N]` in rank order, or node `node`'s alone."""
    run_dir = Path(o.get("runs_dir") or "runs") / job_id
    kept = kept_nodes(run_dir)
    if not kept and not (run_dir / "launch.json").exists():
        return False
    if follow:
        raise UserError(f"job {job_id} ran attached, and its logs are whole once it has ended; drop -f")
    ranks = sorted({*kept, *_local_ranks(run_dir)})
    if not ranks:
        raise UserError(f"job {job_id} left no node log in {run_dir}")
    if node is not None and node not in ranks:
        raise UserError(f"--node {node} is not a node of job {job_id} (0..{max(ranks)})")
    wanted = [node] if node is not None else ranks
    # Each kept log comes whole into its copy here, as it arrives; printed from there after.
    failed = _fetch(o, job_id, {r: kept[r] for r in wanted if r in kept}, run_dir)
    for rank in wanted:
        path = run_dir / f"node-{rank}.log"
        if path.exists():
            _print(path, None if node is not None else f"[node {rank}] ")
    if failed:
        rank = min(failed)
        more = f" (and {len(failed) - 1} other node{'s' * (len(failed) > 2)})" if len(failed) > 1 else ""
        raise UserError(
            f"node {rank}'s log of job {job_id} could not be read ({failed[rank]}){more}; what came up of it is "
            f"in {run_dir / f'node-{rank}.log'}"
        )
    return True


def _local_ranks(run_dir: Path) -> list[int]:
    ranks = []
    for p in run_dir.glob("node-*.log"):
        rank = p.stem.removeprefix("node-")
        if rank.isdigit():
            ranks.append(int(rank))
    return ranks


def _print(path: Path, prefix: str | None) -> None:
    """`path` on stdout, line by line (a week's log is never held in memory), each line after
    `prefix` when given."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                line = raw.decode("utf-8", "replace")
                sys.stdout.write(line if prefix is None else prefix + line.rstrip("\n") + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        from launcher.cli.detached import reader_gone

        reader_gone()


def _fetch(o: dict[str, Any], job_id: str, want: dict[int, dict], run_dir: Path) -> dict[int, str]:
    """Each wanted node's kept log, by the run's rank, read down a tree into
    RUN_DIR/node-RANK.log (replacing what came up of it during the run only once it is whole):
    the ranks that could not be read, and why."""
    if not want:
        return {}
    setup_logging()
    cluster = find_cluster(o)
    by_address = {n.address: n for n in cluster.nodes}
    missing = [r for r, k in want.items() if k.get("address") not in by_address]
    if missing:
        raise UserError(
            f"node {missing[0]} of job {job_id} ({want[missing[0]].get('address')}) is not in this cluster; give the "
            "cluster flags the job was launched with"
        )
    nodes = {r: by_address[k["address"]] for r, k in want.items()}
    scripts = {nodes[r].rank: read_script(job_id, k["log"]) for r, k in want.items()}
    if o.get("dry_run"):
        _dry_run(cluster, nodes, scripts)
        raise SystemExit(0)
    from launcher.code.launch_tree import TreeLaunch, ensure_keys

    transport = make_transport(cluster, trusted_ssh(o, cluster, ssh_config(o, cluster)))
    keys = ensure_keys(cluster, transport)
    part = dataclasses.replace(cluster, nodes=tuple(n for n in cluster.nodes if n.rank in scripts))
    parts = {r: run_dir / f".node-{r}.log.part" for r in nodes}
    failed = {}
    try:
        with contextlib.ExitStack() as files:
            sinks = {nodes[r].rank: files.enter_context(open(p, "wb")) for r, p in parts.items()}
            answers = TreeLaunch(part, transport, DEFAULT_FANOUT, keys).run_all(scripts, b"", READ_TIMEOUT_S, sinks)
    except BaseException:  # node 0 unknown to known_hosts, Ctrl-C: no partial copy stays behind
        for p in parts.values():
            p.unlink(missing_ok=True)
        raise
    for rank, n in nodes.items():
        _, why = answers.get(n.rank, ("", "no answer"))
        if why and not parts[rank].stat().st_size:
            failed[rank] = why
            parts[rank].unlink()
        else:
            os.replace(parts[rank], run_dir / f"node-{rank}.log")
    return failed


def _dry_run(cluster: Cluster, nodes: dict[int, Node], scripts: dict[int, str]) -> None:
    from launcher.code.launch_tree import tree_line

    click.echo(tree_line(dataclasses.replace(cluster, nodes=tuple(nodes.values())), DEFAULT_FANOUT))
    for rank, n in nodes.items():
        click.echo(f"{n.host}\tprint node {rank}'s log kept on the node\t{scripts[n.rank]}")
