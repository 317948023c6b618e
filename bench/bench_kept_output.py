"""What the nodes' output costs the launching machine when it is not shown (issue 41: every rank's
log stays on its node, and `launch logs` reads it through the tree).

    .venv/bin/python -m bench.bench_kept_output [--nodes 64] [--lines 10000]

One `launch exec --output rank0 -- ...` on --nodes simulated bare nodes, each node printing
--lines lines of 60 bytes, then `launch logs JOB` of that run (every node's whole log, here):
- the anchor, the star (`--fanout off`): every line travels to this machine, which writes it
  to the node's log under runs/ and shows node 0's;
- the tree (`--fanout 4`): every node but node 0 keeps its lines on the node
  (launcher.code.node_agent.Keep) and sends up only what the launch reads.
Each with the launching machine's CPU (the launch and every process it starts, from a cpuacct
cgroup of its own: bench.bench_laptop_cost.measured) and wall time. `launch logs` of the tree's
run reads the kept logs back down a tree of its own, which is where those bytes are paid for:
only when someone asks.

No target in the issue: what it shows is where the bytes go. The simulated nodes share this
machine's 2 cores, so a node's own CPU (the agent writing its log) is counted in neither column
but slows both walls.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_laptop_cost import LAUNCH, measured
from tests.simcluster import SimCluster

# Each node prints LINES lines of 60 bytes ("node N line I" padded), as a chatty training log does.
PRINT = 'for i in $(seq 1 "$1"); do printf "node %s line %-40s\\n" "$GPUFLEET_NODE_RANK" "$i"; done'


def one(c: SimCluster, hostfile: Path, runs: Path, fanout: str, lines: int) -> tuple[float, float, int, str]:
    """(CPU s, wall s, bytes of the run's logs here, its job id) of one launch."""
    argv = [*LAUNCH, "exec", "--hostfile", str(hostfile), *c.launch_flags, "--runs-dir", str(runs)]
    argv += ["--fanout", fanout, "--output", "rank0", "--", "bash", "-c", PRINT, "print", str(lines)]
    before = set(runs.iterdir())
    cpu, wall, _ = measured(argv)
    (run,) = set(runs.iterdir()) - before
    return cpu, wall, sum(p.stat().st_size for p in run.glob("node-*.log")), run.name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--lines", type=int, default=10000)
    a = ap.parse_args()
    runs = Path(tempfile.mkdtemp(prefix="gpufleet-bench-runs-"))
    with SimCluster(a.nodes, bare=True) as c:
        hostfile = Path(c.dir) / "hosts"
        hostfile.write_text("\n".join(c.addresses) + "\n")
        one(c, hostfile, runs, "4", 1)  # the nodes' launch keys, once per cluster
        print(f"{a.nodes} bare nodes, {a.lines} lines of 60 bytes each; launch exec --output rank0", flush=True)
        star = one(c, hostfile, runs, "off", a.lines)
        tree = one(c, hostfile, runs, "4", a.lines)
        for name, (cpu, wall, size, _) in (("star (anchor)", star), ("tree, kept", tree)):
            print(f"{name:>14}: launch CPU {cpu:6.2f} s, wall {wall:6.2f} s, logs here {size / 1e6:7.2f} MB")
        print(f"tree / star: CPU {tree[0] / star[0]:.2f}x, wall {tree[1] / star[1]:.2f}x", flush=True)
        logs = [*LAUNCH, "logs", "--hostfile", str(hostfile), *c.launch_flags, "--runs-dir", str(runs), tree[3]]
        cpu, wall, _ = measured(logs)
        size = sum(p.stat().st_size for p in (runs / tree[3]).glob("node-*.log"))
        print(f"launch logs of the tree's run: CPU {cpu:.2f} s, wall {wall:.2f} s, {size / 1e6:.2f} MB here")
        if size < star[2] * 0.99:
            print("bench_kept_output: launch logs did not bring every node's whole log back", file=sys.stderr)
            return 1
    subprocess.run(["rm", "-rf", str(runs)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
