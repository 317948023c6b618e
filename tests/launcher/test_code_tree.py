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

from launcher.cluster.discovery import cluster_from_outputs, parse_hostfile
from launcher.code import node_agent
from launcher.code.tree import (
    AGENT_SHA,
    authorize_relay,
    depth,
    forwarding_tree,
    hops,
    peers_arg,
    relay_known_hosts,
    relay_plan,
    source_addresses,
)
from launcher.core.types import Cluster, Node, UserError


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
    hosts = {r: ("me", f"n{r}") for r in range(4)}
    (hop1,) = relay_plan(tree, 0, missing, hosts, 2222)
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
    assert node_agent.relay_argv({**child, "host": "::ffff:10.0.0.3"}, "/k", "/kh")[-2] == "::ffff:10.0.0.3"
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
    statement = authorize_relay(public, CLUSTER, hops(CLUSTER, "me"), 22)
    for _ in range(2):
        subprocess.run(["bash", "-c", statement], env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True)
    lines = keys.read_text().splitlines()
    assert lines[0] == "ssh-ed25519 AAAAmine me@laptop" and len(lines) == 2
    # The agent through its bootstrap (launcher.code.tree.relay_command), which checks its copy first.
    assert lines[1].startswith('from="10.0.0.2,10.0.0.3",restrict,command="exec python3 -I -S -c \\"import base64;')
    assert f"{AGENT_SHA} relay 22 me@10.0.0.2,me@10.0.0.3\"" in lines[1] and public.split()[1] in lines[1]
    # sshd's own parser (ssh-keygen reads authorized_keys lines, options and all) accepts it.
    assert subprocess.run(["ssh-keygen", "-l", "-f", str(keys)], capture_output=True).returncode == 0
    stale = lines[1].replace(AGENT_SHA, "0" * 64)
    keys.write_text(f"{lines[0]}\n{stale}\n")
    subprocess.run(["bash", "-c", statement], env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, check=True)
    assert keys.read_text().splitlines() == lines  # the other version's entry replaced, mine kept
    assert oct(keys.stat().st_mode & 0o777) == "0o644"  # edited in place: the file's own mode kept


def test_hops_go_to_internal_addresses_with_each_hostfile_lines_own_user():
    hostfile = parse_hostfile("10.0.0.2\nops@10.0.0.3\n[fd00::3]\n")
    targets = hops(hostfile, "me")
    assert targets == {0: ("me", "10.0.0.2"), 1: ("ops", "10.0.0.3"), 2: ("me", "fd00::3")}
    assert peers_arg(targets) == "me@10.0.0.2,me@fd00::3,ops@10.0.0.3"
    with pytest.raises(UserError, match=r"'a\"b@10.0.0.2' is not a user and an address"):
        peers_arg({0: ('a"b', "10.0.0.2")})  # an ssh config's User that would break the forced command
    (one, two) = relay_plan({0: [1, 2], 1: [], 2: []}, 0, {1: [], 2: []}, targets, 22)
    assert (one["host"], one["user"], two["host"], two["user"]) == ("10.0.0.3", "ops", "fd00::3", "me")
    # --external-ip: this machine connects to the external address, the nodes to each other by the internal one.
    outputs = {
        "cluster": "c",
        "project": "p",
        "zone": "z",
        "machineType": "a3-highgpu-8g",
        "nodes": [
            {"name": f"n{i}", "index": i, "internalIp": f"10.0.0.{i + 2}", "externalIp": f"34.1.1.{i}", "zone": "z"}
            for i in range(2)
        ],
    }
    stack = cluster_from_outputs(outputs, prefer_external=True)
    assert stack.nodes[1].host == "34.1.1.1" and hops(stack, None) == {0: (None, "10.0.0.2"), 1: (None, "10.0.0.3")}
    known = relay_known_hosts(stack, {0: ["ssh-ed25519 AAAA0"], 1: ["ssh-ed25519 AAAA1"]}, 2222)
    assert known.splitlines() == ["[10.0.0.2]:2222 ssh-ed25519 AAAA0", "[10.0.0.3]:2222 ssh-ed25519 AAAA1"]
    with pytest.raises(UserError, match=r"node 1 \(34.1.1.1\).*not in this machine's known_hosts"):
        relay_known_hosts(stack, {0: ["ssh-ed25519 AAAA0"]}, 22)


def test_from_lists_addresses_never_host_names():
    named = Cluster(name="h", nodes=(Node(rank=0, host="localhost", address="localhost"),))
    addresses = source_addresses(named)
    assert "127.0.0.1" in addresses and "localhost" not in addresses
    with pytest.raises(UserError, match=r"'no-such-node\.invalid' does not resolve"):
        source_addresses(Cluster(name="h", nodes=(Node(rank=0, host="x", address="no-such-node.invalid"),)))


def _fake_ssh(tmp_path: Path) -> tuple[Path, Path]:
    """A PATH holding an `ssh` that only records it was run: the relay must not get that far."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "ssh-ran"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f"#!/bin/sh\necho \"$@\" > {marker}\nexit 255\n")
    (bin_dir / "ssh").chmod(0o755)
    return bin_dir, marker


def _relay(home: Path, stdin: bytes, *args: str, path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", Path(node_agent.__file__).read_text(), "relay", *args],
        input=stdin,
        capture_output=True,
        env={"HOME": str(home), "PATH": path},
    )


def _fwd(plan: list) -> bytes:
    key, known = b"PRIVATE", b"10.0.0.3 ssh-ed25519 AAAA\n"
    text = json.dumps(plan).encode()
    return (
        f"KEY {len(key)}\n".encode()
        + key
        + f"KNOWN {len(known)}\n".encode()
        + known
        + f"FWD {len(text)}\n".encode()
        + text
    )


@pytest.mark.parametrize(
    "child",
    [
        {"rank": 1, "host": "192.0.2.1", "user": "me", "port": 22},  # outside the cluster
        {"rank": 1, "host": "10.0.0.3", "user": "root", "port": 22},  # another account
        {"rank": 1, "host": "10.0.0.3", "user": "me", "port": 5432},  # another port
    ],
)
def test_a_fwd_outside_the_forced_commands_peers_is_refused_without_opening_ssh(tmp_path, child):
    bin_dir, marker = _fake_ssh(tmp_path)
    plan = [{**child, "objects": [], "children": []}]
    r = _relay(tmp_path, _fwd(plan) + b"END\n", "22", "me@10.0.0.2,me@10.0.0.3", path=f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode != 0 and b"refused" in r.stderr or b"is not the cluster's" in r.stderr, r.stderr
    assert not marker.exists()
    # A peer nested below a legitimate child is checked too, before anything is opened.
    nested = [{"rank": 1, "host": "10.0.0.3", "user": "me", "port": 22, "objects": [], "children": plan}]
    r = _relay(tmp_path, _fwd(nested) + b"END\n", "22", "me@10.0.0.2,me@10.0.0.3", path=f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode != 0 and not marker.exists(), r.stderr
    # The forced command of an older entry names no peers: no FWD at all.
    r = _relay(tmp_path, _fwd(nested) + b"END\n", path=f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode != 0 and b"not one of the cluster's nodes" in r.stderr and not marker.exists()


def test_a_fwd_to_a_peer_opens_ssh_to_its_internal_address():
    child = {"rank": 1, "host": "10.0.0.3", "user": "me", "port": 22, "objects": [], "children": []}
    node_agent.check_plan([child], {"me@10.0.0.2", "me@10.0.0.3"}, 22)
    argv = node_agent.relay_argv(child, "/k", "/kh")
    assert argv[-4:] == ["-T", "--", "10.0.0.3", "relay"] and argv[argv.index("-l") + 1] == "me"
    # No sntrup761x25519 on a hop (its client side costs ~6x curve25519's CPU), and the option is
    # one this machine's ssh takes: `ssh -G` reads the options as a connection would, opening none.
    assert "KexAlgorithms=-sntrup*" in argv
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o" and argv[i + 1].startswith("KexAlgorithms")]
    got = subprocess.run(["ssh", "-G", *(f"-o{o}" for o in opts), "10.0.0.3"], capture_output=True, text=True)
    (kex,) = [ln.split()[1] for ln in got.stdout.splitlines() if ln.startswith("kexalgorithms ")]
    assert "sntrup" not in kex and "curve25519-sha256" in kex.split(","), got.stderr


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        (b"OBJ " + b"a" * 300 + b"\n", b"over 256 bytes"),
        (b"OBJ " + b"a" * 64 + b" -3\n", b"size '-3' is not allowed"),
        (b"KEY 99999999999\n", b"size '99999999999' is not allowed"),
        (b"FWD 2\n[]FWD 2\n[]END\n", b"frame FWD out of place"),
        (b"FWD 2\n[]KEY 1\nkEND\n", b"frame KEY out of place"),
        (b"KEY 1\nkKEY 1\nkEND\n", b"frame KEY out of place"),
        (b"OBJ " + b"a" * 64 + b" 3\nab", b"ended early"),
        (b"", b"ended before its END frame"),
    ],
)
def test_frames_are_bounded_and_a_stream_cut_short_leaves_no_partial_object(tmp_path, frames, why):
    r = _relay(tmp_path, frames, "22", "me@10.0.0.2")
    assert r.returncode != 0 and why in r.stderr, r.stderr
    objects = tmp_path / ".gpufleet" / "objects"
    assert not objects.exists() or list(objects.iterdir()) == []


def test_two_machines_relay_keys_on_one_account_keep_each_others_entries_and_a_symlink_stays_one(tmp_path):
    publics = []
    for name in ("laptop", "desktop"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
        publics.append((tmp_path / f"{name}.pub").read_text())
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    real = tmp_path / "dotfiles" / "authorized_keys"
    real.parent.mkdir()
    real.write_text("ssh-ed25519 AAAAmine me@laptop\n")
    real.chmod(0o600)
    (home / ".ssh" / "authorized_keys").symlink_to(real)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    statements = [authorize_relay(pub, CLUSTER, hops(CLUSTER, "me"), 22) for pub in publics]
    # Both machines at once, several times over: every writer holds the lock, none loses an entry.
    procs = [subprocess.Popen(["bash", "-c", s], env=env) for s in statements * 4]
    assert [p.wait() for p in procs] == [0] * 8
    assert (home / ".ssh" / "authorized_keys").is_symlink()
    lines = real.read_text().splitlines()
    assert lines[0] == "ssh-ed25519 AAAAmine me@laptop" and len(lines) == 3
    assert all(any(pub.split()[1] in line for line in lines) for pub in publics)
    assert sorted(p.name for p in real.parent.iterdir()) == ["authorized_keys"]  # no temporary file left
    # A new agent version replaces this machine's own entry only.
    other = authorize_relay(publics[0], CLUSTER, hops(CLUSTER, "ops"), 22)
    subprocess.run(["bash", "-c", other], env=env, check=True)
    after = real.read_text().splitlines()
    assert len(after) == 3 and lines[2] in after or lines[1] in after
    assert sum("relay 22 ops@10.0.0.2" in line for line in after) == 1


def test_a_failed_read_of_authorized_keys_leaves_it_as_it_is_and_the_statement_fails(tmp_path):
    """grep's status is checked: a read error (status 2, here a grep that fails as a disk error
    would make it) must not truncate authorized_keys to the relay entry alone."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    keys = home / ".ssh" / "authorized_keys"
    keys.write_text("ssh-ed25519 AAAAmine me@laptop\n")
    failing = tmp_path / "bin"
    failing.mkdir()
    (failing / "grep").write_text(
        '#!/bin/sh\ncase "$1" in -vF) echo "grep: read error" >&2; exit 2;; esac\nexec /usr/bin/grep "$@"\n'
    )
    (failing / "grep").chmod(0o755)
    statement = authorize_relay((tmp_path / "k.pub").read_text(), CLUSTER, hops(CLUSTER, "me"), 22)
    r = subprocess.run(["bash", "-c", statement], env={"HOME": str(home), "PATH": f"{failing}:/usr/bin:/bin"})
    assert r.returncode != 0
    assert keys.read_text() == "ssh-ed25519 AAAAmine me@laptop\n"
    assert sorted(p.name for p in keys.parent.iterdir()) == ["authorized_keys"]


def _send_to_node(home: Path, root: Path, snap, monkeypatch) -> tuple[dict | None, str]:
    """The launching machine's relay stream for `snap`, into a node agent here (HOME=`home`)."""
    from launcher.code.prepare import PrepareReport, _frames, agent_script, run_agent
    from launcher.core.transport import Transport

    monkeypatch.setenv("HOME", str(home))
    files = {f.sha256: (root / f.path, f.size) for f in snap.files}
    node = Node(rank=0, host="n0", address="10.0.0.2")
    stream = _frames(sorted(files), files, {}, [])
    return run_agent(
        Transport(local=True), node, agent_script("relay 22 me@10.0.0.2"), stream, lambda n, t: None, PrepareReport()
    )


def test_a_log_growing_during_the_send_goes_as_its_snapshot_and_is_never_read_as_frames(tmp_path, monkeypatch):
    from launcher.code.snapshot import take_snapshot

    root = tmp_path / "proj"
    root.mkdir()
    (root / "train.log").write_text("step 0\n")
    snap = take_snapshot(root)
    with open(root / "train.log", "a") as f:  # the job of an earlier launch still writing it
        f.write(f"step 1\nFWD 2\n[]OBJ {'a' * 64} 1\nx")
    result, why = _send_to_node(tmp_path / "home", root, snap, monkeypatch)
    assert result is not None and result["objects"] == 1, why
    (entry,) = snap.files
    assert (tmp_path / "home" / ".gpufleet" / "objects" / entry.sha256).read_bytes() == b"step 0\n"


@pytest.mark.parametrize("change", ["rewritten", "shorter", "gone"])
def test_a_file_changed_after_the_snapshot_fails_the_launch_naming_it_and_leaves_no_partial_object(
    tmp_path, monkeypatch, change
):
    from launcher.code.prepare import ChangedFile
    from launcher.code.snapshot import take_snapshot

    root = tmp_path / "proj"
    root.mkdir()
    (root / "a.txt").write_text("fine\n")
    (root / "data.bin").write_bytes(b"x" * (3 << 20))
    snap = take_snapshot(root)
    if change == "rewritten":
        (root / "data.bin").write_bytes(b"y" * (3 << 20))
    elif change == "shorter":
        (root / "data.bin").write_bytes(b"x" * 10)
    else:
        (root / "data.bin").unlink()
    with pytest.raises(ChangedFile, match=rf"{root / 'data.bin'} changed after the snapshot was taken"):
        _send_to_node(tmp_path / "home", root, snap, monkeypatch)
    objects = tmp_path / "home" / ".gpufleet" / "objects"
    assert not any(p.name.startswith(".tmp-") for p in objects.iterdir())
    assert not (objects / next(f.sha256 for f in snap.files if f.path == "data.bin")).exists()


def test_a_transfer_cut_mid_object_leaves_no_partial_file(tmp_path):
    """Ctrl-C on the launching machine: sshd hangs up on the node's relay (SIGHUP) while an
    object is half written; the relay removes it on its way out."""
    import signal
    import time

    objects = tmp_path / ".gpufleet" / "objects"
    p = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", Path(node_agent.__file__).read_text(), "relay", "22", "me@10.0.0.2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    p.stdin.write(f"OBJ {'d' * 64} {4 << 20}\n".encode() + b"x" * (1 << 20))
    p.stdin.flush()
    for _ in range(600):  # until the relay has begun the object (a liveness bound, not a speed check)
        if objects.is_dir() and any(f.name.startswith(".tmp-") for f in objects.iterdir()):
            break
        time.sleep(0.1)
    assert any(f.name.startswith(".tmp-") for f in objects.iterdir())
    p.send_signal(signal.SIGHUP)
    p.communicate()
    assert p.returncode != 0 and list(objects.iterdir()) == []
