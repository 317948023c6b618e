"""Bad-node finder: how long `launch nccl-tests --find-bad-nodes` takes to name a slow node.

    .venv/bin/python -m bench.bench_badnodes [--nodes 4,16] [--rate 40mbit] [--pair-budget 1]

For each cluster size: a simulated cluster of real sshd nodes in network namespaces
(tests/simcluster.py), one node's link throttled both ways with `tc` (token bucket) to --rate,
about 100x below the others; then the installed `launch nccl-tests --find-bad-nodes` with the
sweep's own defaults (all_reduce, 32 MiB, -n 20, -w 1, -c 1), as a user types it. At 40 Mbit/s one
32 MiB all_reduce between the slow node and another takes about 7 s, so timing every pair fully
(-w + 2 x (1 + -n + -c) = 45 calls per pair) took more than 8 minutes at 4 nodes.

A run passes when the finder exits 1 with `--exclude <the throttled node>` and nothing else,
within the target: 120 s at 4 nodes, 240 s at 16. Printed per size: the
time, the target, their ratio (<= 1 passes) and the timed calls of the pairs the budget cut
(the slow node's pairs: 1 of 20). Exit 1 on a miss.
This machine is shared: a loaded machine slows the launch (torch imports on every node) most.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.simcluster import SimCluster, netns_available
from tests.support import LAUNCH, REPO, torch_args

TARGET_S = {4: 120.0, 16: 240.0}  # a person waits minutes for a name, not an hour


def bench(n: int, rate: str, budget: float | None, extra: list[str]) -> tuple[float, bool, str]:
    """(seconds, named the throttled node and only it, the finder's output)."""
    with SimCluster(n, mode="netns") as c:
        slow = n // 2
        c.throttle(slow, rate)
        runs = Path(tempfile.mkdtemp(prefix="gpufleet-bench-badnodes-"))
        argv = [
            LAUNCH,
            "nccl-tests",
            "--hostfile",
            str(c.hostfile),
            *c.launch_flags,
            "--runs-dir",
            str(runs),
            *torch_args(),
            "--find-bad-nodes",
            *extra,
        ]
        if budget is not None:
            argv += ["--pair-budget", str(budget)]
        env = dict(os.environ, GPUFLEET_STATE_DIR=str(runs / "state"))
        t0 = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
        dt = time.perf_counter() - t0
        out = r.stdout + r.stderr
        excluded = re.findall(r"^--exclude (\S+)$", r.stdout, re.M)
        ok = r.returncode == 1 and excluded == [c.nodes[slow].address]
        return dt, ok, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_badnodes", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="4,16", help="cluster sizes, comma list (targets: 4 and 16)")
    p.add_argument("--rate", default="40mbit", help="the slow node's link rate (tc tbf)")
    p.add_argument("--pair-budget", type=float, default=None, help="passed on; default: the finder's")
    p.add_argument("sweep", nargs="*", help="more `launch nccl-tests` flags, after --")
    a = p.parse_args(argv)
    if not netns_available():
        print("bench_badnodes: needs root with `ip netns` (the throttle is tc on a namespace's link)", file=sys.stderr)
        return 1
    missed = []
    print(f"{'nodes':>5} {'seconds':>8} {'target s':>9} {'ratio':>6}  named  pairs cut by the budget (timed calls)")
    for n in [int(x) for x in a.nodes.split(",")]:
        dt, ok, out = bench(n, a.rate, a.pair_budget, a.sweep)
        target = TARGET_S.get(n, 240.0)
        cut = re.findall(r"\((\d+) of \d+ timed calls fit", out)
        cut = [f"{k} x{cut.count(k)}" for k in sorted(set(cut), key=int)]
        print(
            f"{n:>5} {dt:>8.1f} {target:>9.0f} {dt / target:>6.2f}  {'yes' if ok else 'NO':>5}  "
            f"{', '.join(cut) or '-'}",
            flush=True,
        )
        if not ok:
            print(out[-3000:], file=sys.stderr)
            missed.append(f"{n} nodes: the throttled node was not named")
        elif dt > target:
            missed.append(f"{n} nodes: {dt:.0f} s > {target:.0f} s")
    if missed:
        print(f"bench_badnodes: target missed ({'; '.join(missed)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
