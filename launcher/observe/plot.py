"""`launch top --plot FILE.jsonl`: a PNG of a `--record` file, so a user can see when one node
fell behind. Two panels sharing the time axis, one line per node: mean GPU utilization, and the
data NICs' Gbit/s (rx + tx; GPU NICs, or the host NIC on a node with none); a flagged sample is
marked with a red dot, an unreachable node with a grey cross on the time axis.

matplotlib comes with the `plot` extra (`pip install 'gpufleet[plot]'`) and is imported only
here, with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from launcher.core.types import UserError
from launcher.observe.top import SCHEMA

__all__ = ["read_record", "plot_record"]


def read_record(path: Path) -> list[dict]:
    """Every sample line of a `--record` file. A line that is not one (a torn last line of a
    view that was killed mid-write) is skipped; a file with none is a UserError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(
            f"--plot {path}: cannot read it ({e.strerror}); give a file `launch top --record` wrote"
        ) from None
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("schema") == SCHEMA:
            out.append(rec)
    if not out:
        raise UserError(f"--plot {path}: no `{SCHEMA}` samples in it; give a file `launch top --record` wrote")
    return out


def _series(records: list[dict]) -> tuple[dict[int, dict[str, list]], dict[int, str]]:
    """Per node: times, mean GPU util, data-NIC Gbit/s, flagged and unreachable moments."""
    t0 = min(r["received"] for r in records if r.get("received") is not None)
    series: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    hosts: dict[int, str] = {}
    for r in records:
        node, t = r["node"], (r.get("received") or t0) - t0
        hosts[node] = r.get("host", "")
        s = series[node]
        if r["status"] != "ok":
            s["down"].append(t)
            continue
        gpu = r.get("gpu") or {}
        s["t"].append(t)
        s["gpu"].append(gpu.get("util_mean_pct"))
        s["net"].append(r.get("data_gbps"))
        if r.get("flagged"):
            s["flag_t"].append(t)
            s["flag_net"].append(r.get("data_gbps") or 0.0)
    return series, hosts


def _nan(values: list) -> list[float]:
    return [float("nan") if v is None else v for v in values]


def _draw_node(ax_gpu, ax_net, s: dict[str, list], label: str, has_gpu: bool) -> None:
    line = None
    if has_gpu:
        (line,) = ax_gpu.plot(s["t"], _nan(s["gpu"]), label=label, linewidth=1)
    color = line.get_color() if line is not None else None
    ax_net.plot(s["t"], _nan(s["net"]), label=label, linewidth=1, color=color)
    if s["flag_t"]:
        ax_net.scatter(s["flag_t"], s["flag_net"], color="red", s=12, zorder=3)
    if s["down"]:
        ax_net.scatter(s["down"], [0.0] * len(s["down"]), marker="x", color="grey", s=20, zorder=3)


def plot_record(path: Path, output: Path | None = None) -> Path:
    """Draw `path` (a `--record` file) into `output` (default: the same name, .png)."""
    records = read_record(path)
    output = Path(output) if output else Path(path).with_suffix(".png")
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'gpufleet[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, hosts = _series(records)
    has_gpu = any(v is not None for s in series.values() for v in s["gpu"])
    fig, (ax_gpu, ax_net) = plt.subplots(2, 1, sharex=True, figsize=(11, 7), constrained_layout=True)
    for node in sorted(series):
        _draw_node(ax_gpu, ax_net, series[node], f"node {node} ({hosts[node]})", has_gpu)
    if has_gpu:
        ax_gpu.set_ylim(0, 105)
    else:
        ax_gpu.text(
            0.5,
            0.5,
            "no GPU on these nodes (no nvidia-smi)",
            ha="center",
            va="center",
            transform=ax_gpu.transAxes,
            color="grey",
        )
    ax_gpu.set_ylabel("GPU util, mean %")
    ax_net.set_ylabel("data NICs, Gbit/s (rx+tx)")
    ax_net.set_xlabel("seconds since the first sample")
    handles, labels = ax_net.get_legend_handles_labels()
    if len(labels) <= 16:
        ax_net.legend(handles, labels, fontsize="small", loc="upper right")
    ax_gpu.set_title(f"launch top: {len(series)} nodes — red dot: flagged (slow data NICs), x: unreachable")
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
