"""Numerics under attack: NaN/inf in inputs, half precision with float masks, huge fp16 scores.

Every available backend (and ``auto``) is held to one rule, checked against independent
computations: the fp64 reference, the same call with poisoned entries replaced by zeros, or
plain PyTorch. flex runs forward only on CPU (under ``torch.no_grad``) and at one shape, as it
compiles per shape; where it cannot keep a rule (NaN/inf inputs) it declines, which these tests
accept and tests/test_flex.py checks.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import backends, masks
from attnlab.lab import verify
from attnlab.backends import build_call, dispatch
from attnlab.nn import MultiHeadAttention
from attnlab.nn import CallMask

B, H, T, D = 2, 3, 128, 40  # one shape for every flex call: flex compiles per shape, and on CPU
# serves only whole 128-key blocks, so this is a shape where it must keep every rule
NAN, INF = float("nan"), float("inf")
# The small floors of attnlab.lab.verify's rule (magnitude 1, one term).
FLOOR = {dtype: verify.floor_for(dtype, 1.0) for dtype in (torch.bfloat16, torch.float16)}


def _names():
    return [pytest.param(name, id=name) for name in [*backends.available(), "auto"]]


def _qkv(*, dtype=torch.float32, hkv=H, tk=T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=gen).to(dtype),
            torch.randn(B, hkv, tk, D, generator=gen).to(dtype),
            torch.randn(B, hkv, tk, D, generator=gen).to(dtype))


def _serves(name: str, tensors, grad: bool, **options) -> bool:
    if name == "auto":
        return True
    with torch.set_grad_enabled(grad):
        leaves = [t.detach().requires_grad_(grad) for t in tensors]
        return not backends.reasons(build_call(*leaves, **options))[name]


def _run(name: str, tensors, **options):
    """Output and (when the backend can differentiate the call) gradients of q, k, v."""
    grad = _serves(name, tensors, True, **options)
    if not grad and not _serves(name, tensors, False, **options):
        pytest.skip(f"{name} declines this call")
    leaves = [t.detach().clone().requires_grad_(grad) for t in tensors]
    with torch.set_grad_enabled(grad):
        out = attnlab.attention(*leaves, backend=name, **options)
    if not grad:
        return out, None
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype)
    out.backward(torch.where(out.isnan(), 0.0, d_out))
    return out.detach(), [t.grad for t in leaves]


def _assert_same(got, want):
    out, grads = got
    want_out, want_grads = want
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, equal_nan=True)
    for g, w in zip(grads or [], want_grads or []):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ----------------------------------------------------------------------------- masked keys
LENGTHS = torch.tensor([T, 5])


def _padding_options(kind: str) -> tuple[dict, torch.Tensor]:
    """Attention options that block keys j >= LENGTHS[b], and the (B, 1, Tk, 1) real keys."""
    real = masks.padding_mask(LENGTHS, T)  # (B, 1, 1, Tk)
    options = {
        "bool": dict(mask=real),
        "float": dict(mask=torch.zeros(real.shape).masked_fill(~real, -INF)),
        "mod": dict(mask=masks.padding_mod(LENGTHS)),
        "bool-causal": dict(mask=real, causal=True),
    }[kind]
    return options, real.transpose(-2, -1)


# Non-finite values at blocked keys are kept out only where that is free (docs/contract.md,
# "Non-finite values"): the reference and chunked backends never let them in; the fused kernels
# read them with weight 0. Finite values there have no influence on any backend.
_SCRUBBING = ("reference", "chunked")


@pytest.mark.parametrize("poison", [NAN, INF, -INF, 1e4, -3e4], ids=["nan", "inf", "-inf", "1e4", "-3e4"])
@pytest.mark.parametrize("kind", ["bool", "float", "mod", "bool-causal"])
@pytest.mark.parametrize("name", _names())
def test_values_at_padded_keys_have_no_influence(name, kind, poison):
    if not math.isfinite(poison) and name not in _SCRUBBING:
        pytest.skip(f"{name} reads blocked keys with weight 0: only finite values are promised")
    options, real = _padding_options(kind)
    q, k, v = _qkv()
    poisoned = [q, *(torch.where(real, x, poison) for x in (k, v))]
    clean = [q, *(torch.where(real, x, 0.0) for x in (k, v))]
    got, want = _run(name, poisoned, **options), _run(name, clean, **options)
    assert torch.isfinite(got[0]).all()
    _assert_same(got, want)


@pytest.mark.parametrize("name", [n for n in _names() if n.values[0] != "flex"])
def test_unused_cache_slots_and_grouped_heads_have_no_influence(name):
    # Top-left causal with Tq < Tk never reaches keys >= Tq, so even NaN there stays out (they
    # are sliced off, never read); a per-head padding mask over grouped-query heads blocks a key
    # only where every head of its group blocks it (finite values there: no influence).
    q, k, v = _qkv(hkv=1, tk=T + 4)
    unused = torch.arange(T + 4).view(1, 1, T + 4, 1) >= T
    for poison in (NAN, 1e4):
        poisoned = [q, *(torch.where(unused, poison, x) for x in (k, v))]
        clean = [q, *(torch.where(unused, 0.0, x) for x in (k, v))]
        _assert_same(_run(name, poisoned, causal=True), _run(name, clean, causal=True))
    per_head = torch.ones(B, H, 1, T + 4, dtype=torch.bool)
    per_head[:, 0, :, -4:] = False
    per_head[:, 1:, :, -6:] = False  # keys T-2, T-1 stay live through head 0
    _assert_same(_run(name, poisoned, mask=per_head), _run(name, clean, mask=per_head))


@pytest.mark.parametrize("name", _names())
def test_a_fully_masked_row_gives_zeros_and_zero_gradient(name):
    q, k, v = _qkv()
    allowed = torch.ones(T, T, dtype=torch.bool)
    allowed[3] = False
    got = _run(name, [q, k, v], mask=allowed)
    assert got[0][:, :, 3].eq(0).all()
    if got[1]:
        assert got[1][0][:, :, 3].eq(0).all()  # dq of the dead row
        want = _run("reference", [q.double(), k.double(), v.double()], mask=allowed)
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)
    poisoned_q = q.clone()
    poisoned_q[:, :, 3] = NAN  # a NaN query with nothing to attend: zeros or NaN, never a value
    row = _run(name, [poisoned_q, k, v], mask=allowed)[0][:, :, 3]
    assert (row.eq(0) | row.isnan()).all()


def test_multihead_padding_garbage_in_padded_inputs_does_not_leak():
    """Padded tokens' hidden states (finite, whatever they are) change no real token."""
    torch.manual_seed(0)
    real = masks.padding_mask(LENGTHS, T)[:, 0, 0]  # (B, T) True at real tokens
    x = torch.randn(B, T, 16)
    poisoned, clean = x.masked_fill(~real[..., None], 1e4), x.masked_fill(~real[..., None], 0.0)
    probe = [torch.zeros(B, 2, T, 8, requires_grad=True) for _ in range(3)]  # the modules' calls
    serving = [n for n, why in backends.reasons(build_call(*probe, mask=real[:, None, None, :])).items() if not why]
    for name in [*serving, "auto"]:  # flex has no CPU backward; blocks needs a mask mod's bounds
        self_attn = MultiHeadAttention(16, 16, num_heads=2, backend=name, pattern=None)
        got, want = (self_attn(t, mask=CallMask(padding=real)) for t in (poisoned, clean))
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=0)
        cross = MultiHeadAttention(16, 16, num_heads=2, backend=name, pattern=None)
        queries = [torch.randn(B, 5, 16, generator=torch.Generator().manual_seed(1))
                   .requires_grad_() for _ in range(2)]
        got, want = (cross(qx, context=ctx, mask=CallMask(padding=real))
                     for qx, ctx in zip(queries, (poisoned, clean)))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(queries[0].grad, queries[1].grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------- NaN/inf in q
@pytest.mark.parametrize("poison", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "padding"])
@pytest.mark.parametrize("name", _names())
def test_nan_inf_in_query_makes_its_row_nan_on_every_backend(name, masked, poison, request):
    q, k, v = _qkv()
    options = dict(mask=masks.padding_mask(LENGTHS, T)) if masked else {}
    poisoned_q = q.clone()
    poisoned_q[1, 0, 2, 3] = poison
    out, _ = _run(name, [poisoned_q, k, v], **options)
    want, _ = _run("reference", [q.double(), k.double(), v.double()], **options)
    assert out[1, 0, 2].isnan().all(), "the poisoned query's row must be NaN"
    others = torch.ones(B, H, T, dtype=torch.bool)
    others[1, 0, 2] = False
    torch.testing.assert_close(out[others].double(), want[others], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in _names() if n.values[0] != "flex"])
def test_nan_in_an_attended_key_or_value_propagates(name):
    # flex's compiled kernel keeps finite rows where an attended key holds NaN; attnlab no
    # longer scans the inputs to decline it (docs/contract.md, "Non-finite values").
    q, k, v = _qkv()
    for tensor in ("k", "v"):
        poisoned = {"k": k.clone(), "v": v.clone()}
        poisoned[tensor][0, 1, 4, 0] = NAN
        out, _ = _run(name, [q, poisoned["k"], poisoned["v"]], causal=True)
        reached = out[0, 1, 4:] if tensor == "k" else out[0, 1, 4:, 0]  # v: its feature only
        assert reached.isnan().all(), f"NaN in attended {tensor} must reach the rows using it"
        assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, 0]).all()


# ----------------------------------------------------------------------------- half precision
def _alibi_bias() -> torch.Tensor:
    """ALiBi slopes times distance, around -130: a float32 bias whose bf16 step is 1."""
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)]).view(1, H, 1, 1)
    distance = (torch.arange(T).view(1, T) - torch.arange(T).view(T, 1)).float()  # (Tq, Tk)
    return slopes * distance - 130.0  # (1, H, Tq, Tk) float32


def _plain(q, k, v, bias):
    """Plain PyTorch in the low dtype (bias added with PyTorch's type promotion)."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias
    weights = torch.softmax(scores, dim=-1)
    return weights.to(q.dtype) @ v, weights.to(q.dtype)


def _max_err(got, want) -> float:
    return (got.double() - want).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", _names())
def test_fp32_float_mask_with_half_inputs_keeps_the_flash_attention_rule(name, dtype):
    q, k, v = _qkv(dtype=dtype)
    bias = _alibi_bias()
    exact, exact_weights = attnlab.attention(q.double(), k.double(), v.double(), mask=bias.double(),
                                             backend="reference", return_weights=True)
    plain, plain_weights = _plain(q, k, v, bias)
    if not _serves(name, (q, k, v), False, mask=bias):
        pytest.skip(f"{name} declines this call")
    with torch.no_grad():
        out, weights = attnlab.attention(q, k, v, mask=bias, backend=name, return_weights=True)
    assert out.dtype == weights.dtype == dtype
    err, allowed = _max_err(out, exact), 2 * _max_err(plain, exact) + FLOOR[dtype]
    assert err <= allowed, f"out error {err:.3g} > {allowed:.3g}"
    err = _max_err(weights, exact_weights)
    allowed = 2 * _max_err(plain_weights, exact_weights) + FLOOR[dtype]
    assert err <= allowed, f"weights error {err:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sdpa_passes_an_fp32_mask_to_cpu_kernels_with_half_inputs(dtype):
    q, k, v = _qkv(dtype=dtype)
    bias = _alibi_bias()
    out = attnlab.attention(q, k, v, mask=bias, backend="sdpa")
    direct = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(out, direct, rtol=0, atol=0)


def _large_scores():
    """fp16 inputs whose scaled scores are ~16k (they fit fp16) but whose q @ k^T (~65k before
    the 1/sqrt(D) scale) does not; score differences between keys are a few units."""
    gen = torch.Generator().manual_seed(4)
    q = torch.full((B, H, T, D), 128.0)
    k = 64.0 + torch.randint(-1, 2, (B, H, T, D), generator=gen) / 16.0
    v = torch.randn(B, H, T, D, generator=gen)
    return [t.half() for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", _names())
def test_a_float_mask_row_at_finfo_min_is_a_uniform_softmax_forward_and_backward(name, dtype):
    """transformers masks with finfo.min: a row held there is, in the math eager computes, a
    uniform softmax (the scores vanish next to min) with a well-defined gradient. sdpa and
    chunked gave it a backward Tk times too large: exp(s - lse) with lse = min + log(Tk) rounded
    to min. Compared with the fp64 reference of the same mask."""
    q, k, v = (t.to(dtype) for t in _qkv())
    mask = torch.zeros(T, T, dtype=dtype)
    mask[3] = torch.finfo(dtype).min  # one row held at min everywhere
    mask[5, ::2] = torch.finfo(dtype).min  # and a row half blocked this way
    got = _run(name, [q, k, v], mask=mask)
    exact = _run("reference", [t.double() for t in (q, k, v)], mask=mask.double())
    torch.testing.assert_close(got[0].double(), exact[0], rtol=0, atol=1e-5)
    assert torch.allclose(exact[0][:, :, 3].double(), v.double().mean(dim=2))  # uniform
    if _chooses(name, [q, k, v], mask=mask) == "sdpa":
        # the documented exception: PyTorch's fused backward, as F.scaled_dot_product_attention gives it
        exact = _torch_sdpa([q, k, v], mask)
    for have, want in zip(got[1] or [], exact[1]):
        torch.testing.assert_close(have.double(), want.double(), rtol=0, atol=1e-4)


def _chooses(name: str, tensors, **options) -> str:
    """The backend a name runs (auto's choice for a call with a backward ahead)."""
    if name != "auto":
        return name
    leaves = [t.detach().requires_grad_() for t in tensors]
    return dispatch.select(build_call(*leaves, **options)).name


def _torch_sdpa(tensors, mask):
    """Output and q, k, v gradients of F.scaled_dot_product_attention, with _run's output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("name", _names())
def test_fp16_large_scores_are_finite_and_match_fp64(name):
    q, k, v = _large_scores()
    assert torch.isinf(q[0, 0] @ k[0, 0].T).any()
    assert (q[0, 0].float() @ k[0, 0].float().T).max() / math.sqrt(D) < 65504
    exact, exact_weights = attnlab.attention(q.double(), k.double(), v.double(),
                                             backend="reference", return_weights=True)
    if not _serves(name, (q, k, v), False):
        pytest.skip(f"{name} declines this call")
    with torch.no_grad():
        out, weights = attnlab.attention(q, k, v, backend=name, return_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert _max_err(weights, exact_weights) <= FLOOR[torch.float16]
    assert _max_err(out, exact) <= FLOOR[torch.float16] * math.sqrt(T) * exact.abs().max().item()


# ----------------------------------------------------------------------------- every scale
def _fp64_attention(q, k, v, allowed, scale, d_out):
    """Plain fp64 math, independent of every backend: output, q/k/v gradients and weights.

    allowed: bool broadcasting to (B, Hq, Tq, Tk); a row with nothing allowed gets zeros."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # (B, Hq, Tk, D)
    scores = (q @ keys.transpose(-2, -1)) * scale
    alive = allowed.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~allowed, -INF).masked_fill(~alive, 0.0), dim=-1) * alive
    out = weights @ values
    grads = torch.autograd.grad(out, (q, k, v), d_out.double())
    return out.detach(), list(grads), weights.detach()


def _d_out(shape):
    """The output gradient _run uses."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(9))


def _assert_within_rule(name, got, exact, plain, *, extra=(0.0, 0.0, 0.0, 0.0)):
    """attnlab.lab.verify's rule: each of out, dq, dk, dv within 2x (3x) the fp32 reference's error
    vs fp64 plus the floor (plus ``extra``, per tensor)."""
    out, grads = got
    pairs = [(out, exact[0], plain[0])] + list(zip(grads or [], exact[1], plain[1] or []))
    magnitude = max(float(t.abs().max()) for t in [exact[0], *exact[1]])
    for i, (have, want, ref) in enumerate(pairs):
        what = ["out", "dq", "dk", "dv"][i]
        assert torch.isfinite(have).all(), f"{name}: {what} is not finite"
        allowed = verify.allowed_error(_max_err(ref, want), have.dtype, magnitude,
                                       reduction=want.shape[-2], gradient=i > 0) + extra[i]
        assert _max_err(have, want) <= allowed, f"{name}: {what} error {_max_err(have, want):.3g} > {allowed:.3g}"


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("name", _names())
def test_causal_zero_scale_is_the_running_mean_of_v(name, align):
    """The tutorials' averaging trick: uniform weights over the past. PyTorch's CPU kernel
    gave NaN there (it scales its causal -inf fill: -inf * 0), in sdpa and in blocks."""
    q, k, v = _qkv()
    tq = T if align == "top_left" else T // 2
    if name == "flex" and tq != T:
        pytest.skip("flex compiles per shape; the top-left case checks it at the module's shape")
    q = q[:, :, :tq]
    seen = torch.arange(T).view(1, T) <= torch.arange(tq).view(tq, 1) + (T - tq if align == "bottom_right" else 0)
    running_mean = (seen.double() / seen.sum(-1, keepdim=True)) @ v.double()  # (B, H, Tq, D)
    out, grads = _run(name, [q, k, v], causal=True, align=align, scale=0.0)
    torch.testing.assert_close(out.double(), running_mean, rtol=0, atol=1e-5)
    if grads is not None:
        _, exact_grads, _ = _fp64_attention(q, k, v, seen, 0.0, _d_out(out.shape))
        assert grads[0].eq(0).all() and grads[1].eq(0).all()  # the scores do not depend on q, k
        torch.testing.assert_close(grads[2].double(), exact_grads[2], rtol=0, atol=1e-5)


def _scale_mods(t: int):
    """Mask mods whose blocks pieces include causal diagonals (the kernel's is_causal) at length t."""
    return {
        "causal": None,
        "window-wider-than-T": masks.sliding_window_mod(t, t, 2 * t),
        "prefix-lm": masks.prefix_lm_mod(t, t, t // 3),
        "chunked-local": masks.chunked_local_mod(t, t, t // 3),
        "or-masks": masks.or_masks(masks.sliding_window_mod(t, t, 8), masks.prefix_lm_mod(t, t, 20)),
    }


@pytest.mark.parametrize("scale", [0.0, -0.3, -2.0])
@pytest.mark.parametrize("kind", list(_scale_mods(T)))
@pytest.mark.parametrize("name", _names())
def test_zero_and_negative_scales_on_every_causal_piece(name, kind, scale):
    # 3T: blocks then cuts every mod into several query blocks, with causal-diagonal pieces
    # (at T it runs one 256-query block); flex compiles per shape and stays at the module's.
    t = T if name == "flex" else 3 * T
    mod = _scale_mods(t)[kind]
    options = dict(causal=True) if mod is None else dict(mask=mod)
    allowed = masks.materialize(masks.causal_mod(t, t) if mod is None else mod, tq=t, tk=t).expand(B, H, t, t)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, t, D, generator=gen) for _ in range(3))
    got = _run(name, [q, k, v], scale=scale, **options)
    plain = _run("reference", [q, k, v], scale=scale, **options)
    exact = _fp64_attention(q, k, v, allowed, scale, _d_out(got[0].shape))
    _assert_within_rule(name, got, exact, plain)


# ----------------------------------------------------------------------------- large logits
MAGNITUDES = [1e3, 1e5, 1e8]


def _large_logits(magnitude: float):
    """fp32 q, k, v whose scaled scores reach about ``magnitude``; batch 1's keys are all
    padding, so its rows attend nothing."""
    q, k, v = _qkv()
    return q, k * (magnitude / math.sqrt(D)), v


@pytest.mark.parametrize("magnitude", MAGNITUDES, ids=lambda m: f"{m:g}")
@pytest.mark.parametrize("name", _names())
def test_returned_weights_are_a_softmax_at_any_logit_range(name, magnitude):
    """Rows sum to 1 (0 where nothing is attended), blocked keys get 0. blocks once gave
    exp(scores - lse) with its kernel's lse: rows summed to 0.94-1.008 at 1e3, 1e-7 at 1e8."""
    q, k, v = _large_logits(magnitude)
    options = dict(causal=True, mask=masks.padding_mod(torch.tensor([T, 0])))
    if not _serves(name, (q, k, v), False, **options):
        pytest.skip(f"{name} declines this call")
    with torch.no_grad():
        _, weights = attnlab.attention(q, k, v, backend=name, return_weights=True, **options)
    views = [weights]
    if name == "auto":
        views.append(attnlab.attention_weights(q, k, **options))
    for w in views:
        assert torch.isfinite(w).all()
        sums = w.double().sum(-1)  # (B, H, Tq)
        torch.testing.assert_close(sums[0], torch.ones_like(sums[0]), rtol=0, atol=T * 2.0**-24)
        assert w[1].eq(0).all(), "rows with nothing to attend are zeros"
        assert w[0].triu(1).eq(0).all(), "causally blocked keys get weight 0"


def _flash_rounding(q, k, v, d_out, magnitude, exact, scale=D ** -0.5):
    """What FlashAttention-style backwards (sdpa's and blocks' kernel, chunked) add to the
    rule, per out, dq, dk, dv, at scores of ``magnitude``:

    * the weights are recomputed as ``exp(s - lse)`` from an fp32 lse, rounded to half an ulp
      of the largest score: a relative error of ``2**-24 * |s|`` in each weight. It shows in
      rows whose top scores lie within a few units (at 1e5); at 1e8 these inputs' score gaps
      are ~1e7, every row is one-hot and the weights are exact, so it is left out there;
    * ``dS = P * (dP - rowsum(dO * O))`` cancels ``dP`` against a sum rounded another way:
      ``2**-24 * |dO| |v|`` per score, times ``scale * |k|`` in dq (``|q|`` in dk) -- 0 in
      the plain softmax backward, ~30 at 1e8 in dq whose exact value is 0.
    """
    weights = 2.0**-24 * magnitude if magnitude < 1e6 else 0.0
    delta = 2.0**-24 * float(d_out.abs().max() * v.abs().max()) * math.sqrt(k.shape[-2]) * abs(scale)
    return (weights * float(exact[0].abs().max()), delta * float(k.abs().max()),
            delta * float(q.abs().max()), weights * float(exact[1][2].abs().max()))


@pytest.mark.parametrize("magnitude", MAGNITUDES, ids=lambda m: f"{m:g}")
@pytest.mark.parametrize("name", _names())
def test_gradients_at_large_logits_match_fp64(name, magnitude):
    """PyTorch's CPU flash backward recomputed the scores as scale * (q @ k^T) where its forward
    scaled q @ k^T after rounding it: value gradients were 0.2 off at scores 1e5, 1e27 at 1e8
    (sdpa, blocks), until the scale was folded into q."""
    q, k, v = _large_logits(magnitude)
    mod = masks.sliding_window_mod(T, T, 100)
    got = _run(name, [q, k, v], mask=mod)
    plain = _run("reference", [q, k, v], mask=mod)
    allowed = masks.materialize(mod, tq=T, tk=T).expand(B, H, T, T)
    d_out = _d_out(got[0].shape)
    exact = _fp64_attention(q, k, v, allowed, D ** -0.5, d_out)
    _assert_within_rule(name, got, exact, plain, extra=_flash_rounding(q, k, v, d_out, magnitude, exact))


@pytest.mark.parametrize("name", _names())
def test_gradients_at_a_large_scale_keep_the_documented_bound(name):
    """Causal, scale 1000, fp32: dq and dk were 0.0034 off on sdpa, chunked and blocks where the
    largest gradient is 0.0046 and the reference's error 0.00013: the FlashAttention-2 backward's
    ``rowsum(dO * O)`` against ``dP`` (see _flash_rounding), which the scale multiplies. The
    promise (docs/contract.md, "Scale") is the rule plus that bound; sdpa's and blocks' is the
    kernel's own, chunked is the same algorithm."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(3))
    got = _run(name, [q, k, v], causal=True, scale=1000.0)
    plain = _run("reference", [q, k, v], causal=True, scale=1000.0)
    allowed = torch.ones(32, 32, dtype=torch.bool).tril()
    d_out = _d_out(got[0].shape)
    exact = _fp64_attention(q, k, v, allowed, 1000.0, d_out)
    magnitude = 1000.0 * float((q.double() @ k.double().transpose(-2, -1)).abs().max())
    _assert_within_rule(name, got, exact, plain,
                        extra=_flash_rounding(q, k, v, d_out, magnitude, exact, scale=1000.0))


@pytest.mark.parametrize("name", ["sdpa", "blocks", "chunked", "auto"])
def test_half_precision_output_does_not_depend_on_grad_mode(name):
    """sdpa and blocks folded the scale into fp16/bf16 q whenever a backward would run: q * 1000
    overflowed fp16 to inf (NaN out), and in bf16 the rounding of q * scale moved large scores
    by enough to change which key wins (0.12 off, 0.007 without grad)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    for dtype, q_times, scale in ((torch.float16, 100.0, 1000.0), (torch.bfloat16, 1.0, 37.3)):
        inputs = [(q * q_times).to(dtype), k.to(dtype), v.to(dtype)]
        with torch.no_grad():
            without = attnlab.attention(*inputs, causal=True, scale=scale, backend=name)
        leaves = [t.clone().requires_grad_() for t in inputs]
        with_grad = attnlab.attention(*leaves, causal=True, scale=scale, backend=name)
        assert torch.equal(with_grad.detach(), without), dtype
        exact = attnlab.attention(*(t.double() for t in inputs), causal=True, scale=scale, backend="reference")
        assert _max_err(without, exact) <= FLOOR[dtype] * 8 * float(exact.abs().max()), dtype
        grads = torch.autograd.grad(with_grad, leaves, torch.ones_like(with_grad))
        assert all(torch.isfinite(g).all() for g in grads), dtype


def test_sdpa_repeated_calls_keep_a_zero_scale():
    """A repeated signature (a remembered choice) must fold the scale too."""
    dispatch.clear_plans()
    x = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(3))
    running_mean = torch.cumsum(x.double(), dim=2) / torch.arange(1, 6).view(5, 1)
    for _ in range(3):  # the first choice, then remembered ones
        out = attnlab.attention(x, x, x, causal=True, scale=0.0, backend="sdpa")
        torch.testing.assert_close(out.double(), running_mean, rtol=0, atol=1e-6)


def _bound_inputs(seed, scale):
    """Causal fp32 q, k, v (1, 2, 24, 16), the output gradient _run uses, and the exact fp64
    results with the weights."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))
    d_out = _d_out((1, 2, 24, 16))
    exact = _fp64_attention(q, k, v, torch.ones(24, 24, dtype=torch.bool).tril(), scale, d_out)
    bound = verify.flash_backward_bound(*(t.double() for t in (q, k, v, d_out)), exact[2], scale=scale,
                                        dtype=torch.float32)
    return (q, k, v), exact, bound


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("name", _names())
def test_gradients_at_scale_700_keep_the_contract_bound(name, seed):
    """Causal, scale 700, fp32, T=24, D=16: dq was 0.086 off on sdpa and blocks where the
    textbook backward's error is 0.011 and the old bound (rowsum(dO * O) against dP alone)
    allowed 0.039: the weights recomputed as exp(s - lse) lose u * (|s| + |lse|) at scores
    near 1e4, which verify.flash_backward_bound now counts (docs/contract.md, "Scale")."""
    tensors, exact, bound = _bound_inputs(seed, 700.0)
    got = _run(name, list(tensors), causal=True, scale=700.0)
    plain = _run("reference", list(tensors), causal=True, scale=700.0)
    _assert_within_rule(name, got, exact, plain, extra=(0.0, bound[1], bound[2], 0.0))


@pytest.mark.parametrize("scale", [0.25, 4.0])
def test_the_flash_backward_bound_is_not_vacuous_at_moderate_scales(scale):
    """At scale 1/sqrt(D) and 4 the bound is a small fraction of the largest gradient it
    applies to (it would excuse nothing otherwise), and at 700 it grows with the logits."""
    for seed in range(3):
        _, exact, bound = _bound_inputs(seed, scale)
        for index in (1, 2):
            assert bound[index] < 1e-4 * float(exact[1][index - 1].abs().max()), (seed, index, bound)
    assert _bound_inputs(0, 700.0)[2][1] > 1e3 * _bound_inputs(0, 0.25)[2][1]
