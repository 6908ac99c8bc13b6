"""All-to-all sequence parallelism (DeepSpeed-Ulysses): trade sequence shards for head shards.

On rank ``r`` of ``P``: one all-to-all turns ``q``, ``k``, ``v`` from ``(B, H, T/P, D)`` (all
heads, a shard of the sequence) into ``(B, H/P, T, D)`` (heads ``r*H/P .. (r+1)*H/P - 1``, the
whole sequence in global order); plain :func:`attnlab.attention` runs on that with any mask; a
second all-to-all turns the output back into a sequence shard. The backward of an all-to-all is
the opposite all-to-all, so gradients take the same two hops in reverse.

Every rank needs whole heads: ``H`` (and, for grouped-query attention, the key/value heads)
must be divisible by ``P``.

Example:
    >>> x = torch.arange(2 * 4 * 6).view(1, 4, 6, 2).float()     # (B, H, T_local, D), P = 2
    >>> _to_senders(x, world=2).shape                               # (P, B, H/P, T_local, D)
    torch.Size([2, 1, 2, 6, 2])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab.distributed._comm import CommStats, Peers, all_to_all
from attnlab.distributed._global import global_mod
from attnlab.distributed.layout import to_global_order, to_rank_major
from attnlab.functional import attention

__all__ = ["HeadShiftedMod"]


def _to_senders(x: Tensor, *, world: int) -> Tensor:
    """``(B, H, T_local, D) -> (P, B, H/P, T_local, D)``: slice ``i`` holds rank ``i``'s heads."""
    B, H, T, D = x.shape
    return x.view(B, world, H // world, T, D).transpose(0, 1)  # (P, B, H/P, T_local, D)


def seq_to_heads(x: Tensor, who: Peers, layout: str, stats: CommStats | None) -> Tensor:
    """``(B, H, T/P, D)`` sequence shard -> ``(B, H/P, T, D)`` head shard in global order."""
    received = all_to_all(_to_senders(x, world=who.world), who, stats=stats,
                          what="all-to-all (sequence to heads)")  # (P, B, H/P, T_local, D)
    P, B, h, T, D = received.shape
    rank_major = received.permute(1, 2, 0, 3, 4).reshape(B, h, P * T, D)  # (B, H/P, T, D)
    return to_global_order(rank_major, dim=2, layout=layout, world=P)


def heads_to_seq(x: Tensor, who: Peers, layout: str, stats: CommStats | None) -> Tensor:
    """``(B, H/P, T, D)`` head shard in global order -> ``(B, H, T/P, D)`` sequence shard."""
    B, h, T, D = x.shape
    P = who.world
    rank_major = to_rank_major(x, dim=2, layout=layout, world=P)
    senders = rank_major.view(B, h, P, T // P, D).permute(2, 0, 1, 3, 4)  # (P, B, H/P, T/P, D)
    received = all_to_all(senders, who, stats=stats, what="all-to-all (heads to sequence)")
    return received.transpose(0, 1).reshape(B, P * h, T // P, D)  # (B, H, T/P, D)


class _Reshard(torch.autograd.Function):
    """One all-to-all re-shard, ``there`` (seq_to_heads or heads_to_seq); its backward is ``back``,
    the opposite re-shard of the gradient."""

    @staticmethod
    def forward(ctx, x, there, back, who, layout, stats):
        ctx.back, ctx.who, ctx.layout, ctx.stats = back, who, layout, stats
        return there(x, who, layout, stats)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.who, ctx.layout, ctx.stats), None, None, None, None, None


class HeadShiftedMod(_masks.MaskMod):
    """A mask mod seen from a head shard: local head ``h`` is global head ``h + offset``.

    Keeps the wrapped mod's key bounds, so tiled backends still skip what it blocks.

    Example:
        >>> per_head = lambda b, h, q, k: k <= q + h        # head h sees h keys ahead
        >>> mod = HeadShiftedMod(per_head, offset=2)
        >>> bool(mod(torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.tensor(2)))
        True
    """

    def __init__(self, mod: Callable, offset: int):
        self.mod, self.offset = mod, offset

    def __call__(self, b, h, q_idx, kv_idx):
        return _masks.apply_mod(self.mod, b, h + self.offset, q_idx, kv_idx)  # a plain mod: vmapped

    def kv_bounds(self, q_start, q_end):
        bounds = getattr(self.mod, "kv_bounds", None)
        return None if bounds is None else bounds(q_start, q_end)

    def check_sizes(self, *, batch, heads, tq, tk):
        check = getattr(self.mod, "check_sizes", None)
        if check is not None:
            check(batch=batch, heads=heads + self.offset, tq=tq, tk=tk)

    def __repr__(self) -> str:
        return f"HeadShiftedMod({self.mod!r}, offset={self.offset})"


def _local_mask(mask, who: Peers, heads: int):
    """The global mask as this rank's head shard sees it."""
    if mask is None:
        return None
    per_rank = heads // who.world
    if isinstance(mask, Tensor):
        if mask.ndim == 4 and mask.shape[1] == heads and who.world > 1:
            return mask[:, who.rank * per_rank:(who.rank + 1) * per_rank]
        return mask
    return HeadShiftedMod(mask, who.rank * per_rank) if who.rank else mask


def head_share(who: Peers, heads: int) -> slice:
    """The global query heads of this rank's head shard.

    Example:
        >>> from attnlab.distributed._comm import Peers
        >>> head_share(Peers(group=None, world=2, rank=1, timeout=1.0), 8)
        slice(4, 8, None)
    """
    per_rank = heads // who.world
    return slice(who.rank * per_rank, (who.rank + 1) * per_rank)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, who: Peers, layout: str, causal: bool,
                      scale: float, mask=None, backend: str = "auto",
                      stats: CommStats | None = None, score_mod=None, sinks: Tensor | None = None) -> Tensor:
    """Ulysses on checked shards; see :func:`attnlab.distributed.context_parallel_attention`.

    ``score_mod`` sees global head numbers (positions already are global); ``sinks`` ``(Hq,)``
    are cut to this rank's heads (so their gradient here is this rank's share)."""
    qh, kh, vh = (_Reshard.apply(t, seq_to_heads, heads_to_seq, who, layout, stats)
                  for t in (q, k, v))  # (B, H/P, T, D)
    mine = head_share(who, q.shape[1])
    mod = global_mod(score_mod, head_offset=mine.start, heads=q.shape[1], length=qh.shape[2])
    out = attention(qh, kh, vh, mask=_local_mask(mask, who, q.shape[1]), causal=causal,
                    scale=scale, backend=backend, score_mod=mod, sinks=None if sinks is None else sinks[mine])
    return _Reshard.apply(out, heads_to_seq, seq_to_heads, who, layout, stats)  # (B, H, T/P, D)
