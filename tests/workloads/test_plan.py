"""The memory plan against hand arithmetic, its verdicts and the smallest fix it suggests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workloads.config import MODEL_SIZES
from workloads.plan import GiB, Layout, PlanError, format_plan, head_tensors, layer_tensors, mesh_lines, plan

A3_MEGA = "a3-megagpu-8g"  # 8 x H100 80GB: the catalog's memory_gb 80 -> 80 GiB


def _70b(nodes: int, layout: Layout, **kw):
    return plan("llama3-70b", layout, machine_type=A3_MEGA, nodes=nodes, micro_batch=1, seq_len=8192, **kw)


# Measured on one lent NVIDIA H200 (torch 2.11.0+cu130, driver 580.159.04) by an earlier session,
# main at a42d604: llama3-1b, micro-batch 4, seq 2048, bf16, one rank through
# `launch train --local --nodes 1`; torch.cuda.max_memory_allocated after 15-40 steps, in GiB
# (bench/RESULTS.md, bench/gpu_checks.sh). The plan's total less its reserve is the comparable figure.
H200_PEAK_GIB = {"eager": 41.78, "checkpointed": 27.20, "compiled": 28.96}


@pytest.mark.parametrize("mode", sorted(H200_PEAK_GIB))
def test_the_plan_is_within_10_percent_of_the_peaks_measured_on_an_h200(mode):
    p = plan(
        "llama3-1b",
        Layout(),
        machine_type="a3-ultragpu-8g",
        nodes=1,
        gpus_per_node=1,
        micro_batch=4,
        seq_len=2048,
        compile=mode == "compiled",
        activation_checkpointing=mode == "checkpointed",
    )
    assert p.mode == mode
    planned = (p.total - p.reserved) / GiB
    assert abs(planned / H200_PEAK_GIB[mode] - 1) < 0.10, (mode, planned)


def test_the_llama3_1b_peaks_by_hand():
    """One rank, no FSDP: fp32 weights under autocast, so the residual stream is fp32 and the
    peak is at the start of backward, before any gradient exists."""
    kw = dict(machine_type="a3-ultragpu-8g", nodes=1, gpus_per_node=1, micro_batch=4, seq_len=2048)
    eager = plan("llama3-1b", Layout(), **kw)
    n = eager.n_params
    assert eager.params == 4 * n and eager.optimizer == 8 * n and not eager.grads_at_peak
    # autocast's bf16 copies of every matmul weight: 16 layers and the tied output table.
    assert eager.buffers == 2 * (16 * (60_821_504 - 2 * 2048) + 128256 * 2048)
    sbh, sbf, sbv = 4 * 2048 * 2048, 4 * 2048 * 8192, 4 * 2048 * 128256
    # Eager layer, bytes: fp32 norm inputs 2 x 4sbh; five bf16 casts of the normed inputs (wq, wk,
    # wv; w1, w3) 5 x 2sbh; q 2sbh, k and v 2 x 2sbh/4, attention out 2sbh; SwiGLU 4 x 2sbf; the
    # log-sum-exp 4 x 32 heads x sb; two rstd 2 x 4sb.
    layer = 8 * sbh + 10 * sbh + 2 * sbh + sbh + 2 * sbh + 8 * sbf + 4 * 32 * 8192 + 8 * 8192
    assert eager.layer == layer  # 55 sbh and the small terms
    # The head: final norm input fp32 4sbh, its rstd, the output's bf16 input 2sbh; at the
    # log-softmax's backward its output, its gradient and the logits' fp32 gradient: 12 sbV.
    head = 4 * sbh + 4 * 8192 + 2 * sbh + 12 * sbv
    assert eager.activations == 16 * layer + head
    # Compiled: one bf16 cast per norm, SwiGLU keeps 3 sbf; the loss keeps the bf16 logits (their
    # gradient written in place) and the output weight's bf16 gradient while they live.
    compiled = plan("llama3-1b", Layout(), compile=True, **kw)
    c_layer = layer - 6 * sbh - 2 * sbf
    c_head = 4 * sbh + 4 * 8192 + 2 * sbh + 2 * sbv + 8 * 8192 + 2 * 128256 * 2048
    assert compiled.layer == c_layer and compiled.activations == 16 * c_layer + c_head
    assert compiled.buffers == eager.buffers
    # Checkpointed: each layer keeps its fp32 input; the loss's peak is larger than a recomputed
    # layer; only the output's bf16 copy and the recomputed layer's outlive forward.
    ac = plan("llama3-1b", Layout(), activation_checkpointing=True, **kw)
    assert ac.activations == 16 * 4 * sbh + head
    assert ac.buffers == 2 * (60_821_504 - 2 * 2048 + 128256 * 2048)
    for p in (eager, compiled, ac):
        assert p.total == p.params + p.optimizer + p.buffers + p.activations + p.reserved


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
    # One layer, b 1, s 8192, h 8192, f 28672, 64 heads, 8 KV heads, tp 8, FSDP's bf16 weights (so
    # a bf16 residual stream and no autocast copies), 2 B:
    #   norm inputs 2sbh + linear inputs 2sbh = 268,435,456 elements (not split by tp)
    #   q + out 2sbh + k, v 2sbh x 8/64 = 2.25 sbh = 150,994,944; SwiGLU 4sbf = 939,524,096; both / 8
    #   -> (268,435,456 + 136,314,880) x 2 B = 809,500,672, + log-sum-exp 4 x 8 heads x 8192 = 262,144
    #   + the two RMSNorms' fp32 rstd, 2 x 4 x 8192 = 65,536
    layer = 809_828_352
    assert p.layer == layer
    # After the layers: final norm and output inputs 2sbh x 2 B = 268,435,456 and the rstd 32,768;
    # the loss's peak in backward 12 x s x V = 12 x 8192 x 128256 = 12,608,077,824.
    head = 268_435_456 + 32_768 + 12_608_077_824
    # Checkpointed: each layer keeps its input (sbh x 2 B = 134,217,728); the loss's peak is larger
    # than one recomputed layer.
    assert p.activations == 80 * 134_217_728 + head == 23_613_964_288  # 22.0 GiB
    # The gradients are made in backward, after the peak (one step, no accumulation).
    total = 2_204_803_328 + 4_409_606_656 + 1_050_681_344 + 23_613_964_288 + 2 * GiB
    assert p.total == total == 33_426_539_264  # 31.13 GiB
    assert p.capacity == 80 * GiB
    assert p.fits and p.verdict == "fits (31.1 of 80 GiB)" and p.suggestion is None
    assert _70b(16, Layout(dp_shard=16, tp=8)).activations == 80 * layer + head


def test_without_checkpointing_the_same_layout_misses_and_compiling_is_the_fix():
    p = _70b(16, Layout(dp_shard=16, tp=8))
    # 6.16 GiB of weights and AdamW states + 0.98 buffers + 72.33 activations + 2 reserved = 81.47.
    assert not p.fits
    assert p.verdict == "does not fit by 1.5 GiB"
    # --compile is tried first: it keeps 3 of SwiGLU's 4 f-wide tensors and the bf16 logits alone.
    assert p.suggestion.change == "--compile"
    assert p.suggestion.plan.layout == Layout(dp_shard=16, tp=8) and p.suggestion.plan.fits
    assert p.suggestion.plan.layer == 809_828_352 - 2 * 8192 * 28672 // 8
    assert p.suggestion.cost == "compiled: 0.77x the step time (measured: 132 vs 172 ms, llama3-1b on one H200)"


def test_70b_on_one_node_does_not_fit_at_any_layout_and_the_plan_asks_for_2_nodes():
    p = _70b(1, Layout(tp=8))
    # 12 B x 70,553,706,496 / 8 = 105.8e9 B = 98.6 GiB of weights and AdamW states per GPU before
    # a single activation: no layout of 8 GPUs shards them further than 8 ways.
    assert p.params + p.optimizer == 12 * 70_553_706_496 / 8
    assert p.verdict.startswith("does not fit by 159")
    # 2 nodes: 49.3 GiB of weights and states + 22 GiB checkpointed activations + buffers < 80.
    fix = p.suggestion
    assert fix.change == "--nodes 2 --dp-shard 2 --activation-checkpointing"
    assert fix.plan.layout == Layout(dp_shard=2, tp=8) and fix.plan.nodes == 2 and fix.plan.fits
    assert fix.cost == (
        "checkpointed: 1.20x the step time (measured: 206 vs 172 ms, llama3-1b on one H200); "
        "the new layout's communication: not estimated"
    )
    assert not _70b(2, Layout(dp_shard=2, tp=8), compile=True).fits


def test_the_search_reaches_for_tensor_parallelism_within_the_node():
    """8B compiled and checkpointed with sequence parallel at micro-batch 16: the states are
    sharded 8 ways already, the activations are the problem, and tp 2 (from dp_shard) splits them."""
    p = plan(
        "llama3-8b",
        Layout(dp_shard=8),
        machine_type=A3_MEGA,
        nodes=1,
        micro_batch=16,
        seq_len=8192,
        compile=True,
        activation_checkpointing=True,
        sequence_parallel=True,
    )
    assert p.mode == "compiled+checkpointed" and not p.fits
    assert p.suggestion.change == "--dp-shard 4 --tp 2"
    assert p.suggestion.plan.layout == Layout(dp_shard=4, tp=2) and p.suggestion.plan.fits
    assert p.suggestion.cost == "the new layout's communication: not estimated"


def test_when_no_layout_fits_the_plan_says_to_shrink_the_micro_batch():
    """8B at micro-batch 48, compiled: the bf16 logits alone (2 x 48 x 8192 x 128256 B = 93.9 GiB,
    not split by tp without loss parallel) fill an H100, at any node count."""
    p = plan("llama3-8b", Layout(dp_shard=8), machine_type=A3_MEGA, nodes=1, micro_batch=48, seq_len=8192)
    assert p.suggestion is None
    assert "  nothing fits up to 256 nodes: lower --micro-batch or --seq-len" in format_plan(p)


def test_compile_is_tried_before_checkpointing_and_sharding():
    """GPT 1.3B replicated 8 ways on A100 40GB at micro-batch 16: compiling and checkpointing
    together fit without sharding; already compiled, checkpointing is the one move left."""
    kw = dict(machine_type="a2-highgpu-8g", nodes=1, micro_batch=16, seq_len=2048)
    p = plan("1.3B", Layout(dp_replicate=8), **kw)
    assert p.capacity == 40 * GiB and not p.fits
    assert p.suggestion.change == "--compile --activation-checkpointing"
    assert p.suggestion.cost == "compiled+checkpointed: step time not measured"
    compiled = plan("1.3B", Layout(dp_replicate=8), compile=True, **kw)
    assert compiled.suggestion.change == "--activation-checkpointing"


def test_a_pipeline_is_not_compiled_and_the_plan_says_so():
    p = _70b(16, Layout(dp_shard=8, tp=8, pp=2), compile=True)
    assert not p.compiled and p.mode == "eager" and [m for m, _ in p.by_mode] == ["eager", "checkpointed"]
    assert "mode: eager (autograd keeps what each op saves); a pipeline runs uncompiled" in format_plan(p)
    assert "--compile" not in (p.suggestion.change if p.suggestion else "")


def test_accumulated_gradients_are_held_at_the_peak():
    one = _70b(16, Layout(dp_shard=16, tp=8), activation_checkpointing=True)
    four = _70b(16, Layout(dp_shard=16, tp=8), activation_checkpointing=True, grad_accum=4)
    assert four.total - one.total == one.grads == 2_204_803_328
    assert "(held at the peak: earlier micro-batches of the step made them)" in "\n".join(format_plan(four))


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
    layer_in, layer, head = 134_217_728, 809_828_352, 268_435_456 + 32_768 + 12_608_077_824
    assert two.activations == max(2 * 40 * layer_in + layer, 40 * layer_in + head)
    assert two.activations < one.activations
    # The pipeline's micro-batches accumulate gradients: they are held at the peak.
    assert (
        two.grads_at_peak
        and two.total == two.params + two.optimizer + two.grads + two.buffers + two.activations + two.reserved
    )


def test_gpipe_keeps_every_micro_batch_and_interleaving_keeps_half_a_round_more():
    def act(schedule: str) -> float:
        return _70b(
            16, Layout(dp_shard=8, tp=8, pp=2), pp_schedule=schedule, pp_microbatches=8, activation_checkpointing=True
        ).activations

    layer_in, layer, head = 134_217_728, 809_828_352, 268_435_456 + 32_768 + 12_608_077_824
    # GPipe: 8 micro-batches forward before any backward, on both ranks; the last also the head.
    assert act("gpipe") == max(8 * 40 * layer_in + layer, 8 * 40 * layer_in + head)
    # 1F1B: min(pp 2, 8) on the first rank; interleaved: pp + (pp - 1) / 2 = 2.5.
    assert act("1f1b") == max(2 * 40 * layer_in + layer, 40 * layer_in + head)
    assert act("interleaved-1f1b") == max(2.5 * 40 * layer_in + layer, 40 * layer_in + head)
    text = "\n".join(format_plan(_70b(16, Layout(dp_shard=8, tp=8, pp=2), pp_schedule="gpipe", pp_microbatches=8)))
    assert "pipeline gpipe, 8 micro-batches a step" in text
    with pytest.raises(PlanError, match="--pp-schedule 'zb' is unknown; one of: gpipe, 1f1b, interleaved-1f1b"):
        _70b(16, Layout(dp_shard=8, tp=8, pp=2), pp_schedule="zb")


def test_sequence_parallel_splits_the_norm_inputs_too():
    base = _70b(16, Layout(dp_shard=16, tp=8))
    sp = _70b(16, Layout(dp_shard=16, tp=8), sequence_parallel=True)
    # Per layer the two norm inputs (2sbh x 2 B = 268,435,456) and their rstd (65,536) shrink to 1/8.
    assert base.activations - sp.activations == 80 * (268_435_456 + 65_536) * 7 / 8


def test_loss_parallel_splits_the_logits_across_tp():
    base = _70b(16, Layout(dp_shard=16, tp=8))
    lp = _70b(16, Layout(dp_shard=16, tp=8), loss_parallel=True)
    assert base.activations - lp.activations == 12_608_077_824 * 7 / 8


def test_an_unknown_machine_type_is_a_plan_error_naming_the_flag():
    with pytest.raises(PlanError, match="--machine-type: machine type 'a9-huge' is unknown; one of: a2-highgpu-1g"):
        plan("llama3-8b", Layout(dp_shard=8), machine_type="a9-huge", nodes=1, micro_batch=1, seq_len=64)


def test_fp32_doubles_the_16_bit_activations_and_drops_the_bf16_weight_copies_ddp_keeps_buckets():
    kw = dict(machine_type=A3_MEGA, nodes=1, micro_batch=1, seq_len=1024)
    bf16 = plan("124M", Layout(dp_replicate=8), **kw)
    fp32 = plan("124M", Layout(dp_replicate=8), precision="fp32", **kw)
    assert fp32.params == bf16.params and fp32.optimizer == bf16.optimizer
    # DDP: its fp32 all-reduce buckets (4 B a parameter), and under bf16 autocast's copies (2 B) of
    # the matmul weights and biases: 12 layers (12c² + 13c each, less the LayerNorms' 4c) and the
    # tied output table.
    layer_params = 12 * 768 * 768 + 13 * 768 - 4 * 768
    assert bf16.buffers == 4 * bf16.n_params + 2 * (12 * layer_params + 50304 * 768)
    assert fp32.buffers == 4 * fp32.n_params
    # A GPT-2 layer under autocast with fp32 weights: the fp32 residual at both LayerNorms 8sbh, the
    # bf16 casts of their outputs for q, k, v and fc1 8sbh, q, k, v 6sbh, attention out 2sbh, GELU
    # in and out 2 x 2sbf = 16sbh: 40sbh; the fp32 log-sum-exp 4asb and LayerNorm mean and rstd 16sb.
    sb = 1024
    sbh, asb, sbv = sb * 768, 12 * sb, sb * 50304
    head = 6 * sbh + 8 * sb + 12 * sbv
    assert bf16.activations == 12 * (40 * sbh + 4 * asb + 16 * sb) + head
    # fp32: one normed input per LayerNorm (no casts), every tensor 4 B: 64sbh.
    assert fp32.activations == 12 * (64 * sbh + 4 * asb + 16 * sb) + 8 * sbh + 8 * sb + 12 * sbv


def _saved_storages(module, *args, skip=(), autocast=True):
    """The storages autograd saves for backward in one forward of `module` (eager, CPU): bytes of
    each storage once, and of the bf16 weight copies (autocast's) apart; parameters and `skip`
    aside."""
    import contextlib

    import torch

    skipped = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *skip]}
    shapes = {tuple(p.shape) for p in module.parameters()} | {tuple(p.shape)[::-1] for p in module.parameters()}
    acts: dict[int, int] = {}
    copies: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skipped:
            copy = t.dtype == torch.bfloat16 and tuple(t.shape) in shapes
            (copies if copy else acts)[ptr] = t.untyped_storage().nbytes()
        return t

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return sum(acts.values()), sum(copies.values())


def test_the_layer_formula_is_what_autograd_keeps_for_a_llama_block():
    """Count the bytes autograd saves for backward in one block of llama3-debug (CPU), fp32 and
    under bf16 autocast: every saved tensor's storage once, weights and the RoPE table aside. It
    is the plan's per-layer figure plus one fp32 sbh per norm: on CPU RMSNorm is composite and its
    last multiply keeps x·rstd for the weight's gradient, where CUDA's fused kernel
    (aten._fused_rms_norm, whose backward takes input, rstd and weight) keeps only the input and
    rstd the plan counts. Under autocast each of wq, wk, wv, w1 and w3 keeps its own bf16 cast of
    its input (autocast caches only casts of leaf tensors, the weights)."""
    torch = pytest.importorskip("torch")
    from workloads.llama import Llama
    from workloads.llama_sizes import LLAMA_SIZES

    size, b, s = LLAMA_SIZES["llama3-debug"], 2, 24
    torch.manual_seed(0)
    model = Llama(size)
    x = torch.randn(b, s, size.dim, requires_grad=True)
    composite = 2 * 4 * b * s * size.dim
    for precision in ("fp32", "bf16"):
        p = plan(
            "llama3-debug",
            Layout(),
            machine_type=A3_MEGA,
            nodes=1,
            gpus_per_node=1,
            micro_batch=b,
            seq_len=s,
            precision=precision,
        )
        acts, copies = _saved_storages(
            model.layers["0"], x, model.rope, skip=[model.rope], autocast=precision == "bf16"
        )
        assert acts == p.layer + composite, precision
        if precision == "bf16":  # the layer's seven matmul weights, once each
            assert copies == 2 * size.layer_params - 2 * 2 * size.dim


def test_the_layer_formula_is_what_autograd_keeps_for_a_gpt_block_under_autocast():
    torch = pytest.importorskip("torch")
    from workloads.model import GPT

    b, s = 2, 24
    torch.manual_seed(0)
    model = GPT(MODEL_SIZES["tiny"])
    p = plan("tiny", Layout(), machine_type=A3_MEGA, nodes=1, gpus_per_node=1, micro_batch=b, seq_len=s)
    acts, copies = _saved_storages(model.blocks["0"], torch.randn(b, s, 32, requires_grad=True))
    assert acts == p.layer == sum(v for _, v in layer_tensors("tiny", micro_batch=b, seq_len=s))
    c = 32
    assert copies == 2 * (4 * c * c + 8 * c * c)  # q, k, v, proj, fc1, fc2 (the biases are in the sums)


def _saved_by_compile(model, *args):
    """What the compiled forward of `model` saves for backward, under bf16 autocast on CPU:
    AOTAutograd with inductor's decompositions and the min-cut partitioner inductor uses
    (torch/_functorch/partitioners.py min_cut_rematerialization_partition), the kernels left
    eager. Returns the bytes of the saved activations (views counted once, with their base) and
    of the saved bf16 casts of the weights."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    aten, prims = torch.ops.aten, torch.ops.prims
    views = {aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.t.default}
    views |= {aten.transpose.int, aten.alias.default, aten.expand.default, aten.unsqueeze.default}
    graphs = {}

    def forward(gm, _):
        graphs["forward"] = gm
        return make_boxed_func(gm.forward)

    def backward(gm, _):
        graphs["saved"] = [n.name for n in gm.graph.nodes if n.op == "placeholder" and "tangents" not in n.name]
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=forward,
        bw_compiler=backward,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(model, backend=backend)(*args)
    loss.backward()
    nodes = {n.name: n for n in graphs["forward"].graph.nodes}
    bases = {}
    for name in graphs["saved"]:
        if name not in nodes:
            continue  # the RNG state a checkpointed region keeps
        node = nodes[name]
        while node.op == "call_function" and node.target in views:
            node = node.args[0]
        bases[node.name] = node
    acts = copies = 0
    for node in bases.values():
        val = node.meta["val"]
        if node.op == "placeholder" or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue  # the inputs (weights, token ids, RoPE table) and the loss's scalar
        source = node
        while source.op == "call_function" and (
            source.target in views or source.target == prims.convert_element_type.default
        ):
            source = source.args[0]
        nbytes = val.numel() * val.element_size()
        if source.op == "placeholder":
            copies += nbytes
        else:
            acts += nbytes
    return acts, copies


def _compiled_parts(name: str, b: int, s: int) -> tuple[float, float]:
    layer = sum(v for _, v in layer_tensors(name, micro_batch=b, seq_len=s, compiled=True))
    head = dict(head_tensors(name, micro_batch=b, seq_len=s, compiled=True))
    head.pop("output weight gradient")  # made in backward, not saved
    return layer, sum(head.values())


def test_what_a_compiled_llama_keeps_is_what_the_partitioner_saves():
    """llama3-debug compiled whole, loss included. Per layer: the fp32 residual at both norms,
    their rstd, one bf16 cast per norm, q, k, v, the attention's output and log-sum-exp, SwiGLU's
    w1 and w3 outputs and their product (its silu recomputed); at the head the bf16 logits and the
    loss's max and log-sum-exp, not the fp32 log-softmax. The first layer keeps the output
    projection's bf16 output where the others keep the fp32 sum after attention (its input is the
    embedding's output, which is no fusible op, so the partitioner's ban on recomputing a sum read
    far apart does not apply): 2 bytes an element less than the plan counts."""
    torch = pytest.importorskip("torch")
    from workloads.llama import Llama
    from workloads.llama_sizes import LLAMA_SIZES

    size, b, s = LLAMA_SIZES["llama3-debug"], 2, 24
    torch.manual_seed(0)
    x, y = torch.randint(0, size.vocab_size, (2, b, s))
    acts, copies = _saved_by_compile(Llama(size), x, y)
    layer, head = _compiled_parts("llama3-debug", b, s)
    assert acts == size.n_layers * layer + head - 2 * b * s * size.dim
    # The bf16 casts of every matmul weight: the layers' and the tied output table's.
    assert copies == 2 * (size.n_layers * (size.layer_params - 2 * size.dim) + size.vocab_size * size.dim)
    p = plan(
        "llama3-debug", Layout(), machine_type=A3_MEGA, nodes=1, gpus_per_node=1, micro_batch=b, seq_len=s, compile=True
    )
    assert p.layer == layer and p.buffers == copies


def test_what_a_compiled_gpt_keeps_is_what_the_partitioner_saves():
    """GPT tiny compiled whole: each LayerNorm's normalized fp32 input and its rstd (the mean folded
    into the normalized input), one
    bf16 cast per LayerNorm, q, k, v, the attention's output and log-sum-exp, the GELU's input and
    output (the output is fc2's input: a matmul reads it in backward, so it is saved, not
    recomputed); the head as for Llama."""
    torch = pytest.importorskip("torch")
    from workloads.model import GPT

    size, b, s = MODEL_SIZES["tiny"], 2, 24
    torch.manual_seed(0)
    x, y = torch.randint(0, size.vocab_size, (2, b, s))
    acts, _ = _saved_by_compile(GPT(size), x, y)
    layer, head = _compiled_parts("tiny", b, s)
    assert acts == size.n_layer * layer + head + 8 * s  # and the int64 positions wpe's backward reads


def test_a_compiled_checkpointed_llama_keeps_each_layers_fp32_input():
    """Checkpointed and compiled: each layer's input (the fp32 residual) and the head; the final
    norm's input is the last layer's output, recomputed with it."""
    torch = pytest.importorskip("torch")
    from workloads.llama import Llama
    from workloads.llama_sizes import LLAMA_SIZES

    size, b, s = LLAMA_SIZES["llama3-debug"], 2, 24
    torch.manual_seed(0)
    x, y = torch.randint(0, size.vocab_size, (2, b, s))
    acts, copies = _saved_by_compile(Llama(size, activation_checkpointing=True), x, y)
    _, head = _compiled_parts("llama3-debug", b, s)
    sbh = b * s * size.dim
    assert acts == size.n_layers * 4 * sbh + head - 4 * sbh
    assert copies == 2 * size.vocab_size * size.dim  # the output's cast alone outlives forward


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
    assert lines[0].startswith("model llama3-70b: 70.55B parameters; micro-batch 1 x seq 8192")
    assert "  parameters           2.05 GiB" in lines
    assert lines[1] == "mode: eager (autograd keeps what each op saves)"
    assert "  activations         72.33 GiB eager" in lines
    assert "  gradients            2.05 GiB (made in backward as activations are freed: not held at the peak)" in lines
    assert (
        "  by mode: eager 81.5 GiB (used); compiled 67.6 GiB; checkpointed 31.1 GiB; compiled+checkpointed 21.6 GiB"
        in lines
    )
    assert "verdict: does not fit by 1.5 GiB" in lines
    assert lines[-1] == (
        "  smallest change that fits: --compile -> dp_replicate(1) x dp_shard(16) x tp(8) x pp(1): "
        "fits (67.6 of 80 GiB); compiled: 0.77x the step time (measured: 132 vs 172 ms, llama3-1b on one H200)"
    )


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
