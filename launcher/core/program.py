"""The program each node runs, assembled by one builder (`ProgramBuilder`) and rendered once, in
the spirit of SkyPilot's sky/backends/task_codegen.py (prologue, task, epilogue, build). Pure: no
network, no processes. The wire protocol it speaks is launcher.core.wire; the ssh line that
carries it launcher.core.ssh; torchrun's argv launcher.core.torchrun; its run and stop, on the node
in Python, launcher.core.node_run; a detached job's supervised run launcher.core.supervise.

Everything that crosses a shell goes through `shlex.quote`, so an argument such as
`"; rm -rf ~` reaches the program as one literal argument.

A node's program is one bash line (as `--dry-run=json` shows it), in sections, in order
(`NodeProgram.sections`). Its environment and its checks are rendered from typed pieces
(launcher.core.node_plan), the same ones `NodeProgram.plan()` gathers into the node's typed plan
(gpufleet.node_plan), which `--dry-run` shows: the plan and the program cannot drift.

1. prologue: statements before anything else (on SSH nodes the job's hold on the node,
   launcher.core.holds; the detach check's authorization of the cluster key,
   `ProgramBuilder.add_prologue`);
2. environment: the launch's `export`s (resolving the host NIC on the node when the catalog
   cannot name it), first, so the check sees what the run will. The user's --env values are
   not in the program: it reads them from stdin, where the launcher writes them first
   (`env_stdin`; launcher.core.wire.env_block), so no command line on any machine holds them;
3. checks: what the launcher compares across nodes as `key=value` lines (hostname, clock, ready
   marker, torch version, --workdir, the cheap part of `launch doctor`), and node 0's lock on the
   rendezvous port for a torchrun job (a second launch on the same port refuses instead of
   joining the first one's store);
4. gate: `CHECKED_MARKER`, then one line on stdin. The launcher sends `go` only once every node
   has answered and passed; end of input instead (a node failed the check, or Ctrl-C) makes it
   exit without running anything. Every node is checked before any workload starts, but no node
   pays for a second session, and each node's handshake overlaps the others';
5. prepare: what runs after `go` and before the workload: `cd --workdir`, then each step added
   with `ProgramBuilder.add_prepare`;
6. run: the job's `GPUFLEET_*` variables, then the rank command (torchrun's, or the plain
   command; each wrapper added with `ProgramBuilder.wrap_run` applied to it) started under
   `setsid` with a unique `GPUFLEET_RUN` token in its environment, and the stop protocol around it:
   - attached: the node's plan goes to launcher.core.node_run, in Python (`python3 -I -S -c SOURCE
     run PLAN`): it starts the rank command, watches the rest of stdin; when the launcher closes
     it, or the SSH connection drops, or a Spot preemption notice comes, it sends SIGTERM to the
     workload's process group and to every rank, waits up to --term-grace, then SIGKILLs every
     process that carries the token, and prints one STOP_REPORT line per rank. `EXIT_MARKER
     <status>` comes last, which tells a nonzero exit of the code apart from a lost connection (no
     marker). It writes no files;
   - supervised (a detached job, `LaunchConfig.controller_grace_s` set): the workload must
     outlive the controller's session, so a supervisor on the node owns it and its output goes to
     a file the session streams (launcher.core.supervise). A stop is then a `term` line before
     the end of input, never the end of input alone.

Extension points (a step is added to the builder, never spliced into a rendered string):

- `ProgramBuilder.add_prepare(name, step)`: `step(ctx: NodeContext) -> list[str]`, bash
  statements run on each node after `go` and before the run, in the order added, after the
  --workdir `cd`. For a bare node: unpack a code snapshot, build or activate a Python environment,
  `cd` into the job's directory, `export GPUFLEET_CODE=...`. A failing statement should print one
  `gpufleet.contracts.LAUNCHER_ERROR_PREFIX` line to stderr and `exit` nonzero (as the --workdir
  step does), which the launcher reads as the node's own error.
- `ProgramBuilder.wrap_run(name, wrapper)`: `wrapper(ctx: NodeContext, argv) -> list[str]`
  returns the rank command to run instead of `argv` (torchrun's argv, or the plain command), e.g.
  `["podman", "run", "--rm", "--network=host", "-e", "GPUFLEET_RUN", ..., IMAGE, *argv]`. Wrappers
  apply in the order added (the last added is outermost), to the attached and the supervised run
  alike. `ctx.token` is the run token (`GPUFLEET_RUN=<job>-<rank>`) the stop protocol finds the
  run's processes by: a wrapper whose processes leave the host's view of /proc (a container with
  its own pid namespace) must pass it on (`-e GPUFLEET_RUN`) and stop its own children on
  SIGTERM.
- `ProgramBuilder.add_prologue(name, statements)`: statements before the environment.

Steps that belong to the request (a snapshot, an image) are added in `ProgramBuilder.__init__`
from the `LaunchConfig`, never by a caller: the launching machine and a detached job's
controller both build from the same request (launcher.jobs.record carries it) through this
builder, so both render the same program. A caller adds only what is its own (the detach check's
prologue).
"""

from __future__ import annotations

import ast
import functools
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.contracts import LAUNCHER_ERROR_PREFIX, READY_MARKER
from gpufleet.node_plan import Check, CheckKind, EnvSource, EnvVar, Limits, NodePlan
from gpufleet.node_plan import PrepareStep as PlannedStep
from gpufleet.replica import python_argv
from launcher.core import node_run, supervise
from launcher.core.container import in_image
from launcher.core.env import HOST_IFACE_ON_NODE, launch_env
from launcher.core.hang import flight_recorder_aliases
from launcher.core.holds import hold_statements
from launcher.core.node_local import compile_cache_key, node_local_statements
from launcher.core.node_plan import container_of, env_vars, fact_checks, hardware_checks, prepare_steps, rank_ranges
from launcher.core.prestart import prestart_statements
from launcher.core.ssh import python_source_command
from launcher.core.torchrun import torchrun_argvs
from launcher.core.types import Cluster, LaunchConfig, Node, UserError
from launcher.core.wire import (
    CHECKED_MARKER,
    ENV_BLOCK_MAX,
    GO,
    JOB_ID_VAR,
    NNODES_VAR,
    NODE_RANK_VAR,
    RUN_VAR,
    env_block,
    join,
    rdzv_lock_path,
    read_env_statements,
    run_token,
)

__all__ = [
    "NodeContext",
    "PrepareStep",
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
    """What a step sees when it writes a node's statements: the launch, the node, the node's
    environment (what the program exports) and the run token (`GPUFLEET_RUN=<job>-<rank>`,
    unquoted)."""

    cluster: Cluster
    node: Node
    config: LaunchConfig
    env: Mapping[str, str]
    token: str


# Bash statements run after `go` and before the run (see the module docstring).
PrepareStep = Callable[[NodeContext], Sequence[str]]
# A node's processes and the first and last global rank they run (None: not known before the start).
RankSpan = tuple[int, tuple[int, int] | None]
# The rank command to run instead of `argv` (see the module docstring).
RunWrapper = Callable[[NodeContext, Sequence[str]], Sequence[str]]


@dataclass(frozen=True)
class NodeProgram:
    """One node's program, in its parts; `render()` writes it as one bash line (the module
    docstring's sections). `argv`: the rank command, wrapped already; `check` adds the hostname,
    clock and ready-marker lines (and the torch version with `check_torch`) a torchrun launch
    compares across nodes; `lock_port` takes the rendezvous-port lock (node 0 of a torchrun
    launch); `watch_preemption` starts the Spot preemption watcher (a Compute Engine node);
    `prologue` and `prepare`: the builder's steps, rendered for this node. For the node's typed
    plan (`plan()`): `command`, the rank command before its wrappers; `procs` and `ranks`, the
    processes and global ranks it runs (launcher.core.node_plan.rank_ranges); `steps`, the
    prepare steps as data; `prologue_names`, the prologue's steps by name."""

    cluster: Cluster
    node: Node
    config: LaunchConfig
    env: Mapping[str, str]
    argv: Sequence[str]
    lock_port: int | None = None
    check: bool = False
    check_torch: bool = False
    watch_preemption: bool = False
    prologue: Sequence[str] = ()
    prepare: Sequence[str] = ()
    command: Sequence[str] = ()
    procs: int = 1
    ranks: tuple[int, int] | None = None
    steps: Sequence[PlannedStep] = ()
    prologue_names: Sequence[str] = ()

    def sections(self) -> list[tuple[str, list[str]]]:
        """(name, statements) in the order they run."""
        return [
            ("prologue", list(self.prologue)),
            # The environment first: the check must see what the run will (`--env PATH=...`
            # decides which `python3` has torch), so it is exported before the check's lines.
            ("environment", self._environment()),
            ("checks", self._checks()),
            ("gate", _gate()),
            ("prepare", [*self._workdir_step(), *self.prepare]),
            ("run", self._run()),
        ]

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

    def plan(self) -> NodePlan:
        """This node's typed plan (gpufleet.node_plan), from the same parts `render()` writes."""
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
            prepare=tuple(self.steps),
            limits=Limits(config.stop_grace_s, self.watch_preemption, config.controller_grace_s),
            container=container_of(self.argv)[0],
            prologue=tuple(self.prologue_names),
        )

    def _environment(self) -> list[str]:
        s = _env_statements(self.cluster, self.node, self.env_vars())
        if "TORCH_FR_BUFFER_SIZE" in self.env and not self.config.image:  # an image's torch is its own
            s.append(flight_recorder_aliases(self.config.python))
        return s

    def render(self) -> str:
        return join([st for _, statements in self.sections() for st in statements])

    def _checks(self) -> list[str]:
        """The check's statements, rendered from `checks()`, in its order."""
        s: list[str] = []
        hardware = (CheckKind.GPUS, CheckKind.NIC, CheckKind.RXDM)
        asked = False
        for check in self.checks():
            if check.kind is CheckKind.PREEMPTIBLE:
                s.append(_preemptible_statement())
            elif check.kind in hardware:
                # The cheap part of `launch doctor`, asked once for all of them (from the same
                # expectation the checks were named from), ending with `wait`.
                s += [] if asked else prestart_statements(self.cluster, self.config.image_os)
                asked = True
            elif check.kind is CheckKind.RDZV_PORT:
                s += self._lock_statements(int(check.target))
            else:
                s += _check_statements([check])
        return s

    def _lock_statements(self, port: int) -> list[str]:
        lock = '"$HOME"/' + shlex.quote(rdzv_lock_path(self.node.address, port))
        # Held from the check to the end of the run (torchrun inherits fd 9), so there is no
        # moment between "free" and "taken" for another launch to slip into. The file is
        # private (umask 077), and the user's own umask is back for the workload.
        return [
            "O=$(umask)",
            "umask 077",
            'mkdir -p "$HOME/.gpufleet"',
            f"exec 9>>{lock}",
            f"if flock -n 9; then echo {shlex.quote(self.config.job_id)} > {lock}.job; echo port=free; else "
            f"echo port=busy:$(cat {lock}.job 2>/dev/null); echo {CHECKED_MARKER}; exit 75; fi",
            'umask "$O"',
        ]

    def _workdir_step(self) -> list[str]:
        wd = self.config.workdir
        if not wd:
            return []
        # A line the launcher reads as this node's own error (gpufleet.contracts.is_error_line).
        return [
            f"cd {_workdir(wd)} || {{ echo \"{LAUNCHER_ERROR_PREFIX}--workdir {shlex.quote(wd)} does not "
            f"exist on {self.node.host}\" >&2; exit 71; }}"
        ]

    def _run(self) -> list[str]:
        config = self.config
        s = ["export " + " ".join(f"{v.name}={shlex.quote(v.value or '')}" for v in self.run_vars())]
        if config.controller_grace_s is None:
            return s + _attached_run(self.plan())
        # A detached job: the run outlives this session. Keep the launcher's end of stdin on fd 3
        # for the stream's stop relay: a background list's stdin is /dev/null in a
        # non-interactive shell (POSIX, "Asynchronous Lists").
        # node_run's code once, in a variable: the supervisor and the stream both run it.
        plan, var = self.plan(), "GPUFLEET_NODE_RUN"
        return [
            *s,
            "exec 3<&0",
            f"{var}={shlex.quote(_node_run_source())}",
            *supervise.supervised_run(plan, _node_run("supervise", plan, var), node_run_command("stream", var)),
        ]


def _gate() -> list[str]:
    return [
        f"echo {CHECKED_MARKER}",
        # One line from the launcher: `go`, or end of input when it decided not to start.
        "IFS= read -r G || exit 0",
        f'[ "$G" = {GO} ] || exit 0',
    ]


def _attached_run(plan: NodePlan) -> list[str]:
    """The run under this session, in Python (launcher.core.node_run, sent as its source with the
    node's plan): the workload, the watch on the launcher's stdin and the preemption notice, the
    stop, then `EXIT_MARKER <rc>`. Not `exec`: the prologue's EXIT trap (the node's hold) runs
    when it ends."""
    return [_node_run("run", plan)]


def _node_run(mode: str, plan: NodePlan, var: str | None = None) -> str:
    """launcher.core.node_run's `mode` on the node, for `plan` (the supervisor's run directory
    is added to it by the statement that starts it)."""
    return node_run_command(f"{mode} {shlex.quote(plan.to_json())}", var)


def node_run_command(args: str, var: str | None = None) -> str:
    """A node's statement that runs launcher.core.node_run with `args` (quoted already); `var`:
    the shell variable that holds its code already. `stream` gets the run's directory, the
    supervisor's pid and the offset added by the statement that runs it."""
    return python_source_command(_node_run_source(), args, var=var)


@functools.cache
def _node_run_source() -> str:
    """launcher.core.node_run's code as it travels to every node on the ssh command line: its
    docstrings and comments left out (ast.unparse), a third of the file's bytes."""
    tree = ast.parse(Path(node_run.__file__).read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _prepared_step(ctx: NodeContext) -> list[str]:
    """Each path launcher.code prepared for the job is on this node (the job's directory, its
    code, its environment), else one line naming it: a node that lost its disk since the launch
    cannot run the job's code, and says so instead of failing on a missing interpreter."""
    return [
        f"[ -e {shlex.quote(p)} ] || {{ echo \"{LAUNCHER_ERROR_PREFIX}{ctx.node.host} lacks {shlex.quote(p)}, which "
        "the launch prepared for this job (did the node lose its disk?); launch the job again\" >&2; exit 71; }"
        for p in ctx.config.prepared
    ]


class ProgramBuilder:
    """Every node's program for one launch of `config` on `cluster`, in the launch's rank order
    (see the module docstring for the sections and the extension points). Without `env`, making
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
        self._prologue: list[tuple[str, tuple[str, ...]]] = []
        self._prepare: list[tuple[str, PrepareStep]] = []
        self._wrappers: list[tuple[str, RunWrapper]] = []
        # Steps that come with the request are added here, from `config` (see the module docstring).
        if config.prepared:
            self.add_prepare("prepared", _prepared_step)
        # The account's own local directory: the local checkpoint tier and the compile caches.
        # The same on every node: computed once (no per-node re-entry into launcher.core.env).
        node_local = node_local_statements(compile_cache_key(config.python, config.env, config.image))
        self.add_prepare("node-local", lambda ctx: node_local)
        if config.image:  # the ranks in a container (launcher.core.container)
            self.wrap_run("container", _container)
        elif config.replication is not None:  # a --recover job's checkpoint copies (gpufleet.replica)
            self.wrap_run("replicate", _replicate)
        if not cluster.local:  # accounts share the nodes: each job says it holds them
            self.add_prologue("hold the nodes", hold_statements(config.job_id, [n.host for n in cluster.nodes]))

    def add_prologue(self, name: str, statements: Sequence[str]) -> ProgramBuilder:
        self._prologue.append((name, tuple(statements)))
        return self

    def add_prepare(self, name: str, step: PrepareStep) -> ProgramBuilder:
        self._prepare.append((name, step))
        return self

    def wrap_run(self, name: str, wrapper: RunWrapper) -> ProgramBuilder:
        self._wrappers.append((name, wrapper))
        return self

    def steps(self) -> list[str]:
        """The added steps' names, by section (what a dry run may show)."""
        return [
            *(f"prologue:{n}" for n, _ in self._prologue),
            *(f"prepare:{n}" for n, _ in self._prepare),
            *(f"wrap:{n}" for n, _ in self._wrappers),
        ]

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
        added = [name for name, step in self._prepare if step is not _prepared_step]
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
            prologue=[st for _, statements in self._prologue for st in statements],
            prepare=[st for _, step in self._prepare for st in step(ctx)],
            command=command,
            procs=ranks[node.rank][0],
            ranks=ranks[node.rank][1],
            steps=prepare_steps(config.workdir, config.python, config.prepared, self.env, added),
            prologue_names=[name for name, _ in self._prologue],
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
    """A re-adopting controller's program for every node, by rank: stream the detached run's
    output from `offsets[rank]` bytes on (launcher.core.supervise.attach_script)."""
    stream = node_run_command("stream")
    return {
        n.rank: supervise.attach_script(config.job_id, config.attempt, n.rank, offsets.get(n.rank, 0), stream)
        for n in cluster.nodes
    }


def probe_script(python: str, workdir: str | None, check_torch: bool, extra: Sequence[str] = ()) -> str:
    """`launch hosts`' program: the check lines (the torch version of `python` with `check_torch`,
    whether `workdir` exists; and `extra` statements that print `key=value` lines) and
    CHECKED_MARKER, then it waits for end of input, as a launch's node does before `go`."""
    return join(
        [
            *_check_statements(fact_checks(python, workdir, facts=True, torch=check_torch)),
            *extra,
            f"echo {CHECKED_MARKER}",
            "IFS= read -r G",
            "exit 0",
        ]
    )


def _resolve_iface(address: str, head_address: str) -> str:
    # The interface that holds the address we reach this node at; failing that (we connected by
    # name), the interface the route to node 0 leaves through. `ip -o` prints one line per
    # address: "2: eth0    inet 10.0.0.2/24 ...".
    a, h = shlex.quote(address), shlex.quote(head_address)
    return (
        f"I=$(ip -o -4 addr show 2>/dev/null | awk -v a={a} "
        "'{split($4,p,\"/\"); if (p[1]==a) {print $2; exit}}'); "
        f'[ -n "$I" ] || I=$(ip -o route get {h} 2>/dev/null | '
        "sed -n 's/.* dev \\([^ ]*\\).*/\\1/p')"
    )


def _check_statements(checks: Sequence[Check]) -> list[str]:
    """`key=value` lines about the node (launcher.core.node_plan.fact_checks): hostname, clock
    and ready marker (NODE_FACTS), the torch version of a python (TORCH_VERSION), whether
    --workdir exists (WORKDIR)."""
    s = []
    for check in checks:
        if check.kind is CheckKind.NODE_FACTS:
            s += [
                "echo host=$(hostname)",
                "echo time=$(date +%s.%N)",
                f"if [ -f {READY_MARKER} ]; then echo ready=yes; else echo ready=no; fi",
            ]
        elif check.kind is CheckKind.TORCH_VERSION:
            # importlib.metadata reads the version without importing torch (seconds on a busy node).
            s.append(
                f"echo torch=$({shlex.quote(check.target)} -c 'import importlib.metadata as m; "
                "print(m.version(\"torch\"))' 2>/dev/null || echo missing)"
            )
        elif check.kind is CheckKind.WORKDIR:
            s.append(f"if [ -d {_workdir(check.target)} ]; then echo workdir=ok; else echo workdir=missing; fi")
        else:
            raise ValueError(f"{check.kind.value} is not a check of the node's facts")
    return s


# A Spot VM gets 30 s between its preemption notice and its stop
# (https://cloud.google.com/compute/docs/instances/spot#preemption-process): a --term-grace above
# this leaves the ranks too little time after SIGTERM before the VM goes. The pre-start check asks
# a node that watches for the notice whether it is one only then.
SPOT_NOTICE_S = 30
SPOT_GRACE_MAX_S = 25.0


def _preemptible_statement() -> str:
    """`preemptible=TRUE|FALSE` from the node's metadata server (`instance/scheduling/preemptible`,
    https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys; TRUE on a Spot VM,
    whose scheduling sets preemptible), `unknown` without one."""
    url = '"http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1/instance/scheduling/preemptible"'
    return f"echo preemptible=$(curl -sf -m 2 -H 'Metadata-Flavor: Google' {url} || echo unknown)"


def _workdir(wd: str) -> str:
    # `~/x` means the login directory on the node, so keep the tilde outside the quotes.
    return ("~/" + shlex.quote(wd[2:])) if wd.startswith("~/") else shlex.quote(wd)


def stdin_env(config: LaunchConfig) -> list[tuple[str, str]]:
    """The user's --env values a node program reads from stdin, in the order it reads them (the
    last value of a key given twice; a HOST_IFACE_ON_NODE value is resolved on the node instead)."""
    return [(k, v) for k, v in dict(config.env).items() if v != HOST_IFACE_ON_NODE]


def env_stdin(config: LaunchConfig) -> bytes:
    """What the launcher writes to a node program's stdin first: its --env values
    (launcher.core.wire.env_block). The check reads them; `go` comes after."""
    return env_block(stdin_env(config))


def _env_statements(cluster: Cluster, node: Node, variables: Sequence[EnvVar]) -> list[str]:
    """The statements that set `variables` (launcher.core.node_plan.env_vars), in order: an
    `export` of the launch's own values (a PATH-like one prepended to the node's value), a read
    from stdin of each --env value (`stdin_env`: its value is not in the program), and the host
    NIC resolved on the node for those that need it (HOST_IFACE_ON_NODE)."""
    s = []
    unresolved = [v.name for v in variables if v.source is EnvSource.NODE]
    for v in variables:
        if v.source is EnvSource.STDIN:
            s += read_env_statements(v.name, prepend=v.prepend)
        elif v.source is EnvSource.LAUNCH:
            tail = f"${{{v.name}:+:${v.name}}}" if v.prepend else ""
            s.append(f"export {v.name}={shlex.quote(v.value or '')}{tail}")
    if unresolved:
        s.append(_resolve_iface(node.address, cluster.nodes[0].address))
        s.append('if [ -n "$I" ]; then export ' + " ".join(f'{k}="$I"' for k in unresolved) + "; fi")
    return s
