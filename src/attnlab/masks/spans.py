"""Which keys each block of queries may reach: a mask's per-query-block key ranges.

A tiled kernel (the ``blocks`` and ``flex`` backends) and a picture of a mask (the lab's mask
views) both cut the queries into blocks of ``block`` rows and need, for each block, the one
contiguous range of keys that any of its queries may attend (with a window of 2, the block of
queries 4-7 reaches keys 3-7). That is a fact about the mask, read
from its bounds (:func:`~attnlab.masks.mods.kv_range`), so it lives here with the masks.

Example:
    >>> from attnlab import masks
    >>> masks.block_spans(masks.sliding_window_mod(8, 8, window=2), 8, 8, 4)
    [(0, 4, 0, 4), (4, 8, 3, 8)]
"""

from __future__ import annotations

from collections.abc import Callable

from attnlab.masks.mods import kv_range

__all__ = ["block_spans"]


def block_spans(mod: Callable | None, tq: int, tk: int, block: int) -> list[tuple[int, int, int, int]]:
    """``(q_start, q_end, kv_lo, kv_hi)`` for each query block: the keys it may reach.

    Args:
        mod: a mask mod (its bounds give the ranges; a mod without bounds reaches every key), or
            None for no mask.
        tq, tk: the numbers of queries and keys.
        block: queries per block; the last block holds the rest.

    Example:
        >>> from attnlab import masks
        >>> block_spans(masks.causal_mod(6, 6), 6, 6, 4)
        [(0, 4, 0, 4), (4, 6, 0, 6)]
    """
    spans = []
    for qs in range(0, tq, block):
        qe = min(qs + block, tq)
        spans.append((qs, qe, *kv_range(mod, qs, qe, tk)))
    return spans
