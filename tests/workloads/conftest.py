"""Run workloads.train for real: torchrun with gloo on CPU, tiny models, few steps."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from filelock import FileLock

REPO = Path(__file__).resolve().parents[2]

# The reference run every equivalence test compares against: 2 ranks, micro 8 x 2 ranks x 4 accum.
REF_ARGS = [
    "--model",
    "tiny",
    "--global-batch",
    "64",
    "--micro-batch",
    "8",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "3",
    "--lr-decay-steps",
    "20",
    "--log-every",
    "1",
    "--straggler-every",
    "0",
]
REF_STEPS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # One thread per rank: the machine has 2 cores, and oversubscription makes CPU runs crawl.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env.update(extra or {})
    return env


def torchrun_cmd(args: list[str], nproc: int = 2, max_restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        "-m",
        "workloads.train",
        *args,
    ]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def train_cmd(args: list[str], nproc: int = 2, max_restarts: int = 0) -> list[str]:
    """torchrun with `nproc` ranks; nproc=0 means a plain `python -m workloads.train` (no agent,
    one rank: a start costs each process seconds of CPU importing torch)."""
    return [sys.executable, "-m", "workloads.train", *args] if nproc == 0 else torchrun_cmd(args, nproc, max_restarts)


def train(
    args: list[str], nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 240, max_restarts: int = 0
) -> Run:
    """Run training to completion (nproc as train_cmd's)."""
    cmd = train_cmd(args, nproc, max_restarts)
    p = subprocess.run(cmd, cwd=REPO, env=child_env(env), capture_output=True, text=True, timeout=timeout)
    return Run(p.returncode, p.stdout, p.stderr)


def start(
    args: list[str], nproc: int = 2, env: dict[str, str] | None = None, max_restarts: int = 0
) -> subprocess.Popen:
    """Start training (nproc as train_cmd's) in its own session, so a test can signal the whole tree."""
    return subprocess.Popen(
        train_cmd(args, nproc, max_restarts),
        cwd=REPO,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def workers(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's live worker processes, read from /proc."""
    found: dict[int, int] = {}
    for child in Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(child)
    return found


def wait_for(predicate, timeout: float = 60, interval: float = 0.005, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"run ended (rc {proc.returncode}) before the condition\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(interval)


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    lines = [ln for ln in metrics.read_text().splitlines() if ln.endswith("}")]
    return json.loads(lines[-1])["step"] if lines else 0


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (or the one plain process). The workers need their own
    kill: torchrun starts each in a new session (elastic subprocess_handler:
    start_new_session=True), outside its group."""
    if proc.poll() is None:
        try:
            pids = list(workers(proc.pid).values())
        except OSError:
            pids = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def one_line_exit_2(argv: list[str], env: dict[str, str] | None = None) -> str:
    """`python -m workloads.train ARGV` met in this process (no torch import per case): a
    usage error must be exit 2 with one line on stderr and nothing on stdout. Returns the line."""
    line, stdout = one_line_exit(argv, 2, env)
    assert stdout == "", stdout
    return line


def one_line_exit(argv: list[str], code: int, env: dict[str, str] | None = None) -> tuple[str, str]:
    """`python -m workloads.train ARGV` met in this process: exit `code` with one line on stderr.
    Returns the line and what went to stdout."""
    from workloads.train import main

    err, out = io.StringIO(), io.StringIO()
    term = signal.getsignal(signal.SIGTERM)  # main ignores SIGTERM once past parsing
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in (env or {}).items():
                mp.setenv(k, v)
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                rc = main(argv)
    finally:
        signal.signal(signal.SIGTERM, term)
    assert not torch.distributed.is_initialized()  # main left the process group it made
    assert rc == code, err.getvalue()
    assert err.getvalue().count("\n") == 1, err.getvalue()
    return err.getvalue().strip(), out.getvalue()


def params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert sorted(a) == sorted(b)
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, f"parameters differ by up to {worst:g} (allowed {atol:g})"


@pytest.fixture(scope="session")
def reference(tmp_path_factory, worker_id) -> dict[str, torch.Tensor]:
    """Final parameters of an uninterrupted 2-rank DDP run of REF_STEPS steps, run once for the
    whole session however many xdist workers use it: the first writes it under a lock in the
    base directory the workers share, the others read it (pytest-xdist's documented recipe,
    "Making session-scoped fixtures execute only once")."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    out = shared / "reference-params.pt"
    with FileLock(f"{out}.lock"):
        if not out.exists():
            part = shared / "reference-params.part.pt"
            run = train(REF_ARGS + ["--steps", str(REF_STEPS), "--save-params", str(part)])
            assert run.returncode == 0, run.stderr
            part.rename(out)
    return params(out)


@contextlib.contextmanager
def start_gcs_emulator(bucket: str, timeout: float = 30, host: str = "127.0.0.1", log: Path | None = None):
    """gcp-storage-emulator (in memory) on a free port of `host` with `bucket`; yields the value
    for STORAGE_EMULATOR_HOST. Used by the tests' fixture and bench/bench_checkpoint.py; a
    simulated cluster's nodes reach it on the cluster's gateway address. `log`: a file for its
    request log, one line per request (`"GET /download/storage/v1/b/BUCKET/o/NAME?alt=media
    HTTP/1.1" 200 -`), which bench/bench_spare_peer.py counts."""
    port = free_port()
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    argv = [str(exe), "start", "--host", host, "--port", str(port), "--in-memory", "--default-bucket", bucket]
    if log is None:
        proc = subprocess.Popen([*argv, "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        with open(log, "ab") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    try:

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex((host, port)) == 0

        wait_for(up, timeout=timeout, interval=0.05, proc=proc)
        yield f"http://{host}:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def gcs_emulator():
    """gcp-storage-emulator on a free local port with bucket `ckpt`; yields its env."""
    with start_gcs_emulator("ckpt", timeout=20) as host:
        yield {"STORAGE_EMULATOR_HOST": host}
