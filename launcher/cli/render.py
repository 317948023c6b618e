"""What the user sees of a launch: one console on stderr (status line, summary table, one red
line per error), node output on stdout as `[node N] line`, library log records as one coloured
line each. `execute` drives one `launcher.core.launch.Launch` through a launch plan (launcher.runner)
with this display.

rich lives here and in the command modules; library modules (launch, session, ...) log and emit
`NodeEvent`s instead of printing.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher.core.launch import Interrupted, Launch, NodeEvent, NodeState
from launcher.core.output import LiveFilter, failure_line, kept_nodes, result_rows
from launcher.core.pull import PullFailed, pull_image, refusal
from launcher.core.transport import make_transport
from launcher.core.types import EXIT_USER_ERROR, Cluster, LaunchConfig, LaunchResult, UserError
from launcher.jobs.busy import BusyCheck
from launcher.runner import LaunchPlan, dry_run

__all__ = [
    "err",
    "setup_logging",
    "fail",
    "user_errors",
    "live_printer",
    "render_result",
    "execute",
    "print_plan",
    "container_summary",
    "pull_everywhere",
    "finish",
]

err = Console(stderr=True, highlight=False, soft_wrap=True)


class _RichHandler(logging.Handler):
    """Library warnings in yellow, errors in red, one line each, on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        style = "red" if record.levelno >= logging.ERROR else "yellow" if record.levelno >= logging.WARNING else "dim"
        err.print(f"[{style}]{escape(record.getMessage())}[/{style}]")


def setup_logging() -> None:
    root = logging.getLogger("launcher")
    if not any(isinstance(h, _RichHandler) for h in root.handlers):
        root.addHandler(_RichHandler())
    root.setLevel(logging.INFO)
    root.propagate = False


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    err.print(f"[red]error: {escape(message)}[/red]")
    raise SystemExit(code)


def user_errors(fn):
    """A UserError becomes one red line and exit 2: no traceback, nothing ran."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PullFailed as e:
            for line in e.lines:
                err.print(f"[red]error: {escape(line)}[/red]")
            fail(str(e))
        except UserError as e:
            fail(str(e))
        except Interrupted as e:
            err.print(f"[red]interrupted ({e}) while connecting; nothing was started[/red]")
            raise SystemExit(128 + e.signum) from None

    return wrapper


# At most this many nodes still to answer are named in the status line.
_NAME_WAITING = 3


def live_printer(cluster: Cluster, order: str = "", output: str = "all"):
    """The live display of a launch: a status line (on stderr) while the nodes connect and
    check, then the output --output shows (launcher.core.output.LiveFilter) on stdout as
    `[node N] line`, with the status line saying what the others do; the start line ends with
    `order` (the rank order used and why). Returns (on_event, status, the filter)."""
    n = len(cluster.nodes)
    waiting = {node.rank: node.label for node in cluster.nodes}
    shown = LiveFilter(output, n)
    status = err.status(f"connecting to {n} node{'s' * (n != 1)}…")
    status.start()

    def write(rank: int, lines: list[str]) -> None:
        for text in lines:
            sys.stdout.write(f"[node {rank}] {text}\n")
        sys.stdout.flush()

    def on_event(event: NodeEvent) -> None:
        rank = event.node.rank
        if event.line is not None:
            write(rank, shown.line(rank, event.line))
            return
        if event.state is not None and event.state.final:
            write(rank, shown.ended(rank, event.state.value))
            if output != "all" and rank not in waiting:
                status.update(escape(shown.summary() or ""))
        if event.state is NodeState.RUNNING:
            if rank == n - 1:
                if output == "all":
                    status.stop()
                else:  # the nodes not shown, on the status line until the end
                    status.update(escape(shown.summary() or ""))
                err.print(f"[dim]started on {n} node{'s' * (n != 1)}{escape('; ' + order if order else '')}[/dim]")
        elif event.state is not NodeState.CONNECTING and rank in waiting:
            # The node answered its check (passed it, or ended): one fewer to wait for.
            waiting.pop(rank)
            line = f"checked {n - len(waiting)}/{n} nodes"
            if 0 < len(waiting) <= _NAME_WAITING:
                # The last few are the ones holding everyone up: say which.
                line += "; waiting for " + ", ".join(waiting.values())
            status.update(escape(line))

    return on_event, status, shown


def render_result(result: LaunchResult, cluster: Cluster) -> None:
    table = Table(title=f"job {result.job_id}", title_justify="left")
    for col in ("node", "host", "exit", "duration"):
        table.add_column(col)
    for row in result_rows(result):
        style = {"ok": "green", "stopped": "yellow"}.get(row.kind, "red")
        table.add_row(row.node, escape(row.host), f"[{style}]{escape(row.status)}[/{style}]", row.duration)
    err.print(table)
    # One line for the cause (its own lines were in the live stream above; everything it printed,
    # torchrun's report included, is in its log).
    line = failure_line(result)
    if line is not None:
        err.print(f"[red]{escape(line)}[/red]")
    if result.signal is not None:
        err.print(f"[red]stopped every node on signal {result.signal}[/red]")
    if result.hang is not None:  # the `hang:` line itself came when the stacks were in
        where = f"; stacks: {result.hang.stacks_dir}/" if result.hang.stacks_dir else ""
        err.print(f"[red]stopped every node: no progress (the hang: line above names the culprit){escape(where)}[/red]")
    if line is None:
        err.print(f"[dim]logs: {result.run_dir}/node-<rank>.log[/dim]")


def execute(p: LaunchPlan, dry_run_format: str = "text", output: str = "all") -> LaunchResult | None:
    """Every attached launch's one path: run the plan with the live display (the nodes' lines
    --output `output` shows) and the summary table, or, for --dry-run, print the plan (as
    `dry_run_format`: "text" or "json") and connect to nothing (returns None). On SSH nodes a
    detached job holding them refuses the launch: one line, nothing started. With the config's
    `fanout`, the sessions go down a tree from node 0 (launcher.code.launch_tree)."""
    cluster, config = p.cluster, p.config
    if config.dry_run:
        if config.image:
            err.print(f"[dim]{escape(container_summary(cluster, config))}[/dim]")
        if config.fanout and not cluster.local:
            from launcher.code.launch_tree import kept_line, tree_line

            for line in (tree_line(cluster, config.fanout), kept_line(cluster, config)):
                if line:
                    err.print(f"[dim]{escape(line)}[/dim]")
        print_plan(p, dry_run_format)
        return None
    pull_everywhere(cluster, config)
    tree = None
    if config.fanout:  # the nodes' launch keys first, where they lack them
        from launcher.code.launch_tree import tree_for

        tree = tree_for(cluster, config, p.transport)
    stop = threading.Event()
    busy = None if cluster.local else BusyCheck(cluster, config, stop)
    on_event, status, shown = live_printer(cluster, p.order_message, output)
    try:
        launch = Launch(
            cluster,
            config,
            on_event=busy.gate(on_event) if busy else on_event,
            stop=stop,
            transport=p.transport,
            verdict=p.verdict,
            tree=tree,
        )
        result = launch.run(programs=p.programs, stdin=p.stdin)
    except Interrupted:
        if busy is not None and busy.busy is not None:
            raise busy.refusal() from None
        raise
    finally:
        status.stop()
        if busy is not None:
            busy.close()
    render_result(result, cluster)
    said = shown.summary()
    if said:
        where = (
            f"every node's lines: launch logs {result.job_id} (kept on the nodes)"
            if kept_nodes(result.run_dir)
            else f"every node's lines: {result.run_dir}/node-<rank>.log"
        )
        err.print(f"[dim]{escape(said)}; {escape(where)}[/dim]")
    return result


def container_summary(cluster: Cluster, config: LaunchConfig) -> str:
    """--dry-run's line about --image: the image and the machine type's wiring."""
    from gpufleet.catalog import lookup
    from gpufleet.containers import wiring

    machine = lookup(cluster.machine_type) if cluster.machine_type and not cluster.local else None
    w = wiring(machine, config.image_os)
    what = "; ".join(w.notes) or "no GPUs (no machine type)"
    return f"container {config.image} on every node (pulled first), --network/--ipc/--pid host: {what}"


def pull_everywhere(cluster: Cluster, config: LaunchConfig) -> None:
    """--image: pull it on every node at once, with each node's progress on the status line;
    a node that cannot pull it stops the launch (PullFailed: one line per node, exit 2)."""
    if not config.image or config.dry_run:
        return
    n = len(cluster.nodes)
    done: dict[str, str] = {}
    lock = threading.Lock()
    with err.status(f"pulling {config.image} on {n} node{'s' * (n != 1)}…") as status:

        def progress(node, line: str) -> None:
            with lock:
                done[node.label] = line
                status.update(f"pulling {config.image}: {escape(node.label)}: {escape(line[:100])}")

        pulled = pull_image(cluster, config.image, make_transport(cluster, config.ssh), progress, env=config.env)
    failed = refusal(config.image, pulled)
    if failed is not None:
        raise failed
    for p in pulled.values():
        if p.status == "local":
            what = f"{p.node.label}: using its own copy of {config.image}, unchecked: {p.note}"
            err.print(f"[yellow]{escape(what)}[/yellow]")
    fetched = [p.node.label for p in pulled.values() if p.status == "pulled"]
    err.print(
        f"[dim]{escape(config.image)}: pulled on {', '.join(fetched)}; already current on "
        f"{n - len(fetched)} of {n} node{'s' * (n != 1)}[/dim]"
        if fetched
        else f"[dim]{escape(config.image)}: already current on every node[/dim]"
    )


def print_plan(p: LaunchPlan, fmt: str = "text") -> None:
    """--dry-run: the order's line, the --env names (their values hidden) and, with --iap, each
    node's tunnel on stderr; on stdout each node's plan (launcher.runner.dry_run) as a real launch
    runs it (the prepared environment's python, the nodes' home as
    launcher.cli.code_options.DRY_RUN_HOME): a block per node to read, or with `fmt` "json" the
    whole plans."""
    if p.order_message:
        err.print(f"[dim]{escape(p.order_message)}[/dim]")
    if p.stdin_note():
        err.print(f"[dim]{escape(p.stdin_note())}[/dim]")
    for node in p.cluster.nodes:
        if p.transport.route(node):  # --iap: the tunnel each node's connection would take
            err.print(f"[dim]{escape(node.label)}: {escape(p.transport.route(node))}[/dim]")
    click.echo(dry_run.as_json(p) if fmt == "json" else "\n".join(dry_run.text(p)))


def finish(result: LaunchResult | None) -> None:
    if result is not None and result.exit_code != 0:
        raise SystemExit(result.exit_code)
