"""attnlab.attention: fp64 gradients, fully masked rows, properties, input validation, dropout."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import attention

DT = torch.float64
NEG_INF = float("-inf")


def _randn(*shape, seed=0, requires_grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)
    return t.requires_grad_(requires_grad)


def plain_attention(q, k, v, *, allowed=None, bias=None, scale=None):
    """Independent fp64 formula: softmax(q k^T * scale + bias, masked) v, zero for empty rows."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf row -> NaN -> 0
    return weights @ v


# ----------------------------------------------------------------------------- gradcheck


def _gradcheck_cases():
    q, k, v = (3, 4), (5, 4), (5, 4)
    bool_mask = _randn(3, 5, seed=1) > -0.3
    bool_mask[:, 0] = True
    float_mask = _randn(3, 5, seed=2)
    float_mask[1, 2] = NEG_INF
    return {
        "no_mask": (q, k, v, {}),
        "bool_mask": (q, k, v, {"mask": bool_mask}),
        "float_mask": (q, k, v, {"mask": float_mask}),
        "mask_mod": (q, k, v, {"mask": lambda b, h, qi, ki: (qi + ki) % 3 != 1}),
        "causal_top_left_tq_lt_tk": (q, k, v, {"causal": True}),
        "causal_bottom_right_tq_lt_tk": (q, k, v, {"causal": True, "align": "bottom_right"}),
        "causal_top_left_tq_gt_tk": ((5, 4), (3, 4), (3, 4), {"causal": True}),
        "dv_ne_d": ((3, 4), (5, 4), (5, 2), {}),
        "rank3_scale": ((2, 3, 4), (2, 5, 4), (2, 5, 3), {"scale": 0.7}),
        "gqa": ((1, 4, 3, 2), (1, 2, 5, 2), (1, 2, 5, 3), {"causal": True}),
    }


@pytest.mark.parametrize("name", list(_gradcheck_cases()))
def test_gradcheck_reference_fp64(name):
    q_shape, k_shape, v_shape, kwargs = _gradcheck_cases()[name]
    q = _randn(*q_shape, seed=10, requires_grad=True)
    k = _randn(*k_shape, seed=11, requires_grad=True)
    v = _randn(*v_shape, seed=12, requires_grad=True)

    def fn(q, k, v):
        return attention(q, k, v, backend="reference", **kwargs)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- empty rows


def _empty_row_cases():
    bool_mask = torch.ones(4, 5, dtype=torch.bool)
    bool_mask[1] = False
    float_mask = torch.zeros(4, 5, dtype=DT)
    float_mask[2] = NEG_INF
    return {
        # (q rows, k rows, kwargs, rows that must be empty)
        "bool_mask_row": (4, 5, {"mask": bool_mask}, [1]),
        "float_-inf_row": (4, 5, {"mask": float_mask}, [2]),
        "mod_row": (4, 5, {"mask": lambda b, h, qi, ki: qi != 3}, [3]),
        "causal_bottom_right_tq_gt_tk": (5, 3, {"causal": True, "align": "bottom_right"}, [0, 1]),
    }


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("name", list(_empty_row_cases()))
def test_fully_masked_rows_give_zeros_and_zero_gradient(name, backend):
    tq, tk, kwargs, empty = _empty_row_cases()[name]
    q = _randn(tq, 4, seed=20, requires_grad=True)
    k = _randn(tk, 4, seed=21, requires_grad=True)
    v = _randn(tk, 3, seed=22, requires_grad=True)
    out = attention(q, k, v, backend=backend, **kwargs)
    assert not out.isnan().any()
    assert torch.equal(out[empty], torch.zeros(len(empty), 3, dtype=DT))
    alive = [i for i in range(tq) if i not in empty]
    assert (out[alive].abs().sum(-1) > 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert not t.grad.isnan().any()
    assert torch.equal(q.grad[empty], torch.zeros(len(empty), 4, dtype=DT))


def test_causal_top_left_with_more_queries_than_keys_has_no_empty_rows():
    q, k = _randn(5, 4, seed=23), _randn(3, 4, seed=24)
    _, weights = attention(q, k, k, causal=True, return_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, dtype=DT))
    assert torch.equal(weights > 0, torch.ones(5, 3, dtype=torch.bool).tril())


# ----------------------------------------------------------------------------- vs plain formula


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("masking", ["none", "bool", "float", "causal"])
def test_matches_plain_fp64_formula(rank, masking, backend):
    lead = {2: (), 3: (2,), 4: (2, 3)}[rank]
    q, k, v = _randn(*lead, 6, 8, seed=30), _randn(*lead, 7, 8, seed=31), _randn(*lead, 7, 5, seed=32)
    kwargs, allowed, bias = {}, None, None
    if masking == "bool":
        allowed = _randn(6, 7, seed=33) > -0.5
        kwargs["mask"] = allowed
    elif masking == "float":
        bias = _randn(6, 7, seed=34)
        kwargs["mask"] = bias
    elif masking == "causal":
        allowed = torch.ones(6, 7, dtype=torch.bool).tril()
        kwargs["causal"] = True
    expected = plain_attention(q, k, v, allowed=allowed, bias=bias)
    torch.testing.assert_close(attention(q, k, v, backend=backend, **kwargs), expected,
                               atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- properties


@st.composite
def qkv_and_mask(draw):
    tq, tk, d = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, tq, d, generator=gen, dtype=DT) * 3
    k = torch.randn(2, tk, d, generator=gen, dtype=DT) * 3
    v = torch.randn(2, tk, 3, generator=gen, dtype=DT)
    mask = torch.rand(2, tq, tk, generator=gen) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    return q, k, v, mask


@given(qkv_and_mask())
def test_weights_are_non_negative_and_rows_sum_to_one(case):
    q, k, v, keep = case
    _, weights = attention(q, k, v, mask=keep, return_weights=True)
    assert (weights >= 0).all()
    alive = keep.any(dim=-1)
    sums = weights.sum(dim=-1)
    assert torch.allclose(sums[alive], torch.ones_like(sums[alive]), atol=1e-6, rtol=0)
    assert torch.equal(sums[~alive], torch.zeros_like(sums[~alive]))


@given(qkv_and_mask(), st.randoms(use_true_random=False))
def test_permuting_queries_permutes_outputs(case, rnd):
    q, k, v, keep = case
    perm = list(range(q.shape[1]))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    out = attention(q, k, v, mask=keep)
    permuted = attention(q[:, perm], k, v, mask=keep[:, perm])
    torch.testing.assert_close(permuted, out[:, perm], atol=1e-12, rtol=0)


@given(qkv_and_mask(), st.randoms(use_true_random=False))
def test_permuting_keys_and_values_together_leaves_outputs_unchanged(case, rnd):
    q, k, v, keep = case
    perm = list(range(k.shape[1]))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    out = attention(q, k, v, mask=keep)
    permuted = attention(q, k[:, perm], v[:, perm], mask=keep[:, :, perm])
    torch.testing.assert_close(permuted, out, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- validation


def _bad_inputs():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    q4, k4 = torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4)
    return {
        # name: (args, kwargs, exception, regex that the message must match)
        "rank_6": ((torch.randn(1, 1, 1, 1, 3, 4), k, v), {}, ValueError, r"q.*rank.*\(1, 1, 1, 1, 3, 4\)"),
        "rank_1": ((q, torch.randn(4), v), {}, ValueError, r"k.*rank.*\(4,\)"),
        "mismatched_D": ((q, torch.randn(2, 5, 3), v), {}, ValueError, r"k.*D.*q \(2, 3, 4\).*k \(2, 5, 3\)"),
        "mismatched_Tk": ((q, k, torch.randn(2, 4, 6)), {}, ValueError, r"v.*Tk.*k \(2, 5, 4\).*v \(2, 4, 6\)"),
        "heads_not_divisible": ((q4, k4, k4), {}, ValueError, r"heads.*\(3\).*\(2\).*\(1, 3, 2, 4\)"),
        "mask_not_broadcastable": ((q, k, v), {"mask": torch.ones(3, 4, dtype=torch.bool)},
                                   ValueError, r"mask.*\(3, 4\).*\(2, 3, 5\)"),
        "dropout_negative": ((q, k, v), {"dropout_p": -0.1}, ValueError, r"dropout_p.*-0.1"),
        "dropout_one": ((q, k, v), {"dropout_p": 1.0}, ValueError, r"dropout_p.*1.0"),
        "integer_mask": ((q, k, v), {"mask": torch.ones(3, 5, dtype=torch.int64)}, TypeError,
                         r"mask.*torch.int64"),
        "mixed_dtypes": ((q, k.double(), v), {}, TypeError, r"dtype.*torch.float32.*torch.float64"),
        "mixed_devices": ((q, k.to("meta"), v), {}, ValueError, r"device.*cpu.*meta"),
        "mask_device": ((q, k, v), {"mask": torch.ones(3, 5, dtype=torch.bool, device="meta")},
                        ValueError, r"mask.*device.*meta"),
        "unknown_backend": ((q, k, v), {"backend": "nope"}, ValueError, r"backend.*'nope'"),
        "non_tensor": (([[1.0]], k, v), {}, TypeError, r"q.*torch.Tensor.*list"),
        "integer_q": ((torch.ones(3, 4, dtype=torch.int64), k[0], v[0]), {}, TypeError, r"q.*floating"),
        "bad_align": ((q, k, v), {"causal": True, "align": "middle"}, ValueError, r"align.*'middle'"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_input_raises_with_argument_and_shapes(name):
    args, kwargs, exc, pattern = _bad_inputs()[name]
    with pytest.raises(exc, match=pattern):
        attention(*args, **kwargs)


# ----------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keeps_one_minus_p_and_scales_survivors(p, backend):
    T = 512
    zeros = torch.zeros(1, 1, T, 1, dtype=DT)  # equal scores: every weight is 1/T
    eye = torch.eye(T, dtype=DT).view(1, 1, T, T)  # values = identity: out = dropped weights
    gen = torch.Generator().manual_seed(0)
    out = attention(zeros, zeros, eye, dropout_p=p, generator=gen, backend=backend)
    kept = out > 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / T / (1 - p)))


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_dropout_same_generator_seed_same_output(backend):
    q, k, v = _randn(2, 3, 9, 4, seed=40), _randn(2, 3, 9, 4, seed=41), _randn(2, 3, 9, 4, seed=42)

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return attention(q, k, v, dropout_p=0.3, generator=gen, backend=backend)

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


# ----------------------------------------------------------------------------- return_weights


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.4])
def test_return_weights_gives_per_head_weights_and_leaves_out_bitwise_unchanged(backend, dropout_p):
    q, k, v = _randn(2, 3, 6, 4, seed=50), _randn(2, 3, 7, 4, seed=51), _randn(2, 3, 7, 5, seed=52)

    def run(return_weights):
        gen = torch.Generator().manual_seed(3)
        return attention(q, k, v, causal=True, dropout_p=dropout_p, generator=gen, backend=backend,
                         return_weights=return_weights)

    out = run(False)
    out_with, weights = run(True)
    assert torch.equal(out, out_with)
    assert weights.shape == (2, 3, 6, 7)  # per head, never averaged
    for h in range(3):  # each head's weights from the plain formula, before dropout
        scores = q[:, h] @ k[:, h].transpose(-2, -1) / 2.0
        scores = scores.masked_fill(~torch.ones(6, 7, dtype=torch.bool).tril(), NEG_INF)
        torch.testing.assert_close(weights[:, h], torch.softmax(scores, dim=-1), atol=1e-12, rtol=0)
