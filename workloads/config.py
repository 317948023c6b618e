"""What a training run was asked to do: `TrainConfig`, the named model sizes, and the CLI mapping.

Importing this module does not import torch, so the launcher-side tests and `--help` stay fast.
Every user mistake raises `ConfigError` with one line that names the flag, the bad value and the
fix; `workloads.train` prints it on rank 0 and exits 2 before any process group exists (so a bad
flag can never leave a rank waiting in a collective).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable, Iterable

from gpufleet.catalog import UnknownMachineType, lookup
from workloads.llama_sizes import LLAMA_SIZES, LlamaSize
from workloads.parallel.dims import PP_SCHEDULES, LayoutError, ParallelDims

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DDPConfig",
    "FP8_RECIPES",
    "LRSchedulerConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "PlanConfig",
    "ProfilingConfig",
    "TrainingConfig",
    "INIT_DEVICES",
    "ModelSize",
    "MODEL_SIZES",
    "MODELS",
    "TrainConfig",
    "build_parser",
    "config_from_args",
    "pick_init_device",
    "world_size_from_env",
]

EXIT_BAD_ARGS = 2


class ConfigError(ValueError):
    """A user mistake in the run's arguments; the message is the whole explanation."""


@dataclass(frozen=True)
class ModelSize:
    """A GPT-2-style decoder shape."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int  # the longest sequence the position table holds


# GPT-2 small/medium shapes (Radford et al. 2019, Table 2; nanoGPT model.py `from_pretrained`):
# 124M = 12/12/768, 350M = 24/16/1024. ~1.3B follows GPT-3 XL (Brown et al. 2020, Table 2.1:
# 24 layers, d_model 2048, d_head 128 -> 16 heads). The vocabulary is GPT-2's 50257 padded to
# 50304, a multiple of 64, as nanoGPT does for faster matmuls. "tiny", "tiny-4l" and "small-test"
# exist for CPU tests: "tiny" trains in milliseconds, "tiny-4l" is its 4-layer twin (enough layers
# for 4 pipeline stages), "small-test" (4.21M params) makes a save last long enough to interrupt it.
MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=64),
    "tiny-4l": ModelSize(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=64),
    "small-test": ModelSize(n_layer=4, n_head=4, n_embd=256, vocab_size=4096, block_size=128),
    "124M": ModelSize(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024),
    "350M": ModelSize(n_layer=24, n_head=16, n_embd=1024, vocab_size=50304, block_size=1024),
    "1.3B": ModelSize(n_layer=24, n_head=16, n_embd=2048, vocab_size=50304, block_size=2048),
}

# Every --model: the GPT sizes above and the Llama-3 sizes (workloads.llama_sizes).
MODELS: dict[str, ModelSize | LlamaSize] = {**MODEL_SIZES, **LLAMA_SIZES}

PRECISIONS = ("auto", "bf16", "fp16", "fp32", "fp8")
# torchao.float8's recipes (Float8LinearRecipeName): tensorwise scales a tensor by one number and
# lets FSDP2 all-gather the weights in fp8; rowwise scales each row, which holds accuracy better
# (its communication stays in bf16). pytorch/ao torchao/float8/README.md.
FP8_RECIPES = ("rowwise", "tensorwise")
PARALLELISMS = ("ddp", "fsdp")
PP_SCHEDULE_NAMES = tuple(PP_SCHEDULES)
COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
INIT_DEVICES = ("auto", "meta", "full")


def world_size_from_env() -> int:
    """The number of ranks torchrun started (1 when run as a plain `python -m`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---- the sections: each validates its own fields; the field names are the flags' -----------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require(section: object, names: tuple[str, ...], ok: Callable[[Any], bool], words: str) -> None:
    """ConfigError naming the first of `names` whose value fails `ok`: `--steps must be at least 1, got 0`."""
    for name in names:
        value = getattr(section, name)
        if not ok(value):
            raise ConfigError(f"{_flag(name)} {words}, got {value}")


def _one_of(name: str, value: str, allowed: Iterable[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{_flag(name)} {value!r} is unknown; one of: {', '.join(allowed)}")


def _at_least_1(section: object, *names: str) -> None:
    _require(section, names, lambda v: v >= 1, "must be at least 1")


def _not_negative(section: object, *names: str) -> None:
    _require(section, names, lambda v: v >= 0, "must be 0 or more")


@dataclass
class ModelConfig:
    """Which model, and how it is built and computed."""

    model: str = "tiny"
    """Named model size: a GPT-2 style size (124M, 350M, 1.3B; tiny, tiny-4l and small-test for
    CPU tests) or a Llama-3 size (llama3-debug, llama3-1b, llama3-8b, llama3-70b)."""
    precision: str = "auto"
    """bf16 (autocast), fp16 (autocast + GradScaler), fp32, fp8 (the Linear layers' matmuls in
    float8 through torchao.float8, bf16 elsewhere; needs an SM 8.9+ GPU: H100, H200, and is
    compiled; on CPU torchao's emulation, for tests only); auto = bf16 on GPU, fp32 on CPU."""
    fp8_recipe: str = "rowwise"
    """--precision fp8's scaling: rowwise (a scale per row: closer to bf16) or tensorwise (one
    scale per tensor: faster, and FSDP2 all-gathers the weights in fp8)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (less memory, ~1/3 more compute)."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    init_device: str = "auto"
    """How the model is built. meta: on the meta device (shapes only), sharded there (pipeline
    stages, TP, FSDP2), then each rank allocates and initialises only its own shards on its
    device, so no process ever holds the whole model. full: built whole on every rank's host
    (from the seed: the same weights in every layout), then sharded. auto: meta when the layout
    shards the model (--dp-shard, --tp or --pp above 1) and either the ranks run on CUDA or the
    whole model's fp32 weights on each of a node's ranks would take more than half the host's
    available memory; full otherwise. On CPU, meta-built shards come from each rank's own
    generator (DTensor has no RNG tracker there), so the initial weights depend on the layout."""

    def __post_init__(self) -> None:
        _one_of("model", self.model, MODELS)
        size = MODELS[self.model]
        if size.n_embd % size.n_head:
            raise ConfigError(f"model {self.model}: n_embd {size.n_embd} % n_head {size.n_head} != 0")
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        _one_of("init_device", self.init_device, INIT_DEVICES)


@dataclass
class TrainingConfig:
    """How long, on what data, in what batches. Batches are counted in sequences (samples), not tokens."""

    seq_len: int = 0
    """Tokens per sample; 0 = the model's block size."""
    steps: int = 100
    """Optimizer steps to run in total (a resumed run counts the steps already done)."""
    global_batch: int = 0
    """Samples per optimizer step across all ranks (micro_batch x data-parallel ranks x
    accumulation); 0 = micro_batch x data-parallel ranks (no accumulation), so the default runs at
    any world size."""
    micro_batch: int = 4
    """Samples per rank per forward/backward."""
    seed: int = 1337
    """Seeds the weights, the data order and every RNG; same seed, same run."""
    data: str | None = None
    """A uint16 token file (nanoGPT .bin); None = the synthetic learnable task."""
    synthetic_samples: int = 1 << 16
    """Samples in one epoch of the synthetic task."""

    def __post_init__(self) -> None:
        _at_least_1(self, "steps", "micro_batch", "synthetic_samples")
        _not_negative(self, "seq_len", "global_batch")


@dataclass
class OptimizerConfig:
    """AdamW (torchtitan's optimizer section)."""

    lr: float = 6e-4
    """Peak learning rate (before --scale-lr)."""
    scale_lr: bool = False
    """Multiply the learning rate by the world size (Goyal et al. 2017, linear scaling rule)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to 2-D weights only (nanoGPT)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def __post_init__(self) -> None:
        _require(self, ("lr",), lambda v: v > 0, "must be positive")
        _not_negative(self, "weight_decay", "grad_clip")


@dataclass
class LRSchedulerConfig:
    """Linear warmup, then cosine decay to a floor (torchtitan's lr_scheduler section)."""

    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr x this."""
    warmup_steps: int = 10
    """Linear warmup steps before the cosine decay."""
    lr_decay_steps: int = 0
    """Step at which the cosine reaches its floor; 0 = --steps (nanoGPT's lr_decay_iters). Set it
    to the full run's length when a run is split into parts (--steps 10, then --resume --steps 20)."""

    def __post_init__(self) -> None:
        _not_negative(self, "warmup_steps", "lr_decay_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class ParallelismConfig:
    """The device mesh: data-parallel replicas and shards, tensor and pipeline parallelism."""

    parallelism: str = "ddp"
    """Shorthand for the data-parallel layout when neither --dp-replicate nor --dp-shard is
    given: "ddp" replicates over the rest of the world, "fsdp" shards over it (fully_shard)."""
    dp_replicate: int = 0
    """Data-parallel replicas (all-reduce between them; HSDP with --dp-shard); 0 = from --parallelism."""
    dp_shard: int = 0
    """Data-parallel shards (FSDP2 fully_shard); -1 = the rest of the world; 0 = from --parallelism."""
    tp: int = 1
    """Tensor-parallel degree: each layer's matmuls split over this many ranks of one node."""
    pp: int = 1
    """Pipeline-parallel degree: the layers split into this many stages (torch.distributed.pipelining)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b or interleaved-1f1b (two stages per rank)."""
    pp_microbatches: int = 0
    """Microbatches a pipeline step splits each data-parallel rank's batch into; 0 = batch / --micro-batch."""

    def __post_init__(self) -> None:
        _at_least_1(self, "tp", "pp")
        _not_negative(self, "dp_replicate", "pp_microbatches")
        _one_of("parallelism", self.parallelism, PARALLELISMS)
        _one_of("pp_schedule", self.pp_schedule, PP_SCHEDULE_NAMES)


@dataclass
class DDPConfig:
    """DistributedDataParallel's knobs: buckets, graph, gradient compression (its comm hooks)."""

    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size (the DDP default)."""
    gradient_as_bucket_view: bool = False
    """DDP: gradients alias the all-reduce buckets (saves one copy of the gradients)."""
    static_graph: bool = False
    """DDP: the graph is the same every step (lets DDP skip unused-parameter search)."""
    compression: str = "none"
    """DDP gradient compression through torch's comm hooks: none, bf16, fp16, powersgd."""
    powersgd_rank: int = 4
    """PowerSGD matrix approximation rank."""

    def __post_init__(self) -> None:
        _at_least_1(self, "powersgd_rank")
        _require(self, ("bucket_cap_mb",), lambda v: v > 0, "must be positive")
        _one_of("compression", self.compression, COMPRESSIONS)


@dataclass
class CheckpointConfig:
    """Where checkpoints go, how often, and what a preemption leaves for the last one."""

    checkpoint_dir: str | None = None
    """Where checkpoints go: a local directory or gs://bucket/prefix; None = no checkpoints."""
    checkpoint_every: int = 0
    """Save every K steps (0 = only at the end and on SIGTERM)."""
    keep_checkpoints: int = 3
    """Keep the newest N checkpoints; older ones are deleted after a new one is published."""
    async_checkpoint: bool = False
    """Periodic saves (--checkpoint-every) overlap training: a step waits only for the copy of the
    state to host memory, the shards are written in the background (DCP async_save). The save at
    the end and on SIGTERM stay synchronous."""
    preemption_budget: str = "30s"
    """Time a preemption notice leaves for the SIGTERM save (Compute Engine stops a Spot VM 30 s
    after the notice); the save's measured time is checked against it. Seconds: 30s, 45, 1.5m."""
    resume: bool = False
    """Continue from the latest checkpoint when there is one (start at step 0 when there is none,
    so a torchrun restart with --max-restarts and a first launch use the same command)."""
    save_params: str | None = None
    """Rank 0 writes the final model parameters (a torch.save'd state_dict) to this path."""
    local_checkpoint_every: int = 0
    """Every K steps each rank also writes its own checkpoint to the node-local tier (the local
    SSD): training waits only for the copy off the device; the write runs in the background
    (docs/checkpoints.md). 0 = no local tier."""
    local_checkpoint_dir: str | None = None
    """The node-local tier's directory, this account's own (0700); default: the node's
    $GPUFLEET_LOCAL_CHECKPOINT_DIR, which gpufleet's launch sets."""
    keep_local_checkpoints: int = 2
    """Keep each rank's newest N local checkpoints (never fewer than the newest complete one)."""
    budget_s: float = field(default=30.0, init=False, repr=False)
    """--preemption-budget in seconds."""

    def __post_init__(self) -> None:
        _at_least_1(self, "keep_checkpoints")
        _at_least_1(self, "keep_local_checkpoints")
        _not_negative(self, "checkpoint_every")
        _not_negative(self, "local_checkpoint_every")
        self.budget_s = _parse_seconds("--preemption-budget", self.preemption_budget)
        if self.resume and not (self.checkpoint_dir or self.local_checkpoint_every):
            raise ConfigError("--resume needs --checkpoint-dir or --local-checkpoint-every (where the checkpoints are)")
        if self.local_checkpoint_dir and not self.local_checkpoint_every:
            raise ConfigError("--local-checkpoint-dir needs --local-checkpoint-every K (how often to save there)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir")
        if self.async_checkpoint and not self.checkpoint_every:
            raise ConfigError(
                "--async-checkpoint overlaps the periodic saves with training; it needs "
                "--checkpoint-every K (the final and SIGTERM saves are always synchronous)"
            )


@dataclass
class MetricsConfig:
    """What rank 0 logs, and the straggler check."""

    log_every: int = 1
    """Log a line every K steps."""
    metrics_file: str | None = None
    """Also append each log line as JSON to this file (rank 0)."""
    straggler_every: int = 20
    """Every K steps the ranks share their forward-pass (compute) times, the part of a step that
    waits on no other rank under DDP; 0 disables the check."""
    straggler_threshold: float = 1.2
    """A rank whose forward time is above this x the median of all ranks' is named in a warning."""

    def __post_init__(self) -> None:
        _at_least_1(self, "log_every")
        _not_negative(self, "straggler_every")
        if self.straggler_threshold <= 1:
            raise ConfigError(f"--straggler-threshold must be above 1, got {self.straggler_threshold}")


@dataclass
class ProfilingConfig:
    """A torch.profiler trace of some steps."""

    profile_steps: str | None = None
    """"a:b": record a torch.profiler trace of steps a..b-1 for TensorBoard."""
    profile_dir: str = "profile"
    """Where the profiler trace goes."""
    step_range: tuple[int, int] | None = field(default=None, init=False, repr=False)
    """--profile-steps as (a, b)."""

    def __post_init__(self) -> None:
        if self.profile_steps is not None:
            self.step_range = _parse_range(self.profile_steps)


@dataclass
class PlanConfig:
    """The memory plan (--plan) instead of a run."""

    plan: bool = False
    """Print the memory plan of this model and layout on --plan-nodes x --plan-machine-type (per-GPU
    parameters, gradients, optimizer state, activations; fits or not, and the smallest change
    that fits) and exit, starting no process group. The layout flags count that world's ranks."""
    plan_machine_type: str = "a3-megagpu-8g"
    """--plan: the machine type whose GPUs (gpufleet.catalog) the plan is for."""
    plan_nodes: int = 1
    """--plan: how many nodes the plan is for."""

    def __post_init__(self) -> None:
        _at_least_1(self, "plan_nodes")


# TrainConfig's sections, in the order --help lists them (torchtitan's JobConfig groups its
# fields the same way: model, training, optimizer, lr_scheduler, parallelism, checkpoint, ...).
SECTIONS: dict[str, type] = {
    "model_spec": ModelConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "lr_scheduler": LRSchedulerConfig,
    "layout": ParallelismConfig,
    "ddp": DDPConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "profiling": ProfilingConfig,
    "planning": PlanConfig,
}


def flag_fields(section: type) -> list[Field]:
    """A section's fields that are flags (not the values derived from them)."""
    return [f for f in fields(section) if f.init]


# Each flag's section, by field name (one name space: a flag names its field).
_SECTION_OF: dict[str, str] = {f.name: name for name, section in SECTIONS.items() for f in flag_fields(section)}


class TrainConfig:
    """One training run, in sections (SECTIONS). Built from the flags' names, as the command line
    gives them (`TrainConfig(steps=10, tp=2, world_size=4)`; a name no section has is a
    TypeError, as for a dataclass), and read by section (`cfg.optimizer.lr`) or by the flag's
    name (`cfg.lr`). Each section checks its own fields; the rules that tie fields of several
    sections together are `_check_cross_field`, each with its arithmetic in the message."""

    model_spec: ModelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    lr_scheduler: LRSchedulerConfig
    layout: ParallelismConfig
    ddp: DDPConfig
    checkpoint: CheckpointConfig
    metrics: MetricsConfig
    profiling: ProfilingConfig
    planning: PlanConfig

    def __init__(self, world_size: int = 1, **flags: Any) -> None:
        unknown = sorted(set(flags) - set(_SECTION_OF))
        if unknown:
            raise TypeError(f"TrainConfig.__init__() got an unexpected keyword argument {unknown[0]!r}")
        for name, section in SECTIONS.items():
            mine = {f.name: flags[f.name] for f in flag_fields(section) if f.name in flags}
            setattr(self, name, section(**mine))
        self.world_size = world_size  # the ranks in the job: torchrun's WORLD_SIZE, not a flag
        _at_least_1(self, "world_size")
        self._batch_is_default = False
        self._dims = self._resolve_layout()
        if self.training.global_batch == 0:
            self.training.global_batch = self.training.micro_batch * self.dp_size
            self._batch_is_default = True
        self._check_cross_field()

    def __getattr__(self, name: str) -> Any:
        """A flag's value by its name, from its section (called only for names not found on self)."""
        section = _SECTION_OF.get(name)
        if section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(getattr(self, section), name)

    def __setattr__(self, name: str, value: Any) -> None:
        section = _SECTION_OF.get(name)
        if section is None:
            object.__setattr__(self, name, value)
        else:
            setattr(getattr(self, section), name, value)

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={getattr(self, name)!r}" for name in SECTIONS)
        return f"TrainConfig({parts}, world_size={self.world_size})"

    def _resolve_layout(self) -> ParallelDims:
        """The mesh (--dp-replicate/--dp-shard/--tp/--pp, or the --parallelism shorthand) against
        the world size and the model: everything else, the default global batch included, uses it."""
        size, p = self.size, self.layout
        try:
            dims = ParallelDims.resolve(
                self.world_size, p.parallelism, p.dp_replicate, p.dp_shard, p.tp, p.pp, p.pp_schedule
            )
            kv_heads = size.n_kv_heads if isinstance(size, LlamaSize) else None
            dims.check_model(self.model, size.n_layer, size.n_head, kv_heads)
        except LayoutError as e:
            raise ConfigError(str(e)) from None
        return dims

    def _check_cross_field(self) -> None:
        """The rules that tie fields of several sections together, each with its arithmetic in the
        message (a section's own rules are in its __post_init__)."""
        dims, size = self.dims, self.size
        per_step = self.micro_batch * dims.dp
        if self.global_batch % per_step:
            of = (
                _ranks(dims.dp)
                if dims.dp == self.world_size
                else f"{_ranks(dims.dp)} (world {self.world_size} / (tp {dims.tp} x pp {dims.pp}))"
            )
            raise ConfigError(
                f"--global-batch {self.global_batch} is not divisible by --micro-batch "
                f"{self.micro_batch} x {of} = {per_step}; "
                f"use a multiple of {per_step}, or leave --global-batch out for {per_step}"
            )
        if dims.pp > 1:
            try:
                dims.check_microbatches(self.global_batch // dims.dp, self.n_microbatches)
            except LayoutError as e:
                raise ConfigError(str(e)) from None
            for flag, on in (("--save-params", self.save_params), ("--compile", self.compile)):
                if on:
                    raise ConfigError(
                        f"{flag} is not supported with --pp {dims.pp} (each rank holds only its stages); "
                        f"drop {flag} (a checkpoint holds the whole model: workloads.checkpoint.store.load_checkpoint)"
                    )
        if self.precision == "fp8" and dims.pp > 1:
            raise ConfigError(
                f"--precision fp8 runs compiled (torch.compile fuses its float8 casts), and --pp {dims.pp} "
                "runs uncompiled; use --precision bf16 with a pipeline, or fp8 without --pp"
            )
        if not dims.is_ddp and self.precision == "fp16" and (dims.tp > 1 or dims.pp > 1):
            raise ConfigError("--precision fp16 (GradScaler) is not supported with --tp/--pp; use bf16 or fp32")
        if not dims.is_ddp and self.parallelism != "fsdp" and self.compression != "none":
            raise ConfigError(
                f"--compression {self.compression} is a DDP comm hook; layout {dims.describe()} does not "
                "use DDP: drop --compression or use plain data parallelism (--parallelism ddp alone)"
            )
        if self.seq_len > size.block_size:
            raise ConfigError(
                f"--seq-len {self.seq_len} is longer than model {self.model}'s block size "
                f"{size.block_size}; use --seq-len {size.block_size} or less"
            )
        if self.parallelism == "fsdp" and self.compression != "none":
            raise ConfigError(
                f"--compression {self.compression} is a DDP comm hook; FSDP has none: "
                "drop --compression or use --parallelism ddp"
            )
        if self.parallelism == "fsdp" and (self.static_graph or self.gradient_as_bucket_view):
            raise ConfigError(
                "--static-graph and --gradient-as-bucket-view are DDP knobs; drop them or use --parallelism ddp"
            )
        if self.profile_range and self.profile_range[1] > self.steps:
            a, b = self.profile_range
            raise ConfigError(f"--profile-steps {a}:{b} ends after --steps {self.steps}")
        if self.synthetic_samples < self.global_batch and self.data is None:
            raise ConfigError(
                f"--synthetic-samples {self.synthetic_samples} is smaller than one global batch "
                f"({self.global_batch}); raise it"
            )

    @property
    def dims(self) -> ParallelDims:
        """The resolved layout (dp_shard -1 and the --parallelism shorthand filled in)."""
        return self._dims

    @property
    def dp_size(self) -> int:
        """Data-parallel size: world / (tp x pp) = dp_replicate x dp_shard."""
        return self.dims.dp

    @property
    def grad_accum(self) -> int:
        """Micro-steps per optimizer step: global_batch / (micro_batch x data-parallel size)."""
        return self.global_batch // (self.micro_batch * self.dp_size)

    @property
    def n_microbatches(self) -> int:
        """Pipeline microbatches per step: --pp-microbatches, else one per --micro-batch samples."""
        return self.pp_microbatches or self.grad_accum

    def batch_summary(self) -> str:
        """How the global batch splits, and whether it was chosen for the user: the banner's words."""
        split = f"global batch {self.global_batch} = micro-batch {self.micro_batch} x {_ranks(self.dp_size)}"
        if self._batch_is_default:
            return f"{split} (default; --global-batch to set)"
        return f"{split} x {self.grad_accum} accumulation step{'s' * (self.grad_accum != 1)}"

    @property
    def size(self) -> ModelSize | LlamaSize:
        return MODELS[self.model]

    @property
    def is_llama(self) -> bool:
        return isinstance(self.size, LlamaSize)

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len or self.size.block_size

    @property
    def profile_range(self) -> tuple[int, int] | None:
        return self.profiling.step_range

    @property
    def preemption_budget_s(self) -> float:
        """--preemption-budget in seconds."""
        return self.checkpoint.budget_s


def pick_init_device(
    requested: str, *, sharded: bool, cuda: bool, whole_bytes_per_node: float, host_available: float | None
) -> tuple[str, str]:
    """--init-device resolved to "meta" or "full", and why (the rule in TrainConfig.init_device's
    doc). `whole_bytes_per_node`: the whole model's fp32 weights times the ranks of one node, what a
    full build holds at once on a host; `host_available`: that host's available memory (None:
    unknown, counted as enough)."""
    if requested != "auto":
        return requested, "--init-device"
    if not sharded:
        return "full", "auto: the layout does not shard the model"
    if cuda:
        return "meta", "auto: a sharded layout on CUDA"
    if host_available is not None and whole_bytes_per_node > host_available / 2:
        return "meta", (
            f"auto: the whole model on each of the node's ranks ({whole_bytes_per_node / 2**30:.1f} GiB) "
            f"is more than half the host's {host_available / 2**30:.1f} GiB available"
        )
    return "full", "auto: the whole model on each of the node's ranks fits the host (same weights in every layout)"


def _ranks(n: int) -> str:
    return f"{n} data-parallel rank{'s' * (n != 1)}"


def _parse_seconds(flag: str, text: str) -> float:
    """'30s', '30', '1.5m' -> seconds."""
    units = {"s": 1.0, "m": 60.0}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{flag} {text!r} is not a duration; use seconds like 30s, 45 or 1.5m")
    return value * units[unit]


def _parse_range(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        start, end = int(a), int(b)
    except ValueError:
        start, end = -1, -1
    if not sep or start < 0 or end <= start:
        raise ConfigError(f"--profile-steps {text!r} is not a range 'a:b' with 0 <= a < b, e.g. 5:8")
    return start, end


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting on its own."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see {self.prog} --help)")


def build_parser(prog: str = "python -m workloads.train") -> argparse.ArgumentParser:
    """One flag per field of TrainConfig's sections, a group of flags per section, help text
    from the field docs. `prog` names the command in usage errors: the launcher parses the same
    flags as `launch train`."""
    parser = _Parser(
        prog=prog, description="GPT and Llama-3 training under torchrun (DP, FSDP, TP, PP on one mesh; NCCL or gloo)."
    )
    for name, section in SECTIONS.items():
        group = parser.add_argument_group(name, section.__doc__)
        docs = _field_docs(section)
        for f in flag_fields(section):
            _add_flag(group, f, docs.get(f.name, ""))
    return parser


def _add_flag(group: Any, f: Field, doc: str) -> None:
    """`--field-name`: on/off for a bool field, else a value of the default's type."""
    flag, default = _flag(f.name), f.default
    if isinstance(default, bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=doc)
        return
    kind = {int: int, float: float}.get(type(default), str)
    group.add_argument(flag, type=kind, default=default, metavar=f.name.upper(), help=f"{doc} (default: {default})")


def config_from_args(argv: list[str] | None = None, world_size: int | None = None) -> TrainConfig:
    """Parse the command line into a validated TrainConfig (raises ConfigError)."""
    ns = build_parser().parse_args(argv)
    if ns.plan:  # the plan's world, not this process's
        world_size = ns.plan_nodes * plan_gpus_per_node(ns.plan_machine_type)
    return TrainConfig(**vars(ns), world_size=world_size or world_size_from_env())


def plan_gpus_per_node(machine_type: str) -> int:
    """The catalog's GPU count of a machine type (ConfigError naming --plan-machine-type if unknown)."""
    try:
        return lookup(machine_type).gpu_count
    except UnknownMachineType as e:
        raise ConfigError(f"--plan-machine-type: {e}") from None


def _field_docs(section: type) -> dict[str, str]:
    """The docstring under each field, read from the source (the one place they are written)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(section))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
        ):
            docs[prev.target.id] = " ".join(str(node.value.value).split()).replace("%", "%%")
    return docs
