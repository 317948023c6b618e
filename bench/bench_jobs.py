"""Detached jobs: what `--detach`, `launch jobs` and `launch logs` cost, each against its
anchor in the same run, on 16 simulated nodes (netns; each node with a HOME of its own, the client
with another).

    .venv/bin/python -m bench.bench_jobs [--nodes 16] [--repeats 3]

- detach: `launch train --detach` until it has printed `job ID` and exited, against the same
  `launch train` attached until it has started training (node 0 logs step 1). Target: detach <=
  1.2 x attached. Also shown: the attached launch until every node has been told to go (its
  `started on N nodes` line), the least it takes before any training can start.
- jobs / logs: `launch jobs` and `launch logs ID` (the whole stream of a finished 16-node job)
  against `ssh node0 cat` of the same files over the same open connection (ControlPath).
  Target: <= 1.5 x the cat. Both pay one session over the open connection; the launcher also pays
  its own interpreter start (python, click, rich), measured here as `launch --version` (floor).

All connections are kept open across the runs (one ControlPath directory), after one warm-up
round that is not counted, so every number is a warm one.
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

from tests.simcluster import SimCluster

REPO = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "launcher"]
PY = str(REPO / ".venv" / "bin" / "python")
TRAIN = [
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--micro-batch",
    "1",
    "--straggler-every",
    "0",
    "--steps",
    "100000",
    "--log-every",
    "1",
    "--global-batch",
    "16",
]


class Bench:
    def __init__(self, c: SimCluster, work: Path):
        self.c = c
        self.work = work
        self.ctl = Path(tempfile.mkdtemp(prefix="gfj-", dir="/tmp"))
        self.env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_STATE_DIR"}
        self.env["HOME"] = str(work / "client")
        (work / "client").mkdir(exist_ok=True)
        self.flags = [
            "--hostfile",
            str(c.hostfile),
            *c.launch_flags,
            "--ssh-option",
            f"ControlPath={self.ctl}/%C",
            "--runs-dir",
            str(work / "runs"),
        ]
        self.torch = ["--python", PY, "--workdir", str(REPO), "--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1"]

    def run(self, *args: str) -> tuple[float, str]:
        t0 = time.perf_counter()
        r = subprocess.run([*LAUNCH, *args], capture_output=True, text=True, env=self.env, cwd=REPO, timeout=600)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"launch {' '.join(args[:2])} exited {r.returncode}: {r.stderr[-2000:]}")
        return dt, r.stdout

    def detached(self) -> float:
        dt, out = self.run("train", *self.flags, *self.torch, "--detach", "--", *TRAIN)
        job = out.split()[1]
        self.run("stop", *self.flags, job)
        self.c.assert_nothing_left(within=60)
        return dt

    def attached(self) -> tuple[float, float]:
        """(until every node is told to go, until the first training step is logged)."""
        t0 = time.perf_counter()
        p = subprocess.Popen(
            [*LAUNCH, "train", *self.flags, *self.torch, "--", *TRAIN],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=REPO,
        )
        go = None
        try:
            for line in p.stdout:
                if "started on" in line:
                    go = time.perf_counter() - t0
                if "] step 1/" in line:  # rank 0 logs, on node 0
                    step = time.perf_counter() - t0
                    break
            else:
                raise RuntimeError(f"the attached launch ended (rc {p.wait()}) before training")
            p.send_signal(2)
            p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        self.c.assert_nothing_left(within=60)
        return go or step, step

    def cat(self, files: str) -> float:
        argv = [
            "ssh",
            *self.c.ssh_options,
            "-o",
            f"ControlPath={self.ctl}/%C",
            "-o",
            "ControlMaster=auto",
            "-o",
            "ControlPersist=10m",
            "-T",
            self.c.nodes[0].address,
            f"cat {files}",
        ]
        t0 = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, timeout=60)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"ssh cat {files}: {r.stderr[-500:]!r}")
        return dt


def _median(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-jobs-"))
    homes = {i: {"HOME": str(work / f"home{i}")} for i in range(a.nodes)}
    with SimCluster(a.nodes, mode="netns", node_env=homes) as c:
        b = Bench(c, work)
        b.detached(), b.attached()  # warm-up: the cluster key, the open connections
        detach = _median(b.detached, a.repeats)
        starts = [b.attached() for _ in range(a.repeats)]
        attach_go = statistics.median(go for go, _ in starts)
        attach = statistics.median(step for _, step in starts)
        lines = "for i in $(seq 1 500); do echo \"line $i of node $GPUFLEET_NODE_RANK\"; done"
        _, out = b.run("exec", *b.flags, "--detach", "--", "sh", "-c", lines)
        job = out.split()[1]
        b.run("logs", *b.flags, job, "-f")
        d = f"{work}/home0/.gpufleet/jobs"
        logs = _median(lambda: b.run("logs", *b.flags, job)[0], a.repeats * 2)
        cat_logs = _median(lambda: b.cat(f"{d}/{job}/output.log"), a.repeats * 2)
        jobs = _median(lambda: b.run("jobs", *b.flags)[0], a.repeats * 2)
        cat_jobs = _median(lambda: b.cat(f"{d}/*/state.json"), a.repeats * 2)
        floor = _median(lambda: b.run("--version")[0], a.repeats * 2)
    print(
        f"simulated cluster: {a.nodes} sshd nodes (netns); medians of {a.repeats} (detach) / "
        f"{a.repeats * 2} (jobs, logs) runs, warm connections"
    )
    print(
        f"detach {detach:.2f} s vs attached until training (first step) {attach:.2f} s: {detach / attach:.2f}x "
        "(target <= 1.2x)"
    )
    print(f"  and vs attached until every node is told to go {attach_go:.2f} s: {detach / attach_go:.2f}x")
    print(f"logs {logs:.3f} s vs ssh cat {cat_logs:.3f} s: {logs / cat_logs:.2f}x (target <= 1.5x)")
    print(f"jobs {jobs:.3f} s vs ssh cat {cat_jobs:.3f} s: {jobs / cat_jobs:.2f}x (target <= 1.5x)")
    print(f"floor: `launch --version` {floor:.3f} s (the launcher's interpreter start, paid by jobs and logs)")
    missed = [
        name
        for name, ok in (
            ("detach", detach <= 1.2 * attach),
            ("logs", logs <= 1.5 * cat_logs),
            ("jobs", jobs <= 1.5 * cat_jobs),
        )
        if not ok
    ]
    if missed:
        print(f"bench_jobs: target missed ({', '.join(missed)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
