"""The nodes: finding them (a hostfile, stack outputs, a label), ordering their ranks by where they
physically sit, the cluster key node 0's controller reaches them with, and starting stopped VMs."""

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
from launcher.cluster.key import ensure_key, ssh_target
from launcher.cluster.restart_vms import start_terminated
from launcher.cluster.topology import rank_order, spread_warning

__all__ = [
    "cluster_from_outputs",
    "discover_by_label",
    "ensure_key",
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
