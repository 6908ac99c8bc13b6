"""masks.varlen_causal_mod: causal alignment per sequence of a padded batch.

The rule (FlashAttention's varlen): query ``i`` of row ``b`` attends key ``j`` when
``i < q_len[b]``, ``j < k_len[b]`` and ``j <= i + k_len[b] - q_len[b]``. Each row of a padded
batched call must equal that row run alone, unpadded, with ``align="bottom_right"``.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import backends, masks

GRAD_BACKENDS = [n for n in ("reference", "sdpa", "chunked", "blocks") if n in backends.available()]


def rule(q_len, k_len, i, j, window=None):
    """The varlen rule for one row, written out."""
    if i >= q_len or j >= k_len:
        return False
    last = i + k_len - q_len
    return j <= last and (window is None or j > last - window)


def explicit(q_lengths, k_lengths, tq, tk, window=None):
    """Dense (B, Tq, Tk) mask from :func:`rule`, element by element."""
    return torch.tensor([[[rule(ql, kl, i, j, window) for j in range(tk)] for i in range(tq)]
                         for ql, kl in zip(q_lengths, k_lengths)], dtype=torch.bool).view(
                             len(q_lengths), tq, tk)


def _inputs(batch, q_heads, kv_heads, tq, tk, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, tq, 8, generator=gen, dtype=dtype)
    k = torch.randn(batch, kv_heads, tk, 8, generator=gen, dtype=dtype)
    v = torch.randn(batch, kv_heads, tk, 5, generator=gen, dtype=dtype)
    grad = torch.randn(batch, q_heads, tq, 5, generator=gen, dtype=dtype)
    return q, k, v, grad


def _run(q, k, v, grad, **options):
    """Output and q/k/v gradients of one attention call."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attnlab.attention(q, k, v, **options)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


CASES = {  # q_lengths, k_lengths, Tq, Tk, Hq, Hkv
    "equal lengths": ([5, 3, 1], [5, 3, 1], 6, 6, 2, 2),
    "decoding": ([1, 1, 1], [7, 2, 5], 1, 8, 2, 2),
    "decoding, padded queries": ([1, 2, 1], [4, 9, 6], 3, 9, 1, 1),
    "chunked prefill": ([3, 2, 4], [9, 6, 4], 4, 10, 2, 1),
    "more queries than keys": ([4, 3], [2, 3], 5, 4, 1, 1),
    "empty rows": ([0, 2, 3, 0], [3, 0, 5, 0], 3, 5, 2, 2),
    "grouped-query": ([2, 5], [6, 5], 5, 7, 4, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_matches_rule(case):
    q_lengths, k_lengths, tq, tk, _, _ = CASES[case]
    mod = masks.varlen_causal_mod(torch.tensor(q_lengths), torch.tensor(k_lengths))
    dense = masks.materialize(mod, tq=tq, tk=tk, batch=len(q_lengths))[:, 0]  # (B, Tq, Tk)
    assert torch.equal(dense, explicit(q_lengths, k_lengths, tq, tk))


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 9)), min_size=1, max_size=4),
       st.sampled_from([None, 1, 2, 5]))
def test_mask_with_window_matches_rule(lengths, window):
    q_lengths, k_lengths = (list(x) for x in zip(*lengths))
    tq, tk = max(q_lengths) + 1, max(k_lengths) + 2
    mod = masks.varlen_causal_mod(torch.tensor(q_lengths), torch.tensor(k_lengths), window=window)
    dense = masks.materialize(mod, tq=tq, tk=tk, batch=len(q_lengths))[:, 0]  # (B, Tq, Tk)
    assert torch.equal(dense, explicit(q_lengths, k_lengths, tq, tk, window))


def _solo(q, k, v, grad, b, q_len, k_len, window):
    """Row ``b`` run alone on its real tokens, bottom-right aligned, on the reference."""
    rows = (q[b:b + 1, :, :q_len], k[b:b + 1, :, :k_len], v[b:b + 1, :, :k_len])
    if window is None:
        options = dict(causal=True, align="bottom_right")
    else:
        options = dict(mask=masks.sliding_window_mod(q_len, k_len, window, align="bottom_right"))
    return _run(*rows, grad[b:b + 1, :, :q_len], backend="reference", **options)


def _check_rows(got, q, k, v, grad, q_lengths, k_lengths, window=None):
    """Each row's real part equals the row alone; padded positions are zero."""
    out, dq, dk, dv = got
    for b, (q_len, k_len) in enumerate(zip(q_lengths, k_lengths)):
        want = _solo(q, k, v, grad, b, q_len, k_len, window)
        for name, padded, solo, real in (("out", out, want[0], q_len), ("dq", dq, want[1], q_len),
                                         ("dk", dk, want[2], k_len), ("dv", dv, want[3], k_len)):
            torch.testing.assert_close(padded[b:b + 1, :, :real], solo, msg=f"{name} row {b}")
            assert padded[b, :, real:].eq(0).all(), f"{name} row {b}: padded positions not zero"


@pytest.mark.parametrize("name", GRAD_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_row_equals_the_row_alone(name, case):
    q_lengths, k_lengths, tq, tk, hq, hkv = CASES[case]
    q, k, v, grad = _inputs(len(q_lengths), hq, hkv, tq, tk)
    mod = masks.varlen_causal_mod(torch.tensor(q_lengths), torch.tensor(k_lengths))
    got = _run(q, k, v, grad, mask=mod, backend=name)
    _check_rows(got, q, k, v, grad, q_lengths, k_lengths)


@pytest.mark.parametrize("name", GRAD_BACKENDS)
def test_window_per_row_equals_the_row_alone(name):
    q_lengths, k_lengths, tq, tk, hq, hkv = CASES["chunked prefill"]
    q, k, v, grad = _inputs(len(q_lengths), hq, hkv, tq, tk, seed=1)
    mod = masks.varlen_causal_mod(torch.tensor(q_lengths), torch.tensor(k_lengths), window=3)
    got = _run(q, k, v, grad, mask=mod, backend=name)
    _check_rows(got, q, k, v, grad, q_lengths, k_lengths, window=3)


@pytest.mark.slow
def test_flex_forward_equals_the_reference():
    if "flex" not in backends.available():
        pytest.skip("flex not available")
    q, k, v, _ = _inputs(2, 2, 1, 4, 128, dtype=torch.float32)  # flex on CPU: whole 128-key blocks
    mod = masks.varlen_causal_mod(torch.tensor([4, 1]), torch.tensor([100, 7]))
    with torch.no_grad():
        got = attnlab.attention(q, k, v, mask=mod, backend="flex")
        want = attnlab.attention(q, k, v, mask=mod, backend="reference")
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", GRAD_BACKENDS)
def test_composes_with_and(name):
    q_lengths, k_lengths, tq, tk, hq, hkv = CASES["chunked prefill"]
    q, k, v, grad = _inputs(len(q_lengths), hq, hkv, tq, tk, seed=2)
    varlen = masks.varlen_causal_mod(torch.tensor(q_lengths), torch.tensor(k_lengths))
    mod = varlen & masks.sliding_window_mod(tq, tk, 4)
    dense = explicit(q_lengths, k_lengths, tq, tk)[:, None] & masks.sliding_window_mask(tq, tk, 4)
    assert torch.equal(masks.materialize(mod, tq=tq, tk=tk, batch=3)[:, :1], dense)
    got = _run(q, k, v, grad, mask=mod, backend=name)
    want = _run(q, k, v, grad, mask=dense, backend="reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", GRAD_BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), 1e4], ids=["nan", "1e4"])
def test_padding_values_do_not_leak(name, poison):
    if poison != poison and name not in ("reference", "chunked"):
        pytest.skip(f"{name} reads blocked keys with weight 0: only finite values are promised")
    q_lengths, k_lengths, tq, tk, hq, hkv = CASES["chunked prefill"]
    q, k, v, grad = _inputs(len(q_lengths), hq, hkv, tq, tk, seed=3)
    clean = _run(q, k, v, grad, mask=masks.varlen_causal_mod(torch.tensor(q_lengths),
                                                              torch.tensor(k_lengths)),
                 backend="reference")
    for b, k_len in enumerate(k_lengths):
        k[b, :, k_len:] = poison
        v[b, :, k_len:] = poison
    mod = masks.varlen_causal_mod(torch.tensor(q_lengths), torch.tensor(k_lengths))
    got = _run(q, k, v, grad, mask=mod, backend=name)
    for b, (q_len, k_len) in enumerate(zip(q_lengths, k_lengths)):
        for padded, want, real in zip(got, clean, (q_len, q_len, k_len, k_len)):
            torch.testing.assert_close(padded[b, :, :real], want[b, :, :real])


def test_blocks_replans_after_lengths_change_in_place():
    if "blocks" not in backends.available():
        pytest.skip("blocks not available")
    q, k, v, _ = _inputs(2, 1, 1, 3, 9, dtype=torch.float32)
    q_lengths, k_lengths = torch.tensor([3, 1]), torch.tensor([9, 4])
    mod = masks.varlen_causal_mod(q_lengths, k_lengths)
    attnlab.attention(q, k, v, mask=mod, backend="blocks")
    k_lengths[1] = 7
    got = attnlab.attention(q, k, v, mask=mod, backend="blocks")
    torch.testing.assert_close(got, attnlab.attention(q, k, v, mask=mod, backend="reference"))


def test_docs_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "sparse.md").read_text()
    section = text.split("## Padded batches with their own lengths", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/sparse.md", "exec"), {})


# ----------------------------------------------------------------------------- bad lengths


@pytest.mark.parametrize("q_lengths, k_lengths, match", [
    ([-1, 2], [3, 3], r"q_lengths must be non-negative, got \[-1, 2\]"),
    ([1, 2], [3, -4], r"k_lengths must be non-negative, got \[3, -4\]"),
    ([[1, 2]], [[3, 3]], r"q_lengths must be a 1-D integer tensor, got shape \(1, 2\)"),
    ([1, 2, 3], [3, 3], r"q_lengths and k_lengths .* q_lengths \[1, 2, 3\] and k_lengths \[3, 3\]"),
])
def test_bad_lengths_are_refused(q_lengths, k_lengths, match):
    with pytest.raises(ValueError, match=match):
        masks.varlen_causal_mod(torch.tensor(q_lengths), torch.tensor(k_lengths))


@pytest.mark.parametrize("name, dtype", [("q_lengths", torch.float32), ("k_lengths", torch.bool),
                                         ("q_lengths", torch.uint8), ("k_lengths", torch.uint8)])
def test_lengths_of_a_wrong_dtype_are_refused_by_name(name, dtype):
    """Unsigned lengths wrapped around in ``k_len - q_len`` (uint8: 3 - 5 == 254), so a row
    with fewer keys than queries attended keys instead of giving zero rows."""
    lengths = {"q_lengths": torch.tensor([1, 1]), "k_lengths": torch.tensor([1, 1])}
    lengths[name] = lengths[name].to(dtype)
    with pytest.raises(TypeError, match=f"{name} must have a signed integer dtype.*got {dtype}"):
        masks.varlen_causal_mod(lengths["q_lengths"], lengths["k_lengths"])


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        masks.varlen_causal_mod(torch.tensor([1]), torch.tensor([1]), window=0)


@pytest.mark.parametrize("q_lengths, k_lengths, match", [
    ([2, 5], [3, 3], r"q_lengths \[2, 5\] exceed the call's Tq = 4"),
    ([2, 2], [3, 7], r"k_lengths \[3, 7\] exceed the call's Tk = 6"),
    ([2], [3], r"has 1 q_lengths \[2\] but the batch has 2 rows"),
])
def test_lengths_that_do_not_fit_the_call_are_refused(q_lengths, k_lengths, match):
    q, k, v, _ = _inputs(2, 1, 1, 4, 6)
    mod = masks.varlen_causal_mod(torch.tensor(q_lengths), torch.tensor(k_lengths))
    with pytest.raises(ValueError, match="mask: VarlenCausalMod.*" + match):
        attnlab.attention(q, k, v, mask=mod)


# ----------------------------------------------------------------------------- key bounds


@settings(max_examples=150)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=4),
       st.sampled_from([None, 1, 3]), st.integers(1, 5))
def test_kv_bounds_hold_every_allowed_key(lengths, window, block):
    q_lengths, k_lengths = (torch.tensor(x) for x in zip(*lengths))
    tq, tk = 12, 12
    mod = masks.varlen_causal_mod(q_lengths, k_lengths, window=window)
    dense = masks.materialize(mod, tq=tq, tk=tk, batch=len(lengths)).any(dim=(0, 1))  # (Tq, Tk)
    for q_start in range(0, tq, block):
        q_end = min(tq, q_start + block)
        lo, hi = mod.kv_bounds(q_start, q_end)
        keys = dense[q_start:q_end].any(dim=0).nonzero().flatten().tolist()
        assert all(lo <= j < hi for j in keys), (q_start, q_end, lo, hi, keys)
        if window is None and keys:  # without a window the bounds are exact
            assert (lo, hi) == (0, max(keys) + 1)


# ----------------------------------------------------------------------------- length dtypes


def _fp64_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(D)) v in fp64 over the allowed keys ``(B, 1|H, Tq, Tk)``; zero rows
    where no key is allowed."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    alive = allowed.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")).masked_fill(~alive, 0.0), dim=-1)
    return (weights * alive) @ v


SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)


@pytest.mark.parametrize("dtype", SIGNED)
@pytest.mark.parametrize("name", GRAD_BACKENDS)
def test_signed_lengths_of_every_width_give_the_fp64_result(name, dtype):
    """Rows with fewer keys than queries and empty rows, lengths in every signed dtype: varlen
    and key padding agree with an fp64 computation on every backend."""
    q_lengths, k_lengths, tq, tk = [4, 3, 0, 2], [2, 3, 4, 0], 5, 4
    q, k, v, _ = _inputs(len(q_lengths), 2, 1, tq, tk, dtype=torch.float32)
    ql, kl = torch.tensor(q_lengths, dtype=dtype), torch.tensor(k_lengths, dtype=dtype)
    varlen = explicit(q_lengths, k_lengths, tq, tk)[:, None]  # (B, 1, Tq, Tk)
    padded = (torch.arange(tk) < torch.tensor(k_lengths)[:, None])[:, None, None]  # (B, 1, 1, Tk)
    for mod, allowed in ((masks.varlen_causal_mod(ql, kl), varlen),
                         (masks.padding_mod(kl) & masks.causal_mod(tq, tk), padded & masks.causal_mask(tq, tk))):
        got = attnlab.attention(q, k, v, mask=mod, backend=name)
        torch.testing.assert_close(got.double(), _fp64_attention(q, k, v, allowed.expand(-1, 1, tq, tk)),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_flex_with_int8_lengths_gives_the_fp64_result():
    if "flex" not in backends.available():
        pytest.skip("flex not available")
    q_lengths, k_lengths = [4, 3], [2, 100]
    q, k, v, _ = _inputs(2, 2, 1, 4, 128, dtype=torch.float32)  # flex on CPU: whole 128-key blocks
    mod = masks.varlen_causal_mod(torch.tensor(q_lengths, dtype=torch.int8),
                                  torch.tensor(k_lengths, dtype=torch.int8))
    with torch.no_grad():
        got = attnlab.attention(q, k, v, mask=mod, backend="flex")
    want = _fp64_attention(q, k, v, explicit(q_lengths, k_lengths, 4, 128)[:, None])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_padding_lengths_of_a_wrong_dtype_are_refused_by_name():
    for dtype in (torch.uint8, torch.bool, torch.float32):
        with pytest.raises(TypeError, match=f"lengths must have a signed integer dtype.*got {dtype}"):
            masks.padding_mod(torch.tensor([1, 0], dtype=dtype))
        with pytest.raises(TypeError, match=f"lengths must have a signed integer dtype.*got {dtype}"):
            masks.padding_mask(torch.tensor([1, 0], dtype=dtype), 2)
