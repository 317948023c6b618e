"""The cheap part of `launch doctor`, which every launch's pre-start check runs too (a node without
its GPUs or NICs must not start a job that would hang or crawl): what the catalog says a node of
the machine type has (`Expectation`), the node-side bash statements that report its GPUs and NICs
as `key=value` lines, and the verdict on their answers (`prestart_verdict`, built from the same
checks `launch doctor` judges with). Pure functions.

A launch with a known machine type (stack outputs, --label, --machine-type) adds these statements
to its check; `prestart_verdict` then refuses to start when a node lacks a GPU or a NIC (naming
the node) and warns about drift across nodes. Without a machine type (a hostfile alone, --local,
CPU nodes) nothing is added, so such launches cost what they did. launcher.doctor builds the full
check on these parts; this module never imports it.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufleet.catalog import MachineType, NetStack, UnknownMachineType, lookup
from gpufleet.contracts import LOCAL_SSD_MOUNT, RXDM_CONTAINER
from gpufleet.health import GPU_QUERY_FIELDS, GpuRow, PhysicalHost, majority, parse_gpu_query
from launcher.core.types import Cluster, LaunchConfig, UserError

__all__ = [
    "CHECKS",
    "FAIL",
    "OK",
    "SKIP",
    "WARN",
    "Check",
    "Expectation",
    "NodeReport",
    "expectation",
    "gpu_statement",
    "judge_drift",
    "judge_gpus",
    "kib",
    "nic_problems",
    "nic_statements",
    "prestart_statements",
    "prestart_verdict",
    "RXDM_CONTAINER",
    "rxdm_problem",
    "rxdm_statement",
]


@dataclass(frozen=True)
class Expectation:
    """What the catalog says every node of the cluster should have; mostly empty when the
    machine type is unknown (a hostfile without --machine-type), where only drift is judged."""

    machine_type: str | None = None
    gpu_count: int | None = None
    gpu_model: str | None = None
    gpu_memory_gb: int | None = None
    device_names: tuple[str, ...] = ()  # substrings of nvidia-smi's name (catalog GPU.device_names)
    nics: tuple[tuple[str, str, int | None], ...] = ()  # (name on the image, role, MTU to expect)
    rdma_devices: int = 0  # CX-7 NICs, seen as RDMA devices under /sys/class/infiniband
    net_stack: str | None = None
    rxdm: bool = False  # the receive-datapath manager must run (TCPX, TCPXO)
    plugin_dir: str | None = None  # where the NCCL net plugin must be: the env's LD_LIBRARY_PATH
    local_ssd_mount: str | None = None  # the RAID0 of the bundled local SSDs, when it has some


def expectation(
    machine_type: str | None, image_os: str | None = None, env: Mapping[str, str] | None = None
) -> Expectation:
    """The catalog's entry for `machine_type` on `image_os`, as checks. `env` is the environment
    a launch exports on the nodes (launcher.core.env.node_env): the NCCL plugin must be in the first
    directory of its LD_LIBRARY_PATH, which is where NCCL will look (NCCL docs, NCCL_NET_PLUGIN)."""
    if machine_type is None:
        return Expectation()
    try:
        mt: MachineType = lookup(machine_type)
        names = mt.interface_names(image_os)
    except (UnknownMachineType, ValueError) as e:
        raise UserError(str(e)) from None
    os_ = image_os or mt.image_os
    nics = tuple(
        (name, nic.role, mt.gpu_mtu if nic.role == "gpu" else None) for name, nic in zip(names, mt.nics) if name
    )
    plugin_dir = None
    if mt.net_stack is not NetStack.NONE and env and env.get("LD_LIBRARY_PATH"):
        plugin_dir = env["LD_LIBRARY_PATH"].split(":")[0]
    return Expectation(
        machine_type=mt.name,
        gpu_count=mt.gpu_count,
        gpu_model=mt.gpu.model,
        gpu_memory_gb=mt.gpu.memory_gb,
        device_names=mt.gpu.device_names,
        nics=nics,
        rdma_devices=sum(1 for n in mt.nics if n.role == "rdma"),
        net_stack=mt.net_stack.value,
        rxdm=mt.net_stack in (NetStack.TCPX, NetStack.TCPXO),
        plugin_dir=plugin_dir,
        local_ssd_mount=LOCAL_SSD_MOUNT[os_] if mt.local_ssd_count else None,
    )


def gpu_statement(cuda: bool = False) -> str:
    """nvidia-smi's documented CSV query (`--query-gpu=<GPU_QUERY_FIELDS> --format=csv,noheader,
    nounits`), run in the background: `smi_rc=` (127: no nvidia-smi; nonzero: no driver, with
    nvidia-smi's own reason on the first `gpu.0=` line) and one `gpu.N=` line per GPU; with `cuda`,
    also the CUDA version, which only plain nvidia-smi's header gives. Ends in `&`: the caller
    runs `wait` before its marker. Each line is one write of a few hundred bytes, so lines of
    concurrent probes never mix (POSIX: pipe writes of at most PIPE_BUF bytes are atomic)."""
    fields = ",".join(GPU_QUERY_FIELDS)
    s = (
        f"{{ O=$(nvidia-smi --query-gpu={fields} --format=csv,noheader,nounits 2>&1); echo smi_rc=$?; "
        "printf '%s\\n' \"$O\" | awk 'NF {print \"gpu.\" n++ \"=\" $0}'; "
    )
    if cuda:
        s += "echo cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\\([0-9.]*\\).*/\\1/p' | head -n 1); "
    return s + "} &"


def nic_statements(expect: Expectation) -> list[str]:
    """`nic.NAME=<operstate> <mtu> <flags>` (or `nic.NAME=missing`) for every NIC the catalog names
    on the image, from /sys/class/net; `read` is a builtin, so no fork per file."""
    out = []
    for name, _, _ in expect.nics:
        d = f"/sys/class/net/{shlex.quote(name)}"
        out.append(
            f"if [ -e {d} ]; then read -r o < {d}/operstate; read -r m < {d}/mtu; read -r f < {d}/flags; "
            f'echo "nic.{name}=$o $m $f"; else echo nic.{name}=missing; fi'
        )
    return out


def rxdm_statement() -> str:
    """`rxdm_rc=` (docker's status: 127 no docker) and `rxdm=` (the running RxDM container's id,
    empty when it does not run), asking docker as the user, else through `sudo -n` (the socket is
    root's on COS and with Ubuntu's docker.io)."""
    # `docker ps` without -a lists running containers only.
    f = f"-f {shlex.quote(f'name=^{RXDM_CONTAINER}$')}"
    return (
        f"R=$(docker ps -q {f} 2>&1); rc=$?; if [ $rc != 0 ]; then "
        f"R2=$(sudo -n docker ps -q {f} 2>/dev/null) && {{ R=$R2; rc=0; }}; fi; "
        "echo rxdm_rc=$rc; echo \"rxdm=$(printf '%s' \"$R\" | head -n 1)\""
    )


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


def prestart_statements(cluster: Cluster, image_os: str | None) -> list[str]:
    """What a launch's check adds on each node: the GPU query and the NICs, when the cluster's
    machine type is known and its nodes are not this machine (--local), and on GPUDirect-TCPX/
    TCPXO nodes whether RxDM runs; ends with `wait`."""
    if cluster.machine_type is None or cluster.local:
        return []
    expect = expectation(cluster.machine_type, image_os)
    return [gpu_statement(), *nic_statements(expect), *([rxdm_statement()] if expect.rxdm else []), "wait"]


# ---- the verdict's parts, shared with `launch doctor` (launcher.doctor) ----------------------

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


def prestart_verdict(cluster: Cluster, probes: Mapping[int, Any], config: LaunchConfig) -> list[str]:
    """The launch's pre-start judgement of what launcher.core.prestart's statements reported (probes
    by rank, each with `.ok`, `.node` and `.facts`): raise one UserError naming every node with a
    GPU or NIC missing (nothing was started); return warnings for the rest (drift of the driver,
    ECC errors, a wrong MTU). Nothing to say when the check did not run them (no machine type)."""
    facts = {r: p.facts for r, p in probes.items() if p.ok and "smi_rc" in p.facts}
    if not facts or cluster.machine_type is None:
        return []
    expect = expectation(cluster.machine_type, config.image_os)
    errors: list[str] = []
    warnings: list[str] = []
    reports = []
    for node in cluster.nodes:
        f = facts.get(node.rank)
        if f is None:
            continue
        r = NodeReport(node.rank, node.host, node.name, reachable=True)
        r.checks = {k: Check() for k in CHECKS}
        judge_gpus(r, f, expect)
        reports.append(r)
        errors += [f"{node.label}: {p}" for p in r.checks["gpus"].problems]
        for kind, p in nic_problems(f, expect)[1]:
            (warnings if kind == "mtu" else errors).append(f"{node.label}: {p}")
        if expect.rxdm and "rxdm_rc" in f:
            problem = rxdm_problem(f, expect.net_stack)
            if problem:
                errors.append(f"{node.label}: {problem}")
    judge_drift(reports, expect)
    for r in reports:
        warnings += [
            f"{r.label}: {p}" for col in ("driver", "cuda", "ecc", "persistence") for p in r.checks[col].problems
        ]
    if errors:
        raise UserError(
            f"{'; '.join(errors)}; nothing was started. `launch doctor` checks every node in full; "
            "fix the node or --exclude it"
        )
    return warnings
