"""How content travels among the nodes: a forwarding tree from node 0, and the relay key that
lets a node pass content on to its children without holding the cluster key.

The tree. The launching machine sends each object once, to node 0. Node 0 passes it on to at
most `fanout` nodes, each of them to `fanout` more, breadth first by rank, so 16 nodes at
fan-out 4 are two levels deep and node 0 sends 4 copies, not 15 (a star: fan-out N-1). Each
node passes an object on chunk by chunk as the chunks arrive (launcher.code.node_agent,
`Forward`), so a level costs a chunk's delay, not an object's. An edge carries exactly the
objects its child lacks: every node in the tree lacks something, its parent ends up holding
the whole request, and what a child already holds it passes on from its own store.

The relay key. A node deeper than node 0 has to authenticate to its children. The choices:
- the cluster key (launcher.cluster.key) on every interior node: it opens a shell on every node
  of the cluster, so a quarter of the fleet would hold a key that today only node 0 holds, and
  only for a detached job;
- agent forwarding from node 0: the cluster key's authorized entry says no-agent-forwarding,
  and a forwarded agent lends the same shell-on-every-node power to every interior node while
  the transfer lasts;
- an intra-cluster key that every node has from the stack: infra/ installs none (nodes log in
  through OS Login, `enable-oslogin`: a person's own account, no key a node holds).
So a key of its own per cluster, the relay key (`~/.cache/gpufleet/CLUSTER/relay_ed25519`),
authorized on every node by the preparation's first round (which already runs there) with
`restrict` (no forwarding, no pty, no ~/.ssh/rc), `from=` the cluster's addresses, and a
forced command: this version of the node agent, by the hash it is stored under
(`python3 -S .gpufleet/objects/SHA relay`; sshd(8), AUTHORIZED_KEYS FILE FORMAT). Whoever holds
it can only hand a node objects (each checked against its hash) and ask it to pass objects on
to cluster addresses; never run a command. The relay key travels only to node 0 and the
interior nodes, with the known_hosts the launching machine verified (host keys checked
strictly: no first-use trust), and is removed when the relay ends.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from launcher.code import node_agent
from launcher.core.transport import cluster_slug
from launcher.core.types import Cluster

__all__ = ["DEFAULT_FANOUT", "AGENT_SHA", "forwarding_tree", "depth", "relay_plan", "authorize_relay"]

DEFAULT_FANOUT = 4

# The hash the node agent stores its own source under (node_agent.keep_own_source): the exact
# text `python3 -S -c` receives (launcher.code.prepare.agent_script).
AGENT_SHA = hashlib.sha256(Path(node_agent.__file__).read_text().encode()).hexdigest()


def forwarding_tree(root: int, others: Iterable[int], fanout: int) -> dict[int, list[int]]:
    """Each rank's children: `root` first, then breadth first, each parent taking up to `fanout`
    children in rank order (rank i's parent is the (i-1)//fanout-th of the order)."""
    if fanout < 1:
        raise ValueError(f"fan-out {fanout} must be at least 1")
    order = [root, *sorted(others)]
    children: dict[int, list[int]] = {rank: [] for rank in order}
    for i, rank in enumerate(order[1:], start=1):
        children[order[(i - 1) // fanout]].append(rank)
    return children


def depth(tree: Mapping[int, list[int]], root: int) -> int:
    """Levels below the root (a star: 1)."""
    below = tree.get(root, [])
    return 1 + max(depth(tree, c) for c in below) if below else 0


def relay_plan(
    tree: Mapping[int, list[int]],
    root: int,
    missing: Mapping[int, list[str]],
    hosts: Mapping[int, str],
    user: str | None,
    port: int,
) -> list[dict]:
    """The root's FWD frame (node_agent.relay): each child with the objects it lacks and its
    own children, nested."""

    def hop(rank: int) -> dict:
        return {
            "rank": rank,
            "host": hosts[rank],
            "port": port,
            "user": user,
            "objects": sorted(missing[rank]),
            "children": [hop(c) for c in tree[rank]],
        }

    return [hop(c) for c in tree[root]]


def authorize_relay(public_key: str, cluster: Cluster) -> str:
    """A node-side statement: authorize the relay key, its forced command this agent version's
    `relay`. An entry for the same cluster that differs (another agent version, other addresses)
    is replaced: sshd uses the first entry that matches a key."""
    kind, b64 = public_key.split()[:2]
    addresses = ",".join(sorted({n.address for n in cluster.nodes}))
    tag = f"gpufleet-relay-{cluster_slug(cluster)}"
    entry = shlex.quote(
        f'from="{addresses}",restrict,command="exec python3 -S .gpufleet/objects/{AGENT_SHA} relay" {kind} {b64} {tag}'
    )
    others = shlex.quote(f" {tag}")
    return (
        '( umask 077; mkdir -p "$HOME/.ssh" && K="$HOME/.ssh/authorized_keys" && touch "$K" && '
        f'{{ grep -qxF {entry} "$K" || {{ grep -vF {others} "$K" > "$K.gpufleet"; '
        f'printf "%s\\n" {entry} >> "$K.gpufleet" && mv "$K.gpufleet" "$K"; }}; }} )'
    )
