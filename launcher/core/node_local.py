"""The node's per-account local directory, a prepare step of every node program
(launcher.core.program): resolved on the node, since only the node knows its uid, home and disks.
It is MOUNT/gpufleet-UID on the local SSD when one is mounted (the rule of uv's cache,
launcher.code.node_agent.local_cache), else ~/.gpufleet/local on the boot disk; either way a
directory of this account's own (0700, owned by it, not a link), never one another account could
have made first. It holds the node-local checkpoint tier (GPUFLEET_LOCAL_CHECKPOINT_DIR, the
layout of gpufleet.local_tier) and the compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR),
keyed by the job's environment so a relaunch of the same code and environment compiles warm.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping, Sequence

from gpufleet.contracts import LOCAL_SSD_MOUNT
from gpufleet.local_tier import ENV_VAR as LOCAL_CHECKPOINT_VAR

__all__ = ["COMPILE_CACHE_VARS", "LOCAL_CHECKPOINT_VAR", "LOCAL_DIR_VAR", "compile_cache_key", "node_local_statements"]

# The node's per-account local directory , and what lives in it.
LOCAL_DIR_VAR = "GPUFLEET_LOCAL_DIR"
# Where torch.compile keeps its caches: inductor's FX-graph and AOTAutograd caches and triton's
# kernels (PyTorch's "Compile Time Caching Configuration" tutorial names both variables).
COMPILE_CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
# The test hook of launch doctor's node script (launcher.health.script): the local SSD's mount point.
_LSSD_HOOK = "GPUFLEET_LOCAL_SSD_MOUNT"


def compile_cache_key(python: str, env: Mapping[str, str] | Sequence[tuple[str, str]], image: str | None) -> str:
    """The compile caches' directory name: a hash of what the job runs in (its interpreter, its
    prepared environment, its image). A relaunch in the same environment finds the caches of the
    last one; inductor and triton key each entry by the graph's code and their own versions, so a
    changed model recompiles only what changed, and another environment never shares a directory."""
    what = [python, dict(env).get("VIRTUAL_ENV", ""), image or ""]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def node_local_statements(key: str) -> list[str]:
    """Bash statements, run on each node before the workload, that export LOCAL_DIR_VAR, the
    local checkpoint tier's root and the compile caches, each only when the user's --env did not
    set it. A local SSD's MOUNT/gpufleet-UID that is not this account's own 0700 directory is
    never used: one warning line names it and the boot disk's ~/.gpufleet/local is used instead.
    When no directory of this account's own can be had, nothing is exported (a run that needs the
    local tier then refuses with one line: workloads.checkpoint.local)."""
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
