"""The machine catalog: one source of truth for A2/A3/A4 machine facts.

Pure data. Importing this module imports neither pulumi nor torch, so `infra/` (Pulumi),
`launcher/` (the laptop side) and `workloads/` (the node side) all read it.

Every value cites where it came from, with these short names:
- T-A2, T-A3H, T-A3M, T-A3E: the A2, A3 High, A3 Mega and A3 Edge machine tables of
  https://cloud.google.com/compute/docs/accelerator-optimized-machines
- NETBW: https://cloud.google.com/compute/docs/gpus/gpu-network-bandwidth
- GKE-TCPX: https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx
- VERTEX-MTU: https://cloud.google.com/vertex-ai/docs/training/training-clusters/networking
- CTK: github.com/GoogleCloudPlatform/cluster-toolkit @1047080 (paths below are in it);
  CTK-LSSD: its modules/compute/gke-node-pool/disk_definitions.tf
- SKY: github.com/skypilot-org/skypilot, whose sky/provision/gcp/constants.py holds the
  constants named here; SKY-LSSD: its SSD_AUTO_ATTACH_MACHINE_TYPES there
- SKYCAT: github.com/skypilot-org/skypilot-catalog @006059e catalogs/v8/gcp/vms.csv
- CEA: github.com/GoogleCloudPlatform/container-engine-accelerators @992db81
- DSTACK: github.com/dstackai/dstack @511c318; GPUHUNT: github.com/dstackai/gpuhunt
- FASTSOCK: github.com/google/nccl-fastsocket
- TT: github.com/pytorch/torchtitan @b5bcd76 torchtitan/tools/utils.py get_peak_flops

Vocabulary used across gpufleet:
- *node*: one VM. *rank* of a node: its position in the cluster's order (node 0 hosts the
  rendezvous). *local rank*: a process's index among the processes on its node.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "GPU",
    "NIC",
    "NetStack",
    "MachineType",
    "UnknownMachineType",
    "MACHINE_TYPES",
    "lookup",
    "known_types",
    "peak_flops_for_device",
    "A100_40GB",
    "A100_80GB",
    "H100",
    "H100_MEGA",
    "H200",
    "B200",
    "HOURS_PER_MONTH",
    "OnDemandPrice",
    "ON_DEMAND_PRICES",
    "on_demand_price",
    "MachinePrice",
    "MACHINE_PRICES",
    "machine_price",
    "COS_DEFAULT_CONTAINER_IMAGE",
]


class NetStack(str, enum.Enum):
    """How GPUs on different nodes talk to each other."""

    NONE = "none"  # plain NCCL sockets over the host NIC
    FAST_SOCKET = "fast-socket"  # NCCL Fast Socket plugin over one gVNIC (A2)
    TCPX = "gpudirect-tcpx"  # A3 High / Edge: 4 GPU NICs + RxDM
    TCPXO = "gpudirect-tcpxo"  # A3 Mega: 8 GPU NICs + RxDM (FasTrak)
    RDMA = "gpudirect-rdma"  # A3 Ultra / A4: 8 CX-7 NICs, RoCE, gIB plugin


@dataclass(frozen=True)
class GPU:
    model: str
    accelerator_type: str  # the Compute Engine accelerator type name
    memory_gb: int  # per GPU
    peak_bf16_flops: float  # dense, per GPU; the MFU denominator
    device_names: tuple[str, ...] = ()  # substrings of torch.cuda.get_device_name()


# Peak dense bf16 FLOP/s per GPU: TT get_peak_flops (A100 312e12, H100 SXM 989e12, H200 989e12,
# B200 2.25e15), the same constants nanoGPT (model.py estimate_mfu: A100 312e12) and llm.c (llmc/mfu.h) use.
A100_40GB = GPU(
    "A100 40GB",
    # CTK docs/gpu-support.md, DSTACK and the GKE docs say nvidia-tesla-a100; one newer quote of
    # Google's GPU page says nvidia-a100-40gb. The older name is what live tooling still sends.
    "nvidia-tesla-a100",
    40,  # T-A2: 40 GB HBM2 per GPU (320 GB for 8)
    312e12,
    ("A100-SXM4-40GB", "A100-PCIE-40GB"),
)
A100_80GB = GPU("A100 80GB", "nvidia-a100-80gb", 80, 312e12, ("A100-SXM4-80GB", "A100 80GB"))  # T-A2
H100 = GPU("H100 80GB", "nvidia-h100-80gb", 80, 989e12, ("H100",))  # T-A3H, TT
H100_MEGA = GPU("H100 80GB Mega", "nvidia-h100-mega-80gb", 80, 989e12, ("H100",))  # T-A3M, TT
H200 = GPU("H200", "nvidia-h200-141gb", 141, 989e12, ("H200",))  # type name, TT
B200 = GPU("B200", "nvidia-b200", 180, 2.25e15, ("B200",))  # GPUHUNT B200:180GB, TT


@dataclass(frozen=True)
class NIC:
    """One network interface, in the order the instance declares it (nic0 first)."""

    role: str  # "host" (SSH, control, gloo), "gpu" (GPUDirect data), "rdma" (CX-7 RoCE)
    cos_name: str | None  # interface name on Container-Optimized OS / GKE images
    ubuntu_name: str | None  # predictable name on Ubuntu images; None = not published


@dataclass(frozen=True)
class MachineType:
    name: str
    family: str  # "a2", "a3-high", "a3-edge", "a3-mega", "a3-ultra", "a4"
    gpu: GPU
    gpu_count: int
    vcpus: int
    ram_gb: int
    local_ssd_count: int  # 375 GiB NVMe disks bundled with the type (0: none bundled)
    nics: tuple[NIC, ...]
    network_gbps: int  # maximum total egress bandwidth of the VM
    gpu_network_gbps: int  # what the GPU-to-GPU path can carry per node (cost-model B)
    net_stack: NetStack
    gpu_mtu: int | None  # MTU of the GPU networks; None = the VPC default
    provisioning: frozenset[str]  # allowed: standard, spot, flex-start
    default_image: str
    image_os: str  # "ubuntu" or "cos": picks the interface names
    boot_disk_type: str = "pd-ssd"
    """The boot disk's type. A3 Ultra / A4 take Hyperdisk only (CTK examples/machine-learning
    a3-ultragpu-8g/a3ultra-vm.yaml and a4-highgpu-8g/a4high-vm.yaml use hyperdisk-balanced;
    DSTACK: persistent disk unsupported on a4-)."""
    reservation_bound: bool = False
    """Whether VMs that consume a specific reservation use the RESERVATION_BOUND provisioning
    model instead of STANDARD (CTK a3ultra-vm.yaml / a4high-vm.yaml: "if you have a
    reservation, keep RESERVATION_BOUND")."""
    min_placement_distance: int = 1
    """The smallest max distance a compact placement policy may ask for (1-3). CTK
    community/modules/compute/schedmd-slurm-gcp-v6-nodeset: "A3 machines do not support a
    placement_max_distance of 1"."""
    notes: tuple[str, ...] = field(default=())

    @property
    def host_nic(self) -> NIC:
        return self.nics[0]

    @property
    def gpu_nics(self) -> tuple[NIC, ...]:
        return tuple(n for n in self.nics if n.role in ("gpu", "rdma"))

    @property
    def nic_count(self) -> int:
        return len(self.nics)

    @property
    def gpu_network_count(self) -> int:
        """Extra VPCs the GPU NICs need (TCPX 4, TCPXO 8); RDMA uses one VPC with 8 subnets."""
        return sum(1 for n in self.nics if n.role == "gpu")

    @property
    def gpu_network_bytes_per_s(self) -> float:
        return self.gpu_network_gbps * 1e9 / 8

    @property
    def image_oses(self) -> tuple[str, ...]:
        """Image OSes a node of this type can boot with gpufleet's startup script: the TCPXO and
        RDMA stacks install their NCCL plugin, DKMS module and gIB packages with apt
        (infra/templates tcpxo.sh, rdma.sh), and Container-Optimized OS has no package manager."""
        if self.net_stack in (NetStack.TCPXO, NetStack.RDMA):
            return ("ubuntu",)
        return ("ubuntu", "cos")

    def interface_names(self, image_os: str | None = None) -> tuple[str | None, ...]:
        """Names of every NIC, in order, on the given OS (default: this type's default image)."""
        os_ = image_os or self.image_os
        if os_ not in ("ubuntu", "cos"):
            raise ValueError(f"image OS {os_!r} is unknown; one of: ubuntu, cos")
        return tuple(n.cos_name if os_ == "cos" else n.ubuntu_name for n in self.nics)


# ---- NIC layouts --------------------------------------------------------------------------

# A2 and the small A3 High types have one NIC (T-A2: single NIC; T-A3H: "Physical NIC count 1").
# The Ubuntu name of that NIC is not in our sources (it depends on the PCI slot); the launcher
# resolves it on the node as the interface that holds the node's address.
_ONE_NIC = (NIC("host", "eth0", None),)

# A3 High / Edge: 1 host + 4 GPU NICs. Ubuntu names: CTK examples/machine-learning/
# a3-highgpu-8g/nccl-tests/run-nccl-tests.sh
# (host enp0s12; GPU enp6s0,enp12s0,enp134s0,enp140s0). COS: CEA gpudirect-tcpx/nccl-config.yaml
# (eth0; eth1..eth4). Order = the PCI order RxDM's a3vm preset expects (GPU<->NIC map of
# the textproto in CTK a3-highgpu-8g/a3high-slurm-blueprint.yaml).
_A3_HIGH_NICS = (NIC("host", "eth0", "enp0s12"),) + tuple(
    NIC("gpu", f"eth{i + 1}", u) for i, u in enumerate(("enp6s0", "enp12s0", "enp134s0", "enp140s0"))
)

# A3 Mega: 1 host + 8 GPU NICs (T-A3M: 9 NICs). Ubuntu names: CTK examples/
# machine-learning/a3-megagpu-8g/nccl-tests/run-nccl-tests.sh; COS: CEA gpudirect-tcpxo README (eth0 + eth1..eth8).
_A3_MEGA_NICS = (NIC("host", "eth0", "enp0s12"),) + tuple(
    NIC("gpu", f"eth{i + 1}", u)
    for i, u in enumerate(("enp6s0", "enp7s0", "enp13s0", "enp14s0", "enp134s0", "enp135s0", "enp141s0", "enp142s0"))
)

# A3 Ultra / A4: 2 gVNIC + 8 CX-7 (NETBW: "eight ... CX7 ... and two Google virtual NICs").
# gVNIC Ubuntu names: CTK a3-ultragpu-8g/nemo-framework/Dockerfile
# GLOO_SOCKET_IFNAME=enp0s19,enp192s20.
# The CX-7 NICs are used through verbs (gIB), not by interface name; no names are published.
_RDMA_NICS = (
    NIC("host", "eth0", "enp0s19"),
    NIC("host", "eth1", "enp192s20"),
) + tuple(NIC("rdma", None, None) for _ in range(8))


# ---- Images -------------------------------------------------------------------------------

# Ubuntu accelerator images ship the NVIDIA driver (CTK examples/machine-learning/
# a3-megagpu-8g/a3mega-slurm-blueprint.yaml base image
# ubuntu-accelerator-2404-amd64-with-nvidia-580-v20260522, of this family).
UBUNTU_ACCEL = (
    "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accelerator-2404-amd64-with-nvidia-580"
)
# A3 High TCPX on VMs: Google's GPUDirect-TCPX VM doc (https://cloud.google.com/compute/docs/gpus/
# gpudirect) uses cos-105-lts; the Ubuntu path needs a private TCPX kernel PPA (CTK examples/
# machine-learning/a3-highgpu-8g/README.md), so COS is the default a user can actually boot.
COS_TCPX = "projects/cos-cloud/global/images/family/cos-105-lts"

# What jobs run in on a COS node unless the stack or `launch --image` names another image: COS
# has docker and the driver but no Python to build an environment with, so the ranks run in NVIDIA's
# PyTorch container (torch 2.6, numpy: what gpufleet's workloads import), the image Google's A3 High
# examples train in (github.com/GoogleCloudPlatform/cluster-toolkit examples/machine-learning/
# a3-highgpu-8g/nccl-tests/import_pytorch_container.sh imports nvcr.io/nvidia/pytorch). Tag 25.01-py3
# (https://catalog.ngc.nvidia.com/orgs/nvidia/containers/pytorch/tags) pinned by its manifest-list
# digest: the one the registry's own cosign signature tag names (sha256-96990c82....sig, listed in
# github.com/singularityhub/shpc-registry nvcr.io/nvidia/pytorch/container.yaml), and that unrelated
# public projects pin for 25.01-py3. Pinned, every node runs the same bits and a node that holds
# them asks no registry.
COS_DEFAULT_CONTAINER_IMAGE = (
    "nvcr.io/nvidia/pytorch:25.01-py3@sha256:96990c82825613c3bdeebb66675c7c91b0123f64a5895623316dc5b824e0d7a9"
)

_ALL_MODELS = frozenset({"standard", "spot", "flex-start"})
# T-A3M note: "When provisioning a3-highgpu-1g, a3-highgpu-2g, or a3-highgpu-4g machine types,
# you must create instances by using Spot VMs or Flex-start VMs."
_SPOT_OR_FLEX = frozenset({"spot", "flex-start"})


# CTK schedmd-slurm-gcp-v6-nodeset: "A3 machines do not support a placement_max_distance of 1".
_A3_MIN_DISTANCE = 2


def _a2(name: str, gpu: GPU, n: int, vcpus: int, ram: int, lssd: int, gbps: int) -> MachineType:
    # vCPU, RAM, GPU count, bandwidth: T-A2. Local SSD: SKY-LSSD (A2 Ultra bundles 1 per GPU;
    # A2 Standard: "supported", none bundled). MTU: the VPC default; our sources give no jumbo
    # frame guidance for A2. Stack: Fast Socket
    # (https://cloud.google.com/compute/docs/gpus/optimize-gpus, FASTSOCK README.md).
    return MachineType(
        name=name,
        family="a2",
        gpu=gpu,
        gpu_count=n,
        vcpus=vcpus,
        ram_gb=ram,
        local_ssd_count=lssd,
        nics=_ONE_NIC,
        network_gbps=gbps,
        gpu_network_gbps=gbps,
        net_stack=NetStack.FAST_SOCKET,
        gpu_mtu=None,
        provisioning=_ALL_MODELS,
        default_image=UBUNTU_ACCEL,
        image_os="ubuntu",
    )


def _a3_small(name: str, n: int, vcpus: int, ram: int, lssd: int, gbps: int) -> MachineType:
    # T-A3H row; local SSD count SKY-LSSD (2/4/8 x 375 GiB = 750/1500/3000 GiB in T-A3H).
    # One NIC, no GPUDirect (TCPX needs the 8g's 4 GPU NICs: SKY GPU_DIRECT_TCPX_INSTANCE_TYPES).
    return MachineType(
        name=name,
        family="a3-high",
        gpu=H100,
        gpu_count=n,
        vcpus=vcpus,
        ram_gb=ram,
        local_ssd_count=lssd,
        nics=_ONE_NIC,
        network_gbps=gbps,
        gpu_network_gbps=gbps,
        net_stack=NetStack.NONE,
        gpu_mtu=None,
        provisioning=_SPOT_OR_FLEX,
        default_image=UBUNTU_ACCEL,
        image_os="ubuntu",
        min_placement_distance=_A3_MIN_DISTANCE,
    )


_TYPES = [
    _a2("a2-highgpu-1g", A100_40GB, 1, 12, 85, 0, 24),
    _a2("a2-highgpu-2g", A100_40GB, 2, 24, 170, 0, 32),
    _a2("a2-highgpu-4g", A100_40GB, 4, 48, 340, 0, 50),
    _a2("a2-highgpu-8g", A100_40GB, 8, 96, 680, 0, 100),
    _a2("a2-megagpu-16g", A100_40GB, 16, 96, 1360, 0, 100),
    _a2("a2-ultragpu-1g", A100_80GB, 1, 12, 170, 1, 24),
    _a2("a2-ultragpu-2g", A100_80GB, 2, 24, 340, 2, 32),
    _a2("a2-ultragpu-4g", A100_80GB, 4, 48, 680, 4, 50),
    _a2("a2-ultragpu-8g", A100_80GB, 8, 96, 1360, 8, 100),
    _a3_small("a3-highgpu-1g", 1, 26, 234, 2, 25),
    _a3_small("a3-highgpu-2g", 2, 52, 468, 4, 50),
    _a3_small("a3-highgpu-4g", 4, 104, 936, 8, 100),
    MachineType(
        name="a3-highgpu-8g",
        family="a3-high",
        gpu=H100,
        gpu_count=8,
        vcpus=208,
        ram_gb=1872,  # T-A3H
        local_ssd_count=16,  # SKY-LSSD; T-A3H 6,000 GiB = 16 x 375
        nics=_A3_HIGH_NICS,  # T-A3H: 5 physical NICs
        network_gbps=1000,  # T-A3H and NETBW agree
        # 4 GPU NICs "each supporting up to 200 Gbps" (GKE-TCPX) = 800 Gbps = 100 GB/s,
        # the per-node GPU-network bandwidth gpufleet.expected uses.
        gpu_network_gbps=800,
        net_stack=NetStack.TCPX,  # NETBW overview "A3 High ... GPUDirect-TCPX"
        gpu_mtu=8244,  # CTK examples/gke-a3-highgpu.yaml, SKY, DSTACK
        provisioning=_ALL_MODELS,
        default_image=COS_TCPX,
        image_os="cos",
        min_placement_distance=_A3_MIN_DISTANCE,
    ),
    MachineType(
        name="a3-edgegpu-8g",
        family="a3-edge",
        gpu=H100,
        gpu_count=8,
        vcpus=208,
        ram_gb=1872,
        local_ssd_count=16,  # T-A3E, SKY-LSSD
        nics=_A3_HIGH_NICS,  # T-A3E: 5 NICs, same TCPX layout (SKY GPU_DIRECT_TCPX_INSTANCE_TYPES)
        # Sources disagree: T-A3E 600 (asia-south1, northamerica-northeast2) / 400 elsewhere;
        # NETBW overview 600; a newer NETBW copy and DSTACK 800. We keep the NETBW overview's 600 as
        # the VM total and the table's 400 (most regions) for the GPU path, so the expected-
        # bandwidth check errs towards not crying wolf.
        network_gbps=600,
        gpu_network_gbps=400,
        net_stack=NetStack.TCPX,
        gpu_mtu=8244,
        provisioning=_ALL_MODELS,
        default_image=COS_TCPX,
        image_os="cos",
        min_placement_distance=_A3_MIN_DISTANCE,
    ),
    MachineType(
        name="a3-megagpu-8g",
        family="a3-mega",
        gpu=H100_MEGA,
        gpu_count=8,
        vcpus=208,
        ram_gb=1872,
        local_ssd_count=16,  # T-A3M, SKY-LSSD
        nics=_A3_MEGA_NICS,  # T-A3M: 9 NICs
        # T-A3M and NETBW overview 1,800; one NETBW copy 1,600. 1,800 = 8 x 200 GPU + 200 host.
        network_gbps=1800,
        gpu_network_gbps=1600,  # 8 GPU NICs x 200 Gbps (GKE-TCPX) = 200 GB/s
        net_stack=NetStack.TCPXO,  # NETBW overview
        gpu_mtu=8244,  # CTK examples/gke-a3-megagpu.yaml; VERTEX-MTU "For A3 Mega nodes: Use an MTU of 8244."
        provisioning=_ALL_MODELS,
        default_image=UBUNTU_ACCEL,
        image_os="ubuntu",  # CTK a3mega-slurm-blueprint.yaml base image
        min_placement_distance=_A3_MIN_DISTANCE,
    ),
    MachineType(
        name="a3-ultragpu-8g",
        family="a3-ultra",
        gpu=H200,
        gpu_count=8,
        vcpus=224,
        ram_gb=2952,  # SKYCAT
        local_ssd_count=32,  # SKY-LSSD, CTK-LSSD
        nics=_RDMA_NICS,  # NETBW: 8 CX-7 + 2 gVNIC
        network_gbps=3600,  # NETBW overview
        gpu_network_gbps=3200,  # NETBW: "The eight CX7 NICs deliver ... 3,200 Gbps"
        net_stack=NetStack.RDMA,
        gpu_mtu=8896,  # CTK modules/network/gpu-rdma-vpc default; VERTEX-MTU "... A4 nodes: ... 8896"
        provisioning=_ALL_MODELS,
        default_image=UBUNTU_ACCEL,
        image_os="ubuntu",
        boot_disk_type="hyperdisk-balanced",
        reservation_bound=True,  # CTK a3ultra-vm.yaml
        min_placement_distance=_A3_MIN_DISTANCE,
    ),
    MachineType(
        name="a4-highgpu-8g",
        family="a4",
        gpu=B200,
        gpu_count=8,
        vcpus=224,
        ram_gb=3968,  # SKYCAT
        local_ssd_count=32,  # SKY-LSSD, CTK-LSSD
        nics=_RDMA_NICS,
        network_gbps=3600,
        gpu_network_gbps=3200,  # NETBW
        net_stack=NetStack.RDMA,
        gpu_mtu=8896,
        provisioning=_ALL_MODELS,
        default_image=UBUNTU_ACCEL,
        image_os="ubuntu",
        boot_disk_type="hyperdisk-balanced",
        reservation_bound=True,  # CTK a4high-vm.yaml, DSTACK
    ),
]

MACHINE_TYPES: dict[str, MachineType] = {t.name: t for t in _TYPES}


class UnknownMachineType(KeyError):
    """A machine type the catalog does not know. str() is the one-line message."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


def known_types() -> list[str]:
    return sorted(MACHINE_TYPES)


def lookup(name: str) -> MachineType:
    """The catalog entry for `name`; raises UnknownMachineType listing the known types."""
    try:
        return MACHINE_TYPES[name]
    except KeyError:
        raise UnknownMachineType(f"machine type {name!r} is unknown; one of: {', '.join(known_types())}") from None


# H100 variants that GCP does not offer but a user may run the workload on: TT get_peak_flops
# (H100 NVL 835e12, H100 PCIe 756e12). Checked before the SXM entry, whose test is "H100".
_OTHER_DEVICES = (("H100 NVL", 835e12), ("H100 PCIe", 756e12))


def peak_flops_for_device(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU by its CUDA device name (None when not in the catalog)."""
    for needle, flops in _OTHER_DEVICES:
        if needle in device_name:
            return flops
    # H200/B200 are checked before H100 since "H100" is a substring test.
    for gpu in (B200, H200, A100_80GB, A100_40GB, H100):
        if any(s in device_name for s in gpu.device_names):
            return gpu.peak_bf16_flops
    return None


# ---- On-demand prices of the small VMs gpufleet declares beside the nodes --------------------------

# Google prices a month of on-demand use as 730 hours (the monthly column of
# https://cloud.google.com/compute/vm-instance-pricing).
HOURS_PER_MONTH = 730


@dataclass(frozen=True)
class OnDemandPrice:
    """A machine type's on-demand (not Spot, no committed-use discount) list price in one region."""

    machine_type: str
    region: str
    usd_per_hour: float
    source: str
    retrieved: str  # the date the source's figure was generated or read

    @property
    def usd_per_month(self) -> float:
        return self.usd_per_hour * HOURS_PER_MONTH


ON_DEMAND_PRICES: dict[str, OnDemandPrice] = {
    # e2-standard-2 (2 vCPUs, 8 GB), us-central1: $0.06701142/h, $48.92/month. Google's VM instance
    # pricing page (https://cloud.google.com/compute/vm-instance-pricing, "E2 standard machine
    # types") renders its table from the Cloud Billing Catalog; this figure is that catalog's, as
    # mirrored in Cyclenerd/google-cloud-pricing-cost-calculator pricing.yml (generated 2025-03-06;
    # compute.instance.e2-standard-2.cost.us-central1: hour 0.06701142, month 48.9183366). Other
    # regions cost more or less (us-east4 0.07547082, europe-west4 0.07377204 in the same file).
    "e2-standard-2": OnDemandPrice(
        "e2-standard-2",
        "us-central1",
        0.06701142,
        "https://cloud.google.com/compute/vm-instance-pricing (Cloud Billing Catalog via "
        "Cyclenerd/google-cloud-pricing-cost-calculator pricing.yml)",
        "2025-03-06",
    ),
}


def on_demand_price(machine_type: str) -> OnDemandPrice | None:
    """The on-demand list price the catalog knows for a (non-GPU) machine type, or None."""
    return ON_DEMAND_PRICES.get(machine_type)


# ---- On-demand and Spot prices of the GPU machine types ---------------------------------------------

# One node-hour of each type, GPUs included (Compute Engine bills A2/A3 GPUs with the machine type:
# https://cloud.google.com/compute/gpus-pricing, "Accelerator-optimized machine types"). The figures
# are the Cloud Billing Catalog's, which Google's pricing pages render, as mirrored in
# Cyclenerd/google-cloud-pricing-cost-calculator pricing.yml generated 2025-03-06 (the same file
# e2-standard-2's price above cites): compute.instance.<type>.cost.<region>.hour and .hour_spot.
# Spot prices are dynamic (https://cloud.google.com/spot-vms/pricing) and the file's later
# snapshots differ, so a Spot cost is an estimate at this snapshot's price. That file
# lists no a3-edgegpu-8g, a3-ultragpu-8g or a4-highgpu-8g: their price is unknown here (shown n/a),
# never guessed. Flex-start VMs have their own price (https://cloud.google.com/products/dws/pricing),
# which that file does not carry: unknown here too (None, shown n/a).
_PRICING_SOURCE = (
    "https://cloud.google.com/compute/gpus-pricing (Cloud Billing Catalog via "
    "Cyclenerd/google-cloud-pricing-cost-calculator pricing.yml)"
)
_PRICING_DATE = "2025-03-06"


@dataclass(frozen=True)
class MachinePrice:
    """A machine type's list prices per node-hour in one region: on-demand, Spot, Flex-start."""

    machine_type: str
    region: str
    on_demand_usd_per_hour: float
    spot_usd_per_hour: float
    source: str = _PRICING_SOURCE
    retrieved: str = _PRICING_DATE  # the date the source's figures were generated
    flex_start_usd_per_hour: float | None = None
    """None: the source has no Flex-start price for the type (shown n/a, never guessed)."""

    def usd_per_hour(self, provisioning: str) -> float | None:
        """The price per node-hour of a provisioning model ("standard", "spot", "flex-start")."""
        return {
            "standard": self.on_demand_usd_per_hour,
            "spot": self.spot_usd_per_hour,
            "flex-start": self.flex_start_usd_per_hour,
        }[provisioning]


def _prices(region: str, rows: dict[str, tuple[float, float]]) -> dict[str, MachinePrice]:
    return {name: MachinePrice(name, region, od, spot) for name, (od, spot) in rows.items()}


MACHINE_PRICES: dict[str, MachinePrice] = {
    # us-central1, the region of every type below in that file except A3 Mega. (hour, hour_spot).
    **_prices(
        "us-central1",
        {
            "a2-highgpu-1g": (3.673385, 1.293355),
            "a2-highgpu-2g": (7.34677, 2.58671),
            "a2-highgpu-4g": (14.69354, 5.17342),
            "a2-highgpu-8g": (29.38708, 10.34684),
            "a2-megagpu-16g": (55.739504, 19.48024),
            "a2-ultragpu-1g": (5.06879789041096, 2.02746835616438),
            "a2-ultragpu-2g": (10.1375957808219, 4.05493671232877),
            "a2-ultragpu-4g": (20.2751915616438, 8.10987342465753),
            "a2-ultragpu-8g": (40.5503831232877, 16.2197468493151),
            "a3-highgpu-1g": (11.0612499878219, 4.42446871232877),
            "a3-highgpu-2g": (22.1224999756438, 8.84893742465754),
            "a3-highgpu-4g": (44.2449999512877, 17.6978748493151),
            "a3-highgpu-8g": (88.4899999025753, 35.3957496986301),
        },
    ),
    # a3-megagpu-8g is priced there in asia-northeast1, asia-southeast1, australia-southeast1,
    # europe-west1/3/4, us-east4, us-east5 and us-west4 only; us-east4 is the US region it lists first.
    **_prices("us-east4", {"a3-megagpu-8g": (92.9375881512329, 37.391837369863)}),
}


def machine_price(machine_type: str | None) -> MachinePrice | None:
    """The on-demand and Spot prices the catalog knows for a GPU machine type, or None (unknown)."""
    return MACHINE_PRICES.get(machine_type) if machine_type else None
