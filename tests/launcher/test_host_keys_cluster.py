"""Host keys from the stack, on real sshd nodes: a cluster whose nodes are instances (stack outputs
with a project and zone) gets its known_hosts from the keys each VM publishes in its guest
attributes (the documented fake Compute Engine API serves them), before the first connection, and
ssh checks them strictly: a node offering another key is refused, a re-created VM's new published
key replaces the old one with one line saying so. A hostfile cluster trusts on first use, says
so once, and is named by its absolute path."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.launcher.fake_compute import FakeCompute, FakeInstance
from tests.simcluster import SimCluster
from tests.support import LAUNCH

pytestmark = pytest.mark.cluster

P, Z = "proj-1", "us-central1-a"


def _ssh_flags(c: SimCluster) -> list[str]:
    """How to log in, without the simulated cluster's own known_hosts and strict checking; no
    shared connection, so every launch meets each node's key afresh."""
    flags = ["--ssh-key", str(c.client_key)]
    for opt in (
        "IdentitiesOnly=yes",
        "User=root",
        "GlobalKnownHostsFile=/dev/null",
        "BatchMode=yes",
        "ControlMaster=no",
    ):
        flags += ["--ssh-option", opt]
    if c.mode == "loopback":
        flags += ["--ssh-option", f"Port={c.nodes[0].port}"]
    return flags


def _published(c: SimCluster, i: int) -> dict[str, str]:
    kind, b64 = c.nodes[i].host_key_pub.split()[:2]
    return {kind: b64}


def _entry(c: SimCluster, i: int) -> str:
    n = c.nodes[i]
    return n.address if n.port == 22 else f"[{n.address}]:{n.port}"


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, "exec", *args, "--", "hostname"], capture_output=True, text=True, timeout=120)


def test_a_stack_cluster_trusts_only_the_published_keys_and_replaces_a_recreated_vms_key(sim_cluster, tmp_path):
    c = sim_cluster(2)
    instances = [FakeInstance(f"simnode{i}", c.nodes[i].address, host_keys=_published(c, i)) for i in range(2)]
    outputs = tmp_path / "outputs.json"
    nodes = [
        {"name": f"simnode{i}", "index": i, "internalIp": c.nodes[i].address, "externalIp": None} for i in range(2)
    ]
    outputs.write_text(json.dumps({"cluster": "sim", "project": P, "zone": Z, "machineType": None, "nodes": nodes}))
    known = tmp_path / "known_hosts"
    with FakeCompute({(P, Z): instances}) as api:
        args = ["--outputs", str(outputs), "--api-endpoint", api.endpoint, "--known-hosts", str(known)]
        args += [*_ssh_flags(c), "--runs-dir", str(tmp_path / "runs")]

        first = _launch(args)
        assert first.returncode == 0, first.stderr
        # Read before the first connection, and nothing else said: no trust on first use here.
        assert sorted(q["instance"] for q in api.requests if q.get("method") == "getGuestAttributes") == [
            "simnode0",
            "simnode1",
        ]
        assert "first use" not in first.stderr and "new host key" not in first.stderr, first.stderr
        lines = sorted(known.read_text().splitlines())
        assert lines == sorted(f"{_entry(c, i)} {k} {v}" for i in range(2) for k, v in _published(c, i).items())

        # Someone else answers at node 1's address (a new key nobody published): refused.
        c.new_host_key(1)
        in_between = _launch(args)
        assert in_between.returncode != 0, in_between.stderr
        assert "node 1 (" in in_between.stderr and "Host key verification failed" in in_between.stderr
        assert sorted(known.read_text().splitlines()) == lines

        # The VM was re-created: its guest attributes publish the new key, which replaces the old.
        old = instances[1].host_keys
        instances[1].host_keys = _published(c, 1)
        again = _launch(args)
        assert again.returncode == 0, again.stderr
        said = [line for line in again.stderr.splitlines() if "new host key" in line]
        assert said == [
            f"node 1 ({c.nodes[1].address}): instance simnode1 has a new host key (the VM was re-created); "
            f"replaced it in {known} with the keys its guest attributes publish"
        ], again.stderr
        text = known.read_text()
        assert next(iter(instances[1].host_keys.values())) in text and next(iter(old.values())) not in text

        # Unchanged since: nothing said.
        quiet = _launch(args)
        assert quiet.returncode == 0 and "new host key" not in quiet.stderr, quiet.stderr
    c.assert_nothing_left()


def test_two_hostfiles_called_hosts_are_two_clusters_each_trusting_on_first_use_said_once(sim_cluster, tmp_path):
    c = sim_cluster(1)
    files = []
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        files.append(tmp_path / d / "hosts")
        files[-1].write_text(c.hostfile.read_text())
    args = [*_ssh_flags(c), "--runs-dir", str(tmp_path / "runs")]
    said = []
    for hosts in (files[0], files[0], files[1]):
        p = _launch(["--hostfile", str(hosts), *args])
        assert p.returncode == 0, p.stderr
        said.append([line for line in p.stderr.splitlines() if "trusted on first use" in line])
    a, again, b = said
    assert len(a) == 1 and a[0].startswith(f"{files[0]}: host keys are trusted on first use"), a
    assert again == []
    assert len(b) == 1 and b[0].startswith(f"{files[1]}: "), b
    known = sorted(p.name for p in (tmp_path / "state" / "known_hosts").iterdir())
    assert len(known) == 2 and all(name.startswith("hosts-") for name in known), known
    c.assert_nothing_left()
