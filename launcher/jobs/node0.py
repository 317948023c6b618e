"""The client's one way to the job host, where detached jobs keep their records
(launcher.jobs.record): run a reader program (list, logs, stop, a job's samples) and get what it
printed, or one `UserError` naming that host. `launch jobs|logs|stop|attach`, `launch top JOB_ID`
and the busy check all use it. The job host is the cluster's controller host when it has one
(`Cluster.controller`: the stack's controller VM, `--controller HOST`, a hostfile's `controller
HOST` line), else node 0; the class keeps node 0's name, the role it has without one."""

from __future__ import annotations

import subprocess

from launcher.core.transport import Transport
from launcher.core.types import Cluster, ControllerHost, Node, UserError
from launcher.jobs.record import RESTARTED_MARKER, JobRecord, list_script, parse_listing, restart_script

__all__ = ["Node0", "job_host"]


def job_host(cluster: Cluster) -> ControllerHost | Node:
    """Where the cluster's detached jobs run their controllers and keep their records."""
    return cluster.controller or cluster.nodes[0]


class Node0:
    """SSH to the job host (`head`: job_host(cluster)) over the cluster's `transport`."""

    def __init__(self, transport: Transport, head: ControllerHost | Node, timeout_s: float = 60.0):
        self.transport, self.head, self.timeout_s = transport, head, timeout_s

    def argv(self, script: str) -> list[str]:
        return self.transport.argv(self.head, script)

    def run(self, script: str) -> str:
        """What `script` prints on node 0; a failure or no answer in time is one UserError."""
        try:
            r = subprocess.run(self.argv(script), capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise UserError(f"{self.head.label} did not answer within {self.timeout_s:g} s") from None
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            raise UserError(f"{self.head.label}: {why}")
        return r.stdout

    def records(self, job_id: str | None = None) -> list[JobRecord]:
        """Every job's record on node 0 (newest first), or only `job_id`'s."""
        return parse_listing(self.run(list_script(job_id)))

    def record(self, job_id: str) -> JobRecord:
        found = self.records(job_id)
        if not found:
            raise UserError(f"no job {job_id} on {self.head.label}; `launch jobs` lists the jobs there")
        return found[0]

    def restart(self, job_ids: list[str]) -> list[str]:
        """Start again the dead controllers of these jobs (launcher.jobs.record.restart_script);
        the ids whose controller now runs."""
        out = self.run(restart_script(job_ids))
        return [line.split()[1] for line in out.splitlines() if line.startswith(RESTARTED_MARKER + " ")]
