"""Assembling the program each node runs (the wire protocol it speaks: launcher.core.wire; the
ssh line that carries it: launcher.core.ssh; torchrun's argv: launcher.core.torchrun; its stop:
launcher.core.stop). Pure functions: no network, no processes.

Everything that crosses a shell goes through `shlex.quote`, so an argument such as
`"; rm -rf ~` reaches the program as one literal argument.

The remote side is one bash line (so `--dry-run` prints it on one line). It first exports the
launch's environment (resolving the host NIC on the node when the catalog cannot name it), so the
check sees what the run will; then come two halves, and one SSH session per node carries both:
1. the check: it prints what the launcher compares across nodes as `key=value` lines (hostname,
   clock, ready marker, torch version, --workdir), takes node 0's lock on the rendezvous port
   for a torchrun job (so a second launch on the same port refuses instead of joining the first
   one's store), prints `CHECKED_MARKER` and waits for one line on stdin. The launcher
   sends `go` only once every node has answered and passed; end of input instead (a node
   failed the check, or Ctrl-C) makes it exit without running anything. Every node is checked
   before any workload starts, but no node pays for a second session, and each node's
   handshake overlaps the others' instead of waiting behind a barrier;
2. the run: it starts the workload under `setsid` (its own session and process group)
   with a unique `GPUFLEET_RUN` token in its environment. A watchdog reads the rest of stdin:
   when the launcher closes it, or the SSH connection drops, or a Spot preemption notice comes
   (a watcher of the node's metadata server), it sends SIGTERM to the workload's process group
   and to every rank (torchrun starts workers in sessions of their own, so the group alone is
   not enough), waits up to --term-grace, then SIGKILLs every process that carries the token,
   and prints one STOP_REPORT line per rank: exited by itself, or killed. `EXIT_MARKER <status>`
   comes last, which tells a nonzero exit of the code apart from a lost connection (no marker).

Each fork on a node costs on every node of every launch, so the run half forks three times (the
workload, its watchdog, and on a cluster the preemption watcher) and writes no files.

A detached job's run half is another (`LaunchConfig.controller_grace_s` set): its workload must
outlive the controller's session, so a supervisor on the node owns it and its output goes to a
file the session streams (launcher.core.supervise). A stop is then a `term` line before the end of
input, never the end of input alone.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from gpufleet.contracts import LAUNCHER_ERROR_PREFIX, READY_MARKER
from gpufleet.nccl_env import PREPEND_PATH_VARS
from launcher.core import supervise
from launcher.core.env import HOST_IFACE_ON_NODE, job_env, node_env
from launcher.core.prestart import prestart_statements
from launcher.core.stop import preemption_watch, reap_function, stop_functions
from launcher.core.torchrun import nproc_for, torchrun_argv
from launcher.core.types import Cluster, LaunchConfig, Node
from launcher.core.wire import (
    CHECKED_MARKER,
    EXIT_MARKER,
    JOB_ID_VAR,
    NNODES_VAR,
    NODE_RANK_VAR,
    PREEMPTION_NOTICE,
    rdzv_lock_path,
    run_token,
)

__all__ = ["remote_script", "probe_script", "node_commands", "attach_commands"]


def _resolve_iface(address: str, head_address: str) -> str:
    # The interface that holds the address we reach this node at; failing that (we connected by
    # name), the interface the route to node 0 leaves through. `ip -o` prints one line per
    # address: "2: eth0    inet 10.0.0.2/24 ...".
    a, h = shlex.quote(address), shlex.quote(head_address)
    return (
        f"I=$(ip -o -4 addr show 2>/dev/null | awk -v a={a} "
        "'{split($4,p,\"/\"); if (p[1]==a) {print $2; exit}}'); "
        f'[ -n "$I" ] || I=$(ip -o route get {h} 2>/dev/null | '
        "sed -n 's/.* dev \\([^ ]*\\).*/\\1/p')"
    )


def _check_statements(config: LaunchConfig, facts: bool, torch: bool) -> list[str]:
    """`key=value` lines about the node: hostname, clock and ready marker (`facts`), the torch
    version (`torch`), and whether --workdir exists."""
    s = []
    if facts:
        s += [
            "echo host=$(hostname)",
            "echo time=$(date +%s.%N)",
            f"if [ -f {READY_MARKER} ]; then echo ready=yes; else echo ready=no; fi",
        ]
    if torch:
        # importlib.metadata reads the version without importing torch (seconds on a busy node).
        s.append(
            f"echo torch=$({shlex.quote(config.python)} -c 'import importlib.metadata as m; "
            "print(m.version(\"torch\"))' 2>/dev/null || echo missing)"
        )
    if config.workdir:
        s.append(f"if [ -d {_workdir(config.workdir)} ]; then echo workdir=ok; else echo workdir=missing; fi")
    return s


# A Spot VM gets 30 s between its preemption notice and its stop
# (https://cloud.google.com/compute/docs/instances/spot#preemption-process): a --term-grace above
# this leaves the ranks too little time after SIGTERM before the VM goes. The pre-start check asks
# a node that watches for the notice whether it is one only then.
SPOT_NOTICE_S = 30
SPOT_GRACE_MAX_S = 25.0


def _preemptible_statement() -> str:
    """`preemptible=TRUE|FALSE` from the node's metadata server (`instance/scheduling/preemptible`,
    https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys; TRUE on a Spot VM,
    whose scheduling sets preemptible), `unknown` without one."""
    url = '"http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1/instance/scheduling/preemptible"'
    return f"echo preemptible=$(curl -sf -m 2 -H 'Metadata-Flavor: Google' {url} || echo unknown)"


def _workdir(wd: str) -> str:
    # `~/x` means the login directory on the node, so keep the tilde outside the quotes.
    return ("~/" + shlex.quote(wd[2:])) if wd.startswith("~/") else shlex.quote(wd)


def remote_script(
    cluster: Cluster,
    node: Node,
    config: LaunchConfig,
    env: Mapping[str, str],
    argv: Sequence[str],
    lock_port: int | None = None,
    check: bool = False,
    check_torch: bool = False,
    watch_preemption: bool = False,
) -> str:
    """The one-line bash program that checks `node`, waits for `go`, then runs `argv` on it
    (see the module docstring). `check` adds the hostname, clock and ready-marker lines (and the
    torch version with `check_torch`) that a torchrun launch compares across nodes; `lock_port`
    takes the rendezvous-port lock (node 0 of a torchrun launch); `watch_preemption` starts the
    Spot preemption watcher (a Compute Engine node)."""
    job = config.job_id
    token = shlex.quote(run_token(job, node.rank))
    # The environment first: the check must see what the run will (`--env PATH=...`
    # decides which `python3` has torch), so it is exported before the check's lines.
    s = _env_statements(cluster, node, env)
    s += _check_statements(config, facts=check, torch=check and check_torch)
    if watch_preemption and config.stop_grace_s > SPOT_GRACE_MAX_S:
        s.append(_preemptible_statement())
    if check:  # the cheap part of `launch doctor`: GPUs and NICs, when the machine type is known
        s += prestart_statements(cluster, config.image_os)
    if lock_port is not None:
        lock = shlex.quote(rdzv_lock_path(node.address, lock_port))
        # Held from the check to the end of the run (torchrun inherits fd 9), so there is no
        # moment between "free" and "taken" for another launch to slip into. The file is
        # private (umask 077), and the user's own umask is back for the workload.
        s += [
            "O=$(umask)",
            "umask 077",
            f"exec 9>>{lock}",
            f"if flock -n 9; then echo {shlex.quote(job)} > {lock}.job; echo port=free; else "
            f"echo port=busy:$(cat {lock}.job 2>/dev/null); echo {CHECKED_MARKER}; exit 75; fi",
            'umask "$O"',
        ]
    s += [
        f"echo {CHECKED_MARKER}",
        # One line from the launcher: `go`, or end of input when it decided not to start.
        "IFS= read -r G || exit 0",
        '[ "$G" = go ] || exit 0',
    ]
    if config.workdir:
        wd = config.workdir
        # A line the launcher reads as this node's own error (gpufleet.contracts.is_error_line).
        s.append(
            f"cd {_workdir(wd)} || {{ echo \"{LAUNCHER_ERROR_PREFIX}--workdir {shlex.quote(wd)} does not "
            f"exist on {node.host}\" >&2; exit 71; }}"
        )
    s += [
        f"export {JOB_ID_VAR}={shlex.quote(job)} {NODE_RANK_VAR}={node.rank} {NNODES_VAR}={len(cluster.nodes)}",
        # Keep the launcher's end of stdin on fd 3 for the watchdog: a background list's stdin is
        # /dev/null in a non-interactive shell (POSIX, "Asynchronous Lists").
        "exec 3<&0",
    ]
    if config.controller_grace_s is not None:  # a detached job: the run outlives this session
        return _join(s + _supervised(node, config, token, argv, watch_preemption))
    s += [
        # The subshell is not a group leader (no job control here), so setsid runs in place and
        # $! is the new session's id; the token is exported only inside it.
        f"( export {token}; exec setsid -- {' '.join(shlex.quote(a) for a in argv)} ) </dev/null 3<&- 2>&1 &",
        "P=$!",
        reap_function(token),
        *stop_functions(token, config.stop_grace_s),
        # Once stopping, the watchdog ignores the SIGTERM below: the main shell then waits for it
        # to finish (its sleep would otherwise outlive it) instead of cutting it short. A line
        # `term TICKS SECONDS` before the end of input is the stop's own grace (`launch stop --grace`);
        # SIGUSR1 is the preemption watcher's notice: bash runs its trap between reads, not
        # during one, hence a read that times out every second to look.
        "( trap 'N=1' USR1; while :; do IFS= read -r -t 1 L; r=$?; if [ -n \"$N\" ]; then "
        f"echo \"{PREEMPTION_NOTICE} (instance/preempted is TRUE): SIGTERM to every rank, SIGKILL after $S s\"; "
        'break; fi; [ $r -gt 128 ] && continue; [ $r = 0 ] || break; case $L in "term "*) set -- $L; G=$2; S=$3;; '
        "esac; done; "
        "trap '' TERM; stop ) <&3 2>/dev/null &",
        "W=$!",
        *(preemption_watch() if watch_preemption else []),
        "exec 3<&-",
        "wait $P",
        "rc=$?",
        "kill $W 2>/dev/null",
        *(['kill -- -"$M" 2>/dev/null'] if watch_preemption else []),
        "wait $W",
        # After a clean exit torchrun has already waited for its workers; the scan of every
        # process's environment (costly with many processes, and run on every node) is for
        # failures, where children may be left behind. The stop path always scans.
        '[ "$rc" = 0 ] || reap',
        f"printf '{EXIT_MARKER} %d\\n' $rc",
        "exit $rc",
    ]
    return _join(s)


def _supervised(node: Node, config: LaunchConfig, token: str, argv: Sequence[str], watch_preemption: bool) -> list[str]:
    """A detached job's run half (launcher.core.supervise): a supervisor in a session of its own
    runs the workload and stops it (on a stop request, a preemption notice, or no controller for
    --controller-grace); this session streams its output from the start."""
    watch = preemption_watch("USR2") if watch_preemption else []
    sup = supervise.supervisor_script(
        token,
        list(argv),
        int(config.controller_grace_s or 0),
        [reap_function(token), *stop_functions(token, config.stop_grace_s)],
        watch,
        PREEMPTION_NOTICE + " (instance/preempted is TRUE)",
    )
    run_dir = supervise.node_run_dir(config.job_id, config.attempt, node.rank)
    return [*supervise.start_statements(run_dir, sup), "OFF=0", *supervise.stream_statements(EXIT_MARKER)]


def attach_commands(cluster: Cluster, config: LaunchConfig, offsets: Mapping[int, int]) -> dict[int, str]:
    """A re-adopting controller's program for every node, by rank: stream the detached run's
    output from `offsets[rank]` bytes on (launcher.core.supervise.attach_script)."""
    return {
        n.rank: supervise.attach_script(
            config.job_id, config.attempt, n.rank, offsets.get(n.rank, 0), CHECKED_MARKER, EXIT_MARKER
        )
        for n in cluster.nodes
    }


def _env_statements(cluster: Cluster, node: Node, env: Mapping[str, str]) -> list[str]:
    """`export` lines for `env`; PATH-like variables are prepended to the node's value, and a
    HOST_IFACE_ON_NODE value is resolved on the node."""
    s = []
    unresolved = [k for k, v in env.items() if v == HOST_IFACE_ON_NODE]
    for key, value in env.items():
        if value == HOST_IFACE_ON_NODE:
            continue
        if key in PREPEND_PATH_VARS:
            s.append(f"export {key}={shlex.quote(value)}${{{key}:+:${key}}}")
        else:
            s.append(f"export {key}={shlex.quote(value)}")
    if unresolved:
        s.append(_resolve_iface(node.address, cluster.nodes[0].address))
        s.append('if [ -n "$I" ]; then export ' + " ".join(f'{k}="$I"' for k in unresolved) + "; fi")
    return s


_join = supervise.join


def probe_script(config: LaunchConfig, check_torch: bool, extra: Sequence[str] = ()) -> str:
    """`launch hosts`' program: the check lines (and `extra` statements that print `key=value`
    lines) and CHECKED_MARKER, then it waits for end of input, as a launch's node does before `go`."""
    return _join(
        [
            *_check_statements(config, facts=True, torch=check_torch),
            *extra,
            f"echo {CHECKED_MARKER}",
            "IFS= read -r G",
            "exit 0",
        ]
    )


def node_commands(cluster: Cluster, config: LaunchConfig) -> dict[int, str]:
    """The node-side program for every node, by rank (what --dry-run prints)."""
    wl = config.workload
    torchrun = wl.kind == "torchrun"
    # A plain command gets only the user's --env; the NCCL profile is for torchrun workloads.
    env = node_env(cluster, config) if torchrun else {**job_env(config), **dict(config.env)}
    gpus = cluster.gpus_per_node
    out = {}
    for node in cluster.nodes:
        if torchrun:
            argv = torchrun_argv(cluster, node, config, nproc_for(node, gpus, config), wl.argv)
            lock = config.rdzv_port if node.rank == 0 else None
        else:
            argv, lock = list(wl.argv), None
        out[node.rank] = remote_script(
            cluster,
            node,
            config,
            env,
            argv,
            lock_port=lock,
            check=torchrun,
            check_torch=torchrun and config.check_versions,
            watch_preemption=not cluster.local,
        )
    return out
