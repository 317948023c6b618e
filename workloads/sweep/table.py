"""What rank 0 prints: one nccl-tests table per collective, with nccl-tests' number format."""

from __future__ import annotations

import os
import socket

import torch

from gpufleet.bandwidth import avg_busbw
from gpufleet.contracts import SweepRow
from workloads.sweep.config import SweepConfig

__all__ = ["HEADER", "float_str", "format_row", "format_table", "notes_for", "rank_line"]


def float_str(value: float, width: int) -> str:
    """nccl-tests getFloatStr (src/util.cu): 2 decimals while they fit, then 1, 0, then %e."""
    power = 0
    v = 1
    while value >= v:
        power += 1
        v *= 10
    if power < width - 2:
        return "%*.2f" % (width, value)
    if power < width - 1:
        return "%*.1f" % (width, value)
    if power < width + 1:
        return "%*.0f" % (width, value)
    if width >= 7:
        return "%*.1e" % (width, value)
    return "%*.0e" % (width, value)


def _block(time_us: float | None, alg: float | None, bus: float | None, wrong: int | None) -> str:
    if time_us is None:  # a block that was not run (--time-budget): N/A in every column
        return "  %7s  %6s  %6s  %6s" % ("N/A", "N/A", "N/A", "N/A")
    head = "  %7s  %6s  %6s" % (float_str(time_us, 7), float_str(alg, 6), float_str(bus, 6))
    return head + ("    N/A" if wrong is None else "  %6g" % wrong)


def format_row(row: SweepRow) -> str:
    """One data line, `%12li  %12li  %8s  %6s  %6s` then the two blocks (src/util.cu)."""
    pre = "%12li  %12li  %8s  %6s  %6s" % (row.size, row.count, row.type, row.redop, "%6i" % row.root)
    return (
        pre
        + _block(row.oop_time_us, row.oop_algbw, row.oop_busbw, row.oop_wrong)
        + _block(row.ip_time_us, row.ip_algbw, row.ip_busbw, row.ip_wrong)
    )


HEADER = (
    "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n"
    % ("", "", "", "", "")
    + "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s \n"
    % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong")
    + "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s \n"
    % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "")
)


def format_table(coll: str, rows: list[SweepRow], cfg: SweepConfig, rank_lines: list[str], notes: list[str]) -> str:
    """The full nccl-tests style report of one collective, preamble to footer."""
    step = f"{cfg.stepfactor}(factor)" if cfg.stepfactor > 1 else f"{cfg.stepbytes}(bytes)"
    out = [
        f"# Collective test starting: {coll}_perf",
        f"# nThread 1 nGpus 1 minBytes {cfg.minbytes} maxBytes {cfg.maxbytes} step: {step} "
        f"warmup iters: {cfg.warmup_iters} iters: {cfg.iters} agg iters: 1 "
        f"validation: {min(cfg.check, 1)} graph: 0",
        "#",
        "# Using devices",
        *rank_lines,
    ]
    out += [f"# note: {n}" for n in notes]
    out.append("#")
    text = "\n".join(out) + "\n" + HEADER
    text += "".join(format_row(r) + "\n" for r in rows)
    wrong = sum((r.oop_wrong or 0) + (r.ip_wrong or 0) for r in rows)
    text += "# %-20s : %d %s\n" % ("Out of bounds values", wrong, "FAILED" if wrong else "OK")
    text += "# %-20s : %g \n" % ("Avg bus bandwidth", avg_busbw(rows))
    text += "#\n"
    text += f"# Collective test concluded: {coll}_perf\n"
    return text


def notes_for(coll: str, found: list[str]) -> list[str]:
    """The table's notes: how torch.distributed differs from NCCL for `coll`, and what the bench
    `found` (emulations, the time budget) about it."""
    notes = []
    if coll in ("all_reduce", "reduce"):
        notes.append(
            f"{coll}: torch.distributed reduces into its input, so out-of-place copies "
            "send -> recv untimed and reduces recv; both blocks time the same call"
        )
    if coll == "broadcast":
        notes.append("broadcast: out-of-place sends from the root's send buffer into recv elsewhere")
    if coll in ("alltoall", "sendrecv"):
        notes.append(f"{coll}: in-place reads and writes one buffer; timed, not checked (N/A)")
    # "reduce" must not pick up reduce_scatter's notes: match the name and what follows it.
    notes += [n for n in found if n.startswith((f"{coll}:", f"{coll} "))]
    return notes


def rank_line(rank: int, device: torch.device) -> str:
    host = socket.gethostname()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        bus = "%04x:%02x:%02x" % (
            getattr(p, "pci_domain_id", 0),
            getattr(p, "pci_bus_id", 0),
            getattr(p, "pci_device_id", 0),
        )
        return "#  Rank %2d Group  0 Pid %6d on %10s device %2d [%s] %s" % (
            rank,
            os.getpid(),
            host,
            device.index or 0,
            bus,
            p.name,
        )
    return "#  Rank %2d Group  0 Pid %6d on %10s device  0 [cpu] CPU (gloo)" % (rank, os.getpid(), host)
