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

`--case own`: the same for a user's own script (examples/ddp_snapshot.py, a plain DDP loop with a
snapshot in the job's working directory) under `launch run --detach --recover`: node 1 is lost
(SimCluster.power_off) once a snapshot exists; 2 s later its sshd starts again and the clock
starts when it listens; it stops at the script's first output line of attempt 1 in node 0's
record. Against: an attached `launch run` of the same script, from its start to its first output
line (then Ctrl-C). Target: the same 1.2x.

    .venv/bin/python -m bench.bench_recover --case own [--nodes 3] [--repeats 3]
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
EXAMPLE = REPO / "examples" / "ddp_snapshot.py"
EXAMPLE_ARGS = ["--epochs", "100000", "--save-every", "1", "--epoch-seconds", "0.2"]
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


def _first_line_of_attempt_1(text: str) -> bool:
    return "attempt 1 (restart reason " in text


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

    def recovery(self, ckpt: Path, rank: int = 1, away_s: float = 2.0, job_host: Path | None = None) -> float:
        """A detached `train --recover`; once step 5 is saved, node `rank` is preempted and its
        sshd back `away_s` after the job turned RECOVERING. The time from its return to the first
        step after the resume, read from the job host's record (`job_host`: its HOME; node 0's
        by default)."""
        argv = ["train", *self.flags, *self.torch, "--detach", "--recover", "--", *TRAIN, *self.batch]
        job = self.launch(*argv, "--checkpoint-dir", str(ckpt)).split()[1]
        jobdir = (job_host or self.work / "home0") / ".gpufleet" / "jobs" / job
        self.wait(lambda: _step_saved(ckpt, 5), 120, "step 5 saved", interval=0.05)
        self.c.preempt(rank)
        state = jobdir / "state.json"
        self.wait(lambda: json.loads(state.read_text())["state"] == "RECOVERING", 60, "RECOVERING", interval=0.05)
        time.sleep(away_s)
        self.c.restart_sshd(rank)  # returns once its sshd accepts connections
        t0 = time.perf_counter()
        log = jobdir / "output.log"
        self.wait(lambda: _first_step_after_resume(log.read_text()), 180, "the first step after the resume")
        dt = time.perf_counter() - t0
        self.launch("stop", *self.flags, job)
        self.c.assert_nothing_left(within=60)
        return dt

    def own_recovery(self, wd: Path) -> float:
        wd.mkdir()
        out = self.launch("run", *self.flags, *self.own(wd), "--detach", "--recover", "--", str(EXAMPLE), *EXAMPLE_ARGS)
        job = out.split()[1]
        jobdir = self.work / "home0" / ".gpufleet" / "jobs" / job
        self.wait(lambda: (wd / "snapshot.pt").exists(), 120, "a snapshot", interval=0.05)
        self.c.power_off(1)
        state = jobdir / "state.json"
        self.wait(lambda: json.loads(state.read_text())["state"] == "RECOVERING", 60, "RECOVERING", interval=0.05)
        time.sleep(2)
        self.c.restart_sshd(1)
        t0 = time.perf_counter()
        log = jobdir / "output.log"
        self.wait(lambda: _first_line_of_attempt_1(log.read_text()), 120, "the script's first line of attempt 1")
        dt = time.perf_counter() - t0
        self.launch("stop", *self.flags, job)
        self.c.assert_nothing_left(within=60)
        return dt

    def attached_own(self, wd: Path) -> float:
        wd.mkdir()
        argv = [*LAUNCH, "run", *self.flags, *self.own(wd), "--", str(EXAMPLE), *EXAMPLE_ARGS]
        return self._until_line(argv, lambda seen: "attempt 0 (restart reason -)" in seen)

    def own(self, wd: Path) -> list[str]:
        return ["--python", PY, "--workdir", str(wd), "--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1"]

    def _until_line(self, argv: list[str], seen_enough) -> float:
        """Start `argv` (an attached launch), the time until its output satisfies `seen_enough`,
        then Ctrl-C and wait for every node to be clean."""
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env, cwd=REPO)
        seen = ""
        try:
            for line in p.stdout:
                seen += line
                if seen_enough(seen):
                    dt = time.perf_counter() - t0
                    break
            else:
                raise RuntimeError(f"the attached launch ended (rc {p.wait()}) too early:\n{seen[-2000:]}")
            p.send_signal(signal.SIGINT)
            p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        self.c.assert_nothing_left(within=60)
        return dt

    def attached_resume(self, ckpt: Path) -> float:
        argv = [*LAUNCH, "train", *self.flags, *self.torch, "--", *TRAIN, *self.batch]
        return self._until_line([*argv, "--checkpoint-dir", str(ckpt), "--resume"], _first_step_after_resume)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--case", choices=("train", "own"), default="train", help="the built-in workload, or a user's script"
    )
    a = p.parse_args()
    if a.case == "own":
        return compare(
            a,
            "own",
            lambda b, work, k: (b.own_recovery(work / f"wd{k}"), b.attached_own(work / f"attached{k}")),
            "own-script recovery (node 1's sshd back -> the script's first line of attempt 1)",
            "attached `launch run` (start -> its first line)",
        )
    return compare(
        a,
        "train",
        lambda b, work, k: (b.recovery(work / f"ckpt{k}"), b.attached_resume(work / f"ckpt{k}")),
        "recovery (node 1's sshd back -> first step after the resume)",
        "attached `launch train --resume` (start -> first step)",
    )


def compare(a: argparse.Namespace, case: str, one_repeat, measured: str, anchor: str) -> int:
    """`one_repeat(bench, workdir, k)` -> (recovery s, anchor s), a.repeats times on one cluster;
    the medians' ratio against the 1.2x target."""
    work = Path(tempfile.mkdtemp(prefix=f"gpufleet-bench-recover-{case}-"))
    homes = {i: {"HOME": str(work / f"home{i}")} for i in range(a.nodes)}
    recover, attached = [], []
    with SimCluster(a.nodes, mode="netns", node_env=homes) as c:
        b = Bench(c, work)
        for k in range(a.repeats):
            r, s = one_repeat(b, work, k)  # in this order: the recovery's checkpoint is the resume's
            recover.append(r)
            attached.append(s)
            print(f"repeat {k + 1}: recovery {r:.2f} s, attached {s:.2f} s", file=sys.stderr)
    r, s = statistics.median(recover), statistics.median(attached)
    print(f"simulated cluster: {a.nodes} sshd nodes (netns); medians of {a.repeats} runs")
    print(f"{measured} {r:.2f} s vs {anchor} {s:.2f} s: {r / s:.2f}x (target <= 1.2x)")
    if r > 1.2 * s:
        print("bench_recover: target missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
