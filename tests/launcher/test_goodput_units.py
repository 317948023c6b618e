"""A detached job's timeline, goodput, node-hours and cost (launcher.jobs.goodput), from records built
the way the controller writes them, and the catalog's price table they use."""

from __future__ import annotations

import pytest

from gpufleet import catalog
from launcher.jobs.goodput import CATEGORIES, MarkKeeper, format_cost, goodput_of, note_state, summary, timeline
from launcher.jobs.record import JobRecord, JobState

TRAIN = "torchrun -m workloads.train --steps 100 --checkpoint-dir /tmp/ck --checkpoint-every 10"


def _record(states, marks=(), what=TRAIN, nodes=2, machine_type=None, now_state=None) -> JobRecord:
    """A record whose states are [(at, STATE), ...], in the order the controller saved them."""
    last_state = now_state or states[-1][1]
    final = JobState(last_state).final
    running = [at for at, s in states if s == "RUNNING"]
    return JobRecord(
        id="20260101-120000-a1b2c3",
        state=JobState(last_state),
        what=what,
        nodes=[f"10.0.0.{k}" for k in range(nodes)],
        submitted=states[0][0],
        started=running[0] if running else None,
        ended=states[-1][0] if final else None,
        machine_type=machine_type,
        states=[{"at": at, "state": s} for at, s in states],
        marks=[{"at": at, "kind": kind, "step": step} for at, kind, step in marks],
    )


def _by_category(segments) -> list[tuple[float, float, str]]:
    return [(s.start, s.end, s.category) for s in segments]


def _add_up(g) -> None:
    """The segments are contiguous, cover submission to the end, and their sums are the wall time."""
    segs = g.segments
    assert all(a.end == b.start for a, b in zip(segs, segs[1:])), segs
    assert sum(s.seconds for s in segs) == pytest.approx(g.wall_s, abs=1e-9)
    assert sum(g.seconds[c] for c in CATEGORIES) == pytest.approx(g.wall_s, abs=1e-9)


def test_a_clean_run_is_queued_then_starting_then_productive_and_adds_up_to_wall_time():
    r = _record([(0.0, "PENDING"), (10.0, "RUNNING"), (110.0, "SUCCEEDED")], marks=[(25.0, "first", 1)])
    g = goodput_of(r)
    assert _by_category(g.segments) == [(0.0, 10.0, "queued"), (10.0, 25.0, "starting"), (25.0, 110.0, "productive")]
    _add_up(g)
    assert g.wall_s == 110.0 and g.run_s == 100.0
    assert g.goodput_pct == pytest.approx(85.0)  # productive over the time on the nodes: the queue is left out
    assert g.node_hours == pytest.approx(2 * 100.0 / 3600)


def test_one_recovery_splits_into_productive_lost_work_and_recovering():
    # Attempt 1: first step at 10, checkpoint of step 10 (its line at 40), last step at 51, node 1
    # lost at 52; RECOVERING at 60 (after the launch stopped the others), relaunched at 80;
    # attempt 2: first step at 90 (after the restore), done at 150.
    r = _record(
        [(0.0, "PENDING"), (2.0, "RUNNING"), (60.0, "RECOVERING"), (80.0, "RUNNING"), (150.0, "SUCCEEDED")],
        marks=[
            (10.0, "first", 1),
            (40.0, "checkpoint", 10),
            (51.0, "progress", 14),
            (52.0, "failure", None),
            (90.0, "first", 11),
            (140.0, "checkpoint", 20),
            (148.0, "progress", 20),
        ],
    )
    g = goodput_of(r)
    assert _by_category(g.segments) == [
        (0.0, 2.0, "queued"),
        (2.0, 10.0, "starting"),
        (10.0, 40.0, "productive"),
        (40.0, 52.0, "lost"),  # steps 11..14 were done again after the relaunch
        (52.0, 80.0, "recovering"),  # detection, the node's return, every node's check
        (80.0, 90.0, "starting"),
        (90.0, 150.0, "productive"),
    ]
    _add_up(g)
    assert g.seconds == {"queued": 2.0, "starting": 18.0, "productive": 90.0, "lost": 12.0, "recovering": 28.0}
    assert g.goodput_pct == pytest.approx(100.0 * 90 / 148)


def test_lost_work_starts_at_the_attempts_first_step_when_it_saved_no_checkpoint_yet():
    # The earlier attempt's checkpoint (at 30) was resumed from; this attempt saved none, so all
    # of its steps are lost.
    r = _record(
        [(0.0, "PENDING"), (0.0, "RUNNING"), (40.0, "RECOVERING"), (50.0, "RUNNING"), (90.0, "RECOVERING")],
        marks=[(5.0, "first", 1), (30.0, "checkpoint", 5), (39.0, "failure", None), (60.0, "first", 6)],
        now_state="RECOVERING",
    )
    g = goodput_of(r, now=100.0)
    assert _by_category(g.segments)[-3:] == [
        (50.0, 60.0, "starting"),
        (60.0, 90.0, "lost"),
        (90.0, 100.0, "recovering"),
    ]
    _add_up(g)


def test_a_job_that_reports_no_checkpoints_loses_only_the_work_after_its_last_progress_mark():
    r = _record(
        [(0.0, "PENDING"), (0.0, "RUNNING"), (30.0, "RECOVERING"), (40.0, "RUNNING"), (70.0, "SUCCEEDED")],
        marks=[(3.0, "first", None), (20.0, "progress", None), (25.0, "failure", None), (45.0, "first", None)],
        what="torchrun my_train.py --epochs 3",
    )
    g = goodput_of(r)
    assert _by_category(g.segments)[:4] == [
        (0.0, 3.0, "starting"),
        (3.0, 20.0, "productive"),
        (20.0, 25.0, "lost"),
        (25.0, 40.0, "recovering"),
    ]
    _add_up(g)


def test_a_train_run_with_checkpoints_that_fails_before_the_first_save_loses_every_step():
    r = _record(
        [(0.0, "PENDING"), (1.0, "RUNNING"), (31.0, "FAILED")],
        marks=[(5.0, "first", 1), (29.0, "progress", 9)],
    )
    assert _by_category(timeline(r)) == [(0.0, 1.0, "queued"), (1.0, 5.0, "starting"), (5.0, 31.0, "lost")]


def test_a_running_job_is_counted_up_to_now_and_a_pending_one_has_no_goodput_yet():
    running = _record([(0.0, "PENDING"), (4.0, "RUNNING")], marks=[(8.0, "first", 1)])
    g = goodput_of(running, now=20.0)
    assert _by_category(g.segments)[-1] == (8.0, 20.0, "productive") and g.wall_s == 20.0
    pending = goodput_of(_record([(0.0, "PENDING")]), now=5.0)
    assert pending.goodput_pct is None and pending.node_hours == 0.0 and pending.seconds["queued"] == 5.0
    assert summary(pending) == "goodput - (not started)"


def test_a_record_from_before_states_were_kept_is_read_from_its_times():
    r = JobRecord(
        id="20260101-120000-a1b2c3",
        state=JobState.SUCCEEDED,
        what="exec true",
        nodes=["a"],
        submitted=0.0,
        started=3.0,
        ended=9.0,
    )
    assert _by_category(timeline(r)) == [(0.0, 3.0, "queued"), (3.0, 9.0, "starting")]


def test_cost_uses_the_catalogs_on_demand_and_spot_prices_per_node_hour():
    # 2 nodes for 1800 s on the nodes: one node-hour.
    r = _record([(0.0, "PENDING"), (0.0, "RUNNING"), (1800.0, "SUCCEEDED")], machine_type="a3-highgpu-8g")
    g = goodput_of(r)
    price = catalog.machine_price("a3-highgpu-8g")
    assert g.node_hours == pytest.approx(1.0)
    assert g.cost_on_demand_usd == pytest.approx(price.on_demand_usd_per_hour) == pytest.approx(88.49, abs=0.01)
    assert g.cost_spot_usd == pytest.approx(price.spot_usd_per_hour) == pytest.approx(35.40, abs=0.01)
    assert format_cost(g) == "$88.49 on-demand / $35.40 Spot"
    j = g.to_json()
    assert j["price"]["region"] == "us-central1" and j["price"]["retrieved"] == "2025-03-06"
    assert j["cost_usd"] == {"on_demand": pytest.approx(88.49, abs=0.01), "spot": pytest.approx(35.40, abs=0.01)}


@pytest.mark.parametrize("machine_type", [None, "a4-highgpu-8g", "n1-standard-4"])
def test_an_unknown_price_is_shown_as_na_never_guessed(machine_type):
    g = goodput_of(_record([(0.0, "PENDING"), (0.0, "RUNNING"), (60.0, "SUCCEEDED")], machine_type=machine_type))
    assert g.cost_on_demand_usd is None and g.cost_spot_usd is None and format_cost(g) == "n/a"
    assert g.to_json()["cost_usd"] == {"on_demand": None, "spot": None} and g.node_hours > 0


def test_every_price_is_a_catalog_machine_type_with_spot_below_on_demand():
    for name, p in catalog.MACHINE_PRICES.items():
        assert name in catalog.MACHINE_TYPES and p.machine_type == name
        assert 0 < p.spot_usd_per_hour < p.on_demand_usd_per_hour
        assert "pricing" in p.source and p.retrieved == "2025-03-06"
    # The price grows with the GPUs: the 8-GPU A3 High costs 8 times the 1-GPU one, to the cent.
    one, eight = catalog.MACHINE_PRICES["a3-highgpu-1g"], catalog.MACHINE_PRICES["a3-highgpu-8g"]
    assert eight.on_demand_usd_per_hour == pytest.approx(8 * one.on_demand_usd_per_hour, abs=0.01)


# ---- what the controller writes ----


def test_note_state_records_each_change_once_at_the_records_own_times():
    r = _record([(100.0, "PENDING")])
    r.states = []
    note_state(r, now=101.0)
    note_state(r, now=102.0)  # no change: nothing added
    r.state, r.started = JobState.RUNNING, 103.0
    note_state(r, now=103.5)
    r.state = JobState.RECOVERING
    note_state(r, now=110.0)
    r.state, r.ended = JobState.FAILED, 120.0
    note_state(r, now=121.0)
    assert r.states == [
        {"at": 100.0, "state": "PENDING"},
        {"at": 103.0, "state": "RUNNING"},
        {"at": 110.0, "state": "RECOVERING"},
        {"at": 120.0, "state": "FAILED"},
    ]

    # A job with nothing ahead is first saved RUNNING: its (short) queue still starts the timeline.
    quick = _record([(200.0, "PENDING")])
    quick.states, quick.state, quick.started = [], JobState.RUNNING, 200.5
    note_state(quick, now=200.6)
    assert quick.states == [{"at": 200.0, "state": "PENDING"}, {"at": 200.5, "state": "RUNNING"}]


def test_the_mark_keeper_keeps_at_most_four_marks_per_attempt_from_train_lines():
    r = _record([(0.0, "PENDING")])
    keeper = MarkKeeper(r)
    assert not keeper.line("model: 1.2M parameters", 1.0)  # not a step line: no progress for train
    for step in range(1, 13):
        assert keeper.line(f"step {step}/100 | loss 3.2 | lr 6.00e-04 | 12.0 ms/step", 10.0 + step)
    # An async save's line comes after later steps: the checkpoint holds the work up to step 10's line.
    assert keeper.line("checkpoint step 10 -> /tmp/ck/step_10 (1.2 MiB in 0.40 s)", 30.0)
    assert keeper.node_failed(31.0) and not keeper.node_failed(32.0)
    assert r.marks == [
        {"at": 11.0, "kind": "first", "step": 1},
        {"at": 22.0, "kind": "progress", "step": 12},
        {"at": 20.0, "kind": "checkpoint", "step": 10},
        {"at": 31.0, "kind": "failure", "step": None},
    ]
    keeper.new_attempt()
    assert keeper.line("[rank0]: step 11/100 | loss 3.1 | lr 6.00e-04 | 12.0 ms/step", 50.0)
    assert r.marks[-1] == {"at": 50.0, "kind": "first", "step": 11} and len(r.marks) == 5


def test_for_other_workloads_any_output_line_is_progress():
    r = _record([(0.0, "PENDING")], what="torchrun my_train.py --epochs 3")
    keeper = MarkKeeper(r)
    assert keeper.line("epoch 0 loss 1.0", 5.0) and keeper.line("epoch 1 loss 0.9", 6.0)
    assert [m["kind"] for m in r.marks] == ["first", "progress"]


def test_with_a_progress_regex_only_matching_lines_are_progress():
    r = _record([(0.0, "PENDING")], what="torchrun my_train.py --epochs 3")
    keeper = MarkKeeper(r, progress=r"epoch \d+ done")
    assert not keeper.line("loading data", 1.0) and keeper.line("epoch 0 done", 2.0)
    assert r.marks == [{"at": 2.0, "kind": "first", "step": None}]


def test_a_job_that_never_checkpoints_keeps_a_bounded_memory_of_step_times():
    r = _record([(0.0, "PENDING")], what="torchrun -m workloads.train --steps 100000")
    keeper = MarkKeeper(r)
    for step in range(1, 5001):
        keeper.line(f"step {step}/100000 | loss 3.2 | lr 6.00e-04 | 12.0 ms/step", float(step))
    assert len(keeper._seen) <= 1024 and len(r.marks) == 2
    # A (late) save of a recent step still finds that step's time.
    assert keeper.line("checkpoint step 4990 -> /tmp/ck/step_4990 (1 MiB in 0.1 s)", 5001.0)
    assert r.marks[-1] == {"at": 4990.0, "kind": "checkpoint", "step": 4990}
