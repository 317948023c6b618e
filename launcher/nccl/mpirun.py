"""NVIDIA's nccl-tests binaries across hosts: the mpirun command (a pure builder, no I/O).

``nccl_tests_command(binary, hosts, nproc_per_node, args, env, inherit=()) -> list[str]``
    ``mpirun -np N -H h1:8,h2:8 --bind-to none -x K=V ... -x SECRET binary args``, which
    ``launch nccl-tests --impl nccl-tests`` runs on node 0.
"""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = ["nccl_tests_command"]

_HOST_RE = re.compile(r"[A-Za-z0-9_.\-\[\]]+")
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def nccl_tests_command(
    binary: str,
    hosts: list[str],
    nproc_per_node: int,
    args: list[str],
    env: dict[str, str],
    *,
    inherit: Collection[str] = (),
    allow_run_as_root: bool = False,
) -> list[str]:
    """The Open MPI argv that runs an nccl-tests binary on `hosts`, nproc_per_node ranks each.

    Shape from https://github.com/NVIDIA/nccl-tests/issues/100: ``mpirun -np 16 -H node1:8,node2:8
    --bind-to none -x VAR=value ... ./all_reduce_perf -b 8 -e 8G -f 2 -g 1``. ``-x NAME=VALUE``
    sets each variable on every rank (Open MPI's -x takes an optional value), so the argv does
    not depend on mpirun's own environment. The keys in `inherit` (the user's --env, which may be
    secrets) are ``-x NAME`` alone: Open MPI then exports mpirun's own value of NAME (mpirun(1),
    ``-x``), which the node program read from stdin, so the value is on no command line.
    One GPU per process (``-g 1``) is the caller's arg.
    """
    if not hosts:
        raise ValueError("nccl-tests needs at least one host")
    for h in hosts:
        if not _HOST_RE.fullmatch(h):
            raise ValueError(f"host {h!r} is not a plain host name or address (no , : or spaces)")
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    cmd = ["mpirun"]
    if allow_run_as_root:
        cmd.append("--allow-run-as-root")
    cmd += [
        "-np",
        str(len(hosts) * nproc_per_node),
        "-H",
        ",".join(f"{h}:{nproc_per_node}" for h in hosts),
        "--bind-to",
        "none",
    ]
    for k, v in env.items():
        if not _ENV_RE.fullmatch(k):
            raise ValueError(f"environment variable name {k!r} is not valid")
        cmd += ["-x", k if k in inherit else f"{k}={v}"]
    return cmd + [binary, *args]
