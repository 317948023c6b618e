"""A fault schedule on 3 nodes plus 1 spare: goodput by `launch jobs`, each fault's time to train
again, and the work each fault threw away, against the targets of issue 42.

    .venv/bin/python -m bench.bench_faults [--minutes 10] [--every 120] [--local-every 100]
    .venv/bin/python -m bench.bench_faults --minutes 3 --every 30      # a smoke run

A detached `launch train --recover --spares 1` of the tiny model on 4 bare simulated nodes
(netns; the system python3 and a package index only, tests/simcluster.py `bare=True`): the launch
brings gpufleet's code and builds the environment, as on a fresh fleet. The world is nodes 0-2,
node 3 waits as the spare (its environment compiled while it waits). Its checkpoints: the
node-local tier every `--local-every` steps (`--local-checkpoint-every`), each step copied to the
next node of the job's order by the peer replicator (gpufleet.replica), and the durable tier every
`--durable-every` steps in a bucket of gcp-storage-emulator (`--checkpoint-every`,
`--checkpoint-dir gs://...`), which the nodes reach on the cluster's gateway.

From the job's first step, one fault every `--every` seconds (the first half an interval in), in
this order, each on a node of the job's world other than node 0 (which hosts the controller):

    rank killed         SIGKILL one torchrun worker
    node lost for good  SimCluster.power_off, never booted: the spare takes its place
    hang                SIGSTOP one worker; --hang-timeout HANG_S gives the verdict
    node lost for 10 s  power_off, then its sshd starts again 10 s later
    preemption notice   SimCluster.preempt (SIGTERM to its workers, then power_off), back in 10 s

The node lost for good comes while the spare is still free. A fault that comes while the job is
still recovering from the last one waits for it to train again (said in the output). After
`--minutes`, `launch stop`; then `launch jobs --json` gives the goodput and, per recovered failure,
its time to train again and restore source (launcher.jobs.goodput); the lost work in steps comes
from the job's output (the last step before each `restored step N from ...` line, less N).

Targets: goodput >= 90%; each time to train again <= 30 s; lost work <= the local interval. The
anchor, measured in the same run on the same (by then prepared) nodes: an attached
`launch train` on three nodes, from its start to its first step (the median of three); each
time to train again is shown as a ratio of it (the issue's node-lost-for-good target is 1.5x an attached start).
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
from dataclasses import dataclass
from pathlib import Path

from bench.bench_recover import LAUNCH, Bench
from tests.simcluster import HOME, SimCluster
from tests.simindex import wheel_cache
from tests.workloads.conftest import start_gcs_emulator

__all__ = ["KINDS", "Fault", "schedule", "restores", "tier", "lost_steps", "main"]

KINDS = ("rank killed", "node lost for good", "hang", "node lost for 10 s", "preemption notice")
AWAY_S = 10.0  # the node lost for 10 s, and the preempted node, are back after this
HANG_S = 10  # --hang-timeout of the job
FINAL = ("SUCCEEDED", "FAILED", "STOPPED")
DURABLE = "gs://ckpt/faults"  # the durable tier: a bucket on gcp-storage-emulator
_STEP = re.compile(r"\bstep (\d+)/\d+ \|")  # launcher.jobs.goodput's progress mark
_RESTORE = re.compile(
    r"\brestored step (?P<rstep>\d+) from (?P<tier>local|peer|durable)\b"
    r"|\bresumed from (?P<source>\S+(?: \S+)*?) at step (?P<mstep>\d+)"
)


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the job's first step
    kind: str


def schedule(minutes: float, every: float) -> list[Fault]:
    """The five faults, `every` seconds apart from every/2 on; a usage error when the last one
    does not fall inside the run."""
    if every <= 0 or minutes <= 0:
        raise ValueError(f"--minutes {minutes} and --every {every} must both be positive")
    faults = [Fault(every / 2 + k * every, kind) for k, kind in enumerate(KINDS)]
    if faults[-1].at_s >= minutes * 60:
        raise ValueError(
            f"--minutes {minutes} is too short for five faults every {every} s (the last at "
            f"{faults[-1].at_s:.0f} s): give --minutes > {faults[-1].at_s / 60:.2f} or a smaller --every"
        )
    return faults


def restores(output: str) -> list[tuple[int, int, str]]:
    """Each restore in a job's output: (where its line ends, the step restored, the source). Today's
    workloads.train says `resumed from SOURCE at step N`; the tiered restore's line is
    `restored step N from local|peer|durable` (launcher.jobs.goodput.RESTORED_RE). Both lines of
    one restore, with no step line between them, count once (the tier's name wins)."""
    found: list[tuple[int, int, str]] = []
    for m in _RESTORE.finditer(output):
        step, src = (int(m["rstep"]), m["tier"]) if m["rstep"] else (int(m["mstep"]), m["source"])
        if found and found[-1][1] == step and not _STEP.search(output, found[-1][0], m.start()):
            found[-1] = (m.end(), step, m["tier"] or found[-1][2])
        else:
            found.append((m.end(), step, src))
    return found


def tier(source: str) -> str:
    """The tier a `resumed from SOURCE` names: `the local tier (...)`, or the durable directory."""
    return next((t for t in ("local", "peer", "durable") if source.startswith((t, f"the {t}"))), "durable")


def lost_steps(output: str) -> list[tuple[int, int, str, int]]:
    """Per restore in a job's output, in order: (the last step before it, the step restored, the
    source, the steps thrown away). A step line is workloads.train's (`step 12/100 | ...`)."""
    out, at, last = [], 0, 0
    for end, restored, src in restores(output):
        steps = [int(m[1]) for m in _STEP.finditer(output, at, end)]
        last = steps[-1] if steps else last
        out.append((last, restored, src, max(0, last - restored)))
        at, last = end, restored
    return out


def _train(local_every: int, durable_every: int) -> list[str]:
    return [
        *("--model", "tiny", "--seq-len", "32", "--micro-batch", "1", "--straggler-every", "0"),
        *("--steps", "1000000", "--log-every", "1"),
        *("--local-checkpoint-every", str(local_every), "--checkpoint-every", str(durable_every)),
    ]


def _state(path: Path) -> str | None:
    try:
        return json.loads(path.read_text())["state"]
    except (OSError, ValueError, KeyError):
        return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class FaultRun:
    """The detached job and what the schedule did to it."""

    def __init__(self, b: Bench, work: Path, jobdir: Path):
        self.b, self.work, self.jobdir = b, work, jobdir
        self.gone: set[int] = set()  # nodes powered off for good
        self.log: list[dict] = []

    def world(self) -> dict[int, dict[int, int]]:
        """{node: {rank: pid}} of the nodes running workers now."""
        from tests.support import workers  # imports torch: only where the bench needs it

        found = {}
        for i in range(len(self.b.c.nodes)):
            if i not in self.gone:
                w = workers(self.b.c, i)
                if w:
                    found[i] = w
        return found

    def victim(self) -> tuple[int, int]:
        """(node, a worker's pid) on a world node other than node 0."""
        w = self.world()
        for i in sorted(w, reverse=True):
            if i != 0:
                return i, min(w[i].items())[1]
        raise RuntimeError(f"no worker on a node other than node 0 (workers: {w})")

    def restores(self) -> int:
        return len(restores(_read(self.jobdir / "output.log")))

    def trains_again(self, restores_before: int, timeout: float = 300) -> bool:
        """Wait until the job logged a step after a new restore; False if it did not in time."""
        log = self.jobdir / "output.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = _read(log)
            done = restores(text)
            if len(done) > restores_before and _STEP.search(text, done[-1][0]):
                return True
            if _state(self.jobdir / "state.json") in FINAL:
                return False
            time.sleep(0.2)
        return False

    def inject(self, kind: str) -> dict:
        c = self.b.c
        node, pid = self.victim()
        t = time.time()
        if kind == "rank killed":
            os.kill(pid, signal.SIGKILL)
        elif kind == "node lost for good":
            c.power_off(node)
            self.gone.add(node)
        elif kind == "hang":
            os.kill(pid, signal.SIGSTOP)
        elif kind == "node lost for 10 s":
            c.power_off(node)
            time.sleep(AWAY_S)
            c.restart_sshd(node)
        elif kind == "preemption notice":
            c.preempt(node)
            time.sleep(max(0.0, t + AWAY_S - time.time()))
            c.restart_sshd(node)
        return {"kind": kind, "node": node, "pid": pid, "at": t}


class BareBench(Bench):
    """The bench's launches on bare nodes (tests/simcluster.py `bare=True`: the system python3 and
    a package index only): each launch brings gpufleet's code and builds the environment
    (`--index-url`), so the peer replicator runs round the ranks and the spare compiles its
    environment while it waits, as on a real fleet. The durable tier is a bucket on
    gcp-storage-emulator (`store`: its STORAGE_EMULATOR_HOST), which every node reaches on the
    cluster's gateway: bare nodes share no directory."""

    def __init__(self, c: SimCluster, work: Path, store: str):
        super().__init__(c, work)
        self.torch = ["--index-url", c.package_index, "--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1"]
        self.torch += ["--env", f"STORAGE_EMULATOR_HOST={store}"]

    def jobdir(self, job: str) -> Path:
        return self.c.node_path(0, f"{HOME}/.gpufleet/jobs/{job}")


def run(b: BareBench, work: Path, a: argparse.Namespace) -> dict:
    argv = [
        *("train", *b.flags, *b.torch, "--detach", "--recover", "--spares", "1", "--hang-timeout", f"{HANG_S}s"),
        *("--max-recoveries", str(2 * len(KINDS))),  # the default 3 is fewer than the schedule's faults
        *("--", *_train(a.local_every, a.durable_every), "--global-batch", "3", "--checkpoint-dir", DURABLE),
    ]
    job = b.launch(*argv).split()[1]
    jobdir = b.jobdir(job)
    r = FaultRun(b, work, jobdir)
    log = jobdir / "output.log"
    b.wait(lambda: _STEP.search(_read(log)) is not None, 600, "the job's first step", 0.1)
    t0 = time.time()
    for f in schedule(a.minutes, a.every):
        late = time.time() - (t0 + f.at_s)
        if late < 0:
            time.sleep(-late)
        before = r.restores()
        event = r.inject(f.kind)
        event["late_s"] = max(0.0, late)
        event["trained_again"] = r.trains_again(before)
        r.log.append(event)
        print(
            f"[{time.time() - t0:6.1f} s] {f.kind} on node {event['node']}"
            + (f" ({late:.0f} s late: the job was still recovering)" if late > 1 else "")
            + ("" if event["trained_again"] else ": the job did NOT train again"),
            file=sys.stderr,
        )
        if _state(jobdir / "state.json") in FINAL:
            break
    time.sleep(max(0.0, t0 + a.minutes * 60 - time.time()))
    if _state(jobdir / "state.json") not in FINAL:
        b.launch("stop", *b.flags, job)
    b.wait(lambda: _state(jobdir / "state.json") in FINAL, 120, "the job's end", 0.2)
    listing = [json.loads(line) for line in b.launch("jobs", *b.flags, "--json").splitlines()]
    (entry,) = [j for j in listing if j["id"] == job]
    return {"entry": entry, "events": r.log, "output": _read(log), "gone": r.gone}


def attached_start(b: BareBench, work: Path, gone: set[int], a: argparse.Namespace, times: int = 3) -> list[float]:
    """Attached `launch train`s on three of the prepared nodes (not one lost for good): each one's
    start to its first step, `times` times (the median is the anchor: one start varies by 15%)."""
    lines = b.c.hostfile.read_text().splitlines()
    keep = [ln for k, ln in enumerate(lines) if k not in gone][:3]
    hostfile = work / "hostfile3"
    hostfile.write_text("\n".join(keep) + "\n")
    flags = [f if f != str(b.c.hostfile) else str(hostfile) for f in b.flags]
    got = []
    for k in range(times):
        argv = [*LAUNCH, "train", *flags, *b.torch, "--", *_train(a.local_every, a.durable_every)]
        argv += ["--global-batch", "3", "--checkpoint-dir", f"{DURABLE}-attached-{k}"]
        got.append(b._until_line(argv, lambda s: _STEP.search(s) is not None))
    return got


def report(r: dict, starts: list[float], a: argparse.Namespace) -> bool:
    job, g = r["entry"], r["entry"]["goodput"]
    failures = sorted(g.get("failures") or [], key=lambda f: f["at"])
    lost = lost_steps(r["output"])
    anchor_s = statistics.median(starts)
    print(
        f"simulated cluster: 3 bare sshd nodes + 1 spare (netns), tiny model; {a.minutes} min, a fault every "
        f"{a.every} s; local checkpoint every {a.local_every} steps (copied to a peer), durable every "
        f"{a.durable_every} (GCS emulator)"
    )
    print(f"job {job['id']}: {job['state']}, {len(job.get('recoveries') or [])} recoveries, {len(failures)} failures")
    print(
        f"anchor: attached `launch train` on 3 prepared nodes, start -> first step {anchor_s:.2f} s "
        f"(the median of {', '.join(f'{x:.1f}' for x in starts)} s)"
    )
    ok = True
    print(f"{'fault':<20} {'node':>4} {'train again':>12} {'x anchor':>8} {'restored':>16} {'lost steps':>10}  target")
    for k, e in enumerate(r["events"]):
        until = r["events"][k + 1]["at"] if k + 1 < len(r["events"]) else float("inf")
        mine = [f for f in failures if e["at"] - 1 <= f["at"] < until]
        f = mine[0] if mine else None
        tta = None if f is None else f["to_train_s"]
        # The restores in the output are in the failures' order.
        idx = failures.index(f) if f is not None else None
        ls = lost[idx] if idx is not None and idx < len(lost) else None
        if f is not None and f["restored_from"] != "unknown":
            src = f"{f['restored_from']} step {f['restored_step']}"
        else:  # the record names no tier: the output's own line, `resumed from SOURCE`
            src = "-" if ls is None else f"{tier(ls[2])}? step {ls[1]}"
        met = tta is not None and tta <= 30 and ls is not None and ls[3] <= a.local_every
        ok &= met
        print(
            f"{e['kind']:<20} {e['node']:>4} "
            + (f"{tta:>10.1f} s {tta / anchor_s:>7.2f}x" if tta is not None else f"{'never':>12} {'-':>8}")
            + f" {src:>16} {'-' if ls is None else ls[3]:>10}  "
            + ("met" if met else "MISSED")
            + ("" if f is not None else " (no recovery recorded for it)")
        )
    gp = g["goodput_pct"]
    print(
        f"goodput {gp:.1f}% of {g['run_s']:.1f} s (target >= 90%: {'met' if gp >= 90 else 'MISSED'}); "
        + ", ".join(f"{k} {v:.1f} s" for k, v in g["seconds"].items())
    )
    print("time to train again <= 30 s, lost work <= local interval: " + ("met" if ok else "MISSED (see above)"))
    return ok and gp >= 90


def main() -> int:

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--every", type=float, default=120)
    # Every 100 steps of the tiny model is about 3 s here, longer than one peer copy (about 0.5 s):
    # at 10 the copies ran saves behind. A real job's interval is minutes.
    p.add_argument("--local-every", type=int, default=100)
    p.add_argument("--durable-every", type=int, default=500)
    a = p.parse_args()
    try:
        schedule(a.minutes, a.every)
    except ValueError as e:
        print(f"bench_faults: {e}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-faults-"))
    with SimCluster(4, bare=True, index=wheel_cache(), workdir=work / "sim") as c:
        with start_gcs_emulator("ckpt", host=c.gateway) as store:
            b = BareBench(c, work, store)
            r = run(b, work, a)
            print(json.dumps(r["entry"].get("recoveries"), indent=None)[:4000], file=sys.stderr)
            starts = attached_start(b, work, r["gone"], a)
    ok = report(r, starts, a)
    if not ok:
        print("bench_faults: target missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
