"""Finding the nodes: one source per call, each turned into a `Cluster` in rank order.

Sources: a hostfile (the MPI / DeepSpeed convention), the infra stack's outputs (from
`pulumi stack output --json` or a saved file), the Compute Engine API by label, or `--local`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from gpufleet.catalog import MACHINE_TYPES
from gpufleet.contracts import LABEL_NODE, OutputsError, parse_stack_outputs
from launcher.core.container import check_image_ref
from launcher.core.types import Cluster, ControllerHost, Node, UserError

__all__ = [
    "parse_hostfile",
    "read_hostfile",
    "cluster_from_outputs",
    "read_outputs_file",
    "read_stack",
    "stack_dir",
    "STACK_DIR_ENV",
    "discover_by_label",
    "local_cluster",
    "address_of",
]

_SLOTS_RE = re.compile(r"slots=(\d+)")


def parse_hostfile(
    text: str, source: str = "hostfile", machine_type: str | None = None, name: str | None = None
) -> Cluster:
    """One host per line, optional `slots=N`, `#` comments and blank lines ignored; one line
    `controller HOST` names the host of detached jobs' controllers (not a node). `name`: the
    cluster's (read_hostfile: the file's absolute path), else one made from `source`.

    Line order is rank order (the first host is node 0, the rendezvous host).
    """
    nodes: list[Node] = []
    controller: ControllerHost | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *rest = line.split()
        if host == "controller" and rest and not _SLOTS_RE.fullmatch(rest[0]):
            if len(rest) > 1 or controller is not None:
                raise UserError(
                    f"{source} line {lineno}: write one `controller HOST` line with one host (the host of "
                    "detached jobs' controllers)"
                )
            try:
                controller = ControllerHost(host=rest[0], address=address_of(rest[0]))
            except UserError as e:
                raise UserError(f"{source} line {lineno}: {e}") from None
            continue
        slots = None
        for word in rest:
            m = _SLOTS_RE.fullmatch(word)
            if not m or int(m.group(1)) < 1:
                raise UserError(
                    f"{source} line {lineno}: {word!r} is not understood; write `HOST` or `HOST slots=N` (N >= 1)"
                )
            slots = int(m.group(1))
        try:
            nodes.append(Node(rank=len(nodes), host=host, address=address_of(host), slots=slots))
        except UserError as e:
            raise UserError(f"{source} line {lineno}: {e}") from None
    if not nodes:
        raise UserError(f"{source} lists no hosts; write one host per line (`#` starts a comment)")
    return Cluster(
        name=name or _cluster_name(source), nodes=tuple(nodes), machine_type=machine_type, controller=controller
    )


def read_hostfile(path: Path, machine_type: str | None = None) -> Cluster:
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"hostfile {str(path)!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"hostfile {str(path)!r} is not UTF-8 text (byte {e.start}); write one host name or address per line"
        ) from None
    # Named by its absolute path: two files called `hosts` are two clusters, each with its own
    # known_hosts file (launcher.core.transport.cluster_slug).
    return parse_hostfile(text, source=str(path), machine_type=machine_type, name=str(path.resolve()))


def address_of(host: str) -> str:
    """The address in a `[user@]host` SSH target."""
    return host.rsplit("@", 1)[-1].strip("[]")


def _cluster_name(source: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", Path(source).stem) or "cluster"


def cluster_from_outputs(outputs: Any, source: str = "stack outputs", prefer_external: bool = False) -> Cluster:
    """The infra stack's outputs (gpufleet.contracts: {cluster, project, zone, machineType,
    nodes: [{name, index, internalIp, externalIp|null, zone}]}). A node's `index` is its rank;
    indexes must be exactly 0 .. N-1, so a node missing from the outputs is an error, not a
    silent renumbering.

    SSH goes to the external IP when there is one and `prefer_external` (a laptop outside the
    VPC); the rendezvous always uses internal IPs, which every node can reach.
    """
    try:
        parsed = parse_stack_outputs(outputs)
        nodes = tuple(
            Node(
                rank=n.index,
                host=(n.external_ip if prefer_external and n.external_ip else n.internal_ip),
                address=n.internal_ip,
                name=n.name,
            )
            for n in parsed.nodes
        )
        c = parsed.controller
        controller = (
            ControllerHost(
                host=(c.external_ip if prefer_external and c.external_ip else c.internal_ip),
                address=c.internal_ip,
                name=c.name,
            )
            if c is not None
            else None
        )
    except (OutputsError, UserError) as e:
        raise UserError(f"{source}: {e}") from None
    image = parsed.image  # the stack's default container image (gpufleet:containerImage)
    if image is not None:
        try:
            check_image_ref(image)
        except ValueError:
            raise UserError(
                f"{source}: output `image` is {image!r}, not an image reference; fix gpufleet:containerImage "
                "in the stack config (REGISTRY/PATH/NAME[:TAG])"
            ) from None
    return Cluster(
        name=parsed.cluster or "cluster",
        nodes=nodes,
        machine_type=parsed.machine_type,
        zone=parsed.zone,
        project=parsed.project,
        controller=controller,
        package_index=parsed.package_index,
        image=image or None,
        boot_os=parsed.boot_image.os if parsed.boot_image is not None else None,
        spares=parsed.spares,
    )


def read_outputs_file(path: Path, prefer_external: bool = False) -> Cluster:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"outputs file {str(path)!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"outputs file {str(path)!r} is not UTF-8 text (byte {e.start}); save it with "
            "`pulumi stack output --json > FILE`"
        ) from None
    except json.JSONDecodeError as e:
        raise UserError(f"outputs file {str(path)!r} is not JSON: {e.msg} at line {e.lineno}") from None
    return cluster_from_outputs(data, source=str(path), prefer_external=prefer_external)


# Where `--stack NAME` looks for the Pulumi project that holds the stack, when --stack-dir is not given.
STACK_DIR_ENV = "GPUFLEET_STACK_DIR"


def _gpufleet_checkout() -> Path | None:
    """The gpufleet Pulumi project this launcher was installed from (`pip install -e .` of a
    checkout: its Pulumi.yaml sits beside launcher/), else None (a wheel has no Pulumi project)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "Pulumi.yaml").is_file() else None


def stack_dir(given: str | Path | None = None) -> tuple[Path, str]:
    """The Pulumi project directory `--stack` reads the stack's outputs in, and what named it:
    `--stack-dir DIR`, else $GPUFLEET_STACK_DIR, else the gpufleet checkout the launcher runs
    from (the project whose stacks `pulumi up` made), else the current directory. So `launch
    ... --stack NAME` works from any directory, your own project's included. A directory without
    a Pulumi.yaml is one line naming it."""
    env = os.environ.get(STACK_DIR_ENV)
    if given:
        path, what = Path(given), "--stack-dir"
    elif env:
        path, what = Path(env), STACK_DIR_ENV
    else:
        checkout = _gpufleet_checkout()
        path, what = (checkout, "the gpufleet checkout") if checkout else (Path.cwd(), "the current directory")
    if not (path / "Pulumi.yaml").is_file():
        raise UserError(
            f"{what} {str(path)!r} is not a Pulumi project (no Pulumi.yaml there); pass --stack-dir with "
            f"the gpufleet checkout you ran `pulumi up` in (or set {STACK_DIR_ENV})"
        )
    return path, what


def read_stack(stack: str, prefer_external: bool = False, directory: str | Path | None = None) -> Cluster:
    """`pulumi -C DIR stack output --json --stack NAME`, DIR from `stack_dir(directory)`."""
    project, _ = stack_dir(directory)
    if shutil.which("pulumi") is None:
        raise UserError(
            "--stack needs the `pulumi` CLI on PATH; or save the outputs "
            "(`pulumi stack output --json > out.json`) and pass --outputs out.json"
        )
    argv = ["pulumi", "-C", str(project), "stack", "output", "--json", "--stack", stack]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise UserError(
            f"`pulumi stack output --stack {stack}` did not answer within 120 s (logged in? "
            "`pulumi whoami`); or save the outputs and pass --outputs"
        ) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise UserError(f"`pulumi -C {project} stack output --stack {stack}` failed: {last}")
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise UserError(f"`pulumi stack output --stack {stack}` did not print JSON") from None
    return cluster_from_outputs(data, source=f"stack {stack!r}", prefer_external=prefer_external)


def _label_filter(labels: dict[str, str]) -> str:
    # Compute Engine list filter syntax: `labels.KEY = "VALUE"`, expressions ANDed by spaces
    # (https://cloud.google.com/compute/docs/reference/rest/v1/instances/list, `filter`).
    return " ".join(f'(labels.{k} = "{v}")' for k, v in sorted(labels.items()))


def discover_by_label(
    labels: dict[str, str],
    project: str,
    zone: str,
    client: Any = None,
    machine_type: str | None = None,
    prefer_external: bool = False,
) -> Cluster:
    """Running instances with all `labels`, through google-cloud-compute's InstancesClient.

    Rank order: instances with infra's node-index label (`gpufleet.contracts.LABEL_NODE`) first, by
    that index, then the rest by instance name. `client` lets tests point at a local endpoint.
    """
    for k, v in labels.items():
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", k) or not re.fullmatch(r"[a-z0-9_-]{0,63}", v):
            raise UserError(
                f"--label {k}={v} is not a valid Compute Engine label (lowercase letters, digits, '-', '_')"
            )
    running = _running_instances(labels, project, zone, client)

    def index(inst: Any) -> tuple[int, str]:
        raw = inst.labels.get(LABEL_NODE)
        return (int(raw) if raw is not None and raw.isdigit() else 1 << 30, inst.name)

    running.sort(key=index)
    nodes = [_instance_node(rank, inst, prefer_external) for rank, inst in enumerate(running)]
    types = {inst.machine_type.rsplit("/", 1)[-1] for inst in running}
    if machine_type is None and len(types) == 1 and next(iter(types)) in MACHINE_TYPES:
        # A type outside the catalog (a CPU test VM) gets the plain-socket profile.
        machine_type = types.pop()
    name = "-".join(f"{k}-{v}" for k, v in sorted(labels.items()))
    return Cluster(name=name, nodes=tuple(nodes), machine_type=machine_type, zone=zone, project=project)


def _running_instances(labels: dict[str, str], project: str, zone: str, client: Any) -> list[Any]:
    """The running instances that carry every label (InstancesClient.list with a filter)."""
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as gauth
    from google.cloud import compute_v1

    request = compute_v1.ListInstancesRequest(project=project, zone=zone, filter=_label_filter(labels))
    try:
        if client is None:
            client = compute_v1.InstancesClient()
        instances = list(client.list(request=request))
    except gexc.GoogleAPICallError as e:
        raise UserError(f"listing instances in {project}/{zone} failed: {e.message}") from None
    except gauth.GoogleAuthError as e:
        raise UserError(
            f"no Google credentials to list instances in {project}/{zone} ({e.__class__.__name__}); "
            "run `gcloud auth application-default login`, or use --hostfile/--outputs"
        ) from None
    running = [i for i in instances if i.status in ("RUNNING", "")]
    if not running:
        found = f"{len(instances)} not running" if instances else "none"
        raise UserError(
            f"no running instances with label(s) {_label_filter(labels)} in "
            f"{project}/{zone} ({found}); check --label/--project/--zone"
        )
    return running


def _instance_node(rank: int, inst: Any, prefer_external: bool) -> Node:
    nic = inst.network_interfaces[0] if inst.network_interfaces else None
    internal = nic.network_i_p if nic else ""
    external = nic.access_configs[0].nat_i_p if nic and nic.access_configs else ""
    if not internal:
        raise UserError(f"instance {inst.name!r} has no internal IP")
    host = external if (prefer_external and external) else internal
    return Node(rank=rank, host=host, address=internal, name=inst.name)


def local_cluster(node_count: int) -> Cluster:
    """`node_count` nodes as process groups on this machine; the rendezvous is on 127.0.0.1."""
    if node_count < 1:
        raise UserError(f"--nodes {node_count} is not allowed; ask for at least 1 node")
    return Cluster(
        name="local",
        nodes=tuple(Node(rank=i, host="localhost", address="127.0.0.1") for i in range(node_count)),
        local=True,
    )
