"""Read nccl-tests output, and gpufleet sweep output, as it reaches people. No torch, no pulumi.

An output reaches a user through some pipe that changes each line: ``kubectl logs --timestamps``
puts an RFC 3339 time before it, ``srun --label`` the task number, ``mpirun --tag-output``
``[1,N]<stdout>:``, ``launch`` itself ``[node N]``, Windows ``\\r\\n`` endings (and PowerShell's
``>`` UTF-16). ``strip_prefixes`` takes those off, so the rest reads the lines nccl-tests printed.

What a table is of is read from what the output says, never guessed:

- the collective: ``# Collective test starting: X_perf`` (nccl-tests >= 2.13), else a command
  line naming one ``X_perf`` binary (``mpirun ... ./build/all_reduce_perf -b 8``), else the rows
  themselves when exactly one nccl-tests binary prints rows like them (``_infer``), else
  ``"unknown"``;
- the rank count: the ``#  Rank N ... on HOST device D`` lines, else, for a collective whose
  ``count`` is per rank, ``size / (count × type size)``; else 0, which means unknown;
- the node count: the distinct hosts of the ``# Rank`` lines.

API:

``parse_tests(text, *, collective=None, nranks=None) -> list[ParsedTest]``
    One entry per table (per collective for the sweep's ``#gpufleet-json`` line, which wins over
    the tables when present), with how its collective was found.
``parse_output(text, *, collective=None, nranks=None) -> list[SweepRow]``
    Every row of every table.
``decode_output(data) -> str`` and ``strip_prefixes(line) -> str``
    Bytes as a file holds them to text; one line without its pipes' prefixes.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from gpufleet.bandwidth import DTYPE_SIZES
from gpufleet.contracts import JSON_MARKER, SweepRow

__all__ = ["UNKNOWN", "ParsedTest", "decode_output", "parse_output", "parse_tests", "strip_prefixes"]

UNKNOWN = "unknown"

# ---- lines as pipes deliver them -------------------------------------------------------------

_PREFIXES = (
    # kubectl logs --timestamps: RFC 3339 with nanoseconds and a space before the line
    # (kubectl's `--timestamps` help; the kubelet writes time.RFC3339Nano).
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:?\d{2}) ",
    # Open MPI mpirun --tag-output: `[jobid,rank]<stdout>:` (Open MPI 5 adds a space).
    r"\[\d+,\d+\]<std(?:out|err|diag)>: ?",
    # srun --label: the task id, right-aligned to the widest id, then ": " (srun(1) -l).
    r" *\d+: ",
    # launch's own live stream: `[node N] ` before each node's line (launcher.cli.render.live_printer).
    r"\[node \d+\] ",
)
# Any run of them, in any order: they stack (kubectl logs of mpirun's pod). One match per line.
_PREFIX_RUN = re.compile("(?:" + "|".join(_PREFIXES) + ")+")


def strip_prefixes(line: str) -> str:
    """`line` without the prefixes pipes add before it."""
    m = _PREFIX_RUN.match(line)
    return line[m.end() :] if m else line


def decode_output(data: bytes) -> str:
    """A log file's bytes as text: UTF-16 with its BOM (Windows PowerShell's `>` writes that),
    else UTF-8 with or without a BOM; undecodable bytes become U+FFFD rather than an error."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return data.decode("utf-16", errors="replace")
    return data.decode("utf-8-sig", errors="replace")


# ---- what nccl-tests prints ------------------------------------------------------------------

_STARTING = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
_CONCLUDED = re.compile(r"^#\s*Collective test concluded:")
# `#  Rank  0 Group  0 Pid 6899 on HOST device  0 [...]` (2.13+) and `#   Rank  0 Pid ...` (older).
_RANK_LINE = re.compile(r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\b")
_INT = re.compile(r"^-?\d+$")
_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


# busbw / algbw at n ranks (NVIDIA/nccl-tests src/<coll>.cu *GetBw).
def _twice_frac(n: int) -> float:
    return 2.0 * (n - 1) / n


def _frac(n: int) -> float:
    return (n - 1) / n


def _one(n: int) -> float:  # noqa: ARG001 - the same at every n
    return 1.0


# nccl-tests binaries (src/*.cu in NVIDIA/nccl-tests). Per binary: does it reduce (prints an op:
# sum, prod, ...; the others print "none" or nothing), has it a root (prints root >= 0; the
# others -1 or no root column), is its `count` per rank (size = count × type size × nranks;
# else size = count × type size), and its busbw / algbw factors. all_gather and reduce_scatter
# printed busbw = algbw before nccl-tests ec1b5e2 (2020-06-19, "Change all_gather/reduce_scatter
# algbw to match the documentation"), so an old output has either factor; hypercube.cu counts
# (n-1)/n of the buffer in algbw, factor 1.
_SHAPES: dict[str, tuple[bool, bool, bool, tuple]] = {
    "all_reduce": (True, False, False, (_twice_frac,)),
    "reduce_scatter": (True, False, True, (_frac, _one)),
    "reduce": (True, True, False, (_one,)),
    "all_gather": (False, False, True, (_frac, _one)),
    "alltoall": (False, False, True, (_frac,)),
    "broadcast": (False, True, False, (_one,)),
    "sendrecv": (False, False, False, (_one,)),
    "gather": (False, True, True, (_frac,)),
    "scatter": (False, True, True, (_frac,)),
    "hypercube": (False, False, True, (_one,)),
}
# A command line names its binary: `/opt/nccl-tests/build/all_reduce_perf -b 8`, `..._perf_mpi`.
_BINARY = re.compile(r"(?<![\w.-])(" + "|".join(sorted(_SHAPES, key=len, reverse=True)) + r")_perf(?:_mpi)?\b")
# Element sizes of nccl-tests' type names (src/common.cu test_typenames) plus the fp8 types.
_TYPE_SIZES = {**DTYPE_SIZES, "f8e4m3": 1, "f8e5m2": 1}


def _collective_name(prog: str) -> str:
    """`./build/all_reduce_perf_mpi` → `all_reduce`."""
    return re.sub(r"_perf(_\w+)?$", "", os.path.basename(prog))


def _num(tok: str) -> float | None:
    if tok.upper() == "N/A":
        return None
    return float(tok)


def _wrong(tok: str) -> float | None:
    """#wrong is a count: keep it an int (18134, not 18134.0); the old error column is a float."""
    if tok.upper() == "N/A":
        return None
    return int(tok) if _INT.match(tok) else float(tok)


def _header_columns(line: str) -> list[str] | None:
    """Column names if `line` is the names line of an nccl-tests header, else None."""
    toks = line.lstrip("#").split()
    if "size" in toks and "busbw" in toks and ("time" in toks or "cputime" in toks):
        return toks
    return None


@dataclass
class _Row:
    """A table line as printed: the tokens kept for the collective's inference."""

    head: dict[str, str]
    oop: tuple[str, ...]  # time, algbw, busbw, wrong tokens; () for a blank block
    ip: tuple[str, ...]


def _block(toks: list[str], start: int, names: list[str]) -> tuple[str, ...]:
    vals = dict(zip(names, toks[start : start + len(names)]))
    wrong = vals.get("#wrong", vals.get("error", "N/A"))
    return (vals.get("time", vals.get("cputime", "N/A")), vals.get("algbw", "N/A"), vals.get("busbw", "N/A"), wrong)


def _table_line(toks: list[str], cols: list[str]) -> _Row | None:
    """A data line under header `cols`, or None for any other line."""
    if not toks or not _INT.match(toks[0]):
        return None
    time_cols = [i for i, c in enumerate(cols) if c in ("time", "cputime")]
    pre = time_cols[0]  # columns before the first block
    if "redop" in cols[:pre]:
        # nccl-tests prints the op with %6s; a test without one (old alltoall, hypercube) leaves
        # it blank, so the row is a token short. An op is never a number: the token where it
        # should be is the root or the time, and the blank goes back in.
        at = cols.index("redop")
        if len(toks) > at and _NUMBER.match(toks[at]):
            toks = toks[:at] + [""] + toks[at:]
    width = len(cols)
    block = (time_cols[1] - time_cols[0]) if len(time_cols) > 1 else width - pre
    names = cols[pre : pre + block]
    oop_missing = False
    if len(toks) < width:
        # nccl-tests writeBenchMarkLineNullBody prints blanks for an absent out-of-place block.
        if len(toks) == width - block and len(time_cols) > 1:
            oop_missing = True
        else:
            return None
    head = dict(zip(cols[:pre], toks[:pre]))
    if "count" in head and not _INT.match(head["count"]):
        return None
    if "root" in head and not _INT.match(head["root"]):
        return None
    if oop_missing:
        oop, ip = (), _block(toks, pre, names)
    else:
        oop = _block(toks, pre, names)
        ip = _block(toks, pre + block, names) if len(time_cols) > 1 else ()
    try:
        for tok in (*oop, *ip):
            _num(tok)
    except ValueError:
        return None  # a line of other output that happens to start with a number
    return _Row(head, oop, ip)


@dataclass
class _Table:
    cols: list[str]
    named: str | None  # the collective as the output names it
    basis: str
    ranks: dict[int, str]  # rank → host, from the `# Rank` lines before the table
    rows: list[_Row] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedTest:
    """One nccl-tests table (or one collective of a sweep's JSON line) and what it is of."""

    collective: str  # "unknown" when the output does not say
    basis: str  # how the collective was found, for the report
    nranks: int  # 0 when the output does not say
    hosts: tuple[str, ...]  # distinct hosts of the `# Rank` lines, in rank order; () if none
    rows: list[SweepRow]


# ---- which collective: the rows' own evidence ---------------------------------------------------


def _decimals_half_ulp(tok: str) -> float:
    """Half the last printed digit of `tok` (nccl-tests prints bandwidths %6.2f)."""
    return 0.5 * 10.0 ** -(len(tok.split(".", 1)[1]) if "." in tok else 0)


def _factor_fits(fn, pairs: list[tuple[str, str]], n: int) -> bool:
    """Every (algbw, busbw) printed pair agrees with busbw = algbw × fn(n), to the printed digit."""
    f = fn(n)
    for a_tok, b_tok in pairs:
        a, b = float(a_tok), float(b_tok)
        tol = _decimals_half_ulp(b_tok) + f * _decimals_half_ulp(a_tok) + 1e-9
        if abs(b - a * f) > tol:
            return False
    return True


def _rank_candidates(fn, pairs: list[tuple[str, str]], nranks: int) -> list[int]:
    """Rank counts at which factor `fn` is worth testing: the known one, else those the best
    printed ratio implies (the inverse of the factor, ±1 for rounding)."""
    if nranks:
        return [nranks]
    if fn is _one:
        return [2]  # 1 at every n
    a, b = max(((float(x), float(y)) for x, y in pairs), default=(0.0, 0.0))
    if a <= 0:
        return []
    r = b / a
    if fn is _twice_frac:
        n = 2.0 / (2.0 - r) if r < 2 else 0
    else:
        n = 1.0 / (1.0 - r) if r < 1 else 0
    if not 2 <= n < 1 << 20:
        return []
    return [m for m in (round(n) - 1, round(n), round(n) + 1) if m >= 2]


def _count_ratio(table: _Table) -> int | None:
    """size / (count × type size), when every row with a count agrees on one whole number:
    1 for binaries whose count is the whole buffer, nranks for those whose count is per rank."""
    ratios = set()
    for r in table.rows:
        size, count = int(r.head["size"]), int(r.head.get("count", "0"))
        ts = _TYPE_SIZES.get(r.head.get("type", ""))
        if size > 0 and count > 0 and ts:
            k, rem = divmod(size, count * ts)
            ratios.add(k if rem == 0 and k >= 1 else -1)
    if len(ratios) == 1 and -1 not in ratios:
        return ratios.pop()
    return None


def _infer(table: _Table, nranks: int) -> tuple[str, str]:
    """(collective, basis) from the rows, when exactly one nccl-tests binary prints rows like
    them; (UNKNOWN, why) when none or several do. `nranks` 0 is unknown."""
    ops = {r.head.get("redop", "") for r in table.rows} - {""}
    # Every nccl-tests binary that reduces prints its op (old and new formats alike), so no op,
    # or "none", means a binary that does not reduce.
    reduces = bool(ops - {"none"})
    roots = {int(r.head["root"]) for r in table.rows if "root" in r.head}
    # Likewise every rooted binary prints its root (>= 0); no root column means none.
    rooted = any(x >= 0 for x in roots)
    k = _count_ratio(table)
    per_rank = None if k is None else k > 1
    pairs = [
        (blk[1], blk[2])
        for r in table.rows
        for blk in (r.oop, r.ip)
        if blk
        and _NUMBER.match(blk[1])
        and _NUMBER.match(blk[2])
        and "e" not in blk[1].lower()
        and "e" not in blk[2].lower()
        and float(blk[1]) >= 0.1
    ]
    fits = []
    for coll, (red, root, pr, fns) in _SHAPES.items():
        if red != reduces or root != rooted or (per_rank is not None and pr != per_rank):
            continue
        if pairs and not any(_factor_fits(fn, pairs, m) for fn in fns for m in _rank_candidates(fn, pairs, nranks)):
            continue
        fits.append(coll)
    what = (
        f"redop {', '.join(sorted(ops)) if ops else 'none'}, "
        f"{'root ' + ','.join(map(str, sorted(roots))) if roots else 'no root'}"
        + ("" if per_rank is None else f", count {'per rank' if per_rank else '= size/type size'}")
        + (", busbw/algbw" if pairs else "")
    )
    if len(fits) == 1:
        return fits[0], f"from its rows: {what}"
    return UNKNOWN, f"the output does not say; its rows ({what}) fit {' or '.join(fits) or 'no nccl-tests binary'}"


# ---- reading ------------------------------------------------------------------------------------


def _from_json(line: str) -> list[SweepRow]:
    """The rows of our sweep's JSON line; [] for a line cut short (a node log ends mid-line when
    its node dies), so the table printed above it is read instead."""
    try:
        payload = json.loads(line[len(JSON_MARKER) :])
        return [SweepRow.from_dict(d) for d in payload["rows"]]
    except (ValueError, KeyError, TypeError):
        return []


def _tables(lines: list[str]) -> list[_Table]:
    tables: list[_Table] = []
    named: tuple[str, str] | None = None  # (collective, basis) for the next table
    ranks: dict[int, str] = {}
    table: _Table | None = None
    for line in lines:
        s = line.strip()
        if s.startswith("#"):
            m = _STARTING.match(s)
            if m:
                named = (_collective_name(m.group(1)), f"'# Collective test starting: {m.group(1)}'")
                ranks, table = {}, None
                continue
            if _CONCLUDED.match(s):
                named, table = None, None
                continue
            m = _RANK_LINE.match(s)
            if m:
                ranks[int(m.group(1))] = m.group(2)
                continue
            cols = _header_columns(s)
            if cols:
                # A name is for the one table that follows it: a table after it without a name
                # of its own (another file pasted below) is not taken to be the same binary.
                coll, basis = named if named else (None, "")
                table = _Table(cols, coll, basis, ranks)
                tables.append(table)
                named, ranks = None, {}
            continue
        if table is not None:
            row = _table_line(s.split(), table.cols)
            if row is not None:
                table.rows.append(row)
                continue
        found = set(_BINARY.findall(s)) if "_perf" in s else set()
        if len(found) == 1 and not (named and named[1].startswith("'#")):  # the marker wins
            (coll,) = found
            named = (coll, f"the command line '{s if len(s) <= 80 else s[:77] + '...'}'")
            table = None
    return [t for t in tables if t.rows]


def _sweep_row(r: _Row, collective: str, nranks: int, error_column: bool) -> SweepRow:
    def vals(blk: tuple[str, ...]) -> tuple[float | None, ...]:
        if not blk:
            return (None, None, None, None)
        return (_num(blk[0]), _num(blk[1]), _num(blk[2]), _wrong(blk[3]))

    oop, ip = vals(r.oop), vals(r.ip)
    return SweepRow(
        collective=collective,
        size=int(r.head["size"]),
        count=int(r.head.get("count", "0")),
        type=r.head.get("type", ""),
        redop=r.head.get("redop") or "none",
        root=int(r.head.get("root", "-1")),
        nranks=nranks,
        oop_time_us=oop[0],
        oop_algbw=oop[1],
        oop_busbw=oop[2],
        oop_wrong=oop[3],
        ip_time_us=ip[0],
        ip_algbw=ip[1],
        ip_busbw=ip[2],
        ip_wrong=ip[3],
        error_column=error_column,
    )


def parse_tests(text: str, *, collective: str | None = None, nranks: int | None = None) -> list[ParsedTest]:
    """The tables of a sweep's or nccl-tests' output (see the module docstring).

    `collective` and `nranks`, when given, are what the caller knows (it ran the binary); they
    win over what the output says.
    """
    lines = [strip_prefixes(line) for line in text.splitlines()]
    json_rows: list[SweepRow] = []
    for line in lines:
        if line.startswith(JSON_MARKER):
            json_rows += _from_json(line)
    if json_rows:
        by_coll: dict[str, list[SweepRow]] = {}
        for r in json_rows:
            by_coll.setdefault(r.collective, []).append(r)
        return [
            ParsedTest(c, "the sweep's #gpufleet-json line", rows[0].nranks, (), rows) for c, rows in by_coll.items()
        ]

    out = []
    for t in _tables(lines):
        # A count per rank makes size / (count × type size) the rank count exactly (the
        # binaries with a per-rank count are the ones whose ratio is above 1).
        k = _count_ratio(t) or 0
        n = nranks or len(t.ranks) or (k if k > 1 else 0)
        if collective:
            coll, basis = collective, "given by the caller"
        elif t.named:
            coll, basis = t.named, t.basis
        else:
            coll, basis = _infer(t, n)
        hosts = tuple(dict.fromkeys(t.ranks[r] for r in sorted(t.ranks)))
        error_column = "error" in t.cols and "#wrong" not in t.cols
        rows = [_sweep_row(r, coll, n, error_column) for r in t.rows]
        out.append(ParsedTest(coll, basis, n, hosts, rows))
    return out


def parse_output(text: str, *, collective: str | None = None, nranks: int | None = None) -> list[SweepRow]:
    """Every row of `text`: the sweep's #gpufleet-json line when present, else every table."""
    return [r for t in parse_tests(text, collective=collective, nranks=nranks) for r in t.rows]
