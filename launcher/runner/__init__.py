"""Between the CLI and the core: a launch's plan (torchx's runner/api.py `dryrun()` returns what
`schedule()` runs). `plan(cluster, config)` decides everything a launch does before it connects
to run anything: the rank order, the checks and each node's program, rendered once; the attached
run (launcher.cli.render.execute) and the detach (launcher.jobs.handoff.detach) take the plan,
and `--dry-run` prints it (launcher.runner.dry_run: a block per node to read, or the typed plans
as JSON), so a dry run never connects."""

from __future__ import annotations

from launcher.runner import dry_run
from launcher.runner.plan import LaunchPlan, plan, plan_detached

__all__ = ["LaunchPlan", "dry_run", "plan", "plan_detached"]
