"""Render a node's startup script from infra/templates/. Pure: no pulumi, no I/O beyond the templates.

`base.sh` holds the steps every node runs (NIC wait, driver, persistence, ulimits, local SSD RAID0,
nccl-tests, ready marker); one file per network stack defines `net_stack_setup`. `controller.sh` is
the controller VM's (a venv with the Compute Engine client, or the launcher itself; its ready
marker). Both take the helpers in `common.sh`. Placeholders are `@@NAME@@` (bash's own `$NAME`
stays untouched); every value is shell-quoted.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from importlib import resources

from gpufleet.catalog import MachineType, NetStack
from gpufleet.contracts import (
    CONTROLLER_READY_MARKER,
    CONTROLLER_VENV,
    LOCAL_SSD_MOUNT,
    NCCL_TESTS_DIR,
    READY_MARKER,
    RXDM_CONTAINER,
    RXDM_SOCKET_DIR,
)
from infra import pins

__all__ = [
    "STACK_TEMPLATES",
    "LAUNCH_LINK",
    "COMPUTE_REQUIREMENT",
    "GPUDIRECT_REGISTRY",
    "render_startup_script",
    "render_controller_script",
]

# Where the controller's script links `launch` (CONTROLLER_VENV/bin/launch), so a login shell has it.
LAUNCH_LINK = "/usr/local/bin/launch"

# The Compute Engine client the controller restarts stopped nodes with, as gpufleet's own core
# dependency pins it (pyproject.toml [project] dependencies; tests/infra/test_startup.py holds the
# two equal): what the controller's venv gets when no source installs gpufleet itself.
COMPUTE_REQUIREMENT = "google-cloud-compute>=1.14"

# The template that defines net_stack_setup for each stack.
STACK_TEMPLATES: dict[NetStack, str] = {
    NetStack.NONE: "none.sh",
    NetStack.FAST_SOCKET: "fastsocket.sh",
    NetStack.TCPX: "tcpx.sh",
    NetStack.TCPXO: "tcpxo.sh",
    NetStack.RDMA: "rdma.sh",
}

_PLACEHOLDER = re.compile(r"@@([A-Z_]+)@@")


@cache
def _template(name: str) -> str:
    return resources.files("infra").joinpath("templates", name).read_text(encoding="utf-8")


def _fill(text: str, values: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        try:
            return values[m.group(1)]
        except KeyError:
            raise ValueError(f"template placeholder @@{m.group(1)}@@ has no value") from None

    return _PLACEHOLDER.sub(sub, text)


# The Artifact Registry host of Google's GPUDirect images (infra/pins.py TCPX_*, TCPXO_*).
GPUDIRECT_REGISTRY = "us-docker.pkg.dev"


def _words(values: tuple[str, ...] | list[str]) -> str:
    return " ".join(shlex.quote(v) for v in values)


def _pin_values() -> dict[str, str]:
    """Every pin the templates take (infra/pins.py), shell-quoted."""
    q = shlex.quote
    return {
        "NCCL_TESTS_URL": q(pins.NCCL_TESTS.url),
        "NCCL_TESTS_PIN": q(pins.NCCL_TESTS.commit),
        "CUDA_KEYRING_URL": pins.CUDA_KEYRING_URL.format(release="${release}"),
        "CUDA_KEYRING_SUMS": " ".join(f"[{r}]={q(s)}" for r, s in sorted(pins.CUDA_KEYRING_SHA256.items())),
        "NVIDIA_CTK_KEY_URL": q(pins.NVIDIA_CONTAINER_TOOLKIT_KEY.url),
        "NVIDIA_CTK_KEY_FPRS": _words(pins.NVIDIA_CONTAINER_TOOLKIT_KEY.fingerprints),
        "NVIDIA_CTK_REPO": q(pins.NVIDIA_CONTAINER_TOOLKIT_REPO),
        "GOOGLE_APT_KEY_URL": q(pins.GOOGLE_CLOUD_APT_KEY.url),
        "GOOGLE_APT_KEY_FPRS": _words(pins.GOOGLE_CLOUD_APT_KEY.fingerprints),
        "AR_APT_KEY_URL": q(pins.ARTIFACT_REGISTRY_APT_KEY.url),
        "AR_APT_KEY_FPRS": _words(pins.ARTIFACT_REGISTRY_APT_KEY.fingerprints),
        "AR_TRANSPORT_REPO": q(pins.ARTIFACT_REGISTRY_TRANSPORT_REPO),
        "CUDA_DEVEL_IMAGE": q(pins.CUDA_DEVEL_IMAGE.ref),
        "TCPX_PLUGIN_IMAGE": q(pins.TCPX_PLUGIN.ref),
        "TCPX_RXDM_IMAGE": q(pins.TCPX_RXDM.ref),
        "TCPX_PLUGIN_TAG": pins.TCPX_PLUGIN.tag,
        "TCPX_RXDM_TAG": pins.TCPX_RXDM.tag,
        "TCPXO_PLUGIN_IMAGE": q(pins.TCPXO_PLUGIN.ref),
        "TCPXO_RXDM_IMAGE": q(pins.TCPXO_RXDM.ref),
        "TCPXO_PLUGIN_TAG": pins.TCPXO_PLUGIN.tag,
        "TCPXO_RXDM_TAG": pins.TCPXO_RXDM.tag,
        "RXDM_CONTAINER": q(RXDM_CONTAINER),
        "RXDM_SOCKET_DIR": q(RXDM_SOCKET_DIR),
        "UV_VERSION": q(pins.UV["version"]),
        "UV_HASH": q(pins.UV["sha256"]),
    }


def render_startup_script(
    machine: MachineType, *, cluster: str, image_os: str, docker_registries: tuple[str, ...] = ()
) -> str:
    """The startup script for every node of `cluster` (identical across nodes: the node's index is
    in its labels and hostname, so one script serves the fleet). `docker_registries`: the
    Artifact Registry hosts of the stack's own repositories (e.g. "us-central1-docker.pkg.dev"),
    for which docker gets the VM's credentials, besides Google's GPUDirect images' host on A3
    High/Mega."""
    if image_os not in LOCAL_SSD_MOUNT:
        raise ValueError(f"image OS {image_os!r} is unknown; one of: {', '.join(LOCAL_SSD_MOUNT)}")
    gpu_nics = [
        name
        for nic, name in zip(machine.nics, machine.interface_names(image_os))
        if nic.role == "gpu" and name is not None
    ]
    registries = list(docker_registries)
    if machine.net_stack in (NetStack.TCPX, NetStack.TCPXO):
        registries.insert(0, GPUDIRECT_REGISTRY)
    values = {
        **_pin_values(),
        "DOCKER_REGISTRIES": _words(list(dict.fromkeys(registries))),
        "CLUSTER": shlex.quote(cluster),
        "MACHINE_TYPE": shlex.quote(machine.name),
        "NET_STACK": shlex.quote(machine.net_stack.value),
        "IMAGE_OS": shlex.quote(image_os),
        "GPU_COUNT": str(machine.gpu_count),
        "GPU_NICS": " ".join(shlex.quote(n) for n in gpu_nics),
        "LOCAL_SSD_COUNT": str(machine.local_ssd_count),
        "LOCAL_SSD_MOUNT": shlex.quote(LOCAL_SSD_MOUNT[image_os]),
        "READY_MARKER": shlex.quote(READY_MARKER),
        "NCCL_TESTS_DIR": shlex.quote(NCCL_TESTS_DIR),
        "RDMA_NIC_COUNT": str(sum(1 for n in machine.nics if n.role == "rdma")),
    }
    section = _fill(_template(STACK_TEMPLATES[machine.net_stack]), values).rstrip("\n")
    # re.sub does not rescan what it inserts, so the filled section goes in verbatim.
    return _fill(_template("base.sh"), {**values, "COMMON": _common(), "NET_STACK_SETUP": section})


def _common() -> str:
    return _template("common.sh").rstrip("\n")


def render_controller_script(*, cluster: str, source: str | None) -> str:
    """The controller VM's startup script: a venv at CONTROLLER_VENV with python and
    COMPUTE_REQUIREMENT, then CONTROLLER_READY_MARKER. With a `source`, it pip-installs
    `gpufleet @ SOURCE` there instead (which brings google-cloud-compute) and links `launch` on the
    PATH; without one the launcher ships its own code to the controller at first use. It installs
    once per requirement: a reboot with the same one installs nothing. `source` is any pip
    direct-reference URL; infra/config.py checks the one a stack gives (no credentials: the
    script is instance metadata)."""
    requirement = f"gpufleet @ {source}" if source else COMPUTE_REQUIREMENT
    imports = "launcher.cli, google.cloud.compute_v1" if source else "google.cloud.compute_v1"
    values = {
        "CLUSTER": shlex.quote(cluster),
        "SOURCE": shlex.quote(source or ""),
        "REQUIREMENT": shlex.quote(requirement),
        "IMPORTS": shlex.quote(imports),
        "VENV": shlex.quote(CONTROLLER_VENV),
        "LAUNCH_LINK": shlex.quote(LAUNCH_LINK),
        "READY_MARKER": shlex.quote(CONTROLLER_READY_MARKER),
        "COMMON": _common(),
    }
    return _fill(_template("controller.sh"), values)
