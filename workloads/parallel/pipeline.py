"""Pipeline schedules over a rank's stages (torch.distributed.pipelining; torchtitan's
torchtitan/distributed/pipeline_parallel.py builds them the same way)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from workloads.parallel.dims import ParallelDims

__all__ = ["build_schedule"]


def build_schedule(
    stages: list[tuple[int, nn.Module]],
    dims: ParallelDims,
    pp_mesh: DeviceMesh,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """The schedule that runs this rank's stages. The loss_fn gives each microbatch's mean
    loss and the schedule divides the gradients by the number of microbatches (scale_grads),
    so one step's gradients are the mean over the rank's whole batch, as without a pipeline."""
    # Imported here, not at the top: torch.distributed.pipelining pulls in dynamo (~0.8 s per rank
    # measured with `python -X importtime -c "import workloads.train"`), which a run without
    # pipeline stages never uses.
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    group = pp_mesh.get_group()
    built = [PipelineStage(m, s, dims.num_stages, device, group=group) for s, m in stages]
    if dims.pp_schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(built, n_microbatches=n_microbatches, loss_fn=loss_fn)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[dims.pp_schedule]
    return kind(built[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
