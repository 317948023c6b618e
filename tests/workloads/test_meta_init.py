"""The meta build (--init-device meta) on 4 CPU ranks: the model is built on the meta device,
sharded there, and each rank materializes only its own shards; it trains under tp2 x dp2,
pp2 x dp2 (tied embedding) and tp2 x pp2, no rank ever holds the whole model, and a tied
embedding starts as one matrix on the first and the last pipeline stage."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from tests.workloads.conftest import REPO, Run, child_env, free_port, train
from workloads.config import ConfigError, TrainConfig, build_parser, pick_init_device
from workloads.llama_sizes import LLAMA_SIZES, LlamaSize
from workloads.parallel.dims import ParallelDims
from workloads.parallel.materialize import init_seed

pytestmark = pytest.mark.timeout(600)

STEPS = 8
# Small samples: the runs are to train, not to compare, so each step costs little on 2 cores.
SHORT = ["--seq-len", "32", "--global-batch", "16", "--micro-batch", "4", "--lr", "3e-3", "--warmup-steps", "2"]
SHORT += ["--steps", str(STEPS), "--log-every", "1", "--straggler-every", "0", "--init-device", "meta"]


def losses(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+/\d+ \| loss ([0-9.naif]+)", text, re.M)]


def assert_trains_from(text: str, first: float) -> None:
    """All steps logged and finite, the first near `first` (garbage from to_empty, or a table
    left unfilled, is far from it), and the last ones lower: it learns."""
    got = losses(text)
    assert len(got) == STEPS and all(math.isfinite(x) for x in got), text
    assert abs(got[0] - first) < 1.0, (got[0], first)
    assert min(got[-3:]) < got[0] - 0.2, got


def test_one_process_asked_for_a_meta_build_materializes_the_whole_model_on_its_device():
    run = train(["--model", "llama3-debug", *SHORT, "--steps", "2"], nproc=0, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (
        "init meta (--init-device): the model (0.00 GiB of fp32 weights whole) built on the meta device, "
        "then materialized whole on each rank's device" in run.stdout
    )
    got = losses(run.stdout)
    assert len(got) == 2 and abs(got[0] - math.log(LLAMA_SIZES["llama3-debug"].vocab_size)) < 1.0, got


def tied_fields(text: str) -> dict[str, str]:
    line = next(ln for ln in text.splitlines() if ln.startswith("TIED"))
    return dict(kv.split("=", 1) for kv in line.split()[1:])


# Sizes for these tests only, which the worker below adds to --model's choices.
SIZES = {
    # llama3-debug with a tied table (as llama3-1b ties): a pipeline's first and last stage hold it.
    "llama3-debug-tied": replace(LLAMA_SIZES["llama3-debug"], tie_embeddings=True),
    # 1.30 GiB (1.40 GB) of fp32 weights in 24 layers, no one tensor more than 3% of it, so a whole
    # copy on any rank would stand out from its shards and the one tensor being initialised.
    "llama3-meta-test": LlamaSize(
        dim=1024, n_layers=24, n_heads=8, n_kv_heads=4, vocab_size=32768, multiple_of=256, max_seq_len=256
    ),
}


def _report_tied(trainer, cfg) -> None:
    """Under a pipeline with a tied table, rank 0 prints what each rank's share of it holds after
    the build (a TIED line)."""
    import torch
    import torch.distributed as dist

    from workloads.parallel.parallelize import local

    model = trainer.raw_model  # one stage per rank (gpipe, 1f1b): the model itself
    table, head = model.PP_PARTS[3][0], model.PP_PARTS[2][-1]
    # Where this rank holds the head, its weight must still be the table's Parameter.
    kept = getattr(model, head) is None or getattr(model, head).weight is getattr(model, table).weight
    mine = [local(p).detach().clone() for p in trainer.tied]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (trainer.coords, mine, kept))
    if dist.get_rank() == 0:
        by_place = {(c["pp"], c["dp_shard"], c["tp"]): t for c, t, _ in everyone}
        first, last = by_place[(0, 0, 0)][0], by_place[(1, 0, 0)][0]
        beside = by_place[(0, 0, 1) if cfg.dims.tp > 1 else (0, 1, 0)][0]
        print(
            f"TIED equal={torch.equal(first, last)} tie_kept={all(k for *_, k in everyone)} "
            f"shape={'x'.join(map(str, first.shape))} std={first.std().item():.5f} "
            f"shards_differ={not torch.equal(first, beside)}",
            flush=True,
        )


def _build_only(trainer) -> None:
    from workloads.parallel.build import build_line

    trainer.log(build_line(trainer.built, not trainer.dims.is_ddp, trainer.build_growths))


def _worker(argv: list[str]) -> None:
    """workloads.train's main with SIZES among the models, and two flags of this worker's own:
    --build-only prints how the model was built and stops before the first step (a step of a
    1.4 GB model costs each rank seconds of CPU); --build-first MODEL first builds MODEL under the
    same layout, prints its build line and frees it, then goes on with --model (one start of the
    ranks for a test about a build and one about training)."""
    import gc

    import torch.distributed as dist

    from workloads import config, llama_sizes
    from workloads.train import Trainer, _init_distributed

    config.MODELS.update(SIZES)
    llama_sizes.LLAMA_SIZES.update(SIZES)
    build_only = "--build-only" in argv
    argv = [a for a in argv if a != "--build-only"]
    first = None
    if "--build-first" in argv:
        i = argv.index("--build-first")
        first, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    cfg = config.config_from_args(argv)
    _init_distributed()
    trainer = None
    try:
        if first is not None:
            trainer = Trainer(config.config_from_args([*argv, "--model", first]))
            _build_only(trainer)
            trainer = None
            gc.collect()
        trainer = Trainer(cfg)
        if cfg.dims.pp > 1:
            _report_tied(trainer, cfg)
        if build_only:
            _build_only(trainer)
        else:
            trainer.fit()
        dist.barrier()
    finally:
        del trainer
        gc.collect()
        dist.destroy_process_group()


def run_worker(args: list[str], nproc: int, timeout: float = 300) -> Run:
    """_worker under torchrun on `nproc` CPU ranks (0: one plain process)."""
    cmd = [sys.executable]
    if nproc:
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd += ["-m", "tests.workloads.test_meta_init", *args]
    p = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout)
    return Run(p.returncode, p.stdout, p.stderr)


def test_a_tied_llama_under_pp2xdp2_starts_with_one_table_on_both_stages_and_trains():
    run = run_worker(["--model", "llama3-debug-tied", *SHORT, "--pp", "2", "--dp-shard", "2"], nproc=4)
    assert run.returncode == 0, run.stderr[-3000:]
    fields = tied_fields(run.stdout)
    # The first stage's shard of the table is the last stage's, bit for bit, and under FSDP2 the
    # last stage's output still uses it.
    assert fields["equal"] == "True" and fields["tie_kept"] == "True", fields
    # dp_shard 2 splits the 256 x 64 table by rows; the first stage filled it with the output's
    # init (std dim^-0.5 = 0.125, cut at 3 sigma: ~0.99 of it), not left it as to_empty's memory.
    assert fields["shape"] == "128x64" and 0.9 * 0.125 < float(fields["std"]) < 1.05 * 0.125, fields
    assert fields["shards_differ"] == "True", fields  # the two dp shards are not one stream twice
    # A tied table predicts the input token at first (its own logit is |e|^2 / rms(e) = dim^0.5),
    # so the first loss is well above ln(vocab): it is where one process's whole build starts.
    whole = run_worker(["--model", "llama3-debug-tied", *SHORT, "--init-device", "full", "--steps", "1"], nproc=0)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert_trains_from(run.stdout, losses(whole.stdout)[0])


def test_a_tied_gpt_under_tp2xpp2_keeps_its_tie_through_tensor_parallelism_and_trains():
    run = run_worker(["--model", "tiny", *SHORT, "--tp", "2", "--pp", "2", "--pp-schedule", "gpipe"], nproc=4)
    assert run.returncode == 0, run.stderr[-3000:]
    fields = tied_fields(run.stdout)
    assert fields["equal"] == "True" and fields["tie_kept"] == "True", fields
    # tp 2 splits the 64 x 32 wte by rows (RowwiseParallel); GPT's init is N(0, 0.02).
    assert fields["shape"] == "32x32" and 0.017 < float(fields["std"]) < 0.023, fields
    assert fields["shards_differ"] == "True", fields  # the two TP shards are not one stream twice
    assert_trains_from(run.stdout, math.log(64))


def test_no_rank_of_a_meta_build_ever_holds_the_whole_model_and_a_llama_meta_build_trains_from_chance_level():
    # One start of 4 ranks under tp 2 x dp_shard 2: first the build alone of 1.40 GB of fp32
    # weights, each rank's shards a quarter of it; then llama3-debug, built the same way, trains.
    whole = 4 * SIZES["llama3-meta-test"].n_params
    run = run_worker(
        ["--build-first", "llama3-meta-test", "--model", "llama3-debug", *SHORT, "--tp", "2", "--dp-shard", "2"],
        nproc=4,
        timeout=500,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    m = re.search(
        r"\(([0-9.]+) GiB of fp32 weights whole\).*peak host memory while building: \+([0-9.]+) GiB", run.stdout
    )
    assert m, run.stdout
    assert float(m[1]) == pytest.approx(whole / 2**30, abs=0.01)  # the first build line is the big model's
    grew = float(m[2]) * 2**30
    # The most any rank's resident memory rose while building (peak after, minus resident
    # before): its quarter of the weights and the temporaries of the one tensor being filled,
    # well below the whole model, which a whole copy anywhere would reach by itself.
    assert 0.2 * whole < grew < 0.5 * whole, (grew / whole, run.stdout)
    trained = run.stdout[m.end() :]
    assert "| init meta" in trained
    assert "built on the meta device, sharded, then materialized shard by shard" in trained
    # Initial logits of about unit scale: the first loss is about ln(vocab) (+ ~0.5 for their spread).
    assert_trains_from(trained, math.log(LLAMA_SIZES["llama3-debug"].vocab_size))


def test_auto_picks_meta_for_a_sharded_layout_on_cuda_or_a_host_too_small_and_full_otherwise():
    def pick(**kw):
        base = dict(sharded=True, cuda=False, whole_bytes_per_node=4e9, host_available=64e9)
        return pick_init_device("auto", **{**base, **kw})[0]

    assert pick() == "full"  # CPU, fits: every layout starts from the same weights
    assert pick(cuda=True) == "meta"
    assert pick(whole_bytes_per_node=40e9) == "meta"  # more than half the host's available memory
    assert pick(sharded=False, cuda=True) == "full"  # DDP holds the whole model anyway
    assert pick(host_available=None) == "full"
    assert pick_init_device("meta", sharded=False, cuda=False, whole_bytes_per_node=1, host_available=1) == (
        "meta",
        "--init-device",
    )


def test_init_device_is_a_checked_flag_documented_in_help():
    with pytest.raises(ConfigError, match=r"--init-device 'gpu' is unknown; one of: auto, meta, full"):
        TrainConfig(init_device="gpu")
    text = " ".join(build_parser().format_help().split())
    assert "--init-device INIT_DEVICE How the model is built. meta: on the meta device" in text
    assert "full otherwise." in text and "(default: auto)" in text


def test_the_init_seed_differs_by_shard_and_stage_but_not_by_replica():
    dims = ParallelDims.resolve(16, dp_replicate=2, dp_shard=2, tp=2, pp=2)
    seeds = {}
    for rank in range(16):
        c = dims.coordinates(rank)
        seeds.setdefault(init_seed(7, dims, c), set()).add(c["dp_replicate"])
    assert len(seeds) == 8 and all(v == {0, 1} for v in seeds.values())  # replicas share theirs
    one = ParallelDims.resolve(1)
    assert init_seed(7, one, one.coordinates(0)) == 7


if __name__ == "__main__":
    _worker(sys.argv[1:])
