"""The run's layout: how many ways the world is split for each kind of parallelism, every rule
that ties them to the world size and the model checked in one place, the arithmetic in each
message (torchtitan's ParallelDims: pytorch/torchtitan, torchtitan/distributed/parallel_dims.py).

Torch-free, so that a plan or a config check needs no torch. The mesh is built from it by
`workloads.parallel.mesh` in torchtitan's order, outermost first:

    pp  x  dp_replicate  x  dp_shard  x  tp

tp innermost: consecutive ranks, which torchrun puts on one node, form a TP group, so TP's
per-layer all-reduces stay on NVLink; pp outermost: its point-to-point sends cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelDims", "PP_SCHEDULES", "LayoutError"]

# torch.distributed.pipelining schedules by flag value, and how many stages each rank holds.
PP_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}


class LayoutError(ValueError):
    """A layout that does not fit the world or the model; the message says which flag and why."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallelism; dp_shard -1 = whatever the others leave of the world."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    pp_schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise LayoutError(f"--dp-shard must be at least 1, or -1 for the rest of the world, got {self.dp_shard}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise LayoutError(f"--pp-schedule {self.pp_schedule!r} is unknown; one of: {', '.join(PP_SCHEDULES)}")
        others = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise LayoutError(
                    f"dp_replicate({self.dp_replicate}) x tp({self.tp}) x pp({self.pp}) = {others} does not "
                    f"divide world size {self.world_size}, so --dp-shard -1 has no whole rest; "
                    "pick degrees whose product divides the world size"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        total = others * self.dp_shard
        if total != self.world_size:
            raise LayoutError(
                f"dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x tp({self.tp}) x "
                f"pp({self.pp}) = {total} != world size {self.world_size}; make the product the world "
                "size (--dp-shard -1 takes the rest)"
            )

    @classmethod
    def resolve(
        cls,
        world_size: int,
        parallelism: str = "ddp",
        dp_replicate: int = 0,
        dp_shard: int = 0,
        tp: int = 1,
        pp: int = 1,
        pp_schedule: str = "1f1b",
    ) -> ParallelDims:
        """The layout the flags ask for. 0 = unset: with both data-parallel degrees unset,
        --parallelism says which takes the rest of the world (ddp: replicate, fsdp: shard);
        with one set, the other is 1."""
        if dp_replicate == 0 and dp_shard == 0:
            divides = tp * pp > 0 and world_size % (tp * pp) == 0
            if parallelism == "ddp" and divides:
                dp_replicate, dp_shard = world_size // (tp * pp), 1
            else:  # fsdp, or a world tp x pp does not divide: dp_shard -1 names the mismatch
                dp_replicate, dp_shard = 1, -1
        dp_replicate = dp_replicate or 1
        dp_shard = dp_shard or 1
        return cls(dp_replicate, dp_shard, tp, pp, world_size, pp_schedule)

    # ---- derived ------------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Data-parallel size: the ways the global batch is split (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def is_ddp(self) -> bool:
        """Pure replication (a DistributedDataParallel run, or one rank)."""
        return self.dp_shard == 1 and self.tp == 1 and self.pp == 1

    @property
    def uses_fsdp(self) -> bool:
        """Parameters under fully_shard: sharded (FSDP), or HSDP, or replicated next to TP/PP."""
        return not self.is_ddp and self.dp > 1

    @property
    def stages_per_rank(self) -> int:
        return PP_SCHEDULES[self.pp_schedule] if self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def describe(self) -> str:
        """`dp_replicate 1 x dp_shard 2 x tp 2 x pp 1`, or the shorthand for the plain layouts."""
        if self.is_ddp:
            return f"ddp x {self.dp}"
        if self.dp_shard == self.world_size:
            return f"fsdp x {self.dp}"
        parts = [f"{n} {getattr(self, n)}" for n in ("pp", "dp_replicate", "dp_shard", "tp") if getattr(self, n) > 1]
        if self.pp > 1:
            parts[0] += f" ({self.pp_schedule})"
        return " x ".join(parts)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's place on the mesh (pp, dp_replicate, dp_shard, tp), tp varying fastest."""
        coords = {}
        for name, size in (("tp", self.tp), ("dp_shard", self.dp_shard), ("dp_replicate", self.dp_replicate)):
            rank, coords[name] = divmod(rank, size)
        coords["pp"] = rank
        return coords

    def dp_rank(self, rank: int) -> int:
        """Which share of the global batch a rank trains on: its data-parallel coordinate, the
        same for the TP and PP ranks that together hold one replica."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # ---- the model ----------------------------------------------------------------------------

    def check_model(self, model: str, n_layer: int, n_head: int, n_kv_head: int | None = None) -> None:
        """TP splits heads, PP splits layers: both must divide what the model has."""
        if n_head % self.tp:
            raise LayoutError(
                f"--tp {self.tp} does not divide model {model}'s {n_head} attention heads; use a --tp that divides it"
            )
        if n_kv_head is not None and n_kv_head % self.tp:
            raise LayoutError(
                f"--tp {self.tp} does not divide model {model}'s {n_kv_head} KV heads; use a --tp that divides it"
            )
        if self.num_stages > n_layer:
            per = f" x {self.stages_per_rank} stages per rank ({self.pp_schedule})" if self.stages_per_rank > 1 else ""
            raise LayoutError(
                f"--pp {self.pp}{per} = {self.num_stages} pipeline stages is more than model {model}'s "
                f"{n_layer} layers; use --pp {max(1, n_layer // self.stages_per_rank)} or less"
            )

    def check_microbatches(self, local_batch: int, n_microbatches: int) -> None:
        """A pipeline step splits each data-parallel rank's batch into n_microbatches."""
        if local_batch % n_microbatches:
            raise LayoutError(
                f"--pp-microbatches {n_microbatches} does not divide each data-parallel rank's batch "
                f"of {local_batch} samples (--global-batch / dp {self.dp}); use a divisor of {local_batch}"
            )
        if self.pp_schedule == "1f1b" and n_microbatches < self.pp:
            raise LayoutError(
                f"--pp-schedule 1f1b needs at least --pp {self.pp} microbatches, got "
                f"--pp-microbatches {n_microbatches}; raise it or use --pp-schedule gpipe"
            )
        if self.pp_schedule == "interleaved-1f1b":
            rounds = max(1, n_microbatches // self.pp)
            if n_microbatches % rounds:
                raise LayoutError(
                    f"--pp-schedule interleaved-1f1b needs --pp-microbatches a multiple of "
                    f"max(1, {n_microbatches} // pp {self.pp}) = {rounds}; use a multiple of --pp {self.pp}"
                )
