"""Step time of N-D layouts against DDP on 4 CPU ranks (gloo), tiny model, fp32 (report).

TP2xDP2 (`--tp 2 --dp-shard 2`) and PP2xDP2 (`--pp 2 --dp-shard 2`, 1F1B) against DDP4, the same
global batch, the same command otherwise, each a real `torchrun ... -m workloads.train`. On a
CPU the model is far too small for TP or PP to pay: this measures their overhead (TP's per-layer
all-reduces, PP's bubbles and point-to-point sends, FSDP's gathers), which the ratios report.

Run: .venv/bin/python -m bench.bench_layouts [--model tiny] [--steps 20] [--repeats 2]
Rounds alternate between the layouts so machine noise hits all alike; per run, the median step
time after the first 5 steps (start-up, first all-gathers); the best run of each layout counts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["LAYOUTS", "step_time", "main"]

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "ddp4": [],
    "tp2xdp2": ["--tp", "2", "--dp-shard", "2"],
    "pp2xdp2": ["--pp", "2", "--dp-shard", "2"],
}
SKIP = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_time(model: str, steps: int, layout: list[str]) -> float:
    """Median seconds per step of one 4-rank run, after its first SKIP steps."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "4",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{_free_port()}",
            "-m",
            "workloads.train",
            *("--model", model, "--steps", str(steps), "--global-batch", "64", "--micro-batch", "8"),
            *("--straggler-every", "0", "--metrics-file", str(metrics), *layout),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode:
            raise SystemExit(f"{' '.join(layout) or 'ddp'} failed (exit {p.returncode}): {p.stderr[-2000:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        return statistics.median(r["step_s"] for r in rows if r["step"] > SKIP)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    best: dict[str, float] = {}
    for r in range(args.repeats):
        for name, layout in LAYOUTS.items():
            t = step_time(args.model, args.steps, layout)
            best[name] = min(best.get(name, float("inf")), t)
            print(f"round {r + 1}: {name:8s} {t * 1e3:8.1f} ms/step", flush=True)
    base = best["ddp4"]
    print(f"model {args.model}, 4 CPU ranks (gloo), global batch 64, best of {args.repeats}:")
    for name in LAYOUTS:
        print(f"  {name:8s} {best[name] * 1e3:8.1f} ms/step  = {best[name] / base:.2f}x DDP4")
    return 0


if __name__ == "__main__":
    sys.exit(main())
