"""One node's part of a launch as data: the typed plan a person reads in a dry run and the node
agent will execute. Pure data, stdlib only (every side imports it: the launcher builds it, in
launcher.core.node_plan, and the node agent will read it on stdin).

A `NodePlan` says, for one node: who it is (node rank, host, address), which global ranks it
runs, the rank command (torchrun's or the plain command) and, with --image, the container it runs
in, the environment the launch adds (a value that travels on stdin, --env's, is `hidden`: its
name only), the checks before `go` (named, typed: `Check`), the prepare steps after it, and the
limits of the run (term grace, preemption watch, a detached job's controller grace).

`to_json()` / `from_json()` round-trip it; `schema` is `SCHEMA_VERSION`, and `from_json` refuses
another, so a node agent never guesses at a plan written for a different one. As torchx's
`dryrun()` returns the request `schedule()` then runs (pytorch/torchx, torchx/runner/api.py), the
plan is what a dry run shows and what the node's program is rendered from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "EnvSource",
    "EnvVar",
    "CheckKind",
    "Check",
    "PrepareKind",
    "PrepareStep",
    "PrologueKind",
    "PrologueStep",
    "Mount",
    "Container",
    "Limits",
    "NodePlan",
    "PlanError",
]

# Raised by `from_json` for a plan of another schema; bump it when a field changes meaning.
SCHEMA_VERSION = 2


class PlanError(ValueError):
    """A plan that cannot be read: another schema, or a field missing or of the wrong kind."""


class EnvSource(str, Enum):
    """Where a variable's value comes from."""

    LAUNCH = "launch"  # the launch's own: the machine type's NCCL profile, the host NIC, the job's
    STDIN = "stdin"  # the user's --env/--env-file: the value travels on stdin, never shown
    NODE = "node"  # resolved on the node itself (the host NIC the catalog cannot name)


@dataclass(frozen=True)
class EnvVar:
    """A variable the launch sets on the node. `value` is None where it is not known here (a
    value resolved on the node) or must not be shown (`hidden`: an --env value on stdin);
    `prepend`: a PATH-like variable whose value goes before the node's own."""

    name: str
    value: str | None
    source: EnvSource = EnvSource.LAUNCH
    prepend: bool = False

    def __post_init__(self) -> None:
        if self.source is EnvSource.STDIN and self.value is not None:
            raise ValueError(f"{self.name}: a value that travels on stdin is never part of a plan")

    @property
    def hidden(self) -> bool:
        return self.source is EnvSource.STDIN


class CheckKind(str, Enum):
    """What a node answers before `go` (launcher.core.program renders each as its check lines)."""

    NODE_FACTS = "node-facts"  # hostname, clock and the ready marker, compared across nodes
    TORCH_VERSION = "torch-version"  # target: the python whose torch version is compared
    WORKDIR = "workdir"  # target: --workdir, which must exist
    PREEMPTIBLE = "preemptible"  # whether the node is a Spot VM (a --term-grace above its notice)
    GPUS = "gpus"  # expect: the catalog's GPU count and model
    NIC = "nic"  # target: a NIC's name on the image; expect: its role and MTU
    RXDM = "rxdm"  # target: the receive-datapath manager's container, which must run
    RDZV_PORT = "rdzv-port"  # target: the rendezvous port, locked on node 0 for this job
    PHYSICAL_HOST = "physical-host"  # where the VM sits, from its metadata server (`launch hosts`, the rank order)


@dataclass(frozen=True)
class Check:
    """One named check: `kind`, what it looks at (`target`) and what it expects (`expect`)."""

    kind: CheckKind
    target: str = ""
    expect: str = ""


class PrepareKind(str, Enum):
    """What runs after `go` and before the rank command."""

    WORKDIR = "workdir"  # cd into path (--workdir, or the --sync directory)
    CODE = "code"  # path: gpufleet's code snapshot, which must be there (on PYTHONPATH)
    DIRECTORY = "directory"  # path: the job's directory (--sync), which must be there
    ENVIRONMENT = "environment"  # path: the prepared environment's python, which must be there
    PREPARED = "prepared"  # path: something else the launch prepared, which must be there
    LOCAL_DIR = "local-dir"  # path: the compile caches' key; the account's local directory, exported
    FR_ALIASES = "fr-aliases"  # path: the python whose torch, if 2.4-2.7, gets the flight recorder's older names


@dataclass(frozen=True)
class PrepareStep:
    kind: PrepareKind
    path: str


class PrologueKind(str, Enum):
    """What runs before everything else on the node."""

    HOLD = "hold"  # value: the job's hosts, comma-separated; the job's hold on the node (launcher.core.holds)
    AUTHORIZE = "authorize"  # value: the cluster key's authorized_keys line (a detached job's check)


@dataclass(frozen=True)
class PrologueStep:
    kind: PrologueKind
    value: str


@dataclass(frozen=True)
class Mount:
    """A bind mount of the container: `host` path at `container` path."""

    host: str
    container: str
    read_only: bool = False


@dataclass(frozen=True)
class Container:
    """--image: the rank command runs inside `image`, as container `name`, with the runtime's
    `run` options (`options`: flag and value pairs, mounts and -e names included) and the
    variables passed in by name (`env_names`). The runtime (docker, else podman) is picked on the
    node."""

    image: str
    name: str
    gpus: str  # "all" | "none"
    mounts: tuple[Mount, ...] = ()
    devices: tuple[str, ...] = ()
    env_names: tuple[str, ...] = ()
    options: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Limits:
    """How the run stops: SIGTERM to every rank, then SIGKILL after `term_grace_s`; a Spot
    preemption notice stops it too when `watch_preemption`; a detached job's ranks stop after
    `controller_grace_s` with no controller attached (None: attached, stopped when the session
    ends)."""

    term_grace_s: float
    watch_preemption: bool
    controller_grace_s: int | None = None


@dataclass(frozen=True)
class NodePlan:
    """One node's part of a launch (see the module docstring). `ranks`: the first and last
    global rank the node runs, None when torchrun's c10d rendezvous assigns them (--max-restarts)
    or the command is a plain one (`procs` processes, no RANK); `command`: the rank command;
    `argv`: what actually runs, `command` in its wrappers (the container's); `workload`:
    "torchrun" (`command` is torchrun's) or "exec" (a plain command)."""

    job_id: str
    attempt: int
    node_rank: int
    nnodes: int
    host: str
    address: str
    procs: int
    ranks: tuple[int, int] | None
    command: tuple[str, ...]
    argv: tuple[str, ...]
    workload: str
    env: tuple[EnvVar, ...] = ()
    checks: tuple[Check, ...] = ()
    prepare: tuple[PrepareStep, ...] = ()
    limits: Limits = field(default_factory=lambda: Limits(25.0, False))
    container: Container | None = None
    prologue: tuple[PrologueStep, ...] = ()  # what runs before everything (holding the nodes)
    head_address: str = ""  # node 0's address: the route to it names the host NIC where the catalog cannot
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.to_json())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodePlan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodePlan:
        if d.get("schema") != SCHEMA_VERSION:
            raise PlanError(f"plan schema {d.get('schema')!r}; this reads schema {SCHEMA_VERSION}")
        try:
            c = d["container"]
            return cls(
                **{k: d[k] for k in ("job_id", "attempt", "node_rank", "nnodes", "host", "address", "procs")},
                ranks=tuple(d["ranks"]) if d["ranks"] is not None else None,
                command=tuple(d["command"]),
                argv=tuple(d["argv"]),
                workload=d["workload"],
                env=tuple(EnvVar(e["name"], e["value"], EnvSource(e["source"]), e["prepend"]) for e in d["env"]),
                checks=tuple(Check(CheckKind(x["kind"]), x["target"], x["expect"]) for x in d["checks"]),
                prepare=tuple(PrepareStep(PrepareKind(p["kind"]), p["path"]) for p in d["prepare"]),
                limits=Limits(**d["limits"]),
                container=None if c is None else _container(c),
                prologue=tuple(PrologueStep(PrologueKind(p["kind"]), p["value"]) for p in d["prologue"]),
                head_address=d["head_address"],
                schema=d["schema"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"plan field missing or malformed: {e}") from None


def _container(c: dict[str, Any]) -> Container:
    return Container(
        image=c["image"],
        name=c["name"],
        gpus=c["gpus"],
        mounts=tuple(Mount(**m) for m in c["mounts"]),
        devices=tuple(c["devices"]),
        env_names=tuple(c["env_names"]),
        options=tuple((f, v) for f, v in c["options"]),
    )
