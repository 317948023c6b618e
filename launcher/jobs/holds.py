"""Every account's jobs on a cluster, as the nodes' holds registries say (launcher.core.holds):
what `launch jobs --all` lists and `launch top` heads its view with, and the refusal of `launch
stop` for another account's job. A job's record stays private to its account (~/.gpufleet/jobs,
0700); its hold says only who, which job, since when and on which nodes."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

from launcher.core.holds import Hold, by_job, holds_script, parse_holds
from launcher.core.transport import Transport
from launcher.core.types import Cluster, UserError

__all__ = ["cluster_holds", "HoldsWatch", "refuse_others_job", "holds_summary"]


def cluster_holds(cluster: Cluster, transport: Transport, timeout_s: float = 30.0) -> dict[Hold, list[str]]:
    """Every live hold on the cluster's nodes, with the labels of the nodes each was read on (by
    rank order). A node that does not answer is left out: it holds nothing anyone can see."""
    found: dict[int, list[Hold]] = {}
    script = holds_script()

    def one(rank: int) -> None:
        node = cluster.nodes[rank]
        try:
            r = subprocess.run(transport.argv(node, script), capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            return
        if r.returncode == 0:
            found[rank] = parse_holds(r.stdout)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(cluster.nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return by_job((h, cluster.nodes[rank].label) for rank in sorted(found) for h in found[rank])


def holds_summary(holds: dict[Hold, list[str]]) -> str:
    """One line for a heading: who holds how many nodes."""
    if not holds:
        return "held by no job"
    jobs = [f"{h.account}'s job {h.job} ({len(n)} node{'s' * (len(n) != 1)})" for h, n in holds.items()]
    return "held: " + "; ".join(jobs)


def refuse_others_job(job_id: str, account: str, holds: dict[Hold, list[str]]) -> None:
    """UserError when `job_id` is held by an account other than `account`: its record and its
    processes are that account's, and only it can stop them."""
    for h, nodes in holds.items():
        if h.job == job_id and h.account != account:
            raise UserError(
                f"job {job_id} is {h.account}'s ({h.line(nodes)}); only {h.account} can stop it: ask them, "
                "or wait with `launch run --wait`"
            )


class HoldsWatch:
    """The cluster's holds read again every `every_s` in a thread of its own (`launch top`)."""

    def __init__(self, read: Callable[[], dict[Hold, list[str]]], every_s: float = 10.0):
        self._read, self._every = read, every_s
        self._stop = threading.Event()
        self.holds: dict[Hold, list[str]] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> HoldsWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.holds = self._read()
            self._stop.wait(max(0.0, self._every - (time.monotonic() - t0)))

    def summary(self) -> str:
        return "" if self.holds is None else f"  ({holds_summary(self.holds)})"

    def stop(self) -> None:
        self._stop.set()
