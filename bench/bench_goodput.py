"""Goodput of a run with one injected node loss: do the figures `launch jobs --json` reports
(queued, starting, productive, lost, recovering) add up to the job's wall time within 1%?

    .venv/bin/python -m bench.bench_goodput [--nodes 2] [--steps 400]

A detached `launch train --recover` (a log line every step, a checkpoint every 20) on simulated
nodes (netns; each with a HOME of its own, the client with another). Once step 40 is saved and
1 s more has run, node 1 is powered off (SimCluster.power_off: its sshd and every process on it
die at once, no save), and 3 s later it boots again (same host key); the job recovers and runs
to the end.

The anchor is this bench's own clock, not the record's: it watches node 0's jobs directory every
10 ms from before the launch, so it sees the record appear (the job's submission) and turn final
(its end). The nodes share this machine's clock, so the two are comparable. Target: the sum of
the figures is within 1% of that wall time. Also shown: how long the node was off, against the
recovering figure (which adds the detection before and the checks and restart after).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_recover import LAUNCH, REPO, Bench
from tests.simcluster import SimCluster

FINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _train(steps: int) -> list[str]:
    return [
        *("--model", "tiny", "--seq-len", "32", "--micro-batch", "1", "--straggler-every", "0"),
        *("--steps", str(steps), "--log-every", "1", "--checkpoint-every", "20"),
    ]


def _saved(ckpt: Path, at_least: int) -> bool:
    try:
        return int((ckpt / "latest").read_text().strip().split("_")[1]) >= at_least
    except (OSError, IndexError, ValueError):
        return False


def _state(path: Path) -> str | None:
    try:
        return json.loads(path.read_text())["state"]
    except (OSError, ValueError, KeyError):
        return None  # not there yet (a rename is atomic: never half a file)


def run(b: Bench, work: Path, steps: int) -> dict:
    """One run with a node loss: the bench's own times and the job's `launch jobs --json` entry."""
    jobs_dir = work / "home0" / ".gpufleet" / "jobs"
    ckpt = work / "ckpt"
    argv = [*LAUNCH, "train", *b.flags, *b.torch, "--detach", "--recover", "--", *_train(steps), *b.batch]
    proc = subprocess.Popen(
        [*argv, "--checkpoint-dir", str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=b.env,
        cwd=REPO,
    )
    found: list[Path] = []

    def appeared() -> bool:
        found[:] = list(jobs_dir.glob("*/state.json"))
        return bool(found)

    b.wait(appeared, 120, "the job's record")
    t_submitted = time.time()
    out, _ = proc.communicate(timeout=120)
    job_id = out.split()[1]
    state = jobs_dir / job_id / "state.json"
    b.wait(lambda: _saved(ckpt, 40), 300, "step 40 saved", interval=0.05)
    time.sleep(1.0)  # work past the checkpoint, which the loss throws away
    if _state(state) in FINAL:
        raise RuntimeError("the run ended before the node loss: give it more --steps")
    b.c.power_off(1)
    t_off = time.time()
    b.wait(lambda: _state(state) == "RECOVERING", 120, "RECOVERING", interval=0.05)
    time.sleep(max(0.0, t_off + 3.0 - time.time()))
    b.c.restart_sshd(1)
    t_back = time.time()
    b.wait(lambda: _state(state) in FINAL, 900, "the job's end")
    t_end = time.time()
    listing = [json.loads(line) for line in b.launch("jobs", *b.flags, "--json").splitlines()]
    (entry,) = [j for j in listing if j["id"] == job_id]
    b.c.assert_nothing_left(within=60)
    return {"entry": entry, "wall_s": t_end - t_submitted, "off_s": t_back - t_off}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-goodput-"))
    homes = {i: {"HOME": str(work / f"home{i}")} for i in range(a.nodes)}
    with SimCluster(a.nodes, mode="netns", node_env=homes) as c:
        r = run(Bench(c, work), work, a.steps)
    job, g = r["entry"], r["entry"]["goodput"]
    total = sum(g["seconds"].values())
    error = abs(total - r["wall_s"]) / r["wall_s"]
    print(f"simulated cluster: {a.nodes} sshd nodes (netns); {a.steps} steps, node 1 off for {r['off_s']:.1f} s")
    print(f"job {job['id']}: {job['state']}, {len(job['recoveries'])} recovery")
    for k, v in g["seconds"].items():
        print(f"  {k:<11} {v:8.2f} s  {100 * v / g['wall_s']:5.1f}% of wall")
    print(
        f"goodput {g['goodput_pct']:.1f}% of {g['run_s']:.2f} s on the nodes; {g['node_hours']:.4f} node-h; "
        f"cost {g['cost_usd']}"
    )
    print(
        f"figures add up to {total:.2f} s; the record's wall {g['wall_s']:.2f} s; the bench's clock "
        f"(record appeared -> final) {r['wall_s']:.2f} s: {100 * error:.2f}% apart (target <= 1%)"
    )
    ok = job["state"] == "SUCCEEDED" and len(job["recoveries"]) == 1 and error <= 0.01
    ok = ok and g["seconds"]["recovering"] > 0 and g["seconds"]["productive"] > 0
    if not ok:
        print("bench_goodput: target missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
