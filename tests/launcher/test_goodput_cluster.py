"""A detached job's goodput against the simulated cluster: real sshd nodes, real torchrun over gloo,
the controller on node 0 writing the timeline's states and marks into the job's record."""

from __future__ import annotations

import json
import re
import time

import pytest

from launcher.jobs.goodput import CATEGORIES, goodput_of
from launcher.jobs.record import JobRecord
from tests.launcher.test_jobs_cluster import cluster, detach, jobdir, launch, wait_state
from tests.support import TRAIN, slow_steps, source_args, torch_args, wait_saved

pytestmark = pytest.mark.cluster


def test_launch_top_job_id_shows_the_jobs_goodput_while_it_runs(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    # Not workloads.train: any output line is progress, so the job is productive from "ready" on.
    job_id = detach(c, tmp_path, "exec", "--", "sh", "-c", "echo ready; sleep 12")
    r = launch(tmp_path, "top", job_id, *source_args(c, tmp_path), "--duration", "3", check=True)
    titles = [line for line in r.stdout.splitlines() if line.startswith(f"launch top: job {job_id}, 2 nodes")]
    # Once node 0 has answered (the first frame may come before), each frame's title has the goodput.
    assert any(re.search(r"  goodput \d+\.\d%.*, 0\.\d\d node-h, cost n/a  ", t) for t in titles), r.stdout
    done = wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=60)
    assert done["state"] == "SUCCEEDED", done
    g = done["goodput"]
    assert g["seconds"]["productive"] >= 11 and g["seconds"]["lost"] == 0 and g["seconds"]["recovering"] == 0, g
    c.assert_nothing_left()


def test_a_lost_node_shows_as_lost_work_then_recovering_and_launch_jobs_agrees_with_the_record(sim_cluster, tmp_path):
    # One detached train that loses node 1 once (a clean run's figures are the units' to check,
    # tests/launcher/test_goodput_units.py): the record's states and marks, the timeline from them,
    # and `launch jobs` (JSON and table) saying the same.
    c = cluster(sim_cluster, tmp_path, 2)
    ckpt = tmp_path / "ckpt"
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        *slow_steps(tmp_path),
        "--recover",
        "--",
        *TRAIN,
        *("--global-batch", "2", "--steps", "100", "--log-every", "1"),
        *("--checkpoint-dir", str(ckpt), "--checkpoint-every", "20"),
    )
    wait_saved(ckpt, 20)
    c.power_off(1)
    wait_state(c, tmp_path, job_id, {"RECOVERING"}, timeout=60)
    time.sleep(2)
    c.restart_sshd(1)
    done = wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=300)
    assert done["state"] == "SUCCEEDED" and len(done["recoveries"]) == 1, done
    g, record = done["goodput"], JobRecord.from_json(json.loads((jobdir(tmp_path, job_id) / "state.json").read_text()))
    assert [s["state"] for s in record.states] == ["PENDING", "RUNNING", "RECOVERING", "RUNNING", "SUCCEEDED"]
    assert record.states[0]["at"] == record.submitted and record.states[-1]["at"] == record.ended
    kinds = {m["kind"] for m in record.marks}
    assert {"first", "progress", "checkpoint", "failure"} <= kinds, record.marks
    cats = [s[2] for s in g["segments"]]
    assert cats[-6:] == ["starting", "productive", "lost", "recovering", "starting", "productive"], g["segments"]
    assert cats[:-6] in ([], ["queued"]), g["segments"]  # nothing was ahead: a queue of microseconds
    segs = g["segments"]
    assert segs[0][0] == record.submitted and segs[-1][1] == record.ended
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    # Lost work runs from the last checkpoint's step line to node 1's failure, then recovering to
    # the relaunch: the node was off for 2 s at least.
    (failure,) = [m for m in record.marks if m["kind"] == "failure"]
    saved = max(m["at"] for m in record.marks if m["kind"] == "checkpoint" and m["at"] <= failure["at"])
    lost = next(s for s in g["segments"] if s[2] == "lost")
    assert lost[:2] == [saved, failure["at"]]
    assert g["seconds"]["recovering"] >= 2 and g["seconds"]["productive"] > 0
    # `launch jobs --json` says what the record says, and its figures add up.
    assert g == goodput_of(record).to_json()
    assert g["wall_s"] == pytest.approx(record.ended - record.submitted, abs=1e-3)
    assert g["run_s"] == pytest.approx(record.ended - record.started, abs=1e-3)
    assert g["node_hours"] == pytest.approx(2 * g["run_s"] / 3600, abs=1e-5)
    assert sum(g["seconds"][k] for k in CATEGORIES) == pytest.approx(g["wall_s"], abs=1e-2)
    assert g["goodput_pct"] == pytest.approx(100 * g["seconds"]["productive"] / g["run_s"], abs=1e-2)
    # A hostfile without --machine-type: no price is known, so no cost is invented.
    assert record.machine_type is None and g["cost_usd"] == {"on_demand": None, "spot": None} and g["price"] is None
    table = launch(tmp_path, "jobs", *source_args(c, tmp_path), check=True).stdout
    row = next(line for line in table.splitlines() if job_id in line)  # the job's row (its recovery below it)
    assert f"{g['goodput_pct']:.1f}%" in row and f"{g['node_hours']:.2f}" in row and "n/a" in row, table
    c.assert_nothing_left()
