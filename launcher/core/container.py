"""A rank command in a container: the pure renderer of the runtime's argv on one node, and of the
pull that puts the image there first. Pure functions, stdlib only (node 0 runs this with
`python -S`).

torchrun runs INSIDE the container, in the host's process namespace (`--pid host`), and the
container is named after the run token. Outside, the container would hold only the workers,
each rank a `docker run` of its own, and torchrun's restarts, its SIGTERM to its workers and
its exit codes would all cross a runtime client instead of reaching processes. Inside, with
`--pid host`, every rank is a plain process of the node, with the run token (GPUFLEET_RUN) in
its environment, so the node program works unchanged (launcher.core.program): the watchdog's
/proc scan finds the ranks and signals them (SIGTERM, the grace, SIGKILL), the STOP_REPORT
lines name them, py-spy reaches them for a hang's stacks (launcher.core.stacks reads
/proc/PID/root for the container's files), and a detached job's supervisor stops them as it
would bare ones. The ranks run as the launching user (`--user UID:GID`), so that user's
watchdog may signal them and files they write in the mounted working directory are theirs.

The argv is `gpufleet-container NAME GPUS [FLAG VALUE]... IMAGE COMMAND...` (`CONTAINER_ARGV0`),
which the node program runs as its own `container` (launcher.core.node_run, in Python: the
process it starts in the run's session). It picks the runtime on the node:
GPUFLEET_CONTAINER_RUNTIME if set, else docker when its daemon answers on its socket (through
`sudo -n -E` when the socket is not writable: on COS and on Ubuntu with the docker.io package it
is root's), else podman; then runs the container (`--rm`: the runtime removes it when it ends)
and waits for the runtime's client, taking no SIGTERM/SIGINT/SIGHUP (the stop signals the ranks
themselves), then `rm -f`s the container when a signal ended the client or a stop reached the
run: every way out (a clean exit, a failure, a stop, a lost SSH session, a Ctrl-C) leaves no
container. The wrapper carries no run token, so the watchdog's final SIGKILL of every token
process leaves it to do that removal; `--rm` removes a container whose wrapper was killed anyway,
once its processes are gone.

Variables reach the container by name (`-e KEY`, the value taken from the node program's
environment, so no value is on a command line); a PATH-like variable (LD_LIBRARY_PATH, PATH) is
prepended to the image's own value inside the container instead of replacing it, as Google's
A3 Mega container does (cluster-toolkit examples/machine-learning/a3-megagpu-8g/nccl-tests/
run-nccl-tests.sh: `export LD_LIBRARY_PATH=/var/lib/tcpxo/lib64:...:$LD_LIBRARY_PATH`).
The account's node-local directory (launcher.core.node_local: the local checkpoint tier, the
compile caches) exists only where the node found one, so the wrapper itself, on the node, mounts
it at the same path (read-write) and passes its variables (`NODE_LOCAL_VARS`) when they are set.
The image's pull (`pull_script`, before the launch) is still a bash program of its own.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from gpufleet.catalog import lookup
from gpufleet.containers import GPUS_ALL, Wiring, wiring
from gpufleet.contracts import LAUNCHER_ERROR_PREFIX
from gpufleet.nccl_env import PREPEND_PATH_VARS
from launcher.core.node_local import COMPILE_CACHE_VARS, LOCAL_CHECKPOINT_VAR, LOCAL_DIR_VAR
from launcher.core.wire import JOB_ID_VAR, NNODES_VAR, NODE_RANK_VAR, RUN_VAR, read_env_statements

__all__ = [
    "IMAGE_LINE",
    "CONTAINER_ARGV0",
    "in_image",
    "RUNTIME_ENV",
    "NODE_LOCAL_VARS",
    "check_image_ref",
    "container_name",
    "container_argv",
    "pull_script",
    "parse_pull_line",
    "runtime_statement",
]

# Names the runtime command on a node, e.g. `podman` or `sudo -n -E docker` (else: picked there).
RUNTIME_ENV = "GPUFLEET_CONTAINER_RUNTIME"
# The first word of a rank command the node program runs in a container (launcher.core.node_run's
# `container`): `gpufleet-container NAME GPUS [FLAG VALUE]... IMAGE COMMAND...`.
CONTAINER_ARGV0 = "gpufleet-container"
# The pull's verdict line on a node: `gpufleet-image: ok ID pulled|present` or `... error REASON`.
IMAGE_LINE = "gpufleet-image:"

# An image reference as docker reads it (distribution/reference's grammar, loosely): a name of
# lowercase path components with an optional registry host[:port], then `:tag` and/or
# `@sha256:...`. Nothing a shell would read.
_IMAGE_RE = re.compile(
    r"^(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)


def check_image_ref(image: str) -> str:
    """`image` when it is an image reference; else ValueError (one line, with the fix)."""
    if not _IMAGE_RE.match(image):
        raise ValueError(
            f"--image {image!r} is not an image reference; write REGISTRY/PATH/NAME[:TAG][@sha256:DIGEST], "
            "e.g. us-docker.pkg.dev/PROJECT/REPO/train:1"
        )
    return image


def container_name(job_id: str, node_rank: int) -> str:
    """The container of node `node_rank`'s run: `gpufleet-<job>-<rank>`, the run token's value
    (launcher.core.wire.run_token), so a stop, a look at `docker ps` and the token agree."""
    return f"gpufleet-{job_id}-{node_rank}"


def runtime_statement() -> str:
    """Bash that sets `R` to the runtime command on the node (see the module docstring), or
    prints one error line and exits 127 when there is none."""
    return (
        f'if [ -n "${RUNTIME_ENV}" ]; then R=${RUNTIME_ENV}; '
        "elif command -v docker >/dev/null 2>&1 && { [ -n \"$DOCKER_HOST\" ] || [ -S /var/run/docker.sock ]; }; then "
        'R=docker; [ -n "$DOCKER_HOST" ] || [ -w /var/run/docker.sock ] || R="sudo -n -E docker"; '
        "elif command -v podman >/dev/null 2>&1; then R=podman; "
        f'else echo "{LAUNCHER_ERROR_PREFIX}no container runtime on $(hostname): neither docker with its daemon '
        'running nor podman; install one (the startup script installs docker) or drop --image" >&2; exit 127; fi'
    )


# What the node-local prepare step (launcher.core.node_local) exports on the node, only when it
# found the account's own directory: the container gets them by name, and that directory at the
# same path, read-write, only then, so the wrapper decides on the node.
NODE_LOCAL_VARS = (LOCAL_DIR_VAR, LOCAL_CHECKPOINT_VAR, *COMPILE_CACHE_VARS)


def _mount(host: str, container: str, read_only: bool) -> str:
    return f"type=bind,src={host},dst={container}" + (",readonly" if read_only else "")


# gpufleet's own code as launcher.code sent it (`~/.gpufleet/snap/HASH`, on PYTHONPATH): a stock
# image (the stack's default PyTorch image on COS) has torch but not gpufleet's workloads, so the
# snapshot goes in too, read-only, at the same path. Other PYTHONPATH entries are the image's own.
_SNAPSHOT_RE = re.compile(r"/[^,]*/\.gpufleet/snap/[^/,]+")


def _code_mounts(env: Mapping[str, str]) -> list[str]:
    return [
        _mount(d, d, read_only=True)
        for d in dict.fromkeys(env.get("PYTHONPATH", "").split(":"))
        if _SNAPSHOT_RE.fullmatch(d)
    ]


def container_argv(
    wiring: Wiring,
    image: str,
    name: str,
    token_value: str,
    env: Mapping[str, str],
    argv: Sequence[str],
    extra_env: Sequence[str] = (JOB_ID_VAR, NODE_RANK_VAR, NNODES_VAR),
) -> list[str]:
    """The argv that runs `argv` (the rank command: torchrun's, or a plain command) inside
    `image` with `wiring`, as container `name`, its processes carrying GPUFLEET_RUN=`token_value`.
    `env`: the node's variables (exported by the node program before this runs), passed in by
    name; `extra_env`: more names the node program exports."""
    opts: list[str] = ["--network", "host", "--ipc", "host", "--pid", "host"]
    for flag, value in wiring.options:
        opts += [flag, value]
    for d in wiring.devices:
        opts += ["--device", d]
    for m in wiring.mounts:
        opts += ["--mount", _mount(m.host, m.container, m.read_only)]
    for m in _code_mounts(env):
        opts += ["--mount", m]
    opts += ["-e", f"{RUN_VAR}={token_value}"]
    for key in dict.fromkeys([*env, *extra_env]):
        # NODE_LOCAL_VARS: the wrapper passes those set on the node, a user's --env value included.
        if key not in PREPEND_PATH_VARS and key != RUN_VAR and key not in NODE_LOCAL_VARS:
            opts += ["-e", key]
    command = list(argv)
    prepend: dict[str, list[str]] = {}
    for key in sorted(PREPEND_PATH_VARS):
        dirs = [d for d in env.get(key, "").split(":") if d]
        if key == "LD_LIBRARY_PATH":
            dirs += [d for d in wiring.library_path if d not in dirs]
        if dirs:
            prepend[key] = dirs
    if prepend:
        exports = "; ".join(f"export {k}={shlex.quote(':'.join(v))}${{{k}:+:${k}}}" for k, v in sorted(prepend.items()))
        command = ["sh", "-c", f'{exports}; exec "$@"', "sh", *command]
    gpus = "all" if wiring.gpus == GPUS_ALL else "none"
    return [CONTAINER_ARGV0, name, gpus, *opts, image, *command]


def pull_script(image: str, env: Sequence[tuple[str, str]] = ()) -> str:
    """One node's pull (a bash program): the runtime's pull, its progress on stdout as it comes,
    then one `IMAGE_LINE` line: `ok ID present` (the registry had nothing newer: same digest, no
    layer fetched; or a digest-pinned image already here, without asking the registry),
    `ok ID pulled`, `ok ID local REASON` (the pull failed but the image is here: it is used,
    unchecked), or `error REASON` with the registry's own last line, and exit 2. `env`: the
    launch's --env pairs, whose values the program reads from stdin first, as the run does
    (launcher.core.wire.env_block: never on a command line); they may name the runtime or its
    configuration (GPUFLEET_CONTAINER_RUNTIME, DOCKER_HOST, CONTAINERS_CONF)."""
    q = shlex.quote(image)
    return "; ".join(
        [
            *(st for k, _ in env for st in read_env_statements(k, prepend=k in PREPEND_PATH_VARS)),
            runtime_statement().replace("exit 127", f"echo '{IMAGE_LINE} error no container runtime'; exit 2"),
            f"B=$($R image inspect --format '{{{{.Id}}}}' {q} 2>/dev/null)",
            # A digest names its content: present is current, the registry need not be asked.
            f'case {q} in *@sha256:*) if [ -n "$B" ]; then echo "{IMAGE_LINE} ok $B present"; exit 0; fi;; esac',
            f"O=$(mktemp); $R pull {q} 2>&1 | tee \"$O\"; rc=${{PIPESTATUS[0]}}",
            # A pull that fails leaves an image already here in use (built or loaded on the node,
            # or a registry out of reach): `local`, with the registry's reason.
            'if [ "$rc" != 0 ]; then m=$(grep -v "^ *$" "$O" | tail -n 1); rm -f "$O"; '
            f'if [ -n "$B" ]; then echo "{IMAGE_LINE} ok $B local ${{m:-exit $rc}}"; exit 0; fi; '
            f'echo "{IMAGE_LINE} error ${{m:-exit $rc}}"; exit 2; fi',
            'rm -f "$O"',
            f"A=$($R image inspect --format '{{{{.Id}}}}' {q} 2>/dev/null)",
            f'if [ "$A" = "$B" ]; then echo "{IMAGE_LINE} ok $A present"; else echo "{IMAGE_LINE} ok $A pulled"; fi',
        ]
    )


def parse_pull_line(line: str) -> tuple[str, str, str] | None:
    """`IMAGE_LINE` line -> (status, image id, note): ("present"|"pulled", id, ""), ("local", id,
    the registry's reason) or ("error", "", reason); None for any other line."""
    if not line.startswith(IMAGE_LINE):
        return None
    rest = line[len(IMAGE_LINE) :].strip()
    status, _, detail = rest.partition(" ")
    if status == "ok":
        image_id, _, how = detail.partition(" ")
        how, _, note = how.partition(" ")
        return (how or "pulled", image_id, note)
    return ("error", "", detail or "pull failed")


def in_image(
    machine_type: str | None,
    local: bool,
    image_os: str | None,
    image: str,
    job_id: str,
    node_rank: int,
    token: str,
    env: Mapping[str, str],
    argv: Sequence[str],
) -> list[str]:
    """`argv` (node `node_rank`'s rank command) wrapped to run inside `image`, wired for
    `machine_type` on `image_os` (none on `local` nodes, which are this machine's CPUs); `token`:
    the run token, `GPUFLEET_RUN=<job>-<rank>`."""
    machine = lookup(machine_type) if machine_type and not local else None
    name = container_name(job_id, node_rank)
    return container_argv(wiring(machine, image_os), image, name, token.partition("=")[2], env, argv)
