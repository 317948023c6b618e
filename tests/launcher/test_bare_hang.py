"""Hang stacks on bare nodes (tests/simcluster.py, `bare=True`): nodes with the system python3
and the cluster's package index only, nothing of this machine's venv, so no py-spy unless the
launch brings it. A user's --sync job whose requirements.txt names torch alone gets py-spy from
the node's tools environment (built once per node from the same index, launcher.code); `launch
train` gets it beside its python, in gpufleet's workloads environment. Either way the launch
names the rank outside the collective, writes every rank's stack, stops the job and leaves
nothing running.

Two nodes of the session's shared bare cluster (tests/conftest.py `bare_nodes`, where the
workloads environment an earlier test built is found), one rank each: rank 1 sleeps in its data
loading while rank 0 waits for it in a gloo all_reduce. py-spy may ptrace the workers: the nodes'
sessions run as root in the root PID namespace (tests/launcher/test_hang_cluster.py says why that
is allowed)."""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import pytest

from launcher.code.pyenv import EnvSpec
from launcher.core.stacks import PYSPY_TOOLS, PYSPY_VERSION
from tests.launcher.test_jobs_cluster import launch, wait_state
from tests.support import BARE_GROUP, REPO, TRAIN, source_args

pytestmark = [pytest.mark.cluster, BARE_GROUP, pytest.mark.timeout(900)]

N = 2
ONE = ["--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1"]
# Progress is the script's own line (torch's import warns on stderr where numpy is missing, and
# that line must not start the 5 s while the workers still import torch on a loaded machine).
HANG = ["--hang-timeout", "5s", "--progress", r"rank \d+ up"]


@pytest.fixture
def c(bare_nodes):
    return bare_nodes


def src(c, tmp_path: Path) -> list[str]:
    """The first N nodes of the shared cluster (a hostfile of this test's own), and its index."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{a}\n" for a in c.addresses[:N]))
    return [*source_args(c, tmp_path, hostfile), "--index-url", c.package_index]


def lacking_tools(c) -> list[int]:
    """The nodes without the tools environment (py-spy), which a launch that may collect stacks
    builds where the job's own environment lacks py-spy."""
    return [i for i in range(N) if not c.node_path(i, f"/root/{PYSPY_TOOLS}/bin/py-spy").exists()]


def verdict_of(r) -> str:
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("hang: no progress for ")]
    assert len(lines) == 1, r.stdout[-3000:] + r.stderr[-3000:]
    return lines[0]


def stacks_of(tmp_path: Path) -> Path:
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir / "stacks"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's directory: the hang script and a requirements.txt without py-spy."""
    d = tmp_path / "project"
    d.mkdir()
    shutil.copy(REPO / "tests" / "launcher" / "hang_script.py", d / "hang_script.py")
    (d / "requirements.txt").write_text("torch\n")
    return d


def test_a_sync_job_whose_requirements_lack_py_spy_still_gets_the_stacks_and_the_verdict(c, tmp_path, project):
    lacking = lacking_tools(c)
    r = launch(
        tmp_path,
        "run",
        *src(c, tmp_path),
        *ONE,
        "--env",
        "HANG_RANK=1",
        "--sync",
        str(project),
        *HANG,
        "--",
        "hang_script.py",
        timeout=900,
    )
    assert r.returncode == 124, r.stdout[-3000:] + r.stderr[-3000:]
    line = verdict_of(r)
    m = re.search(
        r"node 1 \(([\d.]+)\) rank 1 is outside any collective at load_batch \(hang_script\.py:\d+\) "
        r"<- train_step \(hang_script\.py:\d+\); 1 rank waits in all_reduce",
        line,
    )
    assert m and m.group(1) == c.addresses[1], line
    stacks = stacks_of(tmp_path)
    assert line.endswith(f"stacks: {stacks}/")
    assert sorted(p.name for p in stacks.iterdir()) == ["node-0-rank-0.txt", "node-1-rank-1.txt"]
    assert "load_batch" in (stacks / "node-1-rank-1.txt").read_text()
    assert "all_reduce" in (stacks / "node-0-rank-0.txt").read_text()
    # The job's environment has no py-spy: each node built the tools environment, once.
    assert r.stderr.count(f"installing py-spy-{PYSPY_VERSION} (for hang stacks)") == len(lacking), r.stderr
    assert lacking_tools(c) == []
    key = EnvSpec("requirements.txt", {"requirements.txt": "torch\n"}, index_url=c.package_index).key
    for i in range(N):
        env = c.node_path(i, f"/root/.gpufleet/envs/{key}/bin")
        assert (env / "python").exists() and not (env / "py-spy").exists()
    c.assert_nothing_left()

    # The next launch finds it there: nothing is built. It goes down a tree (--fanout 1: node 0
    # passes node 1 its part), and so do the stacks: node 1 runs two parts signed for it.
    (tmp_path / "again").mkdir()
    seen = c.node_path(1, "/root/.gpufleet/tree/seen")
    before = set(seen.iterdir()) if seen.exists() else set()
    again = launch(
        tmp_path / "again",
        "run",
        *src(c, tmp_path / "again"),
        "--fanout",
        "1",
        *ONE,
        "--env",
        "HANG_RANK=1",
        "--sync",
        str(project),
        *HANG,
        "--",
        "hang_script.py",
        timeout=600,
    )
    assert again.returncode == 124 and "rank 1 is outside any collective" in verdict_of(again), again.stderr[-3000:]
    assert "installing py-spy" not in again.stderr and "building environment" not in again.stderr
    assert len(set(seen.iterdir()) - before) == 2, again.stderr[-3000:]
    assert "load_batch" in (stacks_of(tmp_path / "again") / "node-1-rank-1.txt").read_text()
    c.assert_nothing_left()


def test_a_detached_hang_on_bare_nodes_is_judged_by_the_controllers_shipped_launcher(c, tmp_path, project):
    """Node 0 has no gpufleet installed: its controller runs the copy of launcher/ the launch
    shipped, collects the stacks with the tools environment's py-spy and ends the job FAILED."""
    r = launch(
        tmp_path,
        "run",
        *src(c, tmp_path),
        "--detach",
        *ONE,
        "--env",
        "HANG_RANK=1",
        "--sync",
        str(project),
        *HANG,
        "--",
        "hang_script.py",
        check=True,
    )
    (line,) = r.stdout.splitlines()
    assert line.startswith("job "), r.stdout
    job_id = line.split()[1]
    done = wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=300)
    assert done["state"] == "FAILED" and done["reason"] == "hang" and done["exit"] == 124, done
    assert "node 1 (" in done["why"] and "rank 1 is outside any collective at load_batch" in done["why"], done
    assert done["failed_node"] == 1, done
    stacks = done["why"].rsplit("stacks: ", 1)[1].rstrip("/")
    assert sorted(p.name for p in c.node_path(0, stacks).glob("node-*-rank-*.txt")) == [
        "node-0-rank-0.txt",
        "node-1-rank-1.txt",
    ]
    c.assert_nothing_left()


# Rank 1 of the built-in training stalls in its data loading at step 2 (a sitecustomize on the
# workers' PYTHONPATH, on each node's own disk): every other rank waits for it in a collective.
_STALL = """
    import os
    if os.environ.get("RANK") == "1":
        import time
        from workloads import data
        _at = data.BatchStream.micro_batch_at
        def stuck_loading(self, step, micro):
            if step >= 2:
                time.sleep(3600)
            return _at(self, step, micro)
        data.BatchStream.micro_batch_at = stuck_loading
"""


def test_train_on_bare_nodes_names_the_stalled_rank_with_py_spy_from_its_own_environment(c, tmp_path):
    for i in range(N):
        site = c.node_path(i, "/root/stall-site")
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(textwrap.dedent(_STALL))
    r = launch(
        tmp_path,
        "train",
        *src(c, tmp_path),
        *ONE,
        "--env",
        "PYTHONPATH=/root/stall-site",
        "--hang-timeout",
        "5s",
        "--progress",
        r"step \d+/",
        *TRAIN,
        "--steps",
        "100",
        timeout=900,
    )
    assert r.returncode == 124, r.stdout[-3000:] + r.stderr[-3000:]
    line = verdict_of(r)
    m = re.search(
        r"node 1 \(([\d.]+)\) rank 1 is outside any collective at stuck_loading \(sitecustomize\.py:\d+\) "
        r"<- (Trainer\.)?_micro_step \(train\.py:\d+\); 1 rank waits in ",
        line,
    )
    assert m and m.group(1) == c.addresses[1], line
    stacks = stacks_of(tmp_path)
    assert sorted(p.name for p in stacks.iterdir()) == ["node-0-rank-0.txt", "node-1-rank-1.txt"]
    # gpufleet's workloads environment has py-spy itself (the one beside its python is used).
    assert "installing py-spy" not in r.stderr
    for i in range(N):
        assert any((e / "py-spy").exists() for e in c.node_path(i, "/root/.gpufleet/envs").glob("*/bin"))
    c.assert_nothing_left()
