"""A node that came back at another address: its new address and its SSH host keys, both from the
Compute Engine API, so the controller never trusts a key on first use.

A restarted VM may come back with another address (an ephemeral external IP is released when the
VM stops: https://cloud.google.com/compute/docs/ip-addresses#ephemeraladdress). The controller's
known_hosts then has no key for it, and StrictHostKeyChecking=yes refuses it. The guest
environment publishes the VM's SSH host keys as guest attributes, namespace `hostkeys`, one entry
per key type (github.com/GoogleCloudPlatform/guest-agent, google_guest_agent/instance_setup.go;
`gcloud compute ssh` reads them the same way to fill its known_hosts), and the stack enables
guest attributes on every VM (`enable-guest-attributes`). `instances.getGuestAttributes`
(https://cloud.google.com/compute/docs/reference/rest/v1/instances/getGuestAttributes) is read
with the controller's own credentials: what the API says the VM's keys are, not what the new
address offers.

The client does the same before its first connection to a cluster whose nodes are instances
(`host_key_checking`): its known_hosts holds the keys the VMs publish and ssh checks them strictly;
a re-created VM's new published key replaces the old one, with one line saying so.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from launcher.core.types import Cluster, Node, SshConfig

__all__ = [
    "HOSTKEYS_PATH",
    "published_host_keys",
    "Moved",
    "find_moved",
    "follow_moved",
    "Trust",
    "trust_published_keys",
]

log = logging.getLogger("launcher")

# The guest attributes query path the guest environment writes host keys under.
HOSTKEYS_PATH = "hostkeys/"


def published_host_keys(client: Any, project: str, zone: str, instance: str) -> list[str]:
    """The instance's host keys as `TYPE BASE64`, from its guest attributes; [] when it published
    none (guest attributes off, or no guest environment)."""
    from google.api_core import exceptions as gexc
    from google.cloud import compute_v1

    request = compute_v1.GetGuestAttributesInstanceRequest(
        project=project, zone=zone, instance=instance, query_path=HOSTKEYS_PATH
    )
    try:
        attrs = client.get_guest_attributes(request=request)
    except gexc.NotFound:
        return []
    return [
        f"{e.key} {e.value}"
        for e in attrs.query_value.items
        if e.namespace == "hostkeys" and e.key.startswith(("ssh-", "ecdsa-")) and e.value
    ]


@dataclass(frozen=True)
class Moved:
    """A node at its new address, and the host keys the API published for it."""

    node: Node
    host_keys: tuple[str, ...]

    def known_hosts_lines(self, port: int = 22) -> list[str]:
        name = self.node.host if port == 22 else f"[{self.node.host}]:{port}"
        return [f"{name} {key}" for key in self.host_keys]


def find_moved(client: Any, project: str, zone: str, node: Node) -> Moved | None:
    """`node` at the address `instances.get` gives its instance now, with the host keys it
    published; None when its address is unchanged (or it has no instance name). An SSH host that
    was the external IP stays an external IP; an internal one stays internal. A node that moved
    but published no keys is returned with none: the caller must not reach it."""
    if not node.name:
        return None
    inst = client.get(project=project, zone=zone, instance=node.name)
    nic = inst.network_interfaces[0] if inst.network_interfaces else None
    internal = nic.network_i_p if nic else ""
    external = nic.access_configs[0].nat_i_p if nic and nic.access_configs else ""
    by_external = node.host != node.address
    host = (external if by_external and external else internal) or node.host
    if not internal or (host == node.host and internal == node.address):
        return None
    keys = tuple(published_host_keys(client, project, zone, node.name))
    moved = replace(node, host=host, address=internal)
    log.warning(
        "instance %s moved from %s to %s; %s",
        node.name,
        node.host,
        host,
        f"{len(keys)} host key(s) read from its guest attributes" if keys else "it published no host keys",
    )
    return Moved(moved, keys)


def follow_moved(client: Any, cluster: Cluster, ranks: Iterable[int], known_hosts: Path, port: int = 22) -> Cluster:
    """`cluster` with each of `ranks`' nodes (the unreachable ones) at its instance's address now,
    where it moved and published its host keys; those keys are appended to `known_hosts` (the
    job's own file) under the new address first. A node that moved without publishing keys, or
    that the API cannot tell about, stays where it was: the next check names it."""
    if not (cluster.project and cluster.zone):
        return cluster
    nodes = list(cluster.nodes)
    for rank in ranks:
        try:
            moved = find_moved(client, cluster.project, cluster.zone, nodes[rank])
        except Exception as e:  # the API or the network: the wait goes on, as for a restart
            log.warning("instance %s: its address could not be read: %s: %s", nodes[rank].name, type(e).__name__, e)
            continue
        if moved is None or not moved.host_keys:
            continue
        with open(known_hosts, "a") as f:
            f.write("".join(line + "\n" for line in moved.known_hosts_lines(port)))
        nodes[rank] = moved.node
    return replace(cluster, nodes=tuple(nodes))


# ---- the client: known_hosts seeded from what the VMs publish, before the first connection ----


@dataclass(frozen=True)
class Trust:
    """How the client's ssh checks a cluster's host keys (SshConfig.host_key_checking), and the
    lines to tell the user (a replaced key, nodes that published none)."""

    checking: str
    said: tuple[str, ...] = ()


def _entry(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _recorded(known: Path, entry: str) -> set[str]:
    """`TYPE BASE64` of every key known_hosts holds for `entry`, hashed entries included
    (`ssh-keygen -F`, ssh-keygen(1))."""
    if not known.exists():
        return set()
    r = subprocess.run(["ssh-keygen", "-F", entry, "-f", str(known)], capture_output=True, text=True)
    out = set()
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and not line.startswith("#"):
            out.add(f"{parts[1]} {parts[2]}")
    return out


def _forget(known: Path, entry: str) -> None:
    """Remove every key known_hosts holds for `entry` (`ssh-keygen -R`; it keeps KNOWN.old)."""
    subprocess.run(["ssh-keygen", "-R", entry, "-f", str(known)], capture_output=True, text=True)


def trust_published_keys(client: Any, cluster: Cluster, known: Path, port: int = 22) -> Trust:
    """Seed `known` (the client's known_hosts for `cluster`) with the host keys each node's VM
    publishes in its guest attributes, read through the Compute Engine API before the first
    connection: then ssh checks them strictly ("yes"), never trusting a first offer. A key
    recorded that the VM no longer publishes (a destroyed and re-created VM has new keys) is
    replaced, with one line saying so. Where a host has no instance name, or its VM publishes no
    keys, the cluster stays on trust on first use ("accept-new"), and a line names those hosts."""
    hosts = [(n.label, n.host, n.name) for n in cluster.nodes]
    if cluster.controller is not None:
        c = cluster.controller
        hosts.append((c.label, c.host, c.name))
    named = [h for h in hosts if h[2]]
    with ThreadPoolExecutor(max_workers=min(16, len(named) or 1)) as pool:
        published = dict(
            zip(
                [h[2] for h in named],
                pool.map(lambda h: published_host_keys(client, cluster.project, cluster.zone, h[2]), named),
            )
        )
    known.parent.mkdir(parents=True, exist_ok=True)
    said, missing, lines = [], [], []
    for label, host, name in hosts:
        keys = published.get(name) if name else None
        if not keys:
            missing.append(label)
            continue
        entry = _entry(host, port)
        have = _recorded(known, entry)
        if have and not have <= set(keys):
            _forget(known, entry)
            have = set()
            said.append(
                f"{label}: instance {name} has a new host key (the VM was re-created); replaced it in {known} with "
                "the keys its guest attributes publish"
            )
        lines += [f"{entry} {k}" for k in keys if k not in have]
    if lines:
        with open(known, "a") as f:
            f.write("".join(line + "\n" for line in lines))
    if missing:
        said.append(
            f"{', '.join(missing)}: no host keys published in guest attributes (no instance name, or guest "
            "attributes off); trusting their keys on first use (StrictHostKeyChecking=accept-new)"
        )
        return Trust("accept-new", tuple(said))
    return Trust("yes", tuple(said))


def host_key_checking(cluster: Cluster, ssh: SshConfig, api_endpoint: str | None = None) -> str:
    """How ssh checks `cluster`'s host keys (StrictHostKeyChecking), its known_hosts ready before
    the first connection. A cluster whose nodes are instances (a stack, outputs with a project and
    zone, --label): "yes", with the keys their guest attributes publish (trust_published_keys);
    what changed is logged, one line each. Others (a hostfile) trust on first use, which the
    transport says once. `--ssh-option StrictHostKeyChecking|UserKnownHostsFile`: the user's
    choice, untouched. An API that cannot be asked (credentials, the network): one warning, and
    trust on first use."""
    from launcher.cluster.restart_vms import instances_client
    from launcher.core.transport import known_hosts_path, user_decides_host_keys

    if user_decides_host_keys(ssh) or not (cluster.project and cluster.zone):
        return ssh.host_key_checking
    known = known_hosts_path(cluster, ssh.known_hosts)
    ports = [int(opt.split("=", 1)[1]) for opt in ssh.options if opt.lower().startswith("port=")]
    try:
        trust = trust_published_keys(instances_client(api_endpoint), cluster, known, ports[0] if ports else 22)
    except Exception as e:  # no credentials, no network, no permission: say so, trust on first use
        first = (str(e).splitlines() or [""])[0]
        log.warning(
            "the nodes' host keys could not be read from the Compute Engine API (%s: %s); trusting them on "
            "first use (StrictHostKeyChecking=accept-new)",
            type(e).__name__,
            first,
        )
        return ssh.host_key_checking
    for line in trust.said:
        log.warning("%s", line)
    return trust.checking
