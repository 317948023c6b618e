"""How content travels among the nodes: a forwarding tree from node 0, and the relay key that
lets a node pass content on to its children without holding the cluster key.

The tree. The launching machine sends each object once, to node 0. Node 0 passes it on to at
most `fanout` nodes, each of them to `fanout` more, breadth first by rank, so 16 nodes at
fan-out 4 are two levels deep and node 0 sends 4 copies, not 15 (a star: fan-out N-1). Each
node passes an object on chunk by chunk as the chunks arrive (launcher.code.node_agent,
`Forward`), so a level costs a chunk's delay, not an object's. An edge carries exactly the
objects its child lacks: every node in the tree lacks something, its parent ends up holding
the whole request, and what a child already holds it passes on from its own store.

The relay key. A node deeper than node 0 has to authenticate to its children. The choices:
- the cluster key (launcher.cluster.key) on every interior node: it opens a shell on every node
  of the cluster, so a quarter of the fleet would hold a key that today only node 0 holds, and
  only for a detached job;
- agent forwarding from node 0: the cluster key's authorized entry says no-agent-forwarding,
  and a forwarded agent lends the same shell-on-every-node power to every interior node while
  the transfer lasts;
- an intra-cluster key that every node has from the stack: infra/ installs none (nodes log in
  through OS Login, `enable-oslogin`: a person's own account, no key a node holds).
So a key of its own per cluster, the relay key (`~/.cache/gpufleet/CLUSTER/relay_ed25519`),
authorized on every node by the preparation's first round (which already runs there) with
`restrict` (no forwarding, no pty, no ~/.ssh/rc), `from=` the cluster's addresses, and a
forced command: this version of the node agent, by the hash it is stored under, with the
cluster's nodes as its only destinations (`python3 -I -S .gpufleet/objects/SHA relay PORT
USER@ADDRESS,...`; sshd(8), AUTHORIZED_KEYS FILE FORMAT; -I: no script directory, user site
or PYTHON* variable on sys.path). Whoever holds it can only hand a node objects (each checked
against its hash) and ask it to pass objects on to those nodes, by their internal addresses,
on that port; never run a command, and never reach another host (the node refuses the plan
before it opens any ssh). The relay key travels only to node 0 and the
interior nodes, with the known_hosts the launching machine verified (host keys checked
strictly: no first-use trust), and is removed when the relay ends.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
import shlex
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpufleet.replica import PEER_NAME, python_argv
from launcher.code import node_agent
from launcher.core.transport import cluster_slug
from launcher.core.types import Cluster, UserError

__all__ = [
    "DEFAULT_FANOUT",
    "AGENT_SHA",
    "RELAY_VERSION",
    "forwarding_tree",
    "depth",
    "hops",
    "peers_arg",
    "relay_plan",
    "hop_entry",
    "relay_known_hosts",
    "source_addresses",
    "authorize_relay",
    "authorize_replica",
    "replica_command",
]

DEFAULT_FANOUT = 4

# The hash the node agent stores its own source under (node_agent.keep_own_source): the exact
# text `python3 -I -S -c` receives (launcher.code.prepare.agent_script).
AGENT_SHA = hashlib.sha256(Path(node_agent.__file__).read_text().encode()).hexdigest()


def forwarding_tree(root: int, others: Iterable[int], fanout: int) -> dict[int, list[int]]:
    """Each rank's children: `root` first, then breadth first, each parent taking up to `fanout`
    children in rank order (rank i's parent is the (i-1)//fanout-th of the order)."""
    if fanout < 1:
        raise ValueError(f"fan-out {fanout} must be at least 1")
    order = [root, *sorted(others)]
    children: dict[int, list[int]] = {rank: [] for rank in order}
    for i, rank in enumerate(order[1:], start=1):
        children[order[(i - 1) // fanout]].append(rank)
    return children


def depth(tree: Mapping[int, list[int]], root: int) -> int:
    """Levels below the root (a star: 1)."""
    below = tree.get(root, [])
    return 1 + max(depth(tree, c) for c in below) if below else 0


def hops(cluster: Cluster, user: str | None) -> dict[int, tuple[str | None, str]]:
    """Each node's (user, address) as another node reaches it: its internal address, never the
    name or external address this machine connects to, and its hostfile line's own user
    (`user@10.0.0.3`), else `user` (this machine's ssh user for node 0)."""
    out = {}
    for node in cluster.nodes:
        named, at, _ = node.host.rpartition("@")
        out[node.rank] = (named if at else user, node.address)
    return out


def peers_arg(targets: Mapping[int, tuple[str | None, str]]) -> str:
    """The destinations a relay may reach (node_agent.relay's PEERS): `USER@ADDRESS,...`. Each
    is a plain user and address: the list goes into the forced command's shell line unquoted."""
    peers = sorted({f"{u}@{a}" if u else a for u, a in targets.values()})
    for peer in peers:
        if not PEER_NAME.fullmatch(peer):
            raise UserError(
                f"{peer!r} is not a user and an address the relay key can be limited to; use plain user "
                "names (letters, digits, '.', '_', '-') and addresses"
            )
    return ",".join(peers)


def hop_entry(rank: int, targets: Mapping[int, tuple[str | None, str]], port: int) -> dict:
    """Where a hop goes, as node_agent reads it (`destination`, `relay_argv`): the node's rank, its
    internal address, the port and its user."""
    user, address = targets[rank]
    return {"rank": rank, "host": address, "port": port, "user": user}


def relay_plan(
    tree: Mapping[int, list[int]],
    root: int,
    missing: Mapping[int, list[str]],
    targets: Mapping[int, tuple[str | None, str]],
    port: int,
) -> list[dict]:
    """The root's FWD frame (node_agent.relay): each child with the objects it lacks and its
    own children, nested."""

    def hop(rank: int) -> dict:
        return {
            **hop_entry(rank, targets, port),
            "objects": sorted(missing[rank]),
            "children": [hop(c) for c in tree[rank]],
        }

    return [hop(c) for c in tree[root]]


def relay_known_hosts(cluster: Cluster, keys: Mapping[int, list[str]], port: int) -> str:
    """The known_hosts a relay checks its children with: each node's host keys as this machine
    verified them (launcher.cluster.key.verified_host_keys), under the internal address the hop
    goes to (`[ADDRESS]:PORT` off port 22, as ssh writes it: sshd(8), SSH_KNOWN_HOSTS FILE FORMAT)."""
    lines, missing = [], []
    for node in cluster.nodes:
        name = node.address if port == 22 else f"[{node.address}]:{port}"
        lines += [f"{name} {k}" for k in keys.get(node.rank, [])]
        if not keys.get(node.rank):
            missing.append(node.label)
    if missing:
        raise UserError(
            f"the host key of {', '.join(missing)} is not in this machine's known_hosts files, so the node "
            "passing content on to it could not check it; nothing was started. Connect to it once, or pass "
            "--known-hosts"
        )
    return "\n".join(lines) + "\n"


def source_addresses(cluster: Cluster) -> list[str]:
    """The nodes' addresses for `from=`: an address as it is, a host name resolved here, since
    sshd matches `from=` host names only with `UseDNS yes`, which is not its default
    (sshd_config(5), UseDNS)."""
    out: set[str] = set()
    for node in cluster.nodes:
        try:
            out.add(str(ipaddress.ip_address(node.address)))
            continue
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(node.address, None, proto=socket.IPPROTO_TCP)
        except OSError:
            raise UserError(
                f"{node.label}: its address {node.address!r} does not resolve here, and the relay key is "
                "authorized from addresses only; give the nodes' addresses in the hostfile"
            ) from None
        out.update(str(info[4][0]) for info in infos)
    return sorted(out)


# The relay key's forced command runs the agent through this bootstrap (argv: SHA, then the
# agent's own arguments). It checks the stored copy against its hash first: a copy cut short by a
# full disk, or changed, is never run. Asked for a launch (`tree`), it asks the node passing the
# launch on for the agent's source instead (a line `AGENT?`; node_agent.Hop answers `AGENT SIZE`
# and the source, which runs the same version), checks what came against the hash, stores it and
# runs it: the copy is fetched again. Asked for content (`relay`), it refuses in one line (the
# preparation's first round, which runs the agent from its source, stores it again). The agent's
# compiled code is kept beside it (`SHA.cpython-311`: the sha256 of the interpreter's version and
# marshal's bytes, then those bytes), so a node spends a launch no compile of its 67 KB (11 ms of
# CPU each, every node of every tree launch); a cache cut short or changed, or written by
# another Python (an upgraded one too), is compiled again.
_BOOT = """import hashlib,marshal,os,sys
h=sys.argv[1]
p=os.path.join(os.path.expanduser('~'),'.gpufleet','objects',h)
s=open(p,'rb').read() if os.path.isfile(p) else b''
if hashlib.sha256(s).hexdigest()!=h:
    if os.environ.get('SSH_ORIGINAL_COMMAND')!='tree':
        sys.exit('gpufleet: the node agent '+p+' is missing or corrupt; '
                 'the next launch that prepares this node stores it again')
    sys.stdout.write('AGENT?\\n')
    sys.stdout.flush()
    w=sys.stdin.buffer.readline().split()
    s=sys.stdin.buffer.read(int(w[1])) if len(w)==2 and w[0]==b'AGENT' and w[1].isdigit() else b''
    if hashlib.sha256(s).hexdigest()!=h:
        sys.exit('gpufleet: the node agent sent to replace '+p+' does not match its hash')
    os.umask(0o77)
    os.makedirs(os.path.dirname(p),exist_ok=True)
    t=p+'.boot-'+str(os.getpid())
    with open(t,'wb') as f:
        f.write(s)
    os.chmod(t,0o444)
    os.replace(t,p)
c=p+'.'+sys.implementation.cache_tag
v=sys.version.encode()
try:
    b=open(c,'rb').read()
    o=marshal.loads(b[32:]) if hashlib.sha256(v+b[32:]).digest()==b[:32] else None
except Exception:
    o=None
if o is None:
    o=compile(s,p,'exec')
    b=marshal.dumps(o)
    t=c+'.boot-'+str(os.getpid())
    try:
        with open(os.open(t,os.O_WRONLY|os.O_CREAT|os.O_EXCL,0o400),'wb') as f:
            f.write(hashlib.sha256(v+b).digest()+b)
        os.replace(t,c)
    except OSError:
        pass
sys.argv=[p]+sys.argv[2:]
exec(o)
"""


# What the relay key's authorized_keys entry runs: this agent through this bootstrap. Keys set
# under another (launcher.code.launch_tree.ensure_keys) are set again, and the entry with them.
RELAY_VERSION = hashlib.sha256(f"{AGENT_SHA}\0{_BOOT}".encode()).hexdigest()


def relay_command(port: int, peers: str) -> str:
    """The relay key's forced command: this agent version (AGENT_SHA) through the bootstrap,
    `relay PORT PEERS`. The bootstrap travels as base64 (no quote or `$` for the shell sshd runs
    the command with, none for authorized_keys' `command="..."`)."""
    boot = base64.b64encode(_BOOT.encode()).decode()
    return (
        f"exec python3 -I -S -c \\\"import base64;exec(base64.b64decode('{boot}'))\\\" {AGENT_SHA} relay {port} {peers}"
    )


def authorize_relay(
    public_key: str, cluster: Cluster, targets: Mapping[int, tuple[str | None, str]], port: int = 22
) -> str:
    """A node-side statement: authorize the relay key, its forced command this agent version's
    `relay PORT PEERS` (the cluster's nodes are all it can reach). The entry is keyed by the key
    itself: an entry of the same key that differs (another agent version, other addresses) is
    replaced, since sshd uses the first entry that matches a key, and another machine's relay
    key (another laptop of the same account) is left alone. authorized_keys is edited in place
    under flock(1), so concurrent launches neither lose each other's entries nor turn a
    symlinked file into a plain one."""
    addresses = ",".join(source_addresses(cluster))
    command = relay_command(port, peers_arg(targets))
    return _authorize(
        public_key, f'from="{addresses}",restrict,command="{command}"', f"gpufleet-relay-{cluster_slug(cluster)}"
    )


def replica_command(code: str) -> str:
    """The replica key's forced command: gpufleet.replica's `receive` from gpufleet's code as the
    preparation placed it (`code`: .gpufleet/snap/HASH, from the home directory sshd runs it in),
    in the node's python3,
    isolated (-I -S: the standard library and that directory only on sys.path)."""
    if not _PATH.fullmatch(code):
        raise UserError(f"{code!r} is not a plain path gpufleet's code can be run from on the nodes")
    return "exec " + shlex.join([*python_argv(code), "receive"])


def authorize_replica(public_key: str, cluster: Cluster, code: str) -> str:
    """A node-side statement: authorize the cluster's replica key (launcher.code.prepare
    REPLICA_KEY), `restrict`ed, `from=` the cluster's addresses, its forced command
    `replica_command`: whoever holds it can hand this node one checkpoint rank directory for its
    peer area (gpufleet.replica.receive checks every name and hash), and nothing else: no shell,
    no forwarding, no other path. Every node holds the private key (each one sends its own
    ranks' copies to the next), so it gives no node more than that over another."""
    addresses = ",".join(source_addresses(cluster))
    options = f'from="{addresses}",restrict,command="{replica_command(code)}"'
    return _authorize(public_key, options, f"gpufleet-replica-{cluster_slug(cluster)}")


_PATH = re.compile(r"(?!.*\.\.)[A-Za-z0-9._/-]+")


def _authorize(public_key: str, options: str, tag: str) -> str:
    """The statement that puts `options KEY tag` in authorized_keys in place of any entry of the
    same key (see authorize_relay)."""
    kind, b64 = public_key.split()[:2]
    entry = shlex.quote(f"{options} {kind} {b64} {tag}")
    mine = shlex.quote(f" {kind} {b64} ")
    # grep -v's status 1 means "no line left", which is fine; 2 is an error (the file is left as it is).
    return (
        '( umask 077; mkdir -p "$HOME/.ssh" && K="$HOME/.ssh/authorized_keys" && touch "$K" && '
        'T=$(readlink -f -- "$K") && exec 9<"$T" && flock 9 || exit 1; '
        f'[ "$(grep -cF {mine} "$T")" = 1 ] && grep -qxF {entry} "$T" && exit 0; '
        'N=$(mktemp "$T.XXXXXX") || exit 1; '
        f'grep -vF {mine} "$T" > "$N"; [ $? -le 1 ] && printf "%s\n" {entry} >> "$N" && cat "$N" > "$T"; '
        'rc=$?; rm -f "$N"; exit $rc )'
    )
