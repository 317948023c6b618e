"""How content travels among the nodes (launcher.code.tree, node_agent.relay), without a network:
who passes on to whom, that an edge carries only what its child lacks, what the relay key may
do on a node (store objects, never run a command or write a file of its choosing), and its
authorized_keys entry."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.code import node_agent
from launcher.code.tree import AGENT_SHA, authorize_relay, depth, forwarding_tree, relay_plan
from launcher.core.types import Cluster, Node


def test_sixteen_nodes_at_fanout_four_are_two_levels_and_node_0_sends_four_copies():
    tree = forwarding_tree(0, range(1, 16), 4)
    assert tree[0] == [1, 2, 3, 4]
    assert tree[1] == [5, 6, 7, 8] and tree[2] == [9, 10, 11, 12] and tree[3] == [13, 14, 15]
    assert tree[4] == [] and all(tree[r] == [] for r in range(5, 16))
    assert depth(tree, 0) == 2
    assert sorted(r for kids in tree.values() for r in kids) == list(range(1, 16))  # each node once


def test_fanout_n_minus_1_is_the_star_and_fanout_1_the_chain():
    star = forwarding_tree(0, range(1, 16), 15)
    assert star[0] == list(range(1, 16)) and depth(star, 0) == 1
    chain = forwarding_tree(0, [1, 2, 3], 1)
    assert chain == {0: [1], 1: [2], 2: [3], 3: []} and depth(chain, 0) == 3


def test_64_nodes_at_fanout_4_are_three_levels():
    assert depth(forwarding_tree(0, range(1, 64), 4), 0) == 3


def test_only_nodes_that_lack_content_are_in_the_tree():
    tree = forwarding_tree(0, [3, 7, 9], 2)
    assert tree == {0: [3, 7], 3: [9], 7: [], 9: []}


def test_a_fanout_below_one_is_refused():
    with pytest.raises(ValueError, match="fan-out 0"):
        forwarding_tree(0, [1], 0)


def test_each_edge_carries_exactly_what_its_child_lacks():
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    missing = {1: [b, a], 2: [c], 3: [a, b, c]}
    tree = forwarding_tree(0, missing, 1)  # a chain 0 -> 1 -> 2 -> 3
    hosts = {0: "n0", 1: "n1", 2: "n2", 3: "n3"}
    (hop1,) = relay_plan(tree, 0, missing, hosts, "me", 2222)
    assert (hop1["rank"], hop1["host"], hop1["user"], hop1["port"], hop1["objects"]) == (1, "n1", "me", 2222, [a, b])
    (hop2,) = hop1["children"]
    # Node 2 lacks only c: node 1 sends it c (node 1 has a and b, which node 3 lacks, from its
    # own store); node 2 passes all three on to node 3.
    assert hop2["objects"] == [c] and hop2["children"][0]["objects"] == [a, b, c]
    assert hop2["children"][0]["children"] == []


def _agent(command: str, home: Path, stdin: bytes) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-S", "-I", "-c", Path(node_agent.__file__).read_text(), command],
        input=stdin,
        capture_output=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
    )


def _received(r: subprocess.CompletedProcess) -> dict:
    (line,) = [line for line in r.stdout.decode().splitlines() if " received " in line]
    return json.loads(line.split(" received ", 1)[1])


def test_the_agent_stores_its_own_source_under_the_hash_the_relay_key_runs(tmp_path):
    r = _agent("prepare", tmp_path, b"{}")
    result = json.loads(r.stdout.decode().split(" ", 2)[2])
    assert result["agent"] == AGENT_SHA, r.stderr
    stored = tmp_path / ".gpufleet" / "objects" / AGENT_SHA
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == AGENT_SHA
    assert stored.read_bytes() == Path(node_agent.__file__).read_bytes()


def test_without_sys_orig_argv_the_agent_finds_its_source_in_proc(tmp_path):
    """Python before 3.10 has no sys.orig_argv: /proc/self/cmdline has the same `-c` text."""
    source = Path(node_agent.__file__).read_text()
    r = subprocess.run(
        [sys.executable, "-S", "-I", "-c", source.replace("getattr(sys, \"orig_argv\", [])", "[]"), "prepare"],
        input=b"{}",
        capture_output=True,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    result = json.loads(r.stdout.decode().split(" ", 2)[2])
    changed = hashlib.sha256(source.replace("getattr(sys, \"orig_argv\", [])", "[]").encode()).hexdigest()
    assert result["agent"] == changed != AGENT_SHA, r.stderr
    assert (tmp_path / ".gpufleet" / "objects" / changed).exists()


def test_a_relay_stores_objects_checked_against_their_hash(tmp_path):
    body = os.urandom(3 << 20)  # three chunks
    sha = hashlib.sha256(body).hexdigest()
    r = _agent("relay", tmp_path, f"OBJ {sha} {len(body)}\n".encode() + body + b"END\n")
    assert r.returncode == 0 and _received(r) == {"objects": 1, "failed": {}, "at": _received(r)["at"]}
    assert (tmp_path / ".gpufleet" / "objects" / sha).read_bytes() == body
    bad = _agent("relay", tmp_path, f"OBJ {'0' * 64} 3\nabcEND\n".encode())
    assert bad.returncode != 0 and b"arrived corrupted" in bad.stderr
    assert not (tmp_path / ".gpufleet" / "objects" / ("0" * 64)).exists()


def test_the_relay_key_can_write_no_file_of_its_choosing(tmp_path):
    """`relay` is the relay key's forced command: a frame that would write a path (the old FILE
    frame) or an object under a name that is not a hash is refused, and nothing is written."""
    for frame in (b"FILE .ssh/authorized_keys 600 4\nevilEND\n", b"OBJ ../../.bashrc 4\nevilEND\n"):
        r = _agent("relay", tmp_path, frame)
        assert r.returncode != 0 and b"unknown frame" in r.stderr, r.stderr
    assert not (tmp_path / ".ssh").exists() and not (tmp_path / ".bashrc").exists()
    key = b"PRIVATE"
    stale = tmp_path / ".gpufleet" / "relay" / "999999999"  # a relay killed (no such process now)
    stale.mkdir(parents=True)
    (stale / "id_ed25519").write_bytes(key)
    r = _agent("relay", tmp_path, f"KEY {len(key)}\n".encode() + key + b"END\n")
    assert r.returncode == 0, r.stderr
    # The key is gone when the relay ends, and a killed relay's key with it.
    assert list((tmp_path / ".gpufleet" / "relay").iterdir()) == []


def test_a_child_that_looks_like_an_ssh_option_is_refused():
    child = {"rank": 1, "host": "-oProxyCommand=touch /tmp/x", "objects": [], "children": []}
    with pytest.raises(ValueError, match="is not a host or user name"):
        node_agent.relay_argv(child, "/k", "/kh")
    with pytest.raises(ValueError, match="is not a host or user name"):
        node_agent.relay_argv({**child, "host": "10.0.0.3", "user": "-lroot"}, "/k", "/kh")
    argv = node_agent.relay_argv({**child, "host": "10.0.0.3", "user": "me", "port": 2222}, "/k", "/kh")
    assert argv[-3:] == ["--", "10.0.0.3", "relay"]
    assert "StrictHostKeyChecking=yes" in argv and "UserKnownHostsFile=/kh" in argv and "-i" in argv


def test_a_failed_child_names_its_whole_subtree_as_not_reached(tmp_path, monkeypatch):
    monkeypatch.setattr(node_agent, "OBJECTS", str(tmp_path))
    leaf = {"rank": 3, "host": "h3", "objects": [], "children": []}
    child = {"rank": 1, "host": "h1", "objects": [], "children": [leaf]}
    fwd = node_agent.Forward(child, None, None)  # no relay key arrived: it cannot connect
    failed = fwd.close()
    assert failed[1] == "no relay key arrived"
    assert failed[3].startswith("not reached: node 1")


CLUSTER = Cluster(
    name="hosts", nodes=(Node(rank=0, host="n0", address="10.0.0.2"), Node(rank=1, host="n1", address="10.0.0.3"))
)


def test_the_relay_key_is_authorized_once_restricted_and_replaced_when_the_agent_changes(tmp_path):
    pub = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], capture_output=True, check=True
    )
    assert pub.returncode == 0
    public = (tmp_path / "k.pub").read_text()
    home = tmp_path / "home"
    home.mkdir()
    keys = home / ".ssh" / "authorized_keys"
    keys.parent.mkdir()
    keys.write_text("ssh-ed25519 AAAAmine me@laptop\n")
    statement = authorize_relay(public, CLUSTER)
    for _ in range(2):
        subprocess.run(["bash", "-c", statement], env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True)
    lines = keys.read_text().splitlines()
    assert lines[0] == "ssh-ed25519 AAAAmine me@laptop" and len(lines) == 2
    assert lines[1].startswith('from="10.0.0.2,10.0.0.3",restrict,command="exec python3 -S .gpufleet/objects/')
    assert f"objects/{AGENT_SHA} relay" in lines[1] and public.split()[1] in lines[1]
    # sshd's own parser (ssh-keygen reads authorized_keys lines, options and all) accepts it.
    assert subprocess.run(["ssh-keygen", "-l", "-f", str(keys)], capture_output=True).returncode == 0
    stale = lines[1].replace(AGENT_SHA, "0" * 64)
    keys.write_text(f"{lines[0]}\n{stale}\n")
    subprocess.run(["bash", "-c", statement], env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True)
    assert keys.read_text().splitlines() == lines  # the other version's entry replaced, mine kept
    assert oct(keys.stat().st_mode & 0o777) == "0o600"
