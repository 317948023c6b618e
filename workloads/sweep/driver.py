"""The run: every collective of the config in the process group (or, with --rounds, in each
node group of each round), the tables and the `#gpufleet-json` line, `--json`, the exit status."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpufleet import atomic
from gpufleet.bandwidth import avg_busbw
from gpufleet.contracts import SWEEP_ERROR_PREFIX, SWEEP_JSON_VERSION, SweepRow, sweep_json_line
from gpufleet.groups import NODE_RANK_ENV
from workloads.sweep.bench import Bench
from workloads.sweep.config import SweepConfig, parse_args
from workloads.sweep.table import format_table, notes_for, rank_line

__all__ = ["PlanError", "main", "run_sweep"]

JSON_VERSION = SWEEP_JSON_VERSION  # the document's format: gpufleet.contracts


def run_sweep(cfg: SweepConfig, device: torch.device) -> tuple[list[SweepRow], str]:
    """Run every collective of cfg in the initialised process group.

    Returns the rows and, on rank 0, the text to print (tables then the JSON line; "" elsewhere).
    """
    rows, _, text = _sweep(cfg, device)
    return rows, text


def _sweep(
    cfg: SweepConfig, device: torch.device, emit: Callable[[str], None] | None = None
) -> tuple[list[SweepRow], dict[str, Any], str]:
    """run_sweep, plus the JSON document: built once, for the printed line and for --json.
    With --rounds and `emit`, rank 0 hands each round's text to emit as the round ends (a
    search over many rounds shows progress) and returns only what is left."""
    if cfg.rounds is not None:
        return _sweep_rounds(cfg, device, emit)
    rows, payload, text = _group_sweep(cfg, device, None, {})
    return rows, payload, (text if dist.get_rank() == 0 else "")


def _group_sweep(
    cfg: SweepConfig, device: torch.device, group, extra: dict[str, Any]
) -> tuple[list[SweepRow], dict[str, Any], str]:
    """Every collective of cfg within `group` (None: the world): rows, JSON document, and the
    text (tables, then the JSON line) as this group's rank 0 would print it."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    bench = Bench(cfg, rank, n, device, group)
    lines: list[object] = [None] * n
    dist.all_gather_object(lines, rank_line(rank, device), group=group)
    rows: list[SweepRow] = []
    text = []
    for coll in cfg.collectives:
        if coll == "sendrecv" and n == 1:
            text.append("# sendrecv skipped: it needs 2 or more ranks (torch cannot send to itself)\n")
            continue
        crow = bench.run_collective(coll)
        rows += crow
        text.append(format_table(coll, crow, cfg, [str(x) for x in lines], notes_for(coll, bench.notes)))
    payload = {
        "version": JSON_VERSION,
        **extra,
        "nranks": n,
        "backend": dist.get_backend(group),
        "avg_busbw": avg_busbw(rows),
        "rows": [r.__dict__ for r in rows],
    }
    text.append(sweep_json_line(payload))
    return rows, payload, "".join(text)


class PlanError(ValueError):
    """--rounds names a node this run does not have."""


def _node_rank() -> int:
    """This process's node: the launcher's node rank, else torchrun's GROUP_RANK."""
    return int(os.environ.get(NODE_RANK_ENV) or os.environ.get("GROUP_RANK") or 0)


def _sweep_rounds(
    cfg: SweepConfig, device: torch.device, emit: Callable[[str], None] | None
) -> tuple[list[SweepRow], dict[str, Any], str]:
    """One sweep per group of each round of cfg.rounds, the groups of a round at once, each on a
    process group of its own; global rank 0 prints every group's tables and JSON line."""
    assert cfg.rounds is not None
    rank, n = dist.get_rank(), dist.get_world_size()
    node_of: list[object] = [None] * n
    dist.all_gather_object(node_of, _node_rank())
    ranks_of: dict[int, list[int]] = {}
    for r, node in enumerate(node_of):
        ranks_of.setdefault(int(node), []).append(r)  # type: ignore[arg-type]
    # Every rank sees the same nodes, so every rank raises the same error, before any group.
    missing = sorted({nd for rnd in cfg.rounds for grp in rnd for nd in grp} - set(ranks_of))
    if missing:
        raise PlanError(
            f"--rounds names node {missing[0]}, but this run's nodes are "
            f"{', '.join(map(str, sorted(ranks_of)))} ({NODE_RANK_ENV}, else GROUP_RANK)"
        )
    smallest = min(sum(len(ranks_of[nd]) for nd in grp) for rnd in cfg.rounds for grp in rnd)
    if cfg.root >= smallest:
        raise PlanError(f"root {cfg.root} is not a rank of every group (the smallest has {smallest} ranks); pass -r 0")
    rows: list[SweepRow] = []
    docs: list[dict[str, Any]] = []
    text: list[str] = []
    for i, rnd in enumerate(cfg.rounds):
        t0 = time.perf_counter()
        members = [sorted(r for nd in grp for r in ranks_of[nd]) for grp in rnd]
        mine, _ = dist.new_subgroups_by_enumeration(members)
        result = None
        if mine is not None:
            k = next(j for j, m in enumerate(members) if rank in m)
            extra = {"round": i, "nodes": list(rnd[k])}
            grows, doc, gtext = _group_sweep(cfg, device, mine, extra)
            if rank == members[k][0]:
                result = (k, [r.__dict__ for r in grows], doc, gtext)
        gathered: list[object] = [None] * n
        dist.all_gather_object(gathered, result)
        if mine is not None:
            dist.destroy_process_group(mine)
        for k, grows, doc, gtext in sorted((g for g in gathered if g is not None), key=lambda g: g[0]):
            rows += [SweepRow(**d) for d in grows]
            docs.append(doc)
            text.append(f"# round {i + 1}: nodes {'+'.join(map(str, rnd[k]))}\n{gtext}")
        text.append(f"# round {i + 1} of {len(cfg.rounds)} done in {time.perf_counter() - t0:.1f} s\n")
        if emit is not None and rank == 0:
            emit("".join(text))
            text = []
    payload = {"version": JSON_VERSION, "groups": docs}
    return rows, payload, ("".join(text) if rank == 0 else "")


def main(argv: list[str] | None = None) -> int:
    """Parse, sweep and report under torchrun, always leaving the process group. Exit status: 0
    every checked result right, 1 wrong elements, 2 bad arguments."""
    cfg = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            f"{SWEEP_ERROR_PREFIX}RANK/WORLD_SIZE are not set; run it under torchrun "
            "(torchrun --nproc-per-node 2 -m workloads.sweep ...)",
            file=sys.stderr,
        )
        return 2
    device = _init_process_group()
    try:
        return _run(cfg, device)
    finally:
        dist.destroy_process_group()


def _init_process_group() -> torch.device:
    """NCCL on this rank's GPU, else gloo on the CPU; returns the device the buffers live on."""
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def _run(cfg: SweepConfig, device: torch.device) -> int:
    rank = dist.get_rank()
    problem = _agreed_problem(cfg, rank, dist.get_world_size())
    if problem:
        return _bad_arguments(rank, problem)
    try:
        rows, payload, text = _sweep(cfg, device, _emit if rank == 0 else None)
    except PlanError as e:
        return _bad_arguments(rank, str(e))
    if rank == 0:
        _emit(text)
        if cfg.json_path:
            try:
                _write_json(cfg.json_path, payload)
            except OSError as e:
                return _bad_arguments(rank, f"cannot write --json {cfg.json_path}: {e.strerror or e}")
    failed = any((r.oop_wrong or 0) + (r.ip_wrong or 0) > 0 for r in rows)
    return 1 if failed else 0


def _agreed_problem(cfg: SweepConfig, rank: int, n: int) -> str | None:
    """Collective: what makes the arguments unusable here, the same on every rank. Rank 0 alone
    writes --json; it proves the path writable now, not after the whole sweep, and every rank
    learns the verdict so they all stop together."""
    problem: list[str | None] = [None]
    if not 0 <= cfg.root < n:
        problem[0] = f"root {cfg.root} is not a rank of this run (0..{n - 1}); pass -r 0"
    elif rank == 0 and cfg.json_path:
        problem[0] = _json_path_problem(cfg.json_path)
    dist.broadcast_object_list(problem, src=0)
    return problem[0]


def _bad_arguments(rank: int, why: str) -> int:
    """Rank 0 says why in one line; every rank that gets here exits 2."""
    if rank == 0:
        print(f"{SWEEP_ERROR_PREFIX}{why}", file=sys.stderr)
    return 2


def _emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _json_path_problem(path: str) -> str | None:
    """Why --json PATH cannot be written (its directory missing or read-only, or PATH a
    directory), or None: the same temp file _write_json writes is created and removed."""
    if os.path.isdir(path):
        return f"--json {path} is a directory; pass a file path"
    tmp = atomic.temp_path(path)
    try:
        with open(tmp, "w"):
            pass
        os.remove(tmp)
    except OSError as e:
        return f"--json {path}: cannot write there ({e.strerror or e}); create its directory or pass another path"
    return None


def _write_json(path: str, payload: dict[str, Any]) -> None:
    """Write the document atomically: a reader never sees half a file, an old file is replaced whole."""
    atomic.write_text(path, json.dumps(payload, indent=1) + "\n")
