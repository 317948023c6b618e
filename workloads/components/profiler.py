"""The profiler: a torch.profiler trace of --profile-steps a:b for TensorBoard, and the named
ranges (forward, backward, optimizer, pipeline) that it and Nsight (NVTX) show."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import torch

from workloads.config import ConfigError, ProfilingConfig

__all__ = ["Profiler", "trace_range"]


@contextlib.contextmanager
def trace_range(name: str, cuda: bool) -> Iterator[None]:
    """A named range for torch.profiler and, on GPUs, for Nsight (NVTX)."""
    with torch.profiler.record_function(name):
        if cuda:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if cuda:
                torch.cuda.nvtx.range_pop()


class Profiler:
    """Steps a..b-1 of the run traced into `directory` (one trace per rank, `rank{R}`)."""

    def __init__(self, cfg: ProfilingConfig, rank: int, cuda: bool) -> None:
        self.steps, self.directory, self.rank, self.cuda = cfg.step_range, cfg.profile_dir, rank, cuda
        self._prof: torch.profiler.profile | None = None

    def check_dir(self) -> None:
        """Prove the trace directory writable (ConfigError if not): every rank writes its own."""
        where = Path(self.directory)
        probe = where / f".probe-{os.getpid()}"
        try:
            where.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ConfigError(
                f"--profile-dir {where}: cannot write traces there "
                f"({e.strerror or e}); fix its permissions or pass another --profile-dir"
            ) from None

    @contextlib.contextmanager
    def running(self, step: int) -> Iterator[None]:
        """Profile while the block runs, from `step` (a resumed run counts steps already done)."""
        self._prof = self._start(step)
        try:
            yield
        finally:
            if self._prof:
                self._prof.stop()
                self._prof = None

    def _start(self, step: int) -> torch.profiler.profile | None:
        if self.steps is None or self.steps[1] <= step:
            return None
        a, b = max(self.steps[0], step), self.steps[1]
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=a - step, warmup=0, active=b - a, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.directory, worker_name=f"rank{self.rank}"),
        )
        prof.start()
        return prof

    def step(self) -> None:
        """After each training step."""
        if self._prof:
            self._prof.step()
