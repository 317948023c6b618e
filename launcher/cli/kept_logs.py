"""`launch logs JOB_ID` for an attached launch (its run directory here holds its summary,
launch.json, or says that nodes kept their logs): every node's log is here, but for a launch
down a tree (`--fanout`) the nodes whose lines it did not show live (`--output rank0|failures`)
kept their whole output on the node (launcher.code.node_agent.Keep,
~/.gpufleet/logs/JOB/node-RANK.log). Those are read back down a tree of their own, one connection
from here, and copied to RUNS_DIR/JOB_ID/node-RANK.log."""

from __future__ import annotations

import dataclasses
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

READ_TIMEOUT_S = 300.0  # for every node's log to come back


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
    fetched, failed = _fetch(o, job_id, {r: kept[r] for r in wanted if r in kept})
    for rank in wanted:
        if rank in fetched:
            (run_dir / f"node-{rank}.log").write_text(fetched[rank])
        text = fetched.get(rank)
        if text is None:
            path = run_dir / f"node-{rank}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
        _write(text if node is not None else "".join(f"[node {rank}] {line}\n" for line in text.splitlines()))
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


def _write(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        from launcher.cli.detached import reader_gone

        reader_gone()


def _fetch(o: dict[str, Any], job_id: str, want: dict[int, dict]) -> tuple[dict[int, str], dict[int, str]]:
    """Each wanted node's kept log, by the run's rank, read down a tree: (texts, why not)."""
    if not want:
        return {}, {}
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
    answers = TreeLaunch(part, transport, DEFAULT_FANOUT, keys).run_all(scripts, b"", READ_TIMEOUT_S)
    texts, failed = {}, {}
    for rank, n in nodes.items():
        text, why = answers.get(n.rank, ("", "no answer"))
        if why and not text:
            failed[rank] = why
        else:
            texts[rank] = text
    return texts, failed


def _dry_run(cluster: Cluster, nodes: dict[int, Node], scripts: dict[int, str]) -> None:
    from launcher.code.launch_tree import tree_line

    click.echo(tree_line(dataclasses.replace(cluster, nodes=tuple(nodes.values())), DEFAULT_FANOUT))
    for rank, n in nodes.items():
        click.echo(f"{n.host}\tprint node {rank}'s log kept on the node\t{scripts[n.rank]}")
