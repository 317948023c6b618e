"""Hang detection (launcher.core.hang, launcher.core.stacks): how long from a job's last progress to the
verdict, against the timeout; and how long collecting every worker's stack takes on many nodes.

    .venv/bin/python -m bench.bench_hang [--timeouts 5,20] [--nodes 3] [--scale-nodes 16] [--repeats 3]

1. Verdict: on `--nodes` simulated nodes (netns sshd) x 2 ranks of real torchrun over gloo,
   `launch run --hang-timeout T -- tests/launcher/hang_script.py` (rank 2 sleeps in
   load_batch, the others wait in all_reduce). The clock starts at the last output line of the
   job (its progress) and stops at the verdict line `hang: ...`, both as the launch prints them
   (lines time-stamped as they arrive). Target: verdict <= T + 10 s. The detection and the
   collection are reported apart (the launch logs both).
2. Collection at scale: `--scale-nodes` simulated nodes x 2 ranks. Each node runs, through the
   run half of a real `Launch` (so the processes carry its GPUFLEET_RUN token), a process tree
   shaped like torchrun's: an agent without RANK and 2 children with RANK and LOCAL_RANK, each
   sleeping in a Python function. stdlib Python, not torch: 16 x 3 torch processes do not fit
   this shared machine's memory. Every rank is outside any collective, so every rank is also
   dumped with --native: the worst case. `launcher.core.stacks.collect` is timed as the launch calls
   it (`--repeats` times). Target: <= 10 s.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.simcluster import SimCluster

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python")
SCRIPT = "tests/launcher/hang_script.py"

_AGENT = """
import os, subprocess, sys
node = int(os.environ["GPUFLEET_NODE_RANK"])
env = [{**os.environ, "RANK": str(2 * node + i), "LOCAL_RANK": str(i)} for i in range(2)]
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env[i]) for i in range(2)]
for k in kids:
    k.wait()
"""
_WORKER = """
import time
def load_batch():
    time.sleep(3600)
def train_step():
    load_batch()
print("worker up", flush=True)
train_step()
"""


def verdict_run(nodes: int, timeout_s: float, work: Path) -> dict[str, float]:
    """One hung run: seconds from the last progress line to the detection, and to the verdict."""
    with SimCluster(nodes, mode="netns", workdir=work / f"sim-{timeout_s:g}") as c:
        argv = [
            PY, "-m", "launcher", "run", "--hostfile", str(c.hostfile), *c.launch_flags,
            "--runs-dir", str(work / "runs"), "--python", PY, "--workdir", str(REPO), "--nproc-per-node", "2",
            "--env", "OMP_NUM_THREADS=1", "--hang-timeout", f"{timeout_s:g}s", "--", SCRIPT,
        ]  # fmt: skip
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        last = detect = collected = done = None
        took = ""
        for line in p.stdout:
            now = time.monotonic()
            if line.startswith("[node ") and detect is None:
                last = now
            elif line.startswith("no progress for"):
                detect = now
            elif line.startswith("stacks of "):
                collected, took = now, line.strip()
            elif line.startswith("hang: no progress for"):
                done = now
                print(f"   {line.strip()}")
        rc = p.wait()
        if rc != 124 or None in (last, detect, done):
            raise RuntimeError(f"the hung run did not end in a verdict (exit {rc})")
        print(f"   {took}")
        return {"detect": detect - last, "collected": (collected or done) - last, "verdict": done - last}


def scale_run(nodes: int, repeats: int, work: Path) -> list[float]:
    """Seconds `collect` takes for every rank of `nodes` nodes x 2, `repeats` times."""
    from launcher.cli.options import build_config, find_cluster
    from launcher.core.env import flight_recorder_on
    from launcher.core.launch import Launch
    from launcher.core.stacks import collect
    from launcher.core.types import Workload
    from tests.support import workers

    with SimCluster(nodes, mode="netns", workdir=work / "sim-scale") as c:
        o = {"hostfile": c.hostfile, "runs_dir": work / "runs", "python": PY}
        flags = c.launch_flags
        o["ssh_key"] = Path(flags[flags.index("--ssh-key") + 1])
        o["ssh_options"] = tuple(flags[i + 1] for i, f in enumerate(flags) if f == "--ssh-option")
        cluster = find_cluster(o)
        config = build_config(o, Workload("exec", (PY, "-c", _AGENT, _WORKER)), cluster)
        launch = Launch(cluster, config)
        t = threading.Thread(target=launch.run, kwargs={"handle_signals": False}, daemon=True)
        t.start()
        deadline = time.monotonic() + 300
        while sum(len(workers(c, i)) for i in range(nodes)) < 2 * nodes:
            if time.monotonic() > deadline or not t.is_alive():
                raise RuntimeError("the workers did not start")
            time.sleep(0.5)
        times = []
        try:
            for _ in range(repeats):
                t0 = time.monotonic()
                hang = collect(cluster, config, launch.transport, 0.0, None, flight_recorder_on(cluster))
                times.append(time.monotonic() - t0)
                found = len(list(hang.stacks_dir.glob("node-*-rank-*.txt")))
                if found != 2 * nodes:
                    raise RuntimeError(f"{found} stacks, not {2 * nodes}: {hang.verdict}")
        finally:
            launch.request_stop()
            t.join(60)
        return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeouts", default="5,20", help="hang timeouts to measure, in seconds")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--scale-nodes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="   %(message)s")
    logging.getLogger("launcher").setLevel(logging.WARNING)  # the launch's own chatter
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-hang-") as d:
        work = Path(d)
        print(f"verdict after the last progress line, {args.nodes} nodes x 2 ranks (torchrun, gloo):")
        for timeout_s in (float(x) for x in args.timeouts.split(",")):
            r = verdict_run(args.nodes, timeout_s, work)
            met = r["verdict"] <= timeout_s + 10
            ok &= met
            verdict = f"verdict at {r['verdict']:.1f} s (target <= {timeout_s + 10:g} s: {'met' if met else 'MISSED'})"
            print(
                f"  --hang-timeout {timeout_s:g}s: detected at {r['detect']:.1f} s, "
                f"stacks in at {r['collected']:.1f} s, {verdict}"
            )
        print(f"stack collection, {args.scale_nodes} nodes x 2 ranks (every rank also dumped with --native):")
        logging.getLogger("launcher").setLevel(logging.INFO)
        times = scale_run(args.scale_nodes, args.repeats, work)
        met = statistics.median(times) <= 10
        ok &= met
        print(
            f"  collect: median {statistics.median(times):.2f} s, runs {', '.join(f'{t:.2f}' for t in times)} "
            f"(target <= 10 s: {'met' if met else 'MISSED'})"
        )
    print(f"load average: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
