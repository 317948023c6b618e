"""The node pool: one Compute Engine instance per node, in rank order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpufleet.contracts import node_output
from infra.config import FleetSpec

__all__ = ["scheduling_for", "NodePoolArgs", "NodePool"]


def scheduling_for(spec: FleetSpec) -> gcp.compute.InstanceSchedulingArgs:
    """Scheduling per provisioning model (pulumi-gcp 10.2.0 InstanceSchedulingArgs docstrings).

    GPUs cannot live-migrate, so every model terminates on host maintenance.
    """
    if spec.provisioning == "spot":
        # SPOT: "preemptible should be true and automatic_restart should be false". STOP keeps
        # the instance (and its Pulumi state) so `pulumi up` restarts it instead of recreating it.
        return gcp.compute.InstanceSchedulingArgs(
            provisioning_model="SPOT",
            preemptible=True,
            automatic_restart=False,
            on_host_maintenance="TERMINATE",
            instance_termination_action="STOP",
        )
    if spec.provisioning == "flex-start":
        # FLEX_START: "automatic_restart should be false and instance_termination_action should
        # be set to DELETE. A max_run_duration must also be specified".
        return gcp.compute.InstanceSchedulingArgs(
            provisioning_model="FLEX_START",
            automatic_restart=False,
            on_host_maintenance="TERMINATE",
            instance_termination_action="DELETE",
            max_run_duration=gcp.compute.InstanceSchedulingMaxRunDurationArgs(seconds=spec.max_run_hours * 3600),
        )
    # A3 Ultra / A4 in a reservation are RESERVATION_BOUND (catalog MachineType.reservation_bound).
    model = "RESERVATION_BOUND" if spec.reservation and spec.machine.reservation_bound else "STANDARD"
    return gcp.compute.InstanceSchedulingArgs(
        provisioning_model=model,
        automatic_restart=True,
        on_host_maintenance="TERMINATE",
    )


def _reservation_affinity(spec: FleetSpec) -> gcp.compute.InstanceReservationAffinityArgs | None:
    if spec.reservation is not None:
        return gcp.compute.InstanceReservationAffinityArgs(
            type="SPECIFIC_RESERVATION",
            specific_reservation=gcp.compute.InstanceReservationAffinitySpecificReservationArgs(
                key="compute.googleapis.com/reservation-name", values=[spec.reservation]
            ),
        )
    if spec.provisioning == "flex-start":
        # Flex-start VMs never consume reservations (gcloud: --reservation-affinity=none).
        return gcp.compute.InstanceReservationAffinityArgs(type="NO_RESERVATION")
    return None


@dataclass(frozen=True)
class NodePoolArgs:
    spec: FleetSpec
    nic_targets: Sequence[tuple[pulumi.Input[str], str]]
    """(subnetwork, NIC type) per interface, in NIC order (GpuNetworks.nic_targets)."""
    service_account_email: pulumi.Input[str]
    startup_script: str
    placement_policy: pulumi.Input[str] | None = None
    depends_on: Sequence[pulumi.Resource] = ()
    """Resources the nodes need before they are created: the networks (their NICs name them by
    path), NAT for the first boot's downloads, IAM grants."""


class NodePool(pulumi.ComponentResource):
    """`instances` in rank order; `nodes` is the `nodes` stack output (gpufleet.contracts
    node_output entries, holding Outputs)."""

    def __init__(self, name: str, args: NodePoolArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gpufleet:infra:NodePool", name, None, opts)
        spec = args.spec
        child = pulumi.ResourceOptions(parent=self, depends_on=list(args.depends_on))
        boot_disk = gcp.compute.InstanceBootDiskArgs(
            auto_delete=True,
            initialize_params=gcp.compute.InstanceBootDiskInitializeParamsArgs(
                image=spec.image,
                size=spec.boot_disk_size_gb,
                type=spec.machine.boot_disk_type,
            ),
        )
        scheduling = scheduling_for(spec)
        affinity = _reservation_affinity(spec)
        account = gcp.compute.InstanceServiceAccountArgs(
            email=args.service_account_email,
            scopes=["https://www.googleapis.com/auth/cloud-platform"],  # IAM roles, not scopes, limit it
        )
        # Guest attributes: the guest agent publishes the VM's SSH host keys there (hostkeys/), which the
        # controller reads through the API after a restart moved the VM (launcher.cluster.host_keys).
        metadata = {"enable-oslogin": "TRUE", "enable-guest-attributes": "TRUE", "startup-script": args.startup_script}

        # One list of NIC args shared by every node, like boot_disk: the inputs are the same.
        interfaces = [
            # stack_type stays at its default, IPV4_ONLY (github.com/GoogleCloudPlatform/cluster-toolkit
            # modules/network/multivpc's default too).
            gcp.compute.InstanceNetworkInterfaceArgs(
                subnetwork=subnet,
                nic_type=nic_type,
                access_configs=(
                    [gcp.compute.InstanceNetworkInterfaceAccessConfigArgs(network_tier="PREMIUM")]
                    if k == 0 and spec.external_ip
                    else None
                ),
            )
            for k, (subnet, nic_type) in enumerate(args.nic_targets)
        ]

        self.instances: list[gcp.compute.Instance] = []
        for i in range(spec.vm_count):  # the spares (gpufleet:spares) are the last ones
            # Guest accelerators are bundled with A2/A3/A4 types and are not declared (dstack's
            # GCP backend get_accelerators returns [] for them, github.com/dstackai/dstack). So
            # are their local SSDs:
            # "The local SSDs will be attached automatically to the following machine types"
            # (github.com/skypilot-org/skypilot sky/provision/gcp/constants.py
            # SSD_AUTO_ATTACH_MACHINE_TYPES, citing https://cloud.google.com/compute/docs/disks/
            # local-ssd#lssd_disks_fixed; every catalog type with local_ssd_count > 0 is in that list), so
            # no scratch_disks; the startup script RAIDs whatever /dev/disk/by-id shows.
            self.instances.append(
                gcp.compute.Instance(
                    f"{spec.cluster}-{i}",
                    gcp.compute.InstanceArgs(
                        name=f"{spec.cluster}-{i}",
                        project=spec.project,
                        zone=spec.zone,
                        machine_type=spec.machine_type,
                        boot_disk=boot_disk,
                        network_interfaces=interfaces,
                        scheduling=scheduling,
                        reservation_affinity=affinity,
                        resource_policies=args.placement_policy,
                        service_account=account,
                        metadata=metadata,
                        labels=spec.node_labels(i),
                        tags=[spec.cluster],
                    ),
                    opts=child,
                )
            )
        # Each entry reads the first NIC's addresses through lifted attribute access, no apply:
        # name and zone are this program's own inputs. (An Output.all over name, zone and NICs
        # per node doubled the time to declare 128 nodes; bench/bench_infra.py.)
        self.nodes: list[dict] = [
            node_output(
                name=f"{spec.cluster}-{i}",
                index=i,
                internal_ip=inst.network_interfaces[0].network_ip,
                external_ip=inst.network_interfaces[0].access_configs[0].nat_ip if spec.external_ip else None,
                zone=spec.zone,
            )
            for i, inst in enumerate(self.instances)
        ]
        self.register_outputs({"nodes": self.nodes})
