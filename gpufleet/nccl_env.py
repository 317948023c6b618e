"""NCCL and gloo environment profiles, one per network stack. Pure data plus one renderer.

Importing this module imports neither pulumi nor torch. The launcher reads it to build each
node's environment; the values are the ones Google's own tooling sets, each with its source.
Short names: CTK github.com/GoogleCloudPlatform/cluster-toolkit @1047080 (CTK-A3H =
examples/machine-learning/a3-highgpu-8g, CTK-A3M = .../a3-megagpu-8g, CTK-A3U = .../a3-ultragpu-8g,
CTK-A4 = .../a4-highgpu-8g in it); TCPXO-SRC github.com/google/nccl-plugin-gpudirect-tcpxo
@04815d1; CEA github.com/GoogleCloudPlatform/container-engine-accelerators @992db81; SLURMGCP
github.com/GoogleCloudPlatform/slurm-gcp @13fd92b; FASTSOCK github.com/google/nccl-fastsocket;
SKY github.com/skypilot-org/skypilot.

A profile value may name interfaces through placeholders, filled in by `render()` from the
catalog's interface names for the node's image OS:
- `{host}`: the host NIC (nic0) — what NCCL's and gloo's bootstrap sockets use;
- `{hosts}`: every host-role NIC, comma-separated (A3 Ultra / A4 have two gVNICs);
- `{gpu}`: the GPU NICs, comma-separated; `{gpu0}`..`{gpu7}`: one of them.
When the host NIC's name is not published for the image (the catalog says None), `render()`
returns `HOST_IFACE_ON_NODE` for it and the launcher resolves the name on the node at run time.
"""

from __future__ import annotations

from gpufleet.catalog import MachineType, NetStack

__all__ = [
    "HOST_IFACE_ON_NODE",
    "PREPEND_PATH_VARS",
    "PROFILES",
    "TUNER_CONFIG",
    "render",
]

# Stands for "the interface that holds this node's address", resolved on the node itself.
HOST_IFACE_ON_NODE = "@host-iface"

# Variables whose profile value is prepended to what the node already has, not replacing it
# (CTK-A3H nccl-tests/run-nccl-tests.sh: `LD_LIBRARY_PATH=/var/lib/tcpx/lib64:${LD_LIBRARY_PATH}`).
PREPEND_PATH_VARS = frozenset({"LD_LIBRARY_PATH", "PATH"})

_SOCKETS = {
    # Bootstrap and plain-socket transport over the host NIC (NCCL docs: NCCL_SOCKET_IFNAME).
    "NCCL_SOCKET_IFNAME": "{host}",
}

# CTK-A3H nccl-tests/run-nccl-tests.sh (the same set as CTK-A3H nemo-framework/Dockerfile).
# UNIX_CLIENT_PREFIX /run/tcpx: the RxDM's `--uds_path "/run/tcpx"` in Google's VM startup
# (SKY sky/provision/gcp/constants.py GPU_DIRECT_TCPX_USER_DATA).
_TCPX = {
    "NCCL_NET": "GPUDirectTCPX_v7",
    "NCCL_SOCKET_IFNAME": "{host}",
    "NCCL_GPUDIRECTTCPX_CTRL_DEV": "{host}",
    "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "{gpu}",
    "NCCL_CROSS_NIC": "0",
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
    "NCCL_NSOCKS_PERTHREAD": "4",
    "NCCL_SOCKET_NTHREADS": "1",
    "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
    "NCCL_P2P_NET_CHUNKSIZE": "524288",
    "NCCL_P2P_PCI_CHUNKSIZE": "524288",
    "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
    "NCCL_BUFFSIZE": "4194304",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_P2P_PXN_LEVEL": "0",
    "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": "/run/tcpx",
    "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "500000",
    # CPU bindings per GPU NIC, in the NIC order of the catalog (CTK-A3H run-nccl-tests.sh).
    "NCCL_GPUDIRECTTCPX_TX_BINDINGS": (
        "{gpu0}:8-21,112-125;{gpu1}:8-21,112-125;{gpu2}:60-73,164-177;{gpu3}:60-73,164-177"
    ),
    "NCCL_GPUDIRECTTCPX_RX_BINDINGS": (
        "{gpu0}:22-35,126-139;{gpu1}:22-35,126-139;{gpu2}:74-87,178-191;{gpu3}:74-87,178-191"
    ),
    # CTK-A3H README.md: "Set the LD_LIBRARY_PATH to include /var/lib/tcpx/lib64 and /usr/local/nvidia/lib64".
    "LD_LIBRARY_PATH": "/var/lib/tcpx/lib64:/usr/local/nvidia/lib64",
}

# TCPXO-SRC tcpxo_scripts/nccl-env-profile.sh (current default profile) with
# NCCL_LIB_DIR=/var/lib/tcpxo/lib64 (where the installer puts it on VMs: SLURMGCP
# tools/prologs-epilogs/receive-data-path-manager-mega), plus the VM-only LLCM directory
# (CTK-A3M nccl-tests/run-nccl-tests.sh). NCCL_ALGO deliberately unset:
# "we recommend that NCCL_ALGO remains unset" (CEA gpudirect-tcpxo/README.md, Aug 2025).
_TCPXO_LIB = "/var/lib/tcpxo/lib64"
_TCPXO = {
    "LD_LIBRARY_PATH": _TCPXO_LIB,
    "NCCL_FASTRAK_IFNAME": "{gpu}",
    "NCCL_FASTRAK_CTRL_DEV": "{host}",
    "NCCL_SOCKET_IFNAME": "{host}",
    "NCCL_CROSS_NIC": "0",
    "NCCL_PROTO": "Simple,LL128",
    "NCCL_MIN_NCHANNELS": "4",
    # "The guest config checker will enforce that NCCL_NVLSTREE_MAX_CHUNKSIZE is set to this value
    # and will abort any workload where it is not set" (CEA gpudirect-tcpxo/README.md).
    "NCCL_NVLSTREE_MAX_CHUNKSIZE": "131072",
    "NCCL_P2P_NET_CHUNKSIZE": "524288",
    "NCCL_P2P_PCI_CHUNKSIZE": "524288",
    "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
    "NCCL_FASTRAK_NUM_FLOWS": "2",
    "NCCL_FASTRAK_ENABLE_CONTROL_CHANNEL": "0",
    "NCCL_BUFFSIZE": "8388608",
    "NCCL_FASTRAK_USE_SNAP": "1",
    "NCCL_FASTRAK_USE_LLCM": "1",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_FASTRAK_ENABLE_HOTPATH_LOGGING": "0",
    "NCCL_TUNER_PLUGIN": "libnccl-tuner.so",
    "NCCL_TUNER_CONFIG_PATH": f"{_TCPXO_LIB}/a3plus_tuner_config.textproto",
    "NCCL_SHIMNET_GUEST_CONFIG_CHECKER_CONFIG_FILE": f"{_TCPXO_LIB}/a3plus_guest_config.textproto",
    "NCCL_FASTRAK_PLUGIN_ACCEPT_TIMEOUT_MS": "600000",
    "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": "/dev/aperture_devices",
    "NCCL_DEBUG": "WARN",
}

# The values CTK-A4 a4high-vm.yaml writes to /etc/environment "to enable the NCCL gIB
# network plugin", plus NCCL_NET=gIB and the two gVNICs as socket interfaces (CTK-A3U
# nccl-tests/run-nccl-tests.sh: `NCCL_SOCKET_IFNAME=enp0s19,enp192s20`; CTK-A3U
# nemo-framework/Dockerfile sets GLOO_SOCKET_IFNAME to the same pair).
_RDMA = {
    "NCCL_NET": "gIB",
    "LD_LIBRARY_PATH": "/usr/local/gib/lib64",
    "NCCL_SOCKET_IFNAME": "{hosts}",
    "NCCL_CROSS_NIC": "0",
    "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_P2P_NET_CHUNKSIZE": "131072",
    "NCCL_NVLS_CHUNKSIZE": "524288",
    "NCCL_IB_GID_INDEX": "3",
    "NCCL_IB_ADAPTIVE_ROUTING": "1",
    "NCCL_IB_QPS_PER_CONNECTION": "4",
    "NCCL_IB_TC": "52",
    "NCCL_IB_FIFO_TC": "84",
}

# Tuner config per family for gIB: a4 from CTK-A4 a4high-vm.yaml, a3-ultra from
# CTK-A3U nemo-framework/Dockerfile.
TUNER_CONFIG: dict[str, str] = {
    "a4": "/usr/local/gib/configs/tuner_config.txtpb",
    "a3-ultra": "/usr/local/gib/configs/tuner_config_a3u.txtpb",
}

# The Fast Socket plugin is /usr/lib/libnccl-net.so (FASTSOCK BUILD package_dir; "it has to be
# in LD_LIBRARY_PATH in order to be loaded by NCCL", FASTSOCK README.md); its tuning auto-detects GCP
# NICs, and no Google-published A2 env list exists, so only the path and the socket NIC are set.
_FAST_SOCKET = {
    "LD_LIBRARY_PATH": "/usr/lib",
    "NCCL_SOCKET_IFNAME": "{host}",
}

PROFILES: dict[NetStack, dict[str, str]] = {
    NetStack.NONE: _SOCKETS,
    NetStack.FAST_SOCKET: _FAST_SOCKET,
    NetStack.TCPX: _TCPX,
    NetStack.TCPXO: _TCPXO,
    NetStack.RDMA: _RDMA,
}


def render(machine: MachineType | None, image_os: str | None = None) -> dict[str, str]:
    """The NCCL + gloo environment for one node of `machine` on `image_os` (default the type's).

    `machine=None` (a hostfile without a machine type, `--local`, the simulated cluster) gives
    the plain-socket profile. GLOO_SOCKET_IFNAME always follows NCCL_SOCKET_IFNAME: gloo's
    bootstrap must use the same host NIC (CTK-A3M and CTK-A3U nemo-framework/Dockerfile set both).
    """
    if machine is None:
        names: dict[str, str] = {"host": HOST_IFACE_ON_NODE, "hosts": HOST_IFACE_ON_NODE, "gpu": ""}
        profile = PROFILES[NetStack.NONE]
    else:
        ifaces = machine.interface_names(image_os)
        roles = [n.role for n in machine.nics]
        host_names = [i for i, r in zip(ifaces, roles) if r == "host"]
        gpu_names = [i for i, r in zip(ifaces, roles) if r == "gpu"]
        host = host_names[0] or HOST_IFACE_ON_NODE
        names = {
            "host": host,
            # All host NICs only when every name is known; else the one resolved on the node.
            "hosts": ",".join(host_names) if all(host_names) else host,
            "gpu": ",".join(g for g in gpu_names if g),
        }
        names.update({f"gpu{i}": g or "" for i, g in enumerate(gpu_names)})
        profile = dict(PROFILES[machine.net_stack])
        if machine.net_stack is NetStack.RDMA and machine.family in TUNER_CONFIG:
            profile["NCCL_TUNER_CONFIG_PATH"] = TUNER_CONFIG[machine.family]
    env = {key: value.format(**names) for key, value in profile.items()}
    env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"]
    return env
