"""Reading what the nodes print: which lines stay out of the live stream (torchrun's agent log
lines and its `ChildFailedError` report go to the node's log only), which lines make up a
traceback of the user's own code (shown once, from the first rank that raised it), what a
torchrun worker-failure line means, which node to name as the cause when several fail, and the
one line that says so. Pure functions over lines and outcomes, but for `kept_nodes`, which reads
the run directory's KEPT_FILE (the nodes that kept their own logs, launcher.code.launch_tree)."""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path
from typing import NamedTuple

from gpufleet.contracts import ERROR_LINE_PREFIXES, JSON_MARKER
from launcher.core.types import LaunchResult, NodeOutcome, WorkerFailure
from launcher.core.wire import EXIT_MARKER, STOP_REPORT

__all__ = [
    "worker_failure",
    "worker_failure_note",
    "shown_live",
    "is_agent_line",
    "Sorted",
    "StreamSorter",
    "traceback_key",
    "root_cause",
    "failure_line",
    "OUTPUT_MODES",
    "OUTPUT_ALL_UP_TO",
    "default_output",
    "LiveFilter",
    "KEPT_FILE",
    "launch_reads",
    "kept_nodes",
]

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


def worker_failure(line: str) -> WorkerFailure | None:
    """The worker failure a torchrun agent line reports, if it is one."""
    m = _WORKER_FAILED_RE.search(line)
    return WorkerFailure(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def worker_failure_note(line: str) -> str | None:
    """What a torchrun worker-failure line means, in words ("exit 1", "killed by SIGKILL")."""
    failure = worker_failure(line)
    return failure.note if failure else None


def shown_live(line: str) -> bool:
    """Whether a node's output line belongs in the live stream (every line goes to its log)."""
    return not _HIDDEN_LINE_RE.search(line)


# torchrun's agent logs through torch's logging handler (torch/_logging), in glog's layout: level
# letter, MMDD, time, thread id, the source path and line, "]". Only the agent's own modules
# (torch/distributed/elastic/..., torch/distributed/run.py, torch/distributed/launcher/...) are
# hidden, not whatever the workers log the same way. For instance:
#   E1125 13:08:32.500000 8121 .../torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) ...
_AGENT_LINE_RE = re.compile(
    r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/(?:elastic/|run\.py|launcher/)\S*:\d+\] "
)

# Once a worker has called init_process_group, torch.distributed's excepthook prefixes each line
# of its uncaught traceback with its global rank, "[rank1]: " (torch/distributed/distributed_c10d.py,
# `_distributed_excepthook`).
_RANK_PREFIX_RE = re.compile(r"^(\[rank\d+\]: )")
_TRACEBACK_START = "Traceback (most recent call last):"
# A traceback frame; torchrun's own frames are its modules' and runpy's, which starts it.
_FRAME_RE = re.compile(r'^\s+File "([^"]*)", line \d+')
_TORCHRUN_FRAME_RE = re.compile(r"/torch/distributed/|^<frozen runpy>$")
# What Python prints between the tracebacks of a chain (traceback.py).
_CHAIN_LINES = frozenset(
    {
        "",
        "The above exception was the direct cause of the following exception:",
        "During handling of the above exception, another exception occurred:",
    }
)
# c10d's TCPStore, as seen by torchrun's agent (or a worker) when a peer's store went away: a
# C++ warning and the C++ stack under it, down to a blank line. For instance:
#   [W1125 13:13:19.142413972 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=3, ...
#   Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 ...
#   frame #0: c10::Error::Error(c10::SourceLocation, ...
#   <omitting python frames>
_STORE_LINE_RE = re.compile(r"^\[[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ TCPStore\.cpp:\d+\] \[c10d\] ")
_CPP_STACK_RE = re.compile(r"^(?:Exception raised from |frame #\d+: |<omitting python frames>)")
# The exception torchrun's agent raises when a worker failed (torch/distributed/launcher/api.py),
# followed by its report between two rules of "=" (errors/__init__.py, ChildFailedError.format_msg).
_CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_RULE = "=" * 20


def is_agent_line(line: str) -> bool:
    """Whether `line` is one of torchrun's agent log lines (node log only, never live)."""
    return bool(_AGENT_LINE_RE.match(line))


class Sorted(NamedTuple):
    """Where a line (or a traceback's lines) goes: `live` (the live stream and the node's log),
    `log` (the node's log only) or `traceback` (a user traceback, `text` its lines joined by
    newlines: live once across the launch, see `traceback_key`)."""

    kind: str
    text: str


class StreamSorter:
    """Sorts one output stream of one node, line by line, into `Sorted` pieces.

    A traceback is held back until its exception line arrives: torchrun's own (every frame in
    torch.distributed or runpy; `ChildFailedError` with the report after it, or a rendezvous
    error once a peer is gone) goes to the log only, with the lines that chain it to the next;
    anything else is the user's and comes out whole, as one `traceback` piece. Tracebacks of
    different ranks on one node (each line prefixed "[rankN]: ") are told apart by that prefix.
    The agent's log lines and c10d's TCPStore warnings (with their C++ stack) go to the log."""

    def __init__(self) -> None:
        self._open: dict[str, list[str]] = {}  # by rank prefix ("" for none): a traceback so far
        self._rules: int | None = None  # inside torchrun's report: how many "=" rules seen
        self._after_own = False  # just after torchrun's own traceback or a TCPStore warning

    def feed(self, line: str) -> list[Sorted]:
        if self._rules is not None:
            if line.startswith(_RULE):
                self._rules += 1
                if self._rules == 2:
                    self._rules = None
            return [Sorted("log", line)]
        if is_agent_line(line):
            return [Sorted("log", line)]
        if _STORE_LINE_RE.match(line):
            self._after_own = True
            return [Sorted("log", line)]
        if self._after_own and (line in _CHAIN_LINES or _CPP_STACK_RE.match(line)):
            return [Sorted("log", line)]
        self._after_own = False
        m = _RANK_PREFIX_RE.match(line)
        prefix = m.group(1) if m else ""
        body = line[len(prefix) :]
        block = self._open.get(prefix)
        if block is None:
            if body == _TRACEBACK_START:
                self._open[prefix] = [line]
                return []
            return [Sorted("live", line)]
        block.append(line)
        if body.startswith((" ", "\t")):
            return []  # a frame, or the source line under it
        del self._open[prefix]  # the exception line ends it
        if _torchruns_own(block):
            self._rules = 0 if body.startswith(_CHILD_FAILED) else None
            self._after_own = True
            return [Sorted("log", x) for x in block]
        return [Sorted("traceback", "\n".join(block))]

    def flush(self) -> list[Sorted]:
        """At the end of the stream: a traceback cut short comes out line by line."""
        out = [Sorted("live", x) for block in self._open.values() for x in block]
        self._open.clear()
        return out


def _torchruns_own(block: list[str]) -> bool:
    frames = [m.group(1) for m in map(_FRAME_RE.match, (_RANK_PREFIX_RE.sub("", x) for x in block)) if m]
    return bool(frames) and all(_TORCHRUN_FRAME_RE.search(f) for f in frames)


def traceback_key(text: str) -> str:
    """What makes two ranks' tracebacks "the same one": their frames and the exception's type,
    without the rank prefixes and the message (which often names the rank)."""
    lines = [_RANK_PREFIX_RE.sub("", x) for x in text.split("\n")]
    return "\n".join([*lines[:-1], lines[-1].partition(":")[0]])


def root_cause(outcomes: dict[int, NodeOutcome], arrival: list[int]) -> int | None:
    """Which node to name as having failed first.

    Arrival order alone misleads: when one rank fails, its peers' collectives fail too (gloo
    "Connection reset by peer", an abort), and a peer's torchrun may report before the failing
    node's does. So: a node that became unreachable first (itself, before one cut off with it down
    a tree); then a node whose program said what went wrong (an error line) before the launcher
    stopped it; then the first to exit."""

    def rank_of(r: int) -> tuple[int, int]:
        o = outcomes[r]
        lost = 0 if o.cut_off_by is None else 1
        kind = lost if o.connection_lost else 2 if o.reported_error_before_stop else 3
        return kind, arrival.index(r)

    candidates = [
        r for r in arrival if not outcomes[r].ok and (not outcomes[r].stopped or outcomes[r].reported_error_before_stop)
    ]
    return min(candidates, key=rank_of) if candidates else None


def failure_line(result: LaunchResult) -> str | None:
    """The one line that names the node that failed first, its host, how, and its log."""
    if result.first_failure is None:
        return None
    o = result.outcomes[result.first_failure]
    if o.connection_lost:
        what = f"unreachable ({o.error})"
    elif o.worker is not None:
        what = o.worker.note + (f" (exit {o.worker.status})" if o.worker.exitcode < 0 else "")
    else:
        what = o.status
    rank = o.node.rank
    if rank in kept_nodes(result.run_dir):
        return f"{o.node.label} failed first: {what}; its log is on the node: launch logs {result.job_id} --node {rank}"
    return f"{o.node.label} failed first: {what}; its log: {result.run_dir / f'node-{rank}.log'}"


# ---- the summary table ----

# Up to this many nodes the summary table has a row per node; above, consecutive nodes that ended
# alike share one (`0-127 | 128 nodes | exit 0 | 0.0-0.2 s`), so a failure stands out of 200 rows.
TABLE_EVERY_NODE_UP_TO = 16


class ResultRow(NamedTuple):
    """One row of a launch's summary table: node(s), host(s), status, duration; `kind`: ok,
    stopped or failed (how it is drawn)."""

    node: str
    host: str
    status: str
    duration: str
    kind: str


def result_rows(result: LaunchResult) -> list[ResultRow]:
    """The summary table's rows, in rank order (grouped above TABLE_EVERY_NODE_UP_TO nodes)."""
    groups: list[list[NodeOutcome]] = []
    outcomes = [result.outcomes[r] for r in sorted(result.outcomes)]
    group = len(outcomes) > TABLE_EVERY_NODE_UP_TO
    for o in outcomes:
        last = groups[-1][-1] if groups else None
        if group and last is not None and (last.status, last.ok, last.stopped) == (o.status, o.ok, o.stopped):
            groups[-1].append(o)
        else:
            groups.append([o])
    rows = []
    for g in groups:
        first, end = g[0], g[-1]
        kind = "ok" if first.ok else "stopped" if first.stopped else "failed"
        if len(g) == 1:
            took = f"{first.duration_s:.1f} s"
            rows.append(ResultRow(str(first.node.rank), first.node.host, first.status, took, kind))
            continue
        low, high = min(o.duration_s for o in g), max(o.duration_s for o in g)
        took = f"{low:.1f} s" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f} s"
        rows.append(ResultRow(f"{first.node.rank}-{end.node.rank}", f"{len(g)} nodes", first.status, took, kind))
    return rows


# ---- --output: which nodes' lines a launch shows live (every line goes to its log regardless) ----

# all: every node's; rank0: node 0's (the others' only when they fail); failures: only a failed
# node's, when it fails.
OUTPUT_MODES = ("all", "rank0", "failures")
# Up to this many nodes a launch shows every node's output by default; above, node 0's.
OUTPUT_ALL_UP_TO = 16
# The lines of a node not shown live that come out when it fails: its last TAIL_LINES.
TAIL_LINES = 40


def default_output(nodes: int) -> str:
    """--output when it is not given: every node's lines up to OUTPUT_ALL_UP_TO nodes, node 0's
    above (128 nodes' lines interleaved are read by no one)."""
    return "all" if nodes <= OUTPUT_ALL_UP_TO else "rank0"


class LiveFilter:
    """Which lines of a launch's nodes are shown live under --output `mode` (OUTPUT_MODES). A
    node whose lines are held keeps its last TAIL_LINES; if it fails (its own failure, or lost),
    they come out then, once. `summary()` says, in one line, what was shown and what the nodes
    not shown did. Every line reaches the node's log whatever is shown."""

    def __init__(self, mode: str, nodes: int):
        if mode not in OUTPUT_MODES:
            raise ValueError(f"--output {mode!r}: one of {', '.join(OUTPUT_MODES)}")
        self.mode, self.nodes = mode, nodes
        self._held: dict[int, deque[str]] = {}
        self._ended: dict[int, str] = {}  # rank -> its final state's value
        self._counts: dict[int, int] = {}  # rank -> lines held back so far
        # How many of the nodes not shown live are in each state, kept as they end: the status
        # line asks after every node's end, and a count over every node each time would grow
        # with the square of the nodes.
        rest = sum(1 for r in range(nodes) if not self.live(r))
        self._states: dict[str, int] = {"running": rest} if rest else {}

    def live(self, rank: int) -> bool:
        return self.mode == "all" or (self.mode == "rank0" and rank == 0)

    def line(self, rank: int, text: str) -> list[str]:
        """`text` to show now ([] when it is held)."""
        if self.live(rank):
            return [text]
        self._held.setdefault(rank, deque(maxlen=TAIL_LINES)).append(text)
        self._counts[rank] = self._counts.get(rank, 0) + 1
        return []

    def ended(self, rank: int, state: str) -> list[str]:
        """A node's final state ("exited", "failed", "unreachable", "stopped"): the lines it held
        to show now, when it failed on its own or was lost."""
        if not self.live(rank) and 0 <= rank < self.nodes:
            before = self._ended.get(rank, "running")
            self._states[before] -= 1
            if not self._states[before]:
                del self._states[before]
            self._states[state] = self._states.get(state, 0) + 1
        self._ended[rank] = state
        held = self._held.pop(rank, None)
        if state not in ("failed", "unreachable") or not held:
            return []
        skipped = self._counts.get(rank, 0) - len(held)
        head = [f"(its last {len(held)} lines; {skipped} before them in its log)"] if skipped else []
        return [*head, *held]

    def summary(self) -> str | None:
        """One line on the nodes not shown live (None under "all")."""
        if self.mode == "all":
            return None
        shown = "node 0's output" if self.mode == "rank0" else "a failed node's output"
        rest = sum(self._states.values())
        words = ", ".join(f"{n} {state}" for state, n in sorted(self._states.items(), key=lambda kv: -kv[1]))
        other = "the other" if self.mode == "rank0" else "all"
        return f"--output {self.mode}: {shown} shown live; {other} {rest} node{'s' * (rest != 1)}: {words}"


# ---- a node that keeps its output (a launch down a tree, launcher.code.launch_tree) ----

# In a run's directory: the nodes that kept their output on the node, {"RANK": {"address", "log"}}
# under "nodes" (`launch logs` reads it there, through the tree).
KEPT_FILE = "kept.json"


def launch_reads() -> list[str]:
    """The regexes of the lines the launch itself reads from a node's output once it runs (what
    launcher.core.session and launcher.core.launch act on; every other line is for people): the
    exit marker, a stop's reports, an error line, a torchrun worker's failure, the sweep's rows.
    A node that keeps its output sends these up all the same."""
    starts = [STOP_REPORT, JSON_MARKER, *ERROR_LINE_PREFIXES]
    return [re.escape(EXIT_MARKER), _WORKER_FAILED_RE.pattern, *("^" + re.escape(p) for p in starts)]


def kept_nodes(run_dir: Path) -> dict[int, dict]:
    """The nodes of the run in `run_dir` that kept their output on the node, by rank ({} for none)."""
    try:
        doc = json.loads((run_dir / KEPT_FILE).read_text())
        return {int(rank): dict(node) for rank, node in doc["nodes"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or not ours to read
        return {}
