"""Driving `launch` against the simulated cluster the way a user does: the installed console
script in its own process (so it can be signalled), output captured to a file as it streams."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.faults import SLOW_STEPS
from tests.launcher.fake_gpu_node import SYSTEM_PATH
from tests.simcluster import SimCluster, _environ, netns_available

__all__ = [
    "require_root",
    "REPO",
    "PY",
    "LAUNCH",
    "TRAIN",
    "Launch",
    "source_args",
    "torch_args",
    "workers",
    "wait_for",
    "params",
    "checkpoint_step",
    "wait_saved",
    "named_step",
    "train_job",
    "sigkill",
    "site_dir",
    "slow_steps",
    "BARE_NODES",
    "BARE_GROUP",
    "BARE_FAKE_BIN",
    "BARE_READY_MARKER",
    "BARE_NODE_ENV",
    "hostfile_of",
    "IMAGE_DDP",
    "env_flags",
]

REPO = Path(__file__).resolve().parents[1]

PY = str(REPO / ".venv" / "bin" / "python")
LAUNCH = str(REPO / ".venv" / "bin" / "launch")

# The bare-node modules share one cluster (tests/conftest.py `bare_nodes`) of BARE_NODES nodes,
# on one xdist worker: each such module (or test) carries BARE_GROUP in its pytestmark.
BARE_NODES = 3
BARE_GROUP = pytest.mark.xdist_group("bare_nodes")
# Every shared bare node's sessions look for nvidia-smi first in BARE_FAKE_BIN, on the node's own
# disk, and read the ready marker at BARE_READY_MARKER there (the health script's
# GPUFLEET_READY_MARKER): what `launch doctor` and `launch top` need of a node. Neither exists
# unless a test puts it there, and that test removes it again (the cluster is shared).
BARE_FAKE_BIN = "/root/fake-gpu-bin"
BARE_READY_MARKER = "/root/ready.json"
BARE_NODE_ENV = {"PATH": f"{BARE_FAKE_BIN}:{SYSTEM_PATH}", "GPUFLEET_READY_MARKER": BARE_READY_MARKER}

# A plain DDP script for the --image tests: one all-reduce over gloo, then the rank's line with
# the /etc/passwd it sees (the image's, not this machine's); with FOREVER set it then ticks until
# stopped (for Ctrl-C and stop).
IMAGE_DDP = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
passwd = open("/etc/passwd").read().strip()
os.write(1, f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g} passwd={passwd}\\n".encode())
dist.destroy_process_group()
if os.environ.get("FOREVER"):
    while True:
        os.write(1, f"tick rank={os.environ['RANK']}\\n".encode())
        time.sleep(0.5)
"""


def env_flags(env: dict[str, str]) -> list[str]:
    """`--env K=V` for each variable (e.g. podman's configuration for the ranks' container)."""
    return [a for k, v in env.items() for a in ("--env", f"{k}={v}")]


# The tiny model, one sample per rank per step, no straggler exchange: a step costs ~20 ms on
# this 2-core machine, so a test's time goes to starting torchrun, not to training.
TRAIN = [
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--micro-batch",
    "1",
    "--straggler-every",
    "0",
    "--lr-decay-steps",
    "1000",
]


def hostfile_of(c: SimCluster, tmp_path: Path, n: int, controller: int | None = None) -> Path:
    """A hostfile of a test's own naming the cluster's first `n` nodes, and node `controller` on
    a `controller HOST` line (a host the jobs' controllers run on: a node's sshd, namespace and
    disk are all a controller host has): how a test uses part of a shared cluster."""
    lines = [f"{a}\n" for a in c.addresses[:n]]
    if controller is not None:
        lines.append(f"controller {c.addresses[controller]}\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(lines))
    return hostfile


def source_args(c: SimCluster, tmp_path: Path, hostfile: Path | None = None) -> list[str]:
    """The nodes (a hostfile), how to reach them, and where the run's logs go."""
    return ["--hostfile", str(hostfile or c.hostfile), *c.launch_flags, "--runs-dir", str(tmp_path / "runs")]


def torch_args(nproc: int = 1) -> list[str]:
    # The nodes share this machine's filesystem: their python is this repository's venv. One
    # thread per worker: several workers share 2 cores.
    return ["--python", PY, "--workdir", str(REPO), "--nproc-per-node", str(nproc), "--env", "OMP_NUM_THREADS=1"]


class Launch:
    """`launch ARGS` running in the background; stdout and stderr together in `out`."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        self._fh = open(log, "w")
        self.proc = subprocess.Popen([LAUNCH, *args], stdout=self._fh, stderr=subprocess.STDOUT, cwd=REPO, text=True)

    @property
    def out(self) -> str:
        return self.log.read_text()

    def wait_for_text(self, text: str, timeout: float = 120, count: int = 1) -> None:
        wait_for(lambda: self.out.count(text) >= count, timeout, f"{text!r} in the output", self)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._fh.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._fh.close()


# How often a test polls through `launch` (`launch jobs`, `launch logs`): each poll is a Python
# start of the CLI and an ssh session to node 0, about 0.4 s of CPU in all, and the suite is
# CPU-bound on 2 cores; once a second is plenty for a job's state.
LAUNCH_POLL_S = 1.0


def wait_for(pred, timeout: float, what: str, launch: Launch | None = None, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if launch is not None and launch.proc.poll() is not None:
            if pred():
                return
            raise AssertionError(f"launch ended (rc {launch.proc.returncode}) before {what}:\n{launch.out}")
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{launch.out}" if launch else ""))


def workers(c: SimCluster, i: int) -> dict[int, int]:
    """{global rank: pid} of the torchrun workers running on node i (they carry RANK=)."""
    found = {}
    for pid in c.processes(i):
        env = _environ(pid).split(b"\0")
        if any(v.startswith(b"LOCAL_RANK=") for v in env):
            for v in env:
                if v.startswith(b"RANK="):
                    found[int(v[5:])] = pid
    return found


def params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def checkpoint_step(ckpt: Path) -> int:
    """The step of the checkpoint `latest` names, loaded in full (so a torn file would fail)."""
    from workloads.checkpoint.store import CheckpointError, load_checkpoint

    # While training runs, the checkpoint `latest` named a moment ago may be pruned by the next
    # save before it is read: read `latest` again then (a torn checkpoint still fails).
    for _ in range(5):
        name = (ckpt / "latest").read_text().strip()
        try:
            return load_checkpoint(ckpt / name)["step"]
        except CheckpointError:
            if (ckpt / "latest").read_text().strip() == name:
                raise
    return load_checkpoint(ckpt / (ckpt / "latest").read_text().strip())["step"]


def named_step(ckpt: Path) -> int:
    """The step in the name `latest` holds ("step_00000010"), -1 while there is none: cheap to
    poll, where loading the checkpoint costs ~0.2 s of CPU."""
    try:
        return int((ckpt / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError):
        return -1


def wait_saved(ckpt: Path, step: int, launch: Launch | None = None) -> None:
    """Until the checkpoint `latest` names is at `step` or later and loads in full (a hang fails
    after 120 s)."""

    def saved() -> bool:
        return named_step(ckpt) >= step and checkpoint_step(ckpt) >= step

    wait_for(saved, 120, f"step {step} saved", launch)


def train_job(batch: int, steps: int, ckpt: Path, every: int, log_every: int | None = None) -> list[str]:
    """The workload's arguments for a recovery test: the tiny model, `batch` samples a step,
    a checkpoint every `every` steps in `ckpt` (and a log line every `log_every` steps)."""
    logs = ["--log-every", str(log_every)] if log_every is not None else []
    saves = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every)]
    return [*TRAIN, "--global-batch", str(batch), "--steps", str(steps), *logs, *saves]


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def site_dir(tmp_path: Path, code: str) -> Path:
    """A directory whose sitecustomize.py runs `code` at interpreter start-up: on PYTHONPATH, it
    reaches every rank (test-only fault injection from outside the product)."""
    import textwrap

    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(code))
    return site


def slow_steps(tmp_path: Path, code: str = "") -> list[str]:
    """`--env` that makes each training step SLOW_STEP_S longer, asleep (tests/faults.py), after
    running `code` (more fault injection): 100 steps outlast a node lost after step 20 without
    the CPU of 300."""
    return ["--env", f"PYTHONPATH={site_dir(tmp_path, code + SLOW_STEPS)}"]


def require_root(why: str) -> None:
    """Skip a test that needs root where this run is not root (a developer's run as a user);
    under CI (.ci/run runs as root) not being root is a broken setup: fail."""
    _needed(os.geteuid() == 0, why, "CI must run as root")


def require_netns(why: str) -> None:
    """Skip a test that needs root and `ip netns` where the machine has neither (a developer's
    run as a user); under CI (.ci/run runs as root) their absence is a broken machine: fail."""
    _needed(netns_available(), why, "CI must run as root with iproute2 (make sysdeps)")


def _needed(present: bool, why: str, ci_fix: str) -> None:
    """Nothing when `present`; else a skip on a developer's run, a failure naming `ci_fix` under
    CI, where a missing root or tool is a broken machine, never a reason to run less."""
    if present:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{why}; {ci_fix}")
    pytest.skip(why)
