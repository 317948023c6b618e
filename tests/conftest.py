"""Shared fixtures. `sim_cluster(n)` starts n real sshd nodes (see tests/simcluster.py)."""

from __future__ import annotations

import shutil

import pytest

from tests.simcluster import SimCluster


@pytest.fixture
def sim_cluster(tmp_path):
    """Factory: `cluster = sim_cluster(3)`. Every cluster started is torn down, pass or fail."""
    if not shutil.which("sshd") and not shutil.which("/usr/sbin/sshd"):
        pytest.fail("openssh-server is not installed (the README's `make test` / .ci/run installs it)")
    started: list[SimCluster] = []

    def make(n: int, **kw) -> SimCluster:
        cluster = SimCluster(n, workdir=tmp_path / f"sim{len(started)}", **kw)
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()
