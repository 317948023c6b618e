"""What a sweep runs: `SweepConfig` (nccl-tests' options) and the command line that fills it
(the flags themselves are `workloads.sweep_args`, which imports no torch, for the launcher)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gpufleet.bandwidth import COLLECTIVES, DTYPE_SIZES, REDOPS, size_ladder
from gpufleet.groups import Plan
from workloads.sweep_args import build_parser

__all__ = ["SweepConfig", "TORCH_DTYPES", "parse_args"]

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
