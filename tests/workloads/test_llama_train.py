"""The Llama-3 sizes through workloads.train: one tensor-parallel run on 2 CPU ranks, and
`--plan`, the memory plan printed before any process group exists."""

from __future__ import annotations

import math
import re
import subprocess

import pytest

from tests.support import LAUNCH
from tests.workloads.conftest import REPO, child_env
from workloads.config import ConfigError, TrainConfig
from workloads.llama_sizes import LLAMA_SIZES
from workloads.train import main

PLAN_70B = ["--plan", "--plan-nodes", "16", "--plan-machine-type", "a3-megagpu-8g", "--model", "llama3-70b"]
PLAN_70B += ["--tp", "8", "--dp-shard", "16", "--micro-batch", "1", "--seq-len", "8192"]


def test_llama3_debug_trains_under_tp2_through_the_launcher_with_its_own_flop_count(tmp_path):
    # 2 local nodes of one rank each: the launcher's checks, then torchrun and tensor parallelism.
    launch = subprocess.run(
        [LAUNCH, "train", "--local", "--nodes", "2", "--runs-dir", str(tmp_path / "runs"), "--workdir", str(REPO)]
        + ["--env", "OMP_NUM_THREADS=1", "--", "--model", "llama3-debug", "--steps", "5", "--tp", "2"]
        + ["--seq-len", "64", "--straggler-every", "0"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    node0 = next((tmp_path / "runs").glob("*/node-0.log")).read_text()
    losses = [float(m) for m in re.findall(r"^step \d+/5 \| loss ([0-9.naif]+)", node0, re.M)]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses), node0
    # 6N + 12LHQT of the Llama size (GPT's formula over the same N would count no GQA, no SwiGLU).
    size = LLAMA_SIZES["llama3-debug"]
    flops = size.flops_per_token(64)
    # The banner's N is the non-embedding count (an untied table's lookup is no matmul).
    assert f"model llama3-debug ({(size.n_params - size.embedding_params) / 1e6:.2f}M params)" in node0
    assert "| tp 2 = 2 ranks on cpu" in node0 and f"{flops:.3g} FLOP/token" in node0


def test_tp_must_divide_the_kv_heads_too():
    # llama3-debug: 4 query heads, 2 KV heads; tp 4 divides the first only.
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="llama3-debug", tp=4, world_size=4)
    assert str(e.value) == "--tp 4 does not divide model llama3-debug's 2 KV heads; use a --tp that divides it"


def test_plan_without_torchrun_prints_the_verdict_and_the_fix_and_exits_0(capsys):
    # main in this process, as `python -m workloads.train --plan ...` runs it (no process group).
    assert main(PLAN_70B) == 0
    p = capsys.readouterr()
    assert p.err == "", p.err
    lines = p.out.splitlines()
    assert lines[0].startswith("model llama3-70b: 70.55B parameters; micro-batch 1 x seq 8192")
    assert "  tp 8: ranks 0-7 form one group, within node 0" in lines
    # Built on meta and materialized shard by shard: 70B never sits whole in a process.
    assert (
        "build: on the meta device, sharded there, then materialized shard by shard: each rank allocates and "
        "initialises only its own shards on its GPU, no process holds the whole model (262.8 GiB of fp32 weights)"
    ) in lines
    assert lines[1] == "mode: eager (autograd keeps what each op saves)"
    assert "verdict: does not fit by 1.5 GiB" in lines
    assert lines[-1].startswith("  smallest change that fits: --compile ->")


def test_plan_with_checkpointing_fits(capsys):
    assert main([*PLAN_70B, "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits (31.1 of 80 GiB)" in out.splitlines()
    assert "smallest change" not in out
    assert main([*PLAN_70B, "--compile"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("mode: compiled (--compile: ") and "verdict: fits (67.6 of 80 GiB)" in lines


def test_plan_says_a_ddp_run_or_init_device_full_builds_the_model_whole(capsys):
    one_b = ["--plan", "--model", "llama3-1b", "--micro-batch", "1", "--seq-len", "2048"]
    assert main([*one_b, "--dp-replicate", "8"]) == 0
    assert (
        "build: whole on every rank's host (4.6 GiB of fp32 weights), then moved to its GPU" in capsys.readouterr().out
    )
    assert main([*one_b, "--dp-shard", "8", "--init-device", "full"]) == 0
    out = capsys.readouterr().out
    assert "build: whole on every rank's host (4.6 GiB of fp32 weights), then moved to its GPU and sharded there" in out


def test_plan_refuses_a_layout_that_is_not_its_world_in_one_line(capsys):
    # 2 nodes x 8 GPUs = 16 ranks; tp 8 x dp_shard 16 needs 128.
    args = [*PLAN_70B, "--plan-nodes", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: dp_replicate(1) x dp_shard(16) x tp(8) x pp(1) = 128 != world size 16; make the product "
        "the world size (--dp-shard -1 takes the rest)\n"
    )


def test_plan_names_an_unknown_machine_type(capsys):
    assert main([*PLAN_70B, "--plan-machine-type", "a3-mega"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --plan-machine-type: machine type 'a3-mega' is unknown") and err.count("\n") == 1
