"""DifferentialAttention against the paper's arithmetic written plainly in fp64, and against transformers' DiffLlama."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn import DifferentialAttention, KVCache, PagedKVCache
from attnlab.nn.differential import lambda_init_for

SIZES = [dict(d_model=32, num_heads=4, num_kv_heads=2),
         dict(d_model=24, num_heads=6, num_kv_heads=6, head_dim=6, positions=None),
         dict(d_model=16, num_heads=8, num_kv_heads=2, head_dim=6, rotary_dim=4, layer_idx=5)]


def _module(seed=0, **sizes):
    torch.manual_seed(seed)
    return DifferentialAttention(**sizes, bias=True).double()


def _rotate(x, r, base=10000.0):
    """RoPE on the first r features, pairs (i, i + r/2), positions 0 .. T-1 of x (B, T, n, D)."""
    if r == 0:
        return x
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv  # (T, r/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # (T, 1, r/2)
    x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], -1)


def naive_diff(m: DifferentialAttention, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Per differential head i: queries of heads i and i + H/2, keys of kv heads j and j + Hkv/2
    (j = the head's group), values of both kv heads side by side; causal; ``keep`` (B, T) keys."""
    B, T, _ = x.shape
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    r = 0 if m.rope is None else m.rope.head_dim
    q = _rotate((x @ m.q_proj.weight.T + m.q_proj.bias).view(B, T, H, D), r)
    k = _rotate((x @ m.k_proj.weight.T + m.k_proj.bias).view(B, T, Hkv, D), r)
    v = (x @ m.v_proj.weight.T + m.v_proj.bias).view(B, T, Hkv, D)
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if keep is not None:
        allowed = allowed & keep[:, None, :]
    lam = (torch.exp((m.lambda_q1 * m.lambda_k1).sum()) - torch.exp((m.lambda_q2 * m.lambda_k2).sum())
           + m.lambda_init)
    group = H // Hkv
    heads = []
    for i in range(H // 2):
        j = i // group
        value = torch.cat([v[:, :, j], v[:, :, j + Hkv // 2]], -1)  # (B, T, 2D)
        probs = []
        for qh, kh in ((i, j), (i + H // 2, j + Hkv // 2)):
            s = q[:, :, qh] @ k[:, :, kh].transpose(1, 2) / math.sqrt(D)
            p = s.masked_fill(~allowed, -math.inf).softmax(-1)
            probs.append(torch.nan_to_num(p, nan=0.0))
        o = (probs[0] - lam * probs[1]) @ value  # (B, T, 2D)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.norm_eps)
        heads.append((1 - m.lambda_init) * o)
    return torch.cat(heads, -1) @ m.o_proj.weight.T + m.o_proj.bias


@pytest.mark.parametrize("sizes", SIZES, ids=["gqa", "mha_nope", "partial_rope"])
def test_forward_and_gradients_equal_the_fp64_definition(sizes):
    m = _module(**sizes)
    x = torch.randn(2, 7, sizes["d_model"], dtype=torch.float64, requires_grad=True)
    out, ref = m(x), naive_diff(m, x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    wrt = [x, *m.parameters()]
    assert len(wrt) == 1 + 4 + 4 + 4  # x, four weights and biases, four lambda vectors
    for a, b in zip(torch.autograd.grad(out, wrt, grad), torch.autograd.grad(ref, wrt, grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_padding_mask_reaches_both_softmaxes():
    m = _module(**SIZES[0])
    x = torch.randn(2, 6, 32, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :2] = False  # left padding in row 0
    out, ref = m(x, padding_mask=keep), naive_diff(m, x, keep)
    torch.testing.assert_close(out[0, 2:], ref[0, 2:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-10, atol=1e-10)
    g = torch.autograd.grad(out[:, 2:].sum(), x)[0]
    torch.testing.assert_close(g, torch.autograd.grad(ref[:, 2:].sum(), x)[0], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_decoding_step_by_step_with_the_cache_equals_the_full_forward(kind):
    m = _module(**SIZES[2]).eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    cache = m.new_cache(2, 12, page_size=4 if kind == "paged" else None)
    assert isinstance(cache, PagedKVCache if kind == "paged" else KVCache)
    assert (cache.num_kv_heads, cache.head_dim) == (1, 12)  # Hkv / 2 heads of both halves' keys
    with torch.no_grad():
        steps = [m(x[:, :4], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
        torch.testing.assert_close(torch.cat(steps, 1), m(x), rtol=1e-10, atol=1e-10)


def test_matches_transformers_diffllama_attention():
    mod = pytest.importorskip("transformers.models.diffllama.modeling_diffllama")
    config = mod.DiffLlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=8,
                                 num_hidden_layers=3, attention_bias=True)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    theirs = mod.DiffLlamaAttention(config, layer_idx=2).double()
    ours = DifferentialAttention(32, 4, num_kv_heads=2, layer_idx=2, bias=True, norm_eps=config.rms_norm_eps).double()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    cos, sin = mod.DiffLlamaRotaryEmbedding(config)(x, torch.arange(5)[None])
    causal = torch.full((5, 5), -math.inf, dtype=torch.float64).triu(1)[None, None]
    expected, _ = theirs(x, (cos.double(), sin.double()), causal)
    assert ours.lambda_init == pytest.approx(theirs.lambda_init)
    torch.testing.assert_close(ours(x), expected, rtol=1e-7, atol=1e-7)  # their cos/sin are fp32


def test_lambda_init_follows_the_paper_and_the_layer():
    assert lambda_init_for(0) == pytest.approx(0.2)
    assert lambda_init_for(4) == pytest.approx(0.8 - 0.6 * math.exp(-1.2))
    assert DifferentialAttention(8, 2, layer_idx=4).lambda_init == pytest.approx(lambda_init_for(4))
    assert DifferentialAttention(8, 2, lambda_init=0.5).lambda_init == 0.5


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_heads=3, d_model=12), "num_heads"),
    (dict(num_heads=4, num_kv_heads=1), "num_kv_heads"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(num_heads=6, d_model=16), "d_model"),
    (dict(lambda_init=0.5, layer_idx=1), "lambda_init"),
    (dict(lambda_init=1.0), "lambda_init"),
    (dict(lambda_init=float("nan")), "lambda_init"),
    (dict(layer_idx=-1), "layer_idx"),
    (dict(lambda_std=0.0), "lambda_std"),
    (dict(rotary_dim=3), "rotary_dim"),
])
def test_bad_options_are_a_value_error_naming_the_argument(kwargs, name):
    kwargs = {"d_model": 16, "num_heads": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        DifferentialAttention(kwargs.pop("d_model"), kwargs.pop("num_heads"), **kwargs)


def test_a_cache_of_another_module_is_refused_and_left_unchanged():
    m = _module(**SIZES[0])
    cache = KVCache(1, 2, 8, 8, dtype=torch.float64)  # Hkv heads of head_dim: not the paired layout
    with pytest.raises(ValueError, match="cache"):
        m(torch.randn(1, 2, 32, dtype=torch.float64), cache=cache)
    assert cache.length == 0
