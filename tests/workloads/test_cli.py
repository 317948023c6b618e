"""Bad arguments: one line on rank 0, exit 2, no traceback, no hang (issue 5, issue 7)."""

from __future__ import annotations

import subprocess
import sys

from tests.workloads.conftest import REPO, child_env, train


def test_a_batch_that_does_not_divide_is_one_line_from_rank_0_under_torchrun():
    run = train(["--global-batch", "10", "--micro-batch", "4"], nproc=2, timeout=60)
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    # Both ranks find the mistake; only rank 0 says so.
    assert errors == ["error: --global-batch 10 is not divisible by --micro-batch 4 x world size 2 = 8; "
                      "use a multiple of 8"], run.stderr
    assert "[rank" not in run.stderr and "exitcode  : 2" in run.stderr


def test_bad_arguments_without_torchrun_print_exactly_one_line_and_exit_2():
    for args, needle in ((["--model", "13B"], "--model '13B' is unknown; one of: tiny"),
                         (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
                         (["--compression", "bf16"], "--compression bf16 needs CUDA")):
        run = train(args, nproc=0, timeout=60)
        assert run.returncode == 2, (args, run.stderr)
        assert run.stderr.count("\n") == 1 and needle in run.stderr, run.stderr
        assert run.stdout == ""


def test_help_lists_the_flags_the_launcher_uses():
    p = subprocess.run([sys.executable, "-m", "workloads.train", "--help"], cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for flag in ("--model", "--steps", "--global-batch", "--micro-batch", "--checkpoint-dir",
                 "--checkpoint-every", "--resume", "--save-params", "--parallelism", "--compression"):
        assert flag in p.stdout
