"""Stack configuration -> one typed, validated `FleetSpec`, before any resource is declared.

Pulumi hands a program its config as strings (the CLI serialises every value, lists and maps as
JSON text), so each key is parsed here with a check of its type and its range. Every mistake is
a `ConfigError` whose message is one line naming the key, the bad value and what is allowed.

This module imports pulumi only inside `read_spec()`, so `parse_spec()` is a pure function.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.catalog import COS_DEFAULT_CONTAINER_IMAGE, MachineType, UnknownMachineType, lookup
from gpufleet.contracts import LABEL_CLUSTER, LABEL_NODE, boot_image_os

__all__ = [
    "ConfigError",
    "FleetSpec",
    "NAMESPACE",
    "KEYS",
    "DEFAULTS",
    "IAP_RANGE",
    "COMPACT_PLACEMENT_MAX_VMS",
    "SUBNET_MAX_NODES",
    "parse_spec",
    "read_spec",
    "read_stack_file",
    "read_stack_config",
    "spec_warnings",
    "main",
]

NAMESPACE = "gpufleet"

# Identity-Aware Proxy's TCP forwarding range: SSH through `gcloud compute ssh --tunnel-through-iap`
# comes from here (https://cloud.google.com/iap/docs/using-tcp-forwarding#create-firewall-rule).
IAP_RANGE = "35.235.240.0/20"

# Upper bound of one compact placement policy. github.com/GoogleCloudPlatform/cluster-toolkit
# community/modules/scheduler/schedmd-slurm-gcp-v6-controller/modules/slurm_files/scripts/resume.py
# splits placement groups at PLACEMENT_MAX_CNT = 1500; github.com/GoogleCloudPlatform/slurm-gcp
# raised it 22 -> 150 -> 1500 as Google raised the limit. Older copies of Google's placement page
# still say "a maximum of 150 VMs".
COMPACT_PLACEMENT_MAX_VMS = 1500

# Every subnet is a /20 (infra/networks.py): 4096 addresses less the 4 GCE reserves.
SUBNET_MAX_NODES = 4092

DEFAULTS: dict[str, Any] = {
    "machineType": "a3-highgpu-8g",
    "nodes": 2,
    # Idle nodes beyond gpufleet:nodes for detached --recover jobs' --spares (launcher.jobs.spares).
    "spares": 0,
    "provisioning": "standard",
    # 200 GB holds the image, CUDA toolkit, containers and nccl-tests with room for logs.
    "bootDiskSizeGb": 200,
    "externalIp": False,
    "sshSourceRanges": (IAP_RANGE,),
    # Flex-start VMs need a max run duration (pulumi-gcp 10.2.0 InstanceSchedulingArgs
    # provisioning_model docstring); Google caps Flex-start runs at seven days.
    "maxRunHours": 24,
    # A small on-demand VM runs detached jobs' controllers, so no GPU node is special.
    "controller": True,
    # No default source: the project has no public home to install from. Without one the
    # controller's venv holds google-cloud-compute alone and the launcher ships its own code there
    # at first use, as it ships it to node 0, so the controller runs the client's launcher.
    "controllerSource": None,
    # An Artifact Registry remote repository caching PyPI in the nodes' region (infra/registries.py).
    "packageIndex": True,
    # No default container image: jobs run on the host unless `launch --image` or this names one.
    "containerImage": None,
}

# Every key this program reads, in the namespace `gpufleet`. Anything else there is a typo.
KEYS = (
    "machineType",
    "nodes",
    "spares",
    "name",
    "placement",
    "maxDistance",
    "provisioning",
    "reservation",
    "maxRunHours",
    "image",
    "bootDiskSizeGb",
    "externalIp",
    "sshSourceRanges",
    "serviceAccount",
    "checkpointBucket",
    "labels",
    "controller",
    "controllerSource",
    "packageIndex",
    "containerImage",
    "users",
)

_PLACEMENTS = ("compact", "none")
_PROVISIONING = ("standard", "spot", "flex-start")
# GCE resource names: RFC 1035, lowercase (https://cloud.google.com/compute/docs/naming-resources).
# 40 characters leave room for the longest suffix this program adds ("-gpu-net-8-subnet").
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_PROJECT_RE = re.compile(r"^([a-z0-9.-]+:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
_RESERVATION_RE = re.compile(r"^(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/reservations/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_SA_RE = re.compile(r"^[a-z0-9][-a-z0-9._]*@[a-z0-9][-a-z0-9.]*\.gserviceaccount\.com$")
_IMAGE_RE = re.compile(r"^(https://[-a-z0-9./]+|[a-z][-a-z0-9]*(/[-a-z0-9]+)*)$")
# GCE labels (https://cloud.google.com/compute/docs/labeling-resources#requirements).
_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
# GCS bucket names (https://cloud.google.com/storage/docs/buckets#naming): lowercase letters,
# digits, '-', '_', '.'; start and end with a letter or digit; 3-63 characters (up to 222 with
# dots, each dot-separated part at most 63); not an IP address; no "goog" prefix, no "google".
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
# A pip direct-reference source without credentials: the host part admits no `user:token@`, since
# the URL lands in instance metadata, which every process on the VM can read.
_SOURCE_RE = re.compile(
    r"^(git\+https://[a-z0-9.-]+(:[0-9]{1,5})?/[A-Za-z0-9._~/-]+(@[A-Za-z0-9._/-]+)?"
    r"|https://[a-z0-9.-]+(:[0-9]{1,5})?/[A-Za-z0-9._~/%+-]+\.(whl|tar\.gz|zip))$"
)


# A container image reference (https://github.com/distribution/reference reference.go grammar,
# lowercase path components): [HOST[:PORT]/]PATH[:TAG][@sha256:DIGEST].
_CONTAINER_IMAGE_RE = re.compile(
    r"^[a-z0-9]+([._-][a-z0-9]+)*(\.[a-z0-9-]+)*(:[0-9]{1,5})?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)


class ConfigError(ValueError):
    """Stack config values this program refuses: `.lines`, one per bad key (key, bad value, what is
    allowed). str() is those lines joined; one line where one key is bad."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lines: list[str] = message.splitlines() or [message]

    @classmethod
    def of(cls, lines: list[str]) -> ConfigError:
        return cls("\n".join(lines))


@dataclass(frozen=True)
class FleetSpec:
    """A validated fleet: what `pulumi up` will build."""

    cluster: str
    """Cluster name; prefixes every resource and labels every node."""
    project: str
    zone: str
    machine: MachineType
    nodes: int
    placement: str
    """"compact" (one COLLOCATED policy on every node) or "none"."""
    max_distance: int | None
    provisioning: str
    """"standard", "spot" or "flex-start"."""
    reservation: str | None
    """Specific reservation the nodes must consume."""
    max_run_hours: int
    """Flex-start only: how long GCE lets the nodes run."""
    image: str
    boot_disk_size_gb: int
    external_ip: bool
    ssh_source_ranges: tuple[str, ...]
    service_account: str | None
    """Existing node service account; None = create one with least privilege."""
    checkpoint_bucket: str | None
    labels: tuple[tuple[str, str], ...]
    """User labels (sorted pairs; frozen), added to every labelled resource."""
    controller: bool = True
    """Declare the controller VM (infra/controller.py)."""
    controller_source: str | None = None
    """What the controller's startup script pip-installs gpufleet from; None: the launcher ships
    its own code to the controller at first use (infra/startup.py render_controller_script)."""
    package_index: bool = True
    """Declare the PyPI remote repository and export its URL as `packageIndex`."""
    container_image: str | None = None
    """The jobs' default container image, exported as `image`; None: none. On a Container-Optimized
    OS boot image it defaults to the catalog's COS_DEFAULT_CONTAINER_IMAGE."""
    spares: int = 0
    """K more nodes after the `nodes` (indexes nodes .. nodes+K-1), exported as the `spares` output:
    a detached --recover job's --spares default, so they wait idle and replace a lost node."""
    users: tuple[str, ...] = ()
    """IAM members (`user:EMAIL`, `group:EMAIL`, ...) who may log in to the nodes and the
    controller through OS Login and IAP (infra/access.py grants it)."""

    @property
    def vm_count(self) -> int:
        """Every node VM the stack declares: the nodes and the spares."""
        return self.nodes + self.spares

    @property
    def region(self) -> str:
        return self.zone.rsplit("-", 1)[0]

    @property
    def machine_type(self) -> str:
        return self.machine.name

    @property
    def image_os(self) -> str:
        """ "cos" for Container-Optimized OS images, "ubuntu" otherwise: picks NIC names and script paths."""
        return boot_image_os(self.image)

    @property
    def cluster_labels(self) -> dict[str, str]:
        """The user's labels and the cluster label: what every labelled resource carries."""
        return {**dict(self.labels), LABEL_CLUSTER: self.cluster}

    def node_labels(self, index: int) -> dict[str, str]:
        return {**self.cluster_labels, LABEL_NODE: str(index)}


def _key(name: str) -> str:
    return f"{NAMESPACE}:{name}"


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    shown = value if isinstance(value, str) else json.dumps(value)
    return ConfigError(f"config {key} = {shown!r} is not allowed: {allowed}")


def _json(raw: Any) -> Any:
    """A config value as Pulumi wrote it: structured values arrive as JSON text."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _is_plain_string(raw: Any) -> bool:
    """True when the YAML value was a string (not a number, bool, list or map turned into text)."""
    if not isinstance(raw, str) or not raw.strip():
        return False
    return isinstance(_json(raw), str)


def _int(key: str, raw: Any, lo: int, hi: int, example: int) -> int:
    value = raw
    if isinstance(raw, str) and re.fullmatch(r"[+-]?[0-9]+", raw.strip()):
        value = int(raw)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _fail(_key(key), raw, f"a whole number from {lo} to {hi} (e.g. {example})")
    return value


def _bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise _fail(_key(key), raw, "true or false")


def _choice(key: str, raw: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(raw, str) or raw not in choices:
        raise _fail(_key(key), raw, f"one of: {', '.join(choices)}")
    return raw


def _string(key: str, raw: Any, pattern: re.Pattern[str], allowed: str) -> str:
    if not _is_plain_string(raw) or not pattern.fullmatch(raw):
        raise _fail(_key(key) if ":" not in key else key, raw, allowed)
    return raw


def _cidrs(key: str, raw: Any) -> tuple[str, ...]:
    value = _json(raw)
    allowed = 'a list of IPv4 CIDR ranges, e.g. ["35.235.240.0/20"]'
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise _fail(_key(key), raw, allowed)
    out = []
    for v in value:
        try:
            net = ipaddress.ip_network(v, strict=True)
        except ValueError as e:
            raise _fail(_key(key), v, f"{allowed} ({e})") from None
        if net.version != 4:
            raise _fail(_key(key), v, f"{allowed}; the cluster's networks are IPv4-only")
        out.append(str(net))
    return tuple(out)


def _labels(key: str, raw: Any) -> tuple[tuple[str, str], ...]:
    value = _json(raw)
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _fail(_key(key), raw, 'a map of label names to string values, e.g. {"team": "research"}')
    if len(value) > 62:  # GCE allows 64 labels per resource; two are ours.
        raise _fail(_key(key), raw, "at most 62 labels (GCE allows 64; gpufleet adds 2)")
    for k, v in value.items():
        if k in (LABEL_CLUSTER, LABEL_NODE):
            raise _fail(
                _key(key), k, f"a label name other than {LABEL_CLUSTER} and {LABEL_NODE}, which gpufleet sets itself"
            )
        if not _LABEL_KEY_RE.fullmatch(k):
            raise _fail(
                _key(key), k, "label names of 1-63 lowercase letters, digits, '_' or '-', starting with a letter"
            )
        if not _LABEL_VALUE_RE.fullmatch(v):
            raise _fail(_key(key), f"{k}={v}", "label values of 0-63 lowercase letters, digits, '_' or '-'")
    return tuple(sorted(value.items()))


# IAM principals that can hold a role (https://cloud.google.com/iam/docs/principal-identifiers):
# a Google account, a Google group, a service account, or every account of a Workspace domain.
_MEMBER_RE = re.compile(
    r"^(user|group|serviceAccount):[A-Za-z0-9._%+'-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$"
    r"|^domain:[a-z0-9-]+(\.[a-z0-9-]+)+$"
)


def _members(key: str, raw: Any) -> tuple[str, ...]:
    """A list of IAM members; every bad entry is its own line."""
    value = _json(raw)
    example = '["user:ana@example.com", "group:ml-team@example.com"]'
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(_key(key), raw, f"a list of IAM members, e.g. {example}")
    lines = [
        str(
            _fail(
                f"{_key(key)}[{i}]",
                v,
                "an IAM member: user:EMAIL, group:EMAIL, serviceAccount:EMAIL or domain:DOMAIN",
            )
        )
        for i, v in enumerate(value)
        if not _MEMBER_RE.fullmatch(v)
    ]
    if lines:
        raise ConfigError.of(lines)
    return tuple(dict.fromkeys(value))


def _bucket(key: str, raw: Any) -> str:
    allowed = (
        "a GCS bucket name: 3-63 lowercase letters, digits, '-', '_' or '.', starting and ending "
        "with a letter or digit, not an IP address, no 'goog' prefix and no 'google'"
    )
    if not _is_plain_string(raw):
        raise _fail(_key(key), raw, allowed)
    name = raw.removeprefix("gs://")
    parts = name.split(".")
    ok = (
        bool(_BUCKET_RE.fullmatch(name))
        and (len(name) <= 63 or "." in name)
        and all(0 < len(p) <= 63 for p in parts)
        and not re.fullmatch(r"[0-9]+(\.[0-9]+){3}", name)
        and not name.startswith("goog")
        and "google" not in name
        and "g00gle" not in name
    )
    if not ok:
        raise _fail(_key(key), raw, allowed)
    return name


class _Errors:
    """Every refused value of one config, one line each, in the order the keys are checked: a
    user fixes the whole file in one go instead of one key per run."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, error: ConfigError) -> None:
        self.lines.extend(error.lines)

    def take(self, check: Any, *args: Any) -> Any:
        """check(*args), or None (the error kept) when it refuses the value."""
        try:
            return check(*args)
        except ConfigError as e:
            self.add(e)
            return None


def parse_spec(raw: Mapping[str, Any], *, stack: str) -> FleetSpec:
    """Validate raw config (full keys: "gpufleet:nodes", "gcp:project", ...) into a FleetSpec.
    Keys of other namespaces (other providers, gcp:region, ...) are ignored.

    Raises ConfigError naming every bad key, one line each (`.lines`), before anything is
    declared. A rule that relates two keys is checked only when both values are good, so one
    mistake is never reported twice.
    """
    errors = _Errors()
    ours = {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith(f"{NAMESPACE}:")}
    for name in sorted(set(ours) - set(KEYS)):
        errors.add(ConfigError(f"config {_key(name)} is not a gpufleet setting; known: {', '.join(KEYS)}"))

    get = ours.get

    project = raw.get("gcp:project")
    if project is None:
        errors.add(ConfigError("config gcp:project is not set: run `pulumi config set gcp:project YOUR_PROJECT_ID`"))
    else:
        project = errors.take(
            _string, "gcp:project", project, _PROJECT_RE, "a project ID (6-30 lowercase letters, digits, '-')"
        )
    zone = raw.get("gcp:zone")
    if zone is None:
        errors.add(
            ConfigError(
                "config gcp:zone is not set: run `pulumi config set gcp:zone us-central1-a` "
                "(a zone that has your machine type)"
            )
        )
    else:
        zone = errors.take(_string, "gcp:zone", zone, _ZONE_RE, "a zone such as us-central1-a")

    mt_raw = get("machineType") if get("machineType") is not None else DEFAULTS["machineType"]
    machine: MachineType | None = None
    try:
        machine = lookup(mt_raw if isinstance(mt_raw, str) else json.dumps(mt_raw))
    except UnknownMachineType as e:
        errors.add(ConfigError(f"config {_key('machineType')} = {mt_raw!r} is not allowed: {e}"))

    nodes = (
        DEFAULTS["nodes"] if get("nodes") is None else errors.take(_int, "nodes", get("nodes"), 1, SUBNET_MAX_NODES, 2)
    )

    spares = 0
    if get("spares") is not None:
        spares = errors.take(_int, "spares", get("spares"), 0, SUBNET_MAX_NODES - (nodes or 1), 1)
    vms = (nodes or 0) + (spares or 0)

    cluster = None
    if get("name") is not None:
        cluster = errors.take(
            _string,
            "name",
            get("name"),
            _NAME_RE,
            "1-40 lowercase letters, digits or '-', starting with a letter, not ending with '-'",
        )
    elif _NAME_RE.fullmatch(stack):
        cluster = stack
    else:
        errors.add(
            ConfigError(
                f"the stack name {stack!r} cannot name GCE resources (1-40 lowercase letters, digits or '-', "
                f"starting with a letter); set a cluster name: `pulumi config set {_key('name')} my-cluster`"
            )
        )

    provisioning = (
        DEFAULTS["provisioning"]
        if get("provisioning") is None
        else errors.take(_choice, "provisioning", get("provisioning"), _PROVISIONING)
    )
    if machine is not None and provisioning is not None and provisioning not in machine.provisioning:
        allowed = ", ".join(m for m in _PROVISIONING if m in machine.provisioning)
        # a3-highgpu-1g/2g/4g "must" be created as Spot or Flex-start VMs (A3 note in
        # https://cloud.google.com/compute/docs/accelerator-optimized-machines).
        errors.add(_fail(_key("provisioning"), provisioning, f"{machine.name} can only be provisioned as: {allowed}"))

    reservation = None
    if get("reservation") is not None:
        reservation = errors.take(
            _string,
            "reservation",
            get("reservation"),
            _RESERVATION_RE,
            "a reservation name (or projects/PROJECT/reservations/NAME for a shared one)",
        )
        if reservation is not None and provisioning not in (None, "standard"):
            errors.add(
                _fail(
                    _key("reservation"),
                    reservation,
                    f"no reservation with provisioning {provisioning!r}: a reservation is consumed by "
                    "standard VMs; drop gpufleet:reservation or set gpufleet:provisioning standard",
                )
            )

    max_run_hours = DEFAULTS["maxRunHours"]
    if get("maxRunHours") is not None:
        max_run_hours = errors.take(_int, "maxRunHours", get("maxRunHours"), 1, 168, 24)
        if max_run_hours is not None and provisioning not in (None, "flex-start"):
            errors.add(_fail(_key("maxRunHours"), get("maxRunHours"), "only with gpufleet:provisioning flex-start"))

    # Compact placement is the default for a multi-node fleet. With a reservation the reservation's
    # own placement applies instead (github.com/dstackai/dstack GCP backend: "Cannot use our own
    # placement policies when provisioning in a reservation"), so the default there is none.
    if get("placement") is not None:
        placement = errors.take(_choice, "placement", get("placement"), _PLACEMENTS)
    else:
        placement = "compact" if vms > 1 and reservation is None else "none"
    if placement == "compact" and nodes is not None:
        if vms < 2:
            errors.add(
                _fail(
                    _key("placement"), placement, "compact needs gpufleet:nodes >= 2; set placement none for one node"
                )
            )
        if reservation is not None:
            errors.add(
                _fail(
                    _key("placement"),
                    placement,
                    "none with a reservation: the reservation's own placement policy applies",
                )
            )
        if vms > COMPACT_PLACEMENT_MAX_VMS:
            errors.add(
                _fail(
                    _key("nodes"),
                    f"{nodes} (+{spares} spares)" if spares else nodes,
                    f"at most {COMPACT_PLACEMENT_MAX_VMS} nodes in one compact placement policy "
                    "(Cluster Toolkit's Slurm resume.py PLACEMENT_MAX_CNT); set placement none or split the fleet",
                )
            )

    max_distance = None
    if get("maxDistance") is not None:
        # cluster-toolkit community/modules/compute/schedmd-slurm-gcp-v6-nodeset: valid values null,
        # 1, 2, 3; the catalog knows which types refuse 1.
        lowest = machine.min_placement_distance if machine is not None else 1
        max_distance = errors.take(_int, "maxDistance", get("maxDistance"), lowest, 3, 2)
        if max_distance is not None and placement not in (None, "compact"):
            errors.add(_fail(_key("maxDistance"), get("maxDistance"), "only with gpufleet:placement compact"))

    image = machine.default_image if machine is not None else None
    if get("image") is not None:
        image = errors.take(
            _string,
            "image",
            get("image"),
            _IMAGE_RE,
            "an image path such as projects/ubuntu-os-accelerator-images/global/images/family/NAME",
        )
        if image is not None and machine is not None and boot_image_os(image) not in machine.image_oses:
            # tcpxo.sh and rdma.sh install their plugin, DKMS module and gIB packages with apt;
            # COS has no package manager, so the node would fail at boot (catalog image_oses).
            errors.add(
                _fail(
                    _key("image"),
                    image,
                    f"an Ubuntu image: {machine.name} ({machine.net_stack.value}) installs its NCCL "
                    "plugin with apt, which Container-Optimized OS does not have",
                )
            )

    boot = (
        DEFAULTS["bootDiskSizeGb"]
        if get("bootDiskSizeGb") is None
        else errors.take(_int, "bootDiskSizeGb", get("bootDiskSizeGb"), 50, 65536, 200)
    )
    external_ip = (
        DEFAULTS["externalIp"] if get("externalIp") is None else errors.take(_bool, "externalIp", get("externalIp"))
    )
    ssh = (
        DEFAULTS["sshSourceRanges"]
        if get("sshSourceRanges") is None
        else errors.take(_cidrs, "sshSourceRanges", get("sshSourceRanges"))
    )

    service_account = None
    if get("serviceAccount") is not None:
        service_account = errors.take(
            _string,
            "serviceAccount",
            get("serviceAccount"),
            _SA_RE,
            "a service account email such as nodes@PROJECT.iam.gserviceaccount.com",
        )
    bucket = (
        None if get("checkpointBucket") is None else errors.take(_bucket, "checkpointBucket", get("checkpointBucket"))
    )
    labels = () if get("labels") is None else errors.take(_labels, "labels", get("labels"))

    controller = (
        DEFAULTS["controller"] if get("controller") is None else errors.take(_bool, "controller", get("controller"))
    )
    controller_source = DEFAULTS["controllerSource"]
    if get("controllerSource") is not None:
        controller_source = errors.take(
            _string,
            "controllerSource",
            get("controllerSource"),
            _SOURCE_RE,
            "a pip source without credentials (it is kept in instance metadata): "
            "git+https://HOST/OWNER/REPO.git[@REF] or https://HOST/PATH.whl (.tar.gz, .zip)",
        )
        if controller_source is not None and controller is False:
            errors.add(_fail(_key("controllerSource"), controller_source, "only with gpufleet:controller true"))

    package_index = (
        DEFAULTS["packageIndex"]
        if get("packageIndex") is None
        else errors.take(_bool, "packageIndex", get("packageIndex"))
    )
    container_image = None
    if get("containerImage") is not None:
        container_image = errors.take(
            _string,
            "containerImage",
            get("containerImage"),
            _CONTAINER_IMAGE_RE,
            "a container image such as us-central1-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE:TAG "
            "(or @sha256:DIGEST); gpufleet:image is the nodes' boot disk image",
        )
    elif image is not None and boot_image_os(image) == "cos":
        # COS has no Python to build the jobs' environment in: without an image of the user's,
        # the ranks run in a pinned PyTorch image (docs/fleet.md, "Boot image").
        container_image = COS_DEFAULT_CONTAINER_IMAGE

    users = () if get("users") is None else errors.take(_members, "users", get("users"))

    if errors.lines:
        raise ConfigError.of(errors.lines)
    return FleetSpec(
        cluster=cluster,
        project=project,
        zone=zone,
        machine=machine,
        nodes=nodes,
        spares=spares or 0,
        placement=placement,
        max_distance=max_distance,
        provisioning=provisioning,
        reservation=reservation,
        max_run_hours=max_run_hours,
        image=image,
        boot_disk_size_gb=boot,
        external_ip=external_ip,
        ssh_source_ranges=ssh,
        service_account=service_account,
        checkpoint_bucket=bucket,
        labels=labels,
        controller=controller,
        controller_source=controller_source,
        package_index=package_index,
        container_image=container_image,
        users=users,
    )


def spec_warnings(spec: FleetSpec) -> list[str]:
    """What a valid config grants that a user should know about, one line each (nothing refused):
    `python -m infra.config`, the preview and `pulumi up` print them."""
    out = []
    if spec.external_ip:
        # Every node (and the controller) gets a public address; the SSH rule admits these sources.
        open_to_all = [r for r in spec.ssh_source_ranges if ipaddress.ip_network(r).prefixlen == 0]
        if open_to_all:
            out.append(
                f"{_key('sshSourceRanges')} {open_to_all[0]} with {_key('externalIp')} true opens SSH (tcp:22) on "
                "every node's and the controller's public address to the whole internet; keep the default "
                f"(IAP's {IAP_RANGE}, `gcloud compute ssh --tunnel-through-iap`) or name your own ranges"
            )
    return out


def read_spec() -> FleetSpec:
    """Read the running stack's config (as the Pulumi engine passes it) into a FleetSpec."""
    import pulumi
    from pulumi.runtime import config as runtime_config

    # Every key the engine set: explicitly (set_all_config) or through PULUMI_CONFIG. parse_spec
    # reads gpufleet:*, gcp:project and gcp:zone and ignores the rest.
    raw: dict[str, Any] = dict(runtime_config.get_config_env())
    raw.update(runtime_config.CONFIG.get())
    return parse_spec(raw, stack=pulumi.get_stack())


def _not_config(value: Any) -> Any:
    raise TypeError(f"it holds a {type(value).__name__} value")


def read_stack_file(path: str) -> FleetSpec:
    """Validate a stack file (`Pulumi.<stack>.yaml`) without Pulumi: what `pulumi up` would refuse,
    said before it starts."""
    raw, stack = read_stack_config(path)
    return parse_spec(raw, stack=stack)


def read_stack_config(path: str) -> tuple[dict[str, Any], str]:
    """A stack file's config as the engine passes it, and the stack name its file name gives
    (`Pulumi.<stack>.yaml`; "dev" otherwise). Values are turned into the engine's strings
    (structured values as JSON text), and a bare key belongs to the project's namespace, as
    Pulumi reads them. Raises ConfigError for a file Pulumi could not read; the values are
    checked by parse_spec."""
    import os

    import yaml  # a dependency of the pulumi SDK itself

    class StackLoader(yaml.SafeLoader):
        """YAML as Pulumi reads a stack file: a date (2024-01-01) stays the text it was written as."""

    StackLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.load(f, Loader=StackLoader)  # a SafeLoader
    except OSError as e:
        raise ConfigError(f"stack file {path!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"stack file {path!r} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"stack file {path!r} is not YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("config", {}), dict):
        raise ConfigError(f"stack file {path!r} needs a `config:` map of keys to values (see Pulumi.example.yaml)")
    raw: dict[str, Any] = {}
    for key, value in (doc.get("config") or {}).items():
        full = str(key) if ":" in str(key) else _key(str(key))
        if isinstance(value, dict) and "secure" in value:
            raise ConfigError(
                f"config {full} is encrypted (secure:); gpufleet settings are not secrets: "
                f"`pulumi config set {full} VALUE` without --secret"
            )
        try:
            raw[full] = value if isinstance(value, str) else json.dumps(value, default=_not_config)
        except (TypeError, ValueError) as e:
            # Only an explicit tag (!!timestamp, !!binary, !!set) makes a value JSON cannot hold.
            raise ConfigError(
                f"config {full} is not allowed: {e}; write plain text, a number, true/false, "
                "a list or a map (no YAML !! tags)"
            ) from None
    name = os.path.basename(path)
    stack = name[len("Pulumi.") : -len(".yaml")] if name.startswith("Pulumi.") and name.endswith(".yaml") else "dev"
    return raw, stack


def main(argv: list[str] | None = None) -> int:
    """`python -m infra.config Pulumi.<stack>.yaml`: check a stack's config before `pulumi up`.
    Prints what the fleet would be, or one line per bad key; exit 0, or 2 (usage error)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m infra.config Pulumi.<stack>.yaml", file=sys.stderr)
        return 2
    try:
        spec = read_stack_file(args[0])
    except ConfigError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    for warning in spec_warnings(spec):
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"ok: {spec.cluster}: {spec.nodes} x {spec.machine_type}"
        + (f" (+{spec.spares} spare{'s' * (spec.spares != 1)})" if spec.spares else "")
        + f" in {spec.zone} ({spec.provisioning}, "
        f"placement {spec.placement}{', a controller VM' if spec.controller else ', no controller VM'}); "
        f"boots {spec.image}" + (f", jobs run in {spec.container_image}" if spec.container_image else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
