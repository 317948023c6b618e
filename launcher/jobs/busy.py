"""An attached launch on nodes busy with a detached job is refused (its workers would fight the
job's for the GPUs and the rendezvous port), with one line naming that job.

The question goes to node 0 (where detached jobs' records live, launcher.jobs.record) in a session of
its own, started as soon as node 0 has passed its check: it then rides node 0's open connection
(ControlMaster) instead of paying a handshake of its own, and it overlaps the other nodes' checks.
The launch waits for the answer only once every node has answered its check, before any is told
to go. Node 0 not answering is no refusal: the launch's own check names it.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable

from launcher.core.launch import NodeEvent, NodeState
from launcher.core.transport import make_transport
from launcher.core.types import Cluster, LaunchConfig, UserError
from launcher.jobs.node0 import Node0, job_host
from launcher.jobs.record import JobRecord, list_script, parse_listing

__all__ = ["BusyCheck"]


class BusyCheck:
    """Ask node 0 which detached jobs are pending or running; `gate(on_event)` wraps a launch's
    event callback so that, once every node has answered its check, it waits for the answer and
    sets `stop` when a job holds any of this launch's nodes (the launch then starts nothing)."""

    def __init__(self, cluster: Cluster, config: LaunchConfig, stop: threading.Event):
        self.cluster = cluster
        self.stop = stop
        self.busy: JobRecord | None = None
        self._answered: set[int] = set()  # ranks whose check has ended, one way or another
        self._node0 = Node0(make_transport(cluster, config.ssh, config.dry_run), job_host(cluster))
        self._timeout = config.ssh.connect_timeout + 10.0
        self._proc: subprocess.Popen | None = None

    def _ask(self) -> None:
        self._proc = subprocess.Popen(
            self._node0.argv(list_script()),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    def gate(self, on_event: Callable[[NodeEvent], None]) -> Callable[[NodeEvent], None]:
        def gated(event: NodeEvent) -> None:
            on_event(event)
            rank = event.node.rank
            if event.state is not None and event.state is not NodeState.CONNECTING and rank not in self._answered:
                self._answered.add(rank)
                if rank == 0 and event.state is NodeState.CHECKED:
                    self._ask()
                if len(self._answered) == len(self.cluster.nodes):  # every node has answered; none has gone
                    self._wait()

        return gated

    def _wait(self) -> None:
        if self._proc is None:
            return  # node 0 did not pass its check: the launch refuses on its own
        try:
            out, _ = self._proc.communicate(timeout=self._timeout)
        except subprocess.TimeoutExpired:
            self.close()
            return
        hosts = {n.host for n in self.cluster.nodes}
        active = [r for r in parse_listing(out) if not r.state.final and hosts & set(r.nodes)]
        if self._proc.returncode == 0 and active:
            self.busy = active[-1]  # the oldest: the one running, or first in the queue
            self.stop.set()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def refusal(self) -> UserError:
        r = self.busy
        assert r is not None
        return UserError(
            f"the nodes are busy with detached job {r.id} ({r.state.value}: {r.what}); nothing was "
            f"started. Wait for it (launch logs {r.id} -f), stop it (launch stop {r.id}), or add "
            "--detach to queue behind it"
        )
