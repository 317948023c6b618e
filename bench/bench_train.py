"""Training benchmarks, CPU, measured against their anchors in the same run.

1. Overhead: tokens/s of `workloads.train` (its Trainer, one process) against a bare PyTorch loop
   with the same model, batch, optimizer and clipping. Target ratio >= 0.95.
2. Overlap: 2 gloo ranks; step time of DDP (bucketed all-reduce overlapped with backward)
   against all-reducing every gradient after backward. Ratio = manual / DDP (> 1: DDP wins).

Run: .venv/bin/python -m bench.bench_train [--model small-test] [--steps 20] [--repeats 3]
Rounds alternate between the two sides so machine noise hits both alike; the best round counts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workloads.config import MODEL_SIZES, TrainConfig
from workloads.data import BatchStream, SyntheticTokens
from workloads.model import GPT

__all__ = ["bare_loop_tokens_per_s", "trainer_tokens_per_s", "overlap_step_times", "main"]

SEQ, MICRO = 128, 8


def _cfg(model: str, steps: int) -> TrainConfig:
    return TrainConfig(
        model=model,
        seq_len=SEQ,
        global_batch=MICRO,
        micro_batch=MICRO,
        steps=steps,
        log_every=10**6,
        straggler_every=0,
        warmup_steps=2,
        world_size=1,
    )


def trainer_tokens_per_s(model: str, steps: int, warmup: int = 3) -> float:
    """workloads.train's own loop (Trainer.fit) in a world of one."""
    from workloads.train import Trainer

    cfg = _cfg(model, warmup)
    with contextlib.redirect_stdout(io.StringIO()):  # its log lines are not the benchmark's output
        trainer = Trainer(cfg)
        trainer.fit()  # warm-up steps: allocator, autograd graph caches
        cfg.training.steps = warmup + steps
        t0 = time.perf_counter()
        trainer.fit()
        return steps * MICRO * SEQ / (time.perf_counter() - t0)


def bare_loop_tokens_per_s(model: str, steps: int, warmup: int = 3) -> float:
    """The anchor: the smallest correct loop with the same model, data, AdamW and clipping."""
    size = MODEL_SIZES[model]
    torch.manual_seed(0)
    net = GPT(size)
    opt = torch.optim.AdamW(net.parameters(), lr=6e-4, betas=(0.9, 0.95))
    data = BatchStream(SyntheticTokens(1 << 16, SEQ, size.vocab_size, 0), 0, 1, MICRO, 1, 0)
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            t0 = time.perf_counter()
        x, y = data.micro_batch_at(step, 0)
        loss = net(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * MICRO * SEQ / (time.perf_counter() - t0)


def _overlap_worker(rank: int, port: int, model: str, steps: int, rounds: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(minutes=5)
    )
    size = MODEL_SIZES[model]
    data = BatchStream(SyntheticTokens(1 << 16, SEQ, size.vocab_size, 0), rank, 2, MICRO, 1, 0)
    torch.manual_seed(0)
    net = GPT(size)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    results = {}
    for kind in ("ddp", "manual") * rounds:
        model_ = ddp if kind == "ddp" else net
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        times = []
        for step in range(steps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            x, y = data.micro_batch_at(step, 0)
            model_(x, y).backward()
            if kind == "manual":
                for p in net.parameters():  # one blocking all-reduce per gradient, after backward
                    dist.all_reduce(p.grad)
                    p.grad /= 2
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        best = sorted(times[2:])[len(times[2:]) // 2]  # median of the timed steps
        results[kind] = min(results.get(kind, float("inf")), best)
    if rank == 0:
        out.update(results)
    dist.destroy_process_group()


def overlap_step_times(model: str, steps: int, rounds: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_overlap_worker, args=(port, model, steps, rounds, out), nprocs=2)
        return dict(out)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_train")
    parser.add_argument("--model", default="small-test")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--part", choices=("all", "overhead", "overlap"), default="all")
    args = parser.parse_args()
    missed = False
    if args.part in ("all", "overhead"):
        missed = not _overhead(args)
    if args.part in ("all", "overlap"):
        t = overlap_step_times(args.model, args.steps, args.repeats)
        print(f"overlap ({args.model}, 2 gloo ranks, median step time, best of {args.repeats} alternating rounds):")
        print(f"  DDP (overlapped)                : {t['ddp'] * 1e3:8.1f} ms/step")
        print(f"  all-reduce each grad after bwd  : {t['manual'] * 1e3:8.1f} ms/step")
        print(f"  ratio manual / DDP              : {t['manual'] / t['ddp']:.3f}")
    return 1 if missed else 0


def _overhead(args: argparse.Namespace) -> bool:
    """Print the overhead ratio; whether it meets the target."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ours, bare = [], []
        for i in range(args.repeats):
            # Alternate which side goes first: on a shared machine, order alone can skew a round.
            if i % 2 == 0:
                bare.append(bare_loop_tokens_per_s(args.model, args.steps))
                ours.append(trainer_tokens_per_s(args.model, args.steps))
            else:
                ours.append(trainer_tokens_per_s(args.model, args.steps))
                bare.append(bare_loop_tokens_per_s(args.model, args.steps))
    finally:
        dist.destroy_process_group()
    print(f"overhead ({args.model}, batch {MICRO}x{SEQ}, {args.steps} steps, best of {args.repeats}, 1 thread):")
    print(f"  bare PyTorch loop : {max(bare):10,.0f} tok/s   (rounds: {', '.join(f'{b:,.0f}' for b in bare)})")
    print(f"  workloads.train   : {max(ours):10,.0f} tok/s   (rounds: {', '.join(f'{o:,.0f}' for o in ours)})")
    ratio = max(ours) / max(bare)
    print(f"  ratio             : {ratio:.3f}   (target >= 0.95)")
    if ratio < 0.95:
        print("bench_train: target missed", file=sys.stderr)
    return ratio >= 0.95


if __name__ == "__main__":
    sys.exit(main())
