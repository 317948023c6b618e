"""What the node-local checkpoint tier costs training: `workloads.train --local-checkpoint-every 10`
against the same run without checkpoints (the anchor), both in this run, 2 CPU ranks over gloo.

The model is GPT-2 124M under DDP, fp32 weights and AdamW moments: 12 bytes per parameter, 1.49 GB
of state on every rank, each rank saving its own copy (gpufleet.local_tier's layout). A save blocks
the step while the state is copied off the device (here: a copy in host memory); the files, the
sha256 manifest and the pruning run in DCP's writer thread while training goes on.

Measured: the mean step time over the steps after the first (rank 0's metrics file, `step_s`),
each kind alternating with the other over `--rounds`; and the blocked time each save reports.
Target: mean step time with the local tier <= 1.03 x without.

Memory: per rank the weights, gradients, DDP's buckets, two AdamW moments and the staged copy of
the state, ~4.5 GB; 2 ranks ~9 GB.

Run: .venv/bin/python -m bench.bench_local_checkpoint [--model 124M] [--steps 31] [--every 10]
     [--rounds 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]

TARGET = 1.03
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: argparse.Namespace, local: Path | None, work: Path) -> tuple[list[float], list[float]]:
    """One training run; (step times after the first, blocked time of each local save)."""
    metrics = work / f"m-{os.getpid()}-{_free_port()}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "-m",
        "workloads.train",
        "--model",
        args.model,
        "--seq-len",
        "64",
        "--global-batch",
        "2",
        "--micro-batch",
        "1",
        "--steps",
        str(args.steps),
        "--log-every",
        "1",
        "--straggler-every",
        "0",
        "--metrics-file",
        str(metrics),
    ]
    if local is not None:
        cmd += ["--local-checkpoint-every", str(args.every), "--local-checkpoint-dir", str(local)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPUFLEET_JOB_ID": "bench"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"training failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    blocked = [float(x) for x in re.findall(r"training blocked ([\d.]+) s", p.stdout)]
    return [s["step_s"] for s in steps if s["step"] > 1], blocked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="124M")
    ap.add_argument("--steps", type=int, default=31)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    times: dict[str, list[float]] = {"none": [], "local": []}
    blocked: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        local = work / "local"
        local.mkdir(mode=0o700)
        for r in range(args.rounds):
            for kind in ("none", "local") if r % 2 == 0 else ("local", "none"):
                steps, saves = _run(args, local if kind == "local" else None, work)
                times[kind] += steps
                blocked += saves
                print(f"round {r + 1} {kind}: mean step {statistics.mean(steps):.3f} s", flush=True)
    none, with_local = statistics.mean(times["none"]), statistics.mean(times["local"])
    ratio = with_local / none
    print(f"model {args.model}, 2 ranks (gloo, CPU), a local save every {args.every} steps, {args.rounds} rounds")
    print(f"no checkpoints (anchor): mean step {none:.3f} s")
    print(f"local tier:              mean step {with_local:.3f} s")
    if blocked:
        mean, worst = statistics.mean(blocked), max(blocked)
        print(f"blocked per save: mean {mean:.3f} s, max {worst:.3f} s ({len(blocked)} saves)")
        # The part of the cost that is the save's own wait, apart from the background writer's
        # and hasher's share of the CPU (which a GPU node's spare cores absorb).
        print(f"blocked share of the steps: {mean / (args.every * none):.3f}")
    met = "met" if ratio <= TARGET else "MISSED"
    print(f"ratio local/none: {ratio:.3f} (target <= {TARGET}: {met})")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
