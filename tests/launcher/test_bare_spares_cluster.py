"""Issue 42's end to end, on the session's shared bare cluster (tests/conftest.py `bare_nodes`:
nothing of gpufleet on a node until a launch brings it): a `--detach --recover --spares 1` train
job whose only checkpoints are the node-local tier (`--local-checkpoint-every`, no
`--checkpoint-dir`). Nodes 0 and 1 train, node 2 waits as the spare. Each node's replicator
(gpufleet.replica, the sidecar round its ranks) copies every local step it completes to the next
node of the job's order over the cluster's replica key, so node 1's ranks are on node 2. Node 1
is lost for good (SimCluster.power_off); the spare takes its place at once and restores node 1's
rank from that copy: the job resumes from its last copied local step, not from step 0. Then node
1 comes back and the spare is lost too: node 1 passes its check, takes rank 1 again, and gets that
rank's last step moved to it from the node that held node 2's copies (launcher.jobs.realign). The
job ends SUCCEEDED with both swaps in its record, and node 1 is in the replica ring again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpufleet import local_tier as lt
from tests.launcher.test_jobs_cluster import launch
from tests.support import BARE_GROUP, LAUNCH_POLL_S, TRAIN, source_args, wait_for

pytestmark = [pytest.mark.cluster, BARE_GROUP, pytest.mark.timeout(900)]

FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
ROOT = "/root/.gpufleet/local/checkpoints"  # the tier's root on a node without a local SSD


def src(c, tmp_path: Path) -> list[str]:
    return [*source_args(c, tmp_path), "--index-url", c.package_index]


def job(c, tmp_path: Path, job_id: str) -> dict:
    listed = launch(tmp_path, "jobs", *source_args(c, tmp_path), "--json", check=True).stdout.splitlines()
    (found,) = [j for j in map(json.loads, listed) if j["id"] == job_id]
    return found


def copied_steps(c, node: int, job_id: str, rank: int) -> list[int]:
    return lt.complete_steps(c.node_path(node, ROOT), job_id, lt.PEER, rank)


def test_a_node_lost_for_good_resumes_on_the_spare_from_its_peer_copy_of_the_local_tier(bare_nodes, tmp_path):
    c = bare_nodes
    a = c.addresses
    args = [
        "--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1", "--term-grace", "3s",
        "--recover", "--recover-timeout", "30m", "--spares", "1", "--",
        *TRAIN, "--global-batch", "2", "--steps", "400", "--log-every", "10",
        "--local-checkpoint-every", "20", "--keep-local-checkpoints", "4",
    ]  # fmt: skip
    r = launch(tmp_path, "train", *src(c, tmp_path), "--detach", *args, timeout=900, check=True)
    (line,) = r.stdout.splitlines()
    job_id = line.split()[1]
    # The spare compiled its environment to bytecode while it waited (node_agent `warm`): a swap
    # onto it does not spend its first start compiling what torch imports.
    assert f"node 2 ({a[2]}): compiling its environment to bytecode" in r.stderr, r.stderr
    envs = c.node_path(2, "/root/.gpufleet/envs")
    assert list(envs.glob("*/.gpufleet-bytecode")), r.stderr
    assert list(envs.glob("*/lib/python*/site-packages/torch/__pycache__/__init__.*.pyc"))
    down: set[int] = set()
    done: dict = {}
    try:
        running = job(c, tmp_path, job_id)
        assert running["nodes"] == a[:2] and running["spares"] == [a[2]], running
        # The ring in the job's order: node 0 copies to node 1, node 1 to node 2 (the spare).
        wait_for(lambda: copied_steps(c, 2, job_id, 1), 300, "node 1's rank copied to the spare", interval=0.5)
        wait_for(lambda: copied_steps(c, 1, job_id, 0), 60, "node 0's rank copied to node 1", interval=0.5)
        before = max(copied_steps(c, 2, job_id, 1))
        c.power_off(1)
        down.add(1)
        # The spare trains as rank 1, and the ring is the new world's: node 2 copies to node 0.
        wait_for(lambda: max(copied_steps(c, 0, job_id, 1), default=0) > before, 300, "rank 1's copies on node 0")
        c.restart_sshd(1)  # node 1 is back, out of service: the next swap checks it and takes it
        down.discard(1)
        second = max(copied_steps(c, 0, job_id, 1))
        assert second < 300, f"rank 1 is at step {second} of 400 already: make the run longer"
        c.power_off(2)
        down.add(2)

        def ended() -> bool:
            done.update(job(c, tmp_path, job_id))
            return done["state"] in FINAL

        wait_for(ended, 600, f"job {job_id} to end", interval=LAUNCH_POLL_S)
    finally:
        for i in down:
            c.restart_sshd(i)  # the shared cluster's nodes are back for the next test
        if done.get("state") not in FINAL:
            launch(tmp_path, "stop", *source_args(c, tmp_path), job_id)
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, (done, out[-4000:])
    first, again = done["recoveries"]
    (swap,) = first["swaps"]
    assert (swap["rank"], swap["out"], swap["into"], swap["why"]) == (1, a[1], a[2], "unreachable"), first
    # The second loss: no spare left, so node 1, back and passing its check, is one again and
    # takes rank 1, whose data it does not hold: the controller moved node 2's last copied step
    # there from node 0 (which held it as node 2's ring peer) before the relaunch.
    (swap,) = again["swaps"]
    assert (swap["rank"], swap["out"], swap["into"]) == (1, a[2], a[1]), again
    assert done["nodes"] == [a[0], a[1]] and a[2] in done["out"], done
    # What node 1 held from before it was lost (its steps of attempt 0, some of them past the step
    # attempt 1 resumed from) was removed when it rejoined: never mixed with this run's.
    assert re.search(rf"node {re.escape(a[1])} passes its check again: it is a spare again; its local copies", out)
    moved = re.findall(rf"copied rank 1's step (\d+) from {re.escape(a[0])} \(peer\) to {re.escape(a[1])}", out)
    said = [line for line in out.splitlines() if line.startswith("[controller] ") or "restored step" in line]
    # The messages are strings, which pytest prints whole (it cuts a tuple's long repr short).
    assert len(moved) == 1 and int(moved[0]) >= second, f"second={second}, moved={moved}:\n" + "\n".join(said)
    # Each relaunch resumed from the peer tier at or after the step seen copied before its loss,
    # never step 0; then on to the end.
    restored = [int(m) for m in re.findall(r"restored step (\d+) from peer\b", out)]
    assert len(restored) == 2 and restored[0] >= before > 0 and restored[1] == int(moved[0]), (
        f"before={before}, restored={restored}, moved={moved}:\n" + "\n".join(said)
    )
    assert "] step 400/400 |" in out, out[-4000:]
    # Node 1, back in service, is in the ring again: after the second relaunch each node's ranks
    # go to the other (node 0's to node 1, node 1's to node 0).
    after = out.split("recovery 2 of 3", 1)[1]
    for rank, to in ((0, a[1]), (1, a[0])):
        copied = rf"replica: copied step_\d{{8}} of rank {rank} to (root@)?{re.escape(to)} in [\d.]+ s"
        assert re.search(copied, after), "\n".join(ln for ln in after.splitlines() if "replica" in ln)
    assert re.search(r"replica: copied step_\d{8} of rank 1 to (root@)?" + re.escape(a[2]), out), out[-4000:]
    c.assert_nothing_left()
