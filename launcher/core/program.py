"""The program each node runs, assembled by one builder (`ProgramBuilder`), in the spirit of
SkyPilot's sky/backends/task_codegen.py (prologue, task, epilogue, build). Pure: no network, no
processes. The wire protocol it speaks is launcher.core.wire; the ssh line that carries it
launcher.core.ssh; torchrun's argv launcher.core.torchrun.

A node's program is its typed plan (gpufleet.node_plan.NodePlan, built from the typed pieces of
launcher.core.node_plan) and one line of shell that starts the node's side with it:
`exec python3 -I -S -c SOURCE node PLAN` (`NodeProgram.render`), SOURCE being launcher.core.
node_start's and launcher.core.node_run's code (standard library only: a node has nothing of
gpufleet installed). What a dry run shows is the plan that runs: they cannot drift. On the node,
in order:

1. prologue (launcher.core.node_start): the plan's prologue steps: on SSH nodes the job's hold on
   the node (launcher.core.holds); a detached launch's authorization of the cluster key
   (`ProgramBuilder.add_prologue`);
2. environment: the launch's variables, first, so the check sees what the run will. The user's
   --env values are not in the plan: the node reads them from stdin, where the launcher writes
   them first (`env_stdin`; launcher.core.wire.env_block), so no command line on any machine
   holds them;
3. checks: what the launcher compares across nodes as `key=value` lines (hostname, clock, ready
   marker, torch version, --workdir, the cheap part of `launch doctor`), and node 0's lock on the
   rendezvous port for a torchrun job (a second launch on the same port refuses instead of
   joining the first one's store);
4. gate: `CHECKED_MARKER`, then one line on stdin. The launcher sends `go` only once every node
   has answered and passed; end of input instead (a node failed the check, or Ctrl-C) makes it
   exit without running anything. Every node is checked before any workload starts, but no node
   pays for a second session, and each node's handshake overlaps the others';
5. prepare: `cd --workdir`, each path launcher.code prepared for the job (a node that lost its
   disk says so), the account's local directory (launcher.core.node_local);
6. run (launcher.core.node_run): the job's `GPUFLEET_*` variables, then the rank command
   (torchrun's, or the plain command; each wrapper added with `ProgramBuilder.wrap_run` applied
   to it) in a session of its own with a unique `GPUFLEET_RUN` token in its environment, and the
   stop protocol around it:
   - attached: it watches the rest of stdin; when the launcher closes it, or the SSH connection
     drops, or a Spot preemption notice comes, it sends SIGTERM to the workload's process group
     and to every rank, waits up to --term-grace, then SIGKILLs every process that carries the
     token, and prints one STOP_REPORT line per rank. `EXIT_MARKER <status>` comes last, which
     tells a nonzero exit of the code apart from a lost connection (no marker). It writes no
     files;
   - supervised (a detached job, `LaunchConfig.controller_grace_s` set): the workload must
     outlive the controller's session, so a supervisor on the node owns it and its output goes
     to a file the session streams (launcher.core.supervise). A stop is then a `term` line
     before the end of input, never the end of input alone.

Extension points (a step is added to the builder, never spliced into a rendered string):

- `ProgramBuilder.wrap_run(name, wrapper)`: `wrapper(ctx: NodeContext, argv) -> list[str]`
  returns the rank command to run instead of `argv` (torchrun's argv, or the plain command), e.g.
  `["podman", "run", "--rm", "--network=host", "-e", "GPUFLEET_RUN", ..., IMAGE, *argv]`. Wrappers
  apply in the order added (the last added is outermost), to the attached and the supervised run
  alike. `ctx.token` is the run token (`GPUFLEET_RUN=<job>-<rank>`) the stop protocol finds the
  run's processes by: a wrapper whose processes leave the host's view of /proc (a container with
  its own pid namespace) must pass it on (`-e GPUFLEET_RUN`) and stop its own children on
  SIGTERM.
- `ProgramBuilder.add_prologue(step)`: a typed step (gpufleet.node_plan.PrologueStep) before the
  environment.

Steps that belong to the request (a snapshot, an image) are added in `ProgramBuilder.__init__`
from the `LaunchConfig`, never by a caller: the launching machine and a detached job's
controller both build from the same request (launcher.jobs.record carries it) through this
builder, so both render the same program. A caller adds only what is its own (the detach check's
prologue).
"""

from __future__ import annotations

import ast
import functools
import json
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.node_plan import Check, CheckKind, EnvVar, Limits, NodePlan, PrepareKind, PrologueKind, PrologueStep
from gpufleet.node_plan import PrepareStep as PlannedStep
from gpufleet.replica import python_argv
from launcher.core import node_run, node_start
from launcher.core.container import in_image
from launcher.core.env import HOST_IFACE_ON_NODE, launch_env
from launcher.core.node_local import compile_cache_key
from launcher.core.node_plan import container_of, env_vars, fact_checks, hardware_checks, prepare_steps, rank_ranges
from launcher.core.ssh import python_source_command
from launcher.core.torchrun import torchrun_argvs
from launcher.core.types import Cluster, LaunchConfig, Node, UserError
from launcher.core.wire import (
    ENV_BLOCK_MAX,
    JOB_ID_VAR,
    NNODES_VAR,
    NODE_RANK_VAR,
    RUN_VAR,
    env_block,
    run_token,
)

__all__ = [
    "NodeContext",
    "RunWrapper",
    "NodeProgram",
    "ProgramBuilder",
    "node_commands",
    "attach_commands",
    "node_run_command",
    "probe_script",
    "stdin_env",
    "env_stdin",
]


@dataclass(frozen=True)
class NodeContext:
    """What a run wrapper sees when it wraps a node's rank command: the launch, the node, the
    node's environment (what the program exports) and the run token (`GPUFLEET_RUN=<job>-<rank>`,
    unquoted)."""

    cluster: Cluster
    node: Node
    config: LaunchConfig
    env: Mapping[str, str]
    token: str


# A node's processes and the first and last global rank they run (None: not known before the start).
RankSpan = tuple[int, tuple[int, int] | None]
# The rank command to run instead of `argv` (see the module docstring).
RunWrapper = Callable[[NodeContext, Sequence[str]], Sequence[str]]


@dataclass(frozen=True)
class NodeProgram:
    """One node's program, in its parts; `plan()` is the node's typed plan and `render()` the one
    line that runs it (the module docstring). `argv`: the rank command, wrapped already; `check`
    adds the hostname, clock and ready-marker checks (and the torch version with `check_torch`) a
    torchrun launch compares across nodes; `lock_port` takes the rendezvous-port lock (node 0 of
    a torchrun launch); `watch_preemption` starts the Spot preemption watcher (a Compute Engine
    node); `prologue`: the builder's prologue steps. `command`, the rank command before its
    wrappers; `procs` and `ranks`, the processes and global ranks it runs
    (launcher.core.node_plan.rank_ranges)."""

    cluster: Cluster
    node: Node
    config: LaunchConfig
    env: Mapping[str, str]
    argv: Sequence[str]
    lock_port: int | None = None
    check: bool = False
    check_torch: bool = False
    watch_preemption: bool = False
    prologue: Sequence[PrologueStep] = ()
    command: Sequence[str] = ()
    procs: int = 1
    ranks: tuple[int, int] | None = None

    def env_vars(self) -> list[EnvVar]:
        """The variables the launch sets before the check, in order (its --env values hidden)."""
        return env_vars(self.env, [k for k, _ in stdin_env(self.config)])

    def run_vars(self) -> list[EnvVar]:
        """The job's variables, set before the run: its ID, the node's rank, the node count."""
        return [
            EnvVar(JOB_ID_VAR, self.config.job_id),
            EnvVar(NODE_RANK_VAR, str(self.node.rank)),
            EnvVar(NNODES_VAR, str(len(self.cluster.nodes))),
        ]

    def checks(self) -> list[Check]:
        """What the node answers before `go`, as named checks, in the order it answers them."""
        config = self.config
        out = fact_checks(config.python, config.workdir, facts=self.check, torch=self.check and self.check_torch)
        if self.watch_preemption and config.stop_grace_s > SPOT_GRACE_MAX_S:
            why = f"--term-grace {config.stop_grace_s:g} s is too long for a Spot VM's {SPOT_NOTICE_S} s notice"
            out.append(Check(CheckKind.PREEMPTIBLE, expect=f"not a Spot VM ({why})"))
        if self.check:
            out += hardware_checks(self.cluster, config.image_os)
        if self.lock_port is not None:
            out.append(Check(CheckKind.RDZV_PORT, str(self.lock_port), "free; held for this job until it ends"))
        return out

    def prepare(self) -> list[PlannedStep]:
        """After `go`, in order: --workdir, each path launcher.code prepared, the account's local
        directory, and (for the hang's flight recorder outside an image) the older torch's names."""
        config = self.config
        out = prepare_steps(config.workdir, config.python, config.prepared, self.env)
        out.append(PlannedStep(PrepareKind.LOCAL_DIR, compile_cache_key(config.python, config.env, config.image)))
        if "TORCH_FR_BUFFER_SIZE" in self.env and not config.image:  # an image's torch is its own
            out.append(PlannedStep(PrepareKind.FR_ALIASES, config.python))
        return out

    def plan(self) -> NodePlan:
        """This node's typed plan (gpufleet.node_plan): what the node runs, and what a dry run shows."""
        return self._plan

    @functools.cached_property
    def _plan(self) -> NodePlan:
        """Built once: `render()` and the launch's plans both read it."""
        config, node = self.config, self.node
        return NodePlan(
            job_id=config.job_id,
            attempt=config.attempt,
            node_rank=node.rank,
            nnodes=len(self.cluster.nodes),
            host=node.host,
            address=node.address,
            procs=self.procs,
            ranks=self.ranks,
            command=tuple(self.command or self.argv),
            argv=tuple(self.argv),
            workload=config.workload.kind,
            env=(
                *self.env_vars(),
                *self.run_vars(),
                EnvVar(RUN_VAR, run_token(config.job_id, node.rank).partition("=")[2]),
            ),
            checks=tuple(self.checks()),
            prepare=tuple(self.prepare()),
            limits=Limits(config.stop_grace_s, self.watch_preemption, config.controller_grace_s),
            container=container_of(self.argv)[0],
            prologue=tuple(self.prologue),
            head_address=self.cluster.nodes[0].address,
        )

    def render(self) -> str:
        """The one line the node runs: launcher.core.node_run's `node` with this node's plan."""
        return node_run_command(f"node {shlex.quote(self.plan().to_json())}", replace=True)


def node_run_command(args: str, var: str | None = None, replace: bool = False) -> str:
    """A node's statement that runs launcher.core.node_run with `args` (quoted already); `var`:
    the shell variable that holds its code already; `replace`: `exec`, the line's last statement.
    `stream` gets the run's directory, the supervisor's pid and the offset added by the statement
    that runs it."""
    return python_source_command(_node_run_source(), args, replace=replace, var=var)


def node_program_code() -> str:
    """The node program's code, as every node's line carries it (quoted: shlex.quote)."""
    return _node_run_source()


@functools.cache
def _node_run_source() -> str:
    """The node's program as it travels to every node on the ssh command line: launcher.core.
    node_start's code, then launcher.core.node_run's (which imports node_start's names here, and
    finds them defined above it there), their docstrings and comments left out (ast.unparse)."""
    start = ast.parse(Path(node_start.__file__).read_text())
    run = ast.parse(Path(node_run.__file__).read_text())
    run.body = [n for n in run.body if not (isinstance(n, ast.ImportFrom) and n.module == node_start.__name__)]
    for node in (*ast.walk(start), *ast.walk(run)):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(start) + "\n" + ast.unparse(run)


class ProgramBuilder:
    """Every node's program for one launch of `config` on `cluster`, in the launch's rank order
    (see the module docstring for the parts and the extension points). Without `env`, making
    it computes the nodes' environment (launcher.core.env.launch_env), so bad input (an unknown
    machine type, an image the profile does not know) raises UserError here, before any program
    is rendered."""

    def __init__(self, cluster: Cluster, config: LaunchConfig, env: Mapping[str, str] | None = None):
        self.cluster, self.config = cluster, config
        self.torchrun = config.workload.kind == "torchrun"
        # `env`: launch_env's, computed already (launcher.runner computes it before the order).
        self.env = dict(env) if env is not None else launch_env(cluster, config)
        # What every node's program reads on stdin first (its --env values), computed once here.
        self.stdin = env_stdin(config)
        size = len(self.stdin)
        if size > ENV_BLOCK_MAX:
            raise UserError(
                f"the --env values come to {size} bytes; at most {ENV_BLOCK_MAX} travel to the nodes: "
                "put large data in a file on the nodes and pass its path"
            )
        self._prologue: list[PrologueStep] = []
        self._wrappers: list[tuple[str, RunWrapper]] = []
        # Steps that come with the request are added here, from `config` (see the module docstring).
        if config.image:  # the ranks in a container (launcher.core.container)
            self.wrap_run("container", _container)
        elif config.replication is not None:  # a --recover job's checkpoint copies (gpufleet.replica)
            self.wrap_run("replicate", _replicate)
        if not cluster.local:  # accounts share the nodes: each job says it holds them
            self.add_prologue(PrologueStep(PrologueKind.HOLD, ",".join(n.host for n in cluster.nodes)))

    def add_prologue(self, step: PrologueStep) -> ProgramBuilder:
        self._prologue.append(step)
        return self

    def wrap_run(self, name: str, wrapper: RunWrapper) -> ProgramBuilder:
        self._wrappers.append((name, wrapper))
        return self

    def steps(self) -> list[str]:
        """The added steps' names, by part (what a dry run may show)."""
        return [*(f"prologue:{s.kind.value}" for s in self._prologue), *(f"wrap:{n}" for n, _ in self._wrappers)]

    def program(self, node: Node) -> NodeProgram:
        return self.programs()[node.rank]

    def _rank_commands(self) -> dict[int, list[str]]:
        """Each node's rank command, unwrapped: torchrun's (launcher.core.torchrun), or the plain
        command on every node."""
        if self.torchrun:
            return torchrun_argvs(self.cluster, self.config)
        return {n.rank: list(self.config.workload.argv) for n in self.cluster.nodes}

    def _program(self, node: Node, command: list[str], ranks: Mapping[int, RankSpan]) -> NodeProgram:
        config = self.config
        ctx = NodeContext(self.cluster, node, config, self.env, run_token(config.job_id, node.rank))
        argv = command
        for _, wrapper in self._wrappers:
            argv = list(wrapper(ctx, argv))
        return NodeProgram(
            self.cluster,
            node,
            config,
            self.env,
            argv,
            lock_port=config.rdzv_port if self.torchrun and node.rank == 0 else None,
            check=self.torchrun,
            # With --image, torch is the image's: the node itself may have none (COS).
            check_torch=self.torchrun and config.check_versions and not config.image,
            watch_preemption=not self.cluster.local,
            prologue=tuple(self._prologue),
            command=command,
            procs=ranks[node.rank][0],
            ranks=ranks[node.rank][1],
        )

    def programs(self) -> dict[int, NodeProgram]:
        """Every node's program, in its parts, by rank."""
        argvs = self._rank_commands()
        ranks = rank_ranges(argvs, self.torchrun, static=self.config.max_restarts == 0)
        return {node.rank: self._program(node, argvs[node.rank], ranks) for node in self.cluster.nodes}

    def build(self) -> dict[int, str]:
        """Every node's program, rendered, by rank (what runs on it)."""
        return {rank: p.render() for rank, p in self.programs().items()}

    def plans(self) -> dict[int, NodePlan]:
        """Every node's typed plan (gpufleet.node_plan), by rank: what --dry-run shows."""
        return {rank: p.plan() for rank, p in self.programs().items()}


def _replicate(ctx: NodeContext, argv: Sequence[str]) -> list[str]:
    """The run wrapper of a --recover job with replication: gpufleet.replica's sidecar runs the rank
    command and copies each local checkpoint it completes to the node's peer (the next node of the
    job's order, spares included), with one last copy once the ranks have ended."""
    rep = ctx.config.replication
    assert rep is not None
    peers = rep.peers(ctx.node.host)
    if not peers:
        return list(argv)
    return [
        *python_argv(rep.code), "sidecar",
        "--state", rep.state, "--port", str(rep.port), "--peers", ",".join(peers), "--", *argv,
    ]  # fmt: skip


def _container(ctx: NodeContext, argv: Sequence[str]) -> list[str]:
    """The run wrapper of --image: the rank command inside the image, wired for the machine type."""
    c, config = ctx.cluster, ctx.config
    assert config.image is not None
    return in_image(
        c.machine_type, c.local, config.image_os, config.image, config.job_id, ctx.node.rank, ctx.token, ctx.env, argv
    )


def node_commands(cluster: Cluster, config: LaunchConfig) -> dict[int, str]:
    """`ProgramBuilder(cluster, config).build()`: a launch's programs with no caller's steps."""
    return ProgramBuilder(cluster, config).build()


def attach_commands(cluster: Cluster, config: LaunchConfig, offsets: Mapping[int, int]) -> dict[int, str]:
    """A re-adopting controller's program for every node, by rank: launcher.core.node_run's
    `attach`, which streams the detached run's output from `offsets[rank]` bytes on."""
    job = shlex.quote(config.job_id)
    return {
        n.rank: node_run_command(
            f"attach {job} {int(config.attempt)} {n.rank} {int(offsets.get(n.rank, 0))}", replace=True
        )
        for n in cluster.nodes
    }


def probe_script(python: str, workdir: str | None, check_torch: bool, extra: Sequence[Check] = ()) -> str:
    """`launch hosts`' program: launcher.core.node_run's `probe`, which answers the node's fact
    checks (the torch version of `python` with `check_torch`, whether `workdir` exists) and
    `extra` checks (where the VM sits), prints CHECKED_MARKER, then waits for end of input, as a
    launch's node does before `go`."""
    checks = [*fact_checks(python, workdir, facts=True, torch=check_torch), *extra]
    spec = json.dumps({"checks": [{"kind": c.kind.value, "target": c.target} for c in checks]})
    return node_run_command(f"probe {shlex.quote(spec)}", replace=True)


# A Spot VM gets 30 s between its preemption notice and its stop
# (https://cloud.google.com/compute/docs/instances/spot#preemption-process): a --term-grace above
# this leaves the ranks too little time after SIGTERM before the VM goes. The pre-start check asks
# a node that watches for the notice whether it is one only then.
SPOT_NOTICE_S = 30
SPOT_GRACE_MAX_S = 25.0


def stdin_env(config: LaunchConfig) -> list[tuple[str, str]]:
    """The user's --env values a node program reads from stdin, in the order it reads them (the
    last value of a key given twice; a HOST_IFACE_ON_NODE value is resolved on the node instead)."""
    return [(k, v) for k, v in dict(config.env).items() if v != HOST_IFACE_ON_NODE]


def env_stdin(config: LaunchConfig) -> bytes:
    """What the launcher writes to a node program's stdin first: its --env values
    (launcher.core.wire.env_block). The check reads them; `go` comes after."""
    return env_block(stdin_env(config))
