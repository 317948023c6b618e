"""One group's sweep of one collective: its buffers and calls (`Bench.case`), the warm-up and the
timing (nccl-tests' BenchTime), the check, and the rows."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gpufleet.bandwidth import DTYPE_SIZES, algbw, busbw, coll_sizes
from gpufleet.contracts import SweepRow
from workloads.sweep.cases import CASES, Block, Case, Spec
from workloads.sweep.config import TORCH_DTYPES, SweepConfig

__all__ = ["Bench"]

# Collectives with a reduction; the others print redop "none" (nccl-tests all_gather, broadcast,
# alltoall). sendrecv loops over ops like nccl-tests' SendRecvRunTest although it reduces nothing.
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
_ROOTED = ("broadcast", "reduce")

# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single and warns on the old name;
# older torch has only the old one (all_gather: workloads.sweep.cases).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Bench:
    """One group's sweep. `rank` and `nranks` are within `group` (None: the whole world)."""

    def __init__(self, cfg: SweepConfig, rank: int, nranks: int, device: torch.device, group=None) -> None:
        self.cfg, self.rank, self.n, self.device = cfg, rank, nranks, device
        self.group = group
        self.notes: list[str] = []
        # Set when the backend refuses reduce_scatter_tensor (gloo before torch 2.6) and it is
        # emulated; see _reduce_scatter.
        self._rs_emulated = False

    # --- what the cases call back ---

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
    ) -> tuple[Case, int, int]:
        """The case for one block (workloads.sweep.cases), plus the printed size and count."""
        sz = coll_sizes(coll, nbytes, DTYPE_SIZES[dtype_name], self.n)
        spec = Spec(
            send,
            recv,
            sz.count,
            TORCH_DTYPES[dtype_name],
            op,
            in_place,
            self.rank,
            self.n,
            self.cfg.root,
            self._global(self.cfg.root),
            self.group,
            self._global,
            self._reduce_scatter,
        )
        return CASES[coll](spec), sz.size, sz.count

    # --- timing ---

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_per_op(self, c: Case, iters: int) -> float:
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

    def sizing_call(self, c: Case) -> tuple[float, float]:
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

    def wrong(self, c: Case) -> int | None:
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

    def block(self, coll: str, size: int, sec: float, wrong: int | None) -> Block:
        """One block's columns from this rank's seconds per op and wrong count."""
        sec, wrong = self.across_ranks(sec, wrong)
        a = algbw(size, sec) if sec > 0 else 0.0
        b = busbw(coll, size, sec, self.n) if sec > 0 else 0.0
        return (sec * 1e6, a, b, wrong)

    def warm_up(self, coll: str, c: Case, size: int, label: str) -> int | Block:
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
        """Every row of one collective: each type, each op, each size."""
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
                rows += self._rows(coll, send, recv, dname, op)
        return rows

    def _rows(self, coll: str, send: torch.Tensor, recv: torch.Tensor, dname: str, op: str) -> list[SweepRow]:
        """One type and op: a warm-up pass over every size (nccl-tests: all sizes, warmup_iters
        each), then each size's row."""
        plan: dict[int, int | Block] = {}
        for nbytes in self.cfg.sizes:
            c, size, _ = self.case(coll, send, recv, nbytes, dname, _reduction(op), False)
            plan[nbytes] = self.warm_up(coll, c, size, f"{coll} {size} B {dname} {op}")
        self._sync()
        return [self._row(coll, send, recv, nbytes, dname, op, plan[nbytes]) for nbytes in self.cfg.sizes]

    def _row(
        self, coll: str, send: torch.Tensor, recv: torch.Tensor, nbytes: int, dname: str, op: str, iters: int | Block
    ) -> SweepRow:
        """One size: its out-of-place and in-place blocks, `iters` timed calls each, or (over the
        time budget) the out-of-place block its first call measured, in-place not run."""
        blocks = []
        for in_place in (False, True):
            c, size, count = self.case(coll, send, recv, nbytes, dname, _reduction(op), in_place)
            if not isinstance(iters, int):  # answered by its first call
                blocks.append(iters if not in_place else (None, None, None, None))
                continue
            c.init()
            sec = self.time_per_op(c, iters) if size > 0 else 0.0
            wrong = self.wrong(c) if self.cfg.check > 0 else None
            blocks.append(self.block(coll, size, sec, wrong))
        root = self.cfg.root if coll in _ROOTED else -1
        timed = iters if isinstance(iters, int) else 1
        return SweepRow(coll, size, count, dname, op, root, self.n, *blocks[0], *blocks[1], iters=timed)


def _reduction(op: str) -> str:
    """The reduction a row's op runs: its own, or sum for a collective that reduces nothing ("none")."""
    return op if op != "none" else "sum"
