"""The environment of one node: the machine type's NCCL profile, the host NIC for NCCL and gloo,
then the user's `--env` overrides (each override of a profile value is logged, never silent —
torchtitan's `_warn_overwrite_env` does the same).

"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpufleet.catalog import UnknownMachineType, lookup
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
