"""Detached jobs: the record on node 0 (record), the client's hand-off (handoff), the client's
SSH to node 0 (node0), the refusal of an attached launch on nodes a detached job holds (busy),
every account's jobs on the nodes as their holds say (holds, over launcher.core.holds), the
controller that runs the job on node 0 (`python -m launcher.jobs.controller JOBDIR`, not imported
here), its re-adoption of a job whose controller died (adopt), its recovery (recovery) and, for a
user's own program, the restart reasons and budget (restarts). No click, no rich: node 0 runs this
package with `python -S`.

A job's life, each state one `JobState` value the controller writes to `state.json`:

    PENDING ──> RUNNING ──> SUCCEEDED | FAILED | STOPPED
       │           ↑  └──> RECOVERING ──> FAILED | STOPPED   (--recover: launcher.jobs.recovery)
       │           └────────────┘  (every node back and checked: relaunched with --resume)
       └──────────────────> STOPPED   (`launch stop` while it waited)

PENDING: an earlier job (first in, first out) on any of the same nodes is still pending or
running. RUNNING, PENDING or RECOVERING whose controller is gone is still so while its nodes wait
for one (--controller-grace; a controller started again re-adopts it: adopt), then reads as FAILED.
"""

from __future__ import annotations

from launcher.jobs.busy import BusyCheck
from launcher.jobs.handoff import detach
from launcher.jobs.node0 import Node0, job_host
from launcher.jobs.record import JobRecord, JobState, check_job_id
from launcher.jobs.recovery import Recoverer, RecoverPolicy, recover_policy

__all__ = [
    "BusyCheck",
    "JobRecord",
    "JobState",
    "Node0",
    "RecoverPolicy",
    "Recoverer",
    "check_job_id",
    "detach",
    "job_host",
    "recover_policy",
]
