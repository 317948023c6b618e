"""The node side of `launch prune` (launcher.code.node_prune) as a program, without a network:
a prune and a launch that uses the same directory at the same moment (leases), partial objects
a cut transfer left, and a stray file where it expects directories."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launcher.code import node_agent, node_prune

OLD = time.time() - 10 * 86400


def _scan(home: Path, remove: bool, older_than_s: float = 86400) -> dict:
    r = subprocess.run(
        [sys.executable, "-I", "-S", "-c", Path(node_prune.__file__).read_text(), "scan"],
        input=json.dumps({"older_than_s": older_than_s, "remove": remove}).encode(),
        capture_output=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.decode().split(" result ", 1)[1])


def _old_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "f").write_text("x")
    os.utime(path, (OLD, OLD))
    return path


def test_a_launch_holding_a_directory_keeps_it_from_a_prune_that_found_it_old(tmp_path, monkeypatch):
    g = tmp_path / ".gpufleet"
    work = _old_dir(g / "work" / "j1")
    idle = _old_dir(g / "work" / "j2")
    monkeypatch.setattr(node_agent, "G", str(g))
    fd = node_agent.lease(str(work))  # a launch's preparation, using work/j1 right now
    try:
        items = {i["path"]: i for i in _scan(tmp_path, remove=True)["items"]}
    finally:
        os.close(fd)
    assert items[str(work)]["kept"] == "a launch is using it now" and work.is_dir()
    assert items[str(idle)]["removed"] and not idle.exists()


def test_a_directory_used_after_the_scan_is_checked_again_under_its_lease(tmp_path, monkeypatch):
    g = tmp_path / ".gpufleet"
    work = _old_dir(g / "work" / "j1")
    monkeypatch.setattr(node_prune, "G", str(g))
    item = {"kind": "work", "path": str(work)}
    os.utime(work)  # a launch marked it used between the scan and the removal
    node_prune.remove_unused(item, 86400)
    assert item == {"kind": "work", "path": str(work), "kept": "used recently"} and work.is_dir()


def test_partial_objects_of_a_cut_transfer_go_and_a_live_writers_stay(tmp_path):
    objects = tmp_path / ".gpufleet" / "objects"
    objects.mkdir(parents=True)
    dead = objects / f".tmp-999999999-{'a' * 64}"  # no such process: its writer was killed
    live = objects / f".tmp-{os.getpid()}-{'b' * 64}"  # this process: still writing
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    listed = _scan(tmp_path, remove=False)
    (obj,) = [i for i in listed["items"] if i["kind"] == "objects"]
    assert obj["count"] == 1 and obj["bytes"] == 4
    _scan(tmp_path, remove=True)
    assert not dead.exists() and live.exists()


def test_objects_stay_while_a_launch_holds_the_store(tmp_path, monkeypatch):
    objects = tmp_path / ".gpufleet" / "objects"
    objects.mkdir(parents=True)
    old = objects / ("c" * 64)
    old.write_bytes(b"unlinked")
    os.utime(old, (OLD, OLD))
    monkeypatch.setattr(node_agent, "G", str(tmp_path / ".gpufleet"))
    fd = node_agent.lease(str(objects), fcntl.LOCK_SH)
    try:
        (obj,) = [i for i in _scan(tmp_path, remove=True)["items"] if i["kind"] == "objects"]
    finally:
        os.close(fd)
    assert obj["kept"] == "a launch is using the store now" and old.exists()
    (obj,) = [i for i in _scan(tmp_path, remove=True)["items"] if i["kind"] == "objects"]
    assert obj["removed"] and not old.exists()


def test_a_stray_file_in_node_runs_does_not_stop_the_scan(tmp_path):
    runs = tmp_path / ".gpufleet" / "node-runs"
    runs.mkdir(parents=True)
    (runs / "notes.txt").write_text("a file someone left\n")
    done = _old_dir(runs / "job1" / "0.0")
    (done / "rc").write_text("0\n")
    os.utime(done, (OLD, OLD))
    items = _scan(tmp_path, remove=False)["items"]
    assert [i["path"] for i in items if i["kind"] == "run output"] == [str(done)]


def test_a_launchs_preparation_marks_the_objects_it_finds_as_used(tmp_path):
    body = b"kept\n"
    sha = hashlib.sha256(body).hexdigest()
    objects = tmp_path / ".gpufleet" / "objects"
    objects.mkdir(parents=True)
    (objects / sha).write_bytes(body)
    os.utime(objects / sha, (OLD, OLD))
    req = {"snapshots": [{"hash": "h", "dest": "work/j9", "files": [["a.txt", sha, 0o644]], "copy": True}]}
    r = subprocess.run(
        [sys.executable, "-I", "-S", "-c", Path(node_agent.__file__).read_text(), "prepare"],
        input=json.dumps(req).encode(),
        capture_output=True,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert time.time() - (objects / sha).stat().st_mtime < 86400  # a prune now finds it used
    assert (tmp_path / ".gpufleet" / "work" / "j9" / "a.txt").read_bytes() == body


def test_a_kept_log_goes_once_nothing_was_written_to_it_for_older_than(tmp_path):
    """logs/JOB/ (an attached launch's output its nodes kept, node_agent.Keep): a run still
    writing lines keeps its directory young whatever the directory's own mtime says."""
    logs = tmp_path / ".gpufleet" / "logs"
    old = _old_dir(logs / "job-old")
    os.utime(old / "f", (OLD, OLD))
    writing = _old_dir(logs / "job-writing")  # the directory is old, its log was written just now
    items = {i["path"]: i for i in _scan(tmp_path, remove=True)["items"] if i["kind"] == "kept log"}
    assert items[str(old)].get("removed") and not old.exists()
    assert items[str(writing)]["kept"] == "used recently" and writing.exists()
