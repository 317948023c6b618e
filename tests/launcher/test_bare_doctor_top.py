"""`launch doctor` and `launch top` on bare nodes (tests/simcluster.py, `bare=True`): nodes as
`pulumi up` leaves them, with the system python3 and no gpufleet, no torch, no venv. Neither
command may need more: doctor's checks are bash with the node's own `python3` for the versions
(torch reported missing, which a launch then builds), top's sampler is bash alone.

nvidia-smi is faked as the other doctor and top tests fake it (tests/launcher/fake_gpu_node.py's
`FakeGpuNode` for doctor's queries, test_top_units' loop-mode stand-in for top's `-lms` stream),
in a directory on each node's own disk at the front of its sessions' PATH (BARE_NODE_ENV, sshd
SetEnv). The nodes are two of the session's shared bare cluster (tests/conftest.py
`bare_nodes`): each test removes its stand-ins and marker after, so no other test meets a GPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.launcher.fake_gpu_node import FakeGpuNode
from tests.launcher.test_jobs_cluster import launch
from tests.launcher.test_top_units import FAKE_SMI_LOOP
from tests.support import BARE_FAKE_BIN, BARE_GROUP, BARE_READY_MARKER, hostfile_of, source_args

pytestmark = [pytest.mark.cluster, BARE_GROUP]

N = 2
FAKE_BIN = BARE_FAKE_BIN  # on each node's own disk (its home)
HIDDEN = "/root/.gpufleet-away"  # where what launches left on a shared node waits out a doctor test


@pytest.fixture
def c(bare_nodes):
    yield bare_nodes
    for i in range(N):
        shutil.rmtree(bare_nodes.node_path(i, FAKE_BIN), ignore_errors=True)
        bare_nodes.node_path(i, BARE_READY_MARKER).unlink(missing_ok=True)


def src(c, tmp_path: Path) -> list[str]:
    return source_args(c, tmp_path, hostfile_of(c, tmp_path, N))


def _system_python(c, i: int) -> str:
    r = c.exec(i, ["python3", "-c", "import sys; print(sys.version.split()[0])"])
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture
def without_gpufleet(c):
    """Nothing of gpufleet on the nodes while the test runs: what launches on the shared nodes
    left (their code, environments, jobs) is moved aside, and put back after."""
    moved = []
    for i in range(N):
        there, away = c.node_path(i, "/root/.gpufleet"), c.node_path(i, HIDDEN)
        if there.exists():
            there.rename(away)
            moved.append((there, away))
    try:
        yield
    finally:
        for there, away in moved:
            shutil.rmtree(there, ignore_errors=True)  # what the test's own commands left
            away.rename(there)


def test_doctor_on_bare_nodes_checks_every_node_with_the_system_python_and_no_torch(c, without_gpufleet, tmp_path):
    for i in range(N):
        FakeGpuNode().write(c.node_path(i, FAKE_BIN))
        c.node_path(i, BARE_READY_MARKER).write_text(json.dumps({"cluster": "bare", "node": f"n{i}"}))
        # Nothing of gpufleet or torch on the node: what a launch brings is not there.
        assert not c.node_path(i, "/root/.gpufleet").exists()
        assert c.exec(i, ["python3", "-c", "import torch"]).returncode != 0
    r = launch(tmp_path, "doctor", *src(c, tmp_path), "--json", timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["healthy"] is True and doc["exclude"] == [], doc
    for i, node in enumerate(doc["nodes"]):
        assert node["host"] == c.addresses[i] and node["status"] == "ok", node
        assert len(node["gpus"]) == 8 and node["versions"]["driver"] == "580.159.04"
        assert node["versions"]["python"] == _system_python(c, i)
        assert node["versions"]["torch"] == "missing"
        assert node["checks"]["versions"]["status"] == "ok", node["checks"]["versions"]
    # The table too, as a user reads it.
    t = launch(tmp_path, "doctor", *src(c, tmp_path), timeout=180)
    assert t.returncode == 0 and t.stdout.count("8 x H100 80GB HBM3") == N, t.stdout + t.stderr
    assert f"all {N} nodes healthy" in t.stdout
    c.assert_nothing_left()


def test_top_on_bare_nodes_streams_every_nodes_gpus_and_cpu(c, tmp_path):
    for i in range(N):
        smi = c.node_path(i, FAKE_BIN) / "nvidia-smi"
        smi.parent.mkdir(parents=True, exist_ok=True)
        smi.write_text(FAKE_SMI_LOOP)
        smi.chmod(0o755)
    rec = tmp_path / "top.jsonl"
    r = launch(tmp_path, "top", *src(c, tmp_path), "--duration", "4", "--interval", "0.5", "--record", str(rec))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{N}/{N} nodes answering at the end" in r.stdout + r.stderr
    recs = [json.loads(line) for line in rec.read_text().splitlines()]
    for i in range(N):
        rated = [x for x in recs if x["node"] == i and x["status"] == "ok" and x["interval_s"] is not None]
        assert rated, recs
        last = rated[-1]
        assert last["host"] == c.addresses[i]
        # The stand-in's two GPUs at 90 % and 50 %: read through nvidia-smi's loop on the node.
        assert last["gpu"]["count"] == 2 and last["gpu"]["util_mean_pct"] == 70 and last["gpu"]["util_min_pct"] == 50
        assert last["cpu_util_pct"] is not None
    c.assert_nothing_left()
