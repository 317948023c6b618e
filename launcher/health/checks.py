"""What a node is judged on: one `Check` per column of `launch doctor`'s table, a `NodeReport` per
node, and the judges both the pre-start verdict (launcher.health.prestart) and `launch doctor`
(launcher.health.report) apply to a node's `key=value` answers: its GPUs (`judge_gpus`), its NICs
(`nic_problems`), the receive-datapath manager (`rxdm_problem`) and drift across nodes
(`judge_drift`). Pure functions. The statements that ask the node are launcher.core.prestart's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpufleet.contracts import RXDM_CONTAINER
from gpufleet.health import GpuRow, PhysicalHost, majority, parse_gpu_query
from launcher.core.prestart import Expectation

__all__ = [
    "CHECKS",
    "FAIL",
    "OK",
    "SKIP",
    "WARN",
    "Check",
    "NodeReport",
    "judge_drift",
    "judge_gpus",
    "kib",
    "nic_problems",
    "rxdm_problem",
]

# The columns of the table, in order: one per check.
CHECKS = ("gpus", "driver", "cuda", "persistence", "ecc", "xid", "nics", "net", "versions", "disk", "clock", "topology")


# A GPU reporting less memory than this share of the catalog's figure is not the catalog's GPU:
# nvidia-smi reports usable MiB, a little under the marketing GB (an H100 80GB prints 81559 MiB =
# 79.6 GiB, tests/fixtures/nvidia-smi; an H200 141GB about 140 GiB).
_MEMORY_SHARE = 0.95


OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
_RANK = {SKIP: 0, OK: 1, WARN: 2, FAIL: 3}


@dataclass
class Check:
    """One cell: a short value to show, its status, and one line per problem found."""

    value: str = "-"
    status: str = SKIP
    problems: list[str] = field(default_factory=list)

    def add(self, status: str, problem: str) -> None:
        self.problems.append(problem)
        if _RANK[status] > _RANK[self.status]:
            self.status = status

    def settle(self, value: str) -> None:
        self.value = value
        if self.status == SKIP:
            self.status = OK


@dataclass
class NodeReport:
    rank: int
    host: str
    name: str
    reachable: bool
    error: str = ""
    checks: dict[str, Check] = field(default_factory=dict)
    physical_host: PhysicalHost | None = None
    gpus: list[GpuRow] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if not self.reachable:
            return FAIL
        return max((c.status for c in self.checks.values()), key=_RANK.__getitem__, default=OK)

    @property
    def label(self) -> str:
        return f"node {self.rank} ({self.host})"

    @property
    def problems(self) -> list[str]:
        if not self.reachable:
            return [f"{self.label}: unreachable: {self.error}"]
        return [f"{self.label}: {p}" for c in self.checks.values() for p in c.problems]


def kib(value: str) -> float | None:
    try:
        return int(value.split()[0]) / 2**20  # GiB
    except (ValueError, IndexError):
        return None


def judge_gpus(r: NodeReport, facts: Mapping[str, str], expect: Expectation) -> None:
    gpus, cuda, pers, ecc = (r.checks[k] for k in ("gpus", "cuda", "persistence", "ecc"))
    rc = facts.get("smi_rc", "")
    raw = "\n".join(
        facts[k] for k in sorted((k for k in facts if k.startswith("gpu.")), key=lambda k: int(k.split(".")[1]))
    )
    if rc == "127":
        if expect.gpu_count:
            gpus.add(FAIL, f"nvidia-smi is not installed; {expect.machine_type} has {expect.gpu_count} GPUs")
        gpus.settle("no nvidia-smi")
        return
    if rc != "0":
        why = raw.splitlines()[0] if raw else f"exit {rc}"
        gpus.add(FAIL, f"nvidia-smi failed: {why}")
        gpus.settle("nvidia-smi failed")
        return
    try:
        rows = parse_gpu_query(raw)
    except ValueError as e:
        gpus.add(FAIL, str(e))
        gpus.settle("unreadable")
        return
    r.gpus = rows
    n = len(rows)
    if expect.gpu_count is not None and n != expect.gpu_count:
        gpus.add(FAIL, f"{n} GPU{'s' * (n != 1)} found, {expect.machine_type} has {expect.gpu_count}")
    for g in rows:
        if expect.device_names and not any(d in g.name for d in expect.device_names):
            gpus.add(FAIL, f"GPU {g.index} is {g.name!r}, {expect.machine_type} has {expect.gpu_model}")
        if (
            expect.gpu_memory_gb
            and g.memory_mib is not None
            and g.memory_mib / 1024 < _MEMORY_SHARE * expect.gpu_memory_gb
        ):
            gpus.add(FAIL, f"GPU {g.index} has {g.memory_mib} MiB, {expect.gpu_model} has {expect.gpu_memory_gb} GB")
        if g.ecc_uncorrected:
            ecc.add(
                FAIL,
                f"GPU {g.index} has {g.ecc_uncorrected} uncorrected ECC errors since the driver "
                "loaded (reset the GPU or replace the node)",
            )
        if g.remapped_pending:
            ecc.add(FAIL, f"GPU {g.index} has remapped rows pending (they take effect at the next GPU reset)")
        if g.retired_pending:
            ecc.add(FAIL, f"GPU {g.index} has retired pages pending (they take effect at the next driver reload)")
        if g.persistence is False:
            pers.add(WARN, f"GPU {g.index} has persistence mode off (the startup script turns it on: nvidia-smi -pm 1)")
    models = sorted({g.name.removeprefix("NVIDIA ") for g in rows})
    gpus.settle(f"{n} x {'/'.join(models)}" if rows else "0")
    ecc.settle(str(sum(g.ecc_uncorrected or 0 for g in rows)) if rows else "-")
    pers.settle(("on" if all(g.persistence for g in rows) else "off") if rows else "-")
    drivers = sorted({g.driver for g in rows if g.driver})
    if drivers:
        r.versions["driver"] = "/".join(drivers)
    if facts.get("cuda"):
        r.versions["cuda"] = facts["cuda"]
        cuda.settle(facts["cuda"])
    r.versions["gpus"] = gpus.value


def nic_problems(facts: Mapping[str, str], expect: Expectation) -> tuple[int, list[tuple[str, str]]]:
    """(NICs that are fine, [(kind, problem)]) for the catalog's NICs; kind is "missing",
    "down" or "mtu"."""
    good, out = 0, []
    for name, role, mtu in expect.nics:
        raw = facts.get(f"nic.{name}", "missing")
        if raw == "missing":
            out.append(("missing", f"{role} NIC {name} is missing"))
            continue
        try:
            state, got_mtu, flags = raw.split()[:3]
            up = state == "up" or (state == "unknown" and int(flags, 16) & 0x1)  # IFF_UP, <linux/if.h>
            got = int(got_mtu)
        except ValueError:
            out.append(("missing", f"{role} NIC {name}: unreadable state {raw!r}"))
            continue
        if not up:
            out.append(("down", f"{role} NIC {name} is {state}, not up"))
        elif mtu is not None and got != mtu:
            out.append(("mtu", f"{role} NIC {name} has MTU {got}, {expect.machine_type} needs {mtu}"))
        else:
            good += 1
    return good, out


# Versions that must agree across nodes (one node that differs hangs or slows the job), by the
# column their drift shows in.
_DRIFT = {
    "driver": "driver",
    "cuda": "cuda",
    "gpus": "gpus",
    "nccl": "versions",
    "plugin_file": "versions",
    "torch": "versions",
    "python": "versions",
    "ready.driver": "versions",
    "ready.cuda": "versions",
    "ready.nccl": "versions",
    "ready.plugin": "versions",
    "ready.nccl_tests": "versions",
}


def judge_drift(reports: list[NodeReport], expect: Expectation) -> None:
    live = [r for r in reports if r.reachable]
    for key, column in _DRIFT.items():
        if key == "gpus" and expect.gpu_count is not None:
            continue  # judged against the catalog already, which says which side is wrong
        values = {r.rank: r.versions[key] for r in live if key in r.versions}
        if len(set(values.values())) <= 1:
            continue
        top, count = majority(values)
        by_rank = {r.rank: r for r in live}
        if top is None:
            listed = "; ".join(f"{by_rank[k].label}: {v}" for k, v in sorted(values.items()))
            for k in values:
                by_rank[k].checks[column].add(FAIL, f"{key} differs across nodes with no majority ({listed})")
            continue
        for k, v in values.items():
            if v != top:
                by_rank[k].checks[column].add(FAIL, f"{key} {v}, while {count} of {len(values)} nodes have {top}")


def rxdm_problem(facts: Mapping[str, str], net_stack: str | None) -> str | None:
    """What is wrong with RxDM by the `rxdm_statement` answers; None when it runs."""
    rc, rxdm = facts.get("rxdm_rc", ""), facts.get("rxdm", "")
    if rc == "127":
        return f"docker is not installed, so {RXDM_CONTAINER} cannot run ({net_stack} needs it)"
    if rc != "0":
        return f"cannot ask docker whether {RXDM_CONTAINER} runs: {rxdm or 'exit ' + rc}"
    if not rxdm:
        return (
            f"{RXDM_CONTAINER} (RxDM) is not running ({net_stack} needs it; the startup script starts it: "
            "reboot the node, or run its startup script again)"
        )
    return None
