"""FP8 training (--precision fp8): the model's Linear layers swapped for torchao's Float8Linear,
whose matmuls run on FP8 tensor cores with dynamic scales; everything else stays bf16 (autocast)
and the weights, gradients, optimizer states and checkpoints stay in high precision.

The converter follows torchtitan's (pytorch/torchtitan, torchtitan/components/quantization/
float8.py, Float8LinearConverter, at commit 64dc922 for the tensorwise branch, which later versions
dropped): `Float8LinearConfig.from_recipe_name`; a filter that keeps a layer whose dimensions are
not multiples of 16 (FP8 GEMMs need them: torchtitan quantization/utils.py module_filter_fn) and
the output projection (torchtitan's float8.md filters "output"); for tensorwise under FSDP2,
`enable_fsdp_float8_all_gather` (the weights are all-gathered in fp8) and
`precompute_float8_dynamic_scale_for_fsdp` after each optimizer step (one all-reduce of every
weight's amax instead of one per layer); SM 8.9 or newer, else emulation (tests only). Under
rowwise every collective stays in bf16 (torchtitan: "for float8 with rowwise scaling, all
distributed communication is done in high precision").

Conversion happens before tensor parallelism and FSDP (torchtitan applies its converters to the
model before parallelize_llama): parameter names do not change, so a checkpoint written by an fp8
run loads into a bf16 one and back.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "MIN_CAPABILITY",
    "MIN_TORCH",
    "MIN_TORCHAO",
    "OUTPUT_PROJECTIONS",
    "Float8Summary",
    "convert_to_fp8",
    "fp8_refusal",
    "high_precision_state",
    "keep_reason",
    "device_capability",
    "precompute_scales",
    "torchao_version",
]

# FP8 tensor cores: SM 8.9 (Ada, L4) and SM 9.0 (Hopper: H100, H200) on; torch._scaled_mm refuses
# older GPUs (torchtitan's has_cuda_capability(8, 9) check).
MIN_CAPABILITY = (8, 9)
# torchao 0.18 needs torch 2.11 or newer (pytorch/ao#4154: its kernels use torch 2.11's stable ABI).
MIN_TORCH = (2, 11)
# The torchao gpufleet's workloads extra pins, the one these tests run against.
MIN_TORCHAO = (0, 18)
# The output projection's names (workloads.model.GPT, workloads.llama.Llama): its logits feed the
# softmax, and torchtitan keeps it in high precision (float8.md: filter_fqns=["output"]).
OUTPUT_PROJECTIONS = ("lm_head", "output")


def _version(text: str) -> tuple[int, int]:
    """'2.13.0+cu130' -> (2, 13)."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def fp8_refusal(
    *,
    torch_version: str,
    torchao_version: str | None,
    capability: tuple[int, int] | None,
    device_name: str | None = None,
) -> str | None:
    """Why --precision fp8 cannot run here, in one line (None: it can). `torchao_version` None:
    torchao is not installed; `capability` None: no GPU (torchao's emulation, for tests only)."""
    if _version(torch_version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return (
            f"--precision fp8 needs torch {need} or newer (torchao's floor), found {torch_version}; "
            f"install torch>={need} or use --precision bf16"
        )
    if torchao_version is None:
        return (
            "--precision fp8 needs torchao, which is not installed; install gpufleet[workloads] "
            "(it pins torchao) or use --precision bf16"
        )
    if _version(torchao_version) < MIN_TORCHAO:
        need = ".".join(map(str, MIN_TORCHAO))
        return (
            f"--precision fp8 needs torchao {need} or newer, found {torchao_version}; "
            f"install torchao>={need} (gpufleet[workloads] pins it) or use --precision bf16"
        )
    if capability is not None and capability < MIN_CAPABILITY:
        sm = f"{capability[0]}.{capability[1]}"
        return (
            f"--precision fp8 needs FP8 tensor cores (SM 8.9 or newer: L4, H100, H200); this GPU "
            f"({device_name or 'cuda'}) is SM {sm}; use --precision bf16"
        )
    return None


def keep_reason(fqn: str, module: nn.Module) -> str | None:
    """Why a Linear stays in high precision (None: it is converted)."""
    if fqn.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS:
        return "the output projection"
    if not isinstance(module, nn.Linear):
        return "not a Linear"
    if module.in_features % 16 or module.out_features % 16:
        return f"{module.in_features} x {module.out_features}: not multiples of 16"
    return None


@dataclass
class Float8Summary:
    """What the conversion did, for the start line."""

    recipe: str
    emulate: bool
    fsdp_float8_all_gather: bool
    converted: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    """(layer name, why it stays in high precision)."""
    compiled: str = ""
    """How compilation was decided (set by the builder)."""

    @property
    def precompute(self) -> bool:
        """Scales computed for all weights at once after each optimizer step (tensorwise + FSDP2)."""
        return self.fsdp_float8_all_gather

    def describe(self) -> str:
        """`fp8: torchao 0.18.0 float8 rowwise: 14 Linear layers converted; kept in bf16: output
        (the output projection); ...`."""
        import torchao

        parts = [f"fp8: torchao {torchao.__version__} float8 {self.recipe}"]
        if self.emulate:
            parts[0] += ", emulated on CPU (torchao emulate=True: for tests only, no FP8 hardware, no speed)"
        parts.append(f"{len(self.converted)} Linear layers converted")
        if self.kept:
            parts.append("kept in bf16: " + ", ".join(_grouped(self.kept)))
        if self.fsdp_float8_all_gather:
            parts.append("FSDP2 all-gathers the converted weights in fp8, their scales precomputed after each step")
        elif self.recipe == "rowwise":
            parts.append("collectives in bf16 (torchao's fp8 all-gather is tensorwise only)")
        if self.compiled:
            parts.append(self.compiled)
        return "; ".join(parts)


def _grouped(kept: list[tuple[str, str]]) -> list[str]:
    """`layers.*.attention.wk (40 x 24: not multiples of 16) x 32`: one entry per pattern."""
    counts = Counter((re.sub(r"\.\d+\.", ".*.", name), why) for name, why in kept)
    return [f"{name} ({why})" + (f" x {n}" if n > 1 else "") for (name, why), n in counts.items()]


def _torchao_config(recipe: str, *, emulate: bool, shard: bool) -> Any:
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    # fp8 all-gather needs one scale per weight, which only tensorwise has (torchtitan 64dc922).
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=shard and recipe == "tensorwise")


def convert_to_fp8(model: nn.Module, recipe: str, *, emulate: bool, shard: bool) -> Float8Summary:
    """Swap `model`'s eligible Linear layers for Float8Linear in place (before TP and FSDP);
    `shard`: FSDP2 will shard the model (dp_shard > 1). `emulate`: no FP8 hardware (CPU)."""
    if emulate:
        _import_quietly()
    from torchao.float8 import convert_to_float8_training

    config = _torchao_config(recipe, emulate=emulate, shard=shard)
    summary = Float8Summary(recipe, emulate, config.enable_fsdp_float8_all_gather)

    def eligible(module: nn.Module, fqn: str) -> bool:  # torchao asks about each nn.Linear
        why = keep_reason(fqn, module)
        if why:
            summary.kept.append((fqn, why))
        else:
            summary.converted.append(fqn)
        return why is None

    if recipe == "rowwise":
        # torchtitan does the same for rowwise (pytorch/pytorch#150859: inductor's fused casts
        # round differently from eager's without it).
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return summary


def _import_quietly() -> None:
    """Import torchao without its import-time warnings that its CUDA kernels (.so files) do not
    load: on a CPU build of torch they cannot, and the emulation needs none of them."""
    import logging

    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    finally:
        log.setLevel(level)


def precompute_scales(model: nn.Module) -> None:
    """Every fp8-all-gathered weight's scale in one all-reduce (after the optimizer step)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def torchao_version() -> str | None:
    """The installed torchao's version (None: not installed), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchao")
    except PackageNotFoundError:
        return None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def high_precision_state(state: Any) -> Any:
    """`state` (a state dict, nested) with every fp8-all-gather weight wrapper replaced by the
    high-precision tensor it wraps, so a checkpoint holds plain tensors: a bf16 run (or one
    without torchao) reads it. Tensor-wise fp8 under FSDP2 wraps the weights, and AdamW's states
    made from them by zeros_like, in torchao's WeightWithDynamicFloat8CastTensor."""
    import sys

    if "torchao.float8" not in sys.modules:  # no fp8 run in this process: nothing is wrapped
        return state
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(plain(v) for v in value)
        if isinstance(value, DTensor) and isinstance(value._local_tensor, Wrapped):
            return DTensor.from_local(
                value._local_tensor._tensor.detach(),
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, Wrapped):
            return value._tensor.detach()
        return value

    return plain(state)
