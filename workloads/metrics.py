"""Pure helpers for what rank 0 reports: the log line and the straggler verdict."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

__all__ = ["RankInfo", "find_stragglers", "straggler_warning", "format_log_line", "format_bytes", "preemption_report"]


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs: its global rank, its node (torchrun's GROUP_RANK) and the host name."""

    rank: int
    node: int
    host: str


def find_stragglers(times: list[float], threshold: float = 1.2) -> list[int]:
    """Ranks whose time is above `threshold` x the median of all ranks' times."""
    if len(times) < 2:
        return []
    median = statistics.median(times)
    return [r for r, t in enumerate(times) if median > 0 and t > threshold * median]


def straggler_warning(times: list[float], ranks: list[RankInfo], threshold: float) -> list[str]:
    """One warning line per straggler, naming rank, node and host."""
    median = statistics.median(times) if times else 0.0
    return [
        f"straggler: rank {r} (node {ranks[r].node}, host {ranks[r].host}) compute "
        f"{times[r] * 1e3:.1f} ms/step = {times[r] / median:.2f}x the median {median * 1e3:.1f} ms "
        f"(threshold {threshold}x)"
        for r in find_stragglers(times, threshold)
    ]


def format_log_line(
    step: int,
    steps: int,
    loss: float,
    lr: float,
    step_s: float,
    tokens_per_s: float,
    mfu: float | None,
    peak_mem_gib: float | None,
    tflops: float | None = None,
) -> str:
    """`step 10/100 | loss 3.2145 | lr 6.00e-04 | 123.4 ms/step | 12,345 tok/s | MFU 43.2% | 427.3 TFLOP/s
    | mem 1.2 GiB`. MFU is against the GPU's bf16 peak in every precision, so fp8 and bf16 runs
    compare; `tflops` is the model FLOP/s each GPU achieved (the same count), its effective rate."""
    parts = [
        f"step {step}/{steps}",
        f"loss {loss:.4f}",
        f"lr {lr:.2e}",
        f"{step_s * 1e3:.1f} ms/step",
        f"{tokens_per_s:,.0f} tok/s",
        "MFU n/a" if mfu is None else f"MFU {mfu * 100:.1f}%",
    ]
    if tflops is not None:
        parts.append(f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops:.2g} TFLOP/s")
    if peak_mem_gib is not None:
        parts.append(f"mem {peak_mem_gib:.2f} GiB")
    return " | ".join(parts)


def format_bytes(n: float) -> str:
    """`512 B`, `3.2 MB`, `16.1 GB` (decimal units, as GCS and disk vendors quote them)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def preemption_report(
    step: int, save_s: float, notice_s: float, budget_s: float, nbytes: int, ranks: int, where: str
) -> tuple[bool, str]:
    """Whether the SIGTERM save fit the preemption notice, and the line that says so.

    `notice_s` is how long the notice had already run when the ranks agreed to stop (the step in
    progress finishes first); the budget covers both. When it does not fit, the line names what
    to change: the write rate it would have needed, and the knobs that give it.
    """
    total = notice_s + save_s
    rate = nbytes / save_s if save_s > 0 else float("inf")
    head = (
        f"SIGTERM: checkpoint step {step} saved in {save_s:.2f} s ({format_bytes(nbytes)} from "
        f"{ranks} ranks, {format_bytes(rate)}/s) -> {where}; {total:.2f} s since the notice"
    )
    if total <= budget_s:
        return True, f"{head}, within the {budget_s:g} s --preemption-budget"
    left = budget_s - notice_s
    need = (
        f"it needs {format_bytes(nbytes / left)}/s to fit" if left > 0 else "the step in progress alone used the budget"
    )
    return False, (
        f"{head}, over the {budget_s:g} s --preemption-budget: the VM may stop before the "
        f"next one. {need}: write to faster storage (the local SSD RAID rather than gs://), "
        "spread the state over more ranks (more nodes; each rank writes its own shards), "
        "or shorten the steps (smaller --global-batch per step); and save often "
        "(--checkpoint-every K --async-checkpoint) so a cut save loses little"
    )
