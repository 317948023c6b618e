"""What a training container needs from its node, per machine family and image OS: pure data
and one function (`wiring`). The launcher renders it into a runtime's argv
(launcher.core.container); nothing here runs anything.

Sources, each value below names one:
- CTK-A3H: github.com/GoogleCloudPlatform/cluster-toolkit @146b72d
  examples/machine-learning/a3-highgpu-8g/nccl-tests/run-nccl-tests.sh;
- CTK-A3M: the same repository @2452d0d examples/machine-learning/a3-megagpu-8g/nccl-tests/
  run-nccl-tests.sh (`/var/lib/tcpxo/lib64` and `/dev/aperture_devices` mounted, the FasTrak
  profile `nccl-env-profile.sh` sourced on the host and its NCCL_* passed into the container,
  `LD_LIBRARY_PATH=/var/lib/tcpxo/lib64:...:$LD_LIBRARY_PATH` set inside);
- SLURMGCP: github.com/GoogleCloudPlatform/slurm-gcp @5075fbc tools/prologs-epilogs/
  receive-data-path-manager (RxDM, the daemon the workload's plugin talks to);
- DSTACK-PROV: github.com/dstackai/dstack @23392a5 src/dstack/_internal/server/services/backends/
  provisioning.py (`get_instance_specific_mounts`, `get_instance_specific_gpu_devices`);
- DSTACK-TCPX: the same repository @16ddda8 src/dstack/_internal/core/backends/gcp/features/tcpx.py
  (RxDM's own `docker run`: `/run/tcpx`, `/var/lib/nvidia/lib64:/usr/local/nvidia/lib64`, the
  `/dev/nvidia*` devices, as Google's COS guide has it);
- GCE-TCPX: Google's "Maximize GPU network bandwidth with GPUDirect-TCPX" for A3 High on COS
  (https://cloud.google.com/compute/docs/gpus/gpudirect), whose workload container gets
  `--cap-add=IPC_LOCK --userns=host --shm-size=1g --ulimit memlock=-1 --ulimit stack=67108864`,
  the driver from `/var/lib/nvidia`, the plugin from `/var/lib/tcpx/lib64`, and the devices.

Where gpufleet differs, and why:
- Plugin directories are mounted at the SAME path as on the host (CTK-A3M does this for TCPXO;
  DSTACK-PROV and GCE-TCPX move TCPX's to /usr/local/tcpx/lib64): the node's NCCL profile
  (gpufleet.nccl_env: LD_LIBRARY_PATH, NCCL_TUNER_CONFIG_PATH, ...) then means the same inside
  the container as outside, so one profile serves both and `launch doctor` checks what the
  container will load.
- RxDM's socket directory: `/run/tcpx` at the same path (DSTACK-PROV), not GCE-TCPX's
  `/run/tcpx:/tmp`: our startup script starts RxDM with `--uds_path /run/tcpx` (DSTACK-TCPX) and
  the profile sets NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX=/run/tcpx.
- DSTACK-PROV also mounts `/var/lib/fastrak/lib64` on A3 Mega; our startup script installs the
  TCPXO plugin into /var/lib/tcpxo/lib64 only (CTK-A3M), so there is nothing there to mount.
- No `--shm-size`: the container shares the host's IPC namespace (`--ipc host`, so NCCL's and
  the data loaders' shared memory is the node's whole /dev/shm), where a size does not apply.
- `--ulimit memlock=-1 --ulimit stack=67108864` and `--cap-add IPC_LOCK` (GCE-TCPX) on every
  GPU family, not only TCPX: pinned host memory for GPUDirect needs them alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.catalog import MachineType, NetStack
from gpufleet.contracts import RXDM_SOCKET_DIR

__all__ = [
    "COS_DRIVER_BIN",
    "COS_DRIVER_LIB",
    "GPUS_ALL",
    "GPU_DEVICES",
    "Mount",
    "Wiring",
    "wiring",
]


@dataclass(frozen=True)
class Mount:
    """A host path bound into the container. A missing host path fails the run (bind mounts
    with `--mount`, which never creates the source, unlike `-v`)."""

    host: str
    container: str
    read_only: bool = False


# How the GPUs reach the container.
GPUS_ALL = "all"  # the NVIDIA Container Toolkit: docker `--gpus all`, podman CDI `nvidia.com/gpu=all`
GPU_DEVICES = "devices"  # COS: the /dev/nvidia* nodes by hand (no toolkit there), driver mounted

# COS installs the driver under /var/lib/nvidia (`cos-extensions install gpu`, DSTACK-TCPX); a
# container sees it at /usr/local/nvidia (DSTACK-PROV, GCE-TCPX).
COS_DRIVER_LIB = Mount("/var/lib/nvidia/lib64", "/usr/local/nvidia/lib64", read_only=True)
COS_DRIVER_BIN = Mount("/var/lib/nvidia/bin", "/usr/local/nvidia/bin", read_only=True)


@dataclass(frozen=True)
class Wiring:
    """Everything a machine family's container needs besides the job itself."""

    gpus: str | None = None  # GPUS_ALL | GPU_DEVICES | None (no GPUs: CPU nodes, the tests)
    devices: tuple[str, ...] = ()  # device nodes passed at the same path
    mounts: tuple[Mount, ...] = ()
    # Directories prepended inside the container to its own LD_LIBRARY_PATH (CTK-A3M exports
    # `LD_LIBRARY_PATH=/var/lib/tcpxo/lib64:...:$LD_LIBRARY_PATH` in the container, so the
    # image's own entries stay).
    library_path: tuple[str, ...] = ()
    # Runtime options with a value, as (flag, value) pairs.
    options: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()  # what --dry-run says about it, one line each


# GCE-TCPX's workload container options for pinned memory (see the module docstring).
_PINNED = (("--cap-add", "IPC_LOCK"), ("--ulimit", "memlock=-1"), ("--ulimit", "stack=67108864"))


def _cos_gpu_devices(gpu_count: int) -> tuple[str, ...]:
    # DSTACK-PROV get_instance_specific_gpu_devices, DSTACK-TCPX: /dev/nvidia0..7, nvidia-uvm, nvidiactl.
    return (*(f"/dev/nvidia{i}" for i in range(gpu_count)), "/dev/nvidia-uvm", "/dev/nvidiactl")


def wiring(machine: MachineType | None, image_os: str | None = None) -> Wiring:
    """The container wiring for a node of `machine` on `image_os` (default: the type's own).
    `machine=None` (a hostfile without a machine type, the simulated cluster): no GPUs, only
    the host's network, IPC and process namespaces that every container gets."""
    if machine is None:
        return Wiring()
    os_ = image_os or machine.image_os
    mounts: list[Mount] = []
    devices: tuple[str, ...] = ()
    library_path: list[str] = []
    notes: list[str] = []
    if os_ == "cos":
        gpus = GPU_DEVICES
        devices = _cos_gpu_devices(machine.gpu_count)
        mounts += [COS_DRIVER_LIB, COS_DRIVER_BIN]
        library_path.append(COS_DRIVER_LIB.container)
        notes.append("COS: the driver from /var/lib/nvidia and the /dev/nvidia* devices (no container toolkit)")
    else:
        gpus = GPUS_ALL
        notes.append("GPUs through the NVIDIA Container Toolkit (the startup script configures it for docker)")
    if machine.net_stack is NetStack.TCPX:
        # The TCPX plugin the startup script installs (`install --install-nccl` into /var/lib/tcpx,
        # DSTACK-TCPX) and RxDM's socket directory (DSTACK-PROV: /run/tcpx at /run/tcpx).
        mounts += [
            Mount("/var/lib/tcpx/lib64", "/var/lib/tcpx/lib64", read_only=True),
            Mount(RXDM_SOCKET_DIR, RXDM_SOCKET_DIR),
        ]
        library_path.insert(0, "/var/lib/tcpx/lib64")
        notes.append("GPUDirect-TCPX: plugin /var/lib/tcpx/lib64, RxDM sockets /run/tcpx")
    elif machine.net_stack is NetStack.TCPXO:
        # CTK-A3M, DSTACK-PROV: the plugin and the aperture devices, each at its own path. The
        # FasTrak profile (nccl-env-profile.sh in the plugin directory) is the node's NCCL
        # environment (gpufleet.nccl_env, passed in by name) and is readable inside too.
        mounts += [
            Mount("/var/lib/tcpxo/lib64", "/var/lib/tcpxo/lib64", read_only=True),
            Mount("/dev/aperture_devices", "/dev/aperture_devices"),
        ]
        library_path.insert(0, "/var/lib/tcpxo/lib64")
        notes.append("GPUDirect-TCPXO: plugin /var/lib/tcpxo/lib64, /dev/aperture_devices, the FasTrak profile")
    elif machine.net_stack is NetStack.FAST_SOCKET and os_ == "ubuntu":
        # The google-fast-socket package's plugin (infra/templates/fastsocket.sh) at its path.
        mounts.append(Mount("/usr/lib/libnccl-net.so", "/usr/lib/libnccl-net.so", read_only=True))
        notes.append("NCCL Fast Socket: /usr/lib/libnccl-net.so")
    elif machine.net_stack is NetStack.RDMA:
        # The gIB plugin directory the node's profile points at (gpufleet.nccl_env _RDMA) and the
        # CX-7 NICs' verbs devices.
        mounts.append(Mount("/usr/local/gib", "/usr/local/gib", read_only=True))
        devices = (*devices, "/dev/infiniband")
        library_path.insert(0, "/usr/local/gib/lib64")
        notes.append("GPUDirect-RDMA: gIB plugin /usr/local/gib, /dev/infiniband")
    return Wiring(
        gpus=gpus,
        devices=devices,
        mounts=tuple(mounts),
        library_path=tuple(library_path),
        options=_PINNED,
        notes=tuple(notes),
    )
