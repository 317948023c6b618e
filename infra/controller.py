"""The controller VM: a small on-demand VM beside the nodes that runs detached jobs' controllers,
so that losing any GPU node, node 0 included, loses no job (SkyPilot runs its jobs controller on
such a VM; Slurm runs slurmctld off the compute nodes).

It holds its own service account with only what recovery needs:
- `compute.instances.get` and `.start` on each of the cluster's own nodes: the custom role the
  nodes' restart grant uses (infra/restart_grant.py), bound per instance, never on the project.
Nothing on the checkpoint bucket: the launcher never reads or writes it (the nodes' jobs do, with
the nodes' own grant). No project-level role: the controller runs no logging or monitoring agent (stock Ubuntu, and its
startup script installs none), so the nodes' logWriter/metricWriter would be unused; nor does it
pull images (artifactregistry.reader). Its logs are files the launcher reads over SSH.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpufleet.contracts import LABEL_CONTROLLER, controller_output
from infra.identity import service_account_email

__all__ = [
    "CONTROLLER_MACHINE_TYPE",
    "CONTROLLER_IMAGE",
    "CONTROLLER_BOOT_DISK_GB",
    "CONTROLLER_BOOT_DISK_TYPE",
    "controller_name",
    "controller_account_id",
    "ControllerVmArgs",
    "ControllerVm",
]

# 2 vCPUs, 8 GB: SSH sessions to every node and a sampler, no GPU work (SkyPilot's jobs
# controller is 4 vCPUs for many jobs at once). Price: gpufleet.catalog.ON_DEMAND_PRICES.
CONTROLLER_MACHINE_TYPE = "e2-standard-2"
# Ubuntu 24.04 LTS: python3.12 and apt for python3-venv (https://cloud.google.com/compute/docs/images/os-details).
CONTROLLER_IMAGE = "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64"
# The image's own minimum is 10 GB; 20 leaves room for the venv and job logs.
CONTROLLER_BOOT_DISK_GB = 20
CONTROLLER_BOOT_DISK_TYPE = "pd-balanced"


def controller_name(cluster: str) -> str:
    """`<cluster>-controller`: at most 51 characters for a 40-character cluster name (GCE: 63)."""
    return f"{cluster}-controller"


def controller_account_id(cluster: str) -> str:
    """The controller's service account ID: `<cluster>-controller`, or for a cluster name over 19
    characters its first 12, `-controller-` and a 6-character hash of the whole name (IAM: 6-30
    characters, [a-z]([-a-z0-9]*[a-z0-9])). It never equals a node account ID (`-nodes` ends those)."""
    if len(cluster) <= 19:
        return f"{cluster}-controller"
    digest = hashlib.sha256(cluster.encode()).hexdigest()[:6]
    return f"{cluster[:12].rstrip('-')}-controller-{digest}"


@dataclass(frozen=True)
class ControllerVmArgs:
    cluster: str
    project: str
    zone: str
    subnetwork: str
    """The host subnet, as a self-link path: the nodes' first NIC's (GpuNetworks.nic_targets[0])."""
    external_ip: bool
    """An ephemeral public IP on its NIC, as the nodes get one (gpufleet:externalIp)."""
    labels: dict[str, str]
    """The user's labels; LABEL_CONTROLLER is added, the cluster label is not."""
    network_tag: str
    """The nodes' tag: the cluster's SSH and internal firewall rules then cover the controller."""
    startup_script: str
    restart_role: str
    """The full name of the custom role that may get and start an instance (RestartGrant.role_name)."""
    nodes: Sequence[tuple[str, pulumi.Resource]]
    """(instance name, the Instance resource) for every node."""
    depends_on: Sequence[pulumi.Resource] = ()
    """What the VM must be created after: its subnet and the NAT its first boot downloads through."""
    grants_after: Sequence[pulumi.Resource] = ()
    """What its grants must be created after: the restart role they bind (RestartGrant.role)."""


class ControllerVm(pulumi.ComponentResource):
    """The VM, its service account and that account's grants. `output` is the `controller` stack
    output (gpufleet.contracts.controller_output, holding Outputs); `grants` the IAM bindings."""

    def __init__(self, name: str, args: ControllerVmArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gpufleet:infra:ControllerVm", name, None, opts)
        vm_name = controller_name(args.cluster)
        account_id = controller_account_id(args.cluster)
        account = gcp.serviceaccount.Account(
            f"{args.cluster}-controller",
            gcp.serviceaccount.AccountArgs(
                account_id=account_id,
                project=args.project,
                display_name=f"gpufleet {args.cluster} controller",
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        # A plain string, as the nodes' email is (infra/identity.py); ordering is explicit.
        self.email = service_account_email(account_id, args.project)
        member = f"serviceAccount:{self.email}"

        self.grants: list[pulumi.Resource] = [
            gcp.compute.InstanceIAMMember(
                f"{instance_name}-controller-restart",
                gcp.compute.InstanceIAMMemberArgs(
                    project=args.project,
                    zone=args.zone,
                    instance_name=instance_name,
                    role=args.restart_role,
                    member=member,
                ),
                opts=pulumi.ResourceOptions(parent=self, depends_on=[account, instance, *args.grants_after]),
            )
            for instance_name, instance in args.nodes
        ]

        self.instance = gcp.compute.Instance(
            vm_name,
            gcp.compute.InstanceArgs(
                name=vm_name,
                project=args.project,
                zone=args.zone,
                machine_type=CONTROLLER_MACHINE_TYPE,
                boot_disk=gcp.compute.InstanceBootDiskArgs(
                    auto_delete=True,
                    initialize_params=gcp.compute.InstanceBootDiskInitializeParamsArgs(
                        image=CONTROLLER_IMAGE,
                        size=CONTROLLER_BOOT_DISK_GB,
                        type=CONTROLLER_BOOT_DISK_TYPE,
                    ),
                ),
                network_interfaces=[
                    gcp.compute.InstanceNetworkInterfaceArgs(
                        subnetwork=args.subnetwork,
                        access_configs=(
                            [gcp.compute.InstanceNetworkInterfaceAccessConfigArgs(network_tier="PREMIUM")]
                            if args.external_ip
                            else None
                        ),
                    )
                ],
                # On-demand whatever the fleet's provisioning: a preempted controller would take
                # every detached job's controller with it. E2 VMs live-migrate on host maintenance.
                scheduling=gcp.compute.InstanceSchedulingArgs(
                    provisioning_model="STANDARD",
                    preemptible=False,
                    automatic_restart=True,
                    on_host_maintenance="MIGRATE",
                ),
                service_account=gcp.compute.InstanceServiceAccountArgs(
                    email=self.email,
                    scopes=["https://www.googleapis.com/auth/cloud-platform"],  # IAM roles, not scopes, limit it
                ),
                # Guest attributes let the laptop read the VM's SSH host keys from the Compute
                # Engine API (hostkeys/), so a new address is never trusted on first use.
                metadata={
                    "enable-oslogin": "TRUE",
                    "enable-guest-attributes": "TRUE",
                    "startup-script": args.startup_script,
                },
                labels={**args.labels, LABEL_CONTROLLER: args.cluster},
                tags=[args.network_tag],
            ),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[account, *args.depends_on]),
        )
        nic = self.instance.network_interfaces[0]
        self.output = controller_output(
            name=vm_name,
            internal_ip=nic.network_ip,
            external_ip=nic.access_configs[0].nat_ip if args.external_ip else None,
            zone=args.zone,
        )
        self.register_outputs({"controller": self.output, "email": self.email})
