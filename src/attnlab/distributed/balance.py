"""Balancing a mask's work across ranks: equal chunks assigned to ranks by their cost.

A rank's work in context-parallel attention is the (query, key) pairs its queries may attend
(the ring computes only those blocks). Under a causal mask over one sequence the zigzag layout
equalises it, but packed documents break that: a query sees only its own document, so a chunk
at the end of a long document costs as much as a whole short document, and the rank that holds
it does far more work. Here the sequence is cut into ``chunks_per_rank * P`` equal chunks, each
chunk's cost is the pairs its queries visit (read from the mask's per-row key intervals,
:func:`attnlab.masks.prepare`: for a causal document of length ``L`` the ``i``-th query visits
``i + 1`` keys), and the chunks are dealt to ranks, the same number each, by largest cost first
to the least loaded rank, then improved by swapping chunks between the most loaded rank and
another. The result is a :class:`~attnlab.distributed.layout.ChunkLayout`: ``shard``,
``unshard``, ``positions`` and :func:`attnlab.distributed.context_parallel_attention` take it
as ``layout``.

Example:
    >>> from attnlab import masks
    >>> ids = torch.repeat_interleave(torch.arange(3), torch.tensor([40, 8, 16]))  # 3 documents
    >>> mod = masks.document_mod(ids)
    >>> visited_pairs(mod, length=64, layout="zigzag", world=2)
    [272, 720]
    >>> layout = balanced_layout(mod, length=64, world=2, chunks_per_rank=4)
    >>> layout.chunks, visited_pairs(mod, length=64, layout=layout, world=2)
    (((1, 4, 6, 7), (0, 2, 3, 5)), [528, 464])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab._checks import positive_int
from attnlab.distributed.layout import ChunkLayout, check_length, positions

__all__ = ["row_costs", "visited_pairs", "balanced_layout"]

_SWAP_ROUNDS = 200  # improving swaps tried at most (each lowers the most loaded rank's work)


def row_costs(mask: Callable, *, length: int, batch: int = 1) -> Tensor:
    """Keys each query row may attend, ``(length,)`` int64, summed over the mask's batch rows.

    Read from the mask's per-row key intervals (exact for contiguous documents, windows,
    prefix-LM and varlen; an interval that spans another document counts its keys too).

    Example:
        >>> row_costs(_masks.document_mod(torch.tensor([0, 0, 0, 1, 1])), length=5).tolist()
        [1, 2, 3, 1, 2]
    """
    positive_int("length", length)
    prepared = _masks.prepare(mask, tq=length, tk=length, batch=batch)
    return (prepared.hi - prepared.lo + 1).clamp(min=0).sum(dim=0)  # (length,)


def visited_pairs(mask: Callable, *, length: int, layout, world: int, batch: int = 1) -> list[int]:
    """The (query, key) pairs each rank's queries visit under ``layout``: one int per rank.

    Example:
        >>> visited_pairs(_masks.causal_mod(8, 8), length=8, layout="contiguous", world=2)
        [10, 26]
    """
    costs = row_costs(mask, length=length, batch=batch)
    return [int(costs[positions(length, layout=layout, rank=r, world=world)].sum()) for r in range(world)]


def balanced_layout(mask: Callable, *, length: int, world: int, chunks_per_rank: int = 8,
                    batch: int = 1) -> ChunkLayout:
    """A :class:`ChunkLayout` whose ranks visit about equal (query, key) pairs under ``mask``.

    Args:
        mask: one of attnlab's mask mods over the global sequence (a document mask, typically
            ``masks.document_mod(ids)``), or an AND of them.
        length: global sequence length; a multiple of ``world * chunks_per_rank``.
        world: number of ranks.
        chunks_per_rank: chunks each rank holds; more chunks balance finer, and cost nothing in
            the ring (a rank's chunks are one shard to it).
        batch: batch rows the mask's tensors describe (their costs are summed).

    Returns:
        The layout; every rank computes the same plan from the same mask.

    Raises:
        ValueError: a length that does not divide, a mask without key intervals.

    Example:
        >>> ids = torch.repeat_interleave(torch.arange(2), torch.tensor([24, 8]))
        >>> balanced_layout(_masks.document_mod(ids), length=32, world=2, chunks_per_rank=2).chunks
        ((2, 3), (0, 1))
    """
    positive_int("world", world)
    positive_int("chunks_per_rank", chunks_per_rank)
    n = world * chunks_per_rank
    check_length(length, layout=ChunkLayout(tuple(tuple(range(r * chunks_per_rank, (r + 1) * chunks_per_rank))
                                                  for r in range(world))), world=world)
    costs = row_costs(mask, length=length, batch=batch).view(n, -1).sum(dim=1).tolist()  # per chunk
    ranks = _deal(costs, world, chunks_per_rank)
    _improve(ranks, costs)
    return ChunkLayout(tuple(tuple(sorted(chunks)) for chunks in ranks))


def _deal(costs: list[int], world: int, per_rank: int) -> list[list[int]]:
    """Largest cost first, each chunk to the least loaded rank that has room."""
    ranks: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for chunk in sorted(range(len(costs)), key=lambda c: (-costs[c], c)):
        rank = min((r for r in range(world) if len(ranks[r]) < per_rank), key=lambda r: (loads[r], r))
        ranks[rank].append(chunk)
        loads[rank] += costs[chunk]
    return ranks


def _improve(ranks: list[list[int]], costs: list[int]) -> None:
    """Swap a chunk of the most loaded rank with one of another rank while that lowers the
    larger of the two loads below the most loaded (in place)."""
    for _ in range(_SWAP_ROUNDS):
        loads = [sum(costs[c] for c in chunks) for chunks in ranks]
        top = max(range(len(ranks)), key=lambda r: (loads[r], -r))
        best = None
        for other in range(len(ranks)):
            for i, a in enumerate(ranks[top]):
                for j, b in enumerate(ranks[other]):
                    gain = costs[a] - costs[b]
                    worse = max(loads[top] - gain, loads[other] + gain)
                    if other != top and gain > 0 and worse < loads[top] and (best is None or worse < best[0]):
                        best = (worse, other, i, j)
        if best is None:
            return
        _, other, i, j = best
        ranks[top][i], ranks[other][j] = ranks[other][j], ranks[top][i]
