"""A detached job's timeline, goodput, node-hours and cost, from its record (launcher.jobs.record).

The categories follow Google's ml-goodput-measurement (github.com/AI-Hypercomputer/
ml-goodput-measurement, README "Badput Breakdown Details" and src/goodput.py): goodput is the
job's productive time over its total time, where the total starts when the job starts (its
`record_job_start_time`), and the rest is badput. Here every second from submission to the end
(or now) is in exactly one segment:

    queued      PENDING: waiting for earlier jobs on the same nodes. Not the job's time on its
                nodes: left out of goodput's denominator and of node-hours.
    starting    from a start or relaunch to the attempt's first progress mark: checks, torchrun,
                model build, checkpoint restore (ml-goodput's accelerator initialization,
                training prep, program startup and checkpoint restore)
    productive  from the first progress mark on, while the attempt runs
    lost        work a failure threw away (WASTED_PROGRESS_FROM_DISRUPTION): from the last
                checkpoint before the failure (clamped to the attempt's first progress mark) or,
                for a job that reports no checkpoints, from its last progress mark, to the failure
    recovering  from the failure to the relaunch: detection, VM restart, every node's check
                (INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION)

goodput % = productive / (wall - queued); node-hours = nodes x (wall - queued), where the nodes
are the job's world and its idle spares (--spares: launcher.jobs.spares; a spare is billed while it
waits); cost = node-hours x the machine type's price per node-hour (gpufleet.catalog.machine_price),
on-demand and Spot: the record does not say how the nodes were provisioned, so both are given. A
stopped instance is not billed while it is down, so during a recovery the cost is an upper bound.

Each failure that was recovered (`record.recoveries`) gets its own account (`FailureCost`): its
time to train again, from the failure (the first node failure the controller saw in that attempt,
else the recovery's own time) to the first progress mark of the relaunch after it; where the
restore came from; and the spares swapped in for it. The restore's source is read from one line
of the job's output, `restored step N from local|peer|durable` (RESTORED_RE; a checkpoint helper
prints it as it restores); without such a line it is "unknown".

What the controller writes for this (`MarkKeeper`, `note_state`): `record.states`, each state
change with its time, and `record.marks`, at most four per attempt: its first progress mark, its
latest progress mark (with the step), its latest checkpoint (with the step, at the time that
step's line was seen) and its first node failure. A progress mark is, as for hang detection
(launcher.core.hang), a line matching `--progress REGEX` when given; otherwise a step line of
workloads.train (`step 12/100 | ...`), or any output line of any other workload. Pure functions
and one small class: no I/O.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from typing import Any

from gpufleet.catalog import MachinePrice, machine_price
from launcher.jobs.spares import swap_line

__all__ = [
    "CATEGORIES",
    "Segment",
    "Goodput",
    "MarkKeeper",
    "note_state",
    "is_node_failure",
    "timeline",
    "goodput_of",
    "progress_step",
    "checkpoint_step",
    "restored_from",
    "RESTORED_RE",
    "FailureCost",
    "failures",
    "failure_lines",
    "format_cost",
    "summary",
]

CATEGORIES = ("queued", "starting", "productive", "lost", "recovering")

# workloads.metrics.format_log_line and workloads.train's save line (`checkpoint step 8 -> DIR (...)`).
_STEP_RE = re.compile(r"\bstep (\d+)/\d+ \|")
_CHECKPOINT_RE = re.compile(r"\bcheckpoint step (\d+) -> ")
# Where a relaunch's restore came from, as a checkpoint helper says it: `restored step 40 from peer`.
RESTORED_RE = re.compile(r"\brestored step (\d+) from (local|peer|durable)\b")
_FAILED_STATES = ("failed", "unreachable")  # launcher.core.launch.NodeState values of a node failure
# Steps whose line times are kept for the next checkpoint's mark: a save follows its step closely.
_SEEN_MAX = 1024


def progress_step(line: str) -> int | None:
    m = _STEP_RE.search(line)
    return int(m.group(1)) if m else None


def checkpoint_step(line: str) -> int | None:
    m = _CHECKPOINT_RE.search(line)
    return int(m.group(1)) if m else None


def restored_from(line: str) -> tuple[int, str] | None:
    """(step, source) of a `restored step N from local|peer|durable` line, else None."""
    m = RESTORED_RE.search(line)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True)
class FailureCost:
    """One recovered failure's account: when, which node, how long until the job trained again,
    where the restore came from, and the spares swapped in (launcher.jobs.spares.Swap, as saved)."""

    number: int  # 1 for the job's first recovery
    at: float  # the failure (node 0's clock)
    node: int | None
    reason: str
    to_train_s: float | None  # failure -> first progress of the relaunch; None: it never trained again
    restored_from: str  # local, peer, durable, or unknown
    restored_step: int | None
    swaps: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "at": self.at,
            "node": self.node,
            "reason": self.reason,
            "to_train_s": None if self.to_train_s is None else round(self.to_train_s, 3),
            "restored_from": self.restored_from,
            "restored_step": self.restored_step,
            "swaps": list(self.swaps),
        }


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    category: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Goodput:
    """A job's figures at one moment (its end, or now)."""

    segments: tuple[Segment, ...]
    seconds: dict[str, float]  # per category; they add up to wall_s
    wall_s: float  # submission to the end (or now)
    run_s: float  # wall_s less queued: the job's time on its nodes
    goodput_pct: float | None  # productive / run_s; None before the job ran
    node_hours: float
    price: MachinePrice | None
    cost_on_demand_usd: float | None  # None: the machine type's price is unknown
    cost_spot_usd: float | None
    failures: tuple[FailureCost, ...] = ()  # each recovered failure's own account

    def to_json(self) -> dict[str, Any]:
        p = self.price
        return {
            "failures": [f.to_json() for f in self.failures],
            "goodput_pct": None if self.goodput_pct is None else round(self.goodput_pct, 3),
            "wall_s": round(self.wall_s, 3),
            "run_s": round(self.run_s, 3),
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "node_hours": round(self.node_hours, 6),
            "cost_usd": {
                "on_demand": None if self.cost_on_demand_usd is None else round(self.cost_on_demand_usd, 4),
                "spot": None if self.cost_spot_usd is None else round(self.cost_spot_usd, 4),
            },
            "price": None
            if p is None
            else {
                "machine_type": p.machine_type,
                "region": p.region,
                "on_demand_usd_per_hour": p.on_demand_usd_per_hour,
                "spot_usd_per_hour": p.spot_usd_per_hour,
                "source": p.source,
                "retrieved": p.retrieved,
            },
            "segments": [[s.start, s.end, s.category] for s in self.segments],
        }


# ---- the controller's side: what it notes in the record ----


def note_state(record: Any, now: float) -> None:
    """Append the record's state to `record.states` if it changed (a launcher.jobs.record.JobRecord).
    Every job begins PENDING at `submitted` (even one first saved RUNNING); the first RUNNING is
    at `started` and a final state at `ended`, so the timeline and the record's times agree."""
    states = record.states
    state = record.state.value
    if not states:
        states.append({"at": record.submitted, "state": "PENDING"})
    if states[-1]["state"] == state:
        return
    at = now
    if record.state.final and record.ended is not None:
        at = record.ended
    elif state == "RUNNING" and record.started is not None and not any(s["state"] == "RUNNING" for s in states):
        at = record.started
    states.append({"at": max(at, states[-1]["at"]), "state": state})


class MarkKeeper:
    """Keeps an attempt's marks in `record.marks` (see the module's docstring); `line` and
    `node_failed` say whether a mark changed, so the caller saves the record when it likes."""

    def __init__(self, record: Any, progress: str | None = None):
        self.record = record
        # --progress REGEX (launcher.core.hang) when given; else workloads.train's step lines, and
        # for any other workload any line.
        self.pattern = re.compile(progress) if progress else None
        self.steps_only = _train_argv(record.what) is not None
        self._first = len(record.marks)  # this attempt's marks are record.marks[_first:]
        self._seen: dict[int, float] = {}  # step -> when its line was seen, since the last checkpoint

    def new_attempt(self) -> None:
        self._first = len(self.record.marks)
        self._seen.clear()

    def line(self, text: str, now: float) -> bool:
        restored = restored_from(text)
        if restored is not None:
            return self._put("restore", now, restored[0], source=restored[1])
        saved = checkpoint_step(text)
        if saved is not None:
            # The checkpoint holds the work up to its step's line (an async save commits later).
            at = min(self._seen.get(saved, now), now)
            self._seen = {s: t for s, t in self._seen.items() if s > saved}
            return self._put("checkpoint", at, saved)
        step = progress_step(text)
        if self.pattern is not None:
            if not self.pattern.search(text):
                return False
        elif step is None and self.steps_only:
            return False
        if step is not None:
            self._seen[step] = now
            if len(self._seen) > _SEEN_MAX:  # a job that never checkpoints: keep the latest steps only
                self._seen = dict(list(self._seen.items())[-_SEEN_MAX // 2 :])
        if self._mine("first") is None:
            return self._put("first", now, step)
        return self._put("progress", now, step)

    def node_failed(self, now: float) -> bool:
        if self._mine("failure") is not None:
            return False
        return self._put("failure", now, None)

    def _mine(self, kind: str) -> dict[str, Any] | None:
        for m in self.record.marks[self._first :]:
            if m["kind"] == kind:
                return m
        return None

    def _put(self, kind: str, at: float, step: int | None, **more: Any) -> bool:
        m = self._mine(kind)
        if m is None:
            self.record.marks.append({"at": at, "kind": kind, "step": step, **more})
        else:
            m.update(at=at, step=step, **more)
        return True


def is_node_failure(state_value: str) -> bool:
    return state_value in _FAILED_STATES


# ---- the reader's side: the timeline and the figures ----


def _train_argv(what: str) -> list[str] | None:
    """workloads.train's own arguments when a record's `what` (`torchrun -m workloads.train ...`,
    launcher.jobs.controller) runs the built-in workload, else None."""
    try:
        argv = shlex.split(what)
    except ValueError:
        return None
    return argv[3:] if argv[:3] == ["torchrun", "-m", "workloads.train"] else None


def _reports_checkpoints(record: Any) -> bool:
    """Whether the job tells us its checkpoints: it logged one, or it is workloads.train given
    --checkpoint-dir (which logs each save)."""
    if any(m["kind"] == "checkpoint" for m in record.marks):
        return True
    argv = _train_argv(record.what) or []
    return any(a.split("=", 1)[0] == "--checkpoint-dir" for a in argv)


def _state_spans(record: Any, end: float) -> list[tuple[float, float, str, str | None]]:
    """(start, end, state, next state) for each state the record passed through, up to `end`."""
    states = list(record.states)
    if not states:  # a record written before states were kept: what its times say
        states = [{"at": record.submitted, "state": "PENDING"}]
        if record.started is not None:
            states.append({"at": record.started, "state": "RUNNING"})
        if record.state.final:
            states.append({"at": end, "state": record.state.value})
    spans = []
    for k, s in enumerate(states):
        nxt = states[k + 1] if k + 1 < len(states) else None
        a = min(s["at"], end)
        b = min(nxt["at"], end) if nxt else end
        spans.append((a, max(a, b), s["state"], nxt["state"] if nxt else None))
    return spans


def _attempt(
    a: float, b: float, next_state: str | None, marks: list[dict[str, Any]], checkpoints: list[float], reports: bool
) -> list[Segment]:
    """The segments of one RUNNING span [a, b]."""
    inside = [m for m in marks if a <= m["at"] <= b]
    progress = sorted(m["at"] for m in inside if m["kind"] in ("first", "progress"))
    failures = [m["at"] for m in inside if m["kind"] == "failure"]
    broke = next_state in ("RECOVERING", "FAILED", "STOPPED")
    # The failure: the first node failure seen, when a recovery follows (after it the controller
    # waits for the nodes); otherwise the end of the attempt.
    fail = min(failures) if failures and next_state == "RECOVERING" else b
    if not progress:
        return [Segment(a, fail, "starting"), Segment(fail, b, "recovering")]
    first = progress[0]
    if not broke:
        return [Segment(a, first, "starting"), Segment(first, b, "productive")]
    first = min(first, fail)
    if reports:
        kept = [t for t in checkpoints if t <= fail]
        lost_from = max([first, *kept])
    else:
        lost_from = max([first, *[t for t in progress if t <= fail]])
    return [
        Segment(a, first, "starting"),
        Segment(first, lost_from, "productive"),
        Segment(lost_from, fail, "lost"),
        Segment(fail, b, "recovering"),
    ]


def timeline(record: Any, now: float | None = None) -> list[Segment]:
    """The record's time from submission to its end (or `now`) as contiguous segments."""
    end = record.ended if record.state.final and record.ended is not None else (time.time() if now is None else now)
    spans = _state_spans(record, end)
    checkpoints = sorted(m["at"] for m in record.marks if m["kind"] == "checkpoint")
    reports = _reports_checkpoints(record)
    out: list[Segment] = []
    for a, b, state, nxt in spans:
        if state == "PENDING":
            out.append(Segment(a, b, "queued"))
        elif state == "RECOVERING":
            out.append(Segment(a, b, "recovering"))
        elif state == "RUNNING":
            out.extend(_attempt(a, b, nxt, record.marks, checkpoints, reports))
    merged: list[Segment] = []
    for s in out:
        if s.end <= s.start:
            continue
        if merged and merged[-1].category == s.category and merged[-1].end == s.start:
            merged[-1] = Segment(merged[-1].start, s.end, s.category)
        else:
            merged.append(s)
    return merged


def goodput_of(record: Any, now: float | None = None) -> Goodput:
    """The record's goodput, node-hours and cost at its end (or at `now`, node 0's clock)."""
    segs = timeline(record, now)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for s in segs:
        seconds[s.category] += s.seconds
    wall = segs[-1].end - segs[0].start if segs else 0.0
    run = wall - seconds["queued"]
    node_hours = (len(record.nodes) + len(getattr(record, "spares", None) or [])) * run / 3600.0
    price = machine_price(getattr(record, "machine_type", None))
    return Goodput(
        segments=tuple(segs),
        seconds=seconds,
        wall_s=wall,
        run_s=run,
        goodput_pct=100.0 * seconds["productive"] / run if run > 0 else None,
        node_hours=node_hours,
        price=price,
        cost_on_demand_usd=node_hours * price.on_demand_usd_per_hour if price else None,
        cost_spot_usd=node_hours * price.spot_usd_per_hour if price else None,
        failures=tuple(failures(record)),
    )


def failures(record: Any) -> list[FailureCost]:
    """Each recovery of the record as a FailureCost (see the module's docstring)."""
    recoveries = list(getattr(record, "recoveries", None) or [])
    marks = sorted(record.marks, key=lambda m: m["at"])
    out = []
    for k, r in enumerate(recoveries):
        since = recoveries[k - 1]["at"] if k else float("-inf")
        until = recoveries[k + 1]["at"] if k + 1 < len(recoveries) else float("inf")
        # The first node failure seen after the previous recovery, up to this one's notice.
        seen = [m["at"] for m in marks if m["kind"] == "failure" and since < m["at"] <= r["at"]]
        at = min(seen) if seen else r["at"]
        firsts = [m["at"] for m in marks if m["kind"] == "first" and r["at"] < m["at"] <= until]
        back = firsts[0] if firsts else None
        restores = [m for m in marks if m["kind"] == "restore" and r["at"] < m["at"] <= (back or until)]
        restore = restores[-1] if restores else None
        out.append(
            FailureCost(
                number=k + 1,
                at=at,
                node=r.get("node"),
                reason=r.get("reason", ""),
                to_train_s=None if back is None else back - at,
                restored_from=restore.get("source", "unknown") if restore else "unknown",
                restored_step=restore["step"] if restore else None,
                swaps=tuple(r.get("swaps") or ()),
            )
        )
    return out


def failure_lines(g: Goodput) -> list[str]:
    """Each failure's account, one line: `failure 1 (node 1, node-lost): trained again after
    14.2 s, restored from peer at step 40; swapped node 1 (10.0.0.2) → spare 10.0.0.4 (unreachable)`."""
    out = []
    for f in g.failures:
        who = ", ".join(x for x in (f"node {f.node}" if f.node is not None else "", f.reason) if x)
        again = "not trained again" if f.to_train_s is None else f"trained again after {f.to_train_s:.1f} s"
        at = f" at step {f.restored_step}" if f.restored_step is not None else ""
        swapped = "".join(f"; swapped {swap_line(s)}" for s in f.swaps)
        out.append(
            f"failure {f.number}" + (f" ({who})" if who else "") + f": {again}, restored from "
            f"{f.restored_from}{at}{swapped}"
        )
    return out


def format_cost(g: Goodput) -> str:
    """`$12.34 on-demand / $4.56 Spot`, or `n/a` where the machine type's price is unknown."""
    if g.cost_on_demand_usd is None or g.cost_spot_usd is None:
        return "n/a"
    return f"${g.cost_on_demand_usd:,.2f} on-demand / ${g.cost_spot_usd:,.2f} Spot"


def summary(g: Goodput) -> str:
    """One line: `goodput 87.5% (lost 30 s, recovering 28 s), 0.47 node-h, $41.20 on-demand / ...`."""
    if g.goodput_pct is None:
        return "goodput - (not started)"
    bad = ", ".join(f"{k} {g.seconds[k]:.0f} s" for k in ("starting", "lost", "recovering") if g.seconds[k] >= 0.5)
    cost = format_cost(g)
    return (
        f"goodput {g.goodput_pct:.1f}%" + (f" ({bad})" if bad else "") + f", {g.node_hours:.2f} node-h, cost "
        f"{cost if cost == 'n/a' else cost + ' so far'}"
    )
