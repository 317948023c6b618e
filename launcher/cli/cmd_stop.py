"""`launch stop JOB_ID`: stop a detached job on every node (a pending one leaves the queue). Another
account's job (the nodes' holds name it: launcher.jobs.holds) is refused in one line naming it."""

from __future__ import annotations

import json
import time
from typing import Any

import click
from rich.markup import escape

from launcher.cli.detached import STATE_STYLE, dry_run, node0, restart_orphans
from launcher.cli.options import SOURCE_OPTIONS, DryRunCommand, apply_options
from launcher.cli.render import err, user_errors
from launcher.core.types import LaunchConfig, UserError
from launcher.jobs.holds import cluster_holds, refuse_others_job
from launcher.jobs.node0 import Node0
from launcher.jobs.record import JobRecord, check_job_id, list_script, stop_script
from launcher.jobs.recovery import parse_duration

__all__ = ["stop"]


def _wait_final(n0: Node0, job_id: str, timeout: float) -> JobRecord:
    deadline = time.monotonic() + timeout
    while True:
        record = n0.record(job_id)
        if record.state.final or time.monotonic() > deadline:
            return record
        time.sleep(0.3)


def _request_script(job_id: str) -> str:
    return f'cat "$HOME"/.gpufleet/jobs/{check_job_id(job_id)}/request.json 2>/dev/null; exit 0'


def _job_term_grace(n0: Node0, job_id: str) -> tuple[float, bool]:
    """The job's --term-grace, and whether it runs under torchrun, from its request on node 0."""
    text = n0.run(_request_script(job_id))
    try:
        d = json.loads(text)
        return float(d["config"].get("stop_grace_s", 5.0)), d["workload"]["kind"] == "torchrun"
    except (ValueError, KeyError, TypeError):
        return LaunchConfig.stop_grace_s, False


def _account(n0: Node0) -> str:
    """This account's name on the job host (as a hold names its account)."""
    return n0.run("id -un").strip().splitlines()[-1]


@click.command(cls=DryRunCommand, name="stop")
@apply_options(SOURCE_OPTIONS)
@click.argument("job_id")
@click.option(
    "--grace",
    metavar="DURATION",
    help="SIGTERM to SIGKILL for every rank, e.g. 10s [default: the job's --term-grace], at most the "
    "job's --term-grace under torchrun (whose own SIGKILL follows it).",
)
@user_errors
def stop(job_id: str, grace: str | None, **o: Any) -> None:
    """Stop a detached job on every node (a pending one leaves the queue): every rank gets
    SIGTERM, then SIGKILL after the grace; the job's log says which exited by themselves."""
    check_job_id(job_id)
    grace_s = parse_duration(grace, "--grace") if grace is not None else None
    cluster, n0 = node0(o)
    steps = [
        (f"read job {job_id}'s record", list_script(job_id)),
        (f"read job {job_id}'s --term-grace", _request_script(job_id)),
        (f"stop job {job_id}, then wait for its record to say it ended", stop_script(job_id, grace_s)),
    ]
    if dry_run(o, n0, steps):
        return
    found = n0.records(job_id)
    if not found:  # not this account's: another's (its hold names it), or none
        refuse_others_job(job_id, _account(n0), cluster_holds(cluster, n0.transport))
    # Names a job that is not there; a job whose controller died gets one again, which stops it.
    restart_orphans(n0, [n0.record(job_id)])
    term_s, torchrun = _job_term_grace(n0, job_id)
    if grace_s is not None and torchrun and grace_s > term_s:
        raise UserError(
            f"--grace {grace} is longer than job {job_id}'s --term-grace {term_s:g} s, which torchrun's own "
            f"SIGKILL follows; give at most {term_s:g}s, or start the job with --term-grace {grace}"
        )
    said = n0.run(stop_script(job_id, grace_s)).strip().splitlines()
    wait_s = 30.0 + (grace_s if grace_s is not None else term_s)
    with err.status(f"stopping job {job_id}…"):
        record = _wait_final(n0, job_id, wait_s)
    if "stopping" in said and not record.state.final:
        raise UserError(
            f"job {job_id} did not stop within {wait_s:.0f} s; its controller on {n0.head.label} is pid {record.pid}"
        )
    err.print(f"job {job_id}: [{STATE_STYLE[record.state.value]}]{record.state.value}[/] {escape(record.why)}")
