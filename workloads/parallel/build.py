"""The model as one rank runs it: built from the seed (whole, or on the meta device and then
materialized shard by shard: --init-device), then tensor parallel, pipeline stages and
FSDP2/HSDP over the mesh, or DDP over every rank (with its comm hook), and torch.compile."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workloads.components.float8 import Float8Summary, convert_to_fp8
from workloads.config import TrainConfig, pick_init_device
from workloads.llama import Llama
from workloads.model import GPT, cross_entropy
from workloads.parallel.dims import ParallelDims
from workloads.parallel.materialize import init_seed, materialize_stages, sync_tied, sync_tp_replicated
from workloads.parallel.parallelize import (
    ModelParts,
    apply_fsdp,
    apply_tp,
    merge_stages,
    split_stages,
    tied_group,
)
from workloads.parallel.pipeline import build_schedule

__all__ = ["BuiltModel", "ModelBuilder", "build_line"]


@dataclass
class BuiltModel:
    """What the build gives the Trainer."""

    model: torch.nn.Module
    """What runs forward: DDP's wrapper, the compiled model, or the model (stages) itself."""
    raw: torch.nn.Module
    """The plain model, GPT or Llama (under a pipeline, the module over this rank's stages): what
    the optimizer steps and the checkpoint saves."""
    n_params: int
    """The whole model's parameters (not this rank's share), embeddings excluded."""
    whole_bytes: int
    """The whole model's fp32 weights."""
    init_device: str
    """--init-device resolved: meta or full."""
    init_why: str
    """Why that one (config.pick_init_device)."""
    build_growth: int | None = None
    """How much this process's peak host memory grew while building (None: unknown)."""
    schedule: Any = None
    """The pipeline schedule (None without --pp)."""
    pp_first: bool = True
    """This rank holds the first pipeline stage."""
    pp_last: bool = True
    """This rank holds the last pipeline stage."""
    tied_group: Any = None
    """The group of the first and last stages, which both hold the tied embedding (or None)."""
    tied: list[torch.Tensor] = field(default_factory=list)
    """This rank's copies of the tied embedding: their gradients are summed over `tied_group`."""
    clip_skip: set[int] = field(default_factory=set)
    """Parameters (by id) the gradient norm counts on another stage: the tied copy on the last."""
    fp8: Float8Summary | None = None
    """What --precision fp8 converted and kept (None in other precisions)."""


class ModelBuilder:
    """Builds one rank's model for `cfg` on `dims` (its `mesh`, this rank's `coords`)."""

    def __init__(
        self,
        cfg: TrainConfig,
        dims: ParallelDims,
        mesh: Any,
        coords: dict[str, int],
        device: torch.device,
        world: int,
        ptdtype: torch.dtype,
    ) -> None:
        self.cfg, self.dims, self.mesh, self.coords = cfg, dims, mesh, coords
        self.device, self.world, self.ptdtype = device, world, ptdtype
        self.cuda = device.type == "cuda"
        self.fp8 = cfg.model_spec.precision == "fp8"
        # fp8 is compiled on a GPU even without --compile (torch.compile fuses the float8 casts;
        # eager they cost more than the fp8 matmuls save), and eager on CPU, where torchao
        # emulates it (torchtitan float8.py: emulation "is not compatible with torch.compile").
        self.compile = (cfg.model_spec.compile or self.fp8) if self.cuda else (cfg.model_spec.compile and not self.fp8)

    def build(self) -> BuiltModel:
        cfg = self.cfg
        torch.manual_seed(cfg.training.seed)  # same initial weights on every rank, before any wrapping
        rss_before = _rss_bytes()
        with torch.device("meta"):  # shapes only: no memory, and no draw from the generator
            raw = self._new_model()
        whole_bytes = 4 * raw.num_params(non_embedding=False)
        init_device, init_why = self._pick_init_device(whole_bytes)
        # n_params from the whole (meta) model, before any sharding.
        built = BuiltModel(raw, raw, raw.num_params(), whole_bytes, init_device, init_why)
        if init_device == "full":
            raw = self._new_model().to(self.device)
        if self.fp8:  # before TP and FSDP, as torchtitan applies its converters
            built.fp8 = self._convert_fp8(raw)
        try:
            if not self.dims.is_ddp:
                self._parallelize(raw, built)
            else:
                if init_device == "meta":
                    self._materialize([raw])
                built.model, built.raw = self._replicate(raw), raw
        finally:
            built.build_growth = _peak_rss_bytes() - rss_before if rss_before is not None else None
        return built

    def _new_model(self) -> torch.nn.Module:
        kind = Llama if self.cfg.is_llama else GPT
        return kind(self.cfg.size, activation_checkpointing=self.cfg.model_spec.activation_checkpointing)

    def _convert_fp8(self, raw: torch.nn.Module) -> Float8Summary:
        """The Linear layers to Float8Linear (workloads.components.float8), and how it compiles."""
        shard = not self.dims.is_ddp and self.dims.dp_shard > 1
        summary = convert_to_fp8(raw, self.cfg.model_spec.fp8_recipe, emulate=not self.cuda, shard=shard)
        asked = self.cfg.model_spec.compile
        if self.cuda:
            summary.compiled = "compiled" + ("" if asked else ": fp8 turns torch.compile on (it fuses the casts)")
        else:
            dropped = ": --compile dropped (the emulation is not for torch.compile)"
            summary.compiled = "eager" + (dropped if asked else "")
        return summary

    def _pick_init_device(self, whole_bytes: int) -> tuple[str, str]:
        """--init-device resolved (config.pick_init_device): meta or full, and why."""
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        return pick_init_device(
            self.cfg.model_spec.init_device,
            sharded=not self.dims.is_ddp,
            cuda=self.cuda,
            whole_bytes_per_node=whole_bytes * local_ranks,
            host_available=_host_available_bytes(),
        )

    def _materialize(self, stages: list[torch.nn.Module]) -> None:
        """Memory and initial values for this rank's (meta, sharded) stage modules, then the
        copies that make replicated and tied parameters one value (workloads.parallel.materialize)."""
        dims, seed = self.dims, self.cfg.training.seed
        materialize_stages(stages, self.device, init_seed(seed, dims, self.coords), self.mesh)
        if dims.tp > 1:
            sync_tp_replicated(stages, self.mesh["tp"])
        torch.manual_seed(seed)  # every rank's generator as after a whole build's seeding

    def _replicate(self, raw: torch.nn.Module) -> torch.nn.Module:
        """DDP over every rank (the model whole on each), or the model itself on one rank."""
        cfg = self.cfg
        if self.world == 1:
            # Nothing to reduce with one rank: skip DDP's bucket copies (torchtitan also applies
            # data parallelism only when its degree is above 1).
            model: torch.nn.Module = raw
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(
                raw,
                device_ids=[self.device.index] if self.cuda else None,
                bucket_cap_mb=cfg.ddp.bucket_cap_mb,
                gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
                static_graph=cfg.ddp.static_graph,
            )
            self._register_comm_hook(model)
        return torch.compile(model) if self.compile else model

    def _register_comm_hook(self, ddp: torch.nn.Module) -> None:
        """Gradient compression through PyTorch's own DDP comm hooks."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        kind = self.cfg.ddp.compression
        if kind == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif kind == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif kind == "powersgd":
            # start_powerSGD_iter: plain all-reduce for the first steps, as the PowerSGD paper and
            # the hook's docs advise (error feedback needs a warmed-up model).
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.cfg.ddp.powersgd_rank,
                start_powerSGD_iter=max(2, self.cfg.lr_scheduler.warmup_steps),
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def _parallelize(self, raw: torch.nn.Module, built: BuiltModel) -> None:
        """TP, then pipeline stages, then FSDP2/HSDP over the data-parallel mesh dimensions."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dims, mesh = self.dims, self.mesh
        parts = ModelParts(*raw.PP_PARTS)
        # bf16/fp16 compute with fp32 gradient reduction (torchtitan's default policy); fp8 runs
        # its converted matmuls in fp8 and the rest in bf16.
        mp = (
            MixedPrecisionPolicy(param_dtype=self.ptdtype, reduce_dtype=torch.float32)
            if self.ptdtype in (torch.bfloat16, torch.float16)
            else MixedPrecisionPolicy()
        )
        dp_mesh = mesh["dp_shard"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
        stages = split_stages(raw, parts, dims, self.coords["pp"]) if dims.pp > 1 else [(0, raw)]
        for _, module in stages:
            if dims.tp > 1:
                apply_tp(module, parts, mesh["tp"])
            if dims.dp > 1:
                apply_fsdp(module, parts, dp_mesh, mp)
        if built.init_device == "meta":
            self._materialize([m for _, m in stages])
        whole = merge_stages([m for _, m in stages], parts)
        built.model = built.raw = whole
        if dims.pp == 1:
            if self.compile:
                built.model = torch.compile(whole)
            return
        self._pipeline(stages, parts, built)

    def _pipeline(self, stages: list[tuple[int, torch.nn.Module]], parts: ModelParts, built: BuiltModel) -> None:
        """The schedule over this rank's stages, and the tied embedding the first and the last
        stage both hold (the head's tied weight): summed over the two after backward, counted
        once in the gradient norm."""
        dims, whole = self.dims, built.raw
        held = [s for s, _ in stages]
        built.pp_first, built.pp_last = 0 in held, dims.num_stages - 1 in held
        n_micro = self.cfg.n_microbatches
        built.schedule = build_schedule(stages, dims, self.mesh["pp"], self.device, n_micro, cross_entropy)
        built.tied_group = tied_group(dims)
        built.tied = [getattr(whole, n).weight for n in parts.tied if getattr(whole, n, None) is not None]
        if built.tied_group is not None and built.init_device == "meta":
            sync_tied(built.tied, built.tied_group)  # each stage filled its own copy: take the first's
        if built.pp_last and not built.pp_first:
            built.clip_skip = {id(p) for p in built.tied}


def build_line(built: BuiltModel, sharded: bool, growths: list[int | None]) -> str:
    """How the model was built, and the most host memory that took on any rank (`growths`: each
    rank's `build_growth`)."""
    if built.init_device == "meta":
        how = "built on the meta device, " + (
            "sharded, then materialized shard by shard on each rank"
            if sharded
            else "then materialized whole on each rank's device"
        )
    else:
        how = "built whole on every rank" + (", then sharded" if sharded else "")
    line = (
        f"init {built.init_device} ({built.init_why}): the model ({built.whole_bytes / 2**30:.2f} GiB of fp32 "
        f"weights whole) {how}"
    )
    known = [(g, r) for r, g in enumerate(growths) if g is not None]
    if known:
        most, rank = max(known)
        line += f"; peak host memory while building: +{most / 2**30:.2f} GiB on rank {rank}, the most of any rank"
    return line


def _rss_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _peak_rss_bytes() -> int:
    """This process's peak resident memory so far (getrusage's ru_maxrss: KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _host_available_bytes() -> int | None:
    """The host's MemAvailable (Linux /proc/meminfo; None elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
