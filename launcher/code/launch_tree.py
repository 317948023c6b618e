"""A launch down the tree (`--fanout K`): the launching machine opens one session, to node 0's
agent (launcher.code.node_agent `tree`), and sends it every node's part of the launch in one
plan. Each node runs its own part, passes each child its subtree's plan over ssh with the relay
key (launcher.code.tree: `restrict`ed, its forced command the agent, the cluster's nodes its
only destinations), and sends its subtree's output and exit statuses up, framed by rank. So the
launching machine holds one connection, not one per node, and its CPU does not grow with the
nodes: the handshakes happen on the nodes, K at a time per parent.

Each node's part is its program (launcher.core.program, exactly what the star runs over ssh)
and what the program reads first on stdin (the --env values), signed for that node alone:
HMAC-SHA256 under the node's own launch key, with the cluster's name, the node's rank and
address, a nonce and an expiry. The keys are set once per cluster (`ensure_keys`, one session
per node, the same round that authorizes the relay key): 32 random bytes per node, sent on
stdin to the node's ~/.gpufleet/tree/CLUSTER--ADDRESS (0600, the account's private directory), kept
here in the cluster's state directory (0600). An interior node holds the relay key, which
gives it no shell anywhere; it passes its children's parts on but cannot forge or change one
(the child checks the signature under its own key, which the parent does not hold), replay one
(the child records each nonce), or hand one node's part to another (each key is one node's).
What the launching machine writes to a node once it runs (`go`, a stop's `term` line, the end
of its input) is signed the same way, with a sequence number. What a parent can do is what a
network can: cut its subtree off, which ends their input, so their programs stop or never start.

`TreeLaunch.proc(rank)` is the node's session as launcher.core.session sees an ssh process:
stdin (a line becomes a signed CTL frame, close its end of input), stdout and stderr (pipes the
demultiplexer writes the node's frames into), wait/poll/kill. A node cut off (its parent lost
it, or node 0's session ended) ends with exit 255 and a line naming the node that lost it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from gpufleet import atomic
from launcher.cluster.key import ensure_key, ssh_target, verified_host_keys
from launcher.code import node_agent
from launcher.code.prepare import RELAY_KEY, PrepareReport, agent_script, each_node, run_agent
from launcher.code.tree import RELAY_VERSION, authorize_relay, forwarding_tree, hop_entry, hops, relay_known_hosts
from launcher.core.output import KEPT_FILE, TAIL_LINES, LiveFilter, launch_reads
from launcher.core.program import node_program_code
from launcher.core.transport import Transport, cluster_slug, make_transport, state_dir
from launcher.core.types import Cluster, LaunchConfig, Node, UserError
from launcher.core.wire import EXIT_MARKER

__all__ = [
    "KEYS_FILE",
    "ensure_keys",
    "sign",
    "TreeLaunch",
    "TreeProc",
    "keep_specs",
    "tree_for",
    "tree_line",
    "kept_line",
]

KEYS_FILE = "tree_keys.json"  # in the cluster's state directory, beside its relay key
EXPIRES_S = 300  # a node's part must reach it within this long (clocks may differ this much too)
# A node that keeps its output sends up a line of it at most this often (the hang watch's progress).
SAMPLE_EVERY_S = 5.0


def sign(key: bytes, *parts: object) -> str:
    """node_agent.signature: HMAC-SHA256 of `parts` joined by NUL, hex."""
    return hmac.new(key, "\0".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def _keys_path(cluster: Cluster) -> Path:
    return state_dir() / cluster_slug(cluster) / KEYS_FILE


def _load(path: Path) -> dict:
    try:
        st = path.lstat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise UserError(f"{path} is open to other accounts or not yours; remove it and launch again")
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        raise UserError(f"{path} cannot be read as the cluster's launch keys; remove it and launch again") from None


def ensure_keys(cluster: Cluster, transport: Transport) -> dict[int, bytes]:
    """Every node's launch key, by rank. Where this machine lacks one (a node new to the
    cluster, or keys set by another gpufleet version, whose agent the relay key no longer runs),
    every node gets its key and the relay key's authorization again, one session per node, at
    once; a node that cannot be set up is one line naming it, and nothing is started."""
    path = _keys_path(cluster)
    kept = _load(path)
    addresses = sorted(n.address for n in cluster.nodes)
    keys: dict[str, str] = kept.get("keys", {}) if kept.get("agent") == RELAY_VERSION else {}
    # A job's nodes may be fewer than those the keys were set for (a detached job's world without
    # its spares): the relay key's forced command lets a node reach any node it was set up with.
    if not set(addresses) <= set(kept.get("peers", ())) or any(n.address not in keys for n in cluster.nodes):
        keys = _set_up(
            cluster, transport, {n.address: keys.get(n.address) or secrets.token_hex(32) for n in cluster.nodes}
        )
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{KEYS_FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"agent": RELAY_VERSION, "peers": addresses, "keys": keys}, f)
        os.replace(tmp, path)
    return {n.rank: bytes.fromhex(keys[n.address]) for n in cluster.nodes}


def _set_up(cluster: Cluster, transport: Transport, keys: dict[str, str]) -> dict[str, str]:
    relay = ensure_key(cluster, RELAY_KEY)
    target = ssh_target(transport, cluster.nodes[0])
    authorize = authorize_relay(
        relay.with_name(f"{RELAY_KEY}.pub").read_text(), cluster, hops(cluster, target.user), target.port
    )
    script = f"{authorize} && {agent_script('keys')}"
    slug = cluster_slug(cluster)

    def one(node: Node) -> tuple[dict | None, str]:
        body = json.dumps({"slug": slug, "address": node.address, "key": keys[node.address]}).encode()
        return run_agent(transport, node, script, [body], lambda n, t: None, PrepareReport())

    answers = each_node(list(cluster.nodes), one)
    failed = {r: why for r, (res, why) in answers.items() if not res}
    if failed:
        rank, label = min(failed), {n.rank: n.label for n in cluster.nodes}
        more = f" (and {len(failed) - 1} other node{'s' * (len(failed) > 2)})" if len(failed) > 1 else ""
        raise UserError(
            f"{label[rank]}: cannot set its launch key for --fanout ({failed[rank]}){more}; nothing was started"
        )
    return keys


class _Control:
    """A tree session's stdin as launcher.core.session writes it: each line a signed CTL frame
    for the node, `close` the end of its input."""

    def __init__(self, tree: TreeLaunch, rank: int):
        self.tree, self.rank, self.buf, self.closed = tree, rank, b"", False

    def write(self, data: bytes) -> int:
        if self.closed:
            raise ValueError("write to a closed stdin")
        self.buf += data
        while b"\n" in self.buf:
            line, _, self.buf = self.buf.partition(b"\n")
            self.tree.control(self.rank, line.decode())
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.tree.control(self.rank, "eof")


class TreeProc:
    """One node's session in a tree launch, shaped as the ssh process launcher.core.session
    reads: `stdin`, `stdout`, `stderr`, `wait`, `poll`, `kill`, `returncode`."""

    def __init__(self, tree: TreeLaunch, rank: int, pipes: bool = True):
        self.rank = rank
        self.args = f"node {rank} of the tree"
        self.stdin = _Control(tree, rank)
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        if pipes:  # read as an ssh process's stdout and stderr
            r_out, self._out = os.pipe()
            r_err, self._err = os.pipe()
            self.stdout, self.stderr = open(r_out, "rb"), open(r_err, "rb")
        self.returncode: int | None = None
        # The tree lost this node (its own rank), or the node that passed the launch on to it.
        self.lost_via: int | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        # Without pipes: what came before a session attached, and the session's (data, end).
        self._pending: list[tuple[bool, bytes]] = []
        self._sink: tuple[Callable[[bool, bytes], None], Callable[[int], None]] | None = None

    def attach(self, on_data: Callable[[bool, bytes], None], on_end: Callable[[int], None]) -> None:
        """(Without pipes) `on_data(is_err, bytes)` for the node's output as it comes, what came
        already first, then `on_end(rc)` once, after the last of it; both called in order, under
        this node's lock."""
        with self._lock:
            self._sink = (on_data, on_end)
            for is_err, data in self._pending:
                on_data(is_err, data)
            self._pending = []
            if self.returncode is not None:
                on_end(self.returncode)

    def feed(self, kind: str, data: bytes) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            if self.stdout is None:
                if self._sink is None:
                    self._pending.append((kind == "ERR", data))
                else:
                    self._sink[0](kind == "ERR", data)
                return
            view = memoryview(data)
            while view:
                view = view[os.write(self._out if kind == "OUT" else self._err, view) :]

    def finish(self, rc: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            if self.stdout is not None:
                os.close(self._out)
                os.close(self._err)
            self.returncode = rc
            if self._sink is not None:
                self._sink[1](rc)
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """As a killed ssh client: the node's input ends (its program stops, or never starts),
        and the session is over here at once."""
        try:
            self.stdin.close()
        finally:
            self.finish(-9)


class TreeLaunch:
    """One launch's tree: `start` sends every node's signed part to node 0's agent; `proc(rank)`
    is each node's session (TreeProc)."""

    def __init__(
        self,
        cluster: Cluster,
        transport: Transport,
        fanout: int,
        keys: Mapping[int, bytes],
        keep: Mapping[int, dict] | None = None,
        run_dir: Path | None = None,
        pipes: bool = True,
    ):
        self.cluster, self.transport, self.fanout, self.keys = cluster, transport, fanout, dict(keys)
        # The nodes that keep their output (node_agent.Keep), by rank, and the run's directory here.
        self.keep, self.run_dir = dict(keep or {}), run_dir
        # `pipes`: each node's output on pipes, as an ssh process's (run_all reads them); without,
        # a launch's sessions attach to their nodes (launcher.core.session).
        self.procs = {n.rank: TreeProc(self, n.rank, pipes) for n in cluster.nodes}
        self.head = cluster.nodes[0]
        self.nodes = {n.rank: n for n in cluster.nodes}  # a subset's ranks are not its indexes
        self.tree = forwarding_tree(self.head.rank, [n.rank for n in cluster.nodes[1:]], fanout)
        self._nonces: dict[int, str] = {}
        self._seq = dict.fromkeys(self.procs, 0)
        self._lock = threading.Lock()
        self._root: subprocess.Popen | None = None
        self._code: tuple[str, str] | None = None  # the node program's (sha256, quoted code) in this launch's parts

    def proc(self, rank: int) -> TreeProc:
        return self.procs[rank]

    def run_all(
        self, scripts: Mapping[int, str], stdin: bytes, timeout: float, sinks: Mapping[int, IO[bytes]] | None = None
    ) -> dict[int, tuple[str, str]]:
        """Run one program on each of `scripts`' nodes (by rank) down a tree of their own, each
        reading `stdin` first and then the end of its input, as a plain ssh session with `input`
        does: (stdout, the last line of stderr or why nothing came) by rank. Another launch's
        work on the same nodes (a hang's stacks, while its ranks still run): a new tree, the
        same keys, one more connection from here. With `sinks`, each node's stdout goes to its
        sink as it comes (a whole log, never in memory here), and its text is ""."""
        nodes = tuple(n for n in self.cluster.nodes if n.rank in scripts)
        tree = TreeLaunch(dataclasses.replace(self.cluster, nodes=nodes), self.transport, self.fanout, self.keys)
        tree.start(scripts, stdin)
        out: dict[int, tuple[str, str]] = {}

        def one(rank: int) -> None:
            proc = tree.proc(rank)
            proc.stdin.close()
            errs: list[bytes] = []
            reader = threading.Thread(target=lambda: errs.append(proc.stderr.read()), daemon=True)
            reader.start()
            if sinks is None:
                text = proc.stdout.read().decode(errors="replace")
            else:
                shutil.copyfileobj(proc.stdout, sinks[rank], 1 << 16)
                text = ""
            reader.join()
            tail = (errs[0] if errs else b"").decode(errors="replace").strip().splitlines()
            out[rank] = (text, tail[-1] if tail else "" if proc.wait() == 0 else f"exit {proc.returncode}")

        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in scripts]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for rank in scripts:
            if rank not in out:
                tree.proc(rank).kill()
                out[rank] = ("", f"no answer within {timeout:.0f} s")
        return dict(out)

    def _entry(self, rank: int, scripts: Mapping[int, str], stdin: bytes, targets, port: int, expires: int) -> dict:
        node = self.nodes[rank]
        nonce = self._nonces[rank] = secrets.token_hex(16)
        signed = {
            "slug": cluster_slug(self.cluster),
            "rank": rank,
            "address": node.address,
            "nonce": nonce,
            "expires": expires,
            "program": scripts[rank],
            "stdin": base64.b64encode(stdin).decode(),
        }
        if self._code is not None and signed["program"].count(self._code[1]) == 1:
            # The node program's code travels once per hop (the CODE frame), named here by hash.
            before, _, after = signed["program"].partition(self._code[1])
            signed["program"], signed["code"] = [before, after], self._code[0]
        if rank in self.keep:
            signed["keep"] = self.keep[rank]
        return {
            **hop_entry(rank, targets, port),
            "signed": signed,
            "mac": sign(self.keys[rank], node_agent.canonical(signed)),
            "children": [self._entry(c, scripts, stdin, targets, port, expires) for c in self.tree[rank]],
        }

    def start(self, scripts: Mapping[int, str], stdin: bytes) -> None:
        """Open node 0's session and send the plan: each node's program and stdin, signed."""
        target = ssh_target(self.transport, self.head)
        targets = hops(self.cluster, target.user)
        source = node_program_code()
        quoted = shlex.quote(source)
        code = source.encode()
        self._code = (hashlib.sha256(code).hexdigest(), quoted) if any(quoted in p for p in scripts.values()) else None
        plan = self._entry(self.head.rank, scripts, stdin, targets, target.port, int(time.time()) + EXPIRES_S)
        frames = b""
        if self.tree[self.head.rank]:
            known = relay_known_hosts(self.cluster, verified_host_keys(target, self.cluster), target.port)
            for kind, data in (("KEY", ensure_key(self.cluster, RELAY_KEY).read_bytes()), ("KNOWN", known.encode())):
                frames += f"{kind} {len(data)}\n".encode() + data
        if self._code is not None:
            frames += f"CODE {len(code)}\n".encode() + code
        body = json.dumps(plan).encode()
        frames += f"PLAN {len(body)}\n".encode() + body
        self._record_kept()
        self._root = subprocess.Popen(
            self.transport.argv(self.head, agent_script("tree")),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches the launcher only, which stops in order
        )
        self._send(frames)
        threading.Thread(target=self._demux, daemon=True).start()

    def _record_kept(self) -> None:
        """Where the nodes keep their output, in the run's directory (KEPT_FILE, which `launch
        logs` reads), and a first line in each such node's log here saying so."""
        if not self.keep or self.run_dir is None:
            return
        nodes = {r: {"address": self.nodes[r].address, "log": spec["log"]} for r, spec in self.keep.items()}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_text(self.run_dir / KEPT_FILE, json.dumps({"nodes": nodes}, indent=2) + "\n")
        job = self.run_dir.name
        for rank in self.keep:
            with open(self.run_dir / f"node-{rank}.log", "a") as f:
                f.write(f"(node {rank} keeps its whole output on the node: launch logs {job} --node {rank})\n")

    def _send(self, frame: bytes) -> None:
        with self._lock:
            try:
                assert self._root is not None and self._root.stdin is not None
                self._root.stdin.write(frame)
                self._root.stdin.flush()
            except (OSError, ValueError):
                pass  # node 0's session is gone: its end reports every node

    def control(self, rank: int, word: str) -> None:
        """A signed word for node `rank` (a line on its program's stdin, or `eof`)."""
        if rank not in self._nonces:
            return
        with self._lock:
            self._seq[rank] += 1
            seq = self._seq[rank]
        body = json.dumps({"seq": seq, "word": word, "mac": sign(self.keys[rank], self._nonces[rank], rank, seq, word)})
        self._send(f"CTL {rank} {len(body)}\n".encode() + body.encode())
        if all(p.returncode is not None or p.stdin.closed for p in self.procs.values()):
            self._close_root()

    def _close_root(self) -> None:
        with self._lock:
            try:
                if self._root is not None and self._root.stdin is not None:
                    self._root.stdin.close()
            except OSError:
                pass

    def _demux(self) -> None:
        root = self._root
        assert root is not None and root.stdout is not None and root.stderr is not None
        errs: list[bytes] = []
        reader = threading.Thread(target=lambda: errs.append(root.stderr.read()), daemon=True)
        reader.start()
        why = ""
        try:
            # What node 0's login shell printed before its agent started is not ours; without a
            # HELLO, ssh's own last line (below) says why.
            started = node_agent.hello(root.stdout) == b"HELLO\n"
            while started:
                head = node_agent.header(root.stdout)
                if not head:
                    break
                kind, rank = head[0], int(head[1])
                if kind == "LOST":  # the tree lost it (head[2] == rank), or the node above it
                    self.procs[rank].lost_via = int(head[2])
                elif kind == "EXIT":
                    self.procs[rank].finish(int(head[2]))
                    if all(p.returncode is not None for p in self.procs.values()):
                        self._close_root()  # every node is done: node 0's agent ends
                elif kind in ("OUT", "ERR"):
                    self.procs[rank].feed(kind, node_agent.read_exact(root.stdout, int(head[2])))
                else:
                    raise ValueError(f"unknown frame {kind!r}")
        except (ValueError, EOFError, KeyError, IndexError, OSError) as e:
            why = f"node 0's frames broke off: {e}"
        rc = root.wait()
        reader.join(5)
        tail = (errs[0] if errs else b"").decode(errors="replace").strip().splitlines()
        why = why or (tail[-1] if tail else f"its session ended (exit {rc})")
        for rank, proc in self.procs.items():
            if proc.returncode is None:
                if rc == 255 or rank != self.head.rank:
                    proc.lost_via = self.head.rank
                if rank != self.head.rank:
                    proc.feed(
                        "ERR", f"not reached: {self.head.label}, which passes the launch on, failed: {why}\n".encode()
                    )
                else:
                    proc.feed("ERR", f"{why}\n".encode())
                proc.finish(255 if rc == 255 or rank != self.head.rank else rc)


def keep_specs(cluster: Cluster, config: LaunchConfig) -> dict[int, dict]:
    """What each node that keeps its output gets in its part (node_agent.Keep), by rank: the
    nodes `config.output` does not show live (none under all, or without --output)."""
    if config.output in (None, "all"):
        return {}
    live = LiveFilter(config.output, len(cluster.nodes)).live
    reads = launch_reads()
    return {
        n.rank: {
            "log": f"{config.job_id}/node-{n.rank}.log",
            "up": reads,
            "sample": config.progress,
            "every": SAMPLE_EVERY_S,
            "tail": TAIL_LINES,
            "marker": EXIT_MARKER,
        }
        for n in cluster.nodes
        if not live(n.rank)
    }


def tree_for(cluster: Cluster, config: LaunchConfig, transport: Transport | None = None) -> TreeLaunch | None:
    """The tree one launch of `config` goes down (`config.fanout`), or None: the star (no
    --fanout, --local, a dry run). A launch's sessions are its own: one per Launch."""
    if not config.fanout or cluster.local or config.dry_run:
        return None
    transport = transport or make_transport(cluster, config.ssh)
    keys = ensure_keys(cluster, transport)
    return TreeLaunch(cluster, transport, config.fanout, keys, keep_specs(cluster, config), config.run_dir, pipes=False)


def tree_line(cluster: Cluster, fanout: int) -> str:
    """What a dry run says about the tree: who passes the launch on to whom."""
    tree = forwarding_tree(cluster.nodes[0].rank, [n.rank for n in cluster.nodes[1:]], fanout)
    parts = [f"{p} -> {','.join(map(str, c))}" for p, c in tree.items() if c]
    return f"down a tree from node 0, fan-out {fanout} (this machine opens node 0's session only): " + "; ".join(parts)


def kept_line(cluster: Cluster, config: LaunchConfig) -> str | None:
    """What a dry run says about the nodes that keep their output (keep_specs), or None."""
    kept = keep_specs(cluster, config)
    if not kept:
        return None
    which = "every node" if len(kept) == len(cluster.nodes) else f"{len(kept)} of {len(cluster.nodes)} nodes"
    return (
        f"--output {config.output}: {which} keep their output on the node (~/.gpufleet/logs/{config.job_id}/"
        f"node-RANK.log), sending up what the launch reads; launch logs {config.job_id} reads it"
    )
