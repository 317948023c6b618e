"""Logging and metrics: the per-step log line (rank 0) and its JSON record in --metrics-file."""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

import torch

from workloads.collective import Ranks
from workloads.config import ConfigError
from workloads.metrics import format_log_line
from workloads.model import mfu

__all__ = ["MetricsLogger", "check_writable_file", "unwritable"]


class MetricsLogger:
    """Rank 0's step lines: step, loss, lr, step time, tokens/s, MFU against `peak_flops` (the
    GPU's dense bf16 peak from gpufleet.catalog, None off GPUs; bf16's under fp8 too, so runs
    compare), the effective model TFLOP/s per GPU and peak memory; each also as one
    JSON line in --metrics-file, opened for the whole run so a bad path fails before step 1.
    `flops_token` and `peak_flops` are set once the model is built."""

    def __init__(self, comms: Ranks, path: str | None, device: torch.device) -> None:
        self.comms, self.device = comms, device
        self.flops_token = 0.0
        self.peak_flops: float | None = None
        self.out: IO[str] | None = None
        if path:
            comms.on_rank0(lambda: self._open(path))

    def _open(self, path: str) -> None:
        try:
            self.out = open(path, "a")
        except OSError as e:
            raise ConfigError(unwritable("--metrics-file", path, e)) from None

    def log(self, line: str, stream: Any = None) -> None:
        self.comms.log(line, stream)

    def log_step(self, step: int, steps: int, loss: float, lr: float, step_s: float, tokens_per_s: float) -> None:
        per_gpu_mfu = mfu(self.flops_token, tokens_per_s / self.comms.world, self.peak_flops)
        # The model FLOP/s one GPU achieved: what fp8 raises beyond MFU's bf16 peak.
        tflops = self.flops_token * tokens_per_s / self.comms.world / 1e12
        cuda = self.device.type == "cuda"
        mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None
        self.log(format_log_line(step, steps, loss, lr, step_s, tokens_per_s, per_gpu_mfu, mem, tflops))
        if self.out:  # rank 0
            record = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "step_s": step_s,
                "tokens_per_s": tokens_per_s,
                "mfu": per_gpu_mfu,
                "tflops_per_gpu": tflops,
                "peak_mem_gib": mem,
                "time": time.time(),
            }
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()  # whole lines, readable while the run goes on

    def close(self) -> None:
        if self.out:
            self.out.close()
            self.out = None


def unwritable(flag: str, path: str, err: OSError) -> str:
    return (
        f"{flag} {path}: cannot write it ({err.strerror or err}); create its directory, "
        f"fix its permissions or pass another {flag}"
    )


def check_writable_file(flag: str, path: str) -> None:
    """Prove a file that is written at the end of the run writable now (ConfigError if not);
    a file that did not exist is removed again."""
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):  # append: an existing file is left as it is
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise ConfigError(unwritable(flag, path, e)) from None
