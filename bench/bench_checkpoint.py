"""Checkpoint save time, CPU ranks over gloo, measured against its anchor in the same run.

Anchor: the previous release's full-state save (workloads/train.py at e9d9d60, Trainer.save):
`get_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))` gathers every
parameter and AdamW moment on rank 0, which writes one torch.save file (local: temp file, fsync,
rename; GCS: staged in a temp file, then one upload). The training step is blocked for all of it.

Measured, through workloads.train's own CheckpointManager.save (every rank writes its own shards, DCP):
- DCP sync: the whole save (what the SIGTERM save costs);
- DCP async: the time the step is blocked (state dict + copy to host memory, the slowest rank),
  and the time until the checkpoint is published as latest in the background.

Target: DCP async's blocked time <= 1/3 of the full-state save on 4 ranks, for every store.

The model is FSDP2-sharded (fully_shard per block), fp32 weights and fp32 AdamW moments, so the
checkpoint holds 12 bytes per parameter. Memory: the anchor gathers the whole state on rank 0 next
to the sharded state (2x), and an async save stages a copy (another 1x): the ~1.3B model's 15.8 GB
of state needs ~48 GB of host RAM for all three, so on a 24 GiB machine run the 350M model
(4.3 GB of state) and pass --models 1.3B where the memory is.

Run: .venv/bin/python -m bench.bench_checkpoint [--models 350M] [--ranks 4] [--stores local,gcs]
     [--repeats 2] [--dir /tmp]
Rounds alternate the order of the three kinds so machine noise hits each alike; the best round counts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from workloads.checkpoint.manager import rng_state
from workloads.config import MODEL_SIZES, TrainConfig

__all__ = ["main"]

TARGET = 1 / 3
KINDS = ("full-state", "dcp", "dcp-async")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_state_save(trainer: Any, url: str, name: str) -> None:
    """The anchor: the previous release's Trainer.save and LocalStore/GCSStore.save, in one."""
    model_sd, optim_sd = get_state_dict(
        trainer.model, trainer.optimizers.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    rngs: list[Any] = [None] * trainer.world
    dist.all_gather_object(rngs, rng_state(trainer.device))
    if trainer.rank == 0:
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": trainer.optimizers.scheduler.state_dict(),
            "scaler": trainer.optimizers.scaler.state_dict(),
            "step": trainer.step,
            "rng": rngs,
            "meta": trainer.checkpoint.meta,
        }
        if url.startswith("gs://"):
            store = trainer.checkpoint.store
            with tempfile.NamedTemporaryFile(suffix=".pt") as f:
                torch.save(state, f)
                f.flush()
                store._blob(name).upload_from_filename(f.name, timeout=3600)
            store._blob(name).delete(timeout=600)  # the emulator holds objects in memory
        else:
            final = Path(url) / name
            tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            final.unlink()
    del model_sd, optim_sd
    dist.barrier()


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(rank: int, world: int, port: int, model: str, url: str, repeats: int, out: dict) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=60))
    from workloads.train import Trainer

    cfg = TrainConfig(
        model=model,
        seq_len=16,
        global_batch=world,
        micro_batch=1,
        steps=1,
        world_size=world,
        parallelism="fsdp",
        checkpoint_dir=url,
        keep_checkpoints=1,
        straggler_every=0,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's log lines are not the benchmark's
        trainer = Trainer(cfg)
    results: dict[str, list[float]] = {k: [] for k in (*KINDS, "dcp-async-total")}
    for r in range(repeats):
        order = KINDS if r % 2 == 0 else tuple(reversed(KINDS))
        for kind in order:
            trainer.step += 1  # a new checkpoint name each time
            dist.barrier()
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                if kind == "full-state":
                    _full_state_save(trainer, url, f"full_{trainer.step:08d}.pt")
                elif kind == "dcp":
                    trainer.checkpoint.save()
                    dist.barrier()
                else:
                    trainer.checkpoint.save(asynchronous=True)
                    # The step waits for the slowest rank at its next collective.
                    results[kind].append(_max_over_ranks(time.perf_counter() - t0))
                    trainer.checkpoint.wait()
                    dist.barrier()
                    kind = "dcp-async-total"
            results[kind].append(time.perf_counter() - t0)
    if rank == 0:
        out.update({k: min(v) for k, v in results.items()})
        out["params"] = trainer.built.n_params
        out["rounds"] = {k: v for k, v in results.items()}
    with contextlib.suppress(Exception):
        del trainer
    dist.destroy_process_group()


def _measure(model: str, world: int, url: str, repeats: int) -> dict[str, Any]:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(world, _free_port(), model, url, repeats, out), nprocs=world)
        return dict(out)


@contextlib.contextmanager
def _emulator() -> Any:
    """The GCS emulator the tests use (tests/workloads/conftest.py), as this process's
    STORAGE_EMULATOR_HOST while it runs; yields the checkpoint URL."""
    from tests.workloads.conftest import start_gcs_emulator

    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    with start_gcs_emulator("bench") as host:
        os.environ["STORAGE_EMULATOR_HOST"] = host
        try:
            yield "gs://bench/ckpt"
        finally:
            if previous is None:
                os.environ.pop("STORAGE_EMULATOR_HOST", None)
            else:
                os.environ["STORAGE_EMULATOR_HOST"] = previous


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_checkpoint")
    parser.add_argument("--models", default="350M", help="comma-separated MODEL_SIZES names (1.3B needs ~48 GB RAM)")
    parser.add_argument("--ranks", default="4", help="comma-separated rank counts; the target is checked at 4")
    parser.add_argument("--stores", default="local,gcs", help="local, gcs (gcp-storage-emulator), or both")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the local checkpoints go")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for model in args.models.split(","):
        if model not in MODEL_SIZES:
            print(f"error: --models {model!r} is unknown; one of: {', '.join(MODEL_SIZES)}", file=sys.stderr)
            return 2
        for world in (int(w) for w in args.ranks.split(",")):
            for store in args.stores.split(","):
                if store == "local":
                    where = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
                    try:
                        res = _measure(model, world, str(where), args.repeats)
                    finally:
                        shutil.rmtree(where, ignore_errors=True)
                elif store == "gcs":
                    with _emulator() as url:
                        res = _measure(model, world, url, args.repeats)
                else:
                    print(f"error: --stores {store!r} is unknown; one of: local, gcs", file=sys.stderr)
                    return 2
                rows.append((model, world, store, res))
                _print_row(model, world, store, res)
    missed = [r for r in rows if r[1] == 4 and r[3]["dcp-async"] > TARGET * r[3]["full-state"]]
    print(
        f"target: DCP async blocked time <= {TARGET:.3f} x the full-state save on 4 ranks: "
        + ("met" if not missed else "MISSED for " + ", ".join(f"{m} {s}" for m, _, s, _ in missed))
    )
    return 1 if missed else 0


def _print_row(model: str, world: int, store: str, res: dict[str, Any]) -> None:
    full = res["full-state"]
    state_gb = res["params"] * 12 / 1e9  # fp32 weights + 2 fp32 AdamW moments (n_params excludes wpe)
    print(
        f"{model} ({res['params'] / 1e6:.0f}M params, ~{state_gb:.1f} GB of state), FSDP x {world} CPU ranks, "
        f"{store}, best of {len(res['rounds']['dcp'])}:"
    )
    print(f"  full-state save (anchor)   : {full:8.2f} s")
    print(f"  DCP sync save              : {res['dcp']:8.2f} s   ratio {res['dcp'] / full:.3f}")
    print(
        f"  DCP async, step blocked    : {res['dcp-async']:8.2f} s   ratio {res['dcp-async'] / full:.3f}"
        f"   (target <= {TARGET:.3f})"
    )
    print(f"  DCP async, until published : {res['dcp-async-total']:8.2f} s")
    print(
        "  rounds: " + "; ".join(f"{k} " + ", ".join(f"{x:.2f}" for x in v) for k, v in res["rounds"].items()),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
