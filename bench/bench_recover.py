"""Recovery without a person: how long a --recover job takes from the lost node
answering SSH again to its first training step after the resume, against an attached
`launch train --resume` from its start to its first step, same checkpoint, same run, on 3
simulated nodes (netns; each node with a HOME of its own, the client with another).

    .venv/bin/python -m bench.bench_recover [--nodes 3] [--repeats 3]

Each repeat: a detached `launch train --recover` (checkpoint every 5 steps, a log line every step);
once step 5 is saved, node 1 is preempted (SimCluster.preempt: its workers get SIGTERM and save,
then its sshd and every process on it die); 2 s later its sshd starts again (same host key) and
the clock starts when it listens. The clock stops when node 0's record of the job's output shows
the first step line after `resumed from`. Then the job is stopped, and an attached
`launch train --resume` on the same checkpoint is timed from its start to its first step line
(then Ctrl-C). Target: recovery <= 1.2 x the attached resume.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    "--checkpoint-every",
    "5",
]


def _first_step_after_resume(text: str) -> bool:
    at = text.find("resumed from")
    return at >= 0 and "] step " in text[at:]


def _step_saved(ckpt: Path, at_least: int) -> bool:
    try:
        return int((ckpt / "latest").read_text().strip().split("_")[1]) >= at_least
    except (OSError, IndexError, ValueError):
        return False


class Bench:
    def __init__(self, c: SimCluster, work: Path):
        self.c = c
        self.work = work
        self.env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_STATE_DIR"}
        self.env["HOME"] = str(work / "client")
        (work / "client").mkdir(exist_ok=True)
        self.flags = ["--hostfile", str(c.hostfile), *c.launch_flags, "--runs-dir", str(work / "runs")]
        self.torch = ["--python", PY, "--workdir", str(REPO), "--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1"]
        self.batch = ["--global-batch", str(len(c.nodes))]

    def launch(self, *args: str) -> str:
        r = subprocess.run([*LAUNCH, *args], capture_output=True, text=True, env=self.env, cwd=REPO, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"launch {' '.join(args[:2])} exited {r.returncode}: {r.stderr[-2000:]}")
        return r.stdout

    def wait(self, pred, timeout: float, what: str, interval: float = 0.01) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(interval)

    def recovery(self, ckpt: Path) -> float:
        out = self.launch(
            "train",
            *self.flags,
            *self.torch,
            "--detach",
            "--recover",
            "--",
            *TRAIN,
            *self.batch,
            "--checkpoint-dir",
            str(ckpt),
        )
        job = out.split()[1]
        jobdir = self.work / "home0" / ".gpufleet" / "jobs" / job
        self.wait(lambda: _step_saved(ckpt, 5), 120, "step 5 saved", interval=0.05)
        self.c.preempt(1)
        state = jobdir / "state.json"
        self.wait(lambda: json.loads(state.read_text())["state"] == "RECOVERING", 60, "RECOVERING", interval=0.05)
        time.sleep(2)
        self.c.restart_sshd(1)  # returns once node 1's sshd accepts connections
        t0 = time.perf_counter()
        log = jobdir / "output.log"
        self.wait(lambda: _first_step_after_resume(log.read_text()), 120, "the first step after the resume")
        dt = time.perf_counter() - t0
        self.launch("stop", *self.flags, job)
        self.c.assert_nothing_left(within=60)
        return dt

    def attached_resume(self, ckpt: Path) -> float:
        t0 = time.perf_counter()
        p = subprocess.Popen(
            [
                *LAUNCH,
                "train",
                *self.flags,
                *self.torch,
                "--",
                *TRAIN,
                *self.batch,
                "--checkpoint-dir",
                str(ckpt),
                "--resume",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=REPO,
        )
        seen = ""
        try:
            for line in p.stdout:
                seen += line
                if _first_step_after_resume(seen):
                    dt = time.perf_counter() - t0
                    break
            else:
                raise RuntimeError(f"the attached launch ended (rc {p.wait()}) before training:\n{seen[-2000:]}")
            p.send_signal(signal.SIGINT)
            p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        self.c.assert_nothing_left(within=60)
        return dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-recover-"))
    homes = {i: {"HOME": str(work / f"home{i}")} for i in range(a.nodes)}
    recover, attached = [], []
    with SimCluster(a.nodes, mode="netns", node_env=homes) as c:
        b = Bench(c, work)
        for k in range(a.repeats):
            ckpt = work / f"ckpt{k}"
            recover.append(b.recovery(ckpt))
            attached.append(b.attached_resume(ckpt))
            print(
                f"repeat {k + 1}: recovery {recover[-1]:.2f} s, attached --resume {attached[-1]:.2f} s", file=sys.stderr
            )
    r, s = statistics.median(recover), statistics.median(attached)
    print(f"simulated cluster: {a.nodes} sshd nodes (netns); medians of {a.repeats} runs")
    print(
        f"recovery (node 1's sshd back -> first step after the resume) {r:.2f} s vs attached `launch train "
        f"--resume` (start -> first step) {s:.2f} s: {r / s:.2f}x (target <= 1.2x)"
    )
    if r > 1.2 * s:
        print("bench_recover: target missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
