"""The node's per-account local directory, a prepare step of every node's plan (launcher.core.
program; the node makes and exports it: launcher.core.node_start.local_dir): resolved on the node,
since only the node knows its uid, home and disks.
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
from collections.abc import Mapping, Sequence

from gpufleet.local_tier import ENV_VAR as LOCAL_CHECKPOINT_VAR

__all__ = ["COMPILE_CACHE_VARS", "LOCAL_CHECKPOINT_VAR", "LOCAL_DIR_VAR", "compile_cache_key"]

# The node's per-account local directory , and what lives in it.
LOCAL_DIR_VAR = "GPUFLEET_LOCAL_DIR"
# Where torch.compile keeps its caches: inductor's FX-graph and AOTAutograd caches and triton's
# kernels (PyTorch's "Compile Time Caching Configuration" tutorial names both variables).
COMPILE_CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def compile_cache_key(python: str, env: Mapping[str, str] | Sequence[tuple[str, str]], image: str | None) -> str:
    """The compile caches' directory name: a hash of what the job runs in (its interpreter, its
    prepared environment, its image). A relaunch in the same environment finds the caches of the
    last one; inductor and triton key each entry by the graph's code and their own versions, so a
    changed model recompiles only what changed, and another environment never shares a directory."""
    what = [python, dict(env).get("VIRTUAL_ENV", ""), image or ""]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]
