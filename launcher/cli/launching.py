"""What train, run and exec share: plan the launch (launcher.runner.plan) and run it attached
through the one attached path (launcher.cli.render.execute), or with --detach hand the job to
node 0's controller."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from launcher.cli.options import build_config, find_cluster, recover_request
from launcher.cli.render import execute, finish, setup_logging
from launcher.core.types import Cluster, LaunchConfig, LaunchResult, Workload
from launcher.runner import plan

__all__ = ["start", "WorkloadCheck"]

# Checks a workload's arguments against the nodes and ranks a launch will start (UserError if not).
WorkloadCheck = Callable[[Cluster, LaunchConfig], None]


def start(o: dict[str, Any], workload: Workload, check: WorkloadCheck | None = None, builtin: bool = False) -> None:
    """Run attached (the live stream, then the summary), or with --detach hand off to node 0.
    `builtin`: the built-in workload (launch train), recovered with --resume."""
    keys = ("recover", "max_recoveries", "recover_timeout", "restart_stopped", "min_nodes", "no_restart_exit_codes")
    given = [k for k in keys if o.get(k) is not None]
    if not o.get("detach") and [k for k in given if o[k] is not False or k == "restart_stopped"]:
        from launcher.jobs.recovery import recover_policy

        recover_policy(
            recover_request(o), workload.argv, detach=False, builtin=builtin
        )  # refuses: --recover lives on node 0
    if o.get("controller_grace") is not None and not o.get("detach"):
        from launcher.core.types import UserError

        raise UserError("--controller-grace is for a detached job's controller; add --detach or drop it")
    if o.pop("detach", False):
        from launcher.cli.detached import start_detached  # loaded only when asked for

        start_detached(o, workload, check, builtin=builtin)
    else:
        finish(_attached(o, workload, check))


def _attached(o: dict[str, Any], workload: Workload, check: WorkloadCheck | None) -> LaunchResult | None:
    """The nodes and the config from the flags, the workload's arguments checked against them,
    then the plan, run on the one attached path (render.execute)."""
    setup_logging()
    cluster = find_cluster(o)
    config = build_config(o, workload, cluster)
    if check is not None:
        check(cluster, config)
    return execute(plan(cluster, config))
