"""`launch nccl-tests --from`: real nccl-tests outputs, as published and through the pipes that
carry them to users, read into the report a live run gives.

The corpus is tests/fixtures/nccl-outputs (SOURCES.md names each file's origin; EXPECTED.json):
fourteen outputs people published, byte for byte. EXPECTED.json gives each file's row count and its
largest row's busbw as printed; the pipes are applied here, to the text, the way each tool does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.nccl import parse as nccl_parse
from launcher.nccl import report as rep

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "nccl-outputs"
EXPECTED = json.loads((CORPUS / "EXPECTED.json").read_text())["files"]
FILES = sorted(EXPECTED)
FIELDS = [f.name for f in dataclasses.fields(rep.SweepRow)]


def _file(prefix: str) -> Path:
    (path,) = CORPUS.glob(f"{prefix}-*.txt")
    return path


# ---- the pipes -----------------------------------------------------------------------------


def _kubectl_timestamps(text: str) -> str:
    """`kubectl logs --timestamps`: the kubelet's RFC 3339 time (nanoseconds, Z) and a space."""
    return "".join(
        f"2026-11-23T09:{i // 60 % 60:02d}:{i % 60:02d}.{(i * 7919) % 10**9:09d}Z {line}\n"
        for i, line in enumerate(text.splitlines())
    )


def _srun_label(text: str) -> str:
    """`srun --label` on 16 tasks: the task id right-aligned to two places; rank 0 prints."""
    return "".join(f"{0:>2}: {line}\n" for line in text.splitlines())


def _mpirun_tag_output(text: str) -> str:
    """`mpirun --tag-output`: `[jobid,rank]<stdout>:` (03 was published with it already)."""
    return "".join(line + "\n" if line.startswith("[1,") else f"[1,0]<stdout>:{line}\n" for line in text.splitlines())


def _windows(text: str) -> str:
    return text.replace("\n", "\r\n")


PIPES = {
    "as-published": lambda text: text,
    "kubectl-logs-timestamps": _kubectl_timestamps,
    "srun-label": _srun_label,
    "mpirun-tag-output": _mpirun_tag_output,
    "windows-line-endings": _windows,
    # kubectl logs of an mpirun launcher pod, saved on Windows: the prefixes stack.
    "all-at-once": lambda text: _windows(_kubectl_timestamps(_mpirun_tag_output(text))),
}

# What the outputs themselves say. 04, 05, 07 and 08 print rows that all_gather and alltoall
# both print (no op, no root, count per rank, busbw = (n-1)/n algbw): the file names in
# EXPECTED.json's collective_basis are not in the output, so the parser says "unknown".
SAYS = {
    "01": "all_reduce",
    "02": "all_reduce",
    "03": "all_reduce",
    "04": "unknown",
    "05": "unknown",
    "06": "broadcast",
    "07": "unknown",
    "08": "unknown",
    "09": "all_reduce",
    "10": "all_reduce",
    "11": "all_reduce",
    "12": "all_reduce",
    "13": "all_reduce",
    "14": "all_reduce",
}


@pytest.mark.parametrize("pipe", sorted(PIPES))
@pytest.mark.parametrize("name", FILES)
def test_every_corpus_file_reads_through_every_pipe(name, pipe):
    exp = EXPECTED[name]
    tests = nccl_parse.parse_tests(PIPES[pipe]((CORPUS / name).read_text()))
    rows = [r for t in tests for r in t.rows]
    assert len(rows) == exp["data_rows"]
    largest = max(rows, key=lambda r: r.size)
    assert largest.size == exp["largest_size_bytes"]
    assert f"{largest.oop_busbw:.2f}" == exp["largest_out_of_place_busbw"]
    assert f"{largest.ip_busbw:.2f}" == exp["largest_in_place_busbw"]
    # nccl-tests' "Avg bus bandwidth" is the mean of every printed busbw (size 0 included).
    assert rep.avg_busbw(rows) == pytest.approx(exp["mean_of_printed_busbw"], abs=6e-4)
    (test,) = tests
    assert test.collective == SAYS[name[:2]] and {r.collective for r in rows} == {test.collective}
    assert test.nranks == exp["nranks"] and {r.nranks for r in rows} == {exp["nranks"]}
    # Hosts come from the `# Rank` lines; 07 and 08 were published as the table alone.
    assert len(test.hosts) == (0 if name[:2] in ("07", "08") else exp["nnodes"])


@pytest.mark.parametrize("pipe", ["as-published", "all-at-once"])
@pytest.mark.parametrize("name", FILES)
def test_the_command_reads_every_corpus_file_from_stdin(tmp_path, name, pipe):
    """Each file through `launch nccl-tests --from - --json`: exit 1 for 13 alone (wrong rows)."""
    exp = EXPECTED[name]
    r = _launch("--from", "-", "--json", "--runs-dir", str(tmp_path), input=PIPES[pipe]((CORPUS / name).read_text()))
    assert r.exit_code == (1 if name.startswith("13-") else 0), r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == exp["data_rows"]
    largest = max(rows, key=lambda o: o["size"])
    assert [f"{largest['oop_busbw']:.2f}", f"{largest['ip_busbw']:.2f}"] == [
        exp["largest_out_of_place_busbw"],
        exp["largest_in_place_busbw"],
    ]
    assert f"stdin: {'collective unknown' if SAYS[name[:2]] == 'unknown' else SAYS[name[:2]]}" in r.stderr


def test_unknown_says_which_binaries_fit_and_why():
    (test,) = nccl_parse.parse_tests(_file("05").read_text())
    assert test.basis == (
        "the output does not say; its rows (redop none, no root, count per rank, "
        "busbw/algbw) fit all_gather or alltoall"
    )
    (bcast,) = nccl_parse.parse_tests(_file("06").read_text())
    assert bcast.basis.startswith("from its rows: redop none, root 0, count = size/type size")
    (started,) = nccl_parse.parse_tests(_file("12").read_text())
    assert started.basis == "'# Collective test starting: all_reduce_perf'"


def test_the_command_line_names_the_binary():
    table = _file("07").read_text()
    cmd = "+ mpirun -np 16 -H a:8,b:8 /opt/nccl-tests/build/all_gather_perf -b 8 -e 8G -f 2 -g 1\n"
    (test,) = nccl_parse.parse_tests(cmd + table)
    assert test.collective == "all_gather" and test.basis.startswith("the command line '+ mpirun")
    # The name is for the table after it, not for another pasted below that has none.
    both = nccl_parse.parse_tests(cmd + table + _file("05").read_text())
    assert [t.collective for t in both] == ["all_gather", "unknown"]
    assert [t.nranks for t in both] == [16, 8]
    # A line naming two binaries (a loop in a script) names neither.
    (loop,) = nccl_parse.parse_tests("for b in all_gather_perf alltoall_perf; do ...\n" + table)
    assert loop.collective == "unknown"


_HEADER = (
    "#       size         count      type   redop    root     time   algbw   busbw #wrong"
    "     time   algbw   busbw #wrong\n"
)


def _synthetic(op: str, root: int, per_rank: bool, factor: float, n: int = 8) -> str:
    """A 2.13+ table as src/util.cu prints it, without `# Rank` lines: float, 8 MiB to 1 GiB."""
    lines = [_HEADER]
    for size in (8 << 20, 64 << 20, 1 << 30):
        count = size // 4 // (n if per_rank else 1)
        alg = 100.0 + size / (1 << 30)
        t = size / (alg * 1e9) * 1e6
        lines.append(
            f"{size:12d}  {count:12d}  {'float':>8}  {op:>6}  {root:6d}  {t:7.1f}  {alg:6.2f}  "
            f"{alg * factor:6.2f}  {0:6d}  {t:7.1f}  {alg:6.2f}  {alg * factor:6.2f}  {0:6d}\n"
        )
    return "".join(lines)


@pytest.mark.parametrize(
    ("op", "root", "per_rank", "factor", "says"),
    [
        ("sum", -1, False, 2 * 7 / 8, "all_reduce"),
        ("sum", -1, True, 7 / 8, "reduce_scatter"),
        ("max", 0, False, 1.0, "reduce"),
        ("none", 0, False, 1.0, "broadcast"),
        ("none", -1, False, 1.0, "sendrecv"),
        ("none", 3, True, 7 / 8, "unknown: gather or scatter"),
        ("none", -1, True, 7 / 8, "unknown: all_gather or alltoall"),
        # nccl-tests before ec1b5e2 (2020) printed all_gather's busbw = algbw; so does hypercube.
        ("none", -1, True, 1.0, "unknown: all_gather or hypercube"),
        # No binary prints a per-rank count with an op and busbw = 2(n-1)/n algbw.
        ("sum", -1, True, 2 * 7 / 8, "unknown: no nccl-tests binary"),
    ],
)
def test_the_rows_name_their_binary_only_when_one_fits(op, root, per_rank, factor, says):
    (test,) = nccl_parse.parse_tests(_synthetic(op, root, per_rank, factor))
    if says.startswith("unknown"):
        assert test.collective == "unknown" and test.basis.endswith(f"fit {says[9:]}"), test.basis
    else:
        assert test.collective == says and test.basis.startswith("from its rows"), test.basis
    assert test.nranks == (8 if per_rank else 0)  # size / (count x 4) when the count is per rank


def test_a_blank_redop_is_read_from_the_right_columns():
    """04: the header has redop, the rows leave it blank (11 tokens for 12 columns)."""
    rows = nccl_parse.parse_output(_file("04").read_text())
    first = next(r for r in rows if r.size == 32)
    assert (first.count, first.type, first.redop, first.root) == (1, "float", "none", -1)
    assert (first.oop_time_us, first.ip_time_us, first.oop_wrong) == (89.00, 85.13, None)


def test_wrong_counts_are_whole_numbers_and_name_the_failing_sizes():
    exp = EXPECTED["13-nris-olivia-gh200-allreduce-4node-wrong-NOFOOTER.txt"]["wrong_nonzero_rows_oop_ip"]
    rows = nccl_parse.parse_output(_file("13").read_text())
    bad = rep.failures(rows)
    assert {str(r.size): [str(r.oop_wrong), str(r.ip_wrong)] for r in bad} == exp
    # Old `error` columns are a max error, judged against a tolerance: 5e-07 passes.
    assert rep.failures(nccl_parse.parse_output(_file("14").read_text())) == []


def test_launch_live_stream_and_utf16_files_read_too():
    text = _file("09").read_text()
    stream = "".join(f"[node 0] {line}\n" for line in text.splitlines())
    assert nccl_parse.parse_output(stream) == nccl_parse.parse_output(text)
    # Windows PowerShell's `>` writes UTF-16 with a BOM.
    utf16 = _windows(text).encode("utf-16")
    assert nccl_parse.parse_output(nccl_parse.decode_output(utf16)) == nccl_parse.parse_output(text)


# ---- the command -------------------------------------------------------------------------------


def _launch(*args: str, input: str | bytes | None = None):
    return CliRunner().invoke(main, ["nccl-tests", *args], input=input)


def _run_dir(runs: Path) -> Path:
    (d,) = runs.iterdir()
    return d


def test_wrong_rows_exit_1_and_are_named_with_the_report_written(tmp_path):
    f13 = str(_file("13"))
    r = _launch("--from", f13, "--runs-dir", str(tmp_path / "runs"))
    assert r.exit_code == 1, r.output
    named = re.findall(r"all_reduce at (\d+) B: wrong results \(out-of-place (\d+), in-place (\d+)\)", r.stderr)
    exp = EXPECTED[Path(f13).name]["wrong_nonzero_rows_oop_ip"]
    assert {s: [o, i] for s, o, i in named} == exp
    assert f"{f13}: all_reduce at 2097152 B: wrong results" in r.stderr
    assert (
        f"{f13}: all_reduce ('# Collective test starting: all_reduce_perf'); 16 ranks on 4 nodes; 28 rows" in r.stderr
    )
    assert "collective sweep" in r.stdout and "89.85" in r.stdout and "# Avg bus bandwidth    : 5.099 GB/s" in r.stdout
    run = _run_dir(tmp_path / "runs")
    doc = json.loads((run / "rows.json").read_text())
    assert len(doc["rows"]) == 28 and (doc["nranks"], doc["nnodes"]) == (16, 4)
    assert len((run / "rows.csv").read_text().splitlines()) == 29
    assert (run / "busbw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_prints_each_row_of_every_file_and_nothing_else_on_stdout(tmp_path):
    files = [_file("03"), _file("09")]
    r = _launch("--from", str(files[0]), "--from", str(files[1]), "--json", "--runs-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) == 30 + 31
    objs = [json.loads(line) for line in lines]
    assert all(list(o) == FIELDS for o in objs)
    assert objs[29]["size"] == 4294967296 and objs[29]["oop_busbw"] == 43.81 and objs[29]["oop_wrong"] == 5e-07
    assert objs[-1]["oop_busbw"] == 338.82 and objs[-1]["oop_wrong"] == 0 and objs[-1]["nranks"] == 16
    assert "collective sweep" in r.stderr  # the table moved to stderr
    doc = json.loads((_run_dir(tmp_path) / "rows.json").read_text())
    assert doc["rows"] == objs


def test_stdin_through_kubectl_and_min_busbw(tmp_path):
    text = _kubectl_timestamps(_file("03").read_text())
    ok = _launch("--from", "-", "--min-busbw", "11", "--runs-dir", str(tmp_path / "a"), input=text)
    assert ok.exit_code == 0, ok.output
    assert "stdin: all_reduce (from its rows: redop sum, no root" in ok.stderr
    low = _launch("--from", "-", "--min-busbw", "12", "--runs-dir", str(tmp_path / "b"), input=text)
    assert low.exit_code == 1
    assert low.stderr.splitlines()[-1] == "average bus bandwidth 11.2 GB/s is below --min-busbw 12"


def test_expected_bandwidth_as_a_live_run_gives_it(tmp_path):
    f09 = _file("09")
    r = _launch("--from", str(f09), "--machine-type", "a3-megagpu-8g", "--nodes", "2", "--runs-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    rows = rep.parse_output(f09.read_text())
    report = rep.expected_judgement(rows, "a3-megagpu-8g", 16, 2)
    assert r.stderr.rstrip().splitlines()[-1] == report.verdict  # healthy: no size fell short
    assert report.verdict == "consistent with a healthy a3-megagpu-8g cluster of 2 nodes"
    # The model's terms only behind --explain, after the verdict.
    assert not any(note in r.stderr for note in report.notes) and "A and φ" not in r.stderr
    explained = _launch("--from", str(f09), "--machine-type", "a3-megagpu-8g", "--nodes", "2", "--explain")
    err = explained.stderr.splitlines()
    assert explained.exit_code == 0 and err.index(report.verdict) < err.index(report.notes[0])
    assert all(note in explained.stderr for note in report.notes)


def test_a_slow_cluster_gets_its_verdict_in_words_first(tmp_path):
    """09 at 60% of its busbw: the first expected-bandwidth line says how far below a healthy
    cluster and from which size, in words; 'Avg bus bandwidth' is printed once."""
    lines = []
    for line in _file("09").read_text().splitlines():
        cols = line.split()
        if len(cols) == 13 and cols[0].isdigit():  # a row: both blocks' algbw and busbw at 60%
            for i in (6, 7, 10, 11):
                cols[i] = f"{float(cols[i]) * 0.6:.2f}"
            line = " ".join(cols)
        lines.append(line)
    text = "\n".join(lines) + "\n"
    slow = tmp_path / "slow.txt"
    slow.write_text(text)
    args = ["--from", str(slow), "--ops", "all_reduce", "--machine-type", "a3-megagpu-8g", "--nodes", "2"]
    r = _launch(*args, "--runs-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    first = next(i for i, line in enumerate(err) if "healthy" in line)
    assert re.fullmatch(
        r"below a healthy a3-megagpu-8g by \d+(-\d+)?% from \d+ MiB up: the network is slow \(see --find-bad-nodes\)",
        err[first],
    ), err[first]
    assert "B = " not in r.stderr and "borrowed" not in r.stderr
    assert (r.stdout + r.stderr).count("Avg bus bandwidth") == 1


def test_the_table_fits_120_columns(tmp_path):
    r = _launch("--from", str(_file("13")), "--runs-dir", str(tmp_path))
    table = r.stdout.splitlines()
    assert len(table) > 28 and max(len(line) for line in table) <= 120, max(map(len, table))


def test_without_matplotlib_the_rows_are_written_and_the_plot_skipped_in_one_line(tmp_path, monkeypatch):
    """The launcher-only install (`pip install -e .`) has no matplotlib (the `plot` extra)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    r = _launch("--from", str(_file("09")), "--runs-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "plot: plot skipped: matplotlib is not installed (pip install 'gpufleet[plot]')" in r.stderr
    run = _run_dir(tmp_path)
    assert sorted(p.name for p in run.iterdir()) == ["rows.csv", "rows.json"]
    assert len(json.loads((run / "rows.json").read_text())["rows"]) == 31


def test_expected_bandwidth_says_what_it_lacks(tmp_path):
    f07 = str(_file("07"))
    r = _launch("--from", f07, "--machine-type", "a3-megagpu-8g", "--runs-dir", str(tmp_path / "a"))
    assert r.exit_code == 0, r.output
    assert "no expected bandwidth: pass --nodes N (the output does not name its hosts)" in r.stderr
    assert f"no expected bandwidth: the collective of {f07} is unknown; pass --ops NAME" in r.stderr
    # Naming it with --ops and the node count gives the comparison.
    named = _launch(
        "--from",
        f07,
        "--ops",
        "all_gather",
        "--machine-type",
        "a3-megagpu-8g",
        "--nodes",
        "2",
        "--runs-dir",
        str(tmp_path / "b"),
    )
    assert named.exit_code == 0, named.output
    assert f"{f07}: all_gather (--ops); 16 ranks; 31 rows" in named.stderr
    rows = rep.parse_output(Path(f07).read_text(), collective="all_gather")
    assert rep.expected_judgement(rows, "a3-megagpu-8g", 16, 2).verdict in named.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--from", "/nonexistent/slurm-1234.out"],
            "error: --from /nonexistent/slurm-1234.out: no such file; give a saved nccl-tests or sweep "
            "output, or - for stdin",
        ),
        (["--from", str(CORPUS)], f"error: --from {CORPUS} is a directory; give a file in it"),
        (
            ["--from", str(CORPUS / "SOURCES.md")],
            f"error: --from {CORPUS / 'SOURCES.md'}: no nccl-tests table or #gpufleet-json line in its",
        ),
        (["--from", "-"], "error: --from stdin: no nccl-tests table or #gpufleet-json line in its 0 lines"),
        (["--from", "-", "--from", "-"], "error: --from - is given twice; stdin can be read once"),
        (
            ["--from", str(_file("09")), "--hostfile", "hosts.txt"],
            "error: --hostfile does not apply to --from, which reads results that exist and runs nothing",
        ),
        (["--from", str(_file("09")), "-b", "8"], "error: --minbytes does not apply to --from"),
        (
            ["--from", str(_file("09")), "--ops", "all_gather"],
            f"error: --ops all_gather: {_file('09')} is all_reduce (from its rows",
        ),
        (["--from", str(_file("09")), "--ops", "allreduce"], "error: --ops 'allreduce' with --from names"),
        (
            ["--from", str(_file("09")), "--machine-type", "a3-mega"],
            "error: machine type 'a3-mega' is unknown; one of: a2-highgpu-1g",
        ),
        (["--json"], "error: --json prints the rows read with --from"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    r = _launch(*args, "--runs-dir", str(tmp_path), input="")
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(message), r.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_runs_dir_that_cannot_be_made_is_one_line_before_the_report(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the runs directory should be\n")
    r = _launch("--from", str(_file("09")), "--runs-dir", str(blocker))
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.startswith(f"error: --runs-dir {blocker}: cannot make ") and len(r.stderr.splitlines()) == 1
    assert blocker.read_text() == "a file where the runs directory should be\n"


def test_installed_console_script_reads_a_pipe_and_fails_on_wrong_rows(tmp_path):
    launch = Path(sys.executable).parent / "launch"
    text = _srun_label(_file("13").read_text())
    p = subprocess.run(
        [str(launch), "nccl-tests", "--from", "-", "--json", "--runs-dir", str(tmp_path)],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(rows) == 28 and sum(1 for r in rows if r["oop_wrong"] or r["ip_wrong"]) == 6
    assert "stdin: all_reduce at 33554432 B: wrong results (out-of-place 951005, in-place 820604)" in p.stderr


def test_a_gpufleet_sweep_log_reads_by_its_json_line_or_its_table(monkeypatch, capsys, tmp_path):
    """A real sweep (one process, gloo) as launch's live stream shows it, `[node 0] ` first."""
    import socket

    import workloads.sweep as sweep

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(k, v)
    assert sweep.main(["--ops", "all_reduce,all_gather", "-b", "1K", "-e", "4K", "-f", "2", "-n", "1"]) == 0
    out = capsys.readouterr().out
    log = tmp_path / "sweep.log"
    log.write_text("".join(f"[node 0] {line}\n" for line in out.splitlines()))
    r = _launch("--from", str(log), "--json", "--runs-dir", str(tmp_path / "runs"))
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(o["collective"], o["size"]) for o in rows] == [
        (c, s) for c in ("all_reduce", "all_gather") for s in (1024, 2048, 4096)
    ]
    assert "the sweep's #gpufleet-json line" in r.stderr
    # Without the JSON line (a terminal that did not show it), the tables say the same.
    table_only = tmp_path / "table.log"
    table_only.write_text("".join(l + "\n" for l in log.read_text().splitlines() if "#gpufleet-json" not in l))
    t = _launch("--from", str(table_only), "--json", "--runs-dir", str(tmp_path / "runs"))
    assert t.exit_code == 0, t.output
    from_table = [json.loads(line) for line in t.stdout.splitlines()]
    assert [(o["collective"], o["size"], o["nranks"]) for o in from_table] == [
        (o["collective"], o["size"], 1) for o in rows
    ]
    assert [o["oop_busbw"] for o in from_table] == [pytest.approx(o["oop_busbw"], abs=0.006) for o in rows]
