"""Step timing: the time per step between two log lines, and each rank's own compute time for
the straggler check."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from workloads.config import MetricsConfig
from workloads.metrics import RankInfo, straggler_warning

__all__ = ["StepClock", "Stragglers"]


class StepClock:
    """Seconds per step since the last lap (the log line's `ms/step`)."""

    def __init__(self, step: int) -> None:
        self.at, self.step = time.perf_counter(), step

    def lap(self, step: int) -> float:
        now = time.perf_counter()
        per_step = (now - self.at) / (step - self.step)
        self.at, self.step = now, step
        return per_step


class Stragglers:
    """Every --straggler-every steps the ranks share their forward-pass times (a rank's own speed
    under DDP, which has no collective in forward); a rank above --straggler-threshold x the
    median is named."""

    def __init__(self, cfg: MetricsConfig, ranks: list[RankInfo], device: torch.device) -> None:
        self.every, self.threshold = cfg.straggler_every, cfg.straggler_threshold
        self.ranks, self.device = ranks, device
        self.cuda = device.type == "cuda"
        self.forward_s = 0.0  # this rank's own compute time since the last check
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time the block as forward time when the check is on (its CUDA events pile up until a
        check reads them, so nothing is recorded when it is off)."""
        if not self.every:
            yield
            return
        start = self._mark()
        yield
        if self.cuda:
            self._events.append((start, self._mark()))
        else:
            self.forward_s += time.perf_counter() - start

    def _mark(self) -> Any:
        if self.cuda:  # host timers would see only kernel launches; CUDA events see the GPU
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _take(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.forward_s += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        taken, self.forward_s = self.forward_s, 0.0
        return taken

    def check(self, step: int, warn: Callable[[str], None]) -> None:
        """Collective at every `every`-th step: each straggler's warning line through `warn`."""
        if not self.every or step % self.every:
            return

        times: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(times, self._take() / self.every)
        for line in straggler_warning(times, self.ranks, self.threshold):
            warn("warning: " + line)
