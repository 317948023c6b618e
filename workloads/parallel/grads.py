"""The global gradient norm over every shard and stage, and clipping by it.

torch's clip_grad_norm_ reduces a DTensor's norm over its own mesh, but cannot mix DTensors of
different meshes (TP's 2-D and FSDP's 1-D parameters) or plain tensors with DTensors, and knows
nothing of pipeline stages (torchtitan's dist_utils.clip_grad_norm_ adds the stages by hand).
Here each gradient's squared norm is summed locally, grouped by (mesh, placements), reduced
over exactly the mesh dimensions that shard it, and the total summed over the pipeline stages.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm"]


def _sq(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().pow(2).sum()


def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    skip: set[int] | None = None,
) -> torch.Tensor:
    """Clip the gradients of `params` to a global L2 norm of max_norm; returns the norm.

    `skip`: ids of parameters whose gradient another stage also holds and counts (a weight tied
    between the first and last stage), left out here so it is counted once."""
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and id(p) not in (skip or set())]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in counted:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
        if isinstance(g, DTensor):
            groups.setdefault((g.device_mesh, g.placements), []).append(g)
        else:
            total += _sq(g)
    for (mesh, placements), same in groups.items():
        part = sum((_sq(g.to_local()) for g in same), torch.zeros((), device=device))
        for dim, placement in enumerate(placements):
            if placement.is_shard() or placement.is_partial():
                dist.all_reduce(part, group=mesh.get_group(dim))
        total += part
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm
