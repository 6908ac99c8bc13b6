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
    """The type :func:`causal_mod` returns (query ``i`` at position ``i + offset``).

    Example:
        >>> isinstance(causal_mod(2, 2), CausalMod)
        True
    """

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

    def __init__(self, offset: int = 0):
        self.offset = int_value("offset", offset)

    def __call__(self, b, h, q_idx, kv_idx):
        return _diagonal(q_idx, kv_idx, self.offset)

    def kv_bounds(self, q_start, q_end):
        return 0, max(0, q_end - 1 + self.offset + 1)

    def form(self):
        return ("causal", self.offset) if type(self) is CausalMod else ("mod",)

    def row_ranges(self, q, tk):
        return 0, q + self.offset, None

    def __repr__(self) -> str:
        return f"CausalMod(offset={self.offset})"


def causal_mod(tq: int, tk: int, *, align: str = "top_left") -> CausalMod:
    """Causal mask mod: query ``i`` may attend key ``j <= i + offset``, the offset set by ``align``.

    Example:
        >>> causal_mod(1, 4, align="bottom_right")
        CausalMod(offset=3)
    """
    return CausalMod(causal_offset(tq, tk, align))


class SlidingWindowMod(MaskMod):
    """The type :func:`sliding_window_mod` returns (query ``i`` at position ``i + offset``).

    Example:
        >>> isinstance(sliding_window_mod(4, 4, 2), SlidingWindowMod)
        True
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


def sliding_window_mod(tq: int, tk: int, window: int, *, align: str = "top_left") -> SlidingWindowMod:
    """Causal sliding window: query ``i`` sees the ``window`` keys ending at ``i + offset``.

    Example:
        >>> from attnlab.masks import materialize
        >>> materialize(sliding_window_mod(4, 4, 2), tq=4, tk=4)[0, 0].int()
        tensor([[1, 0, 0, 0],
                [1, 1, 0, 0],
                [0, 1, 1, 0],
                [0, 0, 1, 1]], dtype=torch.int32)
    """
    return SlidingWindowMod(window, causal_offset(tq, tk, align))


class PrefixLMMod(MaskMod):
    """The type :func:`prefix_lm_mod` returns (query ``i`` at position ``i + offset``).

    Example:
        >>> isinstance(prefix_lm_mod(4, 4, 2), PrefixLMMod)
        True
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


def prefix_lm_mod(tq: int, tk: int, prefix_len: int, *, align: str = "top_left") -> PrefixLMMod:
    """Prefix-LM: every query sees the first ``prefix_len`` keys, and the rest causally.

    Example:
        >>> from attnlab.masks import materialize
        >>> materialize(prefix_lm_mod(4, 4, 2), tq=4, tk=4)[0, 0].int()
        tensor([[1, 1, 0, 0],
                [1, 1, 0, 0],
                [1, 1, 1, 0],
                [1, 1, 1, 1]], dtype=torch.int32)
    """
    return PrefixLMMod(prefix_len, causal_offset(tq, tk, align))


class ChunkedLocalMod(MaskMod):
    """The type :func:`chunked_local_mod` returns (query ``i`` at position ``i + offset``).

    Example:
        >>> isinstance(chunked_local_mod(4, 4, 2), ChunkedLocalMod)
        True
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


def chunked_local_mod(tq: int, tk: int, chunk: int, *, causal: bool = True,
                      align: str = "top_left") -> ChunkedLocalMod:
    """Chunked local attention (Llama 4): a query sees only keys of its own ``chunk``-sized
    block, causally when ``causal``.

    Example:
        >>> from attnlab.masks import materialize
        >>> materialize(chunked_local_mod(4, 4, 2), tq=4, tk=4)[0, 0].int()
        tensor([[1, 0, 0, 0],
                [1, 1, 0, 0],
                [0, 0, 1, 0],
                [0, 0, 1, 1]], dtype=torch.int32)
    """
    return ChunkedLocalMod(chunk, causal=causal, offset=causal_offset(tq, tk, align))


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
    """The type :func:`padding_mod` returns.

    Example:
        >>> isinstance(padding_mod(torch.tensor([1, 3])), PaddingMod)
        True
    """

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

    def __init__(self, lengths: Tensor):
        self.lengths = _lengths_tensor("lengths", lengths)

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < _on_device(self.lengths, kv_idx)[b]

    def form(self):
        return ("padding", self.lengths, False) if type(self) is PaddingMod else ("mod",)

    def row_ranges(self, q, tk):
        return 0, self.lengths.to(q.device, torch.int64).view(-1, 1) - 1, None  # (B, 1)

    def check_sizes(self, *, batch, heads, tq, tk):
        if self.lengths.shape[0] != batch:
            raise ValueError(
                f"mask: PaddingMod has {self.lengths.shape[0]} lengths but the batch has {batch} rows"
            )

    def __repr__(self) -> str:
        return f"PaddingMod(lengths={_shown(self.lengths)})"


def padding_mod(lengths: Tensor) -> PaddingMod:
    """Key padding: in batch row ``b`` only keys ``j < lengths[b]`` are real tokens.

    Args:
        lengths: ``(B,)`` non-negative signed integer tensor (read at each call, so lengths
            updated in place are seen).

    Example:
        >>> padding_mod(torch.tensor([2, 5]))
        PaddingMod(lengths=[2, 5])
    """
    return PaddingMod(lengths)


class VarlenCausalMod(MaskMod):
    """The type :func:`varlen_causal_mod` returns.

    Example:
        >>> mod = varlen_causal_mod(torch.tensor([1, 2]), torch.tensor([3, 2]))
        >>> isinstance(mod, VarlenCausalMod), mod.window
        (True, None)
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

    def form(self):
        if type(self) is VarlenCausalMod and self.window is None:
            return ("varlen", self.q_lengths, self.k_lengths)
        return ("mod",)

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


def varlen_causal_mod(q_lengths: Tensor, k_lengths: Tensor, *,
                      window: int | None = None) -> VarlenCausalMod:
    """Causal attention aligned on each row's own lengths in a padded batch (FlashAttention's varlen).

    Row ``b`` holds ``q_lengths[b]`` real queries and ``k_lengths[b]`` real keys, right-padded.
    Query ``i`` may attend key ``j`` when both are real and ``j <= i + k_lengths[b] -
    q_lengths[b]`` (and, with ``window``, ``j`` is among the ``window`` keys ending there): the
    row's last real query sees all its real keys, as decoding a padded batch over a KV cache
    needs (``align="bottom_right"`` would align every row on the padded ``Tk - Tq``). Padded
    queries, and real ones before every key, attend nothing: zero output and gradient. Pass it
    as ``mask`` without ``causal=True``.

    Args:
        q_lengths: ``(B,)`` signed integer tensor, ``0 <= q_lengths[b] <= Tq``.
        k_lengths: ``(B,)`` signed integer tensor, ``0 <= k_lengths[b] <= Tk``.
        window: optional causal sliding window, ``>= 1``.

    Raises:
        TypeError: an unsigned or non-integer dtype (``k - q`` would wrap around).
        ValueError: lengths not 1-D, negative or of different shapes, a window below 1; at
            call time, lengths that do not match the batch or exceed ``Tq`` / ``Tk``.

    Example:
        >>> mod = varlen_causal_mod(torch.tensor([1, 2]), torch.tensor([3, 2]))
        >>> from attnlab.masks import materialize
        >>> materialize(mod, tq=2, tk=3, batch=2)[:, 0].int()
        tensor([[[1, 1, 1],
                 [0, 0, 0]],
        <BLANKLINE>
                [[1, 0, 0],
                 [1, 1, 0]]], dtype=torch.int32)
    """
    return VarlenCausalMod(q_lengths, k_lengths, window=window)


def _document_rows(document_ids: Tensor) -> Tensor:
    """``document_ids`` checked and made 2-D ``(B|1, T)`` int64 (ids are only compared, so
    unsigned ids are converted, not refused; a bool or float dtype is a ``TypeError``)."""
    if not isinstance(document_ids, (Tensor, list, tuple)):
        raise TypeError(f"document_ids must be an integer tensor (T,) or (B, T), got {type(document_ids).__name__}")
    ids = integer_dtype("document_ids", torch.as_tensor(document_ids), unsigned=True)
    if ids.ndim not in (1, 2):
        raise ValueError(
            f"document_ids must be a (T,) or (B, T) integer tensor, got shape "
            f"{tuple(ids.shape)} dtype {ids.dtype}"
        )
    return ids if ids.ndim == 2 else ids[None]  # (B|1, T), a view: an in-place edit reaches it


def _occurrence_bounds(ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per position, the first position of its id and one past the last, ``(B|1, T)`` each.

    Computed over occurrences, not runs, so an id that reappears later in the row (a document
    split in two) still gets bounds covering every key it may attend.
    """
    rows, length = ids.shape
    pos = torch.arange(length, device=ids.device)
    first = torch.empty(rows, length, dtype=torch.int64, device=ids.device)
    end = torch.empty_like(first)
    for r in range(rows):
        _, inverse = torch.unique(ids[r], return_inverse=True)
        slots = int(inverse.max()) + 1 if length else 0
        lo = torch.full((slots,), length, dtype=torch.int64, device=ids.device)
        hi = torch.full((slots,), -1, dtype=torch.int64, device=ids.device)
        first[r] = lo.scatter_reduce(0, inverse, pos, "amin")[inverse]
        end[r] = hi.scatter_reduce(0, inverse, pos, "amax")[inverse] + 1
    return first, end


class DocumentMod(MaskMod):
    """The type :func:`document_mod` returns (query ``i`` at position ``i + offset``).

    Example:
        >>> isinstance(document_mod(torch.tensor([0, 1])), DocumentMod)
        True
    """

    _keyed = True  # attnlab's own: see value_only_key and has_row_ranges

    def __init__(self, document_ids: Tensor, *, causal: bool = True, offset: int = 0):
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.ids = _document_rows(document_ids)  # (B|1, T), the caller's tensor (a view of it)
        self.causal = causal
        self.offset = non_negative_int("offset", offset)
        self._seen: int | None = None  # the ids' version the bounds below were read at
        self._first: list | None = None
        self._end: list | None = None
        self._occurrences()

    def _occurrences(self) -> tuple[list | None, list | None]:
        """Per position, the first occurrence of its id and one past the last, ``(B|1, T)``
        Python lists (None for meta ids), read again whenever the ids were edited in place
        (``Tensor._version``): one integer compared per call, so kv_bounds reads no tensor
        value (dispatch asks it, and dispatch must trace) and is never stale. While tracing,
        the bounds read before are kept (the backends that skip by them decline then)."""
        if not has_values(self.ids) or torch.compiler.is_compiling():
            return self._first, self._end
        version = self.ids._version
        if version != self._seen:
            first, end = _occurrence_bounds(self.ids)
            self._first, self._end, self._seen = first.tolist(), end.tolist(), version
        return self._first, self._end

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
        first, end = self._occurrences()
        if first is None:
            return None
        if stop <= start or self.ids.shape[0] == 0:  # no positions, or ids for an empty batch
            return 0, 0
        lo = min(min(row[start:stop]) for row in first)
        hi = max(max(row[start:stop]) for row in end)
        return lo, max(lo, min(hi, stop) if self.causal else hi)

    def row_ranges(self, q, tk):
        ids = self.ids.to(q.device, torch.int64)  # (B|1, L)
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


def document_mod(document_ids: Tensor, *, causal: bool = True) -> DocumentMod:
    """Packed documents: a query sees only keys of its own document (causally when ``causal``).

    Its key bounds span the documents a query block touches, so tiled backends visit only the
    diagonal blocks of a packed batch.

    Args:
        document_ids: ``(T,)`` or ``(B, T)`` integer tensor, the document of each position
            (one row serves every batch row).
        causal: also block later keys of the same document.

    Example:
        >>> mod = document_mod(torch.tensor([0, 0, 1, 1, 1]))
        >>> from attnlab.masks import materialize
        >>> materialize(mod, tq=5, tk=5)[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 1, 1, 1]], dtype=torch.int32)
        >>> mod.kv_bounds(3, 5)
        (2, 5)
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
