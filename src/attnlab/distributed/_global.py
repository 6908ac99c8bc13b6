"""Score mods and sinks seen from a shard: the global positions and heads they are written for.

A score mod indexes global query/key positions (ALiBi's distance, a bias tensor's rows) and
global head numbers (ALiBi's slope per head). A shard's kernel call numbers its own queries,
keys and heads from 0, so the ring and Ulysses hand it the mod through :class:`GlobalIndexMod`,
which maps local indices to global ones before calling the mod. A mod of the score alone
(softcap) needs no mapping and is passed as it is.

Example:
    >>> from attnlab import scores
    >>> mod = GlobalIndexMod(scores.alibi(torch.tensor([1.0, 0.5])), q_pos=torch.tensor([4, 7]),
    ...                      k_pos=torch.tensor([0, 3]), head_offset=1, heads=2, length=8)
    >>> scores.apply_tile(mod, torch.zeros(1, 1, 2, 2), q_start=0, kv_start=0)[0, 0]   # head 1: slope 0.5
    tensor([[-2.0000, -0.5000],
            [-3.5000, -2.0000]])
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab import scores as _scores

__all__ = ["GlobalIndexMod", "global_mod", "check_score_options"]


class GlobalIndexMod(_scores.ScoreMod):
    """``mod`` evaluated at global indices: local query ``i`` is position ``q_pos[i]``, local
    key ``j`` position ``k_pos[j]`` (None: the same number), local head ``h`` head ``h + head_offset``.

    Shapes:
        q_pos ``(Tq_local,)``, k_pos ``(Tk_local,)`` int64, or None.

    Args:
        mod: the score mod over the whole sequence and every head.
        heads, length: the global head count and sequence length (what ``mod`` is checked against).
    """

    def __init__(self, mod: _scores.ScoreMod, *, q_pos: Tensor | None = None, k_pos: Tensor | None = None,
                 head_offset: int = 0, heads: int, length: int):
        self.mod, self.q_pos, self.k_pos, self.head_offset = mod, q_pos, k_pos, head_offset
        self.heads, self.length = heads, length
        self.additive = mod.additive
        self.relative = mod.relative and q_pos is None and k_pos is None  # distances kept only then
        self.user_function = mod.user_function

    def _indices(self, h, q_idx, kv_idx):
        q = q_idx if self.q_pos is None else self.q_pos[q_idx]
        k = kv_idx if self.k_pos is None else self.k_pos[kv_idx]
        return h + self.head_offset, q, k

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.mod(score, b, *self._indices(h, q_idx, kv_idx))

    def bias(self, b, h, q_idx, kv_idx):
        return self.mod.bias(b, *self._indices(h, q_idx, kv_idx))

    def params(self):
        return self.mod.params()

    def with_params(self, params):
        return type(self)(self.mod.with_params(params), q_pos=self.q_pos, k_pos=self.k_pos,
                          head_offset=self.head_offset, heads=self.heads, length=self.length)

    def signature(self):
        return ("GlobalIndexMod", self.mod.signature(), self.head_offset, self.heads, self.length)

    def check(self, *, batch, heads, tq, tk, device):
        self.mod.check(batch=batch, heads=self.heads, tq=self.length, tk=self.length, device=device)

    def __repr__(self) -> str:
        return f"GlobalIndexMod({self.mod!r}, head_offset={self.head_offset})"


class _GlobalIndexFunction(GlobalIndexMod, _scores.FunctionMod):
    """A :class:`GlobalIndexMod` of a user's function: a :class:`~attnlab.scores.FunctionMod`,
    so that a function written for 0-d indices is mapped position by position as it would be
    on one process."""


def global_mod(mod: _scores.ScoreMod | None, *, q_pos: Tensor | None = None, k_pos: Tensor | None = None,
               head_offset: int = 0, heads: int, length: int) -> _scores.ScoreMod | None:
    """``mod`` for a shard's kernel call: unchanged when it is a function of the score alone, else a
    :class:`GlobalIndexMod` (also where the indices are global already: it is checked against the
    global heads and length, not the shard's).

    Example:
        >>> from attnlab import scores
        >>> global_mod(scores.softcap(5.0), q_pos=torch.arange(2), heads=2, length=4)
        softcap(5)
    """
    if mod is None or mod.in_place:
        return mod
    kind = _GlobalIndexFunction if mod.user_function else GlobalIndexMod
    return kind(mod, q_pos=q_pos, k_pos=k_pos, head_offset=head_offset, heads=heads, length=length)


def check_score_options(score_mod, sinks, *, batch: int, heads: int, length: int,
                        device: torch.device, dtype: torch.dtype) -> tuple[_scores.ScoreMod | None, Tensor | None]:
    """``score_mod`` and ``sinks`` of a context-parallel call, checked against the GLOBAL call
    (``heads`` query heads, ``length`` tokens). Refused: per-query sinks (only per-head ``(Hq,)``
    logits are sharded) and a mod whose tensors need a gradient (the ring differentiates scores,
    not a mod's tensors).

    Example:
        >>> check_score_options(None, torch.zeros(2, 3), batch=1, heads=2, length=4,
        ...                     device=torch.device("cpu"), dtype=torch.float32)
        Traceback (most recent call last):
        ...
        ValueError: sinks: context-parallel attention takes per-head sinks of shape (Hq,) = (2,); got shape (2, 3) (per-query sinks are not sharded: run them on one process)
    """
    if sinks is not None:
        if isinstance(sinks, Tensor) and tuple(sinks.shape) != (heads,):
            raise ValueError(f"sinks: context-parallel attention takes per-head sinks of shape (Hq,) = ({heads},); "
                             f"got shape {tuple(sinks.shape)} (per-query sinks are not sharded: run them on one "
                             "process)")
        sinks = _scores.check_sinks(sinks, heads=heads, device=device)
    if score_mod is None:
        return None, sinks
    mod = _scores.as_score_mod(score_mod)
    mod.check(batch=batch, heads=heads, tq=length, tk=length, device=device)
    if _scores.has_function(mod):
        _scores.check_function(mod, tq=length, tk=length, device=device, dtype=dtype)
    if any(p.requires_grad for p in mod.params()) or _scores.captures_grad(mod):
        raise ValueError(f"score_mod: {mod!r} holds tensors that require grad; context-parallel attention "
                         "differentiates the scores but not a score mod's tensors (detach them, or run on one "
                         "process)")
    return mod, sinks
