"""GatedAttention against Qwen3-Next's arithmetic written plainly in fp64, and against transformers' own module."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn import GatedAttention, KVCache, PagedKVCache

SIZES = [dict(d_model=32, num_heads=4, num_kv_heads=2),
         dict(d_model=20, num_heads=3, num_kv_heads=1, head_dim=8, rotary_dim=2),
         dict(d_model=16, num_heads=2, gate=False, qk_norm=False, positions=None)]


def _module(seed=0, **sizes):
    torch.manual_seed(seed)
    m = GatedAttention(**sizes, bias=True).double()
    with torch.no_grad():  # norm weights start at 0; make them matter
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    return m


def _rotate(x, r, base=10000.0):
    """RoPE on the first r features, pairs (i, i + r/2), positions 0 .. T-1 of x (B, T, n, D)."""
    if r == 0:
        return x
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv  # (T, r/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # (T, 1, r/2)
    x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], -1)


def _norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def naive_gated(m: GatedAttention, x: torch.Tensor, keep: torch.Tensor | None = None, gate=None) -> torch.Tensor:
    """Per head h: q_proj rows [h*2D, h*2D + D) are its query, the next D its gate (Qwen3-Next)."""
    B, T, _ = x.shape
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    r = 0 if m.rope is None else m.rope.head_dim
    qg = (x @ m.q_proj.weight.T + m.q_proj.bias).view(B, T, H, -1)
    q = qg[..., :D]
    k = (x @ m.k_proj.weight.T + m.k_proj.bias).view(B, T, Hkv, D)
    v = (x @ m.v_proj.weight.T + m.v_proj.bias).view(B, T, Hkv, D)
    if m.qk_norm:
        q, k = _norm(q, m.q_norm.weight, m.q_norm.eps), _norm(k, m.k_norm.weight, m.k_norm.eps)
    q, k = _rotate(q, r), _rotate(k, r)
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if keep is not None:
        allowed = allowed & keep[:, None, :]
    heads = []
    for h in range(H):
        kv = h // (H // Hkv)
        s = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(D)
        p = torch.nan_to_num(s.masked_fill(~allowed, -math.inf).softmax(-1), nan=0.0)
        o = p @ v[:, :, kv]  # (B, T, D)
        g = qg[..., h, D:] if gate is None else gate[..., h * D : (h + 1) * D]
        heads.append(o if g.shape[-1] == 0 else o * torch.sigmoid(g))
    return torch.cat(heads, -1) @ m.o_proj.weight.T + m.o_proj.bias


@pytest.mark.parametrize("sizes", SIZES, ids=["gqa", "mqa_partial_rope", "plain"])
def test_forward_and_gradients_equal_the_fp64_definition(sizes):
    m = _module(**sizes)
    x = torch.randn(2, 7, sizes["d_model"], dtype=torch.float64, requires_grad=True)
    out, ref = m(x), naive_gated(m, x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    wrt = [x, *m.parameters()]
    assert len(wrt) == 1 + 8 + (2 if m.qk_norm else 0)
    for a, b in zip(torch.autograd.grad(out, wrt, grad), torch.autograd.grad(ref, wrt, grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_padding_mask_and_a_given_gate():
    m = _module(**SIZES[0])
    x = torch.randn(2, 6, 32, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, :3] = False
    gate = torch.randn(2, 6, 32, dtype=torch.float64, requires_grad=True)
    out, ref = m(x, padding_mask=keep, gate=gate), naive_gated(m, x, keep, gate)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1, 3:], ref[1, 3:], rtol=1e-10, atol=1e-10)
    mine = torch.autograd.grad(out[:, 3:].sum(), (x, gate))
    theirs = torch.autograd.grad(ref[:, 3:].sum(), (x, gate))
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    per_head = torch.randn(2, 6, 4, dtype=torch.float64)  # one gate per head, on each of its features
    torch.testing.assert_close(m(x, gate=per_head), m(x, gate=per_head.repeat_interleave(8, dim=2)))


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_decoding_step_by_step_with_the_cache_equals_the_full_forward(kind):
    m = _module(**SIZES[1]).eval()
    x = torch.randn(2, 9, 20, dtype=torch.float64)
    cache = m.new_cache(2, 12, page_size=4 if kind == "paged" else None)
    assert isinstance(cache, PagedKVCache if kind == "paged" else KVCache)
    with torch.no_grad():
        steps = [m(x[:, :4], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
        torch.testing.assert_close(torch.cat(steps, 1), m(x), rtol=1e-10, atol=1e-10)


def test_matches_transformers_qwen3_next_attention():
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    config = mod.Qwen3NextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 attention_bias=True, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    theirs = mod.Qwen3NextAttention(config, layer_idx=0).double()
    with torch.no_grad():
        theirs.q_norm.weight.normal_(0.0, 0.5)
        theirs.k_norm.weight.normal_(0.0, 0.5)
    rope = mod.Qwen3NextRotaryEmbedding(config)
    rotary = 2 * rope.inv_freq.numel()
    assert rotary < 16  # the partial rotation is exercised
    ours = GatedAttention(32, 4, num_kv_heads=2, head_dim=16, rotary_dim=rotary, bias=True,
                          norm_eps=config.rms_norm_eps, rope_base=config.rope_parameters["rope_theta"]).double()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    cos, sin = rope(x, torch.arange(5)[None])
    causal = torch.full((5, 5), -math.inf, dtype=torch.float64).triu(1)[None, None]
    expected, _ = theirs(x, (cos.double(), sin.double()), causal)
    torch.testing.assert_close(ours(x), expected, rtol=1e-6, atol=1e-6)  # their cos/sin are fp32


@pytest.mark.parametrize("gate", [torch.zeros(1, 3, 5), torch.zeros(1, 4, 16), torch.zeros(3, 16),
                                  torch.zeros(1, 3, 16, dtype=torch.int64)])
def test_a_gate_of_the_wrong_shape_is_a_value_error_naming_gate(gate):
    m = GatedAttention(16, 4)
    with pytest.raises(ValueError, match="gate"):
        m(torch.randn(1, 3, 16), gate=gate)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_heads=3), "d_model"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(rotary_dim=6), "rotary_dim"),
    (dict(rotary_dim=2, positions=None), "rotary_dim"),
    (dict(positions="alibi"), "positions"),
    (dict(dropout_p=1.5), "dropout_p"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(window=4, causal=False), "window"),
])
def test_bad_options_are_a_value_error_naming_the_argument(kwargs, name):
    kwargs = {"num_heads": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        GatedAttention(16, kwargs.pop("num_heads"), **kwargs)


def test_gate_off_and_qk_norm_off_is_sdpa_attention():
    m = GatedAttention(16, 2, gate=False, qk_norm=False, positions=None, causal=False).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    q = m.q_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    k = m.k_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    v = m.v_proj(x).view(2, 5, 2, 8).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 16)
    torch.testing.assert_close(m(x), m.o_proj(out))
