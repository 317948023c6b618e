"""`launch top` and detached jobs: `launch top JOB_ID` views that job's nodes only,
the job's controller samples its nodes into the job record while it runs (launcher.observe.job_metrics),
and `launch top --plot JOB_ID` draws those samples.

The cluster tests use real sshd nodes in network namespaces, each with a home of its own (node 0
holds the job records; the client reaches them only over SSH), and a real controller started by
`launch exec --detach`. Node 0's sessions carry GPUFLEET_JOB_TOP_INTERVAL=1 (sshd SetEnv), so the
controller samples every second instead of every 10 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.cmd_top import top
from launcher.cluster.discovery import local_cluster
from launcher.core.types import LaunchConfig, Workload
from launcher.jobs.record import samples_script
from launcher.observe import job_metrics
from launcher.observe.top import SCHEMA
from tests.launcher.test_jobs_cluster import cluster, job, launch
from tests.simcluster import SimCluster
from tests.support import LAUNCH_POLL_S, source_args, wait_for

FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
JOB = "20260101-120000-a1b2c3"


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # the line being written right now
    return out


def _rated(recs: list[dict], node: int) -> list[dict]:
    return [r for r in recs if r["node"] == node and r["status"] == "ok" and r["interval_s"] is not None]


# ---- no network -----------------------------------------------------------------------------------


def test_the_job_interval_is_10_s_unless_node_0_says_otherwise():
    assert job_metrics.interval({}) == 10.0 == job_metrics.INTERVAL_S
    assert job_metrics.interval({"GPUFLEET_JOB_TOP_INTERVAL": "1.5"}) == 1.5
    for bad in ("fast", "0", "-1", "nan", "7200"):
        assert job_metrics.interval({"GPUFLEET_JOB_TOP_INTERVAL": bad}) == 10.0, bad


def test_record_script_quotes_the_job_and_refuses_what_is_not_a_job_id():
    script = samples_script(JOB)
    assert f'"$HOME"/.gpufleet/jobs/{JOB}' in script and "top.jsonl" in script
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    with pytest.raises(Exception, match="is not a job id"):
        samples_script("x; rm -rf ~")


def test_job_sampling_writes_every_node_under_the_job_id_and_stop_leaves_no_session(tmp_path):
    """The controller's sampler, on `--local` nodes (bash here stands in for ssh): every node
    sampled at the interval, the job id as the record's session, and nothing left after stop()."""
    cluster = local_cluster(2)
    config = LaunchConfig(Workload("exec", ("true",)), job_id=JOB)
    path = tmp_path / "top.jsonl"
    m = job_metrics.start(cluster, config, path, interval_s=0.3)
    try:
        wait_for(lambda: all(len(_rated(_records(path), n)) >= 3 for n in (0, 1)), 30, "3 rated samples per node")
        pids = list(m.sampler.pids().values())
        assert len(pids) == 2
    finally:
        m.stop()
    recs = _records(path)
    assert {r["schema"] for r in recs} == {SCHEMA} and {r["session"] for r in recs} == {JOB}
    assert all(r["interval_s"] == pytest.approx(0.3, abs=0.15) for n in (0, 1) for r in _rated(recs, n))
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "a node session outlived stop()"
    m.stop()  # twice is harmless
    n = len(recs)
    time.sleep(0.8)
    assert len(_records(path)) == n, "samples were written after stop()"


def test_job_sampling_that_cannot_start_never_fails_the_job(tmp_path):
    config = LaunchConfig(Workload("exec", ("true",)), job_id=JOB)
    m = job_metrics.start(local_cluster(1), config, tmp_path / "missing-dir" / "top.jsonl", interval_s=1)
    assert m.sampler is None and m.path is None
    m.stop()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plot", JOB], "give that cluster's node flags"),
        ([JOB], "give that cluster's node flags"),
        ([JOB, "--local", "--nodes", "2"], "--local has none"),
        (["--plot", JOB, "--local", "--nodes", "2"], "--local has none"),
        (["not-a-job", "--local", "--nodes", "2"], "'not-a-job' is not a job id"),
        ([JOB, "--plot", JOB], "drop JOB_ID, --record and --duration"),
    ],
)
def test_launch_top_job_refusals_are_one_line_and_exit_2(args, message):
    r = CliRunner().invoke(top, args)
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1, r.output


# ---- the simulated cluster --------------------------------------------------------------------------


def _cluster(sim_cluster, tmp_path: Path, n: int) -> SimCluster:
    return cluster(sim_cluster, tmp_path, n, node0_env={"GPUFLEET_JOB_TOP_INTERVAL": "1"})


def _detach(c: SimCluster, tmp_path: Path, hostfile: Path, *cmd: str, grace: str = "10m") -> str:
    r = launch(
        tmp_path,
        "exec",
        *source_args(c, tmp_path, hostfile),
        "--detach",
        "--controller-grace",
        grace,
        "--",
        *cmd,
        check=True,
    )
    (line,) = r.stdout.splitlines()
    return line.split()[1]


def _state(c: SimCluster, tmp_path: Path, job_id: str) -> str:
    return job(c, tmp_path, job_id)["state"]


def _job_record(tmp_path: Path, job_id: str) -> Path:
    return tmp_path / "home0" / ".gpufleet" / "jobs" / job_id / "top.jsonl"


def test_top_job_id_views_the_jobs_3_nodes_and_its_controller_samples_them_until_it_ends(sim_cluster, tmp_path):
    c = _cluster(sim_cluster, tmp_path, 4)
    three = tmp_path / "hosts3"
    three.write_text("".join(f"{a}\n" for a in c.addresses[:3]))
    job_id = _detach(c, tmp_path, three, "sleep", "14")
    # Viewed through the whole cluster's flags: node 0 holds the record, the job names its nodes.
    rec = tmp_path / "view.jsonl"
    r = launch(tmp_path, "top", job_id, *source_args(c, tmp_path), "--duration", "3", "--record", str(rec), check=True)
    assert f"launch top: job {job_id}, 3 nodes" in r.stdout
    view = _records(rec)
    assert {(x["node"], x["host"]) for x in view} == set(enumerate(c.addresses[:3]))
    assert c.addresses[3] not in r.stdout
    wait_for(lambda: _state(c, tmp_path, job_id) in FINAL, 60, f"job {job_id} to end", interval=LAUNCH_POLL_S)
    assert _state(c, tmp_path, job_id) == "SUCCEEDED"
    c.assert_nothing_left()
    # The controller's samples: every node of the job (and no other), about every second.
    samples = _records(_job_record(tmp_path, job_id))
    assert {x["session"] for x in samples} == {job_id} and {x["schema"] for x in samples} == {SCHEMA}
    assert {(x["node"], x["host"]) for x in samples} == set(enumerate(c.addresses[:3]))
    for node in range(3):
        rated = _rated(samples, node)
        assert len(rated) >= 8, (node, len(rated))
        assert all(x["interval_s"] == pytest.approx(1.0, abs=0.3) for x in rated), rated
    # --plot JOB_ID: the samples copied to the runs dir, as `launch logs` copies logs, and drawn.
    r = launch(tmp_path, "top", "--plot", job_id, *source_args(c, tmp_path), check=True)
    copy = tmp_path / "runs" / job_id / "top.jsonl"
    assert copy.read_text() == _job_record(tmp_path, job_id).read_text()
    png = (tmp_path / "runs" / job_id / "top.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # The job has ended: its live view is refused, pointing at --plot.
    r = launch(tmp_path, "top", job_id, *source_args(c, tmp_path), "--duration", "1")
    assert r.returncode == 2 and f"launch top --plot {job_id}" in r.stderr, r.stderr
    c.assert_nothing_left()


def test_a_stopped_job_stops_its_sampling_and_leaves_nothing_on_any_node(sim_cluster, tmp_path):
    c = _cluster(sim_cluster, tmp_path, 3)
    job_id = _detach(c, tmp_path, c.hostfile, "sleep", "300")
    path = _job_record(tmp_path, job_id)
    wait_for(lambda: all(_rated(_records(path), n) for n in range(3)), 60, "a rated sample of every node")
    launch(tmp_path, "stop", *source_args(c, tmp_path), job_id, check=True)
    assert _state(c, tmp_path, job_id) == "STOPPED"
    c.assert_nothing_left()
    n = len(_records(path))
    time.sleep(2.5)
    assert len(_records(path)) == n, "the job's samples went on after it was stopped"
    r = launch(tmp_path, "top", "--plot", "20260101-000000-000000", *source_args(c, tmp_path))
    assert r.returncode == 2 and "no job 20260101-000000-000000" in r.stderr, r.stderr


def test_a_killed_controller_takes_its_sampling_sessions_with_it(sim_cluster, tmp_path):
    """SIGKILL leaves stop() no chance: each node's loop ends because its session's input closes
    with the controller (and, with no controller back within --controller-grace, the nodes'
    supervisors stop the job), so nothing is left anywhere."""
    c = _cluster(sim_cluster, tmp_path, 2)
    job_id = _detach(c, tmp_path, c.hostfile, "sleep", "300", grace="2s")
    path = _job_record(tmp_path, job_id)
    wait_for(lambda: all(_rated(_records(path), n) for n in range(2)), 60, "a rated sample of every node")
    pid = int((path.parent / "controller.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    c.assert_nothing_left(within=30)
    n = len(_records(path))
    time.sleep(2.5)
    assert len(_records(path)) == n


def test_launch_top_job_id_ends_by_itself_when_the_job_ends(sim_cluster, tmp_path):
    c = _cluster(sim_cluster, tmp_path, 2)
    job_id = _detach(c, tmp_path, c.hostfile, "sleep", "5")
    # No --duration: top must end by itself when the job does (timeout=60 only catches a hang).
    r = launch(tmp_path, "top", job_id, *source_args(c, tmp_path), timeout=60, check=True)
    assert f"job {job_id} ended (SUCCEEDED); launch top --plot {job_id}" in r.stderr, r.stderr
    assert f"launch top: job {job_id}, 2 nodes" in r.stdout
    c.assert_nothing_left()
