"""The sweep's request written once (gpufleet.collectives) and the one atomic write (gpufleet.atomic)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpufleet import atomic
from gpufleet.bandwidth import COLLECTIVES
from gpufleet.collectives import SWEEP_FLAGS, SweepSpec, collective_list
from launcher.cli.main import main
from tests.launcher import dry_runs

# ---- the sweep's flags ---------------------------------------------------------------------------


def test_the_flags_are_nccl_tests_letters_in_its_order_with_the_request_values():
    spec = SweepSpec(
        ops="all",
        minbytes="1K",
        maxbytes="8M",
        stepfactor=4,
        iters=7,
        warmup_iters=3,
        check=0,
        datatype="half",
        redop="max",
    )
    assert spec.flags() == [
        "-b",
        "1K",
        "-e",
        "8M",
        "-f",
        "4",
        "-n",
        "7",
        "-w",
        "3",
        "-c",
        "0",
        "-d",
        "half",
        "-o",
        "max",
    ]
    assert spec.sweep_argv() == ["--ops", "all", *spec.flags()]
    assert [flag for _, flag in SWEEP_FLAGS] == ["-b", "-e", "-f", "-n", "-w", "-c", "-d", "-o"]


def test_workloads_sweep_reads_the_request_as_it_was_meant():
    """The table is checked against the sweep's own parser: every flag lands on its field."""
    sweep = pytest.importorskip("workloads.sweep")
    spec = SweepSpec(
        ops="all_gather,broadcast",
        minbytes="2K",
        maxbytes="64K",
        stepfactor=4,
        iters=7,
        warmup_iters=3,
        check=0,
        datatype="double",
        redop="min",
    )
    cfg = sweep.parse_args(spec.sweep_argv())
    assert cfg.collectives == ("all_gather", "broadcast")
    assert (cfg.minbytes, cfg.maxbytes, cfg.stepfactor) == (2048, 65536, 4)
    assert (cfg.iters, cfg.warmup_iters, cfg.check) == (7, 3, 0)
    assert cfg.datatypes == ("double",) and cfg.ops == ("min",)


def test_a_collective_list_is_names_or_all_and_an_unknown_name_is_named():
    assert collective_list("all") == COLLECTIVES
    assert collective_list(" all_reduce, sendrecv ,") == ("all_reduce", "sendrecv")
    with pytest.raises(ValueError, match="collective 'allreduce' is unknown; one of: all_reduce, "):
        collective_list("all_reduce,allreduce")
    with pytest.raises(ValueError, match="no collective named"):
        collective_list(" , ")
    with pytest.raises(ValueError, match="'bogus'"):
        SweepSpec(ops="bogus")


def test_an_unknown_collective_is_one_line_before_any_node_is_contacted(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n192.0.2.11\n")  # TEST-NET-1: nothing answers there
    for impl in ("torch", "nccl-tests"):
        r = CliRunner().invoke(
            main,
            [
                "nccl-tests",
                "--hostfile",
                str(hf),
                "--ops",
                "allreduce",
                "--impl",
                impl,
                "--runs-dir",
                str(tmp_path / "runs"),
            ],
        )
        assert r.exit_code == 2, r.output
        (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
        assert line.startswith("error: --ops allreduce: collective 'allreduce' is unknown; one of: all_reduce")
    assert not (tmp_path / "runs").exists()


def test_the_commands_defaults_are_the_requests(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n192.0.2.11\n")
    r = CliRunner().invoke(main, ["nccl-tests", "--hostfile", str(hf), "--dry-run=json"])
    assert r.exit_code == 0, r.output
    sweep = ("-m", "workloads.sweep", *SweepSpec().sweep_argv())
    for plan, argv in zip(dry_runs.plans(r.stdout), dry_runs.started(r.stdout)):
        assert plan.command[-len(sweep) :] == sweep and plan.argv == argv


# ---- writing a file whole ------------------------------------------------------------------------


def test_write_text_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("old\n")
    atomic.write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]


def test_a_writer_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "busbw.png"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic.replacing(path) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".png"  # writers that pick a format by suffix
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["busbw.png"]
