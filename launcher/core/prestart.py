"""What every launch's pre-start check asks a node about its hardware, the cheap part of `launch
doctor` (a node without its GPUs or NICs must not start a job that would hang or crawl): what the
catalog says a node of the machine type has (`Expectation`), and the bash statements of `launch
doctor`'s node script that report its GPUs, NICs and receive-datapath manager as `key=value`
lines. Pure functions.

A launch with a known machine type (stack outputs, --label, --machine-type) adds the same checks
to every node's plan (launcher.core.node_plan.hardware_checks, from `expectation`), which the node
answers in the same lines (launcher.core.node_start), on the launching machine's launch and in a
detached job's controller's alike. Without a machine type (a hostfile alone, --local, CPU nodes)
nothing is added, so such launches cost what they did.

The answers are judged above core, by launcher.health: its pre-start verdict
(launcher.health.prestart), which a launch takes as its `verdict`, refuses a node that lacks a GPU
or a NIC and warns about drift; `launch doctor` builds its full check on these statements.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from gpufleet.catalog import MachineType, NetStack, UnknownMachineType, lookup
from gpufleet.contracts import LOCAL_SSD_MOUNT, RXDM_CONTAINER
from gpufleet.health import GPU_QUERY_FIELDS
from launcher.core.types import UserError

__all__ = [
    "Expectation",
    "expectation",
    "gpu_statement",
    "nic_statements",
    "rxdm_statement",
]


@dataclass(frozen=True)
class Expectation:
    """What the catalog says every node of the cluster should have; mostly empty when the
    machine type is unknown (a hostfile without --machine-type), where only drift is judged."""

    machine_type: str | None = None
    gpu_count: int | None = None
    gpu_model: str | None = None
    gpu_memory_gb: int | None = None
    device_names: tuple[str, ...] = ()  # substrings of nvidia-smi's name (catalog GPU.device_names)
    nics: tuple[tuple[str, str, int | None], ...] = ()  # (name on the image, role, MTU to expect)
    rdma_devices: int = 0  # CX-7 NICs, seen as RDMA devices under /sys/class/infiniband
    net_stack: str | None = None
    rxdm: bool = False  # the receive-datapath manager must run (TCPX, TCPXO)
    plugin_dir: str | None = None  # where the NCCL net plugin must be: the env's LD_LIBRARY_PATH
    local_ssd_mount: str | None = None  # the RAID0 of the bundled local SSDs, when it has some


def expectation(
    machine_type: str | None, image_os: str | None = None, env: Mapping[str, str] | None = None
) -> Expectation:
    """The catalog's entry for `machine_type` on `image_os`, as checks. `env` is the environment
    a launch exports on the nodes (launcher.core.env.node_env): the NCCL plugin must be in the first
    directory of its LD_LIBRARY_PATH, which is where NCCL will look (NCCL docs, NCCL_NET_PLUGIN)."""
    if machine_type is None:
        return Expectation()
    try:
        mt: MachineType = lookup(machine_type)
        names = mt.interface_names(image_os)
    except (UnknownMachineType, ValueError) as e:
        raise UserError(str(e)) from None
    os_ = image_os or mt.image_os
    nics = tuple(
        (name, nic.role, mt.gpu_mtu if nic.role == "gpu" else None) for name, nic in zip(names, mt.nics) if name
    )
    plugin_dir = None
    if mt.net_stack is not NetStack.NONE and env and env.get("LD_LIBRARY_PATH"):
        plugin_dir = env["LD_LIBRARY_PATH"].split(":")[0]
    return Expectation(
        machine_type=mt.name,
        gpu_count=mt.gpu_count,
        gpu_model=mt.gpu.model,
        gpu_memory_gb=mt.gpu.memory_gb,
        device_names=mt.gpu.device_names,
        nics=nics,
        rdma_devices=sum(1 for n in mt.nics if n.role == "rdma"),
        net_stack=mt.net_stack.value,
        rxdm=mt.net_stack in (NetStack.TCPX, NetStack.TCPXO),
        plugin_dir=plugin_dir,
        local_ssd_mount=LOCAL_SSD_MOUNT[os_] if mt.local_ssd_count else None,
    )


def gpu_statement(cuda: bool = False) -> str:
    """nvidia-smi's documented CSV query (`--query-gpu=<GPU_QUERY_FIELDS> --format=csv,noheader,
    nounits`), run in the background: `smi_rc=` (127: no nvidia-smi; nonzero: no driver, with
    nvidia-smi's own reason on the first `gpu.0=` line) and one `gpu.N=` line per GPU; with `cuda`,
    also the CUDA version, which only plain nvidia-smi's header gives. Ends in `&`: the caller
    runs `wait` before its marker. Each line is one write of a few hundred bytes, so lines of
    concurrent probes never mix (POSIX: pipe writes of at most PIPE_BUF bytes are atomic)."""
    fields = ",".join(GPU_QUERY_FIELDS)
    s = (
        f"{{ O=$(nvidia-smi --query-gpu={fields} --format=csv,noheader,nounits 2>&1); echo smi_rc=$?; "
        "printf '%s\\n' \"$O\" | awk 'NF {print \"gpu.\" n++ \"=\" $0}'; "
    )
    if cuda:
        s += "echo cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\\([0-9.]*\\).*/\\1/p' | head -n 1); "
    return s + "} &"


def nic_statements(expect: Expectation) -> list[str]:
    """`nic.NAME=<operstate> <mtu> <flags>` (or `nic.NAME=missing`) for every NIC the catalog names
    on the image, from /sys/class/net; `read` is a builtin, so no fork per file."""
    out = []
    for name, _, _ in expect.nics:
        d = f"/sys/class/net/{shlex.quote(name)}"
        out.append(
            f"if [ -e {d} ]; then read -r o < {d}/operstate; read -r m < {d}/mtu; read -r f < {d}/flags; "
            f'echo "nic.{name}=$o $m $f"; else echo nic.{name}=missing; fi'
        )
    return out


def rxdm_statement() -> str:
    """`rxdm_rc=` (docker's status: 127 no docker) and `rxdm=` (the running RxDM container's id,
    empty when it does not run), asking docker as the user, else through `sudo -n` (the socket is
    root's on COS and with Ubuntu's docker.io)."""
    # `docker ps` without -a lists running containers only.
    f = f"-f {shlex.quote(f'name=^{RXDM_CONTAINER}$')}"
    return (
        f"R=$(docker ps -q {f} 2>&1); rc=$?; if [ $rc != 0 ]; then "
        f"R2=$(sudo -n docker ps -q {f} 2>/dev/null) && {{ R=$R2; rc=0; }}; fi; "
        "echo rxdm_rc=$rc; echo \"rxdm=$(printf '%s' \"$R\" | head -n 1)\""
    )
