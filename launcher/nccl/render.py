"""Show and store a sweep's rows: the table as data, and rows.json, rows.csv and busbw.png.
No terminal here: the CLI draws the table (launcher.cli.nccl_table).

``TABLE_COLUMNS`` and ``table_rows(rows) -> [(cells, wrong)]``
    The table a person reads: its columns (name, right-aligned), and each row's cells as text
    with whether its results are wrong.
``write_results(rows, run_dir, *, machine_type=None, nranks, nnodes) -> {"json","csv","png": Path | None}``
    rows.json, rows.csv and busbw.png (busbw against size on a log2 axis, one line per
    collective, the expected curve dashed when the machine type is known). An existing file is
    never overwritten: the next free name ``rows.1.json`` is used instead (like nccl-tests -J).
    Each file is written whole or not at all (gpufleet.atomic). matplotlib comes with the `plot`
    extra and is imported only inside the plot: on the launcher-only install (`pip install -e .`)
    the rows are written and "png" is None (``PLOT_SKIPPED`` says why, for the CLI to print).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
from pathlib import Path

from gpufleet import atomic
from gpufleet.bandwidth import avg_busbw
from gpufleet.contracts import SweepRow
from launcher.nccl.judge import by_collective, expected_curve, failures, human_size

__all__ = ["TABLE_COLUMNS", "table_rows", "write_results", "plot_available", "PLOT_SKIPPED"]

# The one line a report prints instead of the plot's path when matplotlib is not installed.
PLOT_SKIPPED = "plot skipped: matplotlib is not installed (pip install 'gpufleet[plot]')"

_FIELDS = [f.name for f in dataclasses.fields(SweepRow)]


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "N/A" if v is None else format(v, spec)


def plot_available() -> bool:
    """Whether matplotlib (the `plot` extra) can be imported here."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a broken or shadowed matplotlib counts as missing
        return False


# The table's columns, (name, right-aligned): busbw and time per block (algbw is in rows.csv).
TABLE_COLUMNS: tuple[tuple[str, bool], ...] = (
    ("collective", False),
    ("size", True),
    ("count", True),
    ("type", False),
    ("redop", False),
    ("root", True),
    ("oop us", True),
    ("oop busbw", True),
    ("ip us", True),
    ("ip busbw", True),
    ("#wrong", True),
)


def table_rows(rows: list[SweepRow]) -> list[tuple[list[str], bool]]:
    """Each row's cells under TABLE_COLUMNS, and whether its results are wrong (for the CLI to
    show in red). The average is the caller's one "# Avg bus bandwidth" line, not a row here."""
    bad = {id(r) for r in failures(rows)}
    return [
        (
            [
                r.collective,
                human_size(r.size),
                str(r.count),
                r.type,
                r.redop,
                str(r.root),
                _fmt(r.oop_time_us),
                _fmt(r.oop_busbw),
                _fmt(r.ip_time_us),
                _fmt(r.ip_busbw),
                f"{_fmt(r.oop_wrong, 'g')}/{_fmt(r.ip_wrong, 'g')}",
            ],
            id(r) in bad,
        )
        for r in rows
    ]


# ---- the files -------------------------------------------------------------------------------


def _free_path(run_dir: Path, stem: str, suffix: str) -> Path:
    """run_dir/stem.suffix, or stem.N.suffix for the first N not taken: never overwrite."""
    p = run_dir / f"{stem}{suffix}"
    n = 1
    while p.exists():
        p = run_dir / f"{stem}.{n}{suffix}"
        n += 1
    return p


def _draw(ax, rows: list[SweepRow], machine_type: str | None, nranks: int, nnodes: int) -> None:
    """One line per collective (type, op); its expected curve dashed over the trusted range."""
    for (coll, typ, op), grp in by_collective(rows).items():
        grp = sorted((r for r in grp if r.size > 0), key=lambda r: r.size)
        if not grp:
            continue
        label = coll if len({(r.type, r.redop) for r in rows}) == 1 else f"{coll} {typ} {op}"
        line = ax.plot([r.size for r in grp], [r.best_busbw for r in grp], marker="o", label=label)[0]
        if machine_type is None:
            continue
        try:
            model = expected_curve(grp, machine_type, nranks, nnodes)
        except ValueError:  # a collective or rank count the model cannot take: no curve
            model = None
        sizes = [r.size for r in grp if model is not None and model.trusted(r.size)]
        if model is not None and sizes:
            ax.plot(
                sizes,
                [model.busbw(s) for s in sizes],
                linestyle="--",
                color=line.get_color(),
                label=f"{label} expected",
            )


def _plot(rows: list[SweepRow], path: Path, machine_type: str | None, nranks: int, nnodes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a laptop's SSH session or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    _draw(ax, rows, machine_type, nranks, nnodes)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    # 0 is unknown: `launch nccl-tests --from` output that names no hosts or ranks.
    title = f"{nnodes or '?'} nodes, {nranks or '?'} ranks" + (f", {machine_type}" if machine_type else "")
    ax.set_title(f"bus bandwidth — {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        with atomic.replacing(path) as tmp:
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)


def _write_csv(rows: list[SweepRow], path: Path) -> None:
    with atomic.replacing(path) as tmp, tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))


def write_results(
    rows: list[SweepRow],
    run_dir: str | Path,
    *,
    machine_type: str | None = None,
    nranks: int,
    nnodes: int,
) -> dict[str, Path]:
    """Write rows.json, rows.csv and busbw.png into run_dir; returns their paths by kind ("png":
    None when matplotlib is not installed)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": _free_path(run_dir, "rows", ".json"),
        "csv": _free_path(run_dir, "rows", ".csv"),
        "png": _free_path(run_dir, "busbw", ".png") if plot_available() else None,
    }
    doc = {
        "machine_type": machine_type,
        "nranks": nranks,
        "nnodes": nnodes,
        "avg_busbw": avg_busbw(rows),
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    atomic.write_text(paths["json"], json.dumps(doc, indent=1) + "\n")
    _write_csv(rows, paths["csv"])
    if paths["png"] is not None:
        _plot(rows, paths["png"], machine_type, nranks, nnodes)
    return paths
