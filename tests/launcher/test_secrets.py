"""--env values are secrets: they reach the nodes on stdin, never on a command line, so `ps` on the
launching machine, the controller or any node never shows them. `--env KEY` takes this machine's
value (docker's `-e KEY`); `--env-file` reads KEY=VALUE lines."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from launcher.core.env import parse_env_pairs
from launcher.core.types import UserError
from launcher.nccl.mpirun import nccl_tests_command
from tests.launcher.test_jobs_cluster import cluster as detached_cluster
from tests.launcher.test_jobs_cluster import detach, launch, wait_state
from tests.support import Launch, source_args


def _cmdlines_with(value: str) -> list[str]:
    """Every process on this machine (the simulated nodes are process trees here) whose command
    line holds `value`."""
    found = []
    needle = value.encode()
    for f in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if needle in data:
            line = data.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{f.parent.name}: {line[:200]}")
    return found


def test_env_key_alone_takes_this_machines_value_and_env_file_reads_lines(tmp_path):
    f = tmp_path / "job.env"
    f.write_text("# a comment\n\nA=1\nB=x=y\nHF_TOKEN\n")
    pairs = parse_env_pairs(["C=3", "HF_TOKEN"], [str(f)], environ={"HF_TOKEN": "hf_abc"})
    assert pairs == (("A", "1"), ("B", "x=y"), ("HF_TOKEN", "hf_abc"), ("C", "3"), ("HF_TOKEN", "hf_abc"))
    with pytest.raises(UserError, match="--env 'MISSING': MISSING is not set on this machine"):
        parse_env_pairs(["MISSING"], environ={})
    with pytest.raises(UserError, match="is not KEY=VALUE"):
        parse_env_pairs(["KEY\n=1"], environ={})  # a trailing newline is not part of a name
    with pytest.raises(UserError, match="--env-file .*nope: cannot read it"):
        parse_env_pairs([], [str(tmp_path / "nope")])


def test_mpirun_forwards_the_users_values_by_name_only():
    argv = nccl_tests_command("/bin/all_reduce_perf", ["a", "b"], 8, [], {"NCCL_X": "1"}, pass_through=["HF_TOKEN"])
    assert ["-x", "NCCL_X=1"] == argv[argv.index("NCCL_X=1") - 1 : argv.index("NCCL_X=1") + 1]
    assert argv[argv.index("HF_TOKEN") - 1] == "-x" and not any("HF_TOKEN=" in a for a in argv)


@pytest.mark.cluster
def test_an_attached_jobs_secret_is_on_no_command_line_here_or_on_any_node(sim_cluster, tmp_path, monkeypatch):
    secret = "gpufleet-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("GPUFLEET_TEST_TOKEN", secret)
    c = sim_cluster(2)
    run = Launch(
        [
            "exec",
            *source_args(c, tmp_path),
            "--env",
            "GPUFLEET_TEST_TOKEN",
            "--",
            "sh",
            "-c",
            'echo "got ${#GPUFLEET_TEST_TOKEN} bytes"; sleep 5',
        ],
        tmp_path / "launch.log",
    )
    try:
        run.wait_for_text(f"got {len(secret)} bytes", count=2)  # both nodes have it
        assert _cmdlines_with(secret) == []
        assert run.wait() == 0, run.out
    finally:
        run.kill()
    assert secret not in run.out


@pytest.mark.cluster
def test_a_detached_jobs_secret_is_on_no_command_line_of_the_client_controller_or_nodes(
    sim_cluster, tmp_path, monkeypatch
):
    secret = "gpufleet-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("GPUFLEET_TEST_TOKEN", secret)
    c = detached_cluster(sim_cluster, tmp_path, 2)
    job_id = detach(
        c,
        tmp_path,
        "exec",
        "--env",
        "GPUFLEET_TEST_TOKEN",
        "--",
        "sh",
        "-c",
        'echo "got ${#GPUFLEET_TEST_TOKEN} bytes"; sleep 6',
    )
    wait_state(c, tmp_path, job_id, {"RUNNING"})

    def logged() -> str:
        return launch(tmp_path, "logs", *source_args(c, tmp_path), job_id).stdout

    deadline_out = ""
    for _ in range(200):
        deadline_out = logged()
        if deadline_out.count(f"got {len(secret)} bytes") >= 2:
            break
    assert deadline_out.count(f"got {len(secret)} bytes") >= 2, deadline_out
    # The controller on node 0 runs the job's launch now, with the value from its 0600 env.json.
    assert _cmdlines_with(secret) == []
    assert wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
