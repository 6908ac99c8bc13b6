"""Score mods and sinks (attnlab.scores, attention(score_mod=, sinks=)) against fp64 written here.

Each mod is compared, forward and backward (q, k, v and every learnable part), with an eager
fp64 computation written in this file from the models' own formulas (Gemma 2's softcap, BLOOM's
ALiBi, T5's bucketing as transformers computes it, gpt-oss's sink column), on every backend that
serves the call; torch.autograd.gradcheck checks the tiled backward independently.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import scores
from attnlab.backends import why
from attnlab.backends.chunked import chunked_attention
from attnlab._call import build_call
from attnlab.lab.verify import allowed_error
from attnlab.nn import QKV

F64 = torch.float64


def _qkv(B=2, Hq=4, Hkv=2, Tq=13, Tk=17, D=8, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(B, Hq, Tq, D), make(B, Hkv, Tk, D), make(B, Hkv, Tk, D)


def _eager(q, k, v, *, mod_fn=None, sinks=None, allowed=None, scale=None):
    """Textbook attention in fp64: scores, mod_fn(scores), mask, softmax with a sink column."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale  # (B, H, Tq, Tk)
    if mod_fn is not None:
        s = mod_fn(s)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # gpt-oss's eager: one more column, softmax, the column dropped
        column = sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, column], dim=-1)
    dead = (s == float("-inf")).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


def _positions(Tq, Tk, offset=0):
    i = torch.arange(Tq)[:, None] + offset
    j = torch.arange(Tk)[None, :]
    return i, j


def _t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """T5's _relative_position_bucket, from transformers when installed."""
    transformers = pytest.importorskip("transformers")
    T5Attention = transformers.models.t5.modeling_t5.T5Attention
    return T5Attention._relative_position_bucket(relative_position, bidirectional=bidirectional,
                                                 num_buckets=num_buckets, max_distance=max_distance)


def _leaves(*tensors):
    return [t for t in tensors if t is not None and t.requires_grad]


def _assert_close(got, want, what):
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= 1e-10 * max(1.0, want.abs().max().item() if want.numel() else 0.0), f"{what}: {err}"


def _serving(call_kwargs, q, k, v):
    """Backends that serve the call (reference, chunked, and sdpa when additive)."""
    names = []
    for name in ("reference", "chunked", "sdpa", "blocks", "flex"):
        try:
            attnlab.attention(q.detach(), k.detach(), v.detach(), backend=name, **call_kwargs)
            names.append(name)
        except ValueError:
            pass
    return names


def _check_all(q, k, v, kwargs, want, extra):
    """Forward and every gradient of ``attention(**kwargs)`` on each serving backend vs ``want``."""
    leaves = _leaves(q, k, v, *extra)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    served = _serving(kwargs, q, k, v)
    for name in served:
        out = attnlab.attention(q, k, v, backend=name, **kwargs)
        _assert_close(out, want, f"{name} forward")
        for g, w in zip(torch.autograd.grad(out, leaves, grad_out), want_grads):
            _assert_close(g, w, f"{name} gradient")
    return served


MASKINGS = [dict(), dict(causal=True), dict(causal=True, align="bottom_right")]


@pytest.mark.parametrize("masking", MASKINGS)
def test_softcap_matches_gemma_formula(masking):
    q, k, v = _qkv()
    q = (q.detach() * 6).requires_grad_()  # scores past the cap
    kwargs = dict(score_mod=scores.softcap(2.5), **masking)
    allowed = None
    if masking:
        allowed = attnlab.masks.causal_mask(13, 17, align=masking.get("align", "top_left"))
    want = _eager(q, k, v, mod_fn=lambda s: 2.5 * torch.tanh(s / 2.5), allowed=allowed)
    assert _check_all(q, k, v, kwargs, want, ()) == ["reference", "chunked"]


@pytest.mark.parametrize("symmetric", [False, True])
def test_alibi_with_learnable_slopes(symmetric):
    q, k, v = _qkv()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64, requires_grad=True)
    i, j = _positions(13, 17, offset=4)
    distance = (i - j).abs() if symmetric else (i - j)

    def mod_fn(s):
        return s - slopes.view(1, -1, 1, 1) * distance.to(F64)

    allowed = None if symmetric else attnlab.masks.causal_mask(13, 17, align="bottom_right")
    kwargs = dict(score_mod=scores.alibi(slopes, symmetric=symmetric, offset=4))
    if not symmetric:
        kwargs.update(causal=True, align="bottom_right")
    want = _eager(q, k, v, mod_fn=mod_fn, allowed=allowed)
    # blocks, named, serves a call with nothing to skip too (auto passes it over there)
    served = ["reference", "chunked", "sdpa", "blocks"]
    assert _check_all(q, k, v, kwargs, want, (slopes,)) == served


def test_alibi_standard_slopes_from_a_head_count():
    assert torch.equal(scores.alibi(4).slopes, torch.tensor([0.25, 0.0625, 0.015625, 0.00390625]))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_bias_is_t5s_bucketing(bidirectional):
    rel = torch.arange(-300, 300)
    got = scores.relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    assert torch.equal(got, _t5_bucket(rel, bidirectional, 32, 128))


def test_relative_bias_with_learnable_table():
    q, k, v = _qkv(Tq=40, Tk=40)
    table = torch.randn(16, 4, dtype=F64, requires_grad=True)
    i, j = _positions(40, 40)
    buckets = _t5_bucket(j - i, True, 16, 20)  # (Tq, Tk)

    def mod_fn(s):
        return s + table[buckets].permute(2, 0, 1)[None]  # (1, H, Tq, Tk)

    kwargs = dict(score_mod=scores.relative_bias(table, num_buckets=16, max_distance=20, bidirectional=True),
                  scale=1.0)
    want = _eager(q, k, v, mod_fn=mod_fn, scale=1.0)
    assert _check_all(q, k, v, kwargs, want, (table,)) == ["reference", "chunked", "sdpa", "blocks"]


def test_bias_tensor_broadcasts_and_learns():
    q, k, v = _qkv()
    bias = torch.randn(1, 4, 1, 17, dtype=F64, requires_grad=True)  # (1, H, 1, Tk)
    want = _eager(q, k, v, mod_fn=lambda s: s + bias)
    assert _check_all(q, k, v, dict(score_mod=scores.bias(bias)), want, (bias,)) == \
        ["reference", "chunked", "sdpa", "blocks"]


def test_composition_applies_left_to_right_with_masks_and_sinks():
    q, k, v = _qkv()
    bias = torch.randn(2, 1, 13, 17, dtype=F64, requires_grad=True)
    slopes = torch.rand(4, dtype=F64, requires_grad=True)
    sinks = torch.randn(4, dtype=F64, requires_grad=True)
    padding = torch.ones(2, 1, 1, 17, dtype=torch.bool)
    padding[1, ..., 9:] = False
    i, j = _positions(13, 17)

    def mod_fn(s):
        s = 3.0 * torch.tanh(s / 3.0)
        return s - slopes.view(1, -1, 1, 1) * (i - j).abs().to(F64) + bias

    mod = scores.softcap(3.0) + scores.alibi(slopes, symmetric=True) + scores.bias(bias)
    want = _eager(q, k, v, mod_fn=mod_fn, sinks=sinks, allowed=padding)
    kwargs = dict(score_mod=mod, sinks=sinks, mask=padding)
    assert _check_all(q, k, v, kwargs, want, (bias, slopes, sinks)) == ["reference", "chunked"]


def test_order_matters_for_softcap():
    q, k, v = _qkv()
    one = torch.ones((), dtype=F64) * 5
    a = attnlab.attention(q, k, v, score_mod=scores.softcap(1.0) + scores.bias(one))
    b = attnlab.attention(q, k, v, score_mod=scores.bias(one) + scores.softcap(1.0))
    assert torch.allclose(a, attnlab.attention(q, k, v, score_mod=scores.softcap(1.0)))  # a shift
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("masking", MASKINGS)
def test_sinks_match_gpt_oss_eager(masking):
    q, k, v = _qkv()
    sinks = torch.tensor([0.0, 1.5, -2.0, 4.0], dtype=F64, requires_grad=True)
    allowed = None
    if masking:
        allowed = attnlab.masks.causal_mask(13, 17, align=masking.get("align", "top_left"))
    want = _eager(q, k, v, sinks=sinks, allowed=allowed)
    assert _check_all(q, k, v, dict(sinks=sinks, **masking), want, (sinks,)) == \
        ["reference", "chunked", "sdpa", "blocks"]


def test_sink_gradient_is_the_formula():
    """d sink_h = -sum_(b, i) p_sink * (dO . O): written out, not differentiated."""
    q, k, v = _qkv()
    sinks = torch.randn(4, dtype=F64, requires_grad=True)
    for backend in ("chunked", "sdpa", "reference"):
        out = attnlab.attention(q, k, v, sinks=sinks, backend=backend)
        grad_out = torch.randn_like(out)
        (got,) = torch.autograd.grad(out, sinks, grad_out)
        s = q.detach() @ k.detach().repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)
        lse = torch.logaddexp(s.logsumexp(-1), sinks.detach().view(1, -1, 1))  # (B, H, Tq)
        p_sink = torch.exp(sinks.detach().view(1, -1, 1) - lse)
        want = -(p_sink * (grad_out * out.detach()).sum(-1)).sum(dim=(0, 2))
        _assert_close(got, want, backend)


def test_fully_masked_rows_with_sinks_give_zero_and_zero_gradient():
    q, k, v = _qkv(Tq=5, Tk=5)
    sinks = torch.randn(4, dtype=F64, requires_grad=True)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[0, :, 2] = False  # query 2 of batch 0 sees nothing
    mask[1] = False  # all of batch 1
    for backend in ("reference", "chunked", "sdpa"):
        out = attnlab.attention(q, k, v, mask=mask, sinks=sinks, backend=backend)
        assert out[0, :, 2].eq(0).all() and out[1].eq(0).all(), backend
        dq, d_sinks = torch.autograd.grad(out.sum(), (q, sinks))
        assert dq[0, :, 2].eq(0).all() and dq[1].eq(0).all(), backend
        assert torch.isfinite(d_sinks).all()


def test_user_function_and_flex_style_indexing():
    q, k, v = _qkv()
    table = torch.randn(4, 13, 17, dtype=F64)

    def flex_style(score, b, h, q_idx, kv_idx):  # FlexAttention's own signature and indexing
        return score + table[h, q_idx, kv_idx] * torch.cos((q_idx - kv_idx).to(score.dtype))

    i, j = _positions(13, 17)
    want = _eager(q, k, v, mod_fn=lambda s: s + table[None] * torch.cos((i - j).to(F64)))
    assert _check_all(q, k, v, dict(score_mod=flex_style), want, ()) == ["reference", "chunked"]


def test_user_function_with_declared_parameter():
    q, k, v = _qkv()
    w = torch.tensor(0.7, dtype=F64, requires_grad=True)
    mod = scores.function(lambda w: lambda s, b, h, i, j: s * w - (i - j).abs() * w, params=[w])
    i, j = _positions(13, 17)
    want = _eager(q, k, v, mod_fn=lambda s: s * w - (i - j).abs().to(F64) * w)
    assert _check_all(q, k, v, dict(score_mod=mod), want, (w,)) == ["reference", "chunked"]


def test_undeclared_captured_parameter_is_left_to_the_reference():
    q, k, v = _qkv()
    w = torch.tensor(0.7, dtype=F64, requires_grad=True)
    with pytest.raises(ValueError, match="closes over a tensor that requires grad"):
        attnlab.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * w, backend="chunked")
    out = attnlab.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * w)  # auto: the reference
    (dw,) = torch.autograd.grad(out.sum(), w)
    assert dw.abs() > 0


# ----------------------------------------------------------------------------- issue 30's findings
@pytest.mark.parametrize("parts, call", [(torch.bfloat16, torch.float32), (torch.float32, F64)])
def test_a_composition_of_additive_mods_sums_in_the_calls_dtype(parts, call):
    # sdpa and blocks summed the parts' terms in their own dtype (bf16: off by 0.05) before
    # adding them to the scores; the reference adds them one by one to scores in the call's dtype.
    q, k, v = (t.detach().to(call) for t in _qkv(B=1, Hq=2, Hkv=2, Tq=16, Tk=16))
    g = torch.Generator().manual_seed(3)
    terms = [(torch.randn(16, 16, generator=g, dtype=F64) * 30).to(parts) for _ in range(2)]
    mod = scores.bias(terms[0]) + scores.bias(terms[1])
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    want = _eager(q.double(), k.double(), v.double(), allowed=causal,
                  mod_fn=lambda s: s + terms[0].to(call).double() + terms[1].to(call).double())
    tolerance = 1e-5 if call == torch.float32 else 1e-12
    for backend in ("reference", "sdpa", "chunked", "blocks"):
        out = attnlab.attention(q, k, v, causal=True, score_mod=mod, backend=backend)
        assert (out.double() - want).abs().max() < tolerance, backend


@pytest.mark.parametrize("backend", ["chunked", "blocks"])
def test_learnable_alibi_slope_gradient_in_bf16(backend):
    # The output gradient's row sums D = rowsum(dO * O) came from the output rounded to bf16,
    # and the slope's gradient multiplies each row's rounding by its distance: off by 3.4 where
    # the gradient itself is 0.4. Values near 1 make the rounding of O large against dS.
    g = torch.Generator().manual_seed(0)
    bf16 = lambda t: t.to(torch.bfloat16).double()  # noqa: E731 -- values bf16 holds exactly
    q, k, d_out = (bf16(torch.randn(1, 2, 128, 8, generator=g, dtype=F64)) for _ in range(3))
    v = bf16(1 + 0.01 * torch.randn(1, 2, 128, 8, generator=g, dtype=F64))

    def slope_gradient(name, dtype):
        slopes = torch.tensor([2.0 ** -4, 2.0 ** -7], dtype=dtype, requires_grad=True)
        out = attnlab.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True,
                                score_mod=scores.alibi(slopes), backend=name)
        return torch.autograd.grad(out, slopes, d_out.to(dtype))[0].double()

    want = slope_gradient("reference", F64)
    plain = (slope_gradient("reference", torch.bfloat16) - want).abs().max().item()
    err = (slope_gradient(backend, torch.bfloat16) - want).abs().max().item()
    assert err <= allowed_error(plain, torch.bfloat16, want.abs().max().item(), reduction=128, gradient=True), (err, plain)


def _needs_0d(score, b, h, q_idx, kv_idx):
    """A mod written for 0-d indices only, as FlexAttention calls it."""
    if q_idx.dim():
        raise RuntimeError("written for one position")
    return score + torch.where(q_idx >= kv_idx, 0.5, -0.5).to(score.dtype)


@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
def test_a_function_for_0d_indices_composes(backend):
    # It worked alone (mapped with vmap) but failed inside a composition, which called it on the
    # tile's index grid.
    q, k, v = _qkv(Tq=6, Tk=6)
    i, j = _positions(6, 6)
    want = _eager(q, k, v, mod_fn=lambda s: (torch.tanh(s / 5) * 5 + torch.where(i >= j, 0.5, -0.5)).to(F64))
    out = attnlab.attention(q, k, v, score_mod=scores.softcap(5.0) + _needs_0d, backend=backend)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
def test_chained_indexing_as_in_flex_attention(backend):
    # PyTorch's test_index_multiple / test_index_weird: score + bias[b][q_idx] is FlexAttention-
    # valid; on the tile's index grid it gives a shape of 8 dims, which chunked and auto refused.
    q, k, v = _qkv(Tq=13, Tk=17)
    table = torch.randn(2, 13, dtype=F64)
    weird = torch.randn(2, 4, 13, 17, dtype=F64)

    def multiple(score, b, h, q_idx, kv_idx):
        return score + table[b][q_idx]

    def index_weird(score, b, h, q_idx, kv_idx):
        return score + weird[b, h][q_idx][kv_idx]

    want = _eager(q, k, v, mod_fn=lambda s: s + table[:, None, :, None] + weird)
    out = attnlab.attention(q, k, v, score_mod=scores.compose(multiple, index_weird), backend=backend)
    torch.testing.assert_close(out, want)
    dq, = torch.autograd.grad(out.sum(), q)
    dq_want, = torch.autograd.grad(want.sum(), q)
    torch.testing.assert_close(dq, dq_want)


def test_a_score_mod_with_int_of_an_index_gets_a_clear_error():
    q, k, v = _qkv(Tq=4, Tk=4)
    with pytest.raises(TypeError, match=r"score_mod: function\(.*\) cannot be evaluated.*int\(\)"):
        attnlab.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + int(i) * 0.1, backend="chunked")


@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
@pytest.mark.parametrize("B, T", [(0, 4), (2, 0), (0, 0)])
@pytest.mark.parametrize("shape", ["full", "keys", "batch"])
def test_bias_over_an_empty_batch_or_sequence(backend, B, T, shape):
    # An empty dim of the bias was indexed at 0 as if it broadcast: IndexError.
    q, k, v = _qkv(B=B, Hq=2, Hkv=2, Tq=T, Tk=T)
    tensor = torch.randn({"full": (B, 2, T, T), "keys": (T,), "batch": (B, 1, 1, 1)}[shape], dtype=F64,
                         requires_grad=True)
    out = attnlab.attention(q, k, v, score_mod=scores.bias(tensor), backend=backend)
    assert out.shape == (B, 2, T, 8)
    grads = torch.autograd.grad(out.sum(), (q, tensor), allow_unused=True)
    assert all(g is None or g.shape == t.shape for g, t in zip(grads, (q, tensor)))


@pytest.mark.parametrize("slopes", [[0.5, 1 / 3], 2])
def test_alibi_slopes_from_python_numbers_follow_the_calls_dtype(slopes):
    # They were float32 in a float64 call: 1/3 was off by 1e-8 per unit of distance.
    q, k, v = _qkv(B=1, Hq=2, Hkv=2, Tq=40, Tk=40)
    exact = torch.tensor([0.5, 1 / 3] if isinstance(slopes, list) else [2.0 ** -4, 2.0 ** -8], dtype=F64)
    i, j = _positions(40, 40)
    want = _eager(q, k, v, mod_fn=lambda s: s - exact.view(1, 2, 1, 1) * (i - j).abs().to(F64))
    for backend in ("reference", "sdpa", "chunked"):
        out = attnlab.attention(q, k, v, score_mod=scores.alibi(slopes, symmetric=True), backend=backend)
        assert (out - want).abs().max() < 1e-12, backend
    assert scores.alibi(slopes).slopes.dtype == torch.float32  # a float32 call keeps float32


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_gradcheck_every_learnable_part(backend):
    q, k, v = _qkv(B=1, Hq=2, Hkv=1, Tq=4, Tk=5, D=3)
    slopes = torch.rand(2, dtype=F64, requires_grad=True)
    table = torch.randn(8, 2, dtype=F64, requires_grad=True)
    bias = torch.randn(1, 2, 4, 5, dtype=F64, requires_grad=True)
    sinks = torch.randn(2, dtype=F64, requires_grad=True)

    def f(q, k, v, slopes, table, bias, sinks):
        mod = (scores.softcap(2.0) + scores.alibi(slopes)
               + scores.relative_bias(table, num_buckets=8, max_distance=8, bidirectional=False)
               + scores.bias(bias))
        return attnlab.attention(q, k, v, causal=True, score_mod=mod, sinks=sinks, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v, slopes, table, bias, sinks))


# ----------------------------------------------------------------------------- blocks
def _blocks_call(q, k, v, block, **kwargs):
    from attnlab.backends.blocks import blocks_attention
    return blocks_attention(build_call(q, k, v, **kwargs), block=block).out


BLOCK_MASKS = {
    "window": lambda T: dict(mask=attnlab.masks.sliding_window_mod(T, T, 7)),
    "causal": lambda T: dict(causal=True),
    "documents": lambda T: dict(mask=attnlab.masks.document_mod(torch.arange(T) * 3 // T)),
}


@pytest.mark.parametrize("mask_name", sorted(BLOCK_MASKS))
@pytest.mark.parametrize("mod_name", ["alibi", "relative", "bias", "composed"])
def test_blocks_adds_additive_mods_and_sinks_through_its_masks(mod_name, mask_name):
    """Small blocks, so that runs stack many pieces (one shared tile for ALiBi and T5's bias,
    one per piece for a bias tensor); forward and every gradient against fp64 written here."""
    T = 45
    q, k, v = _qkv(Tq=T, Tk=T)
    slopes = torch.rand(4, dtype=F64, requires_grad=True)
    table = torch.randn(8, 4, dtype=F64, requires_grad=True)
    bias = torch.randn(2, 1, T, T, dtype=F64, requires_grad=True)
    sinks = torch.randn(4, dtype=F64, requires_grad=True)
    i, j = _positions(T, T)
    buckets = scores.relative_position_bucket(j - i, bidirectional=True, num_buckets=8, max_distance=12)
    terms = {
        "alibi": (scores.alibi(slopes), lambda: -slopes.view(1, -1, 1, 1) * (i - j).to(F64)),
        "relative": (scores.relative_bias(table, num_buckets=8, max_distance=12, bidirectional=True),
                     lambda: table[buckets].permute(2, 0, 1)[None]),
        "bias": (scores.bias(bias), lambda: bias),
        "composed": (scores.alibi(slopes, symmetric=True) + scores.bias(bias),
                     lambda: -slopes.view(1, -1, 1, 1) * (i - j).abs().to(F64) + bias),
    }
    mod, term = terms[mod_name]
    masking = BLOCK_MASKS[mask_name](T)
    allowed = build_call(q, k, v, **masking).allowed()
    want = _eager(q, k, v, mod_fn=lambda s: s + term(), sinks=sinks, allowed=allowed)
    got = _blocks_call(q, k, v, 8, score_mod=mod, sinks=sinks, **masking)
    _assert_close(got, want, "forward")
    leaves = _leaves(q, k, v, slopes, table, bias, sinks)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, grad_out, allow_unused=True)
    got_grads = torch.autograd.grad(got, leaves, grad_out, allow_unused=True)
    for w, g in zip(want_grads, got_grads):
        assert (w is None) == (g is None)
        if w is not None:
            _assert_close(g, w, f"{mod_name} gradient")


def test_blocks_shares_a_relative_tile_across_a_run():
    """ALiBi on a sliding window: one tile per run of stacked pieces; a bias tensor: one per piece."""
    from attnlab.backends import blocks

    q = torch.randn(1, 2, 64, 4)
    call = build_call(q, q, q, mask=attnlab.masks.sliding_window_mod(64, 64, 5))
    runs = [run for run in blocks._planned_runs(call, call.mask_mod(), 8) if run.n > 1]
    assert runs
    for run in runs:
        assert blocks._bias_tile(call, scores.alibi(2), run).shape == (1, 2, 8, run.keys)
        assert blocks._bias_tile(call, scores.bias(torch.randn(64, 64)), run).shape == (run.n, 1, 8, run.keys)


def test_blocks_reads_the_mods_tensors_on_every_call():
    """The plan is kept on a prepared mask; the slopes, table and sinks are read per call."""
    q, k, v = (t.detach() for t in _qkv(Tq=40, Tk=40))
    prepared = attnlab.masks.prepare(attnlab.masks.sliding_window_mod(40, 40, 6), tq=40, tk=40)
    slopes, sinks = torch.rand(4, dtype=F64), torch.randn(4, dtype=F64)
    for _ in range(2):
        kwargs = dict(mask=prepared, score_mod=scores.alibi(slopes), sinks=sinks)
        got = attnlab.attention(q, k, v, backend="blocks", **kwargs)
        _assert_close(got, attnlab.attention(q, k, v, backend="reference", **kwargs), "forward")
        slopes.mul_(3.0)
        sinks.add_(1.0)


def test_blocks_fully_masked_rows_with_sinks_give_zero_and_zero_gradient():
    q, k, v = _qkv(Tq=20, Tk=20)
    sinks = torch.randn(4, dtype=F64, requires_grad=True)
    slopes = torch.rand(4, dtype=F64, requires_grad=True)
    mod = attnlab.masks.varlen_causal_mod(torch.tensor([20, 0]), torch.tensor([20, 0]))  # batch 1: nothing
    kwargs = dict(mask=mod, sinks=sinks, score_mod=scores.alibi(slopes))
    out = _blocks_call(q, k, v, 8, **kwargs)
    assert out[1].eq(0).all()
    grads = torch.autograd.grad(out.sum(), (q, sinks, slopes))
    assert grads[0][1].eq(0).all() and all(torch.isfinite(g).all() for g in grads)
    want = attnlab.attention(q, k, v, backend="reference", **kwargs)
    for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, sinks, slopes))):
        _assert_close(g, w, "gradient")


def test_blocks_a_bias_blocking_a_whole_row_of_a_piece():
    # The CPU kernel returns lse 0 for a row whose mask is all -inf, and blocks merges its pieces
    # by lse: the row's other piece was diluted (0.85 off on issue 30's case, 0.019 here).
    q, k, v = _qkv(B=1, Hq=2, Hkv=1, Tq=12, Tk=12, D=4)
    bias = torch.zeros(2, 12, 12, dtype=F64)
    bias[0, 9, 8:] = float("-inf")  # row 9: every key of its causal diagonal piece (blocks of 4)
    bias[1, 5, :] = float("-inf")  # row 5: every key, so nothing to attend
    bias[1, 2, :2] = float("-inf")  # row 2: its first piece's keys
    options = dict(causal=True, score_mod=scores.bias(bias))
    want = attnlab.attention(q, k, v, backend="reference", **options)
    out = _blocks_call(q, k, v, 4, **options)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), (q, k, v)),
                               torch.autograd.grad(want.sum(), (q, k, v)), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda q, k, v: _blocks_call(q, k, v, 4, **options), (q, k, v))


def test_blocks_gradcheck_every_additive_part():
    q, k, v = _qkv(B=1, Hq=2, Hkv=1, Tq=11, Tk=11, D=3)
    slopes = torch.rand(2, dtype=F64, requires_grad=True)
    table = torch.randn(8, 2, dtype=F64, requires_grad=True)
    bias = torch.randn(1, 2, 11, 11, dtype=F64, requires_grad=True)
    sinks = torch.randn(2, dtype=F64, requires_grad=True)
    window = attnlab.masks.sliding_window_mod(11, 11, 4)

    def f(q, k, v, slopes, table, bias, sinks):
        mod = (scores.alibi(slopes)
               + scores.relative_bias(table, num_buckets=8, max_distance=8, bidirectional=False)
               + scores.bias(bias))
        return _blocks_call(q, k, v, 4, mask=window, score_mod=mod, sinks=sinks)

    assert torch.autograd.gradcheck(f, (q, k, v, slopes, table, bias, sinks))


def test_blocks_declines_what_is_not_additive():
    q = torch.randn(1, 2, 16, 4)
    text = why(q, q, q, causal=True, score_mod=scores.softcap(5.0))
    assert "blocks: cannot serve: blocks adds a score mod only through the kernel's float mask" in text


def test_fp32_within_the_conformance_rule():
    q, k, v = _qkv(Tq=70, Tk=70, dtype=torch.float32, seed=3)
    sinks = torch.randn(4, requires_grad=True)
    mod = scores.softcap(5.0) + scores.alibi(4)
    ref = attnlab.attention(*(t.detach().double() for t in (q, k, v)), causal=True, score_mod=mod,
                            sinks=sinks.detach().double(), backend="reference")
    plain = attnlab.attention(q, k, v, causal=True, score_mod=mod, sinks=sinks, backend="reference")
    limit = allowed_error((plain.double() - ref).abs().max().item(), torch.float32, ref.abs().max().item(),
                          reduction=70)
    out = chunked_attention(build_call(q, k, v, causal=True, score_mod=mod, sinks=sinks), q_block=16, kv_block=32).out
    assert (out.double() - ref).abs().max().item() <= limit


def test_weights_show_the_mods_and_the_sinks_share():
    q, k, _ = _qkv()
    sinks = torch.full((4,), 2.0, dtype=F64)
    plain = attnlab.attention_weights(q, k, causal=True)
    with_sinks = attnlab.attention_weights(q, k, causal=True, sinks=sinks)
    assert torch.allclose(plain.sum(-1), torch.ones(2, 4, 13, dtype=F64))
    share = 1 - with_sinks.sum(-1)  # the sink's share per query
    assert (share > 0).all() and (share < 1).all()
    _, weights = attnlab.attention(q, k, k, causal=True, sinks=sinks, return_weights=True, backend="chunked")
    assert torch.allclose(weights, with_sinks)
    capped = attnlab.attention_weights(q * 50, k, score_mod=scores.softcap(1.0))
    assert capped.max() < attnlab.attention_weights(q * 50, k).max()


@pytest.mark.parametrize("bad, error, words", [
    (dict(sinks=torch.zeros(3)), ValueError, "sinks must have shape"),
    (dict(sinks=torch.zeros(4, dtype=torch.long)), TypeError, "sinks must have a floating"),
    (dict(sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor"),
    (dict(score_mod=scores.alibi(torch.ones(3))), ValueError, "score_mod: alibi slopes"),
    (dict(score_mod=scores.bias(torch.zeros(5, 5))), ValueError, "score_mod: bias of shape"),
    (dict(score_mod=scores.relative_bias(torch.zeros(8, 2), num_buckets=8, max_distance=8,
                                         bidirectional=False)), ValueError, "score_mod: relative_bias"),
    (dict(score_mod=lambda s, b, h, i, j: s.sum()), ValueError, "score_mod: .* one score per position"),
    (dict(score_mod=lambda s, b, h, i, j: s.expand(2, *s.shape)), ValueError, "score_mod: .* returned shape"),
    (dict(score_mod=lambda s, b, h, i, j: s[..., :1]), ValueError, "score_mod: .* one score per position"),
    (dict(score_mod=lambda s, b, h, i, j: s > 0), TypeError, "score_mod: .* float tensor"),
    (dict(score_mod="softcap"), TypeError, "score_mod must be"),
])
def test_bad_arguments_name_themselves(bad, error, words):
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(error, match=words):
        attnlab.attention(q, q, q, **bad)


@pytest.mark.parametrize("cap", [0, -1.0, float("inf")])
def test_softcap_must_be_positive(cap):
    with pytest.raises(ValueError, match="softcap"):
        scores.softcap(cap)


def test_dispatch_keys_on_the_signature_not_the_values():
    q = torch.randn(1, 4, 6, 8)
    a = attnlab.attention(q, q, q, causal=True, score_mod=scores.alibi(torch.ones(4)))
    b = attnlab.attention(q, q, q, causal=True, score_mod=scores.alibi(torch.ones(4) * 3))
    assert not torch.allclose(a, b)  # same signature, new values: computed again, not reused
    s1 = attnlab.attention(q, q, q, sinks=torch.zeros(4))
    s2 = attnlab.attention(q, q, q, sinks=torch.full((4,), 5.0))
    assert s2.abs().sum() < s1.abs().sum()
    keys = {attnlab.backends.dispatch.argument_key(
        q, q, q, mask=None, causal=False, align="top_left", scale=None, dropout_p=0.0, generator=None,
        backend="auto", return_weights=False, score_mod=mod, sinks=None)
        for mod in (scores.softcap(2.0), scores.softcap(2.0), scores.softcap(3.0), None)}
    assert len(keys) == 3


def test_why_says_who_serves_what():
    q = torch.randn(1, 4, 64, 8)
    text = why(q, q, q, causal=True, score_mod=scores.softcap(30.0), sinks=torch.zeros(4))
    assert "runs on 'chunked'" in text
    assert "sdpa: cannot serve: sdpa adds a score mod only as a float mask" in text
    assert "blocks: cannot serve" in text and "flex: cannot serve" in text
    assert "score_mod=softcap(30)" in text.splitlines()[0]
    with torch.no_grad():
        text = why(q, q, q, sinks=torch.zeros(4))
    assert "runs on 'sdpa'" in text  # sinks alone: one more key, O(T) memory


class _ForgetsTheSinks(attnlab.backends.Backend):
    """Wrong the way shipped sink code was: the sinks left out of the normalisation."""

    name = "forgets-sinks-test"
    memory = "quadratic"

    def forward(self, call):
        import dataclasses
        plain = dataclasses.replace(call, sinks=None, _memo={})
        return attnlab.backends.AttentionResult(out=attnlab.backends.get("reference").forward(plain).out)


def test_sweep_checks_score_mods_and_catches_wrong_sinks():
    from attnlab.lab import verify

    # seed 2: each sinks kind's configuration has a query with a key (in seed 1's infinite_sinks
    # one, varlen lengths ANDed with bottom-right causal masking leave none: forgetting the
    # sinks changes nothing there)
    n = 4 * len(verify.SCORE_KINDS)  # every fourth configuration has a score kind
    cfgs = verify.configs(n, seed=2)
    assert {c.score for c in cfgs} == {"none", *verify.SCORE_KINDS}
    attnlab.backends.register(_ForgetsTheSinks())
    try:
        results = verify.sweep(["forgets-sinks-test"], [torch.float32], n=n, seed=2, small=True)
    finally:
        attnlab.backends.unregister("forgets-sinks-test")
    failed = {r.config.split("score:")[-1].split()[0] for r in results if not r.passed}
    assert failed == {"sinks", "softcap_sinks", "alibi_sinks", "query_sinks", "infinite_sinks"}


# ----------------------------------------------------------------------------- modules and GPT
def test_module_alibi_equals_the_float_mask_of_nn_positional():
    """positions="alibi" against attnlab.nn.positional.alibi_bias, an independent ALiBi."""
    from attnlab.nn import MultiHeadAttention
    from attnlab.nn.positional import alibi_bias

    torch.manual_seed(0)
    with_alibi = MultiHeadAttention(16, 16, num_heads=4, positions="alibi").double()
    plain = MultiHeadAttention(16, 16, num_heads=4).double()
    plain.load_state_dict(with_alibi.state_dict())
    x = torch.randn(2, 7, 16, dtype=F64)
    expected = plain(x, mask=alibi_bias(4, 7, dtype=F64))
    assert torch.allclose(with_alibi(x), expected, atol=1e-12)
    assert "alibi_slopes" not in with_alibi.state_dict()  # a buffer, rebuilt, never saved


def test_module_options_keep_the_kv_cache_exact():
    from attnlab.nn import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 16, num_heads=4, positions="alibi", softcap=3.0, sinks=True, qkv=QKV(num_kv_heads=2)).double()
    with torch.no_grad():
        mha.sinks.normal_()
    x = torch.randn(2, 7, 16, dtype=F64)
    cache = mha.new_cache(batch_size=2, max_len=7)
    with torch.no_grad():
        steps = [mha(x[:, :4], cache=cache), mha(x[:, 4:5], cache=cache), mha(x[:, 5:], cache=cache)]
    assert torch.allclose(torch.cat(steps, dim=1), mha(x), atol=1e-12)


def test_module_sinks_are_a_learned_parameter_and_match_eager():
    from attnlab.nn import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 8, num_heads=2, sinks=True, softcap=2.0).double()
    with torch.no_grad():
        mha.sinks.copy_(torch.tensor([1.0, -1.0]))
    x = torch.randn(1, 5, 8, dtype=F64)
    q, k, v = mha.project_qkv(x)
    context = _eager(q, k, v, mod_fn=lambda s: 2.0 * torch.tanh(s / 2.0), sinks=mha.sinks,
                     allowed=attnlab.masks.causal_mask(5))
    expected = mha.out_proj(context.transpose(1, 2).reshape(1, 5, 8))
    out = mha(x)
    assert torch.allclose(out, expected, atol=1e-12)
    out.sum().backward()
    assert "sinks" in dict(mha.named_parameters()) and mha.sinks.grad.abs().min() > 0


@pytest.mark.parametrize("bad, error, words", [
    (dict(positions="sinusoidal"), ValueError, "positions must be one of"),
    (dict(positions=__import__("attnlab").nn.RotaryEmbedding(2)), ValueError, "RotaryEmbedding\\(head_dim=4\\)"),
    (dict(softcap=0.0), ValueError, "softcap must be a positive"),
    (dict(sinks=1), TypeError, "sinks must be a bool"),
])
def test_module_options_are_checked(bad, error, words):
    from attnlab.nn import MultiHeadAttention

    with pytest.raises(error, match=words):
        MultiHeadAttention(8, 8, num_heads=2, **bad)


def test_gpt_with_alibi_sinks_and_softcap_trains_and_rebuilds_from_its_config():
    from attnlab.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=20, max_len=16, d_model=16, num_layers=2, num_heads=4, positions="alibi",
                softcap=5.0, sinks=True)
    assert model.pos_emb is None
    ids = torch.randint(0, 20, (4, 12))
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    losses = []
    for _ in range(15):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 20), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert model.blocks[0].attn.sinks.grad.abs().max() > 0
    again = GPT(**model.config)
    again.load_state_dict(model.state_dict())
    assert torch.equal(again(ids), model(ids))


def test_sinks_and_an_additive_mod_trace_whole_under_torch_compile():
    """sdpa serves them without reading a value: fullgraph=True fails on any graph break."""
    torch._dynamo.reset()
    q, sinks = torch.randn(1, 4, 16, 8), torch.randn(4)
    mod = scores.alibi(4, symmetric=True)
    compiled = torch.compile(lambda q, s: attnlab.attention(q, q, q, sinks=s, score_mod=mod), fullgraph=True)
    want = attnlab.attention(q, q, q, sinks=sinks, score_mod=mod, backend="reference")
    assert torch.allclose(compiled(q, sinks), want, atol=1e-6)


# ----------------------------------------------------------------------------- sdpa's sinks by lse
def test_sdpa_applies_sinks_through_the_kernels_lse():
    """On CPU the sinks keep SDPA's own causal kernel (no mask, O(T)) and auto takes it."""
    from attnlab.backends.sdpa import sdpa_plan, sinks_through_lse

    q, k, v = _qkv(Tq=17, Tk=17)
    sinks = torch.randn(4, dtype=F64, requires_grad=True)
    call = build_call(q, k, v, causal=True, sinks=sinks)
    assert sinks_through_lse(call)
    plan = sdpa_plan(call)
    assert (plan.mask_source, plan.memory) == ("is_causal", "linear")
    assert "runs on 'sdpa'" in why(q, k, v, causal=True, sinks=sinks)
    want = _eager(q, k, v, sinks=sinks, allowed=attnlab.masks.causal_mask(17, 17))
    assert _check_all(q, k, v, dict(causal=True, sinks=sinks), want, (sinks,))[:3] == \
        ["reference", "chunked", "sdpa"]
    learnable = scores.bias(torch.zeros(1, 4, 17, 17, dtype=F64, requires_grad=True))
    assert not sinks_through_lse(build_call(q, k, v, sinks=sinks, score_mod=learnable))  # the sink column


@pytest.mark.parametrize("masking", [
    dict(causal=True), dict(causal=True, align="bottom_right"), dict(mask="bool"), dict(mask="float"),
    dict(causal=True, scale=0.0), dict(scale=-0.7)])
def test_sdpa_sinks_by_lse_gradcheck(masking):
    """The kernel's backward with dO scaled and the sink's output in place of out, checked
    numerically (GQA, dead rows, Tq != Tk, a zero and a negative scale)."""
    q, k, v = _qkv(B=2, Hq=2, Hkv=1, Tq=4, Tk=5, D=3)
    sinks = torch.randn(2, dtype=F64, requires_grad=True)
    kwargs = dict(masking)
    if kwargs.get("mask") == "bool":
        mask = torch.rand(2, 1, 4, 5, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[0, 0, 1] = False  # a dead row: the sink takes its mass
        kwargs["mask"] = mask
    elif kwargs.get("mask") == "float":
        kwargs["mask"] = torch.randn(4, 5, dtype=F64).masked_fill(torch.eye(4, 5, dtype=torch.bool), float("-inf"))
    assert attnlab.backends.sdpa.sinks_through_lse(build_call(q, k, v, sinks=sinks, **kwargs))

    def f(q, k, v, sinks):
        return attnlab.attention(q, k, v, sinks=sinks, backend="sdpa", **kwargs)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_sdpa_sinks_by_lse_keep_the_rows_rules():
    """NaN query rows stay NaN; a fully masked row is 0 with zero gradient (the sink's mass)."""
    q, k, v = _qkv(Tq=6, Tk=6, dtype=torch.float32)
    sinks = torch.randn(4, requires_grad=True)
    q_leaf = q.detach().clone()
    q_leaf[0, 1, 2] = float("nan")
    q = q_leaf.requires_grad_()
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[4] = False
    out = attnlab.attention(q, k, v, mask=mask, sinks=sinks, backend="sdpa")
    assert out[0, 1, 2].isnan().all() and torch.isfinite(out[1]).all()
    assert out[:, :, 4].eq(0).all()
    dq, dk, d_sinks = torch.autograd.grad(out[1].sum(), (q_leaf, k, sinks))
    # Batch 0 holds the NaN row: its k gradient and its head's sink gradient may be NaN (the
    # reference's are: 0 * NaN), everything else is finite.
    assert torch.isfinite(dk[1]).all() and torch.isfinite(d_sinks[[0, 2, 3]]).all()
    assert dq[1, :, 4].eq(0).all() and dq[1].ne(0).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_sinks_by_lse_in_half_precision(dtype):
    """Tiny half-precision calls stay within the conformance rule of fp64 (sinks kept in fp32)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _qkv(Tq=16, Tk=16, D=16))
    sinks = torch.randn(4, dtype=dtype, requires_grad=True)
    out = attnlab.attention(q, k, v, causal=True, sinks=sinks, backend="sdpa")
    ref = attnlab.attention(q, k, v, causal=True, sinks=sinks, backend="reference")
    want = attnlab.attention(*(t.double() for t in (q, k, v)), causal=True, sinks=sinks.double(),
                             backend="reference")
    plain = (ref.double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= allowed_error(plain, dtype, 1.0)
    grads = torch.autograd.grad(out.float().sum(), (q, sinks))
    want_grads = torch.autograd.grad(ref.float().sum(), (q, sinks))
    for got, w in zip(grads, want_grads):
        assert (got.double() - w.double()).abs().max().item() <= 0.05 * max(1.0, w.abs().max().item())


def test_sdpa_sinks_by_lse_compile_whole_with_gradients():
    """The lse path traces under fullgraph=True and its gradients equal eager."""
    torch._dynamo.reset()
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(Tq=16, Tk=16))
    sinks = torch.randn(4, requires_grad=True)
    compiled = torch.compile(lambda q, k, v, s: attnlab.attention(q, k, v, causal=True, sinks=s), fullgraph=True)
    got = compiled(q, k, v, sinks)
    want = attnlab.attention(q, k, v, causal=True, sinks=sinks, backend="reference")
    assert torch.allclose(got, want, atol=1e-5)
    for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v, sinks)),
                    torch.autograd.grad(want.sum(), (q, k, v, sinks))):
        assert torch.allclose(g, w, atol=1e-4)


@pytest.mark.parametrize("masking", [dict(), dict(causal=True), dict(causal=True, align="bottom_right")])
def test_chunked_softcap_in_place_gradcheck(masking):
    """softcap alone takes the tiled backend's in-place path (its derivative read from the capped
    scores, 1 - (s' / cap)^2): checked numerically, batched gradients included."""
    assert scores.softcap(1.5).in_place and not (scores.softcap(1.5) + scores.alibi(2)).in_place
    q, k, v = _qkv(B=1, Hq=2, Hkv=1, Tq=4, Tk=6, D=3)

    def f(q, k, v):
        call = build_call(q, k, v, score_mod=scores.softcap(1.5), **masking)
        return chunked_attention(call, q_block=2, kv_block=4).out

    assert torch.autograd.gradcheck(f, (q, k, v), check_batched_grad=True)


def test_sdpa_sinks_by_lse_read_every_memory_layout():
    """The lse op reads its inputs as if contiguous: strided k and v (a sliced last dim, heads
    outermost) gave wrong rows until they were copied (found by the conformance sweep)."""
    q, k, v = _qkv(B=1, Hq=4, Hkv=4, Tq=9, Tk=11, D=3, dtype=torch.float32)
    sinks = torch.randn(4)
    wide = torch.randn(1, 4, 11, 6)
    k_strided, v_strided = wide[..., ::2], wide[..., 1::2]  # last-dim stride 2
    q_outer = q.detach().transpose(0, 1).contiguous().transpose(0, 1)  # heads outermost
    for args in ((q_outer, k, v), (q, k_strided, v_strided)):
        got = attnlab.attention(*args, causal=True, sinks=sinks, backend="sdpa")
        want = attnlab.attention(*(t.contiguous() for t in args), causal=True, sinks=sinks, backend="reference")
        assert torch.allclose(got, want, atol=1e-5)


def test_sdpa_sinks_by_lse_under_vmap_and_batched_gradcheck():
    """torch.func.vmap over the lse path equals a loop (the Function's vmap rule is generated;
    it had none, and vmap over sinks on sdpa failed), and batched gradients check out."""
    import warnings

    q, k, v = (t.detach() for t in _qkv(B=3, Hq=2, Hkv=1, Tq=5, Tk=6, D=4))
    sinks = torch.randn(2, dtype=F64)
    q5, k5, v5 = q[:, None], k[:, None], v[:, None]  # (3, 1, H, T, D): vmapped over dim 0

    def one(q, k, v):
        return attnlab.attention(q, k, v, causal=True, sinks=sinks, backend="sdpa")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no batching rule for ...for_cpu": a loop
        got = torch.func.vmap(one)(q5, k5, v5)
    want = torch.stack([attnlab.attention(*t, causal=True, sinks=sinks, backend="reference")
                        for t in zip(q5, k5, v5)])
    _assert_close(got, want, "vmap")
    leaves = [t[:1].clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert torch.autograd.gradcheck(
            lambda q, k, v, s: attnlab.attention(q, k, v, causal=True, sinks=s, backend="sdpa"),
            leaves, check_batched_grad=True)


@pytest.mark.parametrize("backend", ["chunked", "blocks", "auto"])
@pytest.mark.parametrize("layout", ["contiguous", "expanded-and-transposed"])
def test_a_t5_table_gradient_is_zero_where_no_visible_pair_reads_it(backend, layout):
    """The sweep's case: an 8-bucket table (max distance 1000, offset 53), a causal document mask,
    Tq=65, Tk=100, bottom-right, scale 3; a table entry no visible pair reads gets exactly 0."""
    g = torch.Generator().manual_seed(3)
    B, H, Tq, Tk, D = 2, 2, 65, 100, 16
    q = torch.randn(B, Tq, H, D, generator=g, dtype=F64).transpose(1, 2)  # (B, H, Tq, D), transposed
    k = torch.randn(1, H, Tk, D, generator=g, dtype=F64).expand(B, H, Tk, D)  # stride 0 over the batch
    v = torch.randn(B, H, Tk, D, generator=g, dtype=F64)
    if layout == "contiguous":
        q, k = q.contiguous(), k.contiguous()
    ids = (torch.arange(Tk) >= 60).long() + (torch.arange(Tk) >= 90).long()  # documents 0..59, 60..89, 90..99
    grad_out = torch.randn(B, H, Tq, D, generator=g, dtype=F64)
    base = torch.randn(8, H, generator=g, dtype=F64)

    def table_grad(dtype, name):
        table = base.to(dtype).clone().requires_grad_()
        mod = scores.relative_bias(table, num_buckets=8, max_distance=1000, bidirectional=False, offset=53)
        out = attnlab.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=attnlab.masks.document_mod(ids),
                                causal=True, align="bottom_right", scale=3.0, score_mod=mod, backend=name)
        out.backward(grad_out.to(dtype))
        return table.grad.double()

    expected = table_grad(F64, "reference")
    got = table_grad(torch.float32, backend)
    unread = expected == 0
    assert unread.any() and (~unread).any()  # the case has both kinds of entries
    assert torch.equal(got[unread], torch.zeros_like(got[unread]))
    assert torch.allclose(got, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)
