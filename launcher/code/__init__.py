"""What a launch brings to bare nodes: gpufleet's own code and the --sync snapshot
(content-addressed, sent at most once per cluster from the launching machine), and the job's
Python environment, built once per content with uv (launcher.code.prepare; the node side is
launcher.code.node_agent)."""

from launcher.code.prepare import CodeRequest, PrepareReport, prepare
from launcher.code.pyenv import EnvSpec
from launcher.code.snapshot import Snapshot, code_root, code_snapshot, take_snapshot

__all__ = [
    "CodeRequest",
    "PrepareReport",
    "prepare",
    "EnvSpec",
    "Snapshot",
    "code_root",
    "code_snapshot",
    "take_snapshot",
]
