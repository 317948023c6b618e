"""Hang detection: when a running job has made no progress for `--hang-timeout`, the launch
collects every worker's stack (launcher.core.stacks), names the culprit and stops the job.

Progress is a new output line from any rank, or, with `--progress REGEX`, a line matching it
(`step \\d+`): a job that prints a heartbeat while its training loop is stuck is still caught.
`HangWatch` is fed the launch's line stream (`Launch._on_line`) and asked, on every turn of the
launch's loop, whether the silence has lasted too long; its clock is injected so a test drives
it without waiting. Until the first progress line the limit is at least `STARTUP_S`: torchrun's
agent importing torch, the rendezvous and the workers' own imports take tens of seconds on a
busy or large cluster, and a timeout meant for the training loop must not fire during them.

On by default for `launch train` (10 min), off for `launch run` (a user's script may rightly be
quiet for long: give `--hang-timeout` there). NCCL jobs also get PyTorch's flight recorder
(`flight_recorder_env`), whose per-rank dumps are copied back beside the stacks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from launcher.core.types import UserError

__all__ = [
    "TRAIN_HANG_TIMEOUT",
    "STARTUP_S",
    "HANG_OFF",
    "HangWatch",
    "parse_progress",
    "flight_recorder_prefix",
    "flight_recorder_env",
    "FR_ALIASES",
]

# `launch train`'s default. PyTorch's own NCCL watchdog waits 10 min for a collective
# (torch.distributed.constants.default_pg_nccl_timeout), and a stuck rank outside any
# collective is never caught by it; a training step of the built-in workload takes seconds.
TRAIN_HANG_TIMEOUT = "10m"

HANG_OFF = "off"  # --hang-timeout off
# The least time a job gets to print its first progress line.
STARTUP_S = 180.0


def parse_progress(pattern: str | None, hang_timeout_s: float | None) -> str | None:
    """`--progress REGEX`, checked: a valid regular expression, and only with a hang timeout."""
    if pattern is None:
        return None
    try:
        re.compile(pattern)
    except re.error as e:
        raise UserError(
            f"--progress {pattern!r} is not a valid regular expression ({e}); give one like 'step \\d+'"
        ) from None
    if hang_timeout_s is None:
        raise UserError(f"--progress {pattern!r} only counts with a hang timeout; add --hang-timeout 10m")
    return pattern


class HangWatch:
    """Whether a running job has gone `timeout_s` without progress. `start()` when the workload
    starts, `saw(line)` for every output line; `overdue()` is true once, the first time the
    silence exceeds the limit (the launch then acts on it): `timeout_s`, or before the first
    progress line at least `startup_s`."""

    def __init__(
        self,
        timeout_s: float,
        progress: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        startup_s: float = STARTUP_S,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self.progress = re.compile(progress) if progress is not None else None
        self._clock = clock
        self._last: float | None = None  # when progress was last seen; None before start()
        self._started = False  # a progress line has been seen
        self._fired = False

    def start(self) -> None:
        self._last = self._clock()

    def saw(self, line: str) -> None:
        if self._last is not None and (self.progress is None or self.progress.search(line)):
            self._last = self._clock()
            self._started = True

    def silent_for(self) -> float:
        """Seconds since the last progress (0 before start)."""
        return 0.0 if self._last is None else self._clock() - self._last

    @property
    def limit_s(self) -> float:
        return self.timeout_s if self._started else max(self.timeout_s, self.startup_s)

    def overdue(self) -> bool:
        if self._fired or self._last is None or self.silent_for() <= self.limit_s:
            return False
        self._fired = True
        return True


def flight_recorder_prefix(job_id: str) -> str:
    """Where a rank of the job writes its flight-recorder dump on its node: this prefix plus its
    global rank (torch/csrc/distributed/c10d/FlightRecorder.cpp, DebugInfoWriter: the file is
    the prefix followed by the rank). A flat name in /tmp, since the writer does not create a
    directory, and the job id keeps two jobs apart."""
    return f"/tmp/gpufleet-{job_id}-nccl_trace_rank_"


def flight_recorder_env(job_id: str) -> dict[str, str]:
    """PyTorch's NCCL flight recorder for the job's workers, by the names torch 2.8 and later
    read (torch/csrc/distributed/c10d/FlightRecorder.hpp and ProcessGroupNCCL.hpp; they warn,
    once per rank, when an older name is set):
    - TORCH_FR_BUFFER_SIZE: the ring buffer of the last 2000 collective events;
    - TORCH_NCCL_DUMP_ON_TIMEOUT: dump it when NCCL's watchdog times out;
    - TORCH_FR_DUMP_TEMP_FILE: where;
    - TORCH_NCCL_DEBUG_INFO_PIPE_FILE: each rank opens the named pipe `<prefix><rank>.pipe`, and
      a write to it makes that rank dump now (ProcessGroupNCCL.hpp, DumpPipe); the stack
      collection writes to it, so the dumps exist when gpufleet, not NCCL, saw the hang first.
    A torch older than 2.8 reads only the older names (FR_ALIASES): the node sets them too when
    its torch is one of those (the plan's prepare step, launcher.core.node_start).
    Documented at https://docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html."""
    prefix = flight_recorder_prefix(job_id)
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix,
    }


# The names torch 2.4-2.7 read for the two settings that torch 2.8 renamed (the alias lists in
# torch 2.8's FlightRecorder.hpp: {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, ...).
FR_ALIASES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}
