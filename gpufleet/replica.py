"""The peer tier's wire and its receiving end: what a node's replicator sends to copy one complete
rank directory of the local tier (gpufleet.local_tier) into a peer node's ROOT/JOB/peer/, and the
strict receiver that writes it there. Pure standard library (the node agent runs it with -I -S).

Who copies to whom (`ring_peer`): node i of the job's node order, spares included, sends its own
ranks to node i+1 (the last to the first). With spares (launcher.jobs.spares) a lost node at
position p is replaced by the first spare, and the world is renumbered in the job's order: each
node after p takes the rank of the node just before it, and the spare, last in the order, takes
the last rank. So the node at p+1 needs p's ranks, p+2 needs p+1's, ..., and the spare needs
those of the last node in use: exactly what a ring i -> i+1 has put in each one's peer/. Only
several swaps, or a spare that is not next after the last node in use, need ranks moved.

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

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from gpufleet.atomic import fsync_dir
from gpufleet.local_tier import (
    MANIFEST,
    MANIFEST_FORMAT,
    OWN,
    PEER,
    Manifest,
    complete_steps,
    rank_dir,
    read_manifest,
)

__all__ = ["ReplicaError", "ring_peer", "check_job", "check_file_name", "pack", "receive", "prune"]

_FILE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_MANIFEST = 1 << 20
_CHUNK = 1 << 22


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


def prune(root: str | os.PathLike[str], job: str, area: str, rank: int, keep: int) -> list[int]:
    """Remove all but the newest `keep` complete steps of `rank` in `area` (OWN or PEER), the way
    the writer prunes its own; return the steps removed."""
    if area not in (OWN, PEER):
        raise ReplicaError(f"area {area!r} is neither {OWN!r} nor {PEER!r}")
    steps = complete_steps(root, check_job(job), area, rank)
    gone = steps[: max(0, len(steps) - keep)]
    for step in gone:
        shutil.rmtree(rank_dir(root, job, area, step, rank), ignore_errors=True)
    return gone
