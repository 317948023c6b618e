"""Failure scenarios (issue 7) run alone: `pytest tests/failures`. Each launch writes its runs/
and known_hosts under tmp_path, never into the repository or ~/.cache."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def small_tmpfs(tmp_path):
    """Factory: mount a tmpfs of the given size (root); unmounted after the test."""
    import subprocess

    mounted = []

    def make(size_bytes: int):
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mnt)], check=True)
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
