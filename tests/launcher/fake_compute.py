"""A local stand-in for the Compute Engine API's `instances.list`, for label discovery tests.

It serves GET /compute/v1/projects/{project}/zones/{zone}/instances (the REST path
google-cloud-compute's `InstancesClient.list` calls with transport="rest") and, like the real
API, APPLIES the `filter` it is given: expressions `FIELD = "VALUE"` / `FIELD != "VALUE"` (also
unquoted values and `:`/`eq` forms are refused with 400 as unsupported here), optionally in
parentheses, ANDed when listed side by side or joined by AND
(https://cloud.google.com/compute/docs/reference/rest/v1/instances/list, `filter`). FIELD is
`name`, `status`, `machineType` or `labels.KEY`. Paging: `maxResults` and `pageToken`.

Also, for --recover's restart of stopped Spot VMs, as documented:
- `instances.get`: GET .../instances/{instance}, the instance resource, 404 for an unknown one
  (https://cloud.google.com/compute/docs/reference/rest/v1/instances/get);
- `instances.start`: POST .../instances/{instance}/start, an Operation (`compute#operation`,
  operationType `start`, targetLink the instance); a TERMINATED instance goes to STAGING, then
  to RUNNING once `on_start(instance)` (the test's way to boot the simulated node) has returned;
  starting a RUNNING instance is a no-op operation
  (https://cloud.google.com/compute/docs/reference/rest/v1/instances/start,
  https://cloud.google.com/compute/docs/instances/instance-life-cycle).
- `instances.getGuestAttributes`: GET .../instances/{instance}/getGuestAttributes?queryPath=PATH,
  a `compute#guestAttributes` whose `queryValue.items` are the entries under PATH (`namespace`,
  `key`, `value`); an instance with nothing there answers 404, as the real API does for a path
  no value was written under. The guest environment publishes a VM's SSH host keys there, one
  entry per key type in namespace `hostkeys` (key: the type, value: the base64 key)
  (https://cloud.google.com/compute/docs/reference/rest/v1/instances/getGuestAttributes,
  https://cloud.google.com/compute/docs/metadata/manage-guest-attributes,
  github.com/GoogleCloudPlatform/guest-agent google_guest_agent/instance_setup.go writes
  `hostkeys/<type>`).
Every request is in `requests` (`method`, `project`, `zone`, `instance` where there is one).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

__all__ = ["FakeInstance", "FakeCompute", "FilterError", "parse_filter", "matches"]

_EXPR = re.compile(r'\(?\s*([A-Za-z][A-Za-z0-9_.\-]*)\s*(=|!=)\s*"([^"]*)"\s*\)?')
_PATH = re.compile(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances$")
_ONE = re.compile(r"^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances/([^/]+)(/start|/getGuestAttributes)?$")


class FilterError(ValueError):
    pass


@dataclass
class FakeInstance:
    name: str
    internal_ip: str
    labels: dict[str, str] = field(default_factory=dict)
    status: str = "RUNNING"
    machine_type: str = "n2-standard-2"
    external_ip: str | None = None
    physical_host: str | None = None  # resourceStatus.physicalHost: only VMs with a placement policy
    host_keys: dict[str, str] = field(default_factory=dict)  # guest attributes hostkeys/: type -> base64

    def guest_attributes(self, project: str, zone: str, path: str) -> dict | None:
        """instances.getGuestAttributes for `path` ("hostkeys/" or "hostkeys/ssh-ed25519"), or None
        when nothing was written under it."""
        namespace, _, key = path.partition("/")
        items = [
            {"namespace": "hostkeys", "key": k, "value": v}
            for k, v in self.host_keys.items()
            if namespace == "hostkeys" and key in ("", k)
        ]
        if not items:
            return None
        base = f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/instances/{self.name}"
        return {
            "kind": "compute#guestAttributes",
            "selfLink": f"{base}/guestAttributes/{path}",
            "queryPath": path,
            "queryValue": {"items": items},
        }

    def resource(self, project: str, zone: str) -> dict:
        nic: dict = {"networkIP": self.internal_ip, "name": "nic0"}
        if self.external_ip:
            nic["accessConfigs"] = [{"natIP": self.external_ip, "type": "ONE_TO_ONE_NAT"}]
        extra = {"resourceStatus": {"physicalHost": self.physical_host}} if self.physical_host else {}
        return {
            **extra,
            "kind": "compute#instance",
            "name": self.name,
            "status": self.status,
            "labels": self.labels,
            "zone": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}",
            "machineType": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/machineTypes/{self.machine_type}",
            "networkInterfaces": [nic],
        }


def parse_filter(text: str) -> list[tuple[str, str, str]]:
    """[(field, op, value)] of an AND of simple comparisons; FilterError for anything else."""
    rest = text.strip()
    out = []
    while rest:
        if rest.upper().startswith("AND "):
            rest = rest[4:].lstrip()
            continue
        m = _EXPR.match(rest)
        if not m:
            raise FilterError(f"Invalid value for field 'filter': '{text}'. Invalid list filter expression.")
        out.append((m.group(1), m.group(2), m.group(3)))
        rest = rest[m.end() :].lstrip()
    return out


def _field(resource: dict, name: str) -> str | None:
    if name.startswith("labels."):
        return resource.get("labels", {}).get(name[len("labels.") :])
    if name == "machineType":
        return resource["machineType"].rsplit("/", 1)[-1]
    value = resource.get(name)
    return value if isinstance(value, str) else None


def matches(resource: dict, terms: list[tuple[str, str, str]]) -> bool:
    for name, op, value in terms:
        got = _field(resource, name)
        if (got == value) != (op == "="):
            return False
    return True


class FakeCompute:
    """A threaded HTTP server; use as a context manager. `endpoint` is for client_options."""

    def __init__(
        self,
        instances: dict[tuple[str, str], list[FakeInstance]],
        on_start: Callable[[FakeInstance], None] | None = None,
        host: str = "127.0.0.1",
    ):
        """`host`: the address to serve on (a simulated cluster's gateway, for a controller
        that asks from inside a node's network namespace)."""
        self.instances = instances  # by (project, zone)
        self.requests: list[dict] = []
        self.on_start = on_start
        self._ops = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _one(self, method: str) -> bool:
                """instances.get / .start / .getGuestAttributes; False when the path is not theirs."""
                url = urlparse(self.path)
                m = _ONE.match(url.path)
                verb = {None: "get", "/start": "start", "/getGuestAttributes": "getGuestAttributes"}[
                    m.group(4) if m else None
                ]
                if not m or (method == "POST") != (verb == "start"):
                    return False
                project, zone, name = m.group(1), m.group(2), m.group(3)
                fake.requests.append({"method": verb, "project": project, "zone": zone, "instance": name})
                found = [i for i in fake.instances.get((project, zone), []) if i.name == name]
                missing = f"projects/{project}/zones/{zone}/instances/{name}"
                if found and verb == "getGuestAttributes":
                    path = parse_qs(url.query).get("queryPath", [""])[0]
                    body = found[0].guest_attributes(project, zone, path)
                    if body is not None:
                        self._send(200, body)
                        return True
                    missing += f"/guestAttributes/{path}"
                if not found or verb == "getGuestAttributes":
                    self._send(404, {"error": {"code": 404, "message": f"The resource '{missing}' was not found"}})
                    return True
                if verb == "start":
                    self._send(200, fake.start(found[0], project, zone))
                else:
                    self._send(200, found[0].resource(project, zone))
                return True

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                if not self._one("POST"):
                    self._send(404, {"error": {"code": 404, "message": f"no route {self.path}"}})

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self._one("GET"):
                    return
                url = urlparse(self.path)
                m = _PATH.match(url.path)
                if not m:
                    self._send(404, {"error": {"code": 404, "message": f"no route {url.path}"}})
                    return
                project, zone = m.groups()
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                fake.requests.append({"project": project, "zone": zone, **q})
                if (project, zone) not in fake.instances:
                    self._send(
                        404,
                        {
                            "error": {
                                "code": 404,
                                "message": f"The resource 'projects/{project}/zones/{zone}' was not found",
                            }
                        },
                    )
                    return
                try:
                    terms = parse_filter(q.get("filter", ""))
                except FilterError as e:
                    self._send(400, {"error": {"code": 400, "message": str(e)}})
                    return
                items = [i.resource(project, zone) for i in fake.instances[(project, zone)]]
                items = [r for r in items if matches(r, terms)]
                start = int(q.get("pageToken") or 0)
                size = int(q.get("maxResults") or 500)
                body: dict = {"kind": "compute#instanceList", "items": items[start : start + size]}
                if start + size < len(items):
                    body["nextPageToken"] = str(start + size)
                self._send(200, body)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self, inst: FakeInstance, project: str, zone: str) -> dict:
        """instances.start: the Operation; a stopped instance boots (STAGING, on_start, RUNNING)."""
        self._ops += 1
        booting = inst.status in ("TERMINATED", "STOPPED")
        if booting:
            inst.status = "STAGING"
            threading.Thread(target=self._boot, args=(inst,), daemon=True).start()
        base = f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}"
        return {
            "kind": "compute#operation",
            "id": str(self._ops),
            "name": f"operation-start-{self._ops}",
            "operationType": "start",
            "targetLink": f"{base}/instances/{inst.name}",
            "zone": base,
            "status": "RUNNING" if booting else "DONE",
            "progress": 0 if booting else 100,
            "selfLink": f"{base}/operations/operation-start-{self._ops}",
        }

    def _boot(self, inst: FakeInstance) -> None:
        if self.on_start is not None:
            self.on_start(inst)
        inst.status = "RUNNING"

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeCompute":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
