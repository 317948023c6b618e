"""`launch nccl-tests`' library: parse a sweep's output (ours or NVIDIA nccl-tests'), judge its
rows, render and store them, find a slow node, and the mpirun command. No torch, no pulumi; the
command itself is launcher.cli.cmd_nccl_tests."""

from __future__ import annotations

from launcher.nccl.badnodes import BadNodeSearch
from launcher.nccl.judge import expected_judgement, failures, verdict
from launcher.nccl.mpirun import nccl_tests_command
from launcher.nccl.parse import parse_output
from launcher.nccl.render import table_rows, write_results

__all__ = [
    "BadNodeSearch",
    "expected_judgement",
    "failures",
    "nccl_tests_command",
    "parse_output",
    "table_rows",
    "verdict",
    "write_results",
]
