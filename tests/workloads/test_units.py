"""Pure parts of workloads: config rules, FLOP formula, straggler verdict, data order, store."""

from __future__ import annotations

import pytest
import torch

from workloads.checkpoint import CheckpointError, LocalStore, checkpoint_name
from workloads.config import MODEL_SIZES, ConfigError, TrainConfig, build_parser, config_from_args
from workloads.data import BatchStream, SyntheticTokens
from workloads.metrics import RankInfo, find_stragglers, format_log_line, straggler_warning
from workloads.model import GPT, flops_per_token, mfu


def test_a_global_batch_that_does_not_divide_names_the_arithmetic():
    with pytest.raises(ConfigError, match=r"--global-batch 12 is not divisible by --micro-batch 4 "
                                          r"x world size 2 = 8; use a multiple of 8"):
        TrainConfig(global_batch=12, micro_batch=4, world_size=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "7B"}, "--model '7B' is unknown; one of: tiny, small-test, 124M, 350M, 1.3B"),
    ({"steps": 0}, "--steps must be at least 1, got 0"),
    ({"precision": "fp8"}, "--precision 'fp8' is unknown"),
    ({"seq_len": 65}, "--seq-len 65 is longer than model tiny's block size 64"),
    ({"resume": True}, "--resume needs --checkpoint-dir"),
    ({"parallelism": "fsdp", "compression": "fp16"}, "--compression fp16 is a DDP comm hook"),
    ({"profile_steps": "5"}, "--profile-steps '5' is not a range 'a:b'"),
    ({"profile_steps": "5:200"}, "--profile-steps 5:200 ends after --steps 100"),
])
def test_bad_values_are_named_with_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs)


def test_accumulation_is_derived_from_the_batches():
    assert TrainConfig(global_batch=64, micro_batch=8, world_size=2).grad_accum == 4


def test_every_field_has_a_flag_with_its_docstring_as_help():
    helps = {a.dest: a.help for a in build_parser()._actions if a.dest != "help"}
    assert "checkpoint_dir" in helps and "gs://bucket/prefix" in helps["checkpoint_dir"]
    assert all(h for h in helps.values()), [k for k, h in helps.items() if not h]
    cfg = config_from_args(["--model", "124M", "--no-compile", "--resume", "--checkpoint-dir", "x"],
                           world_size=1)
    assert cfg.model == "124M" and cfg.resume is True and cfg.compile is False


def test_unknown_flag_is_a_config_error_not_a_system_exit():
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        config_from_args(["--bogus"], world_size=1)


def test_flops_per_token_is_6n_plus_12_l_h_q_t():
    assert flops_per_token(1000, 2, 3, 4, 5) == 6 * 1000 + 12 * 2 * 3 * 4 * 5
    model = GPT(MODEL_SIZES["tiny"])
    n = model.num_params()
    assert n == sum(p.numel() for p in model.parameters()) - 64 * 32  # position table excluded
    assert mfu(100.0, 10.0, 1000.0) == pytest.approx(1.0)
    assert mfu(100.0, 10.0, None) is None


def test_gpt_124m_has_124m_parameters():
    with torch.device("meta"):
        model = GPT(MODEL_SIZES["124M"])
    assert 123e6 < model.num_params(non_embedding=False) < 125e6


def test_a_rank_above_1_2x_the_median_is_a_straggler():
    assert find_stragglers([1.0, 1.0, 1.19, 1.0]) == []
    assert find_stragglers([1.0, 1.0, 1.3, 1.0]) == [2]
    assert find_stragglers([2.0]) == []
    (line,) = straggler_warning([0.010, 0.030, 0.010], [RankInfo(0, 0, "a"), RankInfo(1, 1, "b"),
                                                        RankInfo(2, 1, "c")], 1.2)
    assert line.startswith("straggler: rank 1 (node 1, host b) compute 30.0 ms/step = 3.00x the median 10.0 ms")


def test_log_line_reads_at_a_glance():
    line = format_log_line(10, 100, 3.21449, 6e-4, 0.1234, 12345.6, 0.432, 1.5)
    assert line == ("step 10/100 | loss 3.2145 | lr 6.00e-04 | 123.4 ms/step | 12,346 tok/s | "
                    "MFU 43.2% | mem 1.50 GiB")
    assert "MFU n/a" in format_log_line(1, 1, 1.0, 1e-3, 0.1, 1.0, None, None)


def _samples(world: int, micro: int, accum: int, steps: int, n: int = 100) -> list[list[int]]:
    """The sample ids each optimizer step trains on, over all ranks."""
    data = SyntheticTokens(n, 4, 64, seed=0)
    data.batch = lambda ids: (torch.tensor(ids), torch.tensor(ids))  # expose the ids themselves
    streams = [BatchStream(data, r, world, micro, accum, seed=0) for r in range(world)]
    return [sorted(i for s in streams for m in range(accum) for i in s.micro_batch_at(step, m)[0].tolist())
            for step in range(steps)]


def test_ranks_together_see_what_one_process_sees_and_no_sample_twice_per_epoch():
    one = _samples(world=1, micro=8, accum=1, steps=12)
    two = _samples(world=2, micro=2, accum=2, steps=12)
    assert one == two
    epoch = [i for step in one[:12] for i in step]  # 100 // 8 = 12 steps per epoch
    assert len(epoch) == len(set(epoch)) == 96
    # The next epoch is a different order (set_epoch), and the position is a function of the step.
    assert _samples(1, 8, 1, 13)[12] != one[0]


def test_synthetic_sequences_are_learnable_arithmetic():
    x, y = SyntheticTokens(10, 8, 64, seed=3).batch([5])
    assert torch.equal(x[0, 1:], y[0, :-1])
    stride = (x[0, 1] - x[0, 0]) % 64
    assert torch.equal((x[0, :-1] + stride) % 64, x[0, 1:])


def test_latest_moves_only_after_a_whole_write_and_pruning_keeps_the_newest(tmp_path):
    store = LocalStore(str(tmp_path / "c"))
    store.check()
    assert store.latest() is None
    for step in (1, 2, 3):
        store.save(checkpoint_name(step), {"step": step})
    assert store.latest() == "step_00000003.pt"
    assert store.prune(2) == ["step_00000001.pt"]
    assert store.load("step_00000003.pt") == {"step": 3}

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom mid-write")

    with pytest.raises(CheckpointError, match=r"cannot write .*step_00000004.pt: boom mid-write"):
        store.save(checkpoint_name(4), {"bad": Unpicklable()})
    assert store.latest() == "step_00000003.pt"
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["latest", "step_00000002.pt",
                                                                  "step_00000003.pt"]


def test_an_unwritable_checkpoint_dir_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=rf"cannot write checkpoints to {blocker}/sub: "):
        LocalStore(str(blocker / "sub")).check()


def test_a_corrupt_checkpoint_file_is_one_line_naming_it_and_the_fix(tmp_path):
    store = LocalStore(str(tmp_path))
    store.check()
    store.save(checkpoint_name(1), {"step": 1})
    store.save(checkpoint_name(2), {"step": 2})
    whole = (tmp_path / "step_00000002.pt").read_bytes()
    for spoiled in (whole[: len(whole) // 2], b"not a checkpoint at all", b""):
        (tmp_path / "step_00000002.pt").write_bytes(spoiled)
        with pytest.raises(CheckpointError) as info:
            store.load(store.latest())
        msg = str(info.value)
        assert "\n" not in msg
        assert msg.startswith(f"{tmp_path / 'step_00000002.pt'} is not a readable checkpoint (")
        assert f"point {tmp_path / 'latest'} at an older step_*.pt" in msg
    # Not a dict: readable, but no checkpoint.
    torch.save([1, 2], tmp_path / "step_00000002.pt")
    with pytest.raises(CheckpointError, match=r"it holds a list, not a dict"):
        store.load("step_00000002.pt")
    assert store.load("step_00000001.pt") == {"step": 1}  # the older one is still there to use


def test_a_latest_pointer_that_cannot_be_read_is_a_checkpoint_error(tmp_path):
    store = LocalStore(str(tmp_path))
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError, match=rf"cannot read {tmp_path / 'latest'}: .*remove it"):
        store.latest()
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # read_text fails with IsADirectoryError
    with pytest.raises(CheckpointError, match=rf"cannot read {tmp_path / 'latest'}: Is a directory"):
        store.latest()


def test_a_bucket_without_google_credentials_is_one_line_naming_the_bucket_and_the_fix(monkeypatch, tmp_path):
    from workloads.checkpoint import GCSStore

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    with pytest.raises(CheckpointError) as info:
        GCSStore("gs://my-bucket/run1")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("cannot open gs://my-bucket: ") and "no-such-key.json" in msg
    assert "GOOGLE_APPLICATION_CREDENTIALS" in msg and "--checkpoint-dir" in msg
