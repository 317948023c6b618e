"""The node-local checkpoint tier's contract (gpufleet.local_tier): manifest, completeness,
verification, the private-directory rule and the step every rank agrees on."""

from __future__ import annotations

import json
import os

import pytest

from gpufleet.local_tier import (
    MANIFEST,
    OWN,
    PEER,
    LocalTierError,
    check_private,
    common_step,
    complete_steps,
    forget_after,
    rank_dir,
    read_manifest,
    verify,
    write_manifest,
)
from tests.support import require_root


def _rank_copy(root, area: str, step: int, rank: int, world: int = 2, manifest: bool = True):
    d = rank_dir(root, "job", area, step, rank)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (d / ".metadata").write_bytes(b"meta")
    if manifest:
        write_manifest(d, step, rank, world)
    return d


def test_the_layout_is_per_job_per_area_per_step_per_rank(tmp_path):
    assert rank_dir(tmp_path, "j-1", OWN, 10, 3) == tmp_path / "j-1" / "own" / "step_00000010" / "rank_00003"
    assert rank_dir(tmp_path, "j-1", PEER, 10, 3).parts[-3] == "peer"


def test_the_manifest_names_every_file_with_size_and_sha256_and_is_written_by_rename(tmp_path):
    d = _rank_copy(tmp_path, OWN, 4, 1)
    doc = json.loads((d / MANIFEST).read_text())
    assert doc["format"] == "gpufleet-local-checkpoint/1"
    assert (doc["step"], doc["rank"], doc["world_size"]) == (4, 1, 2)
    assert sorted(doc["files"]) == [".metadata", "__0_0.distcp"]
    assert doc["files"]["__0_0.distcp"]["size"] == 10240
    assert len(doc["files"]["__0_0.distcp"]["sha256"]) == 64
    assert [p.name for p in d.iterdir() if p.name.startswith(f".{MANIFEST}")] == []  # no temp file left
    assert read_manifest(d) is not None and verify(d, read_manifest(d)) is None


def test_only_a_rank_directory_with_its_manifest_is_a_complete_step(tmp_path):
    _rank_copy(tmp_path, OWN, 4, 0)
    _rank_copy(tmp_path, OWN, 8, 0)
    _rank_copy(tmp_path, OWN, 12, 0, manifest=False)  # a save cut short
    _rank_copy(tmp_path, OWN, 16, 1)  # another rank's
    assert complete_steps(tmp_path, "job", OWN, 0) == [4, 8]
    assert complete_steps(tmp_path, "job", PEER, 0) == []
    assert complete_steps(tmp_path / "none", "job", OWN, 0) == []


def test_verify_names_the_file_that_is_missing_short_or_changed(tmp_path):
    d = _rank_copy(tmp_path, PEER, 4, 0)
    m = read_manifest(d)
    data = d / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    assert verify(d, m, hashes=False) is None  # the size still matches
    assert verify(d, m) == "__0_0.distcp does not match its sha256 in MANIFEST.json"
    data.write_bytes(b"short")
    assert verify(d, m, hashes=False) == "__0_0.distcp has 5 bytes, the manifest says 10240"
    data.unlink()
    assert verify(d, m) == "__0_0.distcp is missing"


def test_a_manifest_of_another_format_or_torn_is_no_manifest(tmp_path):
    d = _rank_copy(tmp_path, OWN, 4, 0)
    (d / MANIFEST).write_text('{"format": "other/9", "step": 4}')
    assert read_manifest(d) is None
    (d / MANIFEST).write_text('{"format": "gpufleet-local')
    assert read_manifest(d) is None


def test_every_rank_restores_the_newest_step_all_of_them_have():
    assert common_step([{4, 8, 12}, {4, 8}, {8, 12}]) == 8
    assert common_step([{4, 8}, {12}]) is None
    assert common_step([]) is None
    assert common_step([[10], [10]]) == 10


def test_a_private_directory_is_made_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        p = check_private(tmp_path / "a" / "local")
    finally:
        os.umask(old)
    assert p.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("bad", ["link", "open", "file"])
def test_a_directory_that_is_not_this_accounts_own_is_refused_in_one_line(tmp_path, bad):
    p = tmp_path / "local"
    if bad == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        p.symlink_to(tmp_path / "elsewhere")
    elif bad == "open":
        p.mkdir()
        p.chmod(0o777)
    else:
        p.write_text("")
    with pytest.raises(LocalTierError) as e:
        check_private(p, flag="--local-checkpoint-dir")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--local-checkpoint-dir {p}")
    assert {"link": "a link or a file", "open": "chmod 700", "file": "a link or a file"}[bad] in line


def test_a_directory_of_another_account_is_refused(tmp_path):
    require_root("making a directory of another uid needs root")
    p = tmp_path / "local"
    p.mkdir(mode=0o700)
    os.chown(p, 65534, 65534)
    with pytest.raises(LocalTierError, match="belongs to uid 65534, not to this account"):
        check_private(p)


def test_forget_after_removes_every_newer_step_of_both_areas_and_keeps_the_rest(tmp_path):
    for area, step, rank in [("own", 10, 0), ("own", 20, 0), ("own", 30, 0), ("peer", 20, 1), ("peer", 30, 1)]:
        _rank_copy(tmp_path, area, step, rank)
    _rank_copy(tmp_path, "own", 40, 0, manifest=False)  # a save cut short: newer, removed too
    assert forget_after(tmp_path, "job", 20) == [30, 40]
    assert complete_steps(tmp_path, "job", "own", 0) == [10, 20]
    assert complete_steps(tmp_path, "job", "peer", 1) == [20]
    assert sorted(p.name for p in (tmp_path / "job" / "own").iterdir()) == ["step_00000010", "step_00000020"]
    assert forget_after(tmp_path, "job", -1) == [10, 20] and forget_after(tmp_path, "nojob", -1) == []
    assert complete_steps(tmp_path, "job", "own", 0) == [] == complete_steps(tmp_path, "job", "peer", 1)
