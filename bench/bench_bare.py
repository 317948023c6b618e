"""Bare nodes (tests/simcluster.py, `bare=True`: the system python3 and a package index only):
what a launch costs when gpufleet brings its own code, your --sync directory and the job's
environment (launcher.code).

    .venv/bin/python -m bench.bench_bare [--nodes 16] [--parts again,sync,change] [--sync-mb 100]
        [--sync-fanouts 4,star]

Bytes are counted on the launching machine's side of its link: the transmit counter of the
cluster's bridge interface in this (the launching) namespace, which carries everything this
machine sends to the nodes and nothing the nodes fetch from the index or send each other.

- again: a second identical `launch train` on N bare nodes (its environment and code already
  there) against a launch on the same nodes prepared by hand (`--python` the environment's
  interpreter, PYTHONPATH gpufleet's code): bytes sent <= 3 MB, time <= 1.1x.
- sync: `launch exec --sync DIR -- true` of a DIR of 100 MB (10 files of random bytes) to N bare
  nodes with this machine's link shaped to 100 Mbit/s (tc tbf on the bridge interface), against
  one copy of the same 100 MB to one node over ssh under the same shaping: time <= 1.5x, bytes
  <= 1.5 x 100 MB. Once per fan-out of --sync-fanouts (the tree's default 4, and `star`: node 0
  sends to every node), each with content no node has yet.
- change: after a one-package change to requirements.txt (six 1.16.0 -> 1.17.0 beside torch,
  uv's cache warm on every node from the first build), the time until every node has the new
  environment (the launch's preparation, `launch exec --sync DIR -- true`): <= 30 s.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.simcluster import SimCluster
from tests.simindex import wheel_cache
from tests.support import TRAIN

LAUNCH = [sys.executable, "-m", "launcher"]
ONE = ["--nproc-per-node", "1", "--env", "OMP_NUM_THREADS=1"]


def _tx(c: SimCluster) -> int:
    return int(Path(f"/sys/class/net/{c.bridge}/statistics/tx_bytes").read_text())


def _launch(c: SimCluster, runs: Path, *args: str) -> tuple[float, int, str]:
    """Time and bytes this machine sent for one `launch ARGS` on the cluster; its stderr."""
    flags = ["--hostfile", str(c.hostfile), *c.launch_flags, "--runs-dir", str(runs)]
    argv = [*LAUNCH, args[0], *flags, *args[1:]]
    tx0, t0 = _tx(c), time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    dt, sent = time.perf_counter() - t0, _tx(c) - tx0
    if r.returncode != 0:
        raise RuntimeError(f"launch {args[0]} exited {r.returncode}: {r.stderr[-3000:]}")
    return dt, sent, r.stderr


def part_again(c: SimCluster, runs: Path, repeats: int) -> bool:
    index = ["--index-url", c.package_index]
    train = ["train", *index, *ONE, *TRAIN, "--steps", "1"]
    first, sent, err = _launch(c, runs, *train)
    print(f"first launch train on {c.n} bare nodes: {first:.1f} s (code and environment), {sent / 1e6:.1f} MB sent")
    env = re.search(r"building environment (\w+)", err)
    from launcher.code.pyenv import EnvSpec, workloads_requirements
    from launcher.code.snapshot import code_snapshot

    key = EnvSpec("requirements.txt", {"requirements.txt": workloads_requirements()}, index_url=c.package_index).key
    assert env is None or key.startswith(env.group(1)), (key, env.group(1))
    by_hand = [
        "train",
        "--python",
        f"/root/.gpufleet/envs/{key}/bin/python",
        "--env",
        f"PYTHONPATH=/root/.gpufleet/snap/{code_snapshot().hash}",
        *ONE,
        *TRAIN,
        "--steps",
        "1",
    ]
    again, hand, sent_again = [], [], []
    for i in range(repeats):  # interleaved, which goes first alternating
        for which in ((train, again), (by_hand, hand)) if i % 2 == 0 else ((by_hand, hand), (train, again)):
            dt, sent, _ = _launch(c, runs, *which[0])
            which[1].append(dt)
            if which[1] is again:
                sent_again.append(sent)
    t_again, t_hand = statistics.median(again), statistics.median(hand)
    mb = max(sent_again) / 1e6
    ratio = t_again / t_hand
    print(f"second identical launch: {t_again:.2f} s (median of {repeats}), most sent {mb:.2f} MB")
    print(f"launch on nodes prepared by hand: {t_hand:.2f} s; ratio {ratio:.3f} (target <= 1.1; bytes <= 3 MB)")
    return mb <= 3 and ratio <= 1.1


def _random_dir(root: Path, mb: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(10):
        (root / f"part{i}.bin").write_bytes(os.urandom(mb * 1000 * 1000 // 10))
    return root


def part_sync(c: SimCluster, runs: Path, tmp: Path, mb: int, fanouts: list[str]) -> bool:
    """For each fan-out (`star`: the number of nodes minus one, node 0 sends to all), one copy of
    the 100 MB to one node, then `--sync` of a directory of the same size that no node has seen
    (new random bytes), under the same shaping: the ratio pairs each with the copy just before."""
    tbf = ["tbf", "rate", "100mbit", "burst", "64kb", "latency", "100ms"]
    subprocess.run(["tc", "qdisc", "replace", "dev", c.bridge, "root", *tbf], check=True)
    ok = True
    try:
        for i, fanout in enumerate(fanouts):
            k = c.n - 1 if fanout == "star" else int(fanout)
            d = _random_dir(tmp / f"sync{i}", mb)
            blob = tmp / "one.bin"
            with open(blob, "wb") as out:
                for f in sorted(d.iterdir()):
                    out.write(f.read_bytes())
            load = os.getloadavg()[0]
            tx0, t0 = _tx(c), time.perf_counter()
            with open(blob, "rb") as f:
                subprocess.run(["ssh", *c.ssh_options, c.addresses[0], "cat > /tmp/one.bin"], stdin=f, check=True)
            one, one_sent = time.perf_counter() - t0, _tx(c) - tx0
            limit = ["--sync-max", f"{mb * 2}MB", "--sync-fanout", str(k)]
            dt, sent, err = _launch(c, runs, "exec", "--sync", str(d), *limit, "--", "true")
            ratio = dt / one
            print(f"fan-out {k} ({fanout}), load average {load:.1f}:")
            print(f"  one {mb} MB copy to one node (ssh cat): {one:.1f} s, {one_sent / 1e6:.1f} MB sent")
            print(
                f"  --sync {mb} MB to {c.n} nodes: {dt:.1f} s, {sent / 1e6:.1f} MB sent; ratio {ratio:.2f} "
                "(target <= 1.5)"
            )
            print("  " + next((line for line in err.splitlines() if line.startswith("sent ")), "(nothing sent?)"))
            ok &= ratio <= 1.5 and sent <= 1.5 * mb * 1e6
            shutil.rmtree(d)
            subprocess.run(["ssh", *c.ssh_options, c.addresses[0], "rm -f /tmp/one.bin"], check=True)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", c.bridge, "root"], check=False)
    return ok


def part_change(c: SimCluster, runs: Path, tmp: Path) -> bool:
    d = tmp / "proj"
    d.mkdir(parents=True, exist_ok=True)
    (d / "main.py").write_text("print('hi')\n")
    index = ["--index-url", c.package_index]
    (d / "requirements.txt").write_text("torch\nsix==1.16.0\n")
    first, _, _ = _launch(c, runs, "exec", *index, "--sync", str(d), "--", "true")
    print(f"first environment (torch, six 1.16.0) on {c.n} nodes: {first:.1f} s")
    (d / "requirements.txt").write_text("torch\nsix==1.17.0\n")
    dt, _, err = _launch(c, runs, "exec", *index, "--sync", str(d), "--", "true")
    built = err.count("building environment")
    print(f"one package changed: {dt:.1f} s until all {c.n} nodes ran it in the new environment ({built} built)")
    print("  target <= 30 s")
    return dt <= 30 and built == c.n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--parts", default="again,sync,change")
    p.add_argument("--sync-mb", type=int, default=100)
    p.add_argument("--sync-fanouts", default="4,star", help="fan-outs to measure --sync with (star: N-1)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    parts = a.parts.split(",")
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-bare-") as tmp:
        os.environ["GPUFLEET_STATE_DIR"] = f"{tmp}/state"
        with SimCluster(a.nodes, bare=True, index=wheel_cache(), workdir=Path(tmp) / "sim") as c:
            runs = Path(tmp) / "runs"
            if "again" in parts:
                ok &= part_again(c, runs, a.repeats)
            if "sync" in parts:
                ok &= part_sync(c, runs, Path(tmp), a.sync_mb, a.sync_fanouts.split(","))
            if "change" in parts:
                ok &= part_change(c, runs, Path(tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
