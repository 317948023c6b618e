"""Read, judge and store the results of a collective sweep; find a bad node. No torch, no pulumi.

The launcher's ``launch nccl-tests`` calls this module; everything here is a plain function over
plain data, so it is tested without a cluster. matplotlib is imported only inside the plot.

API (what the CLI calls):

``parse_output(text, *, collective=None, nranks=None) -> list[SweepRow]``
    Rows from rank 0's stdout. Reads our sweep's ``#gpufleet-json`` line when present, else the
    table. The table reader also reads NVIDIA nccl-tests output: it finds columns by header
    name, so both ``#wrong`` and the old ``error`` column work, with or without redop/root.
    The collective of a row comes from ``# Collective test starting: X_perf`` (nccl-tests ≥ 2.13)
    or the `collective` argument; nranks from the ``#  Rank`` lines or the `nranks` argument.
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
``expected_report(rows, machine_type, nranks, nnodes, *, margin=0.1) -> list[str]``
    "below expected by X%" lines from the cost model of ``gpufleet.bandwidth``.
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

from gpufleet.bandwidth import (
    DEFAULT_LATENCY_S,
    JSON_MARKER,
    SweepRow,
    avg_busbw,
    bus_factor,
    fit_latency,
    model_busbw,
    plateau_busbw,
)
from gpufleet.catalog import lookup

__all__ = [
    "JSON_MARKER",
    "SweepRow",
    "BadNodeReport",
    "parse_output",
    "avg_busbw",
    "failures",
    "rich_table",
    "write_results",
    "expected_curve",
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


# ---- parsing -------------------------------------------------------------------------------

_STARTING = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
_RANK_LINE = re.compile(r"^#\s+Rank\s+\d+\s+Group")
_INT = re.compile(r"^-?\d+$")


def _collective_name(prog: str) -> str:
    """`./build/all_reduce_perf_mpi` → `all_reduce`."""
    name = os.path.basename(prog)
    return re.sub(r"_perf(_\w+)?$", "", name)


def _num(tok: str) -> float | None:
    if tok.upper() == "N/A":
        return None
    return float(tok)


def _from_json(line: str) -> list[SweepRow]:
    """The rows of our sweep's JSON line; [] for a line cut short (a node log ends mid-line when
    its node dies), so the table printed above it is read instead."""
    try:
        payload = json.loads(line[len(JSON_MARKER):])
        return [SweepRow(**{k: d[k] for k in _FIELDS if k in d}) for d in payload["rows"]]
    except (ValueError, KeyError, TypeError):
        return []


def _header_columns(line: str) -> list[str] | None:
    """Column names if `line` is the names line of an nccl-tests header, else None."""
    toks = line.lstrip("#").split()
    if "size" in toks and "busbw" in toks and ("time" in toks or "cputime" in toks):
        return toks
    return None


def _parse_table_line(
    toks: list[str], cols: list[str], collective: str, nranks: int
) -> SweepRow | None:
    if not toks or not _INT.match(toks[0]):
        return None
    time_cols = [i for i, c in enumerate(cols) if c in ("time", "cputime")]
    if not time_cols:
        return None
    width = len(cols)
    pre = time_cols[0]  # columns before the first block
    block = (time_cols[1] - time_cols[0]) if len(time_cols) > 1 else width - pre
    oop_missing = False
    if len(toks) < width:
        # nccl-tests writeBenchMarkLineNullBody prints blanks for an absent out-of-place block.
        if len(toks) == width - block and len(time_cols) > 1:
            oop_missing = True
        else:
            return None
    try:
        head = dict(zip(cols[:pre], toks[:pre]))
        size, count = int(head["size"]), int(head.get("count", 0))

        def blockvals(start: int) -> tuple[float | None, ...]:
            names = cols[time_cols[0] : time_cols[0] + block]
            vals = dict(zip(names, toks[start : start + block]))
            wrong_key = "#wrong" if "#wrong" in vals else ("error" if "error" in vals else None)
            return (
                _num(vals.get("time", vals.get("cputime", "N/A"))),
                _num(vals.get("algbw", "N/A")),
                _num(vals.get("busbw", "N/A")),
                _num(vals[wrong_key]) if wrong_key else None,
            )

        none4 = (None, None, None, None)
        if oop_missing:
            oop, ip = none4, blockvals(pre)
        else:
            oop = blockvals(pre)
            ip = blockvals(pre + block) if len(time_cols) > 1 else none4
    except (KeyError, ValueError):
        return None  # a line of other output that happens to start with a number
    return SweepRow(
        collective=collective,
        size=size,
        count=count,
        type=head.get("type", ""),
        redop=head.get("redop", "none"),
        root=int(head.get("root", -1)),
        nranks=nranks,
        oop_time_us=oop[0], oop_algbw=oop[1], oop_busbw=oop[2], oop_wrong=oop[3],
        ip_time_us=ip[0], ip_algbw=ip[1], ip_busbw=ip[2], ip_wrong=ip[3],
        error_column="error" in cols and "#wrong" not in cols,
    )


def parse_output(
    text: str, *, collective: str | None = None, nranks: int | None = None
) -> list[SweepRow]:
    """Rows from a sweep's or nccl-tests' stdout (see the module docstring)."""
    json_rows: list[SweepRow] = []
    for line in text.splitlines():
        if line.startswith(JSON_MARKER):
            json_rows += _from_json(line)
    if json_rows:
        return json_rows

    rows: list[SweepRow] = []
    current = collective or "unknown"
    cols: list[str] | None = None
    ranks_seen = 0
    for line in text.splitlines():
        m = _STARTING.match(line)
        if m:
            current = collective or _collective_name(m.group(1))
            cols, ranks_seen = None, 0
            continue
        if _RANK_LINE.match(line):
            ranks_seen += 1
            continue
        if line.startswith("#"):
            hdr = _header_columns(line)
            if hdr:
                cols = hdr
            continue
        if cols is None:
            continue
        row = _parse_table_line(line.split(), cols, current, nranks or ranks_seen)
        if row is not None:
            rows.append(row)
    return rows


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


def expected_curve(
    rows: list[SweepRow], machine_type: str, nranks: int, nnodes: int
) -> tuple[float, float, float] | None:
    """(B GB/s, A seconds, f) of the cost model for rows of one collective; None within a node.

    B = η × the catalog's per-node GPU network rate (gpufleet.bandwidth.plateau_busbw), A fitted
    on the rows' sizes <= 1 MiB, else the stack's DEFAULT_LATENCY_S; f = the bus factor.
    Raises UnknownMachineType for a type the catalog does not know.
    """
    machine = lookup(machine_type)
    coll = rows[0].collective
    plateau = plateau_busbw(machine, coll, nnodes)
    if plateau is None:
        return None
    f = bus_factor(coll, nranks)
    if f == 0:
        return None
    a = fit_latency([(r.size, r.best_busbw) for r in rows], plateau, f)
    if a is None:
        a = DEFAULT_LATENCY_S[machine.net_stack]
    return plateau, a, f


def expected_report(
    rows: list[SweepRow], machine_type: str, nranks: int, nnodes: int, *, margin: float = 0.1
) -> list[str]:
    """One line per row whose busbw is more than `margin` below the cost model's prediction."""
    if nnodes < 2:
        return [
            "no expected bandwidth within one node: NVLink, not the network, sets it and the "
            "catalog holds no NVLink rate"
        ]
    lines = []
    for (coll, typ, op), grp in _groups(rows).items():
        model = expected_curve(grp, machine_type, nranks, nnodes)
        if model is None:
            continue
        plateau, a, f = model
        for r in sorted(grp, key=lambda r: r.size):
            if r.size <= 0:
                continue
            exp = model_busbw(r.size, plateau, a, f)
            got = r.best_busbw
            if exp > 0 and got < (1.0 - margin) * exp:
                pct = 100.0 * (1.0 - got / exp)
                label = coll if op == "none" else f"{coll} ({typ}, {op})"
                lines.append(
                    f"{label} at {_human(r.size)}: busbw {got:.2f} GB/s, below expected "
                    f"{exp:.2f} GB/s by {pct:.0f}% ({machine_type}, {nnodes} nodes, "
                    f"B {plateau:.1f} GB/s, A {a * 1e6:.0f} us)"
                )
    return lines


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
            model = expected_curve(grp, machine_type, nranks, nnodes)
            if model is not None:
                plateau, a, f = model
                ax.plot([r.size for r in grp], [model_busbw(r.size, plateau, a, f) for r in grp],
                        linestyle="--", color=line.get_color(), label=f"{label} expected")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    title = f"{nnodes} nodes, {nranks} ranks" + (f", {machine_type}" if machine_type else "")
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
