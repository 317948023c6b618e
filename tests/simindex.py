"""The simulated cluster's package repository: wheels downloaded once per machine, served as a
PEP 503 "simple" index (https://peps.python.org/pep-0503/) by SimCluster(..., index=WHEELS).

`wheel_cache()` fills one directory per machine (GPUFLEET_SIM_WHEELS, else
~/.cache/gpufleet/sim-wheels) with the wheels a bare node's builds need: gpufleet's
`workloads` requirements with torch pinned to the CPU 2.13.0 build this machine's pip takes from
its local disk, uv (which a node without it installs from the index), the py-spy version a node
whose job environment lacks it gets (launcher.core.stacks.PYSPY_VERSION, a manylinux wheel), and
the small packages the tests' own requirements name. It asks this machine's pip (`pip
download`), so the wheels come from wherever pip is configured to take them; a later call with
the same requirements downloads nothing (one stamp file per requirement set, under a file lock:
concurrent test workers wait for the first).
"""

from __future__ import annotations

import fcntl
import hashlib
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

from launcher.core.stacks import PYSPY_VERSION

__all__ = ["wheel_cache", "write_simple_tree", "INDEX_REQUIREMENTS", "workloads_requirements"]

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the Makefile's TORCH_SPEC: the CPU build on this machine's disk
# Small pure-Python packages the tests' own requirements.txt files name (one changes between runs).
EXTRAS = ("six==1.16.0", "six==1.17.0", "tomli==2.0.1")


def workloads_requirements() -> list[str]:
    """gpufleet's `workloads` extra, from pyproject.toml, with torch pinned to TORCH."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["workloads"]
    return [TORCH if re.match(r"torch\b", r) else r for r in extra]


INDEX_REQUIREMENTS = (*workloads_requirements(), "uv", f"py-spy=={PYSPY_VERSION}", *EXTRAS)


def _cache_dir() -> Path:
    if os.environ.get("GPUFLEET_SIM_WHEELS"):
        return Path(os.environ["GPUFLEET_SIM_WHEELS"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gpufleet" / "sim-wheels"


def wheel_cache(requirements: tuple[str, ...] = INDEX_REQUIREMENTS) -> Path:
    """The directory of wheels for `requirements` (and everything they need), downloaded the
    first time on this machine."""
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    stamp = cache / f".done-{hashlib.sha256(' '.join(sorted(requirements)).encode()).hexdigest()[:16]}"
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return cache
        # One pip call per pinned version of a package, since one resolve cannot hold two.
        groups: list[list[str]] = [[r for r in requirements if r not in EXTRAS]] + [[r] for r in EXTRAS]
        for group in groups:
            r = subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", str(cache), *group],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                raise RuntimeError(f"pip download {' '.join(group)} failed: {r.stderr.strip()[-2000:]}")
        stamp.write_text("\n".join(requirements) + "\n")
    return cache


def _project(wheel: str) -> str:
    """PEP 503's normalized project name of a wheel file (name-version-...whl)."""
    return re.sub(r"[-_.]+", "-", wheel.split("-", 1)[0]).lower()


def write_simple_tree(wheels: Path, root: Path) -> None:
    """root/simple/<project>/index.html linking root/files/<wheel> (a link to `wheels`)."""
    root.mkdir(parents=True, exist_ok=True)
    files = root / "files"
    if not files.exists():
        files.symlink_to(wheels.resolve(), target_is_directory=True)
    projects: dict[str, list[str]] = {}
    for whl in sorted(wheels.glob("*.whl")):
        projects.setdefault(_project(whl.name), []).append(whl.name)
    simple = root / "simple"
    simple.mkdir(exist_ok=True)
    page = "<!DOCTYPE html>\n<html><body>\n{}</body></html>\n"
    (simple / "index.html").write_text(page.format("".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))))
    for project, names in projects.items():
        (simple / project).mkdir(exist_ok=True)
        links = "".join(f'<a href="/files/{html.escape(n)}">{html.escape(n)}</a>\n' for n in names)
        (simple / project / "index.html").write_text(page.format(links))
