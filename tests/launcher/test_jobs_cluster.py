"""Detached jobs against the simulated cluster: real sshd nodes, real torchrun over gloo.

The client and every node have homes of their own (the client's HOME is a directory of the
test's, each node's is set by its sshd), so nothing here passes by the client reading files the
controller wrote, or the controller reading the client's key: node 0 holds the job records, the
cluster key and its known_hosts, and the client reaches them only over SSH.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launcher.jobs.record import process_start
from tests.simcluster import SimCluster
from tests.support import (
    LAUNCH,
    LAUNCH_POLL_S,
    TRAIN,
    checkpoint_step,
    params,
    slow_steps,
    source_args,
    torch_args,
    train_job,
    wait_for,
    wait_saved,
)

pytestmark = pytest.mark.cluster


def cluster(sim_cluster, tmp_path: Path, n: int, node0_env: dict[str, str] | None = None) -> SimCluster:
    """n netns nodes, each with a HOME of its own (and `node0_env` on node 0's sshd)."""
    if os.geteuid() != 0:
        pytest.skip("detached jobs need the netns simulated cluster (root): from= needs each node's address")
    env = {i: {"HOME": str(tmp_path / f"home{i}")} for i in range(n)}
    env[0].update(node0_env or {})
    return sim_cluster(n, mode="netns", node_env=env)


def client_env(tmp_path: Path) -> dict[str, str]:
    """The client's own HOME (its cluster key lands in its ~/.cache/gpufleet), not the nodes'."""
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_STATE_DIR"}
    env["HOME"] = str(tmp_path / "client")
    (tmp_path / "client").mkdir(exist_ok=True)
    return env


def launch(tmp_path: Path, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [LAUNCH, *args], capture_output=True, text=True, cwd=tmp_path, env=client_env(tmp_path), timeout=timeout
    )
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def detach(c: SimCluster, tmp_path: Path, *args: str) -> str:
    """`launch ARGS --detach ...`: returns the job id, after the client process has exited."""
    kind, rest = args[0], args[1:]
    r = launch(tmp_path, kind, *source_args(c, tmp_path), "--detach", *rest, check=True)
    (line,) = r.stdout.splitlines()
    assert line.startswith("job "), r.stdout
    return line.split()[1]


def jobs(c: SimCluster, tmp_path: Path) -> list[dict]:
    r = launch(tmp_path, "jobs", *source_args(c, tmp_path), "--json", check=True)
    return [json.loads(line) for line in r.stdout.splitlines()]


def job(c: SimCluster, tmp_path: Path, job_id: str) -> dict:
    (found,) = [j for j in jobs(c, tmp_path) if j["id"] == job_id]
    return found


def wait_state(c: SimCluster, tmp_path: Path, job_id: str, states: set[str], timeout: float = 120) -> dict:
    """Until `launch jobs` shows the job in one of `states`: its row then."""
    return wait_job(c, tmp_path, job_id, lambda j: j["state"] in states, timeout, f"job {job_id} in {states}")


# How often wait_job asks `launch jobs` while the job's record on this machine's disk says the
# wait is not over and its controller lives: only a safety net, since what `launch jobs` shows
# then is that record.
ASK_ANYWAY_S = 10.0


def wait_job(c: SimCluster, tmp_path: Path, job_id: str, pred, timeout: float, what: str) -> dict:
    """Until `pred` holds of the job's row in `launch jobs --json`: the row then. Each ask is a CLI
    start and an ssh session, so the record under the controller's home (the nodes' homes are the
    test's directories: `cluster`) says when to ask: once `pred` holds of it, or while its
    controller is gone (a reader then shows what no record holds: FAILED, orphaned), else every
    ASK_ANYWAY_S; never more often than LAUNCH_POLL_S, which is how often it asks where no record
    is on this disk (bare nodes). What is returned, and so asserted, is what `launch jobs` said."""
    seen: dict = {}
    asked = float("-inf")

    def reached() -> bool:
        nonlocal asked
        since = time.monotonic() - asked
        if since < LAUNCH_POLL_S:
            return False
        record = _local_record(tmp_path, job_id)
        worth = record is None or _holds(pred, record) or not _controller_alive(tmp_path, job_id)
        if not (worth or since >= ASK_ANYWAY_S):
            return False
        asked = time.monotonic()
        seen.clear()
        seen.update(job(c, tmp_path, job_id))
        return pred(seen)

    try:
        wait_for(reached, timeout, what, interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e} (last: {seen})") from None
    return seen


def _job_dirs(tmp_path: Path, job_id: str) -> list[Path]:
    return list(tmp_path.glob(f"home*/.gpufleet/jobs/{job_id}"))


def _local_record(tmp_path: Path, job_id: str) -> dict | None:
    for d in _job_dirs(tmp_path, job_id):
        try:
            return json.loads((d / "state.json").read_text())
        except (OSError, ValueError):
            return None
    return None


def _holds(pred, record: dict | None) -> bool:
    try:
        return record is not None and bool(pred(record))
    except (LookupError, TypeError):  # a field the record does not have yet (recoveries[0])
        return False


def _controller_alive(tmp_path: Path, job_id: str) -> bool:
    """Whether the controller controller.pid names runs (launcher.jobs.record.controller_alive's
    test); True while there is no such file to read (no job directory here, or not yet written)."""
    for d in _job_dirs(tmp_path, job_id):
        try:
            pid, start = (d / "controller.pid").read_text().split()
        except (OSError, ValueError):
            return True
        return process_start(int(pid)) == start
    return True


def jobdir(tmp_path: Path, job_id: str) -> Path:
    return tmp_path / "home0" / ".gpufleet" / "jobs" / job_id


def test_detached_train_on_2_nodes_succeeds_after_the_client_exits(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    common = [*TRAIN, "--global-batch", "2", "--steps", "20", "--log-every", "5"]
    job_id = detach(c, tmp_path, "train", *torch_args(), "--", *common, "--save-params", str(tmp_path / "detached.pt"))
    # The client has exited; the controller (node 0) runs the job on its own.
    done = wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"})
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0 and done["failed_node"] is None, done
    r = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True)
    # The last step, logged by rank 0, which runs on node 0 (node i holds group rank i).
    (last,) = [line for line in r.stdout.splitlines() if "] step 20/20 |" in line]
    rank0_node = int(last.split("]")[0].removeprefix("[node "))
    assert rank0_node == 0, last
    # What `logs` showed is also in the client's runs dir.
    assert (tmp_path / "runs" / job_id / "output.log").read_text() == r.stdout
    one = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, "--node", str(rank0_node), check=True)
    assert "step 20/20 |" in one.stdout and "[node" not in one.stdout
    table = launch(tmp_path, "jobs", *source_args(c, tmp_path), check=True).stdout
    assert job_id in table and "SUCCEEDED" in table
    # The records are on node 0, in its home, never on the client.
    assert (jobdir(tmp_path, job_id) / "state.json").exists()
    assert not (tmp_path / "client" / ".gpufleet").exists()
    c.assert_nothing_left()
    # The same run attached ends with the same parameters.
    launch(
        tmp_path,
        "train",
        *source_args(c, tmp_path),
        *torch_args(),
        "--",
        *common,
        "--save-params",
        str(tmp_path / "attached.pt"),
        check=True,
    )
    detached, attached = params(tmp_path / "detached.pt"), params(tmp_path / "attached.pt")
    assert detached.keys() == attached.keys()
    assert all(torch.equal(detached[k], attached[k]) for k in detached)


def test_detached_worker_exit_3_on_node_2_fails_naming_node_2_and_leaves_nothing(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 3)
    cmd = (
        'echo "up $GPUFLEET_NODE_RANK"; if [ "$GPUFLEET_NODE_RANK" = 2 ]; then sleep 2; echo dying; exit 3; fi; '
        "sleep 600"
    )
    job_id = detach(c, tmp_path, "exec", "--", "sh", "-c", cmd)
    # Ends in 60 s although the other nodes sleep 600: they were stopped, not waited for.
    done = wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=60)
    assert done["state"] == "FAILED" and done["exit"] == 3 and done["failed_node"] == 2, done
    # From its turn (before the checks) to the end: node 2's 2 s, then every other node stopped within 10 s.
    assert done["ended"] - done["started"] < 12, done
    assert f"node 2 ({c.nodes[2].address}) failed first: exit 3" in done["why"]
    assert "dying" in done["tail"]
    c.assert_nothing_left()
    # -f on an ended job prints everything and exits with the job's status.
    r = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, "-f")
    assert r.returncode == 3, r.stdout + r.stderr
    assert {"[node 0] up 0", "[node 1] up 1", "[node 2] up 2", "[node 2] dying"} <= set(r.stdout.splitlines())


def test_stop_during_detached_training_stops_every_node_keeps_the_checkpoint_and_leaves_nothing(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    ckpt = tmp_path / "ckpt"
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        *slow_steps(tmp_path),
        "--",
        *train_job(2, 100000, ckpt, 5, 5),
    )
    wait_saved(ckpt, 10)
    # The stop's own speed is bench/'s business; a hang is caught by launch()'s timeout.
    r = launch(tmp_path, "stop", *source_args(c, tmp_path), job_id, check=True)
    c.assert_nothing_left(within=2)
    assert "STOPPED" in r.stderr
    done = job(c, tmp_path, job_id)
    assert done["state"] == "STOPPED" and done["exit"] == 128 + signal.SIGTERM, done
    assert checkpoint_step(ckpt) >= 10  # latest names a whole checkpoint that loads
    assert not [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]
    # Stopping an ended job says so and changes nothing.
    again = launch(tmp_path, "stop", *source_args(c, tmp_path), job_id, check=True)
    assert "STOPPED" in again.stderr


def test_attach_follows_to_the_end_and_shows_the_summary_ctrl_c_on_logs_leaves_the_job_running(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    go = tmp_path / "go"
    cmd = f'echo "hello $GPUFLEET_NODE_RANK"; while [ ! -f {go} ]; do sleep 0.1; done; echo "bye $GPUFLEET_NODE_RANK"'
    job_id = detach(c, tmp_path, "exec", "--", "sh", "-c", cmd)
    follow = subprocess.Popen(
        [LAUNCH, "logs", *source_args(c, tmp_path), job_id, "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=client_env(tmp_path),
    )
    try:
        wait_for(
            lambda: (
                (tmp_path / "runs" / job_id / "output.log").exists()
                and (tmp_path / "runs" / job_id / "output.log").read_text().count("hello") == 2
            ),
            60,
            "hello x2",
        )
        follow.send_signal(signal.SIGINT)  # Ctrl-C: stops following, never the job
        # A liveness bound, not a speed one: CI's loaded machine once took over 30 s here.
        out, errs = follow.communicate(timeout=120)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 130 and "stopped following" in errs, errs
    assert job(c, tmp_path, job_id)["state"] == "RUNNING"
    attach = subprocess.Popen(
        [LAUNCH, "attach", *source_args(c, tmp_path), job_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=client_env(tmp_path),
    )
    time.sleep(1)
    go.touch()
    out, errs = attach.communicate(timeout=60)
    assert attach.returncode == 0, out + errs
    assert {"[node 0] hello 0", "[node 1] hello 1", "[node 0] bye 0", "[node 1] bye 1"} <= set(out.splitlines())
    assert f"job {job_id}: SUCCEEDED" in errs and c.nodes[1].address in errs, errs
    c.assert_nothing_left()


def test_a_controller_killed_with_sigkill_reads_as_failed_and_its_workers_do_not_outlive_its_grace(
    sim_cluster, tmp_path
):
    c = cluster(sim_cluster, tmp_path, 2)
    cmd = 'echo "up $GPUFLEET_NODE_RANK"; sleep 300'
    job_id = detach(c, tmp_path, "exec", "--controller-grace", "2s", "--", "sh", "-c", cmd)
    wait_for(
        lambda: c.processes(1) and "up 1" in (jobdir(tmp_path, job_id) / "output.log").read_text(), 60, "node 1 up"
    )
    pid = int((jobdir(tmp_path, job_id) / "controller.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    # No controller back within --controller-grace: the nodes' supervisors stop everything (term
    # grace 5 s, then SIGKILL), long before the workers' own 300 s sleep would end.
    c.assert_nothing_left(within=60)
    done = job(c, tmp_path, job_id)
    assert done["state"] == "FAILED" and f"pid {pid} died" in done["why"], done
    assert "--controller-grace 2 s" in done["why"], done
    # The record on node 0 was never half-written: it still reads, as RUNNING, with the dead pid.
    assert json.loads((jobdir(tmp_path, job_id) / "state.json").read_text())["pid"] == pid


def test_jobs_on_busy_nodes_queue_fifo_stop_removes_a_pending_one_and_attached_launches_are_refused(
    sim_cluster, tmp_path
):
    c = cluster(sim_cluster, tmp_path, 2)
    go = tmp_path / "go"
    first = detach(c, tmp_path, "exec", "--", "sh", "-c", f"while [ ! -f {go} ]; do sleep 0.1; done; echo first")
    wait_state(c, tmp_path, first, {"RUNNING"}, timeout=30)
    second = detach(c, tmp_path, "exec", "--", "sh", "-c", "echo second")
    third = detach(c, tmp_path, "exec", "--", "sh", "-c", "echo third")
    listed = jobs(c, tmp_path)
    assert [(j["id"], j["state"]) for j in listed] == [(third, "PENDING"), (second, "PENDING"), (first, "RUNNING")]
    # An attached launch on these nodes is refused, naming the job that holds them; nothing starts.
    r = launch(tmp_path, "exec", *source_args(c, tmp_path), "--", "touch", str(tmp_path / "attached-ran"))
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [l for l in r.stderr.splitlines() if l.strip()]
    assert line.startswith("error: ") and f"busy with detached job {first} (RUNNING" in line, r.stderr
    assert not (tmp_path / "attached-ran").exists()
    # Stopping a pending job takes it out of the queue.
    stopped = launch(tmp_path, "stop", *source_args(c, tmp_path), third, check=True)
    assert "STOPPED" in stopped.stderr
    assert job(c, tmp_path, third)["state"] == "STOPPED"
    go.touch()
    done = wait_state(c, tmp_path, second, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=60)
    assert done["state"] == "SUCCEEDED", done
    ran_first = job(c, tmp_path, first)
    assert ran_first["state"] == "SUCCEEDED" and done["started"] >= ran_first["ended"], (ran_first, done)
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), third, check=True).stdout
    # It never ran: no node's line, only the controller's own saying how it ended.
    (line,) = out.splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    ending = rf"\[controller\] {stamp} job {third} ended STOPPED at {stamp} \(exit 143\): "
    ending += "stopped while pending; it never ran"
    assert re.fullmatch(ending, line), line
    c.assert_nothing_left()


def test_the_cluster_key_is_on_node_0_only_authorized_from_the_cluster_and_a_changed_host_key_is_refused(
    sim_cluster, tmp_path
):
    c = cluster(sim_cluster, tmp_path, 3)
    go = tmp_path / "go"
    first = detach(
        c,
        tmp_path,
        "exec",
        "--env",
        "SECRET=hunter2",
        "--",
        "sh",
        "-c",
        f'[ "${{#SECRET}}" = 7 ] || exit 9; while [ ! -f {go} ]; do sleep 0.1; done',
    )
    wait_state(c, tmp_path, first, {"RUNNING"}, timeout=30)
    second = detach(c, tmp_path, "exec", "--", "true")
    # The client's key: in the client's own ~/.cache/gpufleet/<cluster>/, mode 600.
    (client_key,) = (tmp_path / "client" / ".cache" / "gpufleet").glob("*/id_ed25519")
    assert stat.S_IMODE(client_key.stat().st_mode) == 0o600
    # The private key: node 0 only, mode 600; the same key, by its public half.
    (node_key,) = (tmp_path / "home0" / ".gpufleet" / "clusters").glob("*/id_ed25519")
    assert stat.S_IMODE(node_key.stat().st_mode) == 0o600 and node_key.read_bytes() == client_key.read_bytes()
    # (The other nodes hold only their runs' output, in .gpufleet/node-runs, and the account's
    # node-local directory, .gpufleet/local (checkpoint tier, compile caches): no key, no record.)
    others = [tmp_path / f"home{i}" / ".gpufleet" for i in (1, 2)]
    assert not [p for d in others for p in d.glob("*") if p.name not in ("node-runs", "local")]
    assert not [p for d in others for p in d.rglob("*") if p.name.startswith("id_") or p.suffix == ".json"]
    public = client_key.with_name("id_ed25519.pub").read_text().split()[1]
    frm = 'from="' + ",".join(sorted(c.addresses)) + '"'
    for i in range(3):
        (entry,) = [
            l for l in (tmp_path / f"home{i}" / ".ssh" / "authorized_keys").read_text().splitlines() if public in l
        ]
        assert entry.startswith(frm + ","), entry
    # The job's known_hosts on node 0 holds each node's host key as its sshd presents it.
    known = (jobdir(tmp_path, first) / "known_hosts").read_text()
    for n in c.nodes:
        assert f"{n.address} {' '.join(n.host_key_pub.split()[:2])}" in known
    # A later job on part of the cluster brings its own known_hosts; the waiting job keeps node 2's key.
    third = detach(c, tmp_path, "exec", "--nodes", "2", "--", "true")
    assert c.nodes[2].address not in (jobdir(tmp_path, third) / "known_hosts").read_text()
    assert c.nodes[2].address in (jobdir(tmp_path, second) / "known_hosts").read_text()
    # No --env value in any record.
    assert not [
        p
        for p in (tmp_path / "home0" / ".gpufleet" / "jobs").rglob("*")
        if p.is_file() and b"hunter2" in p.read_bytes()
    ]
    # Node 2 comes back with another host key while the second job waits: it is refused, by name.
    c.new_host_key(2)
    go.touch()
    assert wait_state(c, tmp_path, first, {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
    done = wait_state(c, tmp_path, second, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=60)
    assert done["state"] == "FAILED" and done["failed_node"] == 2, done
    assert f"node 2 ({c.nodes[2].address}): Host key verification failed" in done["why"], done
    assert "node 0 (" not in done["why"] and "node 1 (" not in done["why"]
    # The queue goes on: the job on nodes 0 and 1 runs next.
    assert wait_state(c, tmp_path, third, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=60)["state"] == "SUCCEEDED"
    c.assert_nothing_left()


def test_detach_refuses_as_an_attached_launch_does_and_hands_nothing_off(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    dead = c.unused_address()
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{c.nodes[0].address}\n{dead}\n{c.nodes[1].address}\n")
    r = launch(
        tmp_path,
        "exec",
        *source_args(c, tmp_path, hosts),
        "--ssh-option",
        "ConnectTimeout=3",
        "--detach",
        "--",
        "touch",
        str(tmp_path / "ran"),
    )
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and dead in errors[0] and "nothing was started" in errors[0], r.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "home0" / ".gpufleet").exists()
    # Asking about a job that is not there is one line too.
    missing = launch(tmp_path, "stop", *source_args(c, tmp_path), "20260101-000000-aaaaaa")
    assert missing.returncode == 2 and "no job 20260101-000000-aaaaaa on node 0" in missing.stderr, missing.stderr
    c.assert_nothing_left()


def test_logs_into_a_pipe_that_closes_early_ends_quietly(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    job_id = detach(c, tmp_path, "exec", "--", "sh", "-c", "seq 1 20000")
    wait_state(c, tmp_path, job_id, {"SUCCEEDED"}, timeout=60)
    for follow in ([], ["-f"]):
        cmd = " ".join([LAUNCH, "logs", *source_args(c, tmp_path), job_id, *follow]) + " | head -n 2"
        r = subprocess.run(
            ["bash", "-o", "pipefail", "-c", cmd],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=client_env(tmp_path),
            timeout=60,
        )
        lines = r.stdout.splitlines()
        assert r.returncode == 0 and len(lines) == 2, r.stdout + r.stderr
        assert all(re.fullmatch(r"\[node [01]\] [12]", line) for line in lines), lines
        assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr
