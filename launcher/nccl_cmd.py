"""`launch nccl-tests`: fan the collective sweep out, then judge and store rank 0's rows.

Two implementations: `--impl torch` (default) runs `workloads.sweep` under torchrun on every
node; `--impl nccl-tests` runs NVIDIA's binaries with mpirun from node 0. `--find-bad-nodes`
sweeps every pair of nodes (disjoint pairs at once), ranks nodes by their pairs' bandwidth,
confirms with a suspect half against a clean half, and prints an `--exclude` list.
Parsing, judging, plots and the pair schedule live in `launcher.nccl_report` (pure).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from gpufleet.catalog import lookup
from infra.contract import NCCL_TESTS_DIR
from launcher import nccl_report
from launcher.cli import (
    _SOURCE_OPTIONS,
    _TORCHRUN_OPTIONS,
    _apply,
    _setup_logging,
    _user_errors,
    build_config,
    err,
    execute_on,
    find_cluster,
)
from launcher.command import nproc_for
from launcher.env import node_env
from launcher.model import Cluster, LaunchConfig, LaunchResult, UserError, Workload
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
    if mt:
        for line in nccl_report.expected_report(rows, mt, nranks, nnodes):
            err.print(f"[yellow]{escape(line)}[/yellow]")
    code = 0
    wrong = nccl_report.failures(rows)
    for r in wrong:
        err.print(f"[red]{r.collective} at {r.size} B: wrong results (out-of-place {r.oop_wrong}, "
                  f"in-place {r.ip_wrong})[/red]")
        code = 1
    if o.get("min_busbw") is not None and avg < o["min_busbw"]:
        err.print(f"[red]average bus bandwidth {avg:.3g} GB/s is below --min-busbw {o['min_busbw']:g}[/red]")
        code = 1
    return code


@click.command(name="nccl-tests")
@_apply(_SOURCE_OPTIONS + _TORCHRUN_OPTIONS + _SWEEP_OPTIONS)
@_user_errors
def nccl_tests(**o: Any) -> None:
    """Measure collective bandwidth across the nodes (an nccl-tests style sweep)."""
    o["env"] = _extra_env(o)
    if o["find_bad_nodes"]:
        raise SystemExit(_find_bad_nodes(o))
    if o["impl"] == "nccl-tests":
        raise SystemExit(_run_nccl_tests_binary(o))
    _setup_logging()
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
    _setup_logging()
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


class _PairFailed(Exception):
    """A sweep of --find-bad-nodes did not give a number: the search ends with `code`."""

    def __init__(self, message: str, code: int, stopped: bool = False):
        super().__init__(message)
        self.code = code
        self.stopped = stopped  # stopped by the launcher (a signal, or another pair's failure)


def _find_bad_nodes(o: dict[str, Any]) -> int:
    """Pairs, a round of disjoint pairs at a time; then halves to confirm."""
    _setup_logging()
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
    base = build_config(o, Workload("torchrun", ("-m", "workloads.sweep", *sweep_argv(o))), cluster)
    parent = base.run_dir
    by_host = {n.host: n for n in cluster.nodes}
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        received.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    counter = iter(range(1 << 20))

    def sweep(hosts: list[str], label: str) -> float:
        sub = dataclasses.replace(cluster, nodes=tuple(
            dataclasses.replace(by_host[h], rank=i) for i, h in enumerate(hosts)))
        idx = next(counter)
        cfg = dataclasses.replace(base, job_id=f"{base.job_id}-{label}", runs_dir=parent,
                                  rdzv_port=base.rdzv_port + idx % 100)
        where = f"the sweep on {', '.join(hosts)}"
        try:
            res = launch(sub, cfg, handle_signals=False, stop=stop)
        except Interrupted:
            raise _PairFailed(f"{where} was stopped before it started", 1, stopped=True) from None
        except UserError as e:
            stop.set()  # the search cannot finish: stop the other pairs of the round
            raise _PairFailed(f"{where} could not start: {e}", 1) from None
        if res.signal is not None:
            raise _PairFailed(f"{where} was stopped", res.exit_code, stopped=True)
        if res.exit_code != 0:
            stop.set()
            raise _PairFailed(f"{where} failed ({res.exit_code}); see {res.run_dir}/node-*.log", res.exit_code)
        rows = rank0_rows(res, _nranks(sub, cfg))
        if not rows:
            stop.set()
            raise _PairFailed(f"{where} printed no rows; see {res.run_dir}/node-*.log", 1)
        largest = max(r.size for r in rows)
        return max(r.best_busbw for r in rows if r.size == largest)

    def gather(futs: dict) -> dict:
        """Each future's result; on a failure, exit with the pair that failed (not one the
        launcher stopped because of it), or with the signal that stopped the search."""
        done, failed = {}, []
        for key, fut in futs.items():
            try:
                done[key] = fut.result()
            except _PairFailed as e:
                failed.append(e)
        if received:
            err.print(f"[red]stopped on {signal.Signals(received[0]).name}; no verdict[/red]")
            raise SystemExit(128 + received[0])
        if failed:
            first = next((e for e in failed if not e.stopped), failed[0])
            err.print(f"[red]error: {escape(str(first))}; no verdict[/red]")
            raise SystemExit(first.code)
        return done

    try:
        hosts = [n.host for n in cluster.nodes]
        pair_bw: dict[tuple[str, str], float] = {}
        for i, rnd in enumerate(nccl_report.pair_schedule(hosts)):
            err.print(f"[dim]round {i + 1}: {', '.join(f'{a}+{b}' for a, b in rnd)}[/dim]")
            with ThreadPoolExecutor(max_workers=len(rnd)) as pool:
                pair_bw.update(gather({pair: pool.submit(sweep, list(pair), f"pair-{pair[0]}-{pair[1]}")
                                       for pair in rnd}))
        report = nccl_report.rank_nodes(pair_bw, o["threshold"])
        for (a, b), bw in sorted(pair_bw.items()):
            click.echo(f"pair {a} {b}: busbw {bw:.3f} GB/s")
        click.echo(f"median node score: {report.median:.3f} GB/s")
        suspects = report.bad
        if suspects:
            try:
                clean, dirty = nccl_report.confirm_halves(hosts, suspects)
            except ValueError as e:
                err.print(f"[yellow]no confirming pass: {escape(str(e))}[/yellow]")
            else:
                with ThreadPoolExecutor(max_workers=2) as pool:
                    halves = gather({"clean": pool.submit(sweep, clean, "clean-half"),
                                     "dirty": pool.submit(sweep, dirty, "suspect-half")})
                clean_bw, dirty_bw = halves["clean"], halves["dirty"]
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
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
