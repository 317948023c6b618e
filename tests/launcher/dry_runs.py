"""Reading a launch's dry run in tests: `--dry-run=json` (launcher.runner.dry_run.as_json) as
(host, the exact remote command) pairs, the node programs, or the typed plans; and the readable
form's node headers."""

from __future__ import annotations

import json
import re
import shlex

from gpufleet.node_plan import NodePlan

__all__ = ["doc", "remote_lines", "programs", "plans", "started", "headers"]


def doc(stdout: str) -> dict:
    """The --dry-run=json document."""
    return json.loads(stdout)


def remote_lines(stdout: str) -> list[tuple[str, str]]:
    """(host, the command the launch runs there), in rank order."""
    return [(n["plan"]["host"], n["remote"]) for n in doc(stdout)["nodes"]]


def programs(stdout: str) -> list[str]:
    """Each node's program (the line that starts its node side with its plan), in rank order."""
    return [n["program"] for n in doc(stdout)["nodes"]]


def plans(stdout: str) -> list[NodePlan]:
    """Each node's typed plan, read back through NodePlan.from_dict, in rank order."""
    return [NodePlan.from_dict(n["plan"]) for n in doc(stdout)["nodes"]]


def started(stdout: str) -> list[tuple[str, ...]]:
    """The argv each node's program starts, in rank order, read from the program itself: its
    last words hand the node's plan to launcher.core.node_run (`node PLAN`)."""
    return [tuple(json.loads(shlex.split(p)[-1])["argv"]) for p in programs(stdout)]


_HEADER = re.compile(r"^\s*node (\d+)  (\S+)")


def headers(stdout: str) -> list[tuple[int, str]]:
    """The readable dry run's (node rank, host) of every node, in order: a block's first line, or
    a folded node's line."""
    return [(int(m.group(1)), m.group(2)) for m in map(_HEADER.match, stdout.splitlines()) if m]
