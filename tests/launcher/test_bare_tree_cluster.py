"""`--fanout` on the session's shared bare nodes (tests/conftest.py `bare_nodes`): real sshd
nodes, each with its own home and authorized_keys, the agent under their system python3. At
fan-out 1 the 3 nodes are a chain (0 -> 1 -> 2): node 1 is an interior node, passing node 2
its part over the relay key. This machine opens sessions to node 0 only (an `ssh` on PATH
records every one it starts), every node runs its part, a failure stops the others through
the tree, a node without its launch key refuses in one line with nothing started, and Ctrl-C
stops every node, leaving nothing."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from launcher.cluster.discovery import read_hostfile
from launcher.code.tree import AGENT_SHA
from launcher.core.transport import cluster_slug
from tests.support import BARE_GROUP, LAUNCH, REPO, Launch, hostfile_of, source_args

pytestmark = [pytest.mark.cluster, BARE_GROUP, pytest.mark.timeout(600)]

N = 3
SAY = 'echo "node $GPUFLEET_NODE_RANK on $(hostname -I | cut -d" " -f1)"'


@pytest.fixture
def c(bare_nodes):
    return bare_nodes


def recording_ssh(tmp_path: Path) -> tuple[dict, Path]:
    """An environment whose `ssh` records its arguments (one line each) and runs the real one."""
    bin_dir, log = tmp_path / "bin", tmp_path / "ssh.log"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\nexec /usr/bin/ssh "$@"\n')
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def sessions_to(log: Path) -> list[str]:
    """The host of every session the launch opened (an ssh with a remote command after `--`)."""
    return [line.split(" -- ", 1)[0].split()[-1] for line in log.read_text().splitlines() if " -- " in line]


def launch(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def test_this_machine_opens_node_0s_session_only_and_every_node_runs_its_part(c, tmp_path):
    src = [*source_args(c, tmp_path, hostfile_of(c, tmp_path, N)), "--fanout", "1"]
    first = launch(["exec", *src, "--", "sh", "-c", SAY])  # sets each node's launch key up
    assert first.returncode == 0, first.stdout + first.stderr
    env, log = recording_ssh(tmp_path)
    r = launch(["exec", *src, "--", "sh", "-c", SAY], env)
    assert r.returncode == 0, r.stdout + r.stderr
    for i in range(N):
        assert f"[node {i}] node {i} on {c.addresses[i]}" in r.stdout, r.stdout
    assert set(sessions_to(log)) == {c.addresses[0]}, log.read_text()
    # What node 2 runs sees its session as the star's would: not the relay key's `tree` request.
    r = launch(["exec", *src, "--", "sh", "-c", 'echo "asked=${SSH_ORIGINAL_COMMAND:-nothing}"'])
    assert "[node 2] asked=nothing" in r.stdout, r.stdout + r.stderr
    # A node that fails stops the others through the tree: node 0 and node 1 (the interior node)
    # were sleeping, and are stopped, not waited for.
    cmd = 'if [ "$GPUFLEET_NODE_RANK" = 2 ]; then echo dying; exit 4; fi; sleep 600'
    r = launch(["exec", *src, "--", "sh", "-c", cmd])
    assert r.returncode == 4, r.stdout + r.stderr
    assert f"node 2 ({c.addresses[2]}) failed first: exit 4" in r.stdout + r.stderr
    c.assert_nothing_left()


def test_a_node_without_its_launch_key_refuses_in_one_line_and_nothing_starts(c, tmp_path):
    hostfile = hostfile_of(c, tmp_path, N)
    src = [*source_args(c, tmp_path, hostfile), "--fanout", "1"]
    assert launch(["exec", *src, "--", "true"]).returncode == 0
    slug = cluster_slug(read_hostfile(hostfile))
    c.node_path(2, f"/root/.gpufleet/tree/{slug}--{c.addresses[2]}").unlink()
    r = launch(["exec", *src, "--", "sh", "-c", 'touch "/tmp/ran-$GPUFLEET_NODE_RANK"'])
    assert r.returncode == 2, r.stdout + r.stderr
    said = [line for line in (r.stdout + r.stderr).splitlines() if "refused its part of the launch" in line]
    assert said and f"it holds no launch key of cluster {slug} at {c.addresses[2]}" in said[0], r.stderr
    assert "nothing was started" in r.stderr
    assert not any(c.node_path(i, f"/tmp/ran-{i}").exists() for i in range(N))
    c.assert_nothing_left()


def test_ctrl_c_stops_every_node_through_the_tree_and_leaves_nothing(c, tmp_path):
    src = [*source_args(c, tmp_path, hostfile_of(c, tmp_path, N)), "--fanout", "1"]
    run = Launch(["exec", *src, "--", "sleep", "600"], tmp_path / "out.log")
    try:
        run.wait_for_text("started on 3 nodes")
        run.signal(signal.SIGINT)
        assert run.wait(60) == 130, run.out
    finally:
        run.kill()
    assert "stopped every node on signal 2" in run.out, run.out
    c.assert_nothing_left()


def test_an_interior_node_lost_mid_run_is_named_with_the_node_below_it_and_nothing_is_left(c, tmp_path):
    """Node 1 of the chain 0 -> 1 -> 2 disappears (its sessions and all they started die at
    once): node 0 names it, node 2's input ends with node 1's ssh, so node 2 stops too."""
    src = [*source_args(c, tmp_path, hostfile_of(c, tmp_path, N)), "--fanout", "1"]
    run = Launch(["exec", *src, "--", "sh", "-c", "echo up; sleep 600"], tmp_path / "out.log")
    try:
        run.wait_for_text("] up", count=N)
        c.kill_sessions(1)
        assert run.wait(120) == 255, run.out
    finally:
        run.kill()
    assert f"node 1 ({c.addresses[1]}) failed first: unreachable" in run.out, run.out
    assert "node 0 lost node 1" in run.out and "node 0 lost node 1, which passes the launch on to node 2" in run.out
    c.assert_nothing_left()


def test_a_corrupt_agent_copy_on_a_node_is_fetched_again_from_its_parent_and_the_launch_runs(c, tmp_path):
    src = [*source_args(c, tmp_path, hostfile_of(c, tmp_path, N)), "--fanout", "1"]
    assert launch(["exec", *src, "--", "true"]).returncode == 0
    copy = c.node_path(2, f"/root/.gpufleet/objects/{AGENT_SHA}")
    intact = copy.read_bytes()
    copy.chmod(0o644)
    copy.write_bytes(intact[:1000])  # cut short, as a full disk leaves it
    r = launch(["exec", *src, "--", "sh", "-c", SAY])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"[node 2] node 2 on {c.addresses[2]}" in r.stdout, r.stdout
    assert copy.read_bytes() == intact
    c.assert_nothing_left()


def test_a_detached_job_with_fanout_runs_down_the_tree_from_its_controller(c, tmp_path):
    """The controller (on node 0 here) gets the relay key and the launch keys beside the cluster
    key, and its launch goes down the tree: node 2 ran a part signed for it (its nonce is kept)."""
    src = [*source_args(c, tmp_path, hostfile_of(c, tmp_path, N)), "--fanout", "1"]
    seen = c.node_path(2, "/root/.gpufleet/tree/seen")
    before = set(seen.iterdir()) if seen.exists() else set()
    r = launch(["exec", *src, "--detach", "--", "sh", "-c", SAY])
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.split()[1]
    deadline = time.monotonic() + 120
    while True:
        rows = launch(["jobs", *src[:-2], "--json"]).stdout.splitlines()
        (row,) = [j for j in map(json.loads, rows) if j.get("id") == job]
        if row["state"] in ("SUCCEEDED", "FAILED", "STOPPED") or time.monotonic() > deadline:
            break
        time.sleep(1)
    logs = launch(["logs", *src[:-2], job])
    assert row["state"] == "SUCCEEDED", (row, logs.stdout + logs.stderr)
    for i in range(N):
        assert f"[node {i}] node {i} on {c.addresses[i]}" in logs.stdout, logs.stdout
    assert len(set(seen.iterdir()) - before) == 1  # the controller's launch: one part signed for node 2
    c.assert_nothing_left()


def test_under_output_rank0_the_other_nodes_keep_their_lines_which_launch_logs_reads_through_the_tree(c, tmp_path):
    """Nodes 1 and 2 are not shown live: each keeps its output on the node and sends up only what
    the launch reads (and a first line, the hang watch's sample). Node 2 fails: its last lines
    come up then, and show. `launch logs` reads each node's whole log from the node, down a tree
    of its own: this machine opens one session."""
    base = source_args(c, tmp_path, hostfile_of(c, tmp_path, N))
    cmd = 'for i in $(seq 1 60); do echo "n$GPUFLEET_NODE_RANK line $i"; done; [ "$GPUFLEET_NODE_RANK" != 2 ] || exit 5'
    r = launch(["exec", *base, "--fanout", "1", "--output", "rank0", "--", "sh", "-c", cmd])
    assert r.returncode == 5, r.stdout + r.stderr
    assert "[node 0] n0 line 60" in r.stdout and "[node 1]" not in r.stdout, r.stdout
    assert "[node 2] n2 line 60" in r.stdout and "[node 2] n2 line 10\n" not in r.stdout, r.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    job = run_dir.name
    assert f"failed first: exit 5; its log is on the node: launch logs {job} --node 2" in r.stdout + r.stderr
    assert "n1 line 30" not in (run_dir / "node-1.log").read_text()
    kept = c.node_path(1, f"/root/.gpufleet/logs/{job}/node-1.log")
    assert kept.read_text().count("n1 line") == 60 and kept.stat().st_mode & 0o777 == 0o600
    env, log = recording_ssh(tmp_path)
    r = launch(["logs", *base, job, "--node", "1"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [line for line in r.stdout.splitlines() if "line" in line] == [f"n1 line {i}" for i in range(1, 61)]
    assert sessions_to(log) == [c.addresses[1]], log.read_text()
    r = launch(["logs", *base, job])
    assert r.returncode == 0, r.stdout + r.stderr
    for i in range(N):
        assert sum(line.startswith(f"[node {i}] n{i} line ") for line in r.stdout.splitlines()) == 60, r.stdout
    assert (run_dir / "node-2.log").read_text().count("n2 line") == 60  # the copy here is whole now
    c.assert_nothing_left()
