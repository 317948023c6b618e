"""How this machine reaches a cluster's nodes: straight to their addresses, or through an IAP
tunnel (https://cloud.google.com/iap/docs/using-tcp-forwarding) when they have no external
address and this machine is not in their VPC. Decided once per command, the same way every time:

- `--iap` / `--no-iap` decide it (`--no-iap`: a VPN or a peered network reaches the internal
  addresses);
- a cluster that is not Compute Engine instances by name (a hostfile, `--local`), `--external-ip`
  with every node's external address, or the user's own ProxyCommand/ProxyJump: straight;
- otherwise straight when this machine is in the nodes' network: its routing table has a route to
  node 0's internal address other than the default route (a connected subnet, a VPN's route), or
  the metadata server says this VM has a network interface on node 0's subnet (a VM in their VPC:
  the controller VM, a workstation VM); else through IAP, said once.

The metadata server is asked as google-auth asks it: `$GCE_METADATA_HOST` (default
metadata.google.internal), header `Metadata-Flavor: Google`,
/computeMetadata/v1/instance/network-interfaces/?recursive=true, a JSON list with each
interface's `ip`, `subnetmask` and `network`
(https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys)."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import struct
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from launcher.core.types import Cluster

__all__ = ["Reach", "decide_reach", "routed_directly", "metadata_subnets", "ROUTE_TABLE", "METADATA_HOST_ENV"]

log = logging.getLogger("launcher")

ROUTE_TABLE = Path("/proc/net/route")  # Linux's IPv4 routing table (proc(5), /proc/net/route)
METADATA_HOST_ENV = "GCE_METADATA_HOST"  # google-auth's override of the metadata server's host
_METADATA_PATH = "/computeMetadata/v1/instance/network-interfaces/?recursive=true"
_METADATA_TIMEOUT_S = 1.0  # google-auth's own metadata ping waits about as long off Compute Engine


@dataclass(frozen=True)
class Reach:
    """`iap`: every node through an IAP tunnel; `why`: the line that says so (None when straight
    or when the user asked for it with --iap)."""

    iap: bool
    why: str | None = None


def _proxied(ssh_options: tuple[str, ...]) -> bool:
    keys = {o.split("=", 1)[0].strip().lower() for o in ssh_options}
    return bool(keys & {"proxycommand", "proxyjump"})


def decide_reach(
    cluster: Cluster, iap: bool | None, external_ip: bool = False, ssh_options: tuple[str, ...] = ()
) -> Reach:
    """Whether the command goes through IAP (see the module's docstring for the rule)."""
    if iap is not None or cluster.local:
        return Reach(bool(iap))
    if not cluster.nodes or not all(n.name for n in cluster.nodes) or _proxied(ssh_options):
        return Reach(False)
    if external_ip and all(n.host != n.address for n in cluster.nodes):
        return Reach(False)  # --external-ip, and every node has one
    head = cluster.nodes[0].address
    if routed_directly(head) or _on_subnet(head, metadata_subnets()):
        return Reach(False)
    why = (
        f"{cluster.name}: the nodes have no external address and this machine is not in their VPC, so "
        "each connection goes through an IAP tunnel (`gcloud compute start-iap-tunnel`); --no-iap for a VPN "
        "or peered network"
    )
    return Reach(True, why)


def _on_subnet(address: str, nets: list[ipaddress.IPv4Network]) -> bool:
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return False
    return any(ip in net for net in nets)


def routed_directly(address: str, table: Path | None = None) -> bool:
    """Whether this machine routes `address` other than by its default route: a loopback
    address, a connected subnet, or a VPN's or peering's route. Reads Linux's /proc/net/route
    (little-endian hex destination and mask); elsewhere, or unreadable, False."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    try:
        lines = (table or ROUTE_TABLE).read_text().splitlines()[1:]
    except OSError:
        return False
    for line in lines:
        cols = line.split()
        if len(cols) < 8:
            continue
        try:
            dest, mask = (ipaddress.IPv4Address(struct.pack("<I", int(c, 16))) for c in (cols[1], cols[7]))
        except (ValueError, struct.error):
            continue
        if int(mask) == 0:  # the default route: it leads anywhere, which proves nothing
            continue
        if ipaddress.IPv4Network(f"{dest}/{mask}", strict=False).supernet_of(ipaddress.IPv4Network(f"{ip}/32")):
            return True
    return False


def metadata_subnets(host: str | None = None) -> list[ipaddress.IPv4Network]:
    """The subnets of this VM's network interfaces as the Compute Engine metadata server gives
    them (`ip` and `subnetmask` of each); [] off Compute Engine (no metadata server answers)."""
    host = host or os.environ.get(METADATA_HOST_ENV) or "metadata.google.internal"
    req = urllib.request.Request(f"http://{host}{_METADATA_PATH}", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=_METADATA_TIMEOUT_S) as resp:
            if resp.headers.get("Metadata-Flavor") != "Google":
                return []  # something else answered (a captive portal): not a metadata server
            interfaces = json.loads(resp.read())
    except (OSError, urllib.error.URLError, socket.timeout, ValueError):
        return []
    nets = []
    for nic in interfaces if isinstance(interfaces, list) else []:
        try:
            nets.append(ipaddress.IPv4Network(f"{nic['ip']}/{nic['subnetmask']}", strict=False))
        except (KeyError, TypeError, ValueError):
            continue
    return nets
