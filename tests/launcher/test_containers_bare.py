"""`launch run --image` on bare simulated nodes: nodes with the system python only (no torch, no
venv, no checkout: tests/simcluster.py `bare=True`), each its own network and mount namespace
entered with `nsenter --net`, where podman (with runc) can run. The image brings torch; the job's
working directory is the node's own. The image is the tests' Python image, in the container store
the nodes share with this machine, as a pre-pulled image on a VM's disk."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.containers.runtime import containers_named, podman_env, python_image
from tests.support import BARE_GROUP, IMAGE_DDP, LAUNCH, REPO, env_flags, source_args

pytestmark = [pytest.mark.cluster, BARE_GROUP]


@pytest.fixture(scope="module")
def conf():
    # Where a bare node can read it (its /tmp and the checkout are its own or hidden there).
    d = Path(tempfile.mkdtemp(prefix="gpufleet-containers-", dir="/var/tmp"))
    try:
        yield d, podman_env(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def nodes(bare_nodes):
    return bare_nodes


N = 2  # of the shared cluster's BARE_NODES: two ranks show what a container changes


def _hostfile(nodes, tmp_path: Path) -> Path:
    """The first N nodes of the shared cluster, in a hostfile of this test's own."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{a}\n" for a in nodes.addresses[:N]))
    return hostfile


def _job_dir(nodes, tmp_path: Path, name: str, text: str) -> str:
    """A directory of this test's own on every node (the cluster is shared) holding `name`."""
    d = f"/root/{tmp_path.name}"
    for i in range(N):
        job = nodes.node_path(i, d)
        job.mkdir(parents=True, exist_ok=True)
        (job / name).write_text(text)
    return d


def test_ddp_over_gloo_runs_in_the_image_on_bare_nodes_that_have_no_torch(nodes, conf, tmp_path):
    _, env = conf
    image = python_image(env)
    job = _job_dir(nodes, tmp_path, "ddp.py", IMAGE_DDP)
    no_torch = nodes.exec(0, ["python3", "-c", "import torch"])
    assert no_torch.returncode != 0  # the node itself has none
    before = set(containers_named(env, "gpufleet-"))
    r = subprocess.run(
        [
            LAUNCH,
            "run",
            *source_args(nodes, tmp_path, _hostfile(nodes, tmp_path)),
            "--image",
            image,
            *env_flags(env),
            "--env",
            "OMP_NUM_THREADS=1",
        ]
        + ["--workdir", job, "--", f"{job}/ddp.py"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(re.findall(r"rank=\d world=\d sum=\S+ passwd=.*", r.stdout))
    want = [f"rank={i} world={N} sum={N * (N + 1) // 2} passwd=root:x:0:0:root:/root:/bin/sh" for i in range(N)]
    assert lines == want, r.stdout
    assert set(containers_named(env, "gpufleet-")) == before
    nodes.assert_nothing_left()


STEPS = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
attempt = os.environ["GPUFLEET_ATTEMPT"]
for step in range(int(os.environ.get("STEPS", "40"))):
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        os.write(1, f"step {step} attempt {attempt} world {t.item():g}\\n".encode())
    time.sleep(0.3)
dist.destroy_process_group()
"""


def test_a_detached_job_in_the_image_comes_back_after_a_node_is_lost(nodes, conf, tmp_path):
    """--detach --recover with --image: node 1 lost (its VM gone, and its container with it), the
    controller on node 0 relaunches in the image once it is back; no container is left."""
    from tests.launcher.test_jobs_cluster import launch, wait_state

    _, env = conf
    image = python_image(env)
    job = _job_dir(nodes, tmp_path, "steps.py", STEPS)
    r = launch(
        tmp_path,
        "run",
        *source_args(nodes, tmp_path, _hostfile(nodes, tmp_path)),
        "--detach",
        "--image",
        image,
        *env_flags(env),
        "--env",
        "OMP_NUM_THREADS=1",
        "--workdir",
        job,
        "--recover",
        "--recover-timeout",
        "3m",
        "--",
        f"{job}/steps.py",
        check=True,
    )
    (line,) = r.stdout.splitlines()
    job_id = line.split()[1]
    logs = lambda: launch(tmp_path, "logs", *source_args(nodes, tmp_path), job_id).stdout  # noqa: E731
    deadline = time.monotonic() + 300
    while "step 3 attempt 0" not in logs():
        assert time.monotonic() < deadline, logs()
        time.sleep(1)
    # The VM goes away: its sessions and sshd, and (as on a real VM) its container.
    nodes.power_off(1)
    subprocess.run(["podman", "rm", "-f", f"gpufleet-{job_id}-1"], env={**os.environ, **env})
    wait_state(nodes, tmp_path, job_id, {"RECOVERING"}, timeout=60)
    nodes.restart_sshd(1)
    done = wait_state(nodes, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=400)
    assert done["state"] == "SUCCEEDED", done
    (rec,) = done["recoveries"]
    assert rec["node"] == 1 and rec["reason"] == "node-lost", rec
    out = logs()
    assert f"step 39 attempt 1 world {N}" in out, out
    assert containers_named(env, f"gpufleet-{job_id}") == []


def test_launch_train_runs_in_a_stock_torch_image_with_gpufleets_code_sent_to_the_nodes(nodes, conf, tmp_path):
    """The default stack on COS: an image with torch and numpy but none of gpufleet (as NVIDIA's
    PyTorch image), nodes without torch. The launcher sends gpufleet's code and mounts it
    read-only in the container, so `launch train` with nothing else trains."""
    from launcher.code.snapshot import code_snapshot
    from tests.support import TRAIN

    _, env = conf
    image = python_image(env)
    gone = subprocess.run(
        ["podman", "run", "--rm", image, "python3", "-c", "import workloads"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert gone.returncode != 0 and "No module named 'workloads'" in gone.stderr  # the image has none
    # A working directory of the test's own: the test image's interpreter lives under this
    # machine's /root, which the default one (the node's home, /root) would hide in the container.
    job = _job_dir(nodes, tmp_path, "README", "train here\n")
    before = set(containers_named(env, "gpufleet-"))
    r = subprocess.run(
        [
            LAUNCH,
            "train",
            *source_args(nodes, tmp_path, _hostfile(nodes, tmp_path)),
            "--image",
            image,
            *env_flags(env),
            "--workdir",
            job,
            "--nproc-per-node",
            "1",
            "--env",
            "OMP_NUM_THREADS=1",
            *TRAIN,
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"step 2/2\b", r.stdout), r.stdout
    snap = code_snapshot().hash
    for i in range(N):
        assert nodes.node_path(i, f"/root/.gpufleet/snap/{snap}/workloads/train.py").is_file()
    assert set(containers_named(env, "gpufleet-")) == before
    nodes.assert_nothing_left()
