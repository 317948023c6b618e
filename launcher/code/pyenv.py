"""What defines a job's Python environment, and its key: the requirements (gpufleet's
`workloads` extra for launch train and nccl-tests; for run and exec `--requirements FILE`, else
the --sync directory's uv.lock, else its pyproject.toml, else its requirements.txt) and where
packages come from (--index-url, --extra-index-url, --find-links as pip has them, else the
stack output `packageIndex`, else PyPI). Each node builds it with uv into
~/.gpufleet/envs/KEY-MARK (launcher.code.node_agent), KEY the hash of all of that and MARK of
what the node chose (its torch index, its Python): a launch whose environment exists builds
nothing, and a changed requirement is a new environment. A uv.lock installs with its hashes
(`uv pip install --require-hashes`), torch included: the lock, not the driver, names its wheel.

On a GPU node torch comes from the PyTorch index of the newest CUDA its driver runs
(`TORCH_INDEXES`), as an extra index, which uv prefers over the main one
(https://docs.astral.sh/uv/pip/compatibility/#packages-that-exist-on-multiple-indexes).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.contracts import uv_requirement
from launcher.core.types import UserError

__all__ = ["EnvSpec", "TORCH_INDEXES", "requirement_source", "workloads_requirements", "PYPI"]

PYPI = "https://pypi.org/simple"

# (minimum driver, index), newest CUDA first: the driver each CUDA toolkit needs on Linux
# (NVIDIA's CUDA Toolkit release notes, table "CUDA Toolkit and Corresponding Driver Versions":
# https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html#id5) for the CUDA builds
# PyTorch publishes (https://pytorch.org/get-started/locally/, the `--index-url
# https://download.pytorch.org/whl/cuXYZ` lines). uv's own `--torch-backend auto` picks the same
# way (astral-sh/uv, crates/uv-torch/src/backend.rs). A driver older than the last row keeps the
# main index's torch.
TORCH_INDEXES: tuple[tuple[str, str], ...] = (
    ("580.65.06", "https://download.pytorch.org/whl/cu130"),  # CUDA 13.0 GA
    ("570.124.06", "https://download.pytorch.org/whl/cu128"),  # CUDA 12.8 GA
    ("560.28.03", "https://download.pytorch.org/whl/cu126"),  # CUDA 12.6 GA
    ("550.54.14", "https://download.pytorch.org/whl/cu124"),  # CUDA 12.4 GA
)

# The files that define a --sync directory's environment, in the order they win.
SOURCES = ("uv.lock", "pyproject.toml", "requirements.txt")


def workloads_requirements() -> str:
    """gpufleet's `workloads` extra (what launch train's and nccl-tests' ranks import), from the
    installed gpufleet's metadata, as a requirements.txt."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("gpufleet") or []
    except PackageNotFoundError:
        raise UserError(
            "gpufleet's package metadata is missing, so the nodes' requirements are unknown; install gpufleet "
            "(pip install -e .) or pass --python with an interpreter that has them"
        ) from None
    out = []
    for r in reqs:
        name, _, marker = r.partition(";")
        if re.search(r"""extra\s*==\s*["']workloads["']""", marker):
            out.append(name.strip())
    return "".join(f"{r}\n" for r in sorted(out))


def requirement_source(sync_dir: Path | None, requirements: Path | None) -> tuple[str, dict[str, str]] | None:
    """(kind, {file name: text}) of the environment's definition, or None (nothing to build).
    `kind` is the file uv reads: requirements.txt, pyproject.toml or uv.lock (with its
    pyproject.toml)."""
    if requirements is not None:
        if not requirements.is_file():
            raise UserError(f"--requirements {requirements}: no such file; give a requirements.txt")
        return "requirements.txt", {"requirements.txt": requirements.read_text()}
    if sync_dir is None:
        return None
    for name in SOURCES:
        f = sync_dir / name
        if f.is_file():
            files = {name: f.read_text()}
            if name == "uv.lock":
                if not (sync_dir / "pyproject.toml").is_file():
                    raise UserError(f"{f} has no pyproject.toml beside it; uv exports a lock with its project")
                files["pyproject.toml"] = (sync_dir / "pyproject.toml").read_text()
            return name, files
    return None


@dataclass(frozen=True)
class EnvSpec:
    kind: str  # requirements.txt | pyproject.toml | uv.lock
    files: dict[str, str]
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    torch_indexes: tuple[tuple[str, str], ...] = field(default=TORCH_INDEXES)

    @property
    def key(self) -> str:
        text = json.dumps(
            [self.kind, sorted(self.files.items()), self.index_url, self.extra_index_urls, self.find_links],
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def main_index(self) -> str:
        return self.index_url or PYPI

    def request(self, local_ssd: list[str] | None) -> dict[str, Any]:
        """The node agent's `env` request; `local_ssd`: where a node's local SSD may be mounted
        (uv's cache goes in this account's own directory there)."""
        return {
            "key": self.key,
            "kind": self.kind,
            "files": self.files,
            "index_url": self.index_url,
            "extra_index_urls": list(self.extra_index_urls),
            "find_links": list(self.find_links),
            "torch_indexes": [list(t) for t in self.torch_indexes],
            "local_ssd": local_ssd,
            "uv": uv_requirement(),  # what a node without uv installs (gpufleet.contracts.UV)
        }
