"""The memory plan: does a model fit the GPUs at a layout, and if not, what is the smallest change
that makes it fit. `python -m workloads.train --plan` and `launch train --dry-run` print it, with
the mode it assumes: eager, compiled (--compile), checkpointed (--activation-checkpointing) or both.

Importing this module does not import torch: the launcher runs it on a laptop.

The figure is the peak of one GPU, which comes at the start of backward: every activation is kept,
the loss's backward makes its largest temporaries, and no gradient exists yet (workloads.train
zeroes them with set_to_none, so a step's first backward makes them as it frees activations). With
gradient accumulation or a pipeline, earlier micro-batches made them: then they count too. The end
of backward (every gradient, the activations gone) is the other candidate; the larger counts.

For a model of N parameters on a layout dp_replicate x dp_shard x tp x pp:

- weights and AdamW states, sharded over tp x pp x dp_shard (dp_replicate copies): 4 + 8 bytes per
  parameter in both precisions, and fp32 gradients (4 B). Under bf16, FSDP2's mixed precision
  (torchtitan `mixed_precision_param = bfloat16`, `mixed_precision_reduce = float32`) keeps fp32
  sharded weights, reduces gradients in fp32 into fp32 shards, and AdamW keeps exp_avg and
  exp_avg_sq in the weights' dtype. A pipeline stage holds its share of the layers plus the
  embedding (first stage) or the final norm and output projection (last stage); the larger counts.
- working buffers: with dp_shard > 1, the gathered weights of two FSDP units (the one computing and
  the one prefetched) and the unsharded gradient of one, a unit being the largest of a layer, the
  embedding and the output (each already split by tp); with dp_shard = 1, DDP's fp32 all-reduce
  buckets (dp_replicate > 1), and under bf16 without FSDP autocast's bf16 copies of the matmul
  weights (norm weights are not cast): autocast caches the cast of a leaf tensor for the whole
  forward (aten/src/ATen/autocast_mode.cpp, cached_cast) and each matmul's backward keeps it. A
  compiled run keeps them too (the partitioner's rule (b) below: backward's matmuls read them).
  Under checkpointing a layer keeps none: the cache dies with forward's autocast region and the
  layer's backward recomputes them; the output projection's copy and one recomputed layer's remain.
- activations of one micro-batch (b sequences of s tokens; hidden h, FFN width f, a query heads,
  KV width h·kv/a, vocabulary V; e = 2 bytes in bf16, 4 in fp32), op by op (`layer_tensors`,
  `head_tensors`). Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198) section 4.1 count sbh(34 + 5as/h) bytes per 16-bit GPT layer with
  dropout and an s x s attention matrix; these models have no dropout, and SDPA's flash kernel
  keeps no s x s matrix but its output and an fp32 log-sum-exp per head and token (4asb).
  The residual stream's dtype r matters: under autocast with fp32 weights (one rank, DDP, tp or pp
  without data parallelism) the embedding's output is fp32 and every residual add promotes to
  fp32, so r = 4; FSDP2's bf16 weights make it bf16 (r = 2). Eager, per layer:
      norm inputs 2·r·sbh (RMSNorm keeps its input and an fp32 rstd per token, LayerNorm its input,
        mean and rstd: autocast runs layer_norm in fp32)
      + the matmuls' inputs: under autocast with fp32 weights each linear casts the normed input
        itself and keeps its own bf16 copy (autocast caches only leaf tensors): q, k, v and w1, w3
        (SwiGLU) or fc1 (GELU), 5 or 4 x e·sbh; otherwise one normed tensor per norm, 2·e·sbh
      + q e·sbh, k and v 2·e·sbh·kv/a, the attention's output e·sbh (SDPA's and wo's input), 4asb
      + SwiGLU 4·e·sbf (w1 out for silu, silu out and w3 out for the product, the product for w2);
        GELU 2·e·sbf (its input and output)
  A one-rank bf16 llama3-1b layer is 55sbh bytes; a GPT-2 one 40sbh (Korthikanti's 34sbh with the
  casts and fp32 norm inputs, less the dropout masks). Tensor parallelism splits all but the norm
  and linear inputs by tp (their "10sbh + 24sbh/t"); with sequence parallel the norm inputs are
  split too (PyTorch's SequenceParallel keeps the gathered linear inputs for backward).
  After the last layer: the final norm's input r·sbh and the output's input e·sbh; the loss
  (F.cross_entropy of the logits' fp32 copy) keeps its fp32 log-softmax, and its backward holds that,
  the log-softmax's gradient and the fp32 logits' gradient at once: 12sbV bytes (split by tp only
  under loss parallel). Forward's peak there is smaller (bf16 logits, fp32 copy, log-softmax: 10sbV).
- compiled (torch.compile, inductor): AOTAutograd traces forward and backward as one graph and
  inductor's partitioner (torch/_functorch/partitioners.py, min_cut_rematerialization_partition;
  Horace He, "Min-cut optimal(*) recomputation (i.e. activation checkpointing) with AOTAutograd",
  https://dev-discuss.pytorch.org/t/min-cut-optimal-recomputation-i-e-activation-checkpointing-with-aotautograd/467)
  chooses what forward saves by a minimum cut weighted by
  bytes, under the rules torch/_functorch/config.py turns on: (a) ops outside an allowlist of
  pointwise, view and reduction ops (matmuls, SDPA, embedding) are never recomputed
  (ban_recompute_not_in_allowlist), as torchtitan's selective checkpointing saves mm and SDPA
  outputs (torchtitan/distributed/activation_checkpoint.py, _op_sac_save_list); (b) a tensor that
  backward reads through an op it cannot fuse into (a matmul's input) is saved, not recomputed
  (ban_recompute_materialized_backward); (c) reductions 4x smaller than their input (rstd, the
  loss's max and log-sum-exp) are saved (ban_recompute_reductions); (d) a pointwise op reading a
  tensor that an unfusible op read earlier is not recomputed (ban_recompute_used_far_apart): the
  residual adds, so the fp32 residual stays saved at each norm; (e) the rest, the cheap pointwise
  ops (casts, silu, RoPE, normalisation, the loss's fp32 upcast and softmax), are recomputed inside
  backward's fused kernels. Per layer that leaves:
      norm inputs 2·r·sbh (LayerNorm: its normalised input, the mean folded in) and one fp32
        statistic per token each
      + one bf16 cast per norm (the casts are one node in the graph), 2·e·sbh
      + q, k, v, attention output, log-sum-exp as eager (SDPA's inputs and outputs)
      + SwiGLU 3·e·sbf: w1 and w3 outputs (matmul outputs, rule a) and their product (w2's input,
        rule b); silu's output is recomputed. GELU 2·e·sbf: fc1's output and fc2's input (rule b).
  A one-rank bf16 llama3-1b layer is 41sbh bytes. The first Llama layer keeps wo's bf16 output
  instead of the fp32 sum after attention (the embedding is no fusible op, so rule d does not
  hold there); the plan counts the fp32 sum (2 bytes x sbh more, once). The loss keeps the bf16
  logits (a matmul output) and the per-token max and log-sum-exp; backward writes the logits'
  gradient into the logits' buffer (inductor's inplace_buffers, torch/_inductor/config.py) and
  then makes the output weight's bf16 gradient (e·Vh/tp) while it lives: e·sbV + e·Vh/tp.
  tests/workloads/test_plan.py checks these lists against what AOTAutograd's partitioner saves
  for llama3-debug and GPT tiny on CPU, tensor by tensor in bytes. A pipeline runs uncompiled
  (workloads.train compiles only at pp 1), so the plan ignores --compile there.
- activation checkpointing keeps each layer's input (r·sbh) and recomputes one layer at a time in
  backward (Korthikanti's "full recomputation", 2sbhL in 16 bits). The recomputation comes after
  the loss's backward has freed its temporaries, so the peak is the inputs plus the larger of the
  head (eager or compiled, as above) and one recomputed layer.
- a pipeline's first rank holds the most micro-batches in flight (each a micro-batch through its
  layers): GPipe all n of them; 1F1B min(pp, n); interleaved 1F1B with two stages per rank
  pp + (pp - 1)/2 (Korthikanti et al. section 4.2.3 after Narayanan et al. 2021: L(1 +
  (p - 1)/(pm)) layers' worth with m = 2 stages a rank). The last rank holds one micro-batch and
  the head under 1F1B, all n under GPipe.
- fp8 (--precision fp8, workloads.components.float8) is bf16 with the converted Linear layers'
  matmuls in float8, and always compiled (pp 1 only). It changes two buffers: under FSDP2 with
  the tensorwise recipe a layer's matmul weights are all-gathered in fp8 (1 byte, not 2; the
  embedding, output projection and norms stay bf16), and without FSDP the converted layers cast
  their fp32 weights to fp8 themselves instead of through autocast's bf16 cache, counted at one
  byte each (an upper bound: torchao saves the fp32 weight and may recast it in backward).
  Activations stay bf16's: torchao's matmul saves its high-precision inputs
  (torchao/float8/float8_linear.py, matmul_with_hp_or_float8_args). Scales (one fp32 number per
  tensor, or per row) are under 0.1% and not counted. Not yet checked on a GPU
  (bench/gpu_checks.sh fp8 compares the peak).
- a reserve of RESERVED_GIB for what torch's allocator does not count: the CUDA context, NCCL's
  buffers, fragmentation.

The check: llama3-1b, micro-batch 4, seq 2048, bf16, one rank on one H200 (torch 2.11.0+cu130,
torch.cuda.max_memory_allocated; bench/RESULTS.md) peaked at 41.78 GiB eager, 27.20 GiB
checkpointed and 28.96 GiB compiled; the plan, less its reserve, says 41.72, 27.25 and 28.92.
"Smallest change that fits" tries --compile first (fewer activations and a faster step: 132 vs
172 ms there), then checkpointing (206 ms), then more sharding, tensor and pipeline parallelism,
then more nodes, and says what each costs in step time where that was measured (STEP_MS).

A GPU's memory is the catalog's figure (gpufleet.catalog GPU.memory_gb), read as GiB: the marketed
"80 GB" of an H100 is what nvidia-smi reports as about 79.6 GiB, and the reserve covers the gap.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from gpufleet.catalog import UnknownMachineType, lookup
from workloads.config import MODEL_SIZES, ConfigError, ModelSize, TrainConfig, pick_init_device
from workloads.llama_sizes import LLAMA_SIZES, LlamaSize

__all__ = [
    "GiB",
    "MODES",
    "RESERVED_GIB",
    "Layout",
    "MemoryPlan",
    "PlanError",
    "Suggestion",
    "format_plan",
    "head_tensors",
    "layer_tensors",
    "mesh_lines",
    "mode_of",
    "model_names",
    "plan",
    "plan_for",
]

GiB = 1024**3
RESERVED_GIB = 2.0
PRECISIONS = ("auto", "bf16", "fp16", "fp32", "fp8")
FP8_RECIPES = ("rowwise", "tensorwise")
# The GPUs whose machine types the smallest change may move to fp8: FP8 tensor cores (SM 9.0,
# Hopper), the A3 family's; workloads.components.float8 refuses anything older than SM 8.9.
_FP8_GPUS = ("H100", "H200")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
_MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first: tp innermost, as torchtitan
_MAX_NODE_DOUBLINGS = 8


class PlanError(ConfigError):
    """A plan asked for something impossible; the message names the flag and the fix."""


@dataclass(frozen=True)
class Layout:
    """How the ranks are split: dp_replicate x dp_shard x tp x pp = world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    def arithmetic(self) -> str:
        return f"dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x tp({self.tp}) x pp({self.pp})"

    def flags(self) -> str:
        """The command-line flags that ask for this layout."""
        return " ".join(f"--{n.replace('_', '-')} {getattr(self, n)}" for n in ("dp_replicate", "dp_shard", "tp", "pp"))


@dataclass(frozen=True)
class _Shape:
    """What the memory formulas need from a model, whichever family it is."""

    name: str
    n_params: int
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    gated: bool  # SwiGLU (three FFN matrices, four f-wide activations) vs GELU
    norm_stats: int  # per-token fp32 statistics a norm keeps: RMSNorm rstd (1), LayerNorm mean, rstd (2)
    norm_params: int  # a layer's norm weights (and biases): autocast casts none of them
    layer_params: int
    first_params: int  # held only by the first pipeline stage (embeddings)
    last_params: int  # held only by the last stage (final norm, output projection when untied)
    tied: bool


def _llama_shape(name: str, s: LlamaSize) -> _Shape:
    return _Shape(
        name=name,
        n_params=s.n_params,
        n_layers=s.n_layers,
        dim=s.dim,
        n_heads=s.n_heads,
        n_kv_heads=s.n_kv_heads,
        ffn=s.hidden_dim,
        vocab=s.vocab_size,
        gated=True,
        norm_stats=1,
        norm_params=2 * s.dim,
        layer_params=s.layer_params,
        first_params=s.embedding_params,
        last_params=s.dim + (0 if s.tie_embeddings else s.embedding_params),
        tied=s.tie_embeddings,
    )


def _gpt_shape(name: str, s: ModelSize) -> _Shape:
    c = s.n_embd
    # workloads.model.GPT: per block 2 LayerNorms (2·2c), qkv (3c² + 3c), proj (c² + c), MLP
    # (4c² + 4c, 4c² + c) = 12c² + 13c; token and position tables; final LayerNorm; tied output.
    layer = 12 * c * c + 13 * c
    first = (s.vocab_size + s.block_size) * c
    return _Shape(
        name=name,
        n_params=first + s.n_layer * layer + 2 * c,
        n_layers=s.n_layer,
        dim=c,
        n_heads=s.n_head,
        n_kv_heads=s.n_head,
        ffn=4 * c,
        vocab=s.vocab_size,
        gated=False,
        norm_stats=2,
        norm_params=4 * c,
        layer_params=layer,
        first_params=first,
        last_params=2 * c,
        tied=True,
    )


def model_names() -> list[str]:
    return [*MODEL_SIZES, *LLAMA_SIZES]


def _shape(model: str) -> _Shape:
    if model in LLAMA_SIZES:
        return _llama_shape(model, LLAMA_SIZES[model])
    if model in MODEL_SIZES:
        return _gpt_shape(model, MODEL_SIZES[model])
    raise PlanError(f"--model {model!r} is unknown; one of: {', '.join(model_names())}")


MODES = ("eager", "compiled", "checkpointed", "compiled+checkpointed")
"""What a step keeps for backward: eager autograd, torch.compile (--compile), activation
checkpointing (--activation-checkpointing), or both."""

STEP_MS = {"eager": 172.0, "compiled": 132.0, "checkpointed": 206.0}
"""Step time of llama3-1b, micro-batch 4, seq 2048, bf16, one rank on one H200 (torch 2.11.0+cu130,
measured; bench/RESULTS.md): what one mode costs against another, as a ratio. Compiled and
checkpointed together was not measured."""


def mode_of(compiled: bool, ac: bool) -> str:
    return MODES[(2 if ac else 0) + (1 if compiled else 0)]


def step_cost(was: str, now: str) -> str:
    """The step time of mode `now` against `was`, where it was measured."""
    if was == now:
        return "same step time"
    if was not in STEP_MS or now not in STEP_MS:
        return "step time not measured"
    ratio = STEP_MS[now] / STEP_MS[was]
    return f"{ratio:.2f}x the step time (measured: {STEP_MS[now]:.0f} vs {STEP_MS[was]:.0f} ms, llama3-1b on one H200)"


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory of one layout at its peak (the start of backward), in bytes, against the GPU's."""

    model: str
    n_params: int
    layout: Layout
    nodes: int
    gpus_per_node: int
    machine_type: str
    gpu: str
    micro_batch: int
    seq_len: int
    precision: str  # "bf16" or "fp32"; fp8 runs are "bf16" with `fp8` set
    compiled: bool
    """The run is compiled (--compile; workloads.train compiles only without a pipeline)."""
    activation_checkpointing: bool
    sequence_parallel: bool
    loss_parallel: bool
    pp_schedule: str
    pp_microbatches: int
    grad_accum: int
    params: float
    grads: float
    optimizer: float
    buffers: float
    """Held through forward into backward: FSDP's gathered units, DDP's buckets, autocast's bf16
    copies of the weights that backward keeps."""
    activations: float
    """What backward keeps at its start, with the loss's peak (see the module's docstring)."""
    layer: float
    """One layer's share of `activations` (what a checkpointed layer recomputes)."""
    reserved: float
    capacity: float
    by_mode: tuple[tuple[str, float], ...] = ()
    """The total of each mode (MODES) at this layout, for comparison."""
    suggestion: Suggestion | None = None
    """The smallest change that fits, when this layout does not (None when it fits, or nothing
    within the search does)."""
    init_device: str = "meta"
    """How the run builds the model (--init-device resolved for GPUs): "meta" or "full"."""
    fp8: str = ""
    """The fp8 recipe (rowwise or tensorwise) of a --precision fp8 run; "" for any other."""

    @property
    def mode(self) -> str:
        return mode_of(self.compiled, self.activation_checkpointing)

    @property
    def grads_at_peak(self) -> bool:
        """Gradients exist at the start of backward only when an earlier micro-batch of the step
        made them (accumulation, or a pipeline's micro-batches); a step's first backward makes
        them after zero_grad(set_to_none=True) freed them, as its activations go."""
        return self.grad_accum > 1 or self.layout.pp > 1

    @property
    def total(self) -> float:
        """The larger of the start of backward (activations and buffers, and the gradients when
        they exist) and its end (every gradient, the activations gone), over the weights, AdamW
        states and the reserve."""
        start = self.buffers + self.activations + (self.grads if self.grads_at_peak else 0)
        end = self.buffers + self.grads
        return self.params + self.optimizer + max(start, end) + self.reserved

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def verdict(self) -> str:
        if self.fits:
            return f"fits ({self.total / GiB:.1f} of {self.capacity / GiB:.0f} GiB)"
        return f"does not fit by {(self.total - self.capacity) / GiB:.1f} GiB"


@dataclass(frozen=True)
class Suggestion:
    """A layout (and possibly more nodes, compilation or checkpointing) that fits, with what to change."""

    change: str
    """The flags to pass, e.g. "--compile", "--activation-checkpointing" or "--tp 8 --dp-shard 2"."""
    plan: MemoryPlan
    cost: str
    """What the change costs in step time, where the plan can tell."""


def plan(
    model: str,
    layout: Layout,
    *,
    machine_type: str,
    nodes: int,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    compile: bool = False,
    activation_checkpointing: bool = False,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    pp_schedule: str = "1f1b",
    pp_microbatches: int = 0,
    grad_accum: int = 1,
    gpus_per_node: int | None = None,
    init_device: str = "auto",
    fp8_recipe: str = "rowwise",
) -> MemoryPlan:
    """The memory plan of `model` at `layout` on `nodes` x `machine_type`, with the smallest change
    that fits when it does not. `layout.dp_shard` -1 takes the ranks the other dimensions leave.
    `micro_batch` is the samples of one forward (under a pipeline, of one pipeline micro-batch);
    `pp_microbatches` the micro-batches of a pipeline step (0: pp, the fewest 1F1B runs with);
    `grad_accum` the micro-batches a rank accumulates into one step. `compile` is torch.compile
    (ignored under a pipeline, which workloads.train does not compile).
    `sequence_parallel` and `loss_parallel` (the logits stay split by vocabulary across tp for the
    loss, torch.distributed.tensor.parallel.loss_parallel) change what tp splits.
    `precision` fp8 (with `fp8_recipe`) is bf16 with the Linear matmuls in float8
    (workloads.components.float8), always compiled: what changes is in `_fp8_words`.
    Raises PlanError (a ConfigError: exit 2) for a layout that cannot run at all."""
    shape = _shape(model)
    try:
        machine = lookup(machine_type)
    except UnknownMachineType as e:
        raise PlanError(f"--machine-type: {e}") from None
    gpus = gpus_per_node or machine.gpu_count
    for name, value in (
        ("nodes", nodes),
        ("micro-batch", micro_batch),
        ("seq-len", seq_len),
        ("nproc-per-node", gpus),
        ("grad-accum", grad_accum),
    ):
        if value < 1:
            raise PlanError(f"--{name} must be at least 1, got {value}")
    if precision not in PRECISIONS:
        raise PlanError(f"--precision {precision!r} is unknown; one of: {', '.join(PRECISIONS)}")
    if precision == "fp8" and fp8_recipe not in FP8_RECIPES:
        raise PlanError(f"--fp8-recipe {fp8_recipe!r} is unknown; one of: {', '.join(FP8_RECIPES)}")
    if precision == "fp8" and layout.pp > 1:
        raise PlanError("--precision fp8 runs compiled and a pipeline uncompiled; use bf16 with --pp")
    if pp_schedule not in PP_SCHEDULES:
        raise PlanError(f"--pp-schedule {pp_schedule!r} is unknown; one of: {', '.join(PP_SCHEDULES)}")
    if pp_microbatches < 0:
        raise PlanError(f"--pp-microbatches must be 0 (one per --micro-batch) or more, got {pp_microbatches}")
    layout = _resolve(layout, nodes * gpus, nodes, gpus)
    _check(shape, layout, nodes * gpus, nodes, gpus)
    ask = _Ask(
        shape=shape,
        machine_type=machine_type,
        gpu=machine.gpu.model,
        capacity=machine.gpu.memory_gb * GiB,
        gpus=gpus,
        micro_batch=micro_batch,
        seq_len=seq_len,
        precision="fp32" if precision == "fp32" else "bf16",  # auto: bf16 on a GPU; fp16 is 2 bytes too
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        pp_schedule=pp_schedule,
        pp_microbatches=pp_microbatches,
        grad_accum=grad_accum,
        fp8_ok=machine.gpu.model.startswith(_FP8_GPUS) and precision in ("auto", "bf16"),
    )
    fp8 = fp8_recipe if precision == "fp8" else ""
    compiled = (compile or bool(fp8)) and layout.pp == 1  # an fp8 run compiles on a GPU by itself
    result = ask.estimate(layout, nodes, activation_checkpointing, compiled, fp8)
    modes = tuple(
        (mode_of(c, a), ask.estimate(layout, nodes, a, c, fp8).total)
        for a in (False, True)
        for c in ((False, True) if layout.pp == 1 and not fp8 else (compiled,))
    )
    sharded = layout.dp_shard > 1 or layout.tp > 1 or layout.pp > 1
    built, _ = pick_init_device(init_device, sharded=sharded, cuda=True, whole_bytes_per_node=0, host_available=None)
    result = replace(result, init_device=built, by_mode=modes)
    if result.fits:
        return result
    return replace(result, suggestion=ask.smallest_fix(layout, nodes, activation_checkpointing, compiled, fp8))


def plan_for(cfg: TrainConfig, *, machine_type: str, nodes: int, gpus_per_node: int | None = None) -> MemoryPlan:
    """The plan of a validated training config (its model, resolved layout, batch split,
    compilation and checkpointing) on `nodes` x `machine_type`, `gpus_per_node` ranks a node
    (default: its GPUs). Under a pipeline the micro-batch is one pipeline micro-batch: each
    data-parallel rank's batch split into the step's micro-batches."""
    dims = cfg.dims
    micro = cfg.micro_batch
    if dims.pp > 1:
        micro = max(1, cfg.global_batch // dims.dp // cfg.n_microbatches)
    return plan(
        cfg.model,
        Layout(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp),
        machine_type=machine_type,
        nodes=nodes,
        micro_batch=micro,
        seq_len=cfg.tokens_per_sample,
        precision=cfg.precision,
        compile=cfg.compile,
        activation_checkpointing=cfg.activation_checkpointing,
        pp_schedule=cfg.pp_schedule,
        pp_microbatches=cfg.n_microbatches if dims.pp > 1 else 0,
        grad_accum=cfg.grad_accum if dims.pp == 1 else 1,
        gpus_per_node=gpus_per_node,
        init_device=cfg.init_device,
        fp8_recipe=cfg.fp8_recipe,
    )


def _resolve(layout: Layout, world: int, nodes: int, gpus: int) -> Layout:
    if layout.dp_shard != -1:
        return layout
    rest = layout.dp_replicate * layout.tp * layout.pp
    if rest < 1 or world % rest:
        raise PlanError(
            f"--dp-shard -1 takes the ranks left by dp_replicate({layout.dp_replicate}) x tp({layout.tp}) x "
            f"pp({layout.pp}) = {rest}, which does not divide world size {world} ({nodes} nodes x {gpus} GPUs)"
        )
    return replace(layout, dp_shard=world // rest)


def _check(shape: _Shape, layout: Layout, world: int, nodes: int, gpus: int) -> None:
    for name in ("dp_replicate", "dp_shard", "tp", "pp"):
        if getattr(layout, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(layout, name)}")
    if layout.world_size != world:
        raise PlanError(
            f"{layout.arithmetic()} = {layout.world_size} != world size {world} ({nodes} nodes x {gpus} GPUs); "
            "make the product equal the world size (--dp-shard -1 takes the rest)"
        )
    if shape.n_heads % layout.tp or shape.n_kv_heads % layout.tp:
        raise PlanError(
            f"--tp {layout.tp} does not divide model {shape.name}'s {shape.n_heads} heads and "
            f"{shape.n_kv_heads} KV heads; use a tp that divides {math.gcd(shape.n_heads, shape.n_kv_heads)}"
        )
    if layout.pp > shape.n_layers:
        raise PlanError(
            f"--pp {layout.pp} is more than model {shape.name}'s {shape.n_layers} layers; "
            f"use --pp {shape.n_layers} or less"
        )


def _mixed_precision_params(layout: Layout, precision: str) -> bool:
    """FSDP2 gathers bf16 weights (MixedPrecisionPolicy param_dtype): workloads.train shards
    whenever the run is not pure replication and has data parallelism (Trainer._parallelize)."""
    is_ddp = layout.dp_shard == 1 and layout.tp == 1 and layout.pp == 1
    return precision == "bf16" and not is_ddp and layout.dp_replicate * layout.dp_shard > 1


def layer_tensors(
    model: str,
    *,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    compiled: bool = False,
    layout: Layout = Layout(),
    sequence_parallel: bool = False,
) -> list[tuple[str, float]]:
    """What one layer keeps for backward on one rank, op by op: (what, bytes). The module's
    docstring derives each entry."""
    bytes16 = "fp32" if precision == "fp32" else "bf16"  # fp16 and auto (on a GPU) are 2 bytes too
    return _layer_tensors(_shape(model), micro_batch, seq_len, bytes16, compiled, layout, sequence_parallel)


def head_tensors(
    model: str,
    *,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    compiled: bool = False,
    layout: Layout = Layout(),
    loss_parallel: bool = False,
) -> list[tuple[str, float]]:
    """What the final norm, the output projection and the loss keep, with the loss's peak in
    backward: (what, bytes)."""
    bytes16 = "fp32" if precision == "fp32" else "bf16"
    return _head_tensors(_shape(model), micro_batch, seq_len, bytes16, compiled, layout, loss_parallel)


def _layer_tensors(
    m: _Shape, b: int, s: int, precision: str, compiled: bool, layout: Layout, sp: bool
) -> list[tuple[str, float]]:
    e = 4 if precision == "fp32" else 2
    mixed = _mixed_precision_params(layout, precision)
    r = 2 if mixed else 4  # the residual stream: fp32 unless FSDP computes with bf16 weights
    casts = precision == "bf16" and not mixed and not compiled  # eager autocast: one copy per linear
    tp, sps = layout.tp, (layout.tp if sp else 1)
    sbh, sbf, sb = b * s * m.dim, b * s * m.ffn, b * s
    kv = m.n_kv_heads / m.n_heads
    ffn_kept = (3 if compiled else 4) if m.gated else 2
    return [
        ("norm inputs", 2 * r * sbh / sps),
        ("norm statistics", 2 * 4 * (1 if compiled else m.norm_stats) * sb / sps),
        ("linear inputs", ((3 + (2 if m.gated else 1)) if casts else 2) * e * sbh),
        ("q", e * sbh / tp),
        ("k, v", 2 * e * sbh * kv / tp),
        ("attention out", e * sbh / tp),
        ("log-sum-exp", 4 * m.n_heads * sb / tp),
        ("feed-forward", ffn_kept * e * sbf / tp),
    ]


def _head_tensors(
    m: _Shape, b: int, s: int, precision: str, compiled: bool, layout: Layout, lp: bool
) -> list[tuple[str, float]]:
    e = 4 if precision == "fp32" else 2
    r = 2 if _mixed_precision_params(layout, precision) else 4
    sbh, sbv, sb = b * s * m.dim, b * s * m.vocab / (layout.tp if lp else 1), b * s
    kept = [
        ("final norm input", r * sbh),
        ("final norm statistics", 4 * (1 if compiled else m.norm_stats) * sb),
        ("output input", e * sbh),
    ]
    if compiled:
        return [
            *kept,
            ("logits (their gradient in place)", e * sbv),
            ("loss max and log-sum-exp", 2 * 4 * sb),
            ("output weight gradient", e * m.vocab * m.dim / layout.tp),
        ]
    return [*kept, ("log-softmax, its gradient, the logits' fp32 gradient", 3 * 4 * sbv)]


@dataclass(frozen=True)
class _Ask:
    """Everything about the run but the layout, the node count, compilation and checkpointing."""

    shape: _Shape
    machine_type: str
    gpu: str
    capacity: float
    gpus: int
    micro_batch: int
    seq_len: int
    precision: str
    sequence_parallel: bool
    loss_parallel: bool
    pp_schedule: str
    pp_microbatches: int
    grad_accum: int
    fp8_ok: bool = False
    """The smallest change may move this run to fp8 (an H100/H200 machine type, a bf16 run)."""

    def _in_flight(self, pp: int) -> tuple[float, int]:
        """Micro-batches in flight on the first and on the last pipeline rank."""
        n = self.pp_microbatches or pp
        if self.pp_schedule == "gpipe":
            return n, n
        if self.pp_schedule == "interleaved-1f1b":
            return min(n, pp + (pp - 1) / 2), 1
        return min(n, pp), 1

    def estimate(self, layout: Layout, nodes: int, ac: bool, compiled: bool = False, fp8: str = "") -> MemoryPlan:
        m, tp, pp = self.shape, layout.tp, layout.pp
        compiled = compiled and pp == 1
        e = 4 if self.precision == "fp32" else 2
        # FSDP2 gathers a converted layer's matmul weights in fp8 under tensorwise (1 byte); the
        # embedding, the output projection and the norms stay bf16.
        gathered = 1 if fp8 == "tensorwise" else e
        mixed = _mixed_precision_params(layout, self.precision)
        layers = math.ceil(m.n_layers / pp)
        # A pipeline's last stage holds its own copy of a tied table, as the output projection.
        last = m.last_params + (m.vocab * m.dim if m.tied and pp > 1 else 0)
        stage_params = m.n_params if pp == 1 else layers * m.layer_params + max(m.first_params, last)
        shard = stage_params / (tp * layout.dp_shard)
        if layout.dp_shard > 1:
            head = max(m.first_params, m.last_params + (m.vocab * m.dim if m.tied else 0))
            unit = max(m.layer_params, head) / tp
            layer_bytes = (m.layer_params - m.norm_params) * gathered + m.norm_params * e
            buffers = 2 * max(layer_bytes, head * e) / tp + 4 * unit  # two gathered units + one fp32 gradient
        else:
            buffers = stage_params / tp * (4 if layout.dp_replicate > 1 else 0)  # DDP's fp32 buckets
            if self.precision == "bf16" and not mixed:
                # autocast's bf16 copies of the matmul weights, cached through forward and kept by
                # backward (compiled too: the partitioner saves them, their users in backward being
                # matmuls); a checkpointed layer keeps none, the one being recomputed aside.
                # Under fp8 the converted layers cast their fp32 weights to fp8 themselves, not
                # through autocast: at most one 1-byte copy of each is kept (torchao saves the fp32
                # weight and recasts; the partitioner may keep the cast instead), counted in full.
                head_weights = m.vocab * m.dim
                layer_weights = m.layer_params - m.norm_params
                kept_layers = layer_weights if ac else layers * layer_weights
                buffers += ((1 if fp8 else 2) * kept_layers + 2 * head_weights) / tp

        b, s = self.micro_batch, self.seq_len
        layer = sum(v for _, v in _layer_tensors(m, b, s, self.precision, compiled, layout, self.sequence_parallel))
        head = sum(v for _, v in _head_tensors(m, b, s, self.precision, compiled, layout, self.loss_parallel))
        r = 2 if mixed else 4
        kept = r * b * s * m.dim / (tp if self.sequence_parallel else 1)  # a checkpointed layer's input
        # Checkpointed: the inputs of every layer, and the larger of the loss's peak (at the start
        # of backward) and one layer recomputed (later, the loss's tensors freed).
        if pp == 1:
            activations = layers * (kept if ac else layer) + (max(layer, head) if ac else head)
        else:
            first, last_n = self._in_flight(pp)
            if ac:
                activations = max(first * layers * kept + layer, last_n * layers * kept + max(layer, head))
            else:
                activations = max(first * layers * layer, last_n * layers * layer + head)
        return MemoryPlan(
            model=m.name,
            n_params=m.n_params,
            layout=layout,
            nodes=nodes,
            gpus_per_node=self.gpus,
            machine_type=self.machine_type,
            gpu=self.gpu,
            micro_batch=b,
            seq_len=s,
            precision=self.precision,
            compiled=compiled,
            activation_checkpointing=ac,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            pp_schedule=self.pp_schedule,
            pp_microbatches=self.pp_microbatches,
            grad_accum=self.grad_accum,
            params=4 * shard,
            grads=4 * shard,
            optimizer=8 * shard,
            buffers=buffers,
            activations=activations,
            layer=layer,
            reserved=RESERVED_GIB * GiB,
            capacity=self.capacity,
            fp8=fp8,
        )

    def _moves(self, layout: Layout, ac: bool, compiled: bool, fp8: str) -> list[_State]:
        """One step each, cheapest first: compile (on CUDA it keeps fewer activations and runs
        faster; not under a pipeline, which workloads.train does not compile); fp8 tensorwise on an
        H100/H200 (compiled; under FSDP2 its weights are all-gathered in 1 byte, not 2);
        checkpointing on (slower); shard more (a replica's factor 2 to dp_shard); double tp within
        a node; double pp. tp and pp take their factor 2 from dp_shard, else dp_replicate."""
        out: list[_State] = []
        if not compiled and layout.pp == 1:
            out.append((layout, ac, True, fp8))
        if self.fp8_ok and not fp8 and layout.pp == 1:
            out.append((layout, ac, True, "tensorwise"))
        if not ac:
            out.append((layout, True, compiled, fp8))
        if layout.dp_replicate % 2 == 0:
            grown = replace(layout, dp_replicate=layout.dp_replicate // 2, dp_shard=layout.dp_shard * 2)
            out.append((grown, ac, compiled, fp8))
        for dim, limit in (("tp", self.gpus), ("pp", self.shape.n_layers)):
            grown_n = getattr(layout, dim) * 2
            if grown_n > limit:
                continue
            if dim == "tp" and (self.shape.n_heads % grown_n or self.shape.n_kv_heads % grown_n):
                continue
            if dim == "pp" and fp8:
                continue  # fp8 runs compiled, a pipeline does not
            for source in ("dp_shard", "dp_replicate"):
                if getattr(layout, source) % 2 == 0:
                    moved = replace(layout, **{dim: grown_n, source: getattr(layout, source) // 2})
                    out.append((moved, ac, compiled and moved.pp == 1, fp8))
                    break
        return out

    def _search(self, start: Layout, nodes: int, ac: bool, compiled: bool, fp8: str) -> MemoryPlan | None:
        """Breadth first over the moves: the fitting layout fewest steps away (ties go to the
        move listed first in `_moves`)."""
        seen: set[_State] = {(start, ac, compiled, fp8)}
        queue = deque([(start, ac, compiled, fp8)])
        while queue:
            layout, on, comp, f8 = queue.popleft()
            candidate = self.estimate(layout, nodes, on, comp, f8)
            if candidate.fits:
                return candidate
            for nxt in self._moves(layout, on, comp, f8):
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        return None

    def smallest_fix(
        self, layout: Layout, nodes: int, ac: bool, compiled: bool = False, fp8: str = ""
    ) -> Suggestion | None:
        """The same nodes at another layout or mode; failing that, the fewest doublings of the
        node count (the new ranks added to dp_shard)."""
        for doublings in range(_MAX_NODE_DOUBLINGS + 1):
            factor = 2**doublings
            grown = replace(layout, dp_shard=layout.dp_shard * factor)
            found = self._search(grown, nodes * factor, ac, compiled, fp8)
            if found is not None:
                return Suggestion(
                    _change(layout, nodes, ac, compiled, found, fp8),
                    found,
                    _cost(layout, nodes, ac, compiled, found, fp8),
                )
        return None


_State = tuple[Layout, bool, bool, str]
"""A point of the search: layout, checkpointing, compiled, fp8 recipe ("" for none)."""


def _change(was: Layout, nodes: int, ac: bool, compiled: bool, now: MemoryPlan, fp8: str = "") -> str:
    flags = []
    if now.nodes != nodes:
        flags.append(f"--nodes {now.nodes}")
    flags += [
        f"--{n.replace('_', '-')} {getattr(now.layout, n)}"
        for n in ("dp_replicate", "dp_shard", "tp", "pp")
        if getattr(now.layout, n) != getattr(was, n)
    ]
    if now.compiled and not compiled:
        flags.append("--compile")
    if now.fp8 and not fp8:
        flags.append(f"--precision fp8 --fp8-recipe {now.fp8}")
    if now.activation_checkpointing and not ac:
        flags.append("--activation-checkpointing")
    return " ".join(flags)


def _cost(was: Layout, nodes: int, ac: bool, compiled: bool, now: MemoryPlan, fp8: str = "") -> str:
    """The step time the change costs: the modes' measured ratio; a layout change adds
    communication the plan does not estimate."""
    parts = []
    if now.fp8 and not fp8:
        parts.append(f"fp8 {now.fp8}: step time not measured yet (bench/gpu_checks.sh fp8); numerics change")
    before = mode_of(compiled, ac)
    if now.mode != before:
        parts.append(f"{now.mode}: {step_cost(before, now.mode)}")
    if now.layout != was or now.nodes != nodes:
        parts.append("the new layout's communication: not estimated")
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 4:
        return f"{ranks[0]},{ranks[1]},...,{ranks[-1]}"
    return ",".join(map(str, ranks))


def mesh_lines(layout: Layout, nodes: int, gpus: int) -> list[str]:
    """The mesh, and for each dimension whether its groups stay inside a node."""
    sizes = {n: getattr(layout, n) for n in _MESH_ORDER}
    dims = " x ".join(f"{n} {sizes[n]}" for n in _MESH_ORDER)
    nodes_hold = f"node k holds ranks {gpus}k..{gpus}k+{gpus - 1}" if gpus > 1 else "one rank per node"
    on_nodes = f"{nodes} node" + ("s" if nodes != 1 else "")
    lines = [f"mesh: {dims} = {layout.world_size} ranks on {on_nodes}, tp innermost; {nodes_hold}"]
    stride = 1
    for name in reversed(_MESH_ORDER):
        size = sizes[name]
        if size > 1:
            group = [i * stride for i in range(size)]
            on = sorted({r // gpus for r in group})
            where = f"within node {on[0]}" if len(on) == 1 else f"across {len(on)} nodes"
            lines.append(f"  {name} {size}: ranks {_ranks(group)} form one group, {where}")
            if name == "tp" and len(on) > 1:
                lines.append(f"  warning: tp {size} > {gpus} GPUs per node: its all-reduces cross the network")
        stride *= size
    return lines


def _build_line(p: MemoryPlan) -> str:
    """How the run will build the model (workloads.train --init-device)."""
    whole = f"{4 * p.n_params / GiB:.1f} GiB of fp32 weights"
    if p.init_device == "meta":
        return (
            "build: on the meta device, sharded there, then materialized shard by shard: each rank "
            f"allocates and initialises only its own shards on its GPU, no process holds the whole model ({whole})"
        )
    sharded = " and sharded there" if p.layout.dp_shard > 1 or p.layout.tp > 1 or p.layout.pp > 1 else ""
    return f"build: whole on every rank's host ({whole}), then moved to its GPU{sharded}"


_MODE_WORDS = {
    "eager": "eager (autograd keeps what each op saves)",
    "compiled": "compiled (--compile: inductor's min-cut partitioner picks what backward keeps)",
    "checkpointed": "checkpointed (--activation-checkpointing: each layer keeps its input, recomputes the rest)",
    "compiled+checkpointed": "compiled and checkpointed (--compile --activation-checkpointing)",
}


def _fp8_words(p: MemoryPlan) -> str:
    """What --precision fp8 changes in the plan (workloads.components.float8)."""
    fsdp = p.layout.dp_shard > 1
    if fsdp and p.fp8 == "tensorwise":
        gather = "FSDP2 all-gathers the converted weights in fp8 (1 byte, not 2: working buffers)"
    elif fsdp:
        gather = "FSDP2 all-gathers in bf16 (torchao's fp8 all-gather is tensorwise only)"
    else:
        gather = "the converted weights' fp8 casts (at most 1 byte each) replace autocast's bf16 copies"
    tensorwise = p.fp8 == "tensorwise"
    scales = "one fp32 scale per weight, precomputed after each step" if tensorwise else "fp32 per-row scales"
    return (
        f"fp8: {gather}; {scales} (under 0.1%: not counted); activations as bf16 (torchao saves the "
        "matmuls' bf16 inputs); weights, gradients, AdamW states and checkpoints stay fp32"
    )


def format_plan(p: MemoryPlan) -> list[str]:
    """The plan as lines of text for a person."""

    def gib(x: float) -> str:
        return f"{x / GiB:8.2f} GiB"

    mp = "bf16 compute, fp32 weights, gradients and AdamW states" if p.precision == "bf16" else "fp32"
    if p.fp8:
        mp = f"fp8 {p.fp8} Linear matmuls (torchao.float8; output projection bf16), bf16 elsewhere, " + mp[14:]
    pipeline = ""
    if p.layout.pp > 1:
        pipeline = f"; pipeline {p.pp_schedule}, {p.pp_microbatches or p.layout.pp} micro-batches a step"
    mode = f"mode: {_MODE_WORDS[p.mode]}"
    if p.layout.pp > 1:
        mode += "; a pipeline runs uncompiled"
    if p.fp8:
        mode += f"; fp8 {p.fp8}, compiled on GPUs with or without --compile"
    if p.grads_at_peak:
        held = "held at the peak: earlier micro-batches of the step made them"
    else:
        held = "made in backward as activations are freed: not held at the peak"
    lines = [
        f"model {p.model}: {p.n_params / 1e9:.2f}B parameters; micro-batch {p.micro_batch} x seq {p.seq_len}; "
        f"{mp}{pipeline}",
        mode,
        *([_fp8_words(p)] if p.fp8 else []),
        *mesh_lines(p.layout, p.nodes, p.gpus_per_node),
        _build_line(p),
        f"per GPU ({p.nodes} x {p.machine_type}, {p.gpu}), at the start of backward:",
        f"  parameters       {gib(p.params)}",
        f"  optimizer state  {gib(p.optimizer)}",
        f"  working buffers  {gib(p.buffers)}",
        f"  activations      {gib(p.activations)} {p.mode}",
        f"  gradients        {gib(p.grads)} ({held})",
        f"  reserved         {gib(p.reserved)} (CUDA context, NCCL buffers, fragmentation)",
        f"  total            {gib(p.total)} of {p.capacity / GiB:.0f} GiB",
        "  by mode: "
        + "; ".join(f"{name} {total / GiB:.1f} GiB{' (used)' if name == p.mode else ''}" for name, total in p.by_mode),
        f"verdict: {p.verdict}",
    ]
    if not p.fits:
        if p.suggestion is None:
            lines.append(
                f"  nothing fits up to {p.nodes * 2**_MAX_NODE_DOUBLINGS} nodes: lower --micro-batch or --seq-len"
            )
        else:
            s = p.suggestion
            cost = f"; {s.cost}" if s.cost else ""
            lines.append(
                f"  smallest change that fits: {s.change} -> {s.plan.layout.arithmetic()}: {s.plan.verdict}{cost}"
            )
    return lines
