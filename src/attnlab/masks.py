"""Attention masks: dense tensors and mask mods with one polarity, True = may attend.

Two forms describe the same patterns:

* **Dense masks** are tensors that broadcast to ``(B, H, Tq, Tk)``. A bool mask says which key
  positions a query may attend to (True = attend); a float mask is added to the scores (``-inf``
  blocks a position, other values bias it).
* **Mask mods** are callables ``mod(b, h, q_idx, kv_idx) -> bool tensor`` with the same polarity.
  A mod means what it returns for one position, on 0-d index tensors: FlexAttention's rule, so
  a mod written for FlexAttention (attention-gym's, say) runs unchanged; a plain function is
  evaluated through ``torch.vmap`` as FlexAttention does (:func:`apply_mod`). The mods in this
  module also broadcast over whole index grids, which is how they are evaluated (fast), and
  know which key range a block of queries can reach (:meth:`MaskMod.kv_bounds`), which lets
  tiled backends skip whole tiles.

One constructor per pattern and form:

=================  ===========================  ==========================
pattern            dense (bool tensor)          mask mod
=================  ===========================  ==========================
causal             :func:`causal_mask`          :func:`causal_mod`
sliding window     :func:`sliding_window_mask`  :func:`sliding_window_mod`
key padding        :func:`padding_mask`         :func:`padding_mod`
packed documents   (materialize the mod)        :func:`document_mod`
prefix-LM          (materialize the mod)        :func:`prefix_lm_mod`
chunked local      (materialize the mod)        :func:`chunked_local_mod`
varlen causal      (materialize the mod)        :func:`varlen_causal_mod`
combination        :func:`and_masks` / :func:`or_masks` (either form)
=================  ===========================  ==========================

The classes :class:`CausalMod`, :class:`SlidingWindowMod`, :class:`PaddingMod`,
:class:`VarlenCausalMod` and :class:`CombinedMod` are the types those functions return (for
``isinstance`` and reading);
:class:`MaskMod` is the base class for writing a mod that declares its key range.

Causal alignment when ``Tq != Tk``:

* ``"top_left"``: query ``i`` sees keys ``j <= i`` (PyTorch's ``is_causal`` convention).
* ``"bottom_right"``: query ``i`` sees keys ``j <= i + Tk - Tq``; the last query sees every key.
  This is what decoding with a KV cache needs: new queries are the *last* ``Tq`` positions.
* per sequence (:func:`varlen_causal_mod`): in a padded batch whose rows have their own query
  and key lengths, query ``i`` of row ``b`` sees keys ``j <= i + k_lengths[b] - q_lengths[b]``
  (FlashAttention's varlen rule), where ``"bottom_right"`` would shift every row by the padded
  ``Tk - Tq``.

Example:
    >>> from attnlab import masks
    >>> masks.causal_mask(2, 3, align="bottom_right")
    tensor([[ True,  True, False],
            [ True,  True,  True]])
    >>> mod = masks.and_masks(masks.causal_mod(4, 4), masks.sliding_window_mod(4, 4, window=2))
    >>> masks.materialize(mod, tq=4, tk=4).int()
    tensor([[[[1, 0, 0, 0],
              [1, 1, 0, 0],
              [0, 1, 1, 0],
              [0, 0, 1, 1]]]], dtype=torch.int32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

import torch
from torch import Tensor

from attnlab._checks import broadcast_shape, has_values, int_value, integer_dtype, non_negative_int, one_of, positive_int

__all__ = [
    "ALIGNMENTS",
    "MaskMod",
    "causal_mod",
    "sliding_window_mod",
    "padding_mod",
    "DocumentMod",
    "PrefixLMMod",
    "ChunkedLocalMod",
    "document_mod",
    "document_positions",
    "prefix_lm_mod",
    "chunked_local_mod",
    "VarlenCausalMod",
    "varlen_causal_mod",
    "and_masks",
    "or_masks",
    "materialize",
    "evaluate",
    "apply_mod",
    "mod_tensors",
    "value_only_key",
    "has_row_ranges",
    "PreparedMask",
    "prepare",
    "kv_range",
    "causal_mask",
    "sliding_window_mask",
    "padding_mask",
    "causal_offset",
]

ALIGNMENTS = ("top_left", "bottom_right")

MaskLike = Union[Tensor, Callable, None]


def check_align(align: str) -> str:
    """``align`` if it is one of :data:`ALIGNMENTS`; ``ValueError`` otherwise.

    Example:
        >>> check_align("bottom_right")
        'bottom_right'
    """
    return one_of("align", align, ALIGNMENTS)


def causal_offset(tq: int, tk: int, align: str = "top_left") -> int:
    """How far the causal diagonal is shifted: query ``i`` sees keys ``j <= i + offset``.

    Args:
        tq: number of queries.
        tk: number of keys.
        align: ``"top_left"`` (offset 0) or ``"bottom_right"`` (offset ``tk - tq``).

    Returns:
        The offset as an int.

    Example:
        >>> causal_offset(1, 5, "bottom_right")
        4
    """
    non_negative_int("tq", tq)
    non_negative_int("tk", tk)
    check_align(align)
    return 0 if align == "top_left" else tk - tq


def _diagonal(q_idx, kv_idx, offset, window: int | None = None):
    """Query ``i`` may attend key ``j`` when ``j <= i + offset`` (and ``j > i + offset - window``).

    The one causal rule behind :class:`CausalMod`, :class:`SlidingWindowMod` and
    :class:`VarlenCausalMod`; ``offset`` may be a tensor (one per batch row).

    Example:
        >>> _diagonal(torch.tensor(2), torch.arange(4), 1, window=2).tolist()
        [False, False, True, True]
    """
    last = q_idx + offset
    allowed = kv_idx <= last
    return allowed if window is None else allowed & (kv_idx > last - window)


class MaskMod:
    """Base class of attnlab's structured mask mods.

    A subclass implements ``__call__(b, h, q_idx, kv_idx)`` with tensor operations (True = may
    attend) and may implement :meth:`kv_bounds` so that tiled backends can skip key blocks that
    no query in a block can reach. Any plain callable with the same signature is accepted
    wherever a mask mod is; it simply has no bounds.

    A mod means what it returns for one position (0-d indices, FlexAttention's rule). A plain
    callable is therefore evaluated through ``torch.vmap`` (see :func:`apply_mod`); a subclass
    promises, with ``broadcasts = True`` (the default), that its ``__call__`` also gives the
    right values when called once on broadcast index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``,
    ``q_idx (1,1,Tq,1)``, ``kv_idx (1,1,1,Tk)`` -- elementwise operations and indexing a
    captured tensor by the indices do -- and is called that way, the fast path. A subclass
    whose ``__call__`` is written for scalar indices only (``table[image_of[kv_idx]][0]``)
    sets ``broadcasts = False`` and is evaluated like a plain callable.

    Example:
        >>> class EvenKeys(MaskMod):
        ...     def __call__(self, b, h, q_idx, kv_idx):
        ...         return kv_idx % 2 == 0
        >>> materialize(EvenKeys() & CausalMod(), tq=3, tk=3)[0, 0].int()
        tensor([[1, 0, 0],
                [1, 0, 0],
                [1, 0, 1]], dtype=torch.int32)
    """

    broadcasts = True

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def kv_bounds(self, q_start: int, q_end: int) -> tuple[int, int] | None:
        """Half-open key range ``[lo, hi)`` that queries ``q_start..q_end-1`` may reach.

        Returns ``None`` when the mod cannot tell (every key may be reachable).
        """
        return None

    def row_ranges(self, q: Tensor, tk: int) -> tuple | None:
        """The mod as one key interval per query row, and optionally a segment per position.

        Query ``q`` of batch row ``b`` may attend key ``j`` exactly when ``lo[b, q] <= j <=
        hi[b, q]`` and, with segments, ``q_segment[b, q] == k_segment[b, j]``. Every mod attnlab
        defines has this form, and so does an AND of them: it is what :func:`prepare` turns into
        the value the block-sparse and flex paths read (an empty row has ``hi < lo``).

        Args:
            q: ``(1, n)`` int64 query positions (on the CPU when :func:`prepare` asks).
            tk: the number of keys.

        Returns:
            ``(lo, hi, segments)``: ints or int64 tensors broadcasting to ``(B|1, n)``, and None
            or ``(q_segment (B|1, n), k_segment (B|1, tk))``; or None (the default) when the mod
            is not of this form (an OR, a mod of your own).

        Example:
            >>> lo, hi, segments = SlidingWindowMod(2).row_ranges(torch.arange(4).view(1, -1), 4)
            >>> lo.tolist(), hi.tolist(), segments
            ([[-1, 0, 1, 2]], [[0, 1, 2, 3]], None)
        """
        return None

    def check_sizes(self, *, batch: int, heads: int, tq: int, tk: int) -> None:
        """Raise ``ValueError`` naming ``mask`` if the mod cannot serve a call of these sizes.

        attnlab calls this once per call, before any backend evaluates the mod, so that a mod
        that would index out of range fails with a message instead of an ``IndexError`` from
        inside a kernel. The default accepts every size.

        Example:
            >>> PaddingMod(torch.tensor([2, 3])).check_sizes(batch=3, heads=1, tq=4, tk=4)
            Traceback (most recent call last):
            ...
            ValueError: mask: PaddingMod has 2 lengths but the batch has 3 rows
        """

    def value_key(self) -> tuple | None:
        """What identifies this mask by value: the class, its options and ints, and each tensor it
        holds by shape, dtype and device. Dispatch keys a mod by it when it holds no tensor
        (:func:`value_only_key`); nothing compares tensor values.

        None for a class that does not declare ``_keyed = True`` itself: a mod of your own (or a
        subclass of attnlab's) may hold state no key can see, so nothing is reused for it.

        Example:
            >>> SlidingWindowMod(4).value_key() == SlidingWindowMod(4).value_key()
            True
            >>> PaddingMod(torch.tensor([3])).value_key()
            ('PaddingMod', ('lengths', ((1,), torch.int64, device(type='cpu'))))
        """
        if not type(self).__dict__.get("_keyed", False):
            return None
        return (type(self).__name__, *(
            (name, (tuple(value.shape), value.dtype, value.device) if isinstance(value, Tensor) else value)
            for name, value in sorted(vars(self).items()) if not name.startswith("_")))

    def __and__(self, other: Callable) -> "CombinedMod":
        return CombinedMod((self, other), "and")

    def __or__(self, other: Callable) -> "CombinedMod":
        return CombinedMod((self, other), "or")


class CausalMod(MaskMod):
    """Causal mask mod: query ``i`` may attend key ``j`` when ``j <= i + offset``.

    Example:
        >>> mod = CausalMod(offset=0)
        >>> bool(mod(0, 0, torch.tensor(2), torch.tensor(3)))
        False
    """

    _keyed = True  # its public attributes say all it masks by (see MaskMod.value_key)

    def __init__(self, offset: int = 0):
        self.offset = int_value("offset", offset)

    def __call__(self, b, h, q_idx, kv_idx):
        return _diagonal(q_idx, kv_idx, self.offset)

    def kv_bounds(self, q_start, q_end):
        return 0, max(0, q_end - 1 + self.offset + 1)

    def row_ranges(self, q, tk):
        return 0, q + self.offset, None

    def __repr__(self) -> str:
        return f"CausalMod(offset={self.offset})"


class SlidingWindowMod(MaskMod):
    """Causal sliding window: query ``i`` sees the ``window`` keys ending at ``i + offset``.

    Query ``i`` may attend key ``j`` when ``i + offset - window < j <= i + offset``; with
    ``window=1`` each query sees one key.

    Example:
        >>> mod = SlidingWindowMod(window=2)
        >>> [bool(mod(0, 0, torch.tensor(3), torch.tensor(j))) for j in range(4)]
        [False, False, True, True]
    """

    _keyed = True  # its public attributes say all it masks by (see MaskMod.value_key)

    def __init__(self, window: int, offset: int = 0):
        self.window = positive_int("window", window)
        self.offset = int_value("offset", offset)

    def __call__(self, b, h, q_idx, kv_idx):
        return _diagonal(q_idx, kv_idx, self.offset, self.window)

    def kv_bounds(self, q_start, q_end):
        lo = max(0, q_start + self.offset - self.window + 1)
        hi = max(lo, q_end - 1 + self.offset + 1)
        return lo, hi

    def row_ranges(self, q, tk):
        last = q + self.offset
        return last - self.window + 1, last, None

    def __repr__(self) -> str:
        return f"SlidingWindowMod(window={self.window}, offset={self.offset})"


def _lengths_tensor(name: str, lengths: object) -> Tensor:
    """``lengths`` as a 1-D non-negative signed-integer tensor (the caller's own tensor when it
    is one, so that lengths updated in place are seen by the next call).

    Raises:
        TypeError: ``lengths`` is not convertible to a tensor, or its dtype is not a signed
            integer (unsigned lengths wrap around in ``k_len - q_len``).
        ValueError: not 1-D, or a negative entry; the message names ``name`` and shows the
            value.

    Example:
        >>> _lengths_tensor("k_lengths", [2, -1])
        Traceback (most recent call last):
        ...
        ValueError: k_lengths must be non-negative, got [2, -1]
    """
    try:
        lengths = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name} must be a 1-D integer tensor, got {lengths!r}") from err
    integer_dtype(name, lengths)
    if lengths.ndim != 1:
        raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(lengths.shape)}")
    if lengths.numel() and has_values(lengths) and bool((lengths < 0).any()):
        raise ValueError(f"{name} must be non-negative, got {lengths.tolist()}")
    return lengths


def _shown(t: Tensor) -> object:
    """``t``'s values for a message or repr; a meta tensor has only a shape to show."""
    return t.tolist() if has_values(t) else f"<meta {tuple(t.shape)}>"


def _on_device(t: Tensor, like: object) -> Tensor:
    """``t`` on ``like``'s device when ``like`` is a tensor (mods are called with index tensors)."""
    return t.to(like.device) if isinstance(like, Tensor) else t


class PaddingMod(MaskMod):
    """Key padding: in batch row ``b`` only keys ``j < lengths[b]`` are real tokens.

    Example:
        >>> mod = PaddingMod(torch.tensor([1, 3]))
        >>> bool(mod(torch.tensor(0), 0, 0, torch.tensor(2)))
        False
    """

    _keyed = True  # its public attributes say all it masks by (see MaskMod.value_key)

    def __init__(self, lengths: Tensor):
        self.lengths = _lengths_tensor("lengths", lengths)

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < _on_device(self.lengths, kv_idx)[b]

    def row_ranges(self, q, tk):
        return 0, self.lengths.to(q.device, torch.int64).view(-1, 1) - 1, None  # (B, 1)

    def check_sizes(self, *, batch, heads, tq, tk):
        if self.lengths.shape[0] != batch:
            raise ValueError(
                f"mask: PaddingMod has {self.lengths.shape[0]} lengths but the batch has {batch} rows"
            )

    def __repr__(self) -> str:
        return f"PaddingMod(lengths={_shown(self.lengths)})"


class VarlenCausalMod(MaskMod):
    """Causal attention aligned per sequence in a padded batch (FlashAttention's varlen rule).

    Row ``b`` of the batch holds ``q_lengths[b]`` real queries and ``k_lengths[b]`` real keys,
    each right-padded (to ``Tq`` and ``Tk``). Query ``i`` of row ``b`` may attend key ``j`` when

    * ``i < q_lengths[b]`` and ``j < k_lengths[b]`` (both are real tokens), and
    * ``j <= i + k_lengths[b] - q_lengths[b]``: bottom-right causal alignment of the row's own
      lengths, so its last real query sees all its real keys (decoding over a KV cache);
    * with ``window``, also ``j > i + k_lengths[b] - q_lengths[b] - window`` (a causal sliding
      window on the same diagonal).

    Padded query rows (``i >= q_lengths[b]``) attend nothing, so by attnlab's rule their output
    and gradients are zero; so do real queries that precede every key (``k_lengths[b] <
    q_lengths[b]``, the first ``q_lengths[b] - k_lengths[b]`` queries), as in FlashAttention.
    A row with ``q_lengths[b] == 0`` or ``k_lengths[b] == 0`` is all zeros. Pass the mod as
    ``mask`` *without* ``causal=True``: ``causal`` aligns on the padded sizes.

    Args:
        q_lengths: ``(B,)`` integer tensor, real queries per row, ``0 <= q_lengths[b] <= Tq``.
        k_lengths: ``(B,)`` integer tensor, real keys per row, ``0 <= k_lengths[b] <= Tk``.
        window: optional causal sliding window (keys per query, ``>= 1``).

    Raises:
        TypeError: lengths whose dtype is not a signed integer (unsigned lengths would wrap
            around in ``k_lengths[b] - q_lengths[b]``).
        ValueError: lengths that are not 1-D, negative, of different shapes, or a
            window below 1; at call time (:meth:`check_sizes`) lengths that do not match the
            batch or exceed ``Tq`` / ``Tk``.

    Example:
        >>> mod = VarlenCausalMod(torch.tensor([1, 2]), torch.tensor([3, 2]))
        >>> materialize(mod, tq=2, tk=3, batch=2)[:, 0].int()
        tensor([[[1, 1, 1],
                 [0, 0, 0]],
        <BLANKLINE>
                [[1, 0, 0],
                 [1, 1, 0]]], dtype=torch.int32)
    """

    _keyed = True  # its public attributes say all it masks by (see MaskMod.value_key)

    def __init__(self, q_lengths: Tensor, k_lengths: Tensor, *, window: int | None = None):
        self.q_lengths = _lengths_tensor("q_lengths", q_lengths)
        self.k_lengths = _lengths_tensor("k_lengths", k_lengths)
        if self.q_lengths.shape != self.k_lengths.shape:
            raise ValueError(
                f"q_lengths and k_lengths must have one entry per batch row each; got "
                f"q_lengths {_shown(self.q_lengths)} and k_lengths {_shown(self.k_lengths)}"
            )
        self.window = None if window is None else positive_int("window", window)

    def __call__(self, b, h, q_idx, kv_idx):
        q_len = _on_device(self.q_lengths, kv_idx)[b]
        k_len = _on_device(self.k_lengths, kv_idx)[b]
        real = (q_idx < q_len) & (kv_idx < k_len)
        return real & _diagonal(q_idx, kv_idx, k_len - q_len, self.window)

    def kv_bounds(self, q_start, q_end):
        """The union over the batch rows of the keys their real queries in the block reach."""
        if not has_values(self.q_lengths) or not has_values(self.k_lengths):
            return None  # meta lengths: no values to bound by
        q_len, k_len = self.q_lengths.to(torch.int64), self.k_lengths.to(torch.int64)
        live = q_len > q_start  # rows with a real query in q_start..q_end-1
        if not bool(live.any()):
            return 0, 0
        offset = (k_len - q_len)[live]  # (live rows,)
        hi = max(0, int((q_len[live].clamp(max=q_end) + offset).max()))  # last query's diagonal + 1
        lo = 0 if self.window is None else max(0, int((q_start + offset).min()) - self.window + 1)
        return lo, max(lo, hi)

    def row_ranges(self, q, tk):
        q_len, k_len = (t.to(q.device, torch.int64).view(-1, 1) for t in (self.q_lengths, self.k_lengths))
        last = q + k_len - q_len  # (B, n): the row's own bottom-right diagonal
        lo = 0 if self.window is None else last - self.window + 1
        return lo, torch.where(q < q_len, last, -1), None  # padded queries: an empty range

    def check_sizes(self, *, batch, heads, tq, tk):
        for name, lengths, size, what in (("q_lengths", self.q_lengths, tq, "Tq"),
                                          ("k_lengths", self.k_lengths, tk, "Tk")):
            if lengths.shape[0] != batch:
                raise ValueError(f"mask: VarlenCausalMod has {lengths.shape[0]} {name} "
                                 f"{_shown(lengths)} but the batch has {batch} rows")
            if lengths.numel() and has_values(lengths) and int(lengths.max()) > size:
                raise ValueError(f"mask: VarlenCausalMod's {name} {lengths.tolist()} exceed "
                                 f"the call's {what} = {size}")

    def __repr__(self) -> str:
        return (f"VarlenCausalMod(q_lengths={_shown(self.q_lengths)}, "
                f"k_lengths={_shown(self.k_lengths)}, window={self.window})")


class PrefixLMMod(MaskMod):
    """Prefix-LM: every query sees the first ``prefix_len`` keys, and the rest causally.

    Query ``i`` may attend key ``j`` when ``j < prefix_len`` or ``j <= i + offset``.

    Example:
        >>> materialize(PrefixLMMod(2), tq=4, tk=4)[0, 0].int()
        tensor([[1, 1, 0, 0],
                [1, 1, 0, 0],
                [1, 1, 1, 0],
                [1, 1, 1, 1]], dtype=torch.int32)
    """

    _keyed = True  # its public attributes say all it masks by (see MaskMod.value_key)

    def __init__(self, prefix_len: int, offset: int = 0):
        self.prefix_len = non_negative_int("prefix_len", prefix_len)
        self.offset = int_value("offset", offset)

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx < self.prefix_len) | (kv_idx <= q_idx + self.offset)

    def kv_bounds(self, q_start, q_end):
        return 0, max(self.prefix_len, q_end + self.offset)

    def row_ranges(self, q, tk):  # keys < prefix_len, or <= the diagonal: one prefix of the keys
        return 0, torch.clamp(q + self.offset, min=self.prefix_len - 1), None

    def __repr__(self) -> str:
        return f"PrefixLMMod(prefix_len={self.prefix_len}, offset={self.offset})"


class ChunkedLocalMod(MaskMod):
    """Chunked local attention: the sequence is cut into chunks of ``chunk`` positions and a
    query sees only keys of its own chunk (causally when ``causal``), as in Llama 4.

    Query ``i`` sits at position ``p = i + offset``; it may attend key ``j`` when
    ``j // chunk == p // chunk`` (and ``j <= p`` when causal).

    Example:
        >>> materialize(ChunkedLocalMod(2), tq=4, tk=4)[0, 0].int()
        tensor([[1, 0, 0, 0],
                [1, 1, 0, 0],
                [0, 0, 1, 0],
                [0, 0, 1, 1]], dtype=torch.int32)
    """

    _keyed = True  # its public attributes say all it masks by (see MaskMod.value_key)

    def __init__(self, chunk: int, *, causal: bool = True, offset: int = 0):
        self.chunk = positive_int("chunk", chunk)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.causal = causal
        self.offset = int_value("offset", offset)

    def __call__(self, b, h, q_idx, kv_idx):
        pos = q_idx + self.offset
        same = torch.div(kv_idx, self.chunk, rounding_mode="floor") == torch.div(
            pos, self.chunk, rounding_mode="floor")
        return (same & (kv_idx <= pos)) if self.causal else same

    def kv_bounds(self, q_start, q_end):
        first, last = q_start + self.offset, q_end - 1 + self.offset
        lo = (first // self.chunk) * self.chunk
        hi = last + 1 if self.causal else (last // self.chunk + 1) * self.chunk
        return lo, max(lo, hi)

    def row_ranges(self, q, tk):
        pos = q + self.offset
        start = torch.div(pos, self.chunk, rounding_mode="floor") * self.chunk
        return start, pos if self.causal else start + self.chunk - 1, None

    def __repr__(self) -> str:
        return f"ChunkedLocalMod(chunk={self.chunk}, causal={self.causal}, offset={self.offset})"


def _document_rows(document_ids: Tensor) -> Tensor:
    """``document_ids`` checked and made 2-D ``(B|1, T)`` int64 (ids are only compared, so
    unsigned ids are converted, not refused; a bool or float dtype is a ``TypeError``)."""
    ids = integer_dtype("document_ids", torch.as_tensor(document_ids), unsigned=True)
    if ids.ndim not in (1, 2):
        raise ValueError(
            f"document_ids must be a (T,) or (B, T) integer tensor, got shape "
            f"{tuple(ids.shape)} dtype {ids.dtype}"
        )
    return (ids if ids.ndim == 2 else ids[None]).to(torch.int64)  # (B|1, T)


def _occurrence_bounds(ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per position, the first position of its id and one past the last, ``(B|1, T)`` each.

    Computed over occurrences, not runs, so an id that reappears later in the row (a document
    split in two) still gets bounds covering every key it may attend.
    """
    rows, length = ids.shape
    pos = torch.arange(length, device=ids.device)
    first, end = torch.empty_like(ids), torch.empty_like(ids)
    for r in range(rows):
        _, inverse = torch.unique(ids[r], return_inverse=True)
        slots = int(inverse.max()) + 1 if length else 0
        lo = torch.full((slots,), length, dtype=torch.int64, device=ids.device)
        hi = torch.full((slots,), -1, dtype=torch.int64, device=ids.device)
        first[r] = lo.scatter_reduce(0, inverse, pos, "amin")[inverse]
        end[r] = hi.scatter_reduce(0, inverse, pos, "amax")[inverse] + 1
    return first, end


class DocumentMod(MaskMod):
    """Packed documents: a query sees only keys of its own document (causally when ``causal``).

    ``document_ids[b, p]`` names the document position ``p`` of batch row ``b`` belongs to
    (one row ``(T,)`` serves every batch row). Query ``i`` sits at position ``i + offset`` and
    may attend key ``j`` when both hold the same id (and ``j <= i + offset`` when causal).
    :meth:`kv_bounds` spans the documents a query block touches, so tiled backends visit only
    the diagonal blocks of a packed batch.

    Example:
        >>> mod = DocumentMod(torch.tensor([0, 0, 1, 1, 1]))
        >>> materialize(mod, tq=5, tk=5)[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 1, 1, 1]], dtype=torch.int32)
        >>> mod.kv_bounds(3, 5)
        (2, 5)
    """

    _keyed = True  # its public attributes say all it masks by (see MaskMod.value_key)

    def __init__(self, document_ids: Tensor, *, causal: bool = True, offset: int = 0):
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.ids = _document_rows(document_ids)  # (B|1, T)
        self.causal = causal
        self.offset = non_negative_int("offset", offset)
        # (B|1, T) each, read once here as Python lists: kv_bounds then reads no tensor values
        # (dispatch asks it, and dispatch must trace); meta ids have no values to bound by
        bounds = _occurrence_bounds(self.ids) if has_values(self.ids) else None
        self._first, self._end = (bounds[0].tolist(), bounds[1].tolist()) if bounds else (None, None)

    def __call__(self, b, h, q_idx, kv_idx):
        pos = q_idx + self.offset
        ids = _on_device(self.ids, kv_idx)
        if ids.shape[0] == 1:  # one row of ids serves every batch row
            same = ids[0][pos] == ids[0][kv_idx]
        else:
            same = ids[b, pos] == ids[b, kv_idx]
        return (same & (kv_idx <= pos)) if self.causal else same

    def kv_bounds(self, q_start, q_end):
        start = max(0, q_start + self.offset)
        stop = min(self.ids.shape[1], q_end + self.offset)
        if self._first is None:
            return None
        if stop <= start or self.ids.shape[0] == 0:  # no positions, or ids for an empty batch
            return 0, 0
        lo = min(min(row[start:stop]) for row in self._first)
        hi = max(max(row[start:stop]) for row in self._end)
        return lo, max(lo, min(hi, stop) if self.causal else hi)

    def row_ranges(self, q, tk):
        ids = self.ids.to(q.device)  # (B|1, L)
        pos = q[0] + self.offset
        return 0, (q + self.offset) if self.causal else tk - 1, (ids[:, pos], ids[:, :tk])

    def check_sizes(self, *, batch, heads, tq, tk):
        rows, length = self.ids.shape
        if rows not in (1, batch):
            raise ValueError(f"mask: DocumentMod has {rows} rows of document ids but the batch has {batch}")
        if tk > length or tq + self.offset > length:
            raise ValueError(
                f"mask: DocumentMod has document ids for {length} positions but the call has "
                f"{tk} keys and queries at positions {self.offset}..{self.offset + tq - 1}"
            )

    def __repr__(self) -> str:
        return f"DocumentMod(ids of shape {tuple(self.ids.shape)}, causal={self.causal}, offset={self.offset})"


class CombinedMod(MaskMod):
    """Logical AND or OR of several mask mods; the bounds are combined when every part has some.

    Example:
        >>> mod = CombinedMod((CausalMod(), SlidingWindowMod(2)), "and")
        >>> mod.kv_bounds(4, 6)
        (3, 6)
    """

    def __init__(self, mods: tuple[Callable, ...], op: str):
        if op not in ("and", "or"):
            raise ValueError(f"op must be 'and' or 'or', got {op!r}")
        self.mods = tuple(mods)
        self.op = op

    def __call__(self, b, h, q_idx, kv_idx):
        result = apply_mod(self.mods[0], b, h, q_idx, kv_idx)
        for mod in self.mods[1:]:
            other = apply_mod(mod, b, h, q_idx, kv_idx)
            result = (result & other) if self.op == "and" else (result | other)
        return result

    def kv_bounds(self, q_start, q_end):
        bounds = [_bounds_of(mod, q_start, q_end) for mod in self.mods]
        known = [bound for bound in bounds if bound is not None]
        if self.op == "and":
            if not known:
                return None
            lo = max(bound[0] for bound in known)
            return lo, max(lo, min(bound[1] for bound in known))
        if len(known) < len(bounds):
            return None
        return min(bound[0] for bound in known), max(bound[1] for bound in known)

    def row_ranges(self, q, tk):
        """An AND intersects its parts' intervals and pairs their segments; an OR has no form."""
        if self.op != "and":
            return None
        lo, hi, segments = 0, tk - 1, None
        for part in self.mods:
            ranges = part.row_ranges(q, tk) if isinstance(part, MaskMod) else None
            if ranges is None:
                return None
            lo = torch.maximum(torch.as_tensor(lo), torch.as_tensor(ranges[0]))
            hi = torch.minimum(torch.as_tensor(hi), torch.as_tensor(ranges[1]))
            segments = _pair_segments(segments, ranges[2])
        return lo, hi, segments

    def value_key(self) -> tuple | None:
        """The op and its parts' keys; None when any part has none (a plain function, say)."""
        parts = tuple(mod.value_key() if isinstance(mod, MaskMod) else None for mod in self.mods)
        return None if None in parts else ("CombinedMod", self.op, *parts)

    def check_sizes(self, *, batch, heads, tq, tk):
        for mod in self.mods:
            if isinstance(mod, MaskMod):
                mod.check_sizes(batch=batch, heads=heads, tq=tq, tk=tk)

    def __repr__(self) -> str:
        return f"CombinedMod({', '.join(map(repr, self.mods))}, op={self.op!r})"


def _bounds_of(mod: Callable, q_start: int, q_end: int) -> tuple[int, int] | None:
    return mod.kv_bounds(q_start, q_end) if isinstance(mod, MaskMod) else None


def causal_mod(tq: int, tk: int, *, align: str = "top_left") -> CausalMod:
    """Causal mask mod for ``tq`` queries over ``tk`` keys with the given alignment.

    Example:
        >>> causal_mod(1, 4, align="bottom_right")
        CausalMod(offset=3)
    """
    return CausalMod(causal_offset(tq, tk, align))


def sliding_window_mod(tq: int, tk: int, window: int, *, align: str = "top_left") -> SlidingWindowMod:
    """Causal sliding-window mask mod: each query sees its last ``window`` keys.

    Example:
        >>> sliding_window_mod(4, 4, 2)
        SlidingWindowMod(window=2, offset=0)
    """
    return SlidingWindowMod(window, causal_offset(tq, tk, align))


def padding_mod(lengths: Tensor) -> PaddingMod:
    """Key-padding mask mod from per-row lengths (keys ``j < lengths[b]`` are real).

    Example:
        >>> padding_mod(torch.tensor([2, 5]))
        PaddingMod(lengths=[2, 5])
    """
    return PaddingMod(lengths)


def document_mod(document_ids: Tensor, *, causal: bool = True) -> DocumentMod:
    """Mask mod for documents packed into one sequence: attention stays inside each document.

    Args:
        document_ids: ``(T,)`` or ``(B, T)`` integer tensor, the document of each position.
        causal: also block later keys of the same document.

    Example:
        >>> document_mod(torch.tensor([0, 0, 1])).kv_bounds(2, 3)
        (2, 3)
    """
    return DocumentMod(document_ids, causal=causal)


def document_positions(document_ids: Tensor) -> Tensor:
    """Position of each token inside its document, restarting at 0 where the id changes.

    What rotary embeddings need for a packed batch to equal each document run alone.

    Args:
        document_ids: ``(T,)`` or ``(B, T)`` integer tensor.

    Returns:
        int64 tensor ``(B|1, T)``.

    Example:
        >>> document_positions(torch.tensor([3, 3, 3, 7, 7, 3]))
        tensor([[0, 1, 2, 0, 1, 0]])
    """
    ids = _document_rows(document_ids)  # (B|1, T)
    length = ids.shape[1]
    pos = torch.arange(length, device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run_start = torch.where(starts, pos, 0).cummax(dim=1).values  # (B|1, T)
    return pos - run_start


def prefix_lm_mod(tq: int, tk: int, prefix_len: int, *, align: str = "top_left") -> PrefixLMMod:
    """Prefix-LM mask mod: the first ``prefix_len`` keys are seen by all, the rest causally.

    Example:
        >>> prefix_lm_mod(4, 4, 2)
        PrefixLMMod(prefix_len=2, offset=0)
    """
    return PrefixLMMod(prefix_len, causal_offset(tq, tk, align))


def chunked_local_mod(tq: int, tk: int, chunk: int, *, causal: bool = True,
                      align: str = "top_left") -> ChunkedLocalMod:
    """Chunked local mask mod: each query sees only its own ``chunk``-sized block of keys.

    Example:
        >>> chunked_local_mod(8, 8, 4)
        ChunkedLocalMod(chunk=4, causal=True, offset=0)
    """
    return ChunkedLocalMod(chunk, causal=causal, offset=causal_offset(tq, tk, align))


def varlen_causal_mod(q_lengths: Tensor, k_lengths: Tensor, *,
                      window: int | None = None) -> VarlenCausalMod:
    """Causal mask mod aligned on each row's own lengths in a padded batch (varlen).

    Query ``i`` of row ``b`` sees real keys ``j <= i + k_lengths[b] - q_lengths[b]``; padded
    queries and keys take no part (see :class:`VarlenCausalMod`). What decoding a right-padded
    batch over a KV cache needs, where ``align="bottom_right"`` would align on ``Tk - Tq``.

    Args:
        q_lengths: ``(B,)`` integer tensor of real query counts.
        k_lengths: ``(B,)`` integer tensor of real key counts.
        window: optional causal sliding window on the same per-row diagonal.

    Example:
        >>> import attnlab
        >>> q, k = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 5, 8)   # (B, H, T, D), padded
        >>> mod = varlen_causal_mod(torch.tensor([1, 3]), torch.tensor([4, 5]))
        >>> out = attnlab.attention(q, k, k, mask=mod)
        >>> solo = attnlab.attention(q[:1, :, :1], k[:1, :, :4], k[:1, :, :4],
        ...                          causal=True, align="bottom_right")
        >>> bool(torch.allclose(out[:1, :, :1], solo, atol=1e-6)), bool(out[0, :, 1:].eq(0).all())
        (True, True)
    """
    return VarlenCausalMod(q_lengths, k_lengths, window=window)


def mod_tensors(mod: Callable) -> tuple[Tensor, ...]:
    """Every tensor one of attnlab's mask mods holds (through and/or), in a fixed order.

    What a cache keyed on a mod's parameters must compare on a hit: a tensor written through
    numpy or ``.data`` keeps its ``_version``, so only its values tell that the mask changed.

    Example:
        >>> mod = and_masks(padding_mod(torch.tensor([3, 5])), sliding_window_mod(6, 6, 2))
        >>> [t.tolist() for t in mod_tensors(mod)]
        [[3, 5]]
    """
    if type(mod) is CombinedMod:
        return tuple(t for part in mod.mods for t in mod_tensors(part))
    return tuple(value for _, value in sorted(vars(mod).items()) if isinstance(value, Tensor))


def value_only_key(mod: object) -> tuple | None:
    """:meth:`MaskMod.value_key` of a mod that holds no tensor (causal, windows, prefixes,
    chunks and ANDs/ORs of them): all it masks by is in the key, so two such mods with equal
    keys are the same mask. None for any other mask (tensors inside, or no key).

    Example:
        >>> value_only_key(sliding_window_mod(8, 8, 2)) == value_only_key(SlidingWindowMod(2))
        True
        >>> value_only_key(padding_mod(torch.tensor([3]))) is None
        True
    """
    key = mod.value_key() if isinstance(mod, MaskMod) else None
    return key if key is not None and not mod_tensors(mod) else None


def has_row_ranges(mod: object) -> bool:
    """Whether ``mod`` is one of attnlab's mods, a :class:`PreparedMask` or an AND of them:
    the mods :meth:`MaskMod.row_ranges` describes (exact classes: a subclass may override
    ``__call__``). Reads no tensor value.

    Example:
        >>> has_row_ranges(causal_mod(4, 4) & sliding_window_mod(4, 4, 2))
        True
        >>> has_row_ranges(causal_mod(4, 4) | sliding_window_mod(4, 4, 2))
        False
    """
    if type(mod) is CombinedMod:
        return mod.op == "and" and all(has_row_ranges(part) for part in mod.mods)
    return type(mod) is PreparedMask or bool(type(mod).__dict__.get("_keyed", False))


def _pair_segments(first, second):
    """One segment id per position for two (q, k) segmentings: equal ids = equal in both."""
    if first is None or second is None:
        return second if first is None else first
    rows = max(first[0].shape[0], second[0].shape[0])
    q_pairs, k_pairs = (torch.stack(torch.broadcast_tensors(a, b), dim=-1).expand(rows, -1, 2)
                        for a, b in zip(first, second))  # (B, T, 2)
    _, ids = torch.unique(torch.cat([q_pairs, k_pairs], dim=1).reshape(-1, 2), dim=0, return_inverse=True)
    ids = ids.view(rows, -1)  # (B, Tq + Tk)
    return ids[:, : q_pairs.shape[1]], ids[:, q_pairs.shape[1]:]


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
    """A mask mod turned, once, into the value the block-sparse and flex paths read: per query
    row one key interval ``[lo, hi]`` and a segment per position (see :meth:`MaskMod.row_ranges`).

    Made by :func:`prepare` for one ``(Tq, Tk)``, as FlexAttention's ``create_block_mask`` makes
    a ``BlockMask``: pass it as ``mask`` to every call of that shape, and what a backend derives
    from it (the blocks' plan, flex's block mask) is computed on the first call and kept on the
    value itself (:attr:`memo`), not in a process-wide cache. It is a snapshot: editing the
    tensors of the mod it came from afterwards does not change it. It reads no tensor value
    when asked for bounds (they are Python lists made here), so dispatch may ask.

    Shapes:
        lo, hi, q_segment: ``(R, Tq)`` int64; k_segment: ``(R, Tk)`` int64; ``R`` is 1 (one
        row serves every batch row) or the batch.

    Example:
        >>> prepared = prepare(sliding_window_mod(6, 6, 2), tq=6, tk=6)
        >>> prepared.kv_bounds(4, 6), bool(torch.equal(
        ...     materialize(prepared, tq=6, tk=6), materialize(SlidingWindowMod(2), tq=6, tk=6)))
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
    """Turn one of attnlab's mask mods (or an AND of them) into a :class:`PreparedMask` for
    calls of ``tq`` queries over ``tk`` keys: the per-row key intervals, and segments, that the
    block-sparse and flex backends read.

    Pass the result as ``mask`` to :func:`attnlab.attention` for every call of that shape: the
    backends then derive their plans from it once. A mod that holds no tensor (causal, windows,
    prefixes, chunks) needs no preparing -- dispatch prepares it once per shape by itself; a
    mod with tensors (padding, varlen lengths, document ids) prepared once per batch saves the
    planning each call otherwise repeats. A :class:`PreparedMask` of this shape is returned as is.

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


class _IndexWithTensors(torch.overrides.TorchFunctionMode):
    """``x[i]`` with integer or tensor indices becomes ``aten.index``, as FlexAttention does.

    Python indexing turns a 0-d index tensor into a Python int (``.item()``), which ``vmap``
    refuses; ``aten.index`` keeps it a tensor, so ``intervals[image_of[kv_idx]]`` maps. This is
    the rule of torch's ``TransformGetItemToIndex``, which ``create_mask`` runs mods under,
    written here because that class is private.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is Tensor.__getitem__:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if all(isinstance(i, (Tensor, int)) and not isinstance(i, bool) for i in index):
                device = args[0].device
                return torch.ops.aten.index(args[0], [
                    i if isinstance(i, Tensor) else torch.tensor(i, device=device) for i in index])
        return func(*args, **(kwargs or {}))


class _NotOneValue(ValueError):
    """A mod returned more than one value for one position: no evaluation can make it a mask."""


def _scalar_call(mod: Callable) -> Callable:
    """``mod`` called on 0-d indices; what vmap maps. One value per position, or an error."""

    def call(*indices):
        allowed = mod(*(i.reshape(()) if isinstance(i, Tensor) and i.dim() else i for i in indices))
        if isinstance(allowed, Tensor) and allowed.numel() != 1:
            raise _NotOneValue(f"returned shape {tuple(allowed.shape)} for one position")
        return allowed.reshape(()) if isinstance(allowed, Tensor) else allowed

    return call


def _mod_indices_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The broadcast shape of a mask mod's index tensors (ValueError when they do not broadcast)."""
    shape = broadcast_shape(shapes)
    if shape is None:
        raise ValueError(f"mask mod indices of shapes {shapes} do not broadcast")
    return shape


def _vmapped(mod: Callable, indices: tuple) -> Tensor:
    """``mod`` on each position of the broadcast index tensors, through nested ``torch.vmap``.

    FlexAttention's ``create_mask`` nests one vmap per axis of ``(b, h, q_idx, kv_idx)``; here
    an axis is mapped only where some index varies along it, and each index tensor only along
    the axes where it is longer than 1, so the result keeps size 1 (or a stride-0 axis, cut
    back to size 1) where the mod ignores an axis, and no full index grid is ever built.
    """
    tensors = [i for i in indices if isinstance(i, Tensor)]
    shape = _mod_indices_shape([tuple(t.shape) for t in tensors])
    padded = [i.view((1,) * (len(shape) - i.dim()) + tuple(i.shape)) if isinstance(i, Tensor) else i
              for i in indices]
    if 0 in shape:
        return torch.zeros(shape, dtype=torch.bool, device=tensors[0].device)
    axes = [axis for axis, size in enumerate(shape) if size > 1]
    fn = _scalar_call(mod)
    for axis in reversed(axes):  # the last wrapped vmap is the outermost: axes[0]
        in_dims = tuple(
            axis - sum(1 for a in axes if a < axis and i.shape[a] > 1)  # axes outer levels took
            if isinstance(i, Tensor) and i.shape[axis] > 1 else None for i in padded)
        fn = torch.vmap(fn, in_dims=in_dims)
    with _IndexWithTensors():
        allowed = fn(*padded)
    allowed = allowed.reshape(shape)
    for axis in axes:
        if allowed.stride(axis) == 0:  # the mod ignores this axis: vmap expanded it
            allowed = allowed.narrow(axis, 0, 1)
    return allowed


def _on_grid(mod: Callable, indices: tuple) -> Tensor:
    """``mod`` called once on the index tensors; its result must broadcast to their shape."""
    allowed = mod(*indices)
    shape = _mod_indices_shape([tuple(i.shape) for i in indices if isinstance(i, Tensor)])
    got = tuple(torch.as_tensor(allowed).shape)
    if len(got) > len(shape) or broadcast_shape([got, shape]) != shape:
        raise ValueError(f"returned shape {got} for index tensors of shape {shape}")
    return allowed


def _unevaluable(subject: str, kind: str, scalar_err: BaseException, grid_err: BaseException) -> TypeError:
    """The one error for a user's mod that fails both on 0-d indices under vmap and on index grids
    (mask mods here, score mods in :mod:`attnlab.scores`)."""
    return TypeError(
        f"{subject} cannot be evaluated. attnlab evaluates {kind} as FlexAttention does, once per "
        f"position on 0-d index tensors under torch.vmap, where {_first_line(scalar_err)}; called on "
        f"whole index tensors instead, {_first_line(grid_err)}. Write it with tensor operations on the "
        "indices (torch.where for choices; no .item(), int(), bool() or Python if/while on index values)")


def _first_line(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0].split(". ")[0]  # vmap's text goes on
    return f"{type(err).__name__}: {first}"


def apply_mod(mod: Callable, b, h, q_idx, kv_idx) -> Tensor:
    """A mask mod at every position of broadcast index tensors, by FlexAttention's semantics.

    A mask mod's meaning is what it returns for one position: ``mod(b, h, q_idx, kv_idx)`` on
    0-d index tensors (FlexAttention's rule; it maps mods with ``torch.vmap``). So a plain
    callable is evaluated through ``torch.vmap`` over the axes its indices vary along: a mod
    written for FlexAttention (``intervals[image_of[kv_idx]]``) and an elementwise one
    (``kv_idx <= q_idx``) both give the right mask. A :class:`MaskMod` whose ``broadcasts`` is
    True (attnlab's own) is called on the index tensors directly, the fast path. A callable
    that vmap refuses (``.numpy()``, data-dependent shapes) is called on the index tensors
    directly, which is what such code can only mean; one that fails both ways raises.

    Args:
        mod: a mask mod ``(b, h, q_idx, kv_idx) -> bool``.
        b, h, q_idx, kv_idx: ints or index tensors that broadcast together.

    Returns:
        The mod's values, broadcastable to the indices' broadcast shape (size 1 along an axis
        the mod ignores).

    Raises:
        TypeError: the mod can be evaluated neither way; the message names ``mask``, the mod
            and both errors. An error the mod raises the same way both times (its own
            ``raise``) propagates as it is.

    Example:
        >>> intervals = torch.tensor([[0, 2], [2, 4]])     # image i is seen by queries [lo, hi)
        >>> image_of = torch.tensor([0, 0, 1])              # image of each key (attention-gym)
        >>> def flamingo(b, h, q_idx, kv_idx):
        ...     interval = intervals[image_of[kv_idx]]
        ...     return (q_idx >= interval[0]) & (q_idx < interval[1])
        >>> apply_mod(flamingo, 0, 0, torch.arange(4)[:, None], torch.arange(3)).int()
        tensor([[1, 1, 0],
                [1, 1, 0],
                [0, 0, 1],
                [0, 0, 1]], dtype=torch.int32)
    """
    indices = (b, h, q_idx, kv_idx)
    if getattr(mod, "broadcasts", False) or all(
            not isinstance(i, Tensor) or i.dim() == 0 for i in indices):  # one position: call it
        return mod(*indices)
    name = getattr(mod, "__qualname__", None) or repr(mod)
    try:
        return _vmapped(mod, indices)
    except _NotOneValue as err:
        raise TypeError(f"mask: the mask mod {name} {err} (b, h, q_idx, kv_idx); a mask mod "
                        f"returns one bool per position, as in FlexAttention") from None
    except Exception as scalar_err:  # noqa: BLE001 -- any failure under vmap: try the grid
        try:
            return _on_grid(mod, indices)
        except Exception as grid_err:  # noqa: BLE001
            if _first_line(grid_err) == _first_line(scalar_err):
                raise  # the mod's own error, whichever way it is called: the user's to see
            raise _unevaluable(f"mask: the mask mod {name}", "a mask mod", scalar_err, grid_err) from scalar_err


def evaluate(
    mod: Callable,
    *,
    q_range: tuple[int, int],
    kv_range: tuple[int, int],
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluate a mask mod on the index grid ``q_range x kv_range`` (one tile or the whole matrix).

    Each position gets the value the mod gives it on 0-d indices (see :func:`apply_mod`).

    Args:
        mod: a mask mod ``(b, h, q_idx, kv_idx) -> bool``.
        q_range, kv_range: ``(start, end)`` query and key indices (end excluded).
        batch, heads: sizes of the batch and head axes to evaluate.
        device: where to build the index tensors.

    Returns:
        Bool tensor broadcastable to ``(batch, heads, q_end - q_start, kv_end - kv_start)``
        (axes the mod ignores stay size 1), True = may attend.

    Example:
        >>> evaluate(CausalMod(0), q_range=(2, 4), kv_range=(0, 4)).int()
        tensor([[[[1, 1, 1, 0],
                  [1, 1, 1, 1]]]], dtype=torch.int32)
    """
    (qs, qe), (ks, ke) = q_range, kv_range
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    q_idx = torch.arange(qs, qe, device=device).view(1, 1, qe - qs, 1)
    kv_idx = torch.arange(ks, ke, device=device).view(1, 1, 1, ke - ks)
    allowed = torch.as_tensor(apply_mod(mod, b, h, q_idx, kv_idx), device=device)
    if allowed.dtype != torch.bool:
        raise TypeError(f"mask mod {mod!r} must return a bool tensor, got dtype {allowed.dtype}")
    return allowed


def materialize(
    mod: Callable,
    *,
    tq: int,
    tk: int,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluate a mask mod on every index and return a dense bool mask.

    Args:
        mod: a mask mod ``(b, h, q_idx, kv_idx) -> bool``.
        tq, tk: numbers of queries and keys.
        batch, heads: sizes of the batch and head axes to evaluate.
        device: where to build the index tensors.

    Returns:
        Bool tensor of shape ``(batch, heads, tq, tk)`` (a broadcast view where the mod
        ignores an axis), True = may attend.

    Example:
        >>> materialize(causal_mod(2, 2), tq=2, tk=2).shape
        torch.Size([1, 1, 2, 2])
    """
    if not callable(mod):
        raise TypeError(f"mod must be a mask mod (b, h, q_idx, kv_idx) -> bool, got {mod!r}")
    for name, size in (("tq", tq), ("tk", tk), ("batch", batch), ("heads", heads)):
        non_negative_int(name, size)
    allowed = evaluate(mod, q_range=(0, tq), kv_range=(0, tk), batch=batch, heads=heads, device=device)
    return allowed.expand(batch, heads, tq, tk)


def kv_range(mod: Callable | None, q_start: int, q_end: int, tk: int) -> tuple[int, int]:
    """The keys ``[lo, hi)`` that queries ``q_start..q_end-1`` may reach, clipped to ``[0, tk)``.

    All keys unless ``mod`` is a :class:`MaskMod` that declares :meth:`MaskMod.kv_bounds`.

    Example:
        >>> kv_range(CausalMod(0), 4, 8, 16)
        (0, 8)
        >>> kv_range(None, 4, 8, 16)
        (0, 16)
    """
    bounds = _bounds_of(mod, q_start, q_end) if mod is not None else None
    if bounds is None:
        return 0, tk
    lo = min(tk, max(0, bounds[0]))
    return lo, max(lo, min(tk, bounds[1]))


def causal_mask(tq: int, tk: int | None = None, *, align: str = "top_left", device=None) -> Tensor:
    """Dense causal mask ``(tq, tk)``, True = may attend.

    Example:
        >>> causal_mask(3).int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    tk = tq if tk is None else tk
    return materialize(causal_mod(tq, tk, align=align), tq=tq, tk=tk, device=device)[0, 0]


def sliding_window_mask(
    tq: int, tk: int, window: int, *, align: str = "top_left", device=None
) -> Tensor:
    """Dense causal sliding-window mask ``(tq, tk)``: each query sees its last ``window`` keys.

    Example:
        >>> sliding_window_mask(3, 3, 2).int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [0, 1, 1]], dtype=torch.int32)
    """
    mod = sliding_window_mod(tq, tk, window, align=align)
    return materialize(mod, tq=tq, tk=tk, device=device)[0, 0]


def padding_mask(lengths: Tensor, max_len: int | None = None) -> Tensor:
    """Dense key-padding mask of shape ``(B, 1, 1, max_len)`` for ``(B, H, T, D)`` inputs.

    Position ``j`` of batch row ``b`` is True (may be attended) when ``j < lengths[b]``.
    For 3-D inputs ``(B, T, D)`` take ``mask[:, 0]``, shape ``(B, 1, max_len)``.

    Args:
        lengths: 1-D integer tensor ``(B,)`` of real sequence lengths (non-negative).
        max_len: padded length; defaults to ``lengths.max()``. Required when ``lengths`` is
            empty (a batch of 0 rows gives a mask of shape ``(0, 1, 1, max_len)``).

    Raises:
        TypeError: ``lengths`` is not a tensor of a signed integer dtype.
        ValueError: ``lengths`` is not 1-D, has a negative entry, or is empty (or on the meta
            device) without ``max_len``; ``max_len`` is not a non-negative int.

    Example:
        >>> padding_mask(torch.tensor([1, 3]), 3)[:, 0, 0]
        tensor([[ True, False, False],
                [ True,  True,  True]])
    """
    mod = PaddingMod(lengths)
    if max_len is None:
        if mod.lengths.numel() == 0 or not has_values(mod.lengths):
            raise ValueError(
                f"padding_mask cannot infer max_len from {'empty' if has_values(mod.lengths) else 'meta'} "
                f"lengths of shape {tuple(mod.lengths.shape)}; pass max_len"
            )
        max_len = int(mod.lengths.max())
    non_negative_int("max_len", max_len)
    dense = materialize(mod, tq=1, tk=max_len, batch=len(mod.lengths), device=mod.lengths.device)
    return dense.contiguous()  # (B, 1, 1, Tk)


def _as_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as an additive bias (0 where allowed, -inf elsewhere); float masks cast."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def and_masks(*masks: MaskLike) -> MaskLike:
    """Combine masks so that a position may be attended only if every mask allows it.

    All dense tensors: bool masks are ANDed; if any is a float mask the result is a float mask
    (bool masks become 0 / ``-inf`` and the biases add). All callables: a :class:`CombinedMod`.
    ``None`` entries are skipped. Mixing tensors and mask mods is a ``TypeError``: materialize
    the mod first.

    Example:
        >>> and_masks(causal_mask(2), torch.tensor([[True, True], [False, True]])).int()
        tensor([[1, 0],
                [0, 1]], dtype=torch.int32)
    """
    return _combine(masks, "and")


def or_masks(*masks: MaskLike) -> MaskLike:
    """Combine bool masks or mask mods: a position may be attended if any mask allows it.

    Example:
        >>> or_masks(causal_mask(2), torch.tensor([[False, True], [False, False]])).int()
        tensor([[1, 1],
                [1, 1]], dtype=torch.int32)
    """
    return _combine(masks, "or")


def _combine(masks: tuple[MaskLike, ...], op: str) -> MaskLike:
    parts = [mask for mask in masks if mask is not None]
    if not parts:
        return None
    if all(callable(mask) and not isinstance(mask, Tensor) for mask in parts):
        return parts[0] if len(parts) == 1 else CombinedMod(tuple(parts), op)
    if not all(isinstance(mask, Tensor) for mask in parts):
        raise TypeError(
            "masks to combine must be all tensors or all mask mods; materialize() a mod to mix"
        )
    try:
        torch.broadcast_shapes(*(mask.shape for mask in parts))
    except RuntimeError:
        shapes = ", ".join(str(tuple(mask.shape)) for mask in parts)
        raise ValueError(f"masks to combine must broadcast together; got shapes {shapes}") from None
    if all(mask.dtype == torch.bool for mask in parts):
        result = parts[0]
        for mask in parts[1:]:
            result = (result & mask) if op == "and" else (result | mask)
        return result
    if op == "or":
        raise TypeError("or_masks combines bool masks or mask mods only, not float masks")
    dtype = next(mask.dtype for mask in parts if mask.dtype != torch.bool)
    result = _as_additive(parts[0], dtype)
    for mask in parts[1:]:
        result = result + _as_additive(mask, dtype)
    return result
