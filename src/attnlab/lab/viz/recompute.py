"""Attention weights recomputed on demand from queries, keys and each row's log-sum-exp.

A view of a long input never holds the ``T x T`` weights of every head. :class:`LazyWeights`
keeps each layer's queries and keys (as the fast path received them: after rotary embeddings,
before grouped-query repetition), the keys each query may attend (one interval ``[lo, hi)`` per
row: full, causal, sliding-window and padded rows all are one), the score mod and the sinks, and
recomputes exactly what a view shows::

    w[i, j] = exp(score(i, j) - lse[i])  for lo[i] <= j < hi[i], else 0

* :meth:`LazyWeights.lse` -- each row's log-sum-exp, in bands of rows (``O(T * band)`` memory);
* :meth:`LazyWeights.tile` -- the weights of a region, at full resolution;
* :meth:`LazyWeights.block_map` -- the overview: per block of queries x block of keys, the
  block's total weight averaged over its queries (``"mean"``, rows sum to 1) or its largest
  weight (``"max"``), computed a band of rows at a time.

Example:
    >>> import torch
    >>> q, k = torch.randn(2, 3, 50, 8).unbind(0)                  # (H, T, D) each: one layer
    >>> lazy = LazyWeights.from_qk(q, k, causal=True)
    >>> dense = torch.softmax((q @ k.mT / 8 ** 0.5).masked_fill(torch.ones(50, 50).triu(1).bool(), -torch.inf), -1)
    >>> bool(torch.allclose(lazy.tile(0, 2, rows=(10, 20), cols=(0, 50)), dense[2, 10:20], atol=1e-6))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnlab.masks import causal_offset
from attnlab.masks.evaluation import evaluate
from attnlab.scores import ScoreMod, Softcap, apply_tile

__all__ = ["LazyWeights", "RecordedLayer", "interval_bounds", "record", "reduce_blocks", "REDUCTIONS"]

REDUCTIONS = ("mean", "max")
BAND = 256  # rows evaluated at once when a mask's intervals are derived


@dataclass(frozen=True)
class RecordedLayer:
    """One layer's call, enough to recompute any of its weights.

    Attributes:
        q: ``(H, T, D)`` float32 queries; k: ``(Hkv, Tk, D)`` float32 keys (``H`` a multiple of ``Hkv``).
        bounds: ``(T, 2)`` int64, each query's attendable keys ``[lo, hi)``.
        scale: the score multiplier; score_mod: applied to the scaled scores, or None;
        sinks: ``(H,)`` or ``(H, T)`` sink logits (they add to each row's log-sum-exp), or None.

    Example:
        >>> layer = RecordedLayer(torch.ones(1, 2, 4), torch.ones(1, 2, 4), torch.tensor([[0, 1], [0, 2]]), 0.5)
        >>> layer.heads, layer.tq
        (1, 2)
    """

    q: Tensor
    k: Tensor
    bounds: Tensor
    scale: float
    score_mod: ScoreMod | None = None
    sinks: Tensor | None = None

    @property
    def heads(self) -> int:
        return self.q.shape[0]

    @property
    def tq(self) -> int:
        return self.q.shape[1]

    @property
    def tk(self) -> int:
        return self.k.shape[1]

    def keys(self) -> Tensor:
        """The keys repeated per query head: ``(H, Tk, D)``."""
        return self.k.repeat_interleave(self.heads // self.k.shape[0], dim=0)

    def softcap(self) -> float | None:
        """The cap when the score mod is a plain soft-cap (what a page's script recomputes), else None."""
        return self.score_mod.cap if isinstance(self.score_mod, Softcap) else None


def interval_bounds(*, tq: int, tk: int, mask=None, causal: bool = False, align: str = "top_left") -> Tensor:
    """Each query's attendable keys as one interval ``[lo, hi)``: ``(tq, 2)`` int64.

    ``mask`` is None, a bool tensor broadcasting to ``(1, 1, tq, tk)`` (True = attend), a float
    tensor of 0 and -inf (or the dtype's lowest value, as eager mask builders write), or a mask mod; ``causal`` with ``align`` intersects it. Rows are
    evaluated a band at a time (``O(tk * BAND)`` memory).

    Raises:
        ValueError: a row whose keys are not one interval (a document mask, top-k keys), a mask
            that differs between heads or batch rows, or a float mask adding other values.

    Example:
        >>> interval_bounds(tq=3, tk=3, causal=True).tolist()
        [[0, 1], [0, 2], [0, 3]]
    """
    rows = torch.arange(tq)
    hi = torch.full((tq,), tk, dtype=torch.long)
    lo = torch.zeros(tq, dtype=torch.long)
    if causal:
        hi = (rows + causal_offset(tq, tk, align) + 1).clamp(0, tk)
    if mask is None:
        return torch.stack([torch.minimum(lo, hi), hi], dim=1)
    parts = [_band_bounds(_band(mask, start, min(start + BAND, tq), tk), start) for start in range(0, tq, BAND)]
    mask_lo, mask_hi = (torch.cat(side) for side in zip(*parts))
    lo, hi = torch.maximum(lo, mask_lo), torch.minimum(hi, mask_hi)
    return torch.stack([torch.minimum(lo, hi), hi], dim=1)


def _band(mask, start: int, end: int, tk: int) -> Tensor:
    """Rows ``start:end`` of the mask as bool ``(end - start, tk)``, the same for every batch row and head."""
    if callable(mask) and not isinstance(mask, Tensor):
        allowed = evaluate(mask, q_range=(start, end), kv_range=(0, tk), batch=1, heads=1)
    elif isinstance(mask, Tensor):
        allowed = mask[..., start:end, :] if mask.shape[-2] > 1 else mask
        if allowed.dtype != torch.bool:  # eager builders block with the dtype's lowest value, others with -inf
            blocked = allowed <= torch.finfo(allowed.dtype).min
            if bool((allowed[~blocked] != 0).any()):
                raise ValueError("mask adds values other than 0 and -inf to the scores: a view of a long "
                                 "input recomputes weights for masks that only allow or block keys")
            allowed = ~blocked
    else:
        raise TypeError(f"mask must be None, a tensor or a mask mod, got {type(mask).__name__}")
    allowed = allowed.reshape(-1, *allowed.shape[-2:]) if allowed.ndim > 2 else allowed[None]
    if allowed.shape[0] > 1 and not bool((allowed == allowed[:1]).all()):
        raise ValueError("mask differs between heads or batch rows: a view of a long input takes one text "
                         "and one mask for every head")
    return allowed[0].expand(end - start, tk)  # (rows, tk)


def _band_bounds(allowed: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """``(lo, hi)`` of each row of a bool band, checking that its keys are one interval."""
    tk = allowed.shape[-1]
    count = allowed.sum(-1)
    lo = torch.where(count > 0, allowed.int().argmax(-1), 0)
    hi = torch.where(count > 0, tk - allowed.flip(-1).int().argmax(-1), 0)
    broken = (hi - lo) != count
    if bool(broken.any()):
        row = start + int(broken.nonzero()[0])
        raise ValueError(f"query {row} attends keys that are not one interval: a view of a long input "
                         "recomputes weights for full, causal, sliding-window and padded rows; show a "
                         "shorter input to see these weights whole")
    return lo, hi


@dataclass
class LazyWeights:
    """Every layer's weights of one input, recomputed on demand; built by :meth:`from_qk` or a lens.

    Attributes:
        tokens: ``T`` labels (positions when none were given).
        layers: one :class:`RecordedLayer` per layer.

    Example:
        >>> q = torch.randn(2, 3, 40, 8)                                 # (L, H, T, D)
        >>> lazy = LazyWeights.from_qk(q, q, causal=True)
        >>> lazy.heads, tuple(lazy.block_map(0, cells=8).shape)           # 40 tokens in blocks of 5
        ((3, 3), (3, 8, 8))
    """

    tokens: list[str]
    layers: list[RecordedLayer]
    _lse: dict = field(default_factory=dict, repr=False)
    _maps: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not self.tokens:
            raise ValueError("tokens must hold at least one token, got none: a view needs one query and key")
        if not self.layers:
            raise ValueError("layers must hold at least one layer, got none")
        sizes = {layer.tq for layer in self.layers} | {layer.tk for layer in self.layers}
        if sizes != {len(self.tokens)}:
            raise ValueError(f"tokens must have one label per query and key ({sorted(sizes)}), got {len(self.tokens)}")

    @classmethod
    def from_qk(cls, q, k, *, tokens: Sequence[str] | None = None, mask=None, causal: bool = False,
                scale: float | None = None, score_mod: ScoreMod | None = None, sinks: Tensor | None = None,
                ) -> LazyWeights:
        """Weights of queries and keys you hold, one layer or several.

        Shapes:
            q: ``(H, T, D)`` (one layer) or ``(L, H, T, D)``; k: ``(Hkv, T, D)`` or ``(L, Hkv, T, D)``.

        Args:
            tokens: ``T`` labels; mask, causal: as :func:`attnlab.attention` takes them (one
                interval of keys per query); scale: default ``1 / sqrt(D)``; score_mod, sinks:
                as :func:`attnlab.attention`.

        Example:
            >>> LazyWeights.from_qk(torch.randn(2, 6, 4), torch.randn(2, 6, 4), tokens=list("abcdef")).tokens[-1]
            'f'
        """
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, Tensor) or t.ndim not in (3, 4):
                raise ValueError(f"{name} must be a (H, T, D) or (L, H, T, D) tensor, got "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        q, k = (t if t.ndim == 4 else t[None] for t in (q, k))
        if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same layers and head size, "
                             "and a multiple of k's heads")
        layers = [record(q_l[None], k_l[None], mask=mask, causal=causal, scale=scale, score_mod=score_mod,
                         sinks=sinks) for q_l, k_l in zip(q, k)]
        return cls([str(i) for i in range(q.shape[2])] if tokens is None else [str(t) for t in tokens], layers)

    @property
    def heads(self) -> tuple[int, ...]:
        """Heads per layer."""
        return tuple(layer.heads for layer in self.layers)

    def _layer(self, layer: int) -> RecordedLayer:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(self.layers):
            raise ValueError(f"layer must be in [0, {len(self.layers)}), got {layer!r}")
        return self.layers[layer]

    def scores(self, layer: int, *, rows: tuple[int, int], cols: tuple[int, int], shift: Tensor | None = None,
               ) -> Tensor:
        """Every head's scores of a region, blocked keys at -inf: ``(H, r, c)`` float32.

        ``shift`` ``(H, r)`` is subtracted from each row (a row's log-sum-exp gives its weights' logs).
        """
        recorded = self._layer(layer)
        (r0, r1), (c0, c1) = _span("rows", rows, recorded.tq), _span("cols", cols, recorded.tk)
        q, keys = recorded.q[:, r0:r1], recorded.keys()[:, c0:c1]  # (H, r, D), (H, c, D)
        if shift is not None and recorded.score_mod is None:  # the shift joins the product: one pass fewer
            scores = torch.baddbmm(-shift[..., None], q, keys.mT, alpha=recorded.scale)  # (H, r, c)
        else:
            scores = torch.bmm(q, keys.mT).mul_(recorded.scale)  # (H, r, c)
        if recorded.score_mod is not None:
            scores = apply_tile(recorded.score_mod, scores[None], q_start=r0, kv_start=c0)[0].float()
            if shift is not None:
                scores = scores - shift[..., None]
        return _block_outside(scores, recorded.bounds[r0:r1], c0)

    def lse(self, layer: int) -> Tensor:
        """Each row's log-sum-exp over its keys (and sink): ``(H, T)``, computed once, ``-inf`` for an empty row."""
        if layer not in self._lse:
            recorded = self._layer(layer)
            lse = _fused_lse(recorded)
            if lse is None:
                lse = torch.cat([self._band_lse(layer, r0, min(r0 + BAND, recorded.tq))
                                 for r0 in range(0, recorded.tq, BAND)], dim=1)
            self._lse[layer] = _with_sinks(lse, recorded.sinks)  # (H, T)
        return self._lse[layer]

    def _band_lse(self, layer: int, r0: int, r1: int) -> Tensor:
        recorded = self.layers[layer]
        c0, c1 = _key_span(recorded.bounds[r0:r1])
        if c1 <= c0:
            return torch.full((recorded.heads, r1 - r0), float("-inf"))
        return torch.logsumexp(self.scores(layer, rows=(r0, r1), cols=(c0, c1)), dim=-1)  # (H, r)

    def tile(self, layer: int, head: int, *, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
        """The weights of one head on a region, at full resolution: ``(r, c)``.

        Example:
            >>> lazy = LazyWeights.from_qk(torch.randn(1, 5, 4), torch.randn(1, 5, 4))
            >>> float(lazy.tile(0, 0, rows=(0, 5), cols=(0, 5)).sum(-1).min()) > 0.999
            True
        """
        recorded = self._layer(layer)
        if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < recorded.heads:
            raise ValueError(f"head must be in [0, {recorded.heads}) for layer {layer}, got {head!r}")
        r0, r1 = _span("rows", rows, recorded.tq)
        scores = self.scores(layer, rows=(r0, r1), cols=cols)[head]
        return _weights(scores, self.lse(layer)[head, r0:r1, None])

    def block_map(self, layer: int, *, cells: int = 256, reduce: str = "mean",
                  progress: Callable[[int], None] | None = None) -> Tensor:
        """Every head's overview: ``(H, n, n)`` with ``n = ceil(T / block)``, ``block = ceil(T / cells)``.

        ``"mean"``: the total weight a block of queries gives a block of keys, averaged over its
        queries (rows sum to 1); ``"max"``: the block's largest weight. A band of ``block`` rows
        is computed at a time, over the keys its rows attend: ``O(H * T * block)`` memory; the
        result is kept for the next call. ``progress(rows_done)`` is called after each band.
        """
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
        if isinstance(cells, bool) or not isinstance(cells, int) or cells < 1:
            raise ValueError(f"cells must be a positive int, got {cells!r}")
        key = (layer, cells, reduce)
        if key not in self._maps:
            self._maps[key] = self._block_map(layer, cells, reduce, progress)
        return self._maps[key]

    def _block_map(self, layer: int, cells: int, reduce: str, progress) -> Tensor:
        recorded, lse = self._layer(layer), self.lse(layer)
        block = math.ceil(recorded.tk / cells)
        n = math.ceil(recorded.tk / block)
        overview = torch.zeros(recorded.heads, math.ceil(recorded.tq / block), n)
        rows_per_band = block * max(1, BAND // block)
        for r0 in range(0, recorded.tq, rows_per_band):
            r1 = min(r0 + rows_per_band, recorded.tq)
            c0, c1 = _key_span(recorded.bounds[r0:r1])
            if c1 > c0:
                first, last = c0 // block, math.ceil(c1 / block)
                c0, c1 = first * block, min(last * block, recorded.tk)
                weights = self.scores(layer, rows=(r0, r1), cols=(c0, c1), shift=lse[:, r0:r1]).exp_()  # (H, r, c)
                reduced = reduce_blocks(weights, block, reduce)  # (H, row blocks, key blocks)
                band = r0 // block
                overview[:, band:band + reduced.shape[1], first:first + reduced.shape[2]] = reduced.nan_to_num(0.0)
            if progress is not None:
                progress(r1)
        return overview


def record(query: Tensor, key: Tensor, *, mask=None, causal: bool = False, align: str = "top_left",
           scale: float | None = None, score_mod: ScoreMod | None = None, sinks: Tensor | None = None,
           indices: Tensor | None = None) -> RecordedLayer:
    """One layer's call (the arguments :func:`attnlab.attention` got) as a :class:`RecordedLayer`.

    Shapes:
        query ``(1, H, T, D)``, key ``(1, Hkv, Tk, D)``: one text.

    Raises:
        ValueError: a batch of several texts, top-k ``indices``, or a mask that is not one
            interval of keys per query (:func:`interval_bounds`).

    Example:
        >>> record(torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4), causal=True).bounds[:, 1].tolist()
        [1, 2, 3]
    """
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(f"a view recomputes the weights of one text (batch 1), got a batch of {query.shape[0]}")
    if indices is not None:
        raise ValueError("a layer attending top-k indices has no interval of keys per query: "
                         "show a shorter input to see its weights whole")
    q = query[0].detach().float()  # (H, T, D)
    k = key[0].detach().float()  # (Hkv, Tk, D)
    bounds = interval_bounds(tq=q.shape[1], tk=k.shape[1], mask=mask, causal=causal, align=align)
    if isinstance(sinks, Tensor):
        sinks = sinks.detach().float().reshape(q.shape[0], -1) if sinks.ndim > 1 else sinks.detach().float()
        sinks = sinks.squeeze(-1) if sinks.ndim == 2 and sinks.shape[1] == 1 else sinks
    return RecordedLayer(q, k, bounds, q.shape[-1] ** -0.5 if scale is None else float(scale), score_mod, sinks)


def _span(name: str, span, size: int) -> tuple[int, int]:
    """``span`` as ``(start, end)`` within ``[0, size]``, ``ValueError`` naming ``name`` otherwise."""
    try:
        start, end = (int(x) for x in span)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (start, end) pair of ints, got {span!r}") from None
    if not 0 <= start < end <= size:
        raise ValueError(f"{name} must satisfy 0 <= start < end <= {size}, got {span!r}")
    return start, end


def _key_span(bounds: Tensor) -> tuple[int, int]:
    """The smallest key range holding every row's interval (empty rows ignored)."""
    live = bounds[bounds[:, 1] > bounds[:, 0]]
    return (int(live[:, 0].min()), int(live[:, 1].max())) if len(live) else (0, 0)


def _with_sinks(lse: Tensor, sinks: Tensor | None) -> Tensor:
    """Rows' log-sum-exp ``(H, T)`` with the sink's logit as one more key."""
    if sinks is None:
        return lse
    logits = sinks[:, None] if sinks.ndim == 1 else sinks  # (H, 1) or (H, T)
    return torch.logaddexp(lse, logits.expand_as(lse))


def reduce_blocks(weights: Tensor, block: int, reduce: str) -> Tensor:
    """``(H, r, c)`` weights to ``(H, ceil(r / block), ceil(c / block))``: per block, the sum over
    its keys averaged over its queries (``"mean"``) or its largest weight (``"max"``); a short last
    block counts its real rows and keys only.

    Example:
        >>> reduce_blocks(torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]]]), 2, "mean")
        tensor([[[0.7500, 0.2500],
                 [0.0000, 1.0000]]])
    """
    r, c = weights.shape[1:]
    parts = []
    for rows, height in _spans(r, block):
        pieces = []
        for cols, width in _spans(c, block):
            tiles = weights[:, rows, cols].unflatten(2, (-1, width)).unflatten(1, (-1, height))  # (H, rb, height, cb, width)
            pieces.append(tiles.sum(-1).mean(2) if reduce == "mean" else tiles.amax(-1).amax(2))
        parts.append(torch.cat(pieces, dim=-1))
    return torch.cat(parts, dim=1)


def _spans(size: int, block: int) -> list[tuple[slice, int]]:
    """An axis of ``size`` as its whole blocks and its short last block: ``(slice, block length)`` pairs."""
    whole = size - size % block
    spans = [(slice(0, whole), block)] if whole else []
    return spans + ([(slice(whole, size), size - whole)] if whole < size else [])


def _block_outside(scores: Tensor, bounds: Tensor, c0: int) -> Tensor:
    """``scores`` ``(H, r, c)`` (first key ``c0``) at -inf outside each row's ``[lo, hi)``; only the
    columns some row does not attend are touched."""
    c1 = c0 + scores.shape[-1]
    lo, hi = bounds[:, 0].clamp(c0, c1), bounds[:, 1].clamp(c0, c1)
    start, end = int(lo.max()) if len(lo) else c0, int(hi.min()) if len(hi) else c1
    if end < start:
        start = end = c0  # rows share no column they all attend: every column may be blocked
    for first, last in ((c0, start), (end, c1)):
        if last > first:
            columns = torch.arange(first, last)
            allowed = (columns >= bounds[:, :1]) & (columns < bounds[:, 1:])  # (r, last - first)
            scores[..., first - c0:last - c0].masked_fill_(~allowed, float("-inf"))
    return scores


def _fused_lse(recorded: RecordedLayer) -> Tensor | None:
    """Each row's log-sum-exp from PyTorch's fused CPU kernel, for a layer that is full or causal
    (diagonal at the end) without a score mod; None otherwise."""
    tq, tk = recorded.tq, recorded.tk
    rows = torch.arange(tq)
    full = bool((recorded.bounds[:, 0] == 0).all()) and bool((recorded.bounds[:, 1] == tk).all())
    causal = tq == tk and bool((recorded.bounds[:, 0] == 0).all()) and bool((recorded.bounds[:, 1] == rows + 1).all())
    kernel = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if recorded.score_mod is not None or not (full or causal) or kernel is None or tq == 0:
        return None
    keys = recorded.keys()[None]  # (1, H, Tk, D)
    _, lse = kernel(recorded.q[None], keys, torch.zeros_like(keys), 0.0, causal and not full, attn_mask=None,
                    scale=recorded.scale)[:2]
    return lse[0].float()  # (H, T)


def _weights(scores: Tensor, lse: Tensor) -> Tensor:
    """``exp(scores - lse)``, 0 where a key is blocked or a row has nothing to attend; a row with a
    NaN score is NaN, as :func:`attnlab.attention_weights` gives it."""
    weights = torch.exp(scores - lse)
    empty = torch.isneginf(lse).expand_as(weights)
    return weights.masked_fill(empty | (torch.isneginf(scores) & ~torch.isnan(lse)), 0.0)
