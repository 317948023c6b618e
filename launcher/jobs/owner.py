"""What a detached job's collaborators may read and change of its controller: the typed interface
(a Protocol) that launcher.jobs.recovery's Recoverer and launcher.jobs.adopt's re-adoption take,
instead of the controller object itself (launcher.jobs.controller.Controller satisfies it). The
job's record changes through `record`, `save()` and `end()`/`finish()` only, as SkyPilot's
sky/jobs/state.py keeps a job's state behind one interface."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO, runtime_checkable

from launcher.core.types import LaunchResult
from launcher.jobs.record import JobRecord, JobState

if TYPE_CHECKING:  # the sessions and threads are imported by whoever runs a launch
    from launcher.core.launch import Launch, NodeEvent
    from launcher.observe.job_metrics import JobMetrics

__all__ = ["JobOwner"]


@runtime_checkable
class JobOwner(Protocol):
    """One detached job's controller, as its recovery and its re-adoption see it."""

    jobdir: Path  # the job's directory on the job host
    record: JobRecord  # the job's record; saved with save()
    request: dict[str, Any]  # request.json: the cluster, the config, --recover's policy
    env: list[list[str]]  # the --env values (env.json), kept while a relaunch may need them
    stop: threading.Event  # set by `launch stop` (SIGTERM): every launch of the job stops
    launch: Launch | None  # the attempt running now
    metrics: JobMetrics | None  # the job's sampling, while it runs
    preempted: bool  # this attempt's output said a node was preempted
    last_step: int | None  # the last training step this attempt's output named
    orphan_stopped: bool  # a node stopped its run itself: no controller for --controller-grace
    started_at: float  # time.monotonic() when this controller started

    def save(self) -> None:
        """Write the record (atomically)."""

    def say(self, text: str) -> None:
        """One line of the controller's own in the job's log (a recovery, a relaunch, why)."""

    def end(
        self,
        state: JobState,
        code: int,
        why: str = "",
        node: int | None = None,
        tail: list[str] | None = None,
        reason: str = "",
    ) -> int:
        """End the job in `state` with exit status `code`; returns `code`."""

    def finish(self, result: LaunchResult, note: str = "") -> int:
        """End the job as `result` says; returns its exit status."""

    def on_event(self, out: TextIO, event: NodeEvent) -> None:
        """A node's line or state change: into the job's output, marks and preemption."""

    def note_run(self, launch: Launch) -> None:
        """Record which attempt runs on which nodes, once per launch."""

    def reset_attempt(self) -> None:
        """A relaunch starts: forget what the last attempt's output said."""
