"""The mask patterns: causal, sliding window, padding, varlen causal, prefix-LM, chunked local
and packed documents, each a :class:`~attnlab.masks.mods.MaskMod` made by one function.

Causal alignment when ``Tq != Tk``: ``"top_left"`` (query ``i`` sees keys ``j <= i``, PyTorch's
``is_causal``) or ``"bottom_right"`` (``j <= i + Tk - Tq``: decoding over a KV cache); per
sequence in a padded batch, :func:`varlen_causal_mod` (FlashAttention's varlen rule).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._checks import has_values, int_value, integer_dtype, non_negative_int, one_of, positive_int
from attnlab.masks.evaluation import materialize
from attnlab.masks.mods import MaskMod


ALIGNMENTS = ("top_left", "bottom_right")


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


class CausalMod(MaskMod):
    """Causal mask mod: query ``i`` may attend key ``j`` when ``j <= i + offset``.

    Example:
        >>> mod = CausalMod(offset=0)
        >>> bool(mod(0, 0, torch.tensor(2), torch.tensor(3)))
        False
    """

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

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

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

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

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

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

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

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

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

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

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

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

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

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
