"""The stop protocol on a node, as bash: how a run's workload is started so that its processes can
be found (its own session, the run token in its environment), stopped (SIGTERM to the workload's
group and every rank, a grace, SIGKILL to what is left, one STOP_REPORT line per rank) and reaped;
the Spot preemption watcher that starts a stop; and the tail every run ends with. Pure functions:
they build bash statements, they run nothing. A detached job's supervisor
(launcher.core.supervise) starts, stops and ends its workload with these statements; the attached
run does the same in Python (launcher.core.node_run), the step toward the node agent running every
part of a node's plan (docs/design-node-program.md)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from launcher.core.wire import PREEMPTION_NOTICE, STOP_REPORT, stop_ticks

__all__ = ["reap_function", "stop_functions", "preemption_watch", "workload_head", "workload_tail", "PREEMPTED_ECHO"]

# What the watchdog (or a detached job's watcher) prints when the preemption watcher tells it.
PREEMPTED_ECHO = f'echo "{PREEMPTION_NOTICE} (instance/preempted is TRUE): SIGTERM to every rank, SIGKILL after $S s"'


def workload_head(token: str, argv: Sequence[str], grace_s: float, redirects: str) -> list[str]:
    """Start `argv` under setsid with `token` (quoted) in its environment, leaving `$P` its
    session's id, then define `reap`, `ranks`, `gone` and `stop` (with the grace `grace_s`).
    `redirects`: the workload's own (its stdin is never the launcher's)."""
    return [
        # The subshell is not a group leader (no job control here), so setsid runs in place and
        # $! is the new session's id; the token is exported only inside it.
        f"( export {token}; exec setsid -- {' '.join(shlex.quote(a) for a in argv)} ) {redirects} &",
        "P=$!",
        reap_function(token),
        *stop_functions(token, grace_s),
    ]


def workload_tail(watch_preemption: bool) -> list[str]:
    """Wait for the workload (`$P`), leaving its status in `$rc`; end the watchdog (`$W`) and
    the preemption watcher (`$M`, when there is one); reap what a failure left behind."""
    return [
        "wait $P",
        "rc=$?",
        "kill $W 2>/dev/null",
        *(['kill -- -"$M" 2>/dev/null'] if watch_preemption else []),
        "wait $W",
        # After a clean exit torchrun has already waited for its workers; the scan of every
        # process's environment (costly with many processes, and run on every node) is for
        # failures, where children may be left behind. The stop path always scans.
        '[ "$rc" = 0 ] || reap',
    ]


def reap_function(token: str) -> str:
    """`reap`: kill every process carrying `token` (quoted): one grep over all environ files."""
    return (
        f"reap() {{ for f in $(grep -lzx {token} /proc/[0-9]*/environ 2>/dev/null); do "
        "q=${f#/proc/}; kill -KILL ${q%/environ} 2>/dev/null; done; }"
    )


def stop_functions(token: str, grace_s: float) -> list[str]:
    """`stop`: SIGTERM to the workload's process group and to every rank at once (torchrun's
    workers run in sessions of their own, so the group alone does not reach them), up to G ticks
    for all of them to exit, then SIGKILL to what is left; one STOP_REPORT line per rank says
    which exited by itself and which was killed (a plain command has no ranks: no lines). A rank
    is a process with the job's token whose environment has torchrun's RANK and whose parent has
    none (a data-loader child inherits it)."""
    return [
        f"G={stop_ticks(grace_s)}; S={grace_s:g}",
        f"ranks() {{ for f in $(grep -lzx {token} /proc/[0-9]*/environ 2>/dev/null); do q=${{f#/proc/}}; "
        "q=${q%/environ}; r=$(grep -az '^RANK=[0-9]*$' \"$f\" 2>/dev/null | tr -d '\\0'); [ -n \"$r\" ] && "
        "echo \"$q $(sed 's/.*) //' /proc/$q/stat 2>/dev/null | cut -d' ' -f2) ${r#RANK=}\"; done | "
        "awk '{p[$1]=1; l[NR]=$0} END {for (i=1;i<=NR;i++) {split(l[i],a,\" \"); if (!(a[2] in p)) "
        "print a[1] \":\" a[3]}}'; }",
        "gone() { s=$(sed 's/.*) //' /proc/$1/stat 2>/dev/null) || return 0; [ \"${s%% *}\" = Z ]; }",
        "stop() { R=$(ranks); kill -TERM -- -$P 2>/dev/null; for e in $R; do kill -TERM ${e%%:*} 2>/dev/null; done; "
        "i=0; while [ $i -lt $G ]; do u=0; kill -0 -- -$P 2>/dev/null && u=1; for e in $R; do gone ${e%%:*} || u=1; "
        "done; [ $u = 1 ] || break; sleep 0.2; i=$((i+1)); done; "
        "for e in $R; do q=${e%%:*}; if gone $q; then "
        f'echo "{STOP_REPORT} rank ${{e#*:}} (pid $q) exited by itself after SIGTERM"; else kill -KILL $q 2>/dev/null; '
        f'echo "{STOP_REPORT} rank ${{e#*:}} (pid $q) killed: still running $S s after SIGTERM"; fi; done; reap; }}',
    ]


def preemption_watch(signal: str = "USR1") -> list[str]:
    """A Spot VM's preemption notice, from its metadata server: `instance/preempted` turns TRUE
    when Compute Engine sends the guest its ACPI soft-off, 30 s before the VM stops
    (https://cloud.google.com/compute/docs/instances/spot#detecting_if_a_vm_was_preempted; the
    hanging GET with `wait_for_change=true`:
    https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange). It tells
    the watchdog (SIGUSR1; a detached job's supervisor, `signal`), which stops every rank with the
    grace. Each hanging GET gives up after
    10 s (`timeout_sec`), so a change between two of them is seen at most that late.
    GCE_METADATA_HOST (the
    variable google-auth reads) names another server; without a metadata server the first GET
    fails and the watcher ends. Its own session, so the main shell ends it and its curl at once."""
    watch = (
        'u="http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1/instance/preempted"; '
        'h="Metadata-Flavor: Google"; v=$(curl -sf -m 5 -H "$h" "$u") || exit 0; '
        'while [ "$v" != TRUE ]; do v=$(curl -sf -m 20 -H "$h" "$u?wait_for_change=true&timeout_sec=10") || exit 0; '
        f'done; kill -{signal} "$1"'
    )
    return [
        f"( exec setsid -- bash --norc --noprofile -c {shlex.quote(watch)} watch $W ) </dev/null >/dev/null 2>&1 &",
        "M=$!",
    ]
