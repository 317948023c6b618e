"""The sweep report through launcher.nccl.report, the one import of its library API: parsing,
judging, storing, bad-node ranking, the mpirun argv (each owned by its own module)."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json

import pytest
from rich.console import Console

from gpufleet.bandwidth import bus_factor
from gpufleet.catalog import lookup
from gpufleet.expected import model_busbw, plateau_busbw
from launcher.cli.nccl_table import rich_table
from launcher.nccl import report as rep
from tests.nccl import samples


def test_modern_output_rows_by_header_name():
    rows = rep.parse_output(samples.MODERN_ALL_GATHER)
    assert [r.size for r in rows] == [8388608, 16777216, 8589934592]
    last = rows[-1]
    assert (last.collective, last.type, last.redop, last.root, last.nranks) == ("all_gather", "float", "none", -1, 16)
    assert (last.oop_time_us, last.oop_algbw, last.oop_busbw, last.oop_wrong) == (42668, 201.32, 188.73, 0)
    assert (last.ip_busbw, last.ip_wrong) == (188.80, 3)
    assert not last.error_column


def test_wrong_elements_are_a_failure():
    rows = rep.parse_output(samples.MODERN_ALL_GATHER)
    assert [r.size for r in rep.failures(rows)] == [8589934592]


def test_old_error_column_without_root():
    rows = rep.parse_output(samples.OLD_ALL_REDUCE, collective="all_reduce", nranks=8)
    assert [r.size for r in rows] == [8, 1048576, 134217728]
    assert all(r.error_column and r.root == -1 and r.redop == "sum" for r in rows)
    assert rows[1].oop_wrong == pytest.approx(2e-7)
    # 2e-07 is float rounding; 5e-01 is a wrong result.
    assert [r.size for r in rep.failures(rows)] == [134217728]
    assert rep.avg_busbw(rows) == pytest.approx((0 + 0 + 31.42 + 31.64 + 158.69 + 158.83) / 6)


def test_old_broadcast_without_redop():
    (row,) = rep.parse_output(samples.OLD_BROADCAST, collective="broadcast")
    assert (row.root, row.redop, row.type, row.oop_busbw, row.ip_busbw) == (0, "none", "float", 16.10, 16.18)


def test_concatenated_tests_na_and_missing_out_of_place_block():
    rows = rep.parse_output(samples.TWO_TESTS)
    assert [(r.collective, r.nranks) for r in rows] == [("all_reduce", 2)] * 2 + [("alltoall", 2)]
    assert rows[1].oop_busbw is None and rows[1].ip_busbw == 9.11
    assert rows[2].oop_wrong is None and rows[2].ip_wrong is None
    assert rep.failures(rows) == []
    assert rep.avg_busbw(rows) == pytest.approx((8.70 + 8.75 + 9.11 + 2.10 + 2.09) / 5)


def test_json_marker_line_wins_over_the_table():
    row = {
        "collective": "all_reduce",
        "size": 64,
        "count": 16,
        "type": "float",
        "redop": "sum",
        "root": -1,
        "nranks": 6,
        "oop_time_us": 10.0,
        "oop_algbw": 0.0064,
        "oop_busbw": 0.01067,
        "oop_wrong": 0,
        "ip_time_us": 11.0,
        "ip_algbw": 0.0058,
        "ip_busbw": 0.0097,
        "ip_wrong": 2,
    }
    text = samples.TWO_TESTS + rep.JSON_MARKER + json.dumps({"version": 1, "rows": [row]}) + "\n"
    (parsed,) = rep.parse_output(text)
    assert parsed.nranks == 6 and parsed.oop_busbw == 0.01067
    assert rep.failures([parsed]) == [parsed]


def test_a_json_line_cut_short_falls_back_to_the_table():
    """A node that dies mid-write leaves half a JSON line in its log: read the table instead."""
    text = samples.TWO_TESTS + rep.JSON_MARKER + '{"version": 1, "rows": [{"collective": "all_re'
    assert rep.parse_output(text) == rep.parse_output(samples.TWO_TESTS) != []


def test_nothing_parsable_gives_no_rows():
    assert rep.parse_output("bash: all_reduce_perf: command not found\n") == []


def test_the_table_has_every_row_and_the_cli_draws_it():
    rows = rep.parse_output(samples.MODERN_ALL_GATHER)
    cells = rep.table_rows(rows)
    assert len(cells) == len(rows) and all(len(c) == len(rep.TABLE_COLUMNS) for c, _ in cells)
    assert [bad for _, bad in cells] == [False, False, True]  # the sample's last row has 3 wrong in place
    assert ["188.73" in c for c, _ in cells].count(True) >= 1 and any(c[1] == "8 GiB" for c, _ in cells)
    console = Console(width=250, record=True)
    console.print(rich_table(rows))
    text = console.export_text()
    assert "188.73" in text and "8 GiB" in text
    assert "Avg bus bandwidth" not in text  # the report's own "# Avg bus bandwidth" line says it, once


def test_a_wrong_row_is_marked_for_the_cli_to_show_red():
    rows = rep.parse_output(samples.MODERN_ALL_GATHER)
    wrong = [dataclasses.replace(rows[0], oop_wrong=3.0), *rows[1:]]
    assert [bad for _, bad in rep.table_rows(wrong)] == [True, False, True]
    assert rep.table_rows(wrong)[0][0][-1].startswith("3/")


# ---- expected bandwidth --------------------------------------------------------------------


def _model_rows(machine: str, coll: str, n: int, nnodes: int, scale: float) -> list[rep.SweepRow]:
    plateau = plateau_busbw(lookup(machine), coll, nnodes)
    f = bus_factor(coll, n)
    rows = []
    for s in (8 << i for i in range(31)):
        # Small sizes at the model, large ones scaled: A is fitted on the first, judged on both.
        b = model_busbw(s, plateau, 100e-6, f) * (scale if s > (64 << 20) else 1.0)
        t = s * f / (b * 1e9) * 1e6
        rows.append(rep.SweepRow(coll, s, s // 4, "float", "sum", -1, n, t, b / f, b, 0, t, b / f, b, 0))
    return rows


# expected_report itself: tests/nccl/test_expected.py, against Google's published sweeps.


def test_write_results_writes_and_never_overwrites(tmp_path):
    rows = _model_rows("a3-megagpu-8g", "all_gather", 16, 2, 1.0) + _model_rows(
        "a3-megagpu-8g", "all_reduce", 16, 2, 0.5
    )
    first = rep.write_results(rows, tmp_path / "runs" / "job1", machine_type="a3-megagpu-8g", nranks=16, nnodes=2)
    assert {k: p.name for k, p in first.items()} == {"json": "rows.json", "csv": "rows.csv", "png": "busbw.png"}
    assert first["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(first["json"].read_text())
    assert len(doc["rows"]) == len(rows) and doc["machine_type"] == "a3-megagpu-8g"
    with first["csv"].open() as fh:
        assert [int(r["size"]) for r in csv.DictReader(fh)] == [r.size for r in rows]
    before = {p: p.read_bytes() for p in first.values()}
    second = rep.write_results(rows[:3], tmp_path / "runs" / "job1", nranks=16, nnodes=2)
    assert [p.name for p in second.values()] == ["rows.1.json", "rows.1.csv", "busbw.1.png"]
    assert all(p.read_bytes() == b for p, b in before.items())


# ---- bad nodes ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(2, 10))
def test_pair_schedule_covers_every_pair_once_in_disjoint_rounds(n):
    hosts = [f"node-{i}" for i in range(n)]
    rounds = rep.pair_schedule(hosts)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    seen = [frozenset(p) for r in rounds for p in r]
    assert sorted(map(sorted, seen)) == sorted(map(sorted, map(frozenset, itertools.combinations(hosts, 2))))
    for r in rounds:
        members = [h for p in r for h in p]
        assert len(members) == len(set(members))


def test_pair_schedule_rejects_too_few_or_repeated_hosts():
    with pytest.raises(ValueError, match="2 or more"):
        rep.pair_schedule(["a"])
    with pytest.raises(ValueError, match="repeat: b"):
        rep.pair_schedule(["a", "b", "b"])


def _pairs(nodes: list[str], slow: set[str], fast: float = 10.0, slow_bw: float = 2.0):
    return {(a, b): (slow_bw if {a, b} & slow else fast) for a, b in itertools.combinations(nodes, 2)}


@pytest.mark.parametrize("n", [3, 4, 8])
def test_rank_nodes_names_the_slow_node_and_only_it(n):
    nodes = [f"node-{i}" for i in range(n)]
    report = rep.rank_nodes(_pairs(nodes, {"node-2"}))
    assert report.bad == ["node-2"] and report.exclude == "node-2"
    (line,) = report.lines
    assert line.startswith("node-2: busbw 2.00 GB/s") and "node-0 2.00" in line


def test_rank_nodes_healthy_cluster_names_nobody_and_noise_is_tolerated():
    nodes = [f"n{i}" for i in range(6)]
    pairs = {p: 10.0 + 0.5 * (i % 3) for i, p in enumerate(itertools.combinations(nodes, 2))}
    report = rep.rank_nodes(pairs)
    assert report.bad == [] and report.exclude == ""


def test_rank_nodes_two_bad_of_eight_worst_first():
    nodes = [f"n{i}" for i in range(8)]
    pairs = _pairs(nodes, {"n5"}, slow_bw=1.0)
    pairs.update({p: 4.0 for p in pairs if "n1" in p and "n5" not in p})
    assert rep.rank_nodes(pairs).exclude == "n5,n1"


def test_confirm_halves_and_suspects():
    hosts = [f"n{i}" for i in range(8)]
    clean, suspect = rep.confirm_halves(hosts, ["n5"])
    assert "n5" in suspect and "n5" not in clean
    assert sorted(clean + suspect) == sorted(hosts) and len(suspect) == 4
    assert rep.confirm_suspects(10.0, 3.0, ["n5"]) == ["n5"]
    assert rep.confirm_suspects(10.0, 9.5, ["n5"]) == []
    with pytest.raises(ValueError, match="clean half"):
        rep.confirm_halves(["a", "b", "c"], ["a", "b"])
    with pytest.raises(ValueError, match="not among the hosts: zz"):
        rep.confirm_halves(hosts, ["zz"])


# ---- nccl-tests argv ------------------------------------------------------------------------


def test_nccl_tests_command_builds_a_hostfile_free_mpirun():
    cmd = rep.nccl_tests_command(
        "/opt/nccl-tests/build/all_reduce_perf",
        ["10.0.0.2", "10.0.0.3"],
        8,
        ["-b", "8", "-e", "8G", "-f", "2", "-g", "1"],
        {"NCCL_ALGO": "Ring", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"},
    )
    assert cmd == [
        "mpirun",
        "-np",
        "16",
        "-H",
        "10.0.0.2:8,10.0.0.3:8",
        "--bind-to",
        "none",
        "-x",
        "NCCL_ALGO=Ring",
        "-x",
        "LD_LIBRARY_PATH=/usr/local/nvidia/lib64",
        "/opt/nccl-tests/build/all_reduce_perf",
        "-b",
        "8",
        "-e",
        "8G",
        "-f",
        "2",
        "-g",
        "1",
    ]
    assert rep.nccl_tests_command("x", ["h"], 1, [], {}, allow_run_as_root=True)[1] == "--allow-run-as-root"
    with pytest.raises(ValueError, match="'h1,h2'"):
        rep.nccl_tests_command("x", ["h1,h2"], 8, [], {})
    with pytest.raises(ValueError, match="'BAD-NAME'"):
        rep.nccl_tests_command("x", ["h1"], 8, [], {"BAD-NAME": "1"})


def test_the_report_api_is_the_owning_modules_names():
    """docs/reference/nccl-api.md: every name nccl_report offers is the object its owning module defines."""
    import importlib

    owners = {
        "launcher.nccl.parse": ["parse_output"],
        "launcher.nccl.judge": [
            "failures",
            "ExpectedReport",
            "expected_curve",
            "expected_judgement",
            "expected_report",
        ],
        "launcher.nccl.render": ["TABLE_COLUMNS", "table_rows", "write_results"],
        "launcher.nccl.badnodes": [
            "BadNodeReport",
            "pair_schedule",
            "rank_nodes",
            "confirm_halves",
            "confirm_suspects",
        ],
        "launcher.nccl.mpirun": ["nccl_tests_command"],
        "gpufleet.contracts": ["JSON_MARKER", "SweepRow"],
        "gpufleet.bandwidth": ["avg_busbw"],
    }
    assert sorted(n for names in owners.values() for n in names) == sorted(rep.__all__)
    for module, names in owners.items():
        owner = importlib.import_module(module)
        for name in names:
            assert getattr(rep, name) is getattr(owner, name), f"nccl_report.{name} is not {module}.{name}"
