"""`launch run --image` on bare simulated nodes: nodes with the system python only (no torch, no
venv, no checkout: tests/simcluster.py `bare=True`), each its own network and mount namespace
entered with `nsenter --net`, where podman (with runc) can run. The image brings torch; the job's
working directory is the node's own. The image is the tests' Python image, in the container store
the nodes share with this machine, as a pre-pulled image on a VM's disk."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.containers.runtime import containers_named, podman_env, python_image
from tests.support import LAUNCH, REPO, source_args

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("containers")]

DDP = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
passwd = open("/etc/passwd").read().strip()
os.write(1, f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g} passwd={passwd}\\n".encode())
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def conf():
    # Where a bare node can read it (its /tmp and the checkout are its own or hidden there).
    d = Path(tempfile.mkdtemp(prefix="gpufleet-containers-", dir="/var/tmp"))
    try:
        yield d, podman_env(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes(bare_cluster):
    return bare_cluster(2)


def test_ddp_over_gloo_runs_in_the_image_on_bare_nodes_that_have_no_torch(nodes, conf, tmp_path):
    _, env = conf
    image = python_image(env)
    for i in range(2):
        job = nodes.node_path(i, "/root/job")
        job.mkdir(parents=True, exist_ok=True)
        (job / "ddp.py").write_text(DDP)
    no_torch = nodes.exec(0, ["python3", "-c", "import torch"])
    assert no_torch.returncode != 0  # the node itself has none
    before = set(containers_named(env, "gpufleet-"))
    flags = [a for k, v in env.items() for a in ("--env", f"{k}={v}")]
    r = subprocess.run(
        [LAUNCH, "run", *source_args(nodes, tmp_path), "--image", image, *flags, "--env", "OMP_NUM_THREADS=1"]
        + ["--workdir", "/root/job", "--", "/root/job/ddp.py"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(re.findall(r"rank=\d world=\d sum=\S+ passwd=.*", r.stdout))
    assert lines == [f"rank={i} world=2 sum=3 passwd=root:x:0:0:root:/root:/bin/sh" for i in range(2)], r.stdout
    assert set(containers_named(env, "gpufleet-")) == before
    nodes.assert_nothing_left()
