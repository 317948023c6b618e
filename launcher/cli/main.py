"""`launch`: the click group and its command table, one module per command named after it
(cmd_train, cmd_run, cmd_exec, cmd_hosts, cmd_nccl_tests, cmd_doctor, cmd_top, cmd_jobs,
cmd_logs, cmd_stop, cmd_attach, cmd_prune). Each command maps its options into a `LaunchConfig`
(launcher.cli.options), finds the `Cluster`, and drives one `launcher.core.launch.Launch`
through launcher.cli.render, which shows its events: a status line and the final table on
stderr, node output on stdout, one red line per error.

Exit status: the first failed node's status; 2 for a user error (nothing ran); 130/143 when
stopped by SIGINT/SIGTERM; 255 when a node became unreachable; 124 when --hang-timeout stopped
a job that made no progress.
"""

from __future__ import annotations

import importlib
import re

import click
from rich.markup import escape

from launcher.cli.render import err
from launcher.cli.workload_args import no_such_option, option_names

__all__ = ["main", "summary"]

# A sentence ends at a full stop before a space or the end, but not inside "e.g." or "i.e.".
_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.(?=\s|$)")


def summary(help_text: str) -> str:
    """A command's help as `launch --help` lists it: the first sentence of its first paragraph, whole."""
    first = " ".join(help_text.strip().split("\n\n")[0].split())
    m = _SENTENCE_END.search(first)
    return first[: m.end()] if m else first


# ---- commands -------------------------------------------------------------------------------


# click >= 8.2 raises this for a group called without a command (older click prints the help).
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _OneLineErrors(click.Group):
    """click reports a bad flag with a usage block and a blank line before the error; every
    other user error here is one red line, so bad flags are too."""

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

    # Every command, each in a module of its own named after it, imported when named (click's
    # documented lazy loading), so `launch exec` does not pay for the sweep's report or the doctor's.
    _lazy = {
        "train": ("launcher.cli.cmd_train", "train"),
        "run": ("launcher.cli.cmd_run", "run"),
        "exec": ("launcher.cli.cmd_exec", "exec_"),
        "hosts": ("launcher.cli.cmd_hosts", "hosts"),
        "nccl-tests": ("launcher.cli.cmd_nccl_tests", "nccl_tests"),
        "doctor": ("launcher.cli.cmd_doctor", "doctor"),
        "top": ("launcher.cli.cmd_top", "top"),
        "jobs": ("launcher.cli.cmd_jobs", "jobs"),
        "logs": ("launcher.cli.cmd_logs", "logs"),
        "stop": ("launcher.cli.cmd_stop", "stop"),
        "attach": ("launcher.cli.cmd_attach", "attach"),
        "prune": ("launcher.cli.cmd_prune", "prune_"),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self._lazy)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command with its summary whole (its short_help, else its help's first sentence),
        wrapped: click's own cuts it at the terminal's width, mid-sentence, with '...'."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.short_help or summary(cmd.help or "")))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self._lazy:
            module, attr = self._lazy[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
# The installed distribution's version (importlib.metadata), so it always says what pip installed.
@click.version_option(package_name="gpufleet", prog_name="launch")
def main() -> None:
    """Launch torchrun (or any command) on every node of a GPU cluster over SSH."""
