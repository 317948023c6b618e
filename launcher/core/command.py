"""Building the command each node runs. Pure functions: no network, no processes.

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
from launcher.core.types import Cluster, LaunchConfig, Node, SshConfig

__all__ = [
    "EXIT_MARKER",
    "STOP_REPORT",
    "PREEMPTION_NOTICE",
    "grace_line",
    "stop_ticks",
    "CHECKED_MARKER",
    "join_timeout_s",
    "nproc_for",
    "torchrun_argv",
    "remote_script",
    "remote_command",
    "ssh_base_argv",
    "ssh_argv",
    "probe_script",
    "rdzv_lock_path",
    "node_commands",
    "attach_commands",
    "run_token",
]

EXIT_MARKER = "__GPUFLEET_EXIT__"
# Starts the watchdog's lines about a stop (never an error line: gpufleet.contracts.is_error_line).
STOP_REPORT = "gpufleet-stop:"
PREEMPTION_NOTICE = f"{STOP_REPORT} preemption notice"
# The check half is done; the node waits for `go`.
CHECKED_MARKER = "__GPUFLEET_CHECKED__"


def rdzv_lock_path(address: str, port: int) -> str:
    # Keyed by address too: nodes that share a /tmp (the simulated cluster, --local) but not a
    # network namespace can each hold the same port.
    return f"/tmp/gpufleet-rdzv-{address}-{port}.lock"


def run_token(job_id: str, node_rank: int) -> str:
    """`GPUFLEET_RUN=<job>-<node>`: in the environment of every process the run half starts on
    node `node_rank` (how the watchdog, and launcher.core.stacks, find them)."""
    return f"GPUFLEET_RUN={job_id}-{node_rank}"


def join_timeout_s(nnodes: int) -> int:
    """Rendezvous timeout: torch's default 600 s for small jobs, plus 5 s per node beyond 64, since
    the last node to boot and connect arrives later on a big cluster."""
    return 600 + 5 * max(0, nnodes - 64)


def nproc_for(node: Node, gpu_count: int | None, config: LaunchConfig) -> int:
    """--nproc-per-node, else the hostfile's slots, else the catalog's GPU count, else 1 (CPU)."""
    if config.nproc_per_node is not None:
        return config.nproc_per_node
    if node.slots is not None:
        return node.slots
    return gpu_count or 1


def torchrun_argv(
    cluster: Cluster, node: Node, config: LaunchConfig, nproc: int, workload_argv: Sequence[str]
) -> list[str]:
    """`python -m torch.distributed.run ...` for one node, with a static rendezvous on node 0:
    the node's group rank is its rank in the cluster's order, so RANK 0 runs on node 0."""
    head = cluster.nodes[0]
    n = len(cluster.nodes)
    # IPv6 in brackets, as torchrun's --master-addr help asks (torch/distributed/run.py).
    master = f"[{head.address}]" if ":" in head.address else head.address
    if config.max_restarts > 0:
        # torchrun's in-place restarts need the c10d rendezvous: under a static one each agent
        # restarts on its own count (static_tcp_rendezvous.py has no rounds, num_nodes_waiting is
        # always 0), so two nodes that restart a different number of times wait on different
        # stores for ever. c10d assigns the group ranks itself (the order line says so).
        rendezvous = [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master}:{config.rdzv_port}",
            f"--rdzv-id={config.job_id}",
            # is_host: node 0 hosts the store (torch's guess from hostnames fails in namespaces).
            f"--rdzv-conf=join_timeout={join_timeout_s(n)},is_host={1 if node.rank == 0 else 0}",
        ]
    else:
        # A static rendezvous (torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py):
        # the group rank is --node-rank and node 0 hosts the TCPStore on --master-port. A c10d
        # rendezvous would assign group ranks by sorting the nodes' addresses
        # (dynamic_rendezvous.py, `_mark_rendezvous_complete`), throwing the order away.
        rendezvous = [
            "--rdzv-backend=static",
            f"--master-addr={master}",
            f"--master-port={config.rdzv_port}",
            f"--node-rank={node.rank}",
            f"--rdzv-id={config.job_id}",
            # How long the store waits for every node (the static handler's `timeout`).
            f"--rdzv-conf=timeout={join_timeout_s(n)}",
        ]
    return [
        config.python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={n}",
        f"--nproc-per-node={nproc}",
        *rendezvous,
        # The address the other nodes reach this one at. Left out, torch uses socket.getfqdn(),
        # which on a node whose /etc/hosts maps its hostname to 127.0.0.1 is "localhost".
        f"--local-addr={node.address}",
        f"--max-restarts={config.max_restarts}",
        *workload_argv,
    ]


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
        f"export GPUFLEET_JOB_ID={shlex.quote(job)} GPUFLEET_NODE_RANK={node.rank} "
        f"GPUFLEET_NNODES={len(cluster.nodes)}",
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
        _reap(token),
        *_stop_statements(token, config.stop_grace_s),
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
        *(_preemption_watch() if watch_preemption else []),
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


def _reap(token: str) -> str:
    # Kill every process carrying the token: one grep over all environ files.
    return (
        f"reap() {{ for f in $(grep -lzx {token} /proc/[0-9]*/environ 2>/dev/null); do "
        "q=${f#/proc/}; kill -KILL ${q%/environ} 2>/dev/null; done; }"
    )


def _supervised(node: Node, config: LaunchConfig, token: str, argv: Sequence[str], watch_preemption: bool) -> list[str]:
    """A detached job's run half (launcher.core.supervise): a supervisor in a session of its own
    runs the workload and stops it (on a stop request, a preemption notice, or no controller for
    --controller-grace); this session streams its output from the start."""
    watch = _preemption_watch("USR2") if watch_preemption else []
    sup = supervise.supervisor_script(
        token,
        list(argv),
        int(config.controller_grace_s or 0),
        [_reap(token), *_stop_statements(token, config.stop_grace_s)],
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


def grace_line(grace_s: float) -> bytes:
    """What the launcher writes to a node before closing its stdin, for a stop whose grace is
    `grace_s` rather than the launch's --term-grace (the watchdog reads it)."""
    return f"term {stop_ticks(grace_s)} {grace_s:g}\n".encode()


def stop_ticks(grace_s: float) -> int:
    """The watchdog's ticks in a grace of `grace_s`."""
    return max(1, round(grace_s * 5))  # the watchdog looks every 0.2 s


def _stop_statements(token: str, grace_s: float) -> list[str]:
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


def _preemption_watch(signal: str = "USR1") -> list[str]:
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


def remote_command(script: str) -> str:
    """What goes on the ssh command line: the remote login shell runs bash with our program.

    `--norc`: bash started by sshd reads ~/.bashrc (bash(1), INVOCATION: "run by the remote
    shell daemon"); the login shell already did, and a second pass (pyenv, conda...) costs a
    noticeable part of a short command's time on every node."""
    return f"exec bash --norc --noprofile -c {shlex.quote(script)}"


def ssh_base_argv(ssh: SshConfig, control_dir: str, known_hosts: str) -> list[str]:
    """ssh and its options. The user's options come first: OpenSSH keeps the first value it
    obtains for each option (ssh_config(5)), so `--ssh-option` wins over our defaults."""
    argv = ["ssh"]
    for opt in ssh.options:
        argv += ["-o", opt]
    if ssh.user:
        argv += ["-l", ssh.user]
    if ssh.key:
        argv += ["-i", str(ssh.key)]
    if ssh.iap:
        if not ssh.zone:
            raise ValueError("--iap needs the zone")
        # gcloud's documented tunnel-through-IAP ProxyCommand for OpenSSH.
        argv += [
            "-o",
            f"ProxyCommand=gcloud compute start-iap-tunnel %h %p --listen-on-stdin --zone {shlex.quote(ssh.zone)}",
        ]
    argv += [
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={ssh.connect_timeout}",
        # Keep-alives: a node that vanished is noticed within 3 x 2 s.
        "-o",
        "ServerAliveInterval=2",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        # First contact records the key; a changed key is refused. Never "no".
        "-o",
        "StrictHostKeyChecking=accept-new",
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath={control_dir}/%C",
        "-o",
        f"ControlPersist={ssh.control_persist}",
        "-o",
        "LogLevel=ERROR",
        "-T",
    ]
    return argv


def ssh_argv(base: Sequence[str], node: Node, command: str) -> list[str]:
    return [*base, node.host, "--", command]


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
