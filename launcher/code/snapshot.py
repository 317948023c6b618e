"""A snapshot of a directory: which files go (`.gitignore` and `.gpufleetignore` rules at every
level, never `.git`), each file's content hash, and the snapshot's own hash (GPUFLEET_CODE).

The ignore rules follow gitignore(5) (https://git-scm.com/docs/gitignore#_pattern_format):
blank lines and `#` comments skipped, `!` re-includes, a trailing `/` matches directories only,
a pattern with a `/` elsewhere is anchored to the directory of its file, `*` `?` `[...]` stop at
`/`, `**` crosses directories, the last matching rule wins, and an excluded directory's files
cannot be re-included. A bracket expression is read as git's wildmatch reads it (wildmatch.c):
`[!...]`/`[^...]` negate, `[:alpha:]` and the other POSIX classes, a range whose ends are
reversed (`[z-a]`) matches its first character alone, and an unclosed `[` makes its pattern match nothing.
Lowest precedence first, as git orders them: core.excludesFile (default ~/.config/git/ignore),
the repository's `info/exclude`, the `.gitignore` files from the repository's top down to DIR,
then DIR's own `.gitignore` and `.gpufleetignore` files.

A file keeps its owner's permissions and whatever of the group's and others' read and execute
bits it has (`st_mode & 0o755`): a 0600 file is 0600 on the node, never widened, and nothing is
made writable by another account. Symbolic links to files inside DIR are followed (their content
goes); one leaving DIR is refused, named, unless `follow_links` (`--sync-follow-links`) says to
send what it points to; symbolic links to directories are left out (a loop would never end).
A name that is not UTF-8 is refused, named: the nodes get paths as JSON text.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
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
    mode: int  # the file's permission bits & 0o755 (0o600 stays 0o600)
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


# POSIX character classes as git's wildmatch knows them (wildmatch.c), ASCII as git's are.
_CLASSES = {
    "alnum": "a-zA-Z0-9",
    "alpha": "a-zA-Z",
    "blank": " \\t",
    "cntrl": "\\x00-\\x1f\\x7f",
    "digit": "0-9",
    "graph": "!-~",
    "lower": "a-z",
    "print": " -~",
    "punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
    "space": " \\t\\n\\r\\f\\v",
    "upper": "A-Z",
    "xdigit": "0-9a-fA-F",
}
_NOTHING = "(?!)"


class PatternError(ValueError):
    pass


def _bracket(glob: str, i: int) -> tuple[str, int]:
    """The regex of the bracket expression at glob[i] == "[", and where it ends; _NOTHING for
    one git's wildmatch never matches with (unclosed)."""
    j = i + 1
    negate = j < len(glob) and glob[j] in "!^"
    j += negate
    parts: list[str] = []
    first = True
    while j < len(glob) and (glob[j] != "]" or first):
        first = False
        if glob.startswith("[:", j):
            end = glob.find(":]", j + 2)
            name = glob[j + 2 : end] if end >= 0 else ""
            if name not in _CLASSES:
                raise PatternError(f"[:{name}:] is not a character class; one of {', '.join(sorted(_CLASSES))}")
            parts.append(_CLASSES[name])
            j = end + 2
            continue
        c = glob[j + 1] if glob[j] == "\\" and j + 1 < len(glob) else glob[j]
        j += 2 if glob[j] == "\\" and j + 1 < len(glob) else 1
        if j + 1 < len(glob) and glob[j] == "-" and glob[j + 1] != "]":
            hi = glob[j + 2] if glob[j + 1] == "\\" and j + 2 < len(glob) else glob[j + 1]
            j += 3 if glob[j + 1] == "\\" and j + 2 < len(glob) else 2
            # wildmatch.c matches a range's first character on its own before it reads the
            # range, which then holds nothing when reversed: `[z-a]` matches `z` alone.
            parts.append(f"{re.escape(c)}-{re.escape(hi)}" if c <= hi else re.escape(c))
            continue
        parts.append(re.escape(c))
    if j >= len(glob):  # no closing `]`: wildmatch gives up, the pattern matches nothing
        return _NOTHING, len(glob)
    if negate:
        return "[^/" + "".join(parts) + "]", j + 1
    return ("(?!/)[" + "".join(parts) + "]" if parts else _NOTHING), j + 1


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
            regex, i = _bracket(glob, i)
            out.append(regex)
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
    above: str = ""  # the snapshot's directory as seen from a rule file's directory above it

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.above:
            rel = f"{self.above}/{rel}"
        if self.base:
            if not rel.startswith(self.base + "/"):
                return False
            rel = rel[len(self.base) + 1 :]
        return bool(self.regex.fullmatch(rel))


def parse_rules(text: str, base: str = "", source: str = "", above: str = "") -> list[_Rule]:
    """The rules of one ignore file (`source`: its name, for an error); a pattern that cannot be
    read is one UserError naming the file, the line and the fix."""
    rules = []
    for lineno, raw in enumerate(text.splitlines(), 1):
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
        try:
            regex = _glob_regex(line) if anchored else "(?:.*/)?" + _glob_regex(line)
            compiled = re.compile(regex)
        except (PatternError, re.error) as e:
            raise UserError(
                f"{source or 'an ignore file'} line {lineno}: the pattern {raw.strip()!r} cannot be read ({e}); "
                "fix or remove it"
            ) from None
        rules.append(_Rule(base, compiled, negate, dir_only, above))
    return rules


def _git(root: Path, *args: str) -> list[str]:
    """git's answer in `root`, one line each; [] without git or outside a repository."""
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return r.stdout.splitlines() if r.returncode == 0 else []


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def git_rules(root: Path) -> list[_Rule]:
    """The rules git applies to `root` beyond its own ignore files, lowest precedence first:
    core.excludesFile (unset: $XDG_CONFIG_HOME/git/ignore, else ~/.config/git/ignore), the
    repository's info/exclude, and the .gitignore files between the repository's top and `root`
    (gitignore(5), DESCRIPTION)."""
    root = root.resolve()
    rules: list[_Rule] = []
    configured = _git(root, "config", "--path", "--get", "core.excludesFile")
    if configured:
        excludes = Path(os.path.expanduser(configured[0]))
    else:
        xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
        excludes = Path(xdg) / "git" / "ignore"
    found = _git(root, "rev-parse", "--path-format=absolute", "--show-toplevel", "--git-common-dir")
    top, common = (Path(found[0]), Path(found[1])) if len(found) == 2 else (root, root / ".git")
    if not root.is_relative_to(top):
        top = root
    above = root.relative_to(top).as_posix()
    above = "" if above == "." else above
    text = _read(excludes)
    if text is not None:
        rules += parse_rules(text, "", str(excludes), above)
    text = _read(common / "info" / "exclude")
    if text is not None:
        rules += parse_rules(text, "", str(common / "info" / "exclude"), above)
    parts = root.relative_to(top).parts
    for d in (top.joinpath(*parts[:n]) for n in range(len(parts))):  # the top, down to root's parent
        text = _read(d / ".gitignore")
        if text is not None:
            rules += parse_rules(text, "", str(d / ".gitignore"), root.relative_to(d).as_posix())
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


def take_snapshot(
    root: Path,
    cache: Path | None = None,
    only: tuple[str, ...] = (),
    follow_links: bool = False,
    git_excludes: bool = True,
) -> Snapshot:
    """Walk `root` (only the top-level entries named in `only`, when given) and hash every file
    the ignore rules keep; `follow_links`: send what a link leaving `root` points to;
    `git_excludes`: git's own exclude files too (a person's directory, not gpufleet's code)."""
    hashes = _HashCache(cache)
    entries: list[FileEntry] = []
    rules: list[_Rule] = git_rules(root) if git_excludes else []
    top = root.resolve()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        for name in IGNORE_FILES:
            f = here / name
            if f.is_file():
                rules += parse_rules(f.read_text(errors="replace"), rel_dir, str(f))
        keep_dirs = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if d == ".git" or (here / d).is_symlink() or (not rel_dir and only and d not in only):
                continue
            if not _ignored(rules, rel, True):
                _check_name(root, rel)
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
            _check_name(root, rel)
            if path.is_symlink() and not follow_links and not path.resolve().is_relative_to(top):
                raise UserError(
                    f"--sync {root}: {rel} is a link to {path.resolve()}, outside the directory; send what it "
                    "points to with --sync-follow-links, or leave it out (.gpufleetignore)"
                )
            mode = st.st_mode & 0o755  # the owner's bits and others' read/execute: never widened
            entries.append(FileEntry(rel, hashes.sha256(path, st), mode, st.st_size))
    hashes.save()
    return Snapshot(tuple(sorted(entries, key=lambda e: e.path)))


def _check_name(root: Path, rel: str) -> None:
    """A name must be UTF-8: the nodes get paths as JSON text (os.walk keeps undecodable bytes
    as surrogates, which no encoder takes)."""
    try:
        rel.encode()
    except UnicodeEncodeError:
        raw = os.fsencode(rel)
        raise UserError(
            f"--sync {root}: the name {raw!r} is not UTF-8; rename it, or leave it out (.gpufleetignore)"
        ) from None


def code_root() -> Path:
    """The directory holding the installed gpufleet/ and workloads/ packages."""
    import gpufleet

    return Path(gpufleet.__file__).resolve().parent.parent


def code_snapshot() -> Snapshot:
    """gpufleet's own code the nodes run (gpufleet/ and workloads/, no bytecode), from the
    installed packages' directory."""
    snap = take_snapshot(code_root(), only=("gpufleet", "workloads"), git_excludes=False)
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
