"""`launch nccl-tests --from FILE`'s library half: the report of a sweep that already ran, read
from its output (the command's options and its display are launcher.cli.nccl_from).

nccl-tests or gpufleet sweep output that exists already (a Slurm log, `kubectl logs`, a file a
colleague pasted; `-` is stdin; repeatable) is read by `launcher.nccl.parse` and gets the report a
live run gets: the rows, rows.json / rows.csv / busbw.png in a new run directory under
--runs-dir, the expected-bandwidth lines with --machine-type and --nodes, --min-busbw, and the
lines naming every row with wrong results. Nothing runs and nothing is connected to.

Bad input (a missing or unreadable file, a file without rows, a value that cannot be right) is
one UserError naming it.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.bandwidth import COLLECTIVES, avg_busbw
from gpufleet.catalog import UnknownMachineType, lookup
from gpufleet.contracts import SweepRow
from launcher.core.types import UserError, new_job_id
from launcher.nccl import parse as nccl_parse
from launcher.nccl.judge import expected_judgement, verdict
from launcher.nccl.parse import ParsedTest
from launcher.nccl.render import write_results

__all__ = ["FromRequest", "FromReport", "report_from"]


@dataclass(frozen=True)
class FromRequest:
    """What `launch nccl-tests --from` was asked; checked when made (a UserError for a value that
    cannot be right, before any file is read)."""

    files: tuple[str, ...]  # file names; "-" is stdin
    ops: str | None = None  # given on the command line: the collective the output is of
    machine_type: str | None = None  # known to the catalog
    nnodes: int | None = None  # --nodes, >= 1
    min_busbw: float | None = None
    runs_dir: Path = Path("runs")
    as_json: bool = False
    explain: bool = False  # the expected-bandwidth model's terms after its verdict

    def __post_init__(self) -> None:
        if self.files.count("-") > 1:
            raise UserError("--from - is given twice; stdin can be read once")
        if self.ops is not None and self.ops not in COLLECTIVES:
            raise UserError(
                f"--ops {self.ops!r} with --from names the collective the output is of: one of {', '.join(COLLECTIVES)}"
            )
        if self.machine_type:
            try:
                lookup(self.machine_type)
            except UnknownMachineType as e:
                raise UserError(str(e)) from None
        if self.nnodes is not None and self.nnodes < 1:
            raise UserError(f"--nodes {self.nnodes}: a run has 1 or more nodes")


@dataclass
class FromReport:
    """What the report says, in the order it is shown: a summary per table read, the rows (and
    their average), a warning about the node count, where the rows were written, the lines naming
    wrong results (or an average below --min-busbw), and the expected-bandwidth lines as
    (style, line), the verdict first. `exit_code`: 1 when there are verdict lines, else 0."""

    summaries: list[str]
    rows: list[SweepRow]
    avg_busbw: float
    nodes_warning: str | None
    paths: dict[str, Path | None]  # "png": None where matplotlib is not installed
    verdict: list[str]
    expected: list[tuple[str, str]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict else 0


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


def _node_count(request: FromRequest, tests: list[tuple[str, ParsedTest]]) -> tuple[int, str | None]:
    """--nodes, else the hosts every test's '# Rank' lines agree on, else 0 (unknown); and a
    warning when --nodes and the '# Rank' lines disagree."""
    hosts = _one({len(t.hosts) for _, t in tests if t.hosts})
    warning = None
    if request.nnodes and hosts and hosts != request.nnodes:
        warning = f"--nodes {request.nnodes}, but the '# Rank' lines name {hosts} hosts; using --nodes {request.nnodes}"
    return request.nnodes or hosts, warning


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


def _expected(
    mt: str, tests: list[tuple[str, ParsedTest]], nnodes: int, explain: bool = False
) -> list[tuple[str, str]]:
    """As a live run: the expected-bandwidth verdict in words, the sizes that fell short, and
    with `explain` the model's terms."""
    out = [("yellow", f"no expected bandwidth: {line}") for line in _lacking(tests, nnodes)]
    if not nnodes:
        return out
    by_ranks: dict[int, list[SweepRow]] = {}
    for _, t in tests:
        if t.collective in COLLECTIVES and t.nranks:
            by_ranks.setdefault(t.nranks, []).extend(t.rows)
    for n, grp in by_ranks.items():
        out += expected_judgement(grp, mt, n, nnodes).styled(explain)
    return out


def report_from(request: FromRequest) -> FromReport:
    """Read every --from input, write its rows into a new run directory, and say what they show."""
    tests = _read_tests(request)
    run_dir = _make_run_dir(request.runs_dir)
    rows = [r for _, t in tests for r in t.rows]
    nranks = _one({t.nranks for _, t in tests})
    nnodes, warning = _node_count(request, tests)
    mt = request.machine_type
    complete = all(t.collective in COLLECTIVES and t.nranks for _, t in tests)
    plot_mt = mt if mt and nnodes and nranks and complete else None
    return FromReport(
        summaries=[_summary(label, t) for label, t in tests],
        rows=rows,
        avg_busbw=avg_busbw(rows),
        nodes_warning=warning,
        paths=write_results(rows, run_dir, machine_type=plot_mt, nranks=nranks, nnodes=nnodes),
        verdict=verdict([(f"{label}: ", t.rows) for label, t in tests], request.min_busbw),
        expected=_expected(mt, tests, nnodes, request.explain) if mt else [],
    )
