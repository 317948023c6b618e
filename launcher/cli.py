"""`launch`: the click edge. Each command maps its options into a `LaunchConfig` (the typed
request), finds the `Cluster`, and drives one `launcher.launch.Launch`, rendering its events.
rich lives only here: a status line and the final table on stderr, node output on stdout, one
red line per error.

Exit status: the first failed node's status; 2 for a user error (nothing ran); 130/143 when
stopped by SIGINT/SIGTERM; 255 when a node became unreachable.
"""

from __future__ import annotations

import functools
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launcher import discovery
from launcher.command import READY_MARKER, node_commands
from launcher.env import parse_env_pairs
from launcher.launch import Interrupted, Launch, NodeEvent, NodeState
from launcher.model import (
    EXIT_USER_ERROR,
    Cluster,
    LaunchConfig,
    LaunchResult,
    SshConfig,
    UserError,
    Workload,
    new_job_id,
)
from launcher.transport import make_transport

__all__ = [
    "main",
    "err",
    "SOURCE_OPTIONS",
    "TORCHRUN_OPTIONS",
    "apply_options",
    "setup_logging",
    "user_errors",
    "find_cluster",
    "build_config",
    "execute",
    "execute_on",
    "live_printer",
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


def _fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    err.print(f"[red]error: {escape(message)}[/red]")
    raise SystemExit(code)


def user_errors(fn):
    """A UserError becomes one red line and exit 2: no traceback, nothing ran."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            _fail(str(e))
        except Interrupted as e:
            err.print(f"[red]interrupted ({e}) while connecting; nothing was started[/red]")
            raise SystemExit(128 + e.signum)

    return wrapper


# ---- options ----------------------------------------------------------------------------

SOURCE_OPTIONS = [
    click.option("--stack", help="Infra stack name: read `pulumi stack output --json --stack NAME`."),
    click.option("--outputs", type=click.Path(path_type=Path), help="A saved stack-outputs JSON file."),
    click.option("--hostfile", type=click.Path(path_type=Path), help="One host per line, optional slots=N."),
    click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
                 help="Find instances by label through the Compute Engine API (repeatable)."),
    click.option("--project", help="Project for --label."),
    click.option("--zone", help="Zone for --label and --iap."),
    click.option("--api-endpoint", hidden=True, help="Compute Engine API endpoint (tests)."),
    click.option("--local", is_flag=True, help="Run N nodes as process groups on this machine."),
    click.option("--nodes", type=int, help="Use the first N nodes in rank order."),
    click.option("--exclude", default="", metavar="HOST,...", help="Leave these hosts out."),
    click.option("--machine-type", help="Machine type for a hostfile (from the outputs otherwise)."),
    click.option("--external-ip", is_flag=True, help="SSH to external IPs (from outside the VPC)."),
    click.option("--ssh-user"),
    click.option("--ssh-key", type=click.Path(path_type=Path)),
    click.option("--ssh-option", "ssh_options", multiple=True, metavar="KEY=VALUE",
                 help="An OpenSSH -o option (repeatable); wins over the defaults."),
    click.option("--known-hosts", type=click.Path(path_type=Path),
                 help="known_hosts file (default: one per cluster under ~/.cache/gpufleet)."),
    click.option("--iap", is_flag=True, help="Reach nodes through an IAP tunnel (no external IP needed)."),
    click.option("--python", help="The python on the nodes [default: python3; --local: this python]."),
    click.option("--workdir", help="Directory the command runs in on each node."),
    click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True),
    click.option("--dry-run", is_flag=True, help="Print each node's host and command; connect to nothing."),
]

_ENV_OPTION = click.option("--env", "env", multiple=True, metavar="KEY=VALUE",
                           help="Set or override a variable on every node (repeatable).")

TORCHRUN_OPTIONS = [
    click.option("--nproc-per-node", type=int, help="Processes per node (default: GPUs, or 1 on CPU)."),
    click.option("--max-restarts", type=int, default=0, show_default=True),
    click.option("--rdzv-port", type=int, help="Rendezvous port on node 0 [default: 29500; --local: a free one]."),
    _ENV_OPTION,
    click.option("--nccl-debug", is_flag=True, help="NCCL_DEBUG=INFO on every node."),
    click.option("--image-os", type=click.Choice(["ubuntu", "cos"]), help="Interface naming of the image."),
]


def apply_options(options):
    def deco(fn):
        for opt in reversed(options):
            fn = opt(fn)
        return fn
    return deco


# train passes options it does not know to workloads.train; run and exec take their program
# after the first argument or `--`, so a misspelt launcher option is an error, not a command.
_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "allow_interspersed_args": False}
_PROGRAM_AFTER = {"allow_interspersed_args": False}


def find_cluster(o: dict[str, Any]) -> Cluster:
    """Exactly one node source, then --exclude and --nodes."""
    flags = {"stack": "--stack", "outputs": "--outputs", "hostfile": "--hostfile", "labels": "--label",
             "local": "--local"}
    given = [k for k in flags if o.get(k)]
    if len(given) != 1:
        what = ", ".join(flags[g] for g in given) if given else "none"
        raise UserError(f"give exactly one node source (--stack, --outputs, --hostfile, --label, --local); got {what}")
    ext = o.get("external_ip", False)
    src = given[0]
    if src == "local":
        if o.get("nodes") is None:
            raise UserError("--local needs --nodes N (how many nodes to simulate here)")
        for key, flag in (("exclude", "--exclude"), ("machine_type", "--machine-type")):
            if o.get(key):
                raise UserError(f"{flag} does not apply to --local (its nodes are processes on this "
                                "machine, on CPU); drop it")
        return discovery.local_cluster(o["nodes"])
    if src == "hostfile":
        cluster = discovery.read_hostfile(o["hostfile"], machine_type=o.get("machine_type"))
    elif src == "outputs":
        cluster = discovery.read_outputs_file(o["outputs"], prefer_external=ext)
    elif src == "stack":
        cluster = discovery.read_stack(o["stack"], prefer_external=ext)
    else:
        labels = {}
        for pair in o["labels"]:
            k, sep, v = pair.partition("=")
            if not sep:
                raise UserError(f"--label {pair!r} is not KEY=VALUE")
            labels[k] = v
        if not o.get("project") or not o.get("zone"):
            raise UserError("--label needs --project and --zone")
        client = None
        if o.get("api_endpoint"):
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import compute_v1
            client = compute_v1.InstancesClient(
                credentials=AnonymousCredentials(), transport="rest",
                client_options={"api_endpoint": o["api_endpoint"]})
        cluster = discovery.discover_by_label(labels, o["project"], o["zone"], client=client,
                                              machine_type=o.get("machine_type"), prefer_external=ext)
    if o.get("machine_type") and src != "hostfile":
        cluster = Cluster(cluster.name, cluster.nodes, o["machine_type"], cluster.zone, cluster.project)
    exclude = tuple(h.strip() for h in (o.get("exclude") or "").split(",") if h.strip())
    return cluster.select(o.get("nodes"), exclude)


def _ssh_options(values: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for v in values:
        v = v.strip()
        if v.startswith("-o"):
            v = v[2:].strip()
        key, sep, val = v.partition("=")
        if not sep and " " in v:
            key, _, val = v.partition(" ")
            sep = "="
        if not sep or not key.isalnum():
            raise UserError(f"--ssh-option {v!r} is not an OpenSSH Key=Value option")
        out.append(f"{key}={val}")
    return tuple(out)


def build_config(o: dict[str, Any], workload: Workload, cluster: Cluster) -> LaunchConfig:
    """Map the CLI options into a LaunchConfig (validation happens in the dataclasses)."""
    ssh = SshConfig(
        user=o.get("ssh_user"), key=o.get("ssh_key"), options=_ssh_options(o.get("ssh_options", ())),
        known_hosts=o.get("known_hosts"), iap=o.get("iap", False), zone=o.get("zone") or cluster.zone,
    )
    return LaunchConfig(
        workload=workload,
        nproc_per_node=o.get("nproc_per_node"),
        max_restarts=o.get("max_restarts", 0),
        # --local without --rdzv-port takes a free port, so two local runs (or anything else
        # on 29500 here) never collide; on a cluster, torchrun's documented default.
        rdzv_port=o.get("rdzv_port") or (_free_port() if cluster.local else 29500),
        workdir=o.get("workdir"),
        env=parse_env_pairs(o.get("env", ())),
        nccl_debug=o.get("nccl_debug", False),
        image_os=o.get("image_os"),
        # --local runs on this machine: the launcher's own interpreter has torch if workloads do.
        python=o.get("python") or (sys.executable if cluster.local else "python3"),
        job_id=new_job_id(),
        runs_dir=o.get("runs_dir") or Path("runs"),
        dry_run=o.get("dry_run", False),
        ssh=ssh,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- running and rendering ------------------------------------------------------------------


# At most this many nodes still to answer are named in the status line.
_NAME_WAITING = 3


def live_printer(cluster: Cluster):
    """The live display of a launch: a status line (on stderr) while the nodes connect and
    check, then each node's output on stdout as `[node N] line`. Returns (on_event, status)."""
    n = len(cluster.nodes)
    waiting = {node.rank: node.label for node in cluster.nodes}
    status = err.status(f"connecting to {n} node{'s' * (n != 1)}…")
    status.start()

    def on_event(event: NodeEvent) -> None:
        rank = event.node.rank
        if event.line is not None:
            sys.stdout.write(f"[node {rank}] {event.line}\n")
            sys.stdout.flush()
        elif event.state is NodeState.RUNNING:
            if rank == n - 1:
                status.stop()
                err.print(f"[dim]started on {n} node{'s' * (n != 1)}[/dim]")
        elif event.state is not NodeState.CONNECTING and rank in waiting:
            # The node answered its check (passed it, or ended): one fewer to wait for.
            waiting.pop(rank)
            line = f"checked {n - len(waiting)}/{n} nodes"
            if 0 < len(waiting) <= _NAME_WAITING:
                # The last few are the ones holding everyone up: say which.
                line += "; waiting for " + ", ".join(waiting.values())
            status.update(escape(line))
    return on_event, status


def _render(result: LaunchResult, cluster: Cluster) -> None:
    table = Table(title=f"job {result.job_id}", title_justify="left")
    for col in ("node", "host", "exit", "duration"):
        table.add_column(col)
    for rank in sorted(result.outcomes):
        o = result.outcomes[rank]
        style = "green" if o.ok else "yellow" if o.stopped else "red"
        table.add_row(str(rank), o.node.host, f"[{style}]{escape(o.status)}[/{style}]", f"{o.duration_s:.1f} s")
    err.print(table)
    if result.first_failure is not None:
        o = result.outcomes[result.first_failure]
        what = f"unreachable ({o.error})" if o.connection_lost else o.status
        err.print(f"[red]{escape(o.node.label)} failed first: {escape(what)} — last lines:[/red]")
        tail = o.tail[-20:]
        for line in o.error_lines:
            if line not in tail:  # its own error line, pushed out by torchrun's summary
                err.print(f"  {escape(line)}")
        if o.error_lines and o.error_lines[-1] not in tail:
            err.print("  ...")
        for line in tail:
            err.print(f"  {escape(line)}")
    if result.signal is not None:
        err.print(f"[red]stopped every node on signal {result.signal}[/red]")
    err.print(f"[dim]logs: {result.run_dir}/node-<rank>.log[/dim]")


def execute(o: dict[str, Any], workload: Workload) -> LaunchResult | None:
    """Find the nodes, build the config, run (or print for --dry-run). Returns None for dry runs."""
    setup_logging()
    cluster = find_cluster(o)
    return execute_on(cluster, build_config(o, workload, cluster))


def execute_on(cluster: Cluster, config: LaunchConfig) -> LaunchResult | None:
    """Run `config` on `cluster` with the live display and the summary table, or, for --dry-run,
    print each node's command and connect to nothing (returns None)."""
    if config.dry_run:
        transport = make_transport(cluster, config)
        for rank, script in node_commands(cluster, config).items():
            click.echo(f"{cluster.nodes[rank].host}\t{transport.display(cluster.nodes[rank], script)}")
        return None
    on_event, status = live_printer(cluster)
    try:
        result = Launch(cluster, config, on_event=on_event).run()
    finally:
        status.stop()
    _render(result, cluster)
    return result


def _finish(result: LaunchResult | None) -> None:
    if result is not None and result.exit_code != 0:
        raise SystemExit(result.exit_code)


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
    # loading): `launch exec` does not pay for the sweep's report, and launcher.nccl_cmd, which
    # imports this module, can be imported first.
    _lazy = {"nccl-tests": ("launcher.nccl_cmd", "nccl_tests"), "doctor": ("launcher.doctor_cli", "doctor"),
             "top": ("launcher.top_cli", "top")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self._lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self._lazy:
            import importlib

            module, attr = self._lazy[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
# The installed distribution's version (importlib.metadata), so it always says what pip installed.
@click.version_option(package_name="gpufleet", prog_name="launch")
def main() -> None:
    """Launch torchrun (or any command) on every node of a GPU cluster over SSH."""


@main.command(context_settings=_PASS_THROUGH)
@apply_options(SOURCE_OPTIONS + TORCHRUN_OPTIONS)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def train(args: tuple[str, ...], **o: Any) -> None:
    """Run the built-in training workload (workloads.train); extra ARGS go to it."""
    _finish(execute(o, Workload("torchrun", ("-m", "workloads.train", *args))))


@main.command(context_settings=_PROGRAM_AFTER)
@apply_options(SOURCE_OPTIONS + TORCHRUN_OPTIONS)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def run(args: tuple[str, ...], **o: Any) -> None:
    """Run SCRIPT [ARGS] (or -m MODULE [ARGS]) under torchrun on every node."""
    if not args:
        raise UserError("nothing to run: `launch run ... -- SCRIPT [ARGS]` or `-- -m MODULE [ARGS]`")
    if args[0] == "-m" and len(args) < 2:
        raise UserError("`-m` needs a module name: `launch run ... -- -m package.module`")
    _finish(execute(o, Workload("torchrun", tuple(args))))


@main.command(name="exec", context_settings=_PROGRAM_AFTER)
@apply_options(SOURCE_OPTIONS + [_ENV_OPTION])
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def exec_(args: tuple[str, ...], **o: Any) -> None:
    """Run a plain command (CMD [ARGS]) on every node."""
    if not args:
        raise UserError("nothing to run: `launch exec ... -- CMD [ARGS]`")
    _finish(execute(o, Workload("exec", tuple(args))))


@main.command()
@apply_options(SOURCE_OPTIONS)
@user_errors
def hosts(**o: Any) -> None:
    """List the nodes in rank order; check SSH and the startup script's ready marker."""
    setup_logging()
    cluster = find_cluster(o)
    config = build_config(o, Workload("exec", ("true",)), cluster)
    table = Table()
    for col in ("node", "host", "address", "name", "ssh", "ready", "hostname"):
        table.add_column(col)
    if config.dry_run:
        for n in cluster.nodes:
            click.echo(f"{n.rank}\t{n.host}\t{n.address}\t{n.name}")
        return
    with err.status(f"checking {len(cluster.nodes)} nodes…"):
        probes = Launch(cluster, config).probe(check_torch=False)
    for n in cluster.nodes:
        p = probes[n.rank]
        ssh = "[green]ok[/green]" if p.ok else f"[red]{escape(p.error)}[/red]"
        ready = p.facts.get("ready", "-")
        ready = "[green]yes[/green]" if ready == "yes" else f"[yellow]{ready}[/yellow]"
        table.add_row(str(n.rank), n.host, n.address, n.name, ssh, ready, p.facts.get("host", ""))
    # A pipe or file gets the whole table, not one squeezed into 80 columns.
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)
    err.print(f"[dim]ready marker: {READY_MARKER}[/dim]")
    if any(not p.ok for p in probes.values()):
        raise SystemExit(1)


# The names launcher.nccl_cmd imports from here, until it drives a `Launch` itself.
_SOURCE_OPTIONS = SOURCE_OPTIONS
_TORCHRUN_OPTIONS = TORCHRUN_OPTIONS
_apply = apply_options
_setup_logging = setup_logging
_user_errors = user_errors
