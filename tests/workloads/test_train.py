"""workloads.train under real torchrun (gloo, CPU): learning, equivalences, resume, FSDP, GCS."""

from __future__ import annotations

import json

import pytest

from tests.workloads.conftest import (
    REF_ARGS,
    REF_STEPS,
    assert_same_params,
    one_line_exit_2,
    params,
    train,
)
from workloads.checkpoint.store import load_checkpoint


def test_loss_falls_on_the_synthetic_task_and_the_output_paths_are_written(tmp_path):
    metrics, out = tmp_path / "m.jsonl", tmp_path / "p.pt"
    metrics.write_text('{"step": 0}\n')  # an existing metrics file is appended to
    run = train(
        [
            "--model",
            "tiny",
            "--steps",
            "40",
            "--global-batch",
            "16",
            "--micro-batch",
            "8",
            "--lr",
            "1e-2",
            "--warmup-steps",
            "5",
            "--metrics-file",
            str(metrics),
            "--save-params",
            str(out),
            "--log-every",
            "1",
            "--straggler-every",
            "0",
        ],
        nproc=0,
    )
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 0
    lines = metrics.read_text().splitlines()
    assert lines[0] == '{"step": 0}' and [json.loads(line)["step"] for line in lines[1:]] == list(range(1, 41))
    losses = [json.loads(line)["loss"] for line in lines[1:]]
    # ln(64) = 4.16 is chance for the tiny model's vocabulary; the task is learnable.
    assert losses[0] > 4.0
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0], losses
    # The log line a person reads: step, loss, time, throughput, MFU (n/a on CPU).
    assert "step 40/40 | loss" in run.stdout and "tok/s | MFU n/a" in run.stdout
    assert "6N+12LHQT" in run.stdout  # the banner states the FLOP formula


def test_two_ranks_reach_the_parameters_of_one_process_with_the_same_global_batch(tmp_path, reference):
    out = tmp_path / "one.pt"
    # 1 process, micro 64, no accumulation vs the reference's micro 8 x 2 ranks x 4 accum.
    args = REF_ARGS + ["--steps", str(REF_STEPS), "--micro-batch", "64", "--save-params", str(out)]
    run = train(args, nproc=0)
    assert run.returncode == 0, run.stderr
    assert "global batch 64 = micro-batch 64 x 1 data-parallel rank x 1 accumulation step |" in run.stdout
    assert_same_params(reference, params(out), atol=1e-5)


def test_accumulating_k_micro_steps_equals_one_step_with_a_k_times_batch(tmp_path):
    outs = []
    for micro in ("4", "32"):
        out = tmp_path / f"micro{micro}.pt"
        run = train(
            REF_ARGS + ["--steps", "8", "--global-batch", "32", "--micro-batch", micro, "--save-params", str(out)],
            nproc=0,
        )
        assert run.returncode == 0, run.stderr
        outs.append(params(out))
    assert_same_params(outs[0], outs[1], atol=1e-5)


def test_fsdp_trains_checkpoints_and_matches_ddp(tmp_path, reference):
    ckpt, out = tmp_path / "ckpt", tmp_path / "fsdp.pt"
    first = train(REF_ARGS + ["--steps", "10", "--parallelism", "fsdp", "--checkpoint-dir", str(ckpt)])
    assert first.returncode == 0, first.stderr
    # Each rank wrote its own shards; read back in one process they are the full tensors.
    assert sorted(p.name for p in (ckpt / "step_00000010").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = load_checkpoint(ckpt / "step_00000010")
    assert state["model"]["wte.weight"].shape == (64, 32)
    assert state["step"] == 10 and state["data"]["samples_seen"] == 640
    second = train(
        REF_ARGS
        + [
            "--steps",
            "20",
            "--parallelism",
            "fsdp",
            "--checkpoint-dir",
            str(ckpt),
            "--resume",
            "--save-params",
            str(out),
        ]
    )
    assert second.returncode == 0, second.stderr
    assert "fsdp x 2 ranks" in second.stdout
    assert_same_params(reference, params(out), atol=1e-5)


def test_keep_last_n_checkpoints_latest_points_at_the_newest_and_another_model_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = train(
        [
            "--steps",
            "8",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "2",
            "--global-batch",
            "4",
            "--micro-batch",
            "2",
            "--straggler-every",
            "0",
        ],
        nproc=0,
    )
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000006", "step_00000008"]
    assert (ckpt / "latest").read_text().strip() == "step_00000008"
    # A run of another model meets the kept checkpoint: one line, exit 2 (main in this process).
    args = ["--model", "small-test", "--seq-len", "64", "--steps", "10", "--checkpoint-dir", str(ckpt), "--resume"]
    line = one_line_exit_2(args + ["--global-batch", "4", "--micro-batch", "2"])
    assert "written with model tiny, this run has small-test" in line


def test_checkpoint_round_trip_through_gcs(tmp_path, reference, gcs_emulator, monkeypatch):
    from google.cloud import storage

    url, out = "gs://ckpt/runs/a", tmp_path / "gcs.pt"
    first = train(REF_ARGS + ["--steps", "10", "--checkpoint-dir", url], env=gcs_emulator)
    assert first.returncode == 0, first.stderr
    assert "checkpoint step 10 -> gs://ckpt/runs/a/step_00000010 (" in first.stdout
    second = train(
        REF_ARGS + ["--steps", "20", "--checkpoint-dir", url, "--resume", "--save-params", str(out)], env=gcs_emulator
    )
    assert second.returncode == 0, second.stderr
    assert_same_params(reference, params(out))

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator["STORAGE_EMULATOR_HOST"])
    bucket = storage.Client().bucket("ckpt")
    names = sorted(b.name for b in bucket.list_blobs(prefix="runs/a/"))
    assert bucket.blob("runs/a/latest").download_as_bytes().decode().strip() == "step_00000020"
    # Both ranks uploaded their own shards; .metadata marks each checkpoint complete.
    assert names == ["runs/a/latest"] + [
        f"runs/a/step_000000{s}/{f}" for s in ("10", "20") for f in (".metadata", "__0_0.distcp", "__1_0.distcp")
    ]


@pytest.mark.parametrize("bucket, why", [("nope", "does not exist"), ("ckpt", "cannot reach")])
def test_a_missing_or_unreachable_bucket_is_one_line_and_exit_2(bucket, why, gcs_emulator):
    from tests.workloads.conftest import free_port

    env = dict(gcs_emulator)
    if why == "cannot reach":
        env["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{free_port()}"  # nothing listens
    args = ["--steps", "2", "--checkpoint-dir", f"gs://{bucket}/x", "--global-batch", "4", "--micro-batch", "2"]
    if why == "does not exist":  # main in this process: exit 2, one line, nothing on stdout
        line = one_line_exit_2(args, env)
        assert f"gs://{bucket}" in line and why in line, line
        return
    # The unreachable case runs under torchrun to show the exit 2 reaching torchrun's summary.
    run = train(args, env=env, timeout=90)
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"gs://{bucket}" in errors[0] and why in errors[0], run.stderr
    assert "[rank" not in run.stderr and "Traceback" not in run.stderr.split("exitcode")[0]
    assert "exitcode  : 2" in run.stderr
