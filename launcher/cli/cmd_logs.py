"""`launch logs JOB_ID`: a detached job's output (every node's, prefixed, or one node's), also
copied to RUNS_DIR/JOB_ID/; `-f` follows it until the job ends. An attached launch down a tree
whose nodes kept their output (launcher.cli.kept_logs) is read from those nodes."""

from __future__ import annotations

import sys
from typing import Any

import click

from launcher.cli.detached import copy_path, dry_run, follow, node0, reader_gone
from launcher.cli.kept_logs import kept_logs
from launcher.cli.options import SOURCE_OPTIONS, DryRunCommand, apply_options
from launcher.cli.render import user_errors
from launcher.core.types import UserError
from launcher.jobs.record import check_job_id, logs_script

__all__ = ["logs"]


@click.command(cls=DryRunCommand, name="logs")
@apply_options(SOURCE_OPTIONS)
@click.argument("job_id")
@click.option("--node", type=int, help="Only this node's log (by rank).")
@click.option("-f", "--follow", "follow_", is_flag=True, help="Keep printing until the job ends; exit with its status.")
@user_errors
def logs(job_id: str, node: int | None, follow_: bool, **o: Any) -> None:
    """Print a job's output (every node's, prefixed, or one node's): a detached job's from its
    controller host; an attached launch's from here, and what its nodes kept (--fanout) from them."""
    check_job_id(job_id)
    if kept_logs(o, job_id, node, follow_):
        return
    cluster, n0 = node0(o)
    if node is not None and not 0 <= node < len(cluster.nodes):
        raise UserError(f"--node {node} is not a node of this cluster (0..{len(cluster.nodes) - 1})")
    what = f"{'follow' if follow_ else 'print'} job {job_id}'s log" + (f" (node {node})" if node is not None else "")
    if dry_run(o, n0, [(what, logs_script(job_id, node, follow=follow_))]):
        return
    copy = copy_path(o, job_id, node)
    if follow_:
        record = follow(n0, job_id, node, copy)
        raise SystemExit(record.exit or 0)
    text = n0.run(logs_script(job_id, node, follow=False))
    copy.write_text(text)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        reader_gone()
