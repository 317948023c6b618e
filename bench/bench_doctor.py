"""`launch doctor` against `launch exec -- true` on the same simulated nodes, in the same run.

    .venv/bin/python -m bench.bench_doctor [--nodes 16,64] [--repeats 3]

The nodes are tests/launcher/fake_gpu_node.GpuSimCluster's: healthy a3-highgpu-8g nodes with a
fake nvidia-smi/dmesg/docker on their PATH, their own metadata server and four veth GPU NICs, so
doctor runs every check it runs on a real cluster (the fakes stand in for the GPU tools only).
Both commands pay the same handshakes: each run gets a fresh ControlPath directory (cold), and is
then repeated over the connections the first one left open (warm), where what remains is the
node-side work. Interleaved, median of `--repeats`. Target: doctor <= 1.3 x exec, cold,
at every size. All "nodes" share this machine's two cores, so every node's checks compete for
them; on a real cluster each node runs its own checks on its own CPUs at once.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.launcher.fake_gpu_node import MTYPE, GpuSimCluster

LAUNCH = [sys.executable, "-m", "launcher"]
TARGET = 1.3


def _time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:4])} exited {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
    return dt


def bench(n: int, repeats: int, c: GpuSimCluster, work: Path) -> dict[str, float]:
    hostfile = work / f"hosts{n}"
    hostfile.write_text("\n".join(c.sim.addresses[:n]) + "\n")
    common = ["--hostfile", str(hostfile), *c.sim.launch_flags, "--runs-dir", str(work / "runs")]
    doctor = [
        "doctor",
        *common,
        "--machine-type",
        MTYPE,
        "--python",
        sys.executable,
        "--env",
        f"LD_LIBRARY_PATH={c.plugin}",
        "--min-free-gb",
        "0.01",
    ]
    exec_ = ["exec", *common, "--", "true"]
    out: dict[str, list[float]] = {k: [] for k in ("exec", "doctor", "exec warm", "doctor warm")}
    for _ in range(repeats):
        for name, argv in (("exec", exec_), ("doctor", doctor)):
            ctl = Path(tempfile.mkdtemp(prefix="gfd-", dir="/tmp"))
            opt = ["--ssh-option", f"ControlPath={ctl}/%C"]
            # Options go before `--` (exec's program follows it).
            full = [*LAUNCH, argv[0], *opt, *argv[1:]]
            out[name].append(_time(full))
            out[f"{name} warm"].append(_time(full))
            for h in c.sim.addresses[:n]:  # close this run's masters so the next cold run is cold
                subprocess.run(
                    ["ssh", *c.sim.ssh_options, "-o", f"ControlPath={ctl}/%C", "-O", "exit", h],
                    capture_output=True,
                    timeout=30,
                )
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="16,64")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sizes = [int(x) for x in a.nodes.split(",")]
    most = max(sizes)
    # One block, subblocks of 8: every node has a physical host, as on A3 with compact placement.
    places = [f"/clu/blk1/sb{i // 8}/h{i:03d}" for i in range(most)]
    missed = []
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-doctor-") as tmp:
        work = Path(tmp)
        c = GpuSimCluster(work / "cluster", places)
        try:
            print(f"simulated cluster: {most} sshd nodes ({c.sim.mode}), {MTYPE} fakes; median of {a.repeats} runs")
            print(
                f"{'nodes':>5} {'exec s':>8} {'doctor s':>9} {'ratio':>6} {'exec warm s':>12} {'doctor warm s':>14} "
                f"{'warm ratio':>11}"
            )
            for n in sizes:
                r = bench(n, a.repeats, c, work)
                ratio, warm = r["doctor"] / r["exec"], r["doctor warm"] / r["exec warm"]
                print(
                    f"{n:>5} {r['exec']:>8.2f} {r['doctor']:>9.2f} {ratio:>6.2f} {r['exec warm']:>12.2f} "
                    f"{r['doctor warm']:>14.2f} {warm:>11.2f}",
                    flush=True,
                )
                if ratio > TARGET:
                    missed.append(f"doctor {ratio:.2f} x exec at {n} nodes")
        finally:
            c.close()
    if missed:
        print(f"bench_doctor: target {TARGET} x missed ({'; '.join(missed)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
