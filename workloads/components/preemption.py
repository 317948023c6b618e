"""Preemption: a SIGTERM becomes a stop that every rank agrees on at a step boundary.

Compute Engine sends a Spot VM's processes SIGTERM and stops the VM 30 s later
(https://cloud.google.com/compute/docs/instances/spot#preemption-process). The handler only
records the notice; the ranks share it once per step (`notice_age`), so they all stop after the
same step and save one checkpoint together.
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = ["Preemption"]


class Preemption:
    """This rank's SIGTERM notice, and the collective that tells every rank about any rank's."""

    def __init__(self, world: int, device: torch.device) -> None:
        self.world, self.device = world, device
        self.cuda = device.type == "cuda"
        self.requested = False
        self.notice_at = 0.0  # time.monotonic() of this rank's first SIGTERM
        self._posted: tuple[torch.Tensor, Any, float] | None = None  # CUDA: last step's flag

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """SIGTERM sets the flag while the block runs; the previous handler is back after it."""
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag and the time: the save happens at the next step boundary, when all ranks agree.
        if not self.requested:
            self.notice_at = time.monotonic()
        self.requested = True

    def notice_age(self) -> float | None:
        """Collective: None while no rank has had a SIGTERM, else the age in seconds of the
        oldest notice any rank got (what the preemption budget has already spent).

        On CUDA the answer lags one step: this step's flag is reduced on the GPU and copied to
        pinned memory behind an event, and the previous step's is read, so the host never waits
        for the step it just queued (an `.item()` here would drain the GPU's queue every step).
        """
        age = time.monotonic() - self.notice_at if self.requested else -1.0
        if self.world == 1:
            return age if age >= 0 else None
        t = torch.tensor([age], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if not self.cuda:
            age = t.item()
            return age if age >= 0 else None
        return self._read_posted(t)

    def _read_posted(self, t: torch.Tensor) -> float | None:
        """Post this step's reduced flag; read the previous step's (None on the first step)."""
        host = torch.empty(1, dtype=torch.float64, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        posted, self._posted = self._posted, (host, done, time.monotonic())
        if posted is None:
            return None
        host, done, at = posted
        done.synchronize()
        age = float(host[0])
        return age + (time.monotonic() - at) if age >= 0 else None
