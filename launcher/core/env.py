"""The environment of one node: the machine type's NCCL profile, the host NIC for NCCL and gloo,
then the user's `--env` overrides (each override of a profile value is logged, never silent —
torchtitan's `_warn_overwrite_env` does the same).

And the node's per-account local directory (`node_local_statements`, a prepare step of the node
program): resolved on the node, since only the node knows its uid, home and disks. It is
MOUNT/gpufleet-UID on the local SSD when one is mounted (the rule of uv's cache,
launcher.code.node_agent.local_cache), else ~/.gpufleet/local on the boot disk; either way a
directory of this account's own (0700, owned by it, not a link), never one another account could
have made first. It holds the node-local checkpoint tier (GPUFLEET_LOCAL_CHECKPOINT_DIR, the
layout of gpufleet.local_tier) and the compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR),
keyed by the job's environment so a relaunch of the same code and environment compiles warm.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpufleet.catalog import UnknownMachineType, lookup
from gpufleet.contracts import LOCAL_SSD_MOUNT
from gpufleet.local_tier import ENV_VAR as LOCAL_CHECKPOINT_VAR
from gpufleet.nccl_env import HOST_IFACE_ON_NODE, render
from launcher.core.hang import flight_recorder_env
from launcher.core.types import Cluster, LaunchConfig, UserError
from launcher.core.wire import ATTEMPT_VAR, JOB_ID_VAR, RESTART_REASON_VAR

__all__ = [
    "launch_env",
    "node_env",
    "job_env",
    "parse_env_pairs",
    "flight_recorder_on",
    "HOST_IFACE_ON_NODE",
    "TORCHRUN_DEFAULTS",
    "LOCAL_DIR_VAR",
    "COMPILE_CACHE_VARS",
    "compile_cache_key",
    "node_local_statements",
]

log = logging.getLogger("launcher.core.env")

_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_env_pairs(
    pairs: Sequence[str], files: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> tuple[tuple[str, str], ...]:
    """The user's variables: each `--env-file` (KEY=VALUE lines; `#` comments and blank lines
    skipped), then each `--env`, so `--env` wins over a file. `KEY=VALUE` sets KEY (the value may
    hold anything, even `=`); `KEY` alone takes this machine's value (`environ`, os.environ by
    default), as docker's `-e KEY` does, so a secret never has to be typed on a command line.
    Bad input is one UserError naming the culprit."""
    environ = os.environ if environ is None else environ
    out = []
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="surrogateescape")
        except OSError as e:
            raise UserError(f"--env-file {path}: {e.strerror}; pass a file of KEY=VALUE lines") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            out.append(_pair(line, f"--env-file {path}:{number}", environ))
    out += [_pair(pair, f"--env {pair!r}", environ) for pair in pairs]
    return tuple(out)


def _pair(text: str, where: str, environ: Mapping[str, str]) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not _KEY_RE.fullmatch(key):
        raise UserError(
            f"{where}: {key!r} is not a shell variable name; write KEY=VALUE, or KEY to pass this machine's"
        )
    if "\0" in value:
        raise UserError(f"{where}: the value of {key} holds a NUL byte, which no environment can")
    if sep:
        return key, value
    if key not in environ:
        raise UserError(f"{where}: {key} is not set here; set it, or write {key}=VALUE")
    return key, environ[key]


# What every torchrun node gets before the user's --env (which may override it, logged).
TORCHRUN_DEFAULTS = {
    # A fresh worker store for every attempt. By default the workers of every attempt share the
    # agents' TCPStore (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
    # `use_agent_store`), so a restarted attempt meets the previous attempt's keys; and each
    # agent numbers attempts itself (TORCHELASTIC_RESTART_COUNT counts its own failures, not the
    # membership restarts another node's failure causes), so nodes cannot agree on a per-attempt
    # prefix either. On a multi-node `--max-restarts` restart that stranded the workers for the
    # 10-minute store timeout. With this opt-out each rendezvous round picks a free port
    # on global rank 0's node and the workers build a new store there (RendezvousStoreInfo.build).
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
}


def job_env(config: LaunchConfig) -> dict[str, str]:
    """The job's contract with the program it runs, on every rank of every node (torchrun's
    workers inherit it): GPUFLEET_JOB_ID, the same on every attempt; GPUFLEET_ATTEMPT, 0 then
    1, 2, ... for each relaunch of a `--recover` job; GPUFLEET_RESTART_REASON (node-lost,
    preempted, worker-failed, hang or shrunk), absent on attempt 0."""
    env = {JOB_ID_VAR: config.job_id, ATTEMPT_VAR: str(config.attempt)}
    if config.restart_reason:
        env[RESTART_REASON_VAR] = config.restart_reason
    return env


def flight_recorder_on(cluster: Cluster) -> bool:
    """Whether the job's workers may use NCCL, and so get its flight recorder: not on --local
    (CPU, gloo), nor on a machine type the catalog says has no GPU; a hostfile without
    --machine-type may be GPU nodes (workloads pick NCCL when CUDA is there)."""
    if cluster.local:
        return False
    try:
        gpus = cluster.gpus_per_node
    except UnknownMachineType:
        return True
    return gpus is None or gpus > 0


def node_env(cluster: Cluster, config: LaunchConfig) -> dict[str, str]:
    """Every variable to export on each node, in order. A value equal to HOST_IFACE_ON_NODE is
    resolved on the node at run time (the interface that holds the node's address)."""
    machine = None
    if cluster.machine_type is not None and not cluster.local:
        try:
            machine = lookup(cluster.machine_type)
        except UnknownMachineType as e:
            raise UserError(str(e)) from None
    try:
        env = render(machine, config.image_os)
    except ValueError as e:
        raise UserError(str(e)) from None
    env.update(TORCHRUN_DEFAULTS)
    # torchrun forwards a SIGTERM to its workers and SIGKILLs them after its own shutdown timeout
    # (30 s unless told: torch/distributed/launcher/api.py, TORCH_ELASTIC_SHUTDOWN_TIMEOUT;
    # pytorch#119856). The node-side watchdog SIGKILLs after --term-grace, so torchrun's timeout
    # is set just beyond it: ours is the one that governs. An older torchrun ignores the variable.
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(math.ceil(config.stop_grace_s) + 5)
    env.update(job_env(config))
    if cluster.local:
        # --local: every "node" is this machine; the loopback interface carries the rendezvous.
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = "lo"
    if flight_recorder_on(cluster):
        env.update(flight_recorder_env(config.job_id))
    if config.nccl_debug:
        # NCCL's own INFO logging (NCCL docs: NCCL_DEBUG=INFO), incl. which NET plugin loaded.
        env["NCCL_DEBUG"] = "INFO"
        env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET,ENV")
    for key, value in config.env:
        if key in env and env[key] != value:
            # The value is the user's and may be a secret: named, never shown (logs are kept).
            log.warning("--env %s overrides the profile value %s=%s", key, key, env[key])
        env[key] = value
    return env


def launch_env(cluster: Cluster, config: LaunchConfig) -> dict[str, str]:
    """What a launch's nodes export: a torchrun workload gets `node_env`; a plain command only the
    job's variables and the user's --env (the NCCL profile is for torchrun workloads). Bad input
    (an unknown machine type, an image the profile does not know) raises UserError."""
    if config.workload.kind == "torchrun":
        return node_env(cluster, config)
    return {**job_env(config), **dict(config.env)}


# The node's per-account local directory (see the module docstring), and what lives in it.
LOCAL_DIR_VAR = "GPUFLEET_LOCAL_DIR"
# Where torch.compile keeps its caches: inductor's FX-graph and AOTAutograd caches and triton's
# kernels (PyTorch's "Compile Time Caching Configuration" tutorial names both variables).
COMPILE_CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
# The test hook of launch doctor's node script (launcher.health.script): the local SSD's mount point.
_LSSD_HOOK = "GPUFLEET_LOCAL_SSD_MOUNT"


def compile_cache_key(config: LaunchConfig) -> str:
    """The compile caches' directory name: a hash of what the job runs in (its interpreter, its
    prepared environment, its image). A relaunch in the same environment finds the caches of the
    last one; inductor and triton key each entry by the graph's code and their own versions, so a
    changed model recompiles only what changed, and another environment never shares a directory."""
    env = dict(config.env)
    what = [config.python, env.get("VIRTUAL_ENV", ""), config.image or ""]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def node_local_statements(config: LaunchConfig) -> list[str]:
    """Bash statements, run on each node before the workload, that export LOCAL_DIR_VAR, the
    local checkpoint tier's root and the compile caches, each only when the user's --env did not
    set it. A local SSD's MOUNT/gpufleet-UID that is not this account's own 0700 directory is
    never used: one warning line names it and the boot disk's ~/.gpufleet/local is used instead.
    When no directory of this account's own can be had, nothing is exported (a run that needs the
    local tier then refuses with one line: workloads.checkpoint.local)."""
    key = compile_cache_key(config)
    mounts = " ".join(shlex.quote(m) for m in dict.fromkeys(LOCAL_SSD_MOUNT.values()))
    private = (
        # made 0700 (mkdir's mode, whatever the umask), then checked: a directory, not a link,
        # this account's, writable by no other account, writable here.
        'gpufleet_private() { mkdir -m 700 "$1" 2>/dev/null; [ -d "$1" ] && [ ! -L "$1" ] && '
        '[ "$(stat -c %u "$1")" = "$(id -u)" ] && [ $(( 0$(stat -c %a "$1") & 022 )) = 0 ] && [ -w "$1" ]; }'
    )
    exports = [f'export {LOCAL_CHECKPOINT_VAR}="${{{LOCAL_CHECKPOINT_VAR}:-$GL/checkpoints}}"']
    exports += [f'export {var}="${{{var}:-$GL/compile/{key}/{sub}}}"' for var, sub in COMPILE_CACHE_VARS.items()]
    return [
        private,
        f'if [ -n "${{{_LSSD_HOOK}:-}}" ]; then GM=("${_LSSD_HOOK}"); else GM=({mounts}); fi',
        'GL=""; for M in "${GM[@]}"; do if mountpoint -q "$M" 2>/dev/null && [ -w "$M" ]; then '
        'if gpufleet_private "$M/gpufleet-$(id -u)"; then GL="$M/gpufleet-$(id -u)"; else '
        'echo "warning: not using $M/gpufleet-$(id -u) on the local SSD: it is not a 0700 directory of this '
        "account's own; remove it (the boot disk is used meanwhile)\" >&2; fi; break; fi; done",
        'if [ -z "$GL" ] && gpufleet_private "$HOME/.gpufleet" && gpufleet_private "$HOME/.gpufleet/local"; '
        'then GL="$HOME/.gpufleet/local"; fi',
        f'if [ -n "$GL" ]; then export {LOCAL_DIR_VAR}="$GL"; (umask 077; mkdir -p "$GL/compile/{key}"); '
        + "; ".join(exports)
        + "; fi",
    ]
