"""Top-k sparse attention, ``attnlab.attention(q, k, v, indices=...)``, against fp64 math written plainly.

The oracle builds the dense bool mask of the listed keys (a scatter: a repeated key counts once,
-1 is none), ANDs the call's mask, and runs softmax attention in fp64. The kernel never builds
that mask; the memory test checks it stays far below one (T, T) tensor.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab._memory import PeakMemory
from attnlab.lab.verify import allowed_error


def listed_mask(indices: torch.Tensor, tk: int) -> torch.Tensor:
    """(..., Tq, Tk) bool: True where indices lists the key (-1 skipped)."""
    dense = torch.zeros(*indices.shape[:-1], tk, dtype=torch.bool)
    for position in range(indices.shape[-1]):
        column = indices[..., position]
        hit = torch.nn.functional.one_hot(column.clamp(min=0), tk).bool() & (column >= 0)[..., None]
        dense |= hit
    return dense


def plain(q, k, v, allowed, *, bias=None, sinks=None, scale=None):
    """softmax(q k^T * scale + bias) v over ``allowed``, zero rows where nothing is allowed."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    alive = (scores > float("-inf")).any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~alive, 0.0), dim=-1) * alive
    if sinks is not None:
        weights = weights[..., :-1]
    return weights @ v


def draw(B, Hq, Hkv, Tq, Tk, D, K, *, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Tq, D, generator=gen, dtype=dtype)
    k = torch.randn(B, Hkv, Tk, D, generator=gen, dtype=dtype)
    v = torch.randn(B, Hkv, Tk, D + 1, generator=gen, dtype=dtype)
    indices = torch.randint(-1, Tk, (B, Hkv, Tq, K), generator=gen)
    return q, k, v, indices


def run_both(q, k, v, indices, allowed, *, dtype, options=(), bias=None, sinks=None):
    """Output and gradients of the kernel in ``dtype``, of plain math in fp64 and in ``dtype``."""
    options = dict(options)
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for kind, work in (("kernel", dtype), ("oracle", torch.float64), ("plain", dtype)):
        inputs = [t.to(work).requires_grad_() for t in (q, k, v)]
        sink = None if sinks is None else sinks.to(work).requires_grad_()
        if kind == "kernel":
            out = attnlab.attention(*inputs, indices=indices, sinks=sink, **options)
        else:
            out = plain(*inputs, allowed, bias=None if bias is None else bias.to(work), sinks=sink,
                        scale=options.get("scale"))
        grads = torch.autograd.grad(out, inputs + ([sink] if sink is not None else []), grad_out.to(work))
        results.append([t.double() for t in (out, *grads)])
    return results


def assert_close(results, dtype, reduction):
    got, oracle, plain_run = results
    for index, (a, b, p) in enumerate(zip(got, oracle, plain_run)):
        magnitude = b.abs().max().item() if b.numel() else 0.0
        bound = allowed_error((p - b).abs().max().item() if b.numel() else 0.0, dtype, magnitude,
                              reduction=reduction, gradient=index > 0)
        error = (a - b).abs().max().item() if b.numel() else 0.0
        assert error <= bound, (index, error, bound)


CASES = {
    # name: (B, Hq, Hkv, Tq, Tk, D, K, options)
    "odd, causal, Tq<Tk bottom_right": (2, 3, 3, 7, 13, 5, 6, dict(causal=True, align="bottom_right")),
    "GQA, Tq>Tk, top_left causal": (1, 4, 2, 9, 5, 8, 5, dict(causal=True)),
    "no mask, k = Tk": (2, 2, 1, 5, 6, 4, 6, {}),
    "scale": (1, 2, 2, 6, 6, 3, 3, dict(scale=-0.7)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_fp64_forward_and_backward(case, dtype):
    B, Hq, Hkv, Tq, Tk, D, K, options = CASES[case]
    q, k, v, indices = draw(B, Hq, Hkv, Tq, Tk, D, K)
    indices[..., 0, :] = -1  # a row with no key
    indices[..., 1, :] = indices[..., 1, :1]  # one key listed k times: counted once
    allowed = listed_mask(indices, Tk).repeat_interleave(Hq // Hkv, dim=1)
    if options.get("causal"):
        allowed &= masks.causal_mask(Tq, Tk, align=options.get("align", "top_left"))
    results = run_both(q, k, v, indices, allowed, dtype=dtype, options=options)
    assert_close(results, dtype, Tk)
    out, dq = results[0][0], results[0][1]
    assert out[:, :, 0].eq(0).all() and dq[:, :, 0].eq(0).all()  # the empty row: zeros, zero gradient


def test_padding_mask_and_sinks_shared_indices():
    """A (B, 1, 1, Tk) padding mask ∩ lists shared by every head (B, 1, Tq, k), sinks per head."""
    q, k, v, indices = draw(2, 4, 2, 6, 9, 4, 5, seed=3)
    indices = indices[:, :1]  # (B, 1, Tq, k): one list for all heads, as DSA's indexer gives
    pad = masks.padding_mask(torch.tensor([9, 4]), 9)  # (B, 1, 1, Tk)
    assert pad.shape == (2, 1, 1, 9)
    allowed = listed_mask(indices, 9) & pad
    sinks = torch.randn(4, dtype=torch.float64)
    results = run_both(q, k, v, indices, allowed, dtype=torch.float32, options=dict(mask=pad), sinks=sinks)
    assert_close(results, torch.float32, 9)


@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_every_list_layout_under_gqa(layout, causal):
    """Lists shared by the batch and/or the heads or one per (b, kv head), 2 query heads per kv head:
    the backward's key bags are sorted once per distinct list and summed over every head."""
    q, k, v, indices = draw(2, 4, 2, 7, 9, 4, 5, seed=10)
    indices = indices[:layout[0], :layout[1]].clone()  # (B|1, Hkv|1, Tq, k)
    indices[..., 2, :] = -1  # a query with no key
    indices[..., 3, :] = 4  # one key listed k times
    allowed = listed_mask(indices, 9).expand(2, 2, 7, 9).repeat_interleave(2, dim=1)  # (B, Hq, Tq, Tk)
    if causal:
        allowed = allowed & masks.causal_mask(7, 9, align="bottom_right")
    options = dict(causal=True, align="bottom_right") if causal else {}
    results = run_both(q, k, v, indices, allowed, dtype=torch.float64, options=options)
    assert_close(results, torch.float64, 9)
    assert results[0][0][:, :, 2].eq(0).all() and results[0][1][:, :, 2].eq(0).all()


def test_expanded_grad_and_unlisted_keys_get_exact_zero():
    """``out.sum().backward()`` hands a stride-0 gradient; keys no query lists get exactly zero dk, dv."""
    q, k, v, indices = draw(2, 2, 1, 6, 10, 4, 3, seed=11)
    indices = indices.clamp(max=7)  # keys 8 and 9 are never listed
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    attnlab.attention(*inputs, indices=indices, causal=True).sum().backward()
    oracle = [t.clone().requires_grad_() for t in (q, k, v)]
    allowed = listed_mask(indices, 10) & masks.causal_mask(6, 10)
    plain(*oracle, allowed.expand(2, 2, 6, 10)).sum().backward()
    for got, expected in zip(inputs, oracle):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-12, rtol=0)
    assert inputs[1].grad[..., 8:, :].eq(0).all() and inputs[2].grad[..., 8:, :].eq(0).all()


def test_nan_score_propagates_and_a_keyless_row_stays_zero():
    """The in-place row softmax: a NaN score reaches its row only; a row with no key is zeros."""
    q, k, v, indices = draw(1, 2, 2, 5, 7, 4, 3, seed=12)
    q[0, 0, 1, 0] = float("nan")
    indices[..., 3, :] = -1
    out = attnlab.attention(q, k, v, indices=indices)
    expected = plain(q, k, v, listed_mask(indices, 7))  # (its own rule zeroes a NaN row)
    nan_row = torch.zeros_like(out, dtype=torch.bool)
    nan_row[0, 0, 1] = True
    assert torch.equal(out.isnan(), nan_row) and out[0, :, 3].eq(0).all()
    torch.testing.assert_close(out[~nan_row], expected[~nan_row], atol=1e-12, rtol=0)


def test_float_mask_is_added_at_the_pairs():
    q, k, v, indices = draw(1, 2, 2, 5, 7, 4, 4, seed=4)
    bias = torch.randn(1, 2, 5, 7, dtype=torch.float64)
    bias[0, 1, 2, :] = float("-inf")  # a fully blocked row
    results = run_both(q, k, v, indices, listed_mask(indices, 7), dtype=torch.float64,
                       options=dict(mask=bias), bias=bias)
    assert_close(results, torch.float64, 7)
    assert results[0][0][0, 1, 2].eq(0).all()


@pytest.mark.parametrize("kind", ["attnlab mod", "plain function"])
def test_mask_mods(kind):
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    mod = masks.document_mod(ids) if kind == "attnlab mod" else (lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx])
    q, k, v, indices = draw(1, 2, 2, 8, 8, 4, 4, seed=5)
    allowed = listed_mask(indices, 8) & masks.materialize(mod, tq=8, tk=8)
    assert_close(run_both(q, k, v, indices, allowed, dtype=torch.float64, options=dict(mask=mod)), torch.float64, 8)


def test_bf16_tiny():
    q, k, v, indices = draw(1, 2, 1, 4, 6, 8, 3, seed=6)
    results = run_both(q, k, v, indices, listed_mask(indices, 6).expand(1, 2, 4, 6), dtype=torch.bfloat16)
    assert_close(results, torch.bfloat16, 6)


def test_ranks_and_reference_backend():
    """Rank 2 and 3 inputs take indices of their rank; backend='reference' is the dense oracle."""
    q, k, v, indices = draw(1, 1, 1, 5, 8, 4, 3, seed=7)
    flat = attnlab.attention(q[0, 0], k[0, 0], v[0, 0], indices=indices[0, 0], causal=True)
    batched = attnlab.attention(q[:, 0], k[:, 0], v[:, 0], indices=indices[:, 0], causal=True)
    dense = attnlab.attention(q, k, v, indices=indices, causal=True, backend="reference")
    expected = plain(q, k, v, listed_mask(indices, 8) & masks.causal_mask(5, 8))
    for got in (flat, batched[0], dense[0, 0]):
        torch.testing.assert_close(got, expected[0, 0], atol=1e-12, rtol=0)


def test_weights_are_dense_and_zero_outside_the_set():
    q, k, v, indices = draw(2, 2, 2, 6, 10, 4, 4, seed=8)
    indices[0, 0, 3] = -1
    out, weights = attnlab.attention(q, k, v, indices=indices, causal=True, return_weights=True)
    _, expected = attnlab.attention(q, k, v, indices=indices, causal=True, return_weights=True, backend="reference")
    assert weights.shape == (2, 2, 6, 10)
    torch.testing.assert_close(weights, expected, atol=1e-12, rtol=0)
    assert weights[~listed_mask(indices, 10)].eq(0).all() and weights[0, 0, 3].eq(0).all()
    torch.testing.assert_close(weights @ v, out, atol=1e-12, rtol=0)


def test_unlisted_keys_are_never_read():
    q, k, v, indices = draw(1, 1, 1, 4, 8, 4, 2, seed=9)
    indices = indices.clamp(max=5)  # keys 6 and 7 are never listed
    before = attnlab.attention(q, k, v, indices=indices)
    k[..., 6:, :], v[..., 6:, :] = float("nan"), float("inf")
    assert torch.equal(attnlab.attention(q, k, v, indices=indices), before)


def test_no_pairs_at_all():
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    k = torch.randn(2, 2, 0, 4, requires_grad=True)
    out = attnlab.attention(q, k, k, indices=torch.zeros(2, 2, 3, 0, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (2, 2, 3, 4) and out.eq(0).all() and q.grad.eq(0).all()


def test_memory_is_linear_in_pairs():
    """T=4096, k=64: forward and backward peak O(T*k), under 64 bytes per pair (weights, int32
    positions, the key bags; the sparse products write in place), under a third of one (T, T) float."""
    T, K = 4096, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, T, 64, generator=gen, requires_grad=True) for _ in range(3))
    indices = (torch.rand(T, K, generator=gen) * torch.arange(1, T + 1)[:, None]).long()
    with PeakMemory() as meter:
        attnlab.attention(q, k, v, indices=indices, causal=True).sum().backward()
    assert meter.peak_bytes < min(64 * T * K, T * T * 4 / 3), meter.peak_bytes


def _call(**changes):
    q = torch.randn(1, 2, 5, 4)
    arguments = dict(indices=torch.zeros(1, 2, 5, 3, dtype=torch.long))
    arguments.update(changes)
    return lambda: attnlab.attention(q, q, q, **arguments)


@pytest.mark.parametrize("changes, error, words", [
    (dict(indices=torch.zeros(1, 2, 5, 3)), TypeError, "indices must have a signed integer dtype"),
    (dict(indices=[[0]]), TypeError, "indices must be an integer tensor"),
    (dict(indices=torch.zeros(5, dtype=torch.long)), ValueError, "indices must have rank 2 to 4"),
    (dict(indices=torch.zeros(1, 2, 4, 3, dtype=torch.long)), ValueError, "its Tq dim is 4, expected 5"),
    (dict(indices=torch.zeros(1, 3, 5, 3, dtype=torch.long)), ValueError, "heads (Hkv or 1) dim is 3"),
    (dict(indices=torch.zeros(1, 2, 5, 6, dtype=torch.long)), ValueError, "k=6 keys per query but there are only Tk=5"),
    (dict(indices=torch.full((1, 2, 5, 3), 5)), ValueError, "[0, Tk=5) or -1 for no key, got 5"),
    (dict(indices=torch.full((1, 2, 5, 3), -2)), ValueError, "got -2"),
    (dict(backend="sdpa"), ValueError, "backend='sdpa' cannot serve a call with indices"),
    (dict(dropout_p=0.1), ValueError, "dropout_p=0.1 is not supported with indices"),
    (dict(score_mod=attnlab.scores.softcap(5.0)), ValueError, "score_mod is not supported with indices"),
    (dict(mask=torch.zeros(5, 5, requires_grad=True)), ValueError, "mask requires grad"),
])
def test_bad_input_names_indices_or_the_option(changes, error, words):
    with pytest.raises(error) as info:
        _call(**changes)()
    assert words in str(info.value)


def test_docs_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "sparse.md").read_text()
    section = text.split("## Top-k attention", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/sparse.md", "exec"), {})


def test_a_compiled_function_runs_the_topk_call_eagerly():
    """torch.compile traced into the index checks (data-dependent) and crashed with an IndexError;
    the top-k call is now left to eager mode (a graph break), with the same result and gradients."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 12, 8, requires_grad=True)
    idx = torch.randint(-1, 12, (1, 1, 12, 3))
    compiled = torch.compile(lambda q, i: attnlab.attention(q, q, q, indices=i, causal=True), backend="eager")
    out, expected = compiled(q, idx), attnlab.attention(q, q, q, indices=idx, causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), q)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), q)[0], rtol=0, atol=0)
