"""What a node says about its own health, as text, parsed. Pure functions, no processes.

These formats cross a boundary: a node prints them (nvidia-smi, the kernel log, the metadata
server) and the launcher judges them (`launcher.health`), so each is read in one place here.

- `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`: one line per GPU, the fields in
  the order asked, separated by ", " (nvidia-smi(1), "--format"; `nvidia-smi --help-query-gpu`
  documents each field). A field a GPU does not report prints as "[N/A]" or "[Not Supported]":
  an H100 prints "[N/A]" for `retired_pages.pending`, as it remaps rows instead of retiring
  pages (tests/fixtures/nvidia-smi/h100-query.csv, our own measurement).
- the CUDA version the driver supports: only plain `nvidia-smi` prints it, in its header
  ("CUDA Version: 13.0"); infra/templates/base.sh reads it the same way for the ready marker.
- XID errors: the driver logs "NVRM: Xid (PCI:0000:00:06): 79, pid=..., ..." in the kernel log
  (NVIDIA, "XID Errors", docs.nvidia.com/deploy/xid-errors).
- physical placement: `physical_host` (metadata server attribute, and the Compute Engine API's
  `resourceStatus.physicalHost`) is "/CLUSTER/BLOCK/SUBBLOCK/HOST" on A3 Ultra / A4 (the API's
  `ResourceStatusPhysicalHostTopology` names the parts cluster, block, subblock, host) and
  "/CLUSTER/RACK/HOST" on older placements (github.com/GoogleCloudPlatform/cluster-toolkit
  docs/slurm-topology.md).
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "GPU_QUERY_FIELDS",
    "GpuRow",
    "parse_gpu_query",
    "parse_cuda_version",
    "Xid",
    "parse_xids",
    "XID_HARDWARE",
    "GPU_LOG_ERRORS",
    "gpu_error",
    "PhysicalHost",
    "parse_physical_host",
    "majority",
]

# The fields doctor asks for, in order: what the GPU checks need (count, model, memory,
# driver, persistence mode, uncorrected ECC, pending retirement/remapping) plus three that help a
# person reading the table. The same list as bench/gpu_checks.sh captured on a real H100.
GPU_QUERY_FIELDS = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "memory.total",
    "driver_version",
    "persistence_mode",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "temperature.gpu",
    "power.draw",
    "utilization.gpu",
)

# What nvidia-smi prints for a value it cannot give (nvidia-smi(1) prints these bracketed).
_NOT_A_VALUE = {
    "[N/A]",
    "N/A",
    "[Not Supported]",
    "[Unknown Error]",
    "[Insufficient Permissions]",
    "[GPU is lost]",
    "[Requires Pstate Change]",
    "",
}


@dataclass(frozen=True)
class GpuRow:
    """One GPU as `nvidia-smi --query-gpu=GPU_QUERY_FIELDS` reports it. None = not reported."""

    index: int
    name: str
    uuid: str
    bus_id: str
    memory_mib: int | None  # memory.total with nounits: MiB
    driver: str
    persistence: bool | None  # "Enabled" / "Disabled"
    ecc_uncorrected: int | None  # volatile (since the driver loaded) uncorrected ECC errors
    retired_pending: bool | None  # a page waits to be retired at the next driver reload
    remapped_pending: bool | None  # a row waits to be remapped at the next GPU reset
    temperature_c: int | None
    power_w: float | None
    utilization_pct: int | None


def _value(raw: str) -> str | None:
    raw = raw.strip()
    return None if raw in _NOT_A_VALUE else raw


def _int(raw: str) -> int | None:
    v = _value(raw)
    return None if v is None else int(float(v))


def _float(raw: str) -> float | None:
    v = _value(raw)
    return None if v is None else float(v)


def _flag(raw: str, yes: str, no: str) -> bool | None:
    v = _value(raw)
    if v is None:
        return None
    if v not in (yes, no):
        raise ValueError(f"{v!r} is neither {yes!r} nor {no!r}")
    return v == yes


def parse_gpu_query(text: str) -> list[GpuRow]:
    """Every GPU in `nvidia-smi --query-gpu=<GPU_QUERY_FIELDS> --format=csv,noheader,nounits`
    output. Raises ValueError naming the line when a line is not that format."""
    rows = []
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for lineno, fields in enumerate(csv.reader(lines, skipinitialspace=True), 1):
        if len(fields) != len(GPU_QUERY_FIELDS):
            raise ValueError(
                f"nvidia-smi line {lineno} has {len(fields)} fields, expected "
                f"{len(GPU_QUERY_FIELDS)} ({','.join(GPU_QUERY_FIELDS)}): {lines[lineno - 1]!r}"
            )
        f = dict(zip(GPU_QUERY_FIELDS, fields))
        try:
            rows.append(
                GpuRow(
                    index=int(f["index"]),
                    name=f["name"].strip(),
                    uuid=f["uuid"].strip(),
                    bus_id=f["pci.bus_id"].strip(),
                    memory_mib=_int(f["memory.total"]),
                    driver=(_value(f["driver_version"]) or ""),
                    persistence=_flag(f["persistence_mode"], "Enabled", "Disabled"),
                    ecc_uncorrected=_int(f["ecc.errors.uncorrected.volatile.total"]),
                    retired_pending=_flag(f["retired_pages.pending"], "Yes", "No"),
                    remapped_pending=_flag(f["remapped_rows.pending"], "Yes", "No"),
                    temperature_c=_int(f["temperature.gpu"]),
                    power_w=_float(f["power.draw"]),
                    utilization_pct=_int(f["utilization.gpu"]),
                )
            )
        except ValueError as e:
            raise ValueError(f"nvidia-smi line {lineno}: {e}: {lines[lineno - 1]!r}") from None
    return rows


_CUDA_RE = re.compile(r"CUDA Version:\s*([0-9][0-9.]*)")


def parse_cuda_version(text: str) -> str | None:
    """The "CUDA Version" in plain `nvidia-smi` output's header, or None."""
    m = _CUDA_RE.search(text)
    return m.group(1) if m else None


@dataclass(frozen=True)
class Xid:
    pci: str  # the GPU's PCI address as the driver logs it
    code: int

    @property
    def hardware(self) -> bool:
        return self.code in XID_HARDWARE


# "NVRM: Xid (PCI:0000:00:06): 79, pid=1234, name=python, GPU has fallen off the bus."
_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?([^)]*)\): (\d+)")

# XIDs that mean the GPU or its memory is at fault, not the program that used it (NVIDIA, "XID
# Errors" catalog): 48 double-bit ECC, 61/62 internal micro-controller, 64 row-remapper failure,
# 74 NVLink, 79 fallen off the bus, 94/95 contained/uncontained ECC, 119/120 GSP, 140 unrecovered
# ECC. Others (13 graphics exception, 31 memory page fault, 43 stopped processing, 45 preemptive
# cleanup, 63 a row was remapped) are usually a program's fault or a recorded repair.
XID_HARDWARE = frozenset({48, 61, 62, 64, 74, 79, 94, 95, 119, 120, 140})


def parse_xids(lines: Iterable[str]) -> list[Xid]:
    """Every XID in kernel-log lines, in order."""
    out = []
    for line in lines:
        m = _XID_RE.search(line)
        if m:
            out.append(Xid(m.group(1).strip(), int(m.group(2))))
    return out


# What a rank's own output says when its GPU, not its program, failed: the CUDA runtime's
# description strings (cudaGetErrorString) of cudaErrorECCUncorrectable, cudaErrorNvlinkUncorrectable,
# cudaErrorDevicesUnavailable and cudaErrorNoDevice (https://docs.nvidia.com/cuda/cuda-runtime-api/
# group__CUDART__TYPES.html, enum cudaError), as torch raises them ("RuntimeError: CUDA error:
# uncorrectable ECC error encountered") and NCCL logs them ("Cuda failure '...'"), and NVML's
# NVML_ERROR_GPU_IS_LOST, "GPU is lost" (https://docs.nvidia.com/deploy/nvml-api/
# group__nvmlDeviceEnumvs.html). Each -> its name in a job's record. Left out on purpose: an
# illegal memory access, an unspecified launch failure or a device-side assert, which are most
# often the program's own fault (the node check's XIDs judge the GPU then).
GPU_LOG_ERRORS = (
    ("uncorrectable ECC error encountered", "uncorrectable ECC error"),
    ("uncorrectable NVLink error", "uncorrectable NVLink error"),
    ("GPU is lost", "GPU lost"),
    ("has fallen off the bus", "GPU fallen off the bus"),
    ("CUDA-capable device(s) is/are busy or unavailable", "GPU busy or unavailable"),
    ("no CUDA-capable device is detected", "no GPU detected"),
)


def gpu_error(lines: Iterable[str]) -> tuple[str, str] | None:
    """(the error's name, the line that says it) for the first line of `lines` that reports a
    failed GPU (GPU_LOG_ERRORS), else None."""
    for line in lines:
        for text, name in GPU_LOG_ERRORS:
            if text in line:
                return name, line.strip()
    return None


@dataclass(frozen=True, order=True)
class PhysicalHost:
    """Where a VM runs. `block`/`subblock` are None when the path does not have them."""

    cluster: str
    block: str | None
    subblock: str | None
    host: str

    @property
    def path(self) -> list[str]:
        """The parts from the widest to the narrowest (what topology sorting groups by)."""
        return [p for p in (self.cluster, self.block, self.subblock, self.host) if p is not None]


def parse_physical_host(value: str) -> PhysicalHost | None:
    """ "/CLUSTER/BLOCK/SUBBLOCK/HOST" or "/CLUSTER/RACK/HOST" (the rack is the block); None for
    an empty value (no placement policy: "The physical location information is available for VMs
    configured with a placement policy", cluster-toolkit docs/slurm-topology.md). ValueError otherwise."""
    value = value.strip()
    if not value:
        return None
    parts = value.split("/")
    if parts[0] != "" or any(not p for p in parts[1:]) or len(parts) not in (4, 5):
        raise ValueError(f"physical host {value!r} is not /CLUSTER/BLOCK/SUBBLOCK/HOST or /CLUSTER/RACK/HOST")
    if len(parts) == 5:
        return PhysicalHost(parts[1], parts[2], parts[3], parts[4])
    return PhysicalHost(parts[1], parts[2], None, parts[3])


K = TypeVar("K", bound=Hashable)


def majority(values: Mapping[K, str]) -> tuple[str | None, int]:
    """The value more keys hold than any other, and how many hold it; (None, n) on a tie for
    the top (no value to call the odd one out)."""
    if not values:
        return None, 0
    ranked = Counter(values.values()).most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return None, ranked[0][1]
    return ranked[0]
