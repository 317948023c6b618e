"""A run's start in a container vs the same run without one, the image already on the nodes.

    .venv/bin/python -m bench.bench_container [--repeats 5]

The run: `launch run --local --nodes 2` of a script that joins a gloo process group, all-reduces
one tensor and exits, once on this machine's venv (`--python`), once with `--image` (the Python
image the tests build from that same venv and torch: tests/containers/build_image.sh), pushed
to a local registry (Debian's docker-registry, standing in for Artifact Registry) and already
pulled, so each run's pull asks the registry for the manifest and fetches nothing. podman with
runc, as on this machine's kind (tests/containers/runtime.py). Each number is the wall time of
the whole `launch run` (checks, pull, rendezvous, the all-reduce, exit); the rounds alternate
which goes first. Target: with container <= 1.2 x without.
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

from tests.containers.runtime import Registry, podman_env, python_image

REPO = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "launcher"]
SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
print("sum", t.item(), flush=True)
"""


def _time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)
    dt = time.perf_counter() - t0
    if r.returncode != 0 or r.stdout.count("sum 2.0") != 2:
        raise RuntimeError(f"{' '.join(argv[:8])}... exited {r.returncode}: {r.stdout[-1000:]}{r.stderr[-2000:]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-container-") as d:
        root = Path(d)
        registry = Registry(root / "registry")
        try:
            env = podman_env(root / "conf", registry.address)
            t0 = time.perf_counter()
            ref = registry.push(env, python_image(env), "gpufleet/python:bench")
            print(f"image built (if absent) and pushed in {time.perf_counter() - t0:.1f} s", flush=True)
            script = root / "allreduce.py"
            script.write_text(SCRIPT)
            base = [*LAUNCH, "run", "--local", "--nodes", "2", "--workdir", str(root), "--runs-dir", str(root / "runs")]
            base += ["--env", "OMP_NUM_THREADS=1"]
            flags = [a for k, v in env.items() for a in ("--env", f"{k}={v}")]
            bare = [*base, "--python", sys.executable, "--", str(script)]
            boxed = [*base, "--image", ref, *flags, "--", str(script)]
            _time(boxed)  # the first pull, and warm caches on both sides
            _time(bare)
            times: dict[str, list[float]] = {"bare": [], "container": []}
            for i in range(args.repeats):
                order = [("bare", bare), ("container", boxed)]
                for name, argv in order if i % 2 == 0 else reversed(order):
                    times[name].append(_time(argv))
            subprocess.run(["podman", "rmi", "-f", ref], env={**os.environ, **env}, capture_output=True)
        finally:
            registry.stop()
    b, c = statistics.median(times["bare"]), statistics.median(times["container"])
    load = os.getloadavg()[0]
    print(f"without container: {b:.2f} s (runs {', '.join(f'{t:.2f}' for t in times['bare'])})")
    print(f"with container:    {c:.2f} s (runs {', '.join(f'{t:.2f}' for t in times['container'])})")
    print(f"ratio {c / b:.2f}x (target <= 1.2x); load average {load:.1f}")
    return 0 if c / b <= 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())
