"""``attnlab.nn.LightningIndexer`` (DSA) against a plain fp64 indexer written here and transformers' own.

The plain indexer loops over queries, keys and heads with the module's weights in fp64: rotary pairs
rotated in place (half-split or interleaved), LayerNorm written out, ``sum_h w_h ReLU(q_h.k/sqrt(D))``,
then each query's best allowed keys. Top-k is compared as sets of scores (ties may pick either key).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.backends.topk import indices_mask
from attnlab.nn import LightningIndexer
from attnlab.nn.indexer import select_topk


def _indexer(*, interleaved=False, topk=3, rope_dim=4, query_dim=6, seed=0):
    torch.manual_seed(seed)
    module = LightningIndexer(10, heads=3, head_dim=8, topk=topk, query_dim=query_dim, rope_dim=rope_dim,
                              interleaved=interleaved)
    with torch.no_grad():
        module.k_norm.weight.uniform_(0.5, 1.5)
        module.k_norm.bias.uniform_(-0.3, 0.3)
    return module


def _rotate(vec, pos, rope_dim, interleaved, base=10000.0):
    """Rotate the first rope_dim features of one vector (fp64) at position pos, pair by pair."""
    out = vec.clone()
    for i in range(rope_dim // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rope_dim // 2)
        angle = pos * base ** (-2 * i / rope_dim)
        out[a] = vec[a] * math.cos(angle) - vec[b] * math.sin(angle)
        out[b] = vec[b] * math.cos(angle) + vec[a] * math.sin(angle)
    return out


def _plain_scores(module, x, xq, params=None):
    """(B, Tq, Tk) index scores in fp64 for queries at the last Tq of the Tk = x.shape[1] positions."""
    p = params or {n: t.detach().double() for n, t in module.named_parameters()}
    x, xq = x.double(), xq.double()
    B, Tk, _ = x.shape
    Tq, H, D = xq.shape[1], module.heads, module.head_dim
    keys = []
    for b in range(B):
        row = []
        for s in range(Tk):
            raw = p["wk.weight"] @ x[b, s]
            normed = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=False) + 1e-6)
            row.append(_rotate(normed * p["k_norm.weight"] + p["k_norm.bias"], s, module.rope_dim, module.interleaved))
        keys.append(row)
    out = torch.zeros(B, Tq, Tk, dtype=torch.float64)
    scores = [[[None] * Tk for _ in range(Tq)] for _ in range(B)]
    for b in range(B):
        for t in range(Tq):
            pos = Tk - Tq + t
            xt = x[b, pos]
            w = p["weights_proj.weight"] @ xt / math.sqrt(H)
            qs = (p["wq_b.weight"] @ xq[b, t]).view(H, D)
            qs = [_rotate(qs[h], pos, module.rope_dim, module.interleaved) for h in range(H)]
            for s in range(Tk):
                scores[b][t][s] = sum(w[h] * torch.relu(qs[h] @ keys[b][s] / math.sqrt(D)) for h in range(H))
        out[b] = torch.stack([torch.stack(r) for r in scores[b]])
    return out


def _assert_topk(indices, scores, allowed, topk):
    """indices (B, 1, Tq, k) hold the best allowed keys of each row (as a set of scores), -1 after."""
    B, Tq, Tk = scores.shape
    assert indices.shape == (B, 1, Tq, min(topk, Tk))
    for b in range(B):
        for t in range(Tq):
            ok = allowed[b, t].nonzero().flatten()
            want = scores[b, t, ok].sort(descending=True).values[:topk]
            got = indices[b, 0, t]
            chosen = got[got >= 0]
            assert bool(allowed[b, t, chosen].all()) and len(set(chosen.tolist())) == len(chosen)
            assert len(chosen) == min(topk, len(ok))
            torch.testing.assert_close(scores[b, t, chosen].sort(descending=True).values, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_and_topk_equal_a_plain_fp64_indexer(interleaved):
    module = _indexer(interleaved=interleaved)
    x, xq = torch.randn(2, 7, 10), torch.randn(2, 7, 6)
    want = _plain_scores(module, x, xq)
    torch.testing.assert_close(module.scores(x, query_input=xq).double(), want, rtol=1e-5, atol=1e-5)
    padding = torch.ones(2, 1, 7, dtype=torch.bool)
    padding[0, 0, :2] = False  # row 0 left-padded by two keys
    indices = module(x, query_input=xq, mask=padding)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    _assert_topk(indices, want, causal & padding, topk=3)
    assert indices[0, 0, 2].tolist() == [2, -1, -1]  # its first real query has one key: itself


def test_fp64_module_matches_to_rounding_and_without_causality():
    module = _indexer(rope_dim=0, query_dim=None).double()
    x = torch.randn(1, 6, 10, dtype=torch.float64)
    want = _plain_scores(module, x, x)
    got = module.scores(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _assert_topk(module(x, causal=False), want, torch.ones(1, 6, 6, dtype=torch.bool), topk=3)


def test_decoding_with_past_keys_equals_the_full_pass():
    module = _indexer(interleaved=True)
    x, xq = torch.randn(2, 8, 10), torch.randn(2, 8, 6)
    full_scores = module.scores(x, query_input=xq)
    past = module.keys(x[:, :5])
    step = module.scores(x[:, 5:], query_input=xq[:, 5:], past_keys=past)
    torch.testing.assert_close(step, full_scores[:, 5:], rtol=1e-5, atol=1e-6)
    want = _plain_scores(module, x, xq[:, 5:])
    _assert_topk(module(x[:, 5:], query_input=xq[:, 5:], past_keys=past), want,
                 torch.ones(3, 8, dtype=torch.bool).tril(5)[None].expand(2, 3, 8), topk=3)


def test_k_is_clamped_to_the_keys_as_transformers_does():
    module = _indexer(topk=50)
    indices = module(torch.randn(1, 4, 10), query_input=torch.randn(1, 4, 6))
    assert indices.shape == (1, 1, 4, 4)  # min(50, Tk=4)
    assert indices[0, 0].tolist()[0] == [0, -1, -1, -1]
    assert sorted(indices[0, 0, 3].tolist()) == [0, 1, 2, 3]


def test_score_gradients_equal_fp64_autograd_of_the_plain_indexer():
    """DSA trains the indexer on its scores: gradients of every weight, and of the inputs."""
    module = _indexer(interleaved=True)
    x = torch.randn(1, 5, 10, requires_grad=True)
    xq = torch.randn(1, 5, 6, requires_grad=True)
    probe = torch.randn(1, 5, 5, dtype=torch.float64)
    (module.scores(x, query_input=xq).double() * probe).sum().backward()
    params = {n: t.detach().double().requires_grad_() for n, t in module.named_parameters()}
    x64, xq64 = (t.detach().double().requires_grad_() for t in (x, xq))
    (_plain_scores(module, x64, xq64, params) * probe).sum().backward()
    for name, param in module.named_parameters():
        torch.testing.assert_close(param.grad.double(), params[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xq.grad.double(), xq64.grad, rtol=1e-4, atol=1e-5)


def test_indexed_attention_equals_dense_fp64_attention_forward_and_backward():
    """The indexer's (B, 1, Tq, k) list drives attnlab.attention: the result is softmax over the
    selected keys, checked against fp64 dense attention with the selection as a mask."""
    module = _indexer(topk=3)
    x = torch.randn(2, 7, 10)
    indices = module(x, query_input=torch.randn(2, 7, 6))
    q, k, v = (torch.randn(2, 4, 7, 8, requires_grad=True) for _ in range(3))
    out = attnlab.attention(q, k, v, indices=indices, causal=True)
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    selected = indices_mask(indices, 7)  # (B, 1, Tq, Tk)
    scores = (q64 @ k64.transpose(-1, -2) / math.sqrt(8)).masked_fill(~selected, float("-inf"))
    want = scores.softmax(-1) @ v64
    want_grads = torch.autograd.grad((want * probe.double()).sum(), (q64, k64, v64))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("call, error, match", [
    (lambda: LightningIndexer(8, heads=2, head_dim=4, topk=0), ValueError, "topk"),
    (lambda: LightningIndexer(8, heads=2, head_dim=4, topk=2, rope_dim=3), ValueError, "rope_dim must be even"),
    (lambda: LightningIndexer(8, heads=2, head_dim=4, topk=2, rope_dim=6), ValueError, "rope_dim .* head_dim=4"),
    (lambda: LightningIndexer(8, heads=0, head_dim=4, topk=2), ValueError, "heads"),
    (lambda: _small()(torch.randn(1, 3, 7)), ValueError, r"x must be \(B, T, 8\), got shape \(1, 3, 7\)"),
    (lambda: _small()(torch.ones(1, 3, 8, dtype=torch.long)), TypeError, "x must have a floating-point dtype"),
    (lambda: _small()(torch.randn(1, 3, 8), query_input=torch.randn(1, 4, 8)), ValueError,
     r"query_input must be \(1, 3, 8\), got shape \(1, 4, 8\)"),
    (lambda: _small()(torch.randn(1, 3, 8), past_keys=torch.randn(1, 2, 5)), ValueError,
     r"past_keys must be \(1, T, 4\)"),
    (lambda: _small()(torch.randn(1, 3, 8), mask=torch.ones(1, 3, 3)), TypeError, "mask must be a bool tensor"),
    (lambda: _small()(torch.randn(1, 3, 8), mask=torch.ones(1, 3, 4, dtype=torch.bool)), ValueError,
     r"mask must be \(B\|1, Tq\|1, Tk\) = \(1\|1, 3\|1, 3\), got shape \(1, 3, 4\)"),
])
def test_bad_input_is_one_error_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _small():
    return LightningIndexer(8, heads=2, head_dim=4, topk=2)


# ------------------------------------------------------------------ transformers' indexers
transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_equals_transformers_indexer_with_its_weights(family):
    """DeepSeek-V3.2 rotates half-split pairs, GLM-MoE-DSA interleaved ones; same weights, same top-k."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm
    make, lib = {"deepseek_v32": (transformers.DeepseekV32Config, dsv32),
                 "glm_moe_dsa": (transformers.GlmMoeDsaConfig, glm)}[family]
    config = make(hidden_size=16, q_lora_rank=12, qk_rope_head_dim=4, index_topk=3, index_head_dim=8,
                  index_n_heads=3, num_attention_heads=2, num_key_value_heads=2, head_dim=4)
    torch.manual_seed(0)
    theirs = getattr(lib, [n for n in dir(lib) if n.endswith("Indexer")][0])(config, 0)
    rotary = getattr(lib, [n for n in dir(lib) if n.endswith("RotaryEmbedding")][0])(config)
    ours = LightningIndexer(16, heads=3, head_dim=8, topk=3, query_dim=12, rope_dim=4,
                            interleaved=family == "glm_moe_dsa")
    ours.load_state_dict(theirs.state_dict())
    x, xq = torch.randn(2, 9, 16), torch.randn(2, 9, 12)
    allowed = torch.ones(2, 9, 9, dtype=torch.bool).tril()
    allowed[0, :, :3] = False  # left padding
    positions = torch.arange(9)[None]
    got = ours(x, query_input=xq, mask=allowed)
    want = theirs(x, xq, rotary(x, positions), allowed, positions).long()  # (B, S, k), masked keys listed
    scores = ours.scores(x, query_input=xq)
    for b in range(2):
        for t in range(9):
            if not allowed[b, t].any():
                continue  # no key at all: transformers lists arbitrary ones, attnlab none
            theirs_ok = want[b, t][allowed[b, t, want[b, t]]]
            mine = got[b, 0, t][got[b, 0, t] >= 0]
            assert len(mine) == len(theirs_ok) == min(3, int(allowed[b, t].sum()))
            torch.testing.assert_close(scores[b, t, mine].sort().values, scores[b, t, theirs_ok].sort().values)
    # Where the k-th and the next allowed score differ (no tie at the cut), the very same key set.
    ranked = scores.masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True).values  # (B, T, T)
    clear = (allowed.sum(-1) > 3) & (ranked[..., 2] > ranked[..., 3])  # (B, T)
    assert clear.sum() >= 6
    for b, t in clear.nonzero().tolist():
        assert set(got[b, 0, t].tolist()) == set(want[b, t].tolist())


def test_equal_scores_pick_the_same_keys_in_a_prefill_and_a_decoding_step():
    """ReLU index heads give many equal (zero) scores: the earlier key wins every tie, so a row
    masked past its query (a prefill) and the same row cut there (a decoding step) agree."""
    scores = torch.tensor([[[0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]]]).expand(1, 8, 8).contiguous()
    prefill = select_topk(scores, 3)  # (1, 1, 8, 3), causal
    for t in range(8):
        step = select_topk(scores[:, t:t + 1, :t + 1], 3)  # the last query over its t + 1 keys
        assert step[0, 0, 0].tolist() == [i for i in prefill[0, 0, t].tolist() if i >= 0]
    assert prefill[0, 0, 7].tolist() == [1, 4, 0]


@pytest.mark.parametrize("mask_rows", [None, 1, "T"])
def test_forward_in_query_blocks_picks_what_the_whole_score_matrix_picks(monkeypatch, mask_rows):
    """The forward scores a few queries at a time (QUERY_BLOCK); blocks of 3 over 11 new queries
    after 4 cached ones, with the causal rule and a padding mask, pick what one (T, Tk) matrix picks."""
    import attnlab.nn.indexer as indexer_module

    torch.manual_seed(3)
    indexer = LightningIndexer(16, heads=3, head_dim=8, topk=4, rope_dim=4)
    x, past_x = torch.randn(2, 11, 16), torch.randn(2, 4, 16)
    past = indexer.keys(past_x)
    mask = None
    if mask_rows is not None:
        mask = torch.rand(2, 11 if mask_rows == "T" else 1, 15) > 0.3
    expected = select_topk(indexer.scores(x, past_keys=past), 4, mask=mask)  # (B, 1, 11, 4)
    monkeypatch.setattr(indexer_module, "QUERY_BLOCK", 3)
    got = indexer(x, past_keys=past, mask=mask)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="mask must be"):
        indexer(x, past_keys=past, mask=torch.ones(2, 5, 15, dtype=torch.bool))
