"""GPU networks: the VPCs, subnets, firewalls and NAT a fleet's NICs attach to (layout: infra/layout.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpufleet.catalog import MachineType
from infra.layout import plan_networks

__all__ = ["GpuNetworksArgs", "GpuNetworks"]


@dataclass(frozen=True)
class GpuNetworksArgs:
    cluster: str
    project: str
    region: str
    zone: str
    machine: MachineType
    ssh_source_ranges: tuple[str, ...]
    nat: bool
    """Give the nodes egress through Cloud NAT (they have no external IP)."""


class GpuNetworks(pulumi.ComponentResource):
    """Every VPC, subnet, firewall rule (and the NAT) of one fleet.

    `nic_targets` lists, in NIC order, the (subnetwork, NIC type) each instance's
    interfaces use, as self-link paths (depend on `attach_after` to be created after them);
    `summary` is the `networks` stack output.
    """

    def __init__(self, name: str, args: GpuNetworksArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gpufleet:infra:GpuNetworks", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        plans, nic_plans = plan_networks(args.machine, cluster=args.cluster, zone=args.zone)
        # What an instance must wait for: every subnet its NICs name (each after its network) and
        # the NAT its first boot downloads through. Listed directly rather than by depending on
        # this component, which Pulumi would expand to all its children for each instance.
        self.attach_after: list[pulumi.Resource] = []
        plans_by_key = {p.key: p for p in plans}
        self.networks: dict[str, gcp.compute.Network] = {}
        self.subnets: dict[str, list[gcp.compute.Subnetwork]] = {}
        for plan in plans:
            net = gcp.compute.Network(
                plan.name,
                gcp.compute.NetworkArgs(
                    name=plan.name,
                    project=args.project,
                    auto_create_subnetworks=False,
                    mtu=plan.mtu,
                    routing_mode="REGIONAL",
                    network_profile=(
                        f"projects/{args.project}/global/networkProfiles/{plan.profile}" if plan.profile else None
                    ),
                ),
                opts=child,
            )
            self.networks[plan.key] = net
            self.subnets[plan.key] = [
                gcp.compute.Subnetwork(
                    sub.name,
                    gcp.compute.SubnetworkArgs(
                        name=sub.name,
                        project=args.project,
                        region=args.region,
                        network=net.self_link,
                        ip_cidr_range=sub.cidr,
                        # Nodes without external IPs still reach Google APIs (GCS checkpoints,
                        # Artifact Registry images) on the host network.
                        private_ip_google_access=plan.role == "host",
                    ),
                    opts=child,
                )
                for sub in plan.subnets
            ]
            self.attach_after.extend(self.subnets[plan.key])
            # All traffic between the cluster's own subnets. The RDMA VPC gets no rule: the A3 Ultra/A4
            # blueprints of github.com/GoogleCloudPlatform/cluster-toolkit (examples/machine-learning/
            # a3-ultragpu-8g/a3ultra-vm.yaml, a4-highgpu-8g/a4high-vm.yaml) declare `firewall_rules = []`.
            if plan.role != "rdma":
                gcp.compute.Firewall(
                    f"{plan.name}-internal",
                    gcp.compute.FirewallArgs(
                        name=f"{plan.name}-internal",
                        project=args.project,
                        network=net.self_link,
                        direction="INGRESS",
                        allows=[
                            gcp.compute.FirewallAllowArgs(protocol="tcp", ports=["0-65535"]),
                            gcp.compute.FirewallAllowArgs(protocol="udp", ports=["0-65535"]),
                            gcp.compute.FirewallAllowArgs(protocol="icmp"),
                        ],
                        source_ranges=list(plan.cidrs),
                        target_tags=[args.cluster],
                    ),
                    opts=child,
                )
        host = plans[0]
        gcp.compute.Firewall(
            f"{args.cluster}-ssh",
            gcp.compute.FirewallArgs(
                name=f"{args.cluster}-ssh",
                project=args.project,
                network=self.networks[host.key].self_link,
                direction="INGRESS",
                allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=["22"])],
                source_ranges=list(args.ssh_source_ranges),
                target_tags=[args.cluster],
            ),
            opts=child,
        )
        if args.nat:
            # The startup script pulls packages and images: without external IPs that needs NAT.
            router = gcp.compute.Router(
                f"{args.cluster}-router",
                gcp.compute.RouterArgs(
                    name=f"{args.cluster}-router",
                    project=args.project,
                    region=args.region,
                    network=self.networks[host.key].self_link,
                ),
                opts=child,
            )
            nat = gcp.compute.RouterNat(
                f"{args.cluster}-nat",
                gcp.compute.RouterNatArgs(
                    name=f"{args.cluster}-nat",
                    project=args.project,
                    region=args.region,
                    router=router.name,
                    nat_ip_allocate_option="AUTO_ONLY",
                    source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
                ),
                opts=child,
            )
            self.attach_after.append(nat)
        # NICs reference their network and subnet by self-link path, built from the names this
        # component declares, rather than by the resources' Output self links: 128 nodes x 9 NICs
        # of Output references cost Pulumi ~2x the declaration time (bench/bench_infra.py). The
        # ordering those references carried is kept by instances depending on `attach_after`.
        # The subnetwork alone names a NIC's network too ("Either network or subnetwork must be
        # provided", pulumi-gcp InstanceNetworkInterfaceArgs).
        self.nic_targets: list[tuple[str, str]] = [
            (
                f"projects/{args.project}/regions/{args.region}/subnetworks/{plans_by_key[n.network].subnets[n.subnet].name}",
                n.nic_type,
            )
            for n in nic_plans
        ]
        self.summary = [
            {"name": p.name, "role": p.role, "mtu": p.mtu, "cidrs": list(p.cidrs), "profile": p.profile} for p in plans
        ]
        self.register_outputs({"networks": self.summary})
