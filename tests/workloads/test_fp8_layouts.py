"""--precision fp8 on the sharded layouts, under torchrun with gloo on CPU (torchao's emulation):
FSDP2 with tensorwise fp8 (weights all-gathered in fp8, scales precomputed each step) and TP with
rowwise fp8 train, and the checkpoints between fp8 and bf16 runs hold the same high-precision
parameters: an fp8 run's checkpoint resumes a bf16 run, and a bf16 run's an fp8 one."""

from __future__ import annotations

import re

import pytest

from tests.workloads.conftest import assert_same_params, params, train

pytest.importorskip("torchao")
# Four torchrun launches in a row (each a few seconds alone, more on a loaded machine).
pytestmark = pytest.mark.timeout(600)

# One global batch for both layouts: FSDP's 2 data-parallel ranks, TP's one with 2 accumulation steps.
ARGS = [
    "--model",
    "llama3-debug",
    "--global-batch",
    "8",
    "--micro-batch",
    "4",
    "--seq-len",
    "64",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
]
ARGS += ["--log-every", "1", "--straggler-every", "0"]


def _ok(run, *lines: str) -> str:
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert run.returncode == 0, run.stdout + "\n".join(errors or run.stderr.splitlines()[-20:])
    for line in lines:
        assert line in run.stdout, run.stdout
    return run.stdout


def _losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+)/\d+ \| loss ([0-9.]+)", stdout, re.M)}


def test_fsdp_and_tp_train_in_fp8_and_checkpoints_cross_between_fp8_and_bf16(tmp_path):
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    # bf16 under FSDP2 to step 2; its checkpoint resumes an fp8 tensorwise run, which trains to step 5
    # (built on the meta device, as a GPU run of a sharded layout is: converted there, then sharded
    # and materialized).
    _ok(train([*ARGS, *ckpt, "--parallelism", "fsdp", "--precision", "bf16", "--steps", "2"]))
    fp8 = _ok(
        train(
            [*ARGS, *ckpt, "--parallelism", "fsdp", "--precision", "fp8", "--fp8-recipe", "tensorwise"]
            + ["--init-device", "meta", "--steps", "5", "--resume", "--save-params", str(tmp_path / "fp8.pt")]
        ),
        "resumed from ",
        "FSDP2 all-gathers the converted weights in fp8, their scales precomputed after each step",
        "step 5/5 | loss",
    )
    assert "fsdp x 2 ranks on cpu (gloo) | fp8 |" in fp8 and sorted(_losses(fp8)) == [3, 4, 5]
    # Its step-5 checkpoint, read by a bf16 run at step 5 (no step left): the same parameters. One
    # plain process reads it (saved by 2 ranks): the precisions differ, the rank count need not.
    _ok(
        train(
            [*ARGS, *ckpt, "--parallelism", "fsdp", "--precision", "bf16", "--steps", "5", "--resume"]
            + ["--save-params", str(tmp_path / "bf16.pt")],
            nproc=0,
        ),
        "resumed from ",
    )
    assert_same_params(params(tmp_path / "fp8.pt"), params(tmp_path / "bf16.pt"))
    # Tensor parallelism in fp8 rowwise, resharded from the FSDP checkpoint, trains on.
    tp = _ok(
        train([*ARGS, *ckpt, "--tp", "2", "--precision", "fp8", "--steps", "7", "--resume"]),
        "tp 2 = 2 ranks on cpu (gloo) | fp8 |",
        "fp8: torchao 0.18.0 float8 rowwise, emulated on CPU",
        "saved as fsdp x 2, read as tp 2",
    )
    losses = _losses(tp)
    assert sorted(losses) == [6, 7] and all(v == v and v < 10 for v in losses.values()), tp
