"""Detached jobs' pure parts: records, the request, the node-side reader programs and the
cluster key's authorized_keys entry, without a network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpufleet import atomic
from launcher.cluster.key import SshTarget, authorize_entry, controller_ssh, known_hosts_text, verified_host_keys
from launcher.core import node_start
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload
from launcher.jobs.record import (
    LIST_MARKER,
    JobRecord,
    JobState,
    check_job_id,
    list_script,
    logs_script,
    parse_listing,
    process_start,
    request_from_json,
    request_json,
    stop_script,
)

CLUSTER = Cluster("c", (Node(0, "10.0.0.2", "10.0.0.2"), Node(1, "10.0.0.3", "10.0.0.3", slots=2)))


def record(**kw) -> JobRecord:
    base = dict(id="20260101-000000-aaaaaa", state=JobState.RUNNING, what="exec true", nodes=["a"], submitted=1.0)
    return JobRecord(**{**base, **kw})


def test_a_running_record_whose_controller_is_gone_reads_as_failed_with_why():
    r = record(pid=123, pid_start="456")
    seen = r.seen_with(alive=False)
    assert seen.state is JobState.FAILED and seen.exit == 1 and "controller (pid 123)" in seen.why
    assert r.seen_with(alive=True).state is JobState.RUNNING
    done = record(state=JobState.SUCCEEDED, exit=0)
    assert done.seen_with(alive=False).state is JobState.SUCCEEDED


def test_a_job_whose_controller_died_reads_as_orphaned_within_its_grace_and_failed_after_it():
    r = record(pid=123, pid_start="456", controller_grace_s=600)
    within = r.seen_with(alive=False, heartbeat_age_s=30)
    assert within.state is JobState.RUNNING and within.orphaned and within.why == ""
    past = r.seen_with(alive=False, heartbeat_age_s=601)
    assert past.state is JobState.FAILED and not past.orphaned and past.exit == 1
    assert "no controller for more than --controller-grace 600 s" in past.why and "pid 123" in past.why
    # No heartbeat at all (a controller from before it existed): no grace to wait in.
    assert r.seen_with(alive=False).state is JobState.FAILED
    assert not r.seen_with(alive=True, heartbeat_age_s=900).orphaned


def test_listing_is_newest_first_and_ignores_banners_and_torn_lines():
    older = record(id="20260101-000000-aaaaaa", submitted=1.0)
    newer = record(id="20260101-000001-bbbbbb", submitted=2.0)
    text = "\n".join(
        [
            "Welcome to node 0",
            f"{LIST_MARKER} 1 - {json.dumps(older.to_json())}",
            f"{LIST_MARKER} 0 - {json.dumps(newer.to_json())}",
            f"{LIST_MARKER} 1 - {{\"id\": ",
        ]
    )
    got = parse_listing(text)
    assert [r.id for r in got] == [newer.id, older.id]
    assert got[0].state is JobState.FAILED  # its controller is not alive
    assert got[1].state is JobState.RUNNING


def test_list_script_tells_a_live_controller_from_a_dead_one(tmp_path):
    jobs = tmp_path / ".gpufleet" / "jobs"
    for job_id, pid in (("20260101-000000-aaaaaa", os.getpid()), ("20260101-000001-bbbbbb", 999999)):
        (jobs / job_id).mkdir(parents=True)
        atomic.write_text(jobs / job_id / "state.json", json.dumps(record(id=job_id, pid=pid).to_json()))
        (jobs / job_id / "controller.pid").write_text(f"{pid} {process_start(os.getpid())}\n")
    out = subprocess.run(
        ["bash", "-c", list_script()], capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)}
    ).stdout
    states = {r.id: r.state for r in parse_listing(out)}
    assert states == {"20260101-000000-aaaaaa": JobState.RUNNING, "20260101-000001-bbbbbb": JobState.FAILED}
    # A dead controller's heartbeat within the job's --controller-grace: still RUNNING, orphaned.
    dead = jobs / "20260101-000001-bbbbbb"
    atomic.write_text(
        dead / "state.json", json.dumps(record(id=dead.name, pid=999999, controller_grace_s=60).to_json())
    )
    (dead / "heartbeat").touch()
    out = subprocess.run(
        ["bash", "-c", list_script()], capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)}
    ).stdout
    (seen,) = [r for r in parse_listing(out) if r.id == dead.name]
    assert seen.state is JobState.RUNNING and seen.orphaned
    os.utime(dead / "heartbeat", (0, time.time() - 61))
    out = subprocess.run(
        ["bash", "-c", list_script()], capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)}
    ).stdout
    (seen,) = [r for r in parse_listing(out) if r.id == dead.name]
    assert seen.state is JobState.FAILED and "--controller-grace 60 s" in seen.why


@pytest.mark.parametrize("bad", ["../x", "20260101-000000-aaaaaa; rm -rf ~", "", "*"])
def test_a_job_id_that_is_not_one_is_refused_before_it_reaches_a_shell(bad):
    with pytest.raises(UserError, match="is not a job id"):
        check_job_id(bad)


def test_the_request_carries_no_env_values_and_round_trips(tmp_path):
    config = LaunchConfig(
        Workload("exec", ("sh", "-c", "echo $TOKEN")), env=(("TOKEN", "s3cret"),), job_id="j", rdzv_port=29600
    )
    d = request_json(CLUSTER, config, controller_ssh("root", 2222, "c-abc", ".gpufleet/jobs/j/known_hosts"))
    assert "s3cret" not in json.dumps(d) and d["config"]["env_keys"] == ["TOKEN"]
    cluster, back = request_from_json(json.loads(json.dumps(d)), [["TOKEN", "s3cret"]], tmp_path, tmp_path / "jobs")
    assert cluster.nodes == CLUSTER.nodes and back.workload == config.workload and back.env == config.env
    assert back.rdzv_port == 29600 and back.run_dir == tmp_path / "jobs" / "j"
    assert back.ssh.key == tmp_path / ".gpufleet/clusters/c-abc/id_ed25519"
    assert back.ssh.known_hosts == tmp_path / ".gpufleet/jobs/j/known_hosts"
    # Host keys are checked for real from node 0, and its sessions share no connection.
    assert "StrictHostKeyChecking=yes" in back.ssh.options and "Port=2222" in back.ssh.options
    assert "ControlMaster=no" in back.ssh.options


def test_the_controller_and_its_recoveries_run_the_clients_rank_order(tmp_path):
    """The client orders the nodes (here by topology) before the hand-off; node 0's controller,
    and every recovery's relaunch, rebuild the cluster from the request: the same order, so each
    node gets the same --node-rank again."""
    from gpufleet.health import PhysicalHost
    from launcher.cluster.topology import launch_order
    from launcher.core.program import node_commands

    nodes = tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(3))
    hosts = {n.host: PhysicalHost("c", f"b{[1, 2, 1][n.rank]}", None, f"h{n.rank}") for n in nodes}
    ordered = launch_order(Cluster("c", nodes), None, hosts).cluster
    assert [n.host for n in ordered.nodes] == ["10.0.0.2", "10.0.0.4", "10.0.0.3"]
    config = LaunchConfig(Workload("torchrun", ("train.py",)), job_id="j")
    d = request_json(ordered, config, controller_ssh("root", 22, "c-abc", ".gpufleet/jobs/j/known_hosts"))
    cluster, back = request_from_json(json.loads(json.dumps(d)), [], tmp_path, tmp_path / "jobs")
    assert cluster.nodes == ordered.nodes
    assert (
        "--node-rank=1" in node_commands(cluster, back)[1]
        and "--local-addr=10.0.0.4" in node_commands(cluster, back)[1]
    )


def test_the_cluster_key_is_authorized_from_the_cluster_addresses_only(tmp_path, monkeypatch):
    entry = authorize_entry("ssh-ed25519 AAAAC3Nz comment", CLUSTER)
    monkeypatch.setenv("HOME", str(tmp_path))
    for _ in range(2):  # twice: one entry
        node_start.authorize(entry)
    keys = (tmp_path / ".ssh" / "authorized_keys").read_text().splitlines()
    assert len(keys) == 1 and keys[0].startswith('from="10.0.0.2,10.0.0.3",') and "ssh-ed25519 AAAAC3Nz" in keys[0]
    assert (tmp_path / ".ssh" / "authorized_keys").stat().st_mode & 0o077 == 0


def test_node_0_gets_the_host_keys_the_client_verified_even_from_a_hashed_known_hosts(tmp_path):
    mine = tmp_path / "known_hosts"
    mine.write_text(
        "[10.0.0.2]:2222 ssh-ed25519 K0\n10.0.0.2 ssh-ed25519 WRONGPORT\n"
        "[10.0.0.3]:2222 ssh-ed25519 K1\n@revoked [10.0.0.3]:2222 ssh-rsa R\n"
    )
    subprocess.run(["ssh-keygen", "-H", "-f", str(mine)], check=True, capture_output=True)
    assert "10.0.0.2" not in mine.read_text()  # hashed, as HashKnownHosts=yes writes them
    target = SshTarget("root", 2222, (str(mine), str(tmp_path / "missing")))
    keys = verified_host_keys(target, CLUSTER)
    assert keys == {0: ["ssh-ed25519 K0"], 1: ["ssh-ed25519 K1"]}
    assert known_hosts_text(CLUSTER, keys, 2222).splitlines() == [
        "[10.0.0.2]:2222 ssh-ed25519 K0",
        "[10.0.0.3]:2222 ssh-ed25519 K1",
    ]
    with pytest.raises(UserError, match=r"host key of node 1 \(10.0.0.3\) is not in this machine's known_hosts"):
        known_hosts_text(CLUSTER, {0: keys[0], 1: []}, 22)


def test_plain_and_hashed_known_hosts_entries_give_each_node_its_keys_in_file_order(tmp_path):
    hashed, plain = tmp_path / "hashed", tmp_path / "plain"
    hashed.write_text("10.0.0.3 ssh-ed25519 H1\n10.0.0.2 ssh-rsa H0\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(hashed)], check=True, capture_output=True)
    plain.write_text("other,10.0.0.2 ssh-ed25519 P0\n10.0.0.20 ssh-ed25519 NOT\n10.0.0.3 ssh-ed25519 H1\n")
    target = SshTarget("root", 22, (str(plain), str(hashed)))
    assert verified_host_keys(target, CLUSTER) == {0: ["ssh-ed25519 P0", "ssh-rsa H0"], 1: ["ssh-ed25519 H1"]}


def test_records_are_replaced_whole(tmp_path):
    p = tmp_path / "state.json"
    atomic.write_text(p, json.dumps({"a": 1}))
    atomic.write_text(p, json.dumps({"a": 2}))
    assert json.loads(p.read_text()) == {"a": 2} and [f.name for f in tmp_path.iterdir()] == ["state.json"]


def test_stop_and_logs_scripts_quote_the_job_dir():
    for script in (logs_script("20260101-000000-aaaaaa", 2, True), stop_script("20260101-000000-aaaaaa")):
        assert '"$HOME"/.gpufleet/jobs/20260101-000000-aaaaaa' in script
        assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["exec", "--local", "--nodes", "2", "--detach", "--", "true"], "--detach needs SSH nodes"),
        (["exec", "--hostfile", "HOSTS", "--dry-run", "--detach", "--", "true"], "--detach and --dry-run"),
        (["logs", "--hostfile", "HOSTS", "../../etc"], "is not a job id"),
        (["stop", "--hostfile", "HOSTS", "20260101-000000-aaaaaa; reboot"], "is not a job id"),
        (["jobs", "--local", "--nodes", "2"], "detached jobs live on an SSH cluster's controller host or node 0"),
    ],
)
def test_detached_commands_refuse_bad_input_in_one_line_before_connecting(tmp_path, args, message):
    from click.testing import CliRunner

    from launcher.cli.main import main

    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.2\n")
    r = CliRunner().invoke(main, [str(hosts) if a == "HOSTS" else a for a in args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.output


def test_a_failed_record_write_keeps_the_old_record_and_leaves_no_temporary_file(tmp_path):
    p = tmp_path / "state.json"
    atomic.write_text(p, '{"a": 1}')
    with pytest.raises(OSError), atomic.replacing(p) as tmp:
        tmp.write_text('{"a": ')
        raise OSError(28, "No space left on device")
    assert p.read_text() == '{"a": 1}' and [f.name for f in tmp_path.iterdir()] == ["state.json"]


def test_the_code_shipped_to_node_0_runs_the_controller_under_python_S_from_the_copy(tmp_path):
    """handoff ships launcher/ and gpufleet/ with their subpackages; node 0 runs the controller from
    that copy with `python -S` (no site-packages: the standard library only)."""
    from launcher.jobs.handoff import _code_files

    files, _ = _code_files()
    for name in (
        "launcher/jobs/controller.py",
        "launcher/core/launch.py",
        "launcher/observe/top.py",
        "gpufleet/atomic.py",
    ):
        assert name in files, sorted(files)
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)}
    code = (
        "import launcher.jobs.controller as c, launcher.jobs.recovery, launcher.observe.job_metrics, sys; "
        "print(c.__file__); print(sorted({'click', 'rich', 'torch'} & set(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [str(tmp_path / "launcher/jobs/controller.py"), "[]"]
    r = subprocess.run(
        [sys.executable, "-S", "-m", "launcher.jobs.controller"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert (r.returncode, r.stderr) == (
        2,
        "usage: python -m launcher.jobs.controller JOBDIR | --adopt-all [JOBS_DIR]\n",
    )


def test_controller_grace_needs_detach_and_a_duration_and_is_refused_in_one_line(tmp_path):
    from click.testing import CliRunner

    from launcher.cli.main import main

    hosts = tmp_path / "hosts"
    hosts.write_text("192.0.2.10\n")  # TEST-NET-1: nothing answers there, and nothing is asked
    base = ["exec", "--hostfile", str(hosts), "--runs-dir", str(tmp_path / "runs")]
    r = CliRunner().invoke(main, [*base, "--controller-grace", "5m", "--", "true"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "error: --controller-grace is for a detached job's controller; add --detach or drop it"
    ], r.output
    r = CliRunner().invoke(main, [*base, "--detach", "--controller-grace", "soon", "--", "true"])
    assert r.exit_code == 2 and "--controller-grace 'soon' is not a duration" in r.output, r.output
