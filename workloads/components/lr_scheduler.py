"""The learning-rate schedule: linear warmup, then cosine decay to a floor (nanoGPT's `get_lr`)."""

from __future__ import annotations

import functools
import math

import torch

from workloads.config import LRSchedulerConfig, TrainingConfig

__all__ = ["build_lr_scheduler", "lr_factor"]


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """The peak learning rate's multiplier at `step`: linear warmup to 1, then cosine decay to
    `min_lr_ratio` at `decay_steps` (held there after it)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, training: TrainingConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_factor`, reading the config at each step. A partial, not a lambda:
    LambdaLR's state_dict keeps a callable object's (empty) __dict__, what checkpoints hold."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_factor, cfg, training))


def _factor(cfg: LRSchedulerConfig, training: TrainingConfig, step: int) -> float:
    decay_steps = cfg.lr_decay_steps or training.steps  # 0: decay over the whole run
    return lr_factor(step, warmup_steps=cfg.warmup_steps, decay_steps=decay_steps, min_lr_ratio=cfg.min_lr_ratio)
