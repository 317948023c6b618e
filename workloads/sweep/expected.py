"""The data: what each rank puts in its buffers, and what every element of every result must
be, so the `-c` check counts wrong elements exactly (nccl-tests' `#wrong`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["count_wrong", "fill", "move_values", "red_values", "reduced", "tolerance"]

# Check data is generated and compared in chunks so a multi-GiB buffer never needs a second
# multi-GiB int64 index tensor next to it.
_CHUNK = 1 << 24

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


def move_values(rank: int, g: torch.Tensor) -> torch.Tensor:
    return (g + rank) % _MOVE_PERIOD + 1


def red_values(rank: int, g: torch.Tensor, op: str) -> torch.Tensor:
    hit = ((g + rank) % _RED_PERIOD == 0).to(torch.int64)
    return hit + 1 if op == "prod" else hit


def reduced(g: torch.Tensor, op: str, nranks: int, dtype: torch.dtype) -> torch.Tensor:
    """What reducing every rank's red_values at global indices g gives, in `dtype`."""
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


def fill(buf: torch.Tensor, start: int, values: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """buf[i] = values(start + i), chunk by chunk (values must repeat every _PERIOD elements)."""
    n = buf.numel()
    tile = _tile(values, start, min(n, _CHUNK), buf)
    for off in range(0, n, _CHUNK):
        m = min(_CHUNK, n - off)
        ph = off % _PERIOD
        buf[off : off + m].copy_(tile[ph : ph + m])


def count_wrong(buf: torch.Tensor, start: int, expected: Callable[[torch.Tensor], torch.Tensor], tol: float) -> int:
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


def tolerance(dtype: torch.dtype, op: str) -> float:
    # Only avg is inexact: sum/n rounds (NCCL premultiplies by 1/n). Every other result of our
    # patterns is a small integer or a power of two, exact in every type, so compare exactly.
    if op != "avg":
        return 0.0
    return {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-5}.get(dtype, 1e-12)
