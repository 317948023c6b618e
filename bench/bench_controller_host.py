"""No node is special: with the jobs' controller on a host that is not a node, losing node 0 (the
rendezvous master) is recovered as fast as losing any other node. On 3 simulated nodes and a 4th
namespace as the controller host (netns; each with a HOME of its own, the client with another).

    .venv/bin/python -m bench.bench_controller_host [--nodes 3] [--repeats 3]

Each repeat, for node 0 and then for the last node: a detached `launch train --recover`
(checkpoint every 5 steps, a log line every step); once step 5 is saved, the node is preempted
(SimCluster.preempt), its sshd starts again 10 s later (same host key) and the clock starts when it
listens. The clock stops when the controller host's record of the job's output shows the first
step line after `resumed from`; then the job is stopped. Target: node 0's time <= 1.2 x the last
node's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_recover import TRAIN, Bench, _first_step_after_resume, _step_saved
from tests.simcluster import SimCluster


def lost_for_10_s(b: Bench, ckpt: Path, rank: int, controller_home: Path) -> float:
    out = b.launch(
        "train", *b.flags, *b.torch, "--detach", "--recover", "--", *TRAIN, *b.batch, "--checkpoint-dir", str(ckpt)
    )
    job = out.split()[1]
    jobdir = controller_home / ".gpufleet" / "jobs" / job
    b.wait(lambda: _step_saved(ckpt, 5), 120, "step 5 saved", interval=0.05)
    b.c.preempt(rank)
    state = jobdir / "state.json"
    b.wait(lambda: json.loads(state.read_text())["state"] == "RECOVERING", 60, "RECOVERING", interval=0.05)
    time.sleep(10)
    b.c.restart_sshd(rank)  # returns once its sshd accepts connections
    t0 = time.perf_counter()
    log = jobdir / "output.log"
    b.wait(lambda: _first_step_after_resume(log.read_text()), 180, "the first step after the resume")
    dt = time.perf_counter() - t0
    b.launch("stop", *b.flags, job)
    b.c.assert_nothing_left(within=60)
    return dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-ctlhost-"))
    homes = {i: {"HOME": str(work / f"home{i}")} for i in range(a.nodes + 1)}
    node0, last = [], []
    with SimCluster(a.nodes, mode="netns", node_env=homes, controller=True) as c:
        b = Bench(c, work)
        b.batch = ["--global-batch", str(a.nodes)]
        home = work / f"home{a.nodes}"
        for k in range(a.repeats):
            node0.append(lost_for_10_s(b, work / f"ckpt{k}-0", 0, home))
            last.append(lost_for_10_s(b, work / f"ckpt{k}-last", a.nodes - 1, home))
            print(f"repeat {k + 1}: node 0 {node0[-1]:.2f} s, node {a.nodes - 1} {last[-1]:.2f} s", file=sys.stderr)
    r, s = statistics.median(node0), statistics.median(last)
    print(f"simulated cluster: {a.nodes} sshd nodes and a controller host (netns); medians of {a.repeats} runs")
    print(
        f"node 0 lost for 10 s (its sshd back -> first step after the resume) {r:.2f} s vs node {a.nodes - 1} "
        f"{s:.2f} s: {r / s:.2f}x (target <= 1.2x)"
    )
    if r > 1.2 * s:
        print("bench_controller_host: target missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
