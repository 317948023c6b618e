"""Running a workload on every node: check, start, stream, stop, report.

`launch(cluster, config)` is the one library call the CLI makes. It logs (logging) and returns a
`LaunchResult`; rendering is the CLI's business. Events for a live display go to `on_event`.

It opens one SSH session per node (a bounded number of handshakes at a time); each node checks
itself (the pre-flight) and waits, and only when every node has passed does the launcher tell
them all to go (launcher.command). `launch hosts` uses `preflight`, the check alone.

Stopping is cooperative first: the launcher closes each node's stdin, and the node-side wrapper
(launcher.command.remote_script) stops its own process tree. A node that cannot be told (its
connection is gone) is simply dropped; its wrapper sees the same EOF when the connection closes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import secrets
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.catalog import lookup

from launcher.command import (
    CHECKED_MARKER,
    EXIT_MARKER,
    nproc_for,
    probe_script,
    remote_command,
    remote_script,
    ssh_argv,
    ssh_base_argv,
    torchrun_argv,
)
from launcher.env import node_env
from launcher.model import Cluster, LaunchConfig, LaunchResult, Node, NodeOutcome, UserError

__all__ = [
    "Transport",
    "Probe",
    "Interrupted",
    "new_job_id",
    "state_dir",
    "make_transport",
    "preflight",
    "handshake_limit",
    "check_probes",
    "node_commands",
    "worker_failure_note",
    "root_cause",
    "launch",
]

log = logging.getLogger("launcher")

Event = Callable[[str, int, str], None]  # (kind, node rank, text)


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived before any workload started; nothing is running."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def new_job_id() -> str:
    """Sortable and unique: the rendezvous id, the run directory and the node-side token."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def state_dir() -> Path:
    """Where per-cluster known_hosts files live (GPUFLEET_STATE_DIR, else ~/.cache/gpufleet)."""
    base = os.environ.get("GPUFLEET_STATE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpufleet")
    return Path(base)


@dataclass
class Transport:
    """Turns a node-side bash program into an argv: ssh to the node, or bash here (--local)."""

    local: bool
    ssh_base: list[str] = field(default_factory=list)

    def argv(self, node: Node, script: str) -> list[str]:
        if self.local:
            return ["bash", "--norc", "--noprofile", "-c", script]
        return ssh_argv(self.ssh_base, node, remote_command(script))

    def display(self, node: Node, script: str) -> str:
        """The exact command that would run over SSH (for --dry-run)."""
        return script if self.local else remote_command(script)


def make_transport(cluster: Cluster, config: LaunchConfig) -> Transport:
    if cluster.local:
        return Transport(local=True)
    ssh = config.ssh
    if ssh.iap and not ssh.zone:
        raise UserError("--iap needs the nodes' zone: pass --zone (stack outputs carry it)")
    key = hashlib.sha256(f"{cluster.name}|{cluster.project}|{cluster.zone}".encode()).hexdigest()[:10]
    known = ssh.known_hosts or state_dir() / "known_hosts" / f"{cluster.name}-{key}"
    # ControlPath must fit a unix socket path (108 bytes): keep it short, per user and cluster.
    control = Path(f"/tmp/gpufleet-ssh-{os.getuid()}") / key
    if not config.dry_run:
        Path(known).parent.mkdir(parents=True, exist_ok=True)
        control.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Transport(local=False, ssh_base=ssh_base_argv(ssh, str(control), str(known)))


# ---- pre-flight ----------------------------------------------------------------------------


@dataclass
class Probe:
    """What the pre-flight learned about one node."""

    node: Node
    ok: bool
    error: str = ""
    facts: dict[str, str] = field(default_factory=dict)
    skew_s: float | None = None  # how far the node's clock is outside the probe's time window


# Handshakes in flight when every connection goes to a different sshd (no bastion or proxy).
DIRECT_CONCURRENCY = 32


def _through_gateway(transport: Transport, node: Node, config: LaunchConfig) -> bool:
    """Whether connections share one sshd on the way (IAP, ProxyJump, ProxyCommand from the
    options or ~/.ssh/config): then sshd's MaxStartups (default 10:30:100, sshd_config(5))
    applies to all of them together and `ssh.concurrency` (8) bounds them."""
    if config.ssh.iap:
        return True
    try:
        out = subprocess.run([*transport.ssh_base, "-G", node.host], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return True
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key in ("proxyjump", "proxycommand") and value.strip() not in ("", "none"):
            return True
    return False


def handshake_limit(cluster: Cluster, config: LaunchConfig, transport: Transport) -> int:
    """How many nodes may be mid-handshake at once. sshd's MaxStartups limits unauthenticated
    connections per sshd: through one gateway they all count against it (`ssh.concurrency`);
    going straight to the nodes, each node's sshd sees one connection from us, so more."""
    workers = config.ssh.concurrency
    if not transport.local and not _through_gateway(transport, cluster.nodes[0], config):
        workers = max(workers, min(len(cluster.nodes), DIRECT_CONCURRENCY))
    return max(1, workers)


def _probe_timeout(config: LaunchConfig) -> float:
    # The handshake, plus the check itself (reading torch's version on a busy node).
    return config.ssh.connect_timeout + 20.0


def _skew(facts: dict[str, str], t0: float, t1: float) -> float | None:
    """How far the node's clock (its `time=` line) lies outside [t0, t1], when it was asked and
    when it answered: with agreeing clocks it falls inside, whatever the latency, so the distance
    outside is a lower bound on the skew."""
    try:
        remote = float(facts.get("time", ""))
    except ValueError:
        return None
    return remote - min(max(remote, t0), t1)


def preflight(
    cluster: Cluster,
    config: LaunchConfig,
    transport: Transport,
    check_torch: bool,
    stop: threading.Event | None = None,
    on_event: Event | None = None,
) -> dict[int, Probe]:
    """The check alone on every node (what `launch hosts` shows): the sessions a launch opens,
    ended after the check instead of told to go."""
    script = probe_script(config, check_torch)
    runs: dict[int, _NodeRun] = {}
    try:
        _check_all(cluster, config, transport, dict.fromkeys((n.rank for n in cluster.nodes), script),
                   runs, queue.Queue(), stop or threading.Event(), on_event or (lambda kind, rank, text: None))
        return {r: run.probe() for r, run in runs.items()}
    finally:
        _cancel_all(runs)


def check_probes(cluster: Cluster, probes: dict[int, Probe], config: LaunchConfig) -> list[str]:
    """Raise one UserError naming every node that cannot run; return warnings for the rest."""
    bad = [p for p in probes.values() if not p.ok]
    if bad:
        listed = "; ".join(f"{p.node.label}: {p.error}" for p in bad)
        raise UserError(f"{len(bad)} of {len(cluster.nodes)} nodes cannot be reached, nothing was "
                        f"started: {listed}. Check the address, --ssh-user/--ssh-key, or --exclude them")
    head = probes.get(0)
    if head and head.facts.get("port", "free").startswith("busy"):
        other = head.facts["port"].partition(":")[2] or "unknown"
        raise UserError(f"rendezvous port {config.rdzv_port} on {head.node.label} is in use by "
                        f"another launch (job {other}); nothing was started. Wait for it, or pass "
                        "--rdzv-port with a free port")
    missing_wd = [p.node.label for p in probes.values() if p.facts.get("workdir") == "missing"]
    if missing_wd:
        raise UserError(f"--workdir {config.workdir!r} does not exist on {', '.join(missing_wd)}; nothing "
                        "was started. Create it there or pass another --workdir")
    torch = {r: p.facts["torch"] for r, p in probes.items() if "torch" in p.facts}
    if torch:
        no_torch = [probes[r].node.label for r, v in torch.items() if v == "missing"]
        if no_torch:
            raise UserError(f"torch is not installed for {config.python!r} on {', '.join(no_torch)}; nothing "
                            "was started. Install it there or pass --python with the right interpreter")
        versions = sorted(set(torch.values()))
        if len(versions) > 1:
            by = "; ".join(f"{probes[r].node.label}: {v}" for r, v in sorted(torch.items()))
            raise UserError(f"torch versions differ across nodes ({by}); nothing was started. Every "
                            "node must run the same version")
    warnings = []
    skews = {r: p.skew_s for r, p in probes.items() if p.skew_s is not None}
    for r, s in sorted(skews.items()):
        # Beyond a couple of seconds, log timestamps and timeouts stop lining up across nodes.
        if abs(s) > 2.0:
            warnings.append(f"{probes[r].node.label}: clock differs from this machine by {s:+.1f} s "
                            "(check chrony/NTP on the node)")
    for r, p in sorted(probes.items()):
        host = p.facts.get("host", "")
        expect = p.node.name or ("" if _is_ip(p.node.address) or cluster.local else p.node.host)
        if expect and host and host.split(".")[0] != expect.split(".")[0].split("@")[-1]:
            warnings.append(f"{p.node.label}: hostname is {host!r}, expected {expect!r} "
                            "(is the host list stale?)")
    hosts = [p.facts.get("host") for p in probes.values()]
    if not cluster.local and len(hosts) > 1 and len(set(hosts)) == 1 and cluster.machine_type:
        warnings.append(f"every node reports the same hostname {hosts[0]!r}: are they one machine?")
    return warnings


def _is_ip(a: str) -> bool:
    return a.replace(".", "").isdigit() or ":" in a


# ---- the run ----------------------------------------------------------------------------


def node_commands(cluster: Cluster, config: LaunchConfig, transport: Transport) -> dict[int, str]:
    """The node-side program for every node (pure; what --dry-run prints)."""
    wl = config.workload
    # A plain command gets only the user's --env; the NCCL profile is for torchrun workloads.
    env = node_env(cluster, config) if wl.kind == "torchrun" else dict(config.env)
    gpus = None
    if cluster.machine_type and not cluster.local:
        gpus = lookup(cluster.machine_type).gpu_count
    out = {}
    for node in cluster.nodes:
        if wl.kind == "torchrun":
            nproc = nproc_for(node, gpus, config)
            argv = torchrun_argv(cluster, node, config, nproc, wl.argv)
            lock = config.rdzv_port if node.rank == 0 else None
        else:
            argv, lock = list(wl.argv), None
        torchrun = wl.kind == "torchrun"
        out[node.rank] = remote_script(cluster, node, config, env, argv, lock_port=lock, check=torchrun,
                                       check_torch=torchrun and config.check_versions)
    return out


# torchrun's agent logs a failed worker at ERROR level, also when it is about to restart the
# group (torch/distributed/elastic/multiprocessing/api.py): "failed (exitcode: -9) local_rank: 0
# (pid: 123) of binary: ...". Its "will restart worker group" line is INFO, hidden by default.
_WORKER_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def worker_failure_note(line: str) -> str | None:
    """What a torchrun worker-failure line means, in words ("exit 1", "killed by SIGKILL")."""
    m = _WORKER_FAILED_RE.search(line)
    if not m:
        return None
    code, local_rank = int(m.group(1)), m.group(2)
    if code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit {code}"
    return f"worker local_rank {local_rank} (pid {m.group(3)}) {how}"


# A program's own one-line error, as workloads.train and this launcher's node-side wrapper print
# them ("error: ...", "gpufleet: ..."): a statement of the cause, not a consequence.
_ERROR_LINE_RE = re.compile(r"^(error|gpufleet): ")


def root_cause(outcomes: dict[int, NodeOutcome], arrival: list[int]) -> int | None:
    """Which node to name as having failed first.

    Arrival order alone misleads: when one rank fails, its peers' collectives fail too (gloo
    "Connection reset by peer", an abort), and a peer's torchrun may report before the failing
    node's does. So: a node that became unreachable first; then a node whose program said what
    went wrong (an error line) before the launcher stopped it; then the first to exit."""
    def rank_of(r: int) -> tuple[int, int]:
        o = outcomes[r]
        kind = 0 if o.connection_lost else 1 if o.reported_error_before_stop else 2
        return kind, arrival.index(r)

    candidates = [r for r in arrival if not outcomes[r].ok and
                  (not outcomes[r].stopped or outcomes[r].reported_error_before_stop)]
    return min(candidates, key=rank_of) if candidates else None


class _NodeRun:
    """One node's SSH session: its check half (key=value lines up to CHECKED_MARKER), then, after
    `go`, its output, streamed as events and written to its log."""

    def __init__(self, node: Node, argv: list[str], events: queue.Queue):
        self.node = node
        self.outcome = NodeOutcome(node)
        self.facts: dict[str, str] = {}
        self.asked_at = time.time()  # with checked_at, the window for the clock-skew bound
        self.checked_at: float | None = None
        self.timed_out: float | None = None  # the check's timeout, when it ran out
        self.tail: deque[str] = deque(maxlen=20)
        self.err: deque[str] = deque(maxlen=5)
        self.error_lines: deque[str] = deque(maxlen=3)
        self.error_at: float | None = None  # when the first error line arrived
        self.marker: int | None = None
        self.start = time.monotonic()
        self.started = False
        self.stopping = False
        self.stop_sent_at: float | None = None
        self._log = None
        self._events = events
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches only the launcher, which stops in order
        )
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, False), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, True), daemon=True),
        ]
        for t in self._threads:
            t.start()
        threading.Thread(target=self._reap, daemon=True).start()

    def _pump(self, stream, is_err: bool) -> None:
        for raw in iter(stream.readline, b""):
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not self.started:
                # The check half: facts on stdout (anything else there, e.g. a banner printed by
                # the login shell, is not ours); stderr kept for the error message.
                if is_err:
                    self.err.append(text)
                elif text == CHECKED_MARKER:
                    self.checked_at = time.time()
                    self._events.put(("checked", self.node.rank, ""))
                else:
                    key, eq, value = text.partition("=")
                    if eq:
                        self.facts[key] = value
                continue
            if not is_err and EXIT_MARKER in text:
                before, _, after = text.partition(EXIT_MARKER)
                try:
                    self.marker = int(after.split()[0])
                except (ValueError, IndexError):
                    pass
                if not before:
                    continue
                text = before
            self._log.write(text.encode() + b"\n")
            self._log.flush()
            self.tail.append(text)
            if is_err:
                self.err.append(text)
            if _ERROR_LINE_RE.match(text):
                self.error_lines.append(text)
                if self.error_at is None:
                    self.error_at = time.monotonic()
            self._events.put(("line", self.node.rank, text))

    def _reap(self) -> None:
        rc = self.proc.wait()
        for t in self._threads:
            t.join()
        if self._log is not None:
            self._log.close()
        self._events.put(("exit", self.node.rank, str(rc)))

    def probe(self) -> Probe:
        """What the check half found. A node that exited after its check has a reason in its
        facts (a busy rendezvous port) or is as good as unreachable."""
        rc = self.proc.poll()
        busy = self.facts.get("port", "").startswith("busy")
        if self.checked_at is None or (rc is not None and not busy):
            if self.timed_out is not None:
                why = f"no answer within {self.timed_out:.0f} s"
            else:
                why = self.err[-1] if self.err else f"exit {rc}" if rc is not None else "no answer"
            return Probe(self.node, False, why)
        return Probe(self.node, True, facts=dict(self.facts),
                     skew_s=_skew(self.facts, self.asked_at, self.checked_at))

    def go(self, logfile: Path) -> None:
        """Start the workload: the node has passed its check and every other node has too."""
        self._log = open(logfile, "ab")
        self.start = time.monotonic()
        self.started = True
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # the connection is gone: its exit event says so

    def cancel(self) -> None:
        """Before `go`: end the session without running anything. A node still in its
        handshake is cut off (nothing runs there yet); one waiting for `go` reads end of input
        and exits."""
        if self.checked_at is None:
            self.force()
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def finish(self, transport_rc: int) -> NodeOutcome:
        o = self.outcome
        o.duration_s = time.monotonic() - self.start
        o.tail = list(self.tail)
        o.stopped = self.stopping
        o.error_lines = list(self.error_lines)
        o.reported_error_before_stop = self.error_at is not None and (
            self.stop_sent_at is None or self.error_at <= self.stop_sent_at)
        # The trailing blank line the wrapper prints before its marker is not output.
        if o.tail and o.tail[-1] == "":
            o.tail.pop()
        if self.marker is not None:
            o.exit_code = self.marker
        elif transport_rc != 255 or self.stopping:
            # No marker but no transport error either: the wrapper itself failed to start, or
            # we stopped a node whose connection we then cut.
            o.exit_code = transport_rc
        else:
            o.connection_lost = True
            o.exit_code = transport_rc
            o.error = self.err[-1] if self.err else "the connection closed without an exit status"
        return o

    def request_stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.stop_sent_at = time.monotonic()
        try:
            self.proc.stdin.close()  # the node-side watchdog reads EOF and stops the tree
        except OSError:
            pass

    def force(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def launch(
    cluster: Cluster,
    config: LaunchConfig,
    on_event: Event | None = None,
    handle_signals: bool = True,
    stop: threading.Event | None = None,
) -> LaunchResult:
    """Check every node, start the workload on all of them, stream, stop on the first failure,
    and report. Raises UserError (nothing started) or Interrupted (nothing started)."""
    emit = on_event or (lambda kind, rank, text: None)
    transport = make_transport(cluster, config)
    scripts = node_commands(cluster, config, transport)
    # A caller running several launches at once (the bad-node finder) shares one stop event.
    stop = stop or threading.Event()
    received: list[int] = []

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        received.append(signum)
        stop.set()

    previous = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    events: queue.Queue = queue.Queue()
    runs: dict[int, _NodeRun] = {}
    started = False
    try:
        _check_all(cluster, config, transport, scripts, runs, events, stop, emit)
        if stop.is_set():
            raise Interrupted(received[0] if received else signal.SIGINT)
        probes = {r: run.probe() for r, run in runs.items()}
        for w in check_probes(cluster, probes, config):
            log.warning(w)
        try:
            config.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the run directory {config.run_dir}: {e.strerror}; nothing was "
                            "started. Pass --runs-dir with a directory you can write") from None
        started = True
        return _run(cluster, config, runs, events, stop, received, emit)
    finally:
        if not started:
            _cancel_all(runs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_all(cluster, config, transport, scripts, runs, events, stop, emit) -> None:
    """Open every node's session, a bounded number of handshakes at a time, until each node has
    passed its check half (and waits for `go`), ended, or run out of time."""
    limit = handshake_limit(cluster, config, transport)
    timeout = _probe_timeout(config)
    pending = deque(cluster.nodes)
    waiting: dict[int, float] = {}  # rank -> deadline, for sessions not yet checked
    done: set[int] = set()
    exits = []  # sessions that ended while checking: the run loop reads their exit events too
    while len(done) < len(cluster.nodes) and not stop.is_set():
        while pending and len(waiting) < limit:
            node = pending.popleft()
            runs[node.rank] = _NodeRun(node, transport.argv(node, scripts[node.rank]), events)
            waiting[node.rank] = time.monotonic() + timeout
        try:
            event = events.get(timeout=0.2)
        except queue.Empty:
            now = time.monotonic()
            for r, deadline in list(waiting.items()):
                if now > deadline and runs[r].timed_out is None:
                    runs[r].timed_out = timeout
                    runs[r].force()  # its exit event follows
            continue
        kind, rank, _ = event
        if kind == "exit":
            exits.append(event)
        if rank not in done:
            waiting.pop(rank, None)
            done.add(rank)
            probe = runs[rank].probe()
            emit("checked", rank, "ok" if probe.ok else probe.error)
    for event in exits:
        events.put(event)


def _cancel_all(runs: dict[int, "_NodeRun"], wait_s: float = 3.0) -> None:
    """End every session before `go`, and wait (briefly) for them to go away."""
    for run in runs.values():
        run.cancel()
    deadline = time.monotonic() + wait_s
    for run in runs.values():
        try:
            run.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.force()


def _run(cluster, config, runs, events, stop, received, emit) -> LaunchResult:
    run_dir = config.run_dir
    result = LaunchResult(config.job_id, run_dir, {})
    for rank, run in runs.items():
        run.go(run_dir / f"node-{rank}.log")
        emit("started", rank, run.node.host)
    running = set(runs)
    force_after = config.stop_grace_s + 4.0
    torchrun = config.workload.kind == "torchrun"
    failures_seen: dict[int, int] = {}
    arrival: list[int] = []  # ranks in the order their commands ended
    failed = False

    def stop_all() -> None:
        for r in running:
            runs[r].request_stop()

    while running:
        if stop.is_set() and result.signal is None:
            result.signal = received[0] if received else signal.SIGINT
            log.warning("received %s: stopping every node", signal.Signals(result.signal).name)
            stop_all()
        try:
            kind, rank, text = events.get(timeout=0.2)
        except queue.Empty:
            now = time.monotonic()
            for r in list(running):
                nr = runs[r]
                if nr.stop_sent_at is not None and now - nr.stop_sent_at > force_after:
                    nr.force()
            continue
        if kind == "checked":
            continue
        if kind == "line":
            emit("line", rank, text)
            note = worker_failure_note(text) if torchrun else None
            if note and not stop.is_set() and not failed:
                failures_seen[rank] = failures_seen.get(rank, 0) + 1
                node = runs[rank].node
                if failures_seen[rank] <= config.max_restarts:
                    log.warning("%s: %s; torchrun restarts the workers on every node (restart %d of "
                                "--max-restarts %d; they resume from the latest checkpoint if the "
                                "workload has one)", node.label, note, failures_seen[rank],
                                config.max_restarts)
                else:
                    log.warning("%s: %s; no restarts left (--max-restarts %d)", node.label, note,
                                config.max_restarts)
            continue
        if rank not in running:
            continue
        running.discard(rank)
        outcome = runs[rank].finish(int(text))
        result.outcomes[rank] = outcome
        arrival.append(rank)
        emit("exit", rank, outcome.status)
        if not outcome.ok and not outcome.stopped and not failed:
            failed = True
            what = outcome.status if not outcome.connection_lost else f"unreachable: {outcome.error}"
            log.error("%s failed (%s); stopping the other nodes", outcome.node.label, what)
            stop_all()
    if failed:
        result.first_failure = root_cause(result.outcomes, arrival)
    _write_summary(result, cluster)
    return result


def _write_summary(result: LaunchResult, cluster: Cluster) -> None:
    summary = {
        "job_id": result.job_id,
        "cluster": cluster.name,
        "exit_code": result.exit_code,
        "first_failure": result.first_failure,
        "nodes": [
            {"rank": o.node.rank, "host": o.node.host, "exit": o.exit_code, "status": o.status,
             "duration_s": round(o.duration_s, 3), "connection_lost": o.connection_lost}
            for o in sorted(result.outcomes.values(), key=lambda o: o.node.rank)
        ],
    }
    (result.run_dir / "launch.json").write_text(json.dumps(summary, indent=2) + "\n")
