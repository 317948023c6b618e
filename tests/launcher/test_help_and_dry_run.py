"""What a newcomer reads first: `launch --help` with every command's summary whole, option help
in words (no code constants), and dry runs that can be compared and say what a real launch runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from launcher.cli.main import main, summary
from launcher.cli.options import DRY_RUN_JOB_ID

LAUNCH = str(Path(sys.executable).parent / "launch")


def test_launch_help_lists_every_command_with_its_whole_first_sentence():
    p = subprocess.run([LAUNCH, "--help"], capture_output=True, text=True, timeout=120, env={"COLUMNS": "80"})
    assert p.returncode == 0, p.stderr
    commands = p.stdout.split("Commands:\n", 1)[1]
    assert "..." not in commands
    text = " ".join(commands.split())
    for name in main.list_commands(None):
        line = summary(main.get_command(None, name).help)
        assert line.endswith("."), (name, line)
        assert f"{name} {line}" in text, name


def test_the_summary_is_the_first_sentence_and_keeps_e_g():
    assert summary("Do a thing, e.g. this one. Then more.\n\nDetails.") == "Do a thing, e.g. this one."
    assert summary("No full stop\nover two lines") == "No full stop over two lines"


def test_model_help_names_sizes_not_a_code_constant():
    r = CliRunner().invoke(main, ["train", "--help"], terminal_width=200)
    assert r.exit_code == 0
    (line,) = [ln for ln in r.output.splitlines() if ln.strip().startswith("--model ")]
    assert "MODEL_SIZES" not in r.output and "124M" in line and "llama3-8b" in line


def test_ssh_user_and_ssh_key_have_help():
    r = CliRunner().invoke(main, ["exec", "--help"], terminal_width=200)
    text = " ".join(r.output.split())
    assert "--ssh-user USER The account to log in as on every node" in text
    assert "--ssh-key FILE The private key ssh offers" in text
    assert "--no-iap" in text and "--stack-dir DIR" in text


def _dry(tmp_path, *extra):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.2\n10.0.0.3\n")
    args = ["train", "--hostfile", str(hosts), "--machine-type", "a3-megagpu-8g", "--dry-run", *extra]
    return CliRunner().invoke(main, args)


def test_two_dry_runs_of_one_launch_are_byte_identical(tmp_path):
    first, second = _dry(tmp_path), _dry(tmp_path)
    assert first.exit_code == 0, first.output
    assert first.stdout == second.stdout and first.stderr == second.stderr
    assert f"GPUFLEET_JOB_ID={DRY_RUN_JOB_ID}" in first.stdout
    given = _dry(tmp_path, "--job-id", "20260101-120000-a1b2c3")
    assert "GPUFLEET_JOB_ID=20260101-120000-a1b2c3" in given.stdout and DRY_RUN_JOB_ID not in given.stdout


def test_job_id_is_for_dry_runs_and_must_look_like_one(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.2\n")
    r = CliRunner().invoke(main, ["exec", "--hostfile", str(hosts), "--job-id", "20260101-120000-a1b2c3", "--", "true"])
    assert r.exit_code == 2 and r.output == (
        "error: --job-id names the job ID a --dry-run shows; a real launch makes its own: drop --job-id\n"
    )
    bad = _dry(tmp_path, "--job-id", "mine")
    assert bad.exit_code == 2 and bad.output.startswith("error: job id 'mine' is not a job id")


def test_the_dry_run_shows_the_environments_python_as_a_real_launch_runs_it(tmp_path):
    r = _dry(tmp_path)
    assert r.exit_code == 0, r.output
    env_python = [
        w for w in r.stdout.split() if w.startswith("/home/USER/.gpufleet/envs/") and w.endswith("/bin/python")
    ]
    assert env_python and "-m torch.distributed.run" in r.stdout
    assert "exec setsid -- python3 " not in r.stdout  # not the bare python3 a real launch replaces
    assert "PYTHONPATH=/home/USER/.gpufleet/snap/" in r.stderr and "stands for the nodes' home directory" in r.stderr
