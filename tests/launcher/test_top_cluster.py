"""`launch top` as a user runs it: the installed console script against real sshd nodes (and
once against `--local` process nodes), traffic from a real gloo job, a `tc` throttle, a node
whose sshd dies, and Ctrl-C (SIGINT to the launch process)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli.cmd_top import top
from tests.support import LAUNCH, REPO, Launch, source_args, torch_args, wait_for

PAIRS = str(Path(__file__).with_name("top_pairs_script.py"))


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # the line being written right now
    return out


def _rated(recs: list[dict], node: int, after: float = 0.0) -> list[dict]:
    """Samples of `node` with rates (its second sample on), received after `after`."""
    return [
        r
        for r in recs
        if r["node"] == node and r["status"] == "ok" and r["interval_s"] is not None and r["received"] > after
    ]


def _frames(out: str) -> list[str]:
    """The tables `launch top` printed into a file, one per refresh (batch mode)."""
    return [f for f in out.split("launch top: ")[1:]]


def _row(frame: str, rank: int) -> str:
    for line in frame.splitlines():
        cells = line.split("│")
        if len(cells) > 3 and cells[0].strip() == str(rank):
            return line
    return ""


def test_launch_top_local_records_every_node_and_stops_at_duration(tmp_path):
    rec = tmp_path / "top.jsonl"
    t0 = time.time()
    r = CliRunner().invoke(
        top, ["--local", "--nodes", "2", "--interval", "0.5", "--duration", "2.6", "--record", str(rec)]
    )
    assert r.exit_code == 0, r.output
    assert time.time() - t0 < 60  # it stopped at --duration instead of running on (a hang catch)
    recs = _records(rec)
    assert {x["node"] for x in recs} == {0, 1}
    assert len(_rated(recs, 0)) >= 2 and len(_rated(recs, 1)) >= 2
    assert all(x["interval_s"] == pytest.approx(0.5, abs=0.15) for x in _rated(recs, 0))
    assert "5 refreshes" in r.output and "2/2 nodes answering" in r.output


@pytest.mark.slow
def test_a_sweep_shows_on_its_nodes_the_idle_node_shows_none_and_a_throttled_node_is_flagged(sim_cluster, tmp_path):
    c = sim_cluster(4)
    c.throttle(2, "20mbit")
    rec = tmp_path / "top.jsonl"
    view = Launch(["top", *source_args(c, tmp_path), "--record", str(rec)], tmp_path / "top.out")
    try:
        wait_for(lambda: all(_rated(_records(rec), n) for n in range(4)), 60, "a rated sample from every node", view)
        # The sweep: nodes 0-2 run pairwise gloo all_reduce loops; node 3 runs nothing.
        three = tmp_path / "hosts3"
        three.write_text("".join(f"{a}\n" for a in c.addresses[:3]))
        run = subprocess.run(
            [LAUNCH, "run", *source_args(c, tmp_path, three), *torch_args(1), "--", PAIRS, "12"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert run.stdout.count("pairs done") == 3
        time.sleep(1.5)
        view.signal(signal.SIGINT)
        assert view.wait(30) == 0, view.out
    finally:
        view.kill()
    c.assert_nothing_left()

    recs = _records(rec)
    assert recs and all(r["schema"] == "gpufleet.top/1" for r in recs)
    busy = [r["received"] for r in _rated(recs, 0) if r["data_gbps"] >= 0.1]
    assert len(busy) >= 5, [r["data_gbps"] for r in _rated(recs, 0)]
    lo, hi = min(busy) + 1.5, max(busy) - 1.5
    during = {n: [r for r in _rated(recs, n) if lo < r["received"] < hi] for n in range(4)}
    assert all(during.values()), {n: len(v) for n, v in during.items()}
    fast = {n: statistics.median(r["data_gbps"] for r in during[n]) for n in (0, 1)}
    assert min(fast.values()) >= 0.1, fast  # the sweep's nodes show traffic
    slow = statistics.median(r["data_gbps"] for r in during[2])
    assert 0.003 < slow < 0.05, slow  # traffic, at most the 20 Mbit/s each way the throttle allows
    assert sum(r["flagged"] for r in during[2]) >= 0.8 * len(during[2])
    assert sum(r["flagged"] for r in during[0] + during[1]) <= 0.2 * len(during[0] + during[1])
    # The idle node moved only this view's own stream (a few kbit/s), before, during and after.
    assert max(r["data_gbps"] for r in _rated(recs, 3)) < 0.001
    host = {n: c.addresses[n] for n in range(4)}
    assert {r["host"] for r in recs if r["node"] == 2} == {host[2]}
    assert all(x["role"] == "host" and x["name"] == "eth0" for r in _rated(recs, 1) for x in r["nics"])
    # The table said so too: a frame during the sweep flags node 2 and shows node 0's traffic.
    flagged = [f for f in _frames(view.out) if "⚑" in _row(f, 2)]
    assert flagged, view.out[-3000:]
    assert "n/a" in _row(flagged[0], 0)  # no GPU here: the GPU columns say so

    png = tmp_path / "top.png"
    p = subprocess.run([LAUNCH, "top", "--plot", str(rec)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000


@pytest.mark.slow
def test_a_node_whose_sshd_dies_is_shown_unreachable_and_the_others_keep_updating(sim_cluster, tmp_path):
    c = sim_cluster(3)
    rec = tmp_path / "top.jsonl"
    view = Launch(["top", *source_args(c, tmp_path), "--interval", "0.5", "--record", str(rec)], tmp_path / "top.out")
    try:
        wait_for(lambda: all(len(_rated(_records(rec), n)) >= 2 for n in range(3)), 60, "samples from every node", view)
        assert c.processes(1), "node 1's sampler should be running"
        # sshd dies: every session (and what it runs), then the listener, so no retry gets in.
        c.kill_sessions(1)
        os.kill(c.nodes[1].sshd.pid, signal.SIGKILL)
        wait_for(
            lambda: any(r["node"] == 1 and r["status"] == "unreachable" for r in _records(rec)),
            30,
            "node 1 recorded unreachable",
            view,
        )
        dead_at = next(r["received"] for r in _records(rec) if r["node"] == 1 and r["status"] == "unreachable")
        wait_for(
            lambda: all(len(_rated(_records(rec), n, dead_at)) >= 6 for n in (0, 2)),
            30,
            "nodes 0 and 2 still sampled after node 1 died",
            view,
        )
        # The view redraws with node 1 unreachable (it retries, and sshd is still dead).
        wait_for(lambda: "unreachable:" in _row(_frames(view.out)[-1], 1), 15, "node 1 shown unreachable", view)
        last = _frames(view.out)[-1]
        assert "unreachable:" not in _row(last, 0) and "unreachable:" not in _row(last, 2)
        view.signal(signal.SIGINT)
        assert view.wait(30) == 0, view.out
    finally:
        view.kill()
    c.assert_nothing_left()
    assert not any(r["node"] == 1 and r["status"] == "ok" and r["received"] > dead_at for r in _records(rec))
    assert "2/3 nodes answering at the end" in view.out
