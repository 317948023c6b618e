"""--spares' pure parts (launcher.jobs.spares): which nodes are spares, who takes a lost node's
place and in which rank, the record and request that carry them (an old record still reads),
each failure's account in goodput, and the refusals: one line, exit 2, nothing started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main as cli
from launcher.core.types import Cluster, LaunchConfig, Node, SshConfig, UserError, Workload
from launcher.jobs.goodput import MarkKeeper, failure_lines, failures, goodput_of, restored_from
from launcher.jobs.record import JobRecord, JobState, request_json
from launcher.jobs.recovery import (
    RecoverRequest,
    Recovery,
    bad_at_check,
    judged_bad,
    recover_policy,
    recovery_lines,
)
from launcher.jobs.spares import Swap, check_spares, split_spares, swap_in

TRAIN_ARGV = ("-m", "workloads.train", "--steps", "10", "--checkpoint-dir", "/ckpt")


def nodes(*hosts: str) -> tuple[Node, ...]:
    return tuple(Node(i, h, h, name=f"vm-{h}") for i, h in enumerate(hosts))


def test_the_last_k_nodes_of_the_launch_order_are_the_spares():
    world, spares = split_spares(nodes("a", "b", "c", "d"), 1)
    assert [n.host for n in world] == ["a", "b", "c"] and [n.rank for n in world] == [0, 1, 2]
    assert [n.host for n in spares] == ["d"]
    world, spares = split_spares(nodes("a", "b", "c", "d"), 2)
    assert [n.host for n in world] == ["a", "b"] and [n.host for n in spares] == ["c", "d"]
    assert split_spares(nodes("a", "b"), 0) == (nodes("a", "b"), ())


def test_a_spare_takes_the_lost_nodes_place_in_the_jobs_order_and_the_world_keeps_its_size():
    order = ["a", "b", "c", "d"]
    world, left, swaps = swap_in(order, nodes("a", "b", "c"), {1: "unreachable"}, nodes("d"))
    assert [(n.rank, n.host) for n in world] == [(0, "a"), (1, "c"), (2, "d")] and left == ()
    assert [(s.rank, s.out, s.into, s.why) for s in swaps] == [(1, "b", "d", "unreachable")]
    assert world[2].name == "vm-d"  # the spare keeps what the request knew of it
    # Node 0 lost: the first node in use holds the rendezvous now.
    world, _, _ = swap_in(order, nodes("a", "b", "c"), {0: "hang"}, nodes("d"))
    assert [n.host for n in world] == ["b", "c", "d"] and world[0].rank == 0


def test_a_node_that_rejoined_the_spares_goes_back_to_its_place_in_the_order():
    order = ["a", "b", "c", "d"]
    world = tuple(Node(i, h, h) for i, h in enumerate(["a", "c", "d"]))  # b was swapped out, then back
    new, left, swaps = swap_in(order, world, {2: "check failed"}, (Node(1, "b", "b"),))
    assert [(n.rank, n.host) for n in new] == [(0, "a"), (1, "b"), (2, "c")] and left == ()
    assert swaps[0].out == "d" and swaps[0].into == "b" and swaps[0].why == "check failed"


def test_more_lost_nodes_than_spares_swaps_the_lowest_ranks_and_keeps_the_rest():
    world, left, swaps = swap_in(list("abcde"), nodes("a", "b", "c"), {2: "unreachable", 1: "unreachable"}, nodes("d"))
    assert [n.host for n in world] == ["a", "c", "d"] and left == ()
    assert [s.rank for s in swaps] == [1]
    world, left, swaps = swap_in(list("abcd"), nodes("a", "b", "c"), {1: "unreachable"}, ())
    assert [n.host for n in world] == ["a", "b", "c"] and swaps == []


@pytest.mark.parametrize(
    "spares, n, words",
    [(-1, 4, "--spares -1 is negative"), (4, 4, "--spares 4 leaves no node"), (5, 4, "give at most 3")],
)
def test_bad_spares_are_one_line_naming_the_flag_and_the_fix(spares, n, words):
    with pytest.raises(UserError) as e:
        check_spares(spares, n)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_spares_need_recover_and_travel_in_the_policy():
    with pytest.raises(UserError, match="--spares needs --recover"):
        recover_policy(RecoverRequest(spares=1), TRAIN_ARGV, detach=True)
    with pytest.raises(UserError, match="--spares -2 is negative"):
        recover_policy(RecoverRequest(recover=True, spares=-2), TRAIN_ARGV, detach=True)
    assert recover_policy(RecoverRequest(recover=True, spares=1), TRAIN_ARGV, detach=True).spares == 1
    assert recover_policy(RecoverRequest(recover=True), TRAIN_ARGV, detach=True).spares == 0


def _hostfile(tmp_path: Path, n: int) -> Path:
    # TEST-NET-1 addresses (RFC 5737): nothing answers there, so a refusal must come before any contact.
    p = tmp_path / "hosts"
    p.write_text("".join(f"192.0.2.{i + 1}\n" for i in range(n)))
    return p


@pytest.mark.parametrize(
    "args, words",
    [
        (["--detach", "--recover", "--spares", "3"], "--spares 3 leaves no node to train on: the cluster has 3 nodes"),
        (["--detach", "--spares", "1"], "--spares needs --recover"),
        (["--spares", "1"], "--spares needs --recover"),
        (["--recover", "--spares", "1"], "--recover needs --detach"),
        (["--detach", "--recover", "--spares", "-1"], "--spares -1 is negative"),
        (["--detach", "--recover", "--spares", "1", "--min-nodes", "3"], "--min-nodes 3 is more than the job's 2"),
    ],
)
def test_spares_refusals_are_one_line_exit_2_and_start_nothing(tmp_path, args, words):
    hosts = _hostfile(tmp_path, 3)
    r = CliRunner().invoke(
        cli, ["run", "--hostfile", str(hosts), "--runs-dir", str(tmp_path / "runs"), *args, "--", "job.py"]
    )
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], r.output
    assert not (tmp_path / "runs").exists()


def test_the_request_carries_the_spares_after_the_world():
    world, spares = split_spares(nodes("a", "b", "c", "d"), 1)
    cluster = Cluster("t", world)
    config = LaunchConfig(workload=Workload("torchrun", TRAIN_ARGV), job_id="20260101-120000-a1b2c3")
    ssh = SshConfig(user="u", key=Path("k"), known_hosts=Path("kh"))
    d = request_json(cluster, config, ssh, {"spares": 1}, spares)
    assert [n["host"] for n in d["cluster"]["nodes"]] == ["a", "b", "c"]
    assert d["spares"] == [{"rank": 3, "host": "d", "address": "d", "slots": None, "name": "vm-d"}]
    assert request_json(cluster, config, ssh)["spares"] == []


def _record(state: JobState = JobState.SUCCEEDED, **more) -> JobRecord:
    more.setdefault("nodes", ["a", "c", "d"])
    return JobRecord(
        id="20260101-120000-a1b2c3", state=state, what="torchrun -m workloads.train", submitted=100.0, **more
    )


def test_a_record_with_swaps_round_trips_and_an_old_record_still_reads():
    swap = Swap(130.0, 1, "b", "d", "unreachable").to_json()
    rec = Recovery(130.0, 1, "unreachable (connection lost)", 40, 2.5, reason="node-lost", swaps=[swap])
    r = _record(spares=[], out=["b"], recoveries=[rec.to_json()])
    back = JobRecord.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and Recovery.from_json(back.recoveries[0]) == rec
    # A record from before --spares: no spares, no out, recoveries without swaps.
    old = r.to_json()
    for k in ("spares", "out"):
        old.pop(k)
    old["recoveries"] = [{k: v for k, v in rec.to_json().items() if k != "swaps"}]
    read = JobRecord.from_json(old)
    assert read.spares == [] and read.out == [] and Recovery.from_json(read.recoveries[0]).swaps == []
    # A newer record's unknown recovery field is left out, not fatal.
    assert Recovery.from_json({**rec.to_json(), "later": 1}) == rec
    (line,) = recovery_lines(back.recoveries)
    assert line.endswith("; swapped node 1 (b) → spare d (unreachable)"), line


def test_a_restore_line_names_its_step_and_source_and_nothing_else_does():
    assert restored_from("[rank0] restored step 40 from peer (12 shards)") == (40, "peer")
    assert restored_from("restored step 7 from durable") == (7, "durable")
    # workloads.train's resume line ends with it (workloads/checkpoint/manager.py, `_apply`).
    line = "[node 0] resumed from /ckpt at step 10 (epoch 0, 20 samples seen); restored step 10 from durable"
    assert restored_from(line) == (10, "durable")
    assert restored_from("restored step 7 from gcs") is None and restored_from("step 7/10 | loss 1") is None


def test_each_failure_gets_its_time_to_train_again_its_restore_source_and_its_swap():
    swap = Swap(130.0, 1, "b", "d", "unreachable").to_json()
    r = _record(
        nodes=["a", "c", "d"],
        recoveries=[
            Recovery(131.0, 1, "unreachable", 40, 2.0, reason="node-lost", swaps=[swap]).to_json(),
            Recovery(200.0, 0, "worker crash", 80, 1.0, reason="worker-failed").to_json(),
        ],
        started=101.0,
        ended=260.0,
    )
    keeper = MarkKeeper(r)
    keeper.line("step 1/100 | loss 1", 110.0)
    keeper.node_failed(129.0)  # the node failure seen before the controller's notice (131)
    keeper.new_attempt()
    keeper.line("restored step 40 from peer", 134.0)
    keeper.line("step 41/100 | loss 1", 141.0)
    keeper.new_attempt()  # the second failure: no failure mark, no restore line
    keeper.line("step 81/100 | loss 1", 215.0)
    one, two = failures(r)
    assert (one.number, one.node, one.reason, one.restored_from, one.restored_step) == (1, 1, "node-lost", "peer", 40)
    assert one.to_train_s == pytest.approx(141.0 - 129.0) and one.swaps == (swap,)
    assert two.to_train_s == pytest.approx(215.0 - 200.0) and two.restored_from == "unknown" and two.swaps == ()
    g = goodput_of(r)
    assert [f["to_train_s"] for f in g.to_json()["failures"]] == [12.0, 15.0]
    first, second = failure_lines(g)
    assert first == (
        "failure 1 (node 1, node-lost): trained again after 12.0 s, restored from peer at step 40; "
        "swapped node 1 (b) → spare d (unreachable)"
    ), first
    assert second == "failure 2 (node 0, worker-failed): trained again after 15.0 s, restored from unknown"


def test_a_failure_never_trained_again_says_so_and_idle_spares_count_in_node_hours():
    r = _record(
        recoveries=[Recovery(150.0, 2, "unreachable", reason="node-lost").to_json()],
        started=100.0,
        ended=200.0,
        state=JobState.FAILED,
    )
    (f,) = failures(r)
    assert f.to_train_s is None and "not trained again" in failure_lines(goodput_of(r))[0]
    with_spare = _record(spares=["e"], started=100.0, ended=200.0)
    assert goodput_of(with_spare).node_hours == pytest.approx(
        4 * goodput_of(_record(started=100.0, ended=200.0)).node_hours / 3
    )


def test_a_lost_node_or_a_hangs_culprit_is_swapped_at_once_and_a_crash_is_not():
    assert judged_bad(Recovery(1.0, 2, "unreachable (connection lost)", reason="node-lost")) == {2: "unreachable"}
    assert judged_bad(Recovery(1.0, 1, "unreachable (x)", reason="preempted")) == {1: "unreachable"}
    assert judged_bad(Recovery(1.0, 0, "hang: rank 0 waits in allreduce", reason="hang")) == {0: "hang"}
    assert judged_bad(Recovery(1.0, 1, "worker crash: exit 1", reason="worker-failed")) == {}
    assert judged_bad(Recovery(1.0, None, "preempted: ...", reason="preempted")) == {}


def test_a_relaunch_check_names_the_unreachable_and_refusing_nodes_only():
    states = {0: "stopped", 1: "unreachable", 2: "failed", 3: "checked"}
    assert bad_at_check(states) == {1: "unreachable", 2: "check failed"}
    assert bad_at_check({0: "stopped", 1: "stopped"}) == {}


def test_launch_jobs_shows_a_jobs_spares_beside_its_nodes():
    from launcher.cli.cmd_jobs import _row

    assert _row(_record(spares=["e"]))[3] == "3 (+1 spare)"
    assert _row(_record(spares=["e", "f"]))[3] == "3 (+2 spares)"
    assert _row(_record())[3] == "3"


def test_a_stacks_spares_are_the_default_of_a_detached_recover_job(tmp_path):
    nodes_doc = [{"index": i, "internalIp": f"192.0.2.{i + 1}", "name": f"dev-{i}"} for i in range(3)]
    outputs = tmp_path / "o.json"
    outputs.write_text(json.dumps({"cluster": "dev", "nodes": nodes_doc, "spares": 1}))
    base = ["run", "--outputs", str(outputs), "--runs-dir", str(tmp_path / "runs"), "--detach", "--recover"]
    # Refused before any contact, and only because the stack's spare is left out of the world.
    r = CliRunner().invoke(cli, [*base, "--min-nodes", "3", "--", "job.py"])
    assert r.exit_code == 2 and "--min-nodes 3 is more than the job's 2 nodes" in r.output, r.output
    r = CliRunner().invoke(cli, [*base, "--spares", "0", "--min-nodes", "4", "--", "job.py"])
    assert r.exit_code == 2 and "--min-nodes 4 is more than the job's 3 nodes" in r.output, r.output


def test_a_controller_that_re_adopts_a_job_after_a_swap_copies_along_the_ring_without_the_node_out():
    from types import SimpleNamespace

    from launcher.core.types import Replication
    from launcher.jobs.adopt import _recoverer
    from launcher.jobs.recovery import RecoverPolicy

    world, spares = split_spares(nodes("a", "b", "c", "d"), 1)
    ring = tuple((h, f"u@{h}") for h in "abcd")
    rep = Replication(ring, 22, ".gpufleet/replica/t", "/code")
    config = LaunchConfig(workload=Workload("torchrun", TRAIN_ARGV), job_id="j", replication=rep)
    request = {"spares": [{"rank": 3, "host": "d", "address": "d", "slots": None, "name": "vm-d"}]}
    swap = Swap(130.0, 1, "b", "d", "unreachable").to_json()
    rec = Recovery(130.0, 1, "unreachable", 40, 2.5, reason="node-lost", swaps=[swap]).to_json()
    owner = SimpleNamespace(request=request, record=_record(spares=[], out=["b"], recoveries=[rec]))
    run = Cluster("t", (Node(0, "a", "a"), Node(1, "c", "c"), Node(2, "d", "d")))
    got = _recoverer(owner, Cluster("t", world), config, RecoverPolicy(spares=1), run)
    assert [h for h, _ in got.config.replication.ring] == ["a", "c", "d"]  # the dead controller's
    # No swap yet: the request's ring, which is the world then the spares.
    owner.record = _record(spares=["d"], nodes=["a", "b", "c"])
    got = _recoverer(owner, Cluster("t", world), config, RecoverPolicy(spares=1), Cluster("t", world))
    assert got.config.replication.ring == ring


def test_a_node_that_rejoined_and_takes_a_rank_again_is_back_in_the_replica_ring(monkeypatch):
    """Node b is lost (the spare d takes its rank), comes back and rejoins the spares, and takes a
    rank again when d is lost: the ring of the next attempt has b again, so its ranks are copied."""
    from types import SimpleNamespace

    from launcher.core.types import Replication
    from launcher.jobs import realign as ra
    from launcher.jobs.recovery import Recoverer, RecoverPolicy

    monkeypatch.setattr(ra, "realign", lambda *a, **k: None)  # the moves are test_replication_units'
    every = nodes("a", "b", "c", "d")
    world, _ = split_spares(every, 1)
    rep = Replication(tuple((h, f"u@{h}") for h in "abcd"), 22, ".gpufleet/replica/t", "/code")
    config = LaunchConfig(workload=Workload("torchrun", TRAIN_ARGV), job_id="j", replication=rep)
    request = {"spares": [{"rank": 3, "host": "d", "address": "d", "slots": None, "name": "vm-d"}]}
    owner = SimpleNamespace(request=request, record=_record(spares=["d"], nodes=["a", "b", "c"]), say=lambda s: None)
    rec = Recoverer(owner, Cluster("t", world), config, RecoverPolicy(spares=1))

    def swap(lost: str, into: str, spares: list[str]) -> list[str]:
        before = [n.host for n in rec.cluster.nodes]
        order = [h for h in "abcd" if h in before and h != lost or h == into]
        rec.cluster = Cluster("t", tuple(Node(i, h, h) for i, h in enumerate(order)))
        owner.record.out = [*owner.record.out, lost]
        owner.record.spares = spares
        rec._realign(before, {lost}, tuple(n for n in every if n.host in spares))
        return [h for h, _ in rec.config.replication.ring]

    assert swap("b", "d", []) == ["a", "c", "d"]
    owner.record.out = []  # b passed its check again: a spare (launcher.jobs.recovery.Recoverer._rejoin)
    assert swap("d", "b", []) == ["a", "b", "c"]
