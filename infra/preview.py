"""Run the Pulumi program the way Pulumi runs it, under Pulumi's documented mocks, and record it.

`preview_program(config)` executes `infra/__main__.py` as `__main__` with the stack config in the
`PULUMI_CONFIG` environment variable (as the engine passes it) under
`pulumi.runtime.set_mocks(..., preview=True)`, waits for every registration, and returns what was
declared and the resolved stack outputs. No credentials, no network. Tests and bench/ use it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import runpy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime import settings as _settings
from pulumi.runtime.mocks import MockMonitor
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

__all__ = ["MAIN", "Declared", "Preview", "RecordingMocks", "preview_program", "run_under_mocks"]

MAIN = str(Path(__file__).with_name("__main__.py"))


@dataclass(frozen=True)
class Declared:
    type: str
    name: str
    inputs: dict[str, Any]
    depends_on: tuple[str, ...] = ()
    """Names of the resources the engine was told this one waits for (explicit and via inputs)."""


class RecordingMocks(pulumi.runtime.Mocks):
    """Mocks that behave like the provider where the program reads back: self links, emails,
    and an internal IP per NIC handed out in declaration order from the subnet's range."""

    def __init__(self) -> None:
        self.declared: list[Declared] = []
        self._next_host: dict[str, int] = {}
        self._cidr: dict[str, ipaddress.IPv4Network] = {}
        self._pending_deps: tuple[str, ...] = ()

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict]:
        inputs = dict(args.inputs)
        self.declared.append(Declared(args.typ, args.name, inputs, self._pending_deps))
        state = dict(inputs)
        name = inputs.get("name", args.name)
        state["name"] = name  # the provider's auto-name, here just the logical name
        project = inputs.get("project", "project")
        if args.typ == "gcp:compute/network:Network":
            state["selfLink"] = f"projects/{project}/global/networks/{name}"
        elif args.typ == "gcp:compute/subnetwork:Subnetwork":
            state["selfLink"] = f"projects/{project}/regions/{inputs.get('region')}/subnetworks/{name}"
            self._next_host[state["selfLink"]] = 2  # .0 and .1 are GCE's (network, gateway)
            self._cidr[state["selfLink"]] = ipaddress.IPv4Network(inputs["ipCidrRange"])
        elif args.typ == "gcp:compute/resourcePolicy:ResourcePolicy":
            state["selfLink"] = f"projects/{project}/regions/{inputs.get('region')}/resourcePolicies/{name}"
        elif args.typ == "gcp:serviceaccount/account:Account":
            state["email"] = f"{inputs['accountId']}@{project}.iam.gserviceaccount.com"
        elif args.typ == "gcp:compute/instance:Instance":
            nics = []
            for nic in inputs.get("networkInterfaces", []):
                nic = dict(nic)
                sub = nic.get("subnetwork")
                host = self._next_host.get(sub, 2)
                self._next_host[sub] = host + 1
                net = self._cidr.get(sub) or ipaddress.IPv4Network("10.255.0.0/16")
                nic["networkIp"] = str(net.network_address + host)
                access = []
                for k, ac in enumerate(nic.get("accessConfigs") or []):
                    access.append({**ac, "natIp": f"203.0.113.{(host + k) % 250 + 1}"})
                if access:
                    nic["accessConfigs"] = access
                nics.append(nic)
            state["networkInterfaces"] = nics
        return f"{name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict, list | None]:
        return {}, None


class _RecordingMonitor(MockMonitor):
    """The mock monitor, also handing each registration's dependencies to the mocks."""

    def __init__(self, mocks: RecordingMocks) -> None:
        super().__init__(mocks)
        self._recording = mocks

    def RegisterResource(self, request: Any) -> Any:
        self._recording._pending_deps = tuple(sorted(u.rsplit("::", 1)[-1] for u in request.dependencies))
        return super().RegisterResource(request)


@dataclass
class Preview:
    declared: list[Declared]
    outputs: dict[str, Any] = field(default_factory=dict)

    def of_type(self, token: str) -> list[Declared]:
        """Resources of a type, by its short name ("Instance") or full token."""
        return [d for d in self.declared if d.type == token or d.type.rsplit(":", 1)[-1] == token]

    def named(self, name: str) -> Declared:
        found = [d for d in self.declared if d.name == name]
        if len(found) != 1:
            raise KeyError(f"{len(found)} resources named {name!r}")
        return found[0]


def run_under_mocks(
    program: Any, *, stack: str = "dev", project: str = "gpufleet", mocks: RecordingMocks | None = None
) -> tuple[RecordingMocks, dict[str, Any]]:
    """Run `program()` (which declares resources and exports outputs) under mocks, preview mode;
    return the mocks and the resolved stack outputs. Exceptions from the program propagate (pass
    your own `mocks` to see what was declared before one)."""
    mocks = mocks if mocks is not None else RecordingMocks()
    _settings.ROOT.set(None)  # a fresh root stack per run
    pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=True, monitor=_RecordingMonitor(mocks))
    _settings.SETTINGS.rpc_manager.clear()
    _settings.SETTINGS.outputs.clear()
    outputs: dict[str, Any] = {}
    exported: dict[str, Any] = {}

    def body() -> pulumi.Output:
        program()
        exported.update(getattr(_settings.get_root_resource(), "outputs", {}))
        return pulumi.Output.from_input(exported).apply(outputs.update)

    _sync_await(run_pulumi_func(lambda: _sync_await(pulumi.Output.from_input(body()).future())))
    if set(outputs) != set(exported):
        # In preview an output that depends on an unknown value never resolves; say so rather
        # than return a partial result.
        raise RuntimeError(f"stack outputs unknown in preview: {', '.join(sorted(set(exported) - set(outputs)))}")
    return mocks, outputs


def preview_program(
    config: Mapping[str, Any],
    *,
    stack: str = "dev",
    project: str = "gpufleet",
    main: str = MAIN,
    mocks: RecordingMocks | None = None,
) -> Preview:
    """Run infra/__main__.py as Pulumi would, with `config` (full keys, e.g. "gpufleet:nodes")."""
    previous = os.environ.get("PULUMI_CONFIG")
    # The engine passes every value as a string; structured values as JSON text.
    os.environ["PULUMI_CONFIG"] = json.dumps(
        {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    )
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
