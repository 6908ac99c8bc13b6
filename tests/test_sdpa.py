"""The sdpa backend's translation of attnlab calls, checked against independent computations."""

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab.backends import build_call, sdpa


def _qkv(tq=7, tk=9, d=8, dv=8, heads=2, kv_heads=2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads, tq, d, generator=gen, dtype=dtype),
            torch.randn(2, kv_heads, tk, d, generator=gen, dtype=dtype),
            torch.randn(2, kv_heads, tk, dv, generator=gen, dtype=dtype))


def _explicit(q, k, v, allowed=None, bias=None, scale=None):
    """Textbook attention in fp64, written independently of attnlab."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, -1), nan=0.0) @ v


def test_bool_mask_polarity_true_means_attend():
    q, k, v = _qkv()
    allowed = torch.rand(7, 9, generator=torch.Generator().manual_seed(1)) > 0.4
    allowed[:, 0] = True
    out = attnlab.attention(q, k, v, mask=allowed, backend="sdpa")
    torch.testing.assert_close(out, _explicit(q, k, v, allowed=allowed))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("tq,tk", [(7, 9), (9, 7), (8, 8)])
def test_causal_alignments(align, tq, tk):
    q, k, v = _qkv(tq=tq, tk=tk)
    offset = 0 if align == "top_left" else tk - tq
    allowed = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + offset
    out = attnlab.attention(q, k, v, causal=True, align=align, backend="sdpa")
    torch.testing.assert_close(out, _explicit(q, k, v, allowed=allowed))


def test_top_left_causal_uses_is_causal_and_flash_on_cpu():
    q, k, v = _qkv(dtype=torch.float32)
    plan = sdpa.sdpa_plan(build_call(q, k, v, causal=True))
    assert plan.mask_source == "is_causal"
    assert plan.kernel == ("flash" if not q.is_cuda else plan.kernel)
    assert sdpa.sdpa_plan(build_call(q, k, v, causal=True, align="bottom_right")).mask_source == "materialised"


def test_grouped_query_dv_scale_and_float_mask():
    q, k, v = _qkv(heads=6, kv_heads=2, dv=5)
    bias = torch.randn(7, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = attnlab.attention(q, k, v, mask=bias, scale=0.3, backend="sdpa")
    torch.testing.assert_close(out, _explicit(q, k, v, bias=bias, scale=0.3))


def test_causal_and_mask_are_anded():
    q, k, v = _qkv(tq=9, tk=9)
    pad = attnlab.masks.padding_mask(torch.tensor([9, 4]), 9)  # (B, 1, 1, Tk)
    out = attnlab.attention(q, k, v, mask=pad, causal=True, backend="sdpa")
    allowed = pad & torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _explicit(q, k, v, allowed=allowed))


def test_dropout_with_generator_leaves_global_rng_alone():
    q, k, v = _qkv(dtype=torch.float32)
    torch.manual_seed(11)
    expected_next = torch.rand(3)
    torch.manual_seed(11)
    attnlab.attention(q, k, v, dropout_p=0.5, generator=torch.Generator().manual_seed(0), backend="sdpa")
    assert torch.equal(torch.rand(3), expected_next)


def test_dropout_backward_is_consistent_with_forward():
    """Same generator seed twice -> same grads (the dropout mask is saved, not redrawn)."""
    grads = []
    for _ in range(2):
        q, k, v = (t.float().requires_grad_() for t in _qkv())
        out = attnlab.attention(q, k, v, dropout_p=0.4, generator=torch.Generator().manual_seed(3),
                                backend="sdpa")
        out.sum().backward()
        grads.append(q.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_forward_backward_matches_fp64(dtype):
    q, k, v = (t.cuda().to(dtype).requires_grad_() for t in _qkv(tq=128, tk=128, d=64, dv=64))
    out = attnlab.attention(q, k, v, causal=True, backend="sdpa")
    out.float().sum().backward()
    allowed = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()
    want = _explicit(*(t.detach().double() for t in (q, k, v)), allowed=allowed)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    assert torch.isfinite(q.grad).all()
