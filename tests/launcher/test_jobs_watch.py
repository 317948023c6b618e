"""launcher.jobs.watch, a detached job as `launch top` follows it, against real job records: the
reader programs run through the local transport (bash on this machine) over a job directory
under a temporary $HOME, as they run on a job host over SSH."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from launcher.core.transport import Transport
from launcher.core.types import Cluster, Node, UserError
from launcher.jobs.record import JOBS_DIR, SAMPLES_FILE, JobRecord, JobState, process_start
from launcher.jobs.watch import JobWatch, copy_samples, job_nodes

JOB = "20260101-120000-a1b2c3"
NODES = tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}", name=f"gpu-{i}") for i in range(4))
CLUSTER = Cluster("c", NODES)
HERE = Transport(local=True)


def _job(home: Path, state: JobState, nodes: list[str], samples: str | None = None) -> Path:
    d = home / JOBS_DIR / JOB
    d.mkdir(parents=True, exist_ok=True)
    # Its controller: this test's process, alive (a record whose controller is gone reads FAILED).
    pid, start = os.getpid(), process_start(os.getpid())
    record = JobRecord(JOB, state, "sleep 300", nodes, submitted=time.time(), pid=pid, pid_start=start or "")
    (d / "state.json").write_text(json.dumps(record.to_json()))
    (d / "controller.pid").write_text(f"{pid} {start}\n")
    if samples is not None:
        (d / SAMPLES_FILE).write_text(samples)
    return d


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home0"))
    return tmp_path / "home0"


def test_the_view_is_the_jobs_nodes_ranked_as_in_the_job(home):
    _job(home, JobState.RUNNING, ["10.0.0.5", "10.0.0.3"])
    viewed = job_nodes(CLUSTER, HERE, JOB)
    assert [(n.rank, n.host, n.name) for n in viewed.nodes] == [(0, "10.0.0.5", "gpu-3"), (1, "10.0.0.3", "gpu-1")]
    assert viewed.name == CLUSTER.name


def test_an_ended_job_or_one_on_nodes_the_flags_do_not_name_is_refused(home):
    _job(home, JobState.RUNNING, ["10.0.0.2", "10.9.9.9"])
    with pytest.raises(UserError, match=r"job .* runs on 10.9.9.9, which the node flags do not name"):
        job_nodes(CLUSTER, HERE, JOB)
    _job(home, JobState.SUCCEEDED, ["10.0.0.2"])
    with pytest.raises(UserError, match=rf"job {JOB} has ended \(SUCCEEDED\); `launch top --plot {JOB}`"):
        job_nodes(CLUSTER, HERE, JOB)
    with pytest.raises(UserError, match=r"no job 20260101-120000-ffffff on node 0"):
        job_nodes(CLUSTER, HERE, "20260101-120000-ffffff")


def test_the_samples_are_copied_to_the_runs_dir_and_none_yet_is_one_error(home, tmp_path):
    d = _job(home, JobState.RUNNING, ["10.0.0.2"])
    with pytest.raises(UserError, match=r"job .* has no samples yet \(its controller samples every 10 s"):
        copy_samples(CLUSTER, HERE, JOB, tmp_path / "runs")
    (d / SAMPLES_FILE).write_text('{"node": 0}\n{"node": 0}\n')
    copy = copy_samples(CLUSTER, HERE, JOB, tmp_path / "runs")
    assert copy == tmp_path / "runs" / JOB / SAMPLES_FILE
    assert copy.read_text() == (d / SAMPLES_FILE).read_text()


def test_the_watch_follows_the_job_until_it_ends(home):
    _job(home, JobState.RUNNING, ["10.0.0.2"])
    watch = JobWatch(HERE, NODES[0], JOB, every_s=0.1).start()
    try:
        assert not watch.ended.wait(0.5)
        assert watch.latest is not None and watch.latest.state is JobState.RUNNING
        assert watch.goodput().startswith("  ")
        _job(home, JobState.FAILED, ["10.0.0.2"])
        assert watch.ended.wait(30)
        assert watch.record is not None and watch.record.state is JobState.FAILED
    finally:
        watch.stop()
