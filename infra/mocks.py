"""Pulumi's documented mocks, run to completion: the one place gpufleet drives Pulumi's runtime.

`run_under_mocks(program)` runs a Pulumi program in this process the way Pulumi's unit-testing
guide does (https://www.pulumi.com/docs/iac/concepts/testing/unit/): `set_mocks(..., preview=True)`
so every resource registration goes to `RecordingMocks` instead of a cloud provider, and
`pulumi.runtime.test` to wait for every registration and output. It uses only the SDK's public
runtime API (`pulumi.runtime.reset_options`, `set_mocks`, `test`, `get_root_resource`), so a Pulumi
upgrade that moves private internals does not break `python -m infra.preview` or the tests.

No credentials and no network: nothing here talks to a Pulumi engine, a backend or Google Cloud.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi.runtime.mocks import MockMonitor

from gpufleet.contracts import LABEL_NODE

__all__ = ["Declared", "RecordingMocks", "run_under_mocks"]

# GCE hands out a subnet's addresses from .2: .0 is the network and .1 the gateway
# (https://cloud.google.com/vpc/docs/subnets#unusable-ip-addresses-in-every-subnet).
_FIRST_HOST = 2
# RFC 5737 TEST-NET-3: an address range reserved for documentation, never routed.
_PLACEHOLDER_PUBLIC = ipaddress.IPv4Network("203.0.113.0/24")


@dataclass(frozen=True)
class Declared:
    """One resource the program registered, with the inputs the provider would have received."""

    type: str
    """Pulumi type token, e.g. "gcp:compute/instance:Instance" or "gpufleet:infra:NodePool"."""
    name: str
    """Logical (Pulumi) name."""
    inputs: dict[str, Any]
    """Inputs as the provider sees them (camelCase keys, nested args as dicts)."""
    depends_on: tuple[str, ...] = ()
    """Names of the resources the engine was told this one waits for (explicit and via inputs)."""
    custom: bool = True
    """True for a provider resource (a cloud object), False for a component resource."""


class RecordingMocks(pulumi.runtime.Mocks):
    """Mocks that record every registration and answer like the provider where the program reads
    back: self links, service-account emails, and an internal IP per NIC from its subnet's range.

    Addresses are placeholders: NIC k of the instance labelled `gpufleet-node=i` gets its subnet's
    address `.2 + i` (the first GCE hands out, then in rank order), so a preview's outputs are the
    same every run; an instance without that label (the controller VM) takes the subnet's last
    usable address (GCE reserves the last two), the next one down for a second, so it never
    takes a node's, whatever order the registrations arrive in. An external IP comes from
    203.0.113.0/24 (documentation range, RFC 5737).
    """

    def __init__(self) -> None:
        self.declared: list[Declared] = []
        # Registrations arrive on Pulumi's executor threads, concurrently.
        self._lock = threading.Lock()
        self._cidr: dict[str, ipaddress.IPv4Network] = {}
        self._used: dict[str, set[int]] = {}
        self._deps: dict[tuple[str, str], tuple[str, ...]] = {}

    def _host(self, subnet: str, wanted: int | None) -> int:
        used = self._used.setdefault(subnet, set())
        if wanted is None:
            # From the top: the last usable address is the third from the end of the range
            # (https://cloud.google.com/vpc/docs/subnets#unusable-ip-addresses-in-every-subnet).
            size = self._cidr[subnet].num_addresses if subnet in self._cidr else 1 << 16
            host = size - 3
            while host in used:
                host -= 1
        else:
            host = wanted if wanted not in used else max(used | {_FIRST_HOST - 1}) + 1
        used.add(host)
        return host

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict]:
        inputs = dict(args.inputs)
        with self._lock:
            deps = self._deps.pop((args.typ, args.name), ())
            self.declared.append(Declared(args.typ, args.name, inputs, deps, bool(args.custom)))
            state = dict(inputs)
            name = inputs.get("name", args.name)
            state["name"] = name  # the provider's auto-name, here just the logical name
            project = inputs.get("project", "project")
            if args.typ == "gcp:compute/network:Network":
                state["selfLink"] = f"projects/{project}/global/networks/{name}"
            elif args.typ == "gcp:compute/subnetwork:Subnetwork":
                state["selfLink"] = f"projects/{project}/regions/{inputs.get('region')}/subnetworks/{name}"
                self._cidr[state["selfLink"]] = ipaddress.IPv4Network(inputs["ipCidrRange"])
            elif args.typ == "gcp:compute/resourcePolicy:ResourcePolicy":
                state["selfLink"] = f"projects/{project}/regions/{inputs.get('region')}/resourcePolicies/{name}"
            elif args.typ == "gcp:serviceaccount/account:Account":
                state["email"] = f"{inputs['accountId']}@{project}.iam.gserviceaccount.com"
            elif args.typ == "gcp:compute/instance:Instance":
                state["networkInterfaces"] = self._nics(inputs)
        return f"{name}-id", state

    def _nics(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        index = (inputs.get("labels") or {}).get(LABEL_NODE, "")
        wanted = _FIRST_HOST + int(index) if index.isdigit() else None
        nics = []
        for nic in inputs.get("networkInterfaces", []):
            nic = dict(nic)
            sub = nic.get("subnetwork") or nic.get("network") or ""
            host = self._host(sub, wanted)
            net = self._cidr.get(sub) or ipaddress.IPv4Network("10.255.0.0/16")
            nic["networkIp"] = str(net.network_address + host)
            access = [
                {**ac, "natIp": str(_PLACEHOLDER_PUBLIC.network_address + (host + k) % 253 + 1)}
                for k, ac in enumerate(nic.get("accessConfigs") or [])
            ]
            if access:
                nic["accessConfigs"] = access
            nics.append(nic)
        return nics

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict, list | None]:
        return {}, None

    def _note_dependencies(self, typ: str, name: str, urns: list[str]) -> None:
        with self._lock:
            self._deps[(typ, name)] = tuple(sorted(u.rsplit("::", 1)[-1] for u in urns))


class _RecordingMonitor(MockMonitor):
    """The SDK's mock monitor (set_mocks' `monitor=`), also telling the mocks what each
    registration depends on, which MockResourceArgs does not carry."""

    def __init__(self, mocks: RecordingMocks) -> None:
        super().__init__(mocks)
        self._recording = mocks

    def RegisterResource(self, request: Any) -> Any:
        self._recording._note_dependencies(request.type, request.name, list(request.dependencies))
        return super().RegisterResource(request)


def run_under_mocks(
    program: Callable[[], Any],
    *,
    stack: str = "dev",
    project: str = "gpufleet",
    mocks: RecordingMocks | None = None,
) -> tuple[RecordingMocks, dict[str, Any]]:
    """Run `program()` (which declares resources and calls `pulumi.export`) under `mocks`, in
    preview mode, and wait until every registration is done.

    Returns the mocks (`.declared`: every resource, in the order it reached them) and the stack
    outputs, resolved to plain values. Exceptions from the program propagate (`pulumi.RunError`
    for a refused config); pass your own `mocks` to see what was declared before one. Each call
    starts from a fresh root stack, so runs in one process do not see each other's exports.
    """
    mocks = mocks if mocks is not None else RecordingMocks()
    # reset_options drops the previous run's root stack; set_mocks then creates a new one.
    pulumi.runtime.reset_options(project=project, stack=stack, preview=True)
    pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=True, monitor=_RecordingMonitor(mocks))
    exported: dict[str, Any] = {}
    outputs: dict[str, Any] = {}

    @pulumi.runtime.test  # clears pending registrations, then runs and waits for everything
    def body() -> pulumi.Output:
        program()
        exported.update(getattr(pulumi.runtime.get_root_resource(), "outputs", {}))
        return pulumi.Output.from_input(exported).apply(outputs.update)

    body()
    if set(outputs) != set(exported):
        # In preview an output that depends on an unknown value never resolves; say so rather
        # than return a partial result.
        raise RuntimeError(f"stack outputs unknown in preview: {', '.join(sorted(set(exported) - set(outputs)))}")
    return mocks, outputs
