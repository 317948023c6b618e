"""A secret passed as `--env KEY` (the launching machine's value) on the simulated cluster, attached
and detached (issue 35, point 3): while the job runs, no process on this machine, which is the
launching machine, the controller (node 0) and every node at once, has the value in its command
line (/proc/PID/cmdline; the nodes' own processes are found by their GPUFLEET_SIMNODE tag too);
every node's workload has it; and once the job has ended no record, log or run file holds it."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
from pathlib import Path

import pytest

from tests.launcher.test_controller_host_cluster import with_controller
from tests.launcher.test_jobs_cluster import client_env as jobs_client_env
from tests.launcher.test_jobs_cluster import cluster, wait_state
from tests.simcluster import SimCluster
from tests.support import LAUNCH, source_args, wait_for

pytestmark = pytest.mark.cluster


def _secret() -> str:
    return "gpufleet-secret-" + secrets.token_hex(12)


def _workload(seen: Path, go: Path) -> list[str]:
    """Each node writes the value it got where the test reads it, then waits for `go`."""
    return [
        "sh",
        "-c",
        f'printf %s "$MY_TOKEN" > {seen}/"$GPUFLEET_NODE_RANK"; while [ ! -f {go} ]; do sleep 0.1; done',
    ]


def _cmdlines_holding(value: bytes) -> dict[int, bytes]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if value in cmdline:
                found[int(entry)] = cmdline.replace(value, b"<THE SECRET>")[:300]
    return found


def _assert_no_command_line_holds(c: SimCluster, value: str) -> None:
    node_pids = c.processes()
    assert node_pids, "the job's processes on the nodes should be running now"
    held = _cmdlines_holding(value.encode())
    assert not held, f"command lines holding the secret: {held}"
    assert not set(held) & set(node_pids)


def _files_holding(value: str, *roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("*") if p.is_file() and value.encode() in p.read_bytes()]


def _seen_everywhere(seen: Path, n: int, value: str) -> None:
    wait_for(lambda: len(list(seen.iterdir())) == n, 60, f"{n} nodes writing what they got", interval=0.2)
    for i in range(n):
        wait_for(lambda i=i: (seen / str(i)).read_text() == value, 10, f"node {i}'s value", interval=0.1)


def test_an_attached_launch_carries_env_key_on_no_command_line(sim_cluster, tmp_path):
    c = sim_cluster(2)
    value = _secret()
    seen, go = tmp_path / "seen", tmp_path / "go"
    seen.mkdir()
    env = {**os.environ, "MY_TOKEN": value}
    p = subprocess.Popen(
        [LAUNCH, "exec", *source_args(c, tmp_path), "--env", "MY_TOKEN", "--", *_workload(seen, go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        _seen_everywhere(seen, 2, value)
        _assert_no_command_line_holds(c, value)
    finally:
        go.touch()
        out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out.decode()
    assert value.encode() not in out
    assert not _files_holding(value, tmp_path / "runs")
    c.assert_nothing_left()


@pytest.mark.parametrize(
    "host,recover",
    [("node0", False), ("node0", True), ("controller", True)],
    ids=["node0", "node0-recover", "controller-recover"],
)
def test_a_detached_job_carries_env_key_on_no_command_line_and_keeps_it_only_while_needed(
    sim_cluster, tmp_path, host, recover
):
    """The client hands the value to the job host (node 0, or a controller host) inside the
    archive on stdin, the controller to each node on stdin. On the job host it is kept in
    env.json, mode 600, only while a controller started again could need it: until the nodes
    run, or with --recover (which may relaunch) until the job ends."""
    c = with_controller(sim_cluster, tmp_path, 2) if host == "controller" else cluster(sim_cluster, tmp_path, 2)
    job_home = tmp_path / ("home2" if host == "controller" else "home0")
    value = _secret()
    seen, go = tmp_path / "seen", tmp_path / "go"
    seen.mkdir()
    more = ["--recover"] if recover else []
    r = subprocess.run(
        [LAUNCH, "exec", *source_args(c, tmp_path), "--detach", *more, "--env", "MY_TOKEN", "--", *_workload(seen, go)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**jobs_client_env(tmp_path), "MY_TOKEN": value},
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split()[1]
    _seen_everywhere(seen, 2, value)
    _assert_no_command_line_holds(c, value)
    env_file = job_home / ".gpufleet" / "jobs" / job_id / "env.json"
    if recover:  # a relaunch needs it: kept, private
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600 and value in env_file.read_text()
    else:  # the nodes have it: gone
        wait_for(lambda: not env_file.exists(), 10, "env.json removed once the nodes run", interval=0.1)
    go.touch()
    done = wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"})
    assert done["state"] == "SUCCEEDED", done
    assert not env_file.exists()
    logs = subprocess.run(
        [LAUNCH, "logs", *source_args(c, tmp_path), job_id],
        capture_output=True,
        text=True,
        env=jobs_client_env(tmp_path),
        timeout=120,
    )
    assert logs.returncode == 0 and value not in logs.stdout + logs.stderr
    # No record, log or run file on the job host, a node or the client holds it.
    homes = [tmp_path / f"home{i}" for i in range(3) if (tmp_path / f"home{i}").exists()]
    assert not _files_holding(value, *homes, tmp_path / "runs", tmp_path / "client")
    c.assert_nothing_left()
