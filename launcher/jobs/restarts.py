"""Relaunching a user's own program (`launch run|exec --detach --recover`): why an attempt ended,
and whether the policy allows another.

The program resumes from its own checkpoint; gpufleet's side of the contract is the environment
every rank gets (launcher.core.env.job_env): GPUFLEET_JOB_ID (the same on every attempt),
GPUFLEET_ATTEMPT (0, 1, ...) and GPUFLEET_RESTART_REASON, one of `REASONS`:

- node-lost: a node became unreachable (no preemption notice came first);
- preempted: a node's metadata server said `instance/preempted` TRUE (launcher.core.node_run's
  watch printed PREEMPTION_NOTICE), or the built-in workload saved and exited on a SIGTERM;
- worker-failed: the program exited nonzero on some rank;
- hang: the launch's hang detector (launcher.hang) stopped the attempt for want of progress
  (`LaunchResult.hang`).

Budgets: node-lost and preempted are the cluster's doing, bounded by --max-recoveries (3) and
--recover-timeout; worker-failed and hang are the program's, bounded by --max-restarts (0 unless
given); a worker exit status in --no-restart-exit-codes (2: a usage error) is never restarted.
The built-in workload (`launch train`) keeps its own rule (launcher.jobs.recovery): every recovery
counts against --max-recoveries, and --max-restarts stays torchrun's in-place restarts.

Pure functions: the controller (launcher.jobs.recovery.Recoverer) does the waiting and relaunching.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from launcher.core.types import LaunchResult, UserError

__all__ = [
    "REASONS",
    "NODE_REASONS",
    "PROGRAM_REASONS",
    "DEFAULT_NO_RESTART_EXIT_CODES",
    "parse_exit_codes",
    "worker_exit_codes",
    "program_error_line",
    "restart_refusal",
]

REASONS = ("node-lost", "preempted", "worker-failed", "hang")
NODE_REASONS = ("node-lost", "preempted")  # bounded by --max-recoveries
PROGRAM_REASONS = ("worker-failed", "hang")  # bounded by --max-restarts
DEFAULT_NO_RESTART_EXIT_CODES = (2,)  # a usage error: the same arguments fail the same way again

# torchrun's failure summary (torch/distributed/elastic/multiprocessing/errors: `exitcode  : 2
# (pid: 123)`) and its agent's ERROR line (`failed (exitcode: 2) local_rank: 0 (pid: 123)`).
_EXITCODE_RE = re.compile(r"(?:^\s*exitcode\s*:\s*|failed \(exitcode: )(-?\d+)")


def parse_exit_codes(text: str) -> tuple[int, ...]:
    """`--no-restart-exit-codes 2,3` as exit statuses, each 0..255."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not re.fullmatch(r"\d{1,3}", part) or int(part) > 255:
            raise UserError(
                f"--no-restart-exit-codes {text!r}: {part!r} is not an exit status (0..255); "
                "give a comma-separated list like 2,3"
            )
        out.append(int(part))
    return tuple(sorted(set(out)))


def worker_exit_codes(result: LaunchResult, torchrun: bool) -> list[int]:
    """The exit statuses the program itself ended with, on the nodes that failed: the worker
    failure torchrun reported (a worker killed by signal N: 128 + N), else what its summary says
    (`exitcode  : 2`); a plain command's is the node's."""
    codes: list[int] = []
    for o in result.outcomes.values():
        if o.ok or o.connection_lost or o.exit_code is None:
            continue
        worker = getattr(o, "worker", None)  # the failure torchrun reported (launcher.core.types.WorkerFailure)
        if torchrun and worker is not None:
            codes.append(worker.status)
            continue
        found = [int(m.group(1)) for line in o.tail for m in [_EXITCODE_RE.search(line)] if m]
        codes += found if torchrun else [o.exit_code]
    return sorted(set(codes))


# The last line of a Python traceback: `ValueError: ...`, `module.SomeError: ...`.
_EXCEPTION_RE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*")


def program_error_line(result: LaunchResult) -> str:
    """What the program said went wrong, in its own words: the last exception line of a Python
    traceback on the first failed node, else "". torchrun's failure summary follows the
    traceback and can push it out of the outcome's tail, so the node's log of the run is read
    too (its end: the latest attempt's output comes last)."""
    order = [result.first_failure] if result.first_failure is not None else []
    order += [r for r in sorted(result.outcomes) if r not in order]
    for rank in order:
        o = result.outcomes[rank]
        if o.ok:
            continue
        said = _exception_lines(o.tail) or _exception_lines(_log_tail(result.run_dir / f"node-{rank}.log"))
        if said:
            return said[-1]
    return ""


def _exception_lines(lines: Iterable[str]) -> list[str]:
    said = [line.strip() for line in lines if _EXCEPTION_RE.match(line.strip())]
    return [line for line in said if not line.startswith("torch.distributed.elastic")]


def _log_tail(path: Path, nbytes: int = 65536) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - nbytes))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def restart_refusal(
    reason: str, exit_codes: Iterable[int], done: list[dict[str, Any]], policy: Any, extra: str = ""
) -> str:
    """Why the policy (a launcher.jobs.recovery.RecoverPolicy with max_restarts set) does not allow
    another attempt after one that ended for `reason`, given the recoveries `done` so far
    (their record entries); "" when it does."""
    if reason in PROGRAM_REASONS:
        blocked = [c for c in exit_codes if c in policy.no_restart_exit_codes]
        if reason == "worker-failed" and blocked:
            listed = ",".join(str(c) for c in policy.no_restart_exit_codes)
            return f"exit {blocked[0]} is in --no-restart-exit-codes {listed}: not restarted"
        n = sum(1 for d in done if d.get("reason") in PROGRAM_REASONS)
        if n >= policy.max_restarts:
            if policy.max_restarts == 0:
                return "not restarted (--max-restarts 0; give --max-restarts N to restart a failed program)"
            return f"gave up after {n} restart{'s' * (n != 1)} (--max-restarts {policy.max_restarts})"
        return ""
    n = sum(1 for d in done if d.get("reason") in NODE_REASONS)
    if n >= policy.max_recoveries:
        return f"gave up after {n} recoveries (--max-recoveries {policy.max_recoveries})"
    return ""
