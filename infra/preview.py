"""What `pulumi up` would build, without a cloud account: `python -m infra.preview Pulumi.<stack>.yaml`.

    python -m infra.preview Pulumi.example.yaml               # tables: resources, nodes, NICs, firewalls
    python -m infra.preview --stack dev                        # reads Pulumi.dev.yaml
    python -m infra.preview Pulumi.example.yaml --json         # the same, machine-readable, on stdout
    python -m infra.preview Pulumi.example.yaml --outputs o.json && launch train --outputs o.json --dry-run

The stack file is checked first, with the same one-line errors as `python -m infra.config` (exit
2). Then `infra/__main__.py` runs as Pulumi runs it (as `__main__`, config in `PULUMI_CONFIG`)
under Pulumi's mocks (infra/mocks.py): no credentials, no network, nothing created. `--outputs`
writes the stack outputs the program exports; their addresses are placeholders the mocks hand
out from the subnets the program declares, and the file says so.

Library: `check_stack_file(path)` gives a stack file's checked config; `preview_program(config)`
returns a `Preview` (every declared resource and the stack outputs); `summarize()` turns one into
the plain data `--json` prints, `outputs_document()` into what `--outputs` writes. Tests and bench/
use them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import runpy
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import pulumi
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpufleet import atomic
from gpufleet.catalog import HOURS_PER_MONTH, machine_price, on_demand_price
from gpufleet.contracts import LABEL_CONTROLLER, LABEL_NODE, boot_image_os
from infra.config import ConfigError, parse_spec, read_stack_config, spec_warnings
from infra.mocks import Declared, RecordingMocks, run_under_mocks
from infra.registries import FREE_GB, PRICING_SOURCE, STORAGE_USD_PER_GB_MONTH

__all__ = [
    "MAIN",
    "NOTE_KEY",
    "OUTPUTS_NOTE",
    "Preview",
    "preview_program",
    "check_stack_file",
    "summarize",
    "outputs_document",
    "main",
]

MAIN = str(Path(__file__).with_name("__main__.py"))

# The key `--outputs` adds to the stack outputs. JSON has no comments; the launcher reads only the
# output keys it knows (gpufleet.contracts.OUTPUT_KEYS), so this one is ignored there.
NOTE_KEY = "_preview"
_PLACEHOLDERS = (
    "Addresses are placeholders from the subnets the program declares (node i: the subnet's "
    "address .2+i; the controller: its last usable one; external IPs from 203.0.113.0/24, a "
    "documentation range). After `pulumi up`, `pulumi stack output --json` gives the real ones."
)
OUTPUTS_NOTE = f"Written by `python -m infra.preview` under Pulumi's mocks: nothing was created. {_PLACEHOLDERS}"
_SUMMARY_NOTE = f"A preview under Pulumi's mocks: nothing was created. {_PLACEHOLDERS}"

# A VPC without an explicit MTU gets 1460 (https://cloud.google.com/vpc/docs/mtu).
_VPC_DEFAULT_MTU = 1460


@dataclass
class Preview:
    declared: list[Declared]
    outputs: dict[str, Any] = field(default_factory=dict)

    def of_type(self, token: str) -> list[Declared]:
        """Resources of a type, by its short name ("Instance") or full token."""
        return [d for d in self.declared if d.type == token or d.type.rsplit(":", 1)[-1] == token]

    def node_instances(self) -> list[Declared]:
        """The nodes' instances (labelled with their index), in rank order."""
        nodes = [d for d in self.of_type("Instance") if LABEL_NODE in (d.inputs.get("labels") or {})]
        return sorted(nodes, key=_rank)

    def controller_instance(self) -> Declared | None:
        """The controller VM's instance, or None when the stack has none."""
        found = [d for d in self.of_type("Instance") if LABEL_CONTROLLER in (d.inputs.get("labels") or {})]
        if len(found) > 1:
            raise KeyError(f"{len(found)} controller instances")
        return found[0] if found else None

    def named(self, name: str) -> Declared:
        found = [d for d in self.declared if d.name == name]
        if len(found) != 1:
            raise KeyError(f"{len(found)} resources named {name!r}")
        return found[0]


def preview_program(
    config: Mapping[str, Any],
    *,
    stack: str = "dev",
    project: str = "gpufleet",
    main: str = MAIN,
    mocks: RecordingMocks | None = None,
) -> Preview:
    """Run infra/__main__.py as Pulumi would, with `config` (full keys, e.g. "gpufleet:nodes"),
    under Pulumi's mocks in preview mode. A refused config raises `pulumi.RunError`."""
    previous = os.environ.get("PULUMI_CONFIG")
    # The engine passes every value as a string; structured values as JSON text.
    os.environ["PULUMI_CONFIG"] = json.dumps({k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()})
    try:
        mocks, outputs = run_under_mocks(
            lambda: runpy.run_path(main, run_name="__main__"), stack=stack, project=project, mocks=mocks
        )
    finally:
        if previous is None:
            os.environ.pop("PULUMI_CONFIG", None)
        else:
            os.environ["PULUMI_CONFIG"] = previous
    return Preview(mocks.declared, outputs)


def check_stack_file(path: str) -> tuple[dict[str, Any], str]:
    """A stack file's config and stack name, checked as `python -m infra.config` checks it
    (ConfigError: the same one line) before anything runs: `preview_program(config, stack=stack)`."""
    raw, stack = read_stack_config(path)
    parse_spec(raw, stack=stack)
    return raw, stack


# ---- the preview as plain data (what --json prints) -------------------------------------------


def _plain(value: Any) -> Any:
    """Inputs as the mocks see them carry numbers as floats (protobuf Struct); 8244.0 -> 8244."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _last(path: str | None) -> str | None:
    return path.rsplit("/", 1)[-1] if path else None


def _rank(inst: Declared) -> tuple[int, str]:
    index = (inst.inputs.get("labels") or {}).get(LABEL_NODE, "")
    return (int(index) if index.isdigit() else sys.maxsize, inst.inputs.get("name", inst.name))


_PROVISIONING_MODELS = ("standard", "spot", "flex-start")


def _node_cost(machine_type: str | None, count: int, provisioning: str | None) -> dict[str, Any]:
    """What the GPU nodes cost per hour and per month under each provisioning model the catalog
    prices (gpufleet.catalog.machine_price); a model it has no price for is None, never guessed."""
    price = machine_price(machine_type)
    cost: dict[str, Any] = {"machineType": machine_type, "nodes": count, "provisioning": provisioning}
    if price is None:
        return {
            **cost,
            "region": None,
            "source": None,
            "retrieved": None,
            "models": dict.fromkeys(_PROVISIONING_MODELS),
        }
    models: dict[str, Any] = {}
    for model in _PROVISIONING_MODELS:
        per_node = price.usd_per_hour(model)
        models[model] = (
            None
            if per_node is None
            else {
                "usdPerNodeHour": round(per_node, 4),
                "usdPerHour": round(per_node * count, 2),
                "usdPerMonth": round(per_node * count * HOURS_PER_MONTH, 2),
            }
        )
    return {**cost, "region": price.region, "source": price.source, "retrieved": price.retrieved, "models": models}


def _grants_to(preview: Preview, inputs: dict[int, dict[str, Any]], member: str) -> list[dict[str, str]]:
    """Every IAM grant the program binds to `member`: on instances, IAP tunnels, service accounts,
    buckets, repositories and the project; instance grants first, then by what they are on."""
    kinds = (
        ("InstanceIAMMember", "instance", "instanceName"),
        ("TunnelInstanceIAMMember", "instance", "instance"),
        ("gcp:serviceaccount/iAMMember:IAMMember", "service account", "serviceAccountId"),
        ("BucketIAMMember", "bucket", "bucket"),
        ("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember", "repository", "repository"),
        ("gcp:projects/iAMMember:IAMMember", "project", "project"),
    )
    grants = [
        {"role": inputs[id(g)]["role"], "on": f"{kind} {_last(inputs[id(g)][key])}"}
        for token, kind, key in kinds
        for g in preview.of_type(token)
        if inputs[id(g)].get("member") == member
    ]
    return sorted(grants, key=lambda g: (g["on"].split()[0] != "instance", g["on"], g["role"]))


def summarize(preview: Preview, *, stack: str, warnings: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """What `pulumi up` would create, as plain data: resource counts by type, networks, each node
    (machine type, zone, NICs, placement, scheduling, service account, labels), every grant to the
    service accounts, the bucket, the Artifact Registry repositories and what they cost, firewall
    rules, and the stack outputs (placeholder addresses). `warnings`: infra.config.spec_warnings."""
    # By resource, not by name: a component and its own resource may share a name (NodePool and
    # the nodes' Account are both `<cluster>-nodes`).
    inputs = {id(d): _plain(d.inputs) for d in preview.declared}
    networks = {i["name"]: i for d in preview.of_type("Network") for i in [inputs[id(d)]]}
    subnets = {i["name"]: i for d in preview.of_type("Subnetwork") for i in [inputs[id(d)]]}
    addresses = {n["name"]: n for n in preview.outputs.get("nodes") or []}
    roles = {n["name"]: n.get("role") for n in preview.outputs.get("networks") or []}

    counts = Counter((d.type, d.custom) for d in preview.declared)
    resources = [
        {"type": t, "count": n, "component": not custom}
        for (t, custom), n in sorted(counts.items(), key=lambda kv: (not kv[0][1], kv[0][0]))
    ]

    def mtu(network: str) -> int:
        return networks.get(network, {}).get("mtu") or _VPC_DEFAULT_MTU

    def nics_of(i: dict[str, Any]) -> list[dict[str, Any]]:
        nics = []
        for k, nic in enumerate(i.get("networkInterfaces") or []):
            subnet = _last(nic.get("subnetwork"))
            network = _last(subnets.get(subnet, {}).get("network") or nic.get("network"))
            nics.append(
                {
                    "nic": f"nic{k}",
                    "network": network,
                    "subnet": subnet,
                    "cidr": subnets.get(subnet, {}).get("ipCidrRange"),
                    "nicType": nic.get("nicType"),
                    "mtu": mtu(network),
                    "externalIp": bool(nic.get("accessConfigs")),
                }
            )
        return nics

    nodes = []
    for inst in preview.node_instances():
        i = inputs[id(inst)]
        nics = nics_of(i)
        sched = i.get("scheduling") or {}
        affinity = i.get("reservationAffinity") or {}
        max_run = (sched.get("maxRunDuration") or {}).get("seconds")
        disk = i.get("bootDisk", {}).get("initializeParams", {})
        node = addresses.get(i["name"], {})
        nodes.append(
            {
                "name": i["name"],
                "index": node.get("index"),
                "machineType": i.get("machineType"),
                "zone": i.get("zone"),
                "internalIp": node.get("internalIp"),
                "externalIp": node.get("externalIp"),
                "nics": nics,
                "placementPolicy": _last(i.get("resourcePolicies")),
                "scheduling": {
                    "provisioningModel": sched.get("provisioningModel"),
                    "onHostMaintenance": sched.get("onHostMaintenance"),
                    "instanceTerminationAction": sched.get("instanceTerminationAction"),
                    "automaticRestart": sched.get("automaticRestart"),
                    "maxRunHours": int(max_run) // 3600 if max_run is not None else None,
                },
                "reservation": (affinity.get("specificReservation") or {}).get("values", [None])[0],
                "serviceAccount": (i.get("serviceAccount") or {}).get("email"),
                "labels": dict(sorted((i.get("labels") or {}).items())),
                "bootDisk": {
                    "image": disk.get("image"),
                    "os": boot_image_os(disk.get("image") or ""),
                    "type": disk.get("type"),
                    "sizeGb": disk.get("size"),
                },
            }
        )

    email = nodes[0]["serviceAccount"] if nodes else None
    member = f"serviceAccount:{email}"
    account = {
        "email": email,
        "created": any(
            (email or "").startswith(f"{inputs[id(d)]['accountId']}@")
            for d in preview.of_type("gcp:serviceaccount/account:Account")
        ),
        "projectRoles": sorted(
            inputs[id(g)]["role"]
            for g in preview.of_type("gcp:projects/iAMMember:IAMMember")
            if inputs[id(g)].get("member") == member
        ),
        "bucketRoles": [
            {"bucket": inputs[id(g)]["bucket"], "role": inputs[id(g)]["role"]}
            for g in preview.of_type("BucketIAMMember")
            if inputs[id(g)].get("member") == member
        ],
        # Every grant, a given account's included (the program binds roles to it too).
        "grants": _grants_to(preview, inputs, member) if email else [],
    }
    out = preview.outputs
    registries = [
        {
            "name": r["repositoryId"],
            "format": r.get("format"),
            "mode": r.get("mode"),
            "location": r.get("location"),
            "upstream": ((r.get("remoteRepositoryConfig") or {}).get("pythonRepository") or {}).get("publicRepository"),
            "url": out.get("packageIndex") if r.get("format") == "PYTHON" else out.get("imageRepository"),
            "readers": sorted(
                inputs[id(g)]["member"]
                for g in preview.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember")
                if inputs[id(g)].get("repository") == r["repositoryId"]
            ),
            "cost": {
                "usdPerGbMonth": STORAGE_USD_PER_GB_MONTH,
                "freeGb": FREE_GB,
                "source": PRICING_SOURCE,
            },
        }
        for r in (inputs[id(d)] for d in preview.of_type("gcp:artifactregistry/repository:Repository"))
    ]
    # Networks in the program's NIC order (the `networks` output), subnets by address: the
    # mocks see registrations in whatever order they arrive.
    order = [n["name"] for n in preview.outputs.get("networks") or []]

    def place(network: str | None) -> int:
        return order.index(network) if network in order else len(order)

    network_rows = [
        {
            "name": name,
            "role": roles.get(name),
            "mtu": mtu(name),
            "profile": _last(n.get("networkProfile")),
            "subnets": [
                {"name": s["name"], "cidr": s["ipCidrRange"]}
                for s in sorted(subnets.values(), key=lambda s: ipaddress.ip_network(s["ipCidrRange"]))
                if _last(s.get("network")) == name
            ],
        }
        for name, n in sorted(networks.items(), key=lambda kv: place(kv[0]))
    ]
    firewalls = [
        {
            "name": f["name"],
            "network": _last(f.get("network")),
            "direction": f.get("direction"),
            "allow": [
                a["protocol"] + (":" + ",".join(a["ports"]) if a.get("ports") else "") for a in f.get("allows") or []
            ],
            "sourceRanges": f.get("sourceRanges") or [],
            "targetTags": f.get("targetTags") or [],
        }
        for f in sorted(
            (inputs[id(d)] for d in preview.of_type("Firewall")),
            key=lambda f: (place(_last(f.get("network"))), f["name"]),
        )
    ]
    policies = [
        {"name": p["name"], **p.get("groupPlacementPolicy", {})}
        for p in (inputs[id(d)] for d in preview.of_type("ResourcePolicy"))
    ]
    buckets = [
        {k: b.get(k) for k in ("name", "location", "uniformBucketLevelAccess", "publicAccessPrevention")}
        for b in (inputs[id(d)] for d in preview.of_type("gcp:storage/bucket:Bucket"))
    ]
    controller = None
    ctl = preview.controller_instance()
    if ctl is not None:
        i = inputs[id(ctl)]
        sched = i.get("scheduling") or {}
        ctl_member = f"serviceAccount:{(i.get('serviceAccount') or {}).get('email')}"
        price = on_demand_price(i.get("machineType", ""))
        grants = _grants_to(preview, inputs, ctl_member)
        listed = preview.outputs.get("controller") or {}
        controller = {
            "name": i["name"],
            "machineType": i.get("machineType"),
            "zone": i.get("zone"),
            "internalIp": listed.get("internalIp"),
            "externalIp": listed.get("externalIp"),
            "nics": nics_of(i),
            "provisioningModel": sched.get("provisioningModel"),
            "preemptible": bool(sched.get("preemptible")),
            "onHostMaintenance": sched.get("onHostMaintenance"),
            "serviceAccount": (i.get("serviceAccount") or {}).get("email"),
            "grants": grants,
            "labels": dict(sorted((i.get("labels") or {}).items())),
            "cost": None
            if price is None
            else {
                "usdPerHour": price.usd_per_hour,
                "usdPerMonth": round(price.usd_per_month, 2),
                "region": price.region,
                "source": price.source,
                "retrieved": price.retrieved,
            },
        }
    members = sorted(
        {
            inputs[id(g)]["member"]
            for g in preview.of_type("gcp:iap/tunnelInstanceIAMMember:TunnelInstanceIAMMember")
            if inputs[id(g)].get("role") == "roles/iap.tunnelResourceAccessor"
        }
    )
    users = [{"member": m, "grants": _grants_to(preview, inputs, m)} for m in members]
    sched = nodes[0]["scheduling"] if nodes else {}
    node_cost = _node_cost(out.get("machineType"), len(nodes), _model(sched.get("provisioningModel")))
    return {
        "stack": stack,
        "cluster": out.get("cluster"),
        "project": out.get("project"),
        "zone": out.get("zone"),
        "machineType": out.get("machineType"),
        "note": _SUMMARY_NOTE,
        "warnings": list(warnings),
        "resources": resources,
        "networks": network_rows,
        "placementPolicies": policies,
        "nodes": nodes,
        "controller": controller,
        "nodeCost": node_cost,
        "bootImage": out.get("bootImage"),
        "containerImage": out.get("image"),
        "users": users,
        "serviceAccount": account,
        "buckets": buckets,
        "registries": registries,
        "firewalls": firewalls,
        "outputs": out,
    }


def _model(provisioning_model: str | None) -> str | None:
    """The stack's provisioning setting from the instances' scheduling (SPOT, FLEX_START, STANDARD
    or RESERVATION_BOUND, which is standard VMs consuming a reservation)."""
    return {"SPOT": "spot", "FLEX_START": "flex-start", "STANDARD": "standard", "RESERVATION_BOUND": "standard"}.get(
        provisioning_model or ""
    )


def outputs_document(preview: Preview) -> dict[str, Any]:
    """The stack outputs as `pulumi stack output --json` would print them, plus the note that
    their addresses are placeholders."""
    return {NOTE_KEY: OUTPUTS_NOTE, **preview.outputs}


# ---- the command ---------------------------------------------------------------------------------


def _grants_table(t: Table, account: str, grants: list[dict[str, str]]) -> Table:
    """One row per role and kind of target: the restart role is granted on every node's instance,
    which a 128-node fleet would otherwise list 128 times."""
    rows: dict[tuple[str, str], list[str]] = {}
    for g in grants:
        kind, _, target = g["on"].partition(" ")
        rows.setdefault((g["role"], kind), []).append(target)
    for k, ((role, kind), targets) in enumerate(rows.items() or [(("(none granted here)", ""), [""])]):
        if len(targets) == 1:
            on = f"{kind} {targets[0]}"
        elif kind == "instance":
            on = f"each node's instance ({len(targets)})"
        else:
            on = f"{kind} " + ", ".join(targets)
        t.add_row(escape(account) if k == 0 else "", escape(role), escape(on.strip()))
    return t


def _render(summary: dict[str, Any], console: Console) -> None:
    """The summary as rich tables (the edge: summarize() is the data)."""

    def table(title: str, *columns: str) -> Table:
        t = Table(title=title, title_justify="left", title_style="bold")
        for c in columns:
            t.add_column(c)
        return t

    s = summary
    console.print(
        f"[bold]pulumi up[/bold] would create stack [bold]{escape(s['stack'])}[/bold]: cluster "
        f"{escape(str(s['cluster']))}, {len(s['nodes'])} x {escape(str(s['machineType']))} in "
        f"{escape(str(s['zone']))} (project {escape(str(s['project']))})"
    )
    for warning in s["warnings"]:
        console.print(f"[yellow]warning: {escape(warning)}[/yellow]")
    t = table("Resources", "type")
    t.add_column("count", justify="right")
    for r in s["resources"]:
        t.add_row(escape(r["type"]) + (" [dim](component)[/dim]" if r["component"] else ""), str(r["count"]))
    cloud = sum(r["count"] for r in s["resources"] if not r["component"])
    comps = sum(r["count"] for r in s["resources"] if r["component"])
    t.caption = f"{cloud} Google Cloud resources, {comps} gpufleet components"
    console.print(t)

    t = table("Networks", "network", "role", "MTU", "subnets", "network profile")
    for n in s["networks"]:
        subs = "\n".join(f"{x['name']} {x['cidr']}" for x in n["subnets"])
        t.add_row(n["name"], n["role"] or "", str(n["mtu"]), escape(subs), n["profile"] or "")
    console.print(t)

    t = table(
        "Nodes",
        "node",
        "name",
        "machine type",
        "zone",
        "internal IP*",
        "placement policy",
        "provisioning",
        "on host maintenance",
        "on termination",
        "labels",
    )
    for n in s["nodes"]:
        sc = n["scheduling"]
        prov = sc["provisioningModel"] or ""
        if n["reservation"]:
            prov += f" (reservation {n['reservation']})"
        term = sc["instanceTerminationAction"] or "-"
        if sc["maxRunHours"]:
            term += f" after {sc['maxRunHours']} h"
        labels = ", ".join(f"{k}={v}" for k, v in n["labels"].items())
        t.add_row(
            str(n["index"]),
            n["name"],
            n["machineType"],
            n["zone"],
            str(n["internalIp"] or ""),
            n["placementPolicy"] or "-",
            escape(prov),
            sc["onHostMaintenance"] or "",
            term,
            escape(labels),
        )
    t.caption = "* placeholder addresses from the declared subnets; Compute Engine assigns the real ones"
    console.print(t)

    # Nodes with the same NIC layout share one table (every node of a fleet, today).
    groups: dict[str, list[dict[str, Any]]] = {}
    for n in s["nodes"]:
        groups.setdefault(json.dumps(n["nics"]), []).append(n)
    for layout, members in groups.items():
        names = [m["name"] for m in members]
        if len(groups) == 1 and len(names) > 1:
            who = f"every node ({names[0]} … {names[-1]})"
        else:
            who = ", ".join(names)
        t = table(f"NICs: {who}", "NIC", "network", "subnet", "CIDR", "NIC type", "MTU", "external IP")
        for nic in json.loads(layout):
            t.add_row(
                nic["nic"],
                nic["network"] or "",
                nic["subnet"] or "",
                nic["cidr"] or "",
                nic["nicType"] or "",
                str(nic["mtu"]),
                "yes" if nic["externalIp"] else "no",
            )
        console.print(t)

    t = table("Boot disks", "node", "image", "OS", "type", "size (GB)")
    for n in s["nodes"]:
        d = n["bootDisk"]
        t.add_row(n["name"], escape(str(d["image"])), d["os"], str(d["type"] or ""), str(d["sizeGb"] or ""))
    console.print(t)
    boot = s.get("bootImage") or {}
    if boot:
        runs = (
            f"jobs run in {s['containerImage']} unless `launch --image` names another"
            if s.get("containerImage")
            else "jobs run on the node in an environment gpufleet builds with uv"
        )
        console.print(f"nodes boot [bold]{escape(_boot(boot))}[/bold]; {escape(runs)}")
    _render_cost(s, console)
    for u in s.get("users") or []:
        console.print(
            _grants_table(table("Who may log in (gpufleet:users)", "member", "role", "on"), u["member"], u["grants"])
        )

    a = s["serviceAccount"]
    how = "created" if a["created"] else "existing: these grants are added to it"
    console.print(
        _grants_table(table("Service account", "account", "role", "on"), f"{a['email']} ({how})", a["grants"])
    )
    for r in s["registries"]:
        what = f"remote repository of {r['upstream']}" if r["upstream"] else f"{r['format'].lower()} repository"
        cost = r["cost"]
        console.print(
            f"artifact registry [bold]{escape(r['name'])}[/bold]: {what} in {r['location']}, {escape(str(r['url']))}; "
            f"read by {', '.join(m.removeprefix('serviceAccount:') for m in r['readers']) or 'no one'}; "
            f"${cost['usdPerGbMonth']:.2f} per GB-month stored after the first {cost['freeGb']:g} GB, "
            f"nothing while empty ({cost['source']})"
        )
    c = s["controller"]
    if c is not None:
        t = table(
            "Controller VM",
            "name",
            "machine type",
            "zone",
            "internal IP*",
            "subnet",
            "external IP",
            "provisioning",
            "on host maintenance",
            "cost per month",
        )
        cost = c["cost"]
        monthly = f"${cost['usdPerMonth']:.2f}" if cost else "unknown"
        t.add_row(
            c["name"],
            c["machineType"] or "",
            c["zone"] or "",
            str(c["internalIp"] or ""),
            c["nics"][0]["subnet"] if c["nics"] else "",
            "yes" if any(n["externalIp"] for n in c["nics"]) else "no",
            c["provisioningModel"] or "",
            c["onHostMaintenance"] or "",
            monthly,
        )
        if cost:
            t.caption = (
                f"on-demand list price in {cost['region']}: ${cost['usdPerHour']:.4f}/h x 730 h "
                f"({cost['retrieved']}; other regions differ; boot disk not included)"
            )
        console.print(t)
        t = table("Controller service account", "account", "role", "on")
        console.print(_grants_table(t, f"{c['serviceAccount']} (created)", c["grants"]))
    else:
        console.print("no controller VM (gpufleet:controller false): detached jobs' controllers run on node 0")
    for p in s["placementPolicies"]:
        extra = f", max distance {p['maxDistance']}" if p.get("maxDistance") else ""
        console.print(
            f"placement policy [bold]{p['name']}[/bold]: {p.get('collocation')}, {p.get('vmCount')} VMs{extra}"
        )
    for b in s["buckets"]:
        console.print(
            f"bucket [bold]{b['name']}[/bold]: {b['location']}, uniform access "
            f"{'on' if b['uniformBucketLevelAccess'] else 'off'}, public access {b['publicAccessPrevention']}"
        )

    t = table("Firewall rules", "rule", "network", "direction", "allow", "sources", "target tags")
    for f in s["firewalls"]:
        t.add_row(
            f["name"],
            f["network"] or "",
            f["direction"] or "",
            ", ".join(f["allow"]),
            ", ".join(f["sourceRanges"]),
            ", ".join(f["targetTags"]),
        )
    console.print(t)
    console.print("[dim]Preview under Pulumi's mocks: no credentials used, nothing created.[/dim]")


def _boot(disk: dict[str, Any]) -> str:
    """A boot image as a person reads it: `projects/cos-cloud/global/images/family/cos-105-lts (cos)`."""
    return f"{disk.get('image') or 'unknown'} ({disk.get('os')})"


def _money(usd: float) -> str:
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.4f}"


def _render_cost(s: dict[str, Any], console: Console) -> None:
    """The GPU nodes per hour and per month under each provisioning model, and the controller VM."""
    cost = s["nodeCost"]
    t = Table(title="Cost (list prices)", title_justify="left", title_style="bold")
    for c in ("what", "provisioning", "per hour", "per month (730 h)"):
        t.add_column(c, justify="right" if c.startswith("per") else "left")
    what = f"{cost['nodes']} x {cost['machineType']}"
    for model in _PROVISIONING_MODELS:
        m = cost["models"][model]
        mine = " (this stack)" if model == cost["provisioning"] else ""
        if m is None:
            t.add_row(what, f"{model}{mine}", "n/a", "n/a")
        else:
            t.add_row(what, f"{model}{mine}", _money(m["usdPerHour"]), _money(m["usdPerMonth"]))
    c = s["controller"]
    if c is not None:
        cc = c["cost"]
        t.add_row(
            f"controller {c['machineType']}",
            "standard",
            _money(cc["usdPerHour"]) if cc else "n/a",
            _money(cc["usdPerMonth"]) if cc else "n/a",
        )
    where = f"in {cost['region']}" if cost["region"] else "unknown"
    src = f"; {cost['source']}, {cost['retrieved']}" if cost["source"] else "; the catalog has no price for this type"
    t.caption = (
        f"GPU node prices {where}{src}. n/a: no price in that source. Other regions differ; boot disks, "
        "network and storage are not included; Spot prices change (an estimate at that date)."
    )
    console.print(t)


def _check_outputs_place(path: Path) -> None:
    """Fail before the preview when `path` cannot be written (its directory missing or read-only,
    or `path` a directory): the atomic writer's own temporary file is created and removed."""
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        tmp = atomic.temp_path(path)
        tmp.touch(exist_ok=False)
        tmp.unlink()
    except OSError as e:
        raise click.ClickException(f"outputs file {str(path)!r} cannot be written: {e.strerror}") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("stack_file", required=False, metavar="[Pulumi.<stack>.yaml]")
@click.option("--stack", "stack_name", metavar="NAME", help="Read Pulumi.NAME.yaml from the current directory.")
@click.option(
    "--outputs",
    "outputs_file",
    type=click.Path(path_type=Path),
    metavar="FILE",
    help="Also write the stack outputs the program would export (placeholder addresses) to FILE, "
    "for `launch ... --outputs FILE --dry-run`.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the preview as JSON on stdout, and nothing else.")
def _command(stack_file: str | None, stack_name: str | None, outputs_file: Path | None, as_json: bool) -> int:
    """Show what `pulumi up` would create for a stack file, under Pulumi's mocks: no cloud account,
    no credentials, no network."""
    if (stack_file is None) == (stack_name is None):
        raise click.UsageError("give a stack file (Pulumi.<stack>.yaml) or --stack NAME, not both")
    path = stack_file if stack_file is not None else f"Pulumi.{stack_name}.yaml"
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        raw, stack = check_stack_file(path)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if outputs_file is not None:
        _check_outputs_place(outputs_file)
    with err.status("running the program under Pulumi's mocks…"):
        try:
            preview = preview_program(raw, stack=stack)
        except pulumi.RunError as e:
            raise click.ClickException(str(e)) from None
    if outputs_file is not None:
        # Whole or not at all: an existing file is never left half-written.
        atomic.write_text(outputs_file, json.dumps(outputs_document(preview), indent=2) + "\n")
    summary = summarize(preview, stack=stack, warnings=spec_warnings(parse_spec(raw, stack=stack)))
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        # A pipe or a file gets whole tables, not ones squeezed into 80 columns.
        _render(summary, Console(highlight=False, width=None if sys.stdout.isatty() else 200))
    if outputs_file is not None:
        shown = escape(str(outputs_file))
        err.print(
            f"wrote {shown}: the stack outputs, with placeholder addresses; next: "
            f"launch train --outputs {shown} --dry-run"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m infra.preview`: exit 0, or 2 with one line (`error: ...`) for a bad stack file
    or usage, as `python -m infra.config` and `launch` do."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        rv = _command.main(args=argv, prog_name="python -m infra.preview", standalone_mode=False)
    except click.UsageError as e:
        err.print(f"[red]error: {escape(e.format_message())} (`python -m infra.preview -h` lists the options)[/red]")
        return 2
    except click.ClickException as e:
        # A stack file with several bad keys: one `error:` line for each (infra.config.ConfigError).
        for line in e.format_message().splitlines():
            err.print(f"[red]error: {escape(line)}[/red]")
        return 2
    except click.Abort:
        err.print("[red]aborted[/red]")
        return 130
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
