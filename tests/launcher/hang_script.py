"""Run by the hang tests under torchrun, written the way a user's training script is: every rank
says it is up, then takes a training step (load a batch, all_reduce). Rank HANG_RANK (default 2)
sleeps in its data loading, so the others wait for it in a gloo all_reduce: one rank outside any
collective. HANG_MODE=barrier: nobody sleeps, but rank 0 waits in a barrier while the others wait
in the all_reduce: every rank in a collective, not the same one."""

import os
import time

import torch
import torch.distributed as dist


def load_batch(rank: int) -> torch.Tensor:
    if rank == int(os.environ.get("HANG_RANK", "2")):
        time.sleep(3600)
    return torch.ones(1)


def train_step(rank: int) -> None:
    batch = load_batch(rank)
    dist.all_reduce(batch)


def main() -> None:
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        os.write(1, f"rank {rank} up\n".encode())
        if os.environ.get("HANG_MODE") == "barrier":
            if rank == 0:
                dist.barrier()
            else:
                dist.all_reduce(torch.ones(1))
        else:
            train_step(rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
