"""Sharded checkpoints under real torchrun over gloo: resharding N ranks -> M ranks,
async saves that overlap training, a kill in the middle of one, the SIGTERM save against its
budget, and the full-state checkpoints of the previous release."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.faults import HALF_WRITTEN_SAVE
from tests.support import site_dir
from tests.workloads.conftest import (
    REF_ARGS,
    REF_STEPS,
    REPO,
    assert_same_params,
    child_env,
    free_port,
    kill_tree,
    last_step,
    params,
    start,
    train,
    wait_for,
    workers,
)
from workloads.checkpoint.store import load_checkpoint

# Global batch 24 divides by 4, 3 and 2 ranks (micro 2: 3, 4 and 6 accumulation steps).
RESHARD_ARGS = [
    "--model",
    "tiny",
    "--global-batch",
    "24",
    "--micro-batch",
    "2",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
    "--lr-decay-steps",
    "20",
    "--straggler-every",
    "0",
    "--log-every",
    "2",
]


def _latest(ckpt) -> str:
    return (ckpt / "latest").read_text().strip()


def _site(tmp_path, code: str) -> dict[str, str]:
    site = site_dir(tmp_path, code)
    return {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _resume(ckpt: Path, steps: int, parallelism: str, out: Path, nproc: int):
    """The reshard test's resume of `ckpt` to `steps` under `parallelism` on `nproc` ranks,
    saving its parameters to `out`."""
    args = ["--steps", str(steps), "--parallelism", parallelism, "--checkpoint-dir", str(ckpt), "--resume"]
    return train(RESHARD_ARGS + args + ["--save-params", str(out)], nproc=nproc)


def test_a_checkpoint_saved_on_4_ranks_loads_on_3_and_on_2_with_the_same_parameters(tmp_path):
    ckpt = tmp_path / "ckpt"
    at6 = tmp_path / "four-at-6.pt"
    four = train(
        RESHARD_ARGS
        + [
            "--steps",
            "6",
            "--checkpoint-every",
            "4",
            "--parallelism",
            "fsdp",
            "--checkpoint-dir",
            str(ckpt),
            "--save-params",
            str(at6),
        ],
        nproc=4,
    )
    assert four.returncode == 0, four.stderr
    assert sorted(p.name for p in (ckpt / "step_00000004").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__3_0.distcp",
    ]
    saved = load_checkpoint(ckpt / "step_00000004")["model"]
    (ckpt / "latest").write_text("step_00000004\n")  # resume from the step-4 checkpoint

    # 4 FSDP shards read by 3 DDP ranks (each needs every tensor whole): bit for bit what was saved.
    out = tmp_path / "3.pt"
    run = _resume(ckpt, 4, "ddp", out, nproc=3)
    assert run.returncode == 0, run.stderr
    assert "at step 4 (epoch 0, 96 samples seen; saved by 4 ranks, read by 3)" in run.stdout
    loaded = params(out)
    assert sorted(loaded) == sorted(saved)
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    assert _latest(ckpt) == "step_00000004"  # nothing new to save at the step it resumed at

    # Read by 2 FSDP ranks (each needs other slices than were written), model and optimizer
    # state: two more steps on 2 ranks end where the 4 ranks ended (the sums over ranks are
    # ordered differently, hence the tolerance; a slice read wrong is off by far more).
    out = tmp_path / "2-at-6.pt"
    run = _resume(ckpt, 6, "fsdp", out, nproc=2)
    assert run.returncode == 0, run.stderr
    assert "at step 4 (epoch 0, 96 samples seen; saved by 4 ranks, read by 2)" in run.stdout
    assert_same_params(params(at6), params(out), atol=1e-5)
    assert _latest(ckpt) == "step_00000006"


def test_async_checkpoints_hold_the_state_of_their_step_and_do_not_disturb_training(tmp_path, reference):
    ckpt, out = tmp_path / "ckpt", tmp_path / "async.pt"
    run = train(
        REF_ARGS
        + [
            "--steps",
            str(REF_STEPS),
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "5",
            "--async-checkpoint",
            "--save-params",
            str(out),
        ]
    )
    assert run.returncode == 0, run.stderr
    # Training went on from the live state while the copies were written: same end as without.
    assert_same_params(reference, params(out))
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("checkpoint step 15 -> "))
    assert "training blocked " in line and "written in the background in " in line, line
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000010", "step_00000015", "step_00000020"]
    # The step-15 checkpoint, written in the background while steps 16.. ran, resumes to the end.
    (ckpt / "latest").write_text("step_00000015\n")
    resumed = tmp_path / "resumed.pt"
    run = train(
        REF_ARGS + ["--steps", str(REF_STEPS), "--checkpoint-dir", str(ckpt), "--resume", "--save-params", str(resumed)]
    )
    assert run.returncode == 0, run.stderr
    assert "at step 15" in run.stdout
    assert_same_params(reference, params(resumed))


def test_a_kill_in_the_middle_of_an_async_save_leaves_the_previous_latest_intact(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = ["--global-batch", "4", "--micro-batch", "2", "--checkpoint-dir", str(ckpt), "--straggler-every", "0"]
    # One plain process: every rank's writes stall alike, so more ranks would show nothing more.
    proc = start(
        args + ["--steps", "100", "--checkpoint-every", "2", "--async-checkpoint", "--metrics-file", str(metrics)],
        env=_site(tmp_path, HALF_WRITTEN_SAVE),
        nproc=0,
    )
    try:

        def half_written() -> bool:
            return any(f.stat().st_size for d in ckpt.glob(".step_00000004.tmp-*") for f in d.iterdir())

        wait_for(half_written, timeout=120, interval=0.01, proc=proc)
        # The save is in the background: training went on past step 4 while it was stuck.
        wait_for(lambda: last_step(metrics) >= 5, timeout=60, interval=0.01, proc=proc)
    finally:
        kill_tree(proc)  # every process at once, mid-write: no handler runs anywhere
    assert [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]  # the torn save is there...
    assert _latest(ckpt) == "step_00000002"  # ...but latest still names the whole one
    assert load_checkpoint(ckpt / "step_00000002")["step"] == 2
    run = train(args + ["--steps", "3", "--resume"], nproc=0)
    assert run.returncode == 0, run.stderr
    assert "at step 2" in run.stdout
    assert not [p.name for p in ckpt.iterdir() if ".tmp-" in p.name]  # dropped at start-up
    assert _latest(ckpt) == "step_00000003"


def test_sigterm_during_an_async_save_finishes_it_then_saves_and_names_what_to_change_over_budget(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    # Rank 1's shard writes take 0.5 s more: the async save is still running when SIGTERM lands.
    env = _site(
        tmp_path,
        """
        import os, time
        if os.environ.get("RANK") == "1":
            import torch.distributed.checkpoint.filesystem as fs
            write = fs._write_files_from_queue
            def slow(*a, **k):
                time.sleep(0.5)
                return write(*a, **k)
            fs._write_files_from_queue = slow
    """,
    )
    base = [
        "--global-batch",
        "16",
        "--micro-batch",
        "4",
        "--lr-decay-steps",
        "100000",
        "--straggler-every",
        "0",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "3",
        "--async-checkpoint",
    ]
    proc = start(base + ["--steps", "100000", "--metrics-file", str(metrics), "--preemption-budget", "0.001s"], env=env)
    try:
        wait_for(lambda: last_step(metrics) >= 4, timeout=120, interval=0.01, proc=proc)
        for pid in workers(proc.pid).values():
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, err
    step = load_checkpoint(ckpt / _latest(ckpt))["step"]
    assert step >= 4 and f"SIGTERM: saving a checkpoint at step {step}" in out
    # The async save under way was finished and published, then the synchronous one was made.
    assert "checkpoint step 3 -> " in out and "written in the background" in out
    (line,) = [ln for ln in err.splitlines() if "--preemption-budget" in ln]
    assert line.startswith(f"warning: SIGTERM: checkpoint step {step} saved in "), line
    # What to change: the rate it needed, or (the step in progress took the whole 1 ms) that.
    assert "over the 0.001 s --preemption-budget" in line
    assert re.search(
        r"(it needs [\d.]+ [kMG]?B/s to fit|the step in progress alone used the budget): "
        r"write to faster storage",
        line,
    ), line
    run = train(base[:-3] + ["--steps", str(step + 1), "--resume"])
    assert run.returncode == 0, run.stderr
    assert f"at step {step}" in run.stdout


def test_a_run_stopped_at_10_resumes_to_20_as_if_uninterrupted_as_does_the_previous_releases_format(
    tmp_path, reference
):
    first = tmp_path / "first"
    run = train(REF_ARGS + ["--steps", "10", "--checkpoint-dir", str(first)])
    assert run.returncode == 0, run.stderr
    assert _latest(first) == "step_00000010"
    out = tmp_path / "resumed-sharded.pt"
    run = train(REF_ARGS + ["--steps", "20", "--checkpoint-dir", str(first), "--resume", "--save-params", str(out)])
    assert run.returncode == 0, run.stderr
    assert "resumed from" in run.stdout and "at step 10" in run.stdout
    # Same data position, optimizer, scheduler and RNG: bit-for-bit the uninterrupted result.
    assert_same_params(reference, params(out))

    # What the previous release wrote (workloads/train.py before sharded checkpoints, Trainer.save): one
    # torch.save'd dict of full state dicts (StateDictOptions(full_state_dict=True)) and the
    # trainer's state, named step_00000010.pt. Made here from the step-10 checkpoint above.
    state = load_checkpoint(first / "step_00000010")
    ckpt = tmp_path / "old"
    ckpt.mkdir()
    torch.save(
        {k: state[k] for k in ("model", "optimizer", "scheduler", "scaler", "step", "rng", "data", "meta")},
        ckpt / "step_00000010.pt",
    )
    (ckpt / "latest").write_text("step_00000010.pt\n")
    out = tmp_path / "resumed.pt"
    run = train(
        REF_ARGS
        + [
            "--steps",
            str(REF_STEPS),
            "--checkpoint-dir",
            str(ckpt),
            "--resume",
            "--keep-checkpoints",
            "1",
            "--save-params",
            str(out),
        ]
    )
    assert run.returncode == 0, run.stderr
    notices = [ln for ln in run.stdout.splitlines() if ln.startswith("notice:")]
    assert notices == [
        f"notice: {ckpt}/step_00000010.pt is a full-state checkpoint of the previous release, "
        "read for this release only; this run saves sharded (DCP) checkpoints, step_*/ directories"
    ]
    assert "at step 10" in run.stdout
    # Model, optimizer, schedule and RNG came through: the uninterrupted run's end, bit for bit.
    assert_same_params(reference, params(out))
    # It saved the sharded format, and pruning took the old file with it.
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000020"]


@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace needs root")
def test_a_local_checkpoint_dir_that_the_nodes_do_not_share_is_refused_before_step_0(tmp_path):
    # Two torchrun agents ("nodes") on this machine; node B sees its own empty tmpfs at the
    # checkpoint path (a private mount namespace), as a node-local disk would be.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "shared",
        "--max-restarts",
        "0",
        "-m",
        "workloads.train",
        "--steps",
        "2",
        "--global-batch",
        "2",
        "--micro-batch",
        "1",
        "--straggler-every",
        "0",
        "--checkpoint-dir",
        str(ckpt),
    ]
    own_disk = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs tmpfs {shlex.quote(str(ckpt))} && exec "$@"',
        "node-b",
        *cmd,
    ]
    procs = [
        subprocess.Popen(c, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in (cmd, own_disk)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    errors = [ln for _, err in outs for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, outs  # printed once, by rank 0
    assert errors[0].startswith(f"error: --checkpoint-dir {ckpt} is not shared between the nodes: node "), errors
    assert "use gs://BUCKET/PREFIX or a directory every node mounts" in errors[0]
    assert any("exitcode  : 2" in err for _, err in outs), outs
    assert not any("step 1/" in out for out, _ in outs)
    assert os.listdir(ckpt) == []  # the probe is gone again
