"""Pure parts of workloads: config rules, FLOP formula, straggler verdict, data order, store."""

from __future__ import annotations

import pytest
import torch

from workloads.checkpoint.store import CheckpointError, LocalStore, checkpoint_name, encode_state, load_checkpoint
from workloads.config import MODEL_SIZES, ConfigError, TrainConfig, build_parser, config_from_args
from workloads.data import BatchStream, SyntheticTokens
from workloads.metrics import RankInfo, find_stragglers, format_log_line, straggler_warning
from workloads.model import GPT, flops_per_token, mfu


def test_a_global_batch_that_does_not_divide_names_the_arithmetic():
    with pytest.raises(
        ConfigError,
        match=r"^--global-batch 12 is not divisible by --micro-batch 4 "
        r"x 2 data-parallel ranks = 8; use a multiple of 8, or leave --global-batch out for 8$",
    ):
        TrainConfig(global_batch=12, micro_batch=4, world_size=2)


@pytest.mark.parametrize("ranks", [1, 3, 6, 128])
def test_without_global_batch_it_follows_the_data_parallel_ranks(ranks):
    cfg = TrainConfig(world_size=ranks)
    assert cfg.dp_size == ranks
    assert (cfg.global_batch, cfg.grad_accum) == (4 * ranks, 1)
    assert cfg.batch_summary() == (
        f"global batch {4 * ranks} = micro-batch 4 x {ranks} data-parallel rank{'s' * (ranks > 1)} "
        "(default; --global-batch to set)"
    )


def test_the_default_global_batch_follows_the_micro_batch_and_the_command_line_leaves_it_open():
    assert config_from_args(["--micro-batch", "2"], world_size=128).global_batch == 256
    assert build_parser().get_default("global_batch") == 0


def test_an_explicit_global_batch_says_its_accumulation():
    cfg = TrainConfig(global_batch=24, micro_batch=4, world_size=3)
    assert cfg.batch_summary() == "global batch 24 = micro-batch 4 x 3 data-parallel ranks x 2 accumulation steps"


def test_a_negative_global_batch_is_refused():
    with pytest.raises(ConfigError, match=r"^--global-batch must be 0 or more, got -1$"):
        TrainConfig(global_batch=-1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"model": "7B"},
            "--model '7B' is unknown; one of: tiny, tiny-4l, small-test, 124M, 350M, 1.3B, "
            "llama3-debug, llama3-1b, llama3-8b, llama3-70b",
        ),
        ({"steps": 0}, "--steps must be at least 1, got 0"),
        ({"precision": "fp4"}, "--precision 'fp4' is unknown"),
        ({"precision": "fp8", "fp8_recipe": "blockwise"}, "--fp8-recipe 'blockwise' is unknown"),
        ({"seq_len": 65}, "--seq-len 65 is longer than model tiny's block size 64"),
        ({"resume": True}, "--resume needs --checkpoint-dir"),
        ({"parallelism": "fsdp", "compression": "fp16"}, "--compression fp16 is a DDP comm hook"),
        ({"profile_steps": "5"}, "--profile-steps '5' is not a range 'a:b'"),
        ({"profile_steps": "5:200"}, "--profile-steps 5:200 ends after --steps 100"),
    ],
)
def test_bad_values_are_named_with_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs)


def test_accumulation_is_derived_from_the_batches():
    assert TrainConfig(global_batch=64, micro_batch=8, world_size=2).grad_accum == 4


def test_every_field_has_a_flag_with_its_docstring_as_help():
    helps = {a.dest: a.help for a in build_parser()._actions if a.dest != "help"}
    assert "checkpoint_dir" in helps and "gs://bucket/prefix" in helps["checkpoint_dir"]
    assert all(h for h in helps.values()), [k for k, h in helps.items() if not h]
    cfg = config_from_args(["--model", "124M", "--no-compile", "--resume", "--checkpoint-dir", "x"], world_size=1)
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
    (line,) = straggler_warning(
        [0.010, 0.030, 0.010], [RankInfo(0, 0, "a"), RankInfo(1, 1, "b"), RankInfo(2, 1, "c")], 1.2
    )
    assert line.startswith("straggler: rank 1 (node 1, host b) compute 30.0 ms/step = 3.00x the median 10.0 ms")


def test_log_line_reads_at_a_glance():
    line = format_log_line(10, 100, 3.21449, 6e-4, 0.1234, 12345.6, 0.432, 1.5)
    assert line == ("step 10/100 | loss 3.2145 | lr 6.00e-04 | 123.4 ms/step | 12,346 tok/s | MFU 43.2% | mem 1.50 GiB")
    assert "MFU n/a" in format_log_line(1, 1, 1.0, 1e-3, 0.1, 1.0, None, None)


def _samples(world: int, micro: int, accum: int, steps: int, n: int = 100) -> list[list[int]]:
    """The sample ids each optimizer step trains on, over all ranks."""
    data = SyntheticTokens(n, 4, 64, seed=0)
    data.batch = lambda ids: (torch.tensor(ids), torch.tensor(ids))  # expose the ids themselves
    streams = [BatchStream(data, r, world, micro, accum, seed=0) for r in range(world)]
    return [
        sorted(i for s in streams for m in range(accum) for i in s.micro_batch_at(step, m)[0].tolist())
        for step in range(steps)
    ]


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


def _dcp_save(store, step: int, state: dict) -> str:
    """What Trainer.save does on one rank: begin, every rank writes (DCP), commit."""
    import torch.distributed.checkpoint as dcp

    name = checkpoint_name(step)
    token = store.begin(name)
    dcp.save(state, storage_writer=store.storage_writer(name, token), no_dist=True)
    return store.commit(name, token)


def test_latest_moves_only_after_a_whole_write_and_pruning_keeps_the_newest(tmp_path):
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "c"
    store = LocalStore(str(root))
    store.check()
    assert store.latest() is None
    for step in (1, 2, 3):
        assert _dcp_save(
            store, step, {"w": torch.full((4,), float(step)), "trainer": encode_state({"step": step})}
        ) == str(root / f"step_0000000{step}")
    assert store.latest() == "step_00000003"
    assert store.prune(2) == ["step_00000001"]
    back = load_checkpoint(root / "step_00000003")
    assert sorted(back) == ["step", "w"] and back["step"] == 3
    assert torch.equal(back["w"], torch.full((4,), 3.0))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom mid-write")

    # A save that fails half-way leaves its staging directory, never a step_ name or a new latest.
    token = store.begin("step_00000004")
    with pytest.raises(BaseException, match="boom mid-write"):
        dcp.save(
            {"w": torch.zeros(4), "bad": Unpicklable()},
            storage_writer=store.storage_writer("step_00000004", token),
            no_dist=True,
        )
    assert store.latest() == "step_00000003"
    assert [p.name for p in root.iterdir() if p.name.startswith(".step_00000004.tmp-")]
    store.abort("step_00000004", token)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    # A directory without .metadata (a save cut short before its end) is never taken for latest.
    (root / "latest").write_text("step_00000009\n")
    (root / "step_00000009").mkdir()
    with pytest.raises(CheckpointError, match="names 'step_00000009', which is not a complete checkpoint"):
        store.latest()


def test_an_unwritable_checkpoint_dir_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=rf"cannot write checkpoints to {blocker}/sub: "):
        LocalStore(str(blocker / "sub")).check()


def test_a_corrupt_full_state_file_of_the_previous_release_is_one_line_naming_it_and_the_fix(tmp_path):
    store = LocalStore(str(tmp_path))
    store.check()
    torch.save({"step": 1}, tmp_path / "step_00000001.pt")
    torch.save({"step": 2}, tmp_path / "step_00000002.pt")
    (tmp_path / "latest").write_text("step_00000002.pt\n")
    whole = (tmp_path / "step_00000002.pt").read_bytes()
    for spoiled in (whole[: len(whole) // 2], b"not a checkpoint at all", b""):
        (tmp_path / "step_00000002.pt").write_bytes(spoiled)
        with pytest.raises(CheckpointError) as info:
            store.load_full_state(store.latest())
        msg = str(info.value)
        assert "\n" not in msg
        assert msg.startswith(f"{tmp_path / 'step_00000002.pt'} is not a readable checkpoint (")
        assert f"point {tmp_path / 'latest'} at an older step_*" in msg
    # Not a dict: readable, but no checkpoint.
    torch.save([1, 2], tmp_path / "step_00000002.pt")
    with pytest.raises(CheckpointError, match=r"it holds a list, not a dict"):
        store.load_full_state("step_00000002.pt")
    assert store.load_full_state("step_00000001.pt") == {"step": 1}  # the older one is still there to use


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
    from workloads.checkpoint.store import GCSStore

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    with pytest.raises(CheckpointError) as info:
        GCSStore("gs://my-bucket/run1")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("cannot open gs://my-bucket: ") and "no-such-key.json" in msg
    assert "GOOGLE_APPLICATION_CREDENTIALS" in msg and "--checkpoint-dir" in msg


def test_the_preemption_save_is_checked_against_the_budget_and_names_what_to_change():
    from workloads.metrics import format_bytes, preemption_report

    assert (format_bytes(512), format_bytes(3.2e6), format_bytes(16.1e9)) == ("512 B", "3.2 MB", "16.1 GB")
    fits, line = preemption_report(24, 1.5, 0.5, 30.0, 3_000_000_000, 16, "/ckpt/step_00000024")
    assert fits
    assert line == (
        "SIGTERM: checkpoint step 24 saved in 1.50 s (3.0 GB from 16 ranks, 2.0 GB/s) -> "
        "/ckpt/step_00000024; 2.00 s since the notice, within the 30 s --preemption-budget"
    )
    fits, line = preemption_report(24, 40.0, 2.0, 30.0, 16_000_000_000, 16, "gs://b/step_00000024")
    assert not fits
    # 16 GB in the 28 s the step left: 571 MB/s needed; the knobs that give it are named.
    assert "42.00 s since the notice, over the 30 s --preemption-budget" in line
    assert "it needs 571.4 MB/s to fit" in line
    for knob in ("local SSD", "more ranks", "--async-checkpoint"):
        assert knob in line


@pytest.mark.parametrize("text, seconds", [("30s", 30.0), ("45", 45.0), ("1.5m", 90.0)])
def test_the_preemption_budget_takes_seconds_or_minutes(text, seconds):
    assert TrainConfig(preemption_budget=text).preemption_budget_s == seconds


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preemption_budget": "soon"}, "--preemption-budget 'soon' is not a duration; use seconds like 30s"),
        ({"preemption_budget": "-3s"}, "--preemption-budget '-3s' is not a duration"),
        (
            {"async_checkpoint": True, "checkpoint_dir": "x"},
            "--async-checkpoint overlaps the periodic saves with training; it needs --checkpoint-every K",
        ),
    ],
)
def test_checkpoint_flags_that_cannot_work_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)
