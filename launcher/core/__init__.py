"""The launch itself, stdlib only (node 0's controller runs it with `python -S`): the types
(`LaunchConfig` asked, `Cluster` of `Node`s that exist, `LaunchResult` that happened), each
node's env and command, the SSH transport and sessions, the pre-start check, and the `Launch`
that owns one launch's life. No click, no rich: the CLI (launcher.cli) renders what it returns."""

from __future__ import annotations

from launcher.core.env import node_env
from launcher.core.launch import Interrupted, Launch, NodeEvent, NodeState
from launcher.core.program import ProgramBuilder, node_commands
from launcher.core.transport import Transport, make_transport
from launcher.core.types import (
    Cluster,
    ControllerHost,
    LaunchConfig,
    LaunchResult,
    Node,
    NodeOutcome,
    SshConfig,
    UserError,
    Workload,
    new_job_id,
)

__all__ = [
    "Cluster",
    "ControllerHost",
    "Interrupted",
    "Launch",
    "LaunchConfig",
    "LaunchResult",
    "Node",
    "NodeEvent",
    "NodeOutcome",
    "NodeState",
    "ProgramBuilder",
    "SshConfig",
    "Transport",
    "UserError",
    "Workload",
    "make_transport",
    "new_job_id",
    "node_commands",
    "node_env",
]
