"""Reading a checkpoint that another node may have written, without running what it names.

DCP reads a checkpoint's `.metadata` with pickle.load, and its non-tensor items with
torch.load(weights_only=False) (torch/distributed/checkpoint/filesystem.py `read_metadata`,
default_planner.py `load_bytes`): a file that names a callable runs it. A local-tier copy may
have been sent by a peer node (gpufleet.replica), and every node writes --checkpoint-dir; no node
may get more power over another than the launcher gave it, so both tiers restore through
allowlists: the metadata may name only DCP's own metadata classes and torch's sizes, dtypes and
layouts (`metadata_problem`); the items only what torch.load(weights_only=True) allows, tensors
and plain containers (`SafeLoadPlanner`).
"""

from __future__ import annotations

import enum
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

__all__ = ["METADATA", "metadata_problem", "SafeLoadPlanner"]

METADATA = ".metadata"
_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "BytesStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),  # Python 3.13's home of it
        ("collections", "OrderedDict"),
    }
)


def _enum_member(cls: Any, name: str) -> Any:
    """`getattr` as a pickle of an Enum member uses it (some Pythons pickle a member as
    `getattr(EnumClass, NAME)`): an Enum class's member, and nothing else."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not an Enum member")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no checkpoint's metadata holds")


def metadata_problem(where: str | os.PathLike[str] | FileSystemReader) -> str | None:
    """Why the DCP metadata of checkpoint `where` (a directory, or the reader DCP will read it
    with: a directory's or workloads.gcs_dcp's) must not be loaded: it cannot be read, or it names
    something other than DCP's metadata classes. None when it may."""
    reader = where if isinstance(where, FileSystemReader) else FileSystemReader(where)
    try:
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, METADATA), "rb") as f:
            data = f.read()
    except Exception as e:  # noqa: BLE001 - a file system's or a bucket's error
        return f"its {METADATA} cannot be read: {getattr(e, 'strerror', None) or e}"
    try:
        _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any way a pickle fails
        return f"its {METADATA} is refused: {e}"
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with each non-tensor item read by torch.load(weights_only=True)
    first: an item that names a callable fails the load before the default reads it."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)
