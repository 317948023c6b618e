"""Training data: a learnable synthetic task or a nanoGPT-style uint16 token file, and the
per-rank order that makes a run resumable from nothing but its step number.

Order: each epoch `DistributedSampler` (shuffle, drop_last, `set_epoch`) deals rank r the samples
perm[r], perm[r + W], perm[r + 2W], ...; micro-step m of optimizer step s takes the next
`micro_batch` of them. So the samples of one optimizer step, over all ranks, are the next
`global_batch` entries of the epoch's permutation whatever the world size: 1 process with batch
2b and 2 ranks with b each see the same samples (the equivalence the tests check), no sample is
repeated or skipped within an epoch, and the data position is a pure function of the step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from workloads.config import ConfigError

__all__ = ["SyntheticTokens", "TokenFile", "BatchStream"]


class SyntheticTokens(Dataset):
    """Arithmetic sequences mod the vocabulary: x[t+1] = x[t] + stride (mod V).

    Start and stride are derived from the sample index, so a sample needs no storage and no RNG,
    and a model that reads the first tokens can predict the rest: the loss must fall.
    """

    def __init__(self, n_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.n, self.seq_len, self.vocab, self.seed = n_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(indices, dtype=torch.int64) + self.seed
        start = (idx * 2654435761) % self.vocab  # Knuth's multiplicative hash
        stride = 1 + (idx * 40503) % 7
        seq = (start[:, None] + stride[:, None] * torch.arange(self.seq_len + 1)) % self.vocab
        return seq[:, :-1], seq[:, 1:]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([i])
        return x[0], y[0]


class TokenFile(Dataset):
    """Non-overlapping (seq_len + 1)-token windows of a uint16 token file (nanoGPT's .bin)."""

    def __init__(self, path: str, seq_len: int, vocab_size: int) -> None:
        try:
            self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(f"--data {path}: cannot map it as uint16 tokens ({e})") from None
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len
        if self.n < 1:
            raise ConfigError(f"--data {path} holds {len(self.tokens)} tokens, fewer than one sample of {seq_len + 1}")
        # Only a prefix is checked: scanning a multi-GB file would stall start-up.
        top = int(self.tokens[: 1 << 20].max())
        if top >= vocab_size:
            raise ConfigError(
                f"--data {path} has token id {top} >= the model's vocabulary "
                f"{vocab_size}; pick a model with a larger vocabulary"
            )

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.seq_len
        rows = np.stack([self.tokens[i * t : i * t + t + 1] for i in indices]).astype(np.int64)
        seq = torch.from_numpy(rows)
        return seq[:, :-1], seq[:, 1:]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([i])
        return x[0], y[0]


class BatchStream:
    """The micro-batches of one rank, addressable by (step, micro-step)."""

    def __init__(
        self,
        dataset: SyntheticTokens | TokenFile,
        rank: int,
        world_size: int,
        micro_batch: int,
        grad_accum: int,
        seed: int,
    ) -> None:
        self.dataset = dataset
        self.sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.steps_per_epoch = len(self.sampler) // (micro_batch * grad_accum)
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"the data holds {len(dataset)} samples, fewer than one global batch "
                f"of {micro_batch * grad_accum * world_size}"
            )
        self._epoch = -1
        self._order: list[int] = []

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of optimizer step `step` (0-based)."""
        return divmod(step, self.steps_per_epoch)

    def micro_batch_at(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, k = self.position(step)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order, self._epoch = list(self.sampler), epoch
        start = (k * self.grad_accum + micro) * self.micro_batch
        return self.dataset.batch(self._order[start : start + self.micro_batch])
