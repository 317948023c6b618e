"""`launch attach JOB_ID`: follow a detached job's output until it ends, then show the summary
table an attached launch shows."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from launcher.cli.detached import copy_path, dry_run, follow, node0, restart_orphans
from launcher.cli.options import SOURCE_OPTIONS, DryRunCommand, apply_options
from launcher.cli.render import err, user_errors
from launcher.jobs.node0 import Node0
from launcher.jobs.record import JobRecord, check_job_id, list_script, logs_script
from launcher.jobs.recovery import recovery_lines

__all__ = ["attach", "render_summary"]


def _summary_script(job_id: str) -> str:
    return f'cat "$HOME"/.gpufleet/jobs/{check_job_id(job_id)}/launch.json 2>/dev/null; exit 0'


def _fetch_summary(n0: Node0, job_id: str) -> dict[str, Any] | None:
    text = n0.run(_summary_script(job_id))
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return None


def render_summary(record: JobRecord, summary: dict[str, Any] | None) -> None:
    """The attached launcher's final table, from the job's record and summary."""
    table = Table(title=f"job {record.id}: {record.state.value}", title_justify="left")
    for col in ("node", "host", "exit", "duration"):
        table.add_column(col)
    for n in (summary or {}).get("nodes", []):
        style = "green" if n["exit"] == 0 else "yellow" if str(n["status"]).startswith("stopped") else "red"
        table.add_row(str(n["rank"]), n["host"], f"[{style}]{escape(n['status'])}[/]", f"{n['duration_s']:.1f} s")
    err.print(table)
    if record.why:
        style = "red" if record.state.value == "FAILED" else "yellow"
        err.print(f"[{style}]{escape(record.why)}" + (" — last lines:" if record.tail else "") + f"[/{style}]")
        for line in record.tail:
            err.print(f"  {escape(line)}")
    for line in recovery_lines(record.recoveries):
        err.print(f"[magenta]{escape(line)}[/magenta]")


@click.command(cls=DryRunCommand, name="attach")
@apply_options(SOURCE_OPTIONS)
@click.argument("job_id")
@user_errors
def attach(job_id: str, **o: Any) -> None:
    """Follow a detached job's output until it ends, then show its summary table."""
    check_job_id(job_id)
    _, n0 = node0(o)
    steps = [
        (f"read job {job_id}'s record", list_script(job_id)),
        (f"follow job {job_id}'s log until it ends", logs_script(job_id, None, follow=True)),
        (f"read job {job_id}'s summary", _summary_script(job_id)),
    ]
    if dry_run(o, n0, steps):
        return
    restart_orphans(n0, n0.records(job_id))
    record = follow(n0, job_id, None, copy_path(o, job_id, None))
    render_summary(record, _fetch_summary(n0, job_id))
    raise SystemExit(record.exit or 0)
