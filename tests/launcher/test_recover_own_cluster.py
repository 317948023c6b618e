"""--recover, --term-grace and `launch stop --grace` for a user's own program, on real sshd nodes
(the simulated cluster), real torchrun over gloo and the controller on node 0. The programs are
written the way people write them: examples/ddp_snapshot.py (a DDP loop that saves a snapshot),
and short scripts below that know nothing of gpufleet beyond its environment variables."""

from __future__ import annotations

import io
import os
import re
import signal
import textwrap
import time
from pathlib import Path

import pytest

from launcher.core.wire import PREEMPTION_NOTICE
from tests.launcher.fake_gpu_node import FakeMetadata
from tests.launcher.test_jobs_cluster import cluster, detach, jobdir, launch, wait_state
from tests.simcluster import _environ
from tests.support import PY, REPO, source_args, wait_for
from tests.workloads.conftest import start_gcs_emulator

pytestmark = pytest.mark.cluster

FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
EXAMPLE = REPO / "examples" / "ddp_snapshot.py"


def own_args(workdir: Path, *more: str) -> list[str]:
    """One worker per node, this repository's python, one thread per worker (2 shared cores)."""
    return ["--python", PY, "--workdir", str(workdir), "--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1", *more]


def logs(c, tmp_path: Path, job_id: str) -> str:
    return launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout


def example(epochs: int, *more: str) -> list[str]:
    """The example script and its arguments: a snapshot every 2 epochs of 0.3 s."""
    return [str(EXAMPLE), "--epochs", str(epochs), "--save-every", "2", "--epoch-seconds", "0.3", *more]


def wait_epoch(read, epochs: int, where: str = "") -> None:
    """Until the snapshot `read()` gives holds `epochs` epochs (a hang fails after 120 s)."""
    # Each look loads the snapshot (from the bucket, for one test): a few a second is plenty for
    # epochs of 0.3 s.
    wait_for(lambda: snapshot_epochs(read) >= epochs, 120, f"epoch {epochs} saved{where}", interval=0.3)


def snapshot_epochs(read) -> int:
    """`epochs_run` of the example's snapshot (`read()` gives its bytes, or None)."""
    import torch

    data = read()
    return torch.load(io.BytesIO(data), weights_only=True)["epochs_run"] if data else 0


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_plain_ddp_script_survives_a_node_lost_for_10_s_and_resumes_from_its_own_snapshot(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    wd = tmp_path / "wd"
    wd.mkdir()
    snap = wd / "snapshot.pt"
    job_id = detach(
        c,
        tmp_path,
        "run",
        *own_args(wd, "--recover", "--recover-timeout", "2m"),
        "--",
        *example(60),
    )
    read = lambda: snap.read_bytes() if snap.exists() else None  # noqa: E731
    wait_epoch(read, 4)
    c.power_off(1)
    t_gone = time.monotonic()
    wait_state(c, tmp_path, job_id, {"RECOVERING"}, timeout=30)
    assert snapshot_epochs(read) < 60, "the node was lost after the end: make the run longer"
    time.sleep(max(0.0, 10 - (time.monotonic() - t_gone)))
    c.restart_sshd(1)
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, done
    (rec,) = done["recoveries"]
    assert rec["node"] == 1 and rec["reason"] == "node-lost" and rec["waited_s"] is not None, rec
    out = logs(c, tmp_path, job_id)
    # Every rank saw the contract: attempt 0 without a reason, then attempt 1 after node-lost.
    assert len(re.findall(r"\] rank \d: attempt 0 \(restart reason -\)", out)) == 2, out
    assert len(re.findall(r"\] rank \d: attempt 1 \(restart reason node-lost\)", out)) == 2, out
    second = out[out.index("attempt 1 (restart reason node-lost)") :]
    resumed = re.search(r"resuming from the snapshot at epoch (\d+)", second)
    assert resumed and int(resumed.group(1)) >= 4, second
    assert "] epoch 0 |" not in second and "] epoch 59 | loss" in second, second
    assert snapshot_epochs(read) == 60
    # The controller's own lines in the log: the recovery with its reason, the relaunch, the end.
    said = [line.split(" ", 3)[3] for line in out.splitlines() if line.startswith("[controller] ")]
    assert len(said) == 3, said
    assert said[0].startswith("attempt 1 after node-lost: node 1: unreachable (") and said[0].endswith(
        "(reason node-lost); waiting for every node to pass its check, then relaunching"
    ), said
    assert re.fullmatch(
        r"relaunched after [\d.]+ s: attempt 1 on 2 nodes \(GPUFLEET_RESTART_REASON=node-lost\)", said[1]
    )
    assert re.fullmatch(rf"job {job_id} ended SUCCEEDED at [\d-]+ [\d:]+ \(exit 0\) after \d+ s", said[2]), said
    assert out.splitlines()[-1].startswith("[controller] ")
    c.assert_nothing_left()


def test_a_snapshot_in_gcs_is_resumed_after_a_worker_fails_under_max_restarts_1(sim_cluster, tmp_path, monkeypatch):
    c = cluster(sim_cluster, tmp_path, 2)
    wd = tmp_path / "wd"
    wd.mkdir()
    # On the cluster's gateway: the nodes reach it from their own network namespaces.
    with start_gcs_emulator("ckpt", timeout=20, host=c.gateway) as host:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
        from google.cloud import storage

        blob = storage.Client().bucket("ckpt").blob("run/snapshot.pt")
        job_id = detach(
            c,
            tmp_path,
            "run",
            *own_args(wd, "--env", f"STORAGE_EMULATOR_HOST={host}", "--recover", "--max-restarts", "1"),
            "--",
            *example(40, "--snapshot", "gs://ckpt/run/snapshot.pt"),
        )
        read = lambda: blob.download_as_bytes() if blob.exists() else None  # noqa: E731
        wait_epoch(read, 4, " to the bucket")
        # A worker dies (the OOM killer, a segfault): SIGKILL to node 1's training process.
        (worker,) = [p for p in c.processes(1) if b"LOCAL_RANK=0" in _environ(p).split(b"\0")]
        os.kill(worker, signal.SIGKILL)
        done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
        assert done["state"] == "SUCCEEDED", done
        assert snapshot_epochs(read) == 40
    (rec,) = done["recoveries"]
    assert rec["reason"] == "worker-failed" and rec["waited_s"] is not None, rec
    out = logs(c, tmp_path, job_id)
    second = out[out.index("attempt 1 (restart reason worker-failed)") :]
    resumed = re.search(r"resuming from the snapshot at epoch (\d+)", second)
    assert resumed and int(resumed.group(1)) >= 4 and "] epoch 0 |" not in second, second
    c.assert_nothing_left()


def test_a_spot_preemption_notice_stops_the_ranks_and_the_job_resumes_with_reason_preempted(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    wd = tmp_path / "wd"
    wd.mkdir()
    snap = wd / "snapshot.pt"
    # One server stands for each node's own metadata server: it answers by the asking address.
    metadata = FakeMetadata(None, reach_at=c.gateway)
    try:
        job_id = detach(
            c,
            tmp_path,
            "run",
            *own_args(wd, "--env", f"GCE_METADATA_HOST={metadata.host}", "--recover", "--term-grace", "5s"),
            "--",
            *example(60),
        )
        read = lambda: snap.read_bytes() if snap.exists() else None  # noqa: E731
        wait_epoch(read, 4)
        metadata.preempt(c.nodes[1].address)
        # The VM stops once its ranks are told (Compute Engine: 30 s after the notice), and boots again.
        out_log = jobdir(tmp_path, job_id) / "output.log"
        wait_for(lambda: PREEMPTION_NOTICE in out_log.read_text(), 60, "the preemption notice")
        c.power_off(1)
        wait_state(c, tmp_path, job_id, {"RECOVERING"}, timeout=30)
        time.sleep(3)
        metadata.boot(c.nodes[1].address)
        c.restart_sshd(1)
        done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
    finally:
        metadata.close()
    assert done["state"] == "SUCCEEDED", (done["why"], done["recoveries"])
    (rec,) = done["recoveries"]
    assert rec["reason"] == "preempted" and rec["waited_s"] is not None, rec
    out = logs(c, tmp_path, job_id)
    assert f"[node 1] {PREEMPTION_NOTICE} (instance/preempted is TRUE): SIGTERM to every rank, SIGKILL after 5 s" in out
    assert f"[node 0] {PREEMPTION_NOTICE}" not in out
    second = out[out.index("attempt 1 (restart reason preempted)") :]
    resumed = re.search(r"resuming from the snapshot at epoch (\d+)", second)
    assert resumed and int(resumed.group(1)) >= 4 and "] epoch 59 | loss" in second, second
    c.assert_nothing_left()


CRASH_AT_START = """
    import os

    print(f"attempt {os.environ['GPUFLEET_ATTEMPT']} starting", flush=True)
    raise FileNotFoundError("no training data in /data/shards: mount the bucket first")
"""


def test_a_script_that_crashes_at_start_stops_after_max_restarts_with_its_own_error(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    crash = script(tmp_path, "crash.py", CRASH_AT_START)
    job_id = detach(c, tmp_path, "run", *own_args(tmp_path, "--recover", "--max-restarts", "1"), "--", str(crash))
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=120)
    assert done["state"] == "FAILED" and done["exit"] != 0, done
    assert "FileNotFoundError: no training data in /data/shards" in done["why"], done
    assert "gave up after 1 restart (--max-restarts 1)" in done["why"], done
    first, second = done["recoveries"]
    assert first["reason"] == second["reason"] == "worker-failed"
    assert first["waited_s"] is not None and second["waited_s"] is None, done["recoveries"]
    out = logs(c, tmp_path, job_id)
    assert out.count("attempt 0 starting") == 2 and out.count("attempt 1 starting") == 2, out
    assert "attempt 2" not in out
    c.assert_nothing_left()


USAGE_ERROR = """
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.parse_args()
"""


def test_exit_status_2_is_not_restarted_whatever_max_restarts_says(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    usage = script(tmp_path, "usage.py", USAGE_ERROR)
    job_id = detach(c, tmp_path, "run", *own_args(tmp_path, "--recover", "--max-restarts", "3"), "--", str(usage))
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=120)
    assert done["state"] == "FAILED", done
    assert "exit 2 is in --no-restart-exit-codes 2: not restarted" in done["why"], done
    (rec,) = done["recoveries"]
    assert rec["waited_s"] is None, rec
    # Once per node (one attempt: not restarted); the controller's closing line quotes it too.
    node_lines = [l for l in logs(c, tmp_path, job_id).splitlines() if l.startswith("[node ")]
    assert sum("the following arguments are required: --data" in l for l in node_lines) == 2
    c.assert_nothing_left()


SAVES_ON_SIGTERM = """
    import os
    import signal
    import sys
    import time

    def on_sigterm(signum, frame):
        time.sleep(3)  # saving a checkpoint
        with open(os.path.join(sys.argv[1], f"saved-{os.environ['RANK']}"), "w") as f:
            f.write("saved\\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    print("training", flush=True)
    while True:
        time.sleep(0.1)
"""

IGNORES_SIGTERM = """
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("training", flush=True)
    while True:
        time.sleep(0.1)
"""


def _stop_after_start(c, tmp_path: Path, job_id: str, *stop_args: str) -> tuple[dict, str]:
    # The job's log on node 0, read here (a wait, not an assertion): no CLI start and ssh session a look.
    out_log = jobdir(tmp_path, job_id) / "output.log"
    wait_for(lambda: out_log.exists() and out_log.read_text().count("training") == 2, 60, "both ranks started")
    r = launch(tmp_path, "stop", *source_args(c, tmp_path), *stop_args, job_id, timeout=120)
    assert r.returncode == 0 and "STOPPED" in r.stderr, r.stderr
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=30)
    return done, logs(c, tmp_path, job_id)


def test_stop_gives_every_rank_the_grace_to_save_and_the_log_says_each_exited_by_itself(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    saves = script(tmp_path, "saves.py", SAVES_ON_SIGTERM)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    job_id = detach(c, tmp_path, "run", *own_args(tmp_path, "--term-grace", "10s"), "--", str(saves), str(out_dir))
    done, out = _stop_after_start(c, tmp_path, job_id, "--grace", "10s")
    assert done["state"] == "STOPPED", done
    assert sorted(p.name for p in out_dir.iterdir()) == ["saved-0", "saved-1"]
    for rank in (0, 1):
        assert re.search(rf"gpufleet-stop: rank {rank} \(pid \d+\) exited by itself after SIGTERM", out), out
    assert "killed" not in out
    c.assert_nothing_left()


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_and_the_log_says_so(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    ignores = script(tmp_path, "ignores.py", IGNORES_SIGTERM)
    job_id = detach(c, tmp_path, "run", *own_args(tmp_path, "--term-grace", "3s"), "--", str(ignores))
    done, out = _stop_after_start(c, tmp_path, job_id)
    assert done["state"] == "STOPPED", done
    for rank in (0, 1):
        assert re.search(rf"gpufleet-stop: rank {rank} \(pid \d+\) killed: still running 3 s after SIGTERM", out), out
    c.assert_nothing_left()
