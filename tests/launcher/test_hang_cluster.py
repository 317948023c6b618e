"""Hang detection on real sshd nodes with real torchrun over gloo: a user's script whose rank 2
sleeps in its data loading while every other rank waits for it in an all_reduce. The launch
names that rank, on its node, with its frame, writes every rank's stack, stops the job and
leaves nothing running; attached and detached.

py-spy reads the workers' memory with ptrace: the nodes' sessions run as root in the root PID
namespace (tests/simcluster.py), which ptrace allows whatever Yama's ptrace_scope says
(CAP_SYS_PTRACE; see ptrace(2), "Ptrace access mode checking"); this machine's kernel has no
Yama at all.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.launcher.test_jobs_cluster import cluster, detach, jobdir, launch, wait_state
from tests.support import LAUNCH, REPO, source_args, torch_args

pytestmark = pytest.mark.cluster

SCRIPT = "tests/launcher/hang_script.py"
# The culprit, with the frame the script sleeps in and its caller.
CULPRIT = re.compile(
    r"node (\d) \(([\d.]+)\) rank 2 is outside any collective at load_batch \(hang_script\.py:\d+\) "
    r"<- train_step \(hang_script\.py:\d+\)"
)


def test_attached_run_names_the_sleeping_rank_writes_the_stacks_and_stops(sim_cluster, tmp_path):
    # Two nodes of two ranks: rank 2 is node 1's first, and one rank shares its node.
    c = sim_cluster(2)
    r = subprocess.run(
        [LAUNCH, "run", *source_args(c, tmp_path), *torch_args(nproc=2), "--hang-timeout", "5s", "--", SCRIPT],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 124, out
    (line,) = [x for x in out.splitlines() if x.startswith("hang: no progress for ")]
    m = CULPRIT.search(line)
    assert m, line
    node = int(m.group(1))
    assert m.group(2) == c.nodes[node].address
    assert "3 ranks wait in all_reduce" in line
    (run_dir,) = (tmp_path / "runs").iterdir()
    stacks = run_dir / "stacks"
    assert line.endswith(f"stacks: {stacks}/")
    files = sorted(p.name for p in stacks.iterdir())
    assert len(files) == 4 and f"node-{node}-rank-2.txt" in files, files
    assert "load_batch" in (stacks / f"node-{node}-rank-2.txt").read_text()
    assert all("all_reduce" in (stacks / f).read_text() for f in files if not f.endswith("-rank-2.txt"))
    c.assert_nothing_left()


def test_where_every_rank_waits_the_one_in_a_different_collective_is_named(sim_cluster, tmp_path):
    c = sim_cluster(2)
    r = subprocess.run(
        [LAUNCH, "run", *source_args(c, tmp_path), *torch_args(nproc=2), "--env", "HANG_MODE=barrier"]
        + ["--hang-timeout", "5s", "--", SCRIPT],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    assert r.returncode == 124, r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("hang: no progress for ")]
    assert re.search(
        r"every rank waits in a collective, but not the same one: node \d \([\d.]+\) rank 0 waits in barrier at "
        r"main \(hang_script\.py:\d+\), while 3 ranks wait in all_reduce at main \(hang_script\.py:\d+\)",
        line,
    ), line
    c.assert_nothing_left()


def test_detached_run_ends_failed_with_reason_hang_naming_the_rank(sim_cluster, tmp_path):
    c = cluster(sim_cluster, tmp_path, 2)
    job_id = detach(c, tmp_path, "run", *torch_args(nproc=2), "--hang-timeout", "5s", "--", SCRIPT)
    done = wait_state(c, tmp_path, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}, timeout=240)
    assert done["state"] == "FAILED" and done["reason"] == "hang" and done["exit"] == 124, done
    m = CULPRIT.search(done["why"])
    assert m and done["failed_node"] == int(m.group(1)), done
    stacks = jobdir(tmp_path, job_id) / "stacks"  # on node 0, in the job's directory
    assert done["why"].endswith(f"stacks: {stacks}/")
    assert len(list(stacks.glob("node-*-rank-*.txt"))) == 4
    # `launch logs` says why: the job's log ends with the controller's own lines, the verdict
    # (with the stacks' directory) and how and when the job ended.
    logs = launch(tmp_path, "logs", *source_args(c, tmp_path), job_id, check=True).stdout.splitlines()
    stamp = r"\[controller\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
    assert re.fullmatch(stamp + re.escape(done["why"]), logs[-2]), logs[-3:]
    assert re.fullmatch(
        stamp + rf"job {job_id} ended FAILED at \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \(exit 124, reason hang\) after \d+ s",
        logs[-1],
    ), logs[-3:]
    c.assert_nothing_left()
