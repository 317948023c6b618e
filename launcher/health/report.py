"""`launch doctor`'s verdict (`judge`): every node's answers to its program
(launcher.health.script) judged against the catalog's entry for its machine type (`Expectation`)
and against the majority of the nodes (drift: the node is named with both values), into one
`Report`. Pure functions: judging touches no network.

The one most common cause of a hung or slow multi-node job is one node that differs: a GPU
missing or with ECC errors, a GPU NIC down or with the wrong MTU, the receive-datapath manager
not running, another driver than its neighbours (Cluster Toolkit issue #3032: a newer driver broke
TCPX with "Connection refused"). The GPU, NIC and drift judges are the pre-start verdict's own
(launcher.health.checks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from gpufleet.contracts import READY_MARKER
from gpufleet.health import parse_physical_host, parse_xids
from launcher.cluster.topology import spread_warning
from launcher.core.prestart import Expectation
from launcher.core.types import Node
from launcher.health.checks import (
    CHECKS,
    FAIL,
    WARN,
    Check,
    NodeReport,
    judge_drift,
    judge_gpus,
    kib,
    nic_problems,
    rxdm_problem,
)

__all__ = ["CLOCK_WARN_S", "Report", "judge"]

# Beyond a couple of seconds, log timestamps and timeouts stop lining up across nodes (the same
# bound the launch's pre-start check warns at, launcher.core.preflight.check_probes).
CLOCK_WARN_S = 2.0


@dataclass
class Report:
    machine_type: str | None
    nodes: list[NodeReport]
    warnings: list[str] = field(default_factory=list)  # about the cluster as a whole

    @property
    def healthy(self) -> bool:
        return all(n.status != FAIL for n in self.nodes)

    @property
    def exclude(self) -> list[str]:
        """What to pass to --exclude to leave out every node with a failed check: the instance
        name when known (stable across address changes), else the host."""
        return [n.name or n.host for n in self.nodes if n.status == FAIL]

    def to_json(self) -> dict:
        return {
            "healthy": self.healthy,
            "machine_type": self.machine_type,
            "exclude": self.exclude,
            "warnings": self.warnings,
            "nodes": [
                {
                    "rank": n.rank,
                    "host": n.host,
                    "name": n.name,
                    "status": n.status,
                    "reachable": n.reachable,
                    "error": n.error,
                    "physical_host": None if n.physical_host is None else asdict(n.physical_host),
                    "gpus": [asdict(g) for g in n.gpus],
                    "versions": n.versions,
                    "checks": {k: asdict(c) for k, c in n.checks.items()},
                    "problems": n.problems,
                }
                for n in self.nodes
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _xids(r: NodeReport, facts: Mapping[str, str]) -> None:
    c = r.checks["xid"]
    if facts.get("klog") == "unreadable":
        c.add(WARN, "the kernel log is unreadable (dmesg and journalctl -k both refused); XIDs not checked")
        c.settle("unreadable")
        return
    xids = parse_xids(v for k, v in facts.items() if k.startswith("xid."))
    for x in xids:
        kind = "a hardware fault" if x.hardware else "usually the program's fault"
        c.add(
            FAIL if x.hardware else WARN,
            f"XID {x.code} on GPU {x.pci} since boot ({kind}; docs.nvidia.com/deploy/xid-errors)",
        )
    c.settle(",".join(str(x.code) for x in xids) if xids else "none")


def _nics(r: NodeReport, facts: Mapping[str, str], expect: Expectation, node: Node) -> None:
    c = r.checks["nics"]
    good, problems = nic_problems(facts, expect)
    for _, problem in problems:
        c.add(FAIL, problem)
    if expect.rdma_devices:
        n = int(facts.get("rdma", "0") or 0)
        if n < expect.rdma_devices:
            c.add(
                FAIL, f"{n} RDMA devices under /sys/class/infiniband, {expect.machine_type} has {expect.rdma_devices}"
            )
    if "addr_iface" in facts:
        if not facts["addr_iface"]:
            c.add(FAIL, f"no interface holds {node.address}, the address the node was reached at")
    parts = []
    if expect.nics:
        parts.append(f"{good}/{len(expect.nics)} up")
    if expect.rdma_devices:
        parts.append(f"rdma {facts.get('rdma', '0')}")
    if facts.get("addr_iface"):
        parts.append(f"{node.address} on {facts['addr_iface']}")
    c.settle(", ".join(parts) or "-")


def _net(r: NodeReport, facts: Mapping[str, str], expect: Expectation) -> None:
    c = r.checks["net"]
    parts = []
    if expect.rxdm:
        # The pre-start check's words too (launcher.health.prestart): one verdict on RxDM.
        problem = rxdm_problem(facts, expect.net_stack)
        if problem is not None:
            c.add(FAIL, problem)
        else:
            parts.append("rxdm up")
    if expect.plugin_dir:
        plugin = facts.get("plugin", "missing")
        if plugin == "missing":
            c.add(FAIL, f"no NCCL net plugin (libnccl-net*.so) in {expect.plugin_dir}, where LD_LIBRARY_PATH points")
        else:
            parts.append("plugin ok")
    if expect.net_stack:
        parts.insert(0, expect.net_stack)
    c.settle(", ".join(parts) or "-")


def _ready(r: NodeReport, facts: Mapping[str, str], expect: Expectation) -> None:
    c = r.checks["versions"]
    raw = facts.get("ready", "missing")
    marker: dict = {}
    if raw == "missing":
        err = facts.get("startup_error")
        why = f" (it failed: {err})" if err else ""
        c.add(
            FAIL if expect.machine_type else WARN,
            f"no ready marker {READY_MARKER}: the startup script has not finished{why}",
        )
    else:
        try:
            marker = json.loads(raw)
            if not isinstance(marker, dict):
                raise ValueError
        except ValueError:
            c.add(FAIL, f"the ready marker {READY_MARKER} is not a JSON object: {raw[:80]!r}")
            marker = {}
    for key in ("driver", "cuda", "nccl", "plugin", "nccl_tests"):
        if isinstance(marker.get(key), str):
            r.versions[f"ready.{key}"] = marker[key]
    if expect.machine_type and marker.get("machine_type") not in (None, expect.machine_type):
        c.add(
            FAIL, f"the ready marker says machine type {marker['machine_type']}, the cluster is {expect.machine_type}"
        )
    for key in ("python", "torch", "nccl"):
        if facts.get(key):
            r.versions[key] = facts[key]
    if facts.get("plugin", "missing") != "missing":
        r.versions["plugin_file"] = facts["plugin"].rsplit("/", 1)[-1]


def _disk(r: NodeReport, facts: Mapping[str, str], expect: Expectation, min_free_gb: float) -> None:
    c = r.checks["disk"]
    parts = []
    for key, what in (("disk.work", "the working directory"), ("disk.lssd", "the local SSDs")):
        if not facts.get(key):
            continue
        gib = kib(facts[key])
        mount = facts[key].split()[1] if len(facts[key].split()) > 1 else "?"
        if gib is None:
            continue
        parts.append(f"{gib:.0f} GiB free")
        if gib < min_free_gb:
            c.add(FAIL, f"{gib:.1f} GiB free on {mount} ({what}); at least {min_free_gb:g} GiB wanted (--min-free-gb)")
    if expect.local_ssd_mount and facts.get("lssd") != "mounted":
        c.add(FAIL, f"the local-SSD RAID is not mounted at {facts.get('lssd_path') or expect.local_ssd_mount}")
    c.settle(" / ".join(parts) or "-")


def _clock(r: NodeReport, skew_s: float | None) -> None:
    c = r.checks["clock"]
    if skew_s is None:
        return
    if abs(skew_s) > CLOCK_WARN_S:
        c.add(WARN, f"clock differs from this machine by {skew_s:+.1f} s (check chrony/NTP on the node)")
    c.settle(f"{skew_s:+.1f} s")


def _topology(r: NodeReport, facts: Mapping[str, str], node: Node) -> None:
    """Where the node sits: its metadata server's answer, else the Compute Engine API's (--label)."""
    c = r.checks["topology"]
    rc = facts.get("metadata_rc", "")
    raw = facts.get("physical_host", "") if rc == "0" else ""
    raw = raw or getattr(node, "physical_host", "") or ""
    try:
        r.physical_host = parse_physical_host(raw)
    except ValueError as e:
        c.add(WARN, str(e))
    if r.physical_host is not None:
        ph = r.physical_host
        c.settle(f"{ph.block or '-'}/{ph.subblock or '-'}")
    elif rc in ("0", "22"):
        c.settle("none")  # no placement policy: the metadata server has no physical_host
    else:
        c.settle("no metadata")


def judge(
    nodes: Sequence[Node],
    facts: Mapping[int, Mapping[str, str] | None],
    expect: Expectation,
    errors: Mapping[int, str] | None = None,
    skews: Mapping[int, float | None] | None = None,
    min_free_gb: float = 10.0,
) -> Report:
    """Judge every node's facts (None: unreachable, with `errors[rank]` saying why) against
    `expect` and against the majority; `skews` are clock offsets from this machine, in seconds."""
    errors, skews = errors or {}, skews or {}
    reports = []
    for node in nodes:
        f = facts.get(node.rank)
        r = NodeReport(
            node.rank, node.host, node.name, reachable=f is not None, error=errors.get(node.rank, "no answer")
        )
        if f is not None:
            r.checks = {k: Check() for k in CHECKS}
            judge_gpus(r, f, expect)
            _xids(r, f)
            _nics(r, f, expect, node)
            _net(r, f, expect)
            _ready(r, f, expect)
            _disk(r, f, expect, min_free_gb)
            _clock(r, skews.get(node.rank))
            _topology(r, f, node)
            driver = r.checks["driver"]
            driver.settle(r.versions.get("driver", "-"))
            v = r.checks["versions"]
            v.settle(" ".join(f"{k} {r.versions[k]}" for k in ("torch", "nccl") if k in r.versions) or "-")
        reports.append(r)
    judge_drift(reports, expect)
    warnings = []
    spread = spread_warning({r.host: r.physical_host for r in reports if r.reachable})
    if spread:
        warnings.append(spread)
    return Report(expect.machine_type, reports, warnings)
