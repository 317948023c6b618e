"""After a swap (launcher.jobs.spares), each rank's local-tier copy of one step on the node that
now holds the rank, before the relaunch restores it.

The peer replicator (gpufleet.replica) copies each node's ranks to the next node of the replica
ring. One swap that puts the ring's next node in the lost node's place keeps every rank where
its data is: each node after the lost one takes the ranks of the node before it, whose copies it
holds (`aligned`). Other swaps do not: a second swap, or a node that rejoined the spares and
sits in the middle of the job's order, gets ranks whose data is on some other node, and without
a move the restore would fall back to an older step every rank has (or to the durable tier, or
to step 0). So the controller asks every node in service what it holds (`inventory`), picks the
newest step every rank has somewhere (gpufleet.replica.plan_moves), and has each holder send the
rank's directory to the rank's new node over the replica key (`send`), as the replicator does.

The ring itself follows the job afterwards (`current_ring`): the world in rank order, then the
spares; the nodes swapped out leave it, so no copy goes to a node out of service.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from gpufleet.catalog import UnknownMachineType
from gpufleet.replica import Move, plan_moves, python_argv, ring_peer
from launcher.core.torchrun import nproc_for
from launcher.core.transport import Transport, make_transport
from launcher.core.types import Cluster, LaunchConfig, Node, Replication

__all__ = ["aligned", "askable", "current_ring", "forget", "rank_hosts", "realign"]

log = logging.getLogger("launcher")

ASK_TIMEOUT_S = 30.0  # one node's inventory, or one rank directory's copy between two nodes: per try
COPY_TIMEOUT_S = 600.0


def aligned(old: Sequence[str], new: Sequence[str], ring: Sequence[str], lost: set[str]) -> bool:
    """Whether every node of the `new` world (hosts by node rank) holds the data of the ranks it
    takes: its own, when it held them before (and was not lost), or its ring predecessor's copies
    (`ring`: the replica ring the failed attempt copied along)."""
    if len(old) != len(new):
        return False
    for before, now in zip(old, new, strict=True):
        if now == before and before not in lost:
            continue
        if now != ring_peer(ring, before):
            return False
    return True


def current_ring(replication: Replication, world: Sequence[Node], spares: Sequence[Node], out: set[str]) -> Replication:
    """The replica ring for the next attempt: the world in rank order, then the spares; a node
    swapped out is left out of it (its copies would go to a node out of service)."""
    ordered = replication.in_order((*world, *spares))
    return replace(ordered, ring=tuple(r for r in ordered.ring if r[0] not in out))


def askable(order: Sequence[str], out: set[str]) -> list[str]:
    """The nodes whose inventory counts, in the job's `order`: every node but those out of service
    (`out`: swapped out, this time or before, and not yet back among the spares). What an out
    node holds is from before it was lost, and its steps after the step the job resumed from
    belong to an attempt the job replaced: only the nodes that took part since have had those
    removed (gpufleet.local_tier.forget_after), and a rejoining node has all of it removed
    (`forget`). Asking it would also wait out its ssh ConnectTimeout where a lost VM answers
    nothing, as on a real VPC."""
    return [h for h in order if h not in out]


def rank_hosts(world: Sequence[Node], cluster: Cluster, config: LaunchConfig) -> list[str]:
    """Each global rank's host, in rank order (each node runs its nproc, as torchrun starts them)."""
    try:
        gpus = cluster.gpus_per_node
    except UnknownMachineType:
        gpus = None
    return [n.host for n in world for _ in range(nproc_for(n, gpus, config))]


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _inventories(
    transport: Transport, nodes: Sequence[Node], rep: Replication, job: str
) -> tuple[dict[str, dict], dict[str, str]]:
    """Each node's `inventory` of the job's local tier, asked at once, and why each node that gave
    none did not (left out of the first)."""
    held: dict[str, dict] = {}
    silent: dict[str, str] = {}

    def ask(node: Node) -> None:
        script = shlex.join([*python_argv(rep.code), "inventory", job])
        r = _run(transport.argv(node, script), ASK_TIMEOUT_S)
        if r is None or r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1] if r is not None else None
            silent[node.host] = last or f"no answer in {ASK_TIMEOUT_S:.0f} s"
            return
        try:
            held[node.host] = {a: {int(k): v for k, v in d.items()} for a, d in json.loads(r.stdout).items()}
        except (ValueError, AttributeError):
            log.warning("job %s: node %s answered its inventory with %r", job, node.host, r.stdout[:200])
            silent[node.host] = "its answer is not an inventory"

    threads = [threading.Thread(target=ask, args=(n,), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return held, silent


def realign(
    cluster: Cluster,
    world: Sequence[Node],
    nodes: Sequence[Node],
    config: LaunchConfig,
    say: Callable[[str], None],
) -> int | None:
    """Put each rank's newest common local step on its node of `world` (the new world, in rank
    order), asking every node of `nodes` that answers (the job's and the spares: `askable`, never
    a node out of service). The step every rank can now restore from the local tier (None: none, and the
    restore falls back to the durable tier or starts over). One line per copy, and one when
    nothing could be found."""
    rep = config.replication
    assert rep is not None
    transport = make_transport(replace(cluster, nodes=tuple(nodes)), config.ssh)
    job = config.job_id
    held, silent = _inventories(transport, nodes, rep, job)
    ranks = rank_hosts(world, cluster, config)
    step, moves = plan_moves(ranks, held)
    unasked = "".join(f"; node {h} did not say what it holds ({why})" for h, why in sorted(silent.items()))
    if step is None:
        say(
            f"no local step is on the nodes in service for all {len(ranks)} ranks{unasked}; the relaunch restores "
            "from the durable tier, if the job has one"
        )
        return None
    if unasked:
        say(f"taking local step {step}, the newest every rank has on the nodes that answered{unasked}")
    hop = dict(rep.ring)
    by_host = {n.host: n for n in nodes}
    failed: list[str] = []

    def copy(m: Move) -> None:
        argv = [*python_argv(rep.code), "send", "--state", rep.state, "--port", str(rep.port)]
        argv += ["--to", hop.get(m.dst, m.dst), job, m.area, str(m.step), str(m.rank)]
        r = _run(transport.argv(by_host[m.src], shlex.join(argv)), COPY_TIMEOUT_S)
        if r is None or r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["no answer"])[-1] if r is not None else "timed out"
            failed.append(f"rank {m.rank} from {m.src} to {m.dst}: {why}")
        else:
            say(f"copied rank {m.rank}'s step {m.step} from {m.src} ({m.area}) to {m.dst}, which holds it now")

    threads = [threading.Thread(target=copy, args=(m,), daemon=True) for m in moves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for line in failed:
        say(f"could not move a local step before the relaunch ({line}); the restore takes an older step")
    return step


def forget(cluster: Cluster, node: Node, config: LaunchConfig) -> list[int] | None:
    """Remove every local step of the job from `node`, which rejoins the spares after the job went
    on without it: what it holds is from before it was lost, and some of it from an attempt the
    job replaced (gpufleet.local_tier.forget_after). The steps removed; None when it did not
    answer."""
    rep = config.replication
    assert rep is not None
    transport = make_transport(replace(cluster, nodes=(node,)), config.ssh)
    r = _run(transport.argv(node, shlex.join([*python_argv(rep.code), "forget", config.job_id])), ASK_TIMEOUT_S)
    if r is None or r.returncode != 0:
        return None
    try:
        return [int(s) for s in json.loads(r.stdout)]
    except (ValueError, TypeError):
        return None
