"""The collective-sweep report's library API in one import (no torch, no pulumi, no I/O here).

Each name lives in the module that owns its one job; this module gathers them for callers that
want the whole API (docs/reference/nccl-api.md):

- parse (``launcher.nccl.parse``): ``parse_output(text, *, collective=None, nranks=None)``,
  our sweep's ``#gpufleet-json`` line when present, else every nccl-tests table, through the
  prefixes of kubectl, srun, mpirun and launch. ``SweepRow``, ``JSON_MARKER`` and
  ``avg_busbw(rows)`` (nccl-tests' "Avg bus bandwidth") are gpufleet's.
- judge (``launcher.nccl.judge``): ``failures(rows)``, ``expected_curve``,
  ``expected_judgement(rows, machine_type, nranks, nnodes, *, margin=0.1, env=None)`` ->
  ``ExpectedReport`` (``.notes``, ``.warnings``, ``.verdict``, ``.healthy``) and
  ``expected_report(...)``, its lines.
- render and store (``launcher.nccl.render``): ``table_rows(rows)`` (the table as data; the
  CLI draws it, ``launcher.cli.nccl_table``),
  ``write_results(rows, run_dir, *, machine_type=None, nranks, nnodes)`` -> rows.json,
  rows.csv and busbw.png, never overwriting.
- find a bad node (``launcher.nccl.badnodes``): ``pair_schedule(hosts)``,
  ``rank_nodes(pair_busbw, threshold=0.8)`` -> ``BadNodeReport`` (``.bad``, ``.lines``,
  ``.exclude``, ``.decisive``), ``confirm_halves(hosts, suspects)``,
  ``confirm_suspects(clean_busbw, suspect_busbw, suspects, threshold)``.
- NVIDIA's binaries (``launcher.nccl.mpirun``): ``nccl_tests_command(binary, hosts,
  nproc_per_node, args, env)``, the mpirun argv.
"""

from __future__ import annotations

from gpufleet.bandwidth import avg_busbw
from gpufleet.contracts import JSON_MARKER, SweepRow
from launcher.nccl.badnodes import BadNodeReport, confirm_halves, confirm_suspects, pair_schedule, rank_nodes
from launcher.nccl.judge import ExpectedReport, expected_curve, expected_judgement, expected_report, failures
from launcher.nccl.mpirun import nccl_tests_command
from launcher.nccl.parse import parse_output
from launcher.nccl.render import TABLE_COLUMNS, table_rows, write_results

__all__ = [
    "JSON_MARKER",
    "SweepRow",
    "BadNodeReport",
    "parse_output",
    "avg_busbw",
    "failures",
    "TABLE_COLUMNS",
    "table_rows",
    "write_results",
    "ExpectedReport",
    "expected_curve",
    "expected_judgement",
    "expected_report",
    "pair_schedule",
    "rank_nodes",
    "confirm_halves",
    "confirm_suspects",
    "nccl_tests_command",
]
