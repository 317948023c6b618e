"""The run half of a detached job's node, which outlives its SSH session: its layout on the node
(the code that runs it is launcher.core.node_run's). Pure values.

An attached launch's node runs its workload under the SSH session itself (launcher.core.node_run):
end of input stops it at once, and nothing is written on the node. A detached job's controller may
die (its process killed, its VM rebooted) while the job trains, so on a detached job's node:

- a *supervisor* (launcher.core.node_run's `supervise`, in Python from the node's plan, in a
  session of its own) owns the workload. The workload's output goes to
  `out` in the run's directory on the node (`node_run_dir`, mode 700, under the home tree the jobs
  use), its exit status to `rc` when it ends. The supervisor's watcher stops every rank (the same
  SIGTERM, --term-grace, SIGKILL and STOP_REPORT lines as an attached stop) on a stop request, a
  Spot preemption notice, or when no controller has been attached for --controller-grace;
- the SSH session only *streams* `out` from a byte offset (node_run's `stream`, in Python too),
  holding a shared lock on `attached` while it is connected, and relays a stop: a `term TICKS SECONDS` line (what the
  controller writes before it closes the session on purpose: `launch stop`, a failed node,
  recovery) becomes the file `stop` and a SIGUSR1 to the watcher. End of input alone means the
  controller went away: the session detaches and the workers keep training;
- once the supervisor has ended, the stream prints what is left of `out`, then `EXIT_MARKER <rc>`,
  and removes the run's directory: its output has reached the controller;
- a controller started again (launcher.jobs.controller, adopting the job) runs node_run's
  `attach`: the same stream, from the offset it had read up to, so no line is lost or read twice.

The lock is flock(2)'s: a session killed with SIGKILL, or a connection cut, releases it with the
process, so the supervisor's test (an exclusive flock that fails while a session holds it, once a
second) needs no heartbeat.
"""

from __future__ import annotations

import shlex

__all__ = [
    "NODE_RUNS_DIR",
    "ORPHAN_STOP",
    "node_run_dir",
]

# Relative to the home directory of the account on the node.
NODE_RUNS_DIR = ".gpufleet/node-runs"
# Starts the supervisor's line when no controller came back in time (a STOP_REPORT line).
ORPHAN_STOP = "gpufleet-stop: no controller for"


def node_run_dir(job_id: str, attempt: int, rank: int) -> str:
    """The run's directory on the node, as bash (`$HOME` expands there): one per job, attempt
    and node rank, so a relaunch never reads an earlier attempt's output."""
    return f'"$HOME"/{NODE_RUNS_DIR}/{shlex.quote(job_id)}/{int(attempt)}.{int(rank)}'
