"""A launch down the tree (launcher.code.launch_tree, node_agent `tree`), without a network: the
real agent, started as a node starts it (`python3 -I -S -c SOURCE`), in a home of the test's own.
What a node runs is only what the launching machine signed for it, under its own key: a part
changed on its way, replayed, expired, or another node's is refused in one line with nothing
run, and a control word that is not signed is not applied. The launcher side (TreeLaunch) and
the CLI's refusals of --fanout are here too; the tree over real sshd nodes is in
tests/launcher/test_bare_tree_cluster.py."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import queue
import secrets
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.cli.options import tree_fanout
from launcher.code import launch_tree, node_agent
from launcher.code.launch_tree import TreeLaunch, TreeProc, keep_specs, kept_line, sign, tree_line
from launcher.code.tree import AGENT_SHA, relay_command
from launcher.core.output import kept_nodes, launch_reads, root_cause
from launcher.core.session import NodeSession
from launcher.core.transport import Transport
from launcher.core.types import Cluster, LaunchConfig, Node, Workload

SLUG, ADDRESS = "hosts-0123456789", "10.0.0.2"
SOURCE = Path(node_agent.__file__).read_text()
# What the node's part runs: it reads its --env value from stdin, says it is checked, waits for
# `go`, then leaves a mark and exits 3.
PROGRAM = (
    'IFS= read -r A; echo "a=$A"; echo checked; IFS= read -r G || exit 0; echo "got $G"; touch "$HOME/ran"; exit 3'
)


def agent(home: Path, command: str, stdin: bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", SOURCE, *command.split()],
        input=stdin,
        capture_output=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin", **(env or {})},
        timeout=60,
    )


def set_key(home: Path, address: str = ADDRESS) -> bytes:
    key = secrets.token_hex(32)
    r = agent(home, "keys", json.dumps({"slug": SLUG, "address": address, "key": key}).encode())
    assert r.returncode == 0 and b'result {"ok": true}' in r.stdout, r.stderr
    return bytes.fromhex(key)


def part(key: bytes, expires: float | None = None, address: str = ADDRESS, rank: int = 0) -> dict:
    """A node's part as launcher.code.launch_tree signs it."""
    signed = {
        "slug": SLUG,
        "rank": rank,
        "address": address,
        "nonce": secrets.token_hex(16),
        "expires": int(expires or time.time() + 60),
        "program": PROGRAM,
        "stdin": base64.b64encode(b"value\n").decode(),
    }
    return {"rank": rank, "signed": signed, "mac": sign(key, node_agent.canonical(signed)), "children": []}


def frames(entry: dict, *words: tuple[str, str]) -> bytes:
    body = json.dumps(entry).encode()
    out = f"PLAN {len(body)}\n".encode() + body
    for seq, (word, tag) in enumerate(words, start=1):
        ctl = json.dumps({"seq": seq, "word": word, "mac": tag}).encode()
        out += f"CTL {entry['rank']} {len(ctl)}\n".encode() + ctl
    return out


def go(key: bytes, entry: dict) -> tuple[str, str]:
    return "go", sign(key, entry["signed"]["nonce"], entry["rank"], 1, "go")


def test_the_key_is_private_to_the_account(tmp_path):
    set_key(tmp_path)
    d = tmp_path / ".gpufleet" / "tree"
    assert d.stat().st_mode & 0o777 == 0o700
    assert (d / f"{SLUG}--{ADDRESS}").stat().st_mode & 0o777 == 0o600


def test_a_signed_part_runs_with_its_stdin_then_go_and_its_output_and_exit_come_up_framed(tmp_path):
    key = set_key(tmp_path)
    entry = part(key)
    r = agent(tmp_path, "tree", frames(entry, go(key, entry)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"HELLO\nOUT 0 ") and r.stdout.endswith(b"EXIT 0 3\n"), r.stdout
    assert b"a=value\n" in r.stdout and b"got go\n" in r.stdout
    assert (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "how, why",
    [
        ("changed", "signature does not match"),
        ("replayed", "was run once already"),
        ("expired", "has expired"),
        ("another node's", "holds no launch key"),
    ],
)
def test_a_part_not_signed_for_this_node_now_is_refused_in_one_line_and_nothing_runs(tmp_path, how, why):
    key = set_key(tmp_path)
    entry = part(key)
    if how == "changed":  # what an interior node passing it on might try
        entry["signed"]["program"] = 'touch "$HOME/ran"; ' + entry["signed"]["program"]
    elif how == "replayed":
        first = agent(tmp_path, "tree", frames(entry))  # ends at once: no go, end of input
        assert first.stdout.endswith(b"EXIT 0 0\n"), first.stdout
    elif how == "expired":
        entry = part(key, expires=time.time() - 1)
    else:  # node 1's part, signed under node 1's own key for its address, handed to this node
        (tmp_path / "node1").mkdir()
        entry = part(set_key(tmp_path / "node1", "10.0.0.3"), address="10.0.0.3")
    r = agent(tmp_path, "tree", frames(entry, go(key, entry)))
    lines = r.stdout.decode().splitlines()
    assert lines[-1] == "EXIT 0 2", r.stdout
    (said,) = [line for line in lines if line.startswith("gpufleet: node 0 refused its part of the launch")]
    assert why in said, said
    assert not (tmp_path / "ran").exists()


def code_part(key: bytes, code: str) -> dict:
    """A part whose line runs `code` (the node program's, as launch_tree names it: by hash)."""
    entry = part(key)
    signed = entry["signed"]
    signed["program"], signed["code"] = ["exec bash -c ", ' "$HOME/marked"'], hashlib.sha256(code.encode()).hexdigest()
    entry["mac"] = sign(key, node_agent.canonical(signed))
    return entry


CODE = 'echo "code ran"; touch "$0"; exit 4'


@pytest.mark.parametrize("sent", [CODE, 'touch "$HOME/ran"; ' + CODE, None])
def test_a_part_runs_the_node_programs_code_only_from_a_code_frame_of_the_hash_it_names(tmp_path, sent):
    key = set_key(tmp_path)
    entry = code_part(key, CODE)
    head = b"" if sent is None else f"CODE {len(sent)}\n".encode() + sent.encode()
    r = agent(tmp_path, "tree", head + frames(entry))
    if sent == CODE:
        assert b"code ran\n" in r.stdout and r.stdout.endswith(b"EXIT 0 4\n"), r.stdout + r.stderr
        assert (tmp_path / "marked").exists()
        return
    # Another code than the plan names (a parent passing it on changed it), or none: one line, nothing runs.
    lines = r.stdout.decode().splitlines()
    assert lines[-1] == "EXIT 0 2" and "the node program's code did not arrive whole" in r.stdout.decode(), r.stdout
    assert not (tmp_path / "ran").exists() and not (tmp_path / "marked").exists()


def test_a_control_word_not_signed_for_the_part_is_not_applied(tmp_path):
    key = set_key(tmp_path)
    entry = part(key)
    forged = ("go", sign(b"\0" * 32, entry["signed"]["nonce"], 0, 1, "go"))
    r = agent(tmp_path, "tree", frames(entry, forged))
    # The program read end of input where `go` would be: it exits 0 having run nothing.
    assert r.stdout.endswith(b"EXIT 0 0\n") and b"got" not in r.stdout, r.stdout
    assert not (tmp_path / "ran").exists()


def test_a_child_outside_the_relay_keys_peers_is_refused_before_any_ssh(tmp_path):
    """As the relay key's forced command runs it (`relay PORT PEERS`, asked for `tree`)."""
    key = set_key(tmp_path)
    entry = part(key)
    entry["children"] = [{"rank": 1, "host": "203.0.113.9", "port": 22, "user": "me", "children": []}]
    r = agent(
        tmp_path, "relay 22 me@10.0.0.3", frames(entry), env={"SSH_ORIGINAL_COMMAND": "tree", "PATH": "/nonexistent"}
    )
    assert r.returncode != 0 and b"is not one of the cluster's nodes" in r.stderr, r.stderr
    assert b"OUT" not in r.stdout and not (tmp_path / "ran").exists()


def test_tree_launch_signs_each_part_and_turns_lines_into_signed_control_words(tmp_path, monkeypatch):
    """The launcher side over a local transport (node 0's agent under bash here): the plan, the
    control words, the demultiplexed output and the exit status, as launcher.core.session reads
    a session."""
    monkeypatch.setenv("HOME", str(tmp_path))
    key = set_key(tmp_path)
    cluster = Cluster(name="hosts", nodes=(Node(0, ADDRESS, ADDRESS),))
    monkeypatch.setattr("launcher.code.launch_tree.cluster_slug", lambda c: SLUG)
    tree = TreeLaunch(cluster, Transport(local=True), 4, {0: key})
    tree.start({0: PROGRAM}, b"value\n")
    proc = tree.proc(0)
    assert proc.stdout.readline() == b"a=value\n" and proc.stdout.readline() == b"checked\n"
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"got go\n"
    assert proc.wait(timeout=30) == 3 and proc.poll() == 3
    assert (tmp_path / "ran").exists()


def test_the_node_programs_code_goes_down_once_and_each_part_names_it_by_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    key = set_key(tmp_path)
    cluster = Cluster(name="hosts", nodes=(Node(0, ADDRESS, ADDRESS),))
    monkeypatch.setattr("launcher.code.launch_tree.cluster_slug", lambda c: SLUG)
    code = 'import sys; print("node program", sys.argv[1]); sys.exit(5)'
    monkeypatch.setattr("launcher.code.launch_tree.node_program_code", lambda: code)
    sent: list[bytes] = []
    tree = TreeLaunch(cluster, Transport(local=True), 4, {0: key})
    real_send = tree._send
    monkeypatch.setattr(tree, "_send", lambda frame: (sent.append(frame), real_send(frame)))
    tree.start({0: f"exec python3 -I -S -c {shlex.quote(code)} here"}, b"")
    proc = tree.proc(0)
    proc.stdin.close()
    assert proc.stdout.read() == b"node program here\n" and proc.wait(timeout=30) == 5
    first = sent[0]
    assert first.count(code.encode()) == 1 and first.startswith(f"CODE {len(code)}\n".encode())
    after = first.split(b"\n", 1)[1][len(code) :]  # past the CODE frame: PLAN SIZE, then the plan
    assert after.startswith(b"PLAN ")
    plan = json.loads(after.split(b"\n", 1)[1])
    assert plan["signed"]["program"] == ["exec python3 -I -S -c ", " here"]
    assert plan["signed"]["code"] == hashlib.sha256(code.encode()).hexdigest()


def test_fanout_is_refused_below_1_with_detach_and_with_local_in_one_line(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.0.0.2\n10.0.0.3\n")
    for flags, why in (
        (["--hostfile", str(hostfile), "--fanout", "0"], "--fanout 0: each node passes the launch on to K others"),
        (["--hostfile", str(hostfile), "--fanout", "four"], "--fanout 'four': give how many nodes each node"),
        (["--local", "--nodes", "2", "--fanout", "2"], "--local runs every node here: drop --fanout"),
    ):
        r = CliRunner().invoke(main, ["exec", *flags, "--", "true"])
        assert r.exit_code == 2, r.output
        assert why in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_dry_run_says_who_passes_the_launch_to_whom():
    cluster = Cluster(name="h", nodes=tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(7)))
    assert tree_line(cluster, 2).endswith(": 0 -> 1,2; 1 -> 3,4; 2 -> 5,6")


def test_without_fanout_an_attached_launch_goes_down_the_tree_above_16_ssh_nodes():
    def nodes(n: int, local: bool = False) -> Cluster:
        return Cluster(
            name="h",
            nodes=tuple(Node(i, f"10.0.{i // 200}.{i % 200 + 2}", f"10.0.0.{i}") for i in range(n)),
            local=local,
        )

    assert tree_fanout(None, nodes(16)) is None and tree_fanout(None, nodes(17)) == 4
    assert tree_fanout("off", nodes(200)) is None and tree_fanout(2, nodes(3)) == 2
    assert tree_fanout(None, nodes(32, local=True)) is None


def forced(home: Path, stdin: bytes, original: str = "tree") -> subprocess.CompletedProcess:
    """The relay key's forced command as sshd runs it: authorized_keys' `command="..."` (its \\"
    dequoted) under the account's shell, asked for `original`."""
    command = relay_command(22, "me@10.0.0.3").replace('\\"', '"')
    return subprocess.run(
        ["sh", "-c", command],
        input=stdin,
        capture_output=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": original},
        timeout=60,
    )


def test_a_corrupt_agent_copy_is_fetched_again_from_the_parent_checked_and_run(tmp_path):
    key = set_key(tmp_path)  # stores the agent's copy, as the keys round does
    copy = tmp_path / ".gpufleet" / "objects" / AGENT_SHA
    assert copy.read_text() == SOURCE
    copy.chmod(0o644)
    copy.write_text(SOURCE[: len(SOURCE) // 2])  # cut short: a full disk
    entry = part(key)
    source = SOURCE.encode()
    r = forced(tmp_path, f"AGENT {len(source)}\n".encode() + source + frames(entry, go(key, entry)))
    assert r.stdout.startswith(b"AGENT?\nHELLO\n") and r.stdout.endswith(b"EXIT 0 3\n"), r.stdout + r.stderr
    assert copy.read_text() == SOURCE and (tmp_path / "ran").exists()
    # What a parent sends must match the hash: anything else is refused in one line, never run.
    copy.chmod(0o644)
    copy.write_text("")
    bad = b'import os; os.system("touch $HOME/evil")\n'
    r = forced(tmp_path, f"AGENT {len(bad)}\n".encode() + bad)
    assert r.returncode == 1 and r.stderr.decode().strip().endswith("does not match its hash"), r.stderr
    assert not (tmp_path / "evil").exists() and copy.read_text() == ""
    # Asked for content, a corrupt copy is one line (the preparation stores the agent again).
    r = forced(tmp_path, b"END\n", original="relay")
    assert r.returncode == 1 and b"is missing or corrupt" in r.stderr and len(r.stderr.splitlines()) == 1


def test_the_agent_runs_from_its_compiled_code_kept_beside_it_and_a_corrupt_one_is_compiled_again(tmp_path):
    key = set_key(tmp_path)
    objects = tmp_path / ".gpufleet" / "objects"
    entry = part(key)
    r = forced(tmp_path, frames(entry, go(key, entry)))
    assert r.stdout.startswith(b"HELLO\n") and r.stdout.endswith(b"EXIT 0 3\n"), r.stdout + r.stderr
    (cache,) = objects.glob(f"{AGENT_SHA}.cpython-*")  # the node's python's tag
    data = cache.read_bytes()
    version = subprocess.run(
        ["python3", "-c", "import sys; print(sys.version, end='')"], capture_output=True, env={"PATH": "/usr/bin:/bin"}
    ).stdout
    assert hashlib.sha256(version + data[32:]).digest() == data[:32] and cache.stat().st_mode & 0o777 == 0o400
    # What the cache holds is what runs (no compile of the source): a stand-in marks that it ran.
    other = subprocess.run(
        ["python3", "-c", "import marshal,sys; sys.stdout.buffer.write(marshal.dumps(compile(sys.argv[1],'x','exec')))"]
        + ["import os; open(os.path.expanduser('~/from-cache'), 'w').close()"],
        capture_output=True,
        env={"PATH": "/usr/bin:/bin"},
        check=True,
    ).stdout
    cache.chmod(0o600)
    cache.write_bytes(hashlib.sha256(version + other).digest() + other)
    forced(tmp_path, b"")
    assert (tmp_path / "from-cache").exists()
    # A cache written by another Python, or cut short, is compiled again from the checked source,
    # and the part runs.
    cache.write_bytes(hashlib.sha256(b"3.0.0" + other).digest() + other)
    forced(tmp_path, b"")
    assert cache.read_bytes() == data
    cache.write_bytes(data[:-100])
    entry = part(key)
    r = forced(tmp_path, frames(entry, go(key, entry)))
    assert r.stdout.endswith(b"EXIT 0 3\n"), r.stdout + r.stderr
    assert cache.read_bytes() == data


def test_the_preparation_stores_a_corrupt_copy_of_the_agent_again(tmp_path):
    set_key(tmp_path)
    copy = tmp_path / ".gpufleet" / "objects" / AGENT_SHA
    copy.chmod(0o644)
    copy.write_text("garbage")
    set_key(tmp_path)
    assert copy.read_text() == SOURCE


def test_run_all_runs_one_program_per_node_to_its_end_down_a_tree_of_its_own(tmp_path, monkeypatch):
    """What a hang's stacks take (launcher.core.stacks._gather): each program reads its stdin,
    then the end of its input, as `ssh HOST PROGRAM < input` does; its stdout comes back whole."""
    monkeypatch.setenv("HOME", str(tmp_path))
    key = set_key(tmp_path)
    cluster = Cluster(name="hosts", nodes=(Node(0, ADDRESS, ADDRESS),))
    monkeypatch.setattr("launcher.code.launch_tree.cluster_slug", lambda c: SLUG)
    tree = TreeLaunch(cluster, Transport(local=True), 4, {0: key})
    script = 'IFS= read -r A; cat >/dev/null; echo "got $A"; echo done'
    assert tree.run_all({0: script}, b"value\n", timeout=30) == {0: ("got value\ndone\n", "")}
    # One that does not end in time is cut off (its input ends, its session is over here).
    assert tree.run_all({0: "sleep 3"}, b"", timeout=1) == {0: ("", "no answer within 1 s")}
    # A whole log goes to its sink as it comes, never into memory here (`launch logs`).
    sink = io.BytesIO()
    assert tree.run_all({0: "seq 1 100000"}, b"", 30, {0: sink}) == {0: ("", "")}
    assert sink.getvalue() == "".join(f"{i}\n" for i in range(1, 100001)).encode()
    # Some of the nodes only (the ranks still running, or the nodes that kept a log): node 1's part
    # is signed for node 1, though it is the first of the tree's nodes.
    two = Cluster(name="hosts", nodes=(Node(0, "10.0.0.9", "10.0.0.9"), Node(1, ADDRESS, ADDRESS)))
    tree = TreeLaunch(two, Transport(local=True), 4, {0: b"\0" * 32, 1: key})
    assert tree.run_all({1: "echo one"}, b"", timeout=30) == {1: ("one\n", "")}


def test_a_node_the_tree_lost_is_lost_not_stopped_and_named_before_one_cut_off_with_it():
    """Which of two lost nodes' exits the launch reads first is a race between their sessions'
    threads: whichever comes first, the stop that follows must not make the other `stopped`, and
    the node lost itself is named, not the one cut off with it."""
    cluster = Cluster(name="h", nodes=tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(3)))
    tree = TreeLaunch(cluster, Transport(local=True), 1, {})
    reports: queue.Queue = queue.Queue()
    sessions = {r: NodeSession(cluster.nodes[r], [], reports, proc=tree.proc(r)) for r in (1, 2)}
    sessions[1].request_stop()  # node 2's exit came first: the launch stops the others
    for rank in (2, 1):
        proc = tree.proc(rank)
        proc.lost_via = 1
        proc.feed("ERR", f"node 0 lost node 1{', which passes the launch on to node 2' * (rank == 2)}: gone\n".encode())
        proc.finish(255)
    for _ in range(2):
        reports.get(timeout=10)
    outcomes = {r: s.outcome(255) for r, s in sessions.items()}
    assert outcomes[1].connection_lost and not outcomes[1].stopped and outcomes[1].cut_off_by is None
    assert outcomes[2].connection_lost and outcomes[2].cut_off_by == 1
    assert root_cause(outcomes, [2, 1]) == 1


def test_what_a_login_shell_prints_before_the_agent_is_passed_over(tmp_path, monkeypatch):
    """bash reads ~/.bashrc under sshd: a banner it prints comes before the agent's HELLO, on node
    0 (read here) and on a child (read by its parent, node_agent.Hop, through `hello`)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    key = set_key(tmp_path)
    cluster = Cluster(name="hosts", nodes=(Node(0, ADDRESS, ADDRESS),))
    monkeypatch.setattr("launcher.code.launch_tree.cluster_slug", lambda c: SLUG)
    banner = launch_tree.agent_script
    monkeypatch.setattr(launch_tree, "agent_script", lambda cmd: "echo 'Welcome to node 0'; " + banner(cmd))
    tree = TreeLaunch(cluster, Transport(local=True), 4, {0: key})
    assert tree.run_all({0: "echo ok"}, b"", timeout=30) == {0: ("ok\n", "")}
    stream = io.BytesIO(b"Welcome\n" * 3 + b"AGENT?\nHELLO\n")
    assert node_agent.hello(stream) == b"AGENT?\n" and node_agent.hello(stream) == b"HELLO\n"
    assert node_agent.hello(io.BytesIO(b"x" * 100 + b"\n"), most=50) == b""


def up_frames(stdout: bytes) -> list[tuple[str, int, bytes]]:
    """An agent's frames up (`OUT RANK SIZE` + bytes, `EXIT RANK RC`, ...), after its HELLO."""
    stream, out = io.BytesIO(stdout), []
    assert node_agent.hello(stream) == b"HELLO\n"
    while head := node_agent.header(stream):
        data = node_agent.read_exact(stream, int(head[2])) if head[0] in ("OUT", "ERR") else head[2].encode()
        out.append((head[0], int(head[1]), data))
    return out


KEPT = (
    'IFS= read -r A; echo checked; IFS= read -r G || exit 0; for i in $(seq 1 50); do echo "line $i"; done; '
    'if [ "$A" = fail ]; then echo "line 51"; echo "gpufleet: the disk is full"; '
    'echo "__GPUFLEET_EXIT__ 1"; exit 1; fi; echo "__GPUFLEET_EXIT__ 0"'
)


@pytest.mark.parametrize("how", ["ends well", "fails"])
def test_a_node_that_keeps_its_output_logs_every_line_and_sends_up_only_what_the_launch_reads(tmp_path, how):
    """`--output rank0|failures` down a tree: from `go` on, every line goes to the node's own log
    (0600 in the account's private ~/.gpufleet/logs); up go the check's lines, a first sample
    (the hang watch's progress), the lines the launch reads (launcher.core.output.launch_reads:
    the exit marker, an error line) and, when the part fails, its last lines not sent yet, before
    its exit marker."""
    key = set_key(tmp_path)
    entry = part(key)
    entry["signed"]["program"] = KEPT
    entry["signed"]["stdin"] = base64.b64encode(b"fail\n" if how == "fails" else b"fine\n").decode()
    entry["signed"]["keep"] = {
        "log": "job-1/node-0.log",
        "up": launch_reads(),
        "sample": "^line",
        "every": 3600,
        "tail": 5,
        "marker": "__GPUFLEET_EXIT__",
    }
    entry["mac"] = sign(key, node_agent.canonical(entry["signed"]))
    r = agent(tmp_path, "tree", frames(entry, go(key, entry)))
    # `go` follows the plan at once here, so the check's line may come before or after it.
    came = [(kind, data.decode()) for kind, _, data in up_frames(r.stdout) if kind != "EXIT"]
    came = [c for c in came if c != ("OUT", "checked\n")]
    assert came[0] == ("OUT", "line 1\n"), came
    if how == "ends well":
        assert came[1:] == [("OUT", "__GPUFLEET_EXIT__ 0\n")], came
    else:  # the error line at once; lines 47-51 (the last 5 held) before the marker
        tail = [("OUT", f"line {i}\n") for i in range(47, 52)]
        assert came[1:] == [("OUT", "gpufleet: the disk is full\n"), *tail, ("OUT", "__GPUFLEET_EXIT__ 1\n")], came
    log = tmp_path / ".gpufleet" / "logs" / "job-1" / "node-0.log"
    kept = [line for line in log.read_text().splitlines() if line != "checked"]
    assert kept[:50] == [f"line {i}" for i in range(1, 51)] and kept[-1].startswith("__GPUFLEET_EXIT__")
    assert log.stat().st_mode & 0o777 == 0o600 and log.parent.parent.stat().st_mode & 0o777 == 0o700


def test_a_log_name_outside_the_logs_directory_is_refused_and_nothing_runs(tmp_path):
    key = set_key(tmp_path)
    entry = part(key)
    entry["signed"]["keep"] = {"log": "../tree/x.log", "up": []}
    entry["mac"] = sign(key, node_agent.canonical(entry["signed"]))
    r = agent(tmp_path, "tree", frames(entry, go(key, entry)))
    assert b"refused its part of the launch: its plan's log is not JOB/node-RANK.log" in r.stdout, r.stdout
    assert r.stdout.endswith(b"EXIT 0 2\n") and not (tmp_path / "ran").exists()


def test_the_nodes_not_shown_live_keep_their_output_and_the_run_says_where(tmp_path, monkeypatch):
    cluster = Cluster(name="h", nodes=tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(3)))
    config = LaunchConfig(workload=Workload("exec", ("true",)), job_id="job-1", runs_dir=tmp_path, fanout=2)
    assert keep_specs(cluster, config) == {} == keep_specs(cluster, replace(config, output="all"))
    specs = keep_specs(cluster, replace(config, output="rank0"))
    assert sorted(specs) == [1, 2] and specs[2]["log"] == "job-1/node-2.log"
    assert sorted(keep_specs(cluster, replace(config, output="failures"))) == [0, 1, 2]
    assert kept_line(cluster, config) is None
    assert "--output rank0: 2 of 3 nodes keep their output" in kept_line(cluster, replace(config, output="rank0"))
    # What `launch logs` reads, written when the tree starts (node 0's session here fails at once).
    monkeypatch.setattr(launch_tree, "ensure_key", lambda c, name: tmp_path / "no-key")
    tree = TreeLaunch(cluster, Transport(local=True), 2, {}, specs, config.run_dir)
    tree._record_kept()
    assert kept_nodes(config.run_dir) == {
        r: {"address": f"10.0.0.{r + 2}", "log": f"job-1/node-{r}.log"} for r in (1, 2)
    }
    assert "launch logs job-1 --node 2" in (config.run_dir / "node-2.log").read_text()
    assert not (config.run_dir / "node-0.log").exists()


def test_launch_logs_of_an_attached_launch_prints_its_nodes_logs_from_here_in_rank_order(tmp_path):
    """A launch over the star kept nothing on the nodes: its logs are the run's directory here."""
    run = tmp_path / "runs" / "20261129-120000-abcdef"
    run.mkdir(parents=True)
    (run / "launch.json").write_text("{}\n")
    for rank in (1, 0):
        (run / f"node-{rank}.log").write_text(f"n{rank} a\nn{rank} b\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.0.0.2\n10.0.0.3\n")
    base = ["logs", "--hostfile", str(hostfile), "--runs-dir", str(tmp_path / "runs"), run.name]
    r = CliRunner().invoke(main, base)
    assert r.exit_code == 0 and r.output == "[node 0] n0 a\n[node 0] n0 b\n[node 1] n1 a\n[node 1] n1 b\n", r.output
    r = CliRunner().invoke(main, [*base, "--node", "1"])
    assert r.exit_code == 0 and r.output == "n1 a\nn1 b\n", r.output
    for extra, why in ((["--node", "2"], "--node 2 is not a node of job"), (["-f"], "ran attached")):
        r = CliRunner().invoke(main, [*base, *extra])
        assert r.exit_code == 2 and why in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_kept_log_that_cannot_be_read_is_one_line_and_what_came_up_of_it_stays(tmp_path, monkeypatch):
    """`launch logs` of a launch whose node 1 kept its log, read through the tree (--local's
    nodes: the agent under bash here, in a home of the test's own), once the log is gone there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    run = tmp_path / "runs" / "20261129-120000-abcdef"
    run.mkdir(parents=True)
    log = f"{run.name}/node-1.log"
    (run / "kept.json").write_text(json.dumps({"nodes": {"1": {"address": "127.0.0.1", "log": log}}}))
    (run / "node-0.log").write_text("n0 a\n")
    (run / "node-1.log").write_text("(node 1 keeps its whole output on the node)\nn1 sampled\n")
    base = ["logs", "--local", "--nodes", "2", "--runs-dir", str(tmp_path / "runs"), run.name]
    r = CliRunner().invoke(main, [*base, "--node", "1"])
    assert r.exit_code == 2, r.output
    said = r.output.strip().splitlines()[-1]
    assert f"node 1's log of job {run.name} could not be read (no log of job {run.name} on this node" in said, said
    assert "n1 sampled" in (run / "node-1.log").read_text() and not list(run.glob(".*.part"))
    # Once it is there, it comes back whole and replaces what came up of it.
    kept = tmp_path / ".gpufleet" / "logs" / log
    kept.parent.mkdir(parents=True)
    kept.write_text("n1 a\nn1 b\n")
    r = CliRunner().invoke(main, base)
    assert r.exit_code == 0 and r.output == "[node 0] n0 a\n[node 1] n1 a\n[node 1] n1 b\n", r.output
    assert (run / "node-1.log").read_text() == "n1 a\nn1 b\n"


def test_a_launch_session_takes_its_nodes_frames_without_a_pipe_or_a_thread_of_its_own(tmp_path):
    """A launch's tree (tree_for: no pipes): what came before the session attached first, whole
    lines as a reader thread reads them (a line cut across frames, a last one without its
    newline), the exit once, after them; nothing once the node has finished."""
    proc = TreeProc(None, 3, pipes=False)  # its stdin is never written here
    proc.feed("OUT", b"gpu=8\nnic=eth")
    reports: queue.Queue = queue.Queue()
    node = Node(3, "10.0.0.5", "10.0.0.5")
    threads = threading.active_count()
    session = NodeSession(node, [], reports, proc=proc)
    assert threading.active_count() == threads and proc.stdout is None
    proc.feed("OUT", b"0\n")
    proc.feed("ERR", b"warning: x\nlast words")
    proc.finish(7)
    proc.feed("OUT", b"late=1\n")
    proc.finish(9)
    assert session.facts == {"gpu": "8", "nic": "eth0"}
    assert list(session.err) == ["warning: x", "last words"]
    got = []
    while not reports.empty():
        got.append(reports.get_nowait())
    assert [(r.kind, r.text) for r in got if r.kind == "exit"] == [("exit", "7")] and got[-1].kind == "exit"


def test_keys_set_under_another_agent_or_bootstrap_are_set_again_with_the_relay_keys_entry(monkeypatch):
    """The relay key's authorized_keys entry runs this agent through this bootstrap: keys kept
    under another (an older gpufleet's, whose entry runs the older one) are set again."""
    cluster = Cluster(name="hosts", nodes=(Node(0, ADDRESS, ADDRESS),))
    calls = []
    monkeypatch.setattr(launch_tree, "_set_up", lambda c, t, keys: calls.append(keys) or keys)
    path = launch_tree._keys_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    kept = {"peers": [ADDRESS], "keys": {ADDRESS: "ab" * 32}}
    for stamp, again in ((AGENT_SHA, True), (launch_tree.RELAY_VERSION, False)):
        calls.clear()
        path.write_text(json.dumps({**kept, "agent": stamp}))
        path.chmod(0o600)
        got = launch_tree.ensure_keys(cluster, Transport(local=True))
        assert bool(calls) == again and (got == {0: bytes.fromhex("ab" * 32)}) != again, stamp  # new keys, or kept
    assert json.loads(path.read_text())["agent"] == launch_tree.RELAY_VERSION
