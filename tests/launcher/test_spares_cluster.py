"""--spares against the simulated cluster: real sshd nodes, real torchrun over gloo, the
controller on node 0. Three nodes train and a fourth waits, checked and prepared; node 1 is lost
for good (SimCluster.power_off: its sshd and everything under it killed, never started again),
and the spare takes its place at once. Then node 1 comes back and the former spare is lost too:
with no spare left, node 1 is checked again, rejoins and takes that place. The job ends SUCCEEDED
on the same world size, resumed from its checkpoint, with both swaps in its record and in
`launch jobs`."""

from __future__ import annotations

import pytest

from tests.launcher.test_jobs_cluster import cluster, detach, job, launch, wait_job, wait_state
from tests.support import checkpoint_step, slow_steps, source_args, torch_args, train_job, wait_saved

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def test_a_node_lost_for_good_is_replaced_by_the_spare_and_the_job_succeeds_with_the_swap_recorded(
    sim_cluster, tmp_path
):
    c = cluster(sim_cluster, tmp_path, 4)
    a = [n.address for n in c.nodes]
    ckpt = tmp_path / "ckpt"
    # A long --recover-timeout: only the spare, never a wait for node 1, can end this job in time. A
    # short --term-grace: the survivors of a lost node cannot finish a collective save anyway.
    job_id = detach(
        c, tmp_path, "train", *torch_args(), *slow_steps(tmp_path), "--term-grace", "3s", "--recover",
        "--recover-timeout", "30m", "--spares", "1", "--",
        *train_job(3, 100, ckpt, 10, 10),
    )  # fmt: skip
    running = job(c, tmp_path, job_id)
    assert running["nodes"] == a[:3] and running["spares"] == [a[3]], running
    wait_saved(ckpt, 10)
    c.power_off(1)
    wait_job(c, tmp_path, job_id, lambda j: j["out"] == [a[1]], 90, "node 1 swapped out")
    wait_job(c, tmp_path, job_id, lambda j: j["recoveries"][0]["waited_s"] is not None, 90, "relaunched")
    first = checkpoint_step(ckpt)
    wait_saved(ckpt, first + 10)  # progress on the spare
    c.restart_sshd(1)  # node 1 is back, and healthy: it rejoins when a spare is next needed
    assert checkpoint_step(ckpt) < 80, "the second loss came near the end: make the run longer"
    c.power_off(3)
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=240)
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, (done, out)
    # The same world size, the rejoined node 1 back at its place, ranks in the job's order.
    assert done["nodes"] == [a[0], a[1], a[2]] and done["spares"] == [] and done["out"] == [a[3]], done
    one, two = done["recoveries"]
    (swap,) = one["swaps"]
    assert (swap["rank"], swap["out"], swap["into"], swap["why"]) == (1, a[1], a[3], "unreachable"), one
    # a[3] held rank 2 of [a0, a2, a3]; node 1 (a[1]) rejoined the spares and took its place.
    assert [(s["rank"], s["out"], s["into"]) for s in two["swaps"]] == [(2, a[3], a[1])], two
    assert one["waited_s"] is not None and two["waited_s"] is not None, done["recoveries"]
    assert "resumed from" in out and "] step 100/100 |" in out, out
    said = [line.split(" ", 3)[3] for line in out.splitlines() if line.startswith("[controller] ")]
    assert any(s.startswith(f"swapped node 1 ({a[1]}) → spare {a[3]} (unreachable); 0 spares left") for s in said), said
    assert f"node {a[1]} passes its check again: it is a spare again" in said, said
    assert any("on 3 nodes" in s for s in said if s.startswith("relaunched after")), said
    # launch jobs: the job's failure, its time to train again and the swap, one line below the table.
    table = launch(tmp_path, "jobs", *source_args(c, tmp_path), check=True).stdout
    (line,) = [l for l in table.splitlines() if l.startswith(f"job {job_id} failure 1 (node 1")]
    assert "trained again after " in line and "restored from durable" in line, line
    assert line.endswith(f"swapped node 1 ({a[1]}) → spare {a[3]} (unreachable)"), line
    failure, _ = job(c, tmp_path, job_id)["goodput"]["failures"]
    assert failure["to_train_s"] > 0 and failure["swaps"] == [swap], failure
    c.assert_nothing_left()
