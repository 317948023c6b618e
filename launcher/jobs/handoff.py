"""`--detach` on the client: check every node as an attached launch does, then hand the job to
a controller on the cluster's job host and return its id. The job host is the cluster's
controller host (`Cluster.controller`: the stack's controller VM, `--controller HOST`, a
hostfile's `controller HOST` line), else node 0; "node 0" below means that host.

0. A controller host is checked first (reachable, and with what the shipped launcher needs: a
   python 3.10+, ssh, tar, setsid, flock): one UserError naming it, nothing started. Its python is
   CONTROLLER_VENV's (the stack's startup script makes it) where there is one, else python3.

1. The check: each node runs the same node-side program an attached launch runs
   (launcher.core.program.ProgramBuilder, rendered once in the launch's plan: launcher.runner)
   up to its gate, and is sent home instead of told to go; the check session also authorizes the
   cluster key (the plan's prologue), and node 0's known_hosts is made of the host
   keys this check was verified with (launcher.cluster.key). A node that cannot run is refused
   as today: one UserError, nothing started. A busy rendezvous port is not a refusal here: the
   queue on node 0 decides when the job may take it.
2. The hand-off: one more session to node 0 receives a tar archive on stdin (the launcher's own
   code, so node 0 runs this version; the cluster key, mode 600; the job's known_hosts; the request;
   the --env values in a file of their own, mode 600; the controller's start line, CONTROLLER_SH),
   and runs that line: `python -m launcher.jobs.controller JOBDIR` in a session of its own (setsid,
   stdin from /dev/null, output to a file), so it outlives this SSH connection. It returns once the
   controller has written its record. The same line starts a dead controller again
   (launcher.jobs.adopt).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import shlex
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import launcher
from gpufleet.contracts import CONTROLLER_VENV
from launcher.cluster.key import (
    NODE_KEY_DIR,
    cluster_slug,
    controller_ssh,
    ensure_key,
    known_hosts_text,
    ssh_target,
    verified_host_keys,
)
from launcher.core.launch import Launch
from launcher.core.preflight import Probe, check_probes
from launcher.core.transport import Transport
from launcher.core.types import Cluster, ControllerHost, LaunchConfig, UserError
from launcher.jobs.node0 import job_host
from launcher.jobs.record import CONTROLLER_SH, JOBS_DIR, request_json
from launcher.jobs.spares import split_spares
from launcher.runner.plan import LaunchPlan

__all__ = ["detach", "controller_sh", "STARTED_MARKER", "NODE0_WARNING"]

log = logging.getLogger("launcher")

STARTED_MARKER = "__GPUFLEET_STARTED__"
NODE0_WARNING = (
    "no controller host: this job's controller runs on node 0, and losing node 0 loses the job; name one "
    "with --controller HOST (or a hostfile line `controller HOST`; stacks have one by default)"
)
# What a controller host must have: the python that runs the shipped launcher (the stack's venv,
# else python3), and the tools the controller and the hand-off use.
_PY_FACT = "__GPUFLEET_PYTHON__"
# What node 0 needs to run the controller: the launcher and what it imports (pure Python).
_SHIPPED = (("launcher", "**/*.py"), ("gpufleet", "**/*.py"))


def detach(plan: LaunchPlan, recover: dict[str, Any] | None = None) -> str:
    """Check every node with the plan's programs (launcher.runner.plan_detached), hand the job
    to the job host's controller, return the job id. `recover`: --recover's settings
    (launcher.jobs.recovery.RecoverPolicy.to_json), carried in the request. With its `spares`
    (--spares K), every node is checked and prepared alike, and the request's cluster is the
    plan's first N-K nodes; the last K travel as the job's spares (launcher.jobs.spares)."""
    cluster, config, transport, key = plan.cluster, plan.config, plan.transport, plan.key
    if key is None:
        raise ValueError("detach takes a detached job's plan (launcher.runner.plan_detached)")
    python = config.python if cluster.controller is None else _controller_python(cluster.controller, config, transport)
    target = ssh_target(transport, cluster.nodes[0])
    _check(plan)
    # After the check: a first contact has just recorded its key (StrictHostKeyChecking=accept-new).
    known = known_hosts_text(cluster, verified_host_keys(target, cluster), target.port)
    slug = cluster_slug(cluster)
    world, spares = split_spares(cluster.nodes, int((recover or {}).get("spares") or 0))
    files = {
        f"{NODE_KEY_DIR}/{slug}/id_ed25519": key.read_bytes(),
        f"{JOBS_DIR}/{config.job_id}/known_hosts": known.encode(),
        f"{JOBS_DIR}/{config.job_id}/request.json": json.dumps(
            request_json(
                dataclasses.replace(cluster, nodes=world),
                config,
                controller_ssh(target.user, target.port, slug, f"{JOBS_DIR}/{config.job_id}/known_hosts"),
                recover,
                spares,
            ),
            indent=1,
        ).encode(),
        f"{JOBS_DIR}/{config.job_id}/env.json": json.dumps([list(kv) for kv in config.env]).encode(),
    }
    if config.fanout:  # the controller's launches go down the tree: its keys travel beside the cluster key
        files.update(_tree_files(cluster, transport, f"{NODE_KEY_DIR}/{slug}"))
    code, code_hash = _code_files()
    files.update({f".gpufleet/code/{code_hash}/{name}": data for name, data in code.items()})
    files[f"{JOBS_DIR}/{config.job_id}/{CONTROLLER_SH}"] = controller_sh(config.job_id, code_hash, python).encode()
    _hand_off(cluster, config, transport, _archive(files), code_hash, slug, python)
    if cluster.controller is None:  # once the job is handed off: a refusal stays one line
        log.warning(NODE0_WARNING)
    return config.job_id


def _tree_files(cluster: Cluster, transport: Transport, key_dir: str) -> dict[str, bytes]:
    """A --fanout job's: the cluster's relay key and every node's launch key (set up here first
    where they are not: launcher.code.launch_tree.ensure_keys), for the controller's state
    directory (launcher.jobs.controller sets GPUFLEET_STATE_DIR to NODE_KEY_DIR), mode 600."""
    from launcher.code.launch_tree import KEYS_FILE, ensure_keys
    from launcher.code.prepare import RELAY_KEY

    ensure_keys(cluster, transport)
    relay = ensure_key(cluster, RELAY_KEY)
    keys = relay.with_name(KEYS_FILE)
    return {
        f"{key_dir}/{RELAY_KEY}": relay.read_bytes(),
        f"{key_dir}/{RELAY_KEY}.pub": relay.with_name(f"{RELAY_KEY}.pub").read_bytes(),
        f"{key_dir}/{KEYS_FILE}": keys.read_bytes(),
    }


def _controller_python_script() -> str:
    venv = shlex.quote(f"{CONTROLLER_VENV}/bin/python")
    return (
        f"for p in {venv} python3; do P=$(command -v \"$p\") || continue; "
        "\"$P\" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || continue; "
        'for t in ssh tar setsid flock; do command -v "$t" >/dev/null || { echo "no $t" >&2; exit 3; }; done; '
        f'echo {_PY_FACT} "$P"; exit 0; done; echo "no python 3.10 or newer" >&2; exit 3'
    )


def _controller_python(host: ControllerHost, config: LaunchConfig, transport: Transport) -> str:
    """The python the controller host runs the shipped launcher with; a host that cannot be
    reached, or lacks what the launcher needs, is one UserError (nothing has started)."""
    argv = transport.argv(host, _controller_python_script())
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30 + config.ssh.connect_timeout)
    except subprocess.TimeoutExpired:
        r = subprocess.CompletedProcess(argv, 255, "", "no answer within 30 s")
    found = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith(_PY_FACT + " ")]
    if r.returncode == 0 and found:
        return found[0]
    why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    if r.returncode == 3:
        raise UserError(
            f"controller {host.host} cannot run the launcher ({why}); nothing was started. Install python3 "
            "(3.10+), openssh-client, tar and util-linux there, or name another host with --controller"
        )
    raise UserError(
        f"controller {host.host} is unreachable ({why}); nothing was started. Check the host given by "
        "--controller, the hostfile's `controller` line or the stack, or leave it out to keep node 0 in the role"
    )


def _check(plan: LaunchPlan) -> dict[int, Probe]:
    """The plan's programs up to their gate (their prologue authorizes the cluster key), then
    every node sent home."""
    probes = Launch(plan.cluster, plan.config, transport=plan.transport).ask(dict(plan.programs), plan.stdin)
    for p in probes.values():
        p.facts.pop("port", None)  # the queue, not the check, decides when the job takes the port
    for warning in check_probes(plan.cluster, probes, plan.config, plan.verdict):
        log.warning(warning)
    return probes


def _code_files() -> tuple[dict[str, bytes], str]:
    root = Path(launcher.__file__).resolve().parent.parent
    files = {}
    for package, pattern in _SHIPPED:
        for path in sorted((root / package).glob(pattern)):
            files[path.relative_to(root).as_posix()] = path.read_bytes()
    digest = hashlib.sha256()
    for name, data in sorted(files.items()):
        digest.update(name.encode() + b"\0" + data + b"\0")
    return files, digest.hexdigest()[:16]


def _archive(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o600
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


RELAY_FILES = "relay_ed25519 relay_ed25519.pub tree_keys.json"  # _tree_files' names, moved into place


def _handoff_script(config: LaunchConfig, code_hash: str, slug: str, python: str) -> str:
    job = shlex.quote(config.job_id)
    key_dir = shlex.quote(f"{NODE_KEY_DIR}/{slug}")
    return "\n".join(
        [
            "umask 077",
            'G="$HOME/.gpufleet"',
            # Unpacked aside, then renamed into place (rename(2) is atomic): a controller starting
            # now never reads half a key, and the job's directory appears whole.
            f'S="$G/.incoming-"{job}',
            f'K="$HOME"/{key_dir}',
            f'N="$S"/{key_dir}',
            'mkdir -p "$S" "$G/jobs" "$G/code" "$K"',
            'tar -x -z -f - -C "$S" || { echo "cannot unpack the job" >&2; rm -rf "$S"; exit 1; }',
            'cmp -s "$N/id_ed25519" "$K/id_ed25519" || mv -f "$N/id_ed25519" "$K/id_ed25519"',
            # A --fanout job's relay key and launch keys (launcher.code.launch_tree), when it has them.
            f'for f in {RELAY_FILES}; do [ ! -f "$N/$f" ] || mv -f "$N/$f" "$K/$f"; done',
            f'[ -d "$G/code/{code_hash}" ] || mv -T "$S/.gpufleet/code/{code_hash}" "$G/code/{code_hash}" 2>/dev/null',
            # A failed hand-off leaves no --env values behind (env.json).
            f'mv -T "$S/{JOBS_DIR}/"{job} "$G/jobs/"{job} || {{ rm -rf "$S"; exit 1; }}',
            'rm -rf "$S"',
            f'J="$G/jobs/"{job}',
            f'C=$(bash "$J/{CONTROLLER_SH}")',
            'i=0; while [ ! -f "$J/state.json" ] && kill -0 "$C" 2>/dev/null && [ $i -lt 1500 ]; do sleep 0.02; '
            "i=$((i+1)); done",
            f'if [ -f "$J/state.json" ]; then echo {STARTED_MARKER} {job}; else echo "the controller did not start:" '
            '>&2; tail -n 5 "$J/controller.log" >&2; kill -0 "$C" 2>/dev/null || rm -f "$J/env.json"; exit 1; fi',
        ]
    )


def controller_sh(job_id: str, code_hash: str, python: str) -> str:
    """The job's controller start line (its directory's CONTROLLER_SH): the hand-off runs it, and
    so does whatever restarts a dead controller (`launch jobs`, `launch attach`, the controller
    VM's boot), which then re-adopts the job. It prints the controller's pid."""
    return "\n".join(
        [
            f'J="$HOME"/{JOBS_DIR}/{shlex.quote(job_id)}',
            'cd "$J" || exit 1',
            # Its own session, stdin from /dev/null, output to a file: nothing ties it to the SSH
            # connection that started it, which ends right after.
            # -S: no site-packages; the controller needs the standard library and the code shipped here.
            f'PYTHONPATH="$HOME/.gpufleet/code/{code_hash}" setsid {shlex.quote(python)} -S '
            '-m launcher.jobs.controller "$J" </dev/null >>"$J/controller.log" 2>&1 &',
            "echo $!",
            "",
        ]
    )


def _hand_off(
    cluster: Cluster, config: LaunchConfig, transport: Transport, archive: bytes, code_hash: str, slug: str, python: str
) -> None:
    head = job_host(cluster)
    argv = transport.argv(head, _handoff_script(config, code_hash, slug, python))
    try:
        r = subprocess.run(argv, input=archive, capture_output=True, timeout=60 + config.ssh.connect_timeout)
    except subprocess.TimeoutExpired:
        raise UserError(
            f"{head.label} did not confirm the hand-off within 60 s; the job may not have started: check `launch jobs`"
        ) from None
    if f"{STARTED_MARKER} {config.job_id}".encode() not in r.stdout:
        lines = r.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit {r.returncode}"]
        raise UserError(f"{head.label} could not start the job's controller: {' / '.join(lines[-5:])}")
