"""What the rest of gpufleet may rely on from a fleet this program declares. Pure data, no pulumi.

The launcher reads the stack outputs (`pulumi stack output --json`) or finds instances through the
Compute Engine API by these labels, and waits for the ready marker the startup script writes.
"""

from __future__ import annotations

__all__ = ["LABEL_CLUSTER", "LABEL_NODE", "READY_MARKER", "NCCL_TESTS_DIR", "LOCAL_SSD_MOUNT", "OUTPUT_KEYS"]

# Instance labels (GCE label keys: lowercase letters, digits, '-' and '_').
LABEL_CLUSTER = "gpufleet-cluster"  # value: the cluster name
LABEL_NODE = "gpufleet-node"  # value: the node index (its rank), "0" .. "N-1"

# Written last by the startup script, atomically, on every boot once the node is usable. JSON:
# {"cluster", "node", "machine_type", "net_stack", "driver", "cuda", "nccl", "plugin", "nccl_tests",
#  "booted_at"}; a version the script could not determine is the string "unknown".
# /var/lib is writable on both Ubuntu and Container-Optimized OS (COS keeps / read-only).
READY_MARKER = "/var/lib/gpufleet/ready.json"

# nccl-tests binaries (all_reduce_perf, all_gather_perf, ...) are built here.
NCCL_TESTS_DIR = "/var/lib/gpufleet/nccl-tests/build"

# The RAID0 of the local NVMe SSDs, by image OS. Ubuntu: CTK setup-raid.yml mounts at /mnt/localssd
# (gcp-facts 4.5). COS keeps / read-only; /mnt/disks is its writable place for extra disks.
LOCAL_SSD_MOUNT = {"ubuntu": "/mnt/localssd", "cos": "/mnt/disks/localssd"}

# The stack outputs, exactly (issue 3 "Outputs").
OUTPUT_KEYS = (
    "cluster",
    "project",
    "zone",
    "machineType",
    "nodes",
    "placementPolicy",
    "networks",
    "checkpointBucket",
)
