"""The bad-node finder end to end: 4 simulated nodes (network namespaces), one link throttled with
tc, real 2-node gloo sweeps over every pair in disjoint rounds, then rank_nodes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher import nccl_report as rep

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PORT = 29400  # each node has its own network namespace, so a fixed port never collides


def _pair_sweep_cmds(cluster, a: int, b: int) -> list[list[str]]:
    endpoint = f"{cluster.nodes[a].address}:{PORT}"
    cmds = []
    for rank, i in enumerate((a, b)):
        cmds.append([
            "ip", "netns", "exec", cluster.nodes[i].netns,
            "env", "OMP_NUM_THREADS=1", "GLOO_SOCKET_IFNAME=eth0", "PYTHONWARNINGS=ignore",
            TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"pair{a}{b}",
            # Every namespace shares one hostname, so torchrun cannot tell by name which agent
            # hosts the rendezvous, nor which address the workers should use: say both.
            "--rdzv-conf", f"is_host={1 if rank == 0 else 0}", "--local-addr", cluster.nodes[i].address,
            "--max-restarts", "0", "-m", "workloads.sweep",
            "--ops", "all_reduce", "-b", "512K", "-e", "512K", "-n", "5", "-w", "1", "-c", "1",
        ])
    return cmds


@pytest.mark.cluster
@pytest.mark.slow
def test_throttled_node_and_only_it_is_named(sim_cluster):
    cluster = sim_cluster(4, mode="netns")
    cluster.throttle(2, "40mbit")
    names = {c.address: i for i, c in enumerate(cluster.nodes)}
    pair_bw: dict[tuple[str, str], float] = {}
    _run_pairs(cluster, names, pair_bw)
    assert len(pair_bw) == 6
    report = rep.rank_nodes(pair_bw)
    slow = cluster.nodes[2].address
    assert report.bad == [slow], (report.scores, pair_bw)
    assert report.exclude == slow
    assert report.lines[0].startswith(f"{slow}: busbw ")


def _run_pairs(cluster, names: dict[str, int], pair_bw: dict[tuple[str, str], float]) -> None:
    """Every pair once, the disjoint pairs of a round at the same time; busbw into pair_bw."""
    for rnd in rep.pair_schedule(cluster.addresses):
        procs = []
        for ha, hb in rnd:
            for cmd in _pair_sweep_cmds(cluster, names[ha], names[hb]):
                procs.append(((ha, hb), subprocess.Popen(
                    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        outs: dict[tuple[str, str], str] = {}
        try:
            for pair, p in procs:
                so, se = p.communicate(timeout=90)
                assert p.returncode == 0, f"{pair}: exit {p.returncode}: {se[-1500:]}"
                if rep.JSON_MARKER in so:
                    outs[pair] = so
        finally:
            for _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for pair, text in outs.items():
            (row,) = rep.parse_output(text)
            assert rep.failures([row]) == []
            pair_bw[pair] = row.best_busbw
