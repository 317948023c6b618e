"""A stack's default for detached jobs on bare hosts: the controller runs on a controller host
that is as bare as the nodes (tests/simcluster.py, `bare=True, controller=True`: the system
python3 only, a home of its own). gpufleet ships the controller its launcher code and the nodes
the --sync snapshot; the controller's relaunch runs the same snapshot in the same directory."""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.launcher.test_jobs_cluster import detach, launch, wait_state
from tests.support import source_args

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("bare_cluster"), pytest.mark.timeout(600)]

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


def test_a_detached_job_controlled_from_a_bare_controller_host_relaunches_the_same_snapshot(bare_cluster, tmp_path):
    c = bare_cluster(2, controller=True)
    project = tmp_path / "project"
    project.mkdir()
    (project / "job.py").write_text(SCRIPT)
    job_id = detach(
        c,
        tmp_path,
        "exec",
        "--sync",
        str(project),
        "--recover",
        "--max-restarts",
        "3",
        "--",
        "python3",
        "job.py",
    )
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=300)
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, (done, out)
    assert done["recoveries"], done  # the first attempt failed, and the controller relaunched it
    runs = set(re.findall(r"\[node (\d)\] code (\w+) cwd (\S+)", out))
    assert {n for n, *_ in runs} == {"0", "1"}, out
    assert len({(code, cwd) for _, code, cwd in runs}) == 1, out  # one snapshot, one directory
    assert out.count("second attempt ok") == 2, out
    # The controller's record and code live on the controller host, not on node 0.
    assert c.node_path(2, f"/root/.gpufleet/jobs/{job_id}/state.json").exists()
    assert not c.node_path(0, f"/root/.gpufleet/jobs/{job_id}").exists()
    c.assert_nothing_left()
