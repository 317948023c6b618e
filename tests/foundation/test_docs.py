"""The documentation says what the code does: the README stays a short entry whose links resolve,
every example runs as written (it names its nodes), and the facts the docs state are read here
from the code that decides them. `make docs` (mkdocs build --strict) checks the site's own links
and anchors; these are the checks a link checker cannot make."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _example_lines(text: str) -> list[str]:
    """The commands of fenced (```) and indented (4 spaces) code blocks, as a user would paste
    them: a line ending in a backslash joined with the next."""
    lines, fenced, held = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            held += line.strip()
            if held.endswith("\\"):
                held = held[:-1] + " "
                continue
            lines.append(held)
        held = ""
    return lines


# A command that names no node source runs only in these forms: reading output that exists
# (--from), drawing a record (--plot), and the memory plan (--dry-run with --nodes and --machine-type).
_NODE_SOURCE = re.compile(r"--(stack|outputs|hostfile|label|local)\b")
_NO_SOURCE_NEEDED = re.compile(r"--from\b|--plot\b|--help\b|\s-h\b")


# `launch top: ...` is the view's title in an output sample, not a command.
_LAUNCH = re.compile(r"launch (train|run|exec|hosts|doctor|top|nccl-tests|jobs|logs|attach|stop)\b(?!:)")


def _needs_no_source(cmd: str) -> bool:
    plan = "--dry-run" in cmd and "--nodes" in cmd and "--machine-type" in cmd
    return bool(_NODE_SOURCE.search(cmd) or _NO_SOURCE_NEEDED.search(cmd)) or plan


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if not t.startswith("http")]
    assert links and [t for t in links if not (ROOT / t).exists()] == []


def test_every_launch_example_names_its_nodes():
    """An example without a node source fails as written (`give exactly one node source`)."""
    bad = []
    for page in _pages():
        for line in _example_lines(page.read_text()):
            for part in line.removeprefix("$ ").split(" | "):
                if _LAUNCH.match(part) and not _needs_no_source(part):
                    bad.append(f"{page.relative_to(ROOT)}: {part}")
    assert bad == []


def test_detach_help_names_the_controller_host():
    from launcher.cli.main import main

    out = CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output
    detach = " ".join(out.split("--detach", 1)[1].split("--", 1)[0].split())
    assert "controller host" in detach and "controller on node 0" not in detach


def test_the_restart_roles_permissions_are_the_ones_documented():
    from infra.restart_grant import RESTART_PERMISSIONS

    fleet = (DOCS / "fleet.md").read_text()
    section = fleet.split("**The restart role**", 1)[1].split("\n\n", 1)[0]
    assert len(RESTART_PERMISSIONS) == 3 and "exactly three permissions" in section
    assert all(f"`{p}`" in section for p in RESTART_PERMISSIONS)
    recovery = " ".join((DOCS / "recovery.md").read_text().split())
    assert all(f"`{p}`" in recovery for p in RESTART_PERMISSIONS)


def test_every_restart_reason_is_documented():
    from launcher.jobs.restarts import REASONS

    row = next(
        r for r in (DOCS / "own-code.md").read_text().splitlines() if r.startswith("| `GPUFLEET_RESTART_REASON`")
    )
    assert all(f"`{reason}`" in row for reason in (*REASONS, "shrunk"))


def test_the_sweep_step_factor_defaults_are_the_ones_documented():
    from gpufleet.collectives import SweepSpec
    from workloads.sweep_args import build_parser

    fabric = (DOCS / "fabric.md").read_text()
    row = next(r for r in fabric.splitlines() if r.startswith("| `-f` / `-i` |"))
    sweep = build_parser().parse_args([])
    assert row.split(" | ")[-1].startswith(f"`{sweep.stepfactor}` / `1M`")
    assert f"`launch nccl-tests -f`: `{SweepSpec().stepfactor}`" in row
    assert f"its `-f` is `{SweepSpec().stepfactor}`" in fabric


def test_the_client_state_paths_are_the_ones_documented(tmp_path, monkeypatch):
    """known_hosts/<cluster>-<hash> and <cluster>-<hash>/id_ed25519 under the state directory."""
    from launcher.cluster.key import cluster_slug
    from launcher.core.transport import state_dir
    from launcher.core.types import Cluster, Node

    monkeypatch.delenv("GPUFLEET_STATE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert state_dir() == tmp_path / ".cache" / "gpufleet"
    slug = cluster_slug(Cluster("llm-dev", (Node(0, "n0", "10.0.0.2"),), "a3-megagpu-8g", project="p", zone="z"))
    assert re.fullmatch(r"llm-dev-[0-9a-f]{10}", slug)
    launch = " ".join((DOCS / "launch.md").read_text().split())
    detached = " ".join((DOCS / "detached.md").read_text().split())
    assert "`~/.cache/gpufleet/known_hosts/<cluster>-<hash>`" in launch
    assert "`~/.cache/gpufleet/<cluster>-<hash>/id_ed25519`" in detached
