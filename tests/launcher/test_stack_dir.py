"""`--stack NAME` from any directory: the stack's outputs are read with `pulumi -C DIR`, DIR from
--stack-dir, $GPUFLEET_STACK_DIR, or the gpufleet checkout the launcher runs from; a directory
that is not a Pulumi project is one line and exit 2. `pulumi` here is a script that records its
arguments and prints the outputs `pulumi stack output --json` prints."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.cluster import discovery

ROOT = Path(__file__).resolve().parents[2]

FAKE_PULUMI = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    with open({calls!r}, "a") as f:
        f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd()}}) + "\\n")
    print(json.dumps({outputs!r}))
    """
)

OUTPUTS = {
    "cluster": "llm-dev",
    "project": "p",
    "zone": "us-central1-a",
    "machineType": None,
    "nodes": [
        {"name": f"llm-dev-{i}", "index": i, "internalIp": f"10.0.0.{i + 2}", "externalIp": None} for i in (0, 1)
    ],
}


@pytest.fixture
def pulumi(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.jsonl"
    script = bin_dir / "pulumi"
    script.write_text(FAKE_PULUMI.format(python=sys.executable, calls=str(calls), outputs=OUTPUTS))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(discovery.STACK_DIR_ENV, raising=False)
    return lambda: [json.loads(line) for line in calls.read_text().splitlines()]


def _project(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "Pulumi.yaml").write_text("name: gpufleet\nruntime: python\n")
    return path


def _hosts(*args: str):
    return CliRunner().invoke(main, ["hosts", "--stack", "llm-dev", "--no-iap", "--dry-run", *args])


def test_the_stack_is_read_in_the_gpufleet_checkout_from_any_directory(pulumi, tmp_path, monkeypatch):
    elsewhere = tmp_path / "my-project"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = _hosts()
    assert r.exit_code == 0, r.output
    (call,) = pulumi()
    assert call["argv"] == ["-C", str(ROOT), "stack", "output", "--json", "--stack", "llm-dev"]
    assert "llm-dev-1" in r.output or "10.0.0.3" in r.output


def test_stack_dir_and_the_environment_name_the_project(pulumi, tmp_path, monkeypatch):
    given, from_env = _project(tmp_path / "given"), _project(tmp_path / "env")
    monkeypatch.setenv(discovery.STACK_DIR_ENV, str(from_env))
    assert _hosts().exit_code == 0
    assert _hosts("--stack-dir", str(given)).exit_code == 0  # the flag wins over the variable
    assert [c["argv"][:2] for c in pulumi()] == [["-C", str(from_env)], ["-C", str(given)]]


def test_a_stack_dir_that_is_not_a_pulumi_project_is_one_line_exit_2(pulumi, tmp_path, monkeypatch):
    r = _hosts("--stack-dir", str(tmp_path))
    assert r.exit_code == 2, r.output
    assert r.output == (
        f"error: --stack-dir {str(tmp_path)!r} is not a Pulumi project (no Pulumi.yaml there); pass --stack-dir "
        "with the gpufleet checkout you ran `pulumi up` in (or set GPUFLEET_STACK_DIR)\n"
    )
    monkeypatch.setenv(discovery.STACK_DIR_ENV, str(tmp_path / "nowhere"))
    r = _hosts()
    assert r.exit_code == 2 and r.output.startswith("error: GPUFLEET_STACK_DIR ") and len(r.output.splitlines()) == 1
    assert not (tmp_path / "calls.jsonl").exists()  # refused before pulumi ran
