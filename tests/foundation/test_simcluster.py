"""The simulated cluster: real sshd nodes, real host-key checking, nothing left behind."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.simcluster import (
    BARE_DISK,
    BARE_RUN,
    HOME,
    SimCluster,
    bare_node_setup,
    hidden_paths,
    leftovers,
    netns_available,
)
from tests.support import BARE_GROUP, require_netns


def _ssh(cluster: SimCluster, address: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ssh", *cluster.ssh_options, "-o", "ConnectTimeout=10", address, command],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("mode", ["netns", "loopback"])
def test_three_nodes_answer_over_ssh_with_host_keys_checked_and_leave_nothing(tmp_path, mode):
    if mode == "netns" and not netns_available():
        pytest.skip("netns mode needs root and ip netns; the loopback variant covers this host")
    cluster = SimCluster(3, mode=mode, workdir=tmp_path / "sim")
    with cluster:
        assert cluster.hostfile.read_text().split() == cluster.addresses
        seen = []
        for address in cluster.addresses:
            r = _ssh(cluster, address, "echo $GPUFLEET_SIMNODE; echo $SSH_CONNECTION")
            assert r.returncode == 0, r.stderr
            tag, connection = r.stdout.splitlines()
            assert tag == f"{cluster.id}-{cluster.addresses.index(address)}"
            seen.append(connection.split()[2])  # the server address this session landed on
        if mode == "netns":  # each session runs inside its own node's namespace
            r = _ssh(cluster, cluster.addresses[2], "ip -o -4 addr show eth0")
            assert cluster.addresses[2] in r.stdout and cluster.addresses[1] not in r.stdout
        assert seen == cluster.addresses and len(set(seen)) == 3
        # A background process started over SSH is found by processes(), and killed by stop().
        r = _ssh(cluster, cluster.addresses[1], "setsid sleep 300 >/dev/null 2>&1 < /dev/null &")
        assert r.returncode == 0, r.stderr
        assert cluster.processes(1) and not cluster.processes(0)
        running = leftovers(cluster.id)  # the checks below are not vacuous: they see a live cluster
        assert len(running["sshd"]) == 3 and running["tagged"]
        assert len(running["namespaces"]) == (3 if mode == "netns" else 0)
    assert leftovers(cluster.id) == {"namespaces": [], "links": [], "sshd": [], "tagged": []}


def test_a_changed_host_key_is_refused(tmp_path):
    """Host keys are really checked: a known_hosts entry with another key makes ssh refuse."""
    with SimCluster(1, workdir=tmp_path / "sim") as cluster:
        other = tmp_path / "other"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
        host = cluster.known_hosts.read_text().split()[0]
        key_type, key = (other.with_suffix(".pub")).read_text().split()[:2]
        cluster.known_hosts.write_text(f"{host} {key_type} {key}\n")
        r = _ssh(cluster, cluster.addresses[0], "true")
        assert r.returncode == 255
        assert "host key" in r.stderr.lower()


def test_teardown_runs_even_when_the_body_fails(tmp_path):
    cluster = SimCluster(2, workdir=tmp_path / "sim")
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            raise RuntimeError("boom")
    assert leftovers(cluster.id) == {"namespaces": [], "links": [], "sshd": [], "tagged": []}
    assert all(node.sshd.poll() is not None for node in cluster.nodes)


def test_a_killed_node_loses_its_sessions(sim_cluster):
    cluster = sim_cluster(2)
    r = _ssh(cluster, cluster.addresses[0], "setsid sleep 300 >/dev/null 2>&1 < /dev/null &")
    assert r.returncode == 0
    assert cluster.processes(0)
    cluster.kill_sessions(0)
    import time

    deadline = time.monotonic() + 5
    while cluster.processes(0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not cluster.processes(0)
    assert _ssh(cluster, cluster.addresses[0], "true").returncode == 0  # sshd itself still serves


@pytest.mark.parametrize("where", ["/tmp", HOME, "/var/tmp", "workdir inside the checkout"])
def test_a_bare_nodes_namespace_hides_a_checkout_wherever_it_lies(where, tmp_path):
    """The node setup's mounts, run in a mount namespace of their own (no network, no sshd), with
    a checkout under each directory the node gets its own of (/tmp, root's home), under one it
    does not (/var/tmp), and with the cluster's workdir inside the checkout: the setup succeeds,
    the checkout is hidden, and /tmp, the home and the sshd files are the node's."""
    require_netns("a bare node's mount namespace needs root")
    parent = tempfile.mkdtemp(prefix="gfs-clone-", dir="/tmp" if where.startswith("workdir") else where)
    try:
        checkout = Path(parent) / "gpufleet"
        (checkout / "tests").mkdir(parents=True)
        (checkout / "pyproject.toml").write_text("[project]\n")
        node = (checkout / "runs" / "sim" if where.startswith("workdir") else tmp_path) / "node0"
        (node / "sshd").mkdir(parents=True)
        for name, text in (("host_key", "node key\n"), ("hosts", "10.9.9.2 simnode0\n"), ("resolv.conf", "")):
            (node / "sshd" / name).write_text(text)
        hidden = hidden_paths(checkout)
        assert checkout in hidden or where == HOME  # under the home, the node's own home covers it
        script = bare_node_setup(node, hidden)
        (node / "tmp" / "on-the-node").write_text("node tmp\n")
        (node / "home" / "on-the-node").write_text("node home\n")
        probe = (
            f"ls -A {shlex.quote(str(checkout))} 2>/dev/null || true; echo ---; "
            f"cat /tmp/on-the-node ~/on-the-node {BARE_RUN}/host_key; grep simnode0 /etc/hosts; ls -A {BARE_DISK}"
        )
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script + probe]
        r = subprocess.run(argv, capture_output=True, text=True, env={"HOME": HOME, "PATH": os.environ["PATH"]})
        assert r.returncode == 0, r.stderr
        assert (checkout / "pyproject.toml").exists()  # here the checkout is whole; there, empty or absent,
        # /tmp, the home and the sshd files the node's own, and the staging mount gone
        assert r.stdout.splitlines() == ["---", "node tmp", "node home", "node key", "10.9.9.2 simnode0"], r.stdout
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@BARE_GROUP
def test_a_bare_node_sees_nothing_of_this_machine_but_the_system_python(bare_nodes, tmp_path):
    """No checkout, no venv, no pip configuration or local wheel store, a /tmp and a home of its
    own (not this machine's); the system python3 with venv; PIP_* unset (sshd's own environment).
    The node is one of the session's shared bare cluster: what this test puts there it removes."""
    bare = bare_nodes
    repo = Path(__file__).resolve().parents[2]
    here = [Path(tempfile.mkdtemp(prefix="gfs-here-", dir=d)) for d in ("/tmp", HOME)]  # this machine's
    mine = f"gfs-node-{tmp_path.name}"
    try:
        for d in ("/tmp", HOME):
            bare.node_path(1, f"{d}/{mine}").write_text("the node's own\n")
        probe = (
            "".join(f"test -e {p} && echo seen {p}; " for p in here)
            + f"cat /tmp/{mine} ~/{mine}; "
            # What lies there (an empty mount, or nothing where the checkout is under /tmp or ~).
            + "".join(
                f"echo {q} holds $(ls -A {q} 2>/dev/null | wc -l); "
                for q in map(shlex.quote, (str(repo), "/opt/wheels", "/etc/xdg/pip"))
            )
            + "cat /etc/pip.conf; env | grep ^PIP_; "
            "python3 -c 'import sys; print(sys.executable, sys.version_info >= (3, 10))'; "
            "python3 -c 'import torch' 2>&1 | tail -n 1; "
            f"python3 -m venv /tmp/{mine}-v && /tmp/{mine}-v/bin/python -c 'print(\"venv ok\")'"
        )
        r = _ssh(bare, bare.addresses[1], probe)
        lines = r.stdout.splitlines()
        assert (repo / "pyproject.toml").exists() and os.listdir("/opt/wheels")  # here they exist...
        assert lines[:2] == ["the node's own"] * 2, r.stdout  # ...there, its own /tmp and home
        assert lines[2:5] == [f"{d} holds 0" for d in (repo, "/opt/wheels", "/etc/xdg/pip")], r.stdout
        assert not any(line.startswith("PIP_") or line.startswith("[global]") for line in lines), r.stdout
        assert "/usr/bin/python3 True" in lines
        assert "ModuleNotFoundError: No module named 'torch'" in lines
        assert lines[-1] == "venv ok", r.stdout + r.stderr
        assert Path("/etc/xdg/pip") in hidden_paths() and repo in hidden_paths()
        # The node's disk is its own: what it wrote is under node_path, not this machine's /tmp.
        assert bare.node_path(1, f"/tmp/{mine}-v/bin/python").exists()
        assert not Path(f"/tmp/{mine}-v/bin/python").exists()
    finally:
        for p in here:
            shutil.rmtree(p)
        for d in ("/tmp", HOME):
            bare.node_path(1, f"{d}/{mine}").unlink(missing_ok=True)
        shutil.rmtree(bare.node_path(1, f"/tmp/{mine}-v"), ignore_errors=True)


@BARE_GROUP
def test_a_bare_node_installs_from_the_cluster_index_and_only_from_it(bare_nodes, tmp_path):
    """The index on the bridge answers every node; pip in a fresh venv installs from it."""
    bare = bare_nodes
    venv_dir = f"/tmp/gfs-pipv-{tmp_path.name}"  # the node is shared: a venv of this test's own
    # Plain HTTP on the cluster's own network: pip wants the host named trusted.
    pip = f"{venv_dir}/bin/pip install -q --no-cache-dir"
    venv = f"rm -rf {venv_dir} && python3 -m venv {venv_dir} && {pip} --trusted-host {bare.index_address}"
    r = _ssh(bare, bare.addresses[0], f"{venv} --index-url {bare.package_index} six==1.17.0 && echo installed")
    assert r.stdout.strip().endswith("installed"), r.stderr
    # Without the index there is nothing to install from: no config points at this machine's wheels.
    r = _ssh(
        bare,
        bare.addresses[0],
        f"{venv} --retries 0 --timeout 2 --index-url http://{bare.unused_address()}:1/simple tomli",
    )
    assert r.returncode != 0
    shutil.rmtree(bare.node_path(0, venv_dir), ignore_errors=True)


def test_own_pids_gives_each_bare_node_a_process_table_of_its_own(tmp_path):
    """With own_pids a node's sessions see their own node's processes only (sshd is its pid 1),
    as on a real VM, while this machine still finds and kills them all."""
    require_netns("bare nodes need root and ip netns")
    with SimCluster(2, workdir=tmp_path / "sim", bare=True, own_pids=True) as c:
        busy = _ssh(c, c.addresses[1], "sleep 300 </dev/null >/dev/null 2>&1 & echo started")
        assert busy.returncode == 0 and busy.stdout.strip() == "started", busy.stderr
        r = _ssh(c, c.addresses[0], "cat /proc/1/comm; for p in /proc/[0-9]*; do cat $p/comm; done")
        assert r.returncode == 0, r.stderr
        first, *names = r.stdout.split()
        assert first == "sshd" and "sleep" not in names, r.stdout  # node 1's sleep is not in node 0's table
        assert len(c.processes(1)) == 1 and len(c.processes(0)) == 0
    assert not leftovers(c.id)["tagged"]
