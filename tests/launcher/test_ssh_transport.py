"""How ssh reaches the nodes: --iap tunnels to each instance by name and zone (gcloud compute
start-iap-tunnel takes an instance name; an address only with --network and --region), shown in the
dry run, and a hostfile with --iap needs names; the control sockets live in $XDG_RUNTIME_DIR, else
in a directory under the temporary directory that must be this user's and private."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import main
from launcher.core.transport import control_dir, make_transport
from launcher.core.types import Cluster, Node, SshConfig, UserError
from tests.simcluster import SimCluster
from tests.support import LAUNCH

Z = "us-central1-a"


def _cluster(names: bool = True) -> Cluster:
    nodes = tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}", name=f"dev-{i}" if names else "") for i in range(2))
    return Cluster("dev", nodes, zone=Z, project="p")


def _transport(**ssh):
    """A dry run's transport (it makes nothing here)."""
    return make_transport(_cluster(), SshConfig(**ssh), dry_run=True)


# ---- --iap --------------------------------------------------------------------------------------


def test_iap_tunnels_to_each_node_by_instance_name_and_zone():
    t = _transport(iap=True, zone=Z)
    argv = t.argv(_cluster().nodes[1], "true")
    host = argv.index("10.0.0.3")
    assert argv[host - 2 : host] == [
        "-o",
        f"ProxyCommand=gcloud compute start-iap-tunnel dev-1 %p --listen-on-stdin --zone {Z}",
    ]
    assert not any("%h" in a for a in argv)
    # The user's own ProxyCommand, given first, wins (OpenSSH keeps the first value).
    mine = _transport(iap=True, zone=Z, options=("ProxyCommand=my-proxy %h",))
    argv = mine.argv(_cluster().nodes[0], "true")
    assert argv.index("ProxyCommand=my-proxy %h") < argv.index(
        "ProxyCommand=gcloud compute start-iap-tunnel dev-0 %p --listen-on-stdin --zone us-central1-a"
    )


def test_without_iap_there_is_no_tunnel():
    argv = _transport().argv(_cluster().nodes[0], "true")
    assert not any(a.startswith("ProxyCommand") for a in argv)


def test_the_dry_run_shows_each_nodes_tunnel(tmp_path):
    outputs = tmp_path / "o.json"
    nodes = [{"name": f"dev-{i}", "index": i, "internalIp": f"10.0.0.{i + 2}", "externalIp": None} for i in range(2)]
    outputs.write_text(json.dumps({"cluster": "dev", "project": "p", "zone": Z, "machineType": None, "nodes": nodes}))
    r = CliRunner().invoke(main, ["exec", "--outputs", str(outputs), "--iap", "--dry-run", "--", "hostname"])
    assert r.exit_code == 0, r.output
    for i in range(2):
        assert (
            f"node {i} (10.0.0.{i + 2}): through IAP: gcloud compute start-iap-tunnel dev-{i} 22 --listen-on-stdin "
            f"--zone {Z}" in r.stderr
        ), r.stderr


def test_a_hostfile_with_iap_needs_instance_names(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("dev-0\n10.0.0.3\n")
    r = CliRunner().invoke(main, ["exec", "--hostfile", str(hosts), "--iap", "--zone", Z, "--dry-run", "--", "true"])
    assert r.exit_code == 2, r.output
    assert r.output == (
        "error: node 1 (10.0.0.3): --iap tunnels to an instance by its name, and 10.0.0.3 is an address; write "
        "the instance names in the hostfile, or use --stack, --outputs or --label, which know them\n"
    )
    hosts.write_text("dev-0\nroot@dev-1\n")
    r = CliRunner().invoke(main, ["exec", "--hostfile", str(hosts), "--iap", "--zone", Z, "--dry-run", "--", "true"])
    assert r.exit_code == 0 and "start-iap-tunnel dev-1 22" in r.stderr, r.output


# What `gcloud compute start-iap-tunnel INSTANCE PORT --listen-on-stdin --zone ZONE` does, here: it
# records its arguments and carries stdin/stdout to the instance's sshd (found by name in a map,
# as IAP finds the instance by name in the zone).
FAKE_GCLOUD = textwrap.dedent(
    """\
    #!{python}
    import json, os, socket, sys, threading
    args = sys.argv[1:]
    with open({calls!r}, "a") as f:
        f.write(json.dumps(args) + "\\n")
    assert args[:2] == ["compute", "start-iap-tunnel"], args
    name, port = args[2], int(args[3])
    assert args[4:] == ["--listen-on-stdin", "--zone", {zone!r}], args
    address = json.load(open({names!r}))[name]
    s = socket.create_connection((address, port))
    def up():
        while data := os.read(0, 65536):
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    threading.Thread(target=up, daemon=True).start()
    while data := s.recv(65536):
        os.write(1, data)
    """
)


def test_a_launch_through_iap_reaches_every_node_by_its_instance_name(sim_cluster, tmp_path):
    c: SimCluster = sim_cluster(2)
    names = {f"simnode{i}": c.nodes[i].address for i in range(2)}
    (tmp_path / "names.json").write_text(json.dumps(names))
    calls = tmp_path / "calls.jsonl"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(
        FAKE_GCLOUD.format(python=sys.executable, calls=str(calls), zone=Z, names=str(tmp_path / "names.json"))
    )
    gcloud.chmod(0o755)
    outputs = tmp_path / "o.json"
    # The addresses are not where the tunnel goes: an IAP tunnel by address would miss.
    nodes = [
        {"name": n, "index": i, "internalIp": f"192.0.2.{10 + i}", "externalIp": None} for i, n in enumerate(names)
    ]
    outputs.write_text(json.dumps({"cluster": "sim", "project": "p", "zone": Z, "machineType": None, "nodes": nodes}))
    known = tmp_path / "known_iap"
    port = c.nodes[0].port  # the tunnel goes to ssh's port, %p: the simulated sshd's
    entry = [f"192.0.2.{10 + i}" if port == 22 else f"[192.0.2.{10 + i}]:{port}" for i in range(2)]
    known.write_text("".join(f"{entry[i]} {' '.join(c.nodes[i].host_key_pub.split()[:2])}\n" for i in range(2)))
    # The simulated cluster's flags, less its known_hosts (the nodes' keys are under the outputs'
    # addresses here).
    opts = []
    it = iter(c.launch_flags)
    for flag, value in zip(it, it):
        if value.startswith("UserKnownHostsFile="):
            continue
        opts += [flag, value]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    p = subprocess.run(
        [LAUNCH, "exec", "--outputs", str(outputs), "--iap", *opts, "--known-hosts", str(known)]
        + ["--runs-dir", str(tmp_path / "runs"), "--", "hostname"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    got = sorted(json.loads(line)[2] for line in calls.read_text().splitlines())
    assert got == ["simnode0", "simnode1"]
    c.assert_nothing_left()


# ---- the control socket directory ---------------------------------------------------------------


@pytest.fixture
def short_tmp(monkeypatch):
    """A temporary directory of its own (short: a socket path must fit 108 bytes), no runtime dir."""
    d = Path(tempfile.mkdtemp(prefix="gf", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _control_path(t) -> str:
    return next(a for a in t.ssh_base if a.startswith("ControlPath="))


def test_the_control_directory_is_made_private_under_the_temporary_directory(short_tmp):
    t = make_transport(_cluster(), SshConfig())
    base = short_tmp / f"gpufleet-ssh-{os.getuid()}"
    assert _control_path(t).startswith(f"ControlPath={base}/")
    assert oct(base.stat().st_mode & 0o777) == "0o700"


def test_the_runtime_directory_is_used_when_there_is_one(short_tmp, monkeypatch):
    runtime = short_tmp / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    t = make_transport(_cluster(), SshConfig())
    assert _control_path(t).startswith(f"ControlPath={runtime}/gpufleet-ssh/")
    assert not (short_tmp / f"gpufleet-ssh-{os.getuid()}").exists()


def test_an_own_directory_that_others_can_only_read_is_made_private(short_tmp):
    base = short_tmp / f"gpufleet-ssh-{os.getuid()}"
    base.mkdir()
    base.chmod(0o755)  # as older versions made it
    assert control_dir() == base
    assert oct(base.stat().st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("kind", ["other-owner", "world-writable", "symlink"])
def test_a_control_directory_someone_else_could_use_is_refused_in_one_line(short_tmp, tmp_path, kind):
    base = short_tmp / f"gpufleet-ssh-{os.getuid()}"
    if kind == "symlink":
        (short_tmp / "elsewhere").mkdir(mode=0o700)
        base.symlink_to(short_tmp / "elsewhere")
    else:
        base.mkdir(mode=0o700)
        if kind == "other-owner":
            os.chown(base, 65534, 65534)  # nobody's (the tests run as root, as the simulated nodes need)
        else:
            base.chmod(0o777)
    with pytest.raises(UserError, match=f"SSH control directory {base} "):
        control_dir()
    hosts = tmp_path / "hosts"
    hosts.write_text("192.0.2.10\n")
    r = CliRunner().invoke(main, ["exec", "--hostfile", str(hosts), "--runs-dir", str(tmp_path / "runs"), "--", "true"])
    assert r.exit_code == 2, r.output
    (line,) = r.output.splitlines()
    assert line.startswith(f"error: SSH control directory {base} ") and "XDG_RUNTIME_DIR" in line, line
    assert not (tmp_path / "runs").exists()
    # A dry run makes nothing and checks nothing: it connects nowhere.
    assert CliRunner().invoke(main, ["exec", "--hostfile", str(hosts), "--dry-run", "--", "true"]).exit_code == 0


def test_the_iap_error_files_of_ended_launches_are_removed_and_live_ones_kept(tmp_path):
    import subprocess as sp

    from launcher.core.transport import _sweep_tunnel_logs

    ended = sp.Popen(["true"])
    ended.wait()
    gone, mine = tmp_path / f"iap-llm-dev-1-{ended.pid}.err", tmp_path / f"iap-llm-dev-1-{os.getpid()}.err"
    alive = tmp_path / "iap-llm-dev-0-1.err"  # pid 1 is always there
    for f in (gone, mine, alive):
        f.write_text("ERROR: ...\n")
    _sweep_tunnel_logs(tmp_path)
    assert not gone.exists() and mine.exists() and alive.exists()
