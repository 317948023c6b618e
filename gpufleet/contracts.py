"""The formats that cross a package boundary, each written once: producer and consumer import it.

Pure data and small pure functions: importing this module imports neither pulumi nor torch nor
click, so `infra/` (Pulumi), `launcher/` (the laptop) and `workloads/` (the nodes) all read it.

- The stack outputs: `infra/__main__.py` exports `stack_outputs(...)` (one `node_output(...)`
  per node); the launcher reads `pulumi stack output --json` back with `parse_stack_outputs`,
  which refuses anything it would have to guess at (a gap in the node indexes, a repeated one).
- Instance labels: infra sets `LABEL_CLUSTER` and `LABEL_NODE` on every node; the launcher's
  `--label` discovery ranks instances by `LABEL_NODE`. The controller VM carries `LABEL_CONTROLLER`
  instead, so discovery by the cluster label never takes it for a node.
- The controller VM (`controller` in the stack outputs, `controller_output(...)`): its startup
  script makes `CONTROLLER_VENV` (the Compute Engine client, or the launcher from the stack's
  controllerSource) and writes `CONTROLLER_READY_MARKER`.
- Paths on a node that the startup script makes and the launcher reads: `READY_MARKER`,
  `NCCL_TESTS_DIR`, `LOCAL_SSD_MOUNT`.
- uv, which builds the jobs' environments: `UV`, the version and wheel hash that the startup
  script installs (infra/pins.py renders it) and that the launcher's node agent pip-installs on a
  node that has no uv (launcher/code/pyenv.py puts it in the agent's request).
- The sweep's machine-readable line: `workloads.sweep` prints `sweep_json_line(doc)`, the
  launcher finds lines that start with `JSON_MARKER` and reads their rows as `SweepRow`s.
- A node program's own one-line error: it starts with one of `ERROR_LINE_PREFIXES`, and the
  launcher names the node that printed one as the cause of a failure (`is_error_line`).

Words: a *node* is one VM; its *index* in the stack outputs (and its `LABEL_NODE` value) is its
*rank* in the launch, 0 .. N-1, node 0 hosting the rendezvous.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "LABEL_CLUSTER",
    "LABEL_NODE",
    "READY_MARKER",
    "NCCL_TESTS_DIR",
    "LOCAL_SSD_MOUNT",
    "HOLDS_DIR",
    "UV",
    "uv_requirement",
    "LABEL_CONTROLLER",
    "CONTROLLER_VENV",
    "CONTROLLER_READY_MARKER",
    "RXDM_CONTAINER",
    "RXDM_SOCKET_DIR",
    "OUTPUT_KEYS",
    "NODE_KEYS",
    "BOOT_IMAGE_KEYS",
    "BOOT_OSES",
    "boot_image_os",
    "boot_image_output",
    "StackBootImage",
    "CONTROLLER_KEYS",
    "OUTPUTS_SHAPE",
    "OutputsError",
    "StackNode",
    "StackController",
    "StackOutputs",
    "node_output",
    "controller_output",
    "stack_outputs",
    "parse_stack_outputs",
    "JSON_MARKER",
    "SWEEP_JSON_VERSION",
    "SweepRow",
    "sweep_json_line",
    "ERROR_PREFIX",
    "SWEEP_ERROR_PREFIX",
    "LAUNCHER_ERROR_PREFIX",
    "ERROR_LINE_PREFIXES",
    "is_error_line",
]


# ---- labels and paths on a node ------------------------------------------------------------------

# Instance labels (GCE label keys: lowercase letters, digits, '-' and '_').
LABEL_CLUSTER = "gpufleet-cluster"  # value: the cluster name
LABEL_NODE = "gpufleet-node"  # value: the node's index (its rank), "0" .. "N-1"

# Written last by the startup script, atomically, on every boot once the node is usable. JSON:
# {"cluster", "node", "machine_type", "net_stack", "driver", "cuda", "nccl", "plugin", "nccl_tests",
#  "booted_at"}; a version the script could not determine is the string "unknown".
# /var/lib is writable on both Ubuntu and Container-Optimized OS (COS keeps / read-only).
READY_MARKER = "/var/lib/gpufleet/ready.json"

# nccl-tests binaries (all_reduce_perf, all_gather_perf, ...) are built here.
NCCL_TESTS_DIR = "/var/lib/gpufleet/nccl-tests/build"

# The RAID0 of the local NVMe SSDs, by image OS. Ubuntu: /mnt/localssd, where
# github.com/GoogleCloudPlatform/cluster-toolkit modules/scripts/startup-script/files/setup-raid.yml
# mounts it. COS keeps / read-only; /mnt/disks is its writable place for extra disks.
LOCAL_SSD_MOUNT = {"ubuntu": "/mnt/localssd", "cos": "/mnt/disks/localssd"}

# Who holds a node (launcher.core.holds): root's, mode 1777, made by the startup script at every
# boot (infra/templates/base.sh, make_holds_dir); the launcher reads and writes it on the nodes.
HOLDS_DIR = "/run/gpufleet-holds"

# uv, which builds the jobs' environments on Ubuntu nodes: one wheel from PyPI, by version and by
# the SHA-256 PyPI lists for it (https://pypi.org/project/uv/0.13.9/#files,
# uv-0.13.9-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl), installed with
# pip --require-hashes, so a different file is refused: by the startup script, and by the node
# agent on a node that ran none (launcher.code.node_agent.find_uv).
UV = {
    "version": "0.13.9",
    "sha256": "d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19",
}


def uv_requirement() -> str:
    """UV as one line of a requirements file for `pip install --require-hashes`."""
    return f"uv=={UV['version']} --hash=sha256:{UV['sha256']}"


# The controller VM's label (value: the cluster name). It does not carry LABEL_CLUSTER: `--label
# gpufleet-cluster=NAME` lists the nodes alone, and a node count never includes the controller.
LABEL_CONTROLLER = "gpufleet-controller"

# On the controller VM: the virtual environment its startup script installs google-cloud-compute
# (for restarting stopped nodes) into, or with gpufleet:controllerSource the launcher itself, whose
# `launch` is then CONTROLLER_VENV/bin/launch. Without a source the launcher runs its shipped code
# with this venv's python.
CONTROLLER_VENV = "/opt/gpufleet/venv"
# Written last by the controller's startup script, atomically, at every boot once the launcher is
# installed. JSON: {"cluster", "controller", "source", "gpufleet", "google_cloud_compute",
# "booted_at"} (a version the script could not read is "unknown"; "source" and "gpufleet" are null
# without gpufleet:controllerSource).
CONTROLLER_READY_MARKER = "/var/lib/gpufleet/controller-ready.json"

# On A3 High and A3 Mega nodes the startup script runs GPUDirect's receive-datapath manager (RxDM)
# as the docker container of this name (`docker ps --filter name=^receive-datapath-manager$`
# lists it while it runs); on A3 High its Unix sockets are in RXDM_SOCKET_DIR (TCPX's --uds_path,
# which a job's container mounts at the same path). TCPXO's RxDM has no socket directory.
RXDM_CONTAINER = "receive-datapath-manager"
RXDM_SOCKET_DIR = "/run/tcpx"


# ---- the stack outputs ---------------------------------------------------------------------------

# The stack outputs, exactly, in the order infra exports them.
OUTPUT_KEYS = (
    "cluster",
    "project",
    "zone",
    "machineType",
    "nodes",
    "spares",
    "controller",
    "placementPolicy",
    "networks",
    "checkpointBucket",
    "packageIndex",
    "image",
    "imageRepository",
    "bootImage",
)
# One entry of `nodes`. externalIp is null unless the stack asks for external IPs.
NODE_KEYS = ("name", "index", "internalIp", "externalIp", "zone")
# The `controller` output: the cluster's controller VM, as a node entry without an index.
# Absent when the stack turns the controller off (`gpufleet:controller false`).
CONTROLLER_KEYS = ("name", "internalIp", "externalIp", "zone")

# The `bootImage` output: what every node boots. `os` ("ubuntu" or "cos") decides whether the
# launcher can build a Python environment on the node (COS has no Python to build one with, so a
# launch there needs a container image); `image` is the image path as the stack gave it, `family`
# its family name when the path names one (Compute Engine then boots the family's newest image).
# Outputs written before this key existed have none: the launcher then knows no OS.
BOOT_IMAGE_KEYS = ("os", "image", "family")
BOOT_OSES = ("ubuntu", "cos")


def boot_image_os(image: str) -> str:
    """ "cos" for a Container-Optimized OS image path (Google publishes them in the project
    cos-cloud, families cos-*: https://cloud.google.com/container-optimized-os/docs/concepts/versioning),
    "ubuntu" for any other: what picks the NIC names, the script's paths and whether a job needs a
    container image."""
    return "cos" if "cos-cloud" in image or "/cos-" in image or image.startswith("cos-") else "ubuntu"


def boot_image_output(image: str) -> dict[str, Any]:
    """The `bootImage` output for a boot disk image path (projects/P/global/images/family/F or
    .../images/NAME)."""
    _, sep, family = image.partition("/images/family/")
    return dict(zip(BOOT_IMAGE_KEYS, (boot_image_os(image), image, family if sep else None)))


# What a reader is told to expect when a document is not the stack outputs.
OUTPUTS_SHAPE = (
    "expected the infra stack's outputs (cluster, zone, machineType, nodes: [{name, index, internalIp, externalIp}])"
)


class OutputsError(ValueError):
    """Stack outputs the launcher refuses. str() is one line: what is wrong, and the fix."""


@dataclass(frozen=True)
class StackNode:
    """One node of the stack outputs; `index` is its rank."""

    index: int
    internal_ip: str  # what every node reaches it at (the rendezvous uses these)
    external_ip: str | None = None
    name: str = ""
    zone: str | None = None


@dataclass(frozen=True)
class StackController:
    """The controller VM of the stack outputs: not a node, it runs detached jobs' controllers."""

    name: str
    internal_ip: str  # what the nodes and the controller reach each other at
    external_ip: str | None = None
    zone: str | None = None


@dataclass(frozen=True)
class StackBootImage:
    """What the stack's nodes boot (the `bootImage` output)."""

    os: str  # one of BOOT_OSES
    image: str
    family: str | None = None


@dataclass(frozen=True)
class StackOutputs:
    """The stack outputs the launcher uses; `nodes` in rank order, indexes exactly 0 .. N-1."""

    nodes: tuple[StackNode, ...]
    cluster: str | None = None
    project: str | None = None
    zone: str | None = None
    machine_type: str | None = None
    controller: StackController | None = None
    """None when the stack has no controller VM (`controller` absent or null)."""
    package_index: str | None = None
    """`packageIndex`: where the nodes get packages (launcher.code); None when the stack has none."""
    image: str | None = None
    """The container image the nodes run by default (`image`, from gpufleet:containerImage); None: none."""
    boot_image: StackBootImage | None = None
    """What the nodes boot (`bootImage`); None in outputs written before the key existed."""
    spares: int = 0
    """`spares` (gpufleet:spares): how many of the last nodes are a detached --recover job's
    spares by default; 0 in outputs written before the key existed."""


def node_output(*, name: Any, index: int, internal_ip: Any, external_ip: Any, zone: Any) -> dict[str, Any]:
    """One entry of the `nodes` output, as infra exports it. Values may be Pulumi Outputs."""
    return dict(zip(NODE_KEYS, (name, index, internal_ip, external_ip, zone)))


def controller_output(*, name: Any, internal_ip: Any, external_ip: Any, zone: Any) -> dict[str, Any]:
    """The `controller` output, as infra exports it. Values may be Pulumi Outputs."""
    return dict(zip(CONTROLLER_KEYS, (name, internal_ip, external_ip, zone)))


def stack_outputs(
    *,
    cluster: Any,
    project: Any,
    zone: Any,
    machine_type: Any,
    nodes: list[dict[str, Any]],
    placement_policy: Any,
    spares: int = 0,
    networks: Any,
    checkpoint_bucket: Any,
    controller: dict[str, Any] | None = None,
    package_index: Any = None,
    image: Any = None,
    image_repository: Any = None,
    boot_image: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every stack output by its key (OUTPUT_KEYS order): what infra/__main__.py exports.
    `controller` (a controller_output) is left out when None: a stack without one has no key.
    `packageIndex`: pip's index URL of the cluster's PyPI repository (null when the stack has none);
    `image`: the stack's default container image (gpufleet:containerImage; null when unset);
    `imageRepository`: the docker repository the nodes can pull from (HOST/PROJECT/REPOSITORY);
    `bootImage`: boot_image_output(the nodes' boot disk image); `spares`: how many of the last
    `nodes` are spares (gpufleet:spares)."""
    values = (
        cluster,
        project,
        zone,
        machine_type,
        nodes,
        spares,
        controller,
        placement_policy,
        networks,
        checkpoint_bucket,
        package_index,
        image,
        image_repository,
        boot_image,
    )
    return {k: v for k, v in zip(OUTPUT_KEYS, values) if k != "controller" or controller is not None}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_str(where: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise OutputsError(f"{where} is {value!r}, not a string; {OUTPUTS_SHAPE}")
    return value or None


def _stack_node(i: int, entry: Any) -> StackNode:
    def bad(what: str) -> OutputsError:
        return OutputsError(f"nodes[{i}] {what}; {OUTPUTS_SHAPE}")

    if not isinstance(entry, dict):
        raise bad("is not an object")
    ip = entry.get("internalIp")
    if not isinstance(ip, str) or not ip:
        raise bad("has no internalIp")
    if "index" not in entry:
        raise bad("has no index")
    index = entry["index"]
    if not _is_int(index):
        raise OutputsError(f"nodes[{i}].index is {index!r}, not an integer; {OUTPUTS_SHAPE}")
    if index < 0:
        raise OutputsError(f"nodes[{i}].index is {index}; node indexes count from 0; {OUTPUTS_SHAPE}")
    return StackNode(
        index=index,
        internal_ip=ip,
        external_ip=_optional_str(f"nodes[{i}].externalIp", entry.get("externalIp")),
        name=_optional_str(f"nodes[{i}].name", entry.get("name")) or "",
        zone=_optional_str(f"nodes[{i}].zone", entry.get("zone")),
    )


def _stack_controller(raw: Any, nodes: list[StackNode]) -> StackController | None:
    if raw is None:
        return None
    shape = "expected controller: {name, internalIp, externalIp, zone}, or no controller key"
    if not isinstance(raw, dict):
        raise OutputsError(f"'controller' is {type(raw).__name__}, not an object; {shape}")
    for key, what in (("name", "name"), ("internalIp", "internalIp")):
        value = raw.get(key)
        if not isinstance(value, str) or not value:
            shown = "" if value is None else f" ({value!r})"
            raise OutputsError(f"controller has no {what}{shown}; {shape}")
    ip = raw["internalIp"]
    for n in nodes:
        if n.internal_ip == ip:
            raise OutputsError(
                f"controller {raw['name']} has node {n.index}'s internalIp {ip}; the controller is its own "
                "VM, not a node: save the outputs again (`pulumi stack output --json > FILE`)"
            )
    return StackController(
        name=raw["name"],
        internal_ip=ip,
        external_ip=_optional_str("controller.externalIp", raw.get("externalIp")),
        zone=_optional_str("controller.zone", raw.get("zone")),
    )


def _stack_boot_image(raw: Any) -> StackBootImage | None:
    if raw is None:
        return None
    shape = f"expected bootImage: {{os: {' or '.join(BOOT_OSES)}, image, family}}, or no bootImage key"
    if not isinstance(raw, dict):
        raise OutputsError(f"'bootImage' is {type(raw).__name__}, not an object; {shape}")
    os_, image = raw.get("os"), raw.get("image")
    if os_ not in BOOT_OSES:
        raise OutputsError(f"bootImage.os is {os_!r}; {shape}")
    if not isinstance(image, str) or not image:
        raise OutputsError(f"bootImage has no image; {shape}")
    return StackBootImage(os=os_, image=image, family=_optional_str("bootImage.family", raw.get("family")))


def _check_indexes(nodes: list[StackNode]) -> None:
    """Indexes are the ranks: exactly 0 .. N-1. A gap is not closed up (nodes 0, 1, 3 would
    silently become ranks 0, 1, 2, and `--exclude`, logs and labels would name the wrong node)."""
    indexes = sorted(n.index for n in nodes)
    if len(set(indexes)) != len(indexes):
        raise OutputsError(f"node indexes repeat: {indexes}; each node must have its own index")
    missing = sorted(set(range(len(indexes))) - set(indexes))
    if missing:
        shown = ", ".join(map(str, indexes))
        raise OutputsError(
            f"node index {missing[0]} is missing (the nodes have indexes {shown}; ranks must be 0 .. "
            f"{len(indexes) - 1}); bring node {missing[0]} back with `pulumi up` and save the outputs "
            "again (`pulumi stack output --json > FILE`), or list the nodes to use in a --hostfile"
        )


def parse_stack_outputs(doc: Any) -> StackOutputs:
    """Read `pulumi stack output --json` (or a saved copy) into StackOutputs, nodes in rank order.

    Keys other than OUTPUT_KEYS are ignored (`python -m infra.preview --outputs` adds a note).
    Raises OutputsError (one line) for: a top level that is not an object; `nodes` missing,
    empty or not a list; a node without an internalIp or an integer index >= 0; a top-level
    string or a node's name/externalIp/zone of another type; a repeated index; a gap in the
    indexes (0, 1, 3 names index 2); a `controller` that is not an object with a name and an
    internalIp (a node's address refused), or whose externalIp/zone is not a string; a
    `bootImage` that is not an object with a known os and an image. No `controller` (or null) is
    a stack without a controller VM; no `bootImage` (older outputs) is an unknown one."""
    if not isinstance(doc, Mapping):
        raise OutputsError(f"top level is {type(doc).__name__}, not an object; {OUTPUTS_SHAPE}")
    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, list):
        what = "'nodes' is missing" if raw_nodes is None else "'nodes' is not a list"
        raise OutputsError(f"{what}; {OUTPUTS_SHAPE}")
    if not raw_nodes:
        raise OutputsError(f"'nodes' is empty; {OUTPUTS_SHAPE}")
    nodes = [_stack_node(i, n) for i, n in enumerate(raw_nodes)]
    _check_indexes(nodes)
    controller = _stack_controller(doc.get("controller"), nodes)
    keys = ("cluster", "project", "zone", "machineType", "image", "packageIndex")
    top = {k: _optional_str(k, doc.get(k)) for k in keys}
    return StackOutputs(
        nodes=tuple(sorted(nodes, key=lambda n: n.index)),
        cluster=top["cluster"],
        project=top["project"],
        zone=top["zone"],
        machine_type=top["machineType"],
        controller=controller,
        package_index=top["packageIndex"],
        image=top["image"] or None,
        boot_image=_stack_boot_image(doc.get("bootImage")),
        spares=_stack_spares(doc.get("spares"), len(nodes)),
    )


def _stack_spares(value: Any, n: int) -> int:
    """The `spares` output: an integer from 0 to n-1 (absent or null: 0)."""
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value < n:
        raise OutputsError(f"'spares' is {value!r}, not a count from 0 to {n - 1} (the nodes less one)")
    return value


# ---- the sweep's JSON line -----------------------------------------------------------------------

# The sweep's machine-readable line (workloads/sweep/ writes it, the launcher's nccl-tests
# reader reads it). It starts with '#' so that anything reading the output as an nccl-tests
# table skips it. The document: {"version", "nranks", "backend", "avg_busbw", "rows": [SweepRow
# fields]}, plus "round" and "nodes" for one group of a --rounds plan (gpufleet.groups).
JSON_MARKER = "#gpufleet-json "
SWEEP_JSON_VERSION = 1


@dataclass
class SweepRow:
    """One table line: a collective at one size, out-of-place then in-place.

    `*_wrong` is the number of wrong elements (`#wrong`), or with `error_column` True the old
    max-error value; None where the output said N/A (not checked) or printed no block.
    """

    collective: str
    size: int
    count: int
    type: str
    redop: str
    root: int
    nranks: int
    oop_time_us: float | None
    oop_algbw: float | None
    oop_busbw: float | None
    oop_wrong: float | None
    ip_time_us: float | None
    ip_algbw: float | None
    ip_busbw: float | None
    ip_wrong: float | None
    error_column: bool = False
    iters: int | None = None
    """Timed calls behind each block's time: -n, or fewer where the sweep's --time-budget cut a
    slow size short (workloads/sweep/); None where the output does not say (nccl-tests)."""

    @property
    def best_busbw(self) -> float:
        """The better of the two blocks: what the fabric can do at this size."""
        return max((b for b in (self.oop_busbw, self.ip_busbw) if b is not None), default=0.0)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SweepRow:
        """A row of the JSON document; keys this version does not know are left out."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def sweep_json_line(doc: Mapping[str, Any]) -> str:
    """The one line (newline included) that carries a sweep's document."""
    return JSON_MARKER + json.dumps(doc, separators=(",", ":")) + "\n"


# ---- a node program's own error line ----------------------------------------------------------------

# A program's own one-line error, a statement of the cause rather than a consequence. The
# launcher names the node that printed one before it was stopped as the cause of a failure.
ERROR_PREFIX = "error: "  # workloads.train
SWEEP_ERROR_PREFIX = "sweep: "  # workloads.sweep
LAUNCHER_ERROR_PREFIX = "gpufleet: "  # the launcher's node-side program (launcher.core.program)
ERROR_LINE_PREFIXES = (ERROR_PREFIX, SWEEP_ERROR_PREFIX, LAUNCHER_ERROR_PREFIX)


def is_error_line(line: str) -> bool:
    """Whether `line` is a node program's own statement of what went wrong."""
    return line.startswith(ERROR_LINE_PREFIXES)
