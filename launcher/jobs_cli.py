"""Detached jobs at the command line (issue 13): `launch train|run|exec ... --detach` (through
`start_detached`), `launch jobs`, `launch logs`, `launch stop` and `launch attach`.

Every command reads node 0 of the cluster the node-source flags name, over the client's own SSH
(the same known_hosts and options as any launch): the records live there, under the home of the
account on node 0 (launcher.jobs), never on this machine.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher.handoff import detach, job_host
from launcher.jobs import JobRecord, check_job_id, list_script, logs_script, parse_listing, stop_script
from launcher.model import Cluster, LaunchConfig, UserError, Workload
from launcher.options import SOURCE_OPTIONS, apply_options, build_config, find_cluster
from launcher.ordering import order_for_launch
from launcher.recover import recover_policy, recovery_lines
from launcher.render import err, setup_logging, user_errors
from launcher.transport import make_transport

__all__ = ["start_detached", "jobs", "logs", "stop", "attach"]

_STYLE = {
    "PENDING": "cyan",
    "RUNNING": "blue",
    "RECOVERING": "magenta",
    "SUCCEEDED": "green",
    "FAILED": "red",
    "STOPPED": "yellow",
}


def start_detached(
    o: dict[str, Any], workload: Workload, check: Callable[[Cluster, LaunchConfig], None] | None = None
) -> None:
    """`--detach`: check every node, hand off to node 0, print `job ID` (stdout's only line).
    `check` refuses workload arguments that do not fit the ranks the job will start."""
    setup_logging()
    if o.get("dry_run"):
        raise UserError("--detach and --dry-run: a dry run starts nothing to hand off; drop one of them")
    policy = recover_policy(o, workload.argv, detach=True)
    cluster = find_cluster(o)
    if policy and policy.min_nodes is not None and policy.min_nodes > len(cluster.nodes):
        raise UserError(
            f"--min-nodes {policy.min_nodes} is more than the job's {len(cluster.nodes)} nodes; give at most "
            f"{len(cluster.nodes)}"
        )
    config = build_config(o, workload, cluster)
    if check is not None:
        check(cluster, config)
    n = len(cluster.nodes)
    # The controller keeps this order: the request carries the nodes in it, and a recovery
    # relaunches from the request.
    order = order_for_launch(cluster, config)
    cluster = order.cluster
    if order.message:
        err.print(f"[dim]{escape(order.message)}[/dim]")
    with err.status(f"checking {n} node{'s' * (n != 1)} and handing the job to node 0…"):
        job_id = detach(cluster, config, policy.to_json() if policy else None)
    click.echo(f"job {job_id}")
    err.print(
        f"[dim]follow it: launch logs {job_id} -f (with the same node flags); stop it: launch stop {job_id}[/dim]"
    )


class _Node0:
    """The client's SSH to node 0 of the cluster the flags name."""

    def __init__(self, o: dict[str, Any]):
        setup_logging()
        self.cluster: Cluster = find_cluster(o)
        if self.cluster.local:
            raise UserError(
                "detached jobs live on node 0 of an SSH cluster; --local has none: give the "
                "cluster's node flags (--hostfile, --stack, ...)"
            )
        self.config: LaunchConfig = build_config(o, Workload("exec", ("true",)), self.cluster)
        self.transport = make_transport(self.cluster, self.config)
        self.head = job_host(self.cluster)  # the controller host, else node 0

    def argv(self, script: str) -> list[str]:
        return self.transport.argv(self.head, script)

    def run(self, script: str) -> str:
        try:
            r = subprocess.run(self.argv(script), capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise UserError(f"{self.head.label} did not answer within 60 s") from None
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            raise UserError(f"{self.head.label}: {why}")
        return r.stdout

    def records(self, job_id: str | None = None) -> list[JobRecord]:
        return parse_listing(self.run(list_script(job_id)))

    def record(self, job_id: str) -> JobRecord:
        found = self.records(job_id)
        if not found:
            raise UserError(f"no job {job_id} on {self.head.label}; `launch jobs` lists the jobs there")
        return found[0]


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _row(r: JobRecord) -> list[str]:
    dur = r.duration_s
    what = r.what if len(r.what) <= 48 else r.what[:47] + "…"
    return [
        r.id,
        escape(what),
        f"[{_STYLE[r.state.value]}]{r.state.value}[/]",
        str(len(r.nodes)),
        _when(r.started),
        "-" if dur is None else f"{dur:.0f} s",
        "-" if r.exit is None else str(r.exit),
        escape(r.why + _recoveries(r)) if r.state.value in ("FAILED", "STOPPED", "RECOVERING") else "",
    ]


def _recoveries(r: JobRecord) -> str:
    n = len(r.recoveries)
    if not n or r.state.value == "RECOVERING":
        return ""
    return f" ({n} recover{'y' if n == 1 else 'ies'}; --json lists them)"


@click.command(name="jobs")
@apply_options(SOURCE_OPTIONS)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job per line.")
@user_errors
def jobs(as_json: bool, **o: Any) -> None:
    """List the cluster's detached jobs, newest first."""
    records = _Node0(o).records()
    if as_json:
        for r in records:
            click.echo(json.dumps(r.to_json()))
        return
    table = Table()
    for col in ("id", "what", "state", "nodes", "started", "duration", "exit", "why"):
        table.add_column(col)
    for r in records:
        table.add_row(*_row(r))
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)


def _copy_path(o: dict[str, Any], job_id: str, node: int | None) -> Path:
    d = Path(o.get("runs_dir") or "runs") / job_id
    d.mkdir(parents=True, exist_ok=True)
    return d / ("output.log" if node is None else f"node-{node}.log")


def _reader_gone() -> None:
    """stdout's reader went away (`launch logs ID | head`): stop quietly, as cat does; the job
    is untouched. stdout goes to /dev/null so the interpreter's final flush cannot fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(0)


def _follow(n0: _Node0, job_id: str, node: int | None, copy: Path) -> JobRecord:
    """Print the job's stream as it grows until the job ends; Ctrl-C stops following only."""
    proc = subprocess.Popen(
        n0.argv(logs_script(job_id, node, follow=True)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        with open(copy, "wb") as f:
            for raw in iter(proc.stdout.readline, b""):
                sys.stdout.buffer.write(raw)
                sys.stdout.flush()
                f.write(raw)
                f.flush()
        proc.wait()
    except BrokenPipeError:
        proc.kill()
        _reader_gone()
    except KeyboardInterrupt:
        proc.kill()
        proc.wait()
        err.print(f"[yellow]stopped following; job {job_id} goes on (launch stop {job_id} stops it)[/yellow]")
        raise SystemExit(130) from None
    if proc.returncode != 0:
        why = proc.stderr.read().decode("utf-8", "replace").strip().splitlines() or [f"exit {proc.returncode}"]
        raise UserError(f"{n0.head.label}: {why[-1]}")
    return n0.record(job_id)


@click.command(name="logs")
@apply_options(SOURCE_OPTIONS)
@click.argument("job_id")
@click.option("--node", type=int, help="Only this node's log (by rank).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job ends; exit with its status.")
@user_errors
def logs(job_id: str, node: int | None, follow: bool, **o: Any) -> None:
    """Print a detached job's output (every node's, prefixed, or one node's)."""
    check_job_id(job_id)
    n0 = _Node0(o)
    if node is not None and not 0 <= node < len(n0.cluster.nodes):
        raise UserError(f"--node {node} is not a node of this cluster (0..{len(n0.cluster.nodes) - 1})")
    copy = _copy_path(o, job_id, node)
    if follow:
        record = _follow(n0, job_id, node, copy)
        raise SystemExit(record.exit or 0)
    text = n0.run(logs_script(job_id, node, follow=False))
    copy.write_text(text)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_gone()


def _wait_final(n0: _Node0, job_id: str, timeout: float) -> JobRecord:
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
    n0 = _Node0(o)
    n0.record(job_id)  # names a job that is not there
    said = n0.run(stop_script(job_id)).strip().splitlines()
    with err.status(f"stopping job {job_id}…"):
        record = _wait_final(n0, job_id, 30.0)
    if "stopping" in said and not record.state.final:
        raise UserError(f"job {job_id} did not stop within 30 s; its controller on {n0.head.label} is pid {record.pid}")
    err.print(f"job {job_id}: [{_STYLE[record.state.value]}]{record.state.value}[/] {escape(record.why)}")


def _fetch_summary(n0: _Node0, job_id: str) -> dict[str, Any] | None:
    text = n0.run(f'cat "$HOME"/.gpufleet/jobs/{check_job_id(job_id)}/launch.json 2>/dev/null; exit 0')
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


@click.command(name="attach")
@apply_options(SOURCE_OPTIONS)
@click.argument("job_id")
@user_errors
def attach(job_id: str, **o: Any) -> None:
    """Follow a detached job's output until it ends, then show its summary table."""
    check_job_id(job_id)
    n0 = _Node0(o)
    record = _follow(n0, job_id, None, _copy_path(o, job_id, None))
    render_summary(record, _fetch_summary(n0, job_id))
    raise SystemExit(record.exit or 0)
