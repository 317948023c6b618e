"""A detached job whose controller dies, against the simulated cluster: real sshd nodes, real
torchrun over gloo, a 4th namespace as the controller host. The controller is killed with SIGKILL
(as the kernel's OOM killer, or its VM going away, would): the nodes keep training; `launch jobs`
starts it again and it re-adopts the job; or, with no controller back within --controller-grace,
the nodes stop their workers themselves."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.launcher.test_controller_host_cluster import FINAL, with_controller
from tests.launcher.test_jobs_cluster import detach, job, launch, wait_job, wait_state
from tests.support import TRAIN, slow_steps, source_args, torch_args, wait_for

pytestmark = pytest.mark.cluster

STEP = re.compile(r"\] step (\d+)/(\d+) \|")


def node_out(tmp_path: Path, job_id: str, node: int) -> Path:
    """Node `node`'s output file of the job's first attempt (launcher.core.supervise)."""
    return tmp_path / f"home{node}" / ".gpufleet" / "node-runs" / job_id / f"0.{node}" / "out"


def last_step(path: Path) -> int:
    try:
        steps = re.findall(r"\bstep (\d+)/\d+ \|", path.read_text())
    except OSError:
        return -1
    return int(steps[-1]) if steps else -1


def kill_controller(c, tmp_path: Path, job_id: str) -> int:
    pid = job(c, tmp_path, job_id)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_killed_controller_is_restarted_by_launch_jobs_and_the_job_ends_with_no_step_lost(sim_cluster, tmp_path):
    c = with_controller(sim_cluster, tmp_path, 2)
    # Slow steps: the run outlasts two controller deaths and a re-adoption on a loaded machine,
    # asleep rather than training 1500 steps.
    steps, every = 500, 10
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        *slow_steps(tmp_path),
        "--recover",
        "--",
        *TRAIN,
        "--global-batch",
        "2",
        "--steps",
        str(steps),
        "--log-every",
        str(every),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "100",
    )
    out0 = node_out(tmp_path, job_id, 0)
    wait_for(lambda: last_step(out0) >= 30, 120, "step 30 on node 0")
    dead = kill_controller(c, tmp_path, job_id)
    at_kill = last_step(out0)
    # No controller: the workers go on (the supervisor owns them, and the grace is 10 minutes).
    wait_for(lambda: last_step(out0) >= min(at_kill + 3 * every, steps), 120, "steps after the controller died")
    # The next `launch jobs` starts the controller again, says so, and shows the job running.
    r = launch(tmp_path, "jobs", *source_args(c, tmp_path), "--json", check=True)
    (said,) = [line for line in r.stderr.splitlines() if "had died" in line]
    assert f"job {job_id}: its controller (pid {dead}) had died; started it again" in said, r.stderr
    (seen,) = [json.loads(line) for line in r.stdout.splitlines() if json.loads(line)["id"] == job_id]
    assert seen["state"] == "RUNNING" and not seen["orphaned"], seen
    # Once it has re-adopted the nodes, it is killed too; this time `launch attach` starts it again
    # and follows the job to its end.
    wait_job(c, tmp_path, job_id, lambda j: j["adoptions"][-1]["attached_s"] is not None, 60, "the re-adoption")
    again = kill_controller(c, tmp_path, job_id)
    assert last_step(out0) < steps, "the job ended before its second controller was killed: make it longer"
    attached = launch(tmp_path, "attach", *source_args(c, tmp_path), job_id, timeout=180)
    assert attached.returncode == 0, attached.stderr
    assert f"job {job_id}: its controller (pid {again}) had died; started it again" in attached.stderr
    assert f"] step {steps}/{steps} |" in attached.stdout and f"job {job_id}: SUCCEEDED" in attached.stderr
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0 and not done["recoveries"], done
    assert [a["pid"] for a in done["adoptions"]] == [dead, again], done["adoptions"]
    assert all(a["attached_s"] is not None for a in done["adoptions"]), done["adoptions"]
    # Every step rank 0 logged, once each, in the job's own log: none lost, none read twice.
    log = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    logged = [int(m.group(1)) for m in STEP.finditer(log)]
    assert logged == list(range(every, steps + 1, every)), logged
    assert not out0.parent.exists()  # the node's copy went once its controller had read it
    c.assert_nothing_left()


def test_with_no_controller_back_within_the_grace_the_nodes_stop_their_workers_and_the_job_failed(
    sim_cluster, tmp_path
):
    c = with_controller(sim_cluster, tmp_path, 2)
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        *slow_steps(tmp_path),
        "--controller-grace",
        "3s",
        "--term-grace",
        "5s",
        "--",
        *TRAIN,
        "--global-batch",
        "2",
        "--steps",
        "100000",
        "--log-every",
        "10",
    )
    out0 = node_out(tmp_path, job_id, 0)
    wait_for(lambda: last_step(out0) >= 10, 120, "step 10 on node 0")
    kill_controller(c, tmp_path, job_id)
    # Nothing of the job is left on any node once the grace has run out: each supervisor stopped
    # its workers (SIGTERM, then SIGKILL after --term-grace) and ended.
    wait_for(lambda: not any(c.processes(i) for i in range(2)), 60, "every node's processes gone")
    c.assert_nothing_left()
    said = out0.read_text()
    assert "gpufleet-stop: no controller for 3 s (--controller-grace)" in said, said[-2000:]
    assert "gpufleet-stop: rank 0 (pid" in said, said[-2000:]
    # The record says why, and `launch jobs` starts no controller for it any more.
    r = launch(tmp_path, "jobs", *source_args(c, tmp_path), "--json", check=True)
    (seen,) = [json.loads(line) for line in r.stdout.splitlines() if json.loads(line)["id"] == job_id]
    assert seen["state"] == "FAILED" and not seen["orphaned"], seen
    assert "no controller for more than --controller-grace 3 s" in seen["why"], seen["why"]
    assert "had died" not in r.stderr, r.stderr
