"""Position encodings against their papers' formulas, written out independently in fp64."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    alibi_bias,
    alibi_slopes,
)
from attnlab.nn.positional import sinusoidal_table


def _rope_by_formula(x, positions, base=10000.0):
    """RoPE with a loop over pairs (i, i + D/2): angle = p * base**(-2i/D)."""
    D = x.shape[-1]
    out = x.clone()
    for row, p in enumerate(positions):
        for i in range(D // 2):
            angle = p * base ** (-2 * i / D)
            a, b = x[..., row, i], x[..., row, i + D // 2]
            out[..., row, i] = a * math.cos(angle) - b * math.sin(angle)
            out[..., row, i + D // 2] = a * math.sin(angle) + b * math.cos(angle)
    return out


def test_rope_equals_formula_with_offset():
    x = torch.randn(2, 3, 7, 10, dtype=torch.float64)
    rope = RotaryEmbedding(10, base=500.0)
    torch.testing.assert_close(rope(x, offset=41), _rope_by_formula(x, range(41, 48), base=500.0),
                               rtol=0, atol=1e-12)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def score(m, n):
        rq = rope(q.expand(m + 1, 16).clone())[m]  # q placed at position m
        rk = rope(k.expand(n + 1, 16).clone())[n]
        return float(rq @ rk)

    for shift in (1, 7, 100):
        assert score(5, 2) == pytest.approx(score(5 + shift, 2 + shift), abs=1e-10)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-6)
    assert score(0, 0) == pytest.approx(float(q @ k), abs=1e-12)  # position 0: no rotation


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(5)


def test_sinusoidal_matches_paper_formula():
    d, T = 9, 30  # odd width too
    table = sinusoidal_table(T, d, offset=3, dtype=torch.float64)
    for pos in range(T):
        for i in range(d):
            freq = (pos + 3) / 10000 ** ((i - i % 2) / d)
            expected = math.sin(freq) if i % 2 == 0 else math.cos(freq)
            assert table[pos, i].item() == pytest.approx(expected, abs=1e-12)
    x = torch.randn(2, T, d, dtype=torch.float64)
    torch.testing.assert_close(SinusoidalPositionalEmbedding(d)(x, offset=3), x + table)


def test_learned_positions_offset_and_bounds():
    emb = LearnedPositionalEmbedding(8, 4)
    x = torch.zeros(1, 3, 4)
    assert torch.equal(emb(x, offset=5)[0], emb.embedding.weight[5:8].detach())
    with pytest.raises(ValueError, match="outside the 8 learned positions"):
        emb(x, offset=6)


def test_alibi_slopes_follow_the_paper():
    # Press et al.: for 8 heads the slopes are 1/2, 1/4, ..., 1/256.
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    # 6 heads: the 4-head sequence 2^-2, 2^-4, 2^-6, 2^-8, then 8-head slopes 2^-1, 2^-3.
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]


def test_alibi_bias_formula_and_alignment():
    H, tq, tk = 4, 3, 6
    bias = alibi_bias(H, tq, tk, dtype=torch.float64)
    slopes = [2.0 ** (-8 * (h + 1) / H) for h in range(H)]
    for h in range(H):
        for i in range(tq):
            for j in range(tk):
                assert bias[0, h, i, j].item() == pytest.approx(-slopes[h] * abs(i + tk - tq - j))
    top_left = alibi_bias(H, tq, tk, align="top_left", dtype=torch.float64)
    assert top_left[0, 1, 2, 0].item() == pytest.approx(-slopes[1] * 2)


def test_learned_positions_refuse_unsigned_and_negative_positions_by_name():
    """uint8 positions indexed the table as a bool mask; -1 silently took the last position."""
    from attnlab.nn.positional import LearnedPositionalEmbedding
    emb, x = LearnedPositionalEmbedding(8, 4), torch.zeros(1, 3, 4)
    with pytest.raises(TypeError, match="positions must have a signed integer dtype.*uint8"):
        emb(x, positions=torch.tensor([0, 1, 2], dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"positions -1\.\.2 are outside the 8 learned positions"):
        emb(x, positions=torch.tensor([-1, 1, 2]))
    got = emb(x, positions=torch.tensor([5, 0, 7], dtype=torch.int32))
    torch.testing.assert_close(got, emb.embedding.weight[[5, 0, 7]].expand(1, 3, 4))


def test_rotary_tables_are_built_once_and_sliced_exactly():
    """cos_sin slices a table kept per dtype and device: equal (bitwise) to computing the rows
    afresh, for any offset, grown when a longer one is asked, and made outside inference mode
    (a table first built under torch.inference_mode serves autograd afterwards)."""
    from attnlab.nn.positional import TABLE_CACHE

    rope = RotaryEmbedding(8)
    with torch.inference_mode():
        first = rope.cos_sin(3, offset=2)
    for count, offset in ((3, 2), (1, 63), (5, 200), (0, 7)):
        got = rope.cos_sin(count, offset=offset, dtype=torch.float64)
        want = rope._angles(count, offset, torch.float64, torch.device("cpu"))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(first[0], rope.cos_sin(3, offset=2)[0])
    table = rope.cos_sin(1, offset=10)[0]
    assert rope.cos_sin(1, offset=11)[0].untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    x = torch.randn(1, 1, 4, 8, requires_grad=True)
    rope(x, offset=1).sum().backward()  # tables from inference mode are no inference tensors
    assert x.grad is not None
    far = rope.cos_sin(2, offset=TABLE_CACHE)  # past the bound: computed, not kept
    assert torch.equal(far[1], rope._angles(2, TABLE_CACHE, torch.float32, torch.device("cpu"))[1])
    assert max(t[0].shape[0] for t in rope._tables.values()) <= TABLE_CACHE
    with pytest.raises(ValueError, match="offset must be a non-negative int"):
        rope.cos_sin(2, offset=-1)
    with pytest.raises((TypeError, ValueError), match="num_positions"):
        rope.cos_sin(2.5)
