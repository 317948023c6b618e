"""The command line of `python -m workloads.sweep`, without torch: `build_parser` is what the
sweep parses on every node and what `launch nccl-tests --help` lists, from one set of words.

The flags and their meaning follow NVIDIA nccl-tests (README.md, "Arguments":
https://github.com/NVIDIA/nccl-tests#arguments); `--ops`, `--json`, `--time-budget` and
`--rounds` are the sweep's own. `workloads.sweep.parse_args` turns the namespace into a checked
`SweepConfig`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from gpufleet.bandwidth import COLLECTIVES, REDOPS, SizeError, parse_size
from gpufleet.contracts import SWEEP_ERROR_PREFIX
from gpufleet.groups import Plan, parse_rounds

__all__ = ["DATATYPES", "build_parser"]

# nccl-tests type names that torch.distributed can carry (workloads.sweep maps each to its dtype).
# uint32/uint64 are NCCL types, but torch's collectives reject them ("Invalid scalar type" on
# gloo, torch 2.13).
DATATYPES = ("int8", "uint8", "int32", "int64", "half", "float", "double", "bfloat16")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump, exit 2
        print(f"{SWEEP_ERROR_PREFIX}{message}", file=sys.stderr)
        sys.exit(2)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _list(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def conv(text: str) -> tuple[str, ...]:
        items = tuple(s.strip() for s in text.split(",") if s.strip())
        return choices if items == ("all",) else items

    return conv


def _rounds_arg(text: str) -> Plan:
    try:
        return parse_rounds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--rounds {text!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m workloads.sweep", description="An nccl-tests style collective sweep, under torchrun.")
    p.add_argument(
        "--ops",
        "--collective",
        dest="collectives",
        type=_list(COLLECTIVES),
        default=("all_reduce",),
        help=f"comma list of collectives, or all ({', '.join(COLLECTIVES)})",
    )
    sizes = "(bytes; K, M, G are binary: 8, 64K, 8G)"
    p.add_argument("-b", "--minbytes", type=_size_arg, default=32 * 1024**2, help=f"smallest size {sizes}")
    p.add_argument("-e", "--maxbytes", type=_size_arg, default=32 * 1024**2, help=f"largest size {sizes}")
    p.add_argument("-i", "--stepbytes", type=_size_arg, default=1024**2, help="bytes added between sizes when -f is 1")
    p.add_argument("-f", "--stepfactor", type=int, default=1, help="multiply the size by this between sizes")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=1, help="untimed warm-up calls per size")
    p.add_argument("-c", "--check", type=int, default=1, help="calls whose results are checked; 0 checks nothing")
    p.add_argument(
        "-d",
        "--datatype",
        type=_list(DATATYPES),
        default=("float",),
        help=f"element type, a comma list or all ({', '.join(DATATYPES)})",
    )
    p.add_argument(
        "-o", "--op", type=_list(REDOPS), default=("sum",), help=f"reduction, a comma list or all ({', '.join(REDOPS)})"
    )
    p.add_argument("-r", "--root", type=int, default=0, help="root rank of broadcast and reduce")
    p.add_argument("--json", dest="json_path", default=None, help="also write the rows to this JSON file (rank 0)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="cut a size's calls short once they would take longer (see SweepConfig)",
    )
    p.add_argument(
        "--rounds",
        type=_rounds_arg,
        default=None,
        metavar="PLAN",
        help="one sweep per node group, e.g. 0+3,1+2;0+2,3+1 (gpufleet.groups)",
    )
    return p
