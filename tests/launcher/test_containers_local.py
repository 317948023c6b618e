"""`--image` for real: podman (with runc and the project's containers.conf), the Python image the
tests build from this machine's venv, and Debian's docker-registry standing in for Artifact
Registry. The nodes are `--local` ones (process groups here, sharing this machine's network),
so torchrun's gloo rendezvous crosses containers on the host network as it would across VMs.

Each test asserts what a container changes: the ranks ran inside the image (its /etc/passwd,
not this machine's), a Ctrl-C reaches the ranks inside (their STOP_REPORT lines) and leaves no
container, a pull happens once and not again, and a missing image is one line per node."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.containers.runtime import Registry, containers_named, podman_env, python_image, tiny_image
from tests.support import IMAGE_DDP, LAUNCH, REPO, Launch, env_flags

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("containers")]


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    root = tmp_path_factory.mktemp("containers")
    registry = Registry(root / "registry")
    env = podman_env(root / "conf", registry.address)
    try:
        yield {"env": env, "image": python_image(env), "registry": registry, "root": root}
    finally:
        registry.stop()


def _run(box, tmp_path: Path, *extra: str, image: str | None = None) -> list[str]:
    script = tmp_path / "ddp.py"
    script.write_text(IMAGE_DDP)
    return [
        "run",
        "--local",
        "--nodes",
        "2",
        "--image",
        image or box["image"],
        *env_flags(box["env"]),
        "--env",
        "OMP_NUM_THREADS=1",
        "--workdir",
        str(tmp_path),
        "--runs-dir",
        str(tmp_path / "runs"),
        *extra,
        "--",
        str(script),
    ]


def test_run_trains_ddp_over_gloo_inside_the_image_and_leaves_no_container(box, tmp_path):
    before = set(containers_named(box["env"], "gpufleet-"))
    r = subprocess.run([LAUNCH, *_run(box, tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(re.findall(r"rank=\d world=\d sum=\S+ passwd=.*", r.stdout))
    # Inside the image: its one-line /etc/passwd, not this machine's.
    assert lines == [f"rank={i} world=2 sum=3 passwd=root:x:0:0:root:/root:/bin/sh" for i in range(2)], r.stdout
    # Built here, in no registry: each node uses its own copy, and says so.
    assert r.stderr.count(f"using its own copy of {box['image']}, unchecked:") == 2, r.stderr
    assert set(containers_named(box["env"], "gpufleet-")) == before


def test_ctrl_c_reaches_the_ranks_inside_and_leaves_no_container(box, tmp_path):
    before = set(containers_named(box["env"], "gpufleet-"))
    launch = Launch(_run(box, tmp_path, "--env", "FOREVER=1", "--term-grace", "10s"), tmp_path / "out")
    try:
        launch.wait_for_text("tick rank=0", timeout=240)
        launch.wait_for_text("tick rank=1", timeout=60)
        running = set(containers_named(box["env"], "gpufleet-")) - before
        assert len(running) == 2, running  # one per node, named after the run token
        launch.signal(signal.SIGINT)
        assert launch.wait(timeout=120) == 130, launch.out
    finally:
        launch.kill()
    out = launch.out
    for rank in (0, 1):
        assert re.search(rf"gpufleet-stop: rank {rank} \(pid \d+\) exited by itself after SIGTERM", out), out
    assert set(containers_named(box["env"], "gpufleet-")) == before
    tokens = [p for p in os.listdir("/proc") if p.isdigit() and _has(p, b"FOREVER=1")]
    assert tokens == [], "ranks left behind"


def _has(pid: str, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def test_a_pull_fetches_once_then_not_again_and_a_missing_image_is_one_line_per_node(box, tmp_path):
    env, reg = box["env"], box["registry"]
    local = tiny_image(env, "localhost/gpufleet-tiny:pull", "from-the-registry")
    ref = reg.push(env, local, "gpufleet/tiny:1")
    subprocess.run(["podman", "rmi", "-f", local, ref], env={**os.environ, **env}, capture_output=True)
    base = ["exec", "--local", "--nodes", "2", *env_flags(env), "--runs-dir", str(tmp_path / "runs")]

    first = subprocess.run([LAUNCH, *base, "--image", ref, "--", "cat", "/marker"], capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(re.findall(r"\[node (\d)\] from-the-registry", first.stdout)) == ["0", "1"], first.stdout
    assert f"{ref}: pulled on node" in first.stderr, first.stderr

    again = subprocess.run([LAUNCH, *base, "--image", ref, "--", "cat", "/marker"], capture_output=True, text=True)
    assert again.returncode == 0 and f"{ref}: already current on every node" in again.stderr, again.stderr

    missing = f"{reg.address}/gpufleet/nope:1"
    bad = subprocess.run([LAUNCH, *base, "--image", missing, "--", "cat", "/marker"], capture_output=True, text=True)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    for rank in (0, 1):
        (line,) = [ln for ln in errors if ln.startswith(f"error: node {rank} (localhost): cannot pull {missing}:")]
        assert "manifest unknown" in line  # the registry's own reason
    assert "2 of 2 nodes cannot pull" in errors[-1] and "nothing was started" in errors[-1]
    assert "[node" not in bad.stdout
    subprocess.run(["podman", "rmi", "-f", ref], env={**os.environ, **env}, capture_output=True)


def test_a_hang_inside_the_container_is_named_from_py_spy_stacks_of_the_ranks_inside(box, tmp_path):
    """py-spy on the node reaches the ranks inside (--pid host): the sleeping rank is named."""
    script = tmp_path / "hang.py"
    script.write_text((REPO / "tests" / "launcher" / "hang_script.py").read_text())
    venv_bin = str(REPO / ".venv" / "bin")  # where this machine's py-spy is (the nodes' PATH)
    args = [
        "run",
        "--local",
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        "--image",
        box["image"],
        *env_flags(box["env"]),
        "--env",
        f"PATH={venv_bin}",
        "--env",
        "OMP_NUM_THREADS=1",
        "--workdir",
        str(tmp_path),
        "--runs-dir",
        str(tmp_path / "runs"),
        # Long enough for torch's import inside on this loaded 2-core machine (the clock starts
        # at the launch's start, before any line).
        "--hang-timeout",
        "45s",
        "--",
        str(script),
    ]
    before = set(containers_named(box["env"], "gpufleet-"))
    r = subprocess.run([LAUNCH, *args], capture_output=True, text=True, cwd=REPO, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 124, out
    (line,) = [x for x in out.splitlines() if x.startswith("hang: no progress for ")]
    assert "rank 2" in line and "3 ranks wait in all_reduce" in line, line
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "load_batch" in (run_dir / "stacks" / "node-1-rank-2.txt").read_text()
    assert set(containers_named(box["env"], "gpufleet-")) == before
