"""`launch nccl-tests`: fan the collective sweep out, then judge and store rank 0's rows.

The click edge: the options are mapped once into the typed request (`Cluster` from
`find_cluster`, `LaunchConfig` from `build_config`, and `NcclRequest` for the rest), and every run
is a caller of `launcher.core.launch.Launch` (through a plan, `launcher.cli.render.execute`, or the bad-node
search's `launcher.nccl.badnodes.BadNodeSearch`), which owns signal handling and stopping. This module
only renders what they return.

Two implementations: `--impl torch` (default) runs `workloads.sweep` under torchrun on every
node; `--impl nccl-tests` runs NVIDIA's binaries with mpirun from node 0. `--find-bad-nodes`
sweeps every pair of nodes (launcher.nccl.badnodes) and prints an `--exclude` list. `--from FILE`
runs nothing: it reports on output that exists (`launcher.nccl.from_files`). The sweep's flags and
the collectives are gpufleet.collectives'; parsing, judging and storing are launcher.nccl.parse,
launcher.nccl.judge and launcher.nccl.render.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from gpufleet.bandwidth import SizeError, avg_busbw, parse_size, size_ladder
from gpufleet.collectives import SWEEP_FLAGS, SWEEP_MODULE, SweepSpec
from gpufleet.contracts import NCCL_TESTS_DIR, SweepRow
from launcher.cli.code_options import INDEX_OPTIONS, code_request, prepare_nodes
from launcher.cli.nccl_from import FROM_OPTIONS, REPORT_WIDTH, from_request, show_paths, show_report_from
from launcher.cli.nccl_table import rich_table
from launcher.cli.options import (
    DETACH_OPTION,
    SOURCE_OPTIONS,
    TORCHRUN_OPTIONS,
    apply_options,
    build_config,
    find_cluster,
)
from launcher.cli.render import err, execute, setup_logging, user_errors
from launcher.cli.workload_args import WorkloadCommand, parser_help
from launcher.cluster.ordering import order_for_launch
from launcher.core.env import node_env
from launcher.core.program import stdin_env
from launcher.core.torchrun import nproc_for
from launcher.core.types import Cluster, LaunchConfig, LaunchResult, UserError, Workload, new_job_id
from launcher.nccl.badnodes import BadNodeSearch, GroupResult, SearchFailed, SearchOptions
from launcher.nccl.judge import expected_judgement, verdict
from launcher.nccl.mpirun import nccl_tests_command
from launcher.nccl.parse import parse_output
from launcher.nccl.render import write_results
from launcher.runner import plan
from workloads.sweep_args import build_parser as build_sweep_parser

__all__ = ["nccl_tests", "NcclRequest", "nccl_request", "rank0_rows", "report_rows"]

_SPEC = SweepSpec()  # the defaults the options show


def _out() -> Console:
    # Tables go to stdout; when it is a file or pipe, 120 columns rather than rich's 80 (the table
    # fits 120, launcher.cli.nccl_table.rich_table; rich wraps its cells on a narrower terminal).
    return Console(highlight=False, width=None if sys.stdout.isatty() else REPORT_WIDTH)


_SWEEP = build_sweep_parser()  # the sweep's own command line, whose words the forwarded options use
# The options that go to workloads.sweep on every node; --help lists them in a section of their own.
_FORWARDED = ("ops", *(name for name, _ in SWEEP_FLAGS))

_SWEEP_OPTIONS = [
    click.option("--ops", "ops", default=_SPEC.ops, show_default=True, help=parser_help(_SWEEP, "--ops")),
    # -b -e -f -n -w -c -d -o, as nccl-tests and workloads.sweep read them (gpufleet.collectives).
    *(
        click.option(
            flag,
            "--" + name.replace("_", "-"),
            type=type(getattr(_SPEC, name)),
            default=getattr(_SPEC, name),
            show_default=True,
            help=parser_help(_SWEEP, flag),
        )
        for name, flag in SWEEP_FLAGS
    ),
    click.option("--impl", type=click.Choice(["torch", "nccl-tests"]), default="torch", show_default=True),
    click.option(
        "--nccl-tests-dir",
        default=NCCL_TESTS_DIR,
        show_default=True,
        help="Where the nodes hold NVIDIA's *_perf binaries (--impl nccl-tests).",
    ),
    click.option("--min-busbw", type=float, help="Exit 1 when the average bus bandwidth (GB/s) is below this."),
    click.option("--nccl-algo", help="NCCL_ALGO for the run."),
    click.option("--nccl-proto", help="NCCL_PROTO for the run."),
    click.option("--find-bad-nodes", is_flag=True, help="Sweep every pair of nodes; name the slow ones."),
    click.option(
        "--threshold",
        type=float,
        default=SearchOptions.threshold,
        show_default=True,
        help="--find-bad-nodes: name nodes below this fraction of the median.",
    ),
    click.option(
        "--pair-budget",
        type=float,
        default=SearchOptions.pair_budget,
        show_default=True,
        metavar="SECONDS",
        help="--find-bad-nodes: seconds each size of a pair's sweep may take; a slower "
        "pair is timed with fewer calls (one, if one call takes longer).",
    ),
]


@dataclass(frozen=True)
class NcclRequest:
    """What `launch nccl-tests` was asked beyond the nodes (`Cluster`) and the launch
    (`LaunchConfig`); built once from the options by `nccl_request`."""

    sweep: SweepSpec = field(default_factory=SweepSpec)
    impl: str = "torch"  # "torch": workloads.sweep under torchrun; "nccl-tests": NVIDIA's binaries
    nccl_tests_dir: str = NCCL_TESTS_DIR
    min_busbw: float | None = None  # exit 1 below this average bus bandwidth (GB/s)
    env: tuple[str, ...] = ()  # KEY=VALUE: --env, then NCCL_ALGO/NCCL_PROTO from --nccl-algo/--nccl-proto
    find_bad_nodes: bool = False
    search: SearchOptions = field(default_factory=SearchOptions)  # --threshold, --pair-budget
    allow_run_as_root: bool = True  # mpirun as root: --ssh-user is root or not given
    explain: bool = False  # --explain: the expected-bandwidth model's terms after its verdict

    @property
    def env_vars(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.env if "=" in e)


def _check_sizes(sweep: SweepSpec) -> None:
    """-b, -e and -f as the sweep on every node reads them (gpufleet.bandwidth, nccl-tests'
    parsesize and its size loop), checked here so a sweep that cannot run starts nowhere."""
    sizes = {}
    for flag, text in (("-b", sweep.minbytes), ("-e", sweep.maxbytes)):
        try:
            sizes[flag] = parse_size(text)
        except SizeError as e:
            raise UserError(f"{flag} {text}: {e}") from None
    try:
        # The sweep's own -i (bytes added when -f is 1), which the launcher leaves at its default.
        size_ladder(sizes["-b"], sizes["-e"], sweep.stepfactor, stepbytes=_SWEEP.get_default("stepbytes"))
    except SizeError as e:
        raise UserError(f"-b {sweep.minbytes} -e {sweep.maxbytes} -f {sweep.stepfactor}: {e}") from None


def nccl_request(o: dict[str, Any]) -> NcclRequest:
    """The command's options (click's dict) as a checked NcclRequest."""
    try:
        sweep = SweepSpec(**{name: o[name] for name in ("ops", *(n for n, _ in SWEEP_FLAGS))})
    except ValueError as e:
        raise UserError(f"--ops {o['ops']}: {e}") from None
    _check_sizes(sweep)
    env = list(o.get("env", ()))
    env += [f"{var}={o[key]}" for var, key in (("NCCL_ALGO", "nccl_algo"), ("NCCL_PROTO", "nccl_proto")) if o.get(key)]
    return NcclRequest(
        sweep=sweep,
        impl=o["impl"],
        nccl_tests_dir=o["nccl_tests_dir"],
        min_busbw=o.get("min_busbw"),
        env=tuple(env),
        find_bad_nodes=o["find_bad_nodes"],
        # Checked only where they apply: a bad --threshold alone changes nothing.
        search=SearchOptions(o["threshold"], o["pair_budget"]) if o["find_bad_nodes"] else SearchOptions(),
        allow_run_as_root=o.get("ssh_user") in (None, "root"),
        explain=bool(o.get("explain")),
    )


def rank0_rows(result: LaunchResult, nranks: int) -> list[SweepRow]:
    """The rows global rank 0 printed: node 0's log (RANK 0 runs on node 0), else the first
    node's log that has rows."""
    for rank in sorted(result.outcomes):
        log = result.run_dir / f"node-{rank}.log"
        if log.exists():
            rows = parse_output(log.read_text(errors="replace"), nranks=nranks)
            if rows:
                return rows
    return []


def _nprocs(cluster: Cluster, config: LaunchConfig) -> list[int]:
    """Processes on each node, as the launch starts them (launcher.core.torchrun.nproc_for)."""
    return [nproc_for(n, cluster.gpus_per_node, config) for n in cluster.nodes]


def _nranks(cluster: Cluster, config: LaunchConfig) -> int:
    return sum(_nprocs(cluster, config))


def report_rows(
    rows: list[SweepRow], cluster: Cluster, config: LaunchConfig, request: NcclRequest, out: Console
) -> int:
    """Print the table, store the results, and say whether the run passes (0) or not (1)."""
    if not rows:
        err.print(f"[red]error: no node printed sweep rows; see {config.run_dir}/node-*.log[/red]")
        return 1
    out.print(rich_table(rows))
    nranks, nnodes = rows[0].nranks or _nranks(cluster, config), len(cluster.nodes)
    mt = cluster.machine_type if not cluster.local else None
    paths = write_results(rows, config.run_dir, machine_type=mt, nranks=nranks, nnodes=nnodes)
    out.print(f"# Avg bus bandwidth    : {avg_busbw(rows):.4g} GB/s")
    show_paths(paths)
    lines = verdict([("", rows)], request.min_busbw)
    for line in lines:
        err.print(f"[red]{escape(line)}[/red]")
    if mt:  # the expected-bandwidth verdict in words, then the short sizes (NCCL_ALGO picks the model)
        judged = expected_judgement(rows, mt, nranks, nnodes, env=request.env_vars)
        for style, line in judged.styled(request.explain):
            err.print(f"[{style}]{escape(line)}[/{style}]")
    return 1 if lines else 0


@click.command(
    name="nccl-tests",
    cls=WorkloadCommand,
    workload_title="Sweep options (python -m workloads.sweep on every node)",
    workload_params=_FORWARDED,
)
@apply_options(SOURCE_OPTIONS + TORCHRUN_OPTIONS + INDEX_OPTIONS + _SWEEP_OPTIONS + FROM_OPTIONS + [DETACH_OPTION])
@user_errors
def nccl_tests(**o: Any) -> None:
    """Measure collective bandwidth across the nodes (an nccl-tests style sweep), or report on
    nccl-tests output that exists (--from FILE)."""
    if o[
        "from_files"
    ]:  # results that exist: read and report, run nothing (launcher.nccl.from_files, shown by launcher.cli.nccl_from)
        raise SystemExit(show_report_from(from_request(o), _out()))
    if o["as_json"]:
        raise UserError(
            "--json prints the rows read with --from; a live run streams its nodes' "
            "output to stdout: add --from FILE or drop --json"
        )
    request = nccl_request(o)
    setup_logging()
    workload = Workload("torchrun", ("-m", SWEEP_MODULE, *request.sweep.sweep_argv()))
    if o.pop("detach", False):
        _detach(o, request, workload)
        return
    cluster = find_cluster(o)
    config = build_config({**o, "env": request.env}, workload, cluster)
    if request.find_bad_nodes:
        config = prepare_nodes(cluster, config, code_request(o, cluster, builtin=True))
        raise SystemExit(_find_bad_nodes(cluster, config, request))
    if request.impl == "nccl-tests":
        raise SystemExit(_run_nccl_tests_binary(cluster, config, request, o.get("dry_run") or "text"))
    # The sweep's ranks import gpufleet's own workloads.sweep: sent, with its environment.
    config = prepare_nodes(cluster, config, code_request(o, cluster, builtin=True))
    result = execute(plan(cluster, config), o.get("dry_run") or "text")
    if result is None:  # --dry-run
        return
    lost = result.first_failure is not None and result.outcomes[result.first_failure].connection_lost
    if result.signal is not None or lost:
        raise SystemExit(result.exit_code)
    code = report_rows(rank0_rows(result, _nranks(cluster, config)), cluster, config, request, _out())
    raise SystemExit(result.exit_code or code)


def _detach(o: dict[str, Any], request: NcclRequest, workload: Workload) -> None:
    """The sweep as a detached job: node 0's controller runs it; its report is read back with
    `launch logs ID --node 0 | launch nccl-tests --from -` (the node log keeps the JSON rows)."""
    if request.find_bad_nodes or request.impl == "nccl-tests":
        what = "--find-bad-nodes" if request.find_bad_nodes else "--impl nccl-tests"
        raise UserError(
            f"--detach hands one sweep to node 0; {what} runs several launches from this "
            "machine: drop --detach, or run it from a machine that stays up"
        )
    from launcher.cli.detached import start_detached  # loaded only when asked for, as cli's --detach does

    start_detached({**o, "env": request.env}, workload, own_code=True)


def _run_nccl_tests_binary(
    cluster: Cluster, config: LaunchConfig, request: NcclRequest, dry_run_format: str = "text"
) -> int:
    """NVIDIA's binaries: mpirun on node 0 over every node, with the same NCCL environment; one
    launch on node 0 per collective. mpirun's ranks follow its host list: the launch's rank order.
    A dry run prints each launch's plan as `dry_run_format`."""
    # The environment first: bad input is refused before the order asks any node.
    env = {k: v for k, v in node_env(cluster, config).items() if not v.startswith("@")}
    order = order_for_launch(cluster, config)
    cluster = order.cluster
    err.print(f"[dim]{escape(order.message)}[/dim]")
    nprocs = set(_nprocs(cluster, config))
    if len(nprocs) != 1:
        raise UserError(
            f"--impl nccl-tests starts the same number of processes on every node (mpirun "
            f"-npernode); the nodes' slots differ ({sorted(nprocs)}): pass --nproc-per-node"
        )
    nproc = nprocs.pop()
    head = dataclasses.replace(cluster, nodes=cluster.nodes[:1])
    code = 0
    for op in request.sweep.collectives:
        argv = nccl_tests_command(
            f"{request.nccl_tests_dir}/{op}_perf",
            [n.address for n in cluster.nodes],
            nproc,
            [*request.sweep.flags(), "-g", "1"],
            env,
            # The --env values: in mpirun's environment (node 0's program reads them from stdin),
            # never in its argv.
            inherit={k for k, _ in stdin_env(config)},
            allow_run_as_root=request.allow_run_as_root,
        )
        op_config = dataclasses.replace(config, workload=Workload("exec", tuple(argv)), job_id=new_job_id())
        result = execute(plan(head, op_config), dry_run_format)
        if result is None:  # --dry-run: the mpirun command on node 0, for each collective
            continue
        if result.exit_code != 0:
            return result.exit_code
        text = (result.run_dir / "node-0.log").read_text(errors="replace")
        rows = parse_output(text, collective=op, nranks=nproc * len(cluster.nodes))
        code = max(code, report_rows(rows, cluster, op_config, request, _out()))
    return code


# ---- --find-bad-nodes: the search is launcher.nccl.badnodes'; this shows it --------------------------


def _print_wrong(group: tuple[str, ...], r: SweepRow) -> None:
    err.print(
        f"[red]{escape('+'.join(group))}: {r.collective} at {r.size} B: wrong results "
        f"(out-of-place {r.oop_wrong}, in-place {r.ip_wrong})[/red]"
    )


def _print_pairs(pairs: dict[tuple[str, ...], GroupResult], median: float, request: NcclRequest) -> None:
    iters, budget = request.sweep.iters, request.search.pair_budget
    for (a, b), grp in sorted(pairs.items()):
        cut = (
            f"  ({grp.iters} of {iters} timed calls fit --pair-budget {budget:g} s)"
            if grp.iters is not None and grp.iters < iters
            else ""
        )
        click.echo(f"pair {a} {b}: busbw {grp.busbw:.3f} GB/s{cut}")
    click.echo(f"median node score: {median:.3f} GB/s")


def _confirm(search: BadNodeSearch, suspects: list[str]) -> None:
    """The halves, unless the cluster is too small for two; what they showed."""
    try:
        halves = search.run_halves(suspects)
    except ValueError as e:
        err.print(f"[yellow]no confirming pass: {escape(str(e))}[/yellow]")
        return
    click.echo(
        f"clean half {','.join(halves.clean)}: {halves.clean_busbw:.3f} GB/s; "
        f"suspect half {','.join(halves.suspect)}: {halves.suspect_busbw:.3f} GB/s"
    )
    if not halves.confirmed:
        err.print("[yellow]the halves did not confirm the suspects; reporting the pair results[/yellow]")


def _search(search: BadNodeSearch, request: NcclRequest) -> int:
    """Pairs, then halves unless the pairs settle it; the verdict and its exit status."""
    threshold = request.search.threshold
    pairs = search.run_pairs()
    report = search.rank(pairs)
    _print_pairs(pairs, report.median, request)
    if report.bad and report.decisive:
        click.echo(
            f"every pair with {', '.join(report.bad)} is below {threshold:g} x the slowest "
            "pair without; no confirming pass"
        )
    elif report.bad:
        _confirm(search, report.bad)
    search.write_pairs(pairs)
    if not report.bad:
        click.echo(f"no node below {threshold:g} x the median; nothing to exclude")
        return 0
    for line in report.lines:
        err.print(f"[red]{escape(line)}[/red]")
    click.echo(f"--exclude {report.exclude}")
    return 1


def _find_bad_nodes(cluster: Cluster, config: LaunchConfig, request: NcclRequest) -> int:
    """Run the search (launcher.nccl.badnodes) and show it: 0 nothing to exclude, 1 an --exclude
    list, else the failing launch's status or 128+signal, with no verdict."""
    search = BadNodeSearch(cluster, config, request.sweep, request.search, on_wrong=_print_wrong)
    for i, rnd in enumerate(search.rounds):
        err.print(f"[dim]round {i + 1}: {', '.join(f'{a}+{b}' for a, b in rnd)}[/dim]")
    err.print(
        f"[dim]one launch for all {len(search.rounds)} rounds; each size of a pair gets "
        f"{request.search.pair_budget:g} s (--pair-budget)[/dim]"
    )
    try:
        return _search(search, request)
    except KeyboardInterrupt:  # Ctrl-C between two launches, when nothing runs on any node
        err.print("[red]stopped on SIGINT; no verdict[/red]")
        return 128 + signal.SIGINT
    except SearchFailed as e:
        if search.signals:
            err.print(f"[red]stopped on {signal.Signals(search.signals[0]).name}; no verdict[/red]")
            return 128 + search.signals[0]
        err.print(f"[red]error: {escape(str(e))}; no verdict[/red]")
        return e.code
