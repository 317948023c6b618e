"""N-D parallelism on one DeviceMesh: the layout (`dims`, torch-free) and its application to a
model (`parallelize`: tensor parallel plans, pipeline stages, FSDP2/HSDP; `pipeline`: the
schedule; `materialize`: memory and initial values for a model sharded on the meta device;
`grads`: the gradient norm over every shard and stage; `build`: the model as one rank runs it,
built from the seed and put on the mesh, or under DDP)."""

from workloads.parallel.dims import PP_SCHEDULES, LayoutError, ParallelDims

__all__ = ["PP_SCHEDULES", "LayoutError", "ParallelDims"]
