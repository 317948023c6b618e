"""A clone is the whole project: nothing in it reads, runs or cites a file outside the repository.

The team's private notes (a `shared/` folder beside the checkout) do not exist for a user who
clones the project, so a test that reads them fails for the user, and a comment that cites them
sends the reader nowhere: sources are cited by their public URL or repository and path.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}
TEXT = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".json", ".txt", ".cfg", ".ini", ""}
# What a reference to the team's notes looks like: the path beside the checkout and the two notes'
# file names. Built from parts so that this file, which must name them to find them, does not
# itself read as such a reference.
_NOTES = ("../" + "shared", "shared/" + "reference", "perf" + "-anchors", "gcp" + "-facts")
OUTSIDE = re.compile("|".join(re.escape(s) for s in _NOTES))


def _project_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file() and path.suffix in TEXT:
            out.append(path)
    return out


def test_no_project_file_reads_or_cites_a_path_outside_the_repository():
    files = _project_files()
    assert len(files) > 100  # the walk found the project
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
        for p in files
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "cite the public source instead:\n" + "\n".join(hits)


def test_the_vendored_nccl_outputs_name_their_origin():
    corpus = ROOT / "tests" / "fixtures" / "nccl-outputs"
    sources = (corpus / "SOURCES.md").read_text()
    outputs = sorted(corpus.glob("*.txt"))
    assert len(outputs) == 14
    for path in outputs:
        assert f"| {path.name} |" in sources, path.name
        first = path.read_text().splitlines()[0]
        assert re.match(r"# source: https://github\.com/[^/]+/[^/]+/blob/[0-9a-f]{40}/", first), first
