"""`launch top`'s pure parts: the node program (run here by bash, with a stand-in nvidia-smi in
loop mode), reading its stream, rates from counters, NIC roles from the catalog, outliers, the
record's schema, the table and the plot. No network."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.cmd_top import render_table, top
from launcher.core.types import Cluster, Node
from launcher.observe.plot import plot_record, read_record
from launcher.observe.sampler import Counters, GpuReading, NodeStream, delta, node_program, parse_gpu_line
from launcher.observe.top import (
    GPU,
    HOST,
    OTHER,
    SCHEMA,
    NicRate,
    NodeRow,
    NodeStatus,
    Recorder,
    RolePlan,
    TopSampler,
    build_row,
    flag_outliers,
    nic_roles,
    role_plan,
    slowest,
    sparkline,
)

NODE = Node(0, "10.0.0.2", "10.0.0.2")


def _node(rank: int) -> Node:
    return Node(rank, f"10.0.0.{rank + 2}", f"10.0.0.{rank + 2}")


# ---- the node program, run by bash here ----------------------------------------------------

# nvidia-smi in loop mode as the real one behaves for `--query-gpu=... -lms N`: the asked fields
# of every GPU, one line each, then again every N ms until killed (nvidia-smi(1), "-lms").
FAKE_SMI_LOOP = r"""#!/bin/bash
q=; ms=
for a in "$@"; do case $a in --query-gpu=*) q=${a#--query-gpu=};; esac; done
while [ $# -gt 0 ]; do [ "$1" = -lms ] && ms=$2; shift; done
[ "$q" = "index,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu" ] || { echo "unexpected query $q" >&2; exit 2; }
while :; do
  for i in 0 1; do echo "$i, $((90 - 40 * i)), 1024, 81559, [N/A], $((40 + i))"; done
  [ -n "$ms" ] || exit 0
  sleep "$(awk -v m="$ms" 'BEGIN{print m/1000}')"
done
"""


def _run_program(interval: float, seconds: float, path_dir: Path | None = None) -> tuple[list[str], int, list[int]]:
    env = dict(os.environ)
    if path_dir is not None:
        env["PATH"] = f"{path_dir}:{env['PATH']}"
    else:  # no nvidia-smi anywhere on PATH
        env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
    p = subprocess.Popen(
        ["bash", "--norc", "--noprofile", "-c", node_program(interval)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    time.sleep(seconds)
    children = _children(p.pid)
    out, errs = p.communicate(timeout=10)  # closes stdin: what the launcher does to end the view
    assert errs == "", errs
    return out.splitlines(), p.returncode, children


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_node_program_streams_one_line_per_interval_and_ends_on_end_of_input():
    lines, rc, _ = _run_program(0.2, 1.1)
    assert rc == 0
    assert lines[0].startswith("H gpufleet-top 1 ")
    assert "P gpu none" in lines
    samples = [l for l in lines if l.startswith("S ")]
    assert 5 <= len(samples) <= 7, samples
    stream = NodeStream()
    counters = [c for c in (stream.feed(l) for l in lines) if c is not None]
    assert len(counters) == len(samples)
    assert all(c.gpus is None for c in counters)
    assert "lo" not in counters[0].nics and counters[0].nics  # this machine's interfaces, lo left out
    assert len(counters[0].cpu) == 8
    steps = [(b.t_us - a.t_us) / 1e6 for a, b in zip(counters, counters[1:])]
    assert all(0.15 < s < 0.35 for s in steps), steps  # the schedule does not drift by the work
    # The address this machine's loopback holds is reported with its interface.
    assert stream.hello.addresses.get("127.0.0.1") == "lo"


def test_node_program_reads_gpus_from_nvidia_smi_loop_and_stops_it(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI_LOOP)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    lines, rc, children = _run_program(0.2, 1.0, tmp_path)
    assert rc == 0 and "P gpu nvidia-smi" in lines
    stream = NodeStream()
    counters = [c for c in (stream.feed(l) for l in lines) if c is not None]
    last = counters[-1]
    assert last.gpus == (
        GpuReading(0, 90.0, 1024.0, 81559.0, None, 40.0),
        GpuReading(1, 50.0, 1024.0, 81559.0, None, 41.0),
    )
    assert stream.other == []
    # The nvidia-smi loop was the program's child, and ending the view ended it too.
    time.sleep(0.3)
    assert children and not any(_alive(c) for c in children), children


def test_node_program_is_valid_bash_and_refuses_silly_intervals():
    r = subprocess.run(["bash", "-n"], input=node_program(1.0), text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    for bad in (0.0, 0.01, 7200):
        with pytest.raises(ValueError, match="interval"):
            node_program(bad)


# ---- reading the stream --------------------------------------------------------------------


def test_stream_reads_hello_samples_gpus_and_keeps_what_is_not_ours():
    s = NodeStream()
    for line in [
        "Welcome to node 3",
        "H gpufleet-top 1 a3-node-3",
        "A eth0 10.0.0.5",
        "A lo 127.0.0.1",
        "R eth0",
        "P gpu nvidia-smi",
        "0, 97, 70000, 81559, 690.50, 65",
        "1, [N/A], 70000, 81559, 700.1, 66",
    ]:
        assert s.feed(line) is None
    c = s.feed("S 1700000000000000 c 10 0 5 80 5 0 0 0 n eth0 1000 2000 n eth1 5 6 i mlx5_0/1 100 200\n")
    assert s.hello.hostname == "a3-node-3" and s.hello.addresses == {"10.0.0.5": "eth0", "127.0.0.1": "lo"}
    assert s.hello.default_iface == "eth0"
    assert s.other == ["Welcome to node 3"]
    assert c.t_us == 1700000000000000 and c.cpu == (10, 0, 5, 80, 5, 0, 0, 0)
    assert c.nics == {"eth0": (1000, 2000), "eth1": (5, 6)}
    assert c.ib == {"mlx5_0/1": (400, 800)}  # port_*_data counts 4-octet units
    assert [g.util_pct for g in c.gpus] == [97.0, None] and c.gpus[0].power_w == 690.5


def test_a_garbled_sample_line_is_kept_aside_not_raised():
    s = NodeStream()
    assert s.feed("S 17 c 1 2 n eth0 notanumber 3") is None
    assert s.other == ["S 17 c 1 2 n eth0 notanumber 3"]


def test_gpu_lines_that_are_not_the_query_are_not_readings():
    assert parse_gpu_line("0, 97, 70000, 81559, 690.50, 65") == GpuReading(0, 97, 70000, 81559, 690.5, 65)
    assert parse_gpu_line("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.") is None
    assert parse_gpu_line("0, 97, 70000") is None
    assert parse_gpu_line("0, x, 1, 2, 3, 4") is None


# ---- rates -----------------------------------------------------------------------------------


def _c(t_s: float, cpu=(100, 0, 0, 900, 0, 0, 0, 0), **nics) -> Counters:
    return Counters(int(t_s * 1e6), tuple(cpu), {k: v for k, v in nics.items()})


def test_the_first_sample_has_no_rates_and_the_second_has_gbps_and_cpu():
    a = _c(100.0, eth0=(0, 0))
    b = _c(102.0, cpu=(150, 0, 50, 1000, 0, 0, 0, 0), eth0=(250_000_000, 125_000_000), eth1=(1, 1))
    assert delta(None, a) is None
    d = delta(a, b)
    assert d.dt_s == pytest.approx(2.0)
    assert d.nic_gbps == {"eth0": (pytest.approx(1.0), pytest.approx(0.5))}  # eth1 is new: no rate yet
    assert d.cpu_util_pct == pytest.approx(50.0)  # 100 busy jiffies of 200


def test_a_counter_that_went_backwards_is_a_reset_not_a_negative_rate():
    a = _c(0.0, eth0=(10_000_000_000, 500))
    b = _c(1.0, eth0=(125_000_000, 1000))
    d = delta(a, b)
    assert d.nic_gbps["eth0"] == (pytest.approx(1.0), pytest.approx(4000 / 1e9))
    assert d.resets == ("eth0",)


def test_no_rate_when_the_node_clock_did_not_move_forward():
    assert delta(_c(5.0, eth0=(0, 0)), _c(5.0, eth0=(9, 9))) is None
    assert delta(_c(5.0, eth0=(0, 0)), _c(4.0, eth0=(9, 9))) is None


# ---- NIC roles -------------------------------------------------------------------------------


def test_roles_come_from_the_catalog_for_the_machine_type_and_image():
    cos = role_plan("a3-highgpu-8g")  # COS by default: eth0 host, eth1..eth4 GPU NICs
    roles = nic_roles(cos, ["eth0", "eth1", "eth4", "docker0"], [], "10.0.0.2", {}, None)
    assert roles == {"eth0": HOST, "eth1": GPU, "eth4": GPU, "docker0": OTHER}
    mega = role_plan("a3-megagpu-8g", "ubuntu")
    roles = nic_roles(mega, ["enp0s12", "enp6s0", "enp142s0", "eth1"], [], "10.0.0.2", {}, None)
    assert roles == {"enp0s12": HOST, "enp6s0": GPU, "enp142s0": GPU, "eth1": OTHER}


def test_rdma_types_count_the_infiniband_ports_as_gpu_nics():
    plan = role_plan("a3-ultragpu-8g")
    roles = nic_roles(plan, ["enp0s19", "enp192s20", "enp8s0"], ["mlx5_0/1"], "10.0.0.2", {}, None)
    assert roles == {"enp0s19": HOST, "enp192s20": HOST, "enp8s0": OTHER, "ib:mlx5_0/1": GPU}


def test_without_a_machine_type_the_host_nic_holds_the_nodes_address():
    roles = nic_roles(
        RolePlan(), ["ens4", "ens5"], ["mlx5_0/1"], "10.1.0.7", {"10.1.0.7": "ens5", "10.2.0.7": "ens4"}, "ens4"
    )
    assert roles == {"ens4": OTHER, "ens5": HOST, "ib:mlx5_0/1": OTHER}
    # Reached by a name or a NAT address the node does not hold: the default route's interface.
    roles = nic_roles(RolePlan(), ["ens4", "ens5"], [], "node-7.example", {"10.1.0.7": "ens5"}, "ens4")
    assert roles == {"ens4": HOST, "ens5": OTHER}
    # A single-NIC Ubuntu type: the catalog cannot name it, so the address decides.
    roles = nic_roles(role_plan("a2-highgpu-1g"), ["ens12"], [], "10.1.0.7", {"10.1.0.7": "ens12"}, None)
    assert roles == {"ens12": HOST}


def test_an_unknown_machine_type_is_the_catalogs_error():
    with pytest.raises(KeyError, match="a3-mega' is unknown"):
        role_plan("a3-mega")


# ---- rows, outliers, highlights ----------------------------------------------------------------


def _row(rank: int, gbps: float | None, status=NodeStatus.OK, **kw) -> NodeRow:
    r = NodeRow(_node(rank), status, interval_s=1.0, **kw)
    if gbps is not None:
        r.nics = [NicRate("eth0", HOST, gbps / 2, gbps / 2)]
        r.host_rx = r.host_tx = gbps / 2
    return r


def test_build_row_sums_gpu_nics_keeps_the_slowest_and_summarises_gpus():
    gpus = (GpuReading(0, 90, 1000, 80000, 700, 60), GpuReading(1, 30, 3000, 80000, 300, 75))
    a = Counters(0, (0,) * 8, {"eth0": (0, 0), "eth1": (0, 0), "eth2": (0, 0)}, {}, gpus)
    b = Counters(
        1_000_000,
        (0,) * 8,
        {"eth0": (125_000_000, 0), "eth1": (1_250_000_000, 250_000_000), "eth2": (250_000_000, 1_250_000_000)},
        {},
        gpus,
    )
    roles = {"eth0": HOST, "eth1": GPU, "eth2": GPU}
    row = build_row(NODE, b, delta(a, b), roles, received=5.0)
    assert (row.host_rx, row.host_tx) == (pytest.approx(1.0), 0.0)
    assert (row.gpu_rx, row.gpu_tx) == (pytest.approx(12.0), pytest.approx(12.0))
    assert (row.gpu_slowest_rx, row.gpu_slowest_tx) == (pytest.approx(2.0), pytest.approx(2.0))
    assert row.data_gbps == pytest.approx(24.0)  # GPU NICs only: the host NIC is not data here
    assert (row.gpu_util_mean, row.gpu_util_min, row.gpu_temp_c) == (60, 30, 75)
    assert (row.gpu_mem_used_mib, row.gpu_power_w, row.gpu_count) == (4000, 1000, 2)
    first = build_row(NODE, a, None, roles, received=4.0)
    assert first.interval_s is None and first.host_rx is None and first.data_gbps is None


def test_a_node_under_half_the_median_is_flagged_and_an_idle_cluster_is_not():
    rows = [_row(0, 9.0), _row(1, 10.0), _row(2, 4.0), _row(3, 11.0)]
    assert flag_outliers(rows) == {2}
    rows = [_row(0, 9.0), _row(1, 10.0), _row(2, 5.0), _row(3, 11.0)]
    assert flag_outliers(rows) == set()  # 5.0 is not under half of 9.5
    # SSH and this view's own stream only: nothing to compare.
    assert flag_outliers([_row(0, 0.002), _row(1, 0.0000001)]) == set()
    # Unreachable nodes are neither judged nor part of the median.
    rows = [_row(0, 10.0), _row(1, 10.0), _row(2, None, NodeStatus.UNREACHABLE), _row(3, 1.0)]
    assert flag_outliers(rows) == {3}


def test_slowest_is_the_low_end_for_traffic_and_util_and_the_high_end_for_heat():
    rows = [
        _row(0, 8.0, gpu_temp_c=60.0, gpu_util_mean=90.0),
        _row(1, 6.0, gpu_temp_c=80.0, gpu_util_mean=95.0),
        _row(2, 7.0, gpu_temp_c=70.0, gpu_util_mean=40.0),
    ]
    assert slowest(rows, "host_rx") == 1
    assert slowest(rows, "gpu_temp_c") == 1
    assert slowest(rows, "gpu_util_mean") == 2
    assert slowest([_row(0, 1.0), _row(1, 1.0)], "host_rx") is None  # all alike: nobody to single out
    assert slowest(rows, "gpu_power_w") is None  # nobody reports it


def test_sparkline_scales_every_node_to_the_same_top():
    assert sparkline([0.0, 5.0, 10.0, None], 10.0) == "▁▅█ "
    assert sparkline([1.0, 1.0], 0.0) == "▁▁"


# ---- the record ------------------------------------------------------------------------------


RECORD_KEYS = {
    "schema",
    "session",
    "node",
    "host",
    "name",
    "status",
    "error",
    "t",
    "received",
    "interval_s",
    "cpu_util_pct",
    "gpu",
    "host_rx_gbps",
    "host_tx_gbps",
    "gpu_nic_rx_gbps",
    "gpu_nic_tx_gbps",
    "gpu_nic_slowest_rx_gbps",
    "gpu_nic_slowest_tx_gbps",
    "data_gbps",
    "nics",
    "counter_resets",
    "flagged",
}


def test_the_recorder_appends_one_json_object_per_row_in_the_documented_schema(tmp_path):
    path = tmp_path / "top.jsonl"
    path.write_text('{"earlier": "view"}\n')
    rec = Recorder(path, "s1")
    rec.write(_row(0, 2.0, cpu_util_pct=12.5))
    rec.write(NodeRow(_node(1), NodeStatus.UNREACHABLE, error="Connection refused", received=3.0))
    rec.close()
    lines = path.read_text().splitlines()
    assert lines[0] == '{"earlier": "view"}'  # nothing already written is lost
    a, b = (json.loads(l) for l in lines[1:])
    assert set(a) == RECORD_KEYS and set(b) == RECORD_KEYS
    assert a["schema"] == SCHEMA and a["session"] == "s1" and a["status"] == "ok"
    assert a["data_gbps"] == 2.0 and a["nics"] == [{"name": "eth0", "role": "host", "rx_gbps": 1.0, "tx_gbps": 1.0}]
    assert a["gpu"] is None and a["cpu_util_pct"] == 12.5
    assert (b["status"], b["error"], b["data_gbps"]) == ("unreachable", "Connection refused", None)


# ---- the table and the plot --------------------------------------------------------------------


def _text(table) -> str:
    from rich.console import Console

    c = Console(width=250, record=True, file=open(os.devnull, "w"))
    c.print(table)
    return c.export_text()


def test_the_table_flags_names_unreachable_nodes_and_says_n_a_without_gpus():
    rows = [_row(0, 10.0), _row(1, 1.0), NodeRow(_node(2), NodeStatus.UNREACHABLE, error="Connection refused")]
    rows[1].flagged = True
    text = _text(render_table(rows, {0: [10.0, 10.0], 1: [1.0, 1.0], 2: []}, "t"))
    lines = {l.split("│")[0].strip(): l for l in text.splitlines() if l.count("│") > 3}
    assert "⚑ slow data NICs" in lines["1"] and "⚑" not in lines["0"]
    assert "unreachable: Connection refused" in lines["2"]
    assert "n/a" in lines["0"] and "5.00" in lines["0"] and "0.50" in lines["1"]


def _record_file(tmp_path: Path) -> Path:
    path = tmp_path / "top.jsonl"
    rec = Recorder(path, "s")
    for k in range(5):
        for rank, gbps in ((0, 10.0), (1, 2.0)):
            r = _row(rank, gbps)
            r.received, r.flagged = 100.0 + k, rank == 1
            rec.write(r)
    rec.write(NodeRow(_node(1), NodeStatus.UNREACHABLE, error="gone", received=106.0))
    rec.close()
    with open(path, "a") as f:
        f.write('{"schema": "gpufleet.top/1", "node": 0, "hos')  # a view killed mid-line
    return path


def test_plot_writes_a_png_of_a_record_and_skips_a_torn_last_line(tmp_path):
    path = _record_file(tmp_path)
    assert len(read_record(path)) == 11
    out = plot_record(path)
    assert out == tmp_path / "top.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_launch_top_plot_through_the_cli_and_its_one_line_errors(tmp_path):
    path = _record_file(tmp_path)
    r = CliRunner().invoke(top, ["--plot", str(path), "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "x.png").stat().st_size > 10_000
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    for args, needle in (
        (["--plot", str(empty)], "no `gpufleet.top/1` samples"),
        (["--plot", str(tmp_path / "missing.jsonl")], "cannot read it"),
        (["--plot", str(path), "--hostfile", str(path)], "--plot draws a record and connects to nothing"),
        (["--local", "--nodes", "1", "--interval", "0"], "--interval 0 is outside"),
        (["--local", "--nodes", "1", "--duration", "-1"], "--duration -1 must be more than 0"),
        (["--local", "--nodes", "1", "--record", str(tmp_path / "no" / "dir.jsonl")], "does not exist"),
    ):
        r = CliRunner().invoke(top, args)
        assert r.exit_code == 2, (args, r.output)
        assert needle in r.output, (args, r.output)


def test_dry_run_prints_each_nodes_program_and_connects_to_nothing(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.9.9.2\n10.9.9.3\n")
    r = CliRunner().invoke(top, ["--hostfile", str(hostfile), "--dry-run", "--interval", "2"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert [l.split("\t")[0] for l in lines] == ["10.9.9.2", "10.9.9.3"]
    assert "exec bash --norc --noprofile -c" in lines[0] and "gpufleet-top" in lines[0]
    assert "next + 2000000" in lines[0]  # the 2 s schedule, in microseconds


def test_the_sampler_follows_a_swap_a_new_nodes_session_starts_and_the_lost_ones_ends():
    # Each "node" runs the real node program here, with bash (no ssh): what a swap changes is
    # which sessions the view holds, not how a node is reached.
    a, b, spare = Node(0, "a", "a"), Node(1, "b", "b"), Node(5, "s", "s")
    sampler = TopSampler(Cluster("sim", (a, b)), lambda node, script: ["bash", "-c", script], interval_s=0.2)

    def seen(hosts: list[str]) -> bool:
        deadline = time.monotonic() + 30  # pytest's timeout bounds a view that never answers
        while time.monotonic() < deadline:
            rows = sampler.rows()
            if [r.node.host for r in rows] == hosts and all(r.status is NodeStatus.OK for r in rows):
                return True
            time.sleep(0.05)
        return False

    try:
        sampler.start()
        assert seen(["a", "b"])
        lost = sampler.pids()[1]
        added, left = sampler.follow([a, replace(spare, rank=1)])
        assert [n.host for n in added] == ["s"] and [n.host for n in left] == ["b"]
        assert seen(["a", "s"]) and [r.node.rank for r in sampler.rows()] == [0, 1]
        # The lost node's session ended and no other started for it; node a kept its own.
        assert lost not in sampler.pids().values()
        deadline = time.monotonic() + 10
        while _alive(lost) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(lost)
        assert sampler.follow([a, replace(spare, rank=1)]) == ([], [])
    finally:
        sampler.stop()
