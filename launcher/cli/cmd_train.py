"""`launch train`: the built-in training workload (workloads.train) on every node. With --dry-run
it also prints the memory plan (workloads.plan) on stderr; without a node source, --dry-run
--nodes N --machine-type T prints the plan alone, before any node exists."""

from __future__ import annotations

from typing import Any

import click
from rich.markup import escape

from launcher.cli.code_options import INDEX_OPTIONS, SYNC_OPTIONS
from launcher.cli.launching import start
from launcher.cli.options import (
    CONTROLLER_GRACE_OPTION,
    DETACH_OPTION,
    FANOUT_OPTION,
    HANG_OPTIONS_TRAIN,
    OUTPUT_OPTION,
    PASS_THROUGH,
    RECOVER_OPTIONS,
    SOURCE_OPTIONS,
    SPARES_OPTION,
    TERM_GRACE_OPTION,
    TORCHRUN_OPTIONS,
    WAIT_OPTION,
    apply_options,
)
from launcher.cli.render import err, user_errors
from launcher.cli.workload_args import TrainArgs, WorkloadCommand, option_names
from launcher.core.torchrun import nproc_for
from launcher.core.types import Cluster, LaunchConfig, UserError, Workload

__all__ = ["train"]

_SOURCES = ("stack", "outputs", "hostfile", "labels", "local")


@click.command(
    name="train",
    cls=WorkloadCommand,
    workload_title=TrainArgs.TITLE,
    workload_rows=TrainArgs.rows,
    context_settings=PASS_THROUGH,
)
@apply_options(
    [
        *SOURCE_OPTIONS,
        *SYNC_OPTIONS,
        *INDEX_OPTIONS,
        *TORCHRUN_OPTIONS,
        *HANG_OPTIONS_TRAIN,
        TERM_GRACE_OPTION,
        OUTPUT_OPTION,
        FANOUT_OPTION,
        DETACH_OPTION,
        WAIT_OPTION,
        CONTROLLER_GRACE_OPTION,
        *RECOVER_OPTIONS,
        SPARES_OPTION,
    ]
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def train(args: tuple[str, ...], **o: Any) -> None:
    """Run the built-in training workload (workloads.train); extra ARGS go to it, checked here
    first (the workload's options are listed below the launcher's). --dry-run also prints the
    memory plan; --dry-run --nodes N --machine-type T without a node source prints only the plan."""
    checked = TrainArgs(args, option_names(click.get_current_context().command))
    if "--plan" in args and not o.get("dry_run"):
        # On the nodes --plan would only make every rank print a plan and exit 0.
        raise UserError("--plan prints a memory plan and trains nothing; run it as `launch train --dry-run ...`")
    if o.get("dry_run") and not any(o.get(k) for k in _SOURCES):
        _plan_only(checked, o)
        return

    def check(cluster: Cluster, config: LaunchConfig) -> None:
        checked.check(cluster, config)
        if not config.dry_run or cluster.local:  # --local: CPU processes, no GPU memory to plan
            return
        if cluster.machine_type is None:
            err.print("[dim]plan: no machine type known for these nodes; --machine-type T for a memory plan[/dim]")
            return
        gpus = nproc_for(cluster.nodes[0], cluster.gpus_per_node, config)
        _print_plan(checked.plan_lines(cluster.machine_type, len(cluster.nodes), gpus))

    start(o, Workload("torchrun", ("-m", "workloads.train", *args)), check, builtin=True)


def _plan_only(checked: TrainArgs, o: dict[str, Any]) -> None:
    from gpufleet.catalog import UnknownMachineType, lookup

    if not o.get("nodes") or not o.get("machine_type"):
        raise UserError(
            "--dry-run without a node source prints the memory plan only, and needs --nodes N and "
            "--machine-type T; or give a node source (--stack, --outputs, --hostfile, --label, --local)"
        )
    try:
        machine = lookup(o["machine_type"])
    except UnknownMachineType as e:
        raise UserError(f"--machine-type: {e}") from None
    gpus = o.get("nproc_per_node") or machine.gpu_count
    _print_plan(checked.plan_lines(o["machine_type"], o["nodes"], gpus))


def _print_plan(lines: list[str]) -> None:
    for line in lines:
        err.print(escape(line))
