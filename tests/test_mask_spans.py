"""``attnlab.masks.block_spans``: the keys each block of queries may reach, read from the mask.

The reference is the materialized mask: for every query block, the keys any of its queries may
attend must lie inside the span (a tiled kernel that skipped one would drop a weight), and for the
patterns whose bounds are exact the span is the tightest one.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import masks
from attnlab.backends import blocks


def _tight_spans(mod, tq: int, tk: int, block: int) -> list[tuple[int, int, int, int]]:
    """The smallest ``[lo, hi)`` per query block, from the dense mask (an empty block gives (0, 0))."""
    dense = masks.materialize(mod, tq=tq, tk=tk)[0, 0]  # (Tq, Tk) bool
    spans = []
    for qs in range(0, tq, block):
        qe = min(qs + block, tq)
        reached = torch.nonzero(dense[qs:qe].any(dim=0)).flatten()
        spans.append((qs, qe, int(reached.min()), int(reached.max()) + 1) if reached.numel() else (qs, qe, 0, 0))
    return spans


@pytest.mark.parametrize("tq, tk, block", [(6, 6, 4), (17, 17, 5), (8, 12, 3), (1, 9, 4)])
@pytest.mark.parametrize("pattern", ["causal", "window", "chunked"])
def test_spans_are_the_tightest_ranges_of_the_dense_mask(pattern, tq, tk, block):
    mod = {"causal": lambda: masks.causal_mod(tq, tk),
           "window": lambda: masks.sliding_window_mod(tq, tk, window=3),
           "chunked": lambda: masks.chunked_local_mod(tq, tk, chunk=4)}[pattern]()
    assert masks.block_spans(mod, tq, tk, block) == _tight_spans(mod, tq, tk, block)


def test_a_mod_without_bounds_and_no_mask_reach_every_key():
    def anything(b, h, q, k):
        return (q + k) % 3 == 0

    dense = masks.materialize(anything, tq=7, tk=5)[0, 0]
    spans = masks.block_spans(anything, 7, 5, 3)
    assert spans == masks.block_spans(None, 7, 5, 3) == [(0, 3, 0, 5), (3, 6, 0, 5), (6, 7, 0, 5)]
    for qs, qe, lo, hi in spans:  # nothing the mask allows lies outside a span
        assert not dense[qs:qe, :lo].any() and not dense[qs:qe, hi:].any()


def test_no_queries_give_no_spans():
    assert masks.block_spans(masks.causal_mod(0, 4), 0, 4, 2) == []


def test_the_blocks_backend_uses_the_masks_function():
    """``attnlab.backends.blocks.block_spans`` (its old home) is the same function, still importable there."""
    assert blocks.block_spans is masks.block_spans
