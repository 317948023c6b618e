"""How the ranks agree: run a step on rank 0 or on every rank and hand its result, or its error,
to all of them, so an error on one rank stops every rank at once instead of leaving the others
waiting in the next collective. Only rank 0 logs."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from workloads.config import ConfigError

__all__ = ["Ranks", "StoppedElsewhere", "every_rank", "is_every_rank"]

T = TypeVar("T")
E = TypeVar("E", bound=Exception)
# Set on an error that every rank raises alike, so that rank 0 alone prints it (train.main).
_EVERY_RANK = "_gpufleet_every_rank"


def every_rank(err: E) -> E:
    """Mark an error every rank meets alike (rank 0 alone prints it)."""
    setattr(err, _EVERY_RANK, True)
    return err


def is_every_rank(err: BaseException) -> bool:
    return getattr(err, _EVERY_RANK, False)


class StoppedElsewhere(ConfigError):
    """This rank stops because another rank failed; that rank printed why."""


@dataclass
class Ranks:
    """This process's place in the default group, and the two ways its ranks agree."""

    rank: int
    world: int
    device: torch.device

    def on_rank0(self, fn: Callable[[], T]) -> T:
        """Run fn on rank 0 and hand its result, or its error, to every rank."""
        from workloads.checkpoint.store import CheckpointError

        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except (ConfigError, CheckpointError) as e:
                box[0] = (type(e).__name__, str(e))
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        kind, value = box[0]
        if kind == "ConfigError":
            raise every_rank(ConfigError(value))
        if kind == "CheckpointError":
            raise every_rank(CheckpointError(value))
        return value

    def on_every_rank(self, fn: Callable[[], T]) -> T:
        """Run fn on every rank; if it raises ConfigError on any, every rank stops together
        instead of waiting for the failed one in the next collective. A failing rank raises its
        own error (main prints it with the rank and host), the others stop quietly; when every
        rank failed alike, the error counts as shared and rank 0 alone prints it."""
        mine: ConfigError | None = None
        try:
            result = fn()
        except ConfigError as e:
            mine = e
        if self.world > 1:
            said: list[Any] = [None] * self.world
            dist.all_gather_object(said, None if mine is None else str(mine))
            if mine is None and any(m is not None for m in said):
                raise StoppedElsewhere("another rank failed")
            if mine is not None and len(set(said)) == 1:
                raise every_rank(mine)
        if mine is not None:
            raise mine
        return result

    def log(self, line: str, stream: Any = None) -> None:
        if self.rank == 0:
            print(line, file=stream or sys.stdout, flush=True)
