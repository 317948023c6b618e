"""launcher.core.node_start, a node's part of a launch up to its run, run as a node runs it (the
system python3, isolated, nothing of gpufleet on its path) against the stand-ins of a GPU node
(tests/launcher/fake_gpu_node.py): its check lines are what the launcher's pre-start verdict reads,
the names it repeats are the launcher's, and it travels in one source with launcher.core.node_run
without either shadowing the other."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from gpufleet.contracts import LAUNCHER_ERROR_PREFIX, LOCAL_SSD_MOUNT, READY_MARKER
from gpufleet.health import GPU_QUERY_FIELDS
from gpufleet.node_plan import CheckKind
from launcher.core import node_local, node_run, node_start, supervise
from launcher.core.hang import FR_ALIASES
from launcher.core.holds import FILE_PREFIX, HOLDS_DIRS
from launcher.core.program import ProgramBuilder
from launcher.core.types import Cluster, LaunchConfig, Node, UserError, Workload
from launcher.core.wire import CHECKED_MARKER, GO, RUN_VAR
from launcher.health import prestart_verdict
from tests.launcher.fake_gpu_node import FakeGpuNode

SOURCE = Path(node_start.__file__).read_text()
CLUSTER = Cluster("t", (Node(0, "10.0.0.2", "10.0.0.2"),), machine_type="a3-highgpu-8g")
CONFIG = LaunchConfig(Workload("torchrun", ("x.py",)), job_id="20260101-000000-abcdef")


def test_the_node_side_names_are_the_launchers():
    assert (node_start.CHECKED_MARKER, node_start.GO) == (CHECKED_MARKER, (GO + "\n").encode())
    assert (node_start.RUN_VAR, node_start.ERROR_PREFIX) == (RUN_VAR, LAUNCHER_ERROR_PREFIX)
    assert (node_start.READY_MARKER, node_start.HOLDS_DIRS, node_start.HOLD_PREFIX) == (
        READY_MARKER,
        HOLDS_DIRS,
        FILE_PREFIX,
    )
    assert node_start.GPU_QUERY == ",".join(GPU_QUERY_FIELDS)
    assert set(node_start.LOCAL_SSD_MOUNTS) == set(LOCAL_SSD_MOUNT.values())
    assert (node_start.LOCAL_DIR_VAR, node_start.LOCAL_CHECKPOINT_VAR) == (
        node_local.LOCAL_DIR_VAR,
        node_local.LOCAL_CHECKPOINT_VAR,
    )
    assert dict(node_start.COMPILE_CACHES) == node_local.COMPILE_CACHE_VARS
    assert dict(node_start.FR_ALIASES) == FR_ALIASES
    assert node_run.NODE_RUNS_DIR == supervise.NODE_RUNS_DIR and node_run.LOCK_FD == node_start.LOCK_FD == 9


def _top_level(path: str) -> dict[str, ast.stmt]:
    out = {}
    for n in ast.parse(Path(path).read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, ast.Assign):
            out.update((t.id, n) for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update(((a.asname or a.name).split(".")[0], n) for a in n.names)
    return out


def test_in_the_one_source_that_travels_neither_module_shadows_a_name_of_the_other():
    """node_start's code comes first, node_run's after it (launcher.core.program): a name both
    define would be node_run's in node_start's functions too. Only the same modules, the names
    node_run takes from node_start, and constants of equal value may be in both."""
    start, run = _top_level(node_start.__file__), _top_level(node_run.__file__)
    for name in start.keys() & run.keys():
        a, b = start[name], run[name]
        if isinstance(b, ast.ImportFrom) and b.module == "launcher.core.node_start":
            continue
        if isinstance(a, ast.Import) and isinstance(b, ast.Import):
            continue
        assert isinstance(a, ast.Assign) and isinstance(b, ast.Assign), name
        assert getattr(node_start, name) == getattr(node_run, name), name


def _checks(plan: dict, env: dict[str, str]) -> dict[str, str]:
    """The node's check lines (Start.checks, in a python3 of its own) as the launcher reads them."""
    driver = "\nimport json, sys\nStart(json.loads(sys.argv[1]), None).checks()\n"
    out = subprocess.run(
        ["python3", "-I", "-S", "-c", SOURCE + driver, json.dumps(plan)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


class _Probe:
    def __init__(self, node: Node, facts: dict[str, str]):
        self.node, self.facts, self.ok = node, facts, True


def test_the_hardware_check_answers_what_the_pre_start_verdict_reads(tmp_path):
    plan = ProgramBuilder(CLUSTER, CONFIG).plans()[0].to_dict()
    kinds = [c["kind"] for c in plan["checks"]]
    assert {CheckKind.GPUS.value, CheckKind.NIC.value, CheckKind.RXDM.value} <= set(kinds)
    fake = FakeGpuNode().write(tmp_path / "bin")
    facts = _checks(plan, {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert facts["smi_rc"] == "0" and len([k for k in facts if k.startswith("gpu.")]) == 8
    assert facts["rxdm_rc"] == "0" and facts["rxdm"]  # the fake docker's container id
    assert (tmp_path / "bin" / "calls.log").read_text().startswith("--query-gpu=" + ",".join(GPU_QUERY_FIELDS))
    # This machine has no eth0..eth4 of an A3's: the NICs as a healthy A3 answers them.
    nics = {f"nic.eth{i}": "up 8244 0x1003" for i in range(5)}
    assert prestart_verdict(CLUSTER, {0: _Probe(CLUSTER.nodes[0], {**facts, **nics})}, CONFIG) == []
    # The same node without nvidia-smi or docker: refused, naming what is missing.
    bare = _checks(plan, {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert (bare["smi_rc"], bare["rxdm_rc"]) == ("127", "127")
    with pytest.raises(UserError, match="nvidia-smi is not installed; a3-highgpu-8g has 8 GPUs"):
        prestart_verdict(CLUSTER, {0: _Probe(CLUSTER.nodes[0], {**bare, **nics})}, CONFIG)


def test_a_nic_is_read_from_sys_class_net_and_one_that_is_not_there_is_missing():
    sysfs = Path("/sys/class/net/lo")
    want = " ".join((sysfs / f).read_text().strip() for f in ("operstate", "mtu", "flags"))
    assert node_start.nic_line("lo") == f"nic.lo={want}"
    assert node_start.nic_line("nosuchnic0") == "nic.nosuchnic0=missing"


def test_the_host_nic_is_the_one_holding_the_nodes_address_else_the_route_to_node_0s():
    assert node_start.host_iface("127.0.0.1", "127.0.0.1") == "lo"
    assert node_start.host_iface("192.0.2.99", "127.0.0.1") == "lo"  # not here: the route's


def test_a_value_from_stdin_is_decoded_byte_for_byte_and_a_missing_one_ends_before_anything():
    from launcher.core.wire import env_block

    value = "a\\nb \\\\ c\nd $(x) 'q'"
    plan = {"env": [{"name": "K", "value": None, "source": "stdin", "prepend": False}]}
    driver = "\nimport json, sys\nStart(json.loads(sys.argv[1]), sys.stdin.buffer).environment()\n"
    driver += "print(repr(os.environ['K']))\n"
    argv = ["python3", "-I", "-S", "-c", SOURCE + driver, json.dumps(plan)]
    out = subprocess.run(argv, input=env_block([("K", value)]), capture_output=True, timeout=60, env={})
    assert ast.literal_eval(out.stdout.decode()) == value
    ended = subprocess.run(argv, input=b"", capture_output=True, timeout=60, env={})
    assert ended.returncode != 0 and b"Ended: 0" in ended.stderr and not ended.stdout  # node_run exits 0 on it


def test_the_rendezvous_port_lock_is_private_and_a_second_holder_is_told_whose_it_is(tmp_path):
    def holder(job: str) -> list[str]:
        driver = f"\nStart({{'address': '10.9.9.9', 'job_id': '{job}'}}, None).lock_port(29555)\nsys.stdin.read()\n"
        return ["python3", "-I", "-S", "-c", SOURCE + "\nimport sys" + driver]

    env = {"HOME": str(tmp_path)}
    first = subprocess.Popen(holder("first"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert first.stdout.readline() == "port=free\n"
        lock = tmp_path / ".gpufleet" / "rdzv-10.9.9.9-29555.lock"
        assert lock.stat().st_mode & 0o777 == 0o600 and (tmp_path / ".gpufleet").stat().st_mode & 0o777 == 0o700
        r = subprocess.run(holder("second"), capture_output=True, text=True, env=env, timeout=60)
        assert r.stdout.splitlines() == ["port=busy:first", CHECKED_MARKER] and "Ended: 75" in r.stderr
    finally:
        first.stdin.close()
        first.wait(timeout=60)
    # Its holder gone, the port is free again.
    again = subprocess.run(holder("third"), input="", capture_output=True, text=True, env=env, timeout=60)
    assert again.stdout == "port=free\n"


def test_where_the_vm_sits_is_asked_of_its_metadata_server_as_the_rank_order_reads_it(tmp_path):
    from launcher.cluster.topology import node_physical_hosts
    from tests.launcher.fake_gpu_node import FakeMetadata

    spec = json.dumps({"checks": [{"kind": CheckKind.PHYSICAL_HOST.value, "target": ""}]})
    driver = "\nimport json, sys\nStart(json.loads(sys.argv[1]), None).checks()\n"

    def ask(host: str) -> dict[str, str]:
        argv = ["python3", "-I", "-S", "-c", SOURCE + driver, spec]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"GCE_METADATA_HOST": host})
        return dict(line.split("=", 1) for line in out.stdout.splitlines())

    placed, bare = FakeMetadata("/c1/b2/s3/h4", bind="127.0.0.1"), FakeMetadata(None, bind="127.0.0.1")
    try:
        facts = ask(placed.host)
        assert facts == {"metadata_rc": "0", "physical_host": "/c1/b2/s3/h4"}
        place = node_physical_hosts(CLUSTER, {0: facts})["10.0.0.2"]
        assert place is not None and (place.block, place.subblock, place.host) == ("b2", "s3", "h4")
        assert ask(bare.host) == {"metadata_rc": "22", "physical_host": ""}  # a VM without a placement
    finally:
        placed.close()
        bare.close()
    assert ask("127.0.0.1:9")["metadata_rc"] not in ("0", "22")  # no metadata server: not on GCE


def test_a_spot_vm_says_so_from_its_metadata_server_and_a_machine_without_one_is_unknown():
    from tests.launcher.fake_gpu_node import FakeMetadata

    spec = json.dumps({"checks": [{"kind": CheckKind.PREEMPTIBLE.value, "target": ""}]})
    driver = "\nimport json, sys\nStart(json.loads(sys.argv[1]), None).checks()\n"

    def ask(host: str) -> str:
        argv = ["python3", "-I", "-S", "-c", SOURCE + driver, spec]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"GCE_METADATA_HOST": host}).stdout

    spot, standard = FakeMetadata(None, bind="127.0.0.1", spot=True), FakeMetadata(None, bind="127.0.0.1")
    try:
        assert (ask(spot.host), ask(standard.host)) == ("preemptible=TRUE\n", "preemptible=FALSE\n")
    finally:
        spot.close()
        standard.close()
    assert ask("127.0.0.1:9") == "preemptible=unknown\n"


def test_a_home_that_cannot_take_the_port_lock_is_one_line_naming_the_node_not_a_traceback(tmp_path):
    (tmp_path / ".gpufleet").write_text("a file where the directory goes")
    driver = (
        "\nimport sys\ntry:\n    Start({'address': '10.9.9.9', 'host': 'n7', 'job_id': 'j'}, None).lock_port(29555)\n"
    )
    driver += "except Ended as e:\n    sys.exit(e.rc)\n"
    r = subprocess.run(
        ["python3", "-I", "-S", "-c", SOURCE + driver],
        capture_output=True,
        text=True,
        env={"HOME": str(tmp_path)},
        timeout=60,
    )
    (line,) = r.stderr.splitlines()
    assert r.returncode == 70 and r.stdout == ""  # the launcher names the node with its last error line
    assert line.startswith("gpufleet: cannot take the rendezvous port's lock ") and " on n7: " in line
