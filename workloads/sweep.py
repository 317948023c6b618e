"""An nccl-tests style collective sweep, run under torchrun: ``python -m workloads.sweep``.

    torchrun --nnodes 2 --nproc-per-node 8 ... -m workloads.sweep --ops all_reduce -b 8 -e 8G -f 2

Flags mirror github.com/NVIDIA/nccl-tests (README.md and its getopt string): -b/-e/-i/-f size ladder (K/M/G binary),
-n timed iterations, -w warm-up iterations, -c correctness checks, -d type, -o reduction, -r root,
plus ``--ops LIST|all`` to pick collectives and ``--json PATH`` to write the rows.

Timing follows nccl-tests' default (src/common.cu BenchTime): a warm-up pass
over every size, then per size one untimed call and a barrier, then ``iters`` calls issued
back-to-back with no synchronisation between them; on GPU the interval is taken with CUDA events
and a final synchronise, on CPU (gloo returns once a call is done) with the wall clock. The time
per op is averaged across ranks (nccl-tests ``-a 1``) and algbw/busbw come from
``gpufleet.bandwidth``. After timing, the data is re-initialised, the op runs ``-c`` times and
every element of every result is compared with what it must be; ``#wrong`` is the number of wrong
elements summed over ranks. Out-of-place runs first, then in-place, as in nccl-tests.

For the bad-node finder (`launch nccl-tests --find-bad-nodes`) two more flags: ``--time-budget
SECONDS`` cuts a slow size's calls short, from the time of its first call, and records in each
row how many calls were timed (``iters``; see SweepConfig.time_budget); ``--rounds PLAN`` runs
one sweep per node group, the groups of a round at the same time on process groups of their own
(gpufleet.groups), so every pair of nodes is measured in one torchrun job.

Rank 0 prints one nccl-tests table per collective (same header lines and column layout, the
"Out of bounds values" and "Avg bus bandwidth" footer), then one line ``#gpufleet-json {...}``
with every row (the launcher parses it; the format is ``gpufleet.contracts``). Exit status: 0 when
every checked result is right, 1 when any ``#wrong`` > 0, 2 for bad arguments (a ``--json`` path
that cannot be written is found before the sweep starts).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpufleet import atomic
from gpufleet.bandwidth import (
    COLLECTIVES,
    DTYPE_SIZES,
    REDOPS,
    algbw,
    avg_busbw,
    busbw,
    coll_sizes,
    size_ladder,
)
from gpufleet.contracts import JSON_MARKER, SWEEP_ERROR_PREFIX, SWEEP_JSON_VERSION, SweepRow, sweep_json_line
from gpufleet.groups import NODE_RANK_ENV, Plan
from workloads.sweep_args import build_parser

__all__ = ["JSON_MARKER", "SweepConfig", "SweepRow", "run_sweep", "format_table", "main"]

JSON_VERSION = SWEEP_JSON_VERSION  # the document's format: gpufleet.contracts

# The dtype of each type name the command line takes (workloads.sweep_args.DATATYPES).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "half": torch.float16,
    "float": torch.float32,
    "double": torch.float64,
    "bfloat16": torch.bfloat16,
}
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,
}
# Collectives with a reduction; the others print redop "none" (nccl-tests all_gather, broadcast,
# alltoall). sendrecv loops over ops like nccl-tests' SendRecvRunTest although it reduces nothing.
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
_ROOTED = ("broadcast", "reduce")

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and warns on the old
# names; older torch has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Check data is generated and compared in chunks so a multi-GiB buffer never needs a second
# multi-GiB int64 index tensor next to it.
_CHUNK = 1 << 24


@dataclass
class SweepConfig:
    """What to run. Field names follow the nccl-tests long options."""

    collectives: tuple[str, ...] = ("all_reduce",)
    """Collectives to sweep, in order."""
    minbytes: int = 32 * 1024**2
    """-b: first size in bytes (nccl-tests default 32M)."""
    maxbytes: int = 32 * 1024**2
    """-e: last size in bytes (nccl-tests default 32M)."""
    stepfactor: int = 1
    """-f: multiply the size by this each step; <= 1 uses stepbytes (nccl-tests default)."""
    stepbytes: int = 1024**2
    """-i: add this to the size each step when stepfactor <= 1 (nccl-tests default 1M)."""
    iters: int = 20
    """-n: timed iterations per size."""
    warmup_iters: int = 1
    """-w: warm-up iterations per size before any timing (nccl-tests default 1 since 2025-08)."""
    check: int = 1
    """-c: correctness-check iterations per size (0: #wrong prints N/A)."""
    datatypes: tuple[str, ...] = ("float",)
    """-d: nccl-tests type names."""
    ops: tuple[str, ...] = ("sum",)
    """-o: reductions, for collectives that reduce (avg runs on floating types only)."""
    root: int = 0
    """-r: root rank of broadcast and reduce."""
    json_path: str | None = None
    """--json: where rank 0 writes the rows (the JSON line is printed regardless)."""
    time_budget: float | None = None
    """--time-budget: seconds a size may take before its calls are cut short (None: never).

    The first call of each size is timed on every rank (after a barrier, so even with -w 0); the
    slowest rank's time t sets how many calls fit: min(-n, max(1, budget // t)) timed calls per
    block, and no more warm-up calls than that. A size whose first call alone took the budget
    or longer is answered by that call: it is the out-of-place time (1 iteration), its result is
    checked (one -c pass), and the in-place block is not run (N/A). A row's `iters` says how
    many calls were timed. Meant for the bad-node finder, where a pair far slower than the rest
    is the answer and measuring it precisely is time wasted."""
    rounds: Plan | None = None
    """--rounds: run one sweep per node group, groups of a round at once (gpufleet.groups)."""
    sizes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        for c in self.collectives:
            if c not in COLLECTIVES:
                raise ValueError(f"collective {c!r} is unknown; one of: {', '.join(COLLECTIVES)}, all")
        for d in self.datatypes:
            if d not in TORCH_DTYPES:
                hint = " (torch.distributed has no collectives for it)" if d in DTYPE_SIZES else ""
                raise ValueError(f"datatype {d!r} is not supported{hint}; one of: {', '.join(TORCH_DTYPES)}")
        for o in self.ops:
            if o not in REDOPS:
                raise ValueError(f"op {o!r} is unknown; one of: {', '.join(REDOPS)}, all")
        if self.ops == ("avg",) and not any(TORCH_DTYPES[d].is_floating_point for d in self.datatypes):
            # With other ops or types too (-o all -d all), avg just skips the integer types.
            raise ValueError("op 'avg' needs a floating datatype (half, float, double, bfloat16)")
        if self.iters < 1:
            raise ValueError(f"iters must be >= 1, got -n {self.iters}")
        if self.warmup_iters < 0 or self.check < 0:
            raise ValueError(f"-w ({self.warmup_iters}) and -c ({self.check}) must be >= 0")
        if self.time_budget is not None and not (self.time_budget > 0 and math.isfinite(self.time_budget)):
            raise ValueError(f"--time-budget must be a number of seconds > 0, got {self.time_budget}")
        self.sizes = size_ladder(self.minbytes, self.maxbytes, self.stepfactor, self.stepbytes)


# ---- data: what each rank holds and what every result must be -------------------------------

# A movement pattern: rank r's element at index g is (g + r) % 97 + 1. Small integers are exact in
# every type (bf16 holds integers to 256) and the rank shift tells any two of 97 ranks apart.
_MOVE_PERIOD = 97
# A reduction pattern: an indicator (g + r) % 3 == 0, so a sum is a count of ranks (exact in bf16
# up to 256·3 ranks), max/min are 0/1 and a product of (1 + indicator) is a power of two.
_RED_PERIOD = 3
# Every pattern and every reduced result repeats every lcm(97, 3) elements: data is made and
# checked one period at a time (_tile).
_PERIOD = _MOVE_PERIOD * _RED_PERIOD


def _index(start: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device, dtype=torch.int64)


def _move_values(rank: int, g: torch.Tensor) -> torch.Tensor:
    return (g + rank) % _MOVE_PERIOD + 1


def _red_values(rank: int, g: torch.Tensor, op: str) -> torch.Tensor:
    hit = ((g + rank) % _RED_PERIOD == 0).to(torch.int64)
    return hit + 1 if op == "prod" else hit


def _reduced(g: torch.Tensor, op: str, nranks: int, dtype: torch.dtype) -> torch.Tensor:
    """What reducing every rank's _red_values at global indices g gives, in `dtype`."""
    # Number of ranks r in [0, n) with (g + r) % 3 == 0, i.e. r ≡ -g (mod 3).
    first = (-g) % _RED_PERIOD
    hits = torch.where(first < nranks, (nranks - 1 - first) // _RED_PERIOD + 1, 0)
    if op == "sum":
        out = hits
    elif op == "prod":
        # 2**hits; integer types wrap like the backend's own integer multiply.
        if dtype.is_floating_point:
            return torch.pow(2.0, hits.to(torch.float64)).to(dtype)
        out = torch.bitwise_left_shift(torch.ones_like(hits), hits.clamp(max=63))
        out = torch.where(hits > 62, 0, out)
    elif op == "max":
        out = (hits > 0).to(torch.int64)
    elif op == "min":
        out = (hits == nranks).to(torch.int64)
    elif op == "avg":
        return (hits.to(torch.float64) / nranks).to(dtype)
    else:  # pragma: no cover - SweepConfig validated the op
        raise ValueError(op)
    # int64 → narrower int wraps modulo 2^bits, as the backend's integer adds do.
    return out.to(dtype)


def _tile(values: Callable[[torch.Tensor], torch.Tensor], start: int, length: int, like: torch.Tensor) -> torch.Tensor:
    """values(start + i) for i < length + _PERIOD, computed on one period and repeated: every
    pattern here repeats every _PERIOD elements, so a chunk at offset `off` is
    tile[off % _PERIOD :][:m]. Copying a tile costs a memcpy; evaluating the pattern element by
    element (int64 index, modulo, compare) cost ~30x that, which at 32 MiB on CPU was most of a
    bad-node search's time."""
    one = values(_index(start, _PERIOD, like.device)).to(like.dtype)
    return one.repeat(-(-(length + _PERIOD) // _PERIOD))


def _fill(buf: torch.Tensor, start: int, values: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """buf[i] = values(start + i), chunk by chunk (values must repeat every _PERIOD elements)."""
    n = buf.numel()
    tile = _tile(values, start, min(n, _CHUNK), buf)
    for off in range(0, n, _CHUNK):
        m = min(_CHUNK, n - off)
        ph = off % _PERIOD
        buf[off : off + m].copy_(tile[ph : ph + m])


def _count_wrong(buf: torch.Tensor, start: int, expected: Callable[[torch.Tensor], torch.Tensor], tol: float) -> int:
    """Elements of buf that differ from expected(start + i) by more than tol (relative);
    expected must repeat every _PERIOD elements."""
    wrong = 0
    n = buf.numel()
    tile = _tile(expected, start, min(n, _CHUNK), buf)
    for off in range(0, n, _CHUNK):
        m = min(_CHUNK, n - off)
        got = buf[off : off + m]
        ph = off % _PERIOD
        exp = tile[ph : ph + m]
        if tol == 0.0:
            bad = got != exp
        else:
            g64, e64 = got.to(torch.float64), exp.to(torch.float64)
            bad = (g64 - e64).abs() > tol * e64.abs().clamp(min=1.0)
        wrong += int(bad.sum().item())
    return wrong


def _tolerance(dtype: torch.dtype, op: str) -> float:
    # Only avg is inexact: sum/n rounds (NCCL premultiplies by 1/n). Every other result of our
    # patterns is a small integer or a power of two, exact in every type, so compare exactly.
    if op != "avg":
        return 0.0
    return {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-5}.get(dtype, 1e-12)


# ---- one collective ------------------------------------------------------------------------


# One block's columns: time (us), algbw, busbw (GB/s), wrong elements; all None when not run.
_Block = tuple[float | None, float | None, float | None, int | None]


@dataclass
class _Case:
    """The buffers and calls of one (collective, size, type, op, placement)."""

    run: Callable[[], None]  # one call
    init: Callable[[], None]  # put the input data in place
    check: Callable[[], int | None]  # wrong elements on this rank (None: not checkable)


class _Bench:
    """One group's sweep. `rank` and `nranks` are within `group` (None: the whole world)."""

    def __init__(self, cfg: SweepConfig, rank: int, nranks: int, device: torch.device, group=None) -> None:
        self.cfg, self.rank, self.n, self.device = cfg, rank, nranks, device
        self.group = group
        self.notes: list[str] = []
        # Set when the backend refuses reduce_scatter_tensor (gloo before torch 2.6) and it is
        # emulated; see _reduce_scatter.
        self._rs_emulated = False

    # --- backend calls; the only place torch.distributed collectives are issued ---

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op) -> None:
        if not self._rs_emulated:
            try:
                _reduce_scatter(out, inp, op=op, group=self.group)
                return
            except (RuntimeError, NotImplementedError) as e:
                if "gloo" not in str(e).lower() and dist.get_backend(self.group) != "gloo":
                    raise
                self._rs_emulated = True
                self.notes.append(
                    "reduce_scatter: this torch's gloo has no reduce_scatter_tensor; emulated as "
                    "all_reduce of the input, then a copy of this rank's slice (slower)"
                )
        tmp = inp.clone()
        dist.all_reduce(tmp, op=op, group=self.group)
        out.copy_(tmp[self.rank * out.numel() : (self.rank + 1) * out.numel()])

    def _global(self, group_rank: int) -> int:
        """The global rank of a rank of this group: what src/dst/peer arguments take."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def case(
        self,
        coll: str,
        send: torch.Tensor,
        recv: torch.Tensor,
        nbytes: int,
        dtype_name: str,
        op: str,
        in_place: bool,
    ) -> tuple[_Case, int, int]:
        """The case for one block, plus the printed size and count."""
        dtype = TORCH_DTYPES[dtype_name]
        sz = coll_sizes(coll, nbytes, DTYPE_SIZES[dtype_name], self.n)
        r, n, root = self.rank, self.n, self.cfg.root
        g, groot = self.group, self._global(self.cfg.root)
        rop = _REDUCE_OPS[op]
        tol = _tolerance(dtype, op)
        count = sz.count

        def red(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda g: _red_values(rank, g, op)

        def move(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda g: _move_values(rank, g)

        def reduced(g: torch.Tensor) -> torch.Tensor:
            return _reduced(g, op, n, dtype)

        if coll in ("all_reduce", "reduce"):
            buf = recv[:count]
            src = send[:count] if not in_place else buf

            def init() -> None:
                _fill(src, 0, red(r))
                if not in_place:
                    # torch's all_reduce/reduce write into their input: the out-of-place block
                    # copies send → recv here, untimed, and reduces recv (see the table note).
                    buf.copy_(src)

            if coll == "all_reduce":
                run = lambda: dist.all_reduce(buf, op=rop, group=g)  # noqa: E731
                check = lambda: _count_wrong(buf, 0, reduced, tol)  # noqa: E731
            else:
                run = lambda: dist.reduce(buf, dst=groot, op=rop, group=g)  # noqa: E731
                # Only the root's result is defined (NCCL leaves others' recvbuff alone).
                check = lambda: _count_wrong(buf, 0, reduced, tol) if r == root else 0  # noqa: E731
        elif coll == "broadcast":
            # Out of place: the root sends from its send buffer, the others receive into recv.
            buf = recv[:count] if (in_place or r != root) else send[:count]

            def init() -> None:
                if r == root:
                    _fill(buf, 0, move(root))
                else:
                    buf.zero_()

            run = lambda: dist.broadcast(buf, src=groot, group=g)  # noqa: E731
            check = lambda: _count_wrong(buf, 0, move(root), 0.0)  # noqa: E731
        elif coll == "all_gather":
            out = recv[: count * n]
            # In place (nccl-tests): this rank's input is its own slice of the output buffer.
            inp = out[r * count : (r + 1) * count] if in_place else send[:count]

            def init() -> None:
                out.zero_()
                _fill(inp, 0, move(r))

            run = lambda: _all_gather(out, inp, group=g)  # noqa: E731

            def check() -> int:
                return sum(_count_wrong(out[j * count : (j + 1) * count], 0, move(j), 0.0) for j in range(n))
        elif coll == "reduce_scatter":
            inp = (recv if in_place else send)[: count * n]
            # In place (nccl-tests recvInplaceOffset = base): the output is this rank's slice.
            out = inp[r * count : (r + 1) * count] if in_place else recv[:count]
            init = lambda: _fill(inp, 0, red(r))  # noqa: E731
            run = lambda: self._reduce_scatter(out, inp, rop)  # noqa: E731
            check = lambda: _count_wrong(out, r * count, reduced, tol)  # noqa: E731
        elif coll == "alltoall":
            out = recv[: count * n]
            inp = out if in_place else send[: count * n]

            def init() -> None:
                if not in_place:
                    out.zero_()
                _fill(inp, 0, move(r))

            run = lambda: dist.all_to_all_single(out, inp, group=g)  # noqa: E731
            if in_place:
                # Like nccl-tests (AlltoAllInitData: reportErrors = !in_place): reading and
                # writing one buffer races, so the in-place result is timed, not checked.
                check = lambda: None  # noqa: E731
            else:
                # Chunk q of the output came from rank q's chunk r: indices r·count + i there.
                def check() -> int:
                    return sum(
                        _count_wrong(out[q * count : (q + 1) * count], r * count, move(q), 0.0) for q in range(n)
                    )
        elif coll == "sendrecv":
            out = recv[:count]
            inp = out if in_place else send[:count]
            nxt, prv = (r + 1) % n, (r - 1) % n

            def init() -> None:
                if not in_place:
                    out.zero_()
                _fill(inp, 0, move(r))

            def run() -> None:
                reqs = dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend, inp, self._global(nxt), group=g),
                        dist.P2POp(dist.irecv, out, self._global(prv), group=g),
                    ]
                )
                for q in reqs:
                    q.wait()

            # In place the send and the receive share one buffer; gloo reads and writes it
            # concurrently, so (as for alltoall) the in-place block is timed, not checked.
            check = (lambda: None) if in_place else (lambda: _count_wrong(out, 0, move(prv), 0.0))  # noqa: E731
        else:  # pragma: no cover - SweepConfig validated the name
            raise ValueError(coll)
        return _Case(run, init, check), sz.size, count

    # --- timing ---

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_per_op(self, c: _Case, iters: int) -> float:
        """Seconds per op on this rank: `iters` back-to-back calls between two synchronisations."""
        c.run()  # one untimed call, then a barrier (nccl-tests TimeTest)
        self._sync()
        dist.barrier(group=self.group)
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                c.run()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            c.run()
        return (time.perf_counter() - t0) / iters

    def sizing_call(self, c: _Case) -> tuple[float, float]:
        """One call, every rank starting together: (this rank's seconds, the slowest rank's)."""
        self._sync()
        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        c.run()
        self._sync()
        sec = time.perf_counter() - t0
        t = torch.tensor([sec], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return sec, t.item()

    def wrong(self, c: _Case) -> int | None:
        total = None
        for _ in range(self.cfg.check):
            c.init()
            c.run()
            self._sync()
            w = c.check()
            total = None if w is None else (total or 0) + w
        return total

    def across_ranks(self, sec: float, wrong: int | None) -> tuple[float, int | None]:
        """Mean time over ranks (nccl-tests -a 1) and wrong elements summed over ranks."""
        t = torch.tensor([sec, float(wrong or 0)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t[0].item() / self.n, (None if wrong is None else int(t[1].item()))

    def block(self, coll: str, size: int, sec: float, wrong: int | None) -> _Block:
        """One block's columns from this rank's seconds per op and wrong count."""
        sec, wrong = self.across_ranks(sec, wrong)
        a = algbw(size, sec) if sec > 0 else 0.0
        b = busbw(coll, size, sec, self.n) if sec > 0 else 0.0
        return (sec * 1e6, a, b, wrong)

    def warm_up(self, coll: str, c: _Case, size: int, label: str) -> int | _Block:
        """Warm one size up; return how many calls to time, or (over the time budget) the
        out-of-place block measured by the size's first call. See SweepConfig.time_budget."""
        cfg = self.cfg
        budget = cfg.time_budget
        c.init()
        if budget is None or size == 0:
            for _ in range(cfg.warmup_iters):
                c.run()
            return cfg.iters
        sec, slowest = self.sizing_call(c)
        if slowest >= budget:
            # The call ran on freshly initialised data, exactly as one -c pass does: check it.
            blk = self.block(coll, size, sec, c.check() if cfg.check > 0 else None)
            self.notes.append(
                f"{label}: its first call took {slowest:.3g} s, over --time-budget {budget:g} s: "
                "timed by that call alone (no warm-up, one check), in-place not run"
            )
            return blk
        fit = max(1, min(cfg.iters, int(budget // slowest)))
        for _ in range(min(cfg.warmup_iters, fit) - 1):
            c.run()
        if fit < cfg.iters:
            self.notes.append(
                f"{label}: {fit} of {cfg.iters} iterations fit --time-budget {budget:g} s (first call {slowest:.3g} s)"
            )
        return fit

    def run_collective(self, coll: str) -> list[SweepRow]:
        cfg = self.cfg
        maxbuf = max(cfg.sizes) if cfg.sizes else 0
        rows: list[SweepRow] = []
        ops = cfg.ops if coll in _REDUCING or coll == "sendrecv" else ("none",)
        for dname in cfg.datatypes:
            dtype = TORCH_DTYPES[dname]
            esize = DTYPE_SIZES[dname]
            # Both buffers hold the largest logical buffer (nccl-tests allocates max bytes for each).
            send = torch.empty(maxbuf // esize + 1, dtype=dtype, device=self.device)
            recv = torch.empty(maxbuf // esize + 1, dtype=dtype, device=self.device)
            for op in ops:
                if op == "avg" and not dtype.is_floating_point:
                    continue  # an integer mean rounds; nothing exact to check it against
                red_op = op if op != "none" else "sum"
                # Warm-up pass over every size (nccl-tests: all sizes, warmup_iters each).
                plan: dict[int, int | _Block] = {}
                for nbytes in cfg.sizes:
                    c, size, _ = self.case(coll, send, recv, nbytes, dname, red_op, False)
                    plan[nbytes] = self.warm_up(coll, c, size, f"{coll} {size} B {dname} {op}")
                self._sync()
                for nbytes in cfg.sizes:
                    blocks = []
                    iters = plan[nbytes]
                    for in_place in (False, True):
                        c, size, count = self.case(coll, send, recv, nbytes, dname, red_op, in_place)
                        if not isinstance(iters, int):  # answered by its first call
                            blocks.append(iters if not in_place else (None, None, None, None))
                            continue
                        c.init()
                        sec = self.time_per_op(c, iters) if size > 0 else 0.0
                        wrong = self.wrong(c) if cfg.check > 0 else None
                        blocks.append(self.block(coll, size, sec, wrong))
                    root = cfg.root if coll in _ROOTED else -1
                    rows.append(
                        SweepRow(
                            coll,
                            size,
                            count,
                            dname,
                            op,
                            root,
                            self.n,
                            *blocks[0],
                            *blocks[1],
                            iters=iters if isinstance(iters, int) else 1,
                        )
                    )
        return rows


# ---- output ----------------------------------------------------------------------------------


def _float_str(value: float, width: int) -> str:
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
    head = "  %7s  %6s  %6s" % (_float_str(time_us, 7), _float_str(alg, 6), _float_str(bus, 6))
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


def _notes_for(coll: str, bench: _Bench) -> list[str]:
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
    notes += [n for n in bench.notes if n.startswith((f"{coll}:", f"{coll} "))]
    return notes


def _rank_line(rank: int, device: torch.device) -> str:
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
    bench = _Bench(cfg, rank, n, device, group)
    lines: list[object] = [None] * n
    dist.all_gather_object(lines, _rank_line(rank, device), group=group)
    rows: list[SweepRow] = []
    text = []
    for coll in cfg.collectives:
        if coll == "sendrecv" and n == 1:
            text.append("# sendrecv skipped: it needs 2 or more ranks (torch cannot send to itself)\n")
            continue
        crow = bench.run_collective(coll)
        rows += crow
        text.append(format_table(coll, crow, cfg, [str(x) for x in lines], _notes_for(coll, bench)))
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


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> SweepConfig:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        return SweepConfig(
            collectives=a.collectives,
            minbytes=a.minbytes,
            maxbytes=a.maxbytes,
            stepfactor=a.stepfactor,
            stepbytes=a.stepbytes,
            iters=a.iters,
            warmup_iters=a.warmup_iters,
            check=a.check,
            datatypes=a.datatype,
            ops=a.op,
            root=a.root,
            json_path=a.json_path,
            time_budget=a.time_budget,
            rounds=a.rounds,
        )
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: error() exits


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            f"{SWEEP_ERROR_PREFIX}RANK/WORLD_SIZE are not set; run it under torchrun "
            "(torchrun --nproc-per-node 2 -m workloads.sweep ...)",
            file=sys.stderr,
        )
        return 2
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        # Rank 0 alone writes --json; it proves the path writable now, not after the whole sweep,
        # and every rank learns the verdict so they all stop together.
        problem: list[str | None] = [None]
        if not 0 <= cfg.root < n:
            problem[0] = f"root {cfg.root} is not a rank of this run (0..{n - 1}); pass -r 0"
        elif rank == 0 and cfg.json_path:
            problem[0] = _json_path_problem(cfg.json_path)
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            if rank == 0:
                print(f"{SWEEP_ERROR_PREFIX}{problem[0]}", file=sys.stderr)
            return 2
        try:
            rows, payload, text = _sweep(cfg, device, _emit if rank == 0 else None)
        except PlanError as e:
            if rank == 0:
                print(f"{SWEEP_ERROR_PREFIX}{e}", file=sys.stderr)
            return 2
        if rank == 0:
            sys.stdout.write(text)
            sys.stdout.flush()
            if cfg.json_path:
                try:
                    _write_json(cfg.json_path, payload)
                except OSError as e:
                    print(
                        f"{SWEEP_ERROR_PREFIX}cannot write --json {cfg.json_path}: {e.strerror or e}", file=sys.stderr
                    )
                    return 2
        failed = any((r.oop_wrong or 0) + (r.ip_wrong or 0) > 0 for r in rows)
        return 1 if failed else 0
    finally:
        dist.destroy_process_group()


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


if __name__ == "__main__":
    sys.exit(main())
