"""The Llama-3 decoder and its sizes: shapes, causality, GQA, counts, meta build, training."""

from __future__ import annotations

import gc
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from workloads.llama import (
    Llama,
    _apply_rope,
    build_meta,
    cross_entropy_loss,
    flops_per_token,
    materialize,
    rope_frequencies,
)
from workloads.llama_sizes import LLAMA_SIZES, LlamaSize, RopeScaling, ffn_hidden_dim

DEBUG = LLAMA_SIZES["llama3-debug"]


@pytest.fixture(autouse=True)
def one_thread():
    """The debug model's matmuls are tiny: extra threads only fight the other tests for cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _debug_model(seed: int = 0, size: LlamaSize = DEBUG) -> Llama:
    torch.manual_seed(seed)
    return materialize(build_meta(size), "cpu")


def test_logits_have_one_row_per_token_and_one_column_per_vocabulary_entry():
    tokens = torch.randint(0, DEBUG.vocab_size, (3, 17))
    assert _debug_model()(tokens).shape == (3, 17, DEBUG.vocab_size)


def test_a_future_token_does_not_change_the_logits_of_the_past():
    model = _debug_model()
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % DEBUG.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_grouped_query_attention_equals_full_attention_with_each_kv_head_repeated():
    """2 KV heads for 4 query heads: query heads 0,1 read KV head 0 and heads 2,3 read KV head 1."""
    attn = _debug_model().layers["0"].attention
    x = torch.randn(2, 10, DEBUG.dim)
    rope = torch.stack(
        (torch.ones(10, DEBUG.head_dim // 2), torch.zeros(10, DEBUG.head_dim // 2)), dim=-1
    )  # angle 0: RoPE is the identity, so the reference needs none
    q = attn.wq(x).view(2, 10, 4, -1).transpose(1, 2)
    k = attn.wk(x).view(2, 10, 2, -1).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 10, 2, -1).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(DEBUG.head_dim)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, -1))
    torch.testing.assert_close(attn(x, rope), expected)


def test_attention_runs_on_a_head_sharded_slice_as_tensor_parallelism_leaves_it():
    """Rank 0 of tp 2 holds query heads 0-1 and KV head 0 and the matching columns of wo; the
    two ranks' outputs sum to the whole layer's (what RowwiseParallel's all-reduce does)."""
    model = _debug_model()
    attn = model.layers["0"].attention
    x = torch.randn(2, 6, DEBUG.dim)
    rope = model.rope
    hd = DEBUG.head_dim
    total = torch.zeros(2, 6, DEBUG.dim)
    for rank in range(2):
        part = type(attn)(DEBUG)
        part.wq.weight = torch.nn.Parameter(attn.wq.weight[rank * 2 * hd : (rank + 1) * 2 * hd])
        part.wk.weight = torch.nn.Parameter(attn.wk.weight[rank * hd : (rank + 1) * hd])
        part.wv.weight = torch.nn.Parameter(attn.wv.weight[rank * hd : (rank + 1) * hd])
        part.wo.weight = torch.nn.Parameter(attn.wo.weight[:, rank * 2 * hd : (rank + 1) * 2 * hd])
        total += part(x, rope)
    torch.testing.assert_close(total, attn(x, rope))


def test_rope_rotates_pairs_so_scores_depend_only_on_relative_position():
    table = build_meta(DEBUG).rope  # meta: shape only
    assert table.shape == (DEBUG.max_seq_len, DEBUG.head_dim // 2, 2)
    table = _debug_model().rope
    q, k = torch.randn(1, 1, 1, DEBUG.head_dim), torch.randn(1, 1, 1, DEBUG.head_dim)

    def score(i: int, j: int) -> torch.Tensor:
        qi = _apply_rope(q.expand(1, 40, 1, -1).contiguous(), table)[0, i, 0]
        kj = _apply_rope(k.expand(1, 40, 1, -1).contiguous(), table)[0, j, 0]
        return qi @ kj

    torch.testing.assert_close(score(5, 2), score(35, 32))
    torch.testing.assert_close(score(0, 0), (q @ k.transpose(-1, -2)).squeeze())


def test_llama31_rope_scaling_keeps_high_frequencies_and_stretches_low_ones():
    scaling = RopeScaling(factor=8.0)
    plain = rope_frequencies(128, 500000.0, None)
    scaled = rope_frequencies(128, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    short = wavelen < 8192 / 4
    long_ = wavelen > 8192 / 1
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long_], plain[long_] / 8)
    middle = ~short & ~long_
    assert middle.any() and ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()
    assert plain[0] == 1.0 and math.isclose(plain[1].item(), 500000.0 ** (-2 / 128), rel_tol=1e-6)


@pytest.mark.parametrize(
    "name, hidden",
    [("llama3-1b", 8192), ("llama3-8b", 14336), ("llama3-70b", 28672)],
)
def test_published_ffn_widths_follow_from_the_multiplier_rule(name, hidden):
    assert LLAMA_SIZES[name].hidden_dim == hidden


def test_ffn_rule_by_hand():
    # 8B: int(2 * 16384 / 3) = 10922; int(1.3 * 10922) = 14198; up to a multiple of 1024 -> 14336.
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336
    # No multiplier: int(2 * 256 / 3) = 170 -> 192 (multiple of 32).
    assert ffn_hidden_dim(64, 32, None) == 192


@pytest.mark.parametrize(
    "name, exact",
    [
        # Hand sums (per layer: 2·d² + 2·d·kv_dim + 3·d·hidden + 2·d; plus V·d once or twice, + d):
        # 1B: 16 x 60,821,504 + 262,668,288 (tied: once) + 2048 = 1,235,814,400 (HF: 1.24B)
        ("llama3-1b", 1_235_814_400),
        # 8B: 32 x 218,112,000 + 2 x 525,336,576 + 4096 = 8,030,261,248 (HF: 8.03B)
        ("llama3-8b", 8_030_261_248),
        # 70B: 80 x 855,654,400 + 2 x 1,050,673,152 + 8192 = 70,553,706,496 (HF: 70.6B)
        ("llama3-70b", 70_553_706_496),
    ],
)
def test_published_sizes_have_their_published_parameter_counts(name, exact):
    assert LLAMA_SIZES[name].n_params == exact


@pytest.mark.parametrize("name", ["llama3-debug", "llama3-8b"])
def test_the_count_matches_the_built_model(name):
    model = build_meta(name) if name != "llama3-debug" else _debug_model()
    assert sum(p.numel() for p in model.parameters()) == LLAMA_SIZES[name].n_params


def test_a_meta_build_of_8b_allocates_nothing_and_keeps_torchtitan_names():
    model = build_meta("llama3-8b")
    assert all(p.is_meta for p in model.parameters())
    names = {n for n, _ in model.named_parameters()}
    assert {
        "tok_embeddings.weight",
        "layers.31.attention.wq.weight",
        "layers.31.attention.wk.weight",
        "layers.0.feed_forward.w3.weight",
        "layers.0.attention_norm.weight",
        "norm.weight",
        "output.weight",
    } <= names
    assert model.layers["0"].attention.wk.weight.shape == (8 * 128, 4096)


def test_materialize_gives_finite_values_with_the_intended_spread():
    model = _debug_model(seed=3)
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
    assert torch.equal(model.norm.weight, torch.ones(DEBUG.dim))
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.15
    assert abs(model.layers["0"].attention.wq.weight.std().item() - 0.02) < 0.003
    assert model.layers["1"].feed_forward.w2.weight.std() < model.layers["0"].feed_forward.w2.weight.std()
    assert model.output.weight.abs().max() <= 3 * DEBUG.dim**-0.5 + 1e-6
    torch.testing.assert_close(model.rope, Llama(DEBUG).rope)


def test_the_same_seed_gives_the_same_weights():
    a, b = _debug_model(seed=7), _debug_model(seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.output.weight, _debug_model(seed=8).output.weight)


def test_1b_ties_the_output_to_the_embedding_and_materialize_keeps_the_tie():
    tiny_tied = LlamaSize(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=50, tie_embeddings=True)
    model = _debug_model(size=tiny_tied)
    assert model.output.weight is model.tok_embeddings.weight
    # The tied table gets the output's init: truncated at 3 / sqrt(dim).
    assert model.tok_embeddings.weight.abs().max() <= 3 * 32**-0.5 + 1e-6
    one_b = build_meta("llama3-1b")
    assert one_b.output.weight is one_b.tok_embeddings.weight
    assert sum(p.numel() for p in one_b.parameters()) == LLAMA_SIZES["llama3-1b"].n_params


def test_a_pipeline_stage_without_embedding_norm_or_output_passes_hidden_states_through():
    """Split the debug model in two stages as a pipeline does; the stages chained give the
    whole model's logits, and the parameter names stay those of the whole model."""
    whole = _debug_model()
    first, last = _debug_model(), _debug_model()
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    assert "layers.1.attention.wq.weight" in dict(last.named_parameters())
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 9))
    hidden = first(tokens)
    assert hidden.shape == (2, 9, DEBUG.dim)
    torch.testing.assert_close(last(hidden), whole(tokens))


def test_the_debug_model_learns_in_a_few_adamw_steps():
    torch.manual_seed(0)
    model = _debug_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A learnable task: each sequence counts up from a random start (next token = this + 1).
    start = torch.randint(0, DEBUG.vocab_size, (16, 1))
    seq = (start + torch.arange(33)) % DEBUG.vocab_size
    inputs, targets = seq[:, :-1], seq[:, 1:]
    losses = []
    for _ in range(30):
        loss = cross_entropy_loss(model(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(DEBUG.vocab_size) - 1.0
    assert losses[-1] < 0.5 * losses[0], losses


def test_built_on_a_real_device_the_model_is_initialised_like_gpt():
    """Llama(size) on CPU, as GPT(size): our init, not nn.Linear's default (std 1/sqrt(3 x 64))."""
    torch.manual_seed(0)
    model = Llama(DEBUG)
    assert abs(model.layers["0"].attention.wq.weight.std().item() - 0.02) < 0.003
    assert model.output.weight.abs().max() <= 3 * DEBUG.dim**-0.5 + 1e-6


def test_given_targets_the_forward_returns_the_mean_loss():
    model = _debug_model()
    tokens, targets = torch.randint(0, DEBUG.vocab_size, (2, 2, 8))
    torch.testing.assert_close(model(tokens, targets), cross_entropy_loss(model(tokens), targets))


def test_activation_checkpointing_gives_the_same_gradients():
    tokens, targets = torch.randint(0, DEBUG.vocab_size, (2, 2, 8))
    grads = []
    for ac in (False, True):
        torch.manual_seed(0)
        model = materialize(build_meta(DEBUG, activation_checkpointing=ac), "cpu")
        model(tokens, targets).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_a_tied_last_stage_holds_the_embedding_but_embeds_nothing():
    """With tied weights the pipeline's last stage keeps tok_embeddings (its output's weight) and
    receives hidden states: floating point input is never looked up."""
    tied = LlamaSize(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=50, tie_embeddings=True)
    whole = _debug_model(size=tied)
    first, last = _debug_model(size=tied), _debug_model(size=tied)
    assert whole.PP_PARTS == (("tok_embeddings",), "layers", ("norm", "output"), ("tok_embeddings",))
    assert build_meta("llama3-8b").PP_PARTS[3] == ()
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    tokens = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(last(first(tokens)), whole(tokens))


def test_num_params_gives_gpts_flop_formula_the_same_n():
    """workloads.model.flops_per_token(N, L, H, Q, T) with the model's num_params() and the size's
    GPT-style names is the Llama count: the trainer's MFU needs nothing model-specific."""
    from workloads.model import flops_per_token as gpt_flops

    for name in ("llama3-8b", "llama3-1b"):
        size, model = LLAMA_SIZES[name], build_meta(name)
        n = model.num_params()
        assert n == size.n_params - (0 if size.tie_embeddings else size.embedding_params)
        assert gpt_flops(n, size.n_layer, size.n_head, size.n_embd // size.n_head, 4096) == flops_per_token(size, 4096)
    assert LLAMA_SIZES["llama3-70b"].block_size == 8192


def test_cross_entropy_is_computed_in_fp32():
    logits = torch.randn(2, 3, 11).bfloat16()
    targets = torch.randint(0, 11, (2, 3))
    expected = F.cross_entropy(logits.float().view(6, 11), targets.view(6))
    assert cross_entropy_loss(logits, targets).dtype == torch.float32
    torch.testing.assert_close(cross_entropy_loss(logits, targets), expected)


def test_a_sequence_longer_than_the_rope_table_is_refused():
    with pytest.raises(ValueError, match="300 tokens is longer than the RoPE table's 256"):
        _debug_model()(torch.zeros(1, 300, dtype=torch.long))


def test_flops_per_token_by_hand():
    # 8B, T = 8192: the embedding (525,336,576) is no matmul; the output projection is.
    # 6 x (8,030,261,248 - 525,336,576) = 45,029,548,032; 12 x 32 x 32 x 128 x 8192 = 12,884,901,888.
    assert flops_per_token("llama3-8b", 8192) == 45_029_548_032 + 12_884_901_888
    # Tied 1B: the shared table is the output matmul, so every parameter counts.
    # 6 x 1,235,814,400 = 7,414,886,400; 12 x 16 x 32 x 64 x 2048 = 805,306,368.
    assert flops_per_token(LLAMA_SIZES["llama3-1b"], 2048) == 7_414_886_400 + 805_306_368


def test_sizes_module_does_not_import_torch():
    code = "import sys, workloads.llama_sizes; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dim": 60, "n_heads": 8, "n_kv_heads": 2}, "dim 60 is not divisible by n_heads 8"),
        ({"dim": 64, "n_heads": 4, "n_kv_heads": 3}, "n_heads 4 is not divisible by n_kv_heads 3"),
    ],
)
def test_an_impossible_shape_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LlamaSize(n_layers=1, vocab_size=10, **kwargs)


def _tp_fsdp_worker() -> None:
    """Under torchrun, 2 ranks: tp 2 (Colwise wq/wk/wv/w1/w3, Rowwise wo/w2, as torchtitan's plan)
    under fully_shard over a dp_shard of 1 (2-D parameters, as a bigger mesh makes them). Prints
    the loss of a fixed batch and, from a meta build sharded then materialized, the local shape of
    one projection."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def shard(model: Llama, mesh) -> Llama:
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(model, mesh["tp"], plan)
        for layer in model.layers.values():
            names = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
            layer_plan = {n: ColwiseParallel() for n in names}
            layer_plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
            parallelize_module(layer, mesh["tp"], layer_plan)
            fully_shard(layer, mesh=mesh["dp_shard"])
        return fully_shard(model, mesh=mesh["dp_shard"])

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "tp"))
        torch.manual_seed(0)
        # Materialized before sharding: every layout starts from rank 0's weights.
        model = shard(materialize(build_meta(DEBUG), "cpu"), mesh)
        tokens = torch.randint(0, DEBUG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = cross_entropy_loss(model(tokens), tokens)
        loss.backward()
        meta = materialize(shard(build_meta(DEBUG), mesh), "cpu")
        local = meta.layers["0"].attention.wq.weight.to_local()
        finite = all(bool(torch.isfinite(p.full_tensor()).all()) for p in meta.parameters())
        if dist.get_rank() == 0:
            print(f"RESULT {loss.item():.10f} {tuple(local.shape)} {finite}", flush=True)
        # As workloads.train.main leaves: every rank past its last collective, the sharded models
        # (their state holds the group) freed, then the group; a rank that tears its gloo pairs
        # down while its peer is still in a collective aborts in C++ ("terminate called without
        # an active exception", torch 2.13 on CPU).
        dist.barrier()
        del model, meta, local
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_and_fsdp_on_gloo_give_the_one_process_loss(tmp_path):
    from tests.workloads.conftest import child_env, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", __file__]
    run = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    _, loss, *rest = next(line for line in run.stdout.splitlines() if line.startswith("RESULT")).split(" ", 2)
    shape, finite = rest[0].rsplit(" ", 1)
    torch.manual_seed(0)
    model = materialize(build_meta(DEBUG), "cpu")
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    assert float(loss) == pytest.approx(cross_entropy_loss(model(tokens), tokens).item(), rel=1e-5)
    # wq: 4 heads x 16 = 64 rows; each tp rank keeps 2 heads (32 rows).
    assert shape == "(32, 64)" and finite == "True"


if __name__ == "__main__":
    _tp_fsdp_worker()
