"""A launch's plan: the cluster in the rank order the launch uses, the config, and each node's
program, rendered once by launcher.core.program's builder, with the transport that carries it
and the verdict that judges what their check asks about each node's GPUs and NICs
(launcher.health.prestart).

    plan(cluster, config)            ──> LaunchPlan ──> Launch.run(programs=...)   (attached)
    plan_detached(cluster, config)   ──> LaunchPlan ──> launcher.jobs.handoff.detach
                                         launcher.runner.dry_run                  (--dry-run)

Bad input (an unknown machine type, an image the profile does not know) is refused when the
nodes' environment is computed, before the order is decided, so before any node is contacted. Deciding the order may ask
the nodes where they sit (launcher.cluster.ordering), except on a dry run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpufleet.node_plan import NodePlan, PrologueKind, PrologueStep
from launcher.cluster.key import authorize_entry, ensure_key
from launcher.cluster.ordering import order_for_launch
from launcher.core.env import launch_env
from launcher.core.preflight import Verdict
from launcher.core.program import ProgramBuilder, stdin_env
from launcher.core.transport import Transport, make_transport
from launcher.core.types import Cluster, LaunchConfig, UserError
from launcher.health.prestart import prestart_verdict

__all__ = ["LaunchPlan", "plan", "plan_detached"]


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch will do. `cluster`: its nodes in the launch's rank order; `order_message`:
    the line that says which order and why (empty for a plain command); `programs`: each node's
    program by rank, rendered; `plans`: each node's typed plan by rank (gpufleet.node_plan), from
    the same parts as its program; `steps`: the builder's added steps, by name; `key`: for a detached
    job, the cluster key its check authorizes on every node; `verdict`: what judges the check's
    answers about the nodes' GPUs and NICs (the Launch that runs the plan takes it)."""

    cluster: Cluster
    config: LaunchConfig
    order_message: str
    programs: Mapping[int, str]
    transport: Transport
    steps: tuple[str, ...] = ()
    key: Path | None = field(default=None)
    plans: Mapping[int, NodePlan] = field(default_factory=dict)
    # What each program reads on stdin before its check: the --env values (never in `programs`).
    stdin: bytes = b""
    verdict: Verdict = prestart_verdict

    def remote_commands(self) -> list[str]:
        """Each node's exact command line, in rank order: the transport's (ssh, or bash for
        --local) around its program."""
        return [self.transport.display(n, self.programs[n.rank]) for n in self.cluster.nodes]

    def stdin_note(self) -> str:
        """What --dry-run says (on stderr) each node reads on stdin before its check: the --env
        values, by name only (launcher.core.program.env_stdin); empty without --env."""
        keys = [k for k, _ in stdin_env(self.config)]
        if not keys:
            return ""
        return "each node reads on stdin, not on its command line: " + " ".join(
            f"{k}=<from --env, hidden>" for k in keys
        )


def plan(cluster: Cluster, config: LaunchConfig) -> LaunchPlan:
    """The plan of an attached launch of `config` on `cluster`."""
    return _plan(cluster, config)


def plan_detached(cluster: Cluster, config: LaunchConfig) -> LaunchPlan:
    """The plan of `--detach`: the same programs (the supervised run: `config.controller_grace_s`
    is set), whose check also authorizes the cluster key on every node (its prologue), made here
    on first use. The controller renders its own programs from the job's request through the
    same builder, without that prologue."""
    if cluster.local:
        raise UserError("--detach needs SSH nodes (its controller runs on node 0); --local runs here: drop --detach")
    if config.dry_run:
        raise UserError("--detach and --dry-run: a dry run starts nothing to hand off; drop one of them")
    return _plan(cluster, config, detached=True)


def _plan(cluster: Cluster, config: LaunchConfig, detached: bool = False) -> LaunchPlan:
    # The environment first: bad input is refused before the order asks any node.
    env = launch_env(cluster, config)
    key = ensure_key(cluster) if detached else None
    order = order_for_launch(cluster, config)
    if config.replication is not None:  # the peer ring follows the job's order (gpufleet.replica)
        config = replace(config, replication=config.replication.in_order(order.cluster.nodes))
    builder = ProgramBuilder(order.cluster, config, env)
    if key is not None:  # from the nodes' and the controller's addresses
        public = key.with_name("id_ed25519.pub").read_text()
        builder.add_prologue(PrologueStep(PrologueKind.AUTHORIZE, authorize_entry(public, order.cluster)))
    programs = builder.programs()
    return LaunchPlan(
        cluster=order.cluster,
        config=config,
        order_message=order.message,
        programs={rank: p.render() for rank, p in programs.items()},
        plans={rank: p.plan() for rank, p in programs.items()},
        transport=make_transport(order.cluster, config.ssh, config.dry_run),
        steps=tuple(builder.steps()),
        key=key,
        stdin=builder.stdin,
    )
