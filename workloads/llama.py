"""A Llama-3-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Laid out as torchtitan's models/llama3 (`tok_embeddings`, `layers` keyed "0".."n-1", `norm`,
`output`; `attention.wq/wk/wv/wo`, `feed_forward.w1/w2/w3`) so tensor- and pipeline-parallel plans
can name its parts: a pipeline stage deletes the layers it does not own and sets `tok_embeddings`,
`norm` or `output` to None, and the FQNs of what remains do not change. Tensor parallelism may
shard the heads: attention infers its local head count from the projections' output width.

A big model is built on the meta device (`build_meta`), sharded there by the caller, and only then
given memory and initial values (`materialize`): no process ever holds the whole of a 70B model.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from workloads.llama_sizes import LLAMA_SIZES, LlamaSize, RopeScaling

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "TransformerBlock",
    "build_meta",
    "cross_entropy_loss",
    "flops_per_token",
    "materialize",
    "rope_frequencies",
]


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The rotation frequency of each channel pair (head_dim / 2 of them), with Llama 3.1's
    scaling when given (Meta's apply_scaling; torchtitan models/llama3/model/model.py
    precompute_freqs_cis computes the same with its RoPEScalingArgs)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return freqs.float()
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / scaling.factor, blended)
    return torch.where(wavelen < high_wavelen, freqs, scaled).float()


def _rope_table(size: LlamaSize, max_seq_len: int) -> torch.Tensor:
    """cos and sin of every (position, channel pair) angle: [max_seq_len, head_dim / 2, 2], fp32."""
    freqs = rope_frequencies(size.head_dim, size.rope_theta, size.rope_scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def _apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent channel pair (x0, x1) of x [batch, seq, heads, head_dim] by its angle:
    the complex product (x0 + i·x1)·e^{iθ} of Meta's reference, in real arithmetic (fp32)."""
    b, s, h, d = x.shape
    pairs = x.float().view(b, s, h, d // 2, 2)
    cos = table[:s, None, :, 0]
    sin = table[:s, None, :, 1]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, size: LlamaSize) -> None:
        super().__init__()
        self.head_dim = size.head_dim
        self.wq = nn.Linear(size.dim, size.n_heads * size.head_dim, bias=False)
        self.wk = nn.Linear(size.dim, size.n_kv_heads * size.head_dim, bias=False)
        self.wv = nn.Linear(size.dim, size.n_kv_heads * size.head_dim, bias=False)
        self.wo = nn.Linear(size.n_heads * size.head_dim, size.dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1, not n_heads: under tensor parallelism wq/wk/wv hold only this rank's heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = _apply_rope(q, rope), _apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        # SDPA repeats each KV head for its group of query heads (enable_gqa); the causal mask is
        # never materialised and flash attention keeps no seq x seq matrix.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, size: LlamaSize) -> None:
        super().__init__()
        self.w1 = nn.Linear(size.dim, size.hidden_dim, bias=False)
        self.w2 = nn.Linear(size.hidden_dim, size.dim, bias=False)
        self.w3 = nn.Linear(size.dim, size.hidden_dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + feed_forward(norm(h))."""

    def __init__(self, layer_id: int, size: LlamaSize) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(size.dim, eps=size.norm_eps)
        self.attention = Attention(size)
        self.ffn_norm = nn.RMSNorm(size.dim, eps=size.norm_eps)
        self.feed_forward = FeedForward(size)
        # Depth-scaled init of the projections into the residual stream (torchtitan depth_init).
        self.out_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab], or the mean loss given targets.

    Built on a real device, the model is initialised (`init_weights`) like GPT; built under
    `torch.device("meta")` it holds shapes only until `materialize`. A pipeline stage takes the
    previous stage's hidden states (floating point) where the first takes tokens (integers), and
    one without `norm`/`output` returns its hidden states.
    """

    def __init__(self, size: LlamaSize, max_seq_len: int | None = None, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.size = size
        self.max_seq_len = max_seq_len or size.max_seq_len
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(size.vocab_size, size.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, size) for i in range(size.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(size.dim, eps=size.norm_eps)
        self.output: nn.Linear | None = nn.Linear(size.dim, size.vocab_size, bias=False)
        self.tie_weights()
        # Derived from the size, so not saved: a checkpoint holds only what training changed.
        self.register_buffer("rope", _rope_table(size, self.max_seq_len), persistent=False)
        if not self.rope.is_meta:
            self.init_weights()

    def tie_weights(self) -> None:
        """The output projection reuses the embedding matrix, for sizes that tie them (again after
        anything that replaced one side's Parameter: to_empty, tensor parallelism)."""
        if self.size.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @property
    def PP_PARTS(self) -> tuple[tuple[str, ...], str, tuple[str, ...], tuple[str, ...]]:
        """What a pipeline splits, under the name GPT's class attribute has: the first stage's
        modules, the layers, the last stage's, and the first-stage module the last stage also holds
        (a tied embedding). A property here, since only the tied sizes have the last."""
        return (
            ("tok_embeddings",),
            "layers",
            ("norm", "output"),
            ("tok_embeddings",) if self.size.tie_embeddings else (),
        )

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once; without an untied embedding table by default, the N of the
        6N FLOP estimate (a tied table is the output matmul, so it stays)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.size.tie_embeddings and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Fill every parameter and the RoPE table; works on plain and on sharded (DTensor)
        parameters, module by module, so each rank initialises only what it holds.

        Embedding N(0, 1); wq/wk/wv/w1 N(0, 0.02) and wo/w2/w3 N(0, 0.02/sqrt(2(layer+1))), both
        trunc_normal_; output N(0, dim^-0.5) cut at 3 sigma; norms 1 (torchtitan models/llama3). A
        tied table gets the output's init (torchtitan skips the embedding's for the tied 1B).
        """
        device = torch.device(buffer_device) if buffer_device is not None else self.rope.device
        self.rope = _rope_table(self.size, self.max_seq_len).to(device)
        # to_empty may have replaced the shared Parameter on one side; tie again before filling.
        self.tie_weights()
        if self.tok_embeddings is not None and not self.size.tie_embeddings:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        # The output's init; a tied first pipeline stage holds the table without the head, and
        # gives it the head's init (the pipeline then copies it to the last stage's).
        head: nn.Module | None = self.output
        if head is None and self.size.tie_embeddings:
            head = self.tok_embeddings
        if head is not None:
            std = self.size.dim**-0.5
            nn.init.trunc_normal_(head.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the RoPE table's {self.max_seq_len}")
        # A tied last stage holds the embedding too: only token ids are embedded.
        embed = self.tok_embeddings is not None and not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if embed else tokens
        for layer in self.layers.values():
            if self.activation_checkpointing and self.training:
                h = checkpoint(layer, h, self.rope, use_reentrant=False)
            else:
                h = layer(h, self.rope)
        if self.output is None:
            return h
        logits = self.output(self.norm(h) if self.norm is not None else h)
        return logits if targets is None else cross_entropy_loss(logits, targets)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def build_meta(size: LlamaSize | str, max_seq_len: int | None = None, activation_checkpointing: bool = False) -> Llama:
    """The model with every tensor on the meta device: shapes only, no memory. Shard it (TP, PP,
    fully_shard), then `materialize` it."""
    if isinstance(size, str):
        size = LLAMA_SIZES[size]
    with torch.device("meta"):
        return Llama(size, max_seq_len, activation_checkpointing)


def materialize(model: Llama, device: torch.device | str) -> Llama:
    """Give a (possibly sharded) meta model memory on `device` and its initial values. Each rank
    allocates and fills only its own shards. Draws from torch's global RNG: seed it first.

    Whether sharded values equal the unsharded ones depends on the device: on CUDA, DTensor's
    offset-based RNG tracker coordinates the shards' random streams; on CPU there is no tracker
    (torch.distributed.tensor._random.is_rng_supported_mesh) and each rank fills its shard from its
    own generator. A CPU run that must start from the same weights in every layout materializes
    first and shards after: parallelize_module scatters rank 0's tensors (src_data_rank=0) and
    fully_shard keeps each rank's slice of identical tensors."""
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    return model


def flops_per_token(size: LlamaSize | str, seq_len: int) -> float:
    """Training FLOPs per token of a Llama size at `seq_len` (see LlamaSize.flops_per_token)."""
    if isinstance(size, str):
        size = LLAMA_SIZES[size]
    return size.flops_per_token(seq_len)
