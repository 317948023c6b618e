"""Warm restarts: a relaunch of `workloads.train --compile` reaching its first step with the
compile caches of the previous launch, against a cold launch (empty caches, the anchor), both in
this run, on CPU.

The caches are where `launch` puts them on a node (launcher.core.node_start.local_dir):
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in the node's per-account local directory, keyed by
the job's environment, so a relaunch in the same environment finds them. Each round makes a new
empty directory (cold), then launches again on it (warm). Measured: the wall time from starting
the process to its first step line (`step 1/...`), which includes Python's start and torch's
import in both.

Target: warm <= 0.5 x cold (mean over the rounds).

Run: .venv/bin/python -m bench.bench_warm_compile [--model small-test] [--rounds 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

TARGET = 0.5
REPO = Path(__file__).resolve().parents[1]


def _first_step_s(model: str, cache: Path) -> float:
    """Seconds from the start of `python -m workloads.train --compile` to its first step line."""
    cmd = [sys.executable, "-m", "workloads.train", "--compile", "--model", model, "--steps", "2"]
    cmd += ["--global-batch", "4", "--micro-batch", "4", "--log-every", "1", "--straggler-every", "0"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    started = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    at = None
    for line in p.stdout:
        if at is None and line.startswith("step 1/"):
            at = time.perf_counter() - started
    err = p.stderr.read() if p.stderr else ""
    if p.wait() != 0 or at is None:
        raise SystemExit(f"training failed (rc {p.returncode}): {err.strip().splitlines()[-1:]}")
    return at


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-test")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    cold, warm = [], []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            cold.append(_first_step_s(args.model, Path(tmp)))
            warm.append(_first_step_s(args.model, Path(tmp)))
        print(f"round {r + 1}: cold {cold[-1]:.2f} s, warm {warm[-1]:.2f} s", flush=True)
    ratio = statistics.mean(warm) / statistics.mean(cold)
    print(f"model {args.model}, --compile on CPU, first step after the process starts, {args.rounds} rounds")
    print(f"cold (empty caches, anchor): {statistics.mean(cold):.2f} s")
    print(f"warm (the last launch's caches): {statistics.mean(warm):.2f} s")
    print(f"ratio warm/cold: {ratio:.3f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'MISSED'})")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
