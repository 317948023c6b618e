"""The optimizer: AdamW over the model's parameters, with its LR schedule and loss scaler, and
the optimizer step (unscale, clip, step, zero, schedule)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from workloads.config import OptimizerConfig

__all__ = ["Optimizers", "build_optimizer"]


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: OptimizerConfig, *, dp: int, mixed_tensors: bool, cuda: bool
) -> torch.optim.AdamW:
    """AdamW with nanoGPT's betas and decay groups; --scale-lr multiplies the rate by `dp`, the
    data-parallel size. `mixed_tensors`: the parameters mix plain tensors with TP's and FSDP's
    DTensors (TP or PP), which one foreach/fused kernel cannot take."""
    lr = cfg.lr * (dp if cfg.scale_lr else 1)
    # nanoGPT: decay the 2-D weights (matmuls, embeddings), not biases and LayerNorm gains.
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if mixed_tensors:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=False)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=cuda)


class Optimizers:
    """The optimizer, its LR scheduler and the fp16 loss scaler, stepped together."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
    ) -> None:
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, clip: Callable[[], None] | None) -> None:
        """Unscale and `clip` the gradients (when given), step, zero the gradients, advance the LR."""
        if clip is not None:
            self.scaler.unscale_(self.optimizer)
            clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    @property
    def last_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's and the scaler's state (the optimizer's own goes through DCP)."""
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
