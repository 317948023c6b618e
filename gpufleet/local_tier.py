"""The node-local checkpoint tier's on-disk contract: written by workloads.train (or a user's own
script), read by its restore, and by a replicator that copies a completed step to a peer node.

The root is `GPUFLEET_LOCAL_CHECKPOINT_DIR` (`ENV_VAR`): a directory of this account's own on the
node (0700, owned by this account, not a link; `check_private`), on the local SSD when the node
has one. What is written there is kept per account and per job:

    ROOT/
      JOB/                          GPUFLEET_JOB_ID (the same on every attempt of a --recover job)
        own/                        what the ranks on this node wrote
          step_00000010/
            rank_00003/             one rank's own DCP checkpoint (every file it needs to load
              .metadata             alone: no other rank's files are read)
              __0_0.distcp
              MANIFEST.json         written last (temporary name, fsync, rename): the marker
            SENT                  once its replicator copied it to a peer node (the peer's
                                  address): the step the ranks keep until every rank's is out
        peer/                       copies of other nodes' ranks, the same layout below it
          step_00000010/
            rank_00007/ ...

A rank directory is *complete* when its MANIFEST.json exists: a crash in the middle of a save
leaves a directory without one, which nothing takes for a checkpoint. The manifest names every
other file of the directory with its size and sha256 (`MANIFEST_FORMAT`), and the step, the rank
and the world size that wrote it; a rank restores only from a directory of its own rank and its
run's world size. A copy in `peer/` is used only once every file's size and hash match.

A replicator copies `own/step_N/rank_R/` of one node into `peer/step_N/rank_R/` of another, the
manifest last (the same rule: no manifest, no checkpoint), then marks the own directory SENT. A
rank run under a replicator (`COPIES_VAR` set) waits for that mark before its next save, and
keeps the newest step whose copies are out for every rank: a node lost at any moment leaves that
step on every node, its own ranks' in its peer's `peer/`. Ranks are global ranks, so a spare that
takes a lost node's ranks finds their shards in its own `peer/` once they are copied there.

Pure standard library: imported by the launcher, by workloads on the nodes, and by the replicator.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.atomic import fsync_dir

__all__ = [
    "ENV_VAR",
    "OWN",
    "PEER",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "Manifest",
    "LocalTierError",
    "step_name",
    "rank_name",
    "rank_dir",
    "complete_steps",
    "write_manifest",
    "read_manifest",
    "verify",
    "check_private",
    "common_step",
    "default_root",
    "forget_after",
    "SENT",
    "COPIES_VAR",
    "mark_sent",
    "was_sent",
]

ENV_VAR = "GPUFLEET_LOCAL_CHECKPOINT_DIR"
OWN, PEER = "own", "peer"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "gpufleet-local-checkpoint/1"
SENT = "SENT"
# Set by gpufleet.replica's sidecar for the ranks it wraps, only when it copies their steps out.
COPIES_VAR = "GPUFLEET_LOCAL_COPIES"
_STEP = re.compile(r"^step_(\d{8})$")
_CHUNK = 1 << 22


class LocalTierError(ValueError):
    """The local directory cannot hold the tier; the message names it and the fix."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def rank_dir(root: str | os.PathLike[str], job: str, area: str, step: int, rank: int) -> Path:
    """ROOT/JOB/AREA/step_N/rank_R (AREA: OWN or PEER)."""
    return Path(root) / job / area / step_name(step) / rank_name(rank)


@dataclass(frozen=True)
class Manifest:
    """What a complete rank directory holds: each file's size and sha256, and who wrote it."""

    step: int
    rank: int
    world_size: int
    files: Mapping[str, tuple[int, str]]  # name -> (size, sha256 hex)

    def to_json(self) -> str:
        files = {n: {"size": s, "sha256": h} for n, (s, h) in sorted(self.files.items())}
        doc = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "files": files,
        }
        return json.dumps(doc, indent=1) + "\n"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):  # hashlib releases the GIL on large buffers
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: str | os.PathLike[str], step: int, rank: int, world_size: int) -> Manifest:
    """Hash every file of `directory` and write MANIFEST.json into it, last: temporary name,
    fsync, rename, fsync of the directory. From then on the directory is a complete checkpoint."""
    d = Path(directory)
    files = {}
    for p in sorted(d.iterdir()):
        if p.name == MANIFEST or p.name.startswith(f".{MANIFEST}") or not p.is_file():
            continue
        files[p.name] = (p.stat().st_size, _sha256(p))
    manifest = Manifest(step, rank, world_size, files)
    tmp = d / f".{MANIFEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / MANIFEST)
    fsync_dir(d)
    return manifest


def read_manifest(directory: str | os.PathLike[str]) -> Manifest | None:
    """The directory's manifest, or None when it has none or one that cannot be read."""
    try:
        doc = json.loads((Path(directory) / MANIFEST).read_text(encoding="utf-8"))
        if doc.get("format") != MANIFEST_FORMAT:
            return None
        files = {str(n): (int(v["size"]), str(v["sha256"])) for n, v in doc["files"].items()}
        return Manifest(int(doc["step"]), int(doc["rank"]), int(doc["world_size"]), files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def verify(directory: str | os.PathLike[str], manifest: Manifest, hashes: bool = True) -> str | None:
    """None when every file the manifest names is there with its size (and, with `hashes`, its
    sha256); else what is wrong, naming the file."""
    d = Path(directory)
    for name, (size, digest) in sorted(manifest.files.items()):
        p = d / name
        try:
            actual = p.stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
        if hashes and _sha256(p) != digest:
            return f"{name} does not match its sha256 in {MANIFEST}"
    return None


def mark_sent(directory: str | os.PathLike[str], peer: str) -> None:
    """Mark an own rank directory as copied to `peer` (after the copy's manifest is on the peer)."""
    (Path(directory) / SENT).write_text(f"{peer}\n")


def was_sent(directory: str | os.PathLike[str]) -> bool:
    """Whether an own rank directory's copy is out (`mark_sent`)."""
    return (Path(directory) / SENT).is_file()


def forget_after(root: str | os.PathLike[str], job: str, step: int) -> list[int]:
    """Remove from this node every step of `job` newer than `step`, in both areas and of every
    rank, each rank directory's manifest first (a removal cut short leaves nothing that looks
    complete); the steps removed. A relaunch that resumed from `step` has left those behind: they
    belong to the attempt it replaced, and a later restore must never take one of them for the
    job's (with step -1: everything, for a node that rejoins a job which moved on without it)."""
    gone: set[int] = set()
    for area in (OWN, PEER):
        base = Path(root) / job / area
        try:
            step_dirs = [d for d in base.iterdir() if _STEP.match(d.name) and int(d.name[5:]) > step]
        except OSError:
            continue
        for d in step_dirs:
            with contextlib.suppress(OSError):
                for rank in d.iterdir():
                    with contextlib.suppress(OSError):
                        (rank / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(d, ignore_errors=True)
            gone.add(int(d.name[5:]))
    return sorted(gone)


def complete_steps(root: str | os.PathLike[str], job: str, area: str, rank: int) -> list[int]:
    """The steps, oldest first, whose rank directory for `rank` in `area` has a manifest."""
    base = Path(root) / job / area
    try:
        names = [p.name for p in base.iterdir()]
    except OSError:
        return []
    steps = []
    for name in names:
        m = _STEP.match(name)
        if m and (base / name / rank_name(rank) / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def check_private(path: str | os.PathLike[str], *, flag: str = ENV_VAR) -> Path:
    """`path` as a directory of this account's own, made if missing (0700 whatever the umask),
    then checked with lstat: a directory, not a link, owned by this account, writable by no other
    account, and writable here. The rule of the node agent's ~/.gpufleet (launcher/code/node_agent.py,
    `private_dir`): never a directory another account could have made first. LocalTierError,
    one line naming `flag`, the path and the fix, otherwise."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(p)
    except OSError as e:
        raise LocalTierError(
            f"{flag} {p}: cannot make it ({e.strerror or e}); pass a directory this account can write"
        ) from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise LocalTierError(f"{flag} {p} is a link or a file, not a directory; pass a directory of this account's own")
    if st.st_uid != os.geteuid():
        raise LocalTierError(
            f"{flag} {p} belongs to uid {st.st_uid}, not to this account (uid {os.geteuid()}); "
            "pass a directory of this account's own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise LocalTierError(f"{flag} {p} has mode {mode:04o}, writable by other accounts; chmod 700 it")
    if not os.access(p, os.W_OK | os.X_OK):
        raise LocalTierError(f"{flag} {p} is not writable by this account; chmod 700 it")
    return p


def common_step(restorable: Sequence[Iterable[int]]) -> int | None:
    """The newest step that every rank can restore (one set of steps per rank), or None.

    Every rank must restore the same step: a rank whose own copy is older than its neighbours'
    makes all of them go back to a step it has too."""
    sets = [set(s) for s in restorable]
    if not sets:
        return None
    both = set.intersection(*sets)
    return max(both) if both else None


def default_root(home: str | None = None, mounts: Iterable[str] | None = None) -> Path:
    """The tier's root a node program gives its ranks when --env does not set ENV_VAR: the node's
    per-account local directory (launcher.core.node_local, the same rule in bash) and
    `checkpoints` in it. That directory is MOUNT/gpufleet-UID on the first local SSD mount that is
    mounted and writable, when it is a 0700 directory of this account's own; otherwise (no local
    SSD, or a wrong directory there) ~/.gpufleet/local. The peer tier's receiver writes here: it
    runs under sshd's forced command, with no job environment to read the root from."""
    from gpufleet.contracts import LOCAL_SSD_MOUNT

    home = home or os.path.expanduser("~")
    for mount in dict.fromkeys(LOCAL_SSD_MOUNT.values()) if mounts is None else mounts:
        if os.path.ismount(mount) and os.access(mount, os.W_OK):
            mine = Path(mount) / f"gpufleet-{os.geteuid()}"
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(mine, 0o700)  # as the node program makes it (a spare has run none yet)
                st = os.lstat(mine)
            except OSError:
                break
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o022:
                return mine / "checkpoints"
            break
    return Path(home) / ".gpufleet" / "local" / "checkpoints"
