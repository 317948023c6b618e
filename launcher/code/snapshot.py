"""A snapshot of a directory: which files go (`.gitignore` and `.gpufleetignore` rules at every
level, never `.git`), each file's content hash, and the snapshot's own hash (GPUFLEET_CODE).

The ignore rules follow gitignore(5) (https://git-scm.com/docs/gitignore#_pattern_format):
blank lines and `#` comments skipped, `!` re-includes, a trailing `/` matches directories only,
a pattern with a `/` elsewhere is anchored to the directory of its file, `*` `?` `[...]` stop at
`/`, `**` crosses directories, the last matching rule wins, and an excluded directory's files
cannot be re-included. Symbolic links to files are followed (their content goes); symbolic links
to directories are left out (a loop would never end).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from launcher.core.types import UserError

__all__ = [
    "Snapshot",
    "FileEntry",
    "take_snapshot",
    "code_snapshot",
    "DEFAULT_SYNC_MAX",
    "parse_size",
    "human_size",
    "IGNORE_FILES",
]

IGNORE_FILES = (".gitignore", ".gpufleetignore")
DEFAULT_SYNC_MAX = 100 * 1000 * 1000  # the "over 100 MB"


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, with /
    sha256: str
    mode: int  # 0o755 or 0o644
    size: int


@dataclass(frozen=True)
class Snapshot:
    files: tuple[FileEntry, ...]

    @property
    def hash(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.path}\0{f.sha256}\0{f.mode:o}\n".encode())
        return h.hexdigest()[:16]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def manifest(self) -> list[list]:
        return [[f.path, f.sha256, f.mode] for f in self.files]


def _glob_regex(glob: str) -> str:
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("/**", i) and i + 3 == len(glob):
            out.append("/.*")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = glob.find("]", i + 2)
            if j < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = glob[i + 1 : j]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j + 1
        elif c == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class _Rule:
    base: str  # the directory of the ignore file, relative ("" at the top)
    regex: re.Pattern
    negate: bool
    dir_only: bool

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not rel.startswith(self.base + "/"):
                return False
            rel = rel[len(self.base) + 1 :]
        return bool(self.regex.fullmatch(rel))


def parse_rules(text: str, base: str = "") -> list[_Rule]:
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):  # "\ " keeps a trailing space
            line += " "
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        elif line.startswith("\\"):
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/")
        regex = _glob_regex(line) if anchored else "(?:.*/)?" + _glob_regex(line)
        rules.append(_Rule(base, re.compile(regex), negate, dir_only))
    return rules


def _ignored(rules: list[_Rule], rel: str, is_dir: bool) -> bool:
    out = False
    for rule in rules:
        if rule.matches(rel, is_dir):
            out = not rule.negate
    return out


class _HashCache:
    """Content hashes by (path, size, mtime): a re-run hashes only what changed."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict[str, list] = {}
        if path is not None:
            try:
                self.data = json.loads(path.read_text())
            except (OSError, ValueError):
                self.data = {}

    def sha256(self, file: Path, st: os.stat_result) -> str:
        key = str(file)
        hit = self.data.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        h = hashlib.sha256()
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        self.data[key] = [st.st_size, st.st_mtime_ns, h.hexdigest()]
        return h.hexdigest()

    def save(self) -> None:
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.data))
                tmp.replace(self.path)
            except OSError:
                pass


def take_snapshot(root: Path, cache: Path | None = None, only: tuple[str, ...] = ()) -> Snapshot:
    """Walk `root` (only the top-level entries named in `only`, when given) and hash every file
    the ignore rules keep."""
    hashes = _HashCache(cache)
    entries: list[FileEntry] = []
    rules: list[_Rule] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        for name in IGNORE_FILES:
            f = here / name
            if f.is_file():
                rules += parse_rules(f.read_text(errors="replace"), rel_dir)
        keep_dirs = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if d == ".git" or (here / d).is_symlink() or (not rel_dir and only and d not in only):
                continue
            if not _ignored(rules, rel, True):
                keep_dirs.append(d)
        dirnames[:] = keep_dirs
        for name in sorted(filenames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if name == ".git" or (not rel_dir and only) or _ignored(rules, rel, False):
                continue
            path = here / name
            try:
                st = path.stat()
            except OSError:  # a dangling link
                continue
            if not path.is_file():
                continue
            mode = 0o755 if st.st_mode & 0o111 else 0o644
            entries.append(FileEntry(rel, hashes.sha256(path, st), mode, st.st_size))
    hashes.save()
    return Snapshot(tuple(sorted(entries, key=lambda e: e.path)))


def code_snapshot() -> Snapshot:
    """gpufleet's own code the nodes run (gpufleet/ and workloads/, no bytecode), from the
    installed packages' directory."""
    import gpufleet

    root = Path(gpufleet.__file__).resolve().parent.parent
    snap = take_snapshot(root, only=("gpufleet", "workloads"))
    return Snapshot(tuple(f for f in snap.files if "__pycache__/" not in f.path and not f.path.endswith(".pyc")))


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3}


def parse_size(text: str, flag: str = "--sync-max") -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"{flag} {text!r} is not a size; give one like 500MB or 2GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_size(n: int) -> str:
    """1234 -> "1.2 kB", 100_000_000 -> "100.0 MB" (powers of 1000, as --sync-max reads them)."""
    for unit, size in (("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
