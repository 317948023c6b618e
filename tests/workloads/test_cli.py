"""Bad arguments: one line on rank 0, exit 2, no traceback, no hang."""

from __future__ import annotations

import subprocess
import sys

from tests.workloads.conftest import REPO, child_env, one_line_exit_2, train


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


def test_help_lists_the_flags_the_launcher_uses():
    p = subprocess.run(
        [sys.executable, "-m", "workloads.train", "--help"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0
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
        assert flag in p.stdout


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
        run = train(["--steps", "2", "--global-batch", "4", "--micro-batch", "2", *args], nproc=0, timeout=60)
        assert run.returncode == 2, (args, run.stderr)
        assert run.stderr.count("\n") == 1 and run.stderr.startswith(f"error: {needle}"), run.stderr
        assert "step 1/" not in run.stdout  # found before training, not at the first log line
    assert not missing.exists()
    assert not params.exists()  # the probe of a writable --save-params leaves nothing behind


def test_writable_output_paths_are_written_and_an_existing_metrics_file_is_appended_to(tmp_path):
    out, metrics = tmp_path / "p.pt", tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0}\n')  # an existing metrics file is appended to
    run = train(
        [
            "--steps",
            "3",
            "--global-batch",
            "4",
            "--micro-batch",
            "2",
            "--save-params",
            str(out),
            "--metrics-file",
            str(metrics),
            "--straggler-every",
            "0",
        ],
        nproc=0,
        timeout=90,
    )
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 0
    assert [line[:11] for line in metrics.read_text().splitlines()] == [
        '{"step": 0}',
        '{"step": 1,',
        '{"step": 2,',
        '{"step": 3,',
    ]


def test_a_bucket_without_credentials_is_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    run = train(
        ["--steps", "2", "--global-batch", "4", "--micro-batch", "2", "--checkpoint-dir", "gs://some-bucket/run"],
        nproc=0,
        timeout=60,
        env={"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing-key.json")},
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: cannot open gs://some-bucket: ")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in run.stderr
