"""A local-tier copy may come from another node (gpufleet.replica), so a restore never runs code
a checkpoint file names: DCP's `.metadata` is read through an allowlist (a peer copy that names
anything else is skipped with one line, as a damaged one is; the tier's `load` refuses it), and
every non-tensor item through torch.load(weights_only=True) (workloads.checkpoint.local)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gpufleet.local_tier import PEER, rank_dir, write_manifest
from workloads.checkpoint.local import LocalTier, SafeLoadPlanner, metadata_problem
from workloads.checkpoint.store import CheckpointError
from workloads.collective import Ranks


class _Runs:
    """Pickled, it calls os.mkdir(path) when loaded: a trace that code from the file ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _saved(d, **state) -> dict:
    state = {"model": {"w": torch.arange(4.0)}, "trainer": b"state", **state}
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    return state


def _tier(root) -> LocalTier:
    tier = object.__new__(LocalTier)  # its collectives are not what is tested here
    tier.root, tier.job, tier.ranks, tier.keep = root, "job1", Ranks(1, 2, torch.device("cpu")), 2
    return tier


def test_a_peer_copy_whose_metadata_names_a_callable_is_skipped_and_never_run(tmp_path, capsys):
    trace = tmp_path / "ran"
    good, bad = (rank_dir(tmp_path, "job1", PEER, step, 1) for step in (4, 8))
    for d in (good, bad):
        _saved(d)
    (bad / ".metadata").write_bytes(pickle.dumps(_Runs(str(trace))))
    for step, d in ((4, good), (8, bad)):
        write_manifest(d, step, 1, 2)  # hashes that match: the sender wrote them too
    assert metadata_problem(good) is None
    assert sorted(_tier(tmp_path).restorable()) == [4]
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"warning: rank 1: skipping the peer copy {bad}: its .metadata is refused: it names "
        "posix.mkdir, which no checkpoint's metadata holds; using the next tier"
    )
    with pytest.raises(CheckpointError, match="posix.mkdir"):
        _tier(tmp_path).load({"model": {"w": torch.zeros(4)}, "trainer": b""}, bad)
    assert not trace.exists()


def test_a_non_tensor_item_that_names_a_callable_fails_the_load_before_it_runs(tmp_path):
    trace = tmp_path / "ran"
    _saved(tmp_path / "ok", extra={"n": 3, "names": ["a"]})
    into = {"model": {"w": torch.zeros(4)}, "trainer": b"", "extra": {"n": 0, "names": [""]}}
    dcp.load(into, storage_reader=dcp.FileSystemReader(tmp_path / "ok"), planner=SafeLoadPlanner(), no_dist=True)
    assert into["trainer"] == b"state" and into["extra"] == {"n": 3, "names": ["a"]}
    assert torch.equal(into["model"]["w"], torch.arange(4.0))
    _saved(tmp_path / "bad", extra=_Runs(str(trace)))
    with pytest.raises(dcp.api.CheckpointException) as refused:
        dcp.load(
            {"model": {"w": torch.zeros(4)}, "trainer": b"", "extra": None},
            storage_reader=dcp.FileSystemReader(tmp_path / "bad"),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert "unsupported GLOBAL posix.mkdir" in repr(refused.value.failures)
    assert not trace.exists()


class _Member:
    """Pickled, it is `getattr(CLS, NAME)`, as some Pythons pickle an Enum member."""

    def __init__(self, cls, name: str):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return (getattr, (self.cls, self.name))


def test_metadata_may_name_an_enum_member_through_getattr_and_nothing_else_through_it(tmp_path):
    from pathlib import PosixPath

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    ok, bad = tmp_path / "ok", tmp_path / "bad"
    ok.mkdir()
    bad.mkdir()
    (ok / ".metadata").write_bytes(pickle.dumps([_Member(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")]))
    assert metadata_problem(ok) is None
    (bad / ".metadata").write_bytes(pickle.dumps(_Member(PosixPath, "unlink")))
    assert "is not an Enum member" in metadata_problem(bad)


def test_a_durable_checkpoint_whose_metadata_names_a_callable_is_refused_in_one_line_and_never_run(tmp_path):
    from tests.workloads.conftest import train

    trace, ckpt = tmp_path / "ran", tmp_path / "ckpt"
    args = ["--global-batch", "8", "--micro-batch", "2", "--straggler-every", "0", "--checkpoint-dir", str(ckpt)]
    assert train([*args, "--steps", "4", "--checkpoint-every", "4"], nproc=0).returncode == 0
    (ckpt / "step_00000004" / ".metadata").write_bytes(pickle.dumps(_Runs(str(trace))))
    run = train([*args, "--steps", "8", "--resume"], nproc=0)
    assert run.returncode != 0
    assert "its .metadata is refused: it names posix.mkdir" in run.stderr and "--checkpoint-dir" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert not trace.exists()
