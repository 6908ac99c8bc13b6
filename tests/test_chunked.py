"""The chunked backend against an fp64 reference: every mask, every tiling, forward and backward.

The oracle is the reference backend run in fp64 (explicit softmax over the full score matrix).
Errors are judged by the rule of docs/contract.md: at most 2x (forward) / 3x (gradients) the error of the
plain reference computation at the same dtype, plus a small floor.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.lab import verify
from attnlab._memory import PeakMemory
from attnlab.backends import build_call, get, select
from attnlab.backends.chunked import chunked_attention, draw_dropout_seed, dropout_keep
from attnlab._math import masked_scores, repeat_kv, softmax_rows



@pytest.fixture(autouse=True)
def _one_thread():
    """Small tiles are thousands of tiny ops; with one intra-op thread they do not wait on each
    other's scheduling when the 2-core test machine is busy (see the chunked module notes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- helpers
def _inputs(b, hq, hkv, tq, tk, d, dv, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, dv, generator=gen, dtype=torch.float64)
    d_out = torch.randn(b, hq, tq, dv, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)], d_out.to(dtype)


def _run(forward, tensors, d_out, **options):
    """Output and gradients of q, k, v (and a float mask, if it requires grad)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    mask = options.pop("mask", None)
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = mask.detach().clone().requires_grad_()
        leaves.append(mask)
    out = forward(build_call(*leaves[:3], mask=mask, **options)).out
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves]


def _reference(call):
    return get("reference").forward(call)


def _as64(options):
    mask = options.get("mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        return {**options, "mask": mask.double()}
    return options


def _assert_design_rule(fast, low, exact, *, gradient: bool):
    """max|fast - exact| <= verify.allowed_error(max|low - exact|, ...), for each tensor pair."""
    magnitude = max(float(t.abs().max()) for t in exact if t.numel())
    for f, lo, ex in zip(fast, low, exact):
        err = (f.double() - ex).abs().max().item()
        base = (lo.double() - ex).abs().max().item()
        allowed = verify.allowed_error(base, f.dtype, magnitude, gradient=gradient)
        assert not math.isnan(err), "NaN in the chunked result"
        assert err <= allowed, f"error {err:.3g} > allowed {allowed:.3g} (plain error {base:.3g})"


def _assert_same_up_to_rounding(first, second):
    """Tilings agree within 1e-6 of each tensor's scale for out, 2e-6 for the gradients
    (sums over more terms), i.e. a few fp32 ulps."""
    for index, (a, b) in enumerate(zip(first, second)):
        tol = (1e-6 if index == 0 else 2e-6) * max(1.0, b.abs().max().item())
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"tensor {index}: tilings differ by {diff:.3g} > {tol:.3g}"


def _padding(b, tk, lengths):
    return masks.padding_mask(torch.tensor(lengths), tk)  # (B, 1, 1, Tk)


def _float_mask(hq, tq, tk):
    bias = torch.randn(1, hq, tq, tk, generator=torch.Generator().manual_seed(5))
    return bias.masked_fill(bias < -1.2, float("-inf"))


# (id, (B, Hq, Hkv, Tq, Tk, D, Dv), options)
CASES = [
    ("causal-top_left", (2, 2, 2, 13, 17, 8, 8), dict(causal=True)),
    ("causal-bottom_right", (1, 3, 3, 11, 16, 5, 5), dict(causal=True, align="bottom_right")),
    ("causal-bottom_right-Tq>Tk", (1, 2, 2, 15, 9, 4, 4), dict(causal=True, align="bottom_right")),
    ("bool-padding", (3, 2, 2, 12, 12, 6, 6), dict(mask=_padding(3, 12, [12, 7, 1]))),
    ("float-mask", (1, 3, 3, 14, 18, 7, 7), dict(mask=_float_mask(3, 14, 18))),
    ("mask-mod", (2, 2, 2, 16, 16, 8, 8), dict(mask=lambda b, h, i, j: (i + j + b + h) % 3 != 0)),
    ("sliding-window", (1, 2, 2, 18, 18, 8, 8), dict(mask=masks.sliding_window_mod(18, 18, 4))),
    ("window-and-causal", (1, 1, 1, 19, 19, 3, 3),
     dict(causal=True, mask=masks.sliding_window_mod(19, 19, 5))),
    ("gqa", (2, 6, 2, 10, 14, 8, 8), dict(causal=True)),
    ("Dv!=D", (1, 2, 1, 9, 13, 3, 11), dict()),
    ("T=1", (1, 2, 2, 1, 1, 4, 4), dict(causal=True)),
    ("T=2", (1, 2, 2, 2, 2, 40, 40), dict(causal=True)),
    ("T=3", (2, 1, 1, 3, 3, 1, 1), dict()),
    ("T=17", (1, 5, 5, 17, 17, 111, 111), dict(causal=True, scale=0.3)),
    ("T=113", (1, 3, 1, 113, 113, 16, 24), dict(causal=True)),
    ("T=113-bool-mod", (1, 2, 2, 113, 97, 8, 8),
     dict(mask=torch.rand(1, 1, 113, 97, generator=torch.Generator().manual_seed(1)) > 0.5)),
]


@pytest.mark.parametrize("shape,options", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_chunk_size_matches_fp64_reference(shape, options):
    tensors, d_out = _inputs(*shape)
    t_max = max(shape[3], shape[4])
    sizes = [1, 7, 64, t_max] if t_max <= 20 else [7, 64, t_max]
    exact = _run(_reference, [t.double() for t in tensors], d_out.double(), **_as64(options))
    low = _run(_reference, tensors, d_out, **options)
    results = []
    for size in sizes:
        def forward(call, size=size):
            return chunked_attention(call, q_block=size, kv_block=size)

        out, grads = _run(forward, tensors, d_out, **options)
        _assert_design_rule([out], [low[0]], [exact[0]], gradient=False)
        _assert_design_rule(grads, low[1], exact[1], gradient=True)
        results.append([out, *grads])
    for other in results[1:]:
        _assert_same_up_to_rounding(results[0], other)


def test_rectangular_tiles_match_square_tiles():
    tensors, d_out = _inputs(1, 2, 2, 37, 53, 8, 8)
    square = _run(lambda c: chunked_attention(c, q_block=16, kv_block=16), tensors, d_out,
                  causal=True, align="bottom_right")
    for qb, kb in [(5, 13), (53, 3)]:
        other = _run(lambda c: chunked_attention(c, q_block=qb, kv_block=kb), tensors, d_out,
                     causal=True, align="bottom_right")
        _assert_same_up_to_rounding([other[0], *other[1]], [square[0], *square[1]])


# ----------------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True),
        dict(causal=True, align="bottom_right", mask=lambda b, h, i, j: (i * j) % 4 != 1),
        dict(mask=masks.padding_mask(torch.tensor([4, 2]), 6)),
        dict(mask="float"),
    ],
    ids=["causal", "mod-bottom_right", "padding", "float-mask-grad"],
)
def test_gradcheck_fp64(options):
    (q, k, v), _ = _inputs(2, 4, 2, 5, 6, 3, 2, dtype=torch.float64)
    leaves = [q, k, v]
    if options.get("mask") == "float":
        options = {"mask": _float_mask(4, 5, 6).double().clamp(min=-5)}
        leaves.append(options["mask"])
    leaves = [t.requires_grad_() for t in leaves]

    def fn(*tensors):
        opts = {**options, "mask": tensors[3]} if len(tensors) == 4 else options
        return chunked_attention(build_call(*tensors[:3], **opts), q_block=2, kv_block=4).out

    assert torch.autograd.gradcheck(fn, tuple(leaves))


# ----------------------------------------------------------------------------- masking edge cases
def test_fully_masked_rows_give_zeros_and_zero_gradients():
    (q, k, v), d_out = _inputs(1, 2, 2, 9, 7, 4, 4)
    mask = torch.ones(1, 2, 9, 7, dtype=torch.bool)
    mask[0, 0, 3] = False
    mask[0, 1, 5:] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    result = chunked_attention(build_call(*leaves, mask=mask), q_block=4, kv_block=3)
    result.out.backward(d_out)
    dead = ~mask.any(-1)  # (1, 2, 9)
    assert result.out[dead].eq(0).all()
    assert leaves[0].grad[dead].eq(0).all()
    assert torch.isneginf(result.lse[dead]).all() and torch.isfinite(result.lse[~dead]).all()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_bottom_right_causal_with_more_queries_than_keys_zeroes_early_rows():
    (q, k, v), _ = _inputs(1, 1, 1, 8, 3, 4, 4)
    q.requires_grad_()
    out = chunked_attention(build_call(q, k, v, causal=True, align="bottom_right"), q_block=3).out
    out.sum().backward()
    assert out[0, 0, :5].eq(0).all() and q.grad[0, 0, :5].eq(0).all()
    assert out[0, 0, 5:].ne(0).any()


@pytest.mark.parametrize("kind", ["bool", "float", "mod", "causal-cache"])
def test_nan_in_masked_keys_and_values_does_not_leak(kind):
    b, h, t, d = 2, 2, 40, 8
    (q, k, v), d_out = _inputs(b, h, h, t, t, d, d)
    lengths = [40, 23]
    real = masks.padding_mask(torch.tensor(lengths), t)  # (B, 1, 1, Tk)
    options = {
        "bool": dict(mask=real),
        "float": dict(mask=torch.zeros(real.shape).masked_fill(~real, float("-inf"))),
        "mod": dict(mask=masks.padding_mod(torch.tensor(lengths))),
        "causal-cache": dict(causal=True),  # queries 0..22 of a 40-slot cache: keys >= 23 unused
    }[kind]
    if kind == "causal-cache":
        q, d_out = q[:, :, :23], d_out[:, :, :23]
        real = torch.arange(t).view(1, 1, 1, t) < 23
    poisoned = [torch.where(real.transpose(-2, -1), x, float("nan")) for x in (k, v)]
    clean = [torch.where(real.transpose(-2, -1), x, 0.0) for x in (k, v)]

    def forward(call):
        return chunked_attention(call, q_block=16, kv_block=16)

    out, grads = _run(forward, [q, *poisoned], d_out, **options)
    want_out, want_grads = _run(forward, [q, *clean], d_out, **options)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    keep = real.transpose(-2, -1).expand(b, h, t, 1)  # (B, H, Tk, 1) real key positions
    torch.testing.assert_close(grads[0], want_grads[0], atol=0, rtol=0)
    for got, want in zip(grads[1:3], want_grads[1:3]):
        torch.testing.assert_close(got[keep.expand_as(got)], want[keep.expand_as(want)])


def test_large_negative_finite_float_mask_is_a_bias_not_a_block():
    # A row biased by finfo.min everywhere is still a softmax over finite scores (uniform
    # weights), as in the reference; only -inf blocks.
    (q, k, v), _ = _inputs(1, 1, 1, 6, 6, 4, 4)
    bias = torch.zeros(1, 1, 6, 6)
    bias[..., 2, :] = torch.finfo(torch.float32).min
    bias[..., 4, :] = float("-inf")
    out = chunked_attention(build_call(q, k, v, mask=bias), q_block=2, kv_block=4).out
    torch.testing.assert_close(out[0, 0, 2], v[0, 0].mean(0))
    assert out[0, 0, 4].eq(0).all()
    torch.testing.assert_close(out, _reference(build_call(q, k, v, mask=bias)).out)


def test_causality_future_tokens_do_not_change_earlier_outputs():
    (q, k, v), _ = _inputs(1, 2, 2, 50, 50, 8, 8)
    out = chunked_attention(build_call(q, k, v, causal=True), q_block=16, kv_block=8).out
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:] += 5.0
    v2[:, :, 30:] -= 3.0
    out2 = chunked_attention(build_call(q, k2, v2, causal=True), q_block=16, kv_block=8).out
    assert torch.equal(out[:, :, :30], out2[:, :, :30])
    assert not torch.allclose(out[:, :, 30:], out2[:, :, 30:])


# ----------------------------------------------------------------------------- tile skipping
def _visited(call, q_block, kv_block):
    seen = {"forward": set(), "backward": set()}
    leaves = [t.clone().requires_grad_() for t in (call.q, call.k, call.v)]
    call = build_call(*leaves, mask=call.mask, causal=call.causal_offset is not None, align=call.align)
    out = chunked_attention(call, q_block=q_block, kv_block=kv_block,
                            tile_hook=lambda stage, qs, ks: seen[stage].add((qs, ks))).out
    out.sum().backward()
    assert seen["forward"] == seen["backward"]
    return seen["forward"]


def _tiles_with_any_allowed(dense, block):
    """Tiles of a (Tq, Tk) bool mask on an aligned grid that allow at least one position."""
    tq, tk = dense.shape
    return {
        (qs, ks)
        for qs in range(0, tq, block)
        for ks in range(0, tk, block)
        if dense[qs:qs + block, ks:ks + block].any()
    }


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_causal_visits_only_tiles_on_or_below_the_diagonal(align):
    t, block = 1024, 64
    (q, k, v), _ = _inputs(1, 1, 1, t, t, 4, 4)
    visited = _visited(build_call(q, k, v, causal=True, align=align), block, block)
    n = t // block
    assert len(visited) == n * (n + 1) // 2  # 136 of 256 tiles
    assert visited == _tiles_with_any_allowed(masks.causal_mask(t, align=align), block)


def test_dense_bool_mask_tiles_with_nothing_allowed_are_skipped():
    t, block = 512, 64
    (q, k, v), _ = _inputs(1, 1, 1, t, t, 4, 4)
    dense = masks.causal_mask(t) & ~masks.causal_mask(t, align="top_left").roll(-200, dims=1)
    dense |= torch.eye(t, dtype=torch.bool)
    visited = _visited(build_call(q, k, v, mask=dense), block, block)
    assert visited == _tiles_with_any_allowed(dense, block)
    assert len(visited) < 0.6 * (t // block) ** 2


def test_sliding_window_visits_order_t_times_window_tiles():
    t, window, block = 2048, 64, 64
    (q, k, v), _ = _inputs(1, 1, 1, t, t, 4, 4)
    visited = _visited(build_call(q, k, v, mask=masks.sliding_window_mod(t, t, window)), block, block)
    n = t // block
    # Each query block reaches window + block - 1 keys: at most 2 key tiles of 64 (not n = 32).
    assert n <= len(visited) <= 2 * n


# ----------------------------------------------------------------------------- memory
def _peak_fwd_bwd(forward, t):
    (q, k, v), d_out = _inputs(1, 1, 1, t, t, 64, 64)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    with PeakMemory() as meter:
        forward(build_call(*leaves)).out.backward(d_out)
    return meter.peak_bytes


def test_forward_backward_peak_memory_is_linear_in_t():
    t = 8192
    chunked = _peak_fwd_bwd(get("chunked").forward, t)
    reference = _peak_fwd_bwd(get("reference").forward, t)
    assert reference >= t * t * 4  # the reference holds at least one fp32 (T, T) matrix
    assert chunked <= 0.25 * reference
    assert chunked <= 64 * t * 64 * 4  # O(T * D): a few dozen (T, D) buffers at most


# ----------------------------------------------------------------------------- dropout
def _dropout_call(tensors, seed, p=0.3, **options):
    return build_call(*tensors, dropout_p=p, generator=torch.Generator().manual_seed(seed),
                      **options)


def test_dropout_same_seed_is_bitwise_identical_and_tiling_independent():
    (q, k, v), _ = _inputs(2, 3, 3, 33, 41, 8, 8)
    first = chunked_attention(_dropout_call((q, k, v), 11, causal=True), q_block=8).out
    again = chunked_attention(_dropout_call((q, k, v), 11, causal=True), q_block=8).out
    other_tiles = chunked_attention(_dropout_call((q, k, v), 11, causal=True), q_block=5,
                                    kv_block=7).out
    other_seed = chunked_attention(_dropout_call((q, k, v), 12, causal=True), q_block=8).out
    assert torch.equal(first, again)
    torch.testing.assert_close(other_tiles, first, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(first, other_seed)


def test_dropout_keeps_one_minus_p_of_the_weights():
    t, p = 512, 0.3
    q = torch.zeros(1, 1, t, 8)  # equal scores: every weight is 1 / T before dropout
    k = torch.randn(1, 1, t, 8)
    v = torch.eye(t).view(1, 1, t, t)  # out[i, j] = weight[i, j] after dropout
    out = chunked_attention(_dropout_call((q, k, v), 3, p=p), q_block=100, kv_block=100).out
    kept = out[0, 0] * t * (1 - p)  # 1 where kept, 0 where dropped
    assert torch.allclose(kept, kept.round(), atol=1e-4)
    assert abs(kept.mean().item() - (1 - p)) < 0.01
    seed = draw_dropout_seed(torch.Generator().manual_seed(3))
    mask = dropout_keep(seed, p, batch=1, heads=1, q_idx=torch.arange(t), kv_idx=torch.arange(t))
    assert torch.equal(kept.round().bool(), mask[0, 0])


def test_dropout_bits_of_neighbours_heads_and_seeds_are_uncorrelated():
    def keep(seed):
        return dropout_keep(seed, 0.5, batch=2, heads=2, q_idx=torch.arange(512),
                            kv_idx=torch.arange(512)).double()  # (2, 2, 512, 512)

    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()

    bits, other_seed = keep(5), keep(6)
    pairs = {
        "rows": (bits[..., 1:, :], bits[..., :-1, :]),
        "columns": (bits[..., 1:], bits[..., :-1]),
        "heads": (bits[:, 1], bits[:, 0]),
        "batch": (bits[1], bits[0]),
        "seeds": (bits, other_seed),
    }
    for name, (a, b) in pairs.items():  # ~5e5..1e6 pairs: the std of corr is <= 0.0015
        assert abs(corr(a, b)) < 0.006, name


def _dropout_reference(tensors, d_out, keep, p, **options):
    """out and grads of softmax(...) * keep / (1 - p) @ v, from the reference's helpers."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    call = build_call(*leaves, **options)
    q_heads = call.q_heads
    weights = softmax_rows(masked_scores(call, call.q, repeat_kv(call.k, q_heads)))
    out = (weights * keep.to(weights.dtype) / (1 - p)) @ repeat_kv(call.v, q_heads)
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves]


def test_dropout_gradients_match_a_reference_with_the_same_mask():
    p, options = 0.25, dict(causal=True, align="bottom_right")
    tensors, d_out = _inputs(2, 4, 2, 19, 27, 8, 6)
    seed = draw_dropout_seed(torch.Generator().manual_seed(9))
    keep = dropout_keep(seed, p, batch=2, heads=4, q_idx=torch.arange(19), kv_idx=torch.arange(27))
    exact = _dropout_reference([t.double() for t in tensors], d_out.double(), keep, p, **options)
    low = _dropout_reference(tensors, d_out, keep, p, **options)
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = chunked_attention(_dropout_call(leaves, 9, p=p, **options), q_block=8, kv_block=8).out
    out.backward(d_out)
    _assert_design_rule([out.detach()], [low[0]], [exact[0]], gradient=False)
    _assert_design_rule([t.grad for t in leaves], low[1], exact[1], gradient=True)


def test_dropout_gradcheck_fp64():
    (q, k, v), _ = _inputs(1, 2, 1, 4, 5, 3, 3, dtype=torch.float64)

    def fn(q, k, v):
        return chunked_attention(_dropout_call((q, k, v), 4, p=0.4), q_block=3, kv_block=2).out

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


# ----------------------------------------------------------------------------- low precision
def test_bf16_within_design_rule_of_fp64():
    tensors, d_out = _inputs(1, 4, 2, 150, 170, 40, 40, dtype=torch.bfloat16)
    options = dict(causal=True, align="bottom_right")
    exact = _run(_reference, [t.double() for t in tensors], d_out.double(), **options)
    low = _run(_reference, tensors, d_out, **options)
    out, grads = _run(lambda c: chunked_attention(c, q_block=64, kv_block=64), tensors, d_out,
                      **options)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    _assert_design_rule([out], [low[0]], [exact[0]], gradient=False)
    _assert_design_rule(grads, low[1], exact[1], gradient=True)


def test_lse_is_fp32_for_half_inputs_and_rebuilds_the_weights():
    (q, k, v), _ = _inputs(2, 2, 2, 21, 30, 8, 8)
    mask = masks.padding_mask(torch.tensor([30, 12]), 30)
    half = chunked_attention(build_call(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=mask))
    assert half.lse.dtype == torch.float32 and half.out.dtype == torch.bfloat16
    _, weights = attnlab.attention(q, k, v, mask=mask, backend="chunked", return_weights=True)
    call64 = build_call(q.double(), k.double(), v.double(), mask=mask)
    expected = softmax_rows(masked_scores(call64, call64.q, call64.k))
    torch.testing.assert_close(weights.double(), expected, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- backend
def test_registered_and_preferred_over_the_quadratic_reference():
    q = torch.randn(1, 2, 1024, 8)
    call = build_call(q, q, q, mask=lambda b, h, i, j: i >= j)
    assert get("chunked").memory == "linear" and not get("chunked").not_supported_reasons(call)
    assert select(call, "auto").name != "reference"
    causal = get("chunked").cost(build_call(q, q, q, causal=True))
    assert 0 < causal < get("chunked").cost(build_call(q, q, q))


@pytest.mark.parametrize("rank", [2, 3])
def test_rank_2_and_3_inputs_through_attention(rank):
    (q, k, v), _ = _inputs(1, 1, 1, 11, 13, 6, 5)
    q, k, v = (t[0, 0] if rank == 2 else t[:, 0] for t in (q, k, v))  # (T, D) or (B, T, D)
    out = attnlab.attention(q, k, v, causal=True, align="bottom_right", backend="chunked")
    want = attnlab.attention(q.double(), k.double(), v.double(), causal=True,
                             align="bottom_right", backend="reference")
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=0)


def test_double_backward_raises_instead_of_returning_wrong_gradients():
    (q, k, v), _ = _inputs(1, 1, 1, 4, 4, 2, 2, dtype=torch.float64)
    q.requires_grad_()
    out = chunked_attention(build_call(q, k, v)).out
    (grad,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


@pytest.mark.parametrize("name,value,error", [("q_block", 0, ValueError), ("kv_block", -3, ValueError),
                                              ("q_block", 2.5, TypeError)])
def test_bad_block_sizes_raise_naming_the_argument(name, value, error):
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(error, match=name):
        chunked_attention(build_call(q, q, q), **{name: value})
