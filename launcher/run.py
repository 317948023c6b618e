"""The names `launcher.run` offered before a launch's life moved onto `launcher.launch.Launch`.

Kept so that callers not yet moved onto `Launch` (launcher.nccl_cmd, launcher.nccl_from) keep
working unchanged; new code imports from the module that owns each name (listed below).
"""

from __future__ import annotations

from launcher.command import node_commands
from launcher.launch import Interrupted, Launch, NodeEvent, NodeState, launch, preflight
from launcher.model import new_job_id
from launcher.output import root_cause, shown_live, worker_failure_note
from launcher.preflight import Probe, check_probes, handshake_limit
from launcher.transport import Transport, make_transport, state_dir

__all__ = [
    "Launch",
    "NodeEvent",
    "NodeState",
    "Transport",
    "Probe",
    "Interrupted",
    "new_job_id",
    "state_dir",
    "make_transport",
    "preflight",
    "handshake_limit",
    "check_probes",
    "node_commands",
    "worker_failure_note",
    "shown_live",
    "root_cause",
    "launch",
]
