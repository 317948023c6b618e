"""`launch doctor`'s pure parts: parsing what a node prints, the catalog's expectations, the
node's read-only program, the verdict (catalog and drift), and ordering ranks by topology."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from gpufleet.health import (
    XID_HARDWARE,
    PhysicalHost,
    majority,
    parse_cuda_version,
    parse_gpu_query,
    parse_physical_host,
    parse_xids,
)
from launcher.cluster.topology import launch_order, order, rank_order, spread_warning
from launcher.core.preflight import Probe
from launcher.core.prestart import Expectation, expectation
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload
from launcher.core.wire import CHECKED_MARKER
from launcher.health import CHECKS, judge, node_script, prestart_verdict
from launcher.health.checks import rxdm_problem
from tests.launcher.fake_gpu_node import FakeGpuNode, healthy_gpus

# Its module fixture runs once: every test of the module on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("doctor_units")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


# ---- parsing what the node prints ----------------------------------------------------------


def test_the_real_h100_query_output_parses_field_by_field():
    (g,) = parse_gpu_query((FIXTURES / "h100-query.csv").read_text())
    assert (g.index, g.name, g.memory_mib, g.driver) == (0, "NVIDIA H100 80GB HBM3", 81559, "580.159.04")
    assert g.uuid == "GPU-0c310bbf-9a9d-a3a9-9784-b63f233e10e0" and g.bus_id == "00000000:00:06.0"
    assert g.persistence is True and g.ecc_uncorrected == 0
    # H100 remaps rows instead of retiring pages: "[N/A]" is "not reported", not "no".
    assert g.retired_pending is None and g.remapped_pending is False
    assert (g.temperature_c, g.power_w, g.utilization_pct) == (40, 77.35, 0)


def test_the_cuda_version_comes_from_plain_nvidia_smis_header():
    assert parse_cuda_version((FIXTURES / "h100-nvidia-smi.txt").read_text()) == "13.0"
    assert parse_cuda_version("No devices were found") is None


def test_a_query_line_with_other_fields_is_refused_naming_the_line():
    good = (FIXTURES / "h100-query.csv").read_text().strip()
    with pytest.raises(ValueError, match=r"nvidia-smi line 2 has 3 fields, expected 13"):
        parse_gpu_query(good + "\n0, NVIDIA H100, 81559\n")
    with pytest.raises(ValueError, match=r"line 1: 'Maybe' is neither 'Yes' nor 'No'"):
        parse_gpu_query(good.replace(", No,", ", Maybe,"))


def test_xids_are_read_from_the_drivers_kernel_log_lines():
    lines = [
        "[ 12.3] eth0: link up",
        "[ 99.1] NVRM: Xid (PCI:0000:04:00): 79, pid=4242, name=python3, GPU has fallen off the bus.",
        "[ 99.2] NVRM: Xid (PCI:0000:06:00): 13, pid=4242, Graphics Exception",
    ]
    xids = parse_xids(lines)
    assert [(x.pci, x.code, x.hardware) for x in xids] == [("0000:04:00", 79, True), ("0000:06:00", 13, False)]
    assert 48 in XID_HARDWARE and 31 not in XID_HARDWARE


def test_physical_host_paths_with_and_without_a_subblock():
    assert parse_physical_host("/c1/b2/s3/h4") == PhysicalHost("c1", "b2", "s3", "h4")
    assert parse_physical_host("/c1/r2/h4") == PhysicalHost("c1", "r2", None, "h4")
    assert parse_physical_host("/c1/r2/h4").path == ["c1", "r2", "h4"]
    assert parse_physical_host("") is None
    for bad in ("c1/b2/h3", "/c1//h3", "/c1/h2", "/a/b/c/d/e"):
        with pytest.raises(ValueError, match="is not /CLUSTER/BLOCK/SUBBLOCK/HOST"):
            parse_physical_host(bad)


def test_majority_names_the_common_value_and_refuses_a_tie():
    assert majority({0: "a", 1: "a", 2: "b"}) == ("a", 2)
    assert majority({0: "a", 1: "b"}) == (None, 1)
    assert majority({}) == (None, 0)


# ---- what the catalog expects --------------------------------------------------------------


def test_a3_high_on_cos_expects_eth0_to_eth4_with_tcpx_mtu_rxdm_and_the_plugin_where_env_points():
    e = expectation("a3-highgpu-8g", None, {"LD_LIBRARY_PATH": "/var/lib/tcpx/lib64:/usr/local/nvidia/lib64"})
    assert e.gpu_count == 8 and e.device_names == ("H100",) and e.gpu_memory_gb == 80
    assert e.nics == (("eth0", "host", None),) + tuple((f"eth{i}", "gpu", 8244) for i in range(1, 5))
    assert e.rxdm and e.plugin_dir == "/var/lib/tcpx/lib64" and e.local_ssd_mount == "/mnt/disks/localssd"


def test_a3_mega_on_ubuntu_and_a3_ultra_rdma_devices():
    mega = expectation("a3-megagpu-8g", "ubuntu")
    assert [n for n, _, _ in mega.nics][:3] == ["enp0s12", "enp6s0", "enp7s0"] and len(mega.nics) == 9
    assert mega.local_ssd_mount == "/mnt/localssd" and mega.rxdm
    ultra = expectation("a3-ultragpu-8g")
    assert ultra.rdma_devices == 8 and not ultra.rxdm and ultra.gpu_memory_gb == 141
    assert expectation(None) == Expectation()
    with pytest.raises(UserError, match="'a3-mega' is unknown"):
        expectation("a3-mega")


# ---- the node's program ----------------------------------------------------------------------


def _script(expect: Expectation, address: str = "127.0.0.1", workdir: str | None = None) -> str:
    return node_script(Node(0, address, address), expect, python="python3", workdir=workdir)


def test_the_node_program_is_valid_bash_and_writes_no_file():
    s = _script(expectation("a3-megagpu-8g", "ubuntu", {"LD_LIBRARY_PATH": "/var/lib/tcpxo/lib64"}))
    subprocess.run(["bash", "-n", "-c", s], check=True)
    # Every output redirection goes to /dev/null or another descriptor: nothing is written.
    targets = re.findall(r"(?<![<0-9&])[0-9]?>>?\s*([^\s;|&)]+)", s)
    assert targets and all(t in ("/dev/null",) or t.startswith("&") for t in targets), targets
    assert "nvidia-smi -pm" not in s and "-r" not in s.split("nvidia-smi")[1].split(";")[0]
    assert s.endswith(f"echo {CHECKED_MARKER}; IFS= read -r G; exit 0")


def _run_script(script: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(
        ["bash", "-c", script], input="", capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    ).stdout
    lines = out.splitlines()
    assert CHECKED_MARKER in lines, out
    return dict(l.split("=", 1) for l in lines[: lines.index(CHECKED_MARKER)] if "=" in l)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> dict[str, str]:
    """What the node program prints on a healthy a3-highgpu-8g node (the fakes in PATH; its
    NICs, which this machine lacks, filled in as a node prints them)."""
    d = tmp_path_factory.mktemp("node")
    FakeGpuNode().write(d / "bin")
    (d / "plugin").mkdir()
    (d / "plugin" / "libnccl-net.so").write_text("")
    (d / "plugin" / "libnccl.so.2.21.5").write_text("")
    marker = d / "ready.json"
    marker.write_text(
        json.dumps(
            {
                "cluster": "c",
                "node": "n",
                "machine_type": "a3-highgpu-8g",
                "driver": "580.159.04",
                "cuda": "13.0",
                "nccl": "2.21.5",
                "plugin": "gpudirecttcpx-v3.1.9+rxdm-v2.0.12",
            }
        )
        + "\n"
    )
    e = expectation("a3-highgpu-8g", None, {"LD_LIBRARY_PATH": str(d / "plugin")})
    facts = _run_script(
        _script(e),
        {
            "PATH": f"{d / 'bin'}:{os.environ['PATH']}",
            "GPUFLEET_READY_MARKER": str(marker),
            "GPUFLEET_LOCAL_SSD_MOUNT": "/",
            "GCE_METADATA_HOST": "127.0.0.1:9",
        },
    )
    facts.update({f"nic.eth{i}": "up 8244 0x1003" for i in range(1, 5)}, **{"nic.eth0": "up 1460 0x1003"})
    facts.update(physical_host="/c1/b1/s1/h1", metadata_rc="0")
    return facts


EXPECT = expectation("a3-highgpu-8g", None, {"LD_LIBRARY_PATH": "/x"})


def _nodes(n: int) -> list[Node]:
    return [Node(i, f"10.0.0.{i + 2}", "127.0.0.1", name=f"gpu-{i}") for i in range(n)]


def test_the_program_reports_every_gpu_the_driver_and_the_ready_marker(healthy):
    assert healthy["smi_rc"] == "0" and sum(k.startswith("gpu.") for k in healthy) == 8
    assert healthy["cuda"] == "13.0" and healthy["klog"] == "dmesg" and healthy["rxdm"]
    assert healthy["plugin"].endswith("/libnccl-net.so") and healthy["nccl"] == "2.21.5"
    assert json.loads(healthy["ready"])["driver"] == "580.159.04" and healthy["lssd"] == "mounted"
    assert healthy["addr_iface"] == "lo"


def test_a_healthy_cluster_passes_every_check_and_excludes_nothing(healthy):
    r = judge(_nodes(3), {i: healthy for i in range(3)}, EXPECT, skews={0: 0.0, 1: 0.3, 2: -0.2}, min_free_gb=0)
    assert r.healthy and r.exclude == [] and r.warnings == []
    n = r.nodes[1]
    assert set(n.checks) == set(CHECKS) and all(c.status == "ok" for c in n.checks.values()), {
        k: (c.status, c.problems) for k, c in n.checks.items()
    }
    assert n.checks["gpus"].value == "8 x H100 80GB HBM3" and n.checks["topology"].value == "b1/s1"
    assert n.checks["driver"].value == "580.159.04" and n.checks["clock"].value == "+0.3 s"


def _with(facts: dict[str, str], **changes: str) -> dict[str, str]:
    return {**facts, **{k.replace("__", "."): v for k, v in changes.items()}}


def test_a_missing_gpu_is_named_against_the_catalog(healthy):
    seven = {k: v for k, v in healthy.items() if k != "gpu.7"}
    r = judge(_nodes(3), {0: healthy, 1: seven, 2: healthy}, EXPECT, min_free_gb=0)
    assert not r.healthy and r.exclude == ["gpu-1"]
    assert r.nodes[1].problems == ["node 1 (10.0.0.3): 7 GPUs found, a3-highgpu-8g has 8"]
    assert r.nodes[1].checks["gpus"].status == "fail" and r.nodes[0].status == "ok"


def test_uncorrected_ecc_errors_and_pending_remaps_fail_the_node(healthy):
    ecc = _with(healthy, gpu__3=healthy["gpu.3"].replace("Enabled, 0,", "Enabled, 2,"))
    remap = _with(healthy, gpu__5=healthy["gpu.5"].replace("[N/A], No,", "[N/A], Yes,"))
    r = judge(_nodes(3), {0: ecc, 1: healthy, 2: remap}, EXPECT, min_free_gb=0)
    assert r.exclude == ["gpu-0", "gpu-2"]
    assert r.nodes[0].checks["ecc"].problems == [
        "GPU 3 has 2 uncorrected ECC errors since the driver loaded (reset the GPU or replace the node)"
    ]
    assert r.nodes[0].checks["ecc"].value == "2"
    assert r.nodes[2].checks["ecc"].problems == [
        "GPU 5 has remapped rows pending (they take effect at the next GPU reset)"
    ]


def test_a_different_driver_on_one_node_is_named_with_both_values(healthy):
    other = {k: (v.replace("580.159.04", "570.172.08") if k.startswith("gpu.") else v) for k, v in healthy.items()}
    r = judge(_nodes(4), {0: healthy, 1: healthy, 2: other, 3: healthy}, EXPECT, min_free_gb=0)
    assert r.exclude == ["gpu-2"]
    assert r.nodes[2].checks["driver"].problems == ["driver 570.172.08, while 3 of 4 nodes have 580.159.04"]
    assert r.nodes[2].checks["driver"].status == "fail" and r.nodes[0].checks["driver"].status == "ok"


def test_drift_without_a_majority_flags_both_sides(healthy):
    other = _with(healthy, torch="2.12.0")
    r = judge(_nodes(2), {0: _with(healthy, torch="2.13.0"), 1: other}, EXPECT, min_free_gb=0)
    assert r.exclude == ["gpu-0", "gpu-1"]
    assert r.nodes[0].checks["versions"].problems == [
        "torch differs across nodes with no majority (node 0 (10.0.0.2): 2.13.0; node 1 (10.0.0.3): 2.12.0)"
    ]


def test_nics_down_with_the_wrong_mtu_or_missing_and_no_rxdm(healthy):
    bad = _with(healthy, nic__eth2="down 8244 0x1002", nic__eth3="up 1460 0x1003", nic__eth4="missing", rxdm="")
    r = judge(_nodes(2), {0: healthy, 1: bad}, EXPECT, min_free_gb=0)
    assert r.nodes[1].checks["nics"].problems == [
        "gpu NIC eth2 is down, not up",
        "gpu NIC eth3 has MTU 1460, a3-highgpu-8g needs 8244",
        "gpu NIC eth4 is missing",
    ]
    assert r.nodes[1].checks["nics"].value.startswith("2/5 up")
    assert r.nodes[1].checks["net"].problems == [
        "receive-datapath-manager (RxDM) is not running (gpudirect-tcpx needs it; the startup script starts it: "
        "reboot the node, or run its startup script again)"
    ]


@pytest.mark.parametrize(
    "rc, rxdm", [("0", ""), ("127", ""), ("1", "permission denied while trying to connect to the docker daemon")]
)
def test_doctor_and_the_pre_start_check_say_the_same_of_rxdm(healthy, rc, rxdm):
    """One verdict on RxDM (launcher.health.checks.rxdm_problem), in `launch doctor`'s table and in
    the line that refuses a launch before it starts."""
    facts = _with(healthy, rxdm_rc=rc, rxdm=rxdm)
    r = judge(_nodes(1), {0: facts}, EXPECT, min_free_gb=0)
    said = rxdm_problem(facts, "gpudirect-tcpx")
    assert said and r.nodes[0].checks["net"].problems == [said]
    node = _nodes(1)[0]
    config = LaunchConfig(Workload("torchrun", ("t.py",)), job_id="j")
    with pytest.raises(UserError) as e:
        prestart_verdict(Cluster("c", (node,), "a3-highgpu-8g"), {0: Probe(node, ok=True, facts=facts)}, config)
    assert f"{node.label}: {said}" in str(e.value)


def test_a_hardware_xid_fails_and_a_programs_xid_warns(healthy):
    hw = _with(healthy, xid__0="[9.1] NVRM: Xid (PCI:0000:04:00): 79, pid=1, GPU has fallen off the bus.")
    app = _with(healthy, xid__0="[9.1] NVRM: Xid (PCI:0000:04:00): 13, pid=1, Graphics Exception")
    r = judge(_nodes(3), {0: hw, 1: app, 2: healthy}, EXPECT, min_free_gb=0)
    assert r.exclude == ["gpu-0"] and r.nodes[1].checks["xid"].status == "warn"
    assert r.nodes[0].checks["xid"].value == "79"


def test_clock_skew_warns_without_excluding_and_unreachable_nodes_are_excluded(healthy):
    r = judge(
        _nodes(3),
        {0: healthy, 1: healthy, 2: None},
        EXPECT,
        errors={2: "Connection refused"},
        skews={1: 7.5},
        min_free_gb=0,
    )
    assert r.exclude == ["gpu-2"]
    assert r.nodes[1].checks["clock"].status == "warn" and r.nodes[1].status == "warn"
    assert r.nodes[2].problems == ["node 2 (10.0.0.4): unreachable: Connection refused"]
    doc = json.loads(r.dumps())
    assert doc["healthy"] is False and doc["exclude"] == ["gpu-2"]
    assert doc["nodes"][0]["checks"]["gpus"] == {"value": "8 x H100 80GB HBM3", "status": "ok", "problems": []}
    assert doc["nodes"][0]["physical_host"] == {"cluster": "c1", "block": "b1", "subblock": "s1", "host": "h1"}


def test_no_ready_marker_or_too_little_disk_fails(healthy):
    gone = _with(healthy, ready="missing", startup_error="line 97: cos-extensions install gpu")
    r = judge(_nodes(2), {0: gone, 1: healthy}, EXPECT, min_free_gb=1e9)
    assert (
        "no ready marker /var/lib/gpufleet/ready.json: the startup script has not finished (it failed: "
        "line 97: cos-extensions install gpu)" in r.nodes[0].checks["versions"].problems
    )
    assert any("GiB wanted (--min-free-gb)" in p for p in r.nodes[1].checks["disk"].problems)


def test_without_a_machine_type_only_drift_is_judged(healthy):
    seven = {k: v for k, v in healthy.items() if k != "gpu.7"}
    r = judge(_nodes(3), {0: healthy, 1: healthy, 2: seven}, Expectation(), min_free_gb=0)
    assert r.exclude == ["gpu-2"]
    assert r.nodes[2].checks["gpus"].problems == ["gpus 7 x H100 80GB HBM3, while 2 of 3 nodes have 8 x H100 80GB HBM3"]
    assert r.nodes[0].checks["nics"].value.startswith("127.0.0.1 on lo")


# ---- topology -----------------------------------------------------------------------------


def test_order_groups_by_path_like_sort_nodes_keeping_the_first_node_first():
    paths = {
        "a": ["c", "b1", "h1"],
        "b": ["c", "b2", "h1"],
        "c": ["c", "b1", "h2"],
        "d": ["c", "b2", "h2"],
        "e": ["c", "b1", "h3"],
    }
    assert order(list("abcde"), paths) == list("acebd")
    # Equal paths keep the given order.
    assert order(["x", "y"], {"x": ["c", "b"], "y": ["c", "b"]}) == ["x", "y"]


def _cluster(n: int) -> Cluster:
    return Cluster("t", tuple(Node(i, f"10.0.0.{i + 2}", f"10.0.0.{i + 2}") for i in range(n)))


def test_rank_order_by_topology_when_every_node_has_one():
    c = _cluster(4)
    hosts = {
        "10.0.0.2": PhysicalHost("c", "b1", "s1", "h1"),
        "10.0.0.3": PhysicalHost("c", "b2", "s1", "h1"),
        "10.0.0.4": PhysicalHost("c", "b1", "s2", "h2"),
        "10.0.0.5": PhysicalHost("c", "b1", "s1", "h3"),
    }
    r = rank_order(c, hosts, None, "the metadata server")
    assert [n.host for n in r.cluster.nodes] == ["10.0.0.2", "10.0.0.5", "10.0.0.4", "10.0.0.3"]
    assert [n.rank for n in r.cluster.nodes] == [0, 1, 2, 3] and r.reordered
    assert r.message == (
        "ranks ordered by physical topology from the metadata server (2 of 4 nodes moved; "
        "--rank-order given keeps the given order)"
    )
    given = rank_order(c, hosts, "given", "the metadata server")
    assert given.cluster is c and not given.reordered


def test_rank_order_keeps_the_given_order_unless_every_node_is_known():
    c = _cluster(2)
    hosts = {"10.0.0.2": PhysicalHost("c", "b1", None, "h1"), "10.0.0.3": None}
    r = rank_order(c, hosts, None, "the Compute Engine API")
    assert (
        r.cluster is c
        and r.message == "ranks in the given order: 1 of 2 nodes have no physical host (from the Compute Engine API)"
    )
    with pytest.raises(UserError, match=r"--rank-order topology: no physical host for node 1 \(10.0.0.3\)"):
        rank_order(c, hosts, "topology", "the Compute Engine API")


def test_launch_order_by_topology_from_physical_host_paths():
    c = _cluster(4)
    paths = ["/CCCCCC/BBBBBB/AAAA", "/CCCCCC/BBBBB2/AAAA", "/CCCCCC/BBBBBB/AAAB", "/CCCCCC/BBBBB2/AAAC"]
    hosts = {n.host: parse_physical_host(p) for n, p in zip(c.nodes, paths)}
    r = launch_order(c, None, hosts)
    # Block BBBBBB's nodes (0, 2) first, then BBBBB2's (1, 3); node 0 stays first.
    assert [n.host for n in r.cluster.nodes] == ["10.0.0.2", "10.0.0.4", "10.0.0.3", "10.0.0.5"]
    assert [n.rank for n in r.cluster.nodes] == [0, 1, 2, 3] and r.reordered
    assert r.message == "rank order: topology (2 blocks; 2 of 4 nodes moved)"
    assert launch_order(c, "topology", hosts).cluster == r.cluster
    same = launch_order(r.cluster, None, hosts)
    assert same.cluster == r.cluster and same.message == "rank order: topology (2 blocks; the given order already is)"


def test_launch_order_given_keeps_the_node_source_order():
    c = _cluster(3)
    hosts = {n.host: PhysicalHost("c", f"b{2 - n.rank}", None, "h") for n in c.nodes}
    r = launch_order(c, "given", hosts)
    assert r.cluster is c and not r.reordered and r.message == "rank order: given (--rank-order given)"


def test_launch_order_falls_back_to_given_and_names_the_nodes_without_a_physical_host():
    c = _cluster(5)
    one = {n.host: PhysicalHost("c", "b", None, f"h{n.rank}") for n in c.nodes} | {"10.0.0.4": None}
    r = launch_order(c, None, one)
    assert r.cluster is c and r.message == "rank order: given (node 2 (10.0.0.4) reports no physical_host)"
    none = dict.fromkeys((n.host for n in c.nodes), None)
    assert launch_order(c, None, none).message == "rank order: given (no node reports a physical_host)"
    two = one | {"10.0.0.2": None}
    assert launch_order(c, None, two).message == (
        "rank order: given (2 of 5 nodes: node 0 (10.0.0.2), node 2 (10.0.0.4) report no physical_host)"
    )
    with pytest.raises(UserError) as e:
        launch_order(c, "topology", one)
    assert str(e.value) == (
        "--rank-order topology: node 2 (10.0.0.4) reports no physical_host (from the metadata server; "
        "only VMs in a placement policy have one); pass --rank-order given"
    )
    with pytest.raises(UserError, match=r"node 0 \(10.0.0.2\), node 1 .* report no physical_host"):
        launch_order(c, "topology", none)


def test_launch_order_without_asking_the_nodes():
    c = _cluster(2)
    dry = launch_order(c, None, None)
    assert dry.cluster is c and dry.message.startswith("rank order: given here (--dry-run asks no node")
    local = Cluster("local", c.nodes, local=True)
    assert launch_order(local, None, None).message == "rank order: given (--local: every node is this machine)"
    with pytest.raises(UserError, match="--rank-order topology does not apply to --local"):
        launch_order(local, "topology", None)
    with pytest.raises(UserError, match="--rank-order 'best' is unknown; one of: topology, given"):
        launch_order(c, "best", None)


def test_a_cluster_across_two_blocks_is_warned_about():
    one = {"a": PhysicalHost("c", "b1", "s1", "h1"), "b": PhysicalHost("c", "b1", "s2", "h2")}
    assert spread_warning(one) is None
    two = {**one, "z": PhysicalHost("c", "b9", "s1", "h1")}
    assert spread_warning(two) == (
        "the nodes span 2 blocks (c/b1: 2 nodes, c/b9: 1 node); a compact placement "
        "keeps a cluster in one block, so if this cluster has one, the placement did not hold"
    )


def test_fake_gpus_are_the_fixtures_values():
    gpus = healthy_gpus(2)
    assert gpus[0].values["name"] == "NVIDIA H100 80GB HBM3" and gpus[1].values["index"] == "1"


def test_a_nodes_physical_host_comes_from_its_metadata_server_else_from_the_api():
    from dataclasses import dataclass

    from launcher.cluster.topology import metadata_statement, node_physical_hosts

    @dataclass(frozen=True)
    class ApiNode(Node):  # a Node as --label discovery returns it, with the API's physicalHost
        physical_host: str = ""

    c = Cluster(
        "t",
        (
            Node(0, "10.0.0.2", "10.0.0.2"),
            ApiNode(1, "10.0.0.3", "10.0.0.3", physical_host="/c/b/s/h3"),
            Node(2, "10.0.0.4", "10.0.0.4"),
        ),
    )
    facts = {
        0: {"metadata_rc": "0", "physical_host": "/c/b/s/h1"},
        1: {"metadata_rc": "7", "physical_host": ""},
        2: {"metadata_rc": "22", "physical_host": ""},
    }
    assert node_physical_hosts(c, facts) == {
        "10.0.0.2": PhysicalHost("c", "b", "s", "h1"),
        "10.0.0.3": PhysicalHost("c", "b", "s", "h3"),
        "10.0.0.4": None,
    }
    s = metadata_statement()
    assert "-H 'Metadata-Flavor: Google'" in s and "${GCE_METADATA_HOST:-metadata.google.internal}" in s
    assert "/computeMetadata/v1/instance/attributes/physical_host" in s


# ---- the cheap part, in every launch's pre-start check ------------------------------------


def test_a_launch_checks_gpus_and_nics_only_when_the_machine_type_is_known():
    from gpufleet.node_plan import CheckKind
    from launcher.core.node_plan import hardware_checks

    assert hardware_checks(_cluster(2), None) == []
    local = Cluster("l", (Node(0, "localhost", "127.0.0.1"),), machine_type="a3-highgpu-8g", local=True)
    assert hardware_checks(local, None) == []
    typed = Cluster("t", _cluster(2).nodes, machine_type="a3-highgpu-8g")
    checks = hardware_checks(typed, None)
    assert checks[0].kind is CheckKind.GPUS and checks[0].expect == "8 x H100 80GB"
    assert [c.target for c in checks if c.kind is CheckKind.NIC] == [f"eth{i}" for i in range(5)]
    assert checks[-1].kind is CheckKind.RXDM  # TCPX needs RxDM up


class _Probe:
    def __init__(self, node: Node, facts: dict[str, str]):
        self.node, self.facts, self.ok = node, facts, True


def test_the_pre_start_check_refuses_a_node_missing_a_gpu_or_nic_and_warns_about_drift(healthy):
    from launcher.core.types import LaunchConfig, Workload
    from launcher.health import prestart_verdict

    cluster = Cluster("t", tuple(_nodes(3)), machine_type="a3-highgpu-8g")
    config = LaunchConfig(Workload("torchrun", ("x.py",)))
    fine = {r: _Probe(n, healthy) for r, n in enumerate(cluster.nodes)}
    assert prestart_verdict(cluster, fine, config) == []
    drift = dict(fine)
    drift[1] = _Probe(
        cluster.nodes[1],
        {k: (v.replace("580.159.04", "570.172.08") if k.startswith("gpu.") else v) for k, v in healthy.items()},
    )
    drift[2] = _Probe(cluster.nodes[2], _with(healthy, nic__eth1="up 1460 0x1003"))
    assert prestart_verdict(cluster, drift, config) == [
        "node 2 (10.0.0.4): gpu NIC eth1 has MTU 1460, a3-highgpu-8g needs 8244",
        "node 1 (10.0.0.3): driver 570.172.08, while 2 of 3 nodes have 580.159.04",
    ]
    broken = dict(fine)
    broken[0] = _Probe(cluster.nodes[0], {k: v for k, v in healthy.items() if k != "gpu.7"})
    broken[2] = _Probe(cluster.nodes[2], _with(healthy, nic__eth3="missing"))
    with pytest.raises(UserError) as e:
        prestart_verdict(cluster, broken, config)
    assert str(e.value) == (
        "node 0 (10.0.0.2): 7 GPUs found, a3-highgpu-8g has 8; node 2 (10.0.0.4): gpu NIC eth3 "
        "is missing; nothing was started. `launch doctor` checks every node in full; fix the "
        "node or --exclude it"
    )
    # A check without the statements (no machine type) has nothing to judge.
    plain = {r: _Probe(n, {"host": "x"}) for r, n in enumerate(cluster.nodes)}
    assert prestart_verdict(cluster, plain, config) == []


def test_a_check_whose_nodes_answered_the_gpu_questions_is_judged_by_its_verdict_or_refused(healthy):
    """core renders the GPU questions and launcher.health judges the answers: the launch's check
    runs the verdict it is given, and refuses to go on without one rather than skip it."""
    from launcher.core.preflight import Probe, check_probes
    from launcher.core.types import LaunchConfig, Workload
    from launcher.health import prestart_verdict
    from launcher.runner import LaunchPlan

    cluster = Cluster("t", tuple(_nodes(2)), machine_type="a3-highgpu-8g")
    config = LaunchConfig(Workload("torchrun", ("x.py",)))
    # What a launch's check prints about the hardware (launcher.core.prestart's statements).
    asked = {k: v for k, v in healthy.items() if k == "smi_rc" or k.startswith(("gpu.", "nic.", "rxdm"))}
    probes = {r: Probe(n, ok=True, facts={**asked, "host": n.name}) for r, n in enumerate(cluster.nodes)}
    assert check_probes(cluster, probes, config, prestart_verdict) == []
    probes[1] = Probe(cluster.nodes[1], ok=True, facts=_with(probes[1].facts, nic__eth3="missing"))
    with pytest.raises(UserError, match=r"node 1 \(10.0.0.3\): gpu NIC eth3 is missing; nothing was started"):
        check_probes(cluster, probes, config, prestart_verdict)
    with pytest.raises(RuntimeError, match="no verdict judges the answers"):
        check_probes(cluster, probes, config)
    # Without the GPU questions (no machine type) there is nothing for a verdict to judge.
    plain = {r: Probe(n, ok=True, facts={"host": n.name}) for r, n in enumerate(cluster.nodes)}
    assert check_probes(cluster, plain, config) == []
    # A launch plan carries the verdict to the Launch that runs it.
    assert LaunchPlan.__dataclass_fields__["verdict"].default is prestart_verdict


def test_the_fake_nvidia_smi_applies_any_query_and_refuses_what_would_change_a_gpu(tmp_path):
    FakeGpuNode(gpus=healthy_gpus(2)).ecc(1, 5).write(tmp_path)
    smi = str(tmp_path / "nvidia-smi")
    out = subprocess.run(
        [smi, "--query-gpu=ecc.errors.uncorrected.volatile.total,index,name", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == "0, 0, NVIDIA H100 80GB HBM3\n5, 1, NVIDIA H100 80GB HBM3\n"
    bad = subprocess.run(
        [smi, "--query-gpu=index,bogus", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    assert (bad.returncode, bad.stdout) == (2, 'Field "bogus" is not a valid field to query.\n')
    assert subprocess.run([smi, "-pm", "1"], capture_output=True).returncode == 3
    assert (tmp_path / "calls.log").read_text().splitlines()[-1] == "-pm 1"
