"""The launcher against the simulated cluster: real sshd nodes, real torchrun over gloo.

Each test uses what a user types. CliRunner drives `launcher.cli.main` in-process; one test runs
the installed console script; the SIGINT and two-launch tests need a real process to signal.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from gpufleet.contracts import LABEL_NODE
from launcher.cli.main import main
from tests.launcher import dry_runs
from tests.launcher.fake_compute import FakeCompute, FakeInstance
from tests.support import LAUNCH, REPO, source_args, torch_args, wait_for

pytestmark = pytest.mark.cluster

SCRIPT = "tests/launcher/allreduce_script.py"


def test_exec_runs_on_every_node_with_prefixes_and_logs(sim_cluster, tmp_path):
    c = sim_cluster(3)
    r = CliRunner().invoke(
        main,
        [
            "exec",
            *source_args(c, tmp_path),
            "--",
            "sh",
            "-c",
            'echo "rank=$GPUFLEET_NODE_RANK $(ip -o -4 addr show eth0 | wc -l)"',
        ],
    )
    assert r.exit_code == 0, r.output
    for i in range(3):
        assert f"[node {i}] rank={i} 1" in r.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "node-2.log").read_text().strip() == "rank=2 1"
    summary = json.loads((run_dir / "launch.json").read_text())
    assert [n["exit"] for n in summary["nodes"]] == [0, 0, 0]
    c.assert_nothing_left()


def test_run_gloo_all_reduce_across_3_nodes_x_2_processes_with_the_python3_env_path_names(sim_cluster, tmp_path):
    """`--env PATH=VENV/bin:...` without --python: the nodes' own python3 has no torch, this
    venv's does; the check must ask the same python3 the run starts."""
    c = sim_cluster(3)
    venv_bin = str(REPO / ".venv" / "bin")
    where = ["--workdir", str(REPO), "--nproc-per-node", "2", "--env", f"PATH={venv_bin}", "--env", "OMP_NUM_THREADS=1"]
    r = CliRunner().invoke(main, ["run", *source_args(c, tmp_path), *where, "--", SCRIPT])
    assert r.exit_code == 0, r.output
    lines = [l for l in r.output.splitlines() if "world=" in l]
    assert len(lines) == 6
    assert all("world=6 sum=21 expected=21" in l for l in lines)
    # gloo was told each node's own interface, resolved on the node from its address.
    assert all("gloo_if=eth0" in l for l in lines)
    assert {l.split("]")[0] for l in lines} == {"[node 0", "[node 1", "[node 2"}
    # torchrun warns about no flag it ignores (a --node-rank is read by the static rendezvous).
    (run_dir,) = (tmp_path / "runs").iterdir()
    logs = "".join(p.read_text() for p in run_dir.glob("node-*.log"))
    assert "node_rank is only used" not in r.output + logs
    c.assert_nothing_left()


def test_node_exit_3_stops_the_others_names_itself_and_leaves_nothing(sim_cluster, tmp_path):
    c = sim_cluster(3)
    cmd = 'if [ "$GPUFLEET_NODE_RANK" = 1 ]; then echo dying; exit 3; fi; sleep 600'
    t0 = time.monotonic()
    r = CliRunner().invoke(main, ["exec", *source_args(c, tmp_path), "--", "sh", "-c", cmd])
    assert r.exit_code == 3, r.output
    assert time.monotonic() - t0 < 60  # the sleeping nodes were stopped, not waited for (600 s)
    assert f"node 1 ({c.nodes[1].address}) failed first: exit 3; its log: " in r.output
    assert r.output.count("dying") == 1 and "[node 1] dying" in r.output  # once: live, not again at the end
    c.assert_nothing_left()


def test_output_rank0_shows_node_0_live_and_a_failed_nodes_last_lines_while_every_log_has_its_own(
    sim_cluster, tmp_path
):
    c = sim_cluster(3)
    cmd = (
        'case "$GPUFLEET_NODE_RANK" in 0) echo "hello from 0"; sleep 600;; 1) echo "quiet from 1";; '
        '2) echo "dying"; sleep 2; exit 3;; esac'
    )
    r = CliRunner().invoke(main, ["exec", *source_args(c, tmp_path), "--output", "rank0", "--", "sh", "-c", cmd])
    assert r.exit_code == 3, r.output
    assert "[node 0] hello from 0" in r.output
    assert "quiet from 1" not in r.output and r.output.count("[node 2] dying") == 1
    assert "--output rank0: node 0's output shown live; the other 2 nodes: 1 exited, 1 failed" in r.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "node-1.log").read_text().strip() == "quiet from 1"
    c.assert_nothing_left()


def test_unreachable_host_is_named_in_one_error_and_nothing_starts(sim_cluster, tmp_path):
    c = sim_cluster(2)
    dead = c.unused_address()
    hf = tmp_path / "hosts"
    hf.write_text(f"{c.nodes[0].address}\n{dead}\n{c.nodes[1].address}\n")
    r = CliRunner().invoke(
        main,
        [
            "exec",
            *source_args(c, tmp_path, hf),
            "--ssh-option",
            "ConnectTimeout=3",
            "--",
            "sh",
            "-c",
            'touch "$0-$GPUFLEET_NODE_RANK"',
            str(tmp_path / "ran"),
        ],
    )
    assert r.exit_code == 2, r.output
    # The reachable nodes passed their check and waited; told not to go, they ran nothing.
    assert not list(tmp_path.glob("ran-*"))
    errors = [l for l in r.output.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and dead in errors[0] and "nothing was started" in errors[0]
    assert "node 0 (" not in errors[0] and "node 2 (" not in errors[0]
    assert not (tmp_path / "runs").exists()
    c.assert_nothing_left()


def test_label_discovery_through_the_compute_api_runs_only_matching_nodes(sim_cluster, tmp_path):
    c = sim_cluster(3)
    instances = [
        # Names sort the other way round: only infra's index label puts trainer-b first.
        FakeInstance("trainer-a", c.nodes[1].address, {"team": "ml", LABEL_NODE: "1"}),
        FakeInstance("trainer-b", c.nodes[0].address, {"team": "ml", LABEL_NODE: "0"}),
        FakeInstance("other", c.nodes[2].address, {"team": "web"}),
    ]
    with FakeCompute({("proj", "us-central1-a"): instances}) as api:
        r = CliRunner().invoke(
            main,
            [
                "exec",
                "--label",
                "team=ml",
                "--project",
                "proj",
                "--zone",
                "us-central1-a",
                "--api-endpoint",
                api.endpoint,
                *c.launch_flags,
                "--runs-dir",
                str(tmp_path / "runs"),
                "--",
                "sh",
                "-c",
                'echo "i am $GPUFLEET_NODE_RANK of $GPUFLEET_NNODES"',
            ],
        )
    assert r.exit_code == 0, r.output
    assert api.requests[0]["filter"] == '(labels.team = "ml")'
    assert "[node 0] i am 0 of 2" in r.output and "[node 1] i am 1 of 2" in r.output
    assert "[node 2]" not in r.output
    # Rank order follows the index label, not the API's order.
    assert r.output.index(c.nodes[0].address) < r.output.index(c.nodes[1].address)


def test_local_mode_runs_two_nodes_as_process_groups_here(tmp_path):
    r = CliRunner().invoke(
        main,
        ["run", "--local", "--nodes", "2", "--runs-dir", str(tmp_path / "runs"), "--workdir", str(REPO), "--", SCRIPT],
    )
    assert r.exit_code == 0, r.output
    lines = [l for l in r.output.splitlines() if "world=" in l]
    assert len(lines) == 2 and all("world=2 sum=3 expected=3 gloo_if=lo" in l for l in lines)
    # Node 0 holds RANK 0 (a static rendezvous), so rank 0's lines come under [node 0].
    assert any(l.startswith("[node 0] rank=0 ") and l.endswith(" node=0") for l in lines), lines
    assert "rank order: given (--local: every node is this machine)" in r.stderr


# Prints what torchrun gave the worker and the address of the node it runs on.
WHERE = """import os, subprocess
out = subprocess.run(["ip", "-o", "-4", "addr", "show", "eth0"], capture_output=True, text=True).stdout
print(f"RANK={os.environ['RANK']} GROUP_RANK={os.environ['GROUP_RANK']} addr={out.split()[3].split('/')[0]}")
"""


def _where(output: str) -> dict[int, tuple[str, str]]:
    """{node: (RANK, address)} from WHERE's lines under each `[node N]` prefix."""
    out = {}
    for line in output.splitlines():
        if line.startswith("[node ") and "RANK=" in line:
            node = int(line.split("]")[0].removeprefix("[node "))
            words = dict(w.split("=", 1) for w in line.split("] ", 1)[1].split())
            assert words["RANK"] == words["GROUP_RANK"] == str(node), line  # one process per node
            out[node] = (words["RANK"], words["addr"])
    return out


def test_rank_0_runs_on_the_hostfiles_first_node_when_that_is_not_address_order(sim_cluster, tmp_path):
    c = sim_cluster(3)
    script = tmp_path / "where.py"
    script.write_text(WHERE)
    # Highest address first: a rendezvous that sorts by address would make it the last node.
    order = [c.addresses[2], c.addresses[0], c.addresses[1]]
    hf = tmp_path / "hostfile"
    hf.write_text("".join(f"{a}\n" for a in order))
    args = ["run", *source_args(c, tmp_path, hf), *torch_args(), "--", str(script)]
    dry = CliRunner().invoke(main, [*args[:1], "--dry-run", *args[1:]])
    assert dry.exit_code == 0, dry.output
    assert dry_runs.headers(dry.stdout) == list(enumerate(order)), dry.stdout
    assert "rank order: given here (--dry-run asks no node for its physical_host" in dry.stderr, dry.output
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert _where(r.output) == {i: (str(i), a) for i, a in enumerate(order)}, r.output
    # The nodes have no metadata server: the order is the hostfile's, and the start line says why.
    assert "started on 3 nodes; rank order: given (no node reports a physical_host)" in r.stderr, r.output
    given = CliRunner().invoke(main, [*args[:1], "--rank-order", "given", *args[1:]])
    assert given.exit_code == 0 and "rank order: given (--rank-order given)" in given.stderr, given.output
    assert _where(given.output) == {i: (str(i), a) for i, a in enumerate(order)}, given.output
    c.assert_nothing_left()


def test_ranks_follow_the_topology_each_node_reports_and_topology_refuses_a_node_without_one(tmp_path):
    from tests.launcher.fake_gpu_node import FakeMetadata
    from tests.simcluster import SimCluster

    # Nodes 0 and 2 share block b1, node 1 sits in b2: topology order is 0, 2, 1.
    places = ["/clu/b1/s1/h01", "/clu/b2/s1/h07", "/clu/b1/s1/h02"]
    c = SimCluster(3, workdir=tmp_path / "sim")
    metadata = [FakeMetadata(p, reach_at=c.gateway) for p in places]
    c.node_env = {i: {"GCE_METADATA_HOST": m.host} for i, m in enumerate(metadata)}
    script = tmp_path / "where.py"
    script.write_text(WHERE)
    try:
        c.start()
        args = ["run", *source_args(c, tmp_path), *torch_args(), "--", str(script)]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        a = c.addresses
        assert _where(r.output) == {0: ("0", a[0]), 1: ("1", a[2]), 2: ("2", a[1])}, r.output
        assert "started on 3 nodes; rank order: topology (2 blocks; 2 of 3 nodes moved)" in r.stderr, r.output
        given = CliRunner().invoke(main, [*args[:1], "--rank-order", "given", *args[1:]])
        assert given.exit_code == 0, given.output
        assert _where(given.output) == {i: (str(i), a[i]) for i in range(3)}, given.output
        # Node 1's metadata server has no physical_host (a VM without a placement policy).
        metadata[1].physical_host = None
        r = CliRunner().invoke(main, [*args[:1], "--rank-order", "topology", *args[1:]])
        assert r.exit_code == 2, r.output
        assert r.output.strip().splitlines() == [
            f"error: --rank-order topology: node 1 ({a[1]}) reports no physical_host (from the metadata "
            "server; only VMs in a placement policy have one); pass --rank-order given"
        ]
        assert len(list((tmp_path / "runs").iterdir())) == 2  # nothing started for the refused one
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0 and f"rank order: given (node 1 ({a[1]}) reports no physical_host)" in r.stderr
        c.assert_nothing_left()
    finally:
        c.stop()
        for m in metadata:
            m.close()


def test_console_script_sigint_stops_everything_and_second_launch_on_same_port_refuses(sim_cluster, tmp_path):
    """The installed `launch`: A runs; B on the same nodes and port refuses without touching A;
    SIGINT to A stops every node (exit 130) and leaves nothing."""
    c = sim_cluster(2)
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n")
    args = ["run", *source_args(c, tmp_path), *torch_args(), "--rdzv-port", "29611", "--", str(sleeper)]
    out_a = open(tmp_path / "a.out", "w+")
    a = subprocess.Popen([LAUNCH, *args], stdout=out_a, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (tmp_path / "a.out").read_text().count("sleeping") == 2, 120, "A's workers")
        b = subprocess.run([LAUNCH, *args], capture_output=True, text=True, timeout=60)
        assert b.returncode == 2, b.stdout + b.stderr
        assert "rendezvous port 29611" in b.stderr and "in use by another launch" in b.stderr
        assert a.poll() is None and c.processes(0) and c.processes(1)  # A untouched
        a.send_signal(signal.SIGINT)
        assert a.wait(timeout=30) == 130
    finally:
        if a.poll() is None:
            a.kill()
    text = (tmp_path / "a.out").read_text()
    assert "stopped every node on signal 2" in text
    c.assert_nothing_left()


def test_node_that_disappears_is_reported_unreachable_not_as_a_code_failure(sim_cluster, tmp_path):
    c = sim_cluster(3)
    p = subprocess.Popen(
        [sys.executable, "-m", "launcher", "exec", *source_args(c, tmp_path), "--", "sh", "-c", "echo up; sleep 600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        seen = []
        while sum("] up" in l for l in seen) < 3:  # every node's command is running
            line = p.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
        c.kill_sessions(2)
        out, _ = p.communicate(timeout=60)  # a hang, not a speed bound: the nodes sleep 600 s
        out = "".join(seen) + out
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 255, out
    assert f"node 2 ({c.nodes[2].address}) failed first: unreachable" in out
    c.assert_nothing_left()


def test_hosts_lists_nodes_in_rank_order_and_flags_the_dead_one(sim_cluster, tmp_path):
    c = sim_cluster(2)
    dead = c.unused_address()
    hf = tmp_path / "hosts"
    hf.write_text(f"{c.nodes[1].address}\n{c.nodes[0].address}\n{dead}\n")
    r = CliRunner().invoke(main, ["hosts", *source_args(c, tmp_path, hf), "--ssh-option", "ConnectTimeout=3"])
    assert r.exit_code == 1, r.output
    rows = [l for l in r.output.splitlines() if l.startswith("│")]
    assert [row.split("│")[2].strip() for row in rows] == [c.nodes[1].address, c.nodes[0].address, dead]
    assert [row.split("│")[5].strip() for row in rows][:2] == ["ok", "ok"]
    assert "ok" not in rows[2].split("│")[5]


SWEEP = ["--ops", "all_reduce", "-b", "512K", "-e", "512K", "-n", "5", "-w", "1"]


@pytest.mark.slow
def test_nccl_tests_writes_rows_and_plot_and_min_busbw_fails_the_run(sim_cluster, tmp_path):
    c = sim_cluster(2)
    r = CliRunner().invoke(
        main, ["nccl-tests", *source_args(c, tmp_path), *torch_args(nproc=2), *SWEEP, "--min-busbw", "1000000"]
    )
    assert r.exit_code == 1, r.output
    assert "is below --min-busbw 1e+06" in r.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    doc = json.loads((run_dir / "rows.json").read_text())
    assert doc["nranks"] == 4 and doc["nnodes"] == 2 and doc["rows"][0]["collective"] == "all_reduce"
    assert doc["rows"][0]["oop_wrong"] == 0 and doc["avg_busbw"] > 0
    assert (run_dir / "rows.csv").exists() and (run_dir / "busbw.png").stat().st_size > 0
    # The sweep's several-kB JSON line is read from the log, not shown.
    assert "#gpufleet-json" not in r.output
    assert any("#gpufleet-json" in p.read_text() for p in run_dir.glob("node-*.log"))


@pytest.mark.slow
def test_find_bad_nodes_names_the_throttled_node_and_prints_an_exclude_list(sim_cluster, tmp_path):
    c = sim_cluster(4, mode="netns")
    c.throttle(2, "40mbit")
    r = CliRunner().invoke(main, ["nccl-tests", *source_args(c, tmp_path), *torch_args(), *SWEEP, "--find-bad-nodes"])
    assert r.exit_code == 1, r.output
    assert r.output.count("pair ") >= 6
    assert f"--exclude {c.nodes[2].address}\n" in r.output
    assert f"{c.nodes[2].address}: busbw " in r.output
    c.assert_nothing_left()
