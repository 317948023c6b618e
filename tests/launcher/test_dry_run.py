"""--dry-run connects to nothing, on every command that offers it: each prints what it would do and
exits 0 (or refuses the combination in one line, exit 2), and no ssh or gcloud runs. The commands
are the ones the `launch` group lists whose options include --dry-run, so a new command that
offers it is tested here without being named. `ssh` and `gcloud` on PATH record every call.
And --dry-run=FORMAT: read where launch reads its options, never from the program's arguments."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from tests.launcher import dry_runs
from tests.launcher.fake_compute import FakeCompute
from tests.support import LAUNCH

JOB = "20260101-120000-abcdef"

# What each command needs besides the node flags (its arguments), when it needs any.
ARGS = {
    "run": ["--", "train.py", "--steps", "3"],
    "exec": ["--", "hostname"],
    "logs": [JOB],
    "stop": [JOB, "--grace", "5s"],
    "attach": [JOB],
}
# Commands whose dry run prints what they would do on the job host, and so must name the job.
ON_JOB_HOST = {"logs", "stop", "attach"}


def _dry_run_commands() -> list[str]:
    ctx = click.Context(main)
    names = []
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        if any(p.name == "dry_run" for p in cmd.params):
            names.append(name)
    return names


def _recorders(tmp_path: Path) -> tuple[dict[str, str], Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for tool in ("ssh", "gcloud", "scp", "mpirun"):
        exe = bin_dir / tool
        exe.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 255\n')
        exe.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPUFLEET_STATE_DIR": str(tmp_path / "state")}
    return env, calls


def test_the_commands_offering_dry_run_are_found():
    # The enumeration itself: a broken lookup would make the test below test nothing.
    assert {
        "train",
        "run",
        "exec",
        "hosts",
        "nccl-tests",
        "doctor",
        "top",
        "jobs",
        "logs",
        "stop",
        "attach",
        "prune",
    } <= set(_dry_run_commands())


@pytest.mark.parametrize("command", _dry_run_commands())
def test_a_dry_run_opens_no_connection(tmp_path, command):
    env, calls = _recorders(tmp_path)
    hostfile = tmp_path / "hosts"
    # TEST-NET-1 addresses (RFC 5737): nothing answers there.
    hostfile.write_text("192.0.2.10\n192.0.2.11\n")
    argv = [LAUNCH, command, "--hostfile", str(hostfile), "--machine-type", "a3-highgpu-8g", "--dry-run"]
    argv += ["--runs-dir", str(tmp_path / "runs"), *ARGS.get(command, [])]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert not calls.exists(), f"{command} --dry-run ran: {calls.read_text()}\n{out}"
    assert p.returncode == 0, out
    assert "192.0.2.10" in p.stdout, out
    if command in ON_JOB_HOST:
        assert JOB in p.stdout, out
    # Nothing made on this machine either: no known_hosts, no control directory for the cluster.
    assert not (tmp_path / "state").exists()


def test_stop_dry_run_shows_the_stop_it_would_send(tmp_path):
    env, calls = _recorders(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("192.0.2.10\n")
    p = subprocess.run(
        [LAUNCH, "stop", JOB, "--hostfile", str(hostfile), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 0 and not calls.exists(), p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert [line.split("\t")[1] for line in lines][-1].startswith(f"stop job {JOB}")
    assert all(line.startswith("192.0.2.10\t") for line in lines), p.stdout


@pytest.mark.parametrize("command", ["exec", "jobs", "logs", "stop", "attach"])
def test_a_dry_run_through_iap_runs_no_tunnel_and_shows_it(tmp_path, command):
    env, calls = _recorders(tmp_path)
    outputs = tmp_path / "o.json"
    nodes = [{"name": f"dev-{i}", "index": i, "internalIp": f"192.0.2.{10 + i}", "externalIp": None} for i in range(2)]
    outputs.write_text(
        json.dumps({"cluster": "dev", "project": "p", "zone": "z1", "machineType": None, "nodes": nodes})
    )
    with FakeCompute({}) as api:  # where the nodes' host keys would be read: not in a dry run
        argv = [LAUNCH, command, "--outputs", str(outputs), "--iap", "--api-endpoint", api.endpoint, "--dry-run"]
        argv += [] if command == "jobs" else ARGS.get(command, ["--", "true"])
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not calls.exists(), calls.read_text()  # neither gcloud nor ssh
    assert api.requests == []
    assert "through IAP: gcloud compute start-iap-tunnel dev-0 22 --listen-on-stdin --zone z1" in p.stderr


# --dry-run=FORMAT (launcher.cli.options.DryRunCommand): the format attached, never the next word,
# and never a program's own argument of the same spelling.


@pytest.mark.parametrize("command", _dry_run_commands())
def test_every_dry_run_refuses_an_unknown_format_in_one_line_naming_the_formats(tmp_path, command):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("192.0.2.10\n")
    r = CliRunner().invoke(main, [command, "--hostfile", str(hostfile), "--dry-run=yaml", *ARGS.get(command, [])])
    assert r.exit_code == 2, r.output
    assert r.output == (
        "error: Invalid value for '--dry-run': 'yaml' is not a dry run's format; one of: text, json "
        f"(`main {command} -h` lists the options)\n"
    )


def _exec_argv(tmp_path: Path, *args: str) -> list[str]:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("192.0.2.10\n")
    return ["exec", "--hostfile", str(hostfile), "--runs-dir", str(tmp_path / "runs"), *args]


@pytest.mark.parametrize(
    "args",
    [
        ["--dry-run=json", "--", "tool", "--dry-run=yaml", "--dry-run"],
        ["--dry-run=json", "tool", "--dry-run=yaml", "--dry-run"],
        ["--dry-run", "--dry-run=json", "tool", "--dry-run=yaml"],
    ],
    ids=["after --", "after the program's name", "the last --dry-run wins"],
)
def test_a_programs_own_dry_run_flags_reach_it_untouched(tmp_path, args):
    r = CliRunner().invoke(main, _exec_argv(tmp_path, *args))
    assert r.exit_code == 0, r.output
    assert [p.argv for p in dry_runs.plans(r.stdout)] == [tuple(args[args.index("tool") :])]


def test_a_bare_dry_run_takes_no_word_after_it(tmp_path):
    r = CliRunner().invoke(main, _exec_argv(tmp_path, "--dry-run", "json"))
    assert r.exit_code == 0, r.output
    assert "run      json" in r.stdout  # the program `json`, shown in the readable form
