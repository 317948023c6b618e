"""Where checkpoints live: a local directory or gs://bucket/prefix, with an atomic `latest`.

A checkpoint is one torch.distributed.checkpoint (DCP) directory that every rank writes its own
shards into, in parallel (torchtitan's layout):

    latest               names the newest complete checkpoint: "step_00000010"
    step_00000010/
        .metadata        written last, by rank 0, after every rank has reported its shards written
        __0_0.distcp     rank 0's shards (DDP: the replicated tensors are spread over the ranks)
        __1_0.distcp     ...
    step_00000008.pt     a full-state checkpoint of the previous release: read, never written

`latest` moves only after a checkpoint is whole, so a crash, a kill -9 or a full disk in the
middle of a save leaves the previous `latest` in place and loadable:

- local: every rank writes into `.step_00000010.tmp-<token>/` (DCP's FileSystemWriter fsyncs each
  file, sync_files=True). DCP's save returns on rank 0 only after its finish step, which runs
  once every rank's writes are reported done, and writes `.metadata` (temp name, then rename).
  Rank 0 then renames the directory to `step_00000010`, fsyncs the parent, and replaces `latest`
  (temp file, fsync, rename(2): atomic on POSIX).
- GCS: an object becomes visible only when its upload completes (GCS docs, "Consistency"), every
  rank uploads its shards straight to `step_00000010/` (workloads.gcs_dcp), `.metadata` comes
  last, and `latest` is uploaded after that.

A local directory must be one that every node sees (it is checked at start-up in multi-node runs):
each rank writes its own shards, and a checkpoint saved on N ranks is read back by M ranks, each
reading the pieces it needs wherever they were written.

Older checkpoints are pruned only after the new pointer is published, never the one `latest`
names. Every store method fails only with CheckpointError, one line that names the path and the
fix, so train.py can hand it to every rank instead of leaving them waiting in a collective.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from gpufleet.atomic import fsync_dir

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "LocalStore",
    "GCSStore",
    "open_store",
    "checkpoint_name",
    "step_of",
    "is_full_state",
    "load_file",
    "load_checkpoint",
    "encode_state",
    "decode_state",
    "failure_cause",
    "failure_line",
    "has_os_error",
    "METADATA",
]

_NAME = re.compile(r"^step_(\d{8})$")  # a DCP checkpoint directory
_PT_NAME = re.compile(r"^step_(\d{8})\.pt$")  # a full-state file of the previous release
# Leftovers of a save that was cut short: a DCP staging directory or a full-state temp file.
_TMP = re.compile(r"^\.step_\d{8}(\.pt)?\.tmp-[0-9a-z]+$")
LATEST = "latest"
METADATA = ".metadata"  # DCP's metadata file name (torch.distributed.checkpoint.filesystem)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the fix."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def is_full_state(name: str) -> bool:
    """True for a full-state `step_*.pt` file written by the previous release."""
    return bool(_PT_NAME.match(name))


def _step_of(name: str) -> int:
    m = _NAME.match(name) or _PT_NAME.match(name)
    return int(m.group(1)) if m else -1


def step_of(name: str) -> int | None:
    """The step of a checkpoint name (`step_00000010` or `step_00000010.pt`), or None."""
    step = _step_of(name)
    return step if step >= 0 else None


def _first_line(err: BaseException, limit: int = 160) -> str:
    """The head of an error's message, short enough for a one-line report."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _os_error_in(err: BaseException) -> BaseException:
    """The first OSError in an exception's chain (the exception itself when there is none)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return err


def has_os_error(err: BaseException) -> bool:
    """Whether an OSError (with its errno) is among the causes of a DCP failure."""
    if isinstance(err, CheckpointException) and err.failures:
        err = err.failures[min(err.failures)][0]
    return isinstance(_os_error_in(err), OSError)


def failure_cause(err: BaseException) -> tuple[int | None, str]:
    """The rank and the one-line cause of what went wrong in a DCP save or load.

    DCP collects every rank's exception into one CheckpointException (a BaseException whose str is
    every rank's traceback): take the lowest failing rank and its cause, an OSError's strerror
    when there is one ("No space left on device").
    """
    rank = None
    if isinstance(err, CheckpointException) and err.failures:
        rank = min(err.failures)
        err = err.failures[rank][0]
    cause = _os_error_in(err)
    text = getattr(cause, "strerror", None) if isinstance(cause, OSError) else None
    return rank, text or _first_line(cause)


def failure_line(err: BaseException) -> str:
    """`rank 1: No space left on device` (see failure_cause)."""
    rank, text = failure_cause(err)
    return text if rank is None else f"rank {rank}: {text}"


def encode_state(state: dict[str, Any]) -> bytes:
    """The trainer's small state (step, scheduler, RNG, data position, meta) as one opaque value
    in the DCP state dict: DCP would otherwise flatten its nested dicts and lists into items whose
    shape (one RNG state per rank) a run on another world size cannot template for loading."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def decode_state(blob: bytes, where: str) -> dict[str, Any]:
    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{where} is not a readable checkpoint ({_first_line(e)}); point its "
            "latest at an older step_*, or pass another --checkpoint-dir"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{where} is not a checkpoint of workloads.train (its trainer state is a {type(state).__name__})"
        )
    return state


def load_file(path: str | os.PathLike[str], *, shown: str | None = None, fix: str = "") -> dict[str, Any]:
    """Load one full-state checkpoint file (tensors and plain data only: weights_only=True).

    A file that cannot be read or holds no checkpoint (truncated, corrupt, not a torch.save'd
    dict) raises CheckpointError naming `shown` (default: the path), followed by `fix`.
    """
    where = shown or str(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"cannot read {where}: {e.strerror or e}{fix}") from None
    except Exception as e:  # torch.load fails with RuntimeError, UnpicklingError, EOFError, ...
        raise CheckpointError(f"{where} is not a readable checkpoint ({_first_line(e)}){fix}") from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{where} is not a readable checkpoint (it holds a {type(state).__name__}, not a dict){fix}"
        )
    return state


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a whole local checkpoint into this process, without a process group: full tensors on
    the CPU as {"model": ..., "optimizer": ..., "step": ..., ...}. A DCP directory or a full-state
    file; for inspecting a checkpoint, converting it, or tests."""
    path = Path(path)
    if path.is_file():
        return load_file(path)
    # torch's public converter (format_utils) reads every piece into one full state dict; through
    # a temporary file, as it writes one.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            state = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{path} is not a readable checkpoint ({failure_line(e)})") from None
    trainer = decode_state(state.pop("trainer", b""), str(path))
    return {**state, **trainer}


class CheckpointStore(Protocol):
    """One --checkpoint-dir. Every rank opens it; rank 0 alone checks, begins, commits, aborts,
    prunes and reads `latest` (train.py hands its answers and errors to the other ranks)."""

    url: str

    def check(self) -> None:
        """Fail now, with a clear line, if the place cannot be written; drop leftovers of cut saves."""

    def latest(self) -> str | None:
        """Name of the newest complete checkpoint, or None."""

    def begin(self, name: str) -> str:
        """Rank 0, before any rank writes `name`: returns the token of this save's staging place."""

    def storage_writer(self, name: str, token: str) -> StorageWriter:
        """Every rank: where DCP writes this rank's shards of the save `token`."""

    def commit(self, name: str, token: str) -> str:
        """Rank 0, after every rank's shards and the metadata are written: publish `name` as latest."""

    def abort(self, name: str, token: str) -> None:
        """Rank 0, after a failed save: remove what it wrote (never raises)."""

    def write_refused(self, name: str, token: str) -> str | None:
        """After a save failed with no OS error in it, before abort: the OS's reason the store
        refuses a write now ("No space left on device"), or None when it takes one."""

    def storage_reader(self, name: str) -> StorageReader:
        """Every rank: where DCP reads checkpoint `name`."""

    def load_full_state(self, name: str) -> dict[str, Any]:
        """Rank 0: read a full-state `step_*.pt` of the previous release."""

    def prune(self, keep: int) -> list[str]:
        """Delete all but the newest `keep` checkpoints (never latest); returns what went."""


def open_store(url: str) -> CheckpointStore:
    return GCSStore(url) if url.startswith("gs://") else LocalStore(url)


class LocalStore:
    def __init__(self, path: str) -> None:
        self.root = Path(path)
        self.url = str(self.root)

    def _fail(self, action: str, path: Path, err: BaseException) -> CheckpointError:
        return CheckpointError(
            f"cannot {action} {path}: {getattr(err, 'strerror', None) or err}; "
            f"free space or fix permissions there, or pass another --checkpoint-dir"
        )

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
            # Staging places of a save that was killed: never latest, safe to drop.
            for p in self.root.iterdir():
                if _TMP.match(p.name):
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        except OSError as e:
            raise self._fail("write checkpoints to", self.root, e) from None

    def _complete(self, name: str) -> bool:
        if _NAME.match(name):
            return (self.root / name / METADATA).is_file()
        return bool(_PT_NAME.match(name)) and (self.root / name).is_file()

    def latest(self) -> str | None:
        pointer = self.root / LATEST
        try:
            if not pointer.exists():
                return None
            name = pointer.read_text().strip()
            found = self._complete(name)
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"cannot read {pointer}: {getattr(e, 'strerror', None) or e}; "
                "fix its permissions, or remove it to start from step 0"
            ) from None
        if not found:
            raise CheckpointError(
                f"{pointer} names {name!r}, which is not a complete checkpoint there; "
                "point it at an existing step_* or remove it"
            )
        return name

    def _staging(self, name: str, token: str) -> Path:
        return self.root / f".{name}.tmp-{token}"

    def begin(self, name: str) -> str:
        return uuid.uuid4().hex[:12]

    def storage_writer(self, name: str, token: str) -> StorageWriter:
        # One file per rank (single_file_per_rank), fsynced before the rank reports it written.
        return FileSystemWriter(self._staging(name, token), sync_files=True)

    def _write_pointer(self, name: str) -> None:
        final = self.root / LATEST
        # The pointer's temp name must not match _TMP, so it is never taken for a staging place.
        tmp = self.root / f".{LATEST}.new-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(name.encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(self.root)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise self._fail("write", final, e) from None

    def commit(self, name: str, token: str) -> str:
        final = self.root / name
        try:
            if final.exists():  # a whole save that never became latest (cut before the pointer)
                shutil.rmtree(final)
            os.rename(self._staging(name, token), final)
            fsync_dir(self.root)
        except OSError as e:
            raise self._fail("publish", final, e) from None
        self._write_pointer(name)
        return str(final)

    def abort(self, name: str, token: str) -> None:
        shutil.rmtree(self._staging(name, token), ignore_errors=True)

    def write_refused(self, name: str, token: str) -> str | None:
        # torch's stream writer reports a short write as "unexpected pos N vs M", the errno lost:
        # ask the disk again with a small write of our own where the save was going.
        where = self._staging(name, token)
        probe = (where if where.is_dir() else self.root) / f".probe-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            return e.strerror or str(e)
        finally:
            probe.unlink(missing_ok=True)
        return None

    def storage_reader(self, name: str) -> StorageReader:
        return FileSystemReader(self.root / name)

    def load_full_state(self, name: str) -> dict[str, Any]:
        return load_file(
            self.root / name, fix=f"; point {self.root / LATEST} at an older step_*, or pass another --checkpoint-dir"
        )

    def prune(self, keep: int) -> list[str]:
        latest = self.latest()
        try:
            names = sorted((p.name for p in self.root.iterdir() if self._complete(p.name)), key=_step_of)
            gone = [n for n in names[:-keep] if n != latest]
            for n in gone:
                p = self.root / n
                if p.is_dir():
                    # .metadata first: a prune cut short leaves an incomplete checkpoint, never a
                    # complete-looking one with shards missing.
                    (p / METADATA).unlink(missing_ok=True)
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
        except OSError as e:
            raise self._fail("prune old checkpoints in", self.root, e) from None
        return gone


class GCSStore:
    # A dead endpoint must fail in seconds, not after the client's 120 s default retry deadline.
    TIMEOUT_S = 30

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        bucket, _, prefix = self.url[len("gs://") :].partition("/")
        if not bucket:
            raise CheckpointError(f"--checkpoint-dir {url!r} names no bucket; use gs://BUCKET/PREFIX")
        self.prefix = prefix + "/" if prefix else ""
        try:
            from google.cloud import storage  # only runs that checkpoint to GCS need the package
        except ImportError:
            raise CheckpointError(
                f"--checkpoint-dir gs://{bucket} needs google-cloud-storage; "
                "pip install 'gpufleet[workloads]' on every node"
            ) from None
        try:
            # Finds credentials now (google.auth.default): without any it raises
            # DefaultCredentialsError, which must reach the user as one line, not a traceback.
            self.client = storage.Client()
        except Exception as e:
            raise CheckpointError(
                f"cannot open gs://{bucket}: {_first_line(e)}; give every node Google credentials "
                "(a VM service account with storage access, `gcloud auth application-default login`, "
                "or GOOGLE_APPLICATION_CREDENTIALS=/path/to/key.json) or pass another --checkpoint-dir"
            ) from None
        self.bucket = self.client.bucket(bucket)

    def _blob(self, name: str) -> Any:
        return self.bucket.blob(self.prefix + name)

    def _fail(self, action: str, name: str, err: BaseException) -> CheckpointError:
        return CheckpointError(
            f"cannot {action} {self.url}/{name}: {_first_line(err)}; check the bucket "
            "name, your credentials and the network, or pass another --checkpoint-dir"
        )

    def check(self) -> None:
        try:
            exists = self.bucket.exists(timeout=self.TIMEOUT_S, retry=None)
        except Exception as e:  # any transport or auth failure means: unreachable
            raise CheckpointError(
                f"cannot reach bucket gs://{self.bucket.name}: "
                f"{_first_line(e)}; "
                "check the name, credentials and network"
            ) from None
        if not exists:
            raise CheckpointError(
                f"bucket gs://{self.bucket.name} does not exist; create it "
                f"(gcloud storage buckets create gs://{self.bucket.name}) or fix --checkpoint-dir"
            )

    def _complete(self, name: str) -> bool:
        if _NAME.match(name):
            return self._blob(f"{name}/{METADATA}").exists(timeout=self.TIMEOUT_S)
        return bool(_PT_NAME.match(name)) and self._blob(name).exists(timeout=self.TIMEOUT_S)

    def latest(self) -> str | None:
        blob = self._blob(LATEST)
        try:
            if not blob.exists(timeout=self.TIMEOUT_S):
                return None
            name = blob.download_as_bytes(timeout=self.TIMEOUT_S).decode().strip()
            ok = self._complete(name)
        except Exception as e:
            raise self._fail("read", LATEST, e) from None
        if not ok:
            raise CheckpointError(f"{self.url}/{LATEST} names {name!r}, which is not a complete checkpoint there")
        return name

    def _delete_under(self, name: str) -> None:
        for blob in self.client.list_blobs(self.bucket, prefix=f"{self.prefix}{name}/", timeout=self.TIMEOUT_S):
            blob.delete(timeout=self.TIMEOUT_S)

    def begin(self, name: str) -> str:
        # GCS has no directory rename: a save writes under its final name, so objects left there
        # by a save that was cut short (never latest) go first, or a stale shard could outlive it.
        try:
            self._delete_under(name)
        except Exception as e:
            raise self._fail("clear", name, e) from None
        return ""

    def storage_writer(self, name: str, token: str) -> StorageWriter:
        from workloads.gcs_dcp import GCSWriter

        return GCSWriter(self.bucket, f"{self.url}/{name}")

    def commit(self, name: str, token: str) -> str:
        try:
            self._blob(LATEST).upload_from_string(name + "\n", timeout=self.TIMEOUT_S)
        except Exception as e:
            raise self._fail("upload", LATEST, e) from None
        return f"{self.url}/{name}"

    def write_refused(self, name: str, token: str) -> str | None:
        return None  # the upload's own error already says why

    def abort(self, name: str, token: str) -> None:
        try:
            self._delete_under(name)
        except Exception:  # best effort: what is left is never latest, and the next begin clears it
            pass

    def storage_reader(self, name: str) -> StorageReader:
        from workloads.gcs_dcp import GCSReader

        return GCSReader(self.bucket, f"{self.url}/{name}")

    def load_full_state(self, name: str) -> dict[str, Any]:
        try:
            with tempfile.NamedTemporaryFile(suffix=".pt") as f:
                try:
                    self._blob(name).download_to_filename(f.name, timeout=max(self.TIMEOUT_S, 600))
                except Exception as e:
                    raise self._fail("download", name, e) from None
                return load_file(
                    f.name,
                    shown=f"{self.url}/{name}",
                    fix=f"; point {self.url}/{LATEST} at an older step_*, or pass another --checkpoint-dir",
                )
        except OSError as e:  # the temp file could not be created or removed
            raise CheckpointError(
                f"cannot stage {self.url}/{name} in {tempfile.gettempdir()}: "
                f"{e.strerror or e}; free space there or point TMPDIR at a larger disk"
            ) from None

    def prune(self, keep: int) -> list[str]:
        latest = self.latest()
        try:
            found: set[str] = set()
            for b in self.client.list_blobs(self.bucket, prefix=self.prefix, timeout=self.TIMEOUT_S):
                rel = b.name[len(self.prefix) :]
                top, _, rest = rel.partition("/")
                if (_NAME.match(top) and rest == METADATA) or (_PT_NAME.match(top) and not rest):
                    found.add(top)
        except Exception as e:
            raise self._fail("list", "", e) from None
        names = sorted(found, key=_step_of)
        gone = [n for n in names[:-keep] if n != latest]
        for n in gone:
            try:
                if _NAME.match(n):
                    # .metadata first: a prune cut short leaves an incomplete checkpoint, never a
                    # complete-looking one with shards missing.
                    self._blob(f"{n}/{METADATA}").delete(timeout=self.TIMEOUT_S)
                    self._delete_under(n)
                else:
                    self._blob(n).delete(timeout=self.TIMEOUT_S)
            except Exception as e:
                raise self._fail("delete", n, e) from None
        return gone
