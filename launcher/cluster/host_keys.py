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
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from launcher.core.types import Cluster, Node

__all__ = ["HOSTKEYS_PATH", "published_host_keys", "Moved", "find_moved", "follow_moved"]

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
