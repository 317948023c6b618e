"""The cluster key: how node 0's controller reaches every node, itself included.

- The key is made once per cluster on the client (ed25519, `ssh-keygen`), kept under the
  client's state directory (`~/.cache/gpufleet/<cluster>/id_ed25519`, mode 600).
- The check session of a detached launch authorizes its public key on every node, restricted
  with `from=` to the cluster's addresses (sshd(8), AUTHORIZED_KEYS FILE FORMAT).
- Node 0's known_hosts holds, for every node, the host key the client's own ssh verified that
  very check session with (read back from the client's known_hosts files, hashed or not, the
  files `ssh -G` names): the controller checks host keys for real (StrictHostKeyChecking=yes),
  with no first-use trust inside the cluster, and trusts exactly what the client trusted. (Asking
  each node for its keys, `ssh-keyscan` over the session, gave the same keys but cost a handshake
  per node.)
- The private key goes to node 0 only (launcher.jobs.handoff), mode 600.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launcher.core.transport import Transport, cluster_slug, state_dir
from launcher.core.types import Cluster, Node, SshConfig, UserError

__all__ = [
    "cluster_slug",
    "ensure_key",
    "SshTarget",
    "ssh_target",
    "verified_host_keys",
    "authorize_entry",
    "known_hosts_text",
    "controller_ssh",
    "NODE_KEY_DIR",
]

# Where node 0 keeps the cluster's private key and known_hosts, relative to its home.
NODE_KEY_DIR = ".gpufleet/clusters"


def ensure_key(cluster: Cluster, name: str = "id_ed25519") -> Path:
    """The cluster's private key on the client, made on first use (its directory mode 700, the
    key mode 600, as ssh-keygen writes it). `name`: another key of the cluster's (the relay key,
    launcher.code.tree)."""
    d = state_dir() / cluster_slug(cluster)
    key = d / name
    if key.exists() and key.with_name(f"{name}.pub").exists():
        return key
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    d.chmod(0o700)
    r = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpufleet-{cluster_slug(cluster)}", "-f", str(key)],
        capture_output=True,
        text=True,
        input="n\n",
    )
    if r.returncode != 0 or not key.exists():
        raise UserError(
            f"cannot make the cluster key {key}: {r.stderr.strip() or 'ssh-keygen failed'}; nothing "
            "was started. Check that ssh-keygen is installed and the directory is writable"
        )
    key.chmod(0o600)
    return key


@dataclass(frozen=True)
class SshTarget:
    """What the client's ssh uses for a node (`ssh -G`): node 0 uses the same user and port."""

    user: str | None
    port: int
    known_hosts: tuple[str, ...]  # the user's then the global known_hosts files
    alias: str | None = None  # HostKeyAlias: the name host keys are recorded under


def ssh_target(transport: Transport, node: Node) -> SshTarget:
    try:
        out = subprocess.run([*transport.ssh_base, "-G", node.host], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    conf = dict(line.partition(" ")[::2] for line in out.splitlines())
    files = [
        os.path.expanduser(f)
        for key in ("userknownhostsfile", "globalknownhostsfile")
        for f in conf.get(key, "").split()
        if f != "/dev/null"
    ]
    alias = conf.get("hostkeyalias")
    return SshTarget(
        conf.get("user") or None,
        int(conf.get("port", "22") or 22),
        tuple(files),
        None if alias in (None, "", "none") else alias,
    )


def _known_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _host_matches(field: str, name: str) -> bool:
    """Whether a known_hosts host field names `name`: a hashed entry (`|1|salt|HMAC-SHA1`, as
    HashKnownHosts writes it, sshd(8) SSH_KNOWN_HOSTS FILE FORMAT) or a list of plain names.
    Wildcard patterns are not followed: ssh records the hosts it verified by their names."""
    if field.startswith("|1|"):
        try:
            salt, digest = field[3:].split("|")
            return hmac.compare_digest(
                hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest(), base64.b64decode(digest)
            )
        except (ValueError, binascii.Error):
            return False
    return name in field.split(",")


def verified_host_keys(target: SshTarget, cluster: Cluster) -> dict[int, list[str]]:
    """Each node's host keys (`TYPE BASE64`) as the client's known_hosts files record them, i.e.
    the keys its ssh has verified the node's sessions with (revoked and CA lines left out)."""
    entries = []
    for f in target.known_hosts:
        try:
            text = Path(f).read_text(errors="replace")
        except OSError:
            continue
        entries += [
            line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith(("#", "@"))
        ]
    entries = [e for e in entries if len(e) >= 3]
    # Plain names looked up, not compared with every node's (a known_hosts of N nodes would cost
    # N x N); a hashed entry has a salt of its own, so each is tried against each name.
    plain: dict[str, list[int]] = {}
    hashed = []
    for i, e in enumerate(entries):
        if e[0].startswith("|1|"):
            hashed.append(i)
        else:
            for name in e[0].split(","):
                plain.setdefault(name, []).append(i)
    keys: dict[int, list[str]] = {}
    for node in cluster.nodes:
        # ssh records a host by its name or address alone: no `user@`, no IPv6 brackets at port 22.
        name = _known_name(target.alias or node.host.rsplit("@", 1)[-1].strip("[]"), target.port)
        found = sorted(plain.get(name, []) + [i for i in hashed if _host_matches(entries[i][0], name)])
        keys[node.rank] = list(dict.fromkeys(f"{entries[i][1]} {entries[i][2]}" for i in found))
    return keys


def authorize_entry(public_key: str, cluster: Cluster) -> str:
    """The cluster key's authorized_keys line, which the check session adds on each node once
    (launcher.core.node_start.authorize): from the cluster's addresses only (its nodes', and its
    controller host's), no forwarding, no pty."""
    kind, b64 = public_key.split()[:2]
    controller = {cluster.controller.address} if cluster.controller else set()
    addresses = ",".join(sorted({n.address for n in cluster.nodes} | controller))
    entry = (
        f'from="{addresses}",no-agent-forwarding,no-port-forwarding,no-X11-forwarding,no-pty '
        f"{kind} {b64} gpufleet-{cluster_slug(cluster)}"
    )
    return entry


def known_hosts_text(cluster: Cluster, keys: dict[int, list[str]], port: int) -> str:
    """Node 0's known_hosts: every node's verified host keys, under the name node 0 connects to."""
    lines, missing = [], []
    for node in cluster.nodes:
        if not keys.get(node.rank):
            missing.append(node.label)
        lines += [f"{_known_name(node.host, port)} {k}" for k in keys.get(node.rank, [])]
    if missing:
        raise UserError(
            f"the host key of {', '.join(missing)} is not in this machine's known_hosts files, so node "
            "0 could not check it; nothing was started. Connect once without --detach (or pass "
            "--known-hosts) so it is recorded, then detach"
        )
    return "\n".join(lines) + "\n"


def controller_ssh(user: str | None, port: int, slug: str, known_hosts: str) -> SshConfig:
    """How node 0 reaches the nodes: the cluster key and the job's own known_hosts (paths relative
    to node 0's home; a job keeps the keys of its own nodes, whatever later jobs on a subset of
    the cluster bring), host keys checked strictly, no connection sharing (each session is its
    own, so a killed controller's sessions all end with it)."""
    options = [
        "StrictHostKeyChecking=yes",
        "IdentitiesOnly=yes",
        "GlobalKnownHostsFile=/dev/null",
        "UpdateHostKeys=no",
        "ControlMaster=no",
        "ControlPath=none",
    ]
    if port != 22:
        options.append(f"Port={port}")
    return SshConfig(
        user=user, key=Path(NODE_KEY_DIR, slug, "id_ed25519"), options=tuple(options), known_hosts=Path(known_hosts)
    )
