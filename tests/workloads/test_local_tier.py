"""The node-local checkpoint tier under real torchrun over gloo: a killed run resumes from its
last local step (not 0) with the parameters of an uninterrupted run; ranks whose local steps
differ agree on one; a peer copy fills in for a missing own copy, and one whose hash does not
match is skipped with one line; a SIGTERM saves once more; a bad local directory is one line,
exit 2, before anything starts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time

from gpufleet.local_tier import COPIES_VAR, MANIFEST, OWN, complete_steps, mark_sent, rank_dir
from tests.support import require_root
from tests.workloads.conftest import (
    REF_ARGS,
    REF_STEPS,
    assert_same_params,
    kill_tree,
    last_step,
    one_line_exit_2,
    params,
    start,
    train,
    wait_for,
    workers,
)
from workloads.checkpoint.local import COPY_WAIT_VAR

JOB = "job-42"


def _env(root) -> dict[str, str]:
    return {"GPUFLEET_LOCAL_CHECKPOINT_DIR": str(root), "GPUFLEET_JOB_ID": JOB}


def _resumed_at(stdout: str) -> tuple[int, str]:
    """(step, source) of the resume line, whose end names the tier for `launch jobs`: local
    when every rank read its own copy, peer when any read a peer's, durable for --checkpoint-dir."""
    m = re.search(r"^resumed from (.*) at step (\d+) .*; restored step (\d+) from (\w+)$", stdout, re.M)
    assert m, stdout
    tier = "durable" if not m[1].startswith("the local tier") else "local" if "peer copies on 0)" in m[1] else "peer"
    assert (m[3], m[4]) == (m[2], tier), m[0]
    return int(m.group(2)), m.group(1)


def test_a_killed_run_resumes_from_its_last_local_step_with_the_uninterrupted_runs_parameters(tmp_path, reference):
    root, metrics, out = tmp_path / "local", tmp_path / "m.jsonl", tmp_path / "out.pt"
    root.mkdir(mode=0o700)
    args = REF_ARGS + ["--steps", str(REF_STEPS), "--local-checkpoint-every", "4"]
    proc = start(args + ["--metrics-file", str(metrics)], env=_env(root))
    try:
        wait_for(lambda: complete_steps(root, JOB, "own", 1) and last_step(metrics) >= 10, timeout=240, proc=proc)
    finally:
        kill_tree(proc)  # kill -9, every process at once: a save under way is cut wherever it is
    saved = set(complete_steps(root, JOB, "own", 0)) & set(complete_steps(root, JOB, "own", 1))
    assert saved and max(saved) >= 8
    run = train(args + ["--resume", "--save-params", str(out)], env=_env(root))
    assert run.returncode == 0, run.stderr
    step, source = _resumed_at(run.stdout)
    assert step == max(saved) and source == "the local tier (own copies on 2 ranks, peer copies on 0)"
    assert_same_params(reference, params(out))
    # Two local steps kept per rank, the newest complete one among them.
    assert complete_steps(root, JOB, "own", 0)[-2:] == [16, 20] and len(complete_steps(root, JOB, "own", 0)) == 2


def test_ranks_with_different_local_steps_restore_one_step_from_own_and_peer_copies(tmp_path):
    root = tmp_path / "local"
    root.mkdir(mode=0o700)
    args = ["--global-batch", "8", "--micro-batch", "2", "--straggler-every", "0", "--local-checkpoint-every", "4"]
    durable = ["--checkpoint-dir", str(tmp_path / "durable")]
    assert train(args + durable + ["--steps", "8", "--checkpoint-every", "4"], env=_env(root)).returncode == 0

    def resume(*more: str) -> tuple[int, str, list[str]]:
        run = train(args + ["--steps", "8", "--resume", *more], env=_env(root))
        assert run.returncode == 0, run.stderr
        return (*_resumed_at(run.stdout), [ln for ln in run.stderr.splitlines() if ln.startswith("warning: rank")])

    # Rank 1 lost its own step 8 (a node's disk, say) and a peer holds a copy, as a replicator
    # leaves it: step 8 for both, rank 1 from the peer copy.
    peer = rank_dir(root, JOB, "peer", 8, 1)
    peer.parent.mkdir(parents=True)
    os.rename(rank_dir(root, JOB, "own", 8, 1), peer)
    step, source, warnings = resume()
    assert (step, source, warnings) == (8, "the local tier (own copies on 1 ranks, peer copies on 1)", [])

    # The peer copy is damaged: skipped with one line naming it. Rank 1 now has step 4 alone and
    # rank 0 steps 4 and 8: both go back to step 4, the newest that both have.
    shard = next(p for p in peer.iterdir() if p.name.endswith(".distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    step, source, warnings = resume()
    assert step == 4
    assert warnings == [
        f"warning: rank 1: skipping the peer copy {peer}: {shard.name} does not match its sha256 in "
        f"{MANIFEST}; using the next tier"
    ]
    # Resuming from step 4 removed what the replaced run had past it on this "node" (rank 0's
    # own step 8, the damaged peer copy): a later restore never mixes it with this run's. That
    # run saved step 8 again, both ranks.
    assert not peer.exists()
    assert [complete_steps(root, JOB, "own", r)[-1] for r in (0, 1)] == [8, 8]
    # Without rank 1's own copy, and with the durable tier, the durable tier holds step 8 for
    # every rank: read from there.
    shutil.rmtree(rank_dir(root, JOB, "own", 8, 1))
    step, source, warnings = resume(*durable)
    assert (step, source, warnings) == (8, str(tmp_path / "durable"), [])


def test_a_sigterm_saves_its_step_to_the_local_tier(tmp_path):
    root, metrics = tmp_path / "local", tmp_path / "m.jsonl"
    root.mkdir(mode=0o700)
    args = ["--global-batch", "8", "--micro-batch", "2", "--straggler-every", "0", "--local-checkpoint-every", "1000"]
    proc = start(args + ["--steps", "100000", "--metrics-file", str(metrics)], env=_env(root))
    try:
        wait_for(lambda: last_step(metrics) >= 3, timeout=180, interval=0.01, proc=proc)
        for pid in workers(proc.pid).values():
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, err
    step = int(re.search(r"SIGTERM: saving a checkpoint at step (\d+)", out).group(1))
    assert complete_steps(root, JOB, "own", 0) == complete_steps(root, JOB, "own", 1) == [step]


def test_local_checkpoints_without_a_local_directory_are_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUFLEET_LOCAL_CHECKPOINT_DIR", raising=False)
    line = one_line_exit_2(["--steps", "2", "--local-checkpoint-every", "1"])
    assert line.startswith("error: --local-checkpoint-every needs a node-local directory: pass --local-checkpoint-dir")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    line = one_line_exit_2(["--steps", "2", "--local-checkpoint-every", "1"], env=_env(open_dir))
    assert (
        line
        == f"error: GPUFLEET_LOCAL_CHECKPOINT_DIR {open_dir} has mode 0777, writable by other accounts; chmod 700 it"
    )
    line = one_line_exit_2(["--steps", "2", "--local-checkpoint-dir", str(tmp_path / "d")])
    assert line == "error: --local-checkpoint-dir needs --local-checkpoint-every K (how often to save there)"


def test_a_local_directory_of_another_account_is_refused(tmp_path):
    require_root("making a directory of another uid needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    line = one_line_exit_2(["--steps", "2", "--local-checkpoint-every", "1", "--local-checkpoint-dir", str(theirs)])
    assert line.startswith(f"error: --local-checkpoint-dir {theirs} belongs to uid 65534, not to this account")


def test_under_a_replicator_each_save_waits_for_the_copies_and_keeps_the_newest_step_every_rank_copied(tmp_path):
    """The test is the replicator (gpufleet.replica's sender marks each own directory it copied
    SENT): rank 0's steps go out at once, rank 1's step 8 after a while, its step 12 never. No
    rank writes step 12 before rank 1's step 8 is out; the wait for step 12 gives up with one
    line; and with --keep-local-checkpoints 1 each rank still keeps step 8, the newest step every
    rank's copy is out for, beside its newest."""
    root = tmp_path / "local"
    root.mkdir(mode=0o700)
    args = ["--global-batch", "8", "--micro-batch", "2", "--straggler-every", "0", "--steps", "16"]
    args += ["--local-checkpoint-every", "4", "--keep-local-checkpoints", "1"]
    env = {**_env(root), COPIES_VAR: "1", COPY_WAIT_VAR: "4"}
    stop, early, marked = threading.Event(), [], set()

    def replicator() -> None:
        seen8 = None
        while not stop.is_set():
            for rank in (0, 1):
                for step in complete_steps(root, JOB, OWN, rank):
                    d = rank_dir(root, JOB, OWN, step, rank)
                    if (step, rank) in marked or (rank, step) == (1, 12):
                        continue
                    if (rank, step) == (1, 8):
                        seen8 = seen8 or time.monotonic()
                        if time.monotonic() - seen8 < 2:
                            continue
                        early.extend(r for r in (0, 1) if (root / JOB / OWN / "step_00000012").exists())
                        early.extend(r for r in (0, 1) if max(complete_steps(root, JOB, OWN, r)) > 8)
                    mark_sent(d, "peer-of-test")
                    marked.add((step, rank))
            time.sleep(0.02)

    helper = threading.Thread(target=replicator, daemon=True)
    helper.start()
    try:
        run = train(args, env=env)
    finally:
        stop.set()
        helper.join()
    assert run.returncode == 0, run.stderr
    assert (8, 1) in marked and early == [], f"ranks {early} wrote step 12 before rank 1's step 8 was copied"
    assert [complete_steps(root, JOB, OWN, r) for r in (0, 1)] == [[8, 16], [8, 16]]
    (warning,) = [ln for ln in run.stderr.splitlines() if "is not out" in ln]
    assert warning.startswith("warning: the copy of local step 12 to a peer node is not out for rank(s) 1 after 4 s")
    assert warning.endswith("a node lost meanwhile resumes from local step 8"), warning


def test_a_run_given_another_local_directory_than_the_one_copied_waits_for_no_copy(tmp_path):
    """The replicator copies $GPUFLEET_LOCAL_CHECKPOINT_DIR; a run given --local-checkpoint-dir
    elsewhere writes where nothing is copied, so it waits for nothing and warns of nothing."""
    copied, own = tmp_path / "copied", tmp_path / "own"
    for d in (copied, own):
        d.mkdir(mode=0o700)
    args = ["--global-batch", "8", "--micro-batch", "2", "--straggler-every", "0", "--steps", "8"]
    args += ["--local-checkpoint-every", "2", "--keep-local-checkpoints", "1", "--local-checkpoint-dir", str(own)]
    run = train(args, env={**_env(copied), COPIES_VAR: "1", COPY_WAIT_VAR: "30"})
    assert run.returncode == 0, run.stderr
    assert "is not out" not in run.stderr and "waited" not in run.stdout, run.stderr
    assert [complete_steps(own, JOB, OWN, r) for r in (0, 1)] == [[8], [8]]


def test_a_copy_wait_that_is_not_a_number_of_seconds_is_one_line_exit_2(tmp_path):
    root = tmp_path / "local"
    root.mkdir(mode=0o700)
    env = {**_env(root), COPIES_VAR: "1", COPY_WAIT_VAR: "soon"}
    line = one_line_exit_2(["--steps", "2", "--local-checkpoint-every", "1"], env=env)
    assert f"{COPY_WAIT_VAR}='soon' is not a number of seconds" in line, line
