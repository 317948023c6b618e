"""Spare nodes (`--spares K` on a detached `--recover` job): which nodes wait, and who takes a
lost node's place. Pure functions; launcher.jobs.recovery.Recoverer does the swapping.

The job's nodes are put in the launch's rank order once, on the client (launcher.cluster.ordering:
by physical topology when every node reports where it sits, else the node source's order). The
last K of that order are the spares: prepared like the others (the same code, environment and
check as every node of a detached launch gets: launcher.jobs.handoff) and then left idle. The job's
world is the other N-K.

When a node is lost or judged bad (unreachable, its check fails, a hang's culprit) and a spare
is left, the spare takes its place at once: the world keeps its size, and its ranks are the
nodes' positions in that same order (the job's order), so a spare does not inherit the lost
node's rank but its place among the nodes in use; rank 0, the rendezvous, is the first node in
use. The node swapped out waits, out of service, until a later swap needs a spare and none is
left; it is then checked again, and one that passes rejoins the spares.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from launcher.core.types import Node, UserError

__all__ = ["Swap", "check_spares", "split_spares", "swap_in", "swap_line"]


@dataclass(frozen=True)
class Swap:
    """One spare put in a lost node's place, as the job's record lists it (`Recovery.swaps`)."""

    at: float  # when (the controller's clock)
    rank: int  # the lost node's rank in the world it left
    out: str  # the lost node's host
    into: str  # the spare's host
    why: str  # unreachable, check failed, hang

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Swap":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def check_spares(spares: int | None, nodes: int | None = None) -> None:
    """--spares' refusals, one line each: a negative count, or as many spares as nodes (or more),
    which leaves no node to train on. `nodes`: the cluster's count, once known."""
    if spares is None:
        return
    if spares < 0:
        raise UserError(f"--spares {spares} is negative; give 0 or more spare nodes")
    if nodes is not None and spares >= nodes:
        raise UserError(
            f"--spares {spares} leaves no node to train on: the cluster has {nodes} node{'s' * (nodes != 1)}; give "
            f"at most {nodes - 1}"
        )


def split_spares(nodes: Sequence[Node], k: int) -> tuple[tuple[Node, ...], tuple[Node, ...]]:
    """(the world, the spares) of nodes in the launch's order: the last `k` are spares; the
    world keeps its ranks 0..N-k-1."""
    check_spares(k, len(nodes))
    cut = len(nodes) - k
    return tuple(nodes[:cut]), tuple(nodes[cut:])


def swap_in(
    order: Sequence[str], world: Sequence[Node], lost: Mapping[int, str], spares: Sequence[Node]
) -> tuple[tuple[Node, ...], tuple[Node, ...], list[Swap]]:
    """Put a spare in place of each lost rank (`lost`: rank -> why, in rank order) while spares
    last: (the new world, renumbered by the job's `order` of hosts; the spares left; the swaps
    made). A lost rank with no spare left stays in the world (its recovery then waits, or shrinks)."""
    now = time.time()
    left = list(spares)
    by_rank = {n.rank: n for n in world}
    keep = dict(by_rank)
    swaps: list[Swap] = []
    for rank in sorted(lost):
        if not left or rank not in by_rank:
            continue
        spare = left.pop(0)
        keep[rank] = spare
        swaps.append(Swap(now, rank, by_rank[rank].host, spare.host, lost[rank]))
    place = {host: i for i, host in enumerate(order)}
    # A host the order does not know (none should be) goes after those it does, in rank order.
    ranked = sorted(keep.items(), key=lambda kv: (place.get(kv[1].host, len(place)), kv[0]))
    new = tuple(replace(node, rank=i) for i, (_, node) in enumerate(ranked))
    return new, tuple(left), swaps


def swap_line(s: dict[str, Any]) -> str:
    """`node 1 (10.0.0.2) → spare 10.0.0.4 (unreachable)`: one swap of a record."""
    w = Swap.from_json(s)
    return f"node {w.rank} ({w.out}) → spare {w.into} ({w.why})"
