"""What one block of a collective runs and checks: its buffers within the send and receive
buffers, the call (in or out of place, as nccl-tests places them), the data put in before it and
the count of wrong elements after it (workloads.sweep.expected)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from workloads.sweep import expected

__all__ = ["CASES", "REDUCE_OPS", "Block", "Case", "Spec"]

# One block's columns: time (us), algbw, busbw (GB/s), wrong elements; all None when not run.
Block = tuple[float | None, float | None, float | None, int | None]

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,
}

# torch 2.13 renamed all_gather_into_tensor to all_gather_single and warns on the old name; older
# torch has only the old one (reduce_scatter: workloads.sweep.bench).
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Case:
    """The buffers and calls of one (collective, size, type, op, placement)."""

    run: Callable[[], None]  # one call
    init: Callable[[], None]  # put the input data in place
    check: Callable[[], int | None]  # wrong elements on this rank (None: not checkable)


Values = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Spec:
    """One block as every collective's case takes it. `rank`, `n` and `root` are within `group`
    (None: the world); `groot` is the root's global rank, what src/dst arguments take;
    `reduce_scatter` is the bench's call (emulated where gloo lacks it)."""

    send: torch.Tensor
    recv: torch.Tensor
    count: int
    dtype: torch.dtype
    op: str
    in_place: bool
    rank: int
    n: int
    root: int
    groot: int
    group: Any
    global_rank: Callable[[int], int]
    reduce_scatter: Callable[[torch.Tensor, torch.Tensor, Any], None]

    @property
    def rop(self) -> Any:
        return REDUCE_OPS[self.op]

    @property
    def tol(self) -> float:
        return expected.tolerance(self.dtype, self.op)

    def red(self, rank: int) -> Values:
        return lambda g: expected.red_values(rank, g, self.op)

    def move(self, rank: int) -> Values:
        return lambda g: expected.move_values(rank, g)

    def reduced(self, g: torch.Tensor) -> torch.Tensor:
        return expected.reduced(g, self.op, self.n, self.dtype)


def _reducing(s: Spec, run: Callable[[torch.Tensor], Any], only_root: bool) -> Case:
    """all_reduce and reduce: torch reduces into its input, so out of place the send buffer is
    copied to recv, untimed, and recv is reduced (see the table note)."""
    buf = s.recv[: s.count]
    src = s.send[: s.count] if not s.in_place else buf

    def init() -> None:
        expected.fill(src, 0, s.red(s.rank))
        if not s.in_place:
            buf.copy_(src)

    def check() -> int:
        # reduce: only the root's result is defined (NCCL leaves others' recvbuff alone).
        if only_root and s.rank != s.root:
            return 0
        return expected.count_wrong(buf, 0, s.reduced, s.tol)

    return Case(lambda: run(buf), init, check)


def _all_reduce(s: Spec) -> Case:
    return _reducing(s, lambda buf: dist.all_reduce(buf, op=s.rop, group=s.group), only_root=False)


def _reduce(s: Spec) -> Case:
    return _reducing(s, lambda buf: dist.reduce(buf, dst=s.groot, op=s.rop, group=s.group), only_root=True)


def _broadcast(s: Spec) -> Case:
    # Out of place: the root sends from its send buffer, the others receive into recv.
    buf = s.recv[: s.count] if (s.in_place or s.rank != s.root) else s.send[: s.count]

    def init() -> None:
        if s.rank == s.root:
            expected.fill(buf, 0, s.move(s.root))
        else:
            buf.zero_()

    run = lambda: dist.broadcast(buf, src=s.groot, group=s.group)  # noqa: E731
    return Case(run, init, lambda: expected.count_wrong(buf, 0, s.move(s.root), 0.0))


def _all_gather(s: Spec) -> Case:
    count, out = s.count, s.recv[: s.count * s.n]
    # In place (nccl-tests): this rank's input is its own slice of the output buffer.
    inp = out[s.rank * count : (s.rank + 1) * count] if s.in_place else s.send[:count]

    def init() -> None:
        out.zero_()
        expected.fill(inp, 0, s.move(s.rank))

    def check() -> int:
        return sum(expected.count_wrong(out[j * count : (j + 1) * count], 0, s.move(j), 0.0) for j in range(s.n))

    return Case(lambda: _gather_into(out, inp, group=s.group), init, check)


def _reduce_scatter(s: Spec) -> Case:
    count = s.count
    inp = (s.recv if s.in_place else s.send)[: count * s.n]
    # In place (nccl-tests recvInplaceOffset = base): the output is this rank's slice.
    out = inp[s.rank * count : (s.rank + 1) * count] if s.in_place else s.recv[:count]
    return Case(
        lambda: s.reduce_scatter(out, inp, s.rop),
        lambda: expected.fill(inp, 0, s.red(s.rank)),
        lambda: expected.count_wrong(out, s.rank * count, s.reduced, s.tol),
    )


def _moved(s: Spec, out: torch.Tensor, inp: torch.Tensor) -> Callable[[], None]:
    """The init of alltoall and sendrecv: out cleared (out of place), this rank's data in inp."""

    def init() -> None:
        if not s.in_place:
            out.zero_()
        expected.fill(inp, 0, s.move(s.rank))

    return init


def _alltoall(s: Spec) -> Case:
    count = s.count
    out = s.recv[: count * s.n]
    inp = out if s.in_place else s.send[: count * s.n]

    def check() -> int | None:
        # Like nccl-tests (AlltoAllInitData: reportErrors = !in_place): reading and writing one
        # buffer races, so the in-place result is timed, not checked.
        if s.in_place:
            return None
        # Chunk q of the output came from rank q's chunk r: indices r·count + i there.
        chunk = s.rank * count
        return sum(expected.count_wrong(out[q * count : (q + 1) * count], chunk, s.move(q), 0.0) for q in range(s.n))

    run = lambda: dist.all_to_all_single(out, inp, group=s.group)  # noqa: E731
    return Case(run, _moved(s, out, inp), check)


def _sendrecv(s: Spec) -> Case:
    out = s.recv[: s.count]
    inp = out if s.in_place else s.send[: s.count]
    nxt, prv = (s.rank + 1) % s.n, (s.rank - 1) % s.n

    def run() -> None:
        reqs = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, inp, s.global_rank(nxt), group=s.group),
                dist.P2POp(dist.irecv, out, s.global_rank(prv), group=s.group),
            ]
        )
        for q in reqs:
            q.wait()

    def check() -> int | None:
        # In place the send and the receive share one buffer; gloo reads and writes it
        # concurrently, so (as for alltoall) the in-place block is timed, not checked.
        return None if s.in_place else expected.count_wrong(out, 0, s.move(prv), 0.0)

    return Case(run, _moved(s, out, inp), check)


# Every collective's case, by its nccl-tests name (gpufleet.bandwidth.COLLECTIVES).
CASES: dict[str, Callable[[Spec], Case]] = {
    "all_reduce": _all_reduce,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "alltoall": _alltoall,
    "sendrecv": _sendrecv,
}
