"""`launch nccl-tests --detach`: the sweep runs under node 0's controller without the
client, and its report is read back from the node log with `--from`, as from any log that exists."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.launcher.test_jobs_cluster import client_env, cluster, detach, launch, wait_state
from tests.support import LAUNCH, source_args, torch_args

pytestmark = pytest.mark.cluster


def test_a_detached_sweep_finishes_without_the_client_and_its_log_gives_the_report(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    job_id = detach(
        c, tmp_path, "nccl-tests", *torch_args(), "-b", "1K", "-e", "64K", "-f", "8", "--ops", "all_reduce,all_gather"
    )
    done = wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"})
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, done

    log = launch(tmp_path, "logs", job_id, "--node", "0", *source_args(c, tmp_path), check=True).stdout
    report = subprocess.run(
        [LAUNCH, "nccl-tests", "--from", "-", "--json", "--runs-dir", str(tmp_path / "runs")],
        input=log,
        capture_output=True,
        text=True,
        env=client_env(tmp_path),
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    rows = [json.loads(line) for line in report.stdout.splitlines()]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather"}
    assert [r["size"] for r in rows if r["collective"] == "all_reduce"] == [1024, 8192, 65536]
    assert all(r["oop_wrong"] == 0 for r in rows)
    c.assert_nothing_left(within=10)


def test_detach_refuses_the_bad_node_finder_in_one_line_and_starts_nothing(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    r = launch(tmp_path, "nccl-tests", *source_args(c, tmp_path), "--detach", "--find-bad-nodes")
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: --detach hands one sweep to node 0; --find-bad-nodes runs several launches")
    assert launch(tmp_path, "jobs", *source_args(c, tmp_path), "--json", check=True).stdout == ""


def test_an_attached_sweep_on_nodes_a_detached_job_holds_is_refused_in_one_line_and_starts_nothing(
    sim_cluster, tmp_path
):
    """Attached `nccl-tests` goes through the same attached path as `launch run`, busy check included."""
    c = cluster(sim_cluster, tmp_path, 3)  # --find-bad-nodes needs 3
    go = tmp_path / "go"
    held = detach(c, tmp_path, "exec", "--", "sh", "-c", f"while [ ! -f {go} ]; do sleep 0.1; done; echo held")
    wait_state(c, tmp_path, held, {"RUNNING"}, timeout=30)
    r = launch(
        tmp_path, "nccl-tests", *source_args(c, tmp_path), *torch_args(), "-b", "1K", "-e", "1K", "--ops", "all_reduce"
    )
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [l for l in r.stderr.splitlines() if l.strip()]
    assert line.startswith("error: ") and f"busy with detached job {held} (RUNNING" in line, r.stderr
    assert "busbw" not in r.stdout  # no sweep ran: no rows
    # The bad-node search's launches are refused alike.
    r = launch(tmp_path, "nccl-tests", *source_args(c, tmp_path), *torch_args(), "--find-bad-nodes")
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("error")]
    assert len(errors) == 1 and f"busy with detached job {held} (RUNNING" in errors[0], r.stderr
    assert not list((tmp_path / "runs").glob("*/pairs.tsv"))
    go.touch()
    done = wait_state(c, tmp_path, held, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=60)
    assert done["state"] == "SUCCEEDED", done
    c.assert_nothing_left()
