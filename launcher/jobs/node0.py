"""The client's one way to node 0, where detached jobs keep their records (launcher.jobs.record):
run a reader program (list, logs, stop, a job's samples) and get what it printed, or one
`UserError` naming node 0. `launch jobs|logs|stop|attach` and `launch top JOB_ID` all use it."""

from __future__ import annotations

import subprocess

from launcher.core.transport import Transport
from launcher.core.types import Node, UserError
from launcher.jobs.record import JobRecord, list_script, parse_listing

__all__ = ["Node0"]


class Node0:
    """SSH to node 0 (`head`) over the cluster's `transport`."""

    def __init__(self, transport: Transport, head: Node, timeout_s: float = 60.0):
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
