"""Re-adopting a detached job whose controller died: what a controller started again on a job
directory with a live record does (launcher.jobs.controller), and `adopt_all`, what the
controller VM runs at boot.

A detached job's nodes outlive their controller (launcher.core.supervise): each node's supervisor
keeps the workload running, its output going to a file, for --controller-grace. A controller
started again within it (by `launch jobs`, `launch attach`, or the controller VM's boot):

- RUNNING: opens a session to every node's supervisor (the same `Launch`, whose check is then
  "is the run there" and whose `go` is "stream from here"), resuming each node's stream at the
  byte its predecessor had read up to (the job directory's `node-N.offset`), so no line is lost or
  read twice, and carries on as the first one would have: the end of the job, or a recovery;
- RECOVERING: nothing runs on the nodes; it goes on waiting for them and relaunches (--recover);
- a node whose run is not there (it ended and was read, or its node was lost) fails the
  re-adoption as a check fails a launch: the other nodes' runs are stopped, and the job is
  recovered (--recover) or FAILED.

Past the grace, the nodes have stopped themselves: the job is FAILED, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from launcher.core.types import Cluster, LaunchConfig, LaunchResult, Node, NodeOutcome, UserError
from launcher.jobs.owner import JobOwner
from launcher.jobs.record import (
    CONTROLLER_SH,
    SAMPLES_FILE,
    JobRecord,
    JobState,
    controller_alive,
    request_from_json,
)

if TYPE_CHECKING:  # imported where they run: the controller's start stays light
    from launcher.core.launch import Launch, NodeEvent
    from launcher.jobs.recovery import Recoverer, RecoverPolicy

__all__ = ["adopt", "adopt_all", "current_run", "stop_script"]

log = logging.getLogger("launcher")


def current_run(cluster: Cluster, config: LaunchConfig, record: JobRecord) -> tuple[Cluster, LaunchConfig]:
    """The cluster and config of the attempt the record says runs (`JobRecord.run`): its nodes as
    that attempt ranked them (a recovery may have left some out, or followed one to a new
    address), its attempt number and restart reason. Without one (the controller died as the
    nodes were told to go), the request's nodes, at the attempt it was starting."""
    run = record.run or {"attempt": len(record.recoveries), "restart_reason": "", "nodes": None}
    if run["nodes"]:
        cluster = dataclasses.replace(cluster, nodes=tuple(Node(**n) for n in run["nodes"]))
    return cluster, dataclasses.replace(config, attempt=run["attempt"], restart_reason=run["restart_reason"])


def stop_script(job_id: str, attempt: int, rank: int, grace_s: float, ticks: int) -> str:
    """Stop a detached run on its node without streaming it (its re-adoption failed elsewhere):
    launcher.core.node_run's `stop-run`, which writes the stop request its supervisor reads, waits
    up to the grace and a minute for it to end, and removes the run's directory."""
    from launcher.core.program import node_run_command

    args = f"stop-run {shlex.quote(job_id)} {int(attempt)} {int(rank)} {int(ticks)} {float(grace_s):g}"
    return node_run_command(args, replace=True)


def _stop_runs(launch: Launch) -> None:
    """Stop the run on every node that can be reached, in parallel (the unreachable ones stop
    themselves after --controller-grace)."""
    from launcher.core.wire import stop_ticks

    cfg = launch.config
    procs = [
        subprocess.Popen(
            launch.transport.argv(
                n, stop_script(cfg.job_id, cfg.attempt, n.rank, cfg.stop_grace_s, stop_ticks(cfg.stop_grace_s))
            ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for n in launch.cluster.nodes
    ]
    for p in procs:
        try:
            p.wait(timeout=cfg.stop_grace_s + 90)
        except subprocess.TimeoutExpired:
            p.kill()


def _lost(launch: Launch, why: str) -> LaunchResult:
    """A re-adoption that failed, as the result of an attempt whose first bad node was lost."""
    rank = launch.first_bad()
    rank = rank if rank is not None else 0
    node = next(n for n in launch.cluster.nodes if n.rank == rank)
    outcome = NodeOutcome(node, exit_code=255, connection_lost=True, error=why)
    return LaunchResult(launch.config.job_id, launch.config.run_dir, {rank: outcome}, first_failure=rank)


def adopt(c: JobOwner, previous: JobRecord, silent_s: float | None) -> int:
    """Re-adopt the job whose record `previous` its dead controller left (launcher.jobs.controller
    calls this with itself as `c`); `silent_s`: how long ago that controller was last alive."""
    from launcher.code.launch_tree import tree_for
    from launcher.core.launch import Interrupted, Launch, read_offsets
    from launcher.jobs.recovery import RecoverPolicy

    r = c.record
    grace = r.controller_grace_s
    if grace is None or silent_s is None or silent_s > grace:
        return c.end(JobState.FAILED, 1, why=previous.orphan_why())
    log.warning(
        "job %s: its controller (pid %d) died about %.0f s ago while the job was %s; re-adopting it",
        r.id,
        previous.pid,
        silent_s,
        previous.state.value,
    )
    c.say(
        f"the job's controller (pid {previous.pid}) died about {silent_s:.0f} s ago while the job was "
        f"{previous.state.value}; this one (pid {r.pid}) re-adopts it"
    )
    r.adoptions.append({"at": time.time(), "pid": previous.pid, "attached_s": None})  # saved with the run
    home = Path(os.path.expanduser("~"))
    cluster, config = request_from_json(c.request, c.env, home, c.jobdir.parent)
    policy = RecoverPolicy(**c.request["recover"]) if c.request.get("recover") is not None else None
    if previous.state is JobState.RECOVERING:
        if policy is None:
            return c.end(JobState.FAILED, 1, why=previous.orphan_why())
        _sample(c, cluster, config)
        return _recoverer(c, cluster, config, policy, current_run(cluster, config, previous)[0]).resume()
    run_cluster, run_config = current_run(cluster, config, previous)
    offsets = read_offsets(c.jobdir, run_config.attempt, [n.rank for n in run_cluster.nodes])
    with open(c.jobdir / "output.log", "a", buffering=1) as out:
        launch = Launch(run_cluster, run_config, on_event=_on_event(c, out, cluster, config), stop=c.stop)
        c.launch = launch
        c.note_run(launch)
        try:
            launch.tree = tree_for(run_cluster, run_config)  # --fanout: the re-attach goes down the tree too
            result = launch.run(handle_signals=True, adopt=offsets)
        except UserError as e:
            log.warning("job %s: re-adopting failed (%s); stopping the nodes' runs", r.id, e)
            _stop_runs(launch)
            result = _lost(launch, f"re-adopting after the controller died: {e}")
        except Interrupted as e:
            _stop_runs(launch)
            return c.end(JobState.STOPPED, 128 + e.signum, why="stopped while re-adopting")
    _sample(c, cluster, config)  # when the re-adoption failed: for the recovery's attempts
    if policy is None:
        return c.finish(result)
    return _recoverer(c, cluster, config, policy, run_cluster).run(result)


def _recoverer(
    c: JobOwner, cluster: Cluster, config: LaunchConfig, policy: RecoverPolicy, run_cluster: Cluster
) -> Recoverer:
    """The Recoverer the dead controller had: on the nodes of the attempt that ran, with the
    reason a shrunk cluster gives the workload (launcher.jobs.recovery.Recoverer._shrink) and,
    after a swap (--spares), the replica ring that attempt copies along: the world, then the
    spares, without the nodes out of service (launcher.jobs.realign.current_ring), as the dead
    controller set it; the request's ring still names the nodes swapped out."""
    from launcher.jobs.realign import current_ring
    from launcher.jobs.recovery import RESTART_REASON_VAR, Recoverer

    if len(run_cluster.nodes) < len(cluster.nodes):
        env = [(k, v) for k, v in config.env if k != RESTART_REASON_VAR]
        config = dataclasses.replace(config, env=(*env, (RESTART_REASON_VAR, "shrunk")))
    rec = Recoverer(c, cluster, config, policy)
    rec.cluster = run_cluster
    rep = rec.config.replication
    if rep is not None and any(r.get("swaps") for r in c.record.recoveries):
        ring = current_ring(rep, run_cluster.nodes, rec.spares, set(c.record.out))
        rec.config = dataclasses.replace(rec.config, replication=ring)
    return rec


def _sample(c: JobOwner, cluster: Cluster, config: LaunchConfig) -> None:
    """The job's sampling (launcher.observe.job_metrics), as the first controller ran it."""
    from launcher.observe import job_metrics

    if c.metrics is None:
        c.metrics = job_metrics.start(cluster, config, c.jobdir / SAMPLES_FILE)


def _on_event(c: JobOwner, out: TextIO, cluster: Cluster, config: LaunchConfig) -> Callable[[NodeEvent], None]:
    t0 = c.started_at

    def on_event(event: NodeEvent) -> None:
        c.on_event(out, event)
        last = c.record.adoptions[-1]
        if event.state is not None and event.state.value == "running" and last["attached_s"] is None:
            last["attached_s"] = round(time.monotonic() - t0, 3)
            c.save()
            log.warning("job %s: re-adopted %.2f s after this controller started", c.record.id, last["attached_s"])
            # Once every node streams again: its SSH sessions do not compete with the re-adoption's.
            _sample(c, cluster, config)

    return on_event


def adopt_all(jobs_home: Path) -> list[str]:
    """Start again the controller of every job under `jobs_home` whose record is not final and whose
    controller is gone (what the controller VM runs at boot); the ids it started."""
    started = []
    for state in sorted(jobs_home.glob("*/state.json")):
        jobdir = state.parent
        try:
            record = JobRecord.from_json(json.loads(state.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if record.state.final or controller_alive(record) or not (jobdir / CONTROLLER_SH).exists():
            continue
        r = subprocess.run(["bash", str(jobdir / CONTROLLER_SH)], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            started.append(record.id)
    return started
