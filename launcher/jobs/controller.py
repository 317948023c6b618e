"""The controller of one detached job, on the job host: `python -m launcher.jobs.controller JOBDIR`
(`--adopt-all`: start again every job's controller that died, as the controller VM's boot does).

Started by launcher.jobs.handoff in a session of its own, it runs the same `launcher.core.launch.Launch`
an attached launch runs (node 0 reaching every node, itself included, over SSH with the cluster
key) and keeps the job's record (launcher.jobs.record) up to date:

    PENDING ──> RUNNING ──> SUCCEEDED | FAILED | STOPPED
       │           ↑  └──> RECOVERING ──> FAILED | STOPPED   (--recover: launcher.jobs.recovery)
       │           └────────────┘  (every node back and checked: relaunched with --resume)
       └──────────────────> STOPPED   (`launch stop` while it waited)

PENDING: an earlier job (first in, first out) on any of the same nodes is still pending or
running. SIGTERM (`launch stop`) stops every node, as Ctrl-C does an attached launch. When the
job ends the controller exits: nothing of the job is left running on any node.

A controller may die (killed, its VM rebooted) while its job runs: the nodes keep training for
--controller-grace (launcher.core.supervise), and a controller started again on the same job
directory finds the record its predecessor left and re-adopts the job (launcher.jobs.adopt).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from gpufleet import atomic
from launcher.cluster.key import NODE_KEY_DIR
from launcher.core.output import failure_line
from launcher.core.supervise import ORPHAN_STOP
from launcher.core.types import LaunchResult, UserError
from launcher.jobs.goodput import MarkKeeper, is_node_failure, note_state
from launcher.jobs.record import (
    CONTROLLER_LOCK,
    CONTROLLER_PREFIX,
    HEARTBEAT_FILE,
    HEARTBEAT_S,
    SAMPLES_FILE,
    STOP_GRACE_FILE,
    JobRecord,
    JobState,
    controller_alive,
    jobs_home,
    process_start,
    request_from_json,
)

__all__ = ["main", "Controller"]

log = logging.getLogger("launcher")

MARKS_SAVE_S = 2.0  # a new progress mark alone rewrites the record at most this often


class Controller:
    """One job's controller: its record, its place in the queue, and its `Launch`."""

    def __init__(self, jobdir: Path):
        self.jobdir = jobdir
        self.request = json.loads((jobdir / "request.json").read_text())
        env_file = jobdir / "env.json"
        self.env = json.loads(env_file.read_text()) if env_file.exists() else []
        # The --env values (mode 600) stay on disk only while a controller started again after this
        # one died could need them: until the nodes are told to go (note_run), or with --recover,
        # which may relaunch the job, until it ends (end). They reach the nodes on stdin.
        self.stop = threading.Event()
        self.metrics = None  # the job's sampling (launcher.observe.job_metrics), while it runs
        self.preempted, self.last_step = False, None  # this attempt's, for launcher.jobs.recovery
        self.launch = None  # the attempt running now (a launcher.core.launch.Launch)
        self.started_at = time.monotonic()
        self.orphan_stopped = False  # a node said it stopped itself: no controller for --controller-grace
        self._run_noted: object = None  # the launch whose nodes the record's `run` names
        wl = self.request["workload"]
        pid = os.getpid()
        self.record = JobRecord(
            id=self.request["config"]["job_id"],
            state=JobState.PENDING,
            what=shlex.join([wl["kind"], *wl["argv"]]),
            nodes=[n["host"] for n in self.request["cluster"]["nodes"]],
            submitted=time.time(),
            pid=pid,
            pid_start=process_start(pid) or "",
            machine_type=self.request["cluster"].get("machine_type"),
            controller_grace_s=self.request["config"].get("controller_grace_s"),
            spares=[n["host"] for n in self.request.get("spares") or []],
        )
        # A record already there: an earlier controller of this job died; this one re-adopts it.
        self.previous: JobRecord | None = None
        state_file = jobdir / "state.json"
        if state_file.exists():
            self.previous = JobRecord.from_json(json.loads(state_file.read_text()))
            self.record = JobRecord.from_json(self.previous.to_json())
            self.record.pid, self.record.pid_start = pid, process_start(pid) or ""
        self.marks = MarkKeeper(self.record, self.request["config"].get("progress"))  # for goodput
        self._saved_at = 0.0
        self._lock = None  # CONTROLLER_LOCK's file, held while this controller lives

    def save(self) -> None:
        note_state(self.record, time.time())
        atomic.write_text(self.jobdir / "state.json", json.dumps(self.record.to_json(), indent=1) + "\n")
        self._saved_at = time.monotonic()

    def say(self, text: str) -> None:
        """One line of the controller's own in the job's log (output.log), after the nodes' lines
        so far: `launch logs JOB` shows what the controller did and why, not only the record."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(self.jobdir / "output.log", "a", buffering=1) as f:
            f.write(f"{CONTROLLER_PREFIX} {stamp} {text}\n")

    def take_lock(self) -> bool:
        """Hold CONTROLLER_LOCK for this controller's life; False: another controller holds it."""
        self._lock = open(self.jobdir / CONTROLLER_LOCK, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return True

    def run(self) -> int:
        if not self.take_lock():
            log.info("job %s has a live controller already; this one exits", self.record.id)
            return 0
        if self.previous is not None and self.previous.state.final:
            return self.previous.exit or 0
        # The previous controller's last sign of life, read before this one's first.
        heartbeat = self.jobdir / HEARTBEAT_FILE
        silent_s = time.time() - heartbeat.stat().st_mtime if heartbeat.exists() else None
        # Handlers first: a `launch stop` may signal this controller as soon as its pid is there.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self._on_stop_signal())
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        (self.jobdir / "controller.pid").write_text(f"{self.record.pid} {self.record.pid_start}\n")
        self._start_heartbeat()
        if self.previous is not None and self.previous.state is not JobState.PENDING:
            from launcher.jobs.adopt import adopt

            return adopt(self, self.previous, silent_s)
        if not self.wait_turn():
            return self.end(JobState.STOPPED, 128 + signal.SIGTERM, why="stopped while pending; it never ran")
        # Imported once the record is written: the hand-off waits for the record, not for these.
        from launcher.code.launch_tree import tree_for
        from launcher.core.launch import Interrupted, Launch
        from launcher.health.prestart import prestart_verdict

        home = Path(os.path.expanduser("~"))
        cluster, config = request_from_json(self.request, self.env, home, self.jobdir.parent)
        from launcher.observe import job_metrics

        self.metrics = job_metrics.start(cluster, config, self.jobdir / SAMPLES_FILE)
        with open(self.jobdir / "output.log", "a", buffering=1) as out:
            launch = None
            try:
                launch = Launch(
                    cluster,
                    config,
                    on_event=lambda e: self.on_event(out, e),
                    stop=self.stop,
                    verdict=prestart_verdict,
                    tree=tree_for(cluster, config),
                )
                self.launch = launch
                result = launch.run(handle_signals=True)
            except UserError as e:
                return self.end(JobState.FAILED, 2, why=str(e), node=launch.first_bad() if launch else None)
            except Interrupted as e:
                return self.end(JobState.STOPPED, 128 + e.signum, why="stopped while connecting; nothing ran")
        if self.request.get("recover") is None:
            return self.finish(result)
        from launcher.jobs.recovery import Recoverer, RecoverPolicy

        return Recoverer(self, cluster, config, RecoverPolicy(**self.request["recover"])).run(result)

    def _start_heartbeat(self) -> None:
        """Touch HEARTBEAT_FILE every HEARTBEAT_S while this controller lives: once it has died,
        the file's age is how long its nodes have been without one (launcher.jobs.record)."""
        path = self.jobdir / HEARTBEAT_FILE

        def beat() -> None:
            while True:
                path.touch()
                time.sleep(HEARTBEAT_S)

        path.touch()
        threading.Thread(target=beat, daemon=True).start()

    def note_run(self, launch) -> None:
        """Keep in the record which attempt runs on which nodes (`JobRecord.run`), once per launch,
        when its nodes are told to go: what a controller started after this one re-adopts."""
        if self._run_noted is launch:
            return
        self._run_noted = launch
        if self.request.get("recover") is None:  # no relaunch can come: the values live only here now
            (self.jobdir / "env.json").unlink(missing_ok=True)
        cfg = launch.config
        self.record.run = {
            "attempt": cfg.attempt,
            "restart_reason": cfg.restart_reason,
            "nodes": [
                {"rank": n.rank, "host": n.host, "address": n.address, "slots": n.slots, "name": n.name}
                for n in launch.cluster.nodes
            ],
        }
        self.save()

    def _on_stop_signal(self) -> None:
        """`launch stop` (SIGTERM): stop every node, with the grace `launch stop --grace` left in
        the job's directory, if it did."""
        try:
            grace = float((self.jobdir / STOP_GRACE_FILE).read_text())
        except (OSError, ValueError):
            grace = None
        if grace is not None and grace > 0 and self.launch is not None:
            self.launch.stop_grace_s = grace
        self.stop.set()

    def on_event(self, out, event) -> None:  # a launcher.core.launch.NodeEvent
        self._mark(event)
        if event.state is not None and event.state.value == "running" and self.launch is not None:
            self.note_run(self.launch)
        if event.line is not None:
            out.write(f"[node {event.node.rank}] {event.line}\n")
            self.orphan_stopped = self.orphan_stopped or event.line.startswith(ORPHAN_STOP)
            if self.request.get("recover") is not None:
                from launcher.core.wire import PREEMPTION_NOTICE
                from launcher.jobs.recovery import PREEMPTED_TEXT, step_of

                self.last_step = step_of(event.line) or self.last_step
                notice = PREEMPTED_TEXT in event.line or event.line.startswith(PREEMPTION_NOTICE)
                self.preempted = self.preempted or notice

    def reset_attempt(self) -> None:
        """A relaunch starts: what the last attempt's output said is forgotten."""
        self.preempted, self.last_step = False, None
        self.marks.new_attempt()

    def _mark(self, event) -> None:
        """Note progress, checkpoints and the first node failure for the goodput timeline; a
        changed mark is saved with the next state change, or within MARKS_SAVE_S."""
        now = time.time()
        if event.line is not None:
            changed = self.marks.line(event.line, now)
        elif event.state is not None and self.record.state is JobState.RUNNING and is_node_failure(event.state.value):
            changed = self.marks.node_failed(now)
        else:
            return
        if changed and time.monotonic() - self._saved_at >= MARKS_SAVE_S:
            self.save()

    def wait_turn(self) -> bool:
        """Wait (PENDING) until no earlier job, and no running one, uses any of this job's nodes;
        then record RUNNING. The check and the change happen under one lock, so two controllers
        never both start. False: stopped while waiting."""
        lock_path = self.jobdir.parent / ".queue.lock"
        first = True
        while not self.stop.is_set():
            with open(lock_path, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if first:  # the queue's order is the order of arrival under the lock
                    self.record.submitted = time.time()
                    first = False
                if not self.ahead():
                    self.record.state, self.record.started = JobState.RUNNING, time.time()
                    self.save()
                    return True
                self.save()
            self.stop.wait(0.5)
        return False

    def ahead(self) -> list[JobRecord]:
        mine = set(self.record.nodes) | set(self.record.spares)  # a job holds its spares too
        out = []
        for f in self.jobdir.parent.glob("*/state.json"):
            try:
                other = JobRecord.from_json(json.loads(f.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if other.id == self.record.id or other.state.final or not set(other.nodes + other.spares) & mine:
                continue
            earlier = (other.submitted, other.id) < (self.record.submitted, self.record.id)
            holds = other.state in (JobState.RUNNING, JobState.RECOVERING)
            if (earlier or holds) and (controller_alive(other) or _waits_for_controller(other, f.parent)):
                out.append(other)
        return out

    def finish(self, result: LaunchResult, note: str = "") -> int:
        """End the record as `result` says; `note` (why recovery gave up) follows a failure's why."""
        if self.orphan_stopped:  # the nodes stopped themselves before a controller came back
            return self.end(JobState.FAILED, result.exit_code or 1, why=(self.previous or self.record).orphan_why())
        if result.signal is not None:
            return self.end(
                JobState.STOPPED, result.exit_code, why=f"stopped (signal {result.signal}): every node was stopped"
            )
        if result.hang is not None:
            h = result.hang
            self.say(h.verdict)  # with the stacks' directory on the job host
            return self.end(JobState.FAILED, result.exit_code, why=h.verdict + note, node=h.node, reason=h.reason)
        if result.exit_code == 0:
            return self.end(JobState.SUCCEEDED, 0)
        return self._failed(result, note)

    def _failed(self, result: LaunchResult, note: str) -> int:
        rank = result.first_failure
        o = result.outcomes.get(rank) if rank is not None else None
        if o is None:
            return self.end(JobState.FAILED, result.exit_code, why="failed" + note)
        tail = [*[line for line in o.error_lines if line not in o.tail], *o.tail[-20:]]
        return self.end(JobState.FAILED, result.exit_code, why=f"{failure_line(result)}{note}", node=rank, tail=tail)

    def end(
        self,
        state: JobState,
        code: int,
        why: str = "",
        node: int | None = None,
        tail: list[str] | None = None,
        reason: str = "",
    ) -> int:
        if self.metrics is not None:  # sampling ends first: a final record's samples are whole
            self.metrics.stop()
        r = self.record
        r.state, r.exit, r.why, r.failed_node, r.tail, r.ended = state, code, why, node, tail or [], time.time()
        r.reason = reason
        r.run = None
        # In the log before the record says so: a reader that sees the final state finds the line.
        self.say(_ending_line(r))
        self.save()
        (self.jobdir / "env.json").unlink(missing_ok=True)  # the --env values: no relaunch can come now
        log.info("job %s %s (exit %d) %s", r.id, state.value, code, why)
        return code


def _ending_line(r: JobRecord) -> str:
    """How and when the job ended, the last line of its log: `job ID ended FAILED at TIME (exit
    124, reason hang) after 42 s: why` (a hang's verdict is the line before it)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.ended))
    how = f"exit {r.exit}" + (f", reason {r.reason}" if r.reason else "")
    took = f" after {r.ended - r.started:.0f} s" if r.started and r.ended else ""
    why = "" if not r.why or r.reason == "hang" else f": {r.why}"
    tail = f" — last lines of node {r.failed_node}: {r.tail[-1]}" if r.tail and r.failed_node is not None else ""
    return f"job {r.id} ended {r.state.value} at {when} ({how}){took}{why}{tail}"


def _waits_for_controller(record: JobRecord, jobdir: Path) -> bool:
    """Whether a job whose controller died still holds its nodes: they keep its run going for
    --controller-grace after its controller's last heartbeat (launcher.core.supervise)."""
    try:
        silent_s = time.time() - (jobdir / HEARTBEAT_FILE).stat().st_mtime
    except OSError:
        return False
    return not record.seen_with(False, silent_s).state.final


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--adopt-all"] and len(args) <= 2:
        # The controller VM's boot: every job whose controller died with the VM gets one again.
        from launcher.jobs.adopt import adopt_all

        home = Path(args[1]) if len(args) == 2 else jobs_home()
        for job_id in adopt_all(home):
            print(f"job {job_id}: its controller had died; started it again to re-adopt the job")
        return 0
    if len(args) != 1:
        sys.stderr.write("usage: python -m launcher.jobs.controller JOBDIR | --adopt-all [JOBS_DIR]\n")
        return 2
    # The cluster's keys the hand-off placed beside its cluster key (NODE_KEY_DIR/CLUSTER): a
    # --fanout job's relay key and launch keys (launcher.code.launch_tree) are read from there.
    os.environ.setdefault("GPUFLEET_STATE_DIR", str(Path.home() / NODE_KEY_DIR))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # stderr: controller.log
    logging.getLogger("launcher").setLevel(logging.INFO)
    controller = Controller(Path(args[0]).resolve())
    try:
        return controller.run()
    except Exception as e:  # a record must never say RUNNING for a controller that has gone
        log.exception("the controller failed")
        return controller.end(JobState.FAILED, 1, why=f"the job's controller failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
