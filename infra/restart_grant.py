"""The nodes may start their own cluster's stopped VMs, and nothing more (least privilege).

`launch train --detach --recover` restarts a Spot node that Compute Engine stopped on preemption:
the controller calls `instances.get` and `instances.start` as the nodes' service account
(launcher.cluster.restart_vms), and reads a restarted VM's published host keys with
`instances.getGuestAttributes` (launcher.cluster.host_keys). This grants exactly those three
permissions, on exactly this cluster's instances: a custom role
(https://cloud.google.com/iam/docs/creating-custom-roles; each is listed for its method under
"IAM permissions" in https://cloud.google.com/compute/docs/reference/rest/v1/instances),
bound on each instance (instance-level IAM policy,
https://cloud.google.com/compute/docs/access/granting-access-to-resources), never on the project.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

__all__ = ["RESTART_PERMISSIONS", "restart_role_id", "RestartGrantArgs", "RestartGrant"]

# getGuestAttributes: a restarted VM's new SSH host keys, which its guest agent publishes under
# `hostkeys/` (https://cloud.google.com/compute/docs/metadata/manage-guest-attributes), so the
# controller verifies the node it reconnects to instead of trusting it on first use.
RESTART_PERMISSIONS = ("compute.instances.get", "compute.instances.start", "compute.instances.getGuestAttributes")


def restart_role_id(cluster: str) -> str:
    """The custom role's ID: `gpufleet_<cluster>_restart`, one per cluster. A role ID is
    [a-zA-Z0-9_.], 3-64 characters (IAMCustomRoleArgs.role_id); a long cluster name is cut and a
    hash of the whole name appended, so two clusters never share a role."""
    base = re.sub(r"[^a-zA-Z0-9_]", "_", cluster)
    role = f"gpufleet_{base}_restart"
    if len(role) <= 64:
        return role
    digest = hashlib.sha256(cluster.encode()).hexdigest()[:8]
    return f"gpufleet_{base[:38]}_restart_{digest}"


@dataclass(frozen=True)
class RestartGrantArgs:
    cluster: str
    project: str
    zone: str
    member: str
    """The nodes' service account, as an IAM member (`serviceAccount:EMAIL`)."""
    instances: Sequence[tuple[str, pulumi.Resource]]
    """(instance name, the Instance resource) for every node of the cluster."""


class RestartGrant(pulumi.ComponentResource):
    """The custom role, and one instance-level binding of it per node (`bindings`)."""

    def __init__(self, name: str, args: RestartGrantArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gpufleet:infra:RestartGrant", name, None, opts)
        role_id = restart_role_id(args.cluster)
        role = gcp.projects.IAMCustomRole(
            f"{args.cluster}-restart-role",
            gcp.projects.IAMCustomRoleArgs(
                project=args.project,
                role_id=role_id,
                title=f"gpufleet {args.cluster}: start a stopped node"[:100],
                description="Lets the cluster's nodes start their own stopped Spot VMs (launch --recover).",
                permissions=list(RESTART_PERMISSIONS),
                stage="GA",
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.role = role  # what another grant of the same role must be created after
        # The role's full name is fixed by the project and the ID: projects/P/roles/ID.
        self.role_name = f"projects/{args.project}/roles/{role_id}"
        self.bindings = [
            gcp.compute.InstanceIAMMember(
                f"{instance_name}-restart",
                gcp.compute.InstanceIAMMemberArgs(
                    project=args.project,
                    zone=args.zone,
                    instance_name=instance_name,
                    role=self.role_name,
                    member=args.member,
                ),
                opts=pulumi.ResourceOptions(parent=self, depends_on=[role, instance]),
            )
            for instance_name, instance in args.instances
        ]
        self.register_outputs({"role": self.role_name})
