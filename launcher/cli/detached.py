"""What the detached-job commands share: `--detach` itself (`start_detached`, for train, run,
exec and nccl-tests), the job host of the cluster the node-source flags name (its controller
host, else node 0: launcher.jobs.node0.job_host), and following a job's stream. Every command
reads the job host over the client's own SSH (the same known_hosts and options as any launch):
the records live there, under the home of its account (launcher.jobs.record), never on this
machine.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from launcher.cli.code_options import code_request, prepare_nodes, warm_spares
from launcher.cli.options import (
    DEFAULT_CONTROLLER_GRACE,
    build_config,
    find_cluster,
    recover_request,
    ssh_config,
    tree_fanout,
    trusted_ssh,
)
from launcher.cli.render import err, pull_everywhere, setup_logging
from launcher.cli.waiting import waiting
from launcher.code import CodeRequest, code_root, code_snapshot
from launcher.core.transport import make_transport
from launcher.core.types import Cluster, LaunchConfig, UserError, Workload
from launcher.jobs.handoff import detach
from launcher.jobs.node0 import Node0, job_host
from launcher.jobs.record import JobRecord, logs_script
from launcher.jobs.recovery import parse_duration, recover_policy
from launcher.jobs.spares import check_spares
from launcher.runner import plan_detached

__all__ = [
    "STATE_STYLE",
    "start_detached",
    "node0",
    "dry_run",
    "copy_path",
    "reader_gone",
    "follow",
    "restart_orphans",
]

STATE_STYLE = {
    "PENDING": "cyan",
    "RUNNING": "blue",
    "RECOVERING": "magenta",
    "SUCCEEDED": "green",
    "FAILED": "red",
    "STOPPED": "yellow",
}


def start_detached(
    o: dict[str, Any],
    workload: Workload,
    check: Callable[[Cluster, LaunchConfig], None] | None = None,
    builtin: bool = False,
    own_code: bool | None = None,
) -> None:
    """`--detach`: check every node, hand off to the job host, print `job ID` (stdout's only line).
    `check` refuses workload arguments that do not fit the ranks the job will start; `builtin`:
    the built-in workload, recovered with --resume (launcher.jobs.recovery). `own_code`: the
    ranks import gpufleet's own code (None: as `builtin`), sent with its environment. The job
    keeps the snapshot and environment prepared here: every recovery runs them."""
    setup_logging()
    if o.get("dry_run"):  # before the cluster is looked for: nothing of it is needed to refuse
        raise UserError("--detach and --dry-run: a dry run starts nothing to hand off; drop one of them")
    policy = recover_policy(recover_request(o), workload.argv, detach=True, builtin=builtin)
    cluster = find_cluster(o)
    if policy is not None and o.get("spares") is None and cluster.spares:  # the stack's gpufleet:spares
        policy = dataclasses.replace(policy, spares=cluster.spares)
        err.print(f"[dim]the stack keeps its last {cluster.spares} nodes as spares (--spares 0 uses them all)[/dim]")
    spares = policy.spares if policy else 0
    check_spares(spares, len(cluster.nodes))
    trains = len(cluster.nodes) - spares  # the job's world: the spares wait (launcher.jobs.spares)
    if policy and policy.min_nodes is not None and policy.min_nodes > trains:
        raise UserError(f"--min-nodes {policy.min_nodes} is more than the job's {trains} nodes; give at most {trains}")
    config = build_config(o, workload, cluster)
    config = dataclasses.replace(config, fanout=tree_fanout(o.get("fanout"), cluster, detach=True))
    grace = parse_duration(o.get("controller_grace") or DEFAULT_CONTROLLER_GRACE, "--controller-grace")
    config = dataclasses.replace(config, controller_grace_s=math.ceil(grace))
    if policy is not None and policy.max_restarts is not None:
        # The controller relaunches a failed program (with GPUFLEET_ATTEMPT), not torchrun in place.
        config = dataclasses.replace(config, max_restarts=0)
    if check is not None:  # against the world it trains on (its size is what the arguments must fit)
        check(dataclasses.replace(cluster, nodes=cluster.nodes[:trains]), config)
    request = code_request(o, cluster, builtin if own_code is None else own_code)
    if policy is not None and not config.image and not request.empty:
        request = _replicated(request)
    config = prepare_nodes(cluster, config, request)
    pull_everywhere(cluster, config)
    n = len(cluster.nodes)
    # The controller keeps the plan's order: the request carries the nodes in it, and a recovery
    # relaunches from the request.
    p = plan_detached(cluster, config)
    if p.order_message:
        err.print(f"[dim]{escape(p.order_message)}[/dim]")
    if spares:
        kept = ", ".join(node.label for node in p.cluster.nodes[trains:])
        err.print(f"[dim]spare{'s' * (spares != 1)}, prepared and idle: {escape(kept)} (--spares {spares})[/dim]")
        warm_spares(p.cluster, p.config, request, p.cluster.nodes[trains:])
    with err.status(f"checking {n} node{'s' * (n != 1)} and handing the job to its controller…"):
        job_id = waiting(lambda: detach(p, policy.to_json() if policy else None), o.get("wait_nodes", False))
    click.echo(f"job {job_id}")
    err.print(
        f"[dim]follow it: launch logs {job_id} -f (with the same node flags); stop it: launch stop {job_id}[/dim]"
    )


def _replicated(request: CodeRequest) -> CodeRequest:
    """A --recover job's request with its local checkpoints copied to a peer node
    (gpufleet.replica), so a node lost for good leaves its ranks' last local step on another node
    (a spare's peer). gpufleet's code runs the copies: a script of the user's own gets it too,
    off its PYTHONPATH."""
    if request.code is None:
        request = dataclasses.replace(request, code=code_snapshot(), code_root=code_root(), code_on_path=False)
    return dataclasses.replace(request, replicate=True)


def node0(o: dict[str, Any]) -> tuple[Cluster, Node0]:
    """The cluster the flags name, and the client's SSH to its job host (controller host, else node 0)."""
    setup_logging()
    cluster = find_cluster(o)
    if cluster.local:
        raise UserError(
            "detached jobs live on an SSH cluster's controller host or node 0; --local has none: give the "
            "cluster's node flags (--hostfile, --stack, ...)"
        )
    transport = make_transport(cluster, trusted_ssh(o, cluster, ssh_config(o, cluster)), o.get("dry_run", False))
    return cluster, Node0(transport, job_host(cluster))


def dry_run(o: dict[str, Any], n0: Node0, steps: list[tuple[str, str]]) -> bool:
    """--dry-run on a command that reads or acts on the job host: print each step it would take
    there, `HOST<TAB>what<TAB>command`, and connect to nothing (True); False without --dry-run."""
    if not o.get("dry_run"):
        return False
    if n0.transport.route(n0.head):
        err.print(f"[dim]{escape(n0.head.label)}: {escape(n0.transport.route(n0.head))}[/dim]")
    for what, script in steps:
        click.echo(f"{n0.head.host}\t{what}\t{n0.transport.display(n0.head, script)}")
    return True


def copy_path(o: dict[str, Any], job_id: str, node: int | None) -> Path:
    d = Path(o.get("runs_dir") or "runs") / job_id
    d.mkdir(parents=True, exist_ok=True)
    return d / ("output.log" if node is None else f"node-{node}.log")


def reader_gone() -> None:
    """stdout's reader went away (`launch logs ID | head`): stop quietly, as cat does; the job
    is untouched. stdout goes to /dev/null so the interpreter's final flush cannot fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(0)


def follow(n0: Node0, job_id: str, node: int | None, copy: Path) -> JobRecord:
    """Print the job's stream as it grows until the job ends; Ctrl-C stops following only.
    Ctrl-C is Python's KeyboardInterrupt here even where this process was started with SIGINT
    ignored (a non-interactive shell's `&` does that), as a launch's own stop handler is."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _follow(n0, job_id, node, copy)
    finally:
        signal.signal(signal.SIGINT, previous)


def _follow(n0: Node0, job_id: str, node: int | None, copy: Path) -> JobRecord:
    proc = subprocess.Popen(
        n0.argv(logs_script(job_id, node, follow=True)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        with open(copy, "wb") as f:
            for raw in iter(proc.stdout.readline, b""):
                sys.stdout.buffer.write(raw)
                sys.stdout.flush()
                f.write(raw)
                f.flush()
        proc.wait()
    except BrokenPipeError:
        proc.kill()
        reader_gone()
    except KeyboardInterrupt:
        proc.kill()
        proc.wait()
        err.print(f"[yellow]stopped following; job {job_id} goes on (launch stop {job_id} stops it)[/yellow]")
        raise SystemExit(130) from None
    if proc.returncode != 0:
        why = proc.stderr.read().decode("utf-8", "replace").strip().splitlines() or [f"exit {proc.returncode}"]
        raise UserError(f"{n0.head.label}: {why[-1]}")
    return n0.record(job_id)


def restart_orphans(n0: Node0, records: list[JobRecord]) -> None:
    """Start again the controller of every job here whose controller died while its nodes still
    wait for one (within --controller-grace): it re-adopts the job. One line each on stderr."""
    orphans = {r.id: r for r in records if r.orphaned}
    if not orphans:
        return
    for job_id in n0.restart(list(orphans)):
        r = orphans[job_id]
        r.orphaned = False
        err.print(
            f"[yellow]job {job_id}: its controller (pid {r.pid}) had died; started it again on "
            f"{escape(n0.head.label)}, which re-adopts the job[/yellow]"
        )
