"""`launch prune`'s library: what launches left on the nodes' disks (launcher.code.node_prune
is the node side), listed or removed.

Two rounds:
1. the job host (the controller host when the cluster has one, else node 0) names the paths its
   jobs that have not ended still need (a RECOVERING job has no process on the nodes, but its
   relaunch needs its directory, code and environment where it left them);
2. every node at once lists (or removes) what no launch used for --older-than, those paths kept.
A job host that cannot be asked means nobody can tell which jobs are live: nothing is listed or
removed anywhere, and the error says so. Another unreachable node is reported and left as it is.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from launcher.code import node_prune
from launcher.code.prepare import PrepareReport, agent_script, run_agent
from launcher.core.transport import Transport
from launcher.core.types import Cluster, ControllerHost, Node, UserError

__all__ = ["PruneRequest", "HostPrune", "prune", "prune_script"]


@dataclass(frozen=True)
class PruneRequest:
    older_than_s: float  # unused this long before it may go
    remove: bool = False  # False: only say what would go


@dataclass
class HostPrune:
    """One host's answer: each candidate (`kind`, `path`, `bytes`, `age_s`, and `kept` with why,
    or `removed`), the paths its own job records pin, its disk's free and total bytes; or
    `error` when it could not be asked."""

    label: str
    items: list[dict] = field(default_factory=list)
    pinned: list[dict] = field(default_factory=list)
    free: int = 0
    total: int = 0
    error: str | None = None

    @property
    def going(self) -> list[dict]:
        return [i for i in self.items if "kept" not in i]

    @property
    def kept(self) -> list[dict]:
        return [i for i in self.items if "kept" in i]


def prune_script() -> str:
    """The node's command: the node side's source run by its own python3, no site-packages."""
    return agent_script("scan", node_prune)


def _ask(transport: Transport, host: Node | ControllerHost, body: dict) -> HostPrune:
    data = json.dumps(body).encode()
    result, why = run_agent(transport, host, prune_script(), [data], lambda n, t: None, PrepareReport())
    if result is None:
        return HostPrune(host.label, error=why)
    return HostPrune(
        host.label, result["items"], result.get("pinned", []), result.get("free", 0), result.get("total", 0)
    )


def _on_each(transport: Transport, hosts: list, body: dict) -> list[HostPrune]:
    """Every host asked at once, answers in the order of `hosts`."""
    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        return list(pool.map(lambda h: _ask(transport, h, body), hosts))


def prune(cluster: Cluster, transport: Transport, request: PruneRequest) -> dict[int, HostPrune]:
    """Every node's answer by rank (after removing, when `request.remove`); the controller host,
    when the cluster has one, under rank -1 (it is scanned for its job records, never pruned)."""
    if cluster.local:
        raise UserError("--local runs keep nothing on nodes; prune a cluster's nodes (--stack, --hostfile, --label)")
    head: Node | ControllerHost = cluster.controller or cluster.nodes[0]
    (first,) = _on_each(transport, [head], {"older_than_s": request.older_than_s, "remove": False})
    if first.error:
        done = "nothing was removed" if request.remove else "nothing was listed"
        raise UserError(
            f"{head.label} keeps the jobs' records and could not be asked ({first.error}): nothing can tell "
            f"which jobs still need their files, so {done}; try again when it answers"
        )
    keep = sorted({p["path"] for p in first.pinned})
    body = {"older_than_s": request.older_than_s, "remove": request.remove, "keep": keep}
    answers = dict(zip([n.rank for n in cluster.nodes], _on_each(transport, list(cluster.nodes), body)))
    if cluster.controller is not None:
        answers[-1] = first
    return answers
