"""The peer tier's receiver refuses what is not the tier's own, and the ring puts each shifted-down
node's ranks on it after a spare swap (gpufleet.replica)."""

from __future__ import annotations

import io
import json

import pytest

from gpufleet import local_tier as lt
from gpufleet.replica import ReplicaError, pack, prune, receive, ring_peer
from launcher.core.types import Node
from launcher.jobs.spares import split_spares, swap_in


def _own(tmp_path, step=10, rank=3, files=None):
    d = lt.rank_dir(tmp_path / "src", "job1", lt.OWN, step, rank)
    d.mkdir(parents=True)
    for name, data in (files or {".metadata": b"meta", "__0_0.distcp": b"x" * 5000}).items():
        (d / name).write_bytes(data)
    lt.write_manifest(d, step, rank, 4)
    return d


def _stream(manifest: dict, blobs: list[bytes]) -> io.BytesIO:
    text = json.dumps(manifest).encode()
    return io.BytesIO(f"{len(text)}\n".encode() + text + b"".join(blobs))


def test_a_packed_rank_directory_arrives_complete_and_verified(tmp_path):
    src = _own(tmp_path)
    dst = receive(tmp_path / "dst", "job1", io.BytesIO(b"".join(pack(src))))
    assert dst == lt.rank_dir(tmp_path / "dst", "job1", lt.PEER, 10, 3)
    m = lt.read_manifest(dst)
    assert m is not None and lt.verify(dst, m) is None
    assert lt.complete_steps(tmp_path / "dst", "job1", lt.PEER, 3) == [10]


def test_a_stream_cut_short_leaves_no_manifest_so_no_checkpoint(tmp_path):
    whole = b"".join(pack(_own(tmp_path)))
    with pytest.raises(ReplicaError, match="ended inside __0_0.distcp"):
        receive(tmp_path / "dst", "job1", io.BytesIO(whole[:-10]))
    assert lt.complete_steps(tmp_path / "dst", "job1", lt.PEER, 3) == []


def test_a_file_whose_hash_does_not_match_is_refused(tmp_path):
    whole = bytearray(b"".join(pack(_own(tmp_path))))
    whole[-1] ^= 0xFF
    with pytest.raises(ReplicaError, match="does not match its sha256"):
        receive(tmp_path / "dst", "job1", io.BytesIO(bytes(whole)))
    assert lt.complete_steps(tmp_path / "dst", "job1", lt.PEER, 3) == []


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".", "MANIFEST.json", ".MANIFEST.json.tmp-1", "", "x" * 200])
def test_file_names_that_are_not_plain_names_are_refused(tmp_path, name):
    manifest = {
        "format": lt.MANIFEST_FORMAT,
        "step": 1,
        "rank": 0,
        "world_size": 1,
        "files": {name: {"size": 1, "sha256": "0" * 64}},
    }
    with pytest.raises(ReplicaError, match="not a plain file name"):
        receive(tmp_path / "dst", "job1", _stream(manifest, [b"x"]))
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "dst" / "job1" / "peer" / "step_00000001").exists()


@pytest.mark.parametrize("job", ["../x", "a/b", "..", "", "-rf"])
def test_a_job_id_that_could_escape_the_root_is_refused(tmp_path, job):
    with pytest.raises(ReplicaError, match="not a plain name"):
        receive(tmp_path / "dst", job, io.BytesIO(b"b"))


@pytest.mark.parametrize("step,rank,world", [(-1, 0, 1), (10**8, 0, 1), (1, 5, 4), (1, -1, 4)])
def test_steps_and_ranks_out_of_range_are_refused(tmp_path, step, rank, world):
    manifest = {"format": lt.MANIFEST_FORMAT, "step": step, "rank": rank, "world_size": world, "files": {}}
    with pytest.raises(ReplicaError, match="out of range"):
        receive(tmp_path / "dst", "job1", _stream(manifest, []))


def test_a_stream_without_a_length_line_is_refused(tmp_path):
    with pytest.raises(ReplicaError, match="manifest's length"):
        receive(tmp_path / "dst", "job1", io.BytesIO(b"{not a length}\n"))


def test_prune_keeps_the_newest_complete_steps(tmp_path):
    for step in (10, 20, 30):
        receive(tmp_path / "dst", "job1", io.BytesIO(b"".join(pack(_own(tmp_path, step=step)))))
    assert prune(tmp_path / "dst", "job1", lt.PEER, 3, keep=2) == [10]
    assert lt.complete_steps(tmp_path / "dst", "job1", lt.PEER, 3) == [20, 30]


def test_the_ring_is_the_next_node_in_the_job_order_wrapping():
    order = ["a", "b", "c", "s"]
    assert [ring_peer(order, h) for h in order] == ["b", "c", "s", "a"]
    assert ring_peer(["a"], "a") is None and ring_peer(order, "zz") is None


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_after_one_swap_every_rank_finds_its_shards_on_its_node_through_the_ring(lost):
    """The spares.py renumbering: each node after the lost one takes the rank of the node before
    it, which the ring i -> i+1 has copied into its peer/."""
    order = ["n0", "n1", "n2", "s0"]
    nodes = [Node(rank=i, host=h, address=h) for i, h in enumerate(order)]
    world, spares = split_spares(nodes, 1)
    held = {h: {i} for i, h in enumerate(order[:3])}  # own/: each node's ranks before the loss
    for i, h in enumerate(order[:3]):
        held[ring_peer(order, h)] = held.get(ring_peer(order, h), set()) | {i}  # peer/
    new, _, swaps = swap_in(order, world, {lost: "unreachable"}, spares)
    assert swaps and swaps[0].into == "s0"
    for node in new:
        assert node.rank in held[node.host], f"{node.host} has rank {node.rank} but holds {held[node.host]}"
