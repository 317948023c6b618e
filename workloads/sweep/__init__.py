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

The package, by job: `config` (SweepConfig and its command line), `expected` (the data each rank
puts in and what every result must be), `bench` (one collective's calls, timing and check),
`table` (nccl-tests' report), `driver` (the run, --rounds, --json, exit status; `main`).
"""

from gpufleet.contracts import JSON_MARKER, SweepRow
from workloads.sweep.config import TORCH_DTYPES, SweepConfig, parse_args
from workloads.sweep.driver import main, run_sweep
from workloads.sweep.table import HEADER, format_row, format_table

__all__ = [
    "HEADER",
    "JSON_MARKER",
    "TORCH_DTYPES",
    "SweepConfig",
    "SweepRow",
    "format_row",
    "format_table",
    "main",
    "parse_args",
    "run_sweep",
]
