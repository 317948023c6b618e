"""Bad arguments: one line on rank 0, exit 2, no traceback, no hang."""

from __future__ import annotations

import pytest

from tests.workloads.conftest import one_line_exit_2, train
from workloads.train import main


def test_a_batch_that_does_not_divide_is_one_line_from_rank_0_under_torchrun():
    run = train(["--global-batch", "10", "--micro-batch", "4"], nproc=2, timeout=60)
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    # Both ranks find the mistake; only rank 0 says so.
    assert errors == [
        "error: --global-batch 10 is not divisible by --micro-batch 4 x 2 data-parallel ranks = 8; "
        "use a multiple of 8, or leave --global-batch out for 8"
    ], run.stderr
    assert "[rank" not in run.stderr and "exitcode  : 2" in run.stderr


def test_bad_arguments_without_torchrun_print_exactly_one_line_and_exit_2():
    # One in a process of its own (nothing else, a warning at import, reaches stderr) ...
    run = train(["--model", "13B"], nproc=0, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "--model '13B' is unknown; one of: tiny" in run.stderr, run.stderr
    assert run.stdout == ""
    # ... and the others through the same main in this process.
    assert "argument --steps: invalid int value: 'abc'" in one_line_exit_2(["--steps", "abc"])
    assert "--compression bf16 needs CUDA" in one_line_exit_2(["--compression", "bf16"])


def test_help_lists_the_flags_the_launcher_uses(capsys):
    # The parser `python -m workloads.train --help` prints (the module runs as a program above).
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--steps",
        "--global-batch",
        "--micro-batch",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--resume",
        "--save-params",
        "--parallelism",
        "--compression",
    ):
        assert flag in out


def test_output_paths_that_cannot_be_written_are_one_line_before_step_0(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    missing = tmp_path / "no-such-dir"
    params = tmp_path / "p.pt"
    for args, needle in (
        (
            ["--save-params", str(params), "--metrics-file", str(missing / "m.jsonl")],
            f"--metrics-file {missing / 'm.jsonl'}: cannot write it",
        ),
        (["--save-params", str(missing / "p.pt")], f"--save-params {missing / 'p.pt'}: cannot write it"),
        (
            ["--profile-steps", "0:1", "--profile-dir", str(blocker / "prof")],
            f"--profile-dir {blocker / 'prof'}: cannot write traces there",
        ),
    ):
        # Met by main in this process, as by each rank: exit 2, one line, nothing on stdout (so no step).
        line = one_line_exit_2(["--steps", "2", "--global-batch", "4", "--micro-batch", "2", *args])
        assert line.startswith(f"error: {needle}"), (args, line)
    assert not missing.exists()
    assert not params.exists()  # the probe of a writable --save-params leaves nothing behind


def test_a_bucket_without_credentials_is_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    line = one_line_exit_2(
        ["--steps", "2", "--global-batch", "4", "--micro-batch", "2", "--checkpoint-dir", "gs://some-bucket/run"],
        env={"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing-key.json")},
    )
    assert line.startswith("error: cannot open gs://some-bucket: ")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in line
