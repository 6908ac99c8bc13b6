"""How a sequence is cut across ranks, and moving between the global and the sharded view.

Two named layouts, and any assignment of equal chunks (:class:`ChunkLayout`):

* ``"contiguous"``: the sequence is cut into ``P`` equal chunks; rank ``r`` holds chunk ``r``.
  Simple, but under a causal mask rank ``P-1`` does ``P`` times the work of rank 0.
* ``"zigzag"``: the sequence is cut into ``2P`` equal chunks; rank ``r`` holds chunks ``r`` and
  ``2P-1-r`` (an early one and a late one), so every rank does the same causal work.
* a :class:`ChunkLayout`: the sequence is cut into ``n * P`` equal chunks and rank ``r`` holds
  the ``n`` chunks ``chunks[r]`` (in increasing order). :func:`attnlab.distributed.balance.balanced_layout`
  builds one that balances the work of a document mask.

A rank's local tokens are always in increasing global position, so a causal mask between two
tokens of the same rank is a plain causal mask on local indices.

The sequence length must be a multiple of ``P`` (contiguous) or ``2P`` (zigzag): attnlab raises
``ValueError`` rather than padding silently (pad to a multiple yourself and mask the pad keys,
e.g. with :func:`attnlab.masks.padding_mod` under ``method="ulysses"``, or put the pad at the end
of a causal sequence, where no real query can see it).

Example:
    >>> chunk_ids("zigzag", rank=0, world=2), chunk_ids("zigzag", rank=1, world=2)
    ([0, 3], [1, 2])
    >>> positions(8, layout="zigzag", rank=1, world=2).tolist()
    [2, 3, 4, 5]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from dataclasses import dataclass

from attnlab._checks import instance_of, int_value, non_negative_int, one_of, positive_int
from attnlab.distributed._comm import peers

__all__ = ["LAYOUTS", "ChunkLayout", "check_layout", "hybrid_layout", "chunk_ids", "chunks_per_rank", "check_length",
           "positions", "shard", "unshard"]

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class ChunkLayout:
    """Rank ``r`` holds chunks ``chunks[r]`` of ``len(chunks) * n`` equal chunks, ``n`` each.

    Every chunk id appears once; each rank's ids are increasing, so local order is global order.

    Example:
        >>> layout = ChunkLayout(((0, 3), (1, 2)))      # zigzag on 2 ranks, spelled out
        >>> positions(8, layout=layout, rank=1, world=2).tolist()
        [2, 3, 4, 5]
    """

    chunks: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        chunks = tuple(tuple(int(c) for c in row) for row in self.chunks)
        object.__setattr__(self, "chunks", chunks)
        sizes = {len(row) for row in chunks}
        flat = sorted(c for row in chunks for c in row)
        if not chunks or len(sizes) != 1 or 0 in sizes or flat != list(range(len(flat))) or any(
                list(row) != sorted(row) for row in chunks):
            raise ValueError(f"layout: a ChunkLayout gives every rank the same number of increasing "
                             f"chunk ids, each of 0..n-1 once; got {self.chunks!r}")

    @property
    def world(self) -> int:
        return len(self.chunks)


def check_layout(layout: object) -> str | ChunkLayout:
    """``layout`` if it is ``"zigzag"``, ``"contiguous"`` or a :class:`ChunkLayout`.

    Example:
        >>> check_layout("zigzag")
        'zigzag'
    """
    return layout if isinstance(layout, ChunkLayout) else one_of("layout", layout, LAYOUTS)


def chunks_per_rank(layout: str | ChunkLayout) -> int:
    """How many equal chunks of the sequence each rank holds: 2 (zigzag), 1 (contiguous), or a
    :class:`ChunkLayout`'s own count.

    Example:
        >>> chunks_per_rank("zigzag")
        2
    """
    if isinstance(check_layout(layout), ChunkLayout):
        return len(layout.chunks[0])
    return 2 if layout == "zigzag" else 1


def chunk_ids(layout: str | ChunkLayout, *, rank: int, world: int) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in local order.

    Example:
        >>> chunk_ids("contiguous", rank=2, world=4), chunk_ids("zigzag", rank=2, world=4)
        ([2], [2, 5])
    """
    positive_int("world", world)
    if not 0 <= non_negative_int("rank", rank) < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if isinstance(check_layout(layout), ChunkLayout):
        if layout.world != world:
            raise ValueError(f"layout: this ChunkLayout is for {layout.world} ranks, the group has {world}")
        return list(layout.chunks[rank])
    return [rank, 2 * world - 1 - rank] if chunks_per_rank(layout) == 2 else [rank]


def hybrid_layout(layout: str | ChunkLayout, *, ring: int, ulysses: int) -> ChunkLayout:
    """Where each of ``ring * ulysses`` ranks' tokens lie when Ulysses runs inside groups of
    ``ulysses`` consecutive ranks and the ring runs across those groups in ``layout``.

    Ring position ``j`` (ranks ``j*U .. j*U+U-1``) holds the ring shard ``layout`` gives rank
    ``j`` of ``ring``; its ``U`` ranks split that shard contiguously, so the all-to-all inside
    the group puts the ring shard back together in order. Each ring chunk is cut into ``U``
    sub-chunks, so every rank holds as many sub-chunks as a ring rank holds chunks.

    Example:
        >>> hybrid_layout("zigzag", ring=2, ulysses=2).chunks   # 8 sub-chunks; ring 0: 0,1 + 6,7
        ((0, 1), (6, 7), (2, 3), (4, 5))
    """
    positive_int("ring", ring)
    positive_int("ulysses", ulysses)
    per = chunks_per_rank(layout)
    shards = [[c * ulysses + i for c in chunk_ids(layout, rank=j, world=ring) for i in range(ulysses)]
              for j in range(ring)]  # each ring rank's sub-chunks, in order
    return ChunkLayout(tuple(tuple(shards[j][u * per:(u + 1) * per]) for j in range(ring) for u in range(ulysses)))


def check_length(length: int, *, layout: str | ChunkLayout, world: int, name: str = "sequence length") -> int:
    """The chunk size for a global ``length``; ``ValueError`` when it does not divide evenly.

    Example:
        >>> check_length(12, layout="zigzag", world=2)
        3
        >>> check_length(10, layout="zigzag", world=4)
        Traceback (most recent call last):
        ...
        ValueError: sequence length 10 must be a positive multiple of 2 * world = 8 for layout='zigzag' (pad it: see attnlab.distributed.layout)
    """
    int_value(name, length)
    pieces = chunks_per_rank(layout) * positive_int("world", world)
    if length <= 0 or length % pieces:
        what = "world" if pieces == world else "2 * world" if layout == "zigzag" else "chunks"
        raise ValueError(f"{name} {length} must be a positive multiple of {what} = {pieces} for "
                         f"layout={layout!r} (pad it: see attnlab.distributed.layout)")
    return length // pieces


def positions(length: int, *, layout: str | ChunkLayout, rank: int, world: int,
              device: torch.device | str | None = None) -> Tensor:
    """Global positions ``(T_local,)`` of rank ``rank``'s tokens of a ``length``-token sequence.

    Use them for position embeddings (RoPE, learned) on a shard.

    Example:
        >>> positions(8, layout="contiguous", rank=1, world=2).tolist()
        [4, 5, 6, 7]
    """
    size = check_length(length, layout=layout, world=world)
    starts = [c * size for c in chunk_ids(layout, rank=rank, world=world)]
    return torch.cat([torch.arange(s, s + size, device=device) for s in starts])


def shard(x: Tensor, *, dim: int, layout: str | ChunkLayout = "zigzag", group=None) -> Tensor:
    """This rank's shard of a global tensor ``x`` along ``dim`` (every rank passes the same ``x``).

    Args:
        x: the full tensor, e.g. ``(B, H, T, D)`` with ``dim=2`` or token ids ``(B, T)``, ``dim=1``.
        dim: the sequence dimension.
        layout: ``"zigzag"`` or ``"contiguous"`` (see the module docstring).
        group: process group (default: the world).

    Returns:
        ``x`` restricted to this rank's positions along ``dim`` (a new tensor).

    Example (run under ``torchrun --nproc-per-node 2``)::

        x = torch.arange(8).view(1, 8)
        shard(x, dim=1, layout="zigzag")   # rank 0: tensor([[0, 1, 6, 7]]), rank 1: [[2, 3, 4, 5]]
    """
    instance_of("x", x, Tensor, "a torch.Tensor")
    dim = _dim(x, dim)
    who = peers(group, None)
    world, rank = who.world, who.rank
    index = positions(x.shape[dim], layout=layout, rank=rank, world=world, device=x.device)
    return x.index_select(dim, index)


def unshard(x_local: Tensor, *, dim: int, layout: str | ChunkLayout = "zigzag", group=None) -> Tensor:
    """Gather every rank's shard back into the global tensor (in global order) on every rank.

    The inverse of :func:`shard`; it all-gathers, so every rank must call it with a shard of
    the same shape.

    Example (run under ``torchrun --nproc-per-node 2``)::

        local = shard(torch.arange(8).view(1, 8), dim=1, layout="zigzag")
        unshard(local, dim=1, layout="zigzag")   # tensor([[0, 1, 2, 3, 4, 5, 6, 7]]) on every rank
    """
    instance_of("x_local", x_local, Tensor, "a torch.Tensor")
    dim = _dim(x_local, dim)
    world = peers(group, None).world
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return to_global_order(torch.cat(parts, dim=dim), dim=dim, layout=layout, world=world)


def rank_major_positions(length: int, *, layout: str | ChunkLayout, world: int,
                         device: torch.device | str | None = None) -> Tensor:
    """Global positions ``(length,)`` of the tokens of every rank, rank 0's first.

    Example:
        >>> rank_major_positions(8, layout="zigzag", world=2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    return torch.cat([positions(length, layout=layout, rank=r, world=world, device=device)
                      for r in range(world)])


def to_global_order(x: Tensor, *, dim: int, layout: str | ChunkLayout, world: int) -> Tensor:
    """Reorder a rank-major concatenation of shards along ``dim`` into global order.

    Example:
        >>> to_global_order(torch.tensor([0, 1, 6, 7, 2, 3, 4, 5]), dim=0, layout="zigzag", world=2).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if _in_order(layout, world):
        return x
    order = rank_major_positions(x.shape[dim], layout=layout, world=world, device=x.device)
    return x.index_select(dim, torch.argsort(order))


def to_rank_major(x: Tensor, *, dim: int, layout: str | ChunkLayout, world: int) -> Tensor:
    """The inverse of :func:`to_global_order`: global order to rank-major shards along ``dim``.

    Example:
        >>> to_rank_major(torch.arange(8), dim=0, layout="zigzag", world=2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if _in_order(layout, world):
        return x
    order = rank_major_positions(x.shape[dim], layout=layout, world=world, device=x.device)
    return x.index_select(dim, order)


def _in_order(layout: str | ChunkLayout, world: int) -> bool:
    """Rank-major order is global order: one rank, or contiguous chunks (no copy needed)."""
    if isinstance(check_layout(layout), ChunkLayout):
        return [c for row in layout.chunks for c in row] == list(range(world * len(layout.chunks[0])))
    return world == 1 or layout == "contiguous"


def _dim(x: Tensor, dim: object) -> int:
    int_value("dim", dim)
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim must be in [{-x.ndim}, {x.ndim}) for a {x.ndim}-d tensor, got {dim}")
    return dim % x.ndim
