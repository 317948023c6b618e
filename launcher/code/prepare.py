"""The launcher side of a launch's preparation, run over the launch's own transport before the
launch: gpufleet's code and the --sync snapshot onto every node, and the job's Python
environment built there (launcher.code.node_agent is the node side). The result feeds the
launch through its LaunchConfig: `python` the environment's interpreter, `workdir` the job's
directory holding the snapshot, PYTHONPATH gpufleet's code, GPUFLEET_CODE the snapshot's hash.

Rounds, each on every node at once:
1. `prepare` on every node (the relay key authorized first, launcher.code.tree): each reports
   the objects it lacks, places what it has, builds the environment if missing (progress lines
   while it builds). An unchanged re-run ends here: nothing sent but the request.
2. When some node lacks content: one stream from this machine to node 0 with every object that
   node 0 lacks among those any node lacks (each file's content at most once per cluster from
   here), and the nodes pass each other what they lack down a tree from node 0 (fan-out
   `CodeRequest.fanout`, launcher.code.tree), over the cluster's own network.
3. `prepare` again on the nodes that lacked content: they place their snapshots. A node that
   still lacks content (a node above it could not pass it on) gets it from node 0 directly,
   nothing more from here; one that still lacks it after that fails the launch, named.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

from gpufleet.contracts import LOCAL_SSD_MOUNT
from launcher.cluster.key import ensure_key, ssh_target, verified_host_keys
from launcher.code import node_agent
from launcher.code.pyenv import EnvSpec
from launcher.code.snapshot import Snapshot
from launcher.code.tree import (
    AGENT_SHA,
    DEFAULT_FANOUT,
    authorize_relay,
    authorize_replica,
    depth,
    forwarding_tree,
    hops,
    peers_arg,
    relay_known_hosts,
    relay_plan,
)
from launcher.core.ssh import python_source_command
from launcher.core.stacks import PYSPY_TOOLS, PYSPY_VERSION
from launcher.core.transport import Transport, cluster_slug, make_transport
from launcher.core.types import Cluster, LaunchConfig, Node, Replication, UserError

__all__ = ["CodeRequest", "PrepareReport", "prepare", "configured", "agent_script", "run_agent", "each_node", "warm"]

log = logging.getLogger("launcher")

Progress = Callable[[Node, str], None]
PREFIX = node_agent.PREFIX
RELAY_KEY = "relay_ed25519"  # the cluster's relay key, beside its cluster key (launcher.code.tree)
# The cluster's replica key (launcher.code.tree.authorize_replica): a --recover job's nodes copy
# their local checkpoints to each other with it (gpufleet.replica).
REPLICA_KEY = "replica_ed25519"


@dataclass(frozen=True)
class CodeRequest:
    """What a launch brings to its nodes (built by the CLI from --sync, --requirements, ...)."""

    code: Snapshot | None = None  # gpufleet/ and workloads/ (launch train, nccl-tests)
    code_root: Path | None = None
    sync: Snapshot | None = None  # the --sync snapshot
    sync_root: Path | None = None
    env: EnvSpec | None = None
    fanout: int = DEFAULT_FANOUT  # each node passes content on to at most this many (N-1: a star)
    # A --recover job's nodes copy their local checkpoints to a peer (gpufleet.replica): every node
    # gets the cluster's replica key, authorized with a forced command that runs gpufleet's code.
    replicate: bool = False
    # gpufleet's code on the ranks' PYTHONPATH (launch train's workloads import it); False: it is
    # sent only for gpufleet's own processes there (the replicator round a script of the user's).
    code_on_path: bool = True

    @property
    def empty(self) -> bool:
        return self.code is None and self.sync is None and self.env is None


@dataclass
class PrepareReport:
    """What the preparation did: bytes this machine sent (requests included), objects sent to
    node 0, environments built (by rank)."""

    bytes_sent: int = 0
    objects_sent: int = 0
    object_bytes: int = 0
    passed_on: int = 0  # nodes that got content from other nodes (node 0 and the tree below it)
    levels: int = 0  # the forwarding tree's depth below node 0 (1: a star)
    resent: dict[int, str] = field(default_factory=dict)  # rank -> why node 0 sent it directly
    built: list[int] = field(default_factory=list)


def agent_script(command: str, program: ModuleType = node_agent) -> str:
    """The node's command running `program` (a standard-library-only module of launcher.code,
    node_agent unless named) from its source text."""
    return python_source_command(Path(program.__file__).read_text(), command, replace=True)


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _request(request: CodeRequest, job_id: str, stacks: bool = False) -> dict:
    """The node agent's `prepare` request; `stacks`: the launch may collect hang stacks, so a
    node whose job environment lacks py-spy gets it (launcher.core.stacks.PYSPY_TOOLS)."""
    snaps = []
    if request.code is not None:
        snaps.append({"hash": request.code.hash, "dest": f"snap/{request.code.hash}", "files": request.code.manifest()})
    if request.sync is not None:
        snaps.append(
            {"hash": request.sync.hash, "dest": f"work/{job_id}", "files": request.sync.manifest(), "copy": True}
        )
    env = tools = None
    if request.env is not None:
        mounts = list(LOCAL_SSD_MOUNT.values())
        env = request.env.request(mounts)
        if stacks:
            tools = _pyspy_tools(request.env).request(mounts)
            tools.update(key=PYSPY_TOOLS.rsplit("/", 1)[-1], program="py-spy")
    return {"snapshots": snaps, "env": env, "tools": tools}


def _pyspy_tools(env: EnvSpec) -> EnvSpec:
    """py-spy, pinned, from the job environment's own package sources (no CUDA index: py-spy's
    wheel is one binary for any Python)."""
    return replace(
        env, kind="requirements.txt", files={"requirements.txt": f"py-spy=={PYSPY_VERSION}\n"}, torch_indexes=()
    )


def run_agent(
    transport: Transport, node: Node, script: str, data: Iterable[bytes], progress: Progress, report: PrepareReport
) -> tuple[dict | None, str]:
    """Run one agent session, `data` on its stdin; its result line's JSON (None if there was
    none) and stderr's tail. A UserError the data raises (launcher.code.prepare.ChangedFile)
    ends the stream where it is and is raised once the session has ended."""
    argv = transport.argv(node, script)
    report.bytes_sent += sum(len(a) for a in argv)
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[bytes] = []
    t = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    t.start()

    failed: list[UserError] = []

    def feed() -> None:
        try:
            for chunk in data:
                report.bytes_sent += len(chunk)
                p.stdin.write(chunk)
        except (BrokenPipeError, ValueError):
            pass
        except UserError as e:  # the data itself failed (a file changed while it was sent)
            failed.append(e)
        try:
            p.stdin.close()
        except (BrokenPipeError, ValueError):
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    result = None
    for raw in p.stdout:
        line = raw.decode(errors="replace").rstrip()
        if not line.startswith(PREFIX):
            continue
        kind, _, text = line[len(PREFIX) :].strip().partition(" ")
        if kind == "progress":
            progress(node, text)
        elif kind in ("result", "received"):
            result = json.loads(text)
    p.wait()
    writer.join(timeout=5)
    t.join(timeout=5)
    if failed:
        raise failed[0]
    tail = b"".join(err).decode(errors="replace").strip().splitlines()
    return result, (tail[-1] if tail else f"exit {p.returncode}")


def each_node(nodes: list[Node], fn: Callable[[Node], object]) -> dict[int, object]:
    """`fn(node)` for every node at once, one thread each: the answers by rank."""
    out: dict[int, object] = {}

    def one(node: Node) -> None:
        out[node.rank] = fn(node)

    threads = [threading.Thread(target=one, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class ChangedFile(UserError):
    """A file sent in a snapshot no longer holds the snapshot's bytes."""


def _object_chunks(sha: str, path: Path, size: int) -> Iterator[bytes]:
    """Exactly the snapshot's `size` bytes of `path`, hashed as they go: a file that changed
    since the snapshot (other bytes, shorter, gone) raises ChangedFile after its last chunk,
    before anything else is sent. A file that only grew past `size` sends its snapshot's
    bytes, which is what the snapshot holds."""
    h, left = hashlib.sha256(), size
    why = "it changed"
    try:
        with open(path, "rb") as f:
            while left:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    why = "it is shorter now"
                    break
                h.update(chunk)
                left -= len(chunk)
                yield chunk
    except OSError as e:
        why = f"it cannot be read now: {e.strerror or e}"
    if left or h.hexdigest() != sha:
        raise ChangedFile(
            f"{path} changed after the snapshot was taken, while it was being sent ({why}); stop what "
            "writes it, or leave it out with .gpufleetignore, and launch again; nothing was started"
        )


def _frames(objects: list[str], files: dict[str, tuple[Path, int]], extra: dict[str, bytes], plan: list):
    """The `relay` stream (node_agent.relay), in chunks: the relay key and known_hosts, the
    forwarding plan (first, so node 0 passes each object on as it arrives), each object's
    snapshot bytes read from disk as they go (its header carries the snapshot's size, never a
    fresh stat), END. A changed file stops the stream before END: the node drops the object."""
    for kind, data in extra.items():
        yield f"{kind} {len(data)}\n".encode() + data
    if plan:
        text = json.dumps(plan).encode()
        yield f"FWD {len(text)}\n".encode() + text
    for sha in objects:
        path, size = files[sha]
        yield f"OBJ {sha} {size}\n".encode()
        yield from _object_chunks(sha, path, size)
    yield b"END\n"


def _fail(cluster: Cluster, errors: dict[int, str]) -> UserError:
    rank = min(errors)
    others = len(errors) - 1
    more = f" (and {others} other node{'s' * (others != 1)})" if others else ""
    return UserError(f"{cluster.nodes[rank].label}: {errors[rank]}{more}; nothing was started")


def prepare(
    cluster: Cluster,
    config: LaunchConfig,
    request: CodeRequest,
    progress: Progress = lambda node, text: None,
) -> tuple[LaunchConfig, PrepareReport]:
    """Bring `request` to every node; the LaunchConfig that runs with it, and what it cost."""
    report = PrepareReport()
    if request.empty or cluster.local or config.dry_run:
        return config, report
    transport = make_transport(cluster, config.ssh, config.dry_run)
    key = ensure_key(cluster, RELAY_KEY)
    target = ssh_target(transport, cluster.nodes[0])
    authorize = authorize_relay(
        key.with_name(f"{RELAY_KEY}.pub").read_text(), cluster, hops(cluster, target.user), target.port
    )
    req = _request(request, config.job_id, stacks=config.hang_timeout_s is not None)
    steps = [authorize]
    replication = _replica(cluster, request, target, req, steps) if request.replicate else None
    body = json.dumps(req).encode()
    script = "; ".join([*steps, agent_script("prepare")])

    def round_(nodes: list[Node]) -> dict[int, dict]:
        answers = each_node(nodes, lambda n: run_agent(transport, n, script, [body], progress, report))
        unreachable = {r: why for r, (res, why) in answers.items() if res is None}
        if unreachable:
            raise _fail(cluster, {r: f"cannot prepare the node ({why})" for r, why in unreachable.items()})
        return {r: res for r, (res, _) in answers.items()}

    results = round_(list(cluster.nodes))
    _deliver(cluster, transport, request, results, round_, report)
    errors = {r: _build_error(request, res["error"]) for r, res in results.items() if res.get("error")}
    if errors:
        raise _fail(cluster, errors)
    report.built = sorted(r for r, res in results.items() if res.get("built"))
    for r, res in sorted(results.items()):
        if res.get("tools_error"):
            log.warning(
                "%s: py-spy could not be installed (%s); a hang there is reported without its stacks",
                cluster.nodes[r].label,
                res["tools_error"],
            )
    homes = {res["home"] for res in results.values()}
    if len(homes) > 1:
        raise UserError(
            f"the nodes' home directories differ ({', '.join(sorted(homes))}), where gpufleet keeps a job's code "
            "and environment; use one user with one home on every node (--ssh-user)"
        )
    pythons = {res["python"] for res in results.values()}
    home = homes.pop()
    config = configured(config, request, home, pythons.pop() if len(pythons) == 1 else None)
    if replication is not None:
        at_home = replace(replication, code=f"{home}/{replication.code}", state=f"{home}/{replication.state}")
        config = replace(config, replication=at_home)
    return config, report


def warm(
    cluster: Cluster, config: LaunchConfig, request: CodeRequest, nodes: Iterable[Node], progress: Progress
) -> dict[int, str]:
    """`nodes` (a job's spares, once prepared) compile their environment and gpufleet's code to
    bytecode (the node agent's `warm`), at once: a swap onto one then starts as warm as the
    nodes that ran. Nothing to do without a built environment. Rank -> why, for each node that
    could not: it stays a spare, only colder (the job's check decides whether it can serve)."""
    if request.env is None or not config.python or cluster.local or config.dry_run:
        return {}
    transport = make_transport(cluster, config.ssh, config.dry_run)
    body = json.dumps({"python": config.python, "code": [request.code.hash] if request.code else []}).encode()
    answers = each_node(
        list(nodes), lambda n: run_agent(transport, n, agent_script("warm"), [body], progress, PrepareReport())
    )
    return {r: why for r, (res, why) in answers.items() if res is None}


def _replica(cluster: Cluster, request: CodeRequest, target, req: dict, steps: list[str]) -> Replication | None:
    """The cluster's replica key for a --recover job: the job's Replication (its paths still
    relative to the nodes' home), with the statement authorizing the key on a node added to
    `steps` and what the node agent keeps added to `req`: the private key and the host keys the
    nodes check each other with, as this machine verified them. None (after a warning) when
    those host keys are not known yet (a first contact trusted on first use)."""
    if request.code is None:
        return None
    try:
        rep, statement, req["replica"] = _replica_parts(cluster, request, target, hops(cluster, target.user))
    except UserError as e:
        log.warning("the local checkpoints are not copied to peer nodes this time: %s", e)
        return None
    steps.append(statement)
    return rep


def _replica_parts(cluster: Cluster, request: CodeRequest, target, targets) -> tuple[Replication, str, dict]:
    key = ensure_key(cluster, REPLICA_KEY)
    code = f".gpufleet/snap/{request.code.hash}"
    statement = authorize_replica(key.with_name(f"{REPLICA_KEY}.pub").read_text(), cluster, code)
    known = relay_known_hosts(cluster, verified_host_keys(target, cluster), target.port)
    slug = cluster_slug(cluster)
    ring = tuple((n.host, peers_arg({n.rank: targets[n.rank]})) for n in cluster.nodes)
    rep = Replication(ring=ring, port=target.port, state=f".gpufleet/replica/{slug}", code=code)
    return rep, statement, {"slug": slug, "key": key.read_text(), "known": known}


def _deliver(
    cluster: Cluster,
    transport: Transport,
    request: CodeRequest,
    results: dict[int, dict],
    round_: Callable[[list[Node]], dict[int, dict]],
    report: PrepareReport,
) -> None:
    """Rounds 2 and 3: what the nodes lack sent down the tree, then every node that lacked it
    asked again (`results` updated); a node still lacking it gets it from node 0 directly, and
    one that lacks it after that fails the launch, named."""
    missing = {r: res["missing"] for r, res in results.items() if res["missing"]}
    if not missing:
        return
    # Every node but node 0 receives through the relay key's forced command, which runs the
    # copy of the node program each stored in round 1: without it nothing can reach the node.
    why = "its python3 could not store gpufleet's node program in ~/.gpufleet/objects"
    lost = {r: why for r in missing if r != cluster.nodes[0].rank and results[r].get("agent") != AGENT_SHA}
    if lost:
        raise _fail(cluster, lost)
    failed = _send(cluster, transport, request, missing, request.fanout, report)
    results.update(round_([cluster.nodes[r] for r in sorted(missing)]))
    still = {r: res["missing"] for r, res in results.items() if res["missing"]}
    head = cluster.nodes[0].rank
    if still and head not in still:  # node 0 holds it all: it sends the starved nodes theirs
        report.resent = {r: failed.get(r, f"{len(m)} files did not arrive") for r, m in still.items()}
        failed.update(_send(cluster, transport, request, still, len(cluster.nodes), report, again=True))
        results.update(round_([cluster.nodes[r] for r in sorted(still)]))
        still = {r: res["missing"] for r, res in results.items() if res["missing"]}
    if still:
        raise _fail(
            cluster,
            {
                r: f"could not receive the job's files ({failed[r]})"
                if r in failed
                else f"{len(m)} files did not arrive"
                for r, m in still.items()
            },
        )


def _build_error(request: CodeRequest, error: str) -> str:
    if "cannot be reached" in error:
        return f"{error}; check --index-url or the stack output packageIndex"
    env = request.env
    what = env.kind if env else "the requirements"
    return f"cannot build the environment from {what}: {error}"


def configured(config: LaunchConfig, request: CodeRequest, home: str, python: str | None = None) -> LaunchConfig:
    """The launch's config with what was prepared: every node holds it at the same place (their
    homes are the same, checked above). `python`: the environment's interpreter where every node
    built the same one (envs/KEY-MARK: a later change of MARK never changes what this job runs),
    else the link envs/KEY each node points at its own. PATH and PYTHONPATH go before what --env gave (and PATH
    before the node's own: launcher.core.command prepends it)."""
    env = dict(config.env)
    add: dict[str, str] = {}
    changes: dict = {}
    prepared: list[str] = []
    if request.code is not None:
        prepared.append(f"{home}/.gpufleet/snap/{request.code.hash}")
        if request.code_on_path:
            add["PYTHONPATH"] = prepared[-1]
    snap = request.sync or (request.code if request.code_on_path else None)
    if snap is not None:
        add["GPUFLEET_CODE"] = snap.hash
    if request.sync is not None:
        changes["workdir"] = f"{home}/.gpufleet/work/{config.job_id}"
        prepared.append(changes["workdir"])
    if request.env is not None:
        venv = python.rsplit("/bin/", 1)[0] if python else f"{home}/.gpufleet/envs/{request.env.key}"
        changes["python"] = f"{venv}/bin/python"
        prepared.append(changes["python"])
        add["VIRTUAL_ENV"] = venv
        add["PATH"] = f"{venv}/bin"  # `launch exec` finds the environment's programs first
    for key in ("PATH", "PYTHONPATH"):
        if key in add and env.get(key):
            add[key] += f":{env[key]}"
    changes["env"] = tuple((k, v) for k, v in config.env if k not in add) + tuple(add.items())
    changes["prepared"] = (*config.prepared, *prepared)
    return replace(config, **changes)


def _send(
    cluster: Cluster,
    transport: Transport,
    request: CodeRequest,
    missing: dict[int, list[str]],
    fanout: int,
    report: PrepareReport,
    again: bool = False,
) -> dict[int, str]:
    """Every object some node lacks, at most once from here (to node 0), and from node 0 down
    the forwarding tree. The ranks that did not get their content, and why (as the tree saw it:
    the launch checks every node again afterwards)."""
    files: dict[str, tuple[Path, int]] = {}
    for snap, root in ((request.code, request.code_root), (request.sync, request.sync_root)):
        if snap is not None and root is not None:
            files.update({f.sha256: (root / f.path, f.size) for f in snap.files})
    head = cluster.nodes[0]
    extra: dict[str, bytes] = {}
    plan: list[dict] = []
    tree: dict[int, list[int]] = {}
    others = {r: m for r, m in missing.items() if r != head.rank}
    target = ssh_target(transport, head)
    targets = hops(cluster, target.user)
    if others:
        extra = {
            "KEY": ensure_key(cluster, RELAY_KEY).read_bytes(),
            "KNOWN": relay_known_hosts(cluster, verified_host_keys(target, cluster), target.port).encode(),
        }
        tree = forwarding_tree(head.rank, others, fanout)
        plan = relay_plan(tree, head.rank, others, targets, target.port)
        if not again:
            report.levels = depth(tree, head.rank)
    # Node 0's report covers every object of the request: what it lacks is all it needs from here
    # to place its own snapshots and to pass the others theirs.
    objects = sorted(missing.get(head.rank, []))
    data = _frames(objects, files, extra, plan)
    report.objects_sent += len(objects)
    report.object_bytes += sum(files[s][1] for s in objects)
    if not again:
        report.passed_on = len(others)
    script = agent_script(f"relay {target.port} {_quote(peers_arg(targets))}")
    result, why = run_agent(transport, head, script, data, lambda n, t: None, report)
    if result is None:
        raise UserError(f"{head.label}: could not receive the job's files ({why}); nothing was started")
    parent = {child: p for p, children in tree.items() for child in children}
    failed = {}
    for r, why in result.get("failed", {}).items():
        rank = int(r)
        by = cluster.nodes[parent.get(rank, head.rank)].label
        failed[rank] = why if why.startswith("not reached") else f"{by} could not pass it on: {why}"
    return failed
