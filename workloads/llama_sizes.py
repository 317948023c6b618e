"""Llama-3 model shapes, their exact parameter count and training FLOPs per token.

Importing this module does not import torch, so the launcher (`--dry-run`, `--plan`) and the
config checks can read a size without it. `workloads.llama` builds the model from a `LlamaSize`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LlamaSize", "LLAMA_SIZES", "RopeScaling", "ffn_hidden_dim"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (params.json `use_scaled_rope`, HF `rope_type: llama3`):
    wavelengths longer than original_max_seq_len / low_freq_factor are stretched by `factor`,
    shorter than original_max_seq_len / high_freq_factor are kept, the band between is blended."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU hidden width, Meta's rule (meta-llama/llama3 llama/model.py FeedForward, which
    torchtitan models/llama3 copies): 2/3 of 4·dim, times the multiplier, rounded up to a
    multiple of `multiple_of`."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LlamaSize:
    """A Llama-3 decoder shape: pre-norm RMSNorm blocks, grouped-query attention with RoPE, a
    SwiGLU feed-forward; no biases anywhere."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    """The output projection shares the token embedding's weight (Llama 3.2 1B/3B)."""
    max_seq_len: int = 8192
    """The longest sequence the RoPE table holds: Llama 3's pre-training context of 8,192 tokens
    before its long-context stage (Dubey et al. 2024, sections 3.4.1 and 3.4.2)."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} is odd; RoPE rotates pairs of channels")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    # The names GPT's ModelSize uses (workloads.config), so code that reads a size's shape (the
    # config checks, the FLOP count, the plan) takes either family.
    @property
    def n_layer(self) -> int:
        return self.n_layers

    @property
    def n_head(self) -> int:
        return self.n_heads

    @property
    def n_embd(self) -> int:
        return self.dim

    @property
    def block_size(self) -> int:
        return self.max_seq_len

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU feed-forward width."""
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def layer_params(self) -> int:
        """One transformer block: wq, wo (dim x dim), wk, wv (dim x kv_dim), w1, w2, w3
        (dim x hidden) and the two RMSNorm weights."""
        kv_dim = self.n_kv_heads * self.head_dim
        return 2 * self.dim * self.dim + 2 * self.dim * kv_dim + 3 * self.dim * self.hidden_dim + 2 * self.dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def n_params(self) -> int:
        """Every parameter, a tied weight once (what sum(p.numel() for p in model.parameters())
        gives, since parameters() yields a shared Parameter once)."""
        output = 0 if self.tie_embeddings else self.embedding_params
        return self.embedding_params + self.n_layers * self.layer_params + self.dim + output

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N + 12·L·H·Q·T.

        N counts the parameters that take part in a matmul: all of them but the embedding table,
        whose lookup is no matmul; a tied table is counted, since it is the output projection too.
        12·L·H·Q·T is the attention scores and the weighted sum of values (L layers, H query heads
        of width Q, sequence T), causal sparsity not subtracted. PaLM (Chowdhery et al. 2022)
        Appendix B; torchtitan models/utils.py get_dense_model_nparams_and_flops computes the same.
        Activation recomputation is not counted (MFU, not HFU).
        """
        matmul_params = self.n_params - (0 if self.tie_embeddings else self.embedding_params)
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len


# The published sizes. Every value below is the model's params.json / HF config.json as torchtitan
# quotes it in torchtitan/models/llama3/__init__.py (llama3_configs "1B", "8B", "70B"), and agrees
# with the Llama 3 paper (Dubey et al. 2024, arXiv:2407.21783) Table 3: 8B 32 layers, width 4096,
# FFN 14336, 32 heads, 8 KV heads; 70B 80 / 8192 / 28672 / 64 / 8; vocabulary 128,000 (the
# tokenizer's 128,000 plus 256 reserved special tokens = 128256); RoPE theta 500,000. The RoPE
# scaling is Llama 3.1's (meta-llama/Llama-3.1-8B config.json rope_scaling: factor 8, low 1, high 4,
# original 8192) and Llama 3.2's for 1B (meta-llama/Llama-3.2-1B config.json: factor 32,
# tie_word_embeddings true, intermediate_size 8192).
LLAMA_SIZES: dict[str, LlamaSize] = {
    # Trains in seconds on CPU; 4 heads and 2 KV heads so tp 2 divides both.
    "llama3-debug": LlamaSize(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=256
    ),
    "llama3-1b": LlamaSize(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.5,  # -> 8192
        rope_scaling=RopeScaling(factor=32.0),
        tie_embeddings=True,
    ),
    "llama3-8b": LlamaSize(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,  # -> 14336
        rope_scaling=RopeScaling(factor=8.0),
    ),
    "llama3-70b": LlamaSize(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,  # -> 28672
        rope_scaling=RopeScaling(factor=8.0),
    ),
}
