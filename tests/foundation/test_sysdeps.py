"""`make test` sets up a fresh machine itself: scripts/sysdeps.sh (through `make sysdeps`) installs
the system packages the suite needs as root, and as anyone else stops with the one apt-get line."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sysdeps.sh"
MISSING = "gpufleet-no-such-package"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root (CI runs as root)")


def _as_nobody(argv: list[str], sysdeps: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUFLEET_SYSDEPS": sysdeps}
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_root
def test_a_user_without_root_gets_the_one_apt_line_and_exit_2():
    r = _as_nobody(["bash", str(SCRIPT)], f"procps {MISSING}")
    assert r.returncode == 2
    assert r.stdout == ""
    # One line, naming only what is missing (procps is there), runnable as written.
    assert r.stderr == (
        f"sysdeps: missing system packages; run as root: apt-get update && apt-get install -y {MISSING}\n"
    )


@needs_root
def test_make_test_stops_before_running_anything_when_packages_are_missing():
    r = _as_nobody(["make", "-s", "test", "VENV=/nonexistent-venv"], MISSING)
    assert r.returncode == 2
    assert f"apt-get install -y {MISSING}" in r.stderr
    # The venv target never ran: nothing was created or installed.
    assert not Path("/nonexistent-venv").exists()
    assert "pytest" not in r.stdout + r.stderr


def test_with_everything_installed_it_does_nothing_and_says_nothing():
    r = subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "GPUFLEET_SYSDEPS": "procps"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_the_suite_and_ci_install_from_the_same_list():
    makefile = (ROOT / "Makefile").read_text()
    assert "test: sysdeps venv" in makefile
    assert "scripts/sysdeps.sh" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "apt-get install -y -qq make" in ci
    # CI keeps no second package list of its own.
    assert "openssh-server" not in ci


def test_the_script_passes_shellcheck():
    assert shutil.which("shellcheck"), "shellcheck is not installed (make sysdeps installs it)"
    r = subprocess.run(
        ["shellcheck", str(SCRIPT), str(ROOT / "bench" / "gpu_checks.sh")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout
