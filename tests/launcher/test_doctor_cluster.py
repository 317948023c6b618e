"""`launch doctor` against the simulated cluster: real sshd nodes in their own network namespaces,
each with a PATH entry holding a fake `nvidia-smi`/`dmesg`/`docker` (tests/launcher/
fake_gpu_node.py) and its own metadata server (reached through GCE_METADATA_HOST), four GPU NICs
made of real veth pairs with the catalog's MTU, its own ready marker, and the TCPX plugin where
`--env LD_LIBRARY_PATH` points. The cluster is an a3-highgpu-8g on COS (eth0 + eth1..eth4).

One cluster serves the module; each test rewrites the nodes' fakes (a node's PATH entry is read
at every call) and puts them back healthy afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.launcher.fake_gpu_node import FakeGpuNode, GpuSimCluster, healthy_gpus
from tests.support import LAUNCH, REPO

pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("doctor_cluster")]

N = 4
# Nodes 0 and 2 share subblock s1, 1 and 3 share s2: topology order is 0, 2, 1, 3.
PLACES = ["/clu/blk1/s1/h01", "/clu/blk1/s2/h07", "/clu/blk1/s1/h02", "/clu/blk1/s2/h09"]


@pytest.fixture(scope="module")
def gc(tmp_path_factory):
    c = GpuSimCluster(tmp_path_factory.mktemp("doctor"), PLACES)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def cluster(gc):
    yield gc
    for i in range(N):
        gc.heal(i)


def doctor(c: GpuSimCluster, tmp_path: Path, *extra: str):
    from launcher.cli.cmd_doctor import doctor as cmd

    r = CliRunner().invoke(cmd, [*c.args(tmp_path), *extra])
    return r


def test_a_healthy_cluster_exits_0_with_every_check_and_ranks_in_topology_order(cluster, tmp_path):
    r = doctor(cluster, tmp_path)
    assert r.exit_code == 0, r.output
    hosts = cluster.sim.addresses
    for col in ("gpus", "driver", "cuda", "nics", "net", "versions", "topology"):
        assert col in r.output
    assert r.output.count("8 x H100 80GB HBM3") == N and r.output.count("580.159.04") == N
    assert r.output.count("5/5 up") == N and r.output.count("gpudirect-tcpx, rxdm up, plugin ok") == N
    assert "blk1/s1" in r.output and "blk1/s2" in r.output
    assert (
        "ranks ordered by physical topology from the metadata server (2 of 4 nodes moved; "
        "--rank-order given keeps the given order)"
    ) in r.output
    assert "all 4 nodes healthy" in r.output and "--exclude" not in r.output

    j = doctor(cluster, tmp_path, "--json")
    assert j.exit_code == 0, j.output
    doc = json.loads(j.stdout)
    assert doc["healthy"] is True and doc["exclude"] == [] and doc["warnings"] == []
    assert doc["rank_order"]["hosts"] == [hosts[0], hosts[2], hosts[1], hosts[3]]
    node = doc["nodes"][1]
    assert node["host"] == hosts[1] and node["status"] == "ok" and len(node["gpus"]) == 8
    assert node["physical_host"] == {"cluster": "clu", "block": "blk1", "subblock": "s2", "host": "h07"}
    assert node["versions"]["torch"] and node["versions"]["nccl"] == "2.21.5"
    assert {k: c["status"] for k, c in node["checks"].items()} == {
        k: "ok"
        for k in (
            "gpus",
            "driver",
            "cuda",
            "persistence",
            "ecc",
            "xid",
            "nics",
            "net",
            "versions",
            "disk",
            "clock",
            "topology",
        )
    }


def _missing_gpu(c: GpuSimCluster) -> int:
    c.heal(1, FakeGpuNode(gpus=healthy_gpus(7)))
    return 1


def _ecc(c: GpuSimCluster) -> int:
    c.heal(2, FakeGpuNode().ecc(3, 2))
    return 2


def _driver(c: GpuSimCluster) -> int:
    c.heal(3, FakeGpuNode(gpus=healthy_gpus(8, driver="570.172.08")))
    return 3


CASES = {
    "missing GPU": (_missing_gpu, "gpus", "7 x H100 80GB HBM3", "7 GPUs found, a3-highgpu-8g has 8"),
    "ECC errors": (_ecc, "ecc", "2", "GPU 3 has 2 uncorrected ECC errors since the driver loaded"),
    "other driver": (_driver, "driver", "570.172.08", "driver 570.172.08, while 3 of 4 nodes have 580.159.04"),
}


@pytest.mark.parametrize("case", CASES)
def test_one_bad_node_exits_1_named_in_table_json_and_exclude_list(cluster, tmp_path, case):
    breaks, column, value, problem = CASES[case]
    bad = breaks(cluster)
    host = cluster.sim.addresses[bad]
    r = doctor(cluster, tmp_path)
    assert r.exit_code == 1, r.output
    assert f"node {bad} ({host}): {problem}" in r.output
    assert "1 of 4 nodes failed a check; leave them out with:" in r.output
    assert r.output.rstrip().splitlines()[-1] == f"--exclude {host}"
    j = doctor(cluster, tmp_path, "--json")
    assert j.exit_code == 1
    doc = json.loads(j.stdout)
    assert doc["healthy"] is False and doc["exclude"] == [host]
    cell = doc["nodes"][bad]["checks"][column]
    assert cell["status"] == "fail" and cell["value"] == value and any(problem in p for p in cell["problems"])
    assert all(n["status"] == "ok" for n in doc["nodes"] if n["rank"] != bad)
    if case == "missing GPU":  # once: the list it printed is what --exclude takes, and the rest are healthy
        again = doctor(cluster, tmp_path, "--exclude", host)
        assert again.exit_code == 0, again.output
        assert "all 3 nodes healthy" in again.output


def test_a_nic_down_no_rxdm_and_a_hardware_xid_each_fail_their_node(cluster, tmp_path):
    cluster.sim.exec(1, ["ip", "link", "set", "eth2", "down"])
    try:
        cluster.heal(2, FakeGpuNode(running_containers=()))
        cluster.heal(3, FakeGpuNode(xids=[("0000:08:00", 79)]))
        r = doctor(cluster, tmp_path)
    finally:
        cluster.sim.exec(1, ["ip", "link", "set", "eth2", "up"])
    hosts = cluster.sim.addresses
    assert r.exit_code == 1, r.output
    assert f"node 1 ({hosts[1]}): gpu NIC eth2 is down, not up" in r.output
    assert (
        f"node 2 ({hosts[2]}): receive-datapath-manager (RxDM) is not running (gpudirect-tcpx needs it; the "
        "startup script starts it: reboot the node, or run its startup script again)"
    ) in r.output
    assert f"node 3 ({hosts[3]}): XID 79 on GPU 0000:08:00 since boot (a hardware fault;" in r.output
    assert r.output.rstrip().splitlines()[-1] == f"--exclude {hosts[1]},{hosts[2]},{hosts[3]}"


def test_an_unreachable_node_is_named_and_excluded(cluster, tmp_path):
    cluster.sim.block(2)
    try:
        j = doctor(cluster, tmp_path, "--json", "--ssh-option", "ConnectTimeout=2")
    finally:
        cluster.sim.unblock(2)
    assert j.exit_code == 1, j.output
    doc = json.loads(j.stdout)
    assert doc["exclude"] == [cluster.sim.addresses[2]]
    node = doc["nodes"][2]
    assert node["reachable"] is False and node["status"] == "fail" and node["error"]
    assert [n["status"] for n in doc["nodes"]] == ["ok", "ok", "fail", "ok"]


def test_a_cluster_spread_over_two_blocks_is_warned_about(cluster, tmp_path):
    cluster.metadata[3].physical_host = "/clu/blk7/s1/h03"
    r = doctor(cluster, tmp_path)
    assert r.exit_code == 0, r.output
    assert (
        "warning: the nodes span 2 blocks (clu/blk1: 3 nodes, clu/blk7: 1 node); a compact placement keeps "
        "a cluster in one block, so if this cluster has one, the placement did not hold"
    ) in r.output
    assert "blk7/s1" in r.output


def test_given_rank_order_and_a_node_without_placement(cluster, tmp_path):
    r = doctor(cluster, tmp_path, "--rank-order", "given")
    assert "ranks in the given order (--rank-order given)" in r.output
    cluster.metadata[2].physical_host = None  # the metadata server answers 404: no placement policy
    r = doctor(cluster, tmp_path)
    assert r.exit_code == 0, r.output
    assert "ranks in the given order: 1 of 4 nodes have no physical host (from the metadata server)" in r.output


def _snapshot(paths: list[Path]) -> dict[str, tuple[int, int]]:
    out = {}
    for root in paths:
        for p in root.rglob("*"):
            if p.is_file() and p.name != "calls.log":
                st = p.stat()
                out[str(p)] = (st.st_mtime_ns, st.st_size)
    return out


def test_doctor_changes_nothing_on_a_node(cluster, tmp_path):
    roots = [cluster.root / f"node{i}" for i in range(N)] + [cluster.plugin]
    before = _snapshot(roots)
    links = [cluster.sim.exec(i, ["ip", "-o", "link"]).stdout for i in range(N)]
    r = doctor(cluster, tmp_path)
    assert r.exit_code == 0, r.output
    assert _snapshot(roots) == before
    assert [cluster.sim.exec(i, ["ip", "-o", "link"]).stdout for i in range(N)] == links
    for i in range(N):
        # Only queries reached nvidia-smi: the CSV query and the plain header.
        calls = (cluster.bin(i) / "calls.log").read_text().splitlines()
        assert sorted(set(calls)) == sorted({"", calls[0]}) and calls[0].startswith("--query-gpu=index,name,")
    cluster.sim.assert_nothing_left()


def test_the_installed_console_script_prints_json_only_on_stdout(cluster, tmp_path):
    _ecc(cluster)
    p = subprocess.run(
        [LAUNCH, "doctor", *cluster.args(tmp_path), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["exclude"] == [cluster.sim.addresses[2]]


def _run(c: GpuSimCluster, tmp_path: Path):
    """`launch run` of a one-line script on these nodes (the installed console script)."""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('ran on node', os.environ['GROUP_RANK'], flush=True)\n")
    args = [a for a in c.args(tmp_path) if a not in ("--min-free-gb", "0.01")]
    return subprocess.run(
        [LAUNCH, "run", *args, "--nproc-per-node", "1", "--", str(script)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_every_launch_checks_gpus_and_nics_first_a_missing_gpu_refuses_and_drift_warns(cluster, tmp_path):
    """The cheap part of doctor runs in every launch's check: a node short of a GPU is
    refused by name before anything starts; another driver on one node is a warning, and it runs."""
    ok = _run(cluster, tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert sorted(ln for ln in ok.stdout.splitlines() if "ran on node" in ln) == [
        f"[node {i}] ran on node {i}" for i in range(N)
    ]
    assert "GPU" not in ok.stderr and "driver" not in ok.stderr
    # Every node reports a physical_host: the launch runs in doctor's order, 0, 2, 1, 3.
    assert "started on 4 nodes; rank order: topology (1 block; 2 of 4 nodes moved)" in ok.stderr, ok.stderr

    _missing_gpu(cluster)
    refused = _run(cluster, tmp_path)
    assert refused.returncode == 2, refused.stderr
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")]
    assert f"node 2 ({cluster.sim.addresses[1]}): 7 GPUs found, a3-highgpu-8g has 8" in line  # rank 2 by topology
    assert "nothing was started" in line and "--exclude" in line
    assert "ran on node" not in refused.stdout
    cluster.heal(1)

    _driver(cluster)
    warned = _run(cluster, tmp_path)
    assert warned.returncode == 0, warned.stderr
    assert (
        f"node 3 ({cluster.sim.addresses[3]}): driver 570.172.08, while 3 of 4 nodes have 580.159.04" in warned.stderr
    )
    assert warned.stderr.index("driver 570.172.08") < warned.stderr.index("started on 4 nodes")
    cluster.sim.assert_nothing_left()


def test_hosts_shows_each_nodes_block_and_warns_when_the_cluster_spans_two(cluster, tmp_path):
    args = [a for a in cluster.args(tmp_path) if a not in ("--min-free-gb", "0.01")]
    args = [a for i, a in enumerate(args) if a != "--env" and (i == 0 or args[i - 1] != "--env")]
    ok = subprocess.run(
        [LAUNCH, "hosts", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("blk1/s1") == 2 and ok.stdout.count("blk1/s2") == 2, ok.stdout
    assert "span" not in ok.stderr
    cluster.metadata[3].physical_host = "/clu/blk7/s1/h03"
    spread = subprocess.run(
        [LAUNCH, "hosts", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert spread.returncode == 0, spread.stderr
    assert "blk7/s1" in spread.stdout
    assert "warning: the nodes span 2 blocks (clu/blk1: 3 nodes, clu/blk7: 1 node)" in spread.stderr
