"""Issue 42's end to end, on the session's shared bare cluster (tests/conftest.py `bare_nodes`:
nothing of gpufleet on a node until a launch brings it): a `--detach --recover --spares 1` train
job whose only checkpoints are the node-local tier (`--local-checkpoint-every`, no
`--checkpoint-dir`). Nodes 0 and 1 train, node 2 waits as the spare. Each node's replicator
(gpufleet.replica, the sidecar round its ranks) copies every local step it completes to the next
node of the job's order over the cluster's replica key, so node 1's ranks are on node 2. Node 1
is lost for good (SimCluster.power_off); the spare takes its place at once and restores node 1's
rank from that copy: the job resumes from its last copied local step, not from step 0, and ends
SUCCEEDED with the swap in its record."""

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
        *TRAIN, "--global-batch", "2", "--steps", "600", "--log-every", "10",
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
    lost = False
    done: dict = {}
    try:
        running = job(c, tmp_path, job_id)
        assert running["nodes"] == a[:2] and running["spares"] == [a[2]], running
        # The ring in the job's order: node 0 copies to node 1, node 1 to node 2 (the spare).
        wait_for(lambda: copied_steps(c, 2, job_id, 1), 300, "node 1's rank copied to the spare", interval=0.5)
        wait_for(lambda: copied_steps(c, 1, job_id, 0), 60, "node 0's rank copied to node 1", interval=0.5)
        before = max(copied_steps(c, 2, job_id, 1))
        c.power_off(1)
        lost = True

        def ended() -> bool:
            done.update(job(c, tmp_path, job_id))
            return done["state"] in FINAL

        wait_for(ended, 600, f"job {job_id} to end", interval=LAUNCH_POLL_S)
    finally:
        if lost:
            c.restart_sshd(1)  # the shared cluster's node 1 is back for the next test
        if done.get("state") not in FINAL:
            launch(tmp_path, "stop", *source_args(c, tmp_path), job_id)
    out = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout
    assert done["state"] == "SUCCEEDED" and done["exit"] == 0, (done, out[-4000:])
    (rec,) = done["recoveries"]
    (swap,) = rec["swaps"]
    assert (swap["rank"], swap["out"], swap["into"], swap["why"]) == (1, a[1], a[2], "unreachable"), rec
    assert done["nodes"] == [a[0], a[2]] and done["out"] == [a[1]], done
    # Resumed on the spare from node 1's rank as copied there: the peer tier, at or after the
    # step seen copied before the loss, never step 0; then on to the end.
    (restored,) = [int(m) for m in re.findall(r"restored step (\d+) from peer\b", out)]
    assert restored >= before > 0, (before, out[-4000:])
    assert "] step 600/600 |" in out, out[-4000:]
    assert re.search(r"replica: copied step_\d{8} of rank 1 to (root@)?" + re.escape(a[2]), out), out[-4000:]
    c.assert_nothing_left()
