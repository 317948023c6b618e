"""`launch exec`: a plain command (CMD [ARGS]) on every node."""

from __future__ import annotations

from typing import Any

import click

from launcher.cli.code_options import INDEX_OPTIONS, REQUIREMENTS_OPTION, SYNC_OPTIONS
from launcher.cli.launching import start
from launcher.cli.options import (
    CONTROLLER_GRACE_OPTION,
    DETACH_OPTION,
    ENV_FILE_OPTION,
    ENV_OPTION,
    EXEC_RESTARTS_OPTION,
    FANOUT_OPTION,
    IMAGE_OPTION,
    OUTPUT_OPTION,
    PROGRAM_AFTER,
    RECOVER_OPTIONS,
    SOURCE_OPTIONS,
    TERM_GRACE_OPTION,
    WAIT_OPTION,
    DryRunCommand,
    apply_options,
)
from launcher.cli.render import user_errors
from launcher.core.types import UserError, Workload

__all__ = ["exec_"]


@click.command(cls=DryRunCommand, name="exec", context_settings=PROGRAM_AFTER)
@apply_options(
    [
        *SOURCE_OPTIONS,
        *SYNC_OPTIONS,
        REQUIREMENTS_OPTION,
        *INDEX_OPTIONS,
        ENV_OPTION,
        ENV_FILE_OPTION,
        IMAGE_OPTION,
        TERM_GRACE_OPTION,
        OUTPUT_OPTION,
        FANOUT_OPTION,
        DETACH_OPTION,
        WAIT_OPTION,
        CONTROLLER_GRACE_OPTION,
        *RECOVER_OPTIONS,
        EXEC_RESTARTS_OPTION,
    ]
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def exec_(args: tuple[str, ...], **o: Any) -> None:
    """Run a plain command (CMD [ARGS]) on every node."""
    if not args:
        raise UserError("nothing to run: `launch exec ... -- CMD [ARGS]`")
    start(o, Workload("exec", tuple(args)))
