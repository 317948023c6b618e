"""Recovery without a person: what `--recover` asks for, and how the controller on
node 0 (launcher.jobs.controller) tells a failure it should recover from, and one it should not.

A detached training job started with `--recover` that fails because a node became unreachable,
was preempted (its workers got SIGTERM, saved a checkpoint and exited: workloads.train then
logs `PREEMPTED_TEXT` and exits 0 on every rank) or because a worker crashed, is relaunched by
its controller with `--resume` once every node passes the launch's own check again. It gives up
after `max_recoveries`, when a node is not back within `timeout_s`, or when a crash repeats at
the same step with the same error (a bug does not heal by restarting). With `--spares K`
(launcher.jobs.spares) a node lost, a hang's culprit, or a node its relaunch's check finds bad is
replaced by a spare at once instead of waited for; with no spare left, as above.

The policy and the reading of a failure are pure functions; `Recoverer` is the one stateful part:
it does the waiting and the relaunching for the controller, through the same `Launch`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TextIO

from gpufleet.health import gpu_error
from launcher.core.types import Cluster, LaunchConfig, LaunchResult, Node, UserError, Workload
from launcher.jobs.owner import JobOwner
from launcher.jobs.record import JobState
from launcher.jobs.restarts import (
    DEFAULT_NO_RESTART_EXIT_CODES,
    parse_exit_codes,
    program_error_line,
    restart_refusal,
    worker_exit_codes,
)
from launcher.jobs.spares import check_spares, swap_in, swap_line

if TYPE_CHECKING:  # imported where it runs: the controller's start stays light
    from launcher.core.launch import Launch, NodeEvent

__all__ = [
    "RecoverPolicy",
    "Recovery",
    "PREEMPTED_TEXT",
    "RESTART_REASON_VAR",
    "parse_duration",
    "RecoverRequest",
    "recover_policy",
    "resume_argv",
    "checkpoint_tiers",
    "step_of",
    "failure_of",
    "recovery_lines",
    "judged_bad",
    "bad_at_check",
    "Recoverer",
]

log = logging.getLogger("launcher")

# What workloads.train logs (rank 0) when a SIGTERM made it save and exit: the run is not done.
PREEMPTED_TEXT = "rerun with --resume to continue"
# What a relaunch on fewer nodes (--min-nodes) tells the workload, beside torchrun's new WORLD_SIZE.
RESTART_REASON_VAR = "GPUFLEET_RESTART_REASON"
# A launch's node state after a failed check -> why a spare takes that node's place (--spares).
_SWAP_WHY = {"unreachable": "unreachable", "failed": "check failed"}
# A failure's cause when its rank reported a failed GPU (gpufleet.health.gpu_error), and the
# swap's why: a spare takes that node's place before any check.
GPU_ERROR = "GPU error"
# A step line (`step 12/100 | loss ...`) or a resume (`resumed from DIR at step 12 ...`).
_STEP_RE = re.compile(r"(?:\bstep (\d+)/\d+ \||\bresumed from .* at step (\d+)\b)")
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*")


@dataclass(frozen=True)
class RecoverPolicy:
    """`--recover`'s settings, as they travel to node 0 in the job's request."""

    max_recoveries: int = 3
    timeout_s: float = 1800.0  # how long a node may take to come back, per recovery
    restart_stopped: bool = True  # start a TERMINATED instance again (launcher.cluster.restart_vms)
    api_endpoint: str | None = None  # the Compute Engine API's, when not the default (tests)
    # A user's own program (`launch run|exec`; launcher.jobs.restarts): restarts after a failed worker
    # or a hang; None for the built-in workload, whose every recovery counts in max_recoveries.
    max_restarts: int | None = None
    no_restart_exit_codes: tuple[int, ...] = (2,)  # a worker exit status never restarted
    resume: bool = True  # relaunch with workloads.train's --resume (the built-in workload)
    min_nodes: int | None = None  # go on with this many nodes or more when a lost one is not back in time
    spares: int = 0  # --spares: idle nodes that take a lost one's place at once (launcher.jobs.spares)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Recovery:
    """One recovery, as the job's record lists it."""

    at: float  # when the failure was seen (node 0's clock)
    node: int | None  # rank of the node that failed (or was not back), when known
    cause: str  # why, in one line
    step: int | None = None  # the last step the job logged before it failed
    waited_s: float | None = None  # from the failure to the relaunch (None: it never relaunched)
    signature: str = ""  # the failure's status and error lines: a repeat at the same step is a bug
    restarted: dict[str, str] = dataclasses.field(default_factory=dict)  # instance -> what start did
    reason: str = ""  # GPUFLEET_RESTART_REASON of the relaunch (launcher.jobs.restarts.REASONS)
    shrunk_to: int | None = None  # --min-nodes: the nodes it went on with, when some were not back
    swaps: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # --spares: launcher.jobs.spares.Swap

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Recovery":
        """A record's recovery; a field this version does not know (a newer controller's) is left out."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def parse_duration(text: str, flag: str = "--recover-timeout") -> float:
    """`90`, `90s`, `30m`, `2h`, `7d` in seconds; a bad value is a UserError naming `flag`."""
    m = _DURATION_RE.fullmatch(text)
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"{flag} {text!r} is not a duration; give seconds or a number with s, m, h or d (like 30m)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@dataclass(frozen=True)
class RecoverRequest:
    """What was asked about recovery, as given (None: not given); `recover_policy` checks it."""

    recover: bool = False
    max_recoveries: int | None = None
    recover_timeout: str | None = None  # a duration: 90, 90s, 30m, 2h
    restart_stopped: bool | None = None
    no_restart_exit_codes: str | None = None  # comma-separated exit statuses
    min_nodes: int | None = None
    api_endpoint: str | None = None  # the Compute Engine API's, when not the default (tests)
    max_restarts: int | None = None  # a user's own program's restarts (launch run/exec)
    spares: int | None = None  # --spares K (launcher.jobs.spares)

    def given(self) -> list[str]:
        """The recovery settings given, as their flags."""
        flags = (
            ("--max-recoveries", self.max_recoveries),
            ("--recover-timeout", self.recover_timeout),
            ("--restart-stopped/--no-restart-stopped", self.restart_stopped),
            ("--no-restart-exit-codes", self.no_restart_exit_codes),
            ("--min-nodes", self.min_nodes),
            ("--spares", self.spares),
        )
        return [flag for flag, value in flags if value is not None]


def recover_policy(
    asked: RecoverRequest, train_argv: tuple[str, ...], detach: bool, builtin: bool = True
) -> RecoverPolicy | None:
    """`--recover` and its settings, refused (one line, nothing started) where there is nothing
    to resume from or no controller to do it. `builtin`: the built-in workload (`launch train`),
    which needs a checkpoint tier (`checkpoint_tiers`) and is relaunched with --resume; a user's
    own program resumes from its own checkpoint (launcher.jobs.restarts)."""
    given = asked.given()
    if not asked.recover:
        if given:
            raise UserError(f"{given[0]} needs --recover; add --recover (with --detach) or drop {given[0]}")
        return None
    if not detach:
        raise UserError("--recover needs --detach: the job's controller recovers it; add --detach")
    codes = asked.no_restart_exit_codes
    no_restart = DEFAULT_NO_RESTART_EXIT_CODES if codes is None else parse_exit_codes(codes)
    if builtin and codes is not None:
        raise UserError(
            "--no-restart-exit-codes is for your own program (launch run/exec); launch train recovers "
            "the built-in workload by --max-recoveries: drop --no-restart-exit-codes"
        )
    if builtin and not checkpoint_tiers(train_argv):
        raise UserError(
            "--recover needs checkpoints to resume from among the training arguments: the durable tier "
            "(-- --checkpoint-dir DIR_OR_BUCKET --checkpoint-every K) or each node's own disk "
            "(-- --local-checkpoint-every N), or both; nothing was started"
        )
    n = asked.max_recoveries
    if n is not None and n < 1:
        raise UserError(f"--max-recoveries {n} must be at least 1")
    m = asked.min_nodes
    if m is not None and m < 1:
        raise UserError(f"--min-nodes {m} must be at least 1")
    check_spares(asked.spares)
    timeout = parse_duration(asked.recover_timeout) if asked.recover_timeout is not None else 1800.0
    restart = asked.restart_stopped is not False  # on by default with --recover
    return RecoverPolicy(
        max_recoveries=3 if n is None else n,
        timeout_s=timeout,
        restart_stopped=restart,
        api_endpoint=asked.api_endpoint if restart else None,
        max_restarts=None if builtin else int(asked.max_restarts or 0),
        no_restart_exit_codes=no_restart,
        resume=builtin,
        min_nodes=m,
        spares=asked.spares or 0,
    )


def _flag_value(argv: tuple[str, ...], flag: str) -> str | None:
    """The value the last `flag V` or `flag=V` of `argv` gives (as argparse keeps the last), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        elif a.startswith(f"{flag}="):
            value = a.partition("=")[2]
    return value


def checkpoint_tiers(train_argv: tuple[str, ...]) -> list[str]:
    """The checkpoint tiers workloads.train's arguments write, which a relaunch with --resume
    restores from (workloads.checkpoint.manager restore: the node's own local copies, a peer's,
    then --checkpoint-dir): `durable` for --checkpoint-dir, `local` for --local-checkpoint-every
    N other than 0 (0 turns the tier off; a value that is not a number is workloads.train's to refuse)."""
    tiers = []
    if _flag_value(train_argv, "--checkpoint-dir"):
        tiers.append("durable")
    every = _flag_value(train_argv, "--local-checkpoint-every")
    if every is not None:
        try:
            on = int(every) != 0
        except ValueError:
            on = True
        if on:
            tiers.append("local")
    return tiers


def resume_argv(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The training arguments with `--resume` (workloads.train's flag) added once: the relaunch
    restores the newest step its tiers hold (`checkpoint_tiers`), the local tier's included, since
    every attempt of a job writes under the same GPUFLEET_JOB_ID on each node."""
    return argv if "--resume" in argv else (*argv, "--resume")


def step_of(line: str) -> int | None:
    """The step a workloads.train line says the run is at (a step line, or a resume), else None."""
    m = _STEP_RE.search(line)
    return int(m.group(1) or m.group(2)) if m else None


def failure_of(result: LaunchResult, preempted: bool, step: int | None) -> Recovery | None:
    """The recovery a failed attempt calls for (None: it succeeded, or was stopped by a person).
    `preempted`: a node had a preemption notice during the attempt, which makes that the reason
    whatever the program's exit (launcher.jobs.restarts.REASONS)."""
    if result.signal is not None:
        return None
    now = time.time()
    if result.exit_code == 0:
        if not preempted:
            return None
        cause = "preempted: the workers got SIGTERM and saved a checkpoint"
        return Recovery(now, None, cause, step, reason="preempted")
    if result.hang is not None:  # the same hang at the same step twice is not retried
        return Recovery(now, result.hang.node, result.hang.verdict, step, signature=result.hang.reason, reason="hang")
    rank = result.first_failure
    o = result.outcomes.get(rank) if rank is not None else None
    # A node that vanished explains its peers' crashes (their collectives lost it), whichever of
    # the two the launch heard of first: name the lost node.
    lost = sorted(r for r, out in result.outcomes.items() if out.connection_lost)
    if lost and (o is None or not o.connection_lost):
        rank, o = lost[0], result.outcomes[lost[0]]
    if o is None:
        return Recovery(
            now,
            None,
            f"failed (exit {result.exit_code})",
            step,
            signature=f"exit {result.exit_code}",
            reason="preempted" if preempted else "worker-failed",
        )
    if o.connection_lost:
        cause = f"unreachable ({o.error or 'connection lost'})"
        return Recovery(now, rank, cause, step, reason="preempted" if preempted else "node-lost")
    # A GPU that failed (its rank says so: gpufleet.health.GPU_LOG_ERRORS) explains its peers'
    # collective errors too, whichever rank the launch heard of first: name its node.
    for r, out in sorted(result.outcomes.items()):
        if found := gpu_error([*out.error_lines, *out.tail]):
            cause = f"{GPU_ERROR} ({found[0]}): {found[1]}"
            return Recovery(now, r, cause, step, signature=cause, reason="preempted" if preempted else "worker-failed")
    # The crash in words: the program's own error line, else torchrun's account of the worker
    # (a SIGKILL prints nothing), else the last line that is not gpufleet's replicator's.
    own = [line for line in o.tail if not line.lstrip().startswith("replica: ")]
    last = (o.error_lines or ([o.worker.note] if o.worker else own[-1:]) or [""])[-1]
    cause = f"worker crash: {o.status}" + (f": {last}" if last else "")
    return Recovery(
        now,
        rank,
        cause,
        step,
        signature=" / ".join([o.status, *o.error_lines]),
        reason="preempted" if preempted else "worker-failed",
    )


def judged_bad(rec: Recovery) -> dict[int, str]:
    """{rank: why} of the node a failure has judged bad already, which a spare replaces before
    any check (--spares): a node lost (unreachable), a hang's culprit, or one whose rank reported
    a failed GPU; {} for anything else (a worker crash on a node that may be sound, a preemption
    that names no node yet)."""
    if rec.node is None:
        return {}
    if rec.reason == "hang":
        return {rec.node: "hang"}
    if rec.cause.startswith(GPU_ERROR):
        return {rec.node: GPU_ERROR}
    return {rec.node: "unreachable"} if rec.cause.startswith("unreachable") else {}


def bad_at_check(states: dict[int, str]) -> dict[int, str]:
    """{rank: why} of the nodes a relaunch's check found bad (launcher.core.launch.NodeState
    values by rank): unreachable, or its program refused after answering (`check failed`)."""
    return {r: _SWAP_WHY[v] for r, v in states.items() if v in _SWAP_WHY}


def recovery_lines(recoveries: list[dict[str, Any]]) -> list[str]:
    """A job record's recoveries, one line each: when, which node, why, how long until the relaunch."""
    out = []
    for k, d in enumerate(recoveries, 1):
        r = Recovery.from_json(d)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.at))
        node = f"node {r.node}" if r.node is not None else "a node"
        node += f" ({r.reason})" if r.reason else ""
        step = f" at step {r.step}" if r.step is not None else ""
        back = f"relaunched after {r.waited_s:.1f} s" if r.waited_s is not None else "not relaunched"
        started = "".join(f"; instance {name} {what}" for name, what in r.restarted.items())
        shrunk = f"; went on with {r.shrunk_to} nodes (--min-nodes)" if r.shrunk_to is not None else ""
        swapped = "".join(f"; swapped {swap_line(s)}" for s in r.swaps)
        out.append(f"recovery {k}: {when} {node}{step}: {r.cause}; {back}{started}{shrunk}{swapped}")
    return out


# ---- the controller's side: wait for the nodes, relaunch with --resume ----


class Recoverer:
    """Drives a detached job's recoveries for its controller (launcher.jobs.controller.Controller):
    record each failure (RECOVERING), wait until every node passes the launch's own check, then
    relaunch the same job with --resume, until it ends or the policy says stop. The Launch is
    the same one every launch runs; each relaunch attempt is one `Launch.run` whose check
    refuses (nothing started) while a node is not back."""

    def __init__(self, controller: JobOwner, cluster: Cluster, config: LaunchConfig, policy: RecoverPolicy):
        self.c = controller
        self.cluster = cluster
        self.policy = policy
        argv = resume_argv(config.workload.argv) if policy.resume else config.workload.argv
        self.config = dataclasses.replace(config, workload=Workload(config.workload.kind, argv))
        # --spares (launcher.jobs.spares): every node of the job in the launch's order, the world
        # first; which are spares now, and which were swapped out, the record keeps (a controller
        # that re-adopts the job reads them there).
        every = [*cluster.nodes, *(Node(**n) for n in controller.request.get("spares") or [])]
        self.order = [n.host for n in every]
        self.known = {n.host: n for n in every}
        # The request's ring, every node of the job in it: a node swapped out leaves the ring of the
        # attempts after (`_realign`), and takes its place in it again once it rejoins and is used.
        self.every_ring = config.replication

    @property
    def spares(self) -> tuple[Node, ...]:
        return tuple(self.known[h] for h in self.c.record.spares if h in self.known)

    def run(self, result: LaunchResult) -> int:
        """From a finished attempt's result to the job's exit status (the record says the rest)."""
        while True:
            if self.c.orphan_stopped:  # the nodes stopped themselves: no controller for --controller-grace
                return self.c.finish(result)
            rec = failure_of(result, self.c.preempted, self.c.last_step)
            if rec is None:
                return self.c.finish(result)
            refusal = self._refusal(rec, result)
            if refusal:
                return self._give_up(result, rec, refusal)
            self._begin(rec)
            attempt = self._relaunch(rec)
            if isinstance(attempt, int):
                return attempt
            result = attempt

    def resume(self) -> int:
        """Go on with the recovery the record says was under way when the job's controller died
        (launcher.jobs.adopt): wait for every node again, then relaunch."""
        if self.c.record.recoveries:
            rec = Recovery.from_json(self.c.record.recoveries[-1])
        else:
            rec = Recovery(time.time(), None, "the controller died as the job started", reason="node-lost")
        attempt = self._relaunch(rec)
        return attempt if isinstance(attempt, int) else self.run(attempt)

    def _refusal(self, rec: Recovery, result: LaunchResult) -> str:
        if self.policy.max_restarts is not None:  # a user's own program
            codes = worker_exit_codes(result, self.config.workload.kind == "torchrun")
            return restart_refusal(rec.reason, codes, self.c.record.recoveries, self.policy)
        done = [Recovery.from_json(r) for r in self.c.record.recoveries]
        if rec.signature and any(d.signature == rec.signature and d.step == rec.step for d in done):
            return (
                f"the same error at step {rec.step} as the last recovery's: not retried (a bug does not heal by "
                "restarting)"
            )
        if len(done) >= self.policy.max_recoveries:
            return f"gave up after {len(done)} recoveries (--max-recoveries {self.policy.max_recoveries})"
        return ""

    def _give_up(self, result: LaunchResult, rec: Recovery, refusal: str) -> int:
        self.c.record.recoveries.append(rec.to_json())
        node = f"node {rec.node}: " if rec.node is not None else ""
        why = f"{node}{rec.cause}; {refusal}"
        if result.exit_code == 0:  # preempted: every rank saved and exited 0, but the run is not done
            return self.c.end(JobState.FAILED, 1, why=why, node=rec.node)
        said = rec.signature.partition(" / ")[2]  # the node's own error lines, if it printed any
        if not said and self.policy.max_restarts is not None:
            said = program_error_line(result)
        return self.c.finish(result, note=(f": {said}" if said else "") + f"; {refusal}")

    def _begin(self, rec: Recovery) -> None:
        r = self.c.record
        r.recoveries.append(rec.to_json())
        r.state = JobState.RECOVERING
        r.why = self._why(rec)
        self.c.save()
        log.warning("job %s: %s; waiting for every node to pass its check, then relaunching", r.id, r.why)
        self.c.say(f"{r.why} (reason {rec.reason}); waiting for every node to pass its check, then relaunching")

    def _why(self, rec: Recovery) -> str:
        """The record's one line while recovering: which recovery, the node when known, the cause."""
        n = len(self.c.record.recoveries)
        node = f"node {rec.node}: " if rec.node is not None else ""
        if self.policy.max_restarts is None:
            return f"recovery {n} of {self.policy.max_recoveries}: {node}{rec.cause}"
        return f"attempt {n} after {rec.reason}: {node}{rec.cause}"

    def _note(self, **changes: Any) -> None:
        """Change the latest recovery in the record, and save it."""
        self.c.record.recoveries[-1].update(changes)
        self.c.save()

    def _relaunch(self, rec: Recovery) -> LaunchResult | int:
        """Poll with the launch's own check until every node passes, then run: the attempt's
        result, or the job's exit status when it ended here (stopped, or a node not back)."""
        from launcher.code.launch_tree import tree_for
        from launcher.core.launch import Interrupted, Launch
        from launcher.health.prestart import prestart_verdict

        t0 = time.monotonic()
        judged = judged_bad(rec)
        if judged and self.policy.spares:  # judged bad already: no check waits for it
            self._swap(rec, judged)
        while True:
            self.c.reset_attempt()
            # Built each try: --min-nodes may have shrunk the cluster and the config meanwhile
            # (its GPUFLEET_RESTART_REASON=shrunk, an --env value, wins over the reason here).
            config = dataclasses.replace(self.config, attempt=len(self.c.record.recoveries), restart_reason=rec.reason)
            with open(self.c.jobdir / "output.log", "a", buffering=1) as out:
                on_event = self._on_event(out, t0)
                launch = Launch(self.cluster, config, on_event=on_event, stop=self.c.stop, verdict=prestart_verdict)
                self.c.launch = launch
                try:
                    launch.tree = tree_for(self.cluster, config)  # --fanout: this attempt's own sessions
                    return launch.run(handle_signals=True)
                except UserError as e:
                    bad = launch.first_bad()
                    why = str(e)
                except Interrupted as e:
                    return self.c.end(JobState.STOPPED, 128 + e.signum, why="stopped while recovering")
            if rec.node is None and bad is not None:  # a preemption names no node until its check fails
                rec.node = bad
                self.c.record.why = self._why(rec)
                self._note(node=bad)
            self._restart_stopped(launch, rec)
            bad_now = bad_at_check({r: s.value for r, s in launch.states.items()})
            if bad_now and self.policy.spares and self._swap(rec, bad_now):
                continue  # at once: the spare's own check comes with the relaunch
            self._follow_moved(launch)
            waited = time.monotonic() - t0
            if waited > self.policy.timeout_s and self._shrink(launch, rec):
                continue
            if waited > self.policy.timeout_s:
                self._note(waited_s=None)
                label = f"node {bad}" if bad is not None else "a node"
                return self.c.end(
                    JobState.FAILED,
                    255,
                    node=bad,
                    why=f"{label} was not back within --recover-timeout {self.policy.timeout_s:.0f} s "
                    f"(recovery {len(self.c.record.recoveries)}, {rec.cause}): {why}",
                )
            if self.c.stop.wait(0.5):  # a node still down refuses at once (or after ConnectTimeout)
                return self.c.end(JobState.STOPPED, 128 + 15, why="stopped while recovering")

    def _swap(self, rec: Recovery, lost: dict[int, str]) -> bool:
        """--spares: put a spare in place of each lost rank while spares last (when none is
        left, the nodes swapped out earlier are checked again first: one that passes is a spare
        again). The world keeps its size; ranks follow the job's order (launcher.jobs.spares).
        False: no spare to swap in."""
        if not self.spares:
            self._rejoin()
        before = [n.host for n in self.cluster.nodes]
        world, left, swaps = swap_in(self.order, self.cluster.nodes, lost, self.spares)
        if not swaps:
            return False
        r = self.c.record
        self.cluster = dataclasses.replace(self.cluster, nodes=world)
        r.nodes = [n.host for n in world]
        r.spares = [n.host for n in left]
        r.out = [*r.out, *(s.out for s in swaps)]
        rec.swaps.extend(s.to_json() for s in swaps)
        self._note(swaps=list(rec.swaps))
        for s in swaps:
            line = swap_line(s.to_json())
            self.c.say(f"swapped {line}; {len(left)} spare{'s' * (len(left) != 1)} left; relaunching at once")
            log.warning("job %s: swapped %s", r.id, line)
        # A stopped VM (a Spot preemption) swapped out is started again, so it may rejoin the spares.
        self._start_instances(rec, [self.known[s.out].name for s in swaps])
        if self.config.replication is not None:
            self._realign(before, {s.out for s in swaps}, left)
        return True

    def _realign(self, before: list[str], gone: set[str], spares: tuple[Node, ...]) -> None:
        """The local tier after a swap (launcher.jobs.realign): each rank's data moved to its new
        node when the swap did not leave it there, and the replica ring set to the new world."""
        from launcher.jobs.realign import aligned, askable, current_ring, realign

        rep = self.config.replication
        assert rep is not None
        ring = [h for h, _ in rep.ring]
        now = [n.host for n in self.cluster.nodes]
        out = set(self.c.record.out)
        assert self.every_ring is not None
        new = current_ring(self.every_ring, self.cluster.nodes, spares, out)
        self.config = dataclasses.replace(self.config, replication=new)
        if aligned(before, now, ring, gone):
            return
        # `out` holds this swap's nodes too (`_swap` added them before calling this).
        asked = [self.known[h] for h in askable(self.order, out) if h in self.known]
        realign(self.cluster, self.cluster.nodes, asked, self.config, self.c.say)

    def _rejoin(self) -> None:
        """Check each node swapped out with the launch's own check, one at a time; each that
        passes joins the spares (the record says so, and the job's log)."""
        from launcher.core.launch import Launch
        from launcher.core.preflight import check_probes
        from launcher.core.program import env_stdin, node_commands
        from launcher.health.prestart import prestart_verdict

        r = self.c.record
        for host in list(r.out):
            node = self.known.get(host)
            if node is None or self.c.stop.is_set():
                continue
            one = dataclasses.replace(self.cluster, nodes=(dataclasses.replace(node, rank=0),))
            try:
                probes = Launch(one, self.config, stop=self.c.stop).ask(
                    node_commands(one, self.config), env_stdin(self.config)
                )
                for p in probes.values():
                    p.facts.pop("port", None)  # alone it would be the rendezvous; the job's is elsewhere
                check_probes(one, probes, self.config, prestart_verdict)
            except Exception as e:  # not back, or not healthy: it stays out
                log.info("job %s: node %s is still out of service: %s", r.id, host, e)
                continue
            r.out = [h for h in r.out if h != host]
            r.spares = [*r.spares, host]
            self.c.save()
            said = f"node {host} passes its check again: it is a spare again"
            if self.config.replication is not None:  # its local copies are from before it was lost
                from launcher.jobs.realign import forget

                gone = forget(self.cluster, node, self.config)
                if gone:
                    said += f"; its local copies of the job (steps {gone[0]}-{gone[-1]}, from before) are removed"
            self.c.say(said)

    def _restart_stopped(self, launch: Launch, rec: Recovery) -> None:
        """Start the unreachable nodes' instances that Compute Engine stopped (once each per
        recovery), when the request knows where they are and --restart-stopped is on."""
        by_rank = {n.rank: n for n in self.cluster.nodes}
        self._start_instances(rec, [by_rank[r].name for r, s in launch.states.items() if s.value == "unreachable"])

    def _start_instances(self, rec: Recovery, names: list[str]) -> None:
        """Compute Engine `instances.start` on the named instances it stopped, once each per
        recovery, when the request knows where they are and --restart-stopped is on."""
        c = self.cluster
        if not (self.policy.restart_stopped and c.project and c.zone):
            return
        names = [n for n in names if n and n not in rec.restarted]
        if not names:
            return
        from launcher.cluster.restart_vms import instances_client, start_terminated

        try:
            done = start_terminated(instances_client(self.policy.api_endpoint), c.project, c.zone, names)
        except Exception as e:  # no google-cloud-compute on node 0, no credentials: say so, keep waiting
            done = dict.fromkeys(names, f"could not be started: {type(e).__name__}: {e}")
        rec.restarted.update(done)
        self._note(restarted=dict(rec.restarted))
        for name, what in done.items():
            self.c.say(f"instance {name} {what} (--restart-stopped)")

    def _shrink(self, launch: Launch, rec: Recovery) -> bool:
        """--min-nodes: leave out the nodes that are not back in time and go on with the others
        (renumbered in their order, node 0 of it the rendezvous master), when that leaves at least
        --min-nodes. The workload gets torchrun's new WORLD_SIZE and GPUFLEET_RESTART_REASON=shrunk;
        the built-in one reshards its DCP checkpoint on load. False: it may not shrink."""
        missing = {r for r, s in launch.states.items() if s.value in ("unreachable", "failed")}
        kept = [n for n in self.cluster.nodes if n.rank not in missing]
        if self.policy.min_nodes is None or not missing or not kept or len(kept) < self.policy.min_nodes:
            return False
        gone = ", ".join(n.label for n in self.cluster.nodes if n.rank in missing)
        self.cluster = dataclasses.replace(
            self.cluster, nodes=tuple(dataclasses.replace(n, rank=i) for i, n in enumerate(kept))
        )
        env = [(k, v) for k, v in self.config.env if k != RESTART_REASON_VAR]
        self.config = dataclasses.replace(self.config, env=(*env, (RESTART_REASON_VAR, "shrunk")))
        self.c.record.nodes = [n.host for n in kept]
        rec.shrunk_to = len(kept)
        self._note(shrunk_to=len(kept))
        self.c.say(
            f"{gone} not back within --recover-timeout {self.policy.timeout_s:.0f} s; going on with {len(kept)} "
            f"nodes (--min-nodes {self.policy.min_nodes}), restart reason shrunk"
        )
        log.warning(
            "job %s: %s not back within --recover-timeout %.0f s; going on with %d nodes (--min-nodes %d)",
            self.c.record.id,
            gone,
            self.policy.timeout_s,
            len(kept),
            self.policy.min_nodes,
        )
        return True

    def _follow_moved(self, launch: Launch) -> None:
        """Unreachable nodes whose instance is now at another address (a restart gave it a new
        one) are reached there, with the host keys the Compute Engine API publishes for it
        (launcher.cluster.host_keys); the request must know where they are, as for --restart-stopped."""
        c = self.cluster
        ranks = [r for r, s in launch.states.items() if s.value == "unreachable" and c.nodes[r].name]
        if not (ranks and self.policy.restart_stopped and c.project and c.zone):
            return
        from launcher.cluster.host_keys import follow_moved
        from launcher.cluster.restart_vms import instances_client

        ports = [int(o.split("=", 1)[1]) for o in self.config.ssh.options if o.startswith("Port=")]
        try:
            client = instances_client(self.policy.api_endpoint)
        except Exception as e:  # no google-cloud-compute where the controller runs: say so, keep waiting
            log.warning("cannot ask the Compute Engine API where unreachable nodes are: %s: %s", type(e).__name__, e)
            return
        moved = follow_moved(client, c, ranks, self.config.ssh.known_hosts, ports[0] if ports else 22)
        if moved != c:
            for old, new in zip(c.nodes, moved.nodes):
                if new.host != old.host:
                    self.c.say(
                        f"node {old.rank} ({old.name}) moved from {old.host} to {new.host}; reached there with "
                        "the host keys its guest attributes publish"
                    )
            self.cluster = moved
            self.c.record.nodes = [n.host for n in moved.nodes]
            self.c.save()

    def _on_event(self, out: TextIO, t0: float) -> Callable[[NodeEvent], None]:
        started = []

        def on_event(event: NodeEvent) -> None:
            self.c.on_event(out, event)
            if event.state is not None and event.state.value == "running" and not started:
                started.append(True)
                self.c.record.state = JobState.RUNNING
                self._note(waited_s=round(time.monotonic() - t0, 3))
                log.warning("job %s: relaunched after %.1f s", self.c.record.id, time.monotonic() - t0)
                cfg = self.c.launch.config if self.c.launch is not None else self.config
                self.c.say(
                    f"relaunched after {time.monotonic() - t0:.1f} s: attempt {cfg.attempt} on "
                    f"{len(self.cluster.nodes)} nodes (GPUFLEET_RESTART_REASON={cfg.restart_reason})"
                )

        return on_event
