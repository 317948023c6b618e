"""A collective sweep's request, written once for the two programs that run one.

NVIDIA's nccl-tests binaries (``src/common.cu``) and ``workloads.sweep`` read the same flags for a
sweep: ``-b -e -f -n -w -c -d -o``. ``SWEEP_FLAGS`` is that table, ``SweepSpec`` one request with
the defaults ``launch nccl-tests`` offers, and ``SweepSpec.flags()`` the argv both programs take.
The launcher builds its click options from ``SWEEP_FLAGS`` and ``SweepSpec``'s defaults, so a flag
is named in one place. The names of the collectives are ``gpufleet.bandwidth.COLLECTIVES``, which
``workloads.sweep`` reads too. No torch: the launcher imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.bandwidth import COLLECTIVES

__all__ = ["COLLECTIVES", "ALL", "SWEEP_MODULE", "SWEEP_FLAGS", "SweepSpec", "collective_list"]

ALL = "all"  # every collective of COLLECTIVES
SWEEP_MODULE = "workloads.sweep"  # run on every node as `python -m workloads.sweep`

# (SweepSpec field, the flag nccl-tests and workloads.sweep both read), in nccl-tests' order.
SWEEP_FLAGS: tuple[tuple[str, str], ...] = (
    ("minbytes", "-b"),
    ("maxbytes", "-e"),
    ("stepfactor", "-f"),
    ("iters", "-n"),
    ("warmup_iters", "-w"),
    ("check", "-c"),
    ("datatype", "-d"),
    ("redop", "-o"),
)


def collective_list(text: str) -> tuple[str, ...]:
    """A comma list of collectives (spaces and empty items ignored), or "all": the names, each
    one of COLLECTIVES. Raises ValueError naming the first unknown one and the choices."""
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if names == (ALL,):
        return COLLECTIVES
    unknown = [n for n in names if n not in COLLECTIVES]
    if unknown or not names:
        what = f"collective {unknown[0]!r} is unknown" if unknown else "no collective named"
        raise ValueError(f"{what}; one of: {', '.join(COLLECTIVES)}, or {ALL}")
    return names


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep: the collectives and nccl-tests' flags. Sizes stay text ("32M"), as both
    programs parse them (nccl-tests' parsesize, gpufleet.bandwidth.parse_size)."""

    ops: str = "all_reduce"  # a comma list of COLLECTIVES, or "all"
    minbytes: str = "32M"  # -b: the first size
    maxbytes: str = "32M"  # -e: the last size
    stepfactor: int = 2  # -f: each size is the previous one times this
    iters: int = 20  # -n: timed calls per size and block
    warmup_iters: int = 1  # -w: untimed calls before a size
    check: int = 1  # -c: calls whose results are checked
    datatype: str = "float"  # -d: nccl-tests' type name
    redop: str = "sum"  # -o: the reduction of the collectives that reduce

    def __post_init__(self) -> None:
        collective_list(self.ops)

    @property
    def collectives(self) -> tuple[str, ...]:
        return collective_list(self.ops)

    def flags(self) -> list[str]:
        """`-b MIN -e MAX -f F -n N -w W -c C -d TYPE -o OP`: what both programs take."""
        return [a for name, flag in SWEEP_FLAGS for a in (flag, str(getattr(self, name)))]

    def sweep_argv(self) -> list[str]:
        """The arguments of `python -m workloads.sweep` for this request."""
        return ["--ops", self.ops, *self.flags()]
