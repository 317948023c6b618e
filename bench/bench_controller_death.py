"""The controller can die: a detached job's controller killed mid-run is started again by the next
`launch jobs`, which re-adopts the job without losing a training step. On 2 simulated nodes and a
3rd namespace as the controller host (netns; each with a HOME of its own, the client with another).

    .venv/bin/python -m bench.bench_controller_death [--nodes 2] [--repeats 3] [--dead-s 3]

Each repeat: a detached `launch train` (a log line every step); once node 0's own copy of the
output shows step 20, the controller is killed with SIGKILL; `--dead-s` later, `launch jobs` (the
user's next look at the job) starts it again. Measured:
- re-adoption: from the new controller's start to every node streaming to it again (the record's
  `adoptions[-1].attached_s`, the controller's own clock), against one poll interval: the time one
  `launch jobs` takes on the same cluster (what a user, or a script polling the job, waits for
  each look), measured in the same run just before. Target: <= 1x;
- steps lost: every step from 1 to the last one logged must be in the job's log exactly once
  (target 0 lost, 0 twice); and the steps the workers made while no controller was there.
Then the job is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_recover import Bench
from tests.simcluster import SimCluster
from tests.support import TRAIN

_STEP = re.compile(r"\bstep (\d+)/\d+ \|")


def _steps(text: str) -> list[int]:
    return [int(m.group(1)) for m in _STEP.finditer(text)]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def one_death(b: Bench, controller_home: Path, dead_s: float) -> dict[str, float]:
    out = b.launch(
        "train", *b.flags, *b.torch, "--detach", "--", *TRAIN, *b.batch, "--steps", "100000", "--log-every", "1"
    )
    job = out.split()[1]
    jobdir = controller_home / ".gpufleet" / "jobs" / job
    node_out = b.work / "home0" / ".gpufleet" / "node-runs" / job / "0.0" / "out"
    b.wait(lambda: max(_steps(_read(node_out)), default=0) >= 20, 180, "step 20", interval=0.05)
    t = time.perf_counter()
    b.launch("jobs", *b.flags)  # the anchor: one poll of the job, with its controller alive
    poll_s = time.perf_counter() - t
    record = json.loads((jobdir / "state.json").read_text())
    os.kill(record["pid"], signal.SIGKILL)
    at_kill = max(_steps(_read(node_out)))
    time.sleep(dead_s)
    while_dead = max(_steps(_read(node_out))) - at_kill
    b.launch("jobs", *b.flags)  # starts the controller again

    def adopted() -> bool:
        a = json.loads((jobdir / "state.json").read_text()).get("adoptions") or []
        return bool(a) and a[-1]["attached_s"] is not None

    b.wait(adopted, 120, "the re-adoption", interval=0.05)
    attached_s = json.loads((jobdir / "state.json").read_text())["adoptions"][-1]["attached_s"]
    # A few steps streamed by the new controller, then stop the job.
    b.wait(lambda: max(_steps(_read(jobdir / "output.log")), default=0) >= at_kill + while_dead + 10, 120, "steps")
    b.launch("stop", *b.flags, job)
    b.c.assert_nothing_left(within=60)
    logged = _steps((jobdir / "output.log").read_text())
    expected = set(range(1, max(logged) + 1))
    return {
        "attached_s": attached_s,
        "poll_s": poll_s,
        "lost": len(expected - set(logged)),
        "twice": len(logged) - len(set(logged)),
        "while_dead": while_dead,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dead-s", type=float, default=3.0, help="how long the job runs with no controller")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-ctldeath-"))
    homes = {i: {"HOME": str(work / f"home{i}")} for i in range(a.nodes + 1)}
    runs = []
    with SimCluster(a.nodes, mode="netns", node_env=homes, controller=True) as c:
        b = Bench(c, work)
        b.batch = ["--global-batch", str(a.nodes)]
        for k in range(a.repeats):
            runs.append(one_death(b, work / f"home{a.nodes}", a.dead_s))
            r = runs[-1]
            print(
                f"repeat {k + 1}: re-adopted {r['attached_s']:.2f} s after the restart, one poll {r['poll_s']:.2f} s; "
                f"{r['while_dead']} steps with no controller; {r['lost']} lost, {r['twice']} twice",
                file=sys.stderr,
            )
    attached = statistics.median(r["attached_s"] for r in runs)
    poll = statistics.median(r["poll_s"] for r in runs)
    lost = sum(r["lost"] + r["twice"] for r in runs)
    dead = statistics.median(r["while_dead"] for r in runs)
    print(f"simulated cluster: {a.nodes} sshd nodes and a controller host (netns); medians of {a.repeats} runs")
    print(
        f"controller killed: its restart -> every node re-adopted {attached:.2f} s vs one poll (`launch jobs`) "
        f"{poll:.2f} s: {attached / poll:.2f}x (target <= 1x)"
    )
    print(
        f"steps lost or logged twice: {lost} over {a.repeats} runs (target 0); the workers made {dead:.0f} steps "
        f"in the {a.dead_s:g} s with no controller"
    )
    if attached > poll or lost:
        print("bench_controller_death: target missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
