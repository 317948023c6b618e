"""`launch prune` on bare nodes (tests/simcluster.py, `bare=True`: each node's home is its own
disk, as on a real fleet): a real `--sync` launch leaves its directory and stored files, and
prune removes what no launch used for --older-than, keeping what a running process uses and
what a detached job that has not ended still needs. The nodes are two of the session's shared
bare cluster (tests/conftest.py `bare_nodes`): what other tests left there is recent, so prune
keeps it, and what these tests plant they remove after."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launcher.test_jobs_cluster import client_env, launch
from tests.support import BARE_GROUP, LAUNCH, hostfile_of, source_args, wait_for

pytestmark = [pytest.mark.cluster, BARE_GROUP, pytest.mark.timeout(600)]

G = "/root/.gpufleet"
OLD = time.time() - 10 * 86400  # ten days ago
PLANTED = ("envs/oldkey", "work/pinned-job", "jobs/pinned-job", "work/busy-job", "work/stale-job")


@pytest.fixture
def c(bare_nodes):
    yield bare_nodes
    for i in range(2):
        for name in PLANTED:
            shutil.rmtree(bare_nodes.node_path(i, f"{G}/{name}"), ignore_errors=True)


def source(c, tmp_path: Path) -> list[str]:
    """The shared cluster's first two nodes."""
    return source_args(c, tmp_path, hostfile_of(c, tmp_path, 2))


def work_dirs(c, i: int) -> set[Path]:
    d = c.node_path(i, f"{G}/work")
    return set(d.iterdir()) if d.is_dir() else set()


def backdate(c, i: int, path: str) -> None:
    """Node i's `path` (a directory, and everything under it) last used ten days ago."""
    top = c.node_path(i, path)
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (OLD, OLD), follow_symlinks=False)
    os.utime(top, (OLD, OLD))


def plant(c, i: int, path: str, files: dict[str, bytes]) -> Path:
    d = c.node_path(i, path)
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return d


def test_prune_lists_then_removes_only_what_nothing_uses_or_needs(c, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_bytes(b"print('hello')\n" + os.urandom(2000))
    sha = hashlib.sha256((project / "main.py").read_bytes()).hexdigest()
    src = source(c, tmp_path)
    before = {i: work_dirs(c, i) for i in range(2)}
    r = launch(tmp_path, "exec", *src, "--sync", str(project), "--", "true", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    works = {i: sorted(work_dirs(c, i) - before[i]) for i in range(2)}
    (old_work,) = works[0]
    assert [p.name for p in works[1]] == [old_work.name]
    for i in range(2):
        backdate(c, i, f"{G}/work/{old_work.name}")
        backdate(c, i, f"{G}/objects")
    # An old environment, an old directory a detached job that is RECOVERING still needs (its
    # record on node 0, the job host, pins it), and an old one a running process works in.
    plant(c, 1, f"{G}/envs/oldkey", {"bin/python": b"#!/bin/sh\n", "lib/big": b"x" * 50_000})
    backdate(c, 1, f"{G}/envs/oldkey")
    plant(c, 1, f"{G}/work/pinned-job", {"ckpt.pt": b"keep me"})
    backdate(c, 1, f"{G}/work/pinned-job")
    rec = plant(
        c,
        0,
        f"{G}/jobs/pinned-job",
        {
            "state.json": json.dumps({"state": "RECOVERING"}).encode(),
            "request.json": json.dumps({"config": {"prepared": [f"{G}/work/pinned-job"]}}).encode(),
        },
    )
    for i in range(2):
        plant(c, i, f"{G}/work/busy-job", {"out.txt": b"busy"})
        backdate(c, i, f"{G}/work/busy-job")
    busy = subprocess.Popen(
        [LAUNCH, "exec", *src, "--workdir", f"{G}/work/busy-job", "--", "sleep", "300"],
        cwd=tmp_path,
        env=client_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: all(c.processes(i) for i in range(2)), 60, "the busy job's sleep on both nodes")
        time.sleep(1)
        listed = launch(tmp_path, "prune", *src, "--older-than", "1d", "--list", timeout=120)
        assert listed.returncode == 0, listed.stderr
        going = {tuple(line.split("\t")[:2]) + (line.split("\t")[3],) for line in listed.stdout.splitlines()}
        assert (("node 0", "would remove", f"{G}/work/{old_work.name}")) in going, listed.stdout
        assert (("node 1", "would remove", f"{G}/work/{old_work.name}")) in going, listed.stdout
        assert (("node 1", "would remove", f"{G}/envs/oldkey")) in going, listed.stdout
        assert "pinned-job" not in listed.stdout and "busy-job" not in listed.stdout, listed.stdout
        assert "stored files no snapshot uses" in listed.stdout  # the old objects of the --sync
        assert "kept 1: a job that has not ended needs it" in listed.stderr, listed.stderr
        assert listed.stderr.count("kept 1: in use by a running process") == 2, listed.stderr
        assert old_work.exists() and c.node_path(1, f"{G}/envs/oldkey").exists()  # --list removes nothing

        pruned = launch(tmp_path, "prune", *src, "--older-than", "1d", timeout=120)
        assert pruned.returncode == 0, pruned.stderr
        assert pruned.stdout.count("\tremoved\t") == len(listed.stdout.splitlines()), pruned.stdout
        for i in range(2):
            assert not c.node_path(i, f"{G}/work/{old_work.name}").exists()
            assert not c.node_path(i, f"{G}/objects/{sha}").exists()
        assert not c.node_path(1, f"{G}/envs/oldkey").exists()
        assert c.node_path(1, f"{G}/work/pinned-job/ckpt.pt").read_bytes() == b"keep me"
        assert c.node_path(1, f"{G}/work/busy-job/out.txt").read_bytes() == b"busy"
        assert (rec / "state.json").exists()  # job records are never pruned
        assert "freed" in pruned.stderr and "free of" in pruned.stderr
    finally:
        busy.send_signal(signal.SIGINT)
        busy.wait(timeout=60)
    c.assert_nothing_left()


def test_a_job_host_that_cannot_be_asked_means_nothing_is_removed_anywhere(c, tmp_path):
    plant(c, 1, f"{G}/work/stale-job", {"x": b"x"})
    backdate(c, 1, f"{G}/work/stale-job")
    dry = launch(tmp_path, "prune", *source(c, tmp_path), "--dry-run", timeout=60)
    assert dry.returncode == 0 and len(dry.stdout.splitlines()) == 2, dry.stdout + dry.stderr
    assert "then remove it" in dry.stdout
    c.block(0)
    try:
        # The blocked node's handshake ends at ConnectTimeout: 3 s proves what the default 10 s does.
        r = launch(
            tmp_path,
            "prune",
            *source(c, tmp_path),
            "--ssh-option",
            "ConnectTimeout=3",
            "--older-than",
            "1d",
            timeout=180,
        )
    finally:
        c.unblock(0)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert "node 0" in line and "keeps the jobs' records" in line and "nothing was removed" in line, line
    assert c.node_path(1, f"{G}/work/stale-job/x").exists()
