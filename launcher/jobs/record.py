"""Detached jobs' records: what a job is (`JobRecord`, `JobState`), where its record
lives on node 0, how it is written (atomically: a reader never sees half a file) and how a reader
tells a live job from one whose controller died.

A job's directory on node 0 is `~/.gpufleet/jobs/<id>/`:

    request.json   what was asked: the cluster and the launch config, --env values left out
    env.json       the --env values (mode 600), deleted once the nodes run (they reach them on
                   stdin); with --recover when the job ends, for a controller started again to relaunch
    state.json     the record: state, times, exit, the node that failed first and why
    output.log     every node's output as the attached launcher shows it: `[node N] line`; and
                   the controller's own lines, `[controller] TIME text` (CONTROLLER_PREFIX): each
                   recovery or restart with its reason, a hang verdict with its stacks, a
                   re-adoption, and last how and when the job ended
    node-N.log     node N's own log; launch.json: the summary (launcher.core.launch.write_summary)
    controller.log the controller's own messages
    node-N.offset  how many bytes of node N's output the controller has read (launcher.core.launch)
    controller.sh  the controller's start line; controller.lock: held by the live controller
    heartbeat      touched by the live controller every HEARTBEAT_S

The controller's pid and its start time (field 22 of /proc/PID/stat) are in the record, so a
reader can tell a controller that is still there from one killed with SIGKILL (or a rebooted
node 0). A record that says PENDING, RUNNING or RECOVERING whose controller is gone is shown as
such, `orphaned`, while the heartbeat is younger than the job's --controller-grace (its nodes keep
training and a controller started again re-adopts the job: launcher.jobs.adopt), else as FAILED.

The node-side programs readers run (list, logs, stop) are built here as pure functions; each
value that crosses a shell goes through `shlex.quote`.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launcher.core.types import Cluster, LaunchConfig, Node, Replication, SshConfig, UserError, Workload

# How the controller's own lines in a job's output.log begin (launcher.jobs.controller.Controller.say).
CONTROLLER_PREFIX = "[controller]"

__all__ = [
    "JobState",
    "JobRecord",
    "JOBS_DIR",
    "LIST_MARKER",
    "jobs_home",
    "process_start",
    "controller_alive",
    "request_json",
    "request_from_json",
    "check_job_id",
    "list_script",
    "parse_listing",
    "logs_script",
    "stop_script",
    "STOP_GRACE_FILE",
    "HEARTBEAT_FILE",
    "HEARTBEAT_S",
    "CONTROLLER_SH",
    "CONTROLLER_LOCK",
    "RESTARTED_MARKER",
    "restart_script",
    "SAMPLES_FILE",
    "samples_script",
]

# Relative to the home directory of the account on node 0 (the nodes' $HOME, never the client's).
JOBS_DIR = ".gpufleet/jobs"
# `launch stop --grace`: the stop's own SIGTERM-to-SIGKILL grace, in seconds, left in the job's
# directory for its controller to read when the SIGTERM arrives.
STOP_GRACE_FILE = "stop-grace"
# The job's own `launch top --record` (launcher.observe.job_metrics), sampled by its controller.
SAMPLES_FILE = "top.jsonl"
# Touched by a live controller every HEARTBEAT_S: when a dead one was last alive (the start of
# its nodes' --controller-grace, to a second or two).
HEARTBEAT_FILE = "heartbeat"
HEARTBEAT_S = 2.0
# The controller's start line, written by the hand-off: what restarts a dead one (`restart_script`).
CONTROLLER_SH = "controller.sh"
# Held by the job's live controller (flock): a second one started for it exits at once.
CONTROLLER_LOCK = "controller.lock"
# Printed by `restart_script` for each controller it started again.
RESTARTED_MARKER = "__GPUFLEET_RESTARTED__"
# Prefixes each record line of `list_script`'s output, so a login banner is never read as one.
LIST_MARKER = "__GPUFLEET_JOB__"

_JOB_ID_RE = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")  # launcher.core.types.new_job_id


class JobState(str, enum.Enum):
    """Where a detached job is. PENDING waits for earlier jobs on the same nodes (FIFO)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"  # --recover: a node failed; waiting for every node, then --resume
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def final(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


@dataclass
class JobRecord:
    """One job's `state.json`."""

    id: str
    state: JobState
    what: str  # the workload, as one line
    nodes: list[str]  # hosts, in rank order
    submitted: float  # when its controller started on node 0 (node 0's clock orders the queue)
    pid: int = 0  # the controller's
    pid_start: str = ""  # the controller's start time (/proc/PID/stat field 22)
    started: float | None = None
    ended: float | None = None
    exit: int | None = None
    failed_node: int | None = None  # rank of the node that failed first
    why: str = ""  # for FAILED/STOPPED: what happened, in one line
    reason: str = ""  # for FAILED: the cause as one word, where there is one (hang)
    tail: list[str] = field(default_factory=list)  # the failed node's last lines
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # launcher.jobs.recovery.Recovery, in order
    machine_type: str | None = None  # the nodes' (None: unknown), for the cost (launcher.jobs.goodput)
    states: list[dict[str, Any]] = field(default_factory=list)  # {at, state}: each change (launcher.jobs.goodput)
    marks: list[dict[str, Any]] = field(default_factory=list)  # progress and checkpoint marks (launcher.jobs.goodput)
    # --controller-grace: how long the nodes keep training with no controller (None: a record
    # from before it existed, whose nodes stopped with their controller).
    controller_grace_s: float | None = None
    # The attempt running now, for a controller that re-adopts it: {attempt, restart_reason,
    # nodes: [{rank, host, address, slots, name}]} (the nodes as this attempt ranked them).
    run: dict[str, Any] | None = None
    adoptions: list[dict[str, Any]] = field(default_factory=list)  # {at, pid, attached_s}: each re-adoption
    # --spares (launcher.jobs.spares): the idle nodes, prepared and checked, that take a lost
    # node's place; and the nodes swapped out since, until their check passes again. Hosts.
    spares: list[str] = field(default_factory=list)
    out: list[str] = field(default_factory=list)
    orphaned: bool = False  # as read: the controller is gone, the nodes wait for one (never saved True)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "JobRecord":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["state"] = JobState(known["state"])
        return cls(**known)

    @property
    def duration_s(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.time()) - self.started

    def seen_with(self, alive: bool, heartbeat_age_s: float | None = None) -> "JobRecord":
        """The record as a reader should show it. PENDING/RUNNING/RECOVERING with the controller
        gone: still so, `orphaned`, while its last sign of life (`heartbeat_age_s` ago) is within
        --controller-grace (its nodes keep training, waiting to be re-adopted); else FAILED (the
        nodes stopped themselves), never RUNNING forever."""
        if self.state.final or alive:
            return self
        grace = self.controller_grace_s
        d = self.to_json()
        if grace is not None and heartbeat_age_s is not None and heartbeat_age_s <= grace:
            d.update(orphaned=True)
            return JobRecord.from_json(d)
        d.update(state=JobState.FAILED.value, exit=self.exit if self.exit is not None else 1, why=self.orphan_why())
        return JobRecord.from_json(d)

    def orphan_why(self) -> str:
        """Why a job whose controller died and was not back in time failed, in one line."""
        if self.controller_grace_s is None:
            return (
                f"the controller (pid {self.pid}) died while the job was {self.state.value}; its nodes were "
                "stopped by their watchdogs"
            )
        return (
            f"no controller for more than --controller-grace {self.controller_grace_s:g} s (pid {self.pid} died "
            f"while the job was {self.state.value}): every node stopped its workers"
        )


def jobs_home() -> Path:
    """`~/.gpufleet/jobs` of this account: called on node 0, by the controller."""
    return Path(os.path.expanduser("~")) / JOBS_DIR


def process_start(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot), or None if no such
    process: with the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return None if fields[0] == "Z" else fields[19]


def controller_alive(record: JobRecord) -> bool:
    """Whether the record's controller still runs: its pid names a process that is not a zombie and
    started when the controller did (node 0's readers run the same test, `_alive_sh`)."""
    return bool(record.pid) and process_start(record.pid) == record.pid_start


# ---- the request: what the controller needs to run the same Launch ----


def request_json(
    cluster: Cluster,
    config: LaunchConfig,
    ssh: SshConfig,
    recover: dict[str, Any] | None = None,
    spares: tuple[Node, ...] = (),
) -> dict[str, Any]:
    """The request without secrets: --env values are left out (they go to env.json); `ssh` names
    the key and known_hosts by their paths relative to node 0's home; `recover`: --recover's
    settings (launcher.jobs.recovery.RecoverPolicy), None without it; `spares`: --spares' nodes,
    after the cluster's in the launch's order (launcher.jobs.spares)."""
    return {
        "recover": recover,
        "spares": [_node_json(n) for n in spares],
        "cluster": {
            "name": cluster.name,
            "machine_type": cluster.machine_type,
            "zone": cluster.zone,
            "project": cluster.project,
            "nodes": [_node_json(n) for n in cluster.nodes],
        },
        "workload": {"kind": config.workload.kind, "argv": list(config.workload.argv)},
        "config": {
            "nproc_per_node": config.nproc_per_node,
            "max_restarts": config.max_restarts,
            "rdzv_port": config.rdzv_port,
            "workdir": config.workdir,
            "nccl_debug": config.nccl_debug,
            "image_os": config.image_os,
            "python": config.python,
            "job_id": config.job_id,
            "check_versions": config.check_versions,
            "stop_grace_s": config.stop_grace_s,
            "hang_timeout_s": config.hang_timeout_s,
            "progress": config.progress,
            "controller_grace_s": config.controller_grace_s,
            "image": config.image,
            "env_keys": [k for k, _ in config.env],
            "prepared": list(config.prepared),
            "replication": config.replication.to_json() if config.replication else None,
            "fanout": config.fanout,
        },
        "ssh": {
            "user": ssh.user,
            "key": str(ssh.key),
            "options": list(ssh.options),
            "known_hosts": str(ssh.known_hosts),
        },
    }


def _node_json(n: Node) -> dict[str, Any]:
    return {"rank": n.rank, "host": n.host, "address": n.address, "slots": n.slots, "name": n.name}


def request_from_json(
    d: dict[str, Any], env: list[list[str]], home: Path, runs_dir: Path
) -> tuple[Cluster, LaunchConfig]:
    """The `Cluster` and `LaunchConfig` the controller runs: the client's, with node 0's key and
    known_hosts (under `home`) and runs directory."""
    c = d["cluster"]
    cluster = Cluster(c["name"], tuple(Node(**n) for n in c["nodes"]), c["machine_type"], c["zone"], c["project"])
    s = d["ssh"]
    ssh = SshConfig(
        user=s["user"], key=home / s["key"], options=tuple(s["options"]), known_hosts=home / s["known_hosts"]
    )
    cfg = {k: v for k, v in d["config"].items() if k != "env_keys"}
    cfg["prepared"] = tuple(cfg.get("prepared", ()))
    cfg["replication"] = Replication.from_json(cfg["replication"]) if cfg.get("replication") else None
    config = LaunchConfig(
        workload=Workload(d["workload"]["kind"], tuple(d["workload"]["argv"])),
        env=tuple((k, v) for k, v in env),
        runs_dir=runs_dir,
        ssh=ssh,
        **cfg,
    )
    return cluster, config


# ---- what readers run on node 0 ----


def check_job_id(job_id: str) -> str:
    if not _JOB_ID_RE.fullmatch(job_id):
        raise UserError(f"job id {job_id!r} is not a job id (like 20260101-120000-a1b2c3); `launch jobs` lists them")
    return job_id


def _job_dir(job_id: str) -> str:
    return f'"$HOME"/{JOBS_DIR}/{shlex.quote(check_job_id(job_id))}'


def _alive_sh(d: str) -> str:
    """Bash that sets `p` to the controller's pid from `$d/controller.pid` and `a` to 1 when that
    controller still runs (not a zombie, and started when the record says: a reused pid is not
    it), else 0: `controller_alive`'s test, for the node-side readers."""
    return (
        f'p=; t=; read -r p t < "{d}/controller.pid" 2>/dev/null; '
        'a=0; if [ -n "$p" ] && [ -r /proc/"$p"/stat ]; then '
        's=$(sed "s/.*) //" /proc/"$p"/stat); set -- $s; '
        'if [ "$1" != Z ] && [ "${20}" = "$t" ]; then a=1; fi; fi; '
    )


def list_script(job_id: str | None = None) -> str:
    """Print `LIST_MARKER alive age state.json-on-one-line` for each job (or the one job); `age`:
    seconds since a dead controller's last heartbeat (`-`: alive, or none)."""
    glob = _job_dir(job_id) if job_id else f'"$HOME"/{JOBS_DIR}/*'
    return (
        f"for d in {glob}; do [ -f \"$d/state.json\" ] || continue; "
        + _alive_sh("$d")
        + 'j=$(tr -d "\\n" < "$d/state.json"); h=-; '
        # Only a live job's dead controller has an age worth a fork (an ended job's is never read).
        + f'if [ "$a" = 0 ] && [ -f "$d/{HEARTBEAT_FILE}" ]; then case $j in *\'"state": "PENDING"\'*|'
        + '*\'"state": "RUNNING"\'*|*\'"state": "RECOVERING"\'*) '
        + f'h=$(( ${{EPOCHSECONDS:-$(date +%s)}} - $(stat -c %Y "$d/{HEARTBEAT_FILE}") ));; esac; fi; '
        + f'printf "%s %s %s %s\\n" {LIST_MARKER} "$a" "$h" "$j"; done'
    )


def parse_listing(text: str) -> list[JobRecord]:
    """`list_script`'s output as records (as readers should show them), newest first."""
    out = []
    for line in text.splitlines():
        if not line.startswith(LIST_MARKER + " "):
            continue
        try:
            _, alive, age, doc = line.split(" ", 3)
            out.append(JobRecord.from_json(json.loads(doc)).seen_with(alive == "1", None if age == "-" else float(age)))
        except (ValueError, KeyError, TypeError):
            continue  # a record from another version: skipped, never fatal to the listing
    return sorted(out, key=lambda r: (r.submitted, r.id), reverse=True)


def logs_script(job_id: str, node: int | None, follow: bool) -> str:
    """Print the job's whole stream (or one node's log); with `follow`, keep printing until the
    controller has exited. The job's state is read separately (`list_script`)."""
    d = _job_dir(job_id)
    name = "output.log" if node is None else f"node-{int(node)}.log"
    f = f'"$D"/{name}'
    head = f'D={d}; [ -d "$D" ] || {{ echo "no job {check_job_id(job_id)} on this node" >&2; exit 3; }}; '
    if not follow:
        return head + f"[ -f {f} ] && cat {f}; exit 0"
    # tail -F waits for a pending job's file to appear; --pid ends the follow with the controller.
    return head + (
        _alive_sh("$D") + f'if [ "$a" = 1 ]; then exec tail -n +1 -s 0.2 -F --pid="$p" {f} 2>/dev/null; '
        f"else [ -f {f} ] && cat {f}; fi; exit 0"
    )


def stop_script(job_id: str, grace_s: float | None = None) -> str:
    """SIGTERM the job's controller (checked by its start time), which stops every node and
    records STOPPED; prints `stopping`, or `ended` when there was nothing to stop. `grace_s`:
    this stop's SIGTERM-to-SIGKILL grace for every rank, instead of the job's --term-grace."""
    d = _job_dir(job_id)
    grace = f'printf "%s" {float(grace_s)!r} > "$D/{STOP_GRACE_FILE}"; ' if grace_s is not None else ""
    return (
        f'D={d}; [ -d "$D" ] || {{ echo "no job {check_job_id(job_id)} on this node" >&2; exit 3; }}; '
        + _alive_sh("$D")
        + f'if [ "$a" = 1 ]; then {grace}kill -TERM "$p" && echo stopping && exit 0; fi; '
        "echo ended"
    )


def restart_script(job_ids: list[str]) -> str:
    """Start again the dead controller of each job (its directory's CONTROLLER_SH, not while a
    controller holds CONTROLLER_LOCK), wait up to 10 s for it to run, and print `RESTARTED_MARKER
    ID` for each one that does; it re-adopts the job (launcher.jobs.controller)."""
    out = []
    for job_id in job_ids:
        d = _job_dir(job_id)
        out.append(
            f'D={d}; if [ -f "$D/{CONTROLLER_SH}" ] && flock -n "$D/{CONTROLLER_LOCK}" true; then '
            f'read -r o _ < "$D/controller.pid"; bash "$D/{CONTROLLER_SH}"; i=0; while [ $i -lt 100 ]; do '
            + _alive_sh("$D")
            + f'if [ "$a" = 1 ] && [ "$p" != "$o" ]; then echo {RESTARTED_MARKER} {shlex.quote(job_id)}; break; fi; '
            "sleep 0.1; i=$((i+1)); done; fi"
        )
    return "; ".join(out) + "; exit 0"


def samples_script(job_id: str) -> str:
    """The node-0 program that prints a job's samples (SAMPLES_FILE; nothing when it has none
    yet), or says on stderr that there is no such job (exit 3)."""
    return (
        f'D={_job_dir(job_id)}; [ -d "$D" ] || {{ echo "no job {job_id} on this node" >&2; exit 3; }}; '
        f'[ -f "$D"/{SAMPLES_FILE} ] && cat "$D"/{SAMPLES_FILE}; exit 0'
    )
