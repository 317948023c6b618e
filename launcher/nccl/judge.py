"""Judge a sweep's rows: wrong results, --min-busbw, and the expected bandwidth. No torch, no I/O.

``failures(rows)``
    Rows with ``#wrong`` > 0, or an old-style max error above ``error_tolerance``.
``verdict(groups, min_busbw)``
    One line per failure (each wrong row, an average below ``--min-busbw``); [] when the run
    passes. These decide the exit status of ``launch nccl-tests``.
``expected_judgement(rows, machine_type, nranks, nnodes, *, margin=0.1, env=None) -> ExpectedReport``
    The rows against the calibrated model of ``gpufleet.expected``: per collective its basis
    and which sizes were judged how (busbw in the trusted range, time against a latency bound
    below it, or not at all), one warning per size that falls short, and a one-line verdict in
    words ("consistent with a healthy a3-megagpu-8g cluster of 2 nodes" / "below a healthy
    a3-megagpu-8g by 38-45% from 64 MiB up: the network is slow (see --find-bad-nodes)"). A slow
    network is a warning, never a failure. ``expected_report(...)`` is its ``.lines``, the
    verdict last; ``.styled(explain)`` is what the CLI shows: the verdict first, the model's
    terms (its basis, what was judged how) only with ``--explain``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.bandwidth import avg_busbw
from gpufleet.contracts import SweepRow
from gpufleet.expected import MARGIN, Expectation, Finding, Judgement, expectation, judge

__all__ = [
    "DEFAULT_ERROR_TOLERANCE",
    "ExpectedReport",
    "by_collective",
    "expected_curve",
    "expected_judgement",
    "expected_report",
    "failures",
    "human_size",
    "verdict",
]

# Old nccl-tests print a max absolute error instead of a count of wrong elements. nccl-tests gave
# no single threshold for it; 1e-3 flags anything beyond float rounding of small sums.
DEFAULT_ERROR_TOLERANCE = 1e-3


# ---- wrong results and --min-busbw ----------------------------------------------------------


def failures(rows: list[SweepRow], error_tolerance: float = DEFAULT_ERROR_TOLERANCE) -> list[SweepRow]:
    """Rows with a wrong result: #wrong > 0, or an old-style max error above error_tolerance."""
    bad = []
    for r in rows:
        limit = error_tolerance if r.error_column else 0.0
        if any(w is not None and w > limit for w in (r.oop_wrong, r.ip_wrong)):
            bad.append(r)
    return bad


def verdict(groups: list[tuple[str, list[SweepRow]]], min_busbw: float | None) -> list[str]:
    """One line per failure, [] when the run passes: each row with wrong results (#wrong > 0, or
    an old error column above tolerance), prefixed by its group's label (a file name, or ""),
    then the average bus bandwidth of all rows when it is below `min_busbw`."""
    lines = [
        f"{where}{r.collective} at {r.size} B: wrong results (out-of-place {r.oop_wrong}, in-place {r.ip_wrong})"
        for where, rows in groups
        for r in failures(rows)
    ]
    avg = avg_busbw([r for _, rows in groups for r in rows])
    if min_busbw is not None and avg < min_busbw:
        lines.append(f"average bus bandwidth {avg:.3g} GB/s is below --min-busbw {min_busbw:g}")
    return lines


# ---- words for sizes and groups of rows ----------------------------------------------------


def human_size(nbytes: int) -> str:
    """`32 MiB`, `1.5 KiB`, `8 B`: a size as the report shows it."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            v = nbytes / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes} B"


def by_collective(rows: list[SweepRow]) -> dict[tuple[str, str, str], list[SweepRow]]:
    """The rows by (collective, type, redop), in the order they first appear."""
    out: dict[tuple[str, str, str], list[SweepRow]] = {}
    for r in rows:
        out.setdefault((r.collective, r.type, r.redop), []).append(r)
    return out


def _label(coll: str, typ: str, op: str) -> str:
    return coll if op == "none" else f"{coll} ({typ}, {op})"


def _span(sizes: list[int]) -> str:
    if not sizes:
        return "none"
    lo, hi = min(sizes), max(sizes)
    return human_size(lo) if lo == hi else f"{human_size(lo)}-{human_size(hi)}"


def _pct_span(pcts: list[float]) -> str:
    lo, hi = round(min(pcts)), round(max(pcts))
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


# ---- expected bandwidth --------------------------------------------------------------------


def expected_curve(
    rows: list[SweepRow],
    machine_type: str,
    nranks: int,
    nnodes: int,
    env: dict[str, str] | None = None,
) -> Expectation | None:
    """The model (gpufleet.expected) for rows of one collective; None within one node.

    `env`: the user's NCCL variables (NCCL_ALGO decides ring or NVLS tree for all_reduce).
    Raises UnknownMachineType for a type the catalog does not know, ValueError for a
    collective it cannot model ("unknown": the output did not say).
    """
    return expectation(machine_type, rows[0].collective, nranks, nnodes, env)


@dataclass
class ExpectedReport:
    """The rows against the expected-bandwidth model: what to print, and the verdict."""

    notes: list[str]  # per collective: the model's basis, and which sizes were judged how
    warnings: list[str]  # one per size that fell short
    verdict: str  # one line
    healthy: bool | None  # None: nothing could be judged
    judgements: list[Judgement]

    @property
    def lines(self) -> list[str]:
        return [*self.notes, *self.warnings, self.verdict]

    def styled(self, explain: bool = False) -> list[tuple[str, str]]:
        """(rich style, line) for the CLI: the verdict first (green when healthy, bold yellow when
        not, plain when nothing could be judged), then the sizes that fell short (yellow); the
        model's terms (its basis and scope, dim) only when `explain` (--explain)."""
        style = {True: "green", False: "bold yellow", None: "default"}[self.healthy]
        notes = [("dim", n) for n in self.notes] if explain else []
        return [(style, self.verdict), *(("yellow", w) for w in self.warnings), *notes]


def _finding_line(label: str, f: Finding) -> str:
    at = f"{label} at {human_size(f.size)}"
    if f.kind == "latency":
        return f"{at}: {f.measured:.1f} us per op, above the latency bound of {f.expected:.0f} us"
    if f.pct is None:
        return f"{at}: busbw prints 0.00 GB/s where {f.expected:.2f} GB/s is expected"
    return f"{at}: busbw {f.measured:.2f} GB/s, below expected {f.expected:.2f} GB/s by {f.pct:.0f}%"


def _scope_line(label: str, j: Judgement) -> str:
    e = j.expectation
    parts = [f"busbw judged at {_span(j.judged)} (trusted from {human_size(int(e.trusted_from))})"]
    if j.bounded:
        parts.append(f"time judged against a {e.latency_bound_s * 1e6:.0f} us latency bound at {_span(j.bounded)}")
    if j.skipped:
        why = (
            "protocol and algorithm switches"
            if e.latency_bound_s is not None
            else "below the trusted range; no published small-size times to bound them"
        )
        parts.append(f"not judged at {_span(j.skipped)} ({why})")
    return f"{label}: " + "; ".join(parts)


def _slow_line(slow: list[tuple[Judgement, list[Finding]]], judgements: list[Judgement], machine_type: str) -> str:
    """The verdict when some sizes' busbw fell short: where, and by how much."""
    first = min(f.size for _, fs in slow for f in fs)
    flagged = {f.size for _, fs in slow for f in fs}
    judged_up = sorted({s for j in judgements for s in j.judged if s >= first})
    pcts = [f.pct for _, fs in slow for f in fs if f.pct is not None]
    by = f" by {_pct_span(pcts)}" if pcts else ""
    where = (
        f"from {human_size(first)} up"
        if all(s in flagged for s in judged_up)
        else f"at {len(flagged)} of {len(judged_up)} sizes from {human_size(first)} to {human_size(max(judged_up))}"
    )
    return f"below a healthy {machine_type}{by} {where}: the network is slow (see --find-bad-nodes)"


def _expected_verdict(judgements: list[Judgement], machine_type: str, nnodes: int) -> tuple[str, bool | None]:
    slow = [(j, [f for f in j.findings if f.kind == "busbw"]) for j in judgements]
    slow = [(j, fs) for j, fs in slow if fs]
    late = [f for j in judgements for f in j.findings if f.kind == "latency"]
    if not any(j.judged or j.bounded for j in judgements):
        return "no verdict: no size in the model's trusted range or under a latency bound", None
    if not slow and not late:
        caveat = (
            "" if any(j.judged for j in judgements) else " (judged by latency only: no size reached the trusted range)"
        )
        return f"consistent with a healthy {machine_type} cluster of {nnodes} nodes{caveat}", True
    if slow:
        line = _slow_line(slow, judgements, machine_type)
        if late:
            line += "; small messages are slower than the latency bound too"
        return line, False
    return (
        f"slower than the latency bound at {_span([f.size for f in late])}: small messages are "
        "slow (see --find-bad-nodes)"
    ), False


def expected_judgement(
    rows: list[SweepRow],
    machine_type: str,
    nranks: int,
    nnodes: int,
    *,
    margin: float = MARGIN,
    env: dict[str, str] | None = None,
) -> ExpectedReport:
    """Judge every collective (type, op) of `rows` against the model; see gpufleet.expected."""
    if nnodes < 2:
        line = (
            "no verdict: within one node NVLink, not the network, sets the bandwidth and no "
            "published GCP sweep calibrates it"
        )
        return ExpectedReport([], [], line, None, [])
    notes, warnings, judgements = [], [], []
    for (coll, typ, op), grp in by_collective(rows).items():
        label = _label(coll, typ, op)
        try:
            exp = expected_curve(grp, machine_type, nranks, nnodes, env)
        except ValueError as e:
            notes.append(f"{label}: {len(grp)} rows not judged ({e})")
            continue
        assert exp is not None  # nnodes >= 2
        j = judge(grp, exp, margin)
        judgements.append(j)
        notes.append(f"{label} expected ({exp.algorithm.value}): {exp.basis}")
        notes.append(_scope_line(label, j))
        warnings += [_finding_line(label, f) for f in j.findings]
    line, healthy = _expected_verdict(judgements, machine_type, nnodes)
    return ExpectedReport(notes, warnings, line, healthy, judgements)


def expected_report(
    rows: list[SweepRow],
    machine_type: str,
    nranks: int,
    nnodes: int,
    *,
    margin: float = MARGIN,
    env: dict[str, str] | None = None,
) -> list[str]:
    """The report's lines: the model's basis and scope per collective, one warning per size
    below it (or above the latency bound), and the one-line verdict last."""
    return expected_judgement(rows, machine_type, nranks, nnodes, margin=margin, env=env).lines
