"""Give a model that was built and sharded on the meta device its memory and initial values, each
rank only its own shards (torchtitan's flow: pytorch/torchtitan, torchtitan/train.py builds the
model under torch.device("meta"), parallelizes it, then calls `to_empty` and `init_weights`).

The random streams are chosen so that what must be equal is equal and what must differ differs:

- each rank seeds its generator with the run's seed plus its place on the mesh's pp, dp_shard and
  tp dimensions, not dp_replicate: HSDP's replicas fill their shards alike, while two shards of
  one tensor, or two pipeline stages, do not repeat each other's values (on CPU, DTensor fills
  each rank's shard from that rank's own generator: torch.distributed.tensor._random
  .is_rng_supported_mesh; torchtitan's set_determinism also gives each pp rank its own seed);
- a parameter that tensor parallelism does not shard (a norm's gain, GPT's position table) is
  copied from the first rank of each TP group to the others, so the group holds one value;
- the embedding that a tied first and last pipeline stage both hold is copied from the first
  stage to the last, so the two start as the one matrix they stand for.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from workloads.parallel.dims import ParallelDims
from workloads.parallel.parallelize import local

__all__ = ["init_seed", "materialize_stages", "sync_tp_replicated", "sync_tied"]


def init_seed(seed: int, dims: ParallelDims, coords: dict[str, int]) -> int:
    """The seed a rank initialises its shards with: `seed` plus its index over (pp, dp_shard, tp);
    `seed` itself on one rank or under pure data parallelism (every rank alike)."""
    return seed + (coords["pp"] * dims.dp_shard + coords["dp_shard"]) * dims.tp + coords["tp"]


def materialize_stages(
    stages: list[nn.Module],
    device: torch.device,
    seed: int,
    mesh: DeviceMesh | None = None,
) -> None:
    """`to_empty` then `init_weights` on each of this rank's stage modules (meta, possibly
    sharded), with the generator seeded by `seed` (see init_seed). On CUDA DTensor's own RNG
    tracker is set to that seed without its rank-0 broadcast (which would give every pipeline
    stage rank 0's seed); the caller re-seeds the global generator afterwards."""
    if mesh is not None and device.type == "cuda":
        from torch.distributed.tensor import _random as dtensor_random

        # The API torchtitan's set_determinism calls for the same reason (pp ranks' own seeds).
        dtensor_random.manual_seed(seed, mesh)
    else:
        torch.manual_seed(seed)
    with warnings.catch_warnings():
        # On CPU DTensor warns at every random op that its RNG support is partial; the seeds above
        # are this module's answer to that, so the warning says nothing new.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        for module in stages:
            module.to_empty(device=device)
            module.init_weights(buffer_device=device)  # type: ignore[operator]


def _sharded_on(param: torch.Tensor, dim_name: str) -> bool:
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return dim_name in names and isinstance(param.placements[names.index(dim_name)], Shard)


@torch.no_grad()
def sync_tp_replicated(modules: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Copy every parameter that tensor parallelism does not shard from the TP group's first
    rank to the others (their shards of it, under FSDP, are the same shard)."""
    group = tp_mesh.get_group()
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters():
            if id(p) in seen or _sharded_on(p, "tp"):
                continue
            seen.add(id(p))
            dist.broadcast(local(p), group=group, group_src=0)


@torch.no_grad()
def sync_tied(tied: list[torch.Tensor], group: Any) -> None:
    """Copy the tied embedding from the first pipeline stage to the last (group rank 0 is the
    first stage's: workloads.parallel.parallelize.tied_group). Every rank of the group calls it."""
    for p in tied:
        dist.broadcast(local(p), group=group, group_src=0)
