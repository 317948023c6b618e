"""--recover against the simulated cluster: real sshd nodes, real torchrun over gloo, the
controller on node 0. A node is "preempted" as Compute Engine stops a Spot VM (its workers get
SIGTERM and save, then its sshd and everything started through it die) and brought back later
with its disk and host key (SimCluster.preempt / restart_sshd)."""

from __future__ import annotations

import time

import pytest

from gpufleet.contracts import LABEL_NODE
from tests.launcher.fake_compute import FakeCompute, FakeInstance
from tests.launcher.test_jobs_cluster import cluster, detach, job, launch, wait_job, wait_state
from tests.support import (
    TRAIN,
    checkpoint_step,
    params,
    site_dir,
    slow_steps,
    source_args,
    torch_args,
    train_job,
    wait_saved,
)

pytestmark = pytest.mark.cluster

FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
NODES = 2


def fake_instances(c) -> list[FakeInstance]:
    """The cluster's nodes as Compute Engine instances gpu-0.. labelled cluster=t."""
    return [FakeInstance(f"gpu-{i}", n.address, {"cluster": "t", LABEL_NODE: str(i)}) for i, n in enumerate(c.nodes)]


def by_labels(c, api: FakeCompute, tmp_path) -> list[str]:
    """The nodes found by their labels through the fake Compute Engine API, as a stack-less user
    names them."""
    where = ["--project", "proj", "--zone", "us-central1-a", "--api-endpoint", api.endpoint]
    return ["--label", "cluster=t", *where, *c.launch_flags, "--runs-dir", str(tmp_path / "runs")]


def test_a_preempted_node_back_10_s_later_is_recovered_and_the_run_ends_as_an_uninterrupted_one(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, NODES)
    ckpt = tmp_path / "ckpt"
    common = [*TRAIN, "--global-batch", str(NODES), "--steps", "100", "--log-every", "10", "--checkpoint-every", "10"]
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        *slow_steps(tmp_path),
        "--recover",
        "--recover-timeout",
        "2m",
        "--",
        *common,
        "--checkpoint-dir",
        str(ckpt),
        "--save-params",
        str(tmp_path / "recovered.pt"),
    )
    wait_saved(ckpt, 20)
    c.preempt(1)
    t_gone = time.monotonic()
    seen = wait_state(c, tmp_path, job_id, {"RECOVERING"}, timeout=30)
    wait_job(c, tmp_path, job_id, lambda j: j["recoveries"][0]["node"] == 1, 20, "node 1 named")
    assert checkpoint_step(ckpt) < 100, "the preemption came after the end: make the run longer"
    time.sleep(max(0.0, 10 - (time.monotonic() - t_gone)))
    recovering = job(c, tmp_path, job_id)
    assert recovering["state"] == "RECOVERING" and "recovery 1 of 3: node 1" in recovering["why"], recovering
    back = time.time()
    c.restart_sshd(1)
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, done
    (rec,) = done["recoveries"]
    # waited_s counts from the controller's notice (rec["at"]), which a loaded machine delays by
    # seconds after the preemption: what must hold is that the relaunch came after the node did.
    assert rec["node"] == 1 and rec["at"] + rec["waited_s"] >= back, (rec, back)
    assert "preempted" in rec["cause"] or "unreachable" in rec["cause"], rec
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    assert "resumed from" in out and "] step 100/100 |" in out, seen
    c.assert_nothing_left()
    # The same run, uninterrupted and attached, ends with the same parameters.
    launch(
        tmp_path,
        "train",
        *source_args(c, tmp_path),
        *torch_args(),
        "--",
        *common,
        "--checkpoint-dir",
        str(tmp_path / "ckpt2"),
        "--save-params",
        str(tmp_path / "straight.pt"),
        check=True,
        timeout=300,
    )
    got, want = params(tmp_path / "recovered.pt"), params(tmp_path / "straight.pt")
    assert sorted(got) == sorted(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst == 0.0, f"parameters differ by up to {worst:g}\n{out}"


CRASH_AT_STEP_5 = """
    import os
    if "LOCAL_RANK" in os.environ and os.environ.get("RANK") == "0":
        import torch
        _step = torch.optim.AdamW.step
        def step(self, *a, **k):
            s = next(iter(self.state.values()), {}).get("step")
            if s is not None and int(s) == 4:  # the optimizer's own count: step 5 also after a resume
                print("error: injected crash at step 5", flush=True)
                os._exit(3)
            return _step(self, *a, **k)
        torch.optim.AdamW.step = step
"""


def test_a_crash_at_the_same_step_with_the_same_error_is_retried_once_then_fails(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    site = site_dir(tmp_path, CRASH_AT_STEP_5)
    ckpt = tmp_path / "ckpt"
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        "--env",
        f"PYTHONPATH={site}",
        "--recover",
        "--",
        *train_job(2, 20, ckpt, 2, 1),
    )
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
    assert done["state"] == "FAILED" and done["exit"] != 0, done
    assert "same error at step 4" in done["why"] and "injected crash at step 5" in done["why"], done
    first, second = done["recoveries"]
    assert first["waited_s"] is not None and second["waited_s"] is None, done["recoveries"]
    assert first["signature"] == second["signature"] and first["step"] == second["step"] == 4
    assert checkpoint_step(ckpt) == 4
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    nodes = "\n".join(line for line in out.splitlines() if line.startswith("[node "))
    assert nodes.count("injected crash at step 5") == 2 and "resumed from" in nodes
    # Then the controller's own lines: the recovery, and the end with the repeated error's verdict.
    said = [line.split(" ", 3)[3] for line in out.splitlines() if line.startswith("[controller] ")]
    assert said[0].startswith("recovery 1 of 3: node ") and "(reason worker-failed)" in said[0], said
    assert said[-1].startswith(f"job {job_id} ended FAILED at ") and "same error at step 4" in said[-1], said
    table = launch(tmp_path, "jobs", *source_args(c, tmp_path), check=True).stdout
    assert "FAILED" in table and "(2" in table and "recoveries;" in table, table  # the why column may wrap
    # attach on the ended job: its output, then the summary with every recovery listed.
    attached = launch(tmp_path, "attach", *source_args(c, tmp_path), job_id)
    assert attached.returncode == done["exit"], attached.stderr
    assert "recovery 1: " in attached.stderr and "relaunched after" in attached.stderr, attached.stderr
    assert "recovery 2: " in attached.stderr and "not relaunched" in attached.stderr
    c.assert_nothing_left()


def test_recover_without_a_checkpoint_dir_is_refused_before_anything_starts(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    r = launch(
        tmp_path,
        "train",
        *source_args(c, tmp_path),
        *torch_args(),
        "--detach",
        "--recover",
        "--",
        *TRAIN,
        "--steps",
        "5",
    )
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    (line,) = [l for l in r.stderr.splitlines() if l.strip()]
    assert line.startswith("error: ") and "--checkpoint-dir" in line, r.stderr
    attached = launch(
        tmp_path,
        "train",
        *source_args(c, tmp_path),
        "--recover",
        "--",
        *TRAIN,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    )
    assert attached.returncode == 2 and "--recover needs --detach" in attached.stderr, attached.stderr
    assert not (tmp_path / "home0" / ".gpufleet").exists() and not (tmp_path / "ckpt").exists()
    c.assert_nothing_left()


def test_a_preempted_spot_node_that_compute_engine_stopped_is_started_again_through_the_api(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    instances = fake_instances(c)

    def boot(inst: FakeInstance) -> None:  # what instances.start does: the VM boots, its sshd answers
        time.sleep(2)
        c.restart_sshd(int(inst.name.split("-")[1]))

    # On the bridge's address: the controller asks from inside node 0's network namespace.
    with FakeCompute({("proj", "us-central1-a"): instances}, on_start=boot, host=c.gateway) as api:
        ckpt = tmp_path / "ckpt"
        r = launch(
            tmp_path,
            "train",
            *by_labels(c, api, tmp_path),
            *torch_args(),
            *slow_steps(tmp_path),
            "--detach",
            "--recover",
            "--recover-timeout",
            "2m",
            "--",
            *train_job(2, 100, ckpt, 10, 10),
            check=True,
        )
        job_id = r.stdout.split()[1]
        wait_saved(ckpt, 20)
        c.preempt(1)
        instances[1].status = "TERMINATED"  # a Spot VM stops (instanceTerminationAction STOP)
        assert checkpoint_step(ckpt) < 100, "the preemption came after the end: make the run longer"
        done = wait_state(c, tmp_path, job_id, FINAL, timeout=180)
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, done
    (rec,) = done["recoveries"]
    assert rec["node"] == 1 and rec["restarted"] == {"gpu-1": "started (it was TERMINATED)"}, rec
    # start went to that instance only, once; get asked about no node that answered.
    starts = [q["instance"] for q in api.requests if q.get("method") == "start"]
    gets = {q["instance"] for q in api.requests if q.get("method") == "get"}
    assert starts == ["gpu-1"] and gets == {"gpu-1"}, api.requests
    assert instances[1].status == "RUNNING"
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    assert "resumed from" in out and "] step 100/100 |" in out
    c.assert_nothing_left()


def test_a_node_never_back_fails_the_job_after_the_timeout_naming_it_and_no_restart_stopped_leaves_its_vm_alone(
    sim_cluster, tmp_path
):
    c = cluster(sim_cluster, tmp_path, 2)
    instances = fake_instances(c)
    with FakeCompute({("proj", "us-central1-a"): instances}, host=c.gateway) as api:
        ckpt = tmp_path / "ckpt"
        r = launch(
            tmp_path,
            "train",
            *by_labels(c, api, tmp_path),
            *torch_args(),
            *slow_steps(tmp_path),
            "--detach",
            "--recover",
            "--no-restart-stopped",
            "--recover-timeout",
            "5s",
            "--",
            *train_job(2, 100000, ckpt, 5),
            check=True,
        )
        job_id = r.stdout.split()[1]
        wait_saved(ckpt, 5)
        c.power_off(1)
        instances[1].status = "TERMINATED"
        done = wait_state(c, tmp_path, job_id, FINAL, timeout=90)
    assert done["state"] == "FAILED" and done["failed_node"] == 1, done
    assert "node 1 was not back within --recover-timeout 5 s" in done["why"] and c.nodes[1].address in done["why"]
    (rec,) = done["recoveries"]
    assert rec["node"] == 1 and rec["waited_s"] is None and rec["restarted"] == {}, rec
    assert [q for q in api.requests if q.get("method")] == [] and instances[1].status == "TERMINATED"
    c.assert_nothing_left()


def test_max_recoveries_1_with_two_preemptions_ends_the_job_at_the_second_and_lists_both(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    ckpt = tmp_path / "ckpt"
    job_id = detach(
        c,
        tmp_path,
        "train",
        *torch_args(),
        *slow_steps(tmp_path),
        "--recover",
        "--max-recoveries",
        "1",
        "--",
        *train_job(2, 100000, ckpt, 10, 10),
    )
    wait_saved(ckpt, 10)
    c.preempt(1)
    wait_state(c, tmp_path, job_id, {"RECOVERING"}, timeout=30)
    c.restart_sshd(1)
    wait_job(c, tmp_path, job_id, lambda j: j["recoveries"][0]["waited_s"] is not None, 60, "relaunched")
    first = checkpoint_step(ckpt)
    wait_saved(ckpt, first + 10)  # progress after the resume
    c.preempt(1)
    done = wait_state(c, tmp_path, job_id, FINAL, timeout=60)
    assert done["state"] == "FAILED" and "gave up after 1 recoveries (--max-recoveries 1)" in done["why"], done
    one, two = done["recoveries"]
    assert one["waited_s"] is not None and two["waited_s"] is None and two["at"] > one["at"], done["recoveries"]
    assert "preempted" in two["cause"] or "unreachable" in two["cause"]
    c.restart_sshd(1)
    c.assert_nothing_left()


def test_stop_while_recovering_ends_the_job_stopped_and_relaunches_nothing(sim_cluster, tmp_path):
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
        *train_job(2, 100000, ckpt, 5),
    )
    wait_saved(ckpt, 5)
    c.power_off(1)
    wait_state(c, tmp_path, job_id, {"RECOVERING"}, timeout=30)
    r = launch(tmp_path, "stop", *source_args(c, tmp_path), job_id, check=True)
    assert "STOPPED" in r.stderr, r.stderr
    done = job(c, tmp_path, job_id)
    assert done["state"] == "STOPPED" and "while recovering" in done["why"], done
    c.restart_sshd(1)
    time.sleep(3)
    assert job(c, tmp_path, job_id)["state"] == "STOPPED"
    c.assert_nothing_left()
