"""torch.distributed.checkpoint straight to and from Cloud Storage, through google-cloud-storage.

DCP's FileSystemWriter/FileSystemReader do their IO through a `FileSystemBase` (torch's own
FsspecWriter swaps in an fsspec one the same way, torch/distributed/checkpoint/_fsspec_filesystem.py).
This one maps paths `gs://bucket/prefix/step_N/__0_0.distcp` to objects and streams:

- write: every rank uploads its own shard file with a resumable upload (`BlobWriter`), in
  parallel with the other ranks; an object appears only when its upload completes (GCS docs,
  "Consistency"), so a rank killed mid-upload leaves no object at all.
- read: one ranged GET per piece a rank needs (GCS supports HTTP Range on media downloads), so a
  rank loading a resharded checkpoint fetches only its byte ranges, not whole shard files, and
  torch.load gets an in-memory piece it can seek in freely (a seek-heavy read through a buffered
  BlobReader re-fetches its whole buffer on every backward seek).
- DCP writes `.metadata` as `.metadata.tmp` and renames it: a server-side copy and a delete here,
  done by rank 0 after every rank reported its shards written, so `.metadata` is the last object of
  a checkpoint (what workloads.checkpoint.store.GCSStore takes for "complete").
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemBase, _StorageInfo

__all__ = ["GCSFileSystem", "GCSWriter", "GCSReader"]

# Resumable uploads go in chunks of a multiple of 256 KiB (google-cloud-storage fileio.BlobWriter);
# 64 MiB keeps the request count low for GB-sized shards without holding much in memory.
_CHUNK = 64 * 1024 * 1024
_TIMEOUT_S = 600


class GCSFileSystem(FileSystemBase):
    """DCP's file operations on one bucket; paths are `gs://bucket/key` strings."""

    def __init__(self, bucket: Any) -> None:
        self.bucket = bucket

    def _key(self, path: str | os.PathLike[str]) -> str:
        text = str(path)
        head = f"gs://{self.bucket.name}/"
        if not text.startswith(head):
            raise ValueError(f"{text} is not in gs://{self.bucket.name}")
        return text[len(head) :]

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        from google.cloud.storage.fileio import BlobWriter

        blob = self.bucket.blob(self._key(path), chunk_size=_CHUNK)
        if "w" in mode:
            # ignore_flush: DCP flushes between items; a GCS upload can only be finalized once.
            # On an exception BlobWriter.__exit__ cancels the upload: no partial object appears.
            with BlobWriter(blob, ignore_flush=True, timeout=_TIMEOUT_S) as stream:
                yield stream
        elif str(path).endswith("/.metadata"):  # small, read whole (pickle.load)
            yield io.BytesIO(blob.download_as_bytes(timeout=_TIMEOUT_S))
        else:
            yield _Pieces(blob)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path).rstrip("/")

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        blob = self.bucket.blob(self._key(path))
        self.bucket.copy_blob(blob, self.bucket, self._key(new_path), timeout=_TIMEOUT_S)
        blob.delete(timeout=_TIMEOUT_S)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Object stores have no directories."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).startswith("gs://")

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return bool(self.bucket.blob(self._key(path)).exists(timeout=_TIMEOUT_S))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.bucket.blob(self._key(path)).delete(timeout=_TIMEOUT_S)


class _Pieces:
    """A shard object that GCSReader reads piece by piece (see GCSReader._slice_file)."""

    def __init__(self, blob: Any) -> None:
        self.blob = blob


class GCSWriter(FileSystemWriter):
    """DCP StorageWriter for gs://bucket/prefix/step_N: one object per rank, plus `.metadata`."""

    def __init__(self, bucket: Any, path: str) -> None:
        # sync_files=False: there is no file descriptor to fsync (DCP would fall back to a
        # machine-wide os.sync()); an upload is durable once it completes.
        super().__init__(path, sync_files=False)
        self.fs = GCSFileSystem(bucket)
        self.path = self.fs.init_path(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return GCSFileSystem.validate_checkpoint_id(checkpoint_id)


class GCSReader(FileSystemReader):
    """DCP StorageReader for gs://bucket/prefix/step_N, reading byte ranges."""

    def __init__(self, bucket: Any, path: str) -> None:
        super().__init__(path)
        self.fs = GCSFileSystem(bucket)
        self.path = self.fs.init_path(path)

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> io.BytesIO:
        # One GET with a byte range per piece; checksum=None: the object's CRC covers the whole
        # object, not a range (google-cloud-storage disables it for ranges the same way).
        data = file.blob.download_as_bytes(
            start=sinfo.offset, end=sinfo.offset + sinfo.length - 1, checksum=None, timeout=_TIMEOUT_S
        )
        return io.BytesIO(data)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return GCSFileSystem.validate_checkpoint_id(checkpoint_id)
