"""Writing a file so that a reader never sees half of it: the project's one atomic-write helper.

The new content goes to a temporary file beside the target, is flushed to disk (fsync), and then
replaces the target in one rename (rename(2) is atomic within a filesystem, POSIX). A reader, a
crash or a full disk leaves either the old file or the new one whole; on an error the temporary
file is removed and the target is untouched.

``replacing(path)`` yields the temporary path for writers that write a file themselves
(``csv``, matplotlib's ``savefig``); ``write_text(path, text)`` is the common case;
``temp_path(path)`` names the temporary file, for a caller that checks early that it can be made.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["fsync_dir", "replacing", "temp_path", "write_text"]


def temp_path(path: str | Path) -> Path:
    """The temporary file `replacing(path)` writes: beside `path`, hidden, this process's own."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path in `path`'s directory (same suffix, so writers that choose a format by
    it still do); when the block ends without error it is synced and renamed onto `path`."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """`path` holds `text`, whole, or keeps what it held."""
    with replacing(path) as tmp:
        tmp.write_text(text)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename into it, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
