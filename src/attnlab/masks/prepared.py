"""A mask mod prepared once per shape: :func:`prepare` and the :class:`PreparedMask` it returns.

As FlexAttention's ``create_block_mask`` makes a ``BlockMask``: a caller who repeats a call
holds the prepared value, and backends keep what they derive from it on the value itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnlab._checks import has_values, non_negative_int
from attnlab.masks.mods import CombinedMod, MaskMod
from attnlab.masks.patterns import _on_device


def has_row_ranges(mod: object) -> bool:
    """Whether ``mod`` is one of attnlab's mods, a :class:`PreparedMask` or an AND of them:
    the mods :meth:`MaskMod.row_ranges` describes (exact classes: a subclass may override
    ``__call__``). Reads no tensor value.

    Example:
        >>> from attnlab.masks import causal_mod, sliding_window_mod
        >>> has_row_ranges(causal_mod(4, 4) & sliding_window_mod(4, 4, 2))
        True
        >>> has_row_ranges(causal_mod(4, 4) | sliding_window_mod(4, 4, 2))
        False
    """
    if type(mod) is CombinedMod:
        return mod.op == "and" and all(has_row_ranges(part) for part in mod.mods)
    return type(mod) is PreparedMask or bool(type(mod).__dict__.get("_keyed", False))


def _segment_extents(q_segment: Tensor, k_segment: Tensor) -> tuple[Tensor, Tensor]:
    """Per query, the first and last key of its segment (``tk`` and -1 when none), ``(R, Tq)``."""
    tq, tk = q_segment.shape[1], k_segment.shape[1]
    first = torch.empty_like(q_segment)
    last = torch.empty_like(q_segment)
    keys = torch.arange(tk)
    for r in range(q_segment.shape[0]):
        _, inverse = torch.unique(torch.cat([q_segment[r], k_segment[r]]), return_inverse=True)
        slots = int(inverse.max()) + 1 if inverse.numel() else 0
        q_slot, k_slot = inverse[:tq], inverse[tq:]
        first[r] = torch.full((slots,), tk).scatter_reduce(0, k_slot, keys, "amin")[q_slot]
        last[r] = torch.full((slots,), -1).scatter_reduce(0, k_slot, keys, "amax")[q_slot]
    return first, last


class PreparedMask(MaskMod):
    """The type :func:`prepare` returns: a mask as one key interval ``[lo, hi]`` per query row
    and a segment per position (:meth:`MaskMod.row_ranges`), for one ``(Tq, Tk)``.

    What backends derive from it (the blocks' plan, flex's block mask) is kept on the value
    (:attr:`memo`), not in a process-wide cache. A snapshot: editing the source mod's tensors
    later does not change it. Its bounds are Python lists, so dispatch may ask without reading
    a tensor.

    Shapes:
        lo, hi, q_segment: ``(R, Tq)`` int64; k_segment: ``(R, Tk)`` int64; ``R`` is 1 (one
        row serves every batch row) or the batch.

    Example:
        >>> from attnlab.masks import materialize, sliding_window_mod
        >>> prepared = prepare(sliding_window_mod(6, 6, 2), tq=6, tk=6)
        >>> prepared.kv_bounds(4, 6), bool(torch.equal(
        ...     materialize(prepared, tq=6, tk=6), materialize(sliding_window_mod(6, 6, 2), tq=6, tk=6)))
        ((3, 6), True)
    """

    def __init__(self, lo: Tensor, hi: Tensor, q_segment: Tensor, k_segment: Tensor, *, source: str = "",
                 bounds: tuple[list, list] | None = None):
        self.lo, self.hi, self.q_segment, self.k_segment = lo, hi, q_segment, k_segment
        self.tq, self.tk, self.source = lo.shape[1], k_segment.shape[1], source
        # per query, the lowest and one past the highest key any row reaches (read once, here)
        self._kv_lo, self._kv_hi = bounds if bounds is not None else self._bounds(lo, hi, self.tk)
        self.memo: dict = {}  # what backends derive from this value, per call shape (bounded)

    @staticmethod
    def _bounds(lo: Tensor, hi: Tensor, tk: int) -> tuple[list, list] | None:
        """Python lists of the per-query key bounds over the rows; None for meta tensors."""
        if not has_values(lo):
            return None, None
        if lo.shape[0] == 0:
            return [], []
        cpu_lo, cpu_hi = lo.cpu(), hi.cpu()
        live = cpu_hi >= cpu_lo  # (R, Tq)
        return (torch.where(live, cpu_lo, tk).amin(dim=0).tolist(),
                torch.where(live, cpu_hi + 1, 0).amax(dim=0).tolist())

    def __call__(self, b, h, q_idx, kv_idx):
        b = b if self.lo.shape[0] > 1 else 0
        lo, hi = _on_device(self.lo, kv_idx)[b, q_idx], _on_device(self.hi, kv_idx)[b, q_idx]
        same = _on_device(self.q_segment, kv_idx)[b, q_idx] == _on_device(self.k_segment, kv_idx)[b, kv_idx]
        return (kv_idx >= lo) & (kv_idx <= hi) & same

    def kv_bounds(self, q_start, q_end):
        if self._kv_lo is None:
            return None  # meta tensors: no values to bound by
        lo, hi = min(self._kv_lo[q_start:q_end], default=0), max(self._kv_hi[q_start:q_end], default=0)
        return (lo, hi) if hi > lo else (0, 0)

    def row_ranges(self, q, tk):
        rows = q[0].to(self.lo.device)
        return (self.lo[:, rows].to(q.device), self.hi[:, rows].to(q.device),
                (self.q_segment[:, rows].to(q.device), self.k_segment[:, :tk].to(q.device)))

    def check_sizes(self, *, batch, heads, tq, tk):
        if (tq, tk) != (self.tq, self.tk):
            raise ValueError(f"mask: this PreparedMask was prepared for Tq={self.tq}, Tk={self.tk} "
                             f"but the call has Tq={tq}, Tk={tk}; prepare one per shape")
        if self.lo.shape[0] not in (1, batch):
            raise ValueError(f"mask: this PreparedMask has {self.lo.shape[0]} batch rows but the "
                             f"batch has {batch}")

    def remember(self, key: tuple, make: Callable[[], object]) -> object:
        """``memo[key]``, made by ``make()`` on the first ask; at most 8 entries (the oldest go).

        Thread-safety: two threads asking at once may both make it; the later one is kept.

        Example:
            >>> from attnlab.masks import causal_mod
            >>> prepared = prepare(causal_mod(2, 2), tq=2, tk=2)
            >>> prepared.remember(("x",), lambda: 1), prepared.remember(("x",), lambda: 2)
            (1, 1)
        """
        if key not in self.memo:
            value = make()
            while len(self.memo) >= 8:
                self.memo.pop(next(iter(self.memo)), None)
            self.memo[key] = value
        return self.memo[key]

    def rows(self, batch: int) -> "PreparedMask":
        """This mask with exactly ``batch`` rows of contiguous tensors (what flex's compiled
        kernel indexes by ``b``), remembered.

        Example:
            >>> from attnlab.masks import causal_mod
            >>> prepare(causal_mod(2, 2), tq=2, tk=2).rows(3).lo.shape
            torch.Size([3, 2])
        """
        if self.lo.shape[0] == batch:
            return self
        return self.remember(("rows", batch), lambda: PreparedMask(*(
            t.expand(batch, -1).contiguous() for t in (self.lo, self.hi, self.q_segment, self.k_segment)),
            source=self.source, bounds=(self._kv_lo, self._kv_hi)))

    def __repr__(self) -> str:
        return f"PreparedMask({self.source}, Tq={self.tq}, Tk={self.tk}, rows={self.lo.shape[0]})"


def prepare(mask: Callable, *, tq: int, tk: int, batch: int = 1,
            device: torch.device | str | None = None) -> PreparedMask:
    """One of attnlab's mask mods (or an AND of them) prepared for calls of ``tq`` queries over
    ``tk`` keys, as FlexAttention's ``create_block_mask`` makes a ``BlockMask``.

    Pass the result as ``mask`` to every call of that shape: the block-sparse and flex
    backends then plan from it once. Worth it for a mod holding tensors (padding, varlen,
    documents), prepared once per batch; a mod without tensors is prepared by dispatch itself.
    A :class:`PreparedMask` of this shape is returned as is.

    Args:
        mask: an attnlab mask mod, an AND of them, or a :class:`PreparedMask`.
        tq, tk: numbers of queries and keys of the calls it will serve.
        batch: batch rows of those calls (the mod's tensors must match it, as at call time).
        device: where the tensors go (the calls' device); default CPU.

    Raises:
        ValueError: a mod with no interval form (an OR, a mod of your own: pass it as it is),
            or sizes the mod cannot serve; each names the argument.

    Example:
        >>> import attnlab
        >>> from attnlab.masks import document_mod
        >>> ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
        >>> prepared = prepare(document_mod(ids), tq=8, tk=8)
        >>> q = torch.randn(1, 2, 8, 4)
        >>> bool(torch.allclose(attnlab.attention(q, q, q, mask=prepared),
        ...                     attnlab.attention(q, q, q, mask=document_mod(ids)), atol=1e-6))
        True
    """
    for name, size in (("tq", tq), ("tk", tk), ("batch", batch)):
        non_negative_int(name, size)
    if isinstance(mask, MaskMod):
        mask.check_sizes(batch=batch, heads=1, tq=tq, tk=tk)
    if type(mask) is PreparedMask:
        return mask
    if not has_row_ranges(mask):
        raise ValueError(f"mask: prepare takes attnlab's mask mods and ANDs of them (one key interval "
                         f"per query row), got {mask!r}; pass that mask to attention as it is")
    lo, hi, segments = mask.row_ranges(torch.arange(tq).view(1, -1), tk)  # on the CPU
    rows = max(torch.as_tensor(t).dim() and torch.as_tensor(t).shape[0]
               for t in (lo, hi, *(segments or ()))) or 1
    lo, hi = (torch.as_tensor(t, dtype=torch.int64).expand(rows, tq).clamp(-1, tk) for t in (lo, hi))
    if segments is None:
        q_segment, k_segment = torch.zeros(rows, tq, dtype=torch.int64), torch.zeros(rows, tk, dtype=torch.int64)
    else:
        q_segment, k_segment = (s.to(torch.int64).expand(rows, n) for s, n in zip(segments, (tq, tk)))
        first, last = _segment_extents(q_segment, k_segment)  # tighten the intervals to the segments
        lo, hi = torch.maximum(lo, first), torch.minimum(hi, last)
    lo, hi = lo.clamp(min=0), hi.clamp(max=tk - 1)
    bounds = PreparedMask._bounds(lo, hi, tk)  # on the CPU, whatever the device it goes to
    return PreparedMask(*(t.contiguous().to(device) for t in (lo, hi, q_segment, k_segment)), source=repr(mask),
                        bounds=bounds)
