"""A detached job's own `launch top --record`: while the job runs, its controller on
node 0 samples every node of the job into the job record, `~/.gpufleet/jobs/<id>/top.jsonl`,
in the same JSONL schema as `launch top --record` (launcher.observe.top.SCHEMA; the session is the job
id), so `launch top --plot JOB_ID` can draw the whole run afterwards.

The sampling is `launch top`'s own: one long-lived session per node (launcher.observe.top.TopSampler
running launcher.observe.sampler's node program) over the controller's SSH (the cluster key, the job's
known_hosts, no connection sharing). `stop()` closes every session's input, which ends each
node's loop at once; should the controller be killed instead, its end of every session closes
with it and each node's loop ends the same way. Nothing is left on any node.

Sampling is a by-product: it never fails the job. A sampler that cannot start is logged in
controller.log and the job runs unsampled.

The interval is 10 s (coarser than the live view's 1 s: it samples for the whole job);
GPUFLEET_JOB_TOP_INTERVAL in the controller's environment (node 0's) overrides it, for tests
that should not wait.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from launcher.core.transport import make_transport
from launcher.core.types import Cluster, LaunchConfig
from launcher.observe.top import Recorder, TopSampler, role_plan

__all__ = ["INTERVAL_S", "INTERVAL_ENV", "JobMetrics", "interval", "start"]

log = logging.getLogger("launcher")

# The samples' file in the job's directory on node 0.
# Issue 15: "the controller samples every 10 s into the job record".
INTERVAL_S = 10.0
INTERVAL_ENV = "GPUFLEET_JOB_TOP_INTERVAL"
_LIMITS = (0.1, 3600.0)  # launch top's --interval limits


def interval(environ: dict[str, str] | None = None) -> float:
    """INTERVAL_S, or GPUFLEET_JOB_TOP_INTERVAL (seconds) when it holds a number in 0.1..3600; a
    value that does not is logged and ignored (the job must not fail for its sampling)."""
    raw = (os.environ if environ is None else environ).get(INTERVAL_ENV, "").strip()
    if not raw:
        return INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not _LIMITS[0] <= value <= _LIMITS[1]:
        log.warning(
            "%s=%r is not a number of seconds in %g..%g; sampling every %g s", INTERVAL_ENV, raw, *_LIMITS, INTERVAL_S
        )
        return INTERVAL_S
    return value


class JobMetrics:
    """The running sampler of one job; `stop()` ends it (safe to call twice, never raises)."""

    def __init__(self, sampler: TopSampler | None, recorder: Recorder | None):
        self.sampler = sampler
        self.recorder = recorder

    @property
    def path(self) -> Path | None:
        return self.recorder.path if self.recorder else None

    def stop(self) -> None:
        sampler, recorder, self.sampler, self.recorder = self.sampler, self.recorder, None, None
        try:
            if sampler is not None:
                sampler.stop()
        except Exception:  # a by-product: the job's end must still be recorded
            log.exception("stopping the job's sampler failed")
        finally:
            if recorder is not None:
                recorder.close()
                log.info("sampling stopped: %d samples in %s", recorder.lines, recorder.path)


def start(cluster: Cluster, config: LaunchConfig, path: Path, interval_s: float | None = None) -> JobMetrics:
    """Start sampling every node of `cluster` into `path` (appended to) every `interval_s`
    (default: `interval()`), over the SSH `config` names. Never raises: on failure it logs why
    and returns a handle that samples nothing."""
    iv = interval() if interval_s is None else interval_s
    recorder = None
    try:
        recorder = Recorder(Path(path), config.job_id or "job")
        sampler = TopSampler(
            cluster,
            make_transport(cluster, config.ssh, config.dry_run).argv,
            interval_s=iv,
            plan=role_plan(cluster.machine_type, config.image_os),
            on_row=recorder.write,
            concurrency=config.ssh.concurrency,
        )
        sampler.start()
    except Exception as e:
        log.warning("the job runs unsampled: cannot start its sampler (%s: %s)", type(e).__name__, e)
        if recorder is not None:
            recorder.close()
        return JobMetrics(None, None)
    log.info("sampling %d nodes every %g s into %s", len(cluster.nodes), iv, path)
    return JobMetrics(sampler, recorder)
