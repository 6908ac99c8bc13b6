"""The tutorial modules' claims: equivalent formulations agree, shapes generalise, causality holds."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import attention
from attnlab.nn import MultiHeadAttention
from attnlab.lab.tutorial import (
    AttentionHead,
    CausalAttention,
    CrossAttention,
    MultiHeadAttentionWrapper,
    Projections,
    SelfAttention,
    SimpleSelfAttention,
    causal_average,
    cross_attention,
    multi_head_attention,
    score_variance,
    softmax_peakiness,
)
from attnlab.nn import QKV

DT = torch.float64


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


# ------------------------------------------------------------------ masking: two ways, one answer


@pytest.mark.parametrize("T", [1, 2, 6, 17])
def test_mask_after_softmax_then_renormalise_equals_mask_before_softmax(T):
    q, k = _randn(T, 4, seed=1), _randn(T, 4, seed=2)
    full = torch.softmax(q @ k.T / math.sqrt(4), dim=-1)  # "Clear Tutorial" and "Causal Self Attention", first way
    kept = full * torch.tril(torch.ones(T, T, dtype=DT))
    renormalised = kept / kept.sum(dim=-1, keepdim=True)
    _, weights = attention(q, k, k, causal=True, return_weights=True)  # mask before softmax
    torch.testing.assert_close(weights, renormalised, atol=1e-12, rtol=0)


# ------------------------------------------------------------------ "Mathematical trick"'s averaging trick


@pytest.mark.parametrize("shape", [(8, 2), (4, 8, 2), (1, 1, 3), (3, 17, 5)])
def test_causal_average_methods_agree_with_cumulative_mean(shape):
    x = _randn(*shape, seed=3)
    T = shape[-2]
    counts = torch.arange(1, T + 1, dtype=DT).unsqueeze(-1)  # (T, 1)
    expected = x.cumsum(dim=-2) / counts  # independent formula: running sum / count
    for method in ("loop", "matmul", "softmax"):
        torch.testing.assert_close(causal_average(x, method=method), expected, atol=1e-12, rtol=0)


def test_causal_average_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        causal_average(torch.zeros(3, 2), method="cumsum")


# ------------------------------------------------------------------ scaling ("Mathematical trick")


def test_score_variance_matches_the_sum_of_head_size_products():
    # q.k sums head_size products of independent unit normals: variance head_size; scaled: 1.
    gen = torch.Generator().manual_seed(0)
    v = score_variance(16, batch=64, tokens=64, generator=gen)
    assert abs(v.q - 1) < 0.05 and abs(v.k - 1) < 0.05
    assert abs(v.unscaled / 16 - 1) < 0.1
    assert abs(v.scaled - 1) < 0.1
    assert v.unscaled == pytest.approx(16 * v.scaled, rel=1e-5)


def test_softmax_peakiness_matches_exp_formula_and_sharpens():
    logits = torch.tensor([0.1, -0.2, 0.3, -0.2, 0.5], dtype=DT)
    soft, peaky = softmax_peakiness(logits, factor=8.0)
    torch.testing.assert_close(soft, logits.exp() / logits.exp().sum())
    torch.testing.assert_close(peaky, (8 * logits).exp() / (8 * logits).exp().sum())
    assert peaky.max() > 0.75 > soft.max()
    assert peaky.argmax() == soft.argmax() == 4


# ------------------------------------------------------------------ three multi-head forms agree


def _fused_like_wrapper(wrapper: MultiHeadAttentionWrapper, d_in: int, causal: bool):
    heads = list(wrapper.heads)
    H, d_head = len(heads), heads[0].d_out_kq
    mha = MultiHeadAttention(d_in, H * d_head, num_heads=H, pattern=("causal" if causal else None)).double()
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            # head h's (d_in, d_head) matrix, used as x @ W, is rows h*d_head.. of nn.Linear's W
            stacked = torch.cat([getattr(h, name).T for h in heads], dim=0)  # (H*d_head, d_in)
            getattr(Projections(mha), name).weight.copy_(stacked)
        mha.out_proj.weight.copy_(torch.eye(H * d_head, dtype=DT))
        mha.out_proj.bias.zero_()
    return mha


def test_projections_are_live_views_of_the_module_under_the_tutorials_names():
    torch.manual_seed(3)
    mha = MultiHeadAttention(4, 6, num_heads=2, qkv=QKV(num_kv_heads=1, bias=True))
    W = Projections(mha)
    assert [getattr(W, n).weight.shape for n in ("W_query", "W_key", "W_value")] == [(6, 4), (3, 4), (3, 4)]
    with torch.no_grad():
        W.W_value.weight.fill_(2.0)  # an in-place edit of the view edits the fused parameter
    assert mha.in_proj_weight[9:].eq(2.0).all() and mha.in_proj_weight[:9].ne(2.0).all()
    mha.double()  # the parameters' storage is replaced; the view reads the module afresh
    x = torch.randn(5, 4, dtype=DT)
    assert W.W_key.weight.dtype == DT
    torch.testing.assert_close(W.W_key(x), x @ mha.in_proj_weight[6:9].T + mha.in_proj_bias[6:9])


def test_projections_of_a_cross_attention_module_and_of_something_else():
    mha = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(kdim=5, vdim=3))
    W = Projections(mha)
    assert W.W_key.weight is mha.k_proj_weight and W.W_value.weight is mha.v_proj_weight
    assert W.W_query.bias is None
    with pytest.raises(TypeError, match="module must be an attnlab.nn.MultiHeadAttention, got MultiheadAttention"):
        Projections(torch.nn.MultiheadAttention(8, 2))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])
def test_wrapper_fused_and_functional_multihead_agree(causal, batched):
    torch.manual_seed(0)
    H, d_in, d_head, T = 3, 5, 4, 7
    wrapper = MultiHeadAttentionWrapper(d_in, d_head, d_head, H, causal=causal).double()
    x = _randn(2, T, d_in, seed=4) if batched else _randn(T, d_in, seed=4)
    from_wrapper = wrapper(x)  # (..., T, H*d_head)

    fused = _fused_like_wrapper(wrapper, d_in, causal)(x)

    W = {n: torch.stack([getattr(h, n).T for h in wrapper.heads]) for n in ("W_query", "W_key", "W_value")}
    per_head = multi_head_attention(x, W["W_query"], W["W_key"], W["W_value"], causal=causal)
    functional = per_head.transpose(-3, -2).flatten(-2)  # (..., H, T, d) -> (..., T, H*d)

    torch.testing.assert_close(fused, from_wrapper, atol=1e-12, rtol=0)
    torch.testing.assert_close(functional, from_wrapper, atol=1e-12, rtol=0)


def test_functional_forms_use_query_weights_for_queries():
    # "Self-Attention recap"'s calc_attn/cross_attn swap W_Q and W_K; the scores q.k^T are not symmetric
    # in the swap, so a test against the plain formula catches it.
    x1, x2 = _randn(4, 3, seed=5), _randn(6, 3, seed=6)
    W_q, W_k, W_v = _randn(2, 3, seed=7), _randn(2, 3, seed=8), _randn(5, 3, seed=9)
    expected = torch.softmax((x1 @ W_q.T) @ (x2 @ W_k.T).T / math.sqrt(2), dim=-1) @ (x2 @ W_v.T)
    torch.testing.assert_close(cross_attention(x1, x2, W_q, W_k, W_v), expected)
    swapped = torch.softmax((x1 @ W_k.T) @ (x2 @ W_q.T).T / math.sqrt(2), dim=-1) @ (x2 @ W_v.T)
    assert not torch.allclose(expected, swapped)


def test_functional_multihead_scales_by_its_own_head_dim():
    # "Self-Attention recap"'s multi_head_attn divides by a global d_k; here d_k comes from the weights.
    x = _randn(5, 3, seed=10)
    W_q, W_k, W_v = _randn(2, 7, 3, seed=11), _randn(2, 7, 3, seed=12), _randn(2, 2, 3, seed=13)
    q, k, v = x @ W_q.transpose(-2, -1), x @ W_k.transpose(-2, -1), x @ W_v.transpose(-2, -1)
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(7), dim=-1) @ v  # (2, 5, 2)
    torch.testing.assert_close(multi_head_attention(x, W_q, W_k, W_v), expected)


# ------------------------------------------------------------------ unbatched == batch of one


def _modules():
    torch.manual_seed(0)
    return {
        "simple": (SimpleSelfAttention(), 1),
        "self_uniform": (SelfAttention(4, 3, 5, init="uniform"), 1),
        "self_linear": (SelfAttention(4, 3, qkv_bias=True), 1),
        "causal": (CausalAttention(4, 3, context_length=9, dropout_p=0.3).eval(), 1),
        "cross": (CrossAttention(4, 3, 2), 2),
        "wrapper": (MultiHeadAttentionWrapper(4, 3, 2, 3, causal=True), 1),
        "fused": (MultiHeadAttention(4, 6, 9, 0.0, 2), 1),
    }


@pytest.mark.parametrize("name", list(_modules()))
def test_unbatched_equals_batch_of_one(name):
    module, n_inputs = _modules()[name]
    inputs = [_randn(9 - 2 * i, 4, seed=20 + i).float() for i in range(n_inputs)]
    unbatched = module(*inputs)
    batched = module(*[t.unsqueeze(0) for t in inputs])
    torch.testing.assert_close(batched[0], unbatched, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["self_uniform", "self_linear", "cross", "wrapper"])
def test_batch_rows_are_independent(name):
    module, n_inputs = _modules()[name]
    inputs = [_randn(3, 7, 4, seed=30 + i).float() for i in range(n_inputs)]
    together = module(*inputs)
    for b in range(3):
        torch.testing.assert_close(together[b], module(*[t[b] for t in inputs]), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ causality


def _causal_functions():
    torch.manual_seed(1)
    causal = CausalAttention(4, 3, context_length=10).double()
    mha = MultiHeadAttention(4, 6, 10, 0.0, 3).double()
    wrapper = MultiHeadAttentionWrapper(4, 3, 2, 2, causal=True).double()
    return {
        "CausalAttention": causal,
        "MultiHeadAttention": mha,
        "MultiHeadAttentionWrapper": wrapper,
        "attention(causal=True)": lambda x: attention(x, x, x, causal=True),
        "causal_average": lambda x: causal_average(x, method="softmax"),
    }


@pytest.mark.parametrize("name", list(_causal_functions()))
@pytest.mark.parametrize("t", [0, 3, 9])
def test_future_tokens_never_change_earlier_outputs(name, t):
    fn = _causal_functions()[name]
    x = _randn(2, 10, 4, seed=40)
    changed = x.clone()
    changed[:, t + 1:] = _randn(2, 9 - t, 4, seed=41) * 10  # new future, same past
    before, after = fn(x), fn(changed)
    torch.testing.assert_close(after[:, : t + 1], before[:, : t + 1], atol=1e-12, rtol=0)
    if t < 9:
        assert not torch.allclose(after[:, t + 1:], before[:, t + 1:])


def test_causal_attention_rejects_inputs_longer_than_context_length():
    module = CausalAttention(3, 2, context_length=4)
    with pytest.raises(ValueError, match=r"5 tokens.*context_length=4"):
        module(torch.randn(2, 5, 3))


def test_causal_attention_dropout_only_in_training():
    torch.manual_seed(2)
    module = CausalAttention(3, 2, context_length=8, dropout_p=0.5)
    x = torch.randn(2, 8, 3)
    module.eval()
    no_dropout = AttentionHead(3, 2, causal=True)
    no_dropout.load_state_dict(module.state_dict())
    torch.testing.assert_close(module(x), no_dropout(x))  # eval: dropout off
    module.train()
    assert not torch.allclose(module(x), no_dropout(x))


# ------------------------------------------------------------------ cross-attention


def test_cross_attention_lengths_may_differ_and_self_is_a_special_case():
    torch.manual_seed(3)
    cross = CrossAttention(3, 2, 4, init="linear")
    x1, x2 = torch.randn(6, 3), torch.randn(8, 3)
    assert cross(x1, x2).shape == (6, 4)
    as_self = AttentionHead(3, 2, 4)
    as_self.load_state_dict(cross.state_dict())
    torch.testing.assert_close(cross(x1, x1), as_self(x1))  # context = x: self-attention


def test_cross_attention_feature_mismatch_names_both_shapes():
    cross = CrossAttention(3, 2, 4)
    with pytest.raises(ValueError, match=r"x \(6, 3\) and context \(8, 5\)"):
        cross(torch.randn(6, 3), torch.randn(8, 5))


def test_modules_reject_wrong_feature_dim():
    with pytest.raises(ValueError, match=r"d_in=3.*\(4, 5\)"):
        SelfAttention(3, 2)(torch.randn(4, 5))


def test_uniform_init_has_no_bias():
    with pytest.raises(ValueError, match="qkv_bias"):
        SelfAttention(3, 2, qkv_bias=True, init="uniform")
