"""`launch nccl-tests`: fan the collective sweep out, then judge and store rank 0's rows.

Two implementations: `--impl torch` (default) runs `workloads.sweep` under torchrun on every
node; `--impl nccl-tests` runs NVIDIA's binaries with mpirun from node 0. `--find-bad-nodes`
sweeps every pair of nodes (disjoint pairs at once), ranks nodes by their pairs' bandwidth,
confirms with a suspect half against a clean half, and prints an `--exclude` list.
`--from FILE` runs nothing: it reports on output that exists (`launcher.nccl_from`).
Parsing, judging, plots and the pair schedule live in `launcher.nccl_report` (pure).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from gpufleet.catalog import lookup
from gpufleet.groups import format_rounds, group_documents
from infra.contract import NCCL_TESTS_DIR
from launcher import nccl_report
from launcher.options import SOURCE_OPTIONS, TORCHRUN_OPTIONS, apply_options, build_config, find_cluster
from launcher.render import err, execute_on, setup_logging, user_errors
from launcher.command import nproc_for
from launcher.env import node_env
from launcher.model import Cluster, LaunchConfig, LaunchResult, UserError, Workload
from launcher.nccl_from import FROM_OPTIONS, report_from, verdict
from launcher.run import Interrupted, launch


def _out() -> Console:
    # Tables go to stdout; when it is a file or pipe, do not squeeze them into 80 columns.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)

__all__ = ["nccl_tests", "sweep_argv", "rank0_rows"]

_SWEEP_OPTIONS = [
    click.option("--ops", "--op", "ops", default="all_reduce", show_default=True,
                 help="Collectives: a comma list, or all."),
    click.option("-b", "--minbytes", default="32M", show_default=True),
    click.option("-e", "--maxbytes", default="32M", show_default=True),
    click.option("-f", "--stepfactor", type=int, default=2, show_default=True),
    click.option("-n", "--iters", type=int, default=20, show_default=True),
    click.option("-w", "--warmup-iters", type=int, default=1, show_default=True),
    click.option("-c", "--check", type=int, default=1, show_default=True),
    click.option("-d", "--datatype", default="float", show_default=True),
    click.option("-o", "--redop", default="sum", show_default=True),
    click.option("--impl", type=click.Choice(["torch", "nccl-tests"]), default="torch", show_default=True),
    click.option("--nccl-tests-dir", default=NCCL_TESTS_DIR, show_default=True,
                 help="Where the nodes hold NVIDIA's *_perf binaries (--impl nccl-tests)."),
    click.option("--min-busbw", type=float, help="Exit 1 when the average bus bandwidth (GB/s) is below this."),
    click.option("--nccl-algo", help="NCCL_ALGO for the run."),
    click.option("--nccl-proto", help="NCCL_PROTO for the run."),
    click.option("--find-bad-nodes", is_flag=True, help="Sweep every pair of nodes; name the slow ones."),
    click.option("--threshold", type=float, default=0.8, show_default=True,
                 help="--find-bad-nodes: name nodes below this fraction of the median."),
    click.option("--pair-budget", type=float, default=1.0, show_default=True, metavar="SECONDS",
                 help="--find-bad-nodes: seconds each size of a pair's sweep may take; a slower "
                      "pair is timed with fewer calls (one, if one call takes longer)."),
]


def sweep_argv(o: dict[str, Any]) -> list[str]:
    """Flags for workloads.sweep, which mirror nccl-tests' (-b -e -f -n -w -c -d -o)."""
    return [
        "--ops", o["ops"], "-b", str(o["minbytes"]), "-e", str(o["maxbytes"]),
        "-f", str(o["stepfactor"]), "-n", str(o["iters"]), "-w", str(o["warmup_iters"]),
        "-c", str(o["check"]), "-d", o["datatype"], "-o", o["redop"],
    ]


def rank0_rows(result: LaunchResult, nranks: int) -> list[nccl_report.SweepRow]:
    """The rows global rank 0 printed. With a c10d rendezvous, which node's agent gets global
    rank 0 is decided at the rendezvous (not by --node-rank), so look in every node's log."""
    for rank in sorted(result.outcomes):
        log = result.run_dir / f"node-{rank}.log"
        if log.exists():
            rows = nccl_report.parse_output(log.read_text(errors="replace"), nranks=nranks)
            if rows:
                return rows
    return []


def _extra_env(o: dict[str, Any]) -> tuple[str, ...]:
    env = list(o.get("env", ()))
    if o.get("nccl_algo"):
        env.append(f"NCCL_ALGO={o['nccl_algo']}")
    if o.get("nccl_proto"):
        env.append(f"NCCL_PROTO={o['nccl_proto']}")
    return tuple(env)


def _nprocs(cluster: Cluster, config: LaunchConfig) -> list[int]:
    """Processes on each node, as the launch starts them (launcher.command.nproc_for)."""
    gpus = lookup(cluster.machine_type).gpu_count if cluster.machine_type and not cluster.local else None
    return [nproc_for(n, gpus, config) for n in cluster.nodes]


def _nranks(cluster: Cluster, config: LaunchConfig) -> int:
    return sum(_nprocs(cluster, config))


def _judge(rows, cluster: Cluster, config: LaunchConfig, o: dict[str, Any], out: Console) -> int:
    """Print the table, store the results, and say whether the run passes (0) or not (1)."""
    if not rows:
        err.print(f"[red]error: no node printed sweep rows; see {config.run_dir}/node-*.log[/red]")
        return 1
    out.print(nccl_report.rich_table(rows))
    nranks, nnodes = rows[0].nranks or _nranks(cluster, config), len(cluster.nodes)
    mt = cluster.machine_type if not cluster.local else None
    paths = nccl_report.write_results(rows, config.run_dir, machine_type=mt, nranks=nranks, nnodes=nnodes)
    avg = nccl_report.avg_busbw(rows)
    out.print(f"# Avg bus bandwidth    : {avg:.4g} GB/s")
    err.print(f"[dim]rows: {paths['json']}  {paths['csv']}  plot: {paths['png']}[/dim]")
    lines = verdict([("", rows)], o.get("min_busbw"))
    for line in lines:
        err.print(f"[red]{escape(line)}[/red]")
    if mt:  # the expected-bandwidth report; its one-line verdict ends the output
        env = dict(e.split("=", 1) for e in o.get("env", ()) if "=" in e)  # NCCL_ALGO picks the model
        for style, line in nccl_report.expected_judgement(rows, mt, nranks, nnodes, env=env).styled():
            err.print(f"[{style}]{escape(line)}[/{style}]")
    return 1 if lines else 0


@click.command(name="nccl-tests")
@apply_options(SOURCE_OPTIONS + TORCHRUN_OPTIONS + _SWEEP_OPTIONS + FROM_OPTIONS)
@user_errors
def nccl_tests(**o: Any) -> None:
    """Measure collective bandwidth across the nodes (an nccl-tests style sweep), or report on
    nccl-tests output that exists (--from FILE)."""
    if o["from_files"]:  # results that exist: read and report, run nothing (launcher.nccl_from)
        raise SystemExit(report_from(o, _out()))
    if o["as_json"]:
        raise UserError("--json prints the rows read with --from; a live run streams its nodes' "
                        "output to stdout: add --from FILE or drop --json")
    o["env"] = _extra_env(o)
    if o["find_bad_nodes"]:
        raise SystemExit(_find_bad_nodes(o))
    if o["impl"] == "nccl-tests":
        raise SystemExit(_run_nccl_tests_binary(o))
    setup_logging()
    cluster = find_cluster(o)
    config = build_config(o, Workload("torchrun", ("-m", "workloads.sweep", *sweep_argv(o))), cluster)
    result = execute_on(cluster, config)
    if result is None:  # --dry-run
        return
    lost = result.first_failure is not None and result.outcomes[result.first_failure].connection_lost
    if result.signal is not None or lost:
        raise SystemExit(result.exit_code)
    code = _judge(rank0_rows(result, _nranks(cluster, config)), cluster, config, o, _out())
    raise SystemExit(result.exit_code or code)


def _run_nccl_tests_binary(o: dict[str, Any]) -> int:
    """NVIDIA's binaries: mpirun on node 0 over every node, with the same NCCL environment."""
    setup_logging()
    cluster = find_cluster(o)
    probe_cfg = build_config(o, Workload("torchrun", ("true",)), cluster)
    env = {k: v for k, v in node_env(cluster, probe_cfg).items() if not v.startswith("@")}
    nprocs = set(_nprocs(cluster, probe_cfg))
    if len(nprocs) != 1:
        raise UserError(f"--impl nccl-tests starts the same number of processes on every node (mpirun "
                        f"-npernode); the nodes' slots differ ({sorted(nprocs)}): pass --nproc-per-node")
    nproc = nprocs.pop()
    ops = o["ops"].split(",") if o["ops"] != "all" else [
        "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv"]
    code = 0
    for op in ops:
        args = ["-b", str(o["minbytes"]), "-e", str(o["maxbytes"]), "-f", str(o["stepfactor"]),
                "-n", str(o["iters"]), "-w", str(o["warmup_iters"]), "-c", str(o["check"]),
                "-d", o["datatype"], "-o", o["redop"], "-g", "1"]
        argv = nccl_report.nccl_tests_command(
            f"{o['nccl_tests_dir']}/{op}_perf", [n.address for n in cluster.nodes], nproc, args, env,
            allow_run_as_root=o.get("ssh_user") in (None, "root"),
        )
        head = dataclasses.replace(cluster, nodes=cluster.nodes[:1])
        config = build_config(o, Workload("exec", tuple(argv)), head)
        result = execute_on(head, config)
        if result is None:  # --dry-run: the mpirun command on node 0, for each collective
            continue
        if result.exit_code != 0:
            return result.exit_code
        text = (result.run_dir / "node-0.log").read_text(errors="replace")
        rows = nccl_report.parse_output(text, collective=op, nranks=nproc * len(cluster.nodes))
        cfg = dataclasses.replace(config, job_id=result.job_id)
        code = max(code, _judge(rows, cluster, cfg, o, _out()))
    return code


class _SearchFailed(Exception):
    """A launch of --find-bad-nodes did not give numbers: the search ends with `code`."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class _Group:
    """One group's result in a --find-bad-nodes launch: its busbw at the largest size."""

    busbw: float
    iters: int | None  # timed calls behind it (fewer than -n where --pair-budget cut them)
    wrong: list[nccl_report.SweepRow]


def _group_result(doc: dict[str, Any]) -> _Group:
    fields = {f.name for f in dataclasses.fields(nccl_report.SweepRow)}
    rows = [nccl_report.SweepRow(**{k: v for k, v in d.items() if k in fields}) for d in doc["rows"]]
    if not rows:
        return _Group(0.0, None, [])
    largest = max(r.size for r in rows)
    iters = [d.get("iters") for d in doc["rows"] if d["size"] == largest and d.get("iters") is not None]
    return _Group(max(r.best_busbw for r in rows if r.size == largest), min(iters, default=None),
                  nccl_report.failures(rows))


def _find_bad_nodes(o: dict[str, Any]) -> int:
    """Every pair of nodes, a round of disjoint pairs at a time, all in ONE launch of the sweep
    (`--rounds`, gpufleet.groups); then, unless the pairs settle it, halves to confirm.

    Each pair's sweep runs under `--time-budget` (--pair-budget): a pair far slower than the
    others is timed with one call per size instead of -w + 2 x (1 + -n + -c), so the search takes
    about (rounds x the slow pair's one call) plus one launch, however slow the bad node is.
    """
    budget = o.get("pair_budget", 1.0)
    if not (budget > 0 and math.isfinite(budget)):
        raise UserError(f"--pair-budget {budget} must be a number of seconds > 0")
    setup_logging()
    cluster = find_cluster(o)
    if cluster.local:
        raise UserError("--find-bad-nodes compares machines; --local has only this one")
    if o.get("dry_run"):
        raise UserError("--find-bad-nodes runs many launches, chosen as results come in; --dry-run "
                        "shows one: drop --find-bad-nodes to see the sweep's command")
    if len(cluster.nodes) < 3:
        raise UserError(f"--find-bad-nodes needs 3 or more nodes to tell a bad one apart; found {len(cluster.nodes)}")
    if not 0 < o["threshold"] <= 1:
        raise UserError(f"--threshold {o['threshold']} must be in (0, 1]")
    argv = [*sweep_argv(o), "--time-budget", repr(float(budget))]
    base = build_config(o, Workload("torchrun", ("-m", "workloads.sweep", *argv)), cluster)
    parent = base.run_dir
    hosts = [n.host for n in cluster.nodes]
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        received.append(signum)
        stop.set()

    def run_plan(groups: list[list[list[str]]], label: str) -> dict[tuple[str, ...], _Group]:
        """One launch on every node running `groups` (rounds of host groups) as --rounds."""
        plan = [[tuple(hosts.index(h) for h in g) for g in rnd] for rnd in groups]
        work = Workload("torchrun", ("-m", "workloads.sweep", *argv, "--rounds", format_rounds(plan)))
        cfg = dataclasses.replace(base, workload=work, job_id=f"{base.job_id}-{label}", runs_dir=parent)
        try:
            res = launch(cluster, cfg, handle_signals=False, stop=stop)
        except Interrupted:
            raise _SearchFailed("stopped before the sweep started", 128 + (received or [2])[0]) from None
        except UserError as e:
            raise _SearchFailed(f"the {label} sweep could not start: {e}", 1) from None
        if res.signal is not None or received:
            raise _SearchFailed("stopped", res.exit_code or 1)
        text = "".join(p.read_text(errors="replace") for p in sorted(res.run_dir.glob("node-*.log")))
        found = {tuple(hosts[i] for i in doc["nodes"]): _group_result(doc) for doc in group_documents(text)}
        wrong = [(g, r) for g, grp in found.items() for r in grp.wrong]
        for g, r in wrong:
            err.print(f"[red]{escape('+'.join(g))}: {r.collective} at {r.size} B: wrong results "
                      f"(out-of-place {r.oop_wrong}, in-place {r.ip_wrong})[/red]")
        if res.exit_code != 0:
            raise _SearchFailed(f"the {label} sweep failed ({res.exit_code}); see {res.run_dir}/node-*.log",
                                res.exit_code)
        missing = [g for rnd in groups for g in rnd if tuple(g) not in found]
        if missing:
            raise _SearchFailed(f"the {label} sweep printed no rows for {'+'.join(missing[0])}; "
                                f"see {res.run_dir}/node-*.log", 1)
        return found

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rounds = nccl_report.pair_schedule(hosts)
        for i, rnd in enumerate(rounds):
            err.print(f"[dim]round {i + 1}: {', '.join(f'{a}+{b}' for a, b in rnd)}[/dim]")
        err.print(f"[dim]one launch for all {len(rounds)} rounds; each size of a pair gets "
                  f"{budget:g} s (--pair-budget)[/dim]")
        pairs = run_plan([[list(p) for p in rnd] for rnd in rounds], "pairs")
        pair_bw: dict[tuple[str, str], float] = {(g[0], g[1]): r.busbw for g, r in pairs.items()}
        report = nccl_report.rank_nodes(pair_bw, o["threshold"])
        for (a, b), grp in sorted(pairs.items()):
            cut = (f"  ({grp.iters} of {o['iters']} timed calls fit --pair-budget {budget:g} s)"
                   if grp.iters is not None and grp.iters < o["iters"] else "")
            click.echo(f"pair {a} {b}: busbw {grp.busbw:.3f} GB/s{cut}")
        click.echo(f"median node score: {report.median:.3f} GB/s")
        suspects = report.bad
        if suspects and report.decisive:
            click.echo(f"every pair with {', '.join(suspects)} is below {o['threshold']:g} x the slowest "
                       "pair without; no confirming pass")
        elif suspects:
            try:
                clean, dirty = nccl_report.confirm_halves(hosts, suspects)
            except ValueError as e:
                err.print(f"[yellow]no confirming pass: {escape(str(e))}[/yellow]")
            else:
                halves = run_plan([[clean, dirty]], "halves")
                clean_bw, dirty_bw = halves[tuple(clean)].busbw, halves[tuple(dirty)].busbw
                click.echo(f"clean half {','.join(clean)}: {clean_bw:.3f} GB/s; "
                           f"suspect half {','.join(dirty)}: {dirty_bw:.3f} GB/s")
                confirmed = nccl_report.confirm_suspects(clean_bw, dirty_bw, suspects, o["threshold"])
                if not confirmed:
                    err.print("[yellow]the halves did not confirm the suspects; reporting the pair results[/yellow]")
        (parent / "pairs.tsv").write_text("".join(f"{a}\t{b}\t{bw}\n" for (a, b), bw in sorted(pair_bw.items())))
        if not suspects:
            click.echo(f"no node below {o['threshold']:g} x the median; nothing to exclude")
            return 0
        for line in report.lines:
            err.print(f"[red]{escape(line)}[/red]")
        click.echo(f"--exclude {report.exclude}")
        return 1
    except _SearchFailed as e:
        if received:
            err.print(f"[red]stopped on {signal.Signals(received[0]).name}; no verdict[/red]")
            return 128 + received[0]
        err.print(f"[red]error: {escape(str(e))}; no verdict[/red]")
        return e.code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
