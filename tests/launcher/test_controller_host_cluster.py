"""Detached jobs on a controller host that is not a node, against the simulated cluster: a 4th
network namespace with its own sshd and home runs the jobs' controllers (the hostfile's
`controller HOST` line), so losing node 0 is recovered like losing any node."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.launcher.test_jobs_cluster import detach, job, launch, wait_state
from tests.simcluster import SimCluster
from tests.support import checkpoint_step, slow_steps, source_args, torch_args, train_job, wait_saved

pytestmark = pytest.mark.cluster

FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def with_controller(sim_cluster, tmp_path: Path, n: int, controller_env: dict[str, str] | None = None) -> SimCluster:
    """n netns nodes and a controller host after them, each with a HOME of its own."""
    if os.geteuid() != 0:
        pytest.skip("detached jobs need the netns simulated cluster (root): from= needs each host's address")
    env = {i: {"HOME": str(tmp_path / f"home{i}")} for i in range(n + 1)}
    env[n].update(controller_env or {})
    return sim_cluster(n, mode="netns", node_env=env, controller=True)


def test_a_recovering_job_survives_node_0_lost_for_10_s_and_ends_at_its_last_step(sim_cluster, tmp_path):
    c = with_controller(sim_cluster, tmp_path, 3)
    ckpt = tmp_path / "ckpt"
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        *slow_steps(tmp_path),
        "--recover",
        "--recover-timeout",
        "2m",
        "--",
        *train_job(3, 100, ckpt, 10, 10),
    )
    # The job lives on the controller host: its record, key and known_hosts; nothing on node 0.
    ctl_jobs = tmp_path / "home3" / ".gpufleet" / "jobs"
    assert (ctl_jobs / job_id / "state.json").exists()
    assert not (tmp_path / "home0" / ".gpufleet" / "jobs").exists()
    wait_saved(ckpt, 20)
    c.preempt(0)
    t_gone = time.monotonic()
    wait_state(c, tmp_path, job_id, {"RECOVERING"}, timeout=30)
    t_seen = time.monotonic()  # the controller noticed the loss no later than this
    assert checkpoint_step(ckpt) < 100, "node 0 was lost after the end: make the run longer"
    time.sleep(max(0.0, 10 - (time.monotonic() - t_gone)))
    assert job(c, tmp_path, job_id)["state"] == "RECOVERING"
    t_back = time.monotonic()
    c.restart_sshd(0)
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, done
    (rec,) = done["recoveries"]
    # It waited for node 0: from noticing the loss (at t_seen at the latest) to the relaunch
    # (after t_back) it waited at least t_back - t_seen, however late a loaded machine noticed.
    assert rec["node"] == 0 and rec["waited_s"] >= (t_back - t_seen) - 0.5, rec
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    assert "resumed from" in out and "] step 100/100 |" in out, out[-3000:]
    assert checkpoint_step(ckpt) == 100
    c.assert_nothing_left()


def _refused(r, *words: str) -> str:
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    (line,) = [l for l in r.stderr.splitlines() if l.strip()]
    assert line.startswith("error: ") and all(w in line for w in words), r.stderr
    return line


def test_a_controller_that_is_a_worker_unreachable_or_without_python_is_refused_and_nothing_starts(
    sim_cluster, tmp_path
):
    # The controller host's PATH has what a session needs but no python3 (and it has no stack venv).
    bare = tmp_path / "bare-bin"
    bare.mkdir()
    for tool in ("bash", "sh", "ssh", "tar", "setsid", "cat", "mkdir"):
        (bare / tool).symlink_to(next(Path(d, tool) for d in ("/usr/bin", "/bin") if Path(d, tool).exists()))
    c = with_controller(sim_cluster, tmp_path, 2, controller_env={"PATH": str(bare)})
    base = ["--hostfile", str(tmp_path / "nodes"), *c.launch_flags, "--runs-dir", str(tmp_path / "runs")]
    (tmp_path / "nodes").write_text("".join(f"{a}\n" for a in c.addresses))
    worker = c.nodes[1].address
    _refused(
        launch(tmp_path, "exec", *base, "--controller", worker, "--detach", "--", "true"),
        f"controller {worker} is also node 1",
        "--controller",
    )
    gone = c.unused_address()
    _refused(
        launch(tmp_path, "exec", *base, "--controller", gone, "--detach", "--", "true"),
        f"controller {gone} is unreachable",
    )
    _refused(
        launch(tmp_path, "exec", *base, "--controller", c.controller.address, "--detach", "--", "true"),
        f"controller {c.controller.address} cannot run the launcher",
        "python",
    )
    # Nothing started: no job directory, no key handed anywhere.
    assert not [p for p in tmp_path.glob("home*/.gpufleet/jobs/*")]
    c.assert_nothing_left()


def test_without_a_controller_detach_warns_once_that_losing_node_0_loses_the_job(sim_cluster, tmp_path):
    c = sim_cluster(2, mode="netns", node_env={i: {"HOME": str(tmp_path / f"home{i}")} for i in range(2)})
    if os.geteuid() != 0:
        pytest.skip("detached jobs need the netns simulated cluster (root)")
    r = launch(tmp_path, "exec", *source_args(c, tmp_path), "--detach", "--", "true", check=True)
    job_id = r.stdout.split()[1]
    warned = [l for l in r.stderr.splitlines() if "losing node 0 loses the job" in l]
    assert len(warned) == 1 and "--controller" in warned[0], r.stderr
    assert wait_state(c, tmp_path, job_id, FINAL)["state"] == "SUCCEEDED"


SAY_WORLD = """
    import os
    if "LOCAL_RANK" in os.environ and os.environ.get("RANK") == "0":
        print(f"world {os.environ['WORLD_SIZE']} reason {os.environ.get('GPUFLEET_RESTART_REASON', '-')}", flush=True)
"""


def test_min_nodes_goes_on_without_a_node_that_is_not_back_resharding_the_checkpoint(sim_cluster, tmp_path):

    c = with_controller(sim_cluster, tmp_path, 3)
    ckpt = tmp_path / "ckpt"
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        *slow_steps(tmp_path, SAY_WORLD),
        "--recover",
        "--recover-timeout",
        "5s",
        "--min-nodes",
        "2",
        "--",
        *train_job(6, 60, ckpt, 10, 10),
    )
    wait_saved(ckpt, 20)
    c.power_off(2)  # never back
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, done
    (rec,) = done["recoveries"]
    assert rec["node"] == 2 and rec["shrunk_to"] == 2 and rec["waited_s"] >= 5, rec
    assert done["nodes"] == c.addresses[:2], done
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    assert "world 3 reason -" in out and "world 2 reason shrunk" in out, out[-3000:]
    assert "saved by 3 ranks, read by 2" in out and "] step 60/60 |" in out, out[-3000:]
    attached = launch(tmp_path, "attach", *source_args(c, tmp_path), job_id)
    assert "went on with 2 nodes (--min-nodes)" in attached.stderr, attached.stderr
    c.assert_nothing_left()


def test_stop_reaches_the_job_through_the_controller_host_and_leaves_nothing(sim_cluster, tmp_path):
    c = with_controller(sim_cluster, tmp_path, 2)
    job_id = detach(c, tmp_path, "exec", "--", "sleep", "600")
    wait_state(c, tmp_path, job_id, {"RUNNING"}, timeout=30)
    r = launch(tmp_path, "stop", *source_args(c, tmp_path), job_id, check=True)
    assert "STOPPED" in r.stderr, r.stderr
    assert job(c, tmp_path, job_id)["state"] == "STOPPED"
    # The controller's output and record are on the controller host only.
    assert (tmp_path / "home2" / ".gpufleet" / "jobs" / job_id / "controller.log").exists()
    assert not (tmp_path / "home0" / ".gpufleet" / "jobs").exists()
    c.assert_nothing_left()
