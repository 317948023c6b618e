"""The network layout of a fleet, pure: which VPCs, which subnet each NIC joins, MTU, NIC type.

Derived from the machine catalog; infra/networks.py declares it. Layouts (CTK =
github.com/GoogleCloudPlatform/cluster-toolkit: examples/gke-a3-highgpu.yaml, gke-a3-megagpu.yaml,
machine-learning/a3-ultragpu-8g/a3ultra-vm.yaml, machine-learning/a4-highgpu-8g/a4high-vm.yaml,
modules/network/gpu-rdma-vpc):
- one NIC (A2, a3-highgpu-1g/2g/4g): one VPC, one subnet, gVNIC, the VPC's default MTU.
- TCPX (A3 High / Edge): a host VPC + 4 GPU VPCs, one subnet each, MTU 8244, all gVNIC.
- TCPXO (A3 Mega): a host VPC + 8 GPU VPCs, MTU 8244, all gVNIC.
- RDMA (A3 Ultra / A4): two gVNIC VPCs (MTU 8896) + one RDMA VPC with the zone's RoCE network
  profile and 8 subnets, one per MRDMA NIC.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.catalog import MachineType

__all__ = ["SubnetPlan", "NetworkPlan", "NicPlan", "plan_networks"]


@dataclass(frozen=True)
class SubnetPlan:
    name: str
    cidr: str


@dataclass(frozen=True)
class NetworkPlan:
    key: str
    """Short role-based key: "host", "host-2", "gpu-1".."gpu-8", "rdma"."""
    name: str
    role: str
    """"host", "gpu" or "rdma" (the NIC roles of gpufleet.catalog)."""
    mtu: int | None
    """None = the VPC default (1460)."""
    subnets: tuple[SubnetPlan, ...]
    profile: str | None
    """Network profile name (RDMA VPCs only)."""

    @property
    def cidrs(self) -> tuple[str, ...]:
        return tuple(s.cidr for s in self.subnets)


@dataclass(frozen=True)
class NicPlan:
    network: str
    """NetworkPlan.key."""
    subnet: int
    """Index into that network's subnets."""
    nic_type: str


def _cidr(block: int) -> str:
    # Every subnet is a /20 (4,092 usable addresses, infra.config.SUBNET_MAX_NODES) in its own
    # 10.N.0.0/16, so no two of a cluster's subnets overlap.
    return f"10.{block}.0.0/20"


def plan_networks(
    machine: MachineType, *, cluster: str, zone: str
) -> tuple[tuple[NetworkPlan, ...], tuple[NicPlan, ...]]:
    """The networks a fleet of `machine` needs, and which subnet each NIC (in NIC order) joins."""
    # MTU: the family's GPU-network MTU on every regular VPC of a multi-NIC type (CTK's GKE A3
    # blueprints examples/gke-a3-{highgpu,megagpu}.yaml set 8244 on the host VPC too; the A3
    # Ultra/A4 gVNIC VPCs use 8896), the VPC default for single-NIC types (catalog gpu_mtu None).
    mtu = machine.gpu_mtu
    nets: list[NetworkPlan] = []
    nics: list[NicPlan] = []
    hosts = gpus = 0
    rdma_nics = [n for n in machine.nics if n.role == "rdma"]
    for nic in machine.nics:
        if nic.role == "host":
            hosts += 1
            key = "host" if hosts == 1 else f"host-{hosts}"
            name = f"{cluster}-net" if hosts == 1 else f"{cluster}-net-{hosts}"
            nets.append(NetworkPlan(key, name, "host", mtu, (SubnetPlan(f"{name}-subnet", _cidr(len(nets))),), None))
            nics.append(NicPlan(key, 0, "GVNIC"))
        elif nic.role == "gpu":
            gpus += 1
            key, name = f"gpu-{gpus}", f"{cluster}-gpu-net-{gpus}"
            nets.append(NetworkPlan(key, name, "gpu", mtu, (SubnetPlan(f"{name}-subnet", _cidr(len(nets))),), None))
            nics.append(NicPlan(key, 0, "GVNIC"))
        else:  # rdma: one VPC for all of them, one subnet per NIC (CTK modules/network/gpu-rdma-vpc)
            if not any(n.key == "rdma" for n in nets):
                name = f"{cluster}-rdma-net"
                subnets = tuple(SubnetPlan(f"{name}-subnet-{j}", _cidr(16 + j)) for j in range(len(rdma_nics)))
                nets.append(NetworkPlan("rdma", name, "rdma", mtu, subnets, f"{zone}-vpc-roce"))
            used = sum(1 for n in nics if n.network == "rdma")
            # CTK modules/network/gpu-rdma-vpc nic_type default "MRDMA".
            nics.append(NicPlan("rdma", used, "MRDMA"))
    return tuple(nets), tuple(nics)
