"""The memory plan against hand arithmetic, its verdicts and the smallest fix it suggests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workloads.config import MODEL_SIZES
from workloads.plan import GiB, Layout, PlanError, format_plan, mesh_lines, plan

A3_MEGA = "a3-megagpu-8g"  # 8 x H100 80GB: the catalog's memory_gb 80 -> 80 GiB


def _70b(nodes: int, layout: Layout, **kw):
    return plan("llama3-70b", layout, machine_type=A3_MEGA, nodes=nodes, micro_batch=1, seq_len=8192, **kw)


def test_70b_on_16_a3_mega_nodes_at_tp8_dp_shard16_fits_with_checkpointing_by_hand():
    p = _70b(16, Layout(dp_shard=16, tp=8), activation_checkpointing=True)
    # N = 70,553,706,496 over tp 8 x dp_shard 16 = 128 ranks: 551,200,832 each.
    # fp32 weights 4 B, fp32 gradients 4 B, AdamW exp_avg + exp_avg_sq 8 B.
    assert p.params == p.grads == 4 * 551_200_832 == 2_204_803_328
    assert p.optimizer == 8 * 551_200_832
    # FSDP unit: the largest of a layer (855,654,400), the embedding (128256 x 8192 = 1,050,673,152)
    # and norm + output (1,050,681,344), over tp 8 = 131,335,168 params; two gathered in bf16 (2 B)
    # and one fp32 gradient (4 B): 8 B each.
    assert p.buffers == 8 * 131_335_168
    # One layer, b 1, s 8192, h 8192, f 28672, 64 heads, 8 KV heads, tp 8, bf16 (2 B):
    #   norm inputs 2sbh + linear inputs 2sbh = 268,435,456 elements (not split by tp)
    #   q + out 2sbh + k, v 2sbh x 8/64 = 2.25 sbh = 150,994,944; SwiGLU 4sbf = 939,524,096; both / 8
    #   -> (268,435,456 + 136,314,880) x 2 B = 809,500,672, + log-sum-exp 4 x 8 heads x 8192 = 262,144
    #   + the two RMSNorms' fp32 rstd, 2 x 4 x 8192 = 65,536
    layer = 809_828_352
    # After the layers: final norm and output inputs 2sbh x 2 B = 268,435,456, logits at the loss
    # 10 x s x V = 10 x 8192 x 128256 = 10,506,731,520.
    head = 268_435_456 + 10_506_731_520
    assert p.activations_full == 80 * layer + head == 75_561_435_136  # 70.4 GiB
    # Checkpointed: each layer keeps its input (sbh x 2 B = 134,217,728), one layer recomputed.
    assert p.activations_checkpointed == 80 * 134_217_728 + layer + head == 22_322_413_568  # 20.8 GiB
    total = 2 * 2_204_803_328 + 4_409_606_656 + 1_050_681_344 + 22_322_413_568 + 2 * GiB
    assert p.total == total == 34_339_791_872  # 31.98 GiB
    assert p.capacity == 80 * GiB
    assert p.fits and p.verdict == "fits (32.0 of 80 GiB)" and p.suggestion is None


def test_without_checkpointing_the_same_layout_misses_and_checkpointing_is_the_fix():
    p = _70b(16, Layout(dp_shard=16, tp=8))
    # 8.21 GiB of states + 0.98 buffers + 70.37 activations + 2 reserved = 81.56 GiB of 80.
    assert not p.fits
    assert p.verdict == "does not fit by 1.6 GiB"
    assert p.suggestion.change == "--activation-checkpointing"
    assert p.suggestion.plan.layout == Layout(dp_shard=16, tp=8) and p.suggestion.plan.fits


def test_70b_on_one_node_does_not_fit_at_any_layout_and_the_plan_asks_for_4_nodes():
    p = _70b(1, Layout(tp=8))
    # 16 B x 70,553,706,496 / 8 = 141.1e9 B = 131.4 GiB of weights, gradients and AdamW states per
    # GPU before a single activation: no layout of 8 GPUs shards them further than 8 ways.
    assert p.params + p.grads + p.optimizer == 16 * 70_553_706_496 / 8
    assert p.verdict.startswith("does not fit by 14")
    # 2 nodes: 65.7 GiB of states + 20.8 checkpointed activations > 80. 4 nodes: 32.9 + 20.8 + ...
    fix = p.suggestion
    assert fix.change == "--nodes 4 --dp-shard 4 --activation-checkpointing"
    assert fix.plan.layout == Layout(dp_shard=4, tp=8) and fix.plan.nodes == 4 and fix.plan.fits
    assert not _70b(2, Layout(dp_shard=2, tp=8), activation_checkpointing=True).fits


def test_the_search_reaches_for_tensor_parallelism_within_the_node():
    """8B at micro-batch 5 with checkpointing and sequence parallel: the states are sharded 8 ways
    already, the activations are the problem, and tp 2 (from dp_shard) splits them."""
    p = plan(
        "llama3-8b",
        Layout(dp_shard=8),
        machine_type=A3_MEGA,
        nodes=1,
        micro_batch=5,
        seq_len=8192,
        activation_checkpointing=True,
        sequence_parallel=True,
    )
    assert p.verdict == "does not fit by 6.8 GiB"
    assert p.suggestion.change == "--dp-shard 4 --tp 2"
    assert p.suggestion.plan.layout == Layout(dp_shard=4, tp=2) and p.suggestion.plan.fits


def test_when_no_layout_fits_the_plan_says_to_shrink_the_micro_batch():
    """8B at micro-batch 8: the logits alone (10 x 8 x 8192 x 128256 B = 78.3 GiB, not split by
    tp without loss parallel) fill an H100, at any node count."""
    p = plan("llama3-8b", Layout(dp_shard=8), machine_type=A3_MEGA, nodes=1, micro_batch=8, seq_len=8192)
    assert p.suggestion is None
    assert "  nothing fits up to 256 nodes: lower --micro-batch or --seq-len" in format_plan(p)


def test_shard_more_before_growing_the_model_parallel_dimensions():
    """GPT 1.3B replicated 8 ways on A100 40GB: the first fitting move is to shard a replica
    dimension (checkpointing too, at micro-batch 16)."""
    p = plan("1.3B", Layout(dp_replicate=8), machine_type="a2-highgpu-8g", nodes=1, micro_batch=16, seq_len=2048)
    assert p.capacity == 40 * GiB and not p.fits
    assert p.suggestion.change == "--dp-replicate 4 --dp-shard 2 --activation-checkpointing"


def test_the_gpu_memory_comes_from_the_catalog():
    p = plan("llama3-8b", Layout(dp_shard=8), machine_type="a3-ultragpu-8g", nodes=1, micro_batch=1, seq_len=8192)
    assert p.capacity == 141 * GiB and p.gpu == "H200"


def test_pipeline_stages_split_the_weights_but_the_first_stage_holds_pp_micro_batches():
    one = _70b(16, Layout(dp_shard=16, tp=8), activation_checkpointing=True)
    two = _70b(16, Layout(dp_shard=8, tp=8, pp=2), activation_checkpointing=True)
    # pp 2 halves the layers per GPU but dp_shard 8 doubles each shard: states barely move (the
    # stage holds 40 layers + one 1.05e9 table instead of 80 layers + two).
    stage = 40 * 855_654_400 + 1_050_681_344
    assert two.params == 4 * stage / (8 * 8)
    # 1F1B: stage 0 keeps 2 micro-batches x 40 layers of inputs; the last stage 40 and the head.
    layer_in = 134_217_728
    assert two.activations_checkpointed == max(
        2 * 40 * layer_in + 809_828_352, 40 * layer_in + 809_828_352 + 268_435_456 + 10_506_731_520
    )
    assert two.activations_checkpointed < one.activations_checkpointed


def test_gpipe_keeps_every_micro_batch_and_interleaving_keeps_half_a_round_more():
    def act(schedule: str) -> float:
        return _70b(
            16, Layout(dp_shard=8, tp=8, pp=2), pp_schedule=schedule, pp_microbatches=8, activation_checkpointing=True
        ).activations_checkpointed

    layer_in, layer, head = 134_217_728, 809_828_352, 268_435_456 + 10_506_731_520
    # GPipe: 8 micro-batches forward before any backward, on both ranks; the last also 8 heads.
    assert act("gpipe") == max(8 * 40 * layer_in + layer, 8 * (40 * layer_in + head) + layer)
    # 1F1B: min(pp 2, 8) on the first rank; interleaved: pp + (pp - 1) / 2 = 2.5.
    assert act("1f1b") == max(2 * 40 * layer_in + layer, 40 * layer_in + head + layer)
    assert act("interleaved-1f1b") == max(2.5 * 40 * layer_in + layer, 40 * layer_in + head + layer)
    text = "\n".join(format_plan(_70b(16, Layout(dp_shard=8, tp=8, pp=2), pp_schedule="gpipe", pp_microbatches=8)))
    assert "pipeline gpipe, 8 micro-batches a step" in text
    with pytest.raises(PlanError, match="--pp-schedule 'zb' is unknown; one of: gpipe, 1f1b, interleaved-1f1b"):
        _70b(16, Layout(dp_shard=8, tp=8, pp=2), pp_schedule="zb")


def test_sequence_parallel_splits_the_norm_inputs_too():
    base = _70b(16, Layout(dp_shard=16, tp=8))
    sp = _70b(16, Layout(dp_shard=16, tp=8), sequence_parallel=True)
    # Per layer the two norm inputs (2sbh x 2 B = 268,435,456) and their rstd (65,536) shrink to 1/8.
    assert base.activations_full - sp.activations_full == 80 * (268_435_456 + 65_536) * 7 / 8


def test_loss_parallel_splits_the_logits_across_tp():
    base = _70b(16, Layout(dp_shard=16, tp=8))
    lp = _70b(16, Layout(dp_shard=16, tp=8), loss_parallel=True)
    assert base.activations_full - lp.activations_full == 10_506_731_520 * 7 / 8


def test_an_unknown_machine_type_is_a_plan_error_naming_the_flag():
    with pytest.raises(PlanError, match="--machine-type: machine type 'a9-huge' is unknown; one of: a2-highgpu-1g"):
        plan("llama3-8b", Layout(dp_shard=8), machine_type="a9-huge", nodes=1, micro_batch=1, seq_len=64)


def test_fp32_doubles_the_16_bit_activations_and_drops_the_bf16_weight_copies_ddp_keeps_buckets():
    kw = dict(machine_type=A3_MEGA, nodes=1, micro_batch=1, seq_len=1024)
    bf16 = plan("124M", Layout(dp_replicate=8), **kw)
    fp32 = plan("124M", Layout(dp_replicate=8), precision="fp32", **kw)
    assert fp32.params == bf16.params and fp32.optimizer == bf16.optimizer
    # DDP: its fp32 all-reduce buckets (4 B a parameter), and under bf16 autocast's copies (2 B).
    assert bf16.buffers == 6 * bf16.n_params and fp32.buffers == 4 * fp32.n_params
    # A GPT-2 layer: 32sbh bytes in bf16 (Korthikanti's 34sbh less two dropout masks), the fp32
    # log-sum-exp 4asb and the two LayerNorms' fp32 mean and rstd 16sb.
    sb = 1024
    sbh, asb, head = sb * 768, 12 * sb, 2 * 2 * sb * 768
    assert bf16.activations_full == 12 * (32 * sbh + 4 * asb + 16 * sb) + head + 10 * sb * 50304
    # fp32: twice the 16-bit tensors; the logits need no fp32 copy (8sbV, not 10).
    assert fp32.activations_full == 12 * (64 * sbh + 4 * asb + 16 * sb) + 2 * head + 8 * sb * 50304


def test_the_layer_formula_is_what_autograd_keeps_for_a_llama_block():
    """Count the bytes autograd saves for backward in one block of llama3-debug (fp32, CPU): every
    saved tensor's storage once, weights and the RoPE table aside. It is the plan's per-layer
    figure plus one sbh per norm: on CPU RMSNorm is composite and its last multiply keeps x·rstd
    for the weight's gradient, where CUDA's fused kernel (aten._fused_rms_norm, whose backward
    takes input, rstd and weight) keeps only the input and rstd the plan counts."""
    torch = pytest.importorskip("torch")
    from workloads.llama import Llama
    from workloads.llama_sizes import LLAMA_SIZES

    size, b, s = LLAMA_SIZES["llama3-debug"], 2, 128
    p = plan(
        "llama3-debug",
        Layout(),
        machine_type=A3_MEGA,
        nodes=1,
        gpus_per_node=1,
        micro_batch=b,
        seq_len=s,
        precision="fp32",
    )
    head = 4 * 2 * b * s * size.dim + 8 * b * s * size.vocab_size
    layer = (p.activations_full - head) / size.n_layers

    torch.manual_seed(0)
    model = Llama(size)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), model.rope]}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(b, s, size.dim, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["0"](x, model.rope)
    assert sum(saved.values()) == layer + 2 * 4 * b * s * size.dim


@pytest.mark.parametrize("name", ["tiny", "small-test"])
def test_the_gpt_count_matches_the_built_model(name):
    torch = pytest.importorskip("torch")
    from workloads.model import GPT

    torch.manual_seed(0)
    p = plan(name, Layout(), machine_type=A3_MEGA, nodes=1, gpus_per_node=1, micro_batch=1, seq_len=8)
    assert p.n_params == GPT(MODEL_SIZES[name]).num_params(non_embedding=False)


def test_the_mesh_puts_tp_inside_a_node_and_says_which_groups_cross_nodes():
    lines = mesh_lines(Layout(dp_replicate=2, dp_shard=8, tp=8), nodes=16, gpus=8)
    assert lines[0] == (
        "mesh: pp 1 x dp_replicate 2 x dp_shard 8 x tp 8 = 128 ranks on 16 nodes, tp innermost; "
        "node k holds ranks 8k..8k+7"
    )
    assert lines[1] == "  tp 8: ranks 0-7 form one group, within node 0"
    assert lines[2] == "  dp_shard 8: ranks 0,8,...,56 form one group, across 8 nodes"
    assert lines[3] == "  dp_replicate 2: ranks 0,64 form one group, across 2 nodes"
    wide = mesh_lines(Layout(dp_shard=2, tp=16), nodes=4, gpus=8)
    assert "  warning: tp 16 > 8 GPUs per node: its all-reduces cross the network" in wide


def test_the_formatted_plan_shows_each_part_and_the_verdict():
    lines = format_plan(_70b(16, Layout(dp_shard=16, tp=8)))
    text = "\n".join(lines)
    assert lines[0].startswith("model llama3-70b: 70.55B parameters; micro-batch 1 x seq 8192")
    assert "  parameters           2.05 GiB" in lines
    assert "  activations         70.37 GiB without checkpointing (used)" in lines
    assert "                      20.79 GiB with activation checkpointing" in lines
    assert "verdict: does not fit by 1.6 GiB" in lines
    assert "smallest change that fits: --activation-checkpointing" in text and "fits (32.0 of 80 GiB)" in text


def test_dp_shard_minus_one_takes_the_rest():
    assert _70b(16, Layout(dp_shard=-1, tp=8), activation_checkpointing=True).layout == Layout(dp_shard=16, tp=8)


@pytest.mark.parametrize(
    "model, layout, nodes, gpus, message",
    [
        (
            "llama3-8b",
            Layout(dp_replicate=1, dp_shard=2, tp=2, pp=2),
            2,
            8,
            "dp_replicate(1) x dp_shard(2) x tp(2) x pp(2) = 8 != world size 16 (2 nodes x 8 GPUs)",
        ),
        ("llama3-8b", Layout(dp_shard=4, tp=3), 1, 12, "--tp 3 does not divide model llama3-8b's 32 heads and 8 KV"),
        ("llama3-debug", Layout(dp_shard=2, pp=4), 1, 8, "--pp 4 is more than model llama3-debug's 2 layers"),
        ("llama3-400b", Layout(dp_shard=8), 1, 8, "--model 'llama3-400b' is unknown; one of: tiny, "),
        ("llama3-8b", Layout(dp_shard=-1, tp=3), 1, 8, "--dp-shard -1 takes the ranks left by"),
    ],
)
def test_a_layout_that_cannot_run_is_refused_with_the_arithmetic(model, layout, nodes, gpus, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(model, layout, machine_type=A3_MEGA, nodes=nodes, gpus_per_node=gpus, micro_batch=1, seq_len=64)


def test_plan_module_does_not_import_torch():
    code = "import sys, workloads.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
