"""`launch train`: the built-in training workload (workloads.train) on every node."""

from __future__ import annotations

from typing import Any

import click

from launcher.cli.launching import start
from launcher.cli.options import (
    DETACH_OPTION,
    HANG_OPTIONS_TRAIN,
    PASS_THROUGH,
    RECOVER_OPTIONS,
    SOURCE_OPTIONS,
    TORCHRUN_OPTIONS,
    apply_options,
)
from launcher.cli.render import user_errors
from launcher.cli.workload_args import TrainArgs, WorkloadCommand, option_names
from launcher.core.types import Workload

__all__ = ["train"]


@click.command(
    name="train",
    cls=WorkloadCommand,
    workload_title=TrainArgs.TITLE,
    workload_rows=TrainArgs.rows,
    context_settings=PASS_THROUGH,
)
@apply_options(SOURCE_OPTIONS + TORCHRUN_OPTIONS + HANG_OPTIONS_TRAIN + [DETACH_OPTION] + RECOVER_OPTIONS)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def train(args: tuple[str, ...], **o: Any) -> None:
    """Run the built-in training workload (workloads.train); extra ARGS go to it, checked here
    first (the workload's options are listed below the launcher's)."""
    checked = TrainArgs(args, option_names(click.get_current_context().command))
    start(o, Workload("torchrun", ("-m", "workloads.train", *args)), checked.check)
