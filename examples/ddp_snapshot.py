"""A plain PyTorch DDP training loop that resumes from its own snapshot: what `launch run
--detach --recover` expects of your code, and nothing gpufleet-specific beyond reading two
environment variables to say which attempt this is.

The shape is the one of PyTorch's DDP tutorial series (pytorch/examples,
distributed/ddp-tutorial-series/multinode.py): a Trainer that loads a snapshot at start if there
is one and saves one every --save-every epochs. Here the snapshot may be a path (relative paths
land in `launch run --workdir`) or a `gs://bucket/object` (google-cloud-storage; it honours
STORAGE_EMULATOR_HOST). Rank 0 reads and writes it and broadcasts what it read, so nodes that do
not share a disk resume from the same epoch.

    launch run --stack prod --detach --recover --max-restarts 2 --workdir ~/runs/a -- \\
        ddp_snapshot.py --epochs 100 --save-every 5 --snapshot snapshot.pt
"""

from __future__ import annotations

import argparse
import io
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def read_snapshot(where: str) -> bytes | None:
    if where.startswith("gs://"):
        from google.cloud import storage

        bucket, _, name = where[len("gs://") :].partition("/")
        blob = storage.Client().bucket(bucket).blob(name)
        return blob.download_as_bytes() if blob.exists() else None
    return open(where, "rb").read() if os.path.exists(where) else None


def write_snapshot(where: str, data: bytes) -> None:
    if where.startswith("gs://"):
        from google.cloud import storage

        bucket, _, name = where[len("gs://") :].partition("/")
        storage.Client().bucket(bucket).blob(name).upload_from_string(data)  # one object: whole or absent
        return
    tmp = f"{where}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, where)  # a crash mid-save leaves the previous snapshot whole


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, snapshot: str, save_every: int):
        self.rank = dist.get_rank()
        self.model = DDP(model)
        self.data = data
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.snapshot = snapshot
        self.save_every = save_every
        self.epochs_run = 0
        self._load_snapshot()

    def _load_snapshot(self) -> None:
        found = [read_snapshot(self.snapshot) if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return
        state = torch.load(io.BytesIO(found[0]), weights_only=True)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.epochs_run = state["epochs_run"]
        if self.rank == 0:
            print(f"resuming from the snapshot at epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epochs_run": epoch + 1,
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        write_snapshot(self.snapshot, buf.getvalue())
        print(f"epoch {epoch} | snapshot saved to {self.snapshot}", flush=True)

    def train(self, max_epochs: int, epoch_s: float) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self.data.sampler.set_epoch(epoch)
            for x, y in self.data:
                self.optimizer.zero_grad()
                loss = F.mse_loss(self.model(x), y)
                loss.backward()
                self.optimizer.step()
            if self.rank == 0:
                print(f"epoch {epoch} | loss {loss.item():.4f}", flush=True)
                if (epoch + 1) % self.save_every == 0:
                    self._save_snapshot(epoch)
            time.sleep(epoch_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--snapshot", default="snapshot.pt", help="a path, or gs://bucket/object")
    p.add_argument("--epoch-seconds", type=float, default=0.0, help="sleep after each epoch (demos, tests)")
    args = p.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        attempt = os.environ.get("GPUFLEET_ATTEMPT", "0")
        reason = os.environ.get("GPUFLEET_RESTART_REASON") or "-"
        print(f"rank {dist.get_rank()}: attempt {attempt} (restart reason {reason})", flush=True)
        torch.manual_seed(0)  # the same data on every rank and every attempt
        dataset = TensorDataset(torch.randn(256, 20), torch.randn(256, 1))
        data = DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset))
        Trainer(torch.nn.Linear(20, 1), data, args.snapshot, args.save_every).train(args.epochs, args.epoch_seconds)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
