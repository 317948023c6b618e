"""Shared fixtures: `sim_cluster(n)` starts n real sshd nodes (see tests/simcluster.py); every test
keeps gpufleet state under its tmp_path; `small_tmpfs` mounts a small disk for full-disk tests.

Two kinds of simulated node: `sim_cluster` nodes share this machine's disk (its venv, checkout
and pip configuration: the tests of the launch itself, which need torch on the nodes without
building it); `bare_nodes` (one cluster the bare-node modules share) and `bare_cluster` nodes
are what `pulumi up` gives (the system python only, a package index on the network), for the
tests of what gpufleet must bring to a node itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.simcluster import SimCluster
from tests.simindex import wheel_cache
from tests.support import BARE_NODE_ENV, BARE_NODES, require_netns


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


def _bare_nodes_possible() -> None:
    require_netns("bare nodes need root and ip netns (one mount and network namespace per node)")


@pytest.fixture(scope="module")
def bare_cluster(tmp_path_factory):
    """Factory, one per test module: `cluster = bare_cluster(3)` starts 3 bare nodes and the
    cluster's package index (SimCluster(bare=True, index=...)); the wheels are downloaded once
    per machine (tests/simindex.py). For a module that needs nodes nobody else touched (what a
    fresh node looks like); the others share `bare_nodes`. Torn down after the module."""
    _bare_nodes_possible()
    started: list[SimCluster] = []

    def make(n: int, **kw) -> SimCluster:
        workdir = tmp_path_factory.mktemp("bare")
        cluster = SimCluster(n, workdir=workdir, bare=True, index=wheel_cache(), **kw)
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()


@pytest.fixture(scope="session")
def bare_nodes(tmp_path_factory):
    """ONE cluster of BARE_NODES bare nodes (and the package index) for every module that uses
    it, as a fleet serves job after job: gpufleet's code is sent and the workloads environment
    built once, by whichever test comes first, and found there by the rest. Such a module marks
    itself `BARE_GROUP` (tests/support.py) so xdist runs all of them on one worker (a session
    fixture is per worker). Its tests must not depend on each other's order: each works in
    directories of its own (its job id, its own paths on the nodes), asserts what it did from
    what was there before it, and leaves every node up, nothing running and nothing it planted.
    A test that needs fewer nodes, or a controller host, names them in a hostfile of its own
    (tests/support.py `hostfile_of`). Every session on the nodes has BARE_NODE_ENV. Torn down at
    the end of the session."""
    _bare_nodes_possible()
    cluster = SimCluster(
        BARE_NODES,
        workdir=tmp_path_factory.mktemp("bare-shared"),
        bare=True,
        index=wheel_cache(),
        node_env={i: dict(BARE_NODE_ENV) for i in range(BARE_NODES)},
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Launches write known_hosts under GPUFLEET_STATE_DIR: here, never the user's ~/.cache."""
    monkeypatch.setenv("GPUFLEET_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def small_tmpfs(tmp_path):
    """Factory: mount a tmpfs of the given size (needs root, as the simulated cluster does);
    unmounted after the test."""
    mounted: list[Path] = []

    def make(size_bytes: int) -> Path:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mnt)], check=True)
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
