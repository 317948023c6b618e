"""Where checkpoints live: a local directory or gs://bucket/prefix, with an atomic `latest`.

A checkpoint is one file `step_00000010.pt` (a torch.save'd dict) next to a pointer `latest`
that holds the name of the newest complete one. The pointer moves only after the checkpoint is
whole, so a crash, a kill -9 or a full disk in the middle of a save leaves the previous `latest`
in place and loadable:

- local: write `.step_00000010.pt.tmp-<pid>`, fsync it, rename it to its final name, fsync the
  directory, then write `latest` the same way (rename is atomic on POSIX, rename(2)).
- GCS: an object becomes visible only when its upload completes (GCS docs, "Consistency":
  uploads are atomic), so upload the checkpoint object first and the `latest` object last.

Older checkpoints are pruned only after the new pointer is published, and never the one `latest`
names.

Every store method fails only with CheckpointError, one line that names the path and the fix:
train.py reads and writes on rank 0 and hands that error to the other ranks, so any other
exception there would leave them waiting in the next collective.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["CheckpointError", "CheckpointStore", "LocalStore", "GCSStore", "open_store",
           "checkpoint_name", "load_file"]

_NAME = re.compile(r"^step_(\d{8})\.pt$")
_TMP = re.compile(r"^\.step_\d{8}\.pt\.tmp-\d+$")
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the fix."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def _first_line(err: BaseException, limit: int = 160) -> str:
    """The head of an error's message, short enough for a one-line report."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def load_file(path: str | os.PathLike[str], *, shown: str | None = None, fix: str = "") -> dict[str, Any]:
    """Load one checkpoint file (tensors and plain data only: weights_only=True).

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
        raise CheckpointError(f"{where} is not a readable checkpoint (it holds a "
                              f"{type(state).__name__}, not a dict){fix}")
    return state


class CheckpointStore(Protocol):
    url: str

    def check(self) -> None:
        """Fail now, with a clear line, if the place cannot be written."""

    def latest(self) -> str | None:
        """Name of the newest complete checkpoint, or None."""

    def save(self, name: str, state: dict[str, Any]) -> str:
        """Write a checkpoint, then publish it as latest; returns where it went."""

    def load(self, name: str) -> dict[str, Any]: ...

    def prune(self, keep: int) -> list[str]:
        """Delete all but the newest `keep` checkpoints (never latest); returns what went."""


def open_store(url: str) -> CheckpointStore:
    return GCSStore(url) if url.startswith("gs://") else LocalStore(url)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error_in(err: BaseException) -> BaseException:
    """The first OSError in an exception's chain (the exception itself when there is none)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return err


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
            # Temp files of a save that was killed: never latest, safe to drop.
            for p in self.root.iterdir():
                if _TMP.match(p.name):
                    p.unlink(missing_ok=True)
        except OSError as e:
            raise self._fail("write checkpoints to", self.root, e) from None

    def latest(self) -> str | None:
        pointer = self.root / LATEST
        try:
            if not pointer.exists():
                return None
            name = pointer.read_text().strip()
            found = bool(_NAME.match(name)) and (self.root / name).is_file()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {pointer}: {getattr(e, 'strerror', None) or e}; "
                                  "fix its permissions, or remove it to start from step 0") from None
        if not found:
            raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint there; "
                                  "point it at an existing step_*.pt or remove it")
        return name

    def _write_atomic(self, final: Path, write: Any) -> None:
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.root)
        except (OSError, RuntimeError) as e:
            # torch.save reports ENOSPC as a RuntimeError from its zip writer ("unexpected pos");
            # the OSError underneath says what happened.
            tmp.unlink(missing_ok=True)
            raise self._fail("write", final, _os_error_in(e)) from None

    def save(self, name: str, state: dict[str, Any]) -> str:
        final = self.root / name
        self._write_atomic(final, lambda f: torch.save(state, f))
        # The pointer's temp name must not match _TMP/_NAME, so it is never taken for a checkpoint.
        self._write_atomic(self.root / LATEST, lambda f: f.write(name.encode() + b"\n"))
        return str(final)

    def load(self, name: str) -> dict[str, Any]:
        return load_file(self.root / name, fix=f"; point {self.root / LATEST} at an older step_*.pt, "
                                               "or pass another --checkpoint-dir")

    def prune(self, keep: int) -> list[str]:
        latest = self.latest()
        try:
            names = sorted(p.name for p in self.root.iterdir() if _NAME.match(p.name))
            gone = [n for n in names[:-keep] if n != latest]
            for n in gone:
                (self.root / n).unlink(missing_ok=True)
        except OSError as e:
            raise self._fail("prune old checkpoints in", self.root, e) from None
        return gone


class GCSStore:
    # A dead endpoint must fail in seconds, not after the client's 120 s default retry deadline.
    TIMEOUT_S = 30

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        bucket, _, prefix = self.url[len("gs://"):].partition("/")
        if not bucket:
            raise CheckpointError(f"--checkpoint-dir {url!r} names no bucket; use gs://BUCKET/PREFIX")
        self.prefix = prefix + "/" if prefix else ""
        try:
            from google.cloud import storage  # only runs that checkpoint to GCS need the package
        except ImportError:
            raise CheckpointError(f"--checkpoint-dir gs://{bucket} needs google-cloud-storage; "
                                  "pip install 'gpufleet[workloads]' on every node") from None
        try:
            # Finds credentials now (google.auth.default): without any it raises
            # DefaultCredentialsError, which must reach the user as one line, not a traceback.
            self.client = storage.Client()
        except Exception as e:
            raise CheckpointError(
                f"cannot open gs://{bucket}: {_first_line(e)}; give this node Google credentials "
                "(a VM service account with storage access, `gcloud auth application-default login`, "
                "or GOOGLE_APPLICATION_CREDENTIALS=/path/to/key.json) or pass another --checkpoint-dir"
            ) from None
        self.bucket = self.client.bucket(bucket)

    def _blob(self, name: str) -> Any:
        return self.bucket.blob(self.prefix + name)

    def _fail(self, action: str, name: str, err: BaseException) -> CheckpointError:
        return CheckpointError(f"cannot {action} {self.url}/{name}: {_first_line(err)}; check the bucket "
                               "name, your credentials and the network, or pass another --checkpoint-dir")

    def _stage_fail(self, name: str, err: BaseException) -> CheckpointError:
        err = _os_error_in(err)
        return CheckpointError(f"cannot stage {self.url}/{name} in {tempfile.gettempdir()}: "
                               f"{getattr(err, 'strerror', None) or _first_line(err)}; free space there "
                               "or point TMPDIR at a larger disk")

    def check(self) -> None:
        try:
            exists = self.bucket.exists(timeout=self.TIMEOUT_S, retry=None)
        except Exception as e:  # any transport or auth failure means: unreachable
            raise CheckpointError(f"cannot reach bucket gs://{self.bucket.name}: "
                                  f"{_first_line(e)}; "
                                  "check the name, credentials and network") from None
        if not exists:
            raise CheckpointError(f"bucket gs://{self.bucket.name} does not exist; create it "
                                  f"(gcloud storage buckets create gs://{self.bucket.name}) or fix --checkpoint-dir")

    def latest(self) -> str | None:
        blob = self._blob(LATEST)
        try:
            if not blob.exists(timeout=self.TIMEOUT_S):
                return None
            name = blob.download_as_bytes(timeout=self.TIMEOUT_S).decode().strip()
            ok = bool(_NAME.match(name)) and self._blob(name).exists(timeout=self.TIMEOUT_S)
        except Exception as e:
            raise self._fail("read", LATEST, e) from None
        if not ok:
            raise CheckpointError(f"{self.url}/{LATEST} names {name!r}, which is not a checkpoint there")
        return name

    def save(self, name: str, state: dict[str, Any]) -> str:
        # Stage on local disk, not in memory: a large model's state would double host RAM.
        try:
            with tempfile.NamedTemporaryFile(suffix=".pt") as f:
                try:
                    torch.save(state, f)
                    f.flush()
                except (OSError, RuntimeError) as e:  # a full disk: RuntimeError from torch's zip writer
                    raise self._stage_fail(name, e) from None
                try:
                    self._blob(name).upload_from_filename(f.name, timeout=max(self.TIMEOUT_S, 600))
                except Exception as e:
                    raise self._fail("upload", name, e) from None
        except OSError as e:  # the temp file could not be created or removed
            raise self._stage_fail(name, e) from None
        try:
            self._blob(LATEST).upload_from_string(name + "\n", timeout=self.TIMEOUT_S)
        except Exception as e:
            raise self._fail("upload", LATEST, e) from None
        return f"{self.url}/{name}"

    def load(self, name: str) -> dict[str, Any]:
        try:
            with tempfile.NamedTemporaryFile(suffix=".pt") as f:
                try:
                    self._blob(name).download_to_filename(f.name, timeout=max(self.TIMEOUT_S, 600))
                except Exception as e:
                    raise self._fail("download", name, e) from None
                return load_file(f.name, shown=f"{self.url}/{name}",
                                 fix=f"; point {self.url}/{LATEST} at an older step_*.pt, "
                                     "or pass another --checkpoint-dir")
        except OSError as e:  # the temp file could not be created or removed
            raise self._stage_fail(name, e) from None

    def prune(self, keep: int) -> list[str]:
        latest = self.latest()
        try:
            names = sorted(
                b.name[len(self.prefix):]
                for b in self.client.list_blobs(self.bucket, prefix=self.prefix, timeout=self.TIMEOUT_S)
                if _NAME.match(b.name[len(self.prefix):])
            )
        except Exception as e:
            raise self._fail("list", "", e) from None
        gone = [n for n in names[:-keep] if n != latest]
        for n in gone:
            try:
                self._blob(n).delete(timeout=self.TIMEOUT_S)
            except Exception as e:
                raise self._fail("delete", n, e) from None
        return gone
