"""`launch`: the click group and its commands. Each command maps its options into a
`LaunchConfig` (launcher.options), finds the `Cluster`, and drives one `launcher.launch.Launch`
through launcher.render, which shows its events: a status line and the final table on stderr,
node output on stdout, one red line per error.

Exit status: the first failed node's status; 2 for a user error (nothing ran); 130/143 when
stopped by SIGINT/SIGTERM; 255 when a node became unreachable; 124 when --hang-timeout stopped
a job that made no progress.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpufleet.contracts import READY_MARKER
from launcher.launch import Interrupted, Launch
from launcher.model import Cluster, LaunchConfig, LaunchResult, UserError, Workload
from launcher.options import (
    DETACH_OPTION,
    ENV_OPTION,
    HANG_OPTIONS_RUN,
    HANG_OPTIONS_TRAIN,
    PASS_THROUGH,
    PROGRAM_AFTER,
    RECOVER_OPTIONS,
    SOURCE_OPTIONS,
    TORCHRUN_OPTIONS,
    apply_options,
    build_config,
    find_cluster,
)
from launcher.render import err, execute_on, finish, live_printer, render_result, setup_logging, user_errors
from launcher.topology import metadata_statement, node_physical_hosts, spread_warning
from launcher.workload_args import TrainArgs, WorkloadCommand, no_such_option, option_names

__all__ = ["main"]


# ---- commands -------------------------------------------------------------------------------


# click >= 8.2 raises this for a group called without a command (older click prints the help).
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _OneLineErrors(click.Group):
    """click reports a bad flag with a usage block and a blank line before the error; every
    other user error here is one red line, so bad flags are too (issue 7's input corpus)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as e:  # bare `launch`: the help itself, as click prints it
            click.echo(e.format_message(), err=True)
            rv = e.exit_code
        except click.NoSuchOption as e:  # worded as launch train words a workload option it does not know
            names = option_names(e.ctx.command) if e.ctx is not None else list(e.possibilities or ())
            err.print(f"[red]error: {escape(no_such_option(e.option_name, names))}[/red]")
            rv = e.exit_code
        except click.ClickException as e:
            hint = ""
            ctx = getattr(e, "ctx", None)
            if ctx is not None:
                hint = f" (`{ctx.command_path} -h` lists the options)"
            err.print(f"[red]error: {escape(e.format_message())}{escape(hint)}[/red]")
            rv = e.exit_code
        except click.Abort:
            err.print("[red]aborted[/red]")
            rv = 130
        if not standalone_mode:
            return rv
        raise SystemExit(rv if isinstance(rv, int) else 0)

    # Commands that live in modules of their own, imported when named (click's documented lazy
    # loading), so `launch exec` does not pay for the sweep's report or the doctor's checks.
    _lazy = {
        "nccl-tests": ("launcher.nccl_cmd", "nccl_tests"),
        "doctor": ("launcher.doctor_cli", "doctor"),
        "top": ("launcher.top_cli", "top"),
        "jobs": ("launcher.jobs_cli", "jobs"),
        "logs": ("launcher.jobs_cli", "logs"),
        "stop": ("launcher.jobs_cli", "stop"),
        "attach": ("launcher.jobs_cli", "attach"),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self._lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self._lazy:
            module, attr = self._lazy[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


# Checks a workload's arguments against the nodes and ranks a launch will start (UserError if not).
WorkloadCheck = Callable[[Cluster, LaunchConfig], None]


def _start(o: dict[str, Any], workload: Workload, check: WorkloadCheck | None = None) -> None:
    """Run attached (the live stream, then the summary), or with --detach hand off to node 0."""
    given = [
        k
        for k in ("recover", "max_recoveries", "recover_timeout", "restart_stopped", "min_nodes")
        if o.get(k) is not None
    ]
    if not o.get("detach") and [k for k in given if o[k] is not False or k == "restart_stopped"]:
        from launcher.recover import recover_policy

        recover_policy(o, workload.argv, detach=False)  # refuses: --recover lives on node 0's controller
    if o.pop("detach", False):
        from launcher.jobs_cli import start_detached  # loaded only when asked for, as _lazy's commands

        start_detached(o, workload, check)
    else:
        finish(_attached(o, workload, check))


def _attached(o: dict[str, Any], workload: Workload, check: WorkloadCheck | None) -> LaunchResult | None:
    """render.execute, refusing (one line, nothing started) when a detached job holds the nodes."""
    setup_logging()
    cluster = find_cluster(o)
    config = build_config(o, workload, cluster)
    if check is not None:
        check(cluster, config)
    if config.dry_run or cluster.local:
        return execute_on(cluster, config)
    from launcher.busy import BusyCheck
    from launcher.ordering import order_for_launch

    order = order_for_launch(cluster, config)
    cluster = order.cluster

    stop = threading.Event()
    busy = BusyCheck(cluster, config, stop)
    on_event, status = live_printer(cluster, order.message)
    try:
        result = Launch(cluster, config, on_event=busy.gate(on_event), stop=stop).run()
    except Interrupted:
        if busy.busy is not None:
            raise busy.refusal() from None
        raise
    finally:
        status.stop()
        busy.close()
    render_result(result, cluster)
    return result


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
# The installed distribution's version (importlib.metadata), so it always says what pip installed.
@click.version_option(package_name="gpufleet", prog_name="launch")
def main() -> None:
    """Launch torchrun (or any command) on every node of a GPU cluster over SSH."""


@main.command(
    cls=WorkloadCommand, workload_title=TrainArgs.TITLE, workload_rows=TrainArgs.rows, context_settings=PASS_THROUGH
)
@apply_options(SOURCE_OPTIONS + TORCHRUN_OPTIONS + HANG_OPTIONS_TRAIN + [DETACH_OPTION] + RECOVER_OPTIONS)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def train(args: tuple[str, ...], **o: Any) -> None:
    """Run the built-in training workload (workloads.train); extra ARGS go to it, checked here
    first (the workload's options are listed below the launcher's)."""
    checked = TrainArgs(args, option_names(click.get_current_context().command))
    _start(o, Workload("torchrun", ("-m", "workloads.train", *args)), checked.check)


@main.command(context_settings=PROGRAM_AFTER)
@apply_options(SOURCE_OPTIONS + TORCHRUN_OPTIONS + HANG_OPTIONS_RUN + [DETACH_OPTION])
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def run(args: tuple[str, ...], **o: Any) -> None:
    """Run SCRIPT [ARGS] (or -m MODULE [ARGS]) under torchrun on every node."""
    if not args:
        raise UserError("nothing to run: `launch run ... -- SCRIPT [ARGS]` or `-- -m MODULE [ARGS]`")
    if args[0] == "-m" and len(args) < 2:
        raise UserError("`-m` needs a module name: `launch run ... -- -m package.module`")
    _start(o, Workload("torchrun", tuple(args)))


@main.command(name="exec", context_settings=PROGRAM_AFTER)
@apply_options(SOURCE_OPTIONS + [ENV_OPTION, DETACH_OPTION])
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def exec_(args: tuple[str, ...], **o: Any) -> None:
    """Run a plain command (CMD [ARGS]) on every node."""
    if not args:
        raise UserError("nothing to run: `launch exec ... -- CMD [ARGS]`")
    _start(o, Workload("exec", tuple(args)))


@main.command()
@apply_options(SOURCE_OPTIONS)
@user_errors
def hosts(**o: Any) -> None:
    """List the nodes in rank order; check SSH and the startup script's ready marker."""
    setup_logging()
    cluster = find_cluster(o)
    config = build_config(o, Workload("exec", ("true",)), cluster)
    if config.dry_run:
        for n in cluster.nodes:
            click.echo(f"{n.rank}\t{n.host}\t{n.address}\t{n.name}")
        return
    with err.status(f"checking {len(cluster.nodes)} nodes…"):
        # Where each node sits, from its metadata server (or the API, for --label): doctor's topology.
        probes = Launch(cluster, config).probe(check_torch=False, extra=[metadata_statement()])
    places = node_physical_hosts(cluster, {r: p.facts for r, p in probes.items() if p.ok})
    table = Table()
    for col in ("node", "host", "address", "name", "ssh", "ready", "hostname", "block/subblock"):
        table.add_column(col)
    for n in cluster.nodes:
        p, place = probes[n.rank], places.get(n.host)
        ssh = "[green]ok[/green]" if p.ok else f"[red]{escape(p.error)}[/red]"
        ready = p.facts.get("ready", "-")
        ready = "[green]yes[/green]" if ready == "yes" else f"[yellow]{ready}[/yellow]"
        where = "/".join(x for x in (place.block, place.subblock) if x) if place else "-"
        table.add_row(str(n.rank), n.host, n.address, n.name, ssh, ready, p.facts.get("host", ""), where)
    # A pipe or file gets the whole table, not one squeezed into 80 columns.
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)
    spread = spread_warning(places)
    if spread:
        err.print(f"[yellow]warning: {escape(spread)}[/yellow]")
    err.print(f"[dim]ready marker: {READY_MARKER}[/dim]")
    if any(not p.ok for p in probes.values()):
        raise SystemExit(1)
