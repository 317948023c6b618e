"""--precision fp8 on CPU, in torchao's emulation mode (no FP8 hardware here): which layers are
converted and which kept, the refusals, the loss against bf16, the memory plan's fp8 mode, the
launcher's plan and dry run for 16 A3 Mega nodes, and torchao reaching the nodes' environment.
The FSDP2 and TP layouts and the checkpoints between fp8 and bf16 runs: test_fp8_layouts.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

from tests.workloads.conftest import one_line_exit_2
from workloads.components.float8 import convert_to_fp8, fp8_refusal
from workloads.config import MODELS
from workloads.llama import Llama
from workloads.model import GPT
from workloads.plan import GiB, Layout, format_plan, plan

torchao = pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402


class _Odd(nn.Module):
    """Two blocks with a Linear whose dimensions are not multiples of 16, and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {str(i): nn.ModuleDict({"up": nn.Linear(32, 64), "odd": nn.Linear(64, 24)}) for i in range(2)}
        )
        self.output = nn.Linear(24, 48, bias=False)


def test_the_linears_are_converted_but_the_output_projection_and_odd_dims():
    llama = Llama(MODELS["llama3-debug"])
    summary = convert_to_fp8(llama, "rowwise", emulate=True, shard=False)
    assert summary.kept == [("output", "the output projection")]
    linears = {n: type(m) for n, m in llama.named_modules() if isinstance(m, nn.Linear)}
    assert linears.pop("output") is nn.Linear
    assert len(linears) == 14 and set(linears.values()) == {Float8Linear}
    assert sorted(summary.converted) == sorted(linears)

    odd = _Odd()
    summary = convert_to_fp8(odd, "tensorwise", emulate=True, shard=False)
    assert summary.converted == ["layers.0.up", "layers.1.up"]
    assert type(odd.layers["0"]["odd"]) is nn.Linear and type(odd.output) is nn.Linear
    line = summary.describe()
    assert "; 2 Linear layers converted; kept in bf16: layers.*.odd (64 x 24: not multiples of 16) x 2, " in line
    assert "output (the output projection)" in line and "emulated on CPU" in line and "for tests only" in line


def test_tensorwise_under_fsdp_wraps_the_weights_for_the_fp8_all_gather_and_rowwise_does_not():
    gpt = GPT(MODELS["tiny"])
    summary = convert_to_fp8(gpt, "tensorwise", emulate=True, shard=True)
    assert summary.precompute and summary.kept == [("lm_head", "the output projection")]
    assert isinstance(gpt.blocks["0"].attn.q.weight, WeightWithDynamicFloat8CastTensor)
    assert not isinstance(gpt.lm_head.weight, WeightWithDynamicFloat8CastTensor)
    assert "FSDP2 all-gathers the converted weights in fp8" in summary.describe()
    gpt = GPT(MODELS["tiny"])
    summary = convert_to_fp8(gpt, "rowwise", emulate=True, shard=True)
    assert not summary.precompute and not isinstance(gpt.blocks["0"].attn.q.weight, WeightWithDynamicFloat8CastTensor)
    assert "collectives in bf16" in summary.describe()


@pytest.mark.parametrize(
    "torch_version, torchao_version, capability, words",
    [
        (
            "2.13.0+cu130",
            "0.18.0",
            (8, 0),
            "needs FP8 tensor cores (SM 8.9 or newer: L4, H100, H200); this GPU "
            "(NVIDIA A100-SXM4-80GB) is SM 8.0; use --precision bf16",
        ),
        ("2.10.0", "0.18.0", (9, 0), "needs torch 2.11 or newer (torchao's floor), found 2.10.0"),
        ("2.13.0", None, (9, 0), "needs torchao, which is not installed; install gpufleet[workloads]"),
        ("2.13.0", "0.17.0", (9, 0), "needs torchao 0.18 or newer, found 0.17.0"),
    ],
)
def test_where_fp8_cannot_run_it_says_why_in_one_line(torch_version, torchao_version, capability, words):
    why = fp8_refusal(
        torch_version=torch_version,
        torchao_version=torchao_version,
        capability=capability,
        device_name="NVIDIA A100-SXM4-80GB",
    )
    assert why is not None and why.startswith("--precision fp8 ") and words in why and "\n" not in why


def test_fp8_runs_on_hopper_and_on_cpu_in_emulation():
    assert fp8_refusal(torch_version="2.13.0+cu130", torchao_version="0.18.0", capability=(9, 0)) is None
    assert fp8_refusal(torch_version="2.13.0+cpu", torchao_version="0.18.0", capability=None) is None


def test_an_old_torchao_is_refused_by_the_trainer_with_exit_2(tmp_path, monkeypatch):
    # An installed torchao 0.9's metadata ahead of the real one on the path: what the trainer reads.
    info = tmp_path / "torchao-0.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchao\nVersion: 0.9.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = one_line_exit_2(["--model", "tiny", "--precision", "fp8", "--steps", "1"])
    assert line == (
        "error: --precision fp8 needs torchao 0.18 or newer, found 0.9.0; install torchao>=0.18 "
        "(gpufleet[workloads] pins it) or use --precision bf16"
    )


def test_fp8_with_a_pipeline_is_refused_in_one_line():
    line = one_line_exit_2(
        ["--model", "tiny-4l", "--precision", "fp8", "--pp", "2", "--global-batch", "16"], env={"WORLD_SIZE": "2"}
    )
    assert line.startswith("error: --precision fp8 runs compiled (torch.compile fuses its float8 casts), and --pp 2")


def _train_here(argv: list[str]) -> str:
    """`python -m workloads.train ARGV` in this process (a world of one: no torchrun, and no
    second import of torch and torchao); its stdout."""
    from workloads.train import main

    out, term = io.StringIO(), signal.getsignal(signal.SIGTERM)  # main ignores SIGTERM while it runs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the suite's torchrun ranks run (conftest.child_env): no oversubscription
    try:
        with contextlib.redirect_stdout(out):
            rc = main(argv)
    finally:
        signal.signal(signal.SIGTERM, term)
        torch.set_num_threads(threads)
    assert rc == 0, out.getvalue()
    return out.getvalue()


def _last_loss(stdout: str, steps: int) -> float:
    m = re.search(rf"^step {steps}/{steps} \| loss ([0-9.]+)", stdout, re.M)
    assert m, stdout
    return float(m.group(1))


@pytest.mark.parametrize("model, recipe", [("tiny", "rowwise"), ("llama3-debug", "tensorwise")])
def test_fp8_loss_is_within_1_percent_of_bf16_after_30_steps(model, recipe):
    args = ["--model", model, "--steps", "30", "--micro-batch", "4", "--seq-len", "64", "--lr", "3e-3"]
    args += ["--warmup-steps", "3", "--log-every", "10", "--straggler-every", "0"]
    bf16 = _train_here([*args, "--precision", "bf16"])
    fp8 = _train_here([*args, "--precision", "fp8", "--fp8-recipe", recipe])
    start = float(re.search(r"^step 10/30 \| loss ([0-9.]+)", bf16, re.M).group(1))
    want, got = _last_loss(bf16, 30), _last_loss(fp8, 30)
    assert want < start  # it learned, so the comparison means something
    assert abs(got - want) <= 0.01 * want, (got, want)
    assert f"fp8: torchao {torchao.__version__} float8 {recipe}, emulated on CPU" in fp8
    assert re.search(r"\| MFU n/a \| [0-9.e-]+ TFLOP/s", fp8), fp8


def test_the_plan_names_fp8_and_what_it_changes():
    kw = dict(machine_type="a3-megagpu-8g", nodes=1, micro_batch=2, seq_len=256, precision="fp8")
    rowwise = plan("llama3-debug", Layout(dp_shard=8), fp8_recipe="rowwise", **kw)
    tensorwise = plan("llama3-debug", Layout(dp_shard=8), fp8_recipe="tensorwise", **kw)
    bf16 = plan("llama3-debug", Layout(dp_shard=8), **{**kw, "precision": "bf16"}, compile=True)
    # fp8 runs compiled without --compile; rowwise gathers bf16 weights like bf16 does, tensorwise
    # one byte for each of a layer's matmul weights (llama3-debug's largest FSDP unit is a layer).
    assert tensorwise.compiled and rowwise.compiled and rowwise.buffers == bf16.buffers
    size = MODELS["llama3-debug"]
    assert rowwise.buffers - tensorwise.buffers == 2 * (size.layer_params - 2 * size.dim)
    assert rowwise.activations == bf16.activations
    lines = format_plan(tensorwise)
    assert lines[1].startswith("mode: compiled (") and lines[1].endswith(
        "; fp8 tensorwise, compiled on GPUs with or without --compile"
    )
    assert lines[2].startswith("fp8: FSDP2 all-gathers the converted weights in fp8 (1 byte, not 2: working buffers)")
    assert "fp8 rowwise Linear matmuls" in format_plan(rowwise)[0]


def test_the_smallest_change_may_be_fp8_on_an_h100_but_not_on_an_a100():
    kw = dict(nodes=1, micro_batch=8, seq_len=5120, compile=True)
    h100 = plan("llama3-1b", Layout(), machine_type="a3-highgpu-1g", **kw)
    assert not h100.fits and h100.suggestion.change == "--precision fp8 --fp8-recipe tensorwise"
    assert h100.suggestion.plan.fits and h100.total - h100.suggestion.plan.total < 1 * GiB
    assert "fp8 tensorwise: step time not measured yet" in h100.suggestion.cost
    a100 = plan("llama3-1b", Layout(), machine_type="a2-ultragpu-1g", **kw)
    assert a100.suggestion is not None and "fp8" not in a100.suggestion.change


def test_launch_train_fp8_on_16_a3_mega_nodes_plans_and_dry_runs(tmp_path):
    from launcher.cli import main

    nodes = [{"name": f"mega-{i}", "index": i, "internalIp": f"10.0.0.{10 + i}", "externalIp": None} for i in range(16)]
    outputs = tmp_path / "outputs.json"
    outputs.write_text(
        json.dumps(
            {"cluster": "mega", "project": "p", "zone": "us-central1-a", "machineType": "a3-megagpu-8g", "nodes": nodes}
        )
    )
    argv = ["train", "--outputs", str(outputs), "--runs-dir", str(tmp_path / "runs"), "--dry-run=json", "--"]
    argv += ["--model", "llama3-8b", "--precision", "fp8", "--compile", "--parallelism", "fsdp"]
    r = CliRunner().invoke(main, argv, env={"GPUFLEET_STATE_DIR": str(tmp_path / "state")})
    assert r.exit_code == 0, r.output
    from tests.launcher import dry_runs

    plans = dry_runs.plans(r.stdout)
    assert [p.host for p in plans] == [f"10.0.0.{10 + i}" for i in range(16)]
    for i, (p, argv) in enumerate(zip(plans, dry_runs.started(r.stdout))):
        c = p.command
        assert "--nnodes=16" in c and f"--node-rank={i}" in c and "--nproc-per-node=8" in c, c
        assert c[-7:] == ("--model", "llama3-8b", "--precision", "fp8", "--compile", "--parallelism", "fsdp")
        assert "workloads.train --model llama3-8b --precision fp8 --compile --parallelism fsdp" in " ".join(argv)
    # The plan, after the one line that says how the launch would reach the nodes (IAP here).
    plan_lines = [line for line in r.stderr.splitlines() if "IAP tunnel" not in line]
    assert plan_lines[0].startswith("model llama3-8b: 8.03B parameters; micro-batch 4 x seq 8192; fp8 rowwise")
    assert plan_lines[1].endswith("; fp8 rowwise, compiled on GPUs with or without --compile")
    assert plan_lines[2].startswith("fp8: FSDP2 all-gathers in bf16 (torchao's fp8 all-gather is tensorwise only)")
    assert "mesh: pp 1 x dp_replicate 1 x dp_shard 128 x tp 1 = 128 ranks on 16 nodes, tp innermost; " in r.stderr
    assert "per GPU (16 x a3-megagpu-8g, H100 80GB Mega), at the start of backward:" in plan_lines
    assert "  smallest change that fits: --activation-checkpointing -> " in r.stderr


def test_torchao_is_pinned_in_the_environment_the_nodes_build():
    from launcher.code.pyenv import workloads_requirements

    assert "torchao==0.18.0" in workloads_requirements().split()
    assert torchao.__version__ == "0.18.0"  # and it is the one these tests ran against


def test_a_checkpoint_state_of_an_fp8_run_holds_plain_tensors():
    from workloads.components.float8 import high_precision_state

    gpt = GPT(MODELS["tiny"])
    convert_to_fp8(gpt, "tensorwise", emulate=True, shard=True)
    wrapped = gpt.state_dict()
    assert isinstance(wrapped["blocks.0.attn.q.weight"], WeightWithDynamicFloat8CastTensor)
    plain = high_precision_state({"model": wrapped})["model"]
    assert all(type(t) is torch.Tensor for t in plain.values())
    assert torch.equal(plain["blocks.0.attn.q.weight"], wrapped["blocks.0.attn.q.weight"]._tensor)
