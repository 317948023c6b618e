"""The peer tier's wire and its receiving end: what a node's replicator sends to copy one complete
rank directory of the local tier (gpufleet.local_tier) into a peer node's ROOT/JOB/peer/, and the
strict receiver that writes it there. Pure standard library (the node agent runs it with -I -S).

Who copies to whom (`ring_peer`): node i of the job's node order, spares included, sends its own
ranks to node i+1 (the last to the first). With spares (launcher.jobs.spares) a lost node at
position p is replaced by the first spare, and the world is renumbered in the job's order: each
node after p takes the rank of the node just before it, and the spare, last in the order, takes
the last rank. So the node at p+1 needs p's ranks, p+2 needs p+1's, ..., and the spare needs
those of the last node in use: exactly what a ring i -> i+1 has put in each one's peer/. Only
several swaps, or a spare that is not next after the last node in use, need ranks moved: the
controller does that before the relaunch (launcher.jobs.realign, with `inventory` and `send`
here), and the ring then follows the new world.

The stream for one rank directory:

    b"<n>\\n"  the manifest's length in bytes, in decimal
    <n bytes>  its MANIFEST.json, as written by local_tier.write_manifest
    then each file the manifest names, in sorted name order, exactly its size in bytes

The receiver (`receive`) trusts nothing in it: the step, the rank and every file name must be the
tier's own names (no separator, no "..", no manifest), every file is hashed as it arrives and
compared with the manifest, and the manifest is written last, only when all of them match: a
stream cut short leaves a directory without one, which nothing takes for a checkpoint. Nothing is
ever written outside ROOT/JOB/peer/step_N/rank_R/.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gpufleet.atomic import fsync_dir
from gpufleet.local_tier import (
    COPIES_VAR,
    MANIFEST,
    MANIFEST_FORMAT,
    OWN,
    PEER,
    Manifest,
    check_private,
    complete_steps,
    default_root,
    forget_after,
    mark_sent,
    rank_dir,
    read_manifest,
    step_name,
)

__all__ = [
    "ReplicaError",
    "ring_peer",
    "check_job",
    "check_file_name",
    "pack",
    "receive",
    "prune",
    "Sender",
    "sidecar",
    "main",
    "python_argv",
    "PEER_NAME",
    "inventory",
    "Move",
    "plan_moves",
]

_FILE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_MANIFEST = 1 << 20
_CHUNK = 1 << 22
# A peer as ssh is given it: `user@address` or `address`, plain (no option, no shell character);
# the relay's destinations too (launcher.code.tree.peers_arg).
PEER_NAME = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9_:][A-Za-z0-9._:%-]*")
# The peer copies kept per rank: the newest two, as the writer keeps its own (--keep-local-checkpoints' default).
KEEP = 2
# How often the sender looks for a newly completed step, and how long a peer that could not be
# reached is passed over (the next one in the ring takes its copies meanwhile).
POLL_S = 0.2
UNREACHABLE_S = 60.0
# A sidecar's connection to a peer outlives its last copy by this long at most, in case its
# `close` never comes (a sidecar killed): ssh's ControlPersist. The longest control socket path:
# sockaddr_un holds 107 bytes and a NUL on Linux, and ssh's master first binds the path with a
# 17-byte temporary suffix (openssh mux.c, muxserver_listen).
CONTROL_PERSIST_S = 30
MAX_SOCKET_PATH = 107 - 17


class ReplicaError(ValueError):
    """A replica stream the receiver refuses; the message names the culprit."""


def ring_peer(order: Sequence[str], me: str) -> str | None:
    """The node `me` copies its own ranks to: the next in the job's node order (spares included),
    the last wrapping to the first. None when `me` is alone or not in the order."""
    if me not in order or len(order) < 2:
        return None
    return order[(list(order).index(me) + 1) % len(order)]


def check_job(job: str) -> str:
    if not _JOB.match(job) or job in (".", ".."):
        raise ReplicaError(f"job id {job!r} is not a plain name; letters, digits, '.', '_' and '-' only")
    return job


def check_file_name(name: str) -> str:
    """A file of a rank directory as the receiver accepts it: one plain name (DCP's `.metadata`
    and `__0_0.distcp` pass), never a path, `.`/`..`, or the manifest or its temporary name."""
    if not _FILE.match(name) or name in (".", "..") or name == MANIFEST or name.startswith(f".{MANIFEST}"):
        raise ReplicaError(f"file name {name!r} is not a plain file name of a rank directory")
    return name


def pack(directory: str | os.PathLike[str]) -> Iterator[bytes]:
    """The stream for one complete rank directory (the manifest's text as it is on disk)."""
    d = Path(directory)
    text = (d / MANIFEST).read_bytes()
    manifest = read_manifest(d)
    if manifest is None:
        raise ReplicaError(f"{d} has no readable {MANIFEST}; it is not complete")
    yield f"{len(text)}\n".encode() + text
    for name in sorted(manifest.files):
        with open(d / check_file_name(name), "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk


def _read_exact(stream: BinaryIO, n: int, what: str) -> bytes:
    buf = stream.read(n)
    if len(buf) != n:
        raise ReplicaError(f"the stream ended inside {what} ({len(buf)} of {n} bytes)")
    return buf


def _parse_manifest(text: bytes) -> Manifest:
    try:
        doc = json.loads(text.decode("utf-8"))
        if doc.get("format") != MANIFEST_FORMAT:
            raise ReplicaError(f"the manifest's format is {doc.get('format')!r}, not {MANIFEST_FORMAT!r}")
        files = {str(n): (int(v["size"]), str(v["sha256"])) for n, v in doc["files"].items()}
        step, rank, world = int(doc["step"]), int(doc["rank"]), int(doc["world_size"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ReplicaError(f"the manifest cannot be read ({e})") from None
    if not (0 <= step < 10**8 and 0 <= rank < 10**5 and 0 < world <= 10**5 and rank < world):
        raise ReplicaError(f"the manifest's step {step}, rank {rank} or world size {world} is out of range")
    for name, (size, _) in files.items():
        check_file_name(name)
        if size < 0:
            raise ReplicaError(f"file {name!r} has a negative size {size}")
    return Manifest(step, rank, world, files)


def receive(root: str | os.PathLike[str], job: str, stream: BinaryIO) -> Path:
    """Write one rank directory from `stream` into ROOT/JOB/peer/step_N/rank_R/ and return it.
    ReplicaError (and no manifest there) for any stream it refuses or that ends short."""
    check_job(job)
    line = stream.readline(16)
    if not line.endswith(b"\n") or not line[:-1].isdigit() or int(line) > _MAX_MANIFEST:
        raise ReplicaError("the stream does not start with the manifest's length")
    text = _read_exact(stream, int(line), "the manifest")
    manifest = _parse_manifest(text)
    d = rank_dir(root, job, PEER, manifest.step, manifest.rank)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    (d / MANIFEST).unlink(missing_ok=True)  # an older copy stops counting before any file changes
    for name in sorted(manifest.files):
        size, digest = manifest.files[name]
        h, left = hashlib.sha256(), size
        with open(d / name, "wb") as f:
            while left:
                chunk = _read_exact(stream, min(left, _CHUNK), name)
                h.update(chunk)
                f.write(chunk)
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
        if h.hexdigest() != digest:
            raise ReplicaError(f"{name} does not match its sha256 in the manifest; the copy is dropped")
    tmp = d / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_bytes(text)
    os.replace(tmp, d / MANIFEST)
    fsync_dir(d)
    return d


def prune(
    root: str | os.PathLike[str], job: str, area: str, rank: int, keep: int, spare: int | None = None
) -> list[int]:
    """Remove all but the newest `keep` complete steps of `rank` in `area` (OWN or PEER), the way
    the writer prunes its own, never step `spare` (one just received: an older step a controller
    moved here for a relaunch to restore); return the steps removed."""
    if area not in (OWN, PEER):
        raise ReplicaError(f"area {area!r} is neither {OWN!r} nor {PEER!r}")
    steps = complete_steps(root, check_job(job), area, rank)
    gone = [s for s in steps[: max(0, len(steps) - keep)] if s != spare]
    for step in gone:
        shutil.rmtree(rank_dir(root, job, area, step, rank), ignore_errors=True)
    return gone


def _ranks_in(root: str | os.PathLike[str], job: str, area: str) -> list[int]:
    """The ranks with a directory under any step of ROOT/JOB/AREA, sorted ([] when there is none)."""
    ranks: set[int] = set()
    try:
        for step_dir in (Path(root) / job / area).iterdir():
            for d in step_dir.iterdir() if step_dir.is_dir() else ():
                if d.name.startswith("rank_") and d.name[5:].isdigit():
                    ranks.add(int(d.name[5:]))
    except OSError:
        pass
    return sorted(ranks)


def python_argv(code: str) -> list[str]:
    """How a node runs this module from gpufleet's code as the preparation placed it (`code`, its
    directory, absolute or from the home directory): the node's python3, isolated (-I -S: the
    standard library and that directory alone on sys.path). The sidecar round the ranks and the
    replica key's forced command both start so."""
    run = (
        "import os, sys; sys.path.insert(0, os.path.abspath(sys.argv.pop(1))); "
        "from gpufleet.replica import main; sys.exit(main())"
    )
    return ["python3", "-I", "-S", "-c", run, code]


def _say(text: str) -> None:
    print(f"replica: {text}", file=sys.stderr, flush=True)


class Sender:
    """The sending side on one node: each rank of this node's own area (ROOT/JOB/own) whose
    newest complete step has not gone out yet is streamed (`pack`) to the first peer of `peers`
    that answers, over ssh with the cluster's replica key, whose authorized entry on every node
    forces `receive` (launcher.code.tree.authorize_replica). `peers`: the nodes after this one in
    the job's order, spares included, wrapping round: the first is the ring's next node; one that
    cannot be reached (a node lost) is passed over for UNREACHABLE_S, so its successor holds the
    copies meanwhile. Host keys are checked strictly against the known_hosts the launcher
    verified and sent at preparation (no first-use trust)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        job: str,
        peers: Sequence[str],
        port: int,
        key: str | os.PathLike[str],
        known: str | os.PathLike[str],
        say: Callable[[str], None] = _say,
        mux: bool = False,
    ):
        self.root, self.job, self.port = Path(root), check_job(job), int(port)
        for peer in peers:
            if not PEER_NAME.fullmatch(peer):
                raise ReplicaError(f"peer {peer!r} is not a plain user@address")
        self.peers, self.key, self.known, self.say = list(peers), str(key), str(known), say
        # rank -> the newest step copied out, as (step, its manifest's mtime): a step the ranks
        # wrote again after a relaunch is a new one. At the start, what is there already: the
        # attempt before this one copied it (its last pass), or it is a replaced attempt's, which
        # the ranks remove once they resume (gpufleet.local_tier.forget_after) and no peer should get.
        self.sent: dict[int, tuple[int, int]] = {}
        for rank, step in self.pending():
            self.sent[rank] = self._ident(rank, step)
        self.down: dict[str, float] = {}  # peer -> when it last could not be reached
        # `mux`: one ssh connection per peer, kept while the sender runs (`close` ends them), its
        # socket in the key's own 0700 directory; none where that path is too long for a socket.
        control = str(Path(self.key).parent / "cm-%C")  # %C: 40 hex digits
        self.control = control if mux and len(control) - 2 + 40 <= MAX_SOCKET_PATH else None
        self.connected: set[str] = set()

    def argv(self, peer: str) -> list[str]:
        """ssh to `peer` with the replica key: the options of the relay's hop
        (launcher.code.node_agent.relay_argv, which cannot import gpufleet: it runs alone)."""
        user, _, host = peer.rpartition("@")
        argv = ["ssh", "-i", self.key, "-p", str(self.port), *(["-l", user] if user else [])]
        for opt in (
            "IdentitiesOnly=yes",
            "IdentityAgent=none",
            "BatchMode=yes",
            "StrictHostKeyChecking=yes",
            f"UserKnownHostsFile={self.known}",
            "GlobalKnownHostsFile=/dev/null",
            "UpdateHostKeys=no",
            *(
                (f"ControlPath={self.control}", "ControlMaster=auto", f"ControlPersist={CONTROL_PERSIST_S}")
                if self.control
                else ("ControlMaster=no", "ControlPath=none")
            ),
            "ConnectTimeout=5",
            "ServerAliveInterval=5",
            "ServerAliveCountMax=3",
            "LogLevel=ERROR",
        ):
            argv += ["-o", opt]
        return argv + ["-T", "--", host, self.job]

    def close(self) -> None:
        """End the connection kept to each peer (`mux`): `ssh -O exit`, which stops its master."""
        for peer in sorted(self.connected):
            argv = self.argv(peer)
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    [*argv[: argv.index("-T")], "-O", "exit", "--", peer.rpartition("@")[2]],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10,
                )  # fmt: skip
        self.connected.clear()

    def _ident(self, rank: int, step: int) -> tuple[int, int]:
        try:
            return step, (rank_dir(self.root, self.job, OWN, step, rank) / MANIFEST).stat().st_mtime_ns
        except OSError:
            return step, -1

    def pending(self) -> list[tuple[int, int]]:
        """(rank, step) of each rank of this node whose newest complete step is not out yet."""
        out = []
        for rank in _ranks_in(self.root, self.job, OWN):
            steps = complete_steps(self.root, self.job, OWN, rank)
            # a newer one, the newest after a replaced attempt's went, or one written again
            if steps and self.sent.get(rank) != self._ident(rank, steps[-1]):
                out.append((rank, steps[-1]))
        return out

    def _send_one(self, peer: str, d: Path) -> tuple[int, str]:
        """ssh's exit status and its last line of stderr; -1 when the directory could not be read
        whole (pruned while it went out): the copy is cut short and the peer keeps no manifest."""
        p = subprocess.Popen(self.argv(peer), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        failed = None
        try:
            for chunk in pack(d):
                p.stdin.write(chunk)
        except BrokenPipeError:
            pass
        except (OSError, ReplicaError) as e:
            failed = str(e)
            p.kill()
        finally:
            try:
                p.stdin.close()
            except BrokenPipeError:
                pass
        err = p.stderr.read().decode(errors="replace").strip().splitlines()
        rc = p.wait()
        if failed:
            return -1, failed
        return rc, (err[-1] if err else f"exit {rc}")

    def once(self) -> int:
        """One pass: send what is pending; the number of rank directories copied."""
        copied = 0
        for rank, step in self.pending():
            d = rank_dir(self.root, self.job, OWN, step, rank)
            now = time.monotonic()
            for peer in self.peers:
                if now - self.down.get(peer, -UNREACHABLE_S) < UNREACHABLE_S:
                    continue
                t0 = time.monotonic()
                ident = self._ident(rank, step)
                rc, why = self._send_one(peer, d)
                if self.control and rc != 255:
                    self.connected.add(peer)
                if rc == 0:
                    self.sent[rank] = ident
                    copied += 1
                    with contextlib.suppress(OSError):  # the rank pruned it meanwhile: a newer one is out
                        mark_sent(d, peer)
                    self.say(f"copied {step_name(step)} of rank {rank} to {peer} in {time.monotonic() - t0:.1f} s")
                    break
                if rc == 255:  # ssh's own failure: the peer cannot be reached, try the next one
                    self.down[peer] = time.monotonic()
                    self.say(f"peer {peer} cannot be reached ({why}); copying to the next node for now")
                    continue
                self.say(f"peer {peer} refused {step_name(step)} of rank {rank}: {why}")
                break
        return copied


def inventory(root: str | os.PathLike[str], job: str) -> dict[str, dict[int, list[int]]]:
    """{area: {rank: its complete steps, oldest first}} of this node's local tier for `job`, both
    areas (own and peer): what a controller realigning the ranks after a swap asks each node."""
    out: dict[str, dict[int, list[int]]] = {}
    for area in (OWN, PEER):
        ranks = _ranks_in(root, check_job(job), area)
        out[area] = {r: steps for r in ranks if (steps := complete_steps(root, job, area, r))}
    return out


@dataclass(frozen=True)
class Move:
    """One rank directory to copy before a relaunch: `src`'s AREA copy of `rank` at `step` into
    `dst`'s peer area (launcher.jobs.realign runs it: `send` on `src`)."""

    rank: int
    step: int
    src: str
    area: str
    dst: str


def plan_moves(
    world: Sequence[str], held: Mapping[str, Mapping[str, Mapping[int, Sequence[int]]]]
) -> tuple[int | None, list[Move]]:
    """After a swap: the newest step every rank of the new `world` (hosts by rank) can restore from
    the local tier somewhere (`held`: each reachable node's `inventory`), and the copies that put
    each rank's directory of that step on the node that now holds the rank. (None, []) when some
    rank has no complete step on any node (the restore then uses the durable tier, or starts
    over); (step, []) when every node already holds its ranks."""
    where: list[dict[int, list[tuple[str, str]]]] = [{} for _ in world]
    for host, areas in held.items():
        for area in (OWN, PEER):
            for rank, steps in (areas.get(area) or {}).items():
                if 0 <= int(rank) < len(world):
                    for step in steps:
                        where[int(rank)].setdefault(int(step), []).append((host, area))
    common = set.intersection(*(set(w) for w in where)) if where else set()
    if not common:
        return None, []
    step = max(common)
    moves = []
    for rank, host in enumerate(world):
        holders = where[rank][step]
        if any(h == host for h, _ in holders):
            continue
        src, area = min(holders, key=lambda ha: (ha[1] != OWN, ha[0]))  # a node's own copy first
        moves.append(Move(rank, step, src, area, host))
    return step, moves


def _send_main(args: Sequence[str]) -> int:
    """`send --state DIR --port P --to PEER JOB AREA STEP RANK`: one rank directory of this node's
    local tier to PEER's peer area, over the replica key (its forced `receive`): what a controller
    realigning the ranks after a swap asks of the node that holds them."""
    named = dict(zip(args[0:6:2], args[1:6:2], strict=False))
    rest = list(args[6:])
    if set(named) != {"--state", "--port", "--to"} or len(rest) != 4 or not rest[2].isdigit() or not rest[3].isdigit():
        print("usage: send --state DIR --port P --to PEER JOB AREA STEP RANK", file=sys.stderr)
        return 2
    job, area, step, rank = check_job(rest[0]), rest[1], int(rest[2]), int(rest[3])
    if area not in (OWN, PEER):
        print(f"error: area {area!r} is neither {OWN} nor {PEER}", file=sys.stderr)
        return 2
    state = Path(named["--state"])
    sender = Sender(default_root(), job, [named["--to"]], int(named["--port"]), state / "key", state / "known_hosts")
    d = rank_dir(default_root(), job, area, step, rank)
    if read_manifest(d) is None:
        print(f"error: {d} is not a complete rank directory", file=sys.stderr)
        return 2
    rc, why = sender._send_one(named["--to"], d)
    if rc != 0:
        print(f"error: copying {step_name(step)} of rank {rank} to {named['--to']}: {why}", file=sys.stderr)
        return 1
    return 0


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def sidecar(argv: Sequence[str], make_sender: Callable[[], Sender | None], poll_s: float = POLL_S) -> int:
    """Run the rank command `argv` as a child, and copy each newly completed local step to the
    peer while it runs; once it has ended (a stop's or a preemption's SIGTERM reaches it as it
    reaches the ranks: this process only waits for it), one last pass copies what its last save
    wrote. The child's exit status is the sidecar's (128+N for a signal, as a shell reports it).
    When there is a sender, the child runs with gpufleet.local_tier.COPIES_VAR set: its ranks wait
    for each step's copy before their next save (workloads.checkpoint.local)."""
    sender = None
    try:
        sender = make_sender()
    except (ReplicaError, OSError) as e:
        _say(f"not copying checkpoints to a peer: {e}")
    env = dict(os.environ)
    env.pop(COPIES_VAR, None)
    if sender is not None:
        env[COPIES_VAR] = "1"
    child = subprocess.Popen(list(argv), env=env)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)  # the ranks get it too; this one waits for them
    while True:
        try:
            rc = child.wait(timeout=poll_s)
            break
        except subprocess.TimeoutExpired:
            pass
        if sender is not None:
            sender.once()
    if sender is not None:
        try:
            sender.once()
        finally:
            sender.close()
    return _exit_status(rc)


def _sender_from_env(peers: Sequence[str], port: int, state: str) -> Sender | None:
    """The sender for this node's job, from what the node program exported: None (after one line)
    when the job writes its local tier elsewhere than where peers receive it."""
    from gpufleet.local_tier import ENV_VAR

    root, job = os.environ.get(ENV_VAR), os.environ.get("GPUFLEET_JOB_ID")
    if not root or not job:
        return None
    if Path(root).resolve() != default_root().resolve():
        _say(
            f"{ENV_VAR}={root} is not the node's default local directory ({default_root()}), where peers "
            "receive copies: its checkpoints stay on this node only"
        )
        return None
    return Sender(root, job, peers, port, Path(state) / "key", Path(state) / "known_hosts", mux=True)


def _receive_main() -> int:
    """The replica key's forced command: one rank directory from stdin into this node's peer
    area; the job is the one word the sender asked for (SSH_ORIGINAL_COMMAND)."""
    try:
        job = check_job(os.environ.get("SSH_ORIGINAL_COMMAND", "").strip())
        root = default_root()
        gpufleet_dir = Path(os.path.expanduser("~")) / ".gpufleet"
        # Each directory from the account's own down to the root: one open to others lets another
        # account put a link in place of what is below it.
        for d in ([gpufleet_dir] if root.parent.parent == gpufleet_dir else []) + [root.parent, root]:
            check_private(d, flag="the peer tier's directory")
        d = receive(root, job, sys.stdin.buffer)
        prune(root, job, PEER, int(d.name[5:]), KEEP, spare=int(d.parent.name[5:]))
    except (ReplicaError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(args: Sequence[str] | None = None) -> int:
    """`receive` (the forced command), `sidecar --state DIR --port P --peers A,B,... -- CMD...`, or
    what a controller realigning the ranks after a swap asks: `inventory JOB` (JSON on stdout),
    `send --state DIR --port P --to PEER JOB AREA STEP RANK`, and `forget JOB` (every local step of
    the job on a node that rejoins a job which moved on without it)."""
    args = list(sys.argv[1:] if args is None else args)
    if args[:1] == ["receive"]:
        return _receive_main()
    try:
        if args[:1] == ["inventory"] and len(args) == 2:
            print(json.dumps(inventory(default_root(), args[1])))
            return 0
        if args[:1] == ["send"]:
            return _send_main(args[1:])
        if args[:1] == ["forget"] and len(args) == 2:
            gone = forget_after(default_root(), check_job(args[1]), -1)
            print(json.dumps(gone))
            return 0
    except (ReplicaError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args[:1] == ["sidecar"] and "--" in args:
        cut = args.index("--")
        opts, argv = args[1:cut], args[cut + 1 :]
        named = dict(zip(opts[::2], opts[1::2], strict=False))
        peers = [p for p in named.get("--peers", "").split(",") if p]
        port, state = int(named.get("--port", "22")), named.get("--state", "")
        return sidecar(argv, lambda: _sender_from_env(peers, port, state) if peers and state else None)
    usage = "receive | inventory JOB | send ... | forget JOB | sidecar --state DIR --port P --peers A,B -- CMD..."
    print(f"usage: python -m gpufleet.replica {usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
