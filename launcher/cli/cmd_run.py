"""`launch run`: SCRIPT [ARGS] (or -m MODULE [ARGS]) under torchrun on every node."""

from __future__ import annotations

from typing import Any

import click

from launcher.cli.code_options import INDEX_OPTIONS, REQUIREMENTS_OPTION, SYNC_OPTIONS
from launcher.cli.launching import start
from launcher.cli.options import (
    CONTROLLER_GRACE_OPTION,
    DETACH_OPTION,
    FANOUT_OPTION,
    HANG_OPTIONS_RUN,
    OUTPUT_OPTION,
    PROGRAM_AFTER,
    RECOVER_OPTIONS,
    SOURCE_OPTIONS,
    SPARES_OPTION,
    TERM_GRACE_OPTION,
    TORCHRUN_OPTIONS,
    WAIT_OPTION,
    DryRunCommand,
    apply_options,
)
from launcher.cli.render import user_errors
from launcher.core.types import UserError, Workload

__all__ = ["run"]


@click.command(cls=DryRunCommand, name="run", context_settings=PROGRAM_AFTER)
@apply_options(
    [
        *SOURCE_OPTIONS,
        *SYNC_OPTIONS,
        REQUIREMENTS_OPTION,
        *INDEX_OPTIONS,
        *TORCHRUN_OPTIONS,
        *HANG_OPTIONS_RUN,
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
def run(args: tuple[str, ...], **o: Any) -> None:
    """Run SCRIPT [ARGS] (or -m MODULE [ARGS]) under torchrun on every node."""
    if not args:
        raise UserError("nothing to run: `launch run ... -- SCRIPT [ARGS]` or `-- -m MODULE [ARGS]`")
    if args[0] == "-m" and len(args) < 2:
        raise UserError("`-m` needs a module name: `launch run ... -- -m package.module`")
    start(o, Workload("torchrun", tuple(args)))
