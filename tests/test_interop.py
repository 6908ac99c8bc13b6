"""attnlab's MultiHeadAttention against torch.nn.MultiheadAttention, and torch.compile.

Tolerance (docs/contract.md): with fp64 copies of torch's module as the oracle, attnlab's fp32 error
must be within attnlab.lab.verify's rule of torch's own fp32 error: 2x for outputs, 3x for input
gradients, plus verify's fp32 floor.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import attnlab
from attnlab import masks
from attnlab.lab import verify
from attnlab.nn import MultiHeadAttention, from_torch, to_torch
from attnlab.nn import CallMask, QKV, Chunk, Window

E, H = 24, 3


def _inputs(seed, B, Tq, Tk, kdim, vdim, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, Tq, E, generator=g, dtype=dtype)
    key = torch.randn(B, Tk, kdim, generator=g, dtype=dtype)
    value = torch.randn(B, Tk, vdim, generator=g, dtype=dtype)
    return query, key, value


def _run_torch(ref, query, key, value, *, batch_first, key_padding_mask=None, attn_mask=None):
    """torch's module on batch-first tensors, whatever its own layout."""
    if not batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    out, weights = ref(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                       need_weights=True, average_attn_weights=False)
    return (out if batch_first else out.transpose(0, 1)), weights


def _with_grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out, weights = fn(*tensors)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), weights.detach(), [t.grad for t in tensors]


def _assert_rule(ours, theirs, oracle, what, *, gradient=False):
    """attnlab's error vs the fp64 oracle is within attnlab.lab.verify's rule of torch's own error."""
    err_ours = (ours.double() - oracle).abs().max().item()
    err_theirs = (theirs.double() - oracle).abs().max().item()
    allowed = verify.allowed_error(err_theirs, torch.float32, 1.0, gradient=gradient)
    assert err_ours <= allowed, f"{what}: attnlab {err_ours:.3g}, torch {err_theirs:.3g}"


CONFIGS = [
    # (name, self_attention, kdim, vdim, bias, batch_first, padding, causal)
    ("self_bias", True, E, E, True, True, False, False),
    ("self_padding_nobias", True, E, E, False, True, True, False),
    ("self_causal_seq_first", True, E, E, True, False, False, True),
    ("self_causal_padded", True, E, E, True, True, True, True),
    ("cross_fused_padded", False, E, E, True, True, True, False),
    ("cross_kdim_vdim_seq_first", False, 10, 7, True, False, True, False),
    ("cross_kdim_vdim_nobias", False, 10, 7, False, True, False, False),
]


@pytest.mark.parametrize("name,self_attn,kdim,vdim,bias,batch_first,padding,causal", CONFIGS,
                         ids=[c[0] for c in CONFIGS])
def test_matches_torch_multihead_attention(name, self_attn, kdim, vdim, bias, batch_first, padding, causal):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first).eval()
    ours = from_torch(ref)
    assert not ours.causal and ours.fused == (kdim == vdim == E)
    B, Tq = 3, 9
    Tk = Tq if self_attn else 13
    query, key, value = _inputs(1, B, Tq, Tk, kdim, vdim)
    if self_attn:
        key, value = query, query
    real = torch.ones(B, Tk, dtype=torch.bool)
    if padding:
        real[1, Tk - 4 :] = False
        real[2, 1:3] = False
    kpm = ~real if padding else None  # torch: True = ignore
    causal_bool = masks.causal_mask(Tq, Tk) if causal else None  # attnlab: True = may attend
    attn_mask = ~causal_bool if causal else None  # torch: True = not allowed
    ref64 = copy.deepcopy(ref).double()

    def run_ours(q, k, v):
        context = None if self_attn else k
        return ours(q, context=context, value_input=None if self_attn else v, mask=CallMask(causal_bool, padding=real if padding else None), return_weights=True)

    def run_ref(module):
        return lambda q, k, v: _run_torch(module, q, k, v, batch_first=batch_first,
                                          key_padding_mask=kpm, attn_mask=attn_mask)

    tensors = (query,) if self_attn else (query, key, value)
    expand = (lambda f: (lambda q: f(q, q, q))) if self_attn else (lambda f: f)
    out_ours, w_ours, g_ours = _with_grads(expand(run_ours), *tensors)
    out_ref, w_ref, g_ref = _with_grads(expand(run_ref(ref)), *tensors)
    out_64, w_64, g_64 = _with_grads(expand(run_ref(ref64)), *(t.double() for t in tensors))
    _assert_rule(out_ours, out_ref, out_64, "output")
    _assert_rule(w_ours, w_ref, w_64, "weights")
    for index, (a, b, c) in enumerate(zip(g_ours, g_ref, g_64)):
        _assert_rule(a, b, c, f"grad of input {index}", gradient=True)


def test_causal_module_matches_torch_with_causal_mask():
    torch.manual_seed(3)
    ours = MultiHeadAttention(E, E, num_heads=H, qkv=QKV(bias=True)).eval()
    ref = to_torch(ours).eval()
    x = torch.randn(2, 11, E)
    expected, _ = ref(x, x, x, attn_mask=~masks.causal_mask(11), need_weights=False)
    ref64 = copy.deepcopy(ref).double()
    oracle, _ = ref64(x.double(), x.double(), x.double(), attn_mask=~masks.causal_mask(11),
                      need_weights=False)
    _assert_rule(ours(x), expected, oracle, "causal output")


def test_round_trip_and_single_bias_switch():
    ours = MultiHeadAttention(E, E, num_heads=H, qkv=QKV(bias=False, out_bias=True), pattern=None)
    ref = to_torch(ours, batch_first=False)
    assert ref.in_proj_bias is not None and torch.equal(ref.in_proj_bias, torch.zeros(3 * E))
    back = from_torch(ref)
    x = torch.randn(2, 5, E)
    torch.testing.assert_close(back(x), ours(x), rtol=0, atol=1e-6)


def test_unsupported_conversions_raise():
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch(nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(ValueError, match="num_kv_heads"):
        to_torch(MultiHeadAttention(E, E, num_heads=H, qkv=QKV(num_kv_heads=1)))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        from_torch(nn.Linear(2, 2))


def test_torch_compile_matches_eager_causal_and_padded():
    torch.manual_seed(4)
    module = MultiHeadAttention(32, 32, num_heads=4, positions="rope", qkv=QKV(num_kv_heads=2)).eval()
    compiled = torch.compile(module)
    x = torch.randn(2, 16, 32)
    real = torch.ones(2, 16, dtype=torch.bool)
    real[1, 10:] = False
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(x, mask=CallMask(padding=real)), module(x, mask=CallMask(padding=real)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("option, words", [
    (dict(sinks=True), "sinks (learned)"),
    (dict(pattern=Window(3)), "window=3"),
    (dict(softcap=5.0), "softcap=5.0"),
    (dict(pattern=Chunk(4)), "chunk=4"),
    (dict(positions="alibi"), "positions=ALiBi"),
    (dict(positions="rope"), "positions=RotaryEmbedding"),
    (dict(qkv=QKV(num_kv_heads=1)), "num_kv_heads=1"),
    (dict(attention=lambda q, k, v, **options: attnlab.attention(q, k, v, **options)), "attention="),
])
def test_to_torch_refuses_what_torch_cannot_express_naming_it(option, words):
    """Each of these changes the output (sinks, window, softcap, chunk were dropped without a
    word, 0.40, 0.27, 0.0018, 0.60 off): refused, never converted to a different module."""
    ours = MultiHeadAttention(E, E, num_heads=H, **option)
    with pytest.raises(ValueError, match="torch.nn.MultiheadAttention cannot express .*" + re.escape(words)):
        to_torch(ours)


@pytest.mark.parametrize("option", [dict(), dict(context_length=64), dict(dropout_p=0.25),
                                    dict(qkv=QKV(kdim=10, vdim=7, bias=True)), dict(qkv=QKV(bias=False, out_bias=False)),
                                    dict(backend="chunked")])
def test_to_torch_converts_every_other_setting_to_equal_outputs(option):
    """What converts computes the same: outputs and weights equal torch's module on the same
    weights (causal through torch's attn_mask), and dropout is carried as torch's."""
    torch.manual_seed(5)
    ours = MultiHeadAttention(E, E, num_heads=H, **{"qkv": QKV(bias=True), **option}).eval()
    ref = to_torch(ours).eval()
    assert ref.dropout == ours.dropout_p
    query, key, value = _inputs(2, 2, 9, 9, ours.kdim, ours.vdim)
    cross = ours.kdim != E
    mask = None if cross else masks.causal_mask(9)
    got, w_got = ours(query, context=key if cross else None, value_input=value if cross else None,
                      mask=mask, return_weights=True)
    want, w_want = ref(query, key if cross else query, value if cross else query,
                       attn_mask=None if cross else ~mask, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(w_got, w_want, atol=1e-5, rtol=0)


def test_from_torch_refuses_add_zero_attn():
    with pytest.raises(ValueError, match="add_zero_attn"):
        from_torch(nn.MultiheadAttention(E, H, add_zero_attn=True))
