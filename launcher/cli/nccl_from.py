"""`launch nccl-tests --from FILE`'s options and display; the report itself is
launcher.nccl.from_files'.

``--json`` prints every row as one JSON object per line on stdout (the keys of rows.json) and
nothing else there; the rest of the report goes to stderr.

Exit status: 0; 1 for wrong results or an average below --min-busbw; 2 for bad input (a missing
or unreadable file, a file without rows, an option that does not apply), one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.markup import escape

from launcher.cli.nccl_table import rich_table
from launcher.cli.render import err
from launcher.core.types import UserError
from launcher.nccl.from_files import FromRequest, report_from
from launcher.nccl.render import PLOT_SKIPPED

__all__ = ["FROM_OPTIONS", "REPORT_WIDTH", "from_request", "show_paths", "show_report_from"]

# The report's width where stdout is a file or pipe (rich's own default there is 80 columns).
REPORT_WIDTH = 120

FROM_OPTIONS = [
    click.option(
        "--from",
        "from_files",
        multiple=True,
        metavar="FILE",
        help="Report on nccl-tests or sweep output that exists instead of running (repeatable; - for stdin).",
    ),
    click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="With --from: each row as one JSON object per line on stdout, nothing else there.",
    ),
    click.option(
        "--explain",
        is_flag=True,
        help="After the expected-bandwidth verdict, the model behind it: each collective's formula, "
        "where its constants come from, and which sizes were judged how (docs/expected-bandwidth.md).",
    ),
]

# The options that mean something for results that exist; the others run or place a sweep.
_APPLIES = frozenset({"from_files", "as_json", "explain", "machine_type", "nodes", "min_busbw", "runs_dir", "ops"})


def _refuse_what_does_not_apply(ctx: click.Context) -> None:
    for p in ctx.command.params:
        if p.name in _APPLIES:
            continue
        if ctx.get_parameter_source(p.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            flag = max(p.opts, key=len)
            raise UserError(
                f"{flag} does not apply to --from, which reads results that exist and runs nothing: drop {flag}"
            )


def from_request(o: dict[str, Any]) -> FromRequest:
    """The command's options as a FromRequest; a UserError for an option that does not apply
    or a value that cannot be right (before any file is read)."""
    ctx = click.get_current_context()
    _refuse_what_does_not_apply(ctx)
    # --ops has a default for a live run; with --from only one given on the command line counts.
    ops = o.get("ops") if ctx.get_parameter_source("ops") == ParameterSource.COMMANDLINE else None
    return FromRequest(
        tuple(o["from_files"]),
        ops,
        o.get("machine_type") or None,
        o.get("nodes"),
        o.get("min_busbw"),
        Path(o.get("runs_dir") or "runs"),
        bool(o.get("as_json")),
        bool(o.get("explain")),
    )


def show_paths(paths: dict[str, Path | None]) -> None:
    """Where the rows went, and the plot's path, or one line naming the extra that draws it."""
    plot = paths["png"] if paths["png"] is not None else PLOT_SKIPPED
    err.print(f"[dim]rows: {paths['json']}  {paths['csv']}  plot: {escape(str(plot))}[/dim]")


def show_report_from(request: FromRequest, out: Console) -> int:
    """Read every --from input, show the report, and return the exit status."""
    report = report_from(request)
    for line in report.summaries:
        err.print(f"[dim]{escape(line)}[/dim]")
    if request.as_json:
        out = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else REPORT_WIDTH)
    out.print(rich_table(report.rows))
    if report.nodes_warning:
        err.print(f"[yellow]{escape(report.nodes_warning)}[/yellow]")
    out.print(f"# Avg bus bandwidth    : {report.avg_busbw:.4g} GB/s")
    show_paths(report.paths)
    if request.as_json:
        for r in report.rows:
            click.echo(json.dumps(dataclasses.asdict(r)))
    for line in report.verdict:
        err.print(f"[red]{escape(line)}[/red]")
    for style, line in report.expected:
        err.print(f"[{style}]{escape(line)}[/{style}]")
    return report.exit_code
