"""The pre-start verdict in a detached job's controller: core renders the GPU and NIC questions
into every node's program from the request, on the launching machine and on node 0 alike, and
launcher.health judges the answers, which each launch is given as its `verdict` (a check whose
nodes answered without one raises). A detached `launch run` on simulated a3-highgpu-8g nodes
(tests/launcher/fake_gpu_node.py: fake nvidia-smi, real veth GPU NICs), each with a HOME of its
own, so the job's record and controller live on node 0 as on a real cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher.fake_gpu_node import GpuSimCluster
from tests.launcher.test_jobs_cluster import launch, wait_state
from tests.support import require_netns

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("prestart_detached")]


def test_a_detached_jobs_controller_judges_the_gpus_it_asked_about_and_runs(tmp_path):
    require_netns("the simulated GPU cluster needs netns mode (root and ip netns)")
    homes = {i: {"HOME": str(tmp_path / f"home{i}")} for i in range(2)}
    gc = GpuSimCluster(tmp_path / "gpu", ["/clu/blk1/s1/h01", "/clu/blk1/s1/h02"], env=homes)
    try:
        script = tmp_path / "hello.py"
        script.write_text("import os\nprint('ran on node', os.environ['GROUP_RANK'], flush=True)\n")
        args = [a for a in gc.args(tmp_path) if a not in ("--min-free-gb", "0.01")]
        r = launch(tmp_path, "run", *args, "--nproc-per-node", "1", "--detach", "--", str(script), check=True)
        job_id = r.stdout.split()[1]
        # The controller's own launch asked every node about its GPUs and NICs again (its check is
        # the same program) and judged the answers: without its verdict it would have failed.
        end = wait_state(gc.sim, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=180)
        assert end["state"] == "SUCCEEDED", end
        log = (Path(homes[0]["HOME"]) / ".gpufleet" / "jobs" / job_id / "output.log").read_text()
        assert "ran on node 0" in log and "ran on node 1" in log, log
        gc.sim.assert_nothing_left(within=30)
    finally:
        gc.close()
