"""Reading what the nodes print: which lines are a program's own error, which stay out of the
live stream, what a torchrun worker-failure line means, and which node to name as the cause
when several fail. Pure functions over lines and outcomes."""

from __future__ import annotations

import re
import signal

from gpufleet.contracts import JSON_MARKER
from launcher.core.types import NodeOutcome

__all__ = ["worker_failure_note", "shown_live", "root_cause"]

# torchrun's agent logs a failed worker at ERROR level, also when it is about to restart the
# group (torch/distributed/elastic/multiprocessing/api.py): "failed (exitcode: -9) local_rank: 0
# (pid: 123) of binary: ...". Its "will restart worker group" line is INFO, hidden by default.
_WORKER_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")

# Lines that stay in the node's log but out of the live stream (and the failure tail): the
# sweep's machine-readable row document (several kB on one line, read back from the log), and
# c10d's warning when reverse DNS of a peer's address fails (torch/csrc/distributed/c10d/socket.cpp;
# harmless, and printed on every connection where the nodes' addresses have no PTR record).
_HIDDEN_LINE_RE = re.compile(
    "^" + re.escape(JSON_MARKER) + r"|\[c10d\] The hostname of the client socket cannot be retrieved"
)


def worker_failure_note(line: str) -> str | None:
    """What a torchrun worker-failure line means, in words ("exit 1", "killed by SIGKILL")."""
    m = _WORKER_FAILED_RE.search(line)
    if not m:
        return None
    code, local_rank = int(m.group(1)), m.group(2)
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit {code}"
    return f"worker local_rank {local_rank} (pid {m.group(3)}) {how}"


def shown_live(line: str) -> bool:
    """Whether a node's output line belongs in the live stream (every line goes to its log)."""
    return not _HIDDEN_LINE_RE.search(line)


def root_cause(outcomes: dict[int, NodeOutcome], arrival: list[int]) -> int | None:
    """Which node to name as having failed first.

    Arrival order alone misleads: when one rank fails, its peers' collectives fail too (gloo
    "Connection reset by peer", an abort), and a peer's torchrun may report before the failing
    node's does. So: a node that became unreachable first; then a node whose program said what
    went wrong (an error line) before the launcher stopped it; then the first to exit."""

    def rank_of(r: int) -> tuple[int, int]:
        o = outcomes[r]
        kind = 0 if o.connection_lost else 1 if o.reported_error_before_stop else 2
        return kind, arrival.index(r)

    candidates = [
        r for r in arrival if not outcomes[r].ok and (not outcomes[r].stopped or outcomes[r].reported_error_before_stop)
    ]
    return min(candidates, key=rank_of) if candidates else None
