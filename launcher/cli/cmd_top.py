"""`launch top`: the click edge over launcher.observe.top. A live table, one row per node, refreshed every
`--interval`; `--record FILE.jsonl` keeps every sample; `--plot FILE.jsonl` draws a record.

`launch top JOB_ID` views a detached job's nodes only, read from the job's record on node 0 of
the cluster the node flags name; `--plot JOB_ID` copies the samples the job's controller took to
RUNS_DIR/JOB_ID/top.jsonl and draws them (both launcher.jobs.watch).

On a terminal the table redraws in place (rich Live); into a pipe or file it is printed once per
refresh, one after the other, like `top -b`, so a script or a test reads the whole history.
Ctrl-C (or `--duration`) ends the view: every node's session reads end of input and its loop
exits, then a summary line goes to stderr. Exit status: 0 after Ctrl-C or `--duration`, 143 on
SIGTERM, 2 for a user error, 1 when no node answered at all.
"""

from __future__ import annotations

import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from launcher.cli.options import SOURCE_OPTIONS, DryRunCommand, apply_options, find_cluster, ssh_config
from launcher.cli.render import err, setup_logging, user_errors
from launcher.core.transport import Transport, make_transport
from launcher.core.types import Cluster, Node, SshConfig, UserError, new_job_id
from launcher.jobs.holds import HoldsWatch, cluster_holds
from launcher.jobs.node0 import job_host
from launcher.jobs.record import check_job_id
from launcher.jobs.watch import JobWatch, copy_samples, job_nodes
from launcher.observe.top import (
    FLAG_FRACTION,
    NodeRow,
    NodeStatus,
    Recorder,
    TopSampler,
    role_plan,
    slowest,
    sparkline,
)

__all__ = ["top", "render_table"]

# (header lines, attributes shown in one cell as a/b, format, width); each attribute is
# highlighted on the node at its slow end.
_COLUMNS = [
    (("GPU%", "mean/min"), ("gpu_util_mean", "gpu_util_min"), "{:.0f}", 8),
    (("mem GiB", "used/total"), ("gpu_mem_used_mib",), None, 10),
    (("power", "W"), ("gpu_power_w",), "{:.0f}", 5),
    (("temp", "°C"), ("gpu_temp_c",), "{:.0f}", 4),
    (("CPU", "%"), ("cpu_util_pct",), "{:.0f}", 4),
    (("host NIC", "rx/tx"), ("host_rx", "host_tx"), "gbps", 13),
    (("GPU NICs", "rx/tx"), ("gpu_rx", "gpu_tx"), "gbps", 15),
    (("slowest GPU NIC", "rx/tx"), ("gpu_slowest_rx", "gpu_slowest_tx"), "gbps", 15),
]
_ATTRS = [attr for _, attrs, _, _ in _COLUMNS for attr in attrs]
_GPU_GAUGES = {"gpu_util_mean", "gpu_util_min", "gpu_mem_used_mib", "gpu_power_w", "gpu_temp_c"}
_SEP = " │ "
# Characters in a sparkline: a minute of 1 s samples, three to a character.
_SPARK = 20


def _value(row: NodeRow, attr: str, fmt: str | None) -> str:
    v = getattr(row, attr)
    if v is None:
        # A rate needs two samples: "…" until the second arrives; "n/a" when there is nothing
        # to measure (no GPU on the node, no NIC of that role).
        if attr not in _GPU_GAUGES and row.interval_s is None:
            return "…"
        return "n/a"
    if attr == "gpu_mem_used_mib":
        total = row.gpu_mem_total_mib
        return f"{v / 1024:.0f}/{total / 1024:.0f}" if total else f"{v / 1024:.0f}"
    if fmt == "gbps":  # about three significant digits, from idle links to an A4's 3,200
        return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"
    return fmt.format(v)


def _cell(
    line: Text, row: NodeRow, attrs: tuple[str, ...], fmt: str | None, width: int, worst: dict[str, int | None]
) -> None:
    values = [_value(row, a, fmt) for a in attrs]
    if len(set(values)) == 1 and values[0] in ("n/a", "…"):
        line.append(values[0].rjust(width), style="dim")
        return
    line.append(" " * max(0, width - len("/".join(values))))
    for i, (attr, v) in enumerate(zip(attrs, values)):
        if i:
            line.append("/")
        line.append(v, style="bold red" if worst[attr] == row.node.rank else "")


def _squeeze(values: list[float | None], width: int) -> list[float | None]:
    """`values` in at most `width` buckets (the mean of each; None where a bucket has none)."""
    if len(values) <= width:
        return values
    out = []
    for i in range(width):
        part = [v for v in values[i * len(values) // width : (i + 1) * len(values) // width] if v is not None]
        out.append(sum(part) / len(part) if part else None)
    return out


def render_table(rows: list[NodeRow], histories: dict[int, list[float | None]], title: str) -> Group:
    """The view of `rows`: a title, two header lines, a line per node (NIC columns in Gbit/s;
    the slow end of each column in bold red; flagged, stale and unreachable nodes named last)
    and a caption.

    Each line is one fixed-width rich Text rather than a rich Table: a Table measures and wraps
    every cell, ~0.15 s of CPU per 64-node frame on the 2-core benchmark machine, which a
    loaded machine stretches past the 1 s refresh (bench/bench_top.py); a line costs ~50x less."""
    hw = min(24, max([4] + [len(r.node.host) for r in rows]))
    heads = [Text(), Text()]
    for i, h in enumerate(heads):
        h.append(("" if i == 0 else "node").rjust(4) + _SEP + ("" if i == 0 else "host").ljust(hw), style="bold")
        for header, _, _, width in _COLUMNS:
            h.append(_SEP + header[i].rjust(width), style="bold")
        h.append(_SEP + ("data NICs," if i == 0 else "last min").ljust(_SPARK), style="bold")
    worst = {attr: slowest(rows, attr) for attr in _ATTRS}
    top = max([v for h in histories.values() for v in h if v is not None] or [0.0])
    lines = [Text(title, style="bold"), *heads]
    for row in rows:
        rank = row.node.rank
        host = row.node.host if len(row.node.host) <= hw else row.node.host[: hw - 1] + "…"
        line = Text()
        line.append(str(rank).rjust(4), style="bold red" if row.flagged else "")
        line.append(_SEP + host.ljust(hw))
        down = row.status in (NodeStatus.UNREACHABLE, NodeStatus.CONNECTING)
        for _, attrs, fmt, width in _COLUMNS:
            line.append(_SEP)
            if down:
                line.append(" " * width)
            else:
                _cell(line, row, attrs, fmt, width, worst)
        line.append(_SEP)
        line.append(sparkline(_squeeze(histories.get(rank, []), _SPARK), top).ljust(_SPARK), style="cyan")
        line.append(_SEP)
        if row.status is NodeStatus.UNREACHABLE:
            line.append(f"unreachable: {row.error}", style="red")
        elif row.status is NodeStatus.CONNECTING:
            line.append("connecting…", style="dim")
        elif row.status is NodeStatus.STALE:
            line.append(row.error, style="yellow")
        elif row.flagged:
            line.append("⚑ slow data NICs", style="bold red")
        lines.append(line)
    lines.append(
        Text(
            f"Gbit/s. ⚑: data NICs (GPU NICs; the host NIC where there are none) under "
            f"{FLAG_FRACTION:g} x the median. Bold red: the slow end of a column.",
            style="dim",
        )
    )
    for line in lines:
        line.no_wrap = True
        line.overflow = "crop"
    return Group(*lines)


class _Stopped(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def _on_signal(signum, _frame):
    raise _Stopped(signum)


@dataclass
class _ViewStats:
    frames: list[float] = field(default_factory=list)  # monotonic time of each redraw
    draws: list[float] = field(default_factory=list)  # seconds each redraw took
    signum: int | None = None  # the signal that ended the view; None: --duration ran out
    cpu_s: float = 0.0  # this process's CPU time over the view (every thread)
    wall_s: float = 0.0

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.frames, self.frames[1:])]


def _view(
    sampler: TopSampler, duration: float | None, title: Callable[[], str], until: threading.Event | None = None
) -> _ViewStats:
    """Redraw every interval until `duration`, a signal or `until` is set; `title()` heads each frame."""
    out = Console(highlight=False, soft_wrap=False)
    batch = not out.is_terminal
    if batch:
        out = Console(highlight=False, width=220, soft_wrap=False)
    stats = _ViewStats()
    start, cpu0 = time.monotonic(), time.process_time()
    live = None if batch else Live(console=out, auto_refresh=False, transient=False)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    iv = sampler.interval_s
    try:
        if live:
            live.start()
        k = 0
        while True:
            # A fixed schedule (not sleep(interval) after drawing), so drawing adds no drift; a
            # tick missed while the machine was busy is skipped, not drawn twice to catch up.
            k = max(k + 1, int((time.monotonic() - start) / iv) + 1)
            due = k * iv
            if duration is not None and due > duration + 1e-6:
                time.sleep(max(0.0, start + duration - time.monotonic()))
                break
            time.sleep(max(0.0, start + due - time.monotonic()))
            if until is not None and until.is_set():
                break
            t0 = time.monotonic()
            stats.frames.append(t0)
            rows = sampler.rows()
            hist = {r.node.rank: sampler.history(r.node.rank)[0] for r in rows}
            table = render_table(rows, hist, f"{title()}  {time.strftime('%H:%M:%S')}")
            if live:
                live.update(table, refresh=True)
            else:
                out.print(table)
                sys.stdout.flush()
            stats.draws.append(time.monotonic() - t0)
    except (_Stopped, KeyboardInterrupt) as e:
        stats.signum = getattr(e, "signum", signal.SIGINT)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if live:
            live.stop()
        stats.cpu_s, stats.wall_s = time.process_time() - cpu0, time.monotonic() - start
    return stats


def _summary(stats: _ViewStats, sampler: TopSampler, recorder: Recorder | None) -> str:
    rows = sampler.rows()
    ok = sum(r.status is NodeStatus.OK for r in rows)
    gaps = stats.gaps
    s = f"top: {len(stats.frames)} refreshes"
    if gaps:
        p95 = sorted(gaps)[max(0, int(0.95 * len(gaps)) - 1)]
        s += f", interval mean {statistics.mean(gaps):.3f} s, p95 {p95:.3f} s, max {max(gaps):.3f} s"
    if stats.draws:
        s += f", draw mean {statistics.mean(stats.draws):.3f} s"
    if stats.wall_s > 0:
        s += f"; view CPU {100 * stats.cpu_s / stats.wall_s:.1f}% of one CPU"
    s += f"; {ok}/{len(rows)} nodes answering at the end"
    if recorder:
        s += f"; {recorder.lines} records in {recorder.path}"
    return s


def _job_source(o: dict[str, Any], job_id: str, what: str) -> tuple[Cluster, SshConfig, Transport]:
    """The cluster whose node 0 holds `job_id`'s record, from the node-source flags."""
    check_job_id(job_id)
    if not any(o.get(f) for f in ("stack", "outputs", "hostfile", "labels", "local")):
        raise UserError(
            f"{what}: a job's record is on node 0 of its cluster; give that cluster's node flags "
            "(--hostfile, --stack, ...) as for `launch jobs`"
        )
    cluster = find_cluster(o)
    if cluster.local:
        raise UserError(f"{what}: detached jobs live on node 0 of an SSH cluster; --local has none")
    if o.get("dry_run"):
        raise UserError(f"{what} reads the job's record on node 0, and --dry-run connects to nothing; drop one")
    ssh = ssh_config(o, cluster)
    return cluster, ssh, make_transport(cluster, ssh)


def _view_source(o: dict[str, Any], job_id: str | None) -> tuple[Cluster, SshConfig, Transport, Node, Cluster]:
    """The nodes to view (the flags' cluster, or detached job `job_id`'s nodes of it), the
    flags' node 0 (where the job's record is), and the flags' whole cluster (a job's spares among
    it, which the view follows when one is swapped in)."""
    if job_id:
        cluster, ssh, transport = _job_source(o, job_id, f"launch top {job_id}")
        return job_nodes(cluster, transport, job_id), ssh, transport, job_host(cluster), cluster
    cluster = find_cluster(o)
    ssh = ssh_config(o, cluster)
    return cluster, ssh, make_transport(cluster, ssh, bool(o.get("dry_run"))), job_host(cluster), cluster


def _plot(plot_from: str, output: Path | None, o: dict[str, Any]) -> Path:
    """--plot FILE.jsonl, or --plot JOB_ID: the job's samples copied from node 0 to
    RUNS_DIR/JOB_ID/top.jsonl (as `launch logs` copies logs), then drawn."""
    from launcher.observe.plot import plot_record

    try:
        job_id = check_job_id(plot_from)
    except UserError:
        job_id = None
    if job_id is None or Path(plot_from).exists():
        if any(o.get(f) for f in ("stack", "outputs", "hostfile", "labels", "local")):
            raise UserError(
                "--plot draws a record and connects to nothing; drop the node source (a detached "
                "job's samples: --plot JOB_ID with its node flags)"
            )
        return plot_record(Path(plot_from), output)
    cluster, _, transport = _job_source(o, job_id, f"--plot {job_id}")
    copy = copy_samples(cluster, transport, job_id, Path(o.get("runs_dir") or "runs"))
    err.print(f"[dim]copied job {job_id}'s samples to {escape(str(copy))}[/dim]")
    return plot_record(copy, output)


def _cloud_exporter(o: dict[str, Any], cluster: Cluster, sampler: TopSampler):
    """--cloud-monitoring: a launcher.observe.cloud.CloudExporter of the view's rows, or None."""
    if not o.get("cloud_monitoring"):
        return None
    project = o.get("project") or cluster.project
    if not project:
        raise UserError(
            "--cloud-monitoring needs the project to write to: the stack's outputs carry it; with "
            "another node source pass --project"
        )
    from launcher.observe.cloud import CloudExporter

    return CloudExporter(cluster, project, sampler.rows, sampler.interval_s, endpoint=o.get("monitoring_endpoint"))


def _stop_all(sampler: TopSampler, exporter, recorder: Recorder | None) -> tuple[bool, int]:
    """End the view's sessions (and its export and record); whether any node answered, and how
    many were still connecting."""
    # Ignore a second Ctrl-C while every session ends: stopping is quick and leaves nothing.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        final = sampler.rows()
        answered = any(r.t is not None for r in final)
        connecting = sum(r.status is NodeStatus.CONNECTING for r in final)
        if exporter:
            exporter.stop()
        sampler.stop()
        if recorder:
            recorder.close()
    finally:
        signal.signal(signal.SIGINT, old)
    return answered, connecting


@click.command(cls=DryRunCommand, name="top")
@apply_options(SOURCE_OPTIONS)
@click.argument("job_id", required=False, metavar="[JOB_ID]")
@click.option("--image-os", type=click.Choice(["ubuntu", "cos"]), help="Interface naming of the image (NIC roles).")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between samples and redraws.")
@click.option(
    "--record",
    type=click.Path(path_type=Path),
    metavar="FILE.jsonl",
    help="Append every sample, one JSON object per node per sample (docs/top.md lists the fields).",
)
@click.option("--duration", type=float, help="Stop after this many seconds (for scripts; default: until Ctrl-C).")
@click.option(
    "--plot",
    "plot_from",
    metavar="JOB_ID|FILE.jsonl",
    help="Draw a record as a PNG (per-node GPU util and NIC timelines) and exit: a --record file, or "
    "what a detached job's controller sampled (with the node flags).",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    help="The PNG for --plot [default: FILE.png; RUNS_DIR/JOB_ID/top.png].",
)
@click.option(
    "--cloud-monitoring",
    is_flag=True,
    help="Also write the samples to Cloud Monitoring as custom metrics (the stack's project, or --project).",
)
@click.option(
    "--monitoring-endpoint",
    hidden=True,
    metavar="HOST:PORT",
    help="A Cloud Monitoring stand-in over plain gRPC (tests).",
)
@user_errors
def top(
    job_id: str | None,
    interval: float,
    record: Path | None,
    duration: float | None,
    plot_from: str | None,
    output: Path | None,
    **o: Any,
) -> None:
    """Live view of every node (or of detached job JOB_ID's nodes): GPU util, memory, power,
    temperature, CPU, NIC Gbit/s by role."""
    setup_logging()
    if plot_from is not None:
        _plot_only(plot_from, output, job_id, record, duration, o)
        return
    _check_timing(interval, duration)
    cluster, ssh, transport, head, whole = _view_source(o, job_id)
    if o.get("dry_run"):
        from launcher.observe.sampler import node_program

        script = node_program(interval)
        for n in cluster.nodes:
            click.echo(f"{n.host}\t{transport.display(n, script)}")
        return
    if record is not None and record.parent and not record.parent.is_dir():
        raise UserError(f"--record {record}: directory {record.parent} does not exist; create it first")
    recorder = Recorder(record, new_job_id()) if record else None
    sampler = TopSampler(
        cluster,
        transport.argv,
        interval_s=interval,
        plan=role_plan(cluster.machine_type, o.get("image_os")),
        on_row=recorder.write if recorder else None,
        concurrency=ssh.concurrency,
    )
    exporter = _cloud_exporter(o, cluster, sampler)
    swapped: list[str] = []  # what the view followed: a spare swapped in for a lost node
    follow = _follower(sampler, whole, swapped)
    watch = JobWatch(transport, head, job_id, on_nodes=follow).start() if job_id else None
    # Whose jobs hold the nodes, any account's (launcher.jobs.holds), read again every 10 s.
    holds = HoldsWatch(lambda: cluster_holds(cluster, transport)).start()
    sampler.start()
    if exporter:
        exporter.start()
    try:
        title = _title(cluster, job_id)
        if watch:
            heading = lambda: title + watch.goodput() + "".join(swapped[-1:]) + holds.summary()  # noqa: E731
        else:
            heading = lambda: title + holds.summary()  # noqa: E731
        stats = _view(sampler, duration, heading, watch.ended if watch else None)
    finally:
        holds.stop()
        if watch:
            watch.stop()
        answered, connecting = _stop_all(sampler, exporter, recorder)
    _report_end(stats, sampler, recorder, exporter, watch, job_id, answered, connecting)


def _follower(sampler: TopSampler, whole: Cluster, swapped: list[str]) -> Callable[[list[str]], None]:
    """What a job's view does when the job's nodes change (launcher.jobs.watch.JobWatch): it
    views the new ones (a spare swapped in) and drops those that left, and the title says so."""
    by_host = {n.host: n for n in whole.nodes}

    def follow(hosts: list[str]) -> None:
        nodes = [replace(by_host[h], rank=i) for i, h in enumerate(hosts) if h in by_host]
        added, left = sampler.follow(nodes)
        if added or left:
            into = ", ".join(n.host for n in added) or "none"
            out = ", ".join(n.host for n in left) or "none"
            swapped.append(f"  (following the job: {into} in, {out} out)")

    return follow


def _plot_only(
    plot_from: str,
    output: Path | None,
    job_id: str | None,
    record: Path | None,
    duration: float | None,
    o: dict[str, Any],
) -> None:
    if job_id or record or duration:
        raise UserError(
            "--plot draws a record and exits; drop JOB_ID, --record and --duration "
            "(a job's record: launch top --plot JOB_ID)"
        )
    out = _plot(plot_from, output, o)
    err.print(f"[dim]wrote {escape(str(out))}[/dim]")


def _check_timing(interval: float, duration: float | None) -> None:
    if not 0.1 <= interval <= 3600:
        raise UserError(f"--interval {interval:g} is outside 0.1..3600 seconds")
    if duration is not None and duration <= 0:
        raise UserError(f"--duration {duration:g} must be more than 0 seconds")


def _title(cluster: Cluster, job_id: str | None) -> str:
    n = len(cluster.nodes)
    title = f"launch top: {f'job {job_id}, ' if job_id else ''}{n} node{'s' * (n != 1)}"
    return title + (f", {cluster.machine_type}" if cluster.machine_type else "")


def _report_end(stats, sampler, recorder, exporter, watch, job_id, answered: int, connecting: int) -> None:
    """The summary on stderr, how a watched job ended, and the exit status."""
    err.print(f"[dim]{escape(_summary(stats, sampler, recorder))}[/dim]")
    if watch and watch.record:
        err.print(
            f"job {job_id} ended ({watch.record.state.value}); launch top --plot {job_id} draws what its "
            "controller sampled"
        )
    if exporter:
        err.print(
            f"[dim]{exporter.written} time series written to Cloud Monitoring (project "
            f"{escape(exporter.project)})[/dim]"
        )
    if stats.signum == signal.SIGTERM:
        raise SystemExit(128 + stats.signum)
    if not answered:
        still = f" ({connecting} still connecting when the view ended)" if connecting else ""
        err.print(f"[red]error: no node sent a sample{still}; check the node source and SSH (`launch hosts`)[/red]")
        raise SystemExit(1)
