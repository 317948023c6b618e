"""Render a node's startup script from infra/templates/. Pure: no pulumi, no I/O beyond the templates.

`base.sh` holds the steps every node runs (NIC wait, driver, persistence, ulimits, local SSD RAID0,
nccl-tests, ready marker); one file per network stack defines `net_stack_setup`. Placeholders are
`@@NAME@@` (bash's own `$NAME` stays untouched); every value is shell-quoted.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from importlib import resources

from gpufleet.catalog import MachineType, NetStack
from gpufleet.contracts import LOCAL_SSD_MOUNT, NCCL_TESTS_DIR, READY_MARKER

__all__ = ["STACK_TEMPLATES", "render_startup_script"]

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


def render_startup_script(machine: MachineType, *, cluster: str, image_os: str) -> str:
    """The startup script for every node of `cluster` (identical across nodes: the node's index is
    in its labels and hostname, so one script serves the fleet)."""
    if image_os not in LOCAL_SSD_MOUNT:
        raise ValueError(f"image OS {image_os!r} is unknown; one of: {', '.join(LOCAL_SSD_MOUNT)}")
    gpu_nics = [
        name
        for nic, name in zip(machine.nics, machine.interface_names(image_os))
        if nic.role == "gpu" and name is not None
    ]
    values = {
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
    return _fill(_template("base.sh"), {**values, "NET_STACK_SETUP": section})
