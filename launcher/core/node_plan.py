"""The typed pieces of a node's plan (gpufleet.node_plan), filled from a launch's `Cluster` and
`LaunchConfig`. Pure: no network, no processes.

launcher.core.program's `NodeProgram.plan()` gathers them, with the rank command, into the
node's `NodePlan`, which the node runs (launcher.core.node_start, launcher.core.node_run): what a
dry run shows is what the node runs. The container's part is read back from the very
argv the program runs (`container_of`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpufleet.contracts import RXDM_CONTAINER
from gpufleet.nccl_env import PREPEND_PATH_VARS
from gpufleet.node_plan import Check, CheckKind, Container, EnvSource, EnvVar, Mount, PrepareKind, PrepareStep
from launcher.core.container import CONTAINER_ARGV0
from launcher.core.env import HOST_IFACE_ON_NODE
from launcher.core.prestart import expectation
from launcher.core.types import Cluster

__all__ = ["env_vars", "fact_checks", "hardware_checks", "prepare_steps", "rank_ranges", "container_of"]


def env_vars(env: Mapping[str, str], from_stdin: Sequence[str]) -> list[EnvVar]:
    """The launch's variables in the order the program sets them: its own values (`env`, less
    the keys read from stdin and those resolved on the node), then the --env keys read from stdin
    (`from_stdin`, their values hidden), then the ones resolved on the node (HOST_IFACE_ON_NODE)."""
    own = [
        EnvVar(k, v, EnvSource.LAUNCH, k in PREPEND_PATH_VARS)
        for k, v in env.items()
        if v != HOST_IFACE_ON_NODE and k not in from_stdin
    ]
    hidden = [EnvVar(k, None, EnvSource.STDIN, k in PREPEND_PATH_VARS) for k in from_stdin]
    node = [EnvVar(k, None, EnvSource.NODE) for k, v in env.items() if v == HOST_IFACE_ON_NODE]
    return [*own, *hidden, *node]


def fact_checks(python: str, workdir: str | None, facts: bool, torch: bool) -> list[Check]:
    """The node facts a launch compares across nodes (`facts`), the torch version of `python`
    (`torch`), and whether `workdir` exists."""
    out = [Check(CheckKind.NODE_FACTS, expect="same clock, ready marker")] if facts else []
    if torch:
        out.append(Check(CheckKind.TORCH_VERSION, python, "the same on every node"))
    if workdir:
        out.append(Check(CheckKind.WORKDIR, workdir, "exists"))
    return out


def hardware_checks(cluster: Cluster, image_os: str | None) -> list[Check]:
    """The cheap part of `launch doctor`, which launcher.core.node_start answers (`launch doctor`'s
    script, launcher.health.script, asks the same, from the same `expectation`): GPUs, each NIC,
    RxDM on GPUDirect-TCPX/TCPXO nodes; none without a machine type or on --local nodes."""
    if cluster.machine_type is None or cluster.local:
        return []
    e = expectation(cluster.machine_type, image_os)
    out = [Check(CheckKind.GPUS, expect=f"{e.gpu_count} x {e.gpu_model}")]
    out += [Check(CheckKind.NIC, name, f"{role}, up" + (f", mtu {mtu}" if mtu else "")) for name, role, mtu in e.nics]
    if e.rxdm:
        out.append(Check(CheckKind.RXDM, RXDM_CONTAINER, f"running ({e.net_stack} needs it)"))
    return out


def prepare_steps(
    workdir: str | None, python: str, prepared: Sequence[str], env: Mapping[str, str]
) -> list[PrepareStep]:
    """After `go`: `cd workdir` (--workdir), then each path launcher.code `prepared` checked (named
    by what it is: gpufleet's code on PYTHONPATH, the --sync directory, the environment's
    `python`)."""
    out = [PrepareStep(PrepareKind.WORKDIR, workdir)] if workdir else []
    code = set(env.get("PYTHONPATH", "").split(":"))
    for path in prepared:
        if path in code:
            kind = PrepareKind.CODE
        elif path == workdir:
            kind = PrepareKind.DIRECTORY
        elif path == python:
            kind = PrepareKind.ENVIRONMENT
        else:
            kind = PrepareKind.PREPARED
        out.append(PrepareStep(kind, path))
    return out


def rank_ranges(
    commands: Mapping[int, Sequence[str]], torchrun: bool, static: bool
) -> dict[int, tuple[int, tuple[int, int] | None]]:
    """By node rank: (processes, (first, last) global rank), read from each node's rank command
    (`commands`, in rank order): torchrun's --nproc-per-node. A `static` rendezvous numbers the
    ranks in node order (RANK = the processes of the nodes before it plus LOCAL_RANK); c10d
    (--max-restarts) assigns them at the rendezvous, and a plain command (not `torchrun`) has one
    process and no RANK: None."""
    if not torchrun:
        return {rank: (1, None) for rank in commands}
    out, first = {}, 0
    for rank, argv in commands.items():
        procs = next(int(a.partition("=")[2]) for a in argv if a.startswith("--nproc-per-node="))
        out[rank] = (procs, (first, first + procs - 1) if static else None)
        first += procs
    return out


def container_of(argv: Sequence[str]) -> tuple[Container | None, list[str]]:
    """(the container `argv` runs its command in, the command inside), read from the argv
    itself (launcher.core.container.container_argv's: `gpufleet-container NAME GPUS [FLAG
    VALUE]... IMAGE COMMAND...`); (None, argv) for an argv that is not a container's."""
    if not argv or argv[0] != CONTAINER_ARGV0 or len(argv) < 5:
        return None, list(argv)
    name, gpus = argv[1], argv[2]
    i, options = 3, []
    while argv[i].startswith("-"):  # every option of the runtime's is a flag and its value
        options.append((argv[i], argv[i + 1]))
        i += 2
    mounts = tuple(_mount(v) for f, v in options if f == "--mount")
    devices = tuple(v for f, v in options if f == "--device")
    names = tuple(v.partition("=")[0] for f, v in options if f == "-e")  # the run token's value is in `env`
    rest = tuple((f, v) for f, v in options if f not in ("--mount", "--device", "-e"))
    return Container(argv[i], name, gpus, mounts, devices, names, rest), list(argv[i + 1 :])


def _mount(spec: str) -> Mount:
    """`type=bind,src=A,dst=B[,readonly]` -> Mount(A, B, read_only)."""
    fields = dict(p.partition("=")[::2] for p in spec.split(","))
    return Mount(fields.get("src", ""), fields.get("dst", ""), "readonly" in fields)
