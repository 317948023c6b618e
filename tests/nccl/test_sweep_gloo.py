"""The sweep for real: torchrun over gloo, 3 simulated nodes × 2 processes on localhost."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.bandwidth import COLLECTIVES, bus_factor, coll_sizes, size_ladder
from launcher.nccl import report as rep

# Its module fixture runs once: every test of the module on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("sweep_gloo")

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
NNODES, NPROC = 3, 2
N = NNODES * NPROC


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.fixture(scope="module")
def three_node_sweep(tmp_path_factory):
    """One sweep of every collective; returns (rank 0's stdout, the --json path, all stdouts)."""
    out = tmp_path_factory.mktemp("sweep")
    json_path = out / "rows.json"
    port = _free_port()
    args = [
        "--ops",
        "all",
        "-b",
        "64",
        "-e",
        "4K",
        "-f",
        "8",
        "-n",
        "2",
        "-w",
        "1",
        "-d",
        "float",
        "-o",
        "sum",
        "--json",
        str(json_path),
    ]
    procs = [
        subprocess.Popen(
            [
                str(TORCHRUN),
                "--nnodes",
                str(NNODES),
                "--nproc-per-node",
                str(NPROC),
                "--node-rank",
                str(i),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"sweep{port}",
                "--max-restarts",
                "0",
                "-m",
                "workloads.sweep",
                *args,
            ],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(NNODES)
    ]
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=180))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_out, se) in zip(procs, results):
        assert p.returncode == 0, f"torchrun exit {p.returncode}: {se[-2000:]}"
    # c10d rendezvous hands out ranks in its own order: rank 0 is on whichever agent it chose.
    (rank0,) = [so for so, _ in results if rep.JSON_MARKER in so]
    return rank0, json_path


def _json_rows(text: str) -> list[dict]:
    (line,) = [l for l in text.splitlines() if l.startswith(rep.JSON_MARKER)]
    return json.loads(line[len(rep.JSON_MARKER) :])["rows"]


def test_every_collective_every_size_every_result_correct(three_node_sweep):
    text, _ = three_node_sweep
    rows = _json_rows(text)
    sizes = size_ladder(64, 4096, 8)
    for coll in COLLECTIVES:
        crow = [r for r in rows if r["collective"] == coll]
        expect = [coll_sizes(coll, s, 4, N).size for s in sizes]
        assert [r["size"] for r in crow] == expect, coll
        for r in crow:
            assert r["nranks"] == N and r["oop_wrong"] == 0, r
            # in-place alltoall/sendrecv share one buffer and are timed, not checked (N/A)
            assert r["ip_wrong"] == (None if coll in ("alltoall", "sendrecv") else 0), r
    assert "# Out of bounds values : 0 OK" in text


def test_busbw_over_algbw_is_the_nccl_tests_factor(three_node_sweep):
    rows = _json_rows(three_node_sweep[0])
    for r in rows:
        for blk in ("oop", "ip"):
            if r[f"{blk}_algbw"] > 0:
                ratio = r[f"{blk}_busbw"] / r[f"{blk}_algbw"]
                assert ratio == pytest.approx(bus_factor(r["collective"], N), rel=1e-12)
    ar = [r for r in rows if r["collective"] == "all_reduce"]
    assert ar and all(r["oop_busbw"] / r["oop_algbw"] == pytest.approx(2 * (N - 1) / N) for r in ar)


def test_table_and_json_agree(three_node_sweep):
    text, json_path = three_node_sweep
    table_only = "\n".join(l for l in text.splitlines() if not l.startswith(rep.JSON_MARKER))
    table = rep.parse_output(table_only)
    rows = _json_rows(text)
    assert len(table) == len(rows) == 7 * 3
    for t, j in zip(table, rows):
        assert (t.collective, t.size, t.count, t.type, t.redop, t.root, t.nranks) == (
            j["collective"],
            j["size"],
            j["count"],
            j["type"],
            j["redop"],
            j["root"],
            j["nranks"],
        )
        for blk in ("oop", "ip"):
            # the table prints %.2f (or fewer decimals for big numbers): agree to that precision
            for key in ("time_us", "algbw", "busbw"):
                assert getattr(t, f"{blk}_{key}") == pytest.approx(j[f"{blk}_{key}"], abs=0.0051, rel=1e-3)
            assert getattr(t, f"{blk}_wrong") == j[f"{blk}_wrong"]
    # Each table's footer is the mean busbw of its rows (%g: 6 significant digits).
    footers = [float(m) for m in re.findall(r"^# Avg bus bandwidth\s+: (\S+)", text, re.M)]
    for coll, avg in zip(COLLECTIVES, footers):
        mean = rep.avg_busbw([rep.SweepRow(**r) for r in rows if r["collective"] == coll])
        assert avg == pytest.approx(mean, rel=1e-5)
    assert json.loads(json_path.read_text())["rows"] == rows
    # One document: the --json file says exactly what the printed line says.
    (line,) = [l for l in text.splitlines() if l.startswith(rep.JSON_MARKER)]
    assert json.loads(json_path.read_text()) == json.loads(line[len(rep.JSON_MARKER) :])


def test_write_results_from_the_sweep_writes_the_png(three_node_sweep, tmp_path):
    rows = rep.parse_output(three_node_sweep[0])
    paths = rep.write_results(rows, tmp_path / "job", machine_type="a2-highgpu-8g", nranks=N, nnodes=NNODES)
    assert paths["png"].stat().st_size > 1000
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads(paths["json"].read_text())["rows"]) == len(rows)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["-b", "8T"], "size '8T' is not understood"),
        (["--ops", "allreduce"], "collective 'allreduce' is unknown"),
        (["-b", "1M", "-e", "8"], "swap -b and -e"),
        (["-d", "uint32"], "datatype 'uint32' is not supported"),
        (["-o", "avg", "-d", "int32"], "avg' needs a floating datatype"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    """The parse every rank does first, in this process (a subprocess per case only re-imports
    torch); the whole path, from `python -m`, is the test below."""
    from workloads.sweep.config import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, (argv, err)
    assert err.count("\n") == 1 and needle in err, (argv, err)


def test_python_m_sweep_exits_2_with_one_line_on_a_bad_argument_and_outside_torchrun():
    r = subprocess.run(
        [sys.executable, "-m", "workloads.sweep", "-b", "8T"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "size '8T' is not understood" in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "workloads.sweep"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE")},
    )
    assert r.returncode == 2 and "run it under torchrun" in r.stderr


def test_a_wrong_result_is_counted_and_fails_the_run(monkeypatch, capsys):
    """One process, gloo; the reference values are spoiled so every checked element is wrong."""
    import workloads.sweep as sweep

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    from workloads.sweep import expected

    real = expected.reduced
    monkeypatch.setattr(expected, "reduced", lambda g, op, n, dt: real(g, op, n, dt) + 1)
    rc = sweep.main(["--ops", "all_reduce,broadcast", "-b", "64", "-e", "64", "-n", "1"])
    out = capsys.readouterr().out
    assert rc == 1
    rows = rep.parse_output(out)
    assert [r.collective for r in rep.failures(rows)] == ["all_reduce"]
    ar = rows[0]
    assert (ar.oop_wrong, ar.ip_wrong) == (16, 16)  # 64 bytes of float, every element
    assert "# Out of bounds values : 32 FAILED" in out
    import torch.distributed as dist

    assert not dist.is_initialized()  # destroy_process_group ran


def _one_process(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))


def test_a_json_path_that_cannot_be_written_is_one_line_before_the_sweep(monkeypatch, capsys, tmp_path):
    import workloads.sweep as sweep

    ran = []
    monkeypatch.setattr(sweep.driver, "_sweep", lambda *a: ran.append(a))
    for path, needle in (
        (tmp_path / "no-such-dir" / "rows.json", "cannot write there (No such file"),
        (tmp_path, "is a directory; pass a file path"),
    ):
        _one_process(monkeypatch)
        rc = sweep.main(["-b", "64", "-e", "64", "-n", "1", "--json", str(path)])
        captured = capsys.readouterr()
        assert rc == 2
        assert captured.err.count("\n") == 1 and captured.err.startswith(f"sweep: --json {path}")
        assert needle in captured.err, captured.err
        assert captured.out == ""
    assert ran == []  # refused before any collective ran
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the probe left nothing behind


def test_the_json_file_is_the_printed_document(monkeypatch, capsys, tmp_path):
    import workloads.sweep as sweep

    _one_process(monkeypatch)
    path = tmp_path / "rows.json"
    assert sweep.main(["--ops", "all_reduce", "-b", "64", "-e", "128", "-f", "2", "-n", "1", "--json", str(path)]) == 0
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith(rep.JSON_MARKER)]
    doc = json.loads(path.read_text())
    assert doc == json.loads(line[len(rep.JSON_MARKER) :])
    assert doc["backend"] == "gloo" and doc["avg_busbw"] == rep.avg_busbw([rep.SweepRow(**r) for r in doc["rows"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


# ---- --time-budget and --rounds (the bad-node finder's sweep) -----------------------------


def test_a_size_over_the_time_budget_is_answered_by_its_first_call(monkeypatch, capsys):
    """A budget no call can meet: each size is one call, checked, in-place not run, and says so."""
    import workloads.sweep as sweep

    _one_process(monkeypatch)
    calls = []
    real = sweep.bench.Bench.case

    def counting_case(self, *a, **k):
        c, size, count = real(self, *a, **k)
        run = c.run
        c.run = lambda: (calls.append(size), run())[1]
        return c, size, count

    monkeypatch.setattr(sweep.bench.Bench, "case", counting_case)
    assert (
        sweep.main(
            ["--ops", "all_reduce", "-b", "1K", "-e", "4K", "-f", "4", "-n", "20", "-w", "3", "--time-budget", "1e-9"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert calls == [1024, 4096]  # one call per size: no warm-up, no untimed call, no other block
    rows = _json_rows(out)
    assert [(r["size"], r["iters"], r["ip_busbw"], r["oop_wrong"]) for r in rows] == [
        (1024, 1, None, 0),
        (4096, 1, None, 0),
    ]
    assert rows[0]["oop_algbw"] > 0  # (busbw is 0 with one rank: 2(n-1)/n)
    assert out.count("over --time-budget 1e-09 s: timed by that call alone") == 2
    # The table says N/A for the block that was not run, and reads back as such.
    table = rep.parse_output("\n".join(l for l in out.splitlines() if not l.startswith(rep.JSON_MARKER)))
    assert [(r.size, r.ip_time_us, r.ip_busbw) for r in table] == [(1024, None, None), (4096, None, None)]


def test_the_time_budget_sets_the_timed_calls_from_the_first_call(monkeypatch, capsys):
    import workloads.sweep as sweep

    _one_process(monkeypatch)
    # The first call of every size took 0.3 s on the slowest rank: 3 calls fit 1 s.
    monkeypatch.setattr(sweep.bench.Bench, "sizing_call", lambda self, c: (c.run(), (0.3, 0.3))[1])
    assert sweep.main(["--ops", "all_reduce", "-b", "1K", "-e", "1K", "-n", "20", "--time-budget", "1"]) == 0
    out = capsys.readouterr().out
    (row,) = _json_rows(out)
    assert row["iters"] == 3 and row["ip_algbw"] > 0 and row["ip_wrong"] == 0
    assert "all_reduce 1024 B float sum: 3 of 20 iterations fit --time-budget 1 s (first call 0.3 s)" in out
    # Without a budget every size is timed -n times.
    _one_process(monkeypatch)
    assert sweep.main(["--ops", "all_reduce", "-b", "1K", "-e", "1K", "-n", "4"]) == 0
    assert _json_rows(capsys.readouterr().out)[0]["iters"] == 4


def test_rounds_naming_a_node_the_run_lacks_is_one_line(monkeypatch, capsys):
    import workloads.sweep as sweep

    _one_process(monkeypatch)
    monkeypatch.setenv("GPUFLEET_NODE_RANK", "0")
    assert sweep.main(["-b", "64", "-e", "64", "--rounds", "0+1"]) == 2
    err = capsys.readouterr().err
    assert err == "sweep: --rounds names node 1, but this run's nodes are 0 (GPUFLEET_NODE_RANK, else GROUP_RANK)\n"


@pytest.mark.slow
def test_rounds_run_every_collective_correctly_within_each_group(tmp_path):
    """3 nodes x 2 processes: round 1 is nodes 1+2 (node 0 waits), round 2 all three. The root is
    group rank 1, i.e. global rank 3 in round 1: a wrong rank mapping gives wrong results."""
    port = _free_port()
    args = ["--ops", "all", "-b", "64", "-e", "1K", "-f", "4", "-n", "2", "-r", "1", "--rounds", "1+2;0+1+2"]
    procs = [
        subprocess.Popen(
            [
                str(TORCHRUN),
                "--nnodes",
                str(NNODES),
                "--nproc-per-node",
                str(NPROC),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"rounds{port}",
                "--max-restarts",
                "0",
                "-m",
                "workloads.sweep",
                *args,
            ],
            cwd=REPO,
            env=dict(_env(), GPUFLEET_NODE_RANK=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(NNODES)
    ]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * NNODES, [e[-2000:] for _, e in results]
    (text,) = [so for so, _ in results if rep.JSON_MARKER in so]
    from gpufleet.groups import group_documents

    docs = group_documents(text)
    assert [(d["round"], d["nodes"], d["nranks"]) for d in docs] == [(0, [1, 2], 4), (1, [0, 1, 2], 6)]
    for d in docs:
        assert {r["collective"] for r in d["rows"]} == set(COLLECTIVES)
        for r in d["rows"]:
            assert r["nranks"] == d["nranks"] and r["oop_wrong"] == 0, (d["nodes"], r)
            assert r["ip_wrong"] == (None if r["collective"] in ("alltoall", "sendrecv") else 0), r
            assert r["root"] == (1 if r["collective"] in ("broadcast", "reduce") else -1)
    assert text.count("# round 1: nodes 1+2") == 1 and text.count("# round 2: nodes 0+1+2") == 1
