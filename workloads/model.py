"""A GPT-2-style decoder (after karpathy/nanoGPT model.py) and its FLOP count for MFU."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from workloads.config import ModelSize

__all__ = ["GPT", "Block", "cross_entropy", "flops_per_token", "mfu"]


class _Attention(nn.Module):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.head_dim = size.n_embd // size.n_head
        # Separate q, k, v (not one fused qkv): tensor parallelism shards each column-wise, so a
        # rank holds whole heads of all three.
        self.q = nn.Linear(size.n_embd, size.n_embd)
        self.k = nn.Linear(size.n_embd, size.n_embd)
        self.v = nn.Linear(size.n_embd, size.n_embd)
        self.proj = nn.Linear(size.n_embd, size.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them, or this rank's share under tensor parallelism.
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        # Flash attention where the backend has it; causal mask without materialising it.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(size.n_embd)
        self.attn = _Attention(size)
        self.ln2 = nn.LayerNorm(size.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(size.n_embd, 4 * size.n_embd), nn.GELU(), nn.Linear(4 * size.n_embd, size.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The layers are an nn.ModuleDict keyed by number, so a pipeline stage that holds some of
    them keeps their names (torchtitan's convention); a stage has the parts of other stages set
    to None (PP_PARTS), and its forward takes and returns hidden states where they are missing."""

    def __init__(self, size: ModelSize, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.size = size
        self.activation_checkpointing = activation_checkpointing
        self.wte = nn.Embedding(size.vocab_size, size.n_embd)
        self.wpe = nn.Embedding(size.block_size, size.n_embd)
        self.blocks = nn.ModuleDict({str(i): Block(size) for i in range(size.n_layer)})
        self.ln_f = nn.LayerNorm(size.n_embd)
        self.lm_head = nn.Linear(size.n_embd, size.vocab_size, bias=False)
        self.tie_weights()
        if not self.lm_head.weight.is_meta:
            self.init_weights()

    def tie_weights(self) -> None:
        """The head reuses the embedding matrix (Press & Wolf 2017), as GPT-2."""
        if self.lm_head is not None and self.wte is not None:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Fill every parameter (Llama's signature; GPT has no buffers to rebuild). Works on a
        pipeline stage and on sharded (DTensor) parameters, so a model built on the meta device
        is initialised after `to_empty`, each rank filling only what it holds."""
        self.tie_weights()  # to_empty or tensor parallelism may have replaced one side
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) (nanoGPT model.py).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.size.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once (tied weights once); without the position table by default,
        as nanoGPT counts N for its MFU estimate."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    # What a pipeline splits (workloads.parallel.ModelParts): the first stage embeds, the last
    # normalises and projects, with the embedding matrix it shares with the head.
    PP_PARTS = ("wte", "wpe"), "blocks", ("ln_f", "lm_head"), ("wte",)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy of `targets` given `idx` (both [batch, time]); without
        targets, the logits. A pipeline stage without the embedding takes hidden states, one
        without the head returns them."""
        if self.wpe is not None:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
        else:
            x = idx
        for block in self.blocks.values():
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else cross_entropy(logits, targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32 whatever the compute precision."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12·L·H·Q·T.

    6N: forward (2N) + backward (4N) of the matmuls over N non-embedding parameters; 12·L·H·Q·T:
    the attention scores and weighted sum (L layers, H heads, head dim Q, sequence T). PaLM
    (Chowdhery et al. 2022) Appendix B, as karpathy/nanoGPT `model.py:estimate_mfu` computes it.
    Activation recomputation is not counted (this is MFU, not HFU).
    """
    return 6.0 * n_params + 12.0 * n_layer * n_head * head_dim * seq_len


def mfu(flops_token: float, tokens_per_s: float, peak_flops: float | None) -> float | None:
    """Model FLOP utilisation in [0, 1] (None when the peak is unknown, e.g. on CPU)."""
    if not peak_flops:
        return None
    return flops_token * tokens_per_s / peak_flops
