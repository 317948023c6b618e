"""bench.bench_faults' own logic: the fault schedule and the lost work read from a job's output."""

import pytest

from bench.bench_faults import KINDS, lost_steps, schedule, tier


def test_schedule_spaces_the_five_faults_from_half_an_interval_on():
    faults = schedule(10, 120)
    assert [f.kind for f in faults] == list(KINDS)
    assert [f.at_s for f in faults] == [60, 180, 300, 420, 540]
    assert KINDS.index("node lost for good") < KINDS.index("node lost for 10 s")  # while the spare is free


def test_schedule_refuses_a_run_too_short_for_the_last_fault():
    with pytest.raises(ValueError, match="--minutes 2 is too short"):
        schedule(2, 30)


def test_lost_steps_counts_from_the_last_step_before_each_restore():
    out = "\n".join(
        [
            "[node0] step 1/100 | loss 4.1",
            "[node0] step 17/100 | loss 3.9",
            "node 1 (10.0.0.2): exit 137",
            "[node0] restored step 10 from local",
            "[node0] step 11/100 | loss 3.8",
            "[node0] step 23/100 | loss 3.7",
            "[node0] restored step 20 from durable",
        ]
    )
    assert lost_steps(out) == [(17, 10, "local", 7), (23, 20, "durable", 3)]


def test_todays_resume_line_counts_and_a_tier_line_of_the_same_restore_counts_once():
    out = "\n".join(
        [
            "[node0] step 34/100 | loss 3.1",
            "[node0] resumed from /ckpt/step_30 at step 30 (epoch 0, 90 samples seen)",
            "[node0] restored step 30 from durable",
            "[node0] step 31/100 | loss 3.0",
            "[node0] step 42/100 | loss 2.9",
            "[node0] resumed from local tier at step 40 (epoch 0, 120 samples seen)",
        ]
    )
    assert lost_steps(out) == [(34, 30, "durable", 4), (42, 40, "local tier", 2)]


def test_a_resume_line_names_its_tier():
    assert tier("the local tier (own copies on 3 ranks, peer copies on 0)") == "local"
    assert tier("/tmp/ckpt") == "durable"
    assert tier("local") == "local"
