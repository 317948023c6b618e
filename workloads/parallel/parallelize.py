"""Apply a layout to a model: tensor parallelism (a plan per model class), pipeline stages,
then FSDP2 / HSDP over the data-parallel dimensions, all on one DeviceMesh (torchtitan's order:
pytorch/torchtitan, torchtitan/models/llama3/infra/parallelize.py: TP first, then fully_shard).

A model takes part by its layer structure, torchtitan style: an embedding in front, `layers`
(here `blocks`) as an nn.ModuleDict keyed by layer number, a norm and an output head. A stage
of a pipeline is a copy of the model with the parts of other stages set to None, so every
parameter keeps its name (its FQN) in every layout, and DCP can reshard a checkpoint from any
layout to any other.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from workloads.parallel.dims import ParallelDims

__all__ = [
    "ModelParts",
    "TP_PLANS",
    "apply_fsdp",
    "apply_tp",
    "build_mesh",
    "local",
    "merge_stages",
    "split_stages",
    "stage_layers",
    "tied_group",
]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The world as one 4-D mesh, tp innermost (consecutive ranks: one node)."""
    return init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=MESH_DIMS)


@dataclass(frozen=True)
class ModelParts:
    """Where a model keeps what a pipeline splits: the modules of the first stage, the layers,
    the modules of the last stage, and the first-stage modules the last stage also needs
    (a weight tied between the embedding and the output head)."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    tied: tuple[str, ...] = ()


# ---- tensor parallel plans, one per model class -----------------------------------------------


def _gpt_plan(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """GPT (workloads.model): Megatron-style column/row pairs. q, k, v column-wise (each rank
    holds n_head/tp whole heads), the attention projection row-wise; the MLP's first linear
    column-wise, its second row-wise. The embedding row-wise (sharded over the vocabulary, output
    replicated), the head column-wise with its logits gathered (Replicate) for the loss; both
    shard the vocabulary, so the tied weight has one placement."""
    top = {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    block = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }
    return top, block


def _llama_plan(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Llama-3 (torchtitan's plan, without sequence parallel): wq/wk/wv and w1/w3 column-wise,
    wo and w2 row-wise; embedding row-wise, output column-wise and gathered."""
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    block = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    return top, block


# By class name, so this module needs no import of the models (and a model added later only
# adds a line here).
TP_PLANS: dict[str, Callable[[nn.Module], tuple[dict[str, Any], dict[str, Any]]]] = {
    "GPT": _gpt_plan,
    "Transformer": _llama_plan,
    "Llama": _llama_plan,
}


def _present(module: nn.Module, path: str) -> bool:
    for name in path.split("."):
        module = getattr(module, name, None)  # type: ignore[assignment]
        if module is None:
            return False
    return True


def apply_tp(model: nn.Module, parts: ModelParts, tp_mesh: DeviceMesh) -> None:
    """Shard the model's linears over the tp mesh dimension, by its class's plan."""
    kind = type(model).__name__
    if kind not in TP_PLANS:
        raise ValueError(f"no tensor-parallel plan for model class {kind}; add one to TP_PLANS")
    top, block = TP_PLANS[kind](model)
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if _present(model, k)})
    for layer in getattr(model, parts.layers).values():
        parallelize_module(layer, tp_mesh, block)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # TP replaced the tied parameter on one side


def apply_fsdp(model: nn.Module, parts: ModelParts, dp_mesh: DeviceMesh, mp_policy: Any) -> None:
    """fully_shard each layer, then the rest (FSDP2). A 2-D dp mesh (dp_replicate, dp_shard)
    gives HSDP: sharded within a replica, all-reduced across replicas."""
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(model, parts.layers).values():
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


# ---- pipeline stages ------------------------------------------------------------------------


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Layer numbers per stage, as even as they go (earlier stages take the extra ones)."""
    base, extra = divmod(n_layers, n_stages)
    out, at = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(at, at + n)))
        at += n
    return out


def split_stages(model: nn.Module, parts: ModelParts, dims: ParallelDims, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """This rank's stages ("loop" order: rank r holds stages r, r + pp, ...), each a copy of the
    model with the other stages' parts set to None and its layers only."""
    n = dims.num_stages
    layers = stage_layers(len(getattr(model, parts.layers)), n)
    out = []
    for s in range(pp_rank, n, dims.pp):
        stage = copy.deepcopy(model)
        first, last = s == 0, s == n - 1
        for name in parts.first:
            if not first and not (last and name in parts.tied):
                setattr(stage, name, None)
        if not last:
            for name in parts.last:
                setattr(stage, name, None)
        keep = {str(i) for i in layers[s]}
        blocks = getattr(stage, parts.layers)
        for key in list(blocks.keys()):
            if key not in keep:
                del blocks[key]
        out.append((s, stage))
    return out


def merge_stages(stages: list[nn.Module], parts: ModelParts) -> nn.Module:
    """One module over a rank's stages, with the model's parameter names: what the optimizer
    steps and the checkpoint saves (the stages share its parameters)."""
    if len(stages) == 1:
        return stages[0]
    whole = nn.Module()
    for name in (*parts.first, *parts.last):
        held = [getattr(s, name) for s in stages if getattr(s, name, None) is not None]
        setattr(whole, name, held[0] if held else None)
    merged = nn.ModuleDict()
    for s in stages:
        for key, layer in getattr(s, parts.layers).items():
            merged[key] = layer
    setattr(whole, parts.layers, merged)
    return whole


def tied_group(dims: ParallelDims) -> dist.ProcessGroup | None:
    """The group of the first and last pipeline rank at each (dp, tp) place, which sum the
    gradient of a weight both stages hold (Megatron's embedding group). Every rank must call it."""
    if dims.pp == 1:
        return None
    rank = dist.get_rank()
    pairs = []
    for dr in range(dims.dp_replicate):
        for ds in range(dims.dp_shard):
            for t in range(dims.tp):
                at = [((p * dims.dp_replicate + dr) * dims.dp_shard + ds) * dims.tp + t for p in (0, dims.pp - 1)]
                pairs.append(at)
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    return mine if any(rank in p for p in pairs) else None


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own shard (a DTensor's local tensor; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t
