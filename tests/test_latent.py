"""LatentAttention (MLA) against its naive definition in fp64, absorbed decoding against expanded."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn import KVCache, LatentAttention, PagedKVCache

SIZES = [dict(d_model=32, num_heads=4, latent_dim=12, rope_dim=4),
         dict(d_model=24, num_heads=3, latent_dim=10, q_latent_dim=9, nope_dim=5, rope_dim=6, value_dim=7)]


def _module(seed=0, **sizes):
    torch.manual_seed(seed)
    return LatentAttention(**sizes, bias=True).double().eval()


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x, positions, base=10000.0):
    """RoPE, pairs (i, i + D/2), written out from the definition."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    angle = positions.double()[:, None] * inv[None]  # (T, D/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)


def naive_mla(m: LatentAttention, x: torch.Tensor) -> torch.Tensor:
    """Every head's full keys and values, a causal softmax per head: the textbook MLA."""
    B, T, _ = x.shape
    H, dn, dr, dv, dc = m.num_heads, m.nope_dim, m.rope_dim, m.value_dim, m.latent_dim
    if m.q_latent_dim is None:
        q = x @ m.q_proj.weight.T + m.q_proj.bias
    else:
        cq = _rms(x @ m.q_down.weight.T + m.q_down.bias, m.q_norm.weight, m.q_norm.eps)
        q = cq @ m.q_up.weight.T
    q = q.view(B, T, H, dn + dr)
    down = x @ m.kv_down.weight.T + m.kv_down.bias
    c = _rms(down[..., :dc], m.kv_norm.weight, m.kv_norm.eps)  # (B, T, dc)
    pos = torch.arange(T)
    k_rope = _rotate(down[..., dc:], pos)  # (B, T, dr)
    out = torch.zeros(B, T, H, dv, dtype=x.dtype)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for h in range(H):
        w = m.kv_up.weight[h * (dn + dv) : (h + 1) * (dn + dv)]
        k_h = torch.cat([c @ w[:dn].T, k_rope], -1)  # (B, T, dn + dr)
        v_h = c @ w[dn:].T  # (B, T, dv)
        q_h = torch.cat([q[:, :, h, :dn], _rotate(q[:, :, h, dn:], pos)], -1)
        scores = (q_h @ k_h.transpose(1, 2)) / math.sqrt(dn + dr)
        out[:, :, h] = scores.masked_fill(~mask, -math.inf).softmax(-1) @ v_h
    return out.reshape(B, T, H * dv) @ m.out_proj.weight.T + m.out_proj.bias


@pytest.mark.parametrize("sizes", SIZES, ids=["full_q", "low_rank_q"])
def test_prefill_equals_naive_expanded_fp64(sizes):
    m = _module(**sizes)
    x = torch.randn(2, 9, sizes["d_model"], dtype=torch.float64)
    expected = naive_mla(m, x)
    with torch.no_grad():
        assert (m(x) - expected).abs().max() <= 1e-10
        assert (m(x, absorb=True) - expected).abs().max() <= 1e-10


def test_gradients_equal_naive_fp64():
    m = _module(**SIZES[1])
    x = torch.randn(1, 6, 24, dtype=torch.float64, requires_grad=True)
    ours = torch.autograd.grad(m(x).square().sum(), [x, *m.parameters()])
    theirs = torch.autograd.grad(naive_mla(m, x).square().sum(), [x, *m.parameters()])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("sizes", SIZES, ids=["full_q", "low_rank_q"])
def test_absorbed_decoding_equals_expanded_and_full(sizes, paged):
    m = _module(seed=3, **sizes)
    prompt, steps = 5, 7
    x = torch.randn(2, prompt + steps, sizes["d_model"], dtype=torch.float64)
    outputs = {}
    with torch.no_grad():
        full = m(x)
        for absorb in (True, False):
            cache = m.new_cache(2, prompt + steps, page_size=4 if paged else None)
            parts = [m(x[:, :prompt], cache=cache, absorb=absorb)]
            parts += [m(x[:, t : t + 1], cache=cache, absorb=absorb) for t in range(prompt, prompt + steps)]
            outputs[absorb] = torch.cat(parts, 1)
    assert (outputs[True] - outputs[False]).abs().max() <= 1e-10
    assert (outputs[True] - full).abs().max() <= 1e-10


def test_cache_holds_only_latent_and_rope_key():
    m = _module(**SIZES[0])
    cache = m.new_cache(1, 8)
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        m(x, cache=cache)
        latent, k_rope = m.project_latent(x)
    assert isinstance(cache, KVCache) and cache.values.shape[-1] == 0
    assert cache.keys.shape == (1, 1, 8, m.latent_dim + m.rope_dim)
    torch.testing.assert_close(cache.keys[0, 0, :3, : m.latent_dim], latent[0], rtol=0, atol=0)
    torch.testing.assert_close(cache.keys[0, 0, :3, m.latent_dim :], m.rope(k_rope)[0, 0], rtol=0, atol=0)


def test_bad_cache_and_options_are_refused_without_writing():
    m = _module(**SIZES[0])
    with pytest.raises(ValueError, match="cache must hold 16 key features"):
        m(torch.randn(1, 2, 32, dtype=torch.float64), cache=KVCache(1, 1, 4, 8, dtype=torch.float64))
    cache = m.new_cache(1, 3)
    with torch.no_grad():
        m(torch.randn(1, 2, 32, dtype=torch.float64), cache=cache)
        before = cache.keys.clone()
        with pytest.raises(ValueError, match="overflow"):
            m(torch.randn(1, 2, 32, dtype=torch.float64), cache=cache)
    assert cache.length == 2 and torch.equal(cache.keys, before)
    with pytest.raises(ValueError, match="rope_dim"):
        LatentAttention(32, 4, latent_dim=8, rope_dim=0)
    with pytest.raises(ValueError, match="rope_dim must be even.*got 3"):  # regression: it named head_dim
        LatentAttention(32, 4, latent_dim=8, rope_dim=3)
    paged = m.new_cache(1, 4, page_size=2)
    assert isinstance(paged, PagedKVCache)
    with pytest.raises(ValueError, match="return_weights"):
        m(torch.randn(1, 1, 32, dtype=torch.float64), cache=paged, return_weights=True)
    assert paged.row_lengths == (0,) and paged.free_pages == 2
