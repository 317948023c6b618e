"""A built-in workload's arguments on the launching machine: listed in the command's `--help`,
and checked before any node is touched, so a typo costs one line and exit 2, not a cluster start.

`launch train` passes the options it does not know to `workloads.train`; this module parses them
with that workload's own parser (`workloads.config.build_parser`, which imports no torch), first
alone (a misspelt option, an ill-typed value, a rule that fails at any world size), then again
with the world size the launch will start (`--global-batch 7` on 2 ranks). An unknown option is
named with the closest launcher or workload option (difflib), e.g. `no such option --detatch
(did you mean --detach?)`. `launch run` parses nothing: the user's script owns its arguments.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Sequence

import click

from launcher.cli.options import DryRunCommand
from launcher.core.torchrun import nproc_for
from launcher.core.types import Cluster, LaunchConfig, UserError

__all__ = [
    "WorkloadCommand",
    "TrainArgs",
    "no_such_option",
    "option_names",
    "parser_help",
    "world_size",
    "workload_rows",
]


def world_size(cluster: Cluster, config: LaunchConfig) -> int:
    """The ranks the launch starts: each node's processes (launcher.core.torchrun.nproc_for), summed."""
    return sum(nproc_for(n, cluster.gpus_per_node, config) for n in cluster.nodes)


def option_names(command: click.Command) -> list[str]:
    """A click command's long option names, --no-x forms included."""
    return [
        name
        for p in command.params
        if isinstance(p, click.Option)
        for name in (*p.opts, *p.secondary_opts)
        if name.startswith("--")
    ]


def _parser_names(parser: argparse.ArgumentParser) -> list[str]:
    # argparse has no public list of its options; _actions is what its own help formatter reads.
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def no_such_option(name: str, known: Sequence[str]) -> str:
    """`no such option --detatch (did you mean --detach?)`: difflib's closest name, if one is close."""
    close = difflib.get_close_matches(name, list(dict.fromkeys(known)), n=1)
    return f"no such option {name}" + (f" (did you mean {close[0]}?)" if close else "")


def workload_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(flags, help) for each of the parser's options, as argparse's own --help words them."""
    rows = []
    for a in parser._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        flags = " / ".join(a.option_strings)
        if a.nargs != 0:
            flags += f" {a.metavar or a.dest.upper()}"
        text = (a.help or "") % {**vars(a), "prog": parser.prog}  # argparse's %(default)s expansion
        rows.append((flags, text))
    return rows


def parser_help(parser: argparse.ArgumentParser, flag: str) -> str:
    """The help of the parser's option `flag` (e.g. "-b"), so a launcher option that forwards to a
    workload's flag is described in the workload's words."""
    return next(a.help or "" for a in parser._actions if flag in a.option_strings)


class WorkloadCommand(DryRunCommand):
    """A launcher command that runs a built-in workload: its --help lists the launcher's options,
    then a section of the workload's: the command's own options that only forward to it
    (`workload_params`, by name) and the rows `workload_rows` gives (options passed after --)."""

    def __init__(
        self,
        *args,
        workload_title: str,
        workload_rows: Callable[[], list[tuple[str, str]]] = list,
        workload_params: Sequence[str] = (),
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.workload_title, self.workload_rows, self.workload_params = workload_title, workload_rows, workload_params

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        def rows(forwarded: bool) -> list[tuple[str, str]]:
            params = [p for p in self.get_params(ctx) if (p.name in self.workload_params) == forwarded]
            return [r for r in (p.get_help_record(ctx) for p in params) if r is not None]

        with formatter.section("Options"):
            formatter.write_dl(rows(False))
        with formatter.section(self.workload_title):
            formatter.write_dl([*rows(True), *self.workload_rows()])


class TrainArgs:
    """`launch train`'s extra arguments, checked as workloads.train will read them. Building one
    checks everything a world size does not change; `check` adds the launch's world size."""

    PROG = "launch train"

    def __init__(self, argv: Sequence[str], launcher_options: Sequence[str]):
        self.argv = list(argv)
        self.launcher_options = list(launcher_options)
        self._config(None)

    TITLE = "Workload options (after --; python -m workloads.train)"

    @staticmethod
    def rows() -> list[tuple[str, str]]:
        from workloads.config import build_parser

        return workload_rows(build_parser())

    def check(self, cluster: Cluster, config: LaunchConfig) -> None:
        """The rules that depend on how many ranks the launch starts (the batch split)."""
        self._config(world_size(cluster, config))

    def plan_lines(self, machine_type: str, nodes: int, gpus_per_node: int) -> list[str]:
        """The memory plan (workloads.plan) of these arguments on `nodes` x `machine_type` with
        `gpus_per_node` ranks each; UserError for a layout that cannot run there."""
        from workloads.config import ConfigError
        from workloads.plan import format_plan, plan_for

        cfg = self._config(nodes * gpus_per_node)
        try:
            return format_plan(plan_for(cfg, machine_type=machine_type, nodes=nodes, gpus_per_node=gpus_per_node))
        except ConfigError as e:
            raise UserError(str(e)) from None

    def _config(self, ranks: int | None):
        """Parse and validate (returns the TrainConfig); ranks None = every rule but the batch
        split (not known yet)."""
        from workloads.config import ConfigError, TrainConfig, build_parser

        parser = build_parser(prog=self.PROG)
        try:
            ns, extra = parser.parse_known_args(self.argv)
            if extra:
                raise UserError(self._unknown(extra[0], _parser_names(parser)))
            if ranks is None:
                # Before the launch's world is known: check everything else at the world the
                # layout flags name themselves (dp-shard -1, "the rest", as 1), with a global
                # batch that splits there (a pipeline's microbatches included).
                dp = max(1, ns.dp_replicate) * max(1, ns.dp_shard)
                ranks = dp * max(1, ns.tp) * max(1, ns.pp)
                batch = ns.micro_batch * dp * (ns.pp_microbatches or max(1, ns.pp))
                return TrainConfig(**{**vars(ns), "global_batch": batch}, world_size=ranks)
            return TrainConfig(**vars(ns), world_size=ranks)
        except ConfigError as e:
            raise UserError(str(e)) from None

    def _unknown(self, arg: str, workload_options: list[str]) -> str:
        name = arg.partition("=")[0]
        if not name.startswith("-"):
            return f"unexpected argument {arg!r}: the workload takes options only (`{self.PROG} -h` lists them)"
        if name in self.launcher_options:
            return (
                f"{name} is an option of `{self.PROG}`, not of the workload; put it before the "
                "workload's options (they start at the first option the launcher does not know, or at --)"
            )
        return no_such_option(name, [*self.launcher_options, *workload_options])
