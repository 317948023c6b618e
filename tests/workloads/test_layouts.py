"""N-D layouts on 4 CPU ranks (gloo, tiny model, fp32): TP, PP, FSDP and their mixes train the
same run as one process does (the run DDP must equal) to step 30, and a checkpoint saved under
one layout resumes under another.

The runs are shared between the tests (a module fixture runs each once, on one xdist worker):
30 steps of 32 samples of 32 tokens, with a checkpoint at step 15 that the resumes start from.
A run's cost is its start (every rank imports torch: over 10 s of CPU each on a loaded 2-core
machine), not its steps, so the reference is one plain process and the resumes run on 2 ranks
or in one process: a resume needs its checkpoint resharded, not 4 ranks.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support import LAUNCH
from tests.workloads.conftest import REF_ARGS, REPO, child_env, free_port, one_line_exit_2, train
from workloads.parallel import LayoutError, ParallelDims

# The shared runs (7 starts, 5 of them torchrun) take minutes on a loaded 2-core machine; pytest-timeout
# charges them to the first test that uses the fixture. A bound that catches a hang, no more.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("layouts")]

STEPS = 30
HALF = STEPS // 2
# The reference's model and schedule, with shorter samples and its decay over these 30 steps.
ARGS = [*REF_ARGS, "--global-batch", "32", "--seq-len", "32", "--lr-decay-steps", str(STEPS)]
RTOL = 1e-3


def losses(text: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+)/\d+ \| loss ([0-9.]+)", text, re.M)}


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * abs(b)


def point_latest_at(ckpt: Path, step: int) -> None:
    """What a user does to go back to an older checkpoint (the store's own error says so)."""
    (ckpt / "latest").write_text(f"step_{step:08d}\n")


def launch_local(args: list[str], runs_dir: Path, nodes: int = 1, nproc: int = 4) -> str:
    """`launch train --local` as a user runs it: `nodes` local "nodes" x `nproc` ranks; node
    0's log (rank 0's lines)."""
    run = subprocess.run(
        [LAUNCH, "train", "--local", "--nodes", str(nodes), "--nproc-per-node", str(nproc)]
        # Its own port: --local's free-port pick can meet another worker's concurrent launch.
        + ["--rdzv-port", str(free_port()), "--runs-dir", str(runs_dir), "--workdir", str(REPO)]
        + ["--env", "OMP_NUM_THREADS=1", "--", *ARGS, *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (log,) = runs_dir.glob("*/node-0.log")
    return log.read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of this module, once: the reference (one process: micro-batch 8 x 4
    accumulation steps is the same global batch of 32 as 4 DDP ranks), then through the launcher
    the layouts, each saving at step 15 and finishing at step 30, and resumes from step 15 under
    other layouts."""
    tmp = tmp_path_factory.mktemp("layouts")
    out: dict = {"tmp": tmp}

    def run4(name: str, args: list[str], nproc: int = 4) -> dict[int, float]:
        return losses(launch_local(args, tmp / "runs" / name, nproc=nproc))

    ref = train([*ARGS, "--steps", str(STEPS)], nproc=0)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "global batch 32 = micro-batch 8 x 1 data-parallel rank x 4 accumulation steps" in ref.stdout
    out["ref"] = losses(ref.stdout)
    save = ["--steps", str(STEPS), "--checkpoint-every", str(HALF)]
    # tp2 x dp2 on 2 local "nodes" x 2 ranks, TP inside a node; its periodic save is asynchronous.
    ckpt = tmp / "tp2xdp2"
    node0 = launch_local(
        [*save, "--tp", "2", "--dp-shard", "2", "--checkpoint-dir", str(ckpt), "--async-checkpoint"],
        tmp / "runs" / "tp2xdp2",
        nodes=2,
        nproc=2,
    )
    out["tp2xdp2"], out["tp2xdp2-banner"] = losses(node0), node0
    point_latest_at(ckpt, HALF)
    # Read whole by one plain process (4 shards, 2 of each TP half), which accumulates as the reference does.
    one = train([*ARGS, "--steps", str(STEPS), "--resume", "--checkpoint-dir", str(ckpt)], nproc=0)
    assert one.returncode == 0, one.stderr[-3000:]
    out["tp2xdp2->one process"] = losses(one.stdout)
    ckpt = tmp / "pp2xdp2"
    out["pp2xdp2"] = run4("pp2xdp2", save + ["--pp", "2", "--dp-shard", "2", "--checkpoint-dir", str(ckpt)])
    point_latest_at(ckpt, HALF)
    out["pp2xdp2->tp2 on 2 ranks"] = run4(
        "pp2xdp2-tp2", ["--steps", str(STEPS), "--tp", "2", "--resume", "--checkpoint-dir", str(ckpt)], nproc=2
    )
    ckpt = tmp / "tp2xpp2"
    out["tp2xpp2"] = run4(
        "tp2xpp2", save + ["--pp", "2", "--tp", "2", "--pp-schedule", "gpipe", "--checkpoint-dir", str(ckpt)]
    )
    point_latest_at(ckpt, HALF)
    out["tp2xpp2->fsdp2"] = run4(
        "tp2xpp2-fsdp2",
        ["--steps", str(STEPS), "--parallelism", "fsdp", "--resume", "--checkpoint-dir", str(ckpt)],
        nproc=2,
    )
    out["ckpt"] = ckpt
    return out


def test_the_module_runs_on_one_xdist_worker(request):
    """Under `make test` (--dist loadgroup) every test here is on one worker, so the runs above
    run once. pytest-xdist groups by a suffix it adds to each test's id; on pytest 9.2 the suffix
    no longer takes effect and the grouping silently stops (pytest-dev/pytest-xdist#1386)."""
    if not getattr(request.config.option, "loadgroup", False):  # set on an xdist worker under loadgroup
        pytest.skip("not an xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@layouts"), f"{request.node.nodeid}: loadgroup did not group this module"


@pytest.mark.parametrize("layout", ["tp2xdp2", "pp2xdp2", "tp2xpp2"])
def test_a_layout_trains_the_same_run_as_one_process(runs, layout):
    ref, got = runs["ref"], runs[layout]
    assert sorted(got) == list(range(1, STEPS + 1))
    assert ref[STEPS] < ref[1] - 0.3  # it learns: the comparison is not of two flat lines
    for step in (1, HALF, STEPS):
        assert close(got[step], ref[step]), (layout, step, got[step], ref[step])


@pytest.mark.parametrize("resumed", ["tp2xdp2->one process", "tp2xpp2->fsdp2", "pp2xdp2->tp2 on 2 ranks"])
def test_a_checkpoint_resumes_under_another_layout_to_the_same_loss(runs, resumed):
    got = runs[resumed]
    assert sorted(got) == list(range(HALF + 1, STEPS + 1)), got  # it started at the save
    assert close(got[STEPS], runs["ref"][STEPS]), (got[STEPS], runs["ref"][STEPS])


def test_the_launcher_run_names_its_mesh_and_saves_in_the_background(runs):
    text = runs["tp2xdp2-banner"]
    assert "dp_shard 2 x tp 2 = 4 ranks" in text
    assert "micro-batch 8 x 2 data-parallel ranks x 2 accumulation steps" in text
    assert "training blocked" in text  # the async save's line
    # On CPU, with a tiny model, --init-device auto builds it whole: every layout starts alike.
    assert "| init full" in text and "init full (auto: the whole model on each of the node's ranks fits" in text


def test_interleaved_1f1b_trains_the_same_run_as_one_process():
    args = ["--model", "tiny-4l", "--steps", "4", "--log-every", "1", "--global-batch", "16", "--micro-batch", "8"]
    one = train(args, nproc=0, timeout=120)
    pp = train(args + ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--micro-batch", "4"], nproc=2, timeout=180)
    assert one.returncode == 0 and pp.returncode == 0, one.stderr[-2000:] + pp.stderr[-2000:]
    assert "pp 2 (interleaved-1f1b)" in pp.stdout
    a, b = losses(one.stdout), losses(pp.stdout)
    assert all(close(b[s], a[s]) for s in (1, 4)), (a, b)


def _one_line_exit_2(args: list[str], world: int) -> str:
    """Parse errors are met alike by every rank before the process group exists: the workload's
    main in this process, with torchrun's WORLD_SIZE, meets them as each rank would."""
    return one_line_exit_2(REF_ARGS + args, {"WORLD_SIZE": str(world)})


def test_a_layout_that_does_not_fit_is_one_line_with_its_arithmetic():
    assert _one_line_exit_2(["--dp-replicate", "1", "--dp-shard", "2", "--tp", "2", "--pp", "2"], 6) == (
        "error: dp_replicate(1) x dp_shard(2) x tp(2) x pp(2) = 8 != world size 6; "
        "make the product the world size (--dp-shard -1 takes the rest)"
    )
    assert "--tp 4 does not divide model tiny's 2 attention heads" in _one_line_exit_2(["--tp", "4"], 4)
    assert "--pp 3 = 3 pipeline stages is more than model tiny's 2 layers; use --pp 2 or less" in (
        _one_line_exit_2(["--pp", "3", "--global-batch", "24"], 3)
    )
    assert "--pp-schedule 1f1b needs at least --pp 2 microbatches" in _one_line_exit_2(
        ["--pp", "2", "--pp-microbatches", "1"], 4
    )


def test_tp_must_divide_the_kv_heads_too():
    dims = ParallelDims.resolve(8, tp=4)
    dims.check_model("m", n_layer=2, n_head=8, n_kv_head=8)
    with pytest.raises(LayoutError, match=r"--tp 4 does not divide model m's 2 KV heads"):
        dims.check_model("m", n_layer=2, n_head=8, n_kv_head=2)


def test_dp_shard_minus_one_takes_the_rest_and_the_data_rank_is_the_mesh_coordinate():
    dims = ParallelDims.resolve(16, dp_replicate=2, dp_shard=-1, tp=2, pp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp) == (2, 2, 4)
    # tp innermost: ranks 0 and 1 are one TP pair and train on the same samples.
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims.coordinates(9) == {"tp": 1, "dp_shard": 0, "dp_replicate": 0, "pp": 1}


def test_a_checkpoint_of_another_model_is_one_line_before_any_step(runs):
    run = train(ARGS + ["--model", "tiny-4l", "--steps", "3", "--resume", "--checkpoint-dir", str(runs["ckpt"])])
    assert run.returncode != 0 and "exitcode  : 2" in run.stderr
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "was written with model tiny, this run has tiny-4l" in errors[0], run.stderr
    assert "step 1/" not in run.stdout
