"""The launcher's types: what was asked (`LaunchConfig`), what exists (`Cluster` of `Node`s), and
what happened (`LaunchResult`, with outcomes and failures keyed by node).

Vocabulary (the same as gpufleet.catalog):
- *node*: one machine (a VM, a simulated namespace, or one process group under `--local`).
- *rank* of a node: its position in the cluster's order (the node source's, or the topology's:
  launcher.cluster.topology); node 0 hosts the rendezvous, and the node's program sees it as
  GPUFLEET_NODE_RANK and as torchrun's group rank (a static rendezvous: `--node-rank`), so the
  workers of node i hold the global ranks after node i-1's, and RANK 0 is on node 0.
- *local rank*: a process's index among the `nproc_per_node` processes torchrun starts on a node.
"""

from __future__ import annotations

import re
import secrets
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from gpufleet.catalog import lookup
from launcher.core.container import check_image_ref

__all__ = [
    "UserError",
    "Node",
    "ControllerHost",
    "Cluster",
    "Workload",
    "SshConfig",
    "LaunchConfig",
    "WorkerFailure",
    "NodeOutcome",
    "LaunchResult",
    "Hang",
    "EXIT_CONNECTION_LOST",
    "EXIT_HANG",
    "EXIT_USER_ERROR",
    "new_job_id",
]

# The launcher's own exit codes. 2 = a usage error (click's convention); 255 = what ssh returns
# when the connection itself failed, used when a node became unreachable mid-run.
EXIT_USER_ERROR = 2
EXIT_CONNECTION_LOST = 255
# The launch stopped a job that made no progress for --hang-timeout (timeout(1)'s status).
EXIT_HANG = 124


class UserError(Exception):
    """A problem with what the user asked for. str() is one line naming the culprit and the fix.

    The CLI prints it in red and exits 2; nothing has run on any node when it is raised.
    """


# A host is a DNS name or an IPv4/IPv6 address, optionally user@; nothing a shell would read.
_HOST_RE = re.compile(r"(?:[A-Za-z0-9._-]+@)?(?:[A-Za-z0-9._-]+|\[?[0-9A-Fa-f:.]+\]?)")


@dataclass(frozen=True)
class Node:
    """One machine of the cluster, with its rank (its position; rank 0 hosts the rendezvous)."""

    rank: int
    host: str  # what ssh connects to (name or address)
    address: str  # the address other nodes reach it at (the rendezvous endpoint for rank 0)
    slots: int | None = None  # processes per node from a hostfile `slots=N`; None = default
    name: str = ""  # the instance name when known (stack outputs, Compute Engine API)

    def __post_init__(self) -> None:
        if not _HOST_RE.fullmatch(self.host) or self.host.startswith("-"):
            raise UserError(
                f"host {self.host!r} is not a valid host name or address; "
                "use letters, digits, '.', '-', '_' (or an IP address)"
            )

    @property
    def label(self) -> str:
        return f"node {self.rank} ({self.host})"


@dataclass(frozen=True)
class ControllerHost:
    """The host that runs the cluster's detached jobs' controllers and keeps their records: the
    stack's controller VM, `--controller HOST` or a hostfile's `controller HOST` line. It is not a
    node: no workload runs there, and losing any node loses no job."""

    host: str  # what ssh connects to
    address: str  # the address it reaches the nodes from (authorized in their `from=`)
    name: str = ""  # the instance name when known (stack outputs)

    def __post_init__(self) -> None:
        if not _HOST_RE.fullmatch(self.host) or self.host.startswith("-"):
            raise UserError(
                f"controller host {self.host!r} is not a valid host name or address; "
                "use letters, digits, '.', '-', '_' (or an IP address)"
            )

    @property
    def label(self) -> str:
        return f"the controller ({self.host})"


@dataclass(frozen=True)
class Cluster:
    """The nodes found, in rank order, and what is known about their machine type."""

    name: str
    nodes: tuple[Node, ...]
    machine_type: str | None = None  # None: unknown (hostfile without --machine-type, --local)
    zone: str | None = None
    project: str | None = None
    local: bool = False  # nodes are process groups on this machine, not SSH hosts
    controller: ControllerHost | None = None  # None: node 0 runs detached jobs' controllers
    package_index: str | None = None  # the stack output packageIndex: where nodes get packages
    image: str | None = None  # the stack's default container image (its `image` output), if any
    boot_os: str | None = None  # what the nodes boot ("ubuntu" | "cos", the `bootImage` output); None: unknown
    spares: int = 0  # the stack's `spares` output: --spares' default for a detached --recover job

    def __post_init__(self) -> None:
        if not self.nodes:
            raise UserError(f"cluster {self.name!r} has no nodes; check the node source")
        hosts = [n.host for n in self.nodes]
        dupes = sorted({h for h in hosts if hosts.count(h) > 1})
        if dupes and not self.local:
            raise UserError(f"host {dupes[0]!r} is listed more than once; each node must appear once")
        c = self.controller
        if c is not None:
            worker = next((n for n in self.nodes if {n.host, n.address} & {c.host, c.address}), None)
            if worker is not None:
                raise UserError(
                    f"controller {c.host} is also {worker.label}: a controller on a worker is lost with it; "
                    "name a host that runs no workload (--controller HOST), or leave it out to keep node 0 "
                    "in the role"
                )

    def select(self, node_count: int | None, exclude: tuple[str, ...] = ()) -> "Cluster":
        """Drop `exclude`d hosts, then keep the first `node_count` (`--nodes N`), renumbering
        ranks from 0."""
        known = {n.host for n in self.nodes} | {n.name for n in self.nodes if n.name}
        unknown = [h for h in exclude if h not in known]
        if unknown:
            raise UserError(
                f"--exclude names {', '.join(unknown)}, which is not among the "
                f"{len(self.nodes)} nodes found; run `launch hosts` to list them"
            )
        kept = [n for n in self.nodes if n.host not in exclude and n.name not in exclude]
        if node_count is not None:
            if node_count < 1:
                raise UserError(f"--nodes {node_count} is not allowed; ask for at least 1 node")
            if node_count > len(kept):
                raise UserError(
                    f"--nodes {node_count} asks for more nodes than exist: {len(kept)} found"
                    + (" after --exclude" if exclude else "")
                    + f" in {self.name!r}"
                )
            kept = kept[:node_count]
        if not kept:
            raise UserError("--exclude removed every node; nothing left to run on")
        renumbered = tuple(
            Node(rank=i, host=n.host, address=n.address, slots=n.slots, name=n.name) for i, n in enumerate(kept)
        )
        return replace(self, nodes=renumbered)

    @property
    def gpus_per_node(self) -> int | None:
        """The catalog's GPU count for the machine type; None when it is unknown or the nodes are
        local process groups. Raises UnknownMachineType for a type the catalog does not know."""
        if self.machine_type is None or self.local:
            return None
        return lookup(self.machine_type).gpu_count


@dataclass(frozen=True)
class Workload:
    """What runs on each node. kind: "torchrun" (argv after torchrun's own flags) or "exec"."""

    kind: str
    argv: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("torchrun", "exec"):
            raise ValueError(f"workload kind {self.kind!r}")
        if not self.argv:
            raise UserError("nothing to run: give a command after `--`, e.g. `launch exec -- hostname`")


@dataclass(frozen=True)
class SshConfig:
    """How to reach the nodes with the OpenSSH client."""

    user: str | None = None
    key: Path | None = None
    options: tuple[str, ...] = ()  # extra `-o Key=Value` values, given first so they win
    known_hosts: Path | None = None  # default: one file per cluster under the state dir
    iap: bool = False  # ProxyCommand through `gcloud compute start-iap-tunnel`
    zone: str | None = None  # for --iap
    connect_timeout: int = 10
    concurrency: int = 8  # sshd's default MaxStartups is 10:30:100; stay below 10
    control_persist: str = "10m"
    # "yes" where known_hosts holds every node's published keys (launcher.cluster.host_keys);
    # "accept-new" (trust on first use, a changed key refused) where nothing publishes them.
    host_key_checking: str = "accept-new"


def new_job_id() -> str:
    """Sortable and unique: the rendezvous id, the run directory and the node-side token."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class Replication:
    """How a --recover job's nodes copy their local checkpoints to each other (gpufleet.replica),
    set by the preparation (launcher.code.prepare) that gave every node the cluster's replica key.
    `ring`: each node of the job (spares included) as (host, `user@address` another node reaches
    it at), in the job's order once the launch's plan has fixed it (`in_order`); each node sends
    its own ranks to the next, the last to the first. `state`: where the key and known_hosts are
    on the nodes; `code`: gpufleet's code there."""

    ring: tuple[tuple[str, str], ...]
    port: int
    state: str
    code: str

    def in_order(self, nodes: "tuple[Node, ...]") -> "Replication":
        """The ring in `nodes`' order (the plan's), any node not among them after them."""
        hop, given = dict(self.ring), {n.host for n in nodes}
        first = tuple((n.host, hop[n.host]) for n in nodes if n.host in hop)
        rest = tuple(r for r in self.ring if r[0] not in given)
        return replace(self, ring=first + rest)

    def peers(self, host: str) -> tuple[str, ...]:
        """The nodes `host` sends to, in the order it tries them: the ring's next node first."""
        hosts = [h for h, _ in self.ring]
        if host not in hosts or len(hosts) < 2:
            return ()
        i = hosts.index(host)
        return tuple(hop for _, hop in (self.ring[i + 1 :] + self.ring[:i]))

    def to_json(self) -> dict:
        return {"ring": [list(r) for r in self.ring], "port": self.port, "state": self.state, "code": self.code}

    @classmethod
    def from_json(cls, d: dict) -> "Replication":
        return cls(tuple((str(h), str(p)) for h, p in d["ring"]), int(d["port"]), str(d["state"]), str(d["code"]))


@dataclass(frozen=True)
class LaunchConfig:
    """What the user asked for (the typed request), built by the CLI and handed to a
    `launcher.core.launch.Launch`."""

    workload: Workload
    nproc_per_node: int | None = None  # None: the catalog's GPU count, or 1 on CPU / unknown
    max_restarts: int = 0
    rdzv_port: int = 29500
    workdir: str | None = None  # where the command runs on each node; None = the login dir
    env: tuple[tuple[str, str], ...] = ()  # --env KEY=VAL overrides, in order
    nccl_debug: bool = False
    image_os: str | None = None  # "ubuntu" | "cos"; None = the machine type's default
    python: str = "python3"  # the python on the nodes (torchrun runs as `python -m torch.distributed.run`)
    job_id: str = ""
    runs_dir: Path = Path("runs")
    dry_run: bool = False
    ssh: SshConfig = field(default_factory=SshConfig)
    check_versions: bool = True  # compare torch versions across nodes in the pre-flight
    # --term-grace: SIGTERM to SIGKILL for every rank when a launch stops (or a preemption notice
    # comes): inside Compute Engine's 30 s notice (https://cloud.google.com/compute/docs/instances/spot#preemption-process).
    stop_grace_s: float = 25.0
    attempt: int = 0  # GPUFLEET_ATTEMPT: 0, then 1, 2, ... for each relaunch of a --recover job
    restart_reason: str = ""  # GPUFLEET_RESTART_REASON of a relaunch (launcher.jobs.restarts.REASONS)
    # "topology" | "given"; None: topology when every node reports a physical host, else given
    # (launcher.cluster.topology.launch_order). Decided once, before the nodes' commands are built.
    rank_order: str | None = None
    hang_timeout_s: float | None = None  # --hang-timeout: stop after this long without progress
    progress: str | None = None  # --progress: the regex a progress line matches (None: any line)
    # --controller-grace, a detached job's: its nodes' workloads outlive the controller's SSH
    # sessions (launcher.core.supervise) and stop themselves after this long with no controller.
    # None: an attached launch, whose nodes stop at once when their session ends.
    controller_grace_s: int | None = None
    # What launcher.code prepared on every node for this job (its directory, gpufleet's code, its
    # environment), as absolute paths: the node program's `prepared` step checks each is there
    # before the run, so a recovery on a node that lost its disk names what is missing.
    prepared: tuple[str, ...] = ()
    # --image: every node runs the ranks inside this container image (launcher.core.container);
    # None: on the node itself.
    image: str | None = None
    # A --recover job's peer copies of its local checkpoints (gpufleet.replica); None: none.
    replication: Replication | None = None
    # --fanout: the launch goes down a tree of the nodes, each passing it on to this many
    # (launcher.code.launch_tree); None: one session per node from the launching machine.
    fanout: int | None = None
    # --output of an attached launch down a tree: the nodes whose lines it does not show live keep
    # their output on the node (launcher.code.launch_tree); None or "all": every line comes up.
    output: str | None = None

    def __post_init__(self) -> None:
        if self.image is not None:
            try:
                check_image_ref(self.image)
            except ValueError as e:
                raise UserError(str(e)) from None
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node {self.nproc_per_node} must be at least 1")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts {self.max_restarts} must be 0 or more")
        if not 1024 <= self.rdzv_port <= 65535:
            raise UserError(f"--rdzv-port {self.rdzv_port} must be between 1024 and 65535")
        if self.stop_grace_s <= 0:
            raise UserError(f"--term-grace {self.stop_grace_s:g} s must be more than 0; give a duration like 25s")
        if self.controller_grace_s is not None and self.controller_grace_s < 1:
            raise UserError(
                f"--controller-grace {self.controller_grace_s} s must be at least 1 s; give a duration like 10m"
            )
        if self.image_os not in (None, "ubuntu", "cos"):
            raise UserError(f"--image-os {self.image_os!r} is unknown; one of: ubuntu, cos")
        if self.fanout is not None and self.fanout < 1:
            raise UserError(f"--fanout {self.fanout}: each node passes the launch on to K others; give 1 or more")
        if self.rank_order not in (None, "topology", "given"):
            raise UserError(f"--rank-order {self.rank_order!r} is unknown; one of: topology, given")

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.job_id


class WorkerFailure(NamedTuple):
    """A worker process torchrun saw fail: its `exitcode` as torchrun reports it (negative: the
    signal that killed it)."""

    exitcode: int
    local_rank: int
    pid: int

    @property
    def status(self) -> int:
        """The exit status a shell would report for the worker: 128 + N when killed by signal N."""
        return 128 - self.exitcode if self.exitcode < 0 else self.exitcode

    @property
    def note(self) -> str:
        """In words: "worker local_rank 0 (pid 7) exit 2", "... killed by SIGKILL"."""
        if self.exitcode < 0:
            try:
                how = f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                how = f"killed by signal {-self.exitcode}"
        else:
            how = f"exit {self.exitcode}"
        return f"worker local_rank {self.local_rank} (pid {self.pid}) {how}"


@dataclass
class NodeOutcome:
    """What happened on one node."""

    node: Node
    exit_code: int | None = None  # the remote command's status; None = never finished
    duration_s: float = 0.0
    connection_lost: bool = False  # the SSH connection dropped before the command reported
    # Down a tree (--fanout): lost because the node that passed the launch on to it was (that
    # node's rank); None: lost itself, or not lost.
    cut_off_by: int | None = None
    stopped: bool = False  # the launcher stopped it because another node failed or on a signal
    error: str = ""  # the transport's own message (ssh's stderr) when connection_lost
    tail: list[str] = field(default_factory=list)  # last output lines
    # Lines the node's program printed as its own error ("error: ..."), kept apart from the tail
    # because torchrun's failure summary that follows can push them out of the last 20 lines.
    error_lines: list[str] = field(default_factory=list)
    reported_error_before_stop: bool = False  # an error line came before the launcher stopped it
    # The worker failure that ended this node's run, as torchrun reported it (launcher.core.output.worker_failure),
    # leaving out a worker killed by the launcher's own stop; None: none, or not torchrun.
    worker: WorkerFailure | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.connection_lost

    @property
    def status(self) -> str:
        if self.connection_lost:
            return "unreachable (connection lost)"
        if self.exit_code is None:
            return "not started"
        if self.stopped and self.exit_code != 0:
            return f"stopped ({self.exit_code})"
        if self.exit_code > 128:
            return f"exit {self.exit_code} (signal {self.exit_code - 128})"
        return f"exit {self.exit_code}"


@dataclass(frozen=True)
class Hang:
    """The launch stopped the job for want of progress (--hang-timeout, launcher.core.hang)."""

    verdict: str  # one line naming the culprit (launcher.core.stacks.verdict)
    node: int | None = None  # rank of the node of the first rank it names, when it names one
    stacks_dir: Path | None = None  # where the stacks were written
    reason: str = "hang"  # the word a job record and a restart give for it


@dataclass
class LaunchResult:
    """What happened on every node, and which failed first."""

    job_id: str
    run_dir: Path
    outcomes: dict[int, NodeOutcome]  # by node rank
    first_failure: int | None = None  # rank of the node that failed first
    signal: int | None = None  # SIGINT/SIGTERM received by the launcher
    # The exit status of the first worker torchrun reported failed for good (no restarts left),
    # before the launcher stopped anything: the status when the first failure's own is unknown.
    first_worker_status: int | None = None
    hang: Hang | None = None  # set when the launch stopped a hung job

    @property
    def failures(self) -> dict[Node, NodeOutcome]:
        return {o.node: o for o in self.outcomes.values() if not o.ok and not o.stopped}

    @property
    def exit_code(self) -> int:
        """The root cause's status: the failed worker's own (torchrun itself exits 1 for any
        worker failure), not the SIGTERM of nodes the launcher stopped after it."""
        if self.signal is not None:
            return 128 + self.signal
        if self.hang is not None:
            return EXIT_HANG
        if self.first_failure is None:
            return 0
        first = self.outcomes[self.first_failure]
        if first.connection_lost:
            return EXIT_CONNECTION_LOST
        if first.worker is not None:
            return first.worker.status
        if self.first_worker_status is not None:
            return self.first_worker_status
        return first.exit_code or 1
