"""The nodes: finding them (a hostfile, stack outputs, a label), ordering their ranks by where they
physically sit, the cluster key the controller reaches them with, starting stopped VMs, and
following a VM that came back at another address (its host keys from the Compute Engine API)."""

from __future__ import annotations

from launcher.cluster.discovery import (
    cluster_from_outputs,
    discover_by_label,
    local_cluster,
    parse_hostfile,
    read_hostfile,
    read_outputs_file,
    read_stack,
)
from launcher.cluster.host_keys import follow_moved
from launcher.cluster.key import ensure_key, ssh_target
from launcher.cluster.restart_vms import start_terminated
from launcher.cluster.topology import rank_order, spread_warning

__all__ = [
    "cluster_from_outputs",
    "discover_by_label",
    "ensure_key",
    "follow_moved",
    "local_cluster",
    "parse_hostfile",
    "rank_order",
    "read_hostfile",
    "read_outputs_file",
    "read_stack",
    "spread_warning",
    "ssh_target",
    "start_terminated",
]
