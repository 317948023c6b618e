"""Ranks ordered by where the nodes physically sit. Pure functions.

On A3 and A4, Compute Engine says where each VM runs: `physical_host` ("/CLUSTER/BLOCK/SUBBLOCK/
HOST", gpufleet.health.parse_physical_host) from the metadata server on the node, and
`resourceStatus.physicalHost` from the Compute Engine API. Neighbouring ranks talk the most (ring
all-reduce, pipeline stages), so placing them on neighbouring hosts keeps their traffic under the
fewest switches; Google's A3 Mega docs recommend it and Cluster Toolkit sorts Slurm's hostfile this
way (examples/machine-learning/a3-megagpu-8g/topological-sort/sort_nodes.py, `order`).

`order` follows that function: the paths make a tree whose children keep the order they were
first seen, and the nodes are read off its leaves depth first. So nodes sharing a block (then a
subblock, then a host) become neighbours, groups keep the order of their first member, the first
node stays first, and among equals the given order is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from gpufleet.health import PhysicalHost, parse_physical_host
from launcher.core.types import Cluster, UserError

__all__ = [
    "METADATA_HOST_ENV",
    "METADATA_DEFAULT_HOST",
    "PHYSICAL_HOST_PATH",
    "RANK_ORDERS",
    "metadata_statement",
    "node_physical_hosts",
    "order",
    "RankOrder",
    "rank_order",
    "api_rank_order",
    "launch_order",
    "blocks",
    "spread_warning",
]

# The metadata server, as google-auth reaches it: GCE_METADATA_HOST ("host[:port]") replaces
# metadata.google.internal when set (google/auth/compute_engine/_metadata.py, environment_vars).
# gpufleet's node check honours the same variable; the tests point it at a local server that
# answers like the metadata server for one node (tests/launcher/fake_metadata.py).
METADATA_HOST_ENV = "GCE_METADATA_HOST"
METADATA_DEFAULT_HOST = "metadata.google.internal"
PHYSICAL_HOST_PATH = "/computeMetadata/v1/instance/attributes/physical_host"

RANK_ORDERS = ("topology", "given")


def metadata_statement() -> str:
    """The bash statement a node's check runs to learn where it sits: `metadata_rc=` (curl's
    status: 0 answered, 22 the 404 of a VM without a placement policy, else no metadata server)
    and `physical_host=` lines. The metadata server wants the `Metadata-Flavor: Google` header
    (compute/docs/metadata/querying-metadata); -m 2 bounds a machine that is not on GCE."""
    url = f"http://${{{METADATA_HOST_ENV}:-{METADATA_DEFAULT_HOST}}}{PHYSICAL_HOST_PATH}"
    return (
        f"H=$(curl -sf -m 2 -H 'Metadata-Flavor: Google' \"{url}\" 2>/dev/null); echo metadata_rc=$?; "
        "echo \"physical_host=$H\""
    )


def node_physical_hosts(cluster: Cluster, facts: Mapping[int, Mapping[str, str]]) -> dict[str, PhysicalHost | None]:
    """{node.host: where it sits}: what the node's metadata server said in its check (`facts`
    by rank, from metadata_statement), else what the Compute Engine API said (Node.physical_host,
    --label); None where neither knows or the value is not a physical-host path."""
    out: dict[str, PhysicalHost | None] = {}
    for node in cluster.nodes:
        f = facts.get(node.rank) or {}
        raw = f.get("physical_host", "") if f.get("metadata_rc") == "0" else ""
        raw = raw or getattr(node, "physical_host", "") or ""
        try:
            out[node.host] = parse_physical_host(raw)
        except ValueError:
            out[node.host] = None
    return out


T = TypeVar("T")


def order(items: Sequence[T], paths: Mapping[T, Sequence[str]]) -> list[T]:
    """`items` regrouped so that those sharing a path prefix are adjacent (see the module
    docstring); an item without a path keeps its place relative to the others without one."""
    tree: dict = {}
    for item in items:
        node = tree
        for part in paths.get(item, ("",)):
            node = node.setdefault(("part", part), {})
        node[("leaf", id(item))] = item
    out: list[T] = []

    def walk(node: dict) -> None:
        for (kind, _), child in node.items():
            if kind == "leaf":
                out.append(child)
            else:
                walk(child)

    walk(tree)
    return out


@dataclass(frozen=True)
class RankOrder:
    cluster: Cluster  # renumbered when reordered
    reordered: bool  # ranks follow the topology (not necessarily a different order)
    message: str  # one line saying which order is used and why


def rank_order(cluster: Cluster, hosts: Mapping[str, PhysicalHost | None], mode: str | None, source: str) -> RankOrder:
    """Order `cluster`'s ranks by topology (`mode` "topology"), keep them ("given"), or, with
    `mode` None, order by topology exactly when every node's physical host is known.

    `hosts` maps node.host to its physical host (None: unknown); `source` says where they came
    from ("the metadata server", "the Compute Engine API") for the message. Raises UserError when
    "topology" is asked for and some node has none."""
    if mode not in (None, *RANK_ORDERS):
        raise UserError(f"--rank-order {mode!r} is unknown; one of: {', '.join(RANK_ORDERS)}")
    n = len(cluster.nodes)
    missing = [node.label for node in cluster.nodes if hosts.get(node.host) is None]
    if mode == "given":
        return RankOrder(cluster, False, "ranks in the given order (--rank-order given)")
    if missing:
        if mode == "topology":
            raise UserError(
                f"--rank-order topology: no physical host for {', '.join(missing)} (from "
                f"{source}; only VMs with a placement policy have one); pass --rank-order given"
            )
        return RankOrder(
            cluster,
            False,
            f"ranks in the given order: {len(missing)} of {n} nodes have no physical host (from {source})",
        )
    ordered = order(list(cluster.nodes), {node: hosts[node.host].path for node in cluster.nodes})
    renumbered = tuple(replace(node, rank=i) for i, node in enumerate(ordered))
    moved = sum(a.host != b.host for a, b in zip(cluster.nodes, renumbered))
    new = replace(cluster, nodes=renumbered)
    what = f"{moved} of {n} nodes moved" if moved else "the given order already was"
    return RankOrder(
        new,
        True,
        f"ranks ordered by physical topology from {source} ({what}; --rank-order given keeps the given order)",
    )


def api_rank_order(cluster: Cluster, mode: str | None) -> RankOrder | None:
    """The rank order a launch uses, decided before any node is contacted: by the Compute Engine
    API's `resourceStatus.physicalHost` (Node.physical_host, --label) when every node has one,
    unless `mode` is "given". None when there is nothing to say (no node has one, no mode).

    A launch fixes each node's rank in the program it sends (GPUFLEET_NODE_RANK, node 0's
    rendezvous), so the metadata server's answer, which arrives with the check, comes too late to
    reorder it; "topology" without the API's answer is refused with the way to get it."""
    raw = {n.host: getattr(n, "physical_host", "") or "" for n in cluster.nodes}
    if mode == "given":
        return rank_order(cluster, {}, "given", "the Compute Engine API")
    if not any(raw.values()):
        if mode == "topology":
            raise UserError(
                "--rank-order topology needs each node's physical host before the nodes are contacted: "
                "the Compute Engine API gives it with --label. For other sources, `launch doctor` "
                "reads it from every node's metadata server and prints that order (rank_order.hosts "
                "with --json); a hostfile in that order keeps it"
            )
        return None
    hosts = {}
    for host, value in raw.items():
        try:
            hosts[host] = parse_physical_host(value)
        except ValueError:
            hosts[host] = None
    return rank_order(cluster, hosts, mode, "the Compute Engine API")


def _named(labels: Sequence[str], most: int = 3) -> str:
    return ", ".join(labels[:most]) + (", ..." if len(labels) > most else "")


def launch_order(
    cluster: Cluster,
    mode: str | None,
    hosts: Mapping[str, PhysicalHost | None] | None,
    source: str = "the metadata server",
) -> RankOrder:
    """The order a launch runs its nodes in, and one line saying which and why ("rank order:
    given (node 2 (10.0.0.4) reports no physical_host)", "rank order: topology (2 blocks; 1 of 4
    nodes moved)"). `mode`: --rank-order ("topology", "given"; None: topology exactly when every
    node has a physical host). `hosts`: node.host -> where it sits (None: unknown); None when no
    node was asked (--dry-run). Raises UserError for "topology" when a node has none."""
    if mode not in (None, *RANK_ORDERS):
        raise UserError(f"--rank-order {mode!r} is unknown; one of: {', '.join(RANK_ORDERS)}")
    if mode == "given":
        return RankOrder(cluster, False, "rank order: given (--rank-order given)")
    if cluster.local:
        if mode == "topology":
            raise UserError(
                "--rank-order topology does not apply to --local (its nodes are processes on this "
                "machine); pass --rank-order given or leave it out"
            )
        return RankOrder(cluster, False, "rank order: given (--local: every node is this machine)")
    if hosts is None:
        if mode == "topology":
            why = "--dry-run asks no node for its physical_host; a launch refuses unless every node reports one"
        else:
            why = "--dry-run asks no node for its physical_host; a launch orders by topology if every node reports one"
        return RankOrder(cluster, False, f"rank order: given here ({why})")
    missing = [node.label for node in cluster.nodes if hosts.get(node.host) is None]
    if missing:
        verb = "reports" if len(missing) == 1 else "report"
        if mode == "topology":
            raise UserError(
                f"--rank-order topology: {_named(missing, 8)} {verb} no physical_host (from {source}; "
                "only VMs in a placement policy have one); pass --rank-order given"
            )
        if len(missing) == len(cluster.nodes) > 1:
            return RankOrder(cluster, False, "rank order: given (no node reports a physical_host)")
        what = missing[0] if len(missing) == 1 else f"{len(missing)} of {len(cluster.nodes)} nodes: {_named(missing)}"
        return RankOrder(cluster, False, f"rank order: given ({what} {verb} no physical_host)")
    ordered = rank_order(cluster, hosts, "topology", source).cluster
    moved = sum(a.host != b.host for a, b in zip(cluster.nodes, ordered.nodes))
    nblocks = len(blocks(hosts)) or 1
    what = f"{moved} of {len(cluster.nodes)} nodes moved" if moved else "the given order already is"
    return RankOrder(ordered, True, f"rank order: topology ({nblocks} block{'s' * (nblocks != 1)}; {what})")


def blocks(hosts: Mapping[str, PhysicalHost | None]) -> dict[str, list[str]]:
    """{block: [node host, ...]} for the nodes whose block is known ("CLUSTER/BLOCK": block ids
    are only unique within their cluster)."""
    out: dict[str, list[str]] = {}
    for host, ph in hosts.items():
        if ph is not None and ph.block is not None:
            out.setdefault(f"{ph.cluster}/{ph.block}", []).append(host)
    return out


def spread_warning(hosts: Mapping[str, PhysicalHost | None]) -> str | None:
    """One line when the nodes sit in more than one block: a compact placement policy puts them
    in one, so either there is none or it did not hold (the cluster is slower across blocks)."""
    by_block = blocks(hosts)
    if len(by_block) <= 1:
        return None
    parts = ", ".join(
        f"{b}: {len(v)} node{'s' * (len(v) != 1)}"
        for b, v in sorted(by_block.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )
    return (
        f"the nodes span {len(by_block)} blocks ({parts}); a compact placement keeps a cluster in "
        "one block, so if this cluster has one, the placement did not hold"
    )
