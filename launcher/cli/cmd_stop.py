"""`launch stop JOB_ID`: stop a detached job on every node (a pending one leaves the queue)."""

from __future__ import annotations

import time
from typing import Any

import click
from rich.markup import escape

from launcher.cli.detached import STATE_STYLE, node0
from launcher.cli.options import SOURCE_OPTIONS, apply_options
from launcher.cli.render import err, user_errors
from launcher.core.types import UserError
from launcher.jobs.node0 import Node0
from launcher.jobs.record import JobRecord, check_job_id, stop_script

__all__ = ["stop"]


def _wait_final(n0: Node0, job_id: str, timeout: float) -> JobRecord:
    deadline = time.monotonic() + timeout
    while True:
        record = n0.record(job_id)
        if record.state.final or time.monotonic() > deadline:
            return record
        time.sleep(0.3)


@click.command(name="stop")
@apply_options(SOURCE_OPTIONS)
@click.argument("job_id")
@user_errors
def stop(job_id: str, **o: Any) -> None:
    """Stop a detached job on every node (a pending one leaves the queue)."""
    check_job_id(job_id)
    _, n0 = node0(o)
    n0.record(job_id)  # names a job that is not there
    said = n0.run(stop_script(job_id)).strip().splitlines()
    with err.status(f"stopping job {job_id}…"):
        record = _wait_final(n0, job_id, 30.0)
    if "stopping" in said and not record.state.final:
        raise UserError(f"job {job_id} did not stop within 30 s; its controller on {n0.head.label} is pid {record.pid}")
    err.print(f"job {job_id}: [{STATE_STYLE[record.state.value]}]{record.state.value}[/] {escape(record.why)}")
