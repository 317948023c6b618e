"""One launch's life, owned by one object: `Launch`.

Shaped like torch's elastic agent (torch/distributed/elastic/agent/server/api.py), which owns a
`WorkerGroup` whose `WorkerState` is an enum: a `Launch` owns the typed request (`Cluster` and
`LaunchConfig`), the transport, one `NodeSession` per node, each node's `NodeState`, the stop
event and signal handling, and the `LaunchResult`. It logs (logging) and reports `NodeEvent`s to
its caller; rendering them is the CLI's business. `launch hosts`, `launch exec/run/train` and
the nccl-tests sweeps are callers of it.

A node's state changes in one place, `Launch._set_state`, from the thread that runs the launch:

    connecting ──> checked ──> running ──> exited | failed | unreachable | stopped
        │             │
        └─────────────┴──> unreachable | failed | stopped   (nothing was started)

Every node is checked before any starts: one SSH session per node (a bounded number of
handshakes at a time) runs the check and waits at a gate, and only when every node has passed
does the launch tell them all to go (launcher.core.program). Stopping is cooperative first: the
launch closes each node's stdin, and the node-side wrapper stops its own process tree; a node
that cannot be told (its connection is gone) sees the same end of input when it closes.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet import atomic
from gpufleet.node_plan import Check
from launcher.core.hang import HangWatch
from launcher.core.output import root_cause, traceback_key, worker_failure
from launcher.core.preflight import Probe, Verdict, check_probes, check_timeout, handshake_limit
from launcher.core.program import attach_commands, env_stdin, node_commands, probe_script
from launcher.core.session import NodeSession, Report, Tree
from launcher.core.transport import Transport, make_transport
from launcher.core.types import Cluster, Hang, LaunchConfig, LaunchResult, Node, NodeOutcome, UserError, WorkerFailure
from launcher.core.wire import grace_line

__all__ = ["NodeState", "NodeEvent", "Interrupted", "Launch", "write_summary", "offset_file_name", "read_offsets"]

log = logging.getLogger("launcher")


class NodeState(enum.Enum):
    """Where one node is in a launch."""

    CONNECTING = "connecting"  # its session is opening, or its check is running
    CHECKED = "checked"  # it passed its check and waits for `go`
    RUNNING = "running"  # told `go`: its workload runs
    EXITED = "exited"  # the workload ended with status 0
    FAILED = "failed"  # the workload ended nonzero on its own, or the node refused after its check
    UNREACHABLE = "unreachable"  # it never answered its check, or its connection dropped
    STOPPED = "stopped"  # the launch ended it: a stop after a failure or signal, or sent home at the gate

    @property
    def final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({NodeState.EXITED, NodeState.FAILED, NodeState.UNREACHABLE, NodeState.STOPPED})
_NEXT = {
    None: {NodeState.CONNECTING},
    NodeState.CONNECTING: {NodeState.CHECKED, NodeState.UNREACHABLE, NodeState.STOPPED},
    NodeState.CHECKED: {NodeState.RUNNING, NodeState.FAILED, NodeState.UNREACHABLE, NodeState.STOPPED},
    NodeState.RUNNING: _FINAL,
}


@dataclass(frozen=True)
class NodeEvent:
    """Something a caller may show: a node's new `state` (with `detail`: the check's error, the
    exit status), or one `line` of its output for the live stream."""

    node: Node
    state: NodeState | None = None
    line: str | None = None
    detail: str = ""


OnEvent = Callable[[NodeEvent], None]


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived before any workload started; nothing is running."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _final_state(outcome: NodeOutcome) -> NodeState:
    if outcome.connection_lost:
        return NodeState.UNREACHABLE
    if outcome.ok:
        return NodeState.EXITED
    return NodeState.STOPPED if outcome.stopped else NodeState.FAILED


# SIGTERM to SIGKILL for the other nodes when one is lost (its connection dropped): see _on_exit.
LOST_NODE_GRACE_S = 5.0


class Launch:
    """One launch of `config` on `cluster`: `run()` checks, starts, streams, stops and returns
    the result; `probe()` runs the check alone. `stop` may be shared by launches running at
    once (the bad-node finder's pairs): setting it stops all of them. `verdict` judges what the
    check asked about each node's GPUs and NICs (launcher.health.prestart.prestart_verdict; a
    launch whose programs ask it must have one, launcher.core.preflight.check_probes)."""

    def __init__(
        self,
        cluster: Cluster,
        config: LaunchConfig,
        on_event: OnEvent | None = None,
        stop: threading.Event | None = None,
        transport: Transport | None = None,
        verdict: Verdict | None = None,
        tree: Tree | None = None,
    ):
        self.cluster = cluster
        self.tree = tree  # --fanout: every session through node 0's, down a tree
        self.config = config
        self.verdict = verdict
        self.transport = transport or make_transport(cluster, config.ssh, config.dry_run)
        self.stop_event = stop or threading.Event()
        self.signals: list[int] = []  # SIGINT/SIGTERM received, in order
        self.states: dict[int, NodeState] = {}  # by node rank; changed only by _set_state
        self.result = LaunchResult(config.job_id, config.run_dir, {})
        self._emit = on_event or (lambda event: None)
        self._sessions: dict[int, NodeSession] = {}
        self._reports: queue.Queue[Report] = queue.Queue()
        self._worker_failures: dict[int, int] = {}  # torchrun worker failures seen, by node rank
        self._workers: dict[int, WorkerFailure] = {}  # the worker failure that ended a node's run
        self._tracebacks: set[str] = set()  # user tracebacks shown (traceback_key)
        self._arrival: list[int] = []  # ranks in the order their workloads ended
        self._failing = False  # a node failed on its own: the others are being stopped
        # SIGTERM to SIGKILL on the nodes when this launch stops them: --term-grace, unless a
        # caller sets another before stopping (`launch stop --grace`, through the controller).
        self.stop_grace_s = config.stop_grace_s
        self._hang = HangWatch(config.hang_timeout_s, config.progress) if config.hang_timeout_s else None
        self._offsets: dict[int, int] = {}  # a re-adopted run's: where each node's stream resumes

    # ---- the one place a node's state changes ----

    def _set_state(self, rank: int, state: NodeState, detail: str = "") -> None:
        old = self.states.get(rank)
        if old is not None and old.final:
            return  # a final state is final: a late report changes nothing
        if state not in _NEXT[old]:
            raise RuntimeError(f"node {rank}: no transition from {old} to {state}")
        self.states[rank] = state
        self._emit(NodeEvent(self._sessions[rank].node, state=state, detail=detail))

    def in_state(self, state: NodeState) -> list[int]:
        """Ranks of the nodes in `state`."""
        return [r for r, s in self.states.items() if s is state]

    def first_bad(self) -> int | None:
        """The lowest rank this launch found unreachable or failed: the node a record names."""
        bad = self.in_state(NodeState.UNREACHABLE) + self.in_state(NodeState.FAILED)
        return min(bad) if bad else None

    # ---- what callers call ----

    def run(
        self,
        handle_signals: bool = True,
        adopt: dict[int, int] | None = None,
        programs: Mapping[int, str] | None = None,
        stdin: bytes | None = None,
    ) -> LaunchResult:
        """Check every node, start the workload on all of them, stream, stop on the first
        failure, and report. Raises UserError or Interrupted (nothing was started).
        `adopt`: a detached job's run that is already going (its controller died): instead of
        starting it, re-attach to every node's supervisor and stream from these byte offsets, by
        rank (launcher.core.supervise); a node without its run refuses, as a check does.
        `programs`: each node's program, by rank, rendered already (a launch plan's,
        launcher.runner); else rendered here by the builder (launcher.core.program). `stdin`: what
        those programs read first (the plan's --env values); else computed here."""
        if programs is not None:
            scripts = dict(programs)
        elif adopt is None:
            scripts = node_commands(self.cluster, self.config)
        else:
            self._offsets = adopt
            scripts = attach_commands(self.cluster, self.config, adopt)
        if adopt is not None:
            stdin = b""  # a re-attach reads no --env values
        elif stdin is None:  # the builder's programs read the --env values from stdin first
            stdin = env_stdin(self.config)
        with self._signals_stop(handle_signals):
            try:
                self._check(scripts, stdin)
                self._refuse_or_warn()
                self._make_run_dir()
            except BaseException:
                self._send_home()
                raise
            self._go()
            return self._stream()

    def probe(self, check_torch: bool, extra: Sequence[Check] = ()) -> dict[int, Probe]:
        """The check alone on every node (what `launch hosts` shows; `extra` checks report more
        facts: where the VM sits): the sessions a launch opens, sent home after the check instead of told to go."""
        script = probe_script(self.config.python, self.config.workdir, check_torch, extra)
        return self.ask(dict.fromkeys((n.rank for n in self.cluster.nodes), script))

    def ask(self, scripts: dict[int, str], stdin: bytes = b"") -> dict[int, Probe]:
        """Run each node's own check program (by rank; `key=value` lines, then CHECKED_MARKER,
        then wait for input, as launcher.core.program.probe_script does), with a launch's bounded
        handshakes and timeout, and send every node home: what each answered. `stdin`: what each
        program reads first (a builder's program: its --env values, launcher.core.program.env_stdin)."""
        with self._signals_stop(True):
            try:
                self._check(scripts, stdin)
                if self.stop_event.is_set():  # Ctrl-C while asking: Interrupted, as a launch's check
                    raise Interrupted(self.signals[0] if self.signals else signal.SIGINT)
                return {r: s.probe() for r, s in self._sessions.items()}
            finally:
                self._send_home()

    def request_stop(self, signum: int | None = None) -> None:
        """Stop every node (safe from a signal handler or another thread)."""
        if signum is not None:
            self.signals.append(signum)
        self.stop_event.set()

    # ---- signals ----

    @contextlib.contextmanager
    def _signals_stop(self, enabled: bool) -> Iterator[None]:
        """SIGINT/SIGTERM stop the launch in order instead of raising, while it runs."""
        previous = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda signum, frame: self.request_stop(signum))
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # ---- connecting and checking ----

    def _check(self, scripts: dict[int, str], stdin: bytes = b"") -> None:
        """Open every node's session, a bounded number of handshakes at a time, until each node
        has passed its check half (and waits for `go`), ended, or run out of time."""
        limit = handshake_limit(self.cluster, self.config.ssh, self.transport)
        timeout = check_timeout(self.config.ssh)
        pending = deque(self.cluster.nodes)
        if self.tree is not None:  # one session here; the nodes open each other's
            self.tree.start(scripts, stdin)
            limit, stdin = len(pending), b""
        deadlines: dict[int, float] = {}  # rank -> deadline, for sessions still checking
        while (pending or deadlines) and not self.stop_event.is_set():
            while pending and len(deadlines) < limit:
                node = pending.popleft()
                tree = self.tree
                self._sessions[node.rank] = NodeSession(
                    node,
                    self.transport.argv(node, scripts[node.rank]) if tree is None else [],
                    self._reports,
                    stdin,
                    tunnel_log=self.transport.tunnel_log(node) if tree is None else None,
                    proc=tree.proc(node.rank) if tree is not None else None,
                )
                self._set_state(node.rank, NodeState.CONNECTING)
                deadlines[node.rank] = time.monotonic() + timeout
            try:
                report = self._reports.get(timeout=0.2)
            except queue.Empty:
                self._time_out_checks(deadlines, timeout)
                continue
            deadlines.pop(report.rank, None)
            if report.kind == "checked":
                self._set_state(report.rank, NodeState.CHECKED)
            elif report.kind == "exit":
                answered = self.states[report.rank] is NodeState.CHECKED
                self._set_state(
                    report.rank,
                    NodeState.FAILED if answered else NodeState.UNREACHABLE,
                    self._sessions[report.rank].probe().error,
                )

    def _time_out_checks(self, deadlines: dict[int, float], timeout: float) -> None:
        now = time.monotonic()
        for rank, deadline in deadlines.items():
            session = self._sessions[rank]
            if now > deadline and session.timed_out is None:
                session.timed_out = timeout
                session.force()  # its exit report follows

    def _refuse_or_warn(self) -> None:
        if self.stop_event.is_set():
            raise Interrupted(self.signals[0] if self.signals else signal.SIGINT)
        probes = {r: s.probe() for r, s in self._sessions.items()}
        for warning in check_probes(self.cluster, probes, self.config, self.verdict):
            log.warning(warning)

    def _make_run_dir(self) -> None:
        try:
            self.config.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"cannot create the run directory {self.config.run_dir}: {e.strerror}; nothing was "
                "started. Pass --runs-dir with a directory you can write"
            ) from None

    def _send_home(self, wait_s: float = 3.0) -> None:
        """End every session before `go`, and wait (briefly) for them to go away."""
        for session in self._sessions.values():
            session.cancel()
        deadline = time.monotonic() + wait_s
        for rank, session in self._sessions.items():
            try:
                session.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                session.force()
            self._set_state(rank, NodeState.STOPPED)

    # ---- running ----

    def _go(self) -> None:
        detached = self.config.controller_grace_s is not None
        for rank, session in self._sessions.items():
            if detached:
                offsets = self.config.run_dir / offset_file_name(rank)
                session.go(
                    self.config.run_dir / f"node-{rank}.log", offsets, self.config.attempt, self._offsets.get(rank, 0)
                )
            else:
                session.go(self.config.run_dir / f"node-{rank}.log")
            self._set_state(rank, NodeState.RUNNING)
        if self._hang is not None:
            self._hang.start()

    def _stream(self) -> LaunchResult:
        """Until every node has ended: show output, stop all on a failure or signal."""
        while self.in_state(NodeState.RUNNING):
            self._notice_stop()
            self._notice_hang()
            try:
                report = self._reports.get(timeout=0.2)
            except queue.Empty:
                self._force_overdue()
                continue
            if report.kind in ("line", "log"):
                self._on_line(report.rank, report.text, live=report.kind == "line")
            elif report.kind == "traceback":
                self._on_traceback(report.rank, report.text)
            elif report.kind == "exit" and self.states[report.rank] is NodeState.RUNNING:
                self._on_exit(report.rank, int(report.text))
        if self._failing and self.result.hang is None:
            self.result.first_failure = root_cause(self.result.outcomes, self._arrival)
        write_summary(self.result, self.cluster)
        return self.result

    def _notice_stop(self) -> None:
        if self.stop_event.is_set() and self.result.signal is None:
            self.result.signal = self.signals[0] if self.signals else signal.SIGINT
            log.warning("received %s: stopping every node", signal.Signals(self.result.signal).name)
            self._stop_running()

    def _stop_running(self) -> None:
        # A detached run takes end of input for its controller gone, never for a stop: it is told.
        told = self.stop_grace_s != self.config.stop_grace_s or self.config.controller_grace_s is not None
        line = grace_line(self.stop_grace_s) if told else b""
        for rank in self.in_state(NodeState.RUNNING):
            self._sessions[rank].request_stop(line)

    def _notice_hang(self) -> None:
        """No progress for --hang-timeout: collect every worker's stack, keep the verdict, and
        stop every node (launcher.core.hang, launcher.core.stacks)."""
        if self._hang is None or self._failing or self.stop_event.is_set() or not self._hang.overdue():
            return
        from launcher.core.env import flight_recorder_on
        from launcher.core.stacks import collect

        silent = self._hang.silent_for()
        running = self.in_state(NodeState.RUNNING)
        log.warning("no progress for %.0f s (--hang-timeout): collecting the workers' stacks", silent)
        try:
            fr = flight_recorder_on(self.cluster)
            hang = collect(self.cluster, self.config, self.transport, silent, running, fr, tree=self.tree)
        except Exception as e:  # the job must stop all the same
            log.exception("collecting the stacks failed")
            hang = Hang(f"hang: no progress for {silent:.0f} s; collecting the stacks failed: {type(e).__name__}: {e}")
        log.error("%s", hang.verdict)  # at once: stopping the nodes takes a few seconds more
        self.result.hang = hang
        self._failing = True
        self._stop_running()

    def _force_overdue(self) -> None:
        """Kill the session of a node that has not ended well after it was told to stop."""
        force_after = self.stop_grace_s + 4.0
        now = time.monotonic()
        for rank in self.in_state(NodeState.RUNNING):
            session = self._sessions[rank]
            if session.stop_sent_at is not None and now - session.stop_sent_at > force_after:
                session.force()

    def _on_line(self, rank: int, text: str, live: bool = True) -> None:
        session = self._sessions[rank]
        if live:
            self._emit(NodeEvent(session.node, line=text))
            if self._hang is not None:  # the job's own output; torchrun's report ("log") is not progress
                self._hang.saw(text)
        failure = worker_failure(text) if self.config.workload.kind == "torchrun" else None
        if failure is None:
            return
        seen = self._worker_failures[rank] = self._worker_failures.get(rank, 0) + 1
        limit = self.config.max_restarts
        # The failure that ends the node's run (torchrun restarts the earlier ones), unless it is
        # a worker the launcher's own stop killed.
        if seen > limit and (session.stop_sent_at is None or failure.exitcode >= 0):
            self._workers[rank] = failure
        if self.stop_event.is_set() or self._failing:
            return
        if seen <= limit:
            log.warning(
                "%s: %s; torchrun restarts the workers on every node (restart %d of "
                "--max-restarts %d; they resume from the latest checkpoint if the "
                "workload has one)",
                session.node.label,
                failure.note,
                seen,
                limit,
            )
        elif self.result.first_worker_status is None:
            # The end of the run: the launcher's one line on it comes with the result.
            self.result.first_worker_status = failure.status

    def _on_traceback(self, rank: int, text: str) -> None:
        """A user traceback: shown from the first rank that raised it; the others' stay in their logs."""
        key = traceback_key(text)
        if key in self._tracebacks:
            return
        self._tracebacks.add(key)
        for line in text.split("\n"):
            self._emit(NodeEvent(self._sessions[rank].node, line=line))

    def _on_exit(self, rank: int, transport_rc: int) -> None:
        outcome = self._sessions[rank].outcome(transport_rc)
        outcome.worker = self._workers.get(rank)
        self.result.outcomes[rank] = outcome
        self._arrival.append(rank)
        self._set_state(rank, _final_state(outcome), outcome.status)
        if not outcome.ok and not outcome.stopped and not self._failing:
            self._failing = True
            # Which node failed first is decided once every node has ended (root_cause): the
            # first to end is often a peer of the cause, so none is named here.
            if outcome.connection_lost and self.stop_grace_s > LOST_NODE_GRACE_S:
                # The survivors of a lost node cannot finish anything collective (a checkpoint
                # save waits on the lost peer until the grace ends): a short grace, so the job
                # trains again sooner. What a rank saves alone in seconds still gets written.
                self.stop_grace_s = LOST_NODE_GRACE_S
            if self.in_state(NodeState.RUNNING):
                log.warning(
                    "a node failed; stopping the other nodes (SIGKILL after %g s)",
                    self.stop_grace_s,
                )
            self._stop_running()


def offset_file_name(rank: int) -> str:
    """A detached run's offset file for node `rank`, in the run directory: `ATTEMPT OFFSET`, the
    bytes of the node's output its controller has read (launcher.core.session)."""
    return f"node-{rank}.offset"


def read_offsets(run_dir: Path, attempt: int, ranks: Sequence[int]) -> dict[int, int]:
    """Where each node's stream of `attempt` resumes: the offsets its files keep (0 for a node
    without one, or whose file is an earlier attempt's)."""
    out = {}
    for rank in ranks:
        try:
            tag, offset = (run_dir / offset_file_name(rank)).read_text().split()
        except (OSError, ValueError):
            continue
        if int(tag) == attempt:
            out[rank] = int(offset)
    return out


def write_summary(result: LaunchResult, cluster: Cluster) -> None:
    """`launch.json` in the run directory: every node's exit, status and duration."""
    summary = {
        "job_id": result.job_id,
        "cluster": cluster.name,
        "exit_code": result.exit_code,
        "first_failure": result.first_failure,
        "nodes": [
            {
                "rank": o.node.rank,
                "host": o.node.host,
                "exit": o.exit_code,
                "status": o.status,
                "duration_s": round(o.duration_s, 3),
                "connection_lost": o.connection_lost,
            }
            for o in sorted(result.outcomes.values(), key=lambda o: o.node.rank)
        ],
    }
    # Written whole: `launch attach` reads a detached job's launch.json on node 0 as it ends.
    atomic.write_text(result.run_dir / "launch.json", json.dumps(summary, indent=2) + "\n")
