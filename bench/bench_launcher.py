"""Fan-out speed: `launch exec --nodes N -- true` against `pdsh -w ... true`, same simulated nodes.

    .venv/bin/python -m bench.bench_launcher [--nodes 16,64] [--repeats 3]

pdsh is what DeepSpeed's multi-node launcher uses (`pdsh -S -f 1024 -w HOSTS`, DeepSpeed
launcher/multinode_runner.py PDSHRunner); it is run here with DeepSpeed's flags and the same ssh
options (PDSH_SSH_ARGS_APPEND). Four numbers per size, each the median of `--repeats` runs:
- pdsh: one fresh SSH connection per node, every call;
- launch cold: no open connection (a fresh ControlPath directory each run), so the launcher pays
  the handshakes, and each node's check and run in one session;
- launch repeat: a second call with the connections kept open by the first (ControlPersist);
- floor: `ssh HOST true` to every node at once over those same open connections, the least any
  launcher that opens one session per node per call can cost (sshd's session plus the node's
  login shell); its ratio to pdsh bounds the repeat ratio from below on this machine.
Targets: cold <= pdsh at 16 and 64 nodes; repeat <= 0.5 x pdsh at 64 nodes.

`--baseline REV` also times the launcher of an earlier commit (exported with `git archive` into a
temporary directory and run from there with the same interpreter), cold and repeat, in the same
rounds, alternating which goes first: "No launch may get slower" is then
`cold/base` and `repeat/base` <= 1 within the noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.simcluster import SimCluster

LAUNCH = [sys.executable, "-m", "launcher"]


def _time(argv: list[str], env: dict | None = None, cwd: str | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... exited {r.returncode}: {r.stderr[-2000:]}")
    return dt


def _sessions(hosts: list[str], ssh_opts: list[str]) -> float:
    """`ssh HOST true` to every host at once (as pdsh -f 1024 would), over open connections."""
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            ["ssh", *ssh_opts, "-T", h, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for h in hosts
    ]
    bad = [(h, p.communicate()[1]) for h, p in zip(hosts, procs) if p.wait() != 0]
    dt = time.perf_counter() - t0
    if bad:
        raise RuntimeError(f"ssh {bad[0][0]} true over the open connection failed: {bad[0][1][-500:]!r}")
    return dt


def _export(rev: str) -> str:
    """The tree of commit `rev` in a temporary directory (what `launch` was at that commit)."""
    where = tempfile.mkdtemp(prefix="gpufleet-baseline-")
    archive = subprocess.run(["git", "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", where], input=archive.stdout, check=True)
    return where


def _cold_and_repeat(argv: list[str], cwd: str | None, out: dict[str, list[float]], tag: str) -> None:
    env = dict(os.environ, PYTHONPATH=cwd) if cwd else None
    out[f"cold{tag}"].append(_time(argv, env, cwd))
    out[f"repeat{tag}"].append(_time(argv, env, cwd))


def bench(n: int, repeats: int, c: SimCluster, baseline: str | None = None) -> dict[str, float]:
    hosts = c.addresses[:n]
    hostfile = Path(c.dir) / f"hosts{n}"
    hostfile.write_text("\n".join(hosts) + "\n")
    flags, ssh_opts = c.launch_flags, list(c.ssh_options)
    runs = Path(tempfile.mkdtemp(prefix="gpufleet-bench-runs-"))
    pdsh_env = dict(os.environ, PDSH_RCMD_TYPE="ssh", PDSH_SSH_ARGS_APPEND=" ".join(ssh_opts))
    pdsh = ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), "true"]
    out: dict[str, list[float]] = {
        "pdsh": [],
        "cold": [],
        "repeat": [],
        "floor": [],
        "cold_base": [],
        "repeat_base": [],
    }
    for i in range(repeats):
        out["pdsh"].append(_time(pdsh, pdsh_env))
        kinds = [("", None), *([("_base", baseline)] if baseline else [])]
        for tag, cwd in kinds if i % 2 == 0 else kinds[::-1]:
            ctl = Path(tempfile.mkdtemp(prefix="gfb-", dir="/tmp"))
            argv = [
                *LAUNCH,
                "exec",
                "--hostfile",
                str(hostfile),
                *flags,
                "--ssh-option",
                f"ControlPath={ctl}/%C",
                "--runs-dir",
                str(runs),
                # The star: what this bench compares with pdsh (a baseline checkout predates --fanout).
                *(["--fanout", "off"] if cwd is None else []),
                "--",
                "true",
            ]
            _cold_and_repeat(argv, cwd, out, tag)
            if not tag:
                out["floor"].append(
                    _sessions(hosts, [*ssh_opts, "-o", f"ControlPath={ctl}/%C", "-o", "ControlMaster=no"])
                )
            # Close this round's kept-open connections so the next cold run is cold.
            for h in hosts:
                subprocess.run(
                    ["ssh", *ssh_opts, "-o", f"ControlPath={ctl}/%C", "-O", "exit", h], capture_output=True, timeout=30
                )
    return {k: statistics.median(v) for k, v in out.items() if v}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", metavar="REV", help="also time the launcher of this commit, same rounds")
    a = p.parse_args()
    sizes = [int(x) for x in a.nodes.split(",")]
    baseline = _export(a.baseline) if a.baseline else None
    missed = []
    with SimCluster(max(sizes)) as c:
        print(f"simulated cluster: {max(sizes)} sshd nodes ({c.mode}); median of {a.repeats} runs")
        print(
            f"{'nodes':>5} {'pdsh s':>8} {'cold s':>8} {'repeat s':>9} {'floor s':>8} {'cold/pdsh':>10} "
            f"{'repeat/pdsh':>12} {'floor/pdsh':>11}"
        )
        for n in sizes:
            r = bench(n, a.repeats, c, baseline)
            print(
                f"{n:>5} {r['pdsh']:>8.2f} {r['cold']:>8.2f} {r['repeat']:>9.2f} {r['floor']:>8.2f} "
                f"{r['cold'] / r['pdsh']:>10.2f} {r['repeat'] / r['pdsh']:>12.2f} "
                f"{r['floor'] / r['pdsh']:>11.2f}",
                flush=True,
            )
            if baseline:
                print(
                    f"{'':>5} {a.baseline}: cold {r['cold_base']:.2f} s, repeat {r['repeat_base']:.2f} s; "
                    f"cold/base {r['cold'] / r['cold_base']:.2f}, repeat/base {r['repeat'] / r['repeat_base']:.2f}",
                    flush=True,
                )
            if r["cold"] > r["pdsh"]:
                missed.append(f"cold > pdsh at {n} nodes")
            if n >= 64 and r["repeat"] > 0.5 * r["pdsh"]:
                missed.append(f"repeat > 0.5 x pdsh at {n} nodes")
    if missed:
        print(f"bench_launcher: target missed ({'; '.join(missed)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
