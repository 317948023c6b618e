"""The global gradient norm over TP shards and pipeline stages (workloads.parallel.grads), on 4
real gloo ranks: a loss comparison cannot check it, Adam being blind to a gradient's scale."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.workloads.conftest import free_port


def _grads(stage: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + stage)
    return {name: torch.randn(*shape, generator=g) for name, shape in (("a", (8, 4)), ("b", (4,)), ("c", (6,)))}


def _tied() -> torch.Tensor:
    return torch.randn(5, generator=torch.Generator().manual_seed(7))


def _worker(rank: int, port: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from workloads.parallel.grads import clip_grad_norm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        stage = mesh.get_coordinate()[0]
        full = _grads(stage)
        params = []
        for name, placement in (("a", Shard(0)), ("b", None), ("c", Replicate())):
            p = torch.nn.Parameter(torch.zeros_like(full[name]))
            if placement is None:
                p.grad = full[name].clone()
            else:
                p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full[name]), mesh["tp"], [placement]))
                p.grad = distribute_tensor(full[name].clone(), mesh["tp"], [placement])
            params.append(p)
        tied = torch.nn.Parameter(torch.zeros(5))  # held by both stages, counted once
        tied.grad = _tied().clone()
        params.append(tied)
        skip = {id(tied)} if stage == 1 else set()
        norm = clip_grad_norm(params, 1.0, mesh["pp"].get_group(), skip)
        a = params[0].grad.full_tensor()
        out[rank] = (norm.item(), a, params[1].grad.clone(), tied.grad.clone())
    finally:
        dist.destroy_process_group()


def test_clip_grad_norm_counts_every_shard_and_stage_once_and_scales_every_gradient():
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), out), nprocs=4, join=True)
    expected = math.sqrt(sum(float(g.pow(2).sum()) for s in (0, 1) for g in _grads(s).values()) + _tied().pow(2).sum())
    coef = 1.0 / (expected + 1e-6)
    assert coef < 0.5  # the clip does something to check
    for rank in range(4):
        norm, a, b, tied = out[rank]
        stage = rank // 2
        assert math.isclose(norm, expected, rel_tol=1e-5), (rank, norm, expected)
        assert torch.allclose(a, _grads(stage)["a"] * coef, rtol=1e-5)
        assert torch.allclose(b, _grads(stage)["b"] * coef, rtol=1e-5)
        assert torch.allclose(tied, _tied() * coef, rtol=1e-5)  # a skipped gradient is clipped too
