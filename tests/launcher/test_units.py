"""Pure parts of the launcher: node sources, profiles and overrides, command building, quoting.

No network. Where quoting matters the built program is run for real with local bash.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpufleet.catalog import lookup
from gpufleet.health import PhysicalHost
from gpufleet.nccl_env import HOST_IFACE_ON_NODE, render
from gpufleet.node_plan import CheckKind, EnvVar
from launcher.cli import main
from launcher.cluster.discovery import cluster_from_outputs, local_cluster, parse_hostfile
from launcher.cluster.topology import launch_order
from launcher.core.env import node_env, parse_env_pairs
from launcher.core.program import NodeProgram, ProgramBuilder
from launcher.core.ssh import remote_command
from launcher.core.torchrun import join_timeout_s, torchrun_argv
from launcher.core.types import Cluster, LaunchConfig, LaunchResult, Node, NodeOutcome, UserError, Workload, new_job_id
from launcher.core.wire import CHECKED_MARKER, EXIT_MARKER
from tests.launcher import dry_runs
from tests.support import LAUNCH, REPO

HOSTILE = '"; rm -rf ~'


def _run_wrapper(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a node-side program here as the launcher does: `go` once it is checked, then stdin
    held open (EOF = stop)."""
    p = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    p.stdin.write("go\n")
    p.stdin.flush()
    out, err = p.stdout.read(), p.stderr.read()
    rc = p.wait(timeout=30)
    p.stdin.close()
    return subprocess.CompletedProcess(argv, rc, out, err)


def _cfg(**kw) -> LaunchConfig:
    kw.setdefault("workload", Workload("torchrun", ("train.py",)))
    kw.setdefault("job_id", "job1")
    return LaunchConfig(**kw)


def _cluster(n=3, machine_type=None) -> Cluster:
    return Cluster("c", tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(n)), machine_type)


# ---- hostfile / outputs -----------------------------------------------------------------------


def test_hostfile_reads_slots_comments_and_blank_lines_in_rank_order():
    c = parse_hostfile("# cluster\nnode-a slots=8\n\n  10.0.0.3   # second\nroot@node-c\n")
    assert [(n.rank, n.host, n.slots) for n in c.nodes] == [
        (0, "node-a", 8),
        (1, "10.0.0.3", None),
        (2, "root@node-c", None),
    ]
    assert c.nodes[2].address == "node-c"


@pytest.mark.parametrize(
    "text, culprit",
    [
        ("", "lists no hosts"),
        ("# only a comment\n\n", "lists no hosts"),
        ("a\nb\na\n", "'a' is listed more than once"),
        ("node;reboot\n", "line 1"),
        ("good\nnode$(id) slots=2\n", "line 2"),
        ("a slots=0\n", "'slots=0'"),
        ("a gpus=8\n", "'gpus=8'"),
    ],
)
def test_bad_hostfiles_name_the_line_or_host(text, culprit):
    with pytest.raises(UserError, match=None) as e:
        parse_hostfile(text)
    assert culprit in str(e.value)
    assert "\n" not in str(e.value)


def test_outputs_rank_nodes_by_index_and_keep_internal_ip_for_rendezvous():
    out = {
        "cluster": "demo",
        "zone": "us-central1-a",
        "machineType": "a3-megagpu-8g",
        "nodes": [
            {"name": "n1", "index": 1, "internalIp": "10.0.0.3", "externalIp": "34.1.1.1"},
            {"name": "n0", "index": 0, "internalIp": "10.0.0.2", "externalIp": None},
        ],
    }
    c = cluster_from_outputs(out)
    assert [n.name for n in c.nodes] == ["n0", "n1"] and c.machine_type == "a3-megagpu-8g"
    ext = cluster_from_outputs(out, prefer_external=True)
    assert [n.host for n in ext.nodes] == ["10.0.0.2", "34.1.1.1"]
    assert [n.address for n in ext.nodes] == ["10.0.0.2", "10.0.0.3"]


@pytest.mark.parametrize(
    "doc, culprit",
    [
        ({"cluster": "x"}, "'nodes' is missing"),
        ({"nodes": []}, "'nodes' is empty"),
        ({"nodes": "10.0.0.1"}, "not a list"),
        ({"nodes": [{"index": 0}]}, "nodes[0] has no internalIp"),
        ({"nodes": [{"index": "0", "internalIp": "1.2.3.4"}]}, "not an integer"),
        ({"nodes": [{"index": 0, "internalIp": "1.2.3.4"}, {"index": 0, "internalIp": "1.2.3.5"}]}, "repeat"),
        ([1, 2], "top level is list"),
    ],
)
def test_bad_outputs_are_one_clear_error(doc, culprit):
    with pytest.raises(UserError) as e:
        cluster_from_outputs(doc)
    assert culprit in str(e.value)


def test_a_gap_in_the_outputs_indexes_is_one_line_naming_the_missing_index_not_a_renumbering(tmp_path):
    nodes = [{"name": f"n{i}", "index": i, "internalIp": f"10.0.0.{2 + i}", "externalIp": None} for i in (0, 1, 3)]
    f = tmp_path / "o.json"
    f.write_text(json.dumps({"cluster": "x", "nodes": nodes}))
    r = CliRunner().invoke(main, ["hosts", "--outputs", str(f), "--dry-run"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    (line,) = [ln for ln in r.output.splitlines() if ln.strip()]
    assert line.startswith(f"error: {f}: node index 2 is missing"), line
    assert "pulumi up" in line and "--hostfile" in line


def test_select_takes_first_n_after_exclude_and_renumbers():
    c = _cluster(4).select(2, exclude=("10.0.0.2",))
    assert [(n.rank, n.host) for n in c.nodes] == [(0, "10.0.0.3"), (1, "10.0.0.4")]


def test_asking_for_more_nodes_than_exist_says_how_many_were_found():
    with pytest.raises(UserError, match="asks for more nodes than exist: 3 found"):
        _cluster(3).select(5)
    with pytest.raises(UserError, match="at least 1"):
        _cluster(3).select(0)
    with pytest.raises(UserError, match="not among the 3 nodes"):
        _cluster(3).select(None, exclude=("10.9.9.9",))


# ---- profiles and env -----------------------------------------------------------------------


def test_each_machine_family_gets_its_stack_profile():
    mega = render(lookup("a3-megagpu-8g"))
    assert mega["NCCL_FASTRAK_IFNAME"] == "enp6s0,enp7s0,enp13s0,enp14s0,enp134s0,enp135s0,enp141s0,enp142s0"
    assert mega["NCCL_SOCKET_IFNAME"] == mega["GLOO_SOCKET_IFNAME"] == "enp0s12"
    assert mega["NCCL_NVLSTREE_MAX_CHUNKSIZE"] == "131072" and "NCCL_ALGO" not in mega
    high_cos = render(lookup("a3-highgpu-8g"))  # COS is the A3 High default image
    assert high_cos["NCCL_NET"] == "GPUDirectTCPX_v7"
    assert high_cos["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"] == "eth1,eth2,eth3,eth4"
    assert high_cos["NCCL_GPUDIRECTTCPX_TX_BINDINGS"].startswith("eth1:8-21,112-125;eth2:")
    high_ubuntu = render(lookup("a3-highgpu-8g"), "ubuntu")
    assert high_ubuntu["NCCL_GPUDIRECTTCPX_CTRL_DEV"] == "enp0s12"
    assert high_ubuntu["NCCL_GPUDIRECTTCPX_RX_BINDINGS"].startswith("enp6s0:22-35,126-139;")
    ultra = render(lookup("a3-ultragpu-8g"))
    assert ultra["NCCL_NET"] == "gIB" and ultra["NCCL_SOCKET_IFNAME"] == "enp0s19,enp192s20"
    assert ultra["NCCL_TUNER_CONFIG_PATH"].endswith("tuner_config_a3u.txtpb")
    assert render(lookup("a4-highgpu-8g"))["NCCL_TUNER_CONFIG_PATH"].endswith("/tuner_config.txtpb")
    a2 = render(lookup("a2-highgpu-8g"))
    assert a2["LD_LIBRARY_PATH"] == "/usr/lib" and a2["NCCL_SOCKET_IFNAME"] == HOST_IFACE_ON_NODE
    assert render(None) == {"NCCL_SOCKET_IFNAME": HOST_IFACE_ON_NODE, "GLOO_SOCKET_IFNAME": HOST_IFACE_ON_NODE}


def test_env_override_replaces_profile_value_and_is_logged(caplog):
    cfg = _cfg(env=parse_env_pairs(["NCCL_BUFFSIZE=1048576", "MY_FLAG=a=b"]))
    with caplog.at_level(logging.WARNING, logger="launcher.core.env"):
        env = node_env(_cluster(2, "a3-megagpu-8g"), cfg)
    assert env["NCCL_BUFFSIZE"] == "1048576" and env["MY_FLAG"] == "a=b"
    # The user's value is named, never shown (it may be a secret, and logs are kept).
    assert "--env NCCL_BUFFSIZE overrides the profile value NCCL_BUFFSIZE=8388608" in caplog.text
    assert "1048576" not in caplog.text
    assert "MY_FLAG" not in caplog.text  # a new variable overrides nothing


def test_bad_env_pair_and_unknown_machine_type_are_user_errors():
    with pytest.raises(UserError, match="'1BAD' is not a shell variable name"):
        parse_env_pairs(["1BAD=x"])
    with pytest.raises(UserError, match="'a3-mega' is unknown; one of: .*a3-megagpu-8g"):
        node_env(_cluster(2, "a3-mega"), _cfg())


# ---- command building -------------------------------------------------------------------------


def test_torchrun_argv_is_a_static_rendezvous_on_node_zero_with_the_nodes_rank():
    c = _cluster(3)
    argv = torchrun_argv(c, c.nodes[2], _cfg(rdzv_port=29511), 8, ["-m", "workloads.train"])
    assert argv[:3] == ["python3", "-m", "torch.distributed.run"]
    for flag in (
        "--nnodes=3",
        "--nproc-per-node=8",
        # Node i of the cluster's order is torchrun's group rank i; node 0 hosts the store.
        "--rdzv-backend=static",
        "--master-addr=10.0.0.2",
        "--master-port=29511",
        "--node-rank=2",
        "--rdzv-id=job1",
        f"--rdzv-conf=timeout={join_timeout_s(3)}",
        "--max-restarts=0",
        "--local-addr=10.0.0.4",
    ):
        assert flag in argv
    assert not any(a.startswith(("--rdzv-endpoint", "--rdzv_endpoint")) for a in argv)
    assert argv[-2:] == ["-m", "workloads.train"]
    head = torchrun_argv(c, c.nodes[0], _cfg(), 1, ["x.py"])
    assert "--node-rank=0" in head and "--master-addr=10.0.0.2" in head and "--master-port=29500" in head


def test_torchrun_in_place_restarts_use_the_c10d_rendezvous_that_synchronises_them():
    c = _cluster(3)
    argv = torchrun_argv(c, c.nodes[2], _cfg(max_restarts=2, rdzv_port=29511), 8, ["x.py"])
    for flag in ("--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.2:29511", "--max-restarts=2", "--local-addr=10.0.0.4"):
        assert flag in argv
    assert f"--rdzv-conf=join_timeout={join_timeout_s(3)},is_host=0" in argv
    assert not any(a.startswith("--node-rank") for a in argv)
    head = torchrun_argv(c, c.nodes[0], _cfg(max_restarts=2), 1, ["x.py"])
    assert any(a.endswith("is_host=1") for a in head)


def test_torchrun_argv_brackets_an_ipv6_master_address():
    c = Cluster("c", (Node(0, "fd00::2", "fd00::2"), Node(1, "fd00::3", "fd00::3")))
    assert "--master-addr=[fd00::2]" in torchrun_argv(c, c.nodes[1], _cfg(), 1, ["x.py"])


def test_node_commands_follow_a_reordered_cluster():
    """A cluster renumbered by topology: each node's program carries its new rank, as torchrun's
    --node-rank and as GPUFLEET_NODE_RANK, and node 0 takes the rendezvous-port lock."""
    c = _cluster(3)
    hosts = {
        "10.0.0.2": PhysicalHost("c", "b1", "s1", "h1"),
        "10.0.0.3": PhysicalHost("c", "b2", "s1", "h2"),
        "10.0.0.4": PhysicalHost("c", "b1", "s1", "h3"),
    }
    ordered = launch_order(c, None, hosts).cluster
    assert [n.host for n in ordered.nodes] == ["10.0.0.2", "10.0.0.4", "10.0.0.3"]
    plans = ProgramBuilder(ordered, _cfg()).plans()
    assert "--node-rank=1" in plans[1].command and "--local-addr=10.0.0.4" in plans[1].command
    assert EnvVar("GPUFLEET_NODE_RANK", "1") in plans[1].env
    assert "--node-rank=2" in plans[2].command and "--local-addr=10.0.0.3" in plans[2].command
    locks = {r: [c for c in p.checks if c.kind is CheckKind.RDZV_PORT] for r, p in plans.items()}
    assert [c.target for c in locks[0]] == ["29500"] and plans[0].address == "10.0.0.2"
    assert not locks[1] and not locks[2]


def test_an_unknown_rank_order_is_refused_in_the_config():
    with pytest.raises(UserError, match="--rank-order 'random' is unknown; one of: topology, given"):
        _cfg(rank_order="random")


def test_join_timeout_grows_with_node_count():
    assert join_timeout_s(2) == 600
    assert join_timeout_s(256) > join_timeout_s(128) > join_timeout_s(64)


def test_every_launch_gets_a_new_rendezvous_id():
    assert len({new_job_id() for _ in range(50)}) == 50


def test_hostile_argument_arrives_as_one_literal_argument(tmp_path):
    """Run the built program with local bash (as the remote login shell would) and look at argv."""
    c = _cluster(1)
    cfg = _cfg(job_id=f"unit-{tmp_path.name}")
    argv = [sys.executable, "-c", "import sys; print(repr(sys.argv[1:]))", HOSTILE, "$(id)", "a b"]
    script = NodeProgram(c, c.nodes[0], cfg, {"X": "it's; $HOME"}, argv).render()
    # What ssh hands the remote login shell: one string, parsed by a POSIX shell.
    out = _run_wrapper(["sh", "-c", remote_command(script)])
    assert out.returncode == 0, out.stderr
    assert repr([HOSTILE, "$(id)", "a b"]) in out.stdout
    assert f"{EXIT_MARKER} 0" in out.stdout


def test_wrapper_exports_env_and_resolves_host_nic_from_the_address(tmp_path):
    c = Cluster("c", (Node(0, "127.0.0.1", "127.0.0.1"),))
    env = {
        "NCCL_SOCKET_IFNAME": HOST_IFACE_ON_NODE,
        "GLOO_SOCKET_IFNAME": HOST_IFACE_ON_NODE,
        "LD_LIBRARY_PATH": "/opt/x",
        "Q": "it's; $HOME",
    }
    script = NodeProgram(
        c,
        c.nodes[0],
        _cfg(job_id=f"unit-{tmp_path.name}"),
        env,
        ["sh", "-c", 'echo "$GLOO_SOCKET_IFNAME|$NCCL_SOCKET_IFNAME|$LD_LIBRARY_PATH|$Q"'],
    ).render()
    out = _run_wrapper(
        ["bash", "-c", script], env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LD_LIBRARY_PATH": "/keep"}
    )
    assert "lo|lo|/opt/x:/keep|it's; $HOME" in out.stdout


def test_wrapper_reports_the_exit_status_of_the_command(tmp_path):
    c = _cluster(1)
    script = NodeProgram(c, c.nodes[0], _cfg(job_id=f"unit-{tmp_path.name}"), {}, ["sh", "-c", "exit 7"]).render()
    out = _run_wrapper(["bash", "-c", script])
    assert out.returncode == 7 and f"{EXIT_MARKER} 7" in out.stdout


def test_closing_stdin_stops_the_whole_tree_including_escaped_sessions(tmp_path):
    """EOF on stdin (launcher gone or stopping) kills the command and a child in its own session."""
    c = _cluster(1)
    pidfile = tmp_path / "child.pid"
    prog = (
        f"import subprocess, time; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('up', flush=True); time.sleep(300)"
    )
    script = NodeProgram(
        c, c.nodes[0], _cfg(job_id=f"unit-{tmp_path.name}", stop_grace_s=1.0), {}, [sys.executable, "-c", prog]
    ).render()
    p = subprocess.Popen(["bash", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == CHECKED_MARKER
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "up"
    child = int(pidfile.read_text())
    p.stdin.close()
    assert p.wait(timeout=20) != 0
    assert EXIT_MARKER in p.stdout.read()
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)


def test_without_go_the_node_runs_nothing(tmp_path):
    """End of input at the gate (another node failed its check, or Ctrl-C): nothing starts."""
    c = _cluster(1)
    flag = tmp_path / "ran"
    script = NodeProgram(
        c, c.nodes[0], _cfg(job_id=f"unit-{tmp_path.name}"), {}, ["touch", str(flag)], check=True, check_torch=True
    ).render()
    out = subprocess.run(["bash", "-c", script], input="", capture_output=True, text=True, timeout=30)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[-1] == CHECKED_MARKER and EXIT_MARKER not in out.stdout
    facts = dict(l.split("=", 1) for l in lines[:-1])
    assert set(facts) == {"host", "time", "ready", "torch"} and abs(float(facts["time"]) - time.time()) < 60
    assert not flag.exists()
    # Anything but `go` is as good as end of input.
    out = subprocess.run(["bash", "-c", script], input="stop\n", capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and not flag.exists()


def test_rendezvous_lock_is_held_from_the_check_to_the_end_and_a_second_holder_refuses(tmp_path):
    c = Cluster("c", (Node(0, "127.0.0.1", f"127.0.9.{os.getpid() % 200 + 1}"),))
    port = 20000 + os.getpid() % 10000
    first = NodeProgram(c, c.nodes[0], _cfg(job_id="first"), {}, ["sleep", "30"], lock_port=port, check=True).render()
    second = NodeProgram(c, c.nodes[0], _cfg(job_id="second"), {}, ["true"], lock_port=port, check=True).render()
    p = subprocess.Popen(["bash", "-c", first], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != CHECKED_MARKER:
            lines.append(p.stdout.readline().strip())
        assert "port=free" in lines
        # The first one has not even been told to go: the port is already taken.
        out = subprocess.run(["bash", "-c", second], input="go\n", capture_output=True, text=True, timeout=30)
        assert out.returncode == 75 and "port=busy:first" in out.stdout.splitlines()
        assert EXIT_MARKER not in out.stdout
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    # stdin held open after `go` (end of input would stop `true` before it ran, under load).
    out = _run_wrapper(["bash", "-c", second])
    assert out.returncode == 0 and "port=free" in out.stdout


def test_the_workload_keeps_the_users_umask(tmp_path):
    """Checkpoints and logs a job writes must not turn private because the wrapper made a lock."""
    c = _cluster(1)
    script = NodeProgram(
        c,
        c.nodes[0],
        _cfg(job_id=f"unit-{tmp_path.name}"),
        {},
        ["sh", "-c", "umask"],
        lock_port=20000 + os.getpid() % 10000,
    ).render()
    out = _run_wrapper(["bash", "-c", f"umask 0022; {script}"])
    assert out.returncode == 0 and "0022" in out.stdout.splitlines(), out


def test_result_exit_code_is_the_first_failure_and_signals_win():
    nodes = [Node(i, f"h{i}", f"h{i}") for i in range(2)]
    r = LaunchResult(
        "j",
        None,
        {0: NodeOutcome(nodes[0], exit_code=143, stopped=True), 1: NodeOutcome(nodes[1], exit_code=3)},
        first_failure=1,
    )
    assert r.exit_code == 3 and list(r.failures) == [nodes[1]]
    r.outcomes[1] = NodeOutcome(nodes[1], exit_code=255, connection_lost=True)
    assert r.exit_code == 255 and r.outcomes[1].status.startswith("unreachable")
    r.signal = 2
    assert r.exit_code == 130


# ---- the CLI edge -------------------------------------------------------------------------------


def test_dry_run_prints_each_nodes_plan_and_connects_to_nothing(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n192.0.2.11 slots=2\n")  # TEST-NET-1: nothing answers there
    argv = ["run", "--hostfile", str(hf), "--runs-dir", str(tmp_path / "runs"), "--", "train.py", HOSTILE]
    r = CliRunner().invoke(main, [*argv[:1], "--dry-run=json", *argv[1:]])
    assert r.exit_code == 0, r.output
    lines = dry_runs.remote_lines(r.stdout)
    assert [host for host, _ in lines] == ["192.0.2.10", "192.0.2.11"]
    assert all(remote.startswith("exec bash --norc --noprofile -c ") for _, remote in lines)
    plans, programs = dry_runs.plans(r.stdout), dry_runs.programs(r.stdout)
    assert "--nproc-per-node=2" in plans[1].command and "--nproc-per-node=1" in plans[0].command
    assert (plans[0].ranks, plans[1].ranks) == ((0, 0), (1, 2))  # slots=2: two ranks on node 1
    # The hostile argument is one literal argument: last of the rank command, in the plan the
    # program hands its run (launcher.core.node_run) as one quoted argument, and the program is one
    # argument of bash -c on the remote line.
    for plan, program, (_, remote) in zip(plans, programs, lines):
        assert plan.command[-1] == HOSTILE and program.endswith(" node " + shlex.quote(plan.to_json()))
        assert shlex.split(remote)[-1] == program
    # The readable form says the same per node, the argument quoted as a shell would need it.
    text = CliRunner().invoke(main, [*argv[:1], "--dry-run", *argv[1:]])
    assert text.exit_code == 0, text.output
    assert dry_runs.headers(text.stdout) == [(0, "192.0.2.10"), (1, "192.0.2.11")]
    assert "ranks 1-2 (2 processes)" in text.stdout and shlex.quote(HOSTILE) in text.stdout
    assert not (tmp_path / "runs").exists()


def test_dry_run_says_which_rank_order_and_why(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.11\n192.0.2.10\n")  # not address order: the given order is kept
    base = ["run", "--hostfile", str(hf), "--dry-run", "--runs-dir", str(tmp_path / "runs")]
    r = CliRunner().invoke(main, [*base, "--", "train.py"])
    assert r.exit_code == 0, r.output
    assert (
        "rank order: given here (--dry-run asks no node for its physical_host; a launch orders by "
        "topology if every node reports one)" in r.stderr
    ), r.output
    assert dry_runs.headers(r.stdout) == [(0, "192.0.2.11"), (1, "192.0.2.10")]
    assert "--node-rank=0" in r.stdout.split("node 1", 1)[0] and "--master-addr=192.0.2.11" in r.stdout
    r = CliRunner().invoke(main, [*base, "--rank-order", "given", "--", "train.py"])
    assert r.exit_code == 0 and "rank order: given (--rank-order given)" in r.stderr, r.output
    r = CliRunner().invoke(main, ["train", "--local", "--nodes", "2", "--dry-run"])
    assert "rank order: given (--local: every node is this machine)" in r.stderr, r.output


def test_bad_rank_orders_are_one_line_exit_2():
    r = CliRunner().invoke(main, ["train", "--local", "--nodes", "2", "--rank-order", "random", "--dry-run"])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert "'random' is not one of 'topology', 'given'" in line and "--rank-order" in line
    r = CliRunner().invoke(main, ["train", "--local", "--nodes", "2", "--rank-order", "topology", "--dry-run"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        "error: --rank-order topology does not apply to --local (its nodes are processes on this "
        "machine); pass --rank-order given or leave it out"
    ]


def test_local_dry_run_uses_this_python_and_loopback():
    r = CliRunner().invoke(main, ["train", "--local", "--nodes", "2", "--dry-run", "--", "--steps", "3"])
    assert r.exit_code == 0, r.output
    assert sys.executable in r.output and "GLOO_SOCKET_IFNAME=lo" in r.output
    assert "-m workloads.train --steps 3" in r.output


def test_label_discovery_without_google_credentials_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    # Where google-auth looks for a GCE metadata server: nothing listens there.
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    r = CliRunner().invoke(main, ["exec", "--label", "team=ml", "--project", "p", "--zone", "z", "--", "true"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: no Google credentials to list instances in p/z") and "Traceback" not in r.output


def test_runs_dir_that_cannot_be_created_is_one_line_and_nothing_runs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = CliRunner().invoke(
        main,
        [
            "exec",
            "--local",
            "--nodes",
            "2",
            "--runs-dir",
            str(blocker / "runs"),
            "--",
            "sh",
            "-c",
            'touch "$0-$GPUFLEET_NODE_RANK"',
            str(tmp_path / "ran"),
        ],
    )
    assert r.exit_code == 2, r.output
    assert "cannot create the run directory" in r.output and "--runs-dir" in r.output
    assert not list(tmp_path.glob("ran-*"))


@pytest.mark.parametrize(
    "extra, flag", [(["--exclude", "x"], "--exclude"), (["--machine-type", "a2-highgpu-1g"], "--machine-type")]
)
def test_local_refuses_options_that_name_machines(extra, flag):
    r = CliRunner().invoke(main, ["exec", "--local", "--nodes", "2", *extra, "--", "true"])
    assert r.exit_code == 2 and f"error: {flag} does not apply to --local" in r.output, r.output


def test_nccl_tests_dry_runs_connect_to_nothing_and_bad_flags_are_refused(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("192.0.2.10\n192.0.2.11\n192.0.2.12\n")  # TEST-NET-1: nothing answers there
    base = [
        "nccl-tests",
        "--hostfile",
        str(hf),
        "--machine-type",
        "a3-megagpu-8g",
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    r = CliRunner().invoke(main, [*base, "--impl", "nccl-tests", "--ops", "all_reduce,all_gather", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert r.stderr.count("rank order: given here (--dry-run asks no node") == 1, r.output  # mpirun's host order
    # One command per collective, run on node 0, which starts mpirun over the 3 nodes.
    assert dry_runs.headers(r.stdout) == [(0, "192.0.2.10"), (0, "192.0.2.10")], r.stdout
    first, second = r.stdout.split("node 0  ")[1:]
    assert "all_reduce_perf" in first and "all_gather_perf" in second and "mpirun" in first
    j = CliRunner().invoke(main, [*base, "--impl", "nccl-tests", "--ops", "all_reduce,all_gather", "--dry-run=json"])
    assert j.exit_code == 0, j.output
    docs = [dry_runs.doc(line) for line in j.stdout.splitlines()]  # one JSON document per launch
    assert [[n["plan"]["host"] for n in d["nodes"]] for d in docs] == [["192.0.2.10"], ["192.0.2.10"]]
    assert docs[0]["nodes"][0]["plan"]["command"][0] == "mpirun"
    assert any(a.endswith("/all_reduce_perf") for a in docs[0]["nodes"][0]["plan"]["command"])
    r = CliRunner().invoke(main, [*base, "--find-bad-nodes", "--dry-run"])
    assert r.exit_code == 2 and "error: --find-bad-nodes" in r.output and "--dry-run" in r.output
    r = CliRunner().invoke(main, [*base, "--bogus"])
    assert r.exit_code == 2 and "--bogus" in r.output
    assert not (tmp_path / "runs").exists()


def test_rank_count_follows_each_nodes_slots():
    from launcher.cli.cmd_nccl_tests import _nranks

    c = Cluster("c", (Node(0, "a", "a", slots=2), Node(1, "b", "b", slots=1), Node(2, "c", "c")), "a3-megagpu-8g")
    assert _nranks(c, _cfg()) == 2 + 1 + 8  # slots where given, else the machine type's GPUs
    assert _nranks(c, _cfg(nproc_per_node=4)) == 12


def test_the_status_line_names_the_last_nodes_still_to_answer():
    from launcher.cli.render import live_printer
    from launcher.core.launch import NodeEvent, NodeState

    c = _cluster(5)
    on_event, status, _ = live_printer(c)

    def checked(rank: int) -> None:
        on_event(NodeEvent(c.nodes[rank], state=NodeState.CONNECTING))
        on_event(NodeEvent(c.nodes[rank], state=NodeState.CHECKED))

    try:
        checked(0)
        assert str(status.status) == "checked 1/5 nodes"
        checked(2)
        assert (
            str(status.status)
            == "checked 2/5 nodes; waiting for node 1 (10.0.0.3), node 3 (10.0.0.5), node 4 (10.0.0.6)"
        )
        checked(4)
        on_event(NodeEvent(c.nodes[1], state=NodeState.UNREACHABLE, detail="Connection refused"))
        assert str(status.status) == "checked 4/5 nodes; waiting for node 3 (10.0.0.5)"
        checked(3)
        assert str(status.status) == "checked 5/5 nodes"
    finally:
        status.stop()


def test_a_missing_workdir_is_found_by_the_check_and_nothing_runs(tmp_path):
    """--local nodes run the same node-side program as SSH nodes: the check fails, no node goes."""
    wd, runs = tmp_path / "nowhere", tmp_path / "runs"
    r = CliRunner().invoke(
        main,
        [
            "exec",
            "--local",
            "--nodes",
            "2",
            "--workdir",
            str(wd),
            "--runs-dir",
            str(runs),
            "--",
            "sh",
            "-c",
            'touch "$0-$GPUFLEET_NODE_RANK"',
            str(tmp_path / "ran"),
        ],
    )
    assert r.exit_code == 2, r.output
    errors = [l for l in r.output.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and f"--workdir '{wd}' does not exist on" in errors[0], r.output
    assert not list(tmp_path.glob("ran-*")) and not runs.exists()
    # With the directory there, the same command runs on both nodes, in it.
    wd.mkdir()
    r = CliRunner().invoke(
        main,
        [
            "exec",
            "--local",
            "--nodes",
            "2",
            "--workdir",
            str(wd),
            "--runs-dir",
            str(runs),
            "--",
            "sh",
            "-c",
            'touch "ran-$GPUFLEET_NODE_RANK"',
        ],
    )
    assert r.exit_code == 0, r.output
    assert sorted(f.name for f in wd.iterdir()) == ["ran-0", "ran-1"]


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["exec", "--local", "--nodes", "0", "--", "true"], "--nodes 0"),
        (["exec", "--hostfile", "{empty}", "--", "true"], "lists no hosts"),
        (["exec", "--hostfile", "{spaces}", "--", "true"], "'one' is not understood"),
        (["exec", "--hostfile", "{meta}", "--", "true"], "not a valid host"),
        (["exec", "--outputs", "{nonodes}", "--", "true"], "'nodes' is missing"),
        (["exec", "--outputs", "{notjson}", "--", "true"], "is not JSON"),
        (["exec", "--hostfile", "{hosts}", "--local", "--nodes", "1", "--", "true"], "exactly one node source"),
        (["exec", "--", "true"], "exactly one node source"),
        (["exec", "--hostfile", "{hosts}", "--nodes", "9", "--", "true"], "2 found"),
        (["run", "--hostfile", "{hosts}", "--env", "=x", "--", "a.py"], "--env"),
        (["run", "--hostfile", "{hosts}", "--rdzv-port", "80", "--", "a.py"], "--rdzv-port 80"),
        (["run", "--hostfile", "{hosts}", "--machine-type", "a3-mega", "--", "a.py"], "a3-mega"),
        (["run", "--hostfile", "{hosts}"], "nothing to run"),
        (["exec", "--hostfile", "{hosts}", "--ssh-option", "BatchMode", "--", "true"], "--ssh-option"),
        (["exec", "--label", "team=a", "--", "true"], "--project and --zone"),
    ],
)
def test_user_errors_are_one_line_exit_2_and_run_nothing(tmp_path, args, culprit):
    files = {
        "empty": "",
        "spaces": "node one\n",
        "nonodes": json.dumps({"cluster": "x"}),
        "notjson": "{",
        "hosts": "192.0.2.10\n192.0.2.11\n",
        "meta": "a;b\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [a.format(**{k: str(tmp_path / k) for k in files}) for a in args]
    runs = tmp_path / "runs"
    r = CliRunner().invoke(
        main,
        args + ["--runs-dir", str(runs)]
        if "--" not in args
        else args[: args.index("--")] + ["--runs-dir", str(runs)] + args[args.index("--") :],
    )
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert culprit in r.output
    assert len([l for l in r.output.splitlines() if l.strip()]) == 1, r.output
    assert not runs.exists()


def test_local_cluster_has_loopback_nodes():
    c = local_cluster(3)
    assert [n.address for n in c.nodes] == ["127.0.0.1"] * 3 and c.local


# ---- pre-flight judgement ---------------------------------------------------------------------


def _probes(facts: list[dict], skews=None):
    from launcher.core.preflight import Probe

    c = _cluster(len(facts))
    return c, {
        n.rank: Probe(n, True, facts=f, skew_s=(skews or [0.0] * len(facts))[n.rank]) for n, f in zip(c.nodes, facts)
    }


def test_preflight_refuses_different_torch_versions_naming_each_node():
    from launcher.core.preflight import check_probes

    c, probes = _probes([{"host": "a", "torch": "2.13.0"}, {"host": "b", "torch": "2.12.1"}])
    with pytest.raises(UserError, match=r"torch versions differ .*node 1 \(10.0.0.3\): 2.12.1"):
        check_probes(c, probes, _cfg())


def test_preflight_names_unreachable_nodes_together_and_busy_rendezvous_port():
    from launcher.core.preflight import Probe, check_probes

    c, probes = _probes([{"host": "a", "port": "busy:job0"}, {"host": "b"}, {"host": "c"}])
    with pytest.raises(UserError, match="in use by another launch \\(job job0\\)"):
        check_probes(c, probes, _cfg())
    probes[1] = Probe(c.nodes[1], False, "Connection refused")
    probes[2] = Probe(c.nodes[2], False, "Connection timed out")
    with pytest.raises(UserError) as e:
        check_probes(c, probes, _cfg())
    assert "2 of 3 nodes cannot be reached" in str(e.value)
    assert "node 1 (10.0.0.3): Connection refused; node 2 (10.0.0.4): Connection timed out" in str(e.value)


def test_preflight_warns_about_a_skewed_clock_and_a_wrong_hostname():
    from launcher.core.preflight import check_probes

    c = Cluster("c", (Node(0, "10.0.0.2", "10.0.0.2", name="gpu-0"), Node(1, "10.0.0.3", "10.0.0.3", name="gpu-1")))
    from launcher.core.preflight import Probe

    probes = {
        0: Probe(c.nodes[0], True, facts={"host": "gpu-0"}, skew_s=0.1),
        1: Probe(c.nodes[1], True, facts={"host": "old-box"}, skew_s=-7.5),
    }
    warnings = check_probes(c, probes, _cfg())
    assert any("node 1 (10.0.0.3): clock differs from this machine by -7.5 s" in w for w in warnings)
    assert any("hostname is 'old-box', expected 'gpu-1'" in w for w in warnings)
    assert not any("node 0" in w for w in warnings)


def test_connections_through_a_proxy_are_bounded_below_maxstartups():
    from launcher.core.preflight import through_gateway
    from launcher.core.ssh import ssh_base_argv
    from launcher.core.transport import Transport
    from launcher.core.types import SshConfig

    node = Node(0, "10.0.0.2", "10.0.0.2")
    for opts, iap, expect in [
        ((), False, False),
        (("ProxyJump=bastion",), False, True),
        (("ProxyCommand=nc %h %p",), False, True),
        ((), True, True),
    ]:
        ssh = SshConfig(options=opts, iap=iap, zone="z")
        t = Transport(False, ssh_base_argv(ssh, "/tmp/ctl", "/tmp/kh"))
        assert through_gateway(t, node, ssh) is expect, opts


def test_ssh_argv_checks_host_keys_keeps_connections_and_lets_user_options_win():
    from launcher.core.ssh import ssh_argv, ssh_base_argv
    from launcher.core.types import SshConfig

    base = ssh_base_argv(
        SshConfig(user="ml", options=("StrictHostKeyChecking=yes",), iap=True, zone="us-east5-a"),
        "/tmp/ctl",
        "/home/u/.cache/gpufleet/known_hosts/c-1",
    )
    opts = [base[i + 1] for i, a in enumerate(base) if a == "-o"]
    # ssh keeps the first value of an option: the user's comes before the default.
    assert opts.index("StrictHostKeyChecking=yes") < opts.index("StrictHostKeyChecking=accept-new")
    assert "StrictHostKeyChecking=no" not in opts
    assert "UserKnownHostsFile=/home/u/.cache/gpufleet/known_hosts/c-1" in opts
    assert {"BatchMode=yes", "ControlMaster=auto", "ControlPath=/tmp/ctl/%C", "ServerAliveInterval=2"} <= set(opts)
    # --iap: no tunnel by address in the shared options; each node's own, by name (ssh_argv).
    assert not any(o.startswith("ProxyCommand=") for o in opts)
    assert base[base.index("-l") + 1] == "ml"
    argv = ssh_argv(base, Node(0, "10.0.0.2", "10.0.0.2"), "exec bash -c true")
    assert argv[-3:] == ["10.0.0.2", "--", "exec bash -c true"]
    tunnel = "gcloud compute start-iap-tunnel dev-0 %p --listen-on-stdin --zone us-east5-a"
    argv = ssh_argv(base, Node(0, "10.0.0.2", "10.0.0.2", name="dev-0"), "exec bash -c true", tunnel)
    assert argv[-5:] == ["-o", f"ProxyCommand={tunnel}", "10.0.0.2", "--", "exec bash -c true"]


def test_local_exec_passes_env_and_a_dash_command_literally(tmp_path):
    runs = str(tmp_path / "runs")
    r = CliRunner().invoke(
        main,
        [
            "exec",
            "--local",
            "--nodes",
            "2",
            "--env",
            "GREETING=a b;c",
            "--runs-dir",
            runs,
            "--",
            "sh",
            "-c",
            'echo "[$GREETING] $GPUFLEET_NODE_RANK"',
        ],
    )
    assert r.exit_code == 0, r.output
    assert "[node 0] [a b;c] 0" in r.output and "[node 1] [a b;c] 1" in r.output
    r = CliRunner().invoke(main, ["exec", "--local", "--nodes", "1", "--runs-dir", runs, "--", "-x"])
    assert r.exit_code == 127 and "failed to execute -x" in r.output


def test_misspelt_launcher_option_is_an_error_not_a_command(tmp_path):
    r = CliRunner().invoke(main, ["exec", "--local", "--nodes", "1", "--nodez", "2", "--", "true"])
    assert (r.exit_code, r.output) == (2, "error: no such option --nodez (did you mean --nodes?)\n")


# ---- what the terminal shows, one environment, small things ---------------------------


def test_the_check_sees_the_launch_environment(tmp_path):
    """`--env PATH=...` decides which `python3` the check asks for torch, as it does for the run."""
    import importlib.metadata

    c = _cluster(1)
    venv_bin = str(Path(sys.executable).parent)
    script = NodeProgram(
        c, c.nodes[0], _cfg(job_id=f"unit-{tmp_path.name}"), {"PATH": venv_bin}, ["true"], check=True, check_torch=True
    ).render()
    # A PATH without this venv: its `python3` (if any) has no torch, so only --env can find it.
    out = subprocess.run(
        ["bash", "-c", script], input="", capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
    )
    facts = dict(l.split("=", 1) for l in out.stdout.splitlines() if "=" in l)
    assert facts["torch"] == importlib.metadata.version("torch"), out.stdout + out.stderr


def test_launch_version_names_the_installed_package():
    import importlib.metadata

    version = importlib.metadata.version("gpufleet")
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and r.output == f"launch, version {version}\n"
    p = subprocess.run([LAUNCH, "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == f"launch, version {version}\n", p.stderr


def test_pyproject_license_is_an_spdx_string_setuptools_reads_without_a_warning():
    # setuptools deprecates `license = { text = ... }` with a warning block on every build (PEP 639).
    prog = (
        "from setuptools.config.pyprojecttoml import apply_configuration; "
        "from setuptools.dist import Distribution; "
        "print(apply_configuration(Distribution(), 'pyproject.toml').metadata.license_expression)"
    )
    p = subprocess.run(
        [sys.executable, "-W", "error", "-c", prog], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert p.returncode == 0 and p.stdout.strip() == "Apache-2.0", p.stderr[-2000:]


def test_a_sweep_error_line_names_its_node_as_the_cause(tmp_path):
    """Node 1's sweep says what is wrong, then node 0 exits first: node 1 is still the cause."""
    cmd = (
        'if [ "$GPUFLEET_NODE_RANK" = 1 ]; then echo "sweep: root 5 is not a rank of this run" >&2; '
        "sleep 30; else sleep 2; exit 1; fi"
    )
    r = CliRunner().invoke(
        main, ["exec", "--local", "--nodes", "2", "--runs-dir", str(tmp_path / "runs"), "--", "sh", "-c", cmd]
    )
    assert r.exit_code != 0, r.output
    assert "node 1 (localhost) failed first" in r.output, r.output
    # Its error line is shown once, in the live stream: the launcher's line points to its log.
    assert r.output.count("sweep: root 5 is not a rank of this run") == 1, r.output
    assert "[node 1] sweep: root 5 is not a rank of this run" in r.output


def test_the_sweep_json_line_and_c10d_dns_warnings_stay_in_the_log_not_the_live_stream(tmp_path):
    dns = (
        "[W1123 09:18:02.123456789 socket.cpp:204] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
    )
    cmd = f'echo "#gpufleet-json {{\\"rows\\": []}}"; echo "{dns}" >&2; echo visible'
    r = CliRunner().invoke(
        main, ["exec", "--local", "--nodes", "1", "--runs-dir", str(tmp_path / "runs"), "--", "sh", "-c", cmd]
    )
    assert r.exit_code == 0, r.output
    assert "[node 0] visible" in r.output
    assert "gpufleet-json" not in r.output and "hostname of the client socket" not in r.output
    (log,) = (tmp_path / "runs").glob("*/node-0.log")
    assert log.read_text().splitlines() == ['#gpufleet-json {"rows": []}', dns, "visible"]


# ---- the Launch object ---------------------------------------------------------------------


def test_launch_moves_each_node_through_its_states_and_reports_them(tmp_path):
    from launcher.core.launch import Launch, NodeState

    cmd = 'if [ "$GPUFLEET_NODE_RANK" = 1 ]; then echo bye; exit 3; fi; sleep 30'
    cfg = LaunchConfig(workload=Workload("exec", ("sh", "-c", cmd)), job_id=new_job_id(), runs_dir=tmp_path)
    events = []
    launch = Launch(local_cluster(2), cfg, on_event=events.append)
    result = launch.run(handle_signals=False)
    states = {r: [e.state for e in events if e.node.rank == r and e.state] for r in (0, 1)}
    path = [NodeState.CONNECTING, NodeState.CHECKED, NodeState.RUNNING]
    assert states == {0: [*path, NodeState.STOPPED], 1: [*path, NodeState.FAILED]}
    assert launch.states == {0: NodeState.STOPPED, 1: NodeState.FAILED}
    assert [e.line for e in events if e.line] == ["bye"]
    assert result is launch.result and result.first_failure == 1 and result.exit_code == 3


def test_a_node_that_never_answers_its_check_is_unreachable_and_the_rest_go_home(tmp_path):
    from launcher.core.launch import Launch, NodeState

    c = Cluster("c", (Node(0, "127.0.0.1", "127.0.0.1"), Node(1, "127.0.0.2", "127.0.0.2")))
    cfg = LaunchConfig(workload=Workload("exec", ("true",)), job_id=new_job_id(), runs_dir=tmp_path)
    launch = Launch(c, cfg, transport=_BashHereSshToNode1(tmp_path))
    probes = launch.probe(check_torch=False)
    assert probes[0].ok and not probes[1].ok and "Connection refused" in probes[1].error
    assert launch.states == {0: NodeState.STOPPED, 1: NodeState.UNREACHABLE}


class _BashHereSshToNode1:
    """Node 0 runs in bash here (as --local does); node 1 through real ssh to a port where
    nothing listens, so its connection is refused."""

    local = False

    def __init__(self, tmp_path):
        from launcher.core.ssh import ssh_base_argv
        from launcher.core.types import SshConfig

        ssh = SshConfig(options=("Port=1",), connect_timeout=3)
        # A short ControlPath directory: a socket path has at most 108 bytes, and pytest's
        # tmp_path (deeper still under xdist's per-worker directory) can pass that.
        control = tempfile.mkdtemp(prefix="gfu-", dir="/tmp")
        self.ssh_base = ssh_base_argv(ssh, control, str(tmp_path / "known_hosts"))

    def argv(self, node, script):
        from launcher.core.ssh import remote_command, ssh_argv

        if node.rank == 0:
            return ["bash", "--norc", "--noprofile", "-c", script]
        return ssh_argv(self.ssh_base, node, remote_command(script))

    def tunnel_log(self, node):
        return None  # no IAP tunnel


class _Node1LostAfterItsCheck:
    """Both nodes run in bash here (as --local does), but node 1's "connection" drops 3 s into
    its program, with ssh's status for it (255) and no exit marker: a node lost mid-run."""

    local = True

    def __init__(self, told: Path):
        self.told = told  # what node 0's program read on stdin

    def argv(self, node, script):
        if node.rank == 0:
            return [
                "bash",
                "--norc",
                "--noprofile",
                "-c",
                'tee "$2" | bash --norc --noprofile -c "$1"',
                "n0",
                script,
                str(self.told),
            ]
        # Through a `cat` that dies with the "connection": the program's processes left behind
        # keep only that pipe open, not the launcher's.
        lost = 'bash --norc --noprofile -c "$1" 0<&0 2>&1 | cat & sleep 3; kill -9 $!; exit 255'
        return ["bash", "--norc", "--noprofile", "-c", lost, "node1", script]

    def tunnel_log(self, node):
        return None


def test_the_survivors_of_a_lost_node_are_stopped_with_the_short_grace_not_term_grace(tmp_path, caplog):
    """Their collective save cannot finish without the lost peer: waiting out --term-grace (25 s)
    only delays the next attempt: node 0's watchdog is told the short grace (it ignores SIGTERM, so
    it is killed once that grace is over)."""
    from launcher.core.launch import LOST_NODE_GRACE_S, Launch, NodeState
    from launcher.core.wire import grace_line

    cmd = "trap '' TERM; sleep 97.25"  # a time of its own, to find what node 1 left behind
    cfg = LaunchConfig(workload=Workload("exec", ("sh", "-c", cmd)), job_id=new_job_id(), runs_dir=tmp_path)
    assert cfg.stop_grace_s > LOST_NODE_GRACE_S
    events = []
    launch = Launch(local_cluster(2), cfg, transport=_Node1LostAfterItsCheck(tmp_path / "told"), on_event=events.append)
    try:
        with caplog.at_level("WARNING"):
            result = launch.run(handle_signals=False)
    finally:
        subprocess.run(["pkill", "-KILL", "-f", "sleep 97.25"], check=False)
    assert result.outcomes[1].connection_lost and launch.states[0] is NodeState.STOPPED
    assert f"stopping the other nodes (SIGKILL after {LOST_NODE_GRACE_S:g} s)" in caplog.text
    assert (tmp_path / "told").read_bytes().endswith(b"go\n" + grace_line(LOST_NODE_GRACE_S))
    assert result.outcomes[0].stopped
