"""A stack's default for detached jobs on bare hosts: the controller runs on a controller host
that is as bare as the nodes (tests/simcluster.py, `bare=True`: the system python3 only, a home
of its own). gpufleet ships the controller its launcher code and the nodes the --sync snapshot;
the controller's relaunch runs the same snapshot in the same directory. The hosts are the
session's shared bare cluster (tests/conftest.py `bare_nodes`): nodes 0 and 1, and node 2 as the
controller host (a hostfile's `controller HOST` line is all that makes a host one)."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from tests.launcher.test_jobs_cluster import launch
from tests.support import BARE_GROUP, LAUNCH_POLL_S, hostfile_of, source_args, wait_for

pytestmark = [pytest.mark.cluster, BARE_GROUP, pytest.mark.timeout(600)]

FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}

# Fails the first time it runs on a node, leaving a mark in the job's directory; the job's
# relaunch finds the mark there (attempts of one job share its directory) and succeeds.
SCRIPT = textwrap.dedent(
    """\
    import os, sys
    print(f"code {os.environ['GPUFLEET_CODE']} cwd {os.getcwd()}", flush=True)
    if not os.path.exists("tried"):
        open("tried", "w").close()
        sys.exit(3)
    print("second attempt ok", flush=True)
    """
)


def test_a_detached_job_controlled_from_a_bare_controller_host_relaunches_the_same_snapshot(bare_nodes, tmp_path):
    c = bare_nodes
    src = source_args(c, tmp_path, hostfile_of(c, tmp_path, 2, controller=2))
    project = tmp_path / "project"
    project.mkdir()
    (project / "job.py").write_text(SCRIPT)
    args = ["--sync", str(project), "--recover", "--max-restarts", "3", "--", "python3", "job.py"]
    (line,) = launch(tmp_path, "exec", *src, "--detach", *args, check=True).stdout.splitlines()
    job_id = line.split()[1]
    done: dict = {}

    def ended() -> bool:
        listed = launch(tmp_path, "jobs", *src, "--json", check=True).stdout.splitlines()
        (found,) = [j for j in map(json.loads, listed) if j["id"] == job_id]
        done.update(found)
        return found["state"] in FINAL

    wait_for(ended, 300, f"job {job_id} to end", interval=LAUNCH_POLL_S)
    out = launch(tmp_path, "logs", *src, job_id, check=True).stdout
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, (done, out)
    assert done["recoveries"], done  # the first attempt failed, and the controller relaunched it
    runs = set(re.findall(r"\[node (\d)\] code (\w+) cwd (\S+)", out))
    assert {n for n, *_ in runs} == {"0", "1"}, out
    assert len({(code, cwd) for _, code, cwd in runs}) == 1, out  # one snapshot, one directory
    # The attempt that succeeded ran on both nodes. A node whose run was stopped before its script
    # left the mark (the other node failed first) fails once more in the next attempt, so the job
    # may take more than one relaunch.
    last = out.rsplit("relaunched after", 1)[1]
    assert "[node 0] second attempt ok" in last and "[node 1] second attempt ok" in last, out
    # The controller's record and code live on the controller host, not on node 0.
    assert c.node_path(2, f"/root/.gpufleet/jobs/{job_id}/state.json").exists()
    assert not c.node_path(0, f"/root/.gpufleet/jobs/{job_id}").exists()
    c.assert_nothing_left()
