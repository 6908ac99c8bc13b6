"""TopkAttention (DSA's layer) against dense attention in fp64 with the top-k mask built plainly here.

The plain layer: the index scores ``sum_h w_h ReLU(q_h . k / sqrt(D))`` (LayerNorm and rotary pairs
written out), each query's ``topk`` best allowed keys by ``torch.topk`` on those scores, then per head
a softmax over the kept keys only, grouped-query heads read their key head, ``o_proj``.

Ties among index scores would make the kept set depend on the sort: ``_module`` makes every score
positive and distinct (positive inputs, positive index projections and weights, index keys near +1).
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn import BranchCache, GatedAttention, KVCache, TopkAttention

CASES = [dict(d_model=24, num_heads=4, num_kv_heads=2, topk=3),                    # GQA, rope, topk < T
         dict(d_model=16, num_heads=2, num_kv_heads=1, topk=5, positions=None),    # no positions
         dict(d_model=24, num_heads=3, num_kv_heads=3, topk=32, rotary_dim=4)]     # topk > T: all keys


def _module(seed=0, **sizes):
    torch.manual_seed(seed)
    m = TopkAttention(**sizes, index_heads=3, index_dim=6, bias=True).double()
    with torch.no_grad():  # tie-free index scores for positive inputs (module docstring)
        ix = m.indexer
        ix.wq_b.weight.abs_()
        ix.weights_proj.weight.abs_()
        ix.k_norm.weight.uniform_(0.05, 0.2)
        ix.k_norm.bias.fill_(1.0)
    return m


def _x(B, T, d, seed=1):
    return torch.rand(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1


def _rope(x, r, base=10000.0):
    """Rotate the first r features of x (B, T, n, D), pairs (i, i + r/2), at positions 0 .. T-1."""
    if r == 0:
        return x
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv  # (T, r/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], -1)


def plain_scores(m, x):
    """(B, T, T) index scores of every query and key of x, from the module's indexer weights."""
    ix, (B, T, _) = m.indexer, x.shape
    H, D, r = ix.heads, ix.head_dim, ix.rope_dim
    raw = x @ ix.wk.weight.T
    normed = (raw - raw.mean(-1, keepdim=True)) / torch.sqrt(raw.var(-1, unbiased=False, keepdim=True) + 1e-6)
    keys = _rope((normed * ix.k_norm.weight + ix.k_norm.bias)[:, :, None], r)[:, :, 0]  # (B, T, D)
    queries = _rope((x @ ix.wq_b.weight.T).view(B, T, H, D), r)
    w = x @ ix.weights_proj.weight.T / math.sqrt(H)  # (B, T, H)
    per_head = torch.einsum("bthd,bsd->bths", queries, keys) / math.sqrt(D)
    return (w[..., None] * per_head.relu()).sum(2)


def plain_kept(m, x, allowed):
    """allowed (B|1, T, T) ANDed with each query's topk best allowed keys by the plain scores."""
    scores = plain_scores(m, x).detach()
    best = scores.masked_fill(~allowed, float("-inf")).topk(min(m.indexer.topk, x.shape[1]), dim=-1)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, best.indices, True)
    return allowed & chosen


def plain_heads(m, x, kept):
    """Per head softmax over the kept keys (B, T, T) (an empty row gives zeros), then o_proj."""
    B, T, _ = x.shape
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    r = 0 if m.rope is None else m.rope.head_dim
    q = _rope((x @ m.q_proj.weight.T + m.q_proj.bias).view(B, T, H, D), r)
    k = _rope((x @ m.k_proj.weight.T + m.k_proj.bias).view(B, T, Hkv, D), r)
    v = (x @ m.v_proj.weight.T + m.v_proj.bias).view(B, T, Hkv, D)
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        s = (q[:, :, h] @ k[:, :, g].transpose(1, 2) / math.sqrt(D)).masked_fill(~kept, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        heads.append(p @ v[:, :, g])
    return torch.cat(heads, -1) @ m.o_proj.weight.T + m.o_proj.bias


def plain_layer(m, x, allowed=None):
    T = x.shape[1]
    causal = torch.ones(1, T, T, dtype=torch.bool).tril()
    return plain_heads(m, x, plain_kept(m, x, causal if allowed is None else causal & allowed))


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("sizes", CASES)
def test_forward_and_gradients_equal_masked_dense(sizes):
    m = _module(**sizes)
    x = _x(2, 9, sizes["d_model"]).requires_grad_()
    out, ref = m(x), plain_layer(m, x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    params = [p for name in PROJECTIONS for p in getattr(m, name).parameters()]
    got = torch.autograd.grad(out, [x, *params], g)
    want = torch.autograd.grad(ref, [x, *params], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_topk_smaller_than_length_is_sparse():
    """The layer really drops keys: with topk=3 it differs from dense causal attention (and from T=topk)."""
    m = _module(**CASES[0])
    x = _x(1, 9, 24)
    causal = torch.ones(1, 9, 9, dtype=torch.bool).tril()
    assert plain_kept(m, x, causal).sum(-1).max() == 3
    assert not torch.allclose(m(x), plain_heads(m, x, causal))


@pytest.mark.parametrize("positions", ["rope", None])
def test_short_sequences_equal_dense_causal_attention(positions):
    """T <= topk keeps every earlier key: GatedAttention without gate or norm (plain GQA) on the same weights."""
    torch.manual_seed(3)
    m = TopkAttention(24, 4, num_kv_heads=2, topk=6, index_heads=2, index_dim=4, positions=positions, bias=True).double()
    dense = GatedAttention(24, 4, num_kv_heads=2, gate=False, qk_norm=False, positions=positions, bias=True).double()
    dense.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("indexer.")})
    x = torch.randn(2, 6, 24, dtype=torch.float64, requires_grad=True)
    out, ref = m(x), dense(x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0])


@pytest.mark.parametrize("sizes", CASES)
def test_decoding_with_the_cache_equals_the_forward(sizes):
    """Prefill 4, two single steps, a chunk of 3, a step: the no-cache forward of all 10 tokens."""
    m = _module(**sizes)
    x = _x(2, 10, sizes["d_model"])
    cache = m.new_cache(2, 12)
    with torch.no_grad():
        full = m(x)
        parts = [m(x[:, a:b], cache=cache) for a, b in ((0, 4), (4, 5), (5, 6), (6, 9), (9, 10))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.length == 10 and cache["index"].length == 10
    torch.testing.assert_close(cache["index"].filled()[0][:, 0], m.indexer.keys(x), rtol=0, atol=0)


def test_padding_mask_and_a_dense_mask_are_honoured():
    m = _module(**CASES[0])
    x = _x(2, 8, 24)
    real = torch.ones(2, 8, dtype=torch.bool)
    real[0, :2] = False  # left padding
    real[1, 6:] = False  # right padding
    out = m(x, padding_mask=real)
    ref = plain_layer(m, x, real[:, None, :])
    torch.testing.assert_close(out[real], ref[real], rtol=1e-10, atol=1e-10)
    assert torch.isfinite(out).all()
    keep = torch.rand(8, 8, generator=torch.Generator().manual_seed(5)) < 0.6
    keep |= torch.eye(8, dtype=torch.bool)
    torch.testing.assert_close(m(x, mask=keep), plain_layer(m, x, keep[None]), rtol=1e-10, atol=1e-10)
    bias = torch.zeros(8, 8, dtype=torch.float64).masked_fill(~keep, float("-inf"))  # a float mask: the same keys
    torch.testing.assert_close(m(x, mask=bias), plain_layer(m, x, keep[None]), rtol=1e-10, atol=1e-10)


def test_packed_documents_equal_separate_sequences():
    m = _module(**CASES[0])
    x = _x(1, 9, 24)
    ids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1])
    packed = m(x, document_ids=ids)
    separate = torch.cat([m(x[:, :5]), m(x[:, 5:])], 1)
    torch.testing.assert_close(packed, separate, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ the indexer's loss
def plain_indexer_loss(m, x, *, sparse, real=None):
    """KL(p || softmax(I)) per query, averaged over the real queries, written out row by row."""
    B, T, _ = x.shape
    real = torch.ones(B, T, dtype=torch.bool) if real is None else real
    allowed = torch.ones(1, T, T, dtype=torch.bool).tril() & real[:, None, :]
    if sparse:
        allowed = plain_kept(m, x, allowed)
    scores = plain_scores(m, x)
    with torch.no_grad():  # per-head weights over the allowed keys: plain_heads' softmax
        H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
        r = 0 if m.rope is None else m.rope.head_dim
        q = _rope((x @ m.q_proj.weight.T + m.q_proj.bias).view(B, T, H, D), r)
        k = _rope((x @ m.k_proj.weight.T + m.k_proj.bias).view(B, T, Hkv, D), r)
        p = sum(torch.softmax((q[:, :, h] @ k[:, :, h // (H // Hkv)].transpose(1, 2) / math.sqrt(D))
                              .masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0) for h in range(H))
    total, count = 0.0, 0
    for b in range(B):
        for t in range(T):
            if not real[b, t]:
                continue
            ok = allowed[b, t].nonzero().flatten()
            target = p[b, t, ok] / p[b, t, ok].sum()
            log_q = torch.log_softmax(scores[b, t, ok], -1)
            total = total + (target * (target.log() - log_q)).sum()
            count += 1
    return total / count


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("sizes", CASES[:2])
def test_indexer_loss_equals_the_plain_kl_and_trains_only_the_indexer(sizes, sparse):
    m = _module(**sizes)
    x = _x(2, 7, sizes["d_model"]).requires_grad_()
    real = torch.ones(2, 7, dtype=torch.bool)
    real[1, :2] = False
    for padding in (None, real):
        loss = m.indexer_loss(x, sparse=sparse, padding_mask=padding)
        ref = plain_indexer_loss(m, x, sparse=sparse, real=padding)
        assert loss.ndim == 0 and float(loss.detach()) > 0
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
        indexer = list(m.indexer.parameters())
        got = torch.autograd.grad(loss, indexer)
        want = torch.autograd.grad(ref, indexer, allow_unused=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-9, atol=1e-12)
    m.zero_grad()
    m.indexer_loss(x, sparse=sparse).backward()
    assert x.grad is None and all(p.grad is None for name in PROJECTIONS for p in getattr(m, name).parameters())
    assert all(p.grad is not None for p in m.indexer.parameters())


def test_sparse_and_dense_losses_differ_once_keys_are_dropped():
    m = _module(**CASES[0])
    x = _x(1, 9, 24)
    assert not torch.allclose(m.indexer_loss(x), m.indexer_loss(x, sparse=True))


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("name", ["topk", "index_heads", "index_dim"])
def test_sizes_must_be_positive(name):
    with pytest.raises(ValueError, match=name):
        TopkAttention(16, 2, **{name: 0})


def test_constructor_refusals():
    with pytest.raises(ValueError, match="index_rope_dim"):
        TopkAttention(16, 2, positions=None, index_rope_dim=2)
    with pytest.raises(ValueError, match="rope_dim"):
        TopkAttention(16, 2, index_dim=4, index_rope_dim=6)
    with pytest.raises(ValueError, match="backend"):
        TopkAttention(16, 2, backend="sdpa")


def test_new_cache_refusals_and_layout():
    m = TopkAttention(16, 4, num_kv_heads=2, index_dim=3)
    with pytest.raises(ValueError, match="page_size"):
        m.new_cache(1, 8, page_size=4)
    with pytest.raises(ValueError, match="windowed"):
        m.new_cache(1, 8, windowed=True)
    cache = m.new_cache(2, 8, windowed=False, dtype=torch.float64)
    assert isinstance(cache, BranchCache) and cache.names == ("keys", "index")
    assert cache["keys"].keys.shape == (2, 2, 8, 4) and cache["index"].keys.shape == (2, 1, 8, 3)
    assert cache["index"].value_dim == 0 and cache.dtype == torch.float64


def _state(cache):
    return [(cache[n].length, cache[n].keys.clone(), cache[n].values.clone()) for n in cache.names]


def _assert_same(cache, state):
    for name, (length, keys, values) in zip(cache.names, state):
        assert cache[name].length == length
        assert torch.equal(cache[name].keys, keys) and torch.equal(cache[name].values, values)


def test_bad_caches_and_masks_are_refused_and_leave_the_cache_as_it_was(monkeypatch):
    m = _module(**CASES[0])
    x = _x(1, 4, 24)
    cache = m.new_cache(1, 5)
    with torch.no_grad():
        m(x, cache=cache)
    before = _state(cache)
    with pytest.raises(TypeError, match="cache"):
        m(x[:, :1], cache=KVCache(1, 2, 8, 6, dtype=torch.float64))
    other = TopkAttention(24, 4, num_kv_heads=2, index_dim=4).double().new_cache(1, 5)
    with pytest.raises(ValueError, match="cache"):
        m(x[:, :1], cache=other)
    with pytest.raises(TypeError, match="cache holds torch.float32"):
        m(x[:, :1], cache=m.new_cache(1, 5, dtype=torch.float32))
    with pytest.raises(ValueError, match="overflow"):
        m(x[:, :2], cache=cache)
    with pytest.raises(ValueError, match="padding_mask"):
        m(x[:, :1], cache=cache, padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="document_ids"):
        m(x[:, :1], cache=cache, document_ids=torch.zeros(1, dtype=torch.long))
    _assert_same(cache, before)
    with pytest.raises(ValueError, match="mask"):
        m(x, mask=lambda b, h, q, k: k <= q)
    with pytest.raises(ValueError, match="mask"):
        m(x, mask=torch.ones(1, 4, 4, 4, dtype=torch.bool))

    def broken(*args, **kwargs):  # fails after both parts were written
        raise RuntimeError("indexer failed")
    monkeypatch.setattr(m.indexer, "forward", broken)
    with pytest.raises(RuntimeError, match="indexer failed"):
        m(x[:, :1], cache=cache)
    _assert_same(cache, before)


def test_indexer_loss_refusals():
    m = TopkAttention(16, 2)
    with pytest.raises(TypeError, match="sparse"):
        m.indexer_loss(torch.randn(1, 3, 16), sparse=1)
    with pytest.raises(ValueError, match="padding_mask"):
        m.indexer_loss(torch.randn(1, 3, 16), padding_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="x must be"):
        m.indexer_loss(torch.randn(1, 3, 8))
