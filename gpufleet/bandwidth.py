"""Bandwidth arithmetic of NVIDIA nccl-tests.

Pure: no torch, no I/O. The sweep (`workloads/sweep/`, on the nodes) and the report
(`launcher/nccl/`, on the laptop) both compute with these functions, so a number printed
on a node and a number recomputed from a parsed table can never disagree.

Definitions follow github.com/NVIDIA/nccl-tests (@a0b82b2, 2.19.6: `src/common.cu` setupArgs, the
per-collective `*GetCollByteCount` and `*GetBw` in `src/<coll>.cu`, `src/util.cu`,
`doc/PERFORMANCE.md`):

- the *size* column S is max(send bytes, recv bytes) of one call — the full logical buffer;
- ``algbw = S / 1e9 / sec`` (GB/s, decimal) for every collective once written in terms of S
  (all_gather/reduce_scatter/alltoall count per-rank elements, times n, times the type size = S);
- ``busbw = algbw × factor`` with factor 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
  reduce_scatter, alltoall), 1 (broadcast, reduce, sendrecv).

The expected-bandwidth model (the α-β curve, what B and A are for a machine type, and where the
curve is trusted) is `gpufleet.expected`, which computes with this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpufleet.contracts import SweepRow

__all__ = [
    "COLLECTIVES",
    "DTYPE_SIZES",
    "REDOPS",
    "CollSizes",
    "SizeError",
    "bus_factor",
    "coll_sizes",
    "algbw",
    "busbw",
    "avg_busbw",
    "parse_size",
    "format_size",
    "size_ladder",
]

# The seven collectives of the nccl-tests suite we mirror, by the name of their binary minus
# "_perf" (`src/all_reduce.cu` → all_reduce_perf → "all_reduce").
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "alltoall",
    "sendrecv",
)

# nccl-tests type names (`test_typenames` in src/common.cu) and their element sizes.
DTYPE_SIZES: dict[str, int] = {
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "half": 2,
    "float": 4,
    "double": 8,
    "bfloat16": 2,
}

# nccl-tests `-o` names (`test_opnames`), minus "mulsum" which is a premul-sum test op of NCCL's own.
REDOPS: tuple[str, ...] = ("sum", "prod", "max", "min", "avg")

_BUS_FACTOR = {
    # (n-1)/n-style factors as functions of n; nccl-tests src/<coll>.cu *GetBw.
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}

# Collectives whose `count` column is per rank (or per peer) and is rounded down to a multiple of
# 16 bytes: `(count/nranks) & -(16/eltSize)` in All{Gather,ToAll}/ReduceScatterGetCollByteCount.
_PER_RANK = frozenset({"all_gather", "reduce_scatter", "alltoall"})


def _check_collective(collective: str) -> None:
    if collective not in _BUS_FACTOR:
        raise ValueError(f"collective {collective!r} is unknown; one of: {', '.join(COLLECTIVES)}")


def _check_nranks(nranks: int) -> None:
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")


def bus_factor(collective: str, nranks: int) -> float:
    """busbw / algbw for `collective` on `nranks` ranks, as nccl-tests defines it."""
    _check_collective(collective)
    _check_nranks(nranks)
    return _BUS_FACTOR[collective](nranks)


@dataclass(frozen=True)
class CollSizes:
    """The buffers of one call, as nccl-tests sizes them for a requested byte count."""

    size: int  # the printed `size` column: max(send_bytes, recv_bytes)
    count: int  # the printed `count` column: the NCCL count argument (per rank for AG/RS/A2A)
    send_bytes: int
    recv_bytes: int


def coll_sizes(collective: str, nbytes: int, type_size: int, nranks: int) -> CollSizes:
    """What nccl-tests does with `-b/-e` = nbytes: count = nbytes/type_size, then per collective.

    all_gather: each rank sends `base` elements, receives base·n; reduce_scatter the reverse;
    alltoall sends and receives base·n (base per peer); base = (count/n) rounded down to a
    multiple of 16 bytes. The others move `count` elements. Source: src/common.cu setupArgs and the
    *GetCollByteCount functions of nccl-tests.
    """
    _check_collective(collective)
    _check_nranks(nranks)
    if type_size not in (1, 2, 4, 8):
        raise ValueError(f"type size {type_size} is not one of 1, 2, 4, 8 bytes")
    if nbytes < 0:
        raise ValueError(f"size must be >= 0 bytes, got {nbytes}")
    count = nbytes // type_size
    if collective in _PER_RANK:
        align = 16 // type_size  # elements per 16 bytes
        base = (count // nranks) // align * align
        total = base * nranks * type_size
        if collective == "all_gather":
            return CollSizes(total, base, base * type_size, total)
        if collective == "reduce_scatter":
            return CollSizes(total, base, total, base * type_size)
        return CollSizes(total, base, total, total)  # alltoall
    b = count * type_size
    return CollSizes(b, count, b, b)


def algbw(size: int, sec: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s) of a call whose printed size is `size` bytes."""
    if sec <= 0:
        raise ValueError(f"time per op must be > 0 s, got {sec}")
    return size / 1.0e9 / sec


def busbw(collective: str, size: int, sec: float, nranks: int) -> float:
    """Bus bandwidth in GB/s: algbw × bus_factor (src/<coll>.cu *GetBw)."""
    return algbw(size, sec) * bus_factor(collective, nranks)


def avg_busbw(rows: list[SweepRow]) -> float:
    """nccl-tests' "Avg bus bandwidth": the mean busbw over every block of every row (a block
    with no busbw, None, is one the output did not print, and is left out)."""
    vals = [b for r in rows for b in (r.oop_busbw, r.ip_busbw) if b is not None]
    return sum(vals) / len(vals) if vals else 0.0


class SizeError(ValueError):
    """A size argument nccl-tests would not accept. str() is the one-line message."""


# nccl-tests parsesize(): `sscanf(value, "%zu %1[kmgKMG]")`, K/M/G binary (1024^k).
_SIZE_RE = re.compile(r"\s*(\d+)\s*([kKmMgG]?)\s*")
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(text: str) -> int:
    """`8` → 8, `1K` → 1024, `8M` → 8·2^20, `8G` → 8·2^30; raises SizeError naming the value."""
    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise SizeError(
            f"size {text!r} is not understood; write bytes as an integer with an optional "
            "K, M or G suffix (binary, like nccl-tests): 8, 1K, 8M, 8G"
        )
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_size(nbytes: int) -> str:
    """The shortest exact K/M/G spelling of a byte count (inverse of parse_size)."""
    for suffix, unit in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def size_ladder(minbytes: int, maxbytes: int, stepfactor: int = 2, stepbytes: int = 0) -> list[int]:
    """The sizes nccl-tests visits: from minbytes while <= maxbytes, ×stepfactor (or +stepbytes).

    src/common.cu TimeTest: `size = minBytes; size <= maxBytes; size = stepFactor > 1 ?
    size*stepFactor : size+stepBytes`. stepbytes is used only when stepfactor <= 1.
    """
    if minbytes < 0 or maxbytes < 0:
        raise SizeError(f"sizes must be >= 0 bytes, got -b {minbytes} -e {maxbytes}")
    if minbytes > maxbytes:
        raise SizeError(
            f"minbytes {format_size(minbytes)} is larger than maxbytes {format_size(maxbytes)}; swap -b and -e"
        )
    if stepfactor <= 1 and stepbytes <= 0:
        raise SizeError(f"step factor {stepfactor} would never reach maxbytes; use -f 2 or more")
    if stepfactor > 1 and minbytes == 0:
        raise SizeError("minbytes 0 with a step factor never grows; start at -b 8 or more")
    sizes = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        size = size * stepfactor if stepfactor > 1 else size + stepbytes
    return sizes
