"""The attention-gym catalogue of score mods (docs/scores.md): every one attnlab expresses, on
every backend that serves it, forward and backward, against an fp64 eager formula.

The formulas are written here as attention-gym writes its score mods (``attn_gym/mods/alibi.py``,
``attn_gym/mods/softcapping.py``, ``attn_gym/mods/latent_attention.py``, the bias types of
``examples/learnable_bias.py``, the relative-position and soft-capping examples of
``examples/flex_attn.ipynb``) plus T5's bucketed bias, applied to the whole score matrix
``(B, H, Tq, Tk)`` in fp64 and masked, softmaxed and summed by hand. The tolerance is
attnlab.lab.verify's rule: the backend's error at most 2x (outputs) or 3x (gradients) that of the same
eager formula run in fp32, plus the floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import attnlab
from attnlab import backends, masks, scores
from attnlab._call import build_call
from attnlab.lab.verify import allowed_error

B, H, T, D, W = 2, 4, 19, 8, 3  # W: attention-gym's local-window width (learnable_bias.py)
BACKENDS = ("reference", "chunked", "sdpa", "blocks")  # with a CPU backward (blocks: once it serves them)


@dataclass(frozen=True)
class Entry:
    """One catalogue row: attnlab's call and the fp64 eager formula it must equal."""

    name: str
    learnable: Callable[[torch.Generator], list[torch.Tensor]]  # the tensors the mod learns
    mod: Callable[[list[torch.Tensor]], object]  # attnlab's score_mod, holding those tensors
    formula: Callable  # (scores, b, h, i, j, tensors) -> scores, on whole (B, H, Tq, Tk) grids
    mask: str = "none"  # none, causal, window, document, prefix, sink_window


def _t5_bucket(relative, *, num_buckets=16, max_distance=40, bidirectional=True):
    """T5's ``_relative_position_bucket`` (transformers' modeling_t5), on a long tensor."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(relative < max_exact, relative, large)


def _randn(*shape):
    return lambda gen: [torch.randn(*shape, generator=gen, dtype=torch.float64)]


def _slope(h, s):  # attention-gym's alibi: exp2(-(h + 1) * 8 / H), in the scores' dtype
    return torch.exp2(-((h + 1) * 8.0 / H)).to(s.dtype)


OFFSETS = torch.randperm(T, generator=torch.Generator().manual_seed(7))  # learnable_bias.py's OFFSET

CATALOGUE = [
    Entry("alibi, causal", lambda g: [], lambda p: scores.alibi(H),
          lambda s, b, h, i, j, p: s + (j - i) * _slope(h, s), mask="causal"),
    Entry("alibi, non-causal", lambda g: [], lambda p: scores.alibi(H),
          lambda s, b, h, i, j, p: s + (j - i) * _slope(h, s)),
    Entry("alibi, learnable slopes", lambda g: [torch.rand(H, generator=g, dtype=torch.float64)],
          lambda p: scores.alibi(p[0]), lambda s, b, h, i, j, p: s + (j - i) * p[0][h], mask="causal"),
    Entry("tanh soft-capping", lambda g: [], lambda p: scores.softcap(2.0),
          lambda s, b, h, i, j, p: 2.0 * torch.tanh(s / 2.0)),
    Entry("tanh soft-capping, causal", lambda g: [], lambda p: scores.softcap(2.0),
          lambda s, b, h, i, j, p: 2.0 * torch.tanh(s / 2.0), mask="causal"),
    Entry("tanh soft-capping, sliding window", lambda g: [], lambda p: scores.softcap(1.5),
          lambda s, b, h, i, j, p: 1.5 * torch.tanh(s / 1.5), mask="window"),
    Entry("soft-capping then alibi, document mask", lambda g: [], lambda p: scores.softcap(2.0) + scores.alibi(H),
          lambda s, b, h, i, j, p: 2.0 * torch.tanh(s / 2.0) + (j - i) * _slope(h, s), mask="document"),
    Entry("alibi, prefix LM", lambda g: [], lambda p: scores.alibi(H, symmetric=True),
          lambda s, b, h, i, j, p: s - (i - j).abs() * _slope(h, s), mask="prefix"),
    Entry("relative position", lambda g: [], lambda p: (lambda s, b, h, i, j: s + (i - j)),
          lambda s, b, h, i, j, p: s + (i - j)),
    Entry("T5 relative bias", _randn(16, H),
          lambda p: scores.relative_bias(p[0], num_buckets=16, max_distance=40, bidirectional=True),
          lambda s, b, h, i, j, p: s + p[0][_t5_bucket(j - i), h]),
    Entry("T5 relative bias, causal", _randn(16, H),
          lambda p: scores.relative_bias(p[0], num_buckets=16, max_distance=40, bidirectional=False),
          lambda s, b, h, i, j, p: s + p[0][_t5_bucket(j - i, bidirectional=False), h], mask="causal"),
    Entry("relative 1-D bias", _randn(2 * T),
          lambda p: scores.function(lambda t: lambda s, b, h, i, j: s + t[(i - j).abs()], params=p),
          lambda s, b, h, i, j, p: s + p[0][(i - j).abs()]),
    Entry("absolute 2-D bias", _randn(T, T), lambda p: scores.bias(p[0]),
          lambda s, b, h, i, j, p: s + p[0][i, j]),
    Entry("head-specific bias", _randn(H, T, T), lambda p: scores.bias(p[0]),
          lambda s, b, h, i, j, p: s + p[0][h, i, j]),
    Entry("batch-and-head bias", _randn(B, H, T, T), lambda p: scores.bias(p[0]),
          lambda s, b, h, i, j, p: s + p[0][b, h, i, j], mask="causal"),
    Entry("multiplicative bias", _randn(T),
          lambda p: scores.function(lambda t: lambda s, b, h, i, j: s * t[i], params=p),
          lambda s, b, h, i, j, p: s * p[0][i]),
    Entry("local-window bias", _randn(2 * W + 1),
          lambda p: scores.function(lambda t: lambda s, b, h, i, j: s + t[(i - j + W).clamp(0, 2 * W)], params=p),
          lambda s, b, h, i, j, p: s + p[0][torch.clamp(i - j + W, 0, 2 * W)]),
    Entry("global-token bias", _randn(T), lambda p: scores.bias(p[0].view(1, 1, 1, T)),
          lambda s, b, h, i, j, p: s + p[0][j]),
    Entry("per-query bias of one pattern", _randn(B, H, 4, T),
          lambda p: scores.function(lambda t: lambda s, b, h, i, j: s + t[b, h, 1, i], params=p),
          lambda s, b, h, i, j, p: s + p[0][b, h, 1, i]),
    Entry("offset bias", _randn(T),
          lambda p: scores.function(lambda t: lambda s, b, h, i, j: s + t[OFFSETS[i]], params=p),
          lambda s, b, h, i, j, p: s + p[0][OFFSETS[i]], mask="causal"),
    Entry("MLA rope score mod", lambda g: [torch.randn(B, H, T, 4, generator=g, dtype=torch.float64),
                                           torch.randn(B, 1, T, 4, generator=g, dtype=torch.float64)],
          lambda p: scores.function(lambda qr, kr: lambda s, b, h, i, j: s + 0.5 * (qr[b, h, i] * kr[b, h // H, j])
                                    .sum(-1), params=p),
          lambda s, b, h, i, j, p: s + 0.5 * torch.einsum("bhid,bjd->bhij", p[0], p[1][:, 0]), mask="causal"),
    Entry("tanh soft-capping, sink tokens and window", lambda g: [], lambda p: scores.softcap(2.0),
          lambda s, b, h, i, j, p: 2.0 * torch.tanh(s / 2.0), mask="sink_window"),
]

# What attention-gym offers that attnlab does not express (docs/scores.md says why).
NOT_EXPRESSED = {"tanh soft-capping, approximate (tanh.approx.f32)"}

DOCS = torch.tensor([[0] * 7 + [1] * 8 + [2] * 4, [0] * 12 + [1] * 7])  # (B, T): documents per row


def _allowed(mask: str) -> torch.Tensor:
    """``(B, 1, T, T)`` bool, True = may attend, written from the masks' definitions."""
    i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
    causal = j <= i
    rule = {"none": torch.ones(T, T, dtype=torch.bool), "causal": causal, "window": causal & (i - j < 5),
            "prefix": causal | (j < 6), "sink_window": causal & ((i - j <= 3) | (j < 4))}
    if mask == "document":
        return (DOCS[:, :, None] == DOCS[:, None, :]) & causal  # (B, T, T)
    return rule[mask].expand(B, T, T)


def _mask_options(mask: str) -> dict:
    """attnlab's mask for ``mask``: causal=, a mask mod, or attention-gym's OR of mask mods."""
    if mask == "causal":
        return dict(causal=True)
    if mask == "window":
        return dict(mask=masks.sliding_window_mod(T, T, 5))
    if mask == "document":
        return dict(mask=masks.document_mod(DOCS))
    if mask == "prefix":
        return dict(mask=masks.prefix_lm_mod(T, T, 6))
    if mask == "sink_window":  # attention-gym's sink_attn.py: (window OR the first tokens) AND causal
        return dict(mask=lambda b, h, i, j: (j <= i) & ((i - j <= 3) | (j < 4)))
    return {}


def _eager(entry: Entry, q, k, v, tensors):
    """The formula on the whole score matrix, masked and softmaxed by hand: ``(B, H, T, Dv)``."""
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    i, j = torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, T)
    s = entry.formula(s, b, h, i, j, tensors)
    s = s.masked_fill(~_allowed(entry.mask)[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _inputs(entry: Entry, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) * 1.5 for _ in range(3)]
    return qkv, entry.learnable(gen)


def _forward_backward(fn, leaves, dtype, seed):
    leaves = [t.detach().to(dtype).requires_grad_() for t in leaves]
    out = fn(leaves)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    out.backward(grad.to(dtype))
    return [out.detach().double()] + [t.grad.double() for t in leaves]


def _served(entry: Entry, qkv, tensors) -> list[str]:
    q, k, v = (t.float().requires_grad_() for t in qkv)
    mod = entry.mod([t.float().requires_grad_() for t in tensors])
    call = build_call(q, k, v, score_mod=mod, **_mask_options(entry.mask))
    return [name for name, why in backends.reasons(call).items() if not why and name in BACKENDS]


@pytest.mark.parametrize("entry", CATALOGUE, ids=[e.name for e in CATALOGUE])
def test_every_expressed_catalogue_mod_matches_its_fp64_formula(entry):
    seed = sum(map(ord, entry.name))
    qkv, tensors = _inputs(entry, seed)
    n = len(qkv)

    def eager(leaves):
        return _eager(entry, *leaves[:n], leaves[n:])

    exact = _forward_backward(eager, qkv + tensors, torch.float64, seed)
    plain = _forward_backward(eager, qkv + tensors, torch.float32, seed)
    served = _served(entry, qkv, tensors)
    assert "reference" in served and "chunked" in served, served  # the tiled path serves every score mod
    for backend in served:
        def run(leaves):
            return attnlab.attention(*leaves[:n], score_mod=entry.mod(leaves[n:]), backend=backend,
                                     **_mask_options(entry.mask))

        got = _forward_backward(run, qkv + tensors, torch.float32, seed)
        for what, g, e, p in zip(["out", "dq", "dk", "dv"] + [f"d{entry.name}"] * len(tensors), got, exact, plain):
            magnitude = float(e.abs().max())
            limit = allowed_error(float((p - e).abs().max()), torch.float32, magnitude,
                                  reduction=max(D, T), gradient=what != "out")
            error = float((g - e).abs().max())
            assert error <= limit, f"{entry.name} on {backend}: {what} error {error:.3g} > allowed {limit:.3g}"


def test_additive_catalogue_mods_reach_sdpa_and_the_others_are_declined_with_a_reason():
    by_name = {e.name: e for e in CATALOGUE}
    for name in ("alibi, causal", "T5 relative bias", "head-specific bias", "global-token bias"):
        qkv, tensors = _inputs(by_name[name], 0)
        assert "sdpa" in _served(by_name[name], qkv, tensors), name
    qkv, tensors = _inputs(by_name["tanh soft-capping"], 0)
    q, k, v = (t.float() for t in qkv)
    why = backends.reasons(build_call(q, k, v, score_mod=scores.softcap(2.0)))["sdpa"]
    assert why and any("score_mod" in reason or "softcap" in reason for reason in why), why
