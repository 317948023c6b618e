"""Issue 7's failure table, each row on the simulated cluster: real sshd nodes, real torchrun
started by the installed `launch`, gloo on CPU, the tiny model.

A row's test does what the failure does (SIGKILL a worker, kill a node's sessions, SIGTERM the
workers, Ctrl-C the launcher, fill the disk...) and checks what a user would see and what is
left on the nodes and on disk."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launcher.core.types import SshConfig
from tests.faults import HALF_WRITTEN_SAVE
from tests.support import (
    PY,
    REPO,
    TRAIN,
    Launch,
    checkpoint_step,
    params,
    sigkill,
    site_dir,
    source_args,
    torch_args,
    wait_for,
    wait_saved,
    workers,
)

pytestmark = pytest.mark.cluster


def train(c, tmp_path, *train_args: str, launch_opts: tuple[str, ...] = (), name: str = "out") -> Launch:
    args = ["train", *source_args(c, tmp_path), *torch_args(), *launch_opts, "--", *TRAIN, *train_args]
    return Launch(args, tmp_path / f"{name}.log")


def failed_first(out: str) -> str:
    """The launcher's 'failed first' line and the last lines it prints under it."""
    assert "failed first" in out, out
    return out[out.rindex("failed first") - 40 :]


# ---- a worker dies -------------------------------------------------------------------------


def test_a_worker_killed_on_node_2_stops_every_node_and_names_node_2(sim_cluster, tmp_path):
    c = sim_cluster(3)
    run = train(
        c, tmp_path, "--global-batch", "3", "--steps", "100000", "--log-every", "5", launch_opts=("--max-restarts", "0")
    )
    try:
        run.wait_for_text("step 10/")
        (pid,) = workers(c, 2).values()
        sigkill(pid)
        rc = run.wait(60)  # left alone, the others would train 100000 steps: this catches a hang
    finally:
        run.kill()
    out = run.out
    assert rc not in (0, 2), out
    report = failed_first(out)
    assert f"node 2 ({c.nodes[2].address}) failed first" in report, report
    assert "SIGKILL" in report  # its last lines: torchrun's summary of the killed worker
    c.assert_nothing_left(within=2)


def test_a_killed_worker_is_restarted_and_training_ends_where_an_uninterrupted_run_ends(sim_cluster, tmp_path):
    c = sim_cluster(2)
    common = ["--global-batch", "2", "--steps", "40", "--log-every", "10", "--checkpoint-every", "10", "--resume"]
    ref = train(
        c,
        tmp_path,
        *common,
        "--checkpoint-dir",
        str(tmp_path / "ref-ckpt"),
        "--save-params",
        str(tmp_path / "ref.pt"),
        name="ref",
    )
    assert ref.wait(300) == 0, ref.out  # a hang catch: 40 tiny steps, slow only on a loaded machine
    ckpt = tmp_path / "ckpt"
    run = train(
        c,
        tmp_path,
        *common,
        "--checkpoint-dir",
        str(ckpt),
        "--save-params",
        str(tmp_path / "final.pt"),
        launch_opts=("--max-restarts", "2"),
    )
    try:
        wait_for(lambda: (ckpt / "latest").exists(), 120, "the first checkpoint", run, interval=0.005)
        (pid,) = workers(c, 1).values()
        sigkill(pid)
        rc = run.wait(180)
    finally:
        run.kill()
    out = run.out
    assert rc == 0, out
    # The log says a restart happened, and why.
    assert (
        f"node 1 ({c.nodes[1].address}): worker local_rank 0 (pid {pid}) killed by SIGKILL; "
        "torchrun restarts the workers on every node (restart 1 of --max-restarts 2" in out
    ), out
    assert "resumed from" in out, out
    a, b = params(tmp_path / "ref.pt"), params(tmp_path / "final.pt")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    c.assert_nothing_left(within=2)


# ---- a node disappears ---------------------------------------------------------------------


def test_a_node_that_disappears_mid_training_is_named_unreachable_and_the_rest_stop(sim_cluster, tmp_path):
    c = sim_cluster(3)
    run = train(c, tmp_path, "--global-batch", "3", "--steps", "100000", "--log-every", "5")
    try:
        run.wait_for_text("step 10/")
        c.kill_sessions(2)
        rc = run.wait(60)  # noticed by the keep-alives (ServerAliveInterval 2 x 3), not a hang
    finally:
        run.kill()
    out = run.out
    assert rc == 255, out
    report = failed_first(out)
    assert f"node 2 ({c.nodes[2].address}) failed first: unreachable" in report, report
    c.assert_nothing_left(within=2)


# ---- preemption and Ctrl-C -------------------------------------------------------------------


def test_sigterm_to_the_workers_saves_a_checkpoint_a_second_one_does_not_kill_the_save_and_resume_continues(
    sim_cluster, tmp_path
):
    """Spot VMs are often reclaimed together: node 0's SIGTERM lands a moment after node 1's, while
    rank 0 is already saving. The save must finish, every worker exit 0, and a resume go on from it."""
    c = sim_cluster(2)
    ckpt = tmp_path / "ckpt"
    common = ["--global-batch", "2", "--log-every", "5", "--checkpoint-dir", str(ckpt)]
    run = train(c, tmp_path, *common, "--steps", "100000")
    try:
        run.wait_for_text("step 10/")
        assert not ckpt.exists() or not (ckpt / "latest").exists()  # no periodic saves
        # Node 1's VM is preempted: its workers get SIGTERM (node 0 hears of it through the
        # workload's per-step stop flag, and rank 0, wherever it runs, saves).
        late = list(workers(c, 0).values())
        for pid in workers(c, 1).values():
            os.kill(pid, signal.SIGTERM)
        run.wait_for_text("SIGTERM: saving a checkpoint", timeout=60)
        for pid in late:  # node 0's notice, while rank 0 saves
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        rc = run.wait(60)
    finally:
        run.kill()
    assert rc == 0, run.out  # a preempted run that saved is a clean exit
    assert "SIGTERM: saving a checkpoint at step" in run.out
    step = checkpoint_step(ckpt)
    assert step >= 10
    # The save is timed and checked against the notice (the default 30 s --preemption-budget).
    (line,) = [ln for ln in run.out.splitlines() if f"SIGTERM: checkpoint step {step} saved in " in ln]
    seconds = float(line.split(" saved in ")[1].split(" s ")[0])
    assert 0 < seconds < 30 and f"-> {ckpt / f'step_{step:08d}'};" in line, line
    assert line.endswith("within the 30 s --preemption-budget"), line
    again = train(c, tmp_path, *common, "--steps", str(step + 5), "--resume", name="resume")
    assert again.wait(120) == 0, again.out
    assert f"resumed from {ckpt} at step {step}" in again.out
    assert f"step {step + 5}/{step + 5}" in again.out
    c.assert_nothing_left(within=2)


def test_ctrl_c_while_a_node_is_still_connecting_starts_nothing_and_exits_130(sim_cluster, tmp_path):
    c = sim_cluster(3)
    c.block(1)  # node 1's handshake hangs until ConnectTimeout
    try:
        # --rank-order given: the launch's own check is the first contact (the topology order asks
        # every node first, in a round of its own that this test is not about).
        run = train(c, tmp_path, "--steps", "10", launch_opts=("--rank-order", "given"))
        target = c.nodes[1].address

        def connecting() -> bool:
            kids = []  # the probes are started from the launcher's pool threads: every task
            for task in Path(f"/proc/{run.proc.pid}/task").glob("*"):
                try:
                    kids += (task / "children").read_text().split()
                except OSError:
                    pass
            for k in kids:
                try:
                    if target in Path(f"/proc/{k}/cmdline").read_text():
                        return True
                except OSError:
                    pass
            return False

        try:
            wait_for(connecting, 60, "the launcher connecting to node 1", run)
            # The other nodes have answered and wait for `go` in their sessions; node 1 has not.
            wait_for(lambda: c.processes(0) and c.processes(2), 60, "nodes 0 and 2 waiting to start", run)
            t0 = time.monotonic()
            run.signal(signal.SIGINT)
            rc = run.wait(60)
            took = time.monotonic() - t0
        finally:
            run.kill()
    finally:
        c.unblock(1)
    out = run.out
    assert rc == 130, out
    assert "nothing was started" in out, out
    # Node 1's handshake would only end at ssh's ConnectTimeout: Ctrl-C did not wait for it.
    assert took < SshConfig().connect_timeout, f"exit took {took:.1f} s after Ctrl-C"
    assert "[node " not in out  # no node printed anything: nothing ran
    assert not (tmp_path / "runs").exists()
    c.assert_nothing_left(within=2)


def test_ctrl_c_during_training_stops_every_node_and_keeps_the_latest_checkpoint_whole(sim_cluster, tmp_path):
    c = sim_cluster(2)
    ckpt = tmp_path / "ckpt"
    run = train(
        c,
        tmp_path,
        "--global-batch",
        "2",
        "--steps",
        "100000",
        "--log-every",
        "5",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "5",
    )
    try:
        wait_saved(ckpt, 10, run)
        run.signal(signal.SIGINT)
        rc = run.wait(60)
    finally:
        run.kill()
    out = run.out
    assert rc == 130, out
    assert "stopped every node on signal 2" in out
    c.assert_nothing_left(within=2)
    assert checkpoint_step(ckpt) >= 10  # latest names a whole checkpoint that loads
    assert not [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]


# ---- checkpoints under stress ------------------------------------------------------------------


def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_latest_and_loadable(sim_cluster, tmp_path):
    c = sim_cluster(2)
    site = site_dir(tmp_path, HALF_WRITTEN_SAVE)
    ckpt = tmp_path / "ckpt"
    run = train(
        c,
        tmp_path,
        "--global-batch",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--steps",
        "100",
        "--checkpoint-every",
        "2",
        launch_opts=("--env", f"PYTHONPATH={site}"),
    )
    try:

        def torn() -> bool:
            return any(f.stat().st_size for d in ckpt.glob(".step_00000004.tmp-*") for f in d.iterdir())

        wait_for(torn, 120, "a half-written checkpoint", run, interval=0.01)
        (writer,) = [pid for i in range(2) for r, pid in workers(c, i).items() if r == 0]
        sigkill(writer)  # the crash: rank 0 dies mid-write, no handler runs
        rc = run.wait(60)
    finally:
        run.kill()
    assert rc not in (0, 2), run.out
    assert [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]  # the torn file is there...
    assert (ckpt / "latest").read_text().strip() == "step_00000002"  # ...latest is not it
    assert checkpoint_step(ckpt) == 2  # and loads whole (tests/workloads resumes from such a state)
    c.assert_nothing_left(within=2)


def test_a_full_checkpoint_disk_names_the_path_and_keeps_the_previous_checkpoint(sim_cluster, tmp_path, small_tmpfs):
    probe = tmp_path / "probe"
    r = subprocess.run(
        [PY, "-m", "workloads.train", *TRAIN, "--global-batch", "1", "--steps", "1", "--checkpoint-dir", str(probe)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    size = sum(f.stat().st_size for f in (probe / "step_00000001").iterdir())
    disk = small_tmpfs(int(size * 1.5))  # room for one checkpoint, not for a second beside it
    c = sim_cluster(2)
    run = train(
        c, tmp_path, "--global-batch", "2", "--steps", "4", "--checkpoint-dir", str(disk), "--checkpoint-every", "1"
    )
    rc = run.wait(120)
    out = run.out
    assert rc not in (0, 2), out
    report = failed_first(out)
    # The node named is the one that said what went wrong (rank 0's), not a peer whose
    # collective broke as a consequence: its own error line, shown once in the live stream.
    node = re.search(r"node (\d+) \(\S+\) failed first", report).group(1)
    errors = [ln for ln in out.splitlines() if "error: " in ln and "No space left on device" in ln]
    assert errors and errors[0].startswith(f"[node {node}] error: "), out
    assert f"{disk / 'step_00000002'}" in errors[0] and out.count(errors[0]) == 1, out
    assert "[rank" not in errors[0]
    assert len({ln.split("] ", 1)[-1] for ln in out.splitlines() if "error: " in ln}) == 1, out  # one line
    assert (disk / "latest").read_text().strip() == "step_00000001"
    assert checkpoint_step(disk) == 1
    assert not [p for p in disk.iterdir() if ".tmp-" in p.name]  # the partial file is removed
    c.assert_nothing_left(within=2)


# ---- nodes that differ -------------------------------------------------------------------------


def _outputs(c, tmp_path: Path, ranks: list[int], name: str) -> Path:
    """Stack outputs naming the nodes simnode<i> (what the hostname check compares against)."""
    doc = {
        "cluster": "sim",
        "zone": "us-central1-a",
        "machineType": None,
        "nodes": [
            {"name": f"simnode{i}", "index": k, "internalIp": c.nodes[i].address, "externalIp": None}
            for k, i in enumerate(ranks)
        ],
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_skewed_clock_and_a_stale_hostname_are_warned_about_before_training_and_a_torch_mismatch_refuses(
    sim_cluster, tmp_path
):
    # Node 3's python reports another torch version: a directory ahead of site-packages on its
    # PYTHONPATH holds a torch-2.12.1.dist-info, which importlib.metadata finds first (the
    # pre-flight reads the version that way, without importing torch).
    shadow = tmp_path / "old-torch"
    (shadow / "torch-2.12.1.dist-info").mkdir(parents=True)
    (shadow / "torch-2.12.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.12.1\n")
    # Node 1's clock is 10 minutes ahead as gpufleet's node program reads it (the pre-flight's
    # `time=` fact): its `python3` runs that program (`python3 -I -S -c SOURCE ...`) with
    # time.time() 600 s ahead. Only that program: libfaketime preloaded into the session breaks
    # torchrun's own timers (time.sleep fails with EINVAL under FAKETIME_SKIP_CMDS/ONLY_CMDS or
    # DONT_FAKE_MONOTONIC; with none of them the agents never return from their exit barrier),
    # which a real clock skew does not do.
    fake = tmp_path / "skewed-bin"
    fake.mkdir()
    (fake / "python3").write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2 $3" = "-I -S -c" ]; then src=$4; shift 4; exec /usr/bin/python3 -I -S -c '
        '"import time as _t; _now = _t.time; _t.time = lambda: _now() + 600\n$src" "$@"; fi\n'
        'exec /usr/bin/python3 "$@"\n'
    )
    (fake / "python3").chmod(0o755)
    c = sim_cluster(
        4,
        hostnames={0: "simnode0", 1: "simnode1", 2: "elsewhere", 3: "simnode3"},
        node_env={
            1: {"PATH": f"{fake}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
            3: {"PYTHONPATH": str(shadow)},
        },
    )
    common = [*c.launch_flags, "--runs-dir", str(tmp_path / "runs"), *torch_args()]
    run = Launch(
        [
            "train",
            "--outputs",
            str(_outputs(c, tmp_path, [0, 1, 2], "three")),
            *common,
            "--",
            *TRAIN,
            "--global-batch",
            "3",
            "--steps",
            "2",
        ],
        tmp_path / "warn.log",
    )
    assert run.wait(120) == 0, run.out
    out = run.out
    # +600 s less the time a probe takes to cross: +599.x or +600.0 s as printed.
    clock = re.compile(
        rf"node 1 \({re.escape(c.nodes[1].address)}\): clock differs from this machine by \+(599|600)\.\d s"
    )
    host = f"node 2 ({c.nodes[2].address}): hostname is 'elsewhere', expected 'simnode2'"
    assert clock.search(out) and host in out, out
    first_node_line = out.index("[node ")
    assert clock.search(out).start() < first_node_line and out.index(host) < first_node_line  # before training
    assert "node 0 (" not in out.split("[node ")[0]  # the agreeing node is not warned about
    assert "done: 2 steps" in out

    bad = Launch(
        ["train", "--outputs", str(_outputs(c, tmp_path, [0, 3], "mixed")), *common, "--", *TRAIN, "--steps", "2"],
        tmp_path / "torch.log",
    )
    assert bad.wait(120) == 2, bad.out
    errors = [ln for ln in bad.out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, bad.out
    assert "torch versions differ across nodes" in errors[0]
    assert f"node 1 ({c.nodes[3].address}): 2.12.1" in errors[0] and torch.__version__.split("+")[0] in errors[0]
    assert "nothing was started" in errors[0]
    assert "Traceback" not in bad.out and "[node " not in bad.out
    c.assert_nothing_left(within=2)


# ---- two launches at once ------------------------------------------------------------------------

_WAITER = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"{sys.argv[1]} up rank={dist.get_rank()}", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
print(f"{sys.argv[1]} done", flush=True)
"""


def test_a_second_launch_on_the_same_port_refuses_and_stopping_another_never_stops_the_first(sim_cluster, tmp_path):
    c = sim_cluster(2)
    script = tmp_path / "waiter.py"
    script.write_text(_WAITER)
    go = tmp_path / "go"

    def launch_run(tag: str, port: str) -> Launch:
        return Launch(
            ["run", *source_args(c, tmp_path), *torch_args(), "--rdzv-port", port, "--", str(script), tag, str(go)],
            tmp_path / f"{tag}.log",
        )

    a = launch_run("A", "29621")
    b = other = None
    try:
        a.wait_for_text("A up", count=2)
        a_pids = {i: set(c.processes(i)) for i in range(2)}
        b = launch_run("B", "29621")  # same nodes, same port
        assert b.wait(60) == 2, b.out
        errors = [ln for ln in b.out.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "rendezvous port 29621" in errors[0] and "in use by another launch" in errors[0]
        assert "--rdzv-port" in errors[0]
        other = launch_run("C", "29622")  # same nodes, another port: runs beside A
        other.wait_for_text("C up", count=2)
        other.signal(signal.SIGINT)
        assert other.wait(60) == 130, other.out
        # A is untouched: still running, every one of its processes alive.
        assert a.proc.poll() is None, a.out
        for i in range(2):
            assert a_pids[i] <= set(c.processes(i)), f"node {i} lost A's processes"
        go.touch()
        assert a.wait(60) == 0, a.out
        assert a.out.count("A done") == 2
    finally:
        for run in (a, b, other):
            if run is not None:
                run.kill()
    c.assert_nothing_left(within=2)
