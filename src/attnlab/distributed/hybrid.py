"""Ulysses inside a subgroup, the ring across subgroups (2-D context parallelism, as in USP).

``P = ulysses * ring`` ranks form a grid: ranks ``j*U .. j*U+U-1`` (consecutive ranks, one node
when each node runs ``U`` processes) are Ulysses group ``j``; ranks ``u, U+u, 2U+u, ...`` are
ring group ``u``. On each rank:

1. an all-to-all inside the Ulysses group turns ``(B, H, T/P, D)`` into ``(B, H/U, T/R, D)``:
   the group's ring shard, in order, for ``H/U`` heads (the sequence is laid out by
   :func:`~attnlab.distributed.layout.hybrid_layout`);
2. ring attention over the ring group on those heads (any mask the ring takes; key/value shards
   of ``T/R`` tokens and ``Hkv/U`` heads travel, so the ring's bytes per rank fall by ``U``);
3. the opposite all-to-all gives back ``(B, H, T/P, Dv)``.

Backward runs the ring's backward and the reverse all-to-alls.

Example:
    >>> _grid(world=4, ulysses=2)         # (Ulysses groups, ring groups) as group ranks
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch import Tensor

from attnlab.distributed._comm import CommStats, Peers, peers
from attnlab.distributed.layout import chunks_per_rank
from attnlab.distributed.ring import ring_attention
from attnlab.distributed.ulysses import _Reshard, head_share, heads_to_seq, seq_to_heads

__all__: list[str] = []  # hybrid_attention is reached through attnlab.distributed.context_parallel_attention

# parent process group -> {ulysses: this rank's (Ulysses group, ring group)}. Made once per
# parent: every member must create a group (a collective), so no rank may forget one alone.
# At most one entry per divisor of the parent's size; weakly keyed, so the entries go with
# their parent (dist.destroy_process_group), the only reset that keeps the ranks agreeing.
_SUBGROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _grid(*, world: int, ulysses: int) -> tuple[list[list[int]], list[list[int]]]:
    ring = world // ulysses
    return ([list(range(j * ulysses, (j + 1) * ulysses)) for j in range(ring)],
            [list(range(u, world, ulysses)) for u in range(ulysses)])


def subgroups(who: Peers, ulysses: int) -> tuple[Peers, Peers]:
    """This rank's Ulysses group and ring group (made on first use, then kept with the parent group)."""
    kept = _SUBGROUPS.setdefault(dist.group.WORLD if who.group is None else who.group, {})
    if ulysses not in kept:
        rows, cols = _grid(world=who.world, ulysses=ulysses)
        mine = []
        for members in (rows[who.rank // ulysses], cols[who.rank % ulysses]):
            ranks = [who.global_rank(r) for r in members]  # only the members create it
            mine.append(dist.new_group(ranks, use_local_synchronization=True))
        kept[ulysses] = tuple(mine)
    row, col = kept[ulysses]
    return peers(row, who.timeout), peers(col, who.timeout)


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, *, who: Peers, ulysses: int, layout, causal: bool,
                     scale: float, mask=None, stats: CommStats | None = None, head_chunks: int = 1,
                     score_mod=None, sinks: Tensor | None = None) -> Tensor:
    """Hybrid attention on checked shards; see :func:`attnlab.distributed.context_parallel_attention`.

    ``layout`` is the ring's layout over the ``P / ulysses`` ring positions.

    Example (under ``torchrun --nproc-per-node 4``; shards in ``hybrid_layout("zigzag", ring=2, ulysses=2)``)::

        out_l = hybrid_attention(q_l, k_l, v_l, who=peers(None, None), ulysses=2, layout="zigzag",
                                 causal=True, scale=q_l.shape[-1] ** -0.5)
    """
    inner, across = subgroups(who, ulysses)
    chunks_per_rank(layout)  # checked: a name or a ChunkLayout over the ring positions
    qh, kh, vh = (_Reshard.apply(t, seq_to_heads, heads_to_seq, inner, "contiguous", stats)
                  for t in (q, k, v))  # (B, H/U, T/R, D): the group's ring shard, in order
    mine = head_share(inner, q.shape[1])  # the group's ring runs these global heads
    out = ring_attention(qh, kh, vh, who=across, layout=layout, causal=causal, scale=scale, mask=mask,
                         stats=stats, head_chunks=head_chunks, score_mod=score_mod,
                         sinks=None if sinks is None else sinks[mine], head_offset=mine.start, heads=q.shape[1])
    return _Reshard.apply(out, heads_to_seq, seq_to_heads, inner, "contiguous", stats)  # (B, H, T/P, Dv)
