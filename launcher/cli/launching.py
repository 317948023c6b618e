"""What train, run and exec share: plan the launch (launcher.runner.plan) and run it attached
through the one attached path (launcher.cli.render.execute), or with --detach hand the job to
its controller (on the controller host, else node 0)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from launcher.cli.code_options import code_request, prepare_nodes
from launcher.cli.options import build_config, find_cluster, recover_request, tree_fanout
from launcher.cli.render import execute, finish, setup_logging
from launcher.cli.waiting import waiting
from launcher.core.output import default_output
from launcher.core.types import Cluster, LaunchConfig, LaunchResult, Workload
from launcher.runner import plan

__all__ = ["start", "WorkloadCheck"]

# Checks a workload's arguments against the nodes and ranks a launch will start (UserError if not).
WorkloadCheck = Callable[[Cluster, LaunchConfig], None]


def start(o: dict[str, Any], workload: Workload, check: WorkloadCheck | None = None, builtin: bool = False) -> None:
    """Run attached (the live stream, then the summary), or with --detach hand off to the controller host
    (node 0 where the cluster has none).
    `builtin`: the built-in workload (launch train), recovered with --resume, whose ranks import
    gpufleet's own code (sent to the nodes, with its environment: launcher.cli.code_options)."""
    keys = (
        "recover",
        "max_recoveries",
        "recover_timeout",
        "restart_stopped",
        "min_nodes",
        "no_restart_exit_codes",
        "spares",
    )
    given = [k for k in keys if o.get(k) is not None]
    if not o.get("detach") and [k for k in given if o[k] is not False or k == "restart_stopped"]:
        from launcher.jobs.recovery import recover_policy

        recover_policy(
            recover_request(o), workload.argv, detach=False, builtin=builtin
        )  # refuses: --recover lives in the detached controller
    if o.get("controller_grace") is not None and not o.get("detach"):
        from launcher.core.types import UserError

        raise UserError("--controller-grace is for a detached job's controller; add --detach or drop it")
    if o.get("output") and o.get("detach"):
        from launcher.core.types import UserError

        raise UserError(
            "--output is for an attached launch: a detached job keeps every node's lines in its log "
            "(`launch logs JOB_ID`); drop --output"
        )
    _check_fanout(o)
    if o.pop("detach", False):
        from launcher.cli.detached import start_detached  # loaded only when asked for

        start_detached(o, workload, check, builtin=builtin)
    else:
        finish(_attached(o, workload, check, builtin))


def _attached(o: dict[str, Any], workload: Workload, check: WorkloadCheck | None, builtin: bool) -> LaunchResult | None:
    """The nodes and the config from the flags, the workload's arguments checked against them,
    the nodes prepared (code, --sync, the environment: launcher.code), then the plan, run on the
    one attached path (render.execute)."""
    setup_logging()
    cluster = find_cluster(o)
    output = o.get("output") or default_output(len(cluster.nodes))
    fanout = tree_fanout(o.get("fanout"), cluster)
    # Down a tree, the nodes not shown live keep their output on the node (launch_tree.keep_specs).
    config = replace(build_config(o, workload, cluster), fanout=fanout, output=output if fanout else None)
    if check is not None:
        check(cluster, config)
    config = prepare_nodes(cluster, config, code_request(o, cluster, builtin))
    p = plan(cluster, config)
    return waiting(lambda: execute(p, o.get("dry_run") or "text", output), o.get("wait_nodes", False))


def _check_fanout(o: dict[str, Any]) -> None:
    """--fanout K|off, read into o["fanout"] (an int, or "off"): K at least 1, and an int only on
    SSH nodes (one line, exit 2, otherwise)."""
    from launcher.core.types import UserError

    given = o.get("fanout")
    if given is None or given == "off":
        return
    try:
        k = int(given)
    except ValueError:
        raise UserError(
            f"--fanout {given!r}: give how many nodes each node passes the launch on to (4 is usual), or off"
        ) from None
    if k < 1:
        raise UserError(
            f"--fanout {k}: each node passes the launch on to K others, so K must be at least 1 (4 is usual)"
        )
    if o.get("local"):
        raise UserError(
            "--fanout passes the launch from node to node over ssh; --local runs every node here: drop --fanout"
        )
    o["fanout"] = k
