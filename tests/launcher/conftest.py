"""Launcher tests write `runs/` under tmp_path; keep CliRunner runs out of the repository."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    # known_hosts files per cluster go under GPUFLEET_STATE_DIR, not the user's ~/.cache.
    monkeypatch.setenv("GPUFLEET_STATE_DIR", str(tmp_path / "state"))
