"""`launch doctor`: what every node should have, the read-only program that asks it, and the
verdict. Pure functions: building the node's program and judging its answers touch no network.

The one most common cause of a hung or slow multi-node job is one node that differs: a
GPU missing or with ECC errors, a GPU NIC down or with the wrong MTU, the receive-datapath manager
not running, another driver than its neighbours (Cluster Toolkit issue #3032: a newer driver broke
TCPX with "Connection refused"). So each node is judged twice: against the catalog's entry for
its machine type (`Expectation`), and against the majority of the nodes (drift: the node is named
with both values).

The node's program (`node_script`) only reads: it runs `nvidia-smi` queries, reads the kernel log,
/sys/class/net, `docker ps`, `df`, the ready marker and the metadata server, prints `key=value`
lines and the launcher's CHECKED_MARKER, then waits for end of input, like the check half of a
launch (launcher.core.program), so it rides the same SSH sessions. Nothing it runs writes a file.

Test hooks, read on the node, each defaulting to the real thing: GCE_METADATA_HOST (the metadata
server's host:port, as google-auth honours it), GPUFLEET_READY_MARKER (the ready marker's path,
gpufleet.contracts.READY_MARKER) and GPUFLEET_LOCAL_SSD_MOUNT (the local-SSD RAID's mount point,
gpufleet.contracts.LOCAL_SSD_MOUNT for the image OS). The simulated nodes share one filesystem and
have no metadata server, so the tests give each node its own through these.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from gpufleet.contracts import READY_MARKER
from gpufleet.health import (
    parse_physical_host,
    parse_xids,
)
from gpufleet.nccl_env import PREPEND_PATH_VARS
from launcher.cluster.topology import metadata_statement, spread_warning
from launcher.core.prestart import (
    CHECKS,
    FAIL,
    WARN,
    Check,
    Expectation,
    NodeReport,
    gpu_statement,
    judge_drift,
    judge_gpus,
    kib,
    nic_problems,
    nic_statements,
)
from launcher.core.types import Node
from launcher.core.wire import CHECKED_MARKER, read_env_statements

__all__ = [
    "RXDM_CONTAINER",
    "CLOCK_WARN_S",
    "node_script",
    "Report",
    "judge",
]

# The container infra/templates/tcpx.sh and tcpxo.sh start (Google's GPUDirect VM sequence).
RXDM_CONTAINER = "receive-datapath-manager"

# Beyond a couple of seconds, log timestamps and timeouts stop lining up across nodes (the same
# bound the launch's pre-start check warns at, launcher.core.preflight.check_probes).
CLOCK_WARN_S = 2.0

_READY_ENV = "GPUFLEET_READY_MARKER"
_LSSD_ENV = "GPUFLEET_LOCAL_SSD_MOUNT"


# ---- the node's program ------------------------------------------------------------------


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
        return True
    except ValueError:
        return False


def node_script(
    node: Node,
    expect: Expectation,
    python: str = "python3",
    workdir: str | None = None,
    env: Sequence[tuple[str, str]] = (),
) -> str:
    """The read-only bash program that reports on `node` as `key=value` lines, then prints
    CHECKED_MARKER and waits for end of input (one line: launcher.core.wire.join's form).
    `env` is the user's --env (launcher.core.program.stdin_env), exported first as a launch does,
    so `--env PATH=...` picks the same python3 here as in the run (PATH-like values are
    prepended): as in a launch, the values are read from stdin (launcher.core.wire.env_block,
    which the caller writes first), never put in the program."""
    q = shlex.quote
    s = [st for k, _ in env for st in read_env_statements(k, prepend=k in PREPEND_PATH_VARS)]
    s += [
        "echo host=$(hostname)",
        "echo time=$(date +%s.%N)",
        # The three slow probes (nvidia-smi, the interpreter, the metadata server) run at once, in
        # the background; the rest reads files meanwhile, and `wait` joins them before the marker.
        # Each line is one write of a few hundred bytes, so lines from different probes never mix
        # (POSIX: writes of at most PIPE_BUF bytes to a pipe are atomic).
        # GPUs, and the driver's CUDA version (launcher.core.prestart).
        gpu_statement(cuda=True),
        # python and torch: torch's version from its dist-info directory on the interpreter's own
        # path, the first one found in sys.path order as importlib.metadata would find it, without
        # importing torch (seconds on a busy node) or importlib.metadata (a scan of every package).
        f"{q(python)} -c 'import sys, glob; print(\"python=\" + sys.version.split()[0]); "
        "d = [g for p in sys.path for g in sorted(glob.glob((p or \".\") + \"/torch-*.dist-info\"))]; "
        "print(\"torch=\" + (d[0].rsplit(\"/\", 1)[1][6:-10] if d else \"missing\"))' "
        "2>/dev/null || echo python=missing &",
        # Where the VM sits (launcher.cluster.topology.metadata_statement).
        f"{{ {metadata_statement()}; }} &",
        # XIDs since boot: the kernel log (dmesg needs root where kernel.dmesg_restrict=1; the
        # journal's kernel messages of this boot are the fallback).
        "if K=$(dmesg 2>/dev/null); then echo klog=dmesg; elif K=$(journalctl -k -b -q --no-pager 2>/dev/null); "
        "then echo klog=journal; else K=; echo klog=unreadable; fi",
        "printf '%s\\n' \"$K\" | grep -F 'NVRM: Xid' | tail -n 20 | awk '{print \"xid.\" n++ \"=\" $0}'",
    ]
    s += nic_statements(expect)
    if _is_ip(node.address):
        # The interface that holds the address we reached the node at (`ip -o` prints one line
        # per address: "2: eth0    inet 10.0.0.2/24 ...").
        s.append(
            f"echo addr_iface=$(ip -o addr show 2>/dev/null | awk -v a={q(node.address)} "
            "'{split($4,p,\"/\"); if (p[1]==a) {print $2; exit}}')"
        )
    if expect.rdma_devices:
        s.append("n=0; for d in /sys/class/infiniband/*; do [ -e \"$d\" ] && n=$((n+1)); done; echo rdma=$n")
    if expect.rxdm:
        name = q(f"name=^{RXDM_CONTAINER}$")
        # docker needs root or the docker group; sudo -n never asks for a password.
        s.append(
            f"R=$(docker ps -q -f {name} 2>&1); rc=$?; if [ $rc != 0 ]; then "
            f"R2=$(sudo -n docker ps -q -f {name} 2>/dev/null) && {{ R=$R2; rc=0; }}; fi; "
            "echo rxdm_rc=$rc; echo \"rxdm=$(printf '%s' \"$R\" | head -n 1)\""
        )
    if expect.plugin_dir:
        d = q(expect.plugin_dir)
        s.append(f"set -- {d}/libnccl-net*.so*; if [ -e \"$1\" ]; then echo plugin=$1; else echo plugin=missing; fi")
        # NCCL's version: the plugin installers put their own libnccl.so.2.X.Y next to the plugin
        # (infra/templates/*.sh nccl_version); else the libnccl2 package.
        s.append(
            f"v=; for f in {d}/libnccl.so.2.*; do [ -e \"$f\" ] && v=${{f##*/libnccl.so.}}; done; "
            "[ -n \"$v\" ] || v=$(dpkg-query -W -f='${Version}' libnccl2 2>/dev/null); echo nccl=$v"
        )
    # The ready marker the startup script writes last (gpufleet.contracts.READY_MARKER), and the
    # error file it leaves beside it when a boot failed (infra/templates/base.sh).
    s.append(
        f"M=${{{_READY_ENV}:-{q(READY_MARKER)}}}; if [ -f \"$M\" ]; then echo \"ready=$(head -c 4096 \"$M\" "
        "| tr -d '\\n')\"; else echo ready=missing; fi; "
        "if [ -f \"${M%/*}/startup-error.txt\" ]; then "
        "echo \"startup_error=$(head -n 1 \"${M%/*}/startup-error.txt\")\"; fi"
    )
    # Free space where the workload writes (its working directory) and on the local SSDs.
    wd = ("~/" + q(workdir[2:])) if workdir and workdir.startswith("~/") else q(workdir) if workdir else "~"
    s.append(f"echo disk.work=$(df -Pk {wd} 2>/dev/null | awk 'NR==2 {{print $4, $6}}')")
    if expect.local_ssd_mount:
        s.append(
            f"L=${{{_LSSD_ENV}:-{q(expect.local_ssd_mount)}}}; if mountpoint -q \"$L\"; then echo lssd=mounted; "
            "echo disk.lssd=$(df -Pk \"$L\" 2>/dev/null | awk 'NR==2 {print $4, $6}'); else echo lssd=not-mounted; fi; "
            "echo lssd_path=$L"
        )
    s += ["wait", f"echo {CHECKED_MARKER}", "IFS= read -r G", "exit 0"]
    # `a &; b` is a syntax error: a statement ending in `&` is already terminated.
    return " ".join(st if st.endswith("&") else st + ";" for st in s).rstrip(";")


# ---- the verdict ---------------------------------------------------------------------------


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
        rc, rxdm = facts.get("rxdm_rc", ""), facts.get("rxdm", "")
        if rc == "127":
            c.add(FAIL, f"docker is not installed, so {RXDM_CONTAINER} cannot run ({expect.net_stack} needs it)")
        elif rc != "0":
            c.add(FAIL, f"cannot ask docker whether {RXDM_CONTAINER} runs: {rxdm or 'exit ' + rc}")
        elif not rxdm:
            c.add(FAIL, f"{RXDM_CONTAINER} is not running ({expect.net_stack} needs it; the startup script starts it)")
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
