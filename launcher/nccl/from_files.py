"""`launch nccl-tests --from FILE`: the report of a sweep that already ran, read from its output.

nccl-tests or gpufleet sweep output that exists already (a Slurm log, `kubectl logs`, a file a
colleague pasted; `-` is stdin; repeatable) is read by `launcher.nccl.parse` and gets the report a
live run gets: the table, rows.json / rows.csv / busbw.png in a new run directory under
--runs-dir, the expected-bandwidth lines with --machine-type and --nodes, --min-busbw, and exit 1
naming every row with wrong results. Nothing runs and nothing is connected to.

``--json`` prints every row as one JSON object per line on stdout (the keys of rows.json) and
nothing else there; the rest of the report goes to stderr.

Exit status: 0; 1 for wrong results or an average below --min-busbw; 2 for bad input (a missing
or unreadable file, a file without rows, an option that does not apply), one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.markup import escape

from gpufleet.bandwidth import COLLECTIVES, avg_busbw
from gpufleet.catalog import UnknownMachineType, lookup
from gpufleet.contracts import SweepRow
from launcher.cli.render import err
from launcher.core.types import UserError, new_job_id
from launcher.nccl import parse as nccl_parse
from launcher.nccl.judge import expected_judgement, verdict
from launcher.nccl.parse import ParsedTest
from launcher.nccl.render import rich_table, write_results

__all__ = ["FROM_OPTIONS", "FromRequest", "from_request", "report_from"]

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
]

# The options that mean something for results that exist; the others run or place a sweep.
_APPLIES = frozenset({"from_files", "as_json", "machine_type", "nodes", "min_busbw", "runs_dir", "ops"})


@dataclass(frozen=True)
class FromRequest:
    """What `launch nccl-tests --from` was asked, checked (built by `from_request`)."""

    files: tuple[str, ...]  # file names; "-" is stdin
    ops: str | None = None  # given on the command line: the collective the output is of
    machine_type: str | None = None  # known to the catalog
    nnodes: int | None = None  # --nodes, >= 1
    min_busbw: float | None = None
    runs_dir: Path = Path("runs")
    as_json: bool = False


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
    names: tuple[str, ...] = tuple(o["from_files"])
    if names.count("-") > 1:
        raise UserError("--from - is given twice; stdin can be read once")
    ops = o.get("ops") if ctx.get_parameter_source("ops") == ParameterSource.COMMANDLINE else None
    if ops is not None and ops not in COLLECTIVES:
        raise UserError(
            f"--ops {ops!r} with --from names the collective the output is of: one of {', '.join(COLLECTIVES)}"
        )
    mt = o.get("machine_type")
    if mt:
        try:
            lookup(mt)
        except UnknownMachineType as e:
            raise UserError(str(e)) from None
    if o.get("nodes") is not None and o["nodes"] < 1:
        raise UserError(f"--nodes {o['nodes']}: a run has 1 or more nodes")
    return FromRequest(
        names,
        ops,
        mt or None,
        o.get("nodes"),
        o.get("min_busbw"),
        Path(o.get("runs_dir") or "runs"),
        bool(o.get("as_json")),
    )


# ---- reading -----------------------------------------------------------------------------------


def _read(name: str) -> str:
    if name == "-":
        # Bytes, so a UTF-16 or CRLF pipe is decoded as a file is (nccl_parse.decode_output).
        stdin = getattr(sys.stdin, "buffer", None)
        return nccl_parse.decode_output(stdin.read()) if stdin else sys.stdin.read()
    try:
        return nccl_parse.decode_output(Path(name).read_bytes())
    except FileNotFoundError:
        raise UserError(
            f"--from {name}: no such file; give a saved nccl-tests or sweep output, or - for stdin"
        ) from None
    except IsADirectoryError:
        raise UserError(
            f"--from {name} is a directory; give a file in it (a node-0.log, a Slurm output file)"
        ) from None
    except OSError as e:
        raise UserError(f"--from {name}: cannot read it ({e.strerror or e})") from None


def _named(tests: list[ParsedTest], ops: str | None, label: str) -> list[ParsedTest]:
    """Tests whose collective the output does not say take --ops; one it does say must agree."""
    if ops is None:
        return tests
    out = []
    for t in tests:
        if t.collective == nccl_parse.UNKNOWN:
            rows = [dataclasses.replace(r, collective=ops) for r in t.rows]
            t = dataclasses.replace(t, collective=ops, basis="--ops", rows=rows)
        elif t.collective != ops:
            raise UserError(f"--ops {ops}: {label} is {t.collective} ({t.basis}); drop --ops")
        out.append(t)
    return out


def _read_tests(request: FromRequest) -> list[tuple[str, ParsedTest]]:
    """(label, test) for every table of every input; a UserError for an input without one."""
    texts = [("stdin" if name == "-" else name, _read(name)) for name in request.files]  # all, first
    tests: list[tuple[str, ParsedTest]] = []
    for label, text in texts:
        found = _named(nccl_parse.parse_tests(text), request.ops, label)
        if not found:
            n = len(text.splitlines())
            raise UserError(
                f"--from {label}: no nccl-tests table or #gpufleet-json line in its {n} "
                f"line{'s' * (n != 1)}; give the stdout of an *_perf binary or of launch nccl-tests"
            )
        tests += [(label, t) for t in found]
    return tests


def _make_run_dir(runs_dir: Path) -> Path:
    run_dir = runs_dir / new_job_id()
    try:  # before anything is printed: a run directory that cannot be made is one line
        run_dir.mkdir(parents=True)
    except OSError as e:
        raise UserError(
            f"--runs-dir {run_dir.parent}: cannot make {run_dir.name} there "
            f"({e.strerror or e}); pass a writable --runs-dir"
        ) from None
    return run_dir


# ---- the report --------------------------------------------------------------------------------


def _summary(label: str, t: ParsedTest) -> str:
    ranks = f"{t.nranks} rank{'s' * (t.nranks != 1)}" if t.nranks else "rank count unknown (no '# Rank' lines)"
    nodes = f" on {len(t.hosts)} node{'s' * (len(t.hosts) != 1)}" if t.hosts else ""
    if t.collective == nccl_parse.UNKNOWN:
        what = f"collective unknown: {t.basis}; pass --ops NAME to name it"
    else:
        what = f"{t.collective} ({t.basis})"
    return f"{label}: {what}; {ranks}{nodes}; {len(t.rows)} rows"


def _one(values: set[int]) -> int:
    """The value every test agrees on, else 0 (unknown)."""
    return values.pop() if len(values) == 1 else 0


def _node_count(request: FromRequest, tests: list[tuple[str, ParsedTest]]) -> int:
    """--nodes, else the hosts every test's '# Rank' lines agree on, else 0 (unknown)."""
    hosts = _one({len(t.hosts) for _, t in tests if t.hosts})
    if request.nnodes and hosts and hosts != request.nnodes:
        err.print(
            f"[yellow]--nodes {request.nnodes}, but the '# Rank' lines name {hosts} hosts; "
            f"using --nodes {request.nnodes}[/yellow]"
        )
    return request.nnodes or hosts


def _lacking(tests: list[tuple[str, ParsedTest]], nnodes: int) -> list[str]:
    """What the expected curve needs and the output does not say: a collective the model knows,
    its rank count and the node count. Named rather than compared against a guess."""
    lacking = [] if nnodes else ["pass --nodes N (the output does not name its hosts)"]
    for label, t in tests:
        if t.collective not in COLLECTIVES:
            lacking.append(f"the collective of {label} is {t.collective}; pass --ops NAME")
        elif not t.nranks:
            lacking.append(f"{label} does not say its rank count")
    return lacking


def _print_expected(mt: str, tests: list[tuple[str, ParsedTest]], nnodes: int) -> None:
    """As a live run: the expected-bandwidth report, its one-line verdict last."""
    for line in _lacking(tests, nnodes):
        err.print(f"[yellow]no expected bandwidth: {escape(line)}[/yellow]")
    if not nnodes:
        return
    by_ranks: dict[int, list[SweepRow]] = {}
    for _, t in tests:
        if t.collective in COLLECTIVES and t.nranks:
            by_ranks.setdefault(t.nranks, []).extend(t.rows)
    for n, grp in by_ranks.items():
        for style, line in expected_judgement(grp, mt, n, nnodes).styled():
            err.print(f"[{style}]{escape(line)}[/{style}]")


def report_from(request: FromRequest, out: Console) -> int:
    """Read every --from input, report on their rows, and return the exit status."""
    tests = _read_tests(request)
    run_dir = _make_run_dir(request.runs_dir)
    for label, t in tests:
        err.print(f"[dim]{escape(_summary(label, t))}[/dim]")
    rows = [r for _, t in tests for r in t.rows]
    if request.as_json:
        out = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)
    out.print(rich_table(rows))
    nranks = _one({t.nranks for _, t in tests})
    nnodes = _node_count(request, tests)
    mt = request.machine_type
    complete = all(t.collective in COLLECTIVES and t.nranks for _, t in tests)
    plot_mt = mt if mt and nnodes and nranks and complete else None
    paths = write_results(rows, run_dir, machine_type=plot_mt, nranks=nranks, nnodes=nnodes)
    out.print(f"# Avg bus bandwidth    : {avg_busbw(rows):.4g} GB/s")
    err.print(f"[dim]rows: {paths['json']}  {paths['csv']}  plot: {paths['png']}[/dim]")
    if request.as_json:
        for r in rows:
            click.echo(json.dumps(dataclasses.asdict(r)))
    lines = verdict([(f"{label}: ", t.rows) for label, t in tests], request.min_busbw)
    for line in lines:
        err.print(f"[red]{escape(line)}[/red]")
    if mt:
        _print_expected(mt, tests, nnodes)
    return 1 if lines else 0
