"""The rank order a launch runs its nodes in, decided once before any node's command is built:
each command carries the node's rank (GPUFLEET_NODE_RANK, torchrun's --node-rank), so node i of
the order holds group rank i. The nodes are asked where they sit (the metadata server's
`physical_host`, as `launch doctor` and `launch hosts` ask) unless the answer cannot change the
order: --rank-order given, --local, --dry-run, or a workload that is not torchrun's."""

from __future__ import annotations

from gpufleet.node_plan import Check, CheckKind
from launcher.cluster.topology import RankOrder, launch_order, node_physical_hosts
from launcher.core.preflight import refuse_unreachable
from launcher.core.types import Cluster, LaunchConfig

__all__ = ["order_for_launch"]


def order_for_launch(cluster: Cluster, config: LaunchConfig) -> RankOrder:
    """`cluster` in the order the launch uses (renumbered), with the line that says which and
    why (empty for a plain command, whose nodes have no torchrun ranks). Raises UserError for
    --rank-order topology when a node has no physical host, or when a node cannot be reached.
    Its caller refuses bad input first (launcher.runner.plan makes the program builder before
    it asks for the order), so a node is never asked about a launch that cannot start."""
    if config.workload.kind != "torchrun":
        return RankOrder(cluster, False, "")
    if config.max_restarts > 0:  # launcher.core.torchrun.torchrun_argv: in-place restarts need c10d
        return RankOrder(
            cluster,
            False,
            f"rank order: torchrun's c10d rendezvous picks it (--max-restarts {config.max_restarts} restarts "
            "workers in place, which a fixed order's static rendezvous cannot)",
        )
    if config.rank_order == "given" or cluster.local or config.dry_run:
        return launch_order(cluster, config.rank_order, None)
    from launcher.core.launch import Launch  # the sessions and threads, only when nodes are asked

    # The launch's own check sessions, sent home once answered (ControlMaster keeps each
    # connection for the launch that follows).
    probes = Launch(cluster, config).probe(check_torch=False, extra=[Check(CheckKind.PHYSICAL_HOST)])
    refuse_unreachable(cluster, probes)
    hosts = node_physical_hosts(cluster, {r: p.facts for r, p in probes.items()})
    return launch_order(cluster, config.rank_order, hosts)
