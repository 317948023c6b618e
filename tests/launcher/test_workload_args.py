"""`launch train`'s workload arguments on the launching machine: listed by --help after the
launcher's options, checked before any node is touched (one line, exit 2, nothing started), and
a default global batch that runs at any world size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.cli.cmd_train import train
from launcher.cli.workload_args import TrainArgs, no_such_option, option_names, world_size
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload, new_job_id
from tests.launcher import dry_runs
from tests.support import LAUNCH, REPO


def _launch_names() -> list[str]:
    return option_names(train)


def test_train_help_lists_the_workload_options_after_the_launchers():
    r = CliRunner().invoke(main, ["train", "--help"])
    assert r.exit_code == 0, r.output
    launcher_at = r.output.index("\nOptions:")
    workload_at = r.output.index("\nWorkload options (after --; python -m workloads.train):")
    assert launcher_at < r.output.index("--nproc-per-node") < r.output.index("--detach") < workload_at
    workload = r.output[workload_at:]
    for flag in ("--model", "--steps", "--global-batch", "--micro-batch", "--checkpoint-dir", "--resume / --no-resume"):
        assert flag in workload, flag
    # The words are the field docs `python -m workloads.train --help` shows, % escapes undone.
    assert "micro_batch x data-parallel ranks (no accumulation)" in " ".join(workload.split())
    assert "%%" not in workload and "--detach" not in workload


def test_a_mistyped_launcher_option_is_one_line_exit_2_and_nothing_starts(tmp_path):
    runs = tmp_path / "runs"
    r = CliRunner().invoke(main, ["train", "--local", "--nodes", "2", "--runs-dir", str(runs), "--detatch"])
    assert r.exit_code == 2, r.output
    assert r.output == "error: no such option --detatch (did you mean --detach?)\n"
    assert not runs.exists()


def test_nothing_reaches_a_node_when_the_workload_arguments_are_wrong(tmp_path):
    """Over SSH: a ProxyCommand that leaves a mark proves whether ssh ran at all."""
    hosts = tmp_path / "hosts"
    hosts.write_text("192.0.2.10\n192.0.2.11\n")  # TEST-NET-1: nothing answers there
    mark = tmp_path / "ssh-ran"
    source = [
        "--hostfile",
        str(hosts),
        "--ssh-option",
        f"ProxyCommand=touch {mark}",
        "--known-hosts",
        str(tmp_path / "known_hosts"),
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    for args, line in (
        (["--detatch"], "no such option --detatch (did you mean --detach?)"),
        (["--", "--global-bach", "8"], "no such option --global-bach (did you mean --global-batch?)"),
        (["--", "--steps", "x"], "argument --steps: invalid int value: 'x' (see launch train --help)"),
        (
            ["--", "--global-batch", "7"],
            "--global-batch 7 is not divisible by --micro-batch 4 x 2 data-parallel ranks = 8; "
            "use a multiple of 8, or leave --global-batch out for 8",
        ),
        (
            ["--detach", "--", "--model", "7B"],
            "--model '7B' is unknown; one of: tiny, tiny-4l, small-test, 124M, 350M, 1.3B, "
            "llama3-debug, llama3-1b, llama3-8b, llama3-70b",
        ),
    ):
        r = CliRunner().invoke(main, ["train", *source, *args])
        assert (r.exit_code, r.output) == (2, f"error: {line}\n"), args
    assert not mark.exists() and not (tmp_path / "runs").exists()
    # The mark is real: the same flags on a command that does reach for the nodes leave it.
    r = CliRunner().invoke(main, ["hosts", *source])
    assert r.exit_code == 1 and mark.exists(), r.output


def test_a_launcher_option_after_the_workloads_says_where_it_belongs(tmp_path):
    r = CliRunner().invoke(
        main, ["train", "--local", "--nodes", "2", "--runs-dir", str(tmp_path), "--steps", "5", "--detach"]
    )
    assert r.exit_code == 2
    assert r.output.startswith("error: --detach is an option of `launch train`, not of the workload; put it before")


def test_the_batch_is_checked_against_the_ranks_the_launch_starts():
    """3 nodes x 2 processes = 6 ranks; 8 GPUs x 16 nodes = 128 ranks (the README's headline)."""
    six = Cluster("local", tuple(Node(i, "localhost", "127.0.0.1") for i in range(3)), local=True)
    big = Cluster("c", tuple(Node(i, f"n{i}", f"10.0.0.{i}") for i in range(16)), "a3-megagpu-8g")
    config = LaunchConfig(workload=Workload("torchrun", ("x",)), job_id=new_job_id(), nproc_per_node=2)
    plain = LaunchConfig(workload=Workload("torchrun", ("x",)), job_id=new_job_id())
    assert world_size(six, config) == 6 and world_size(big, plain) == 128
    TrainArgs([], _launch_names()).check(six, config)
    TrainArgs([], _launch_names()).check(big, plain)
    TrainArgs(["--global-batch", "1024", "--micro-batch", "2"], _launch_names()).check(big, plain)
    with pytest.raises(UserError, match=r"^--global-batch 12 is not divisible by --micro-batch 4 x 128 "):
        TrainArgs(["--global-batch", "12"], _launch_names()).check(big, plain)


def test_the_hint_is_the_closest_name_or_none():
    assert no_such_option("--detatch", ["--detach", "--data"]) == "no such option --detatch (did you mean --detach?)"
    assert no_such_option("--zzz", ["--detach"]) == "no such option --zzz"


def test_the_console_script_refuses_a_typo_before_starting_anything(tmp_path):
    p = subprocess.run(
        [LAUNCH, "train", "--local", "--nodes", "2", "--detatch"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == "error: no such option --detatch (did you mean --detach?)\n"
    assert list(tmp_path.iterdir()) == []  # no runs/ directory


def test_three_local_nodes_train_with_the_default_batch(tmp_path):
    """No batch flag at 3 ranks: the global batch follows them and the banner says so."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["--model", "tiny", "--seq-len", "32", "--steps", "2", "--straggler-every", "0"]
    p = subprocess.run(
        [LAUNCH, "train", "--local", "--nodes", "3", "--workdir", str(REPO), "--", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "global batch 12 = micro-batch 4 x 3 data-parallel ranks (default; --global-batch to set)" in p.stdout
    assert "step 2/2" in p.stdout


def test_nccl_tests_help_lists_the_sweep_options_in_the_sweeps_words_after_the_launchers():
    from workloads.sweep_args import build_parser

    r = CliRunner().invoke(main, ["nccl-tests", "--help"])
    assert r.exit_code == 0, r.output
    sweep_at = r.output.index("\nSweep options (python -m workloads.sweep on every node):")
    launcher, sweep = r.output[:sweep_at], " ".join(r.output[sweep_at:].split())
    assert "--nproc-per-node" in launcher and "--impl" in launcher and "--find-bad-nodes" in launcher
    for flag in ("--ops", "-b, --minbytes", "-e, --maxbytes", "-f, --stepfactor", "-n, --iters", "-d, --datatype"):
        assert flag in sweep and flag not in launcher, flag
    words = {a.option_strings[0]: a.help for a in build_parser()._actions}
    assert f"-b, --minbytes TEXT {words['-b']} [default: 32M]" in sweep


def test_the_launcher_reads_the_workloads_command_lines_without_torch():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from launcher.cli import main\n"
        "dry = ['train', '--local', '--nodes', '2', '--dry-run']\n"
        "plan = ['train', '--nodes', '2', '--machine-type', 'a3-megagpu-8g', '--dry-run']\n"
        "plan += ['--', '--model', 'llama3-8b']\n"
        "for argv in (['train', '--help'], ['nccl-tests', '--help'], dry, plan):\n"
        "    assert CliRunner().invoke(main, argv).exit_code == 0, argv\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_the_sweep_maps_every_type_name_its_command_line_takes():
    from workloads import sweep
    from workloads.sweep_args import DATATYPES

    assert tuple(sweep.TORCH_DTYPES) == DATATYPES
    assert sweep.parse_args(["-d", "all", "-b", "1K"]).datatypes == DATATYPES


PLAN_70B = ["--", "--model", "llama3-70b", "--tp", "8", "--dp-shard", "16", "--micro-batch", "1", "--seq-len", "8192"]


def test_a_dry_run_without_nodes_prints_the_plan_for_the_nodes_and_machine_type_given():
    nodes = ["train", "--nodes", "16", "--machine-type", "a3-megagpu-8g", "--dry-run"]
    r = CliRunner().invoke(main, [*nodes, *PLAN_70B])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert r.stdout == "" and "  tp 8: ranks 0-7 form one group, within node 0" in lines
    assert "mode: eager (autograd keeps what each op saves)" in lines
    assert "verdict: does not fit by 1.5 GiB" in lines
    assert lines[-1].startswith("  smallest change that fits: --compile ->")
    r = CliRunner().invoke(main, [*nodes, *PLAN_70B, "--activation-checkpointing"])
    assert r.exit_code == 0 and "verdict: fits (31.1 of 80 GiB)" in r.stderr.splitlines(), r.output
    # Without --machine-type there is no GPU to plan for: one line, exit 2.
    r = CliRunner().invoke(main, ["train", "--nodes", "16", "--dry-run", *PLAN_70B])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("error: --dry-run without a node source prints the memory plan only")


def test_a_dry_run_on_known_nodes_prints_their_commands_and_the_plan(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("192.0.2.10\n192.0.2.11\n")  # TEST-NET-1: a dry run contacts neither
    source = ["--hostfile", str(hosts), "--machine-type", "a3-megagpu-8g", "--known-hosts", str(tmp_path / "kh")]
    args = ["--", "--model", "llama3-8b", "--tp", "8", "--dp-shard", "2", "--micro-batch", "1", "--seq-len", "8192"]
    r = CliRunner().invoke(main, ["train", *source, "--runs-dir", str(tmp_path / "runs"), "--dry-run", *args])
    assert r.exit_code == 0, r.output
    assert dry_runs.headers(r.stdout) == [(0, "192.0.2.10"), (1, "192.0.2.11")], r.stdout
    assert "dp_shard 2: ranks 0,8 form one group, across 2 nodes" in r.stderr
    assert "verdict: fits (32.1 of 80 GiB)" in r.stderr.splitlines()
    # The layout is checked against the world the nodes give: 16 ranks, not 128.
    bad = ["--", "--model", "llama3-70b", "--tp", "8", "--dp-shard", "16"]
    r = CliRunner().invoke(main, ["train", *source, "--dry-run", *bad])
    assert r.exit_code == 2 and "= 128 != world size 16" in r.output, r.output


def test_a_layout_is_checked_before_the_world_is_known_at_its_own_size():
    # tp 2 and pp 2 are no error before the launch's world size is known (nor is the batch the
    # pipeline splits); tp 3 does not divide 4 heads at any world size.
    TrainArgs(["--model", "llama3-debug", "--tp", "2"], [])
    TrainArgs(["--model", "tiny-4l", "--pp", "2", "--global-batch", "64", "--micro-batch", "8"], [])
    TrainArgs(["--model", "tiny-4l", "--pp", "2", "--pp-schedule", "interleaved-1f1b"], [])
    with pytest.raises(UserError, match="--tp 3 does not divide model llama3-debug's 4 attention heads"):
        TrainArgs(["--model", "llama3-debug", "--tp", "3"], [])


def test_plan_without_dry_run_is_refused_before_any_node_is_touched(tmp_path):
    r = CliRunner().invoke(main, ["train", "--local", "--nodes", "2", "--runs-dir", str(tmp_path), "--", "--plan"])
    assert (r.exit_code, r.output) == (
        2,
        "error: --plan prints a memory plan and trains nothing; run it as `launch train --dry-run ...`\n",
    )
    assert not list(tmp_path.iterdir())
