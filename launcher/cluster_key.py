"""The cluster key (issue 13): how node 0's controller reaches every node, itself included.

- The key is made once per cluster on the client (ed25519, `ssh-keygen`), kept under the
  client's state directory (`~/.cache/gpufleet/<cluster>/id_ed25519`, mode 600).
- The check session of a detached launch authorizes its public key on every node, restricted
  with `from=` to the cluster's addresses (sshd(8), AUTHORIZED_KEYS FILE FORMAT), and reads each
  node's host key over that same, already-verified session (`ssh-keyscan` of the node's own sshd,
  run on the node). Node 0's known_hosts is made from those answers: the controller checks host
  keys for real (StrictHostKeyChecking=yes), with no first-use trust inside the cluster.
- The private key goes to node 0 only (launcher.handoff), mode 600.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
from pathlib import Path

from launcher.model import Cluster, Node, SshConfig, UserError
from launcher.preflight import Probe
from launcher.transport import Transport, state_dir

__all__ = ["cluster_slug", "ensure_key", "ssh_target", "authorize_statements", "known_hosts_text",
           "controller_ssh", "NODE_KEY_DIR"]

# Where node 0 keeps the cluster's private key and known_hosts, relative to its home.
NODE_KEY_DIR = ".gpufleet/clusters"


def cluster_slug(cluster: Cluster) -> str:
    """The cluster's name plus a short hash of (name, project, zone), as the client's known_hosts
    file is named (launcher.transport)."""
    key = hashlib.sha256(f"{cluster.name}|{cluster.project}|{cluster.zone}".encode()).hexdigest()[:10]
    return f"{cluster.name}-{key}"


def ensure_key(cluster: Cluster) -> Path:
    """The cluster's private key on the client, made on first use (its directory mode 700, the
    key mode 600, as ssh-keygen writes it)."""
    d = state_dir() / cluster_slug(cluster)
    key = d / "id_ed25519"
    if key.exists() and key.with_name("id_ed25519.pub").exists():
        return key
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    d.chmod(0o700)
    r = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpufleet-{cluster_slug(cluster)}",
                        "-f", str(key)], capture_output=True, text=True, input="n\n")
    if r.returncode != 0 or not key.exists():
        raise UserError(f"cannot make the cluster key {key}: {r.stderr.strip() or 'ssh-keygen failed'}; nothing "
                        "was started. Check that ssh-keygen is installed and the directory is writable")
    key.chmod(0o600)
    return key


def ssh_target(transport: Transport, node: Node) -> tuple[str | None, int]:
    """The user and port the client's ssh uses for `node` (`ssh -G`), which node 0 uses too."""
    try:
        out = subprocess.run([*transport.ssh_base, "-G", node.host], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    conf = dict(line.partition(" ")[::2] for line in out.splitlines())
    port = int(conf.get("port", "22") or 22)
    return conf.get("user") or None, port


def authorize_statements(public_key: str, cluster: Cluster, node: Node, port: int) -> list[str]:
    """Node-side statements for the check session: authorize the cluster key (once; from the
    cluster's addresses only), and print the node's host keys as `hostkeyN=TYPE KEY` lines."""
    kind, b64 = public_key.split()[:2]
    addresses = ",".join(sorted({n.address for n in cluster.nodes}))
    entry = (f'from="{addresses}",no-agent-forwarding,no-port-forwarding,no-X11-forwarding,no-pty '
             f"{kind} {b64} gpufleet-{cluster_slug(cluster)}")
    e = shlex.quote(entry)
    return [
        '( umask 077; mkdir -p "$HOME/.ssh" && K="$HOME/.ssh/authorized_keys" && touch "$K" && '
        f'{{ grep -qxF {e} "$K" || printf "%s\\n" {e} >> "$K"; }} )',
        f"ssh-keyscan -T 5 -p {int(port)} {shlex.quote(node.host)} 2>/dev/null | "
        "awk '!/^#/ && NF >= 3 {n++; print \"hostkey\" n \"=\" $2 \" \" $3}'",
    ]


def known_hosts_text(cluster: Cluster, probes: dict[int, Probe], port: int) -> str:
    """Node 0's known_hosts: every node's host keys as its own sshd presented them."""
    lines, missing = [], []
    for node in cluster.nodes:
        keys = [v for k, v in sorted(probes[node.rank].facts.items()) if k.startswith("hostkey")]
        if not keys:
            missing.append(node.label)
        host = node.host if port == 22 else f"[{node.host}]:{port}"
        lines += [f"{host} {k}" for k in keys]
    if missing:
        raise UserError(f"could not read the SSH host key of {', '.join(missing)} (ssh-keyscan on the node); "
                        "nothing was started. Install openssh-client there, or launch without --detach")
    return "\n".join(lines) + "\n"


def controller_ssh(user: str | None, port: int, slug: str) -> SshConfig:
    """How node 0 reaches the nodes: the cluster key and known_hosts (paths relative to node 0's
    home), host keys checked strictly, no connection sharing (each session is its own, so a
    killed controller's sessions all end with it)."""
    options = ["StrictHostKeyChecking=yes", "IdentitiesOnly=yes", "GlobalKnownHostsFile=/dev/null",
               "UpdateHostKeys=no", "ControlMaster=no", "ControlPath=none"]
    if port != 22:
        options.append(f"Port={port}")
    return SshConfig(user=user, key=Path(NODE_KEY_DIR, slug, "id_ed25519"), options=tuple(options),
                     known_hosts=Path(NODE_KEY_DIR, slug, "known_hosts"))
