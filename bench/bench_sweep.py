"""Sweep overhead: the sweep's all_reduce busbw at its largest size against a bare loop.

    .venv/bin/python -m bench.bench_sweep [--nproc 2] [--size 32M] [--iters 20] [--repeats 5]

Starts torchrun (gloo, CPU) with --nproc ranks. Each rank alternates, --repeats times: one sweep
(``workloads.sweep.run_sweep``, all_reduce from 8 B to --size by ×4, so the largest size follows a
ladder as in real use) and one bare loop of ``torch.distributed.all_reduce`` on a tensor of
--size, timed the way the sweep times (barrier, wall clock around --iters back-to-back calls,
time averaged across ranks). The ratio is the median over repeats of sweep busbw (in-place block:
the same call as the loop) / the bare loop's busbw right after it; target >= 0.95. Exit 1 when below.

On a GPU node the same command uses NCCL and CUDA events; the issue's GPU anchor (NVIDIA's
all_reduce_perf on the same GPUs, within 5% at >= 64 MB) needs the nccl-tests binary built there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = 0.95
_MARK = "#bench-sweep "


def _worker(size: int, iters: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from gpufleet.bandwidth import busbw
    from workloads.sweep import SweepConfig, run_sweep

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        n = dist.get_world_size()
        cfg = SweepConfig(
            collectives=("all_reduce",), minbytes=8, maxbytes=size, stepfactor=4, iters=iters, warmup_iters=1, check=0
        )
        top = cfg.sizes[-1]
        buf = torch.ones(top // 4, dtype=torch.float32, device=device)
        sweep_bw, bare_bw = [], []
        for _ in range(repeats):
            rows, _ = run_sweep(cfg, device)
            sweep_bw.append(rows[-1].ip_busbw)
            # The bare loop, timed as workloads.sweep.bench.Bench.time_per_op does.
            dist.all_reduce(buf)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(iters):
                    dist.all_reduce(buf)
                e.record()
                torch.cuda.synchronize()
                sec = s.elapsed_time(e) / 1e3 / iters
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(buf)
                sec = (time.perf_counter() - t0) / iters
            t = torch.tensor([sec], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            bare_bw.append(busbw("all_reduce", top, t.item() / n, n))
        if dist.get_rank() == 0:
            print(
                _MARK
                + json.dumps(
                    {"nranks": n, "size": top, "sweep": sweep_bw, "bare": bare_bw, "backend": dist.get_backend()}
                ),
                flush=True,
            )
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_sweep")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--size", default="32M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from gpufleet.bandwidth import parse_size

    size = parse_size(a.size)
    if a.worker:
        _worker(size, a.iters, a.repeats)
        return 0
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        PYTHONWARNINGS="ignore",
    )
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        str(a.nproc),
        "-m",
        "bench.bench_sweep",
        "--worker",
        "--size",
        a.size,
        "--iters",
        str(a.iters),
        "--repeats",
        str(a.repeats),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(_MARK)]
    if r.returncode != 0 or not lines:
        print(f"bench_sweep: torchrun exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return 1
    d = json.loads(lines[0][len(_MARK) :])
    sweep, bare = statistics.median(d["sweep"]), statistics.median(d["bare"])
    # Each sweep run is paired with the bare loop right after it, under the same machine load; the
    # median of the paired ratios is steadier on a shared machine than a ratio of medians.
    ratio = statistics.median(s_ / b_ for s_, b_ in zip(d["sweep"], d["bare"]))
    print(f"all_reduce {d['size']} B, {d['nranks']} ranks ({d['backend']}), {a.iters} iters x {a.repeats} repeats")
    print(f"  sweep busbw (median) : {sweep:.4f} GB/s   runs: {', '.join(f'{x:.4f}' for x in d['sweep'])}")
    print(f"  bare loop busbw      : {bare:.4f} GB/s   runs: {', '.join(f'{x:.4f}' for x in d['bare'])}")
    print(f"  ratio of medians     : {sweep / bare:.3f}")
    print(f"  ratio sweep/bare     : {ratio:.3f}  (median of paired runs; target >= {TARGET})")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
