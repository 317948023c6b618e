"""Read, judge and store the results of a collective sweep; find a bad node. No torch, no pulumi.

The launcher's ``launch nccl-tests`` calls this module; everything here is a plain function over
plain data, so it is tested without a cluster. matplotlib is imported only inside the plot.

API (what the CLI calls):

``parse_output(text, *, collective=None, nranks=None) -> list[SweepRow]``
    Rows from rank 0's stdout (from ``launcher.nccl_parse``, which documents how): our sweep's
    ``#gpufleet-json`` line when present, else every nccl-tests table, columns found by header
    name (``#wrong`` or the old ``error``, with or without redop/root), through the prefixes
    of kubectl, srun, mpirun and launch. The collective and rank count are what the output
    says (or the `collective`/`nranks` arguments), "unknown" and 0 when it does not say.
``avg_busbw(rows)``, ``failures(rows)``
    nccl-tests' "Avg bus bandwidth" (mean busbw of every block of every row; re-exported from
    ``gpufleet.bandwidth``, which the sweep uses too); rows with
    ``#wrong`` > 0 or an old-style max error above ``error_tolerance``.
``rich_table(rows) -> rich.table.Table``
    For the CLI to print; wrong results in red.
``write_results(rows, run_dir, *, machine_type=None, nranks, nnodes) -> {"json","csv","png": Path}``
    rows.json, rows.csv and busbw.png (busbw against size on a log2 axis, one line per
    collective, the expected curve dashed when the machine type is known). An existing file is
    never overwritten: the next free name ``rows.1.json`` is used instead (like nccl-tests -J).
``expected_judgement(rows, machine_type, nranks, nnodes, *, margin=0.1, env=None) -> ExpectedReport``
    The rows against the calibrated model of ``gpufleet.expected``: per collective its basis
    and which sizes were judged how (busbw in the trusted range, time against a latency bound
    below it, or not at all), one warning per size that falls short, and a one-line verdict
    ("consistent with a healthy a3-megagpu-8g cluster of 2 nodes" / "below expected from
    64 MiB up by 38-45%: the network is slow (see --find-bad-nodes)").
    ``expected_report(...)`` is its ``.lines``, the verdict last.
``pair_schedule(hosts) -> list[list[tuple[str, str]]]``
    Rounds of disjoint pairs covering every pair once; the pairs of a round can run at once.
``rank_nodes(pair_busbw, threshold=0.8) -> BadNodeReport``
    Scores each node by the median busbw of the pairs it was in; names every node below
    threshold × the median score. ``report.exclude`` is the ``--exclude`` value.
``confirm_halves(hosts, suspects)`` and ``confirm_suspects(clean_busbw, suspect_busbw, suspects, threshold)``
    The confirming pass: a suspect half and a clean half; a suspect is confirmed when its half
    is below threshold × the clean half.
``nccl_tests_command(binary, hosts, nproc_per_node, args, env) -> list[str]``
    The mpirun argv for NVIDIA's binaries across hosts.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from gpufleet.bandwidth import JSON_MARKER, SweepRow, avg_busbw
from gpufleet.expected import MARGIN, Expectation, Finding, Judgement, expectation, judge
from launcher.nccl_parse import parse_output

__all__ = [
    "JSON_MARKER",
    "SweepRow",
    "BadNodeReport",
    "parse_output",
    "avg_busbw",
    "failures",
    "rich_table",
    "write_results",
    "ExpectedReport",
    "expected_curve",
    "expected_judgement",
    "expected_report",
    "pair_schedule",
    "rank_nodes",
    "confirm_halves",
    "confirm_suspects",
    "nccl_tests_command",
]


# Old nccl-tests print a max absolute error instead of a count of wrong elements. nccl-tests gave
# no single threshold for it; 1e-3 flags anything beyond float rounding of small sums.
DEFAULT_ERROR_TOLERANCE = 1e-3


_FIELDS = [f.name for f in dataclasses.fields(SweepRow)]


# ---- parsing (launcher.nccl_parse; re-exported: parse_output is this module's API too) ------

# ---- judging -------------------------------------------------------------------------------


def failures(rows: list[SweepRow], error_tolerance: float = DEFAULT_ERROR_TOLERANCE) -> list[SweepRow]:
    """Rows with a wrong result: #wrong > 0, or an old-style max error above error_tolerance."""
    bad = []
    for r in rows:
        limit = error_tolerance if r.error_column else 0.0
        if any(w is not None and w > limit for w in (r.oop_wrong, r.ip_wrong)):
            bad.append(r)
    return bad


def _human(nbytes: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            v = nbytes / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes} B"


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "N/A" if v is None else format(v, spec)


def rich_table(rows: list[SweepRow]) -> Table:
    """The rows as a rich table: one line per row, wrong results in red."""
    t = Table(title="collective sweep", caption=f"Avg bus bandwidth: {avg_busbw(rows):.3f} GB/s")
    for name in ("collective", "size", "count", "type", "redop", "root"):
        t.add_column(name, justify="right" if name in ("size", "count", "root") else "left")
    for block in ("oop", "ip"):
        t.add_column(f"{block} time (us)", justify="right")
        t.add_column(f"{block} algbw (GB/s)", justify="right")
        t.add_column(f"{block} busbw (GB/s)", justify="right")
        t.add_column(f"{block} #wrong", justify="right")
    bad = {id(r) for r in failures(rows)}
    for r in rows:
        t.add_row(
            r.collective, _human(r.size), str(r.count), r.type, r.redop, str(r.root),
            _fmt(r.oop_time_us), _fmt(r.oop_algbw), _fmt(r.oop_busbw), _fmt(r.oop_wrong, "g"),
            _fmt(r.ip_time_us), _fmt(r.ip_algbw), _fmt(r.ip_busbw), _fmt(r.ip_wrong, "g"),
            style="red" if id(r) in bad else None,
        )
    return t


# ---- expected bandwidth --------------------------------------------------------------------


def _groups(rows: list[SweepRow]) -> dict[tuple[str, str, str], list[SweepRow]]:
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
    return _human(lo) if lo == hi else f"{_human(lo)}-{_human(hi)}"


def _pct_span(pcts: list[float]) -> str:
    lo, hi = round(min(pcts)), round(max(pcts))
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def expected_curve(
    rows: list[SweepRow], machine_type: str, nranks: int, nnodes: int,
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

    def styled(self) -> list[tuple[str, str]]:
        """(rich style, line) for the CLI: notes dim, warnings yellow, the verdict green when
        healthy, bold yellow when not, plain when nothing could be judged."""
        style = {True: "green", False: "bold yellow", None: "default"}[self.healthy]
        return [*(("dim", n) for n in self.notes), *(("yellow", w) for w in self.warnings),
                (style, self.verdict)]


def _finding_line(label: str, f: Finding) -> str:
    at = f"{label} at {_human(f.size)}"
    if f.kind == "latency":
        return f"{at}: {f.measured:.1f} us per op, above the latency bound of {f.expected:.0f} us"
    if f.pct is None:
        return f"{at}: busbw prints 0.00 GB/s where {f.expected:.2f} GB/s is expected"
    return f"{at}: busbw {f.measured:.2f} GB/s, below expected {f.expected:.2f} GB/s by {f.pct:.0f}%"


def _scope_line(label: str, j: Judgement) -> str:
    e = j.expectation
    parts = [f"busbw judged at {_span(j.judged)} (trusted from {_human(int(e.trusted_from))})"]
    if j.bounded:
        parts.append(f"time judged against a {e.latency_bound_s * 1e6:.0f} us latency bound at "
                     f"{_span(j.bounded)}")
    if j.skipped:
        why = ("protocol and algorithm switches" if e.latency_bound_s is not None
               else "below the trusted range; no published small-size times to bound them")
        parts.append(f"not judged at {_span(j.skipped)} ({why})")
    return f"{label}: " + "; ".join(parts)


def _verdict(judgements: list[Judgement], machine_type: str, nnodes: int) -> tuple[str, bool | None]:
    slow = [(j, [f for f in j.findings if f.kind == "busbw"]) for j in judgements]
    slow = [(j, fs) for j, fs in slow if fs]
    late = [f for j in judgements for f in j.findings if f.kind == "latency"]
    if not any(j.judged or j.bounded for j in judgements):
        return "no verdict: no size in the model's trusted range or under a latency bound", None
    if not slow and not late:
        caveat = "" if any(j.judged for j in judgements) else " (judged by latency only: no size reached the trusted range)"
        return f"consistent with a healthy {machine_type} cluster of {nnodes} nodes{caveat}", True
    if slow:
        first = min(f.size for _, fs in slow for f in fs)
        flagged = {f.size for _, fs in slow for f in fs}
        judged_up = sorted({s for j in judgements for s in j.judged if s >= first})
        pcts = [f.pct for _, fs in slow for f in fs if f.pct is not None]
        by = f" by {_pct_span(pcts)}" if pcts else ""
        where = (f"from {_human(first)} up" if all(s in flagged for s in judged_up)
                 else f"at {len(flagged)} of {len(judged_up)} sizes from {_human(first)} to {_human(max(judged_up))}")
        line = f"below expected {where}{by}: the network is slow (see --find-bad-nodes)"
        if late:
            line += "; small messages are slower than the latency bound too"
        return line, False
    return (f"slower than the latency bound at {_span([f.size for f in late])}: small messages are "
            "slow (see --find-bad-nodes)"), False


def expected_judgement(
    rows: list[SweepRow], machine_type: str, nranks: int, nnodes: int, *, margin: float = MARGIN,
    env: dict[str, str] | None = None,
) -> ExpectedReport:
    """Judge every collective (type, op) of `rows` against the model; see gpufleet.expected."""
    if nnodes < 2:
        line = ("no verdict: within one node NVLink, not the network, sets the bandwidth and no "
                "published GCP sweep calibrates it")
        return ExpectedReport([], [], line, None, [])
    notes, warnings, judgements = [], [], []
    for (coll, typ, op), grp in _groups(rows).items():
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
    verdict, healthy = _verdict(judgements, machine_type, nnodes)
    return ExpectedReport(notes, warnings, verdict, healthy, judgements)


def expected_report(
    rows: list[SweepRow], machine_type: str, nranks: int, nnodes: int, *, margin: float = MARGIN,
    env: dict[str, str] | None = None,
) -> list[str]:
    """The report's lines: the model's basis and scope per collective, one warning per size
    below it (or above the latency bound), and the one-line verdict last."""
    return expected_judgement(rows, machine_type, nranks, nnodes, margin=margin, env=env).lines


# ---- storing -------------------------------------------------------------------------------


def _free_path(run_dir: Path, stem: str, suffix: str) -> Path:
    """run_dir/stem.suffix, or stem.N.suffix for the first N not taken: never overwrite."""
    p = run_dir / f"{stem}{suffix}"
    n = 1
    while p.exists():
        p = run_dir / f"{stem}.{n}{suffix}"
        n += 1
    return p


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _plot(rows: list[SweepRow], path: Path, machine_type: str | None, nranks: int, nnodes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a laptop's SSH session or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (coll, typ, op), grp in _groups(rows).items():
        grp = sorted((r for r in grp if r.size > 0), key=lambda r: r.size)
        if not grp:
            continue
        label = coll if len({(r.type, r.redop) for r in rows}) == 1 else f"{coll} {typ} {op}"
        line = ax.plot([r.size for r in grp], [r.best_busbw for r in grp], marker="o", label=label)[0]
        if machine_type is not None:
            try:
                model = expected_curve(grp, machine_type, nranks, nnodes)
            except ValueError:  # a collective or rank count the model cannot take: no curve
                model = None
            sizes = [r.size for r in grp if model is not None and model.trusted(r.size)]
            if model is not None and sizes:  # drawn over the trusted range only
                ax.plot(sizes, [model.busbw(s) for s in sizes],
                        linestyle="--", color=line.get_color(), label=f"{label} expected")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    # 0 is unknown: `launch nccl-tests --from` output that names no hosts or ranks.
    title = f"{nnodes or '?'} nodes, {nranks or '?'} ranks" + (f", {machine_type}" if machine_type else "")
    ax.set_title(f"bus bandwidth — {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def write_results(
    rows: list[SweepRow], run_dir: str | Path, *, machine_type: str | None = None, nranks: int,
    nnodes: int,
) -> dict[str, Path]:
    """Write rows.json, rows.csv and busbw.png into run_dir; returns their paths by kind."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": _free_path(run_dir, "rows", ".json"),
        "csv": _free_path(run_dir, "rows", ".csv"),
        "png": _free_path(run_dir, "busbw", ".png"),
    }
    doc = {
        "machine_type": machine_type,
        "nranks": nranks,
        "nnodes": nnodes,
        "avg_busbw": avg_busbw(rows),
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    _atomic_write(paths["json"], json.dumps(doc, indent=1) + "\n")
    tmp = paths["csv"].with_name(f".{paths['csv'].name}.tmp{os.getpid()}")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))
    os.replace(tmp, paths["csv"])
    _plot(rows, paths["png"], machine_type, nranks, nnodes)
    return paths


# ---- finding a bad node --------------------------------------------------------------------


def pair_schedule(hosts: list[str]) -> list[list[tuple[str, str]]]:
    """Every pair of hosts once, in rounds of disjoint pairs (the circle method).

    n even: n-1 rounds of n/2 pairs; n odd: n rounds, one host idle in each. Pairs within a
    round share no host, so they can run at the same time without disturbing each other.
    """
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts repeat: {', '.join(h for h in hosts if hosts.count(h) > 1)}")
    if len(hosts) < 2:
        raise ValueError(f"pairs need 2 or more hosts, got {len(hosts)}")
    ring: list[str | None] = list(hosts) + ([None] if len(hosts) % 2 else [])
    m = len(ring)
    rounds = []
    for _ in range(m - 1):
        pairs = [(ring[i], ring[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1], *ring[1:-1]]  # keep the first fixed, rotate the rest
    return rounds


@dataclass
class BadNodeReport:
    """What rank_nodes found."""

    scores: dict[str, float]  # node → median busbw (GB/s) of the pairs it was in
    pairs: dict[str, dict[str, float]]  # node → {partner: busbw}
    median: float  # median of the scores
    threshold: float  # fraction of the median below which a node is named
    bad: list[str]  # named nodes, worst first

    @property
    def exclude(self) -> str:
        """The comma list the launcher's --exclude accepts."""
        return ",".join(self.bad)

    @property
    def decisive(self) -> bool:
        """True when the pairs alone settle it: every pair with a named node is below threshold ×
        the slowest pair of two unnamed nodes. A confirming pass then has nothing to add (a pair
        already far slower than all the others is the answer); the finder skips it."""
        bad = set(self.bad)
        named = [bw for n in bad for bw in self.pairs[n].values()]
        clean = [bw for n, ps in self.pairs.items() if n not in bad for p, bw in ps.items() if p not in bad]
        return bool(named) and bool(clean) and max(named) < self.threshold * min(clean)

    @property
    def lines(self) -> list[str]:
        """One line per named node with its numbers."""
        cut = self.threshold * self.median
        out = []
        for n in self.bad:
            partners = ", ".join(f"{p} {bw:.2f}" for p, bw in sorted(self.pairs[n].items()))
            out.append(
                f"{n}: busbw {self.scores[n]:.2f} GB/s (median of {len(self.pairs[n])} pairs: "
                f"{partners}) < {self.threshold:g} x median {self.median:.2f} = {cut:.2f} GB/s"
            )
        return out


def rank_nodes(pair_busbw: dict[tuple[str, str], float], threshold: float = 0.8) -> BadNodeReport:
    """Score nodes by the median busbw of their pairs; name those below threshold × the median.

    Median, not mean: a slow node drags down every pair it is in, while a healthy node is in one
    slow pair at most (when one node is bad); the median of a healthy node's pairs stays at the
    healthy level, where a mean would pull it toward the cut by its one bad partner.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    pairs: dict[str, dict[str, float]] = {}
    for (a, b), bw in pair_busbw.items():
        if a == b:
            raise ValueError(f"pair ({a}, {b}) names one node twice")
        pairs.setdefault(a, {})[b] = bw
        pairs.setdefault(b, {})[a] = bw
    if len(pairs) < 2:
        raise ValueError("rank_nodes needs pair results covering 2 or more nodes")
    scores = {n: statistics.median(p.values()) for n, p in pairs.items()}
    med = statistics.median(scores.values())
    bad = sorted((n for n, s in scores.items() if s < threshold * med), key=lambda n: scores[n])
    return BadNodeReport(scores, pairs, med, threshold, bad)


def confirm_halves(hosts: list[str], suspects: list[str]) -> tuple[list[str], list[str]]:
    """Two node groups for the confirming pass: (clean half, suspect half).

    The suspect half holds every suspect, topped up with healthy nodes to half the cluster; the
    clean half holds the other healthy nodes. Each half must have 2 nodes to run a sweep.
    """
    unknown = [s for s in suspects if s not in hosts]
    if unknown:
        raise ValueError(f"suspects not among the hosts: {', '.join(unknown)}")
    healthy = [h for h in hosts if h not in suspects]
    size = max(2, len(hosts) // 2, len(suspects))
    fill = max(0, size - len(suspects))
    suspect_half = list(suspects) + healthy[:fill]
    clean_half = healthy[fill:]
    if len(clean_half) < 2:
        raise ValueError(
            f"{len(hosts)} hosts with {len(suspects)} suspects leave {len(clean_half)} healthy "
            "node(s) for the clean half; it needs 2 — trust the pair results instead"
        )
    return clean_half, suspect_half


def confirm_suspects(
    clean_busbw: float, suspect_busbw: float, suspects: list[str], threshold: float = 0.8
) -> list[str]:
    """The suspects, if the suspect half ran below threshold × the clean half; else []."""
    if clean_busbw <= 0:
        raise ValueError(f"clean half busbw must be > 0, got {clean_busbw}")
    return list(suspects) if suspect_busbw < threshold * clean_busbw else []


# ---- NVIDIA nccl-tests across hosts ---------------------------------------------------------

_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]]+$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def nccl_tests_command(
    binary: str, hosts: list[str], nproc_per_node: int, args: list[str], env: dict[str, str],
    *, allow_run_as_root: bool = False,
) -> list[str]:
    """The Open MPI argv that runs an nccl-tests binary on `hosts`, nproc_per_node ranks each.

    Shape from nccl-tests#100 (perf-anchors §1.5): ``mpirun -np 16 -H node1:8,node2:8
    --bind-to none -x VAR=value ... ./all_reduce_perf -b 8 -e 8G -f 2 -g 1``. ``-x NAME=VALUE``
    sets each variable on every rank (Open MPI's -x takes an optional value), so the argv does
    not depend on mpirun's own environment. One GPU per process (``-g 1``) is the caller's arg.
    """
    if not hosts:
        raise ValueError("nccl-tests needs at least one host")
    for h in hosts:
        if not _HOST_RE.match(h):
            raise ValueError(f"host {h!r} is not a plain host name or address (no , : or spaces)")
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    cmd = ["mpirun"]
    if allow_run_as_root:
        cmd.append("--allow-run-as-root")
    cmd += [
        "-np", str(len(hosts) * nproc_per_node),
        "-H", ",".join(f"{h}:{nproc_per_node}" for h in hosts),
        "--bind-to", "none",
    ]
    for k, v in env.items():
        if not _ENV_RE.match(k):
            raise ValueError(f"environment variable name {k!r} is not valid")
        cmd += ["-x", f"{k}={v}"]
    return cmd + [binary, *args]
