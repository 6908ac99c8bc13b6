"""The ``blocks`` backend: masked attention at the fused dense kernel's speed.

For a mask mod that declares :meth:`~attnlab.masks.MaskMod.kv_bounds` (causal, windows,
documents, prefix-LM, chunked-local, ANDs of them), queries are cut into blocks of 32 to 256
(:func:`choose_block`) and each block attends only the keys it can reach, on PyTorch's fused
CPU flash kernel. A block's keys become pieces: a fully visible run, a causal diagonal (the
kernel's ``is_causal``) or a partly visible part (a small additive mask). Consecutive blocks
whose rows see keys from one start to the diagonal (a document, a chunk) become one causal
square. Pieces of one shape run as one kernel call over strided views stacked along the batch
axis ``(n, B*Hq, bq, D)`` (8 equal documents: one call), and a row's pieces merge by their
log-sum-exp (:mod:`attnlab.backends._lse`). The backward pass is the kernel's own, once per
call. The work is the visited tiles, not ``Tq * Tk``.

The contract (docs/contract.md) is kept exactly, or the call is declined: empty rows are zeros
with zero gradient, keys outside a block's span are never read, NaN query rows stay NaN,
grouped-query heads use the kernel's grouping (nothing repeated), ``Dv != D`` is zero-padded,
the scale is folded into q as :func:`attnlab._math.kernel_scales` says, an additive score mod
enters each run's mask (its gradient from ``dS``), and sinks fold in after the merge. Dropout,
dense masks, bounds-less mods and non-additive score mods are declined.

Example:
    >>> import torch, attnlab
    >>> from attnlab import masks
    >>> q = torch.randn(1, 2, 300, 16)
    >>> mod = masks.sliding_window_mod(300, 300, window=32)
    >>> out = attnlab.attention(q, q, q, mask=mod, backend="blocks")
    >>> ref = attnlab.attention(q, q, q, mask=mod, backend="reference")
    >>> bool(torch.allclose(out, ref, atol=1e-5))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import masks as _masks
from attnlab._call import AttentionCall
from attnlab._math import kernel_scales, keep_nan_rows, score_dtype
from attnlab.backends._lse import fold_sinks, kernel_function, merge_, row_delta, score_gradient_, sinks_gradient
from attnlab.backends.base import AttentionResult, Backend, MemoryUse, memory_of_class
from attnlab.backends.rates import RATES
from attnlab.backends.registry import register
from attnlab.backends.sdpa import kernel_keeps_rows
from attnlab.backends.transforms import outside_transforms
from attnlab.masks.spans import block_spans
from attnlab.scores import ScoreMod, additive_term, sink_logits

__all__ = ["BlocksBackend", "blocks_attention", "blocks_gradients", "block_spans", "choose_block", "visited_fraction",
           "BLOCK_SIZES"]

# Queries per block that the cost model chooses from (:func:`choose_block`): smaller blocks
# visit fewer masked-out keys, larger ones run the kernel faster.
BLOCK_SIZES = (32, 64, 128, 256)

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def visited_fraction(call: AttentionCall, *, block: int | None = None) -> float:
    """Share of the ``Tq x Tk`` score matrix the backend computes for ``call`` (1.0 = all).

    Args:
        call: the call.
        block: queries per block; None: the one :func:`choose_block` picks.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 512, 4)
        >>> visited_fraction(build_call(q, q, q, causal=True), block=256)
        0.75
    """
    if call.tq == 0 or call.tk == 0:
        return 0.0
    spans = block_spans(call.mask_mod(), call.tq, call.tk, block or choose_block(call))
    return sum((qe - qs) * (hi - lo) for qs, qe, lo, hi in spans) / (call.tq * call.tk)


@dataclass(frozen=True)
class _Piece:
    """One query block's keys ``[ks, ke)`` and which of them each row sees.

    allowed: ``(B|1, Hq|1, qe-qs, ke-ks)`` bool, or None when every query sees every key.
    """

    qs: int
    qe: int
    ks: int
    ke: int
    allowed: Tensor | None
    causal: bool = False

    def signature(self) -> tuple:
        """Pieces with equal signatures can share one kernel call: same sizes, same mask."""
        if self.allowed is None:
            pattern = "causal" if self.causal else None
        else:
            pattern = (tuple(self.allowed.shape), self.allowed.contiguous().numpy().tobytes())
        return self.qe - self.qs, self.ke - self.ks, pattern


@dataclass(frozen=True)
class _Run:
    """``n`` same-signature pieces run as ONE kernel call, stacked along the batch axis.

    Piece ``i`` is queries ``[qs + i*q_step, +bq)`` against keys ``[ks + i*k_step, +keys)``;
    both are strided views of q/k/v, so nothing is copied (:func:`_blocks`).

    mask: additive 0/-inf ``(1, B*Hq|1, bq, keys)`` shared by the n pieces, or None.
    causal: the kernel's own causal masking (``keys == bq``): no mask tensor to build.
    dead: ``(1, B*Hq|1, bq)`` rows that see no key of the piece, or None: run all-visible,
        dropped from the merge, their output gradient zeroed.
    first: no earlier run wrote these query blocks, so the merge is a copy.
    """

    qs: int
    q_step: int
    bq: int
    ks: int
    k_step: int
    keys: int
    n: int
    mask: Tensor | None
    causal: bool
    dead: Tensor | None
    first: bool

    def query_blocks(self, t: Tensor) -> Tensor:
        """The run's query blocks of ``t`` ``(B, Hq, Tq, *X)``: a view ``(n, B*Hq, bq, *X)``."""
        return _blocks(t, self.qs, self.q_step, self.n, self.bq)

    def key_blocks(self, t: Tensor) -> Tensor:
        """The run's key spans of ``t`` ``(B, Hkv, Tk, X)``: a view ``(n, B*Hkv, keys, X)``
        whose spans may overlap (read only)."""
        return _blocks(t, self.ks, self.k_step, self.n, self.keys)


def _rows(t: Tensor, call: AttentionCall) -> Tensor:
    """A ``(B|1, Hq|1, bq, X)`` mask-like tensor in the kernel's row layout ``(1, B*Hq|1, bq, X)``."""
    if t.shape[0] == 1 and t.shape[1] == 1:
        return t
    return t.expand(call.batch, call.q_heads, *t.shape[2:]).reshape(1, call.batch * call.q_heads,
                                                                    *t.shape[2:])  # (1, B*Hq, bq, X)


# A run of at least this many keys that every query of a block sees is given its own, unmasked
# piece: a masked score costs the kernel little more than an unmasked one, while a split adds a
# kernel call and an lse merge.
_MIN_FULL_RUN = 1024


def _longest_run(full: Tensor) -> tuple[int, int]:
    """The longest run ``[a, b)`` of True in a 1-D bool tensor (``(0, 0)`` when there is none)."""
    edges = torch.diff(F.pad(full.to(torch.int8), (1, 1)))  # +1 where a run starts, -1 one past its end
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    if starts.numel() == 0:
        return 0, 0
    longest = int(torch.argmax(ends - starts))
    return int(starts[longest]), int(ends[longest])


def _causal_tail(allowed: Tensor) -> int | None:
    """Where the last ``bq`` key columns start if they are exactly causal for the block's rows
    (column ``c`` of them seen by row ``r`` iff ``c <= r``, for every batch row and head)."""
    bq, span = allowed.shape[-2:]
    if span < bq:
        return None
    tril = torch.ones(bq, bq, dtype=torch.bool, device=allowed.device).tril()
    return span - bq if bool((allowed[..., span - bq:] == tril).all()) else None


def _split(qs: int, qe: int, lo: int, allowed: Tensor) -> list[_Piece]:
    """Keys ``lo + [0, span)`` of a block: the longest run every query sees (unmasked, when at
    least ``_MIN_FULL_RUN`` keys) and the masked rest, key columns no query sees dropped at the
    edges. ``allowed``: ``(B|1, Hq|1, bq, span)``."""
    span = allowed.shape[-1]
    rows = allowed.flatten(0, 2)  # (B|1 * Hq|1 * bq, span)
    seen_by_all, seen = rows.all(dim=0), rows.any(dim=0)  # (span,) each
    if span and bool(seen_by_all.all()):
        return [_Piece(qs, qe, lo, lo + span, None)]
    a, b = _longest_run(seen_by_all)
    whole = b - a < _MIN_FULL_RUN
    pieces = [] if whole else [_Piece(qs, qe, lo + a, lo + b, None)]
    for start, stop in ((0, span),) if whole else ((0, a), (b, span)):
        cols = seen[start:stop].nonzero().flatten()  # the part's key columns some query sees
        if cols.numel():
            first, last = start + int(cols[0]), start + int(cols[-1]) + 1
            pieces.append(_Piece(qs, qe, lo + first, lo + last, allowed[..., first:last]))
    return pieces


def _tile_pieces(call: AttentionCall, mod: Callable, span: tuple[int, int, int, int]) -> list[_Piece]:
    """One query block's pieces. A block whose keys are a fully visible run followed by a causal
    diagonal (causal, documents, chunks) runs without any mask tensor: the run unmasked, the
    diagonal with the kernel's own causal masking. Otherwise see :func:`_split`. Empty when the
    block attends nothing.
    """
    qs, qe, lo, hi = span
    if hi <= lo:
        return []
    allowed = _masks.evaluate(mod, q_range=(qs, qe), kv_range=(lo, hi), batch=call.batch,
                              heads=call.q_heads, device=call.device)  # (B|1, Hq|1, bq|1, span|1)
    allowed = allowed.expand(*allowed.shape[:2], qe - qs, hi - lo)  # (B|1, Hq|1, bq, span)
    tail = None if bool(allowed.all()) else _causal_tail(allowed)
    if tail is None or not bool(allowed[..., :tail].all()):  # a split that leaves a mask only adds a call
        return _split(qs, qe, lo, allowed)
    return [_Piece(qs, qe, lo + tail, hi, None, causal=True), *_split(qs, qe, lo, allowed[..., :tail])]


def _staircase(block: list[_Piece]) -> tuple[int, int] | None:
    """``(s, d)`` for a block whose row ``q`` sees exactly keys ``[s, q + d]``: its pieces are a
    causal diagonal (keys shifted by ``d``) after a fully visible run ``[s, qs + d)``, or the
    diagonal alone (``s = qs + d``); else None."""
    diagonal = [p for p in block if p.causal]
    rest = [p for p in block if not p.causal]
    if len(diagonal) != 1 or len(rest) > 1:
        return None
    d = diagonal[0].ks - diagonal[0].qs
    if rest and (rest[0].allowed is not None or rest[0].ke != diagonal[0].ks):
        return None
    return (rest[0].ks if rest else diagonal[0].ks), d


def _causal_squares(pieces: list[_Piece]) -> list[_Piece]:
    """Consecutive query blocks ``[a, b)`` whose rows all see keys ``[s, q + d]`` (a document, a
    chunk, the first rows of a window, the rows after a prefix) become at most two pieces: one
    causal square of queries ``[a, b)`` over keys ``[a + d, b + d)`` (the kernel's own causal
    masking) and, when ``s < a + d``, one fully visible run ``[s, a + d)`` for all their rows.
    A few long kernel calls instead of one per block: the kernel is faster on long query blocks,
    and nothing is merged between blocks. ``pieces``: block by block in query order
    (:func:`_tile_pieces`).
    """
    by_block: dict[tuple[int, int], list[_Piece]] = {}
    for piece in pieces:
        by_block.setdefault((piece.qs, piece.qe), []).append(piece)
    out: list[_Piece] = []
    stair = None  # ((s, d), first query a, end query b) of the staircase being grown
    for (qs, qe), block in [*by_block.items(), ((-1, -1), [])]:
        shape = _staircase(block) if block else None
        if stair is not None and shape == stair[0] and qs == stair[2]:
            stair = (shape, stair[1], qe)
            continue
        if stair is not None:
            (s, d), a, b = stair
            out += [_Piece(a, b, s, a + d, None)] if s < a + d else []
            out.append(_Piece(a, b, a + d, b + d, None, causal=True))
        stair = (shape, qs, qe) if shape is not None else None
        if stair is None:
            out += block
    return out


def _progressions(pieces: list[_Piece]) -> list[list[_Piece]]:
    """Split same-signature pieces (sorted by position) into runs with constant query and key
    steps, queries never overlapping and keys never stepping back: each run is a strided view
    of q, k and v."""
    runs: list[list[_Piece]] = []
    for piece in sorted(pieces, key=lambda p: (p.qs, p.ks)):
        run = runs[-1] if runs else None
        step = None if run is None else (piece.qs - run[-1].qs, piece.ks - run[-1].ks)
        if run is not None and step[0] >= piece.qe - piece.qs and step[1] >= 0 \
                and (len(run) == 1 or step == (run[1].qs - run[0].qs, run[1].ks - run[0].ks)):
            run.append(piece)
        else:
            runs.append([piece])
    return runs


def _mask_of(call: AttentionCall, allowed: Tensor | None) -> tuple:
    """The additive mask and dead rows of a piece (see :class:`_Run`), in the row layout."""
    if allowed is None:
        return None, None
    alive = allowed.any(dim=-1, keepdim=True)  # (B|1, Hq|1, bq, 1)
    dead = None if bool(alive.all()) else ~alive
    visible = allowed if dead is None else allowed | dead  # dead rows: a harmless full row
    bias = torch.zeros(visible.shape, dtype=call.dtype, device=call.device).masked_fill_(~visible, float("-inf"))
    return _rows(bias, call), None if dead is None else _rows(dead, call)[..., 0]


def _plan_runs(call: AttentionCall, mod: Callable, spans: list) -> tuple:
    """Every query block's pieces, grouped by signature into as few kernel calls as possible."""
    groups: dict[tuple, list[_Piece]] = {}
    for piece in _causal_squares([p for span in spans for p in _tile_pieces(call, mod, span)]):
        groups.setdefault(piece.signature(), []).append(piece)
    runs, written = [], set()
    for (bq, keys, pattern), pieces in groups.items():
        mask, dead = _mask_of(call, pieces[0].allowed)
        for run in _progressions(pieces):
            q_step = run[1].qs - run[0].qs if len(run) > 1 else bq
            k_step = run[1].ks - run[0].ks if len(run) > 1 else keys
            starts = {p.qs for p in run}
            runs.append(_Run(run[0].qs, q_step, bq, run[0].ks, k_step, keys, len(run), mask,
                             pattern == "causal", dead, first=not (starts & written)))
            written |= starts
    return tuple(runs)


def _planned_runs(call: AttentionCall, mod: Callable, block: int | None) -> tuple:
    """:func:`_plan_runs` for ``call`` in blocks of ``block`` (None: :func:`choose_block`).

    Planning reads every visited mask entry (a few ms at T=8192), so a plan is kept on a
    :class:`~attnlab.masks.PreparedMask` (its ``memo``), per call shape: dispatch prepares a mod
    that holds no tensor once per route, and a caller prepares padding, lengths or document ids
    once per batch (:func:`attnlab.masks.prepare`). Any other mod is planned on every call, so
    an in-place edit of its tensors is always seen.
    """
    def plan() -> tuple:
        with outside_transforms():  # the mask's and the sizes' plan: a constant to torch.func
            return _plan_runs(call, mod, block_spans(mod, call.tq, call.tk, block or choose_block(call)))

    if type(mod) is not _masks.PreparedMask:
        return plan()
    key = ("blocks", call.tq, call.tk, call.batch, call.q_heads, call.kv_heads, call.head_dim,
           call.value_dim, block, block is None and call.requires_grad, call.dtype, call.device)
    return mod.remember(key, plan)


class _DenseMod(_masks.MaskMod):
    """A call's bool mask ``(B|1, H|1, Tq|1, Tk|1)`` as a mask mod, so that blocks plans from
    it as from a mod without bounds (every key block reachable)."""

    def __init__(self, allowed: Tensor):
        self.allowed = allowed

    def __call__(self, b, h, q_idx, kv_idx):
        index = (i if size > 1 else i * 0 for i, size in zip((b, h, q_idx, kv_idx), self.allowed.shape))
        return self.allowed[tuple(index)]


def _planned_mod(call: AttentionCall) -> Callable:
    """The call's whole mask as one mask mod for planning: its mask mod (with causal), a bool
    mask ANDed in, and every key (``CausalMod(Tk)``) when nothing is masked."""
    mod = call.mask_mod()
    if call.mask_kind == "bool":
        dense = _DenseMod(call.mask)
        return dense if mod is None else _masks.and_masks(mod, dense)
    return _masks.CausalMod(call.tk) if mod is None else mod


def _merged_stride(t: Tensor) -> int | None:
    """The one stride that steps through the batch and head axes of ``(B, H, ...)`` ``t`` as
    a single axis ``b*H + h``, or None when there is none.

    ``is_contiguous()`` does not give ``stride(0) == H * stride(1)``: it ignores the strides of
    size-1 dims, so keys projected to ``(B, T, 1, D)`` and transposed to ``(B, 1, T, D)`` are
    "contiguous" with ``stride(1) == D``. With one head the batch stride is the step, with one
    batch element the head stride is, else the two must chain.
    """
    (B, H), (s0, s1) = t.shape[:2], t.stride()[:2]
    if H == 1:
        return s0
    if B == 1 or s0 == H * s1:
        return s1
    return None


def _blocks(t: Tensor, start: int, step: int, n: int, length: int) -> Tensor:
    """``n`` row blocks of a ``(B, H, T, *X)`` tensor as one view ``(n, B*H, length, *X)``.

    ``t`` must have a merged batch-head stride (:func:`_merged_stride`; :func:`_kernel_layout`
    makes sure). Block ``i`` is rows ``[start + i*step, +length)``; blocks may overlap (keys of
    a sliding window), in which case the view must only be read.
    """
    s, merged = t.stride(), _merged_stride(t)
    if merged is None:
        raise RuntimeError(f"blocks: no merged batch-head stride for shape {tuple(t.shape)} stride {s}")
    return t.as_strided((n, t.shape[0] * t.shape[1], length, *t.shape[3:]),
                        (step * s[2], merged, s[2], *s[3:]), t.storage_offset() + start * s[2])


def _add_blocks(dst: Tensor, src: Tensor, start: int, step: int) -> None:
    """``dst`` rows of block ``i`` += ``src[i]`` (the inverse of :func:`_blocks`), overlaps summed.

    ``dst``: ``(B, H, T, X)`` in the standard contiguous layout; ``src``: ``(n, B*H, length, X)``.
    """
    n, length = src.shape[0], src.shape[2]
    if n == 1 or step >= length:
        _blocks(dst, start, step, n, length).add_(src)
    elif step == 0:
        _blocks(dst, start, step, 1, length).add_(src.sum(dim=0, keepdim=True))
    else:  # overlapping blocks: add them in step-long slices, each a view without overlaps
        for offset in range(0, length, step):
            width = min(step, length - offset)
            _blocks(dst, start + offset, step, n, width).add_(src[:, :, offset:offset + width])


def _kernel_layout(t: Tensor) -> Tensor:
    """``t`` itself when the kernel can read its blocks as views, else a contiguous copy.

    Any layout whose batch and head axes merge (:func:`_merged_stride`) and whose last dim is
    dense is read in place, whatever its other strides and offset (the transposed
    ``(B, T, H, D)`` layout with one head or one batch element, expanded batch-1 keys with one
    head, sliced heads of one batch element). The fused kernel misreads a last dim with a
    stride other than 1, so such a tensor is copied, as is one whose axes do not merge.
    """
    if t.stride(-1) == 1 and _merged_stride(t) is not None:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _widened(t: Tensor, width: int) -> Tensor:
    """``t`` with zero columns appended up to ``width`` (the kernel needs ``Dv == D``); exact."""
    return F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t


def _kernel_inputs(plan: _Plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the kernel reads them: one head size, a layout it reads (:func:`_kernel_layout`),
    and q times the scale when the plan folds it. Forward and backward both derive them from the
    Function's inputs (``torch.func`` hands the Function unwrapped tensors, never the call's)."""
    width = max(q.shape[-1], v.shape[-1])
    q, k, v = (_kernel_layout(_widened(t, width)) for t in (q, k, v))
    return (q * plan.factor if plan.factor != 1.0 else q), k, v


@dataclass(frozen=True)
class _Plan:
    """What the autograd function needs besides the tensors.

    factor, kernel_scale: the kernel gets ``q * factor`` and ``kernel_scale`` (see
    :func:`attnlab._math.kernel_scales`; factor 1: q as it is).
    """

    call: AttentionCall
    runs: tuple
    factor: float = 1.0
    kernel_scale: float = 1.0


def _init(t: Tensor, runs: tuple, *, fill: float) -> Tensor:
    """Fill an empty accumulator ``(B, H, Tq, ...)`` with ``fill`` unless the runs that write
    their query blocks first cover every row (then every value is written before it is read)."""
    if sum(run.n * run.bq for run in runs if run.first) < t.shape[2]:
        t.fill_(fill)
    return t


def _run_views(run: _Run, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The run's query blocks ``(n, B*Hq, bq, W)`` and key/value spans ``(n, B*Hkv, keys, W)``."""
    return run.query_blocks(q), run.key_blocks(k), run.key_blocks(v)


def _flash(views: tuple, *, causal: bool, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """The kernel on a run's q ``(n, B*Hq, bq, W)``, k and v ``(n, B*Hkv, keys, W)``: out
    ``(n, B*Hq, bq, W)`` and lse ``(n, B*Hq, bq)``.

    Without grouped heads the n blocks go on the kernel's head axis ``(B*H, n, ...)``: its
    output then holds each head's rows in query order, so a run over every row is the output
    itself (:func:`_rows_of`). Grouped heads must stay on the head axis.
    """
    swap = views[0].shape[1] == views[1].shape[1]
    if swap:
        views = tuple(t.transpose(0, 1) for t in views)
        mask = None if mask is None else mask.transpose(0, 1)
    o, l = _FLASH(*views, is_causal=causal, attn_mask=mask, scale=scale)
    return (o.transpose(0, 1), l.transpose(0, 1)) if swap else (o, l)


def _flash_backward(d_out: Tensor, views: tuple, out: Tensor, lse: Tensor, *, causal: bool,
                    mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's backward on a run (shapes as in :func:`_flash`): dq, dk, dv like the views."""
    swap = views[0].shape[1] == views[1].shape[1]
    tensors = (d_out, *views, out, lse)
    if swap:
        tensors = tuple(t.transpose(0, 1) for t in tensors)
        mask = None if mask is None else mask.transpose(0, 1)
    grads = _FLASH_BACKWARD(*tensors[:5], tensors[5], 0.0, causal, attn_mask=mask, scale=scale)
    return tuple(g.transpose(0, 1) for g in grads) if swap else grads


def _one_run_in_order(plan: _Plan, total: int, *, keys: bool = False) -> bool:
    """Whether the plan is one run whose blocks are the queries (``keys``: the keys)
    ``[0, total)`` once each, in order: the kernel's output (gradients) is then the result."""
    if len(plan.runs) != 1:
        return False
    run = plan.runs[0]
    start, step, length = (run.ks, run.k_step, run.keys) if keys else (run.qs, run.q_step, run.bq)
    return start == 0 and step == length and run.n * length == total


def _rows_of(t: Tensor, shape: tuple) -> Tensor:
    """A run's blocks ``(n, B*H, length, *X)`` covering every row in order, as ``shape``
    ``(B, H, T, *X)``: a view of what :func:`_flash` returns, a copy otherwise."""
    return t.transpose(0, 1).reshape(shape)


def _block_forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None,
                   mod: ScoreMod | None) -> tuple[Tensor, Tensor]:
    """One kernel call per run, the score mod's term in its mask, then the sinks. Returns out
    ``(B, Hq, Tq, W)`` and lse ``(B, Hq, Tq)`` (the sinks included). A run over every row
    is the output as the kernel wrote it: no copy."""
    B, Hq, Tq, W = q.shape
    acc_dtype = score_dtype(q.dtype)
    whole = _one_run_in_order(plan, Tq)
    if not whole:
        out = _init(q.new_empty(B, Hq, Tq, W, dtype=acc_dtype), plan.runs, fill=0.0)
        lse = _init(q.new_empty(B, Hq, Tq, dtype=acc_dtype), plan.runs, fill=float("-inf"))
    for run in plan.runs:
        mask = run.mask if mod is None else _with_mask(_bias_tile(plan.call, mod, run), run)
        o, l = _flash(_run_views(run, q, k, v), causal=run.causal, mask=mask,
                      scale=plan.kernel_scale)  # (n, B*Hq, bq, W), (n, B*Hq, bq)
        if run.dead is not None:
            o, l = o.masked_fill(run.dead.unsqueeze(-1), 0.0), l.masked_fill(run.dead, float("-inf"))
        if mod is not None:  # the kernel gives a row whose mask is all -inf lse 0: it is empty
            empty = _empty_rows(mask, run)
            o, l = o.masked_fill(empty.unsqueeze(-1), 0.0), l.masked_fill(empty, float("-inf"))
        if whole:
            out, lse = _rows_of(o, (B, Hq, Tq, W)).to(acc_dtype), _rows_of(l, (B, Hq, Tq)).to(acc_dtype)
        elif run.first:  # nothing merged into these query blocks yet
            run.query_blocks(out).copy_(o)
            run.query_blocks(lse).copy_(l)
        else:
            merge_(run.query_blocks(out), run.query_blocks(lse), o, l)  # (n, B*Hq, bq, W), (n, B*Hq, bq)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sink_logits(sinks, lse.dtype))
    return out, lse


def _empty_rows(mask: Tensor, run: _Run) -> Tensor:
    """``(n|1, B*Hq|1, bq)``: rows of the run's mask ``(n|1, B*Hq|1, bq, keys)`` with no finite
    entry (inside the causal triangle on a causal run), e.g. a score mod's ``-inf`` bias over
    the piece. Their lse must be ``-inf`` for the merge by lse, not the kernel's 0."""
    if run.causal:
        tril = torch.ones(run.bq, run.keys, dtype=torch.bool, device=mask.device).tril()
        mask = mask.masked_fill(~tril, float("-inf"))
    return (mask == float("-inf")).all(dim=-1)


def _mask_dtype(call: AttentionCall) -> torch.dtype:
    """The score mod's term in the kernel's mask: fp32 for fp16/bf16 calls (the kernel takes an
    fp32 mask with half inputs; rounding the term to half would cost up to half its unit), else
    the call's dtype."""
    return torch.float32 if call.dtype in (torch.float16, torch.bfloat16) else call.dtype


def _bias_tile(call: AttentionCall, mod: ScoreMod, run: _Run) -> Tensor:
    """An additive score mod's term on the run's pieces, in the kernel's row layout
    ``(n|1, B*Hq|1, bq, keys)``.

    One tile serves every piece when the term depends only on ``kv_idx - q_idx`` and ``h``
    (``mod.relative``: ALiBi, T5's bias) and the pieces step queries and keys alike (sliding
    windows, causal diagonals); otherwise each piece gets its own. Read from the mod's tensors
    on every call, never planned: they change at every training step.
    """
    n = 1 if run.n == 1 or (mod.relative and run.q_step == run.k_step) else run.n
    device = call.device
    step = torch.arange(n, device=device).view(n, 1, 1, 1, 1)
    q_idx = run.qs + step * run.q_step + torch.arange(run.bq, device=device).view(1, 1, 1, -1, 1)
    kv_idx = run.ks + step * run.k_step + torch.arange(run.keys, device=device).view(1, 1, 1, 1, -1)
    b = torch.arange(call.batch, device=device).view(1, -1, 1, 1, 1)
    h = torch.arange(call.q_heads, device=device).view(1, 1, -1, 1, 1)
    term = additive_term(mod, b, h, q_idx, kv_idx, dtype=score_dtype(call.dtype)).to(_mask_dtype(call))
    term = term.reshape((1,) * (5 - term.ndim) + tuple(term.shape))  # (n|1, B|1, Hq|1, bq|1, keys|1)
    if term.shape[1] == 1 and term.shape[2] == 1:
        return term.expand(n, 1, 1, run.bq, run.keys)[:, 0]  # (n, 1, bq, keys)
    return term.expand(n, call.batch, call.q_heads, run.bq, run.keys).flatten(1, 2)  # (n, B*Hq, bq, keys)


def _with_mask(tile: Tensor, run: _Run) -> Tensor:
    """The run's mask: the score mod's term plus the plan's 0/-inf mask (causal runs keep the
    kernel's own causal masking, which takes a mask besides)."""
    return tile if run.mask is None else tile + run.mask


def _blocks_forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, *params: Tensor):
    """The Function's forward: out ``(B, Hq, Tq, Dv)`` in q's dtype and lse ``(B, Hq, Tq)``."""
    out, lse = _block_forward(plan, *_kernel_inputs(plan, q, k, v), sinks, _score_mod(plan, params))
    return out.narrow(-1, 0, v.shape[-1]).to(q.dtype), lse


def _blocks_gradients(plan: _Plan, needs: frozenset, d_out: Tensor, tensors: tuple, outputs: tuple) -> tuple:
    """dq, dk, dv, the sinks' and each score-mod tensor's gradient (None where not needed)."""
    q, k, v, sinks, *params = tensors
    need_params = frozenset(i - 4 for i in needs if i >= 4)
    return _block_backward(plan, d_out, (q, k, v), *outputs, sinks, sinks is not None and 3 in needs,
                           need_params, tuple(params))


# ``apply(plan, q, k, v, sinks, *score-mod tensors)``: the fused kernel once per run, forward and
# backward (the backward a Function of its own, for torch.func).
_BlocksFunction = kernel_function("blocks", _blocks_forward, _blocks_gradients)


def _score_mod(plan: _Plan, params: tuple) -> ScoreMod | None:
    """The call's score mod holding the Function's own inputs ``params`` (None without one)."""
    mod = plan.call.score_mod
    return None if mod is None else mod.with_params(params)


def _block_backward(plan: _Plan, d_out: Tensor, inputs: tuple, out: Tensor, lse: Tensor,
                    sinks: Tensor | None, need_sinks: bool, need_params: frozenset,
                    params: tuple) -> tuple:
    """dq, dk, dv of the Function's inputs q, k, v from the output gradient ``d_out``, then the
    sinks' gradient and each score-mod tensor's (None where not needed).

    ``out`` and ``lse`` include the sinks, so the kernel's backward is exact for the real keys;
    the sinks' gradient is ``-p_sink * D_i`` per row, a score-mod tensor's comes from each run's
    ``dS = P * (dP - D_i)`` through its tile of the mod's term. With fp16/bf16 inputs ``D_i`` is
    summed from the scores (:func:`_consistent_delta`), not from the rounded ``out``. Buffers are
    cut with ``narrow`` (not indexing, ``aten::alias``) so that batched gradcheck's vmap applies.
    """
    q, k, v = _kernel_inputs(plan, *inputs)
    D, Dv, W = inputs[0].shape[-1], inputs[2].shape[-1], k.shape[-1]
    acc_dtype = score_dtype(q.dtype)
    mod = _score_mod(plan, params)
    learn = [i in need_params for i in range(len(params))]
    d_params = [torch.zeros_like(p, dtype=acc_dtype) if want else None for p, want in zip(params, learn)]
    delta = None  # D_i = rowsum(dO * O) (B, Hq, Tq), for the sinks' and the mod's gradients
    if (need_sinks or any(learn)) and acc_dtype == q.dtype:
        delta = row_delta(d_out, out, acc_dtype)
    d_out, out = (_kernel_layout(_widened(t, W)) for t in (d_out, out))  # (B, Hq, Tq, W)
    lse = _kernel_layout(lse)
    if (need_sinks or any(learn)) and acc_dtype != q.dtype:
        delta = _consistent_delta(plan, (q, k, v), d_out, lse, mod)
    # Gradients in the standard layout, whatever the inputs' (an expanded k is not writable).
    # A run over every query (every key) in order gives dq (dk, dv) as the kernel wrote them.
    whole_q, whole_k = _one_run_in_order(plan, q.shape[2]), _one_run_in_order(plan, k.shape[2], keys=True)
    dq = None if whole_q else _init(d_out.new_empty(q.shape), plan.runs, fill=0.0)
    dk, dv = (None, None) if whole_k else (d_out.new_zeros(k.shape), d_out.new_zeros(v.shape))
    for run in plan.runs:
        do_r, lse_r = _run_rows(run, d_out, lse)  # (n, B*Hq, bq, W), (n, B*Hq, bq)
        q_r, k_r, v_r = _run_views(run, q, k, v)
        mask, tile = run.mask, None
        if mod is not None:
            with torch.enable_grad():  # the tile's graph back to the mod's tensors that learn
                leaves = [p.detach().requires_grad_(want) for p, want in zip(params, learn)]
                tile = _bias_tile(plan.call, mod.with_params(leaves), run)
            mask = _with_mask(tile.detach(), run)
        gq, gk, gv = _flash_backward(do_r, (q_r, k_r, v_r), run.query_blocks(out), lse_r, causal=run.causal,
                                     mask=mask, scale=plan.kernel_scale)
        if tile is not None and tile.requires_grad:
            d_scores = _score_gradient(plan, run, (q_r, k_r, v_r), do_r, run.query_blocks(delta), lse_r, mask)
            _add_tile_gradients(tile, leaves, d_scores, d_params)
        if whole_q:
            dq = _rows_of(gq, q.shape).to(d_out.dtype)
        elif run.first:  # the same order as the forward: nothing added to these rows yet
            run.query_blocks(dq).copy_(gq)
        else:
            _add_blocks(dq, gq, run.qs, run.q_step)
        if whole_k:
            dk, dv = _rows_of(gk, k.shape).to(d_out.dtype), _rows_of(gv, v.shape).to(d_out.dtype)
        else:
            _add_blocks(dk, gk, run.ks, run.k_step)
            _add_blocks(dv, gv, run.ks, run.k_step)
    if plan.factor != 1.0:
        dq.mul_(plan.factor)  # the kernel differentiated by q * factor
    d_sinks = None
    if need_sinks:
        d_sinks = sinks_gradient(sinks, sink_logits(sinks, acc_dtype), lse, delta)  # summed to the sinks' shape
    d_params = [None if d is None else d.to(p.dtype) for d, p in zip(d_params, params)]
    return dq.narrow(-1, 0, D), dk.narrow(-1, 0, D), dv.narrow(-1, 0, Dv), d_sinks, *d_params


def _run_rows(run: _Run, d_out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """The run's output gradient ``(n, B*Hq, bq, W)`` and lse ``(n, B*Hq, bq)``, a dropped row's
    gradient zeroed and its lse ``+inf`` (its weights are then ``exp(s - inf) = 0``)."""
    do_r, lse_r = run.query_blocks(d_out), run.query_blocks(lse)
    if run.dead is not None:
        do_r = do_r.masked_fill(run.dead.unsqueeze(-1), 0.0)
        lse_r = lse_r.masked_fill(run.dead, float("inf"))
    # A row with nothing to attend anywhere (a score mod's -inf over all its keys) has lse -inf:
    # +inf instead, so that its weights are 0, never exp(-inf - -inf) = NaN.
    return do_r, lse_r.masked_fill(lse_r == float("-inf"), float("inf"))


def _consistent_delta(plan: _Plan, kernel_inputs: tuple, d_out: Tensor, lse: Tensor,
                      mod: ScoreMod | None) -> Tensor:
    """``D_i = sum_j P_ij dP_ij`` ``(B, Hq, Tq)`` summed over the runs in the accumulation dtype:
    ``rowsum(dO * O)`` without the rounding of O to the inputs' dtype.

    kernel_inputs: q, k, v as the kernel read them; d_out ``(B, Hq, Tq, W)`` and lse
    ``(B, Hq, Tq)`` in the kernel's layout.
    """
    q, k, v = kernel_inputs
    delta = d_out.new_zeros(*lse.shape, 1, dtype=lse.dtype)  # (B, Hq, Tq, 1)
    for run in plan.runs:
        do_r, lse_r = _run_rows(run, d_out, lse)
        mask = run.mask if mod is None else _with_mask(_bias_tile(plan.call, mod, run), run)
        probs, d_probs = _probs(plan, run, _run_views(run, q, k, v), do_r, lse_r, mask)
        _add_blocks(delta, probs.mul_(d_probs).sum(dim=-1, keepdim=True), run.qs, run.q_step)
    return delta[..., 0]


def _score_gradient(plan: _Plan, run: _Run, views: tuple, d_out: Tensor, delta: Tensor, lse: Tensor,
                    mask: Tensor) -> Tensor:
    """``dS = P * (dP - D_i)`` of one run's scores ``(n, B*Hq, bq, keys)`` (accumulation dtype),
    which the kernel's backward does not return: the scores and ``dP = dO V^T`` again, with the
    call's global lse (``+inf`` on dropped rows, whose P is then 0). Memory: the run's scores.

    views: the run's q ``(n, B*Hq, bq, W)``, k and v ``(n, B*Hkv, keys, W)`` as the kernel read
    them; d_out ``(n, B*Hq, bq, W)``, delta and lse ``(n, B*Hq, bq)``; mask the run's mask.
    """
    probs, d_probs = _probs(plan, run, views, d_out, lse, mask)
    return score_gradient_(probs, d_probs, delta.unsqueeze(-1))  # (n, B*Hq, bq, keys)


def _probs(plan: _Plan, run: _Run, views: tuple, d_out: Tensor, lse: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``P`` and ``dP = dO V^T`` of one run ``(n, B*Hq, bq, keys)``, in the accumulation dtype
    (shapes as in :func:`_score_gradient`)."""
    acc_dtype = score_dtype(views[0].dtype)
    q, k, v = (t.to(acc_dtype) for t in views)
    n, heads, bq = q.shape[:3]
    groups = heads // k.shape[1]  # query head b*Hq + h reads key head (b*Hq + h) // groups

    def by_group(t: Tensor) -> Tensor:
        return t.reshape(n, k.shape[1], groups, *t.shape[2:])  # (n, B*Hkv, G, bq, W)

    scores = torch.matmul(by_group(q), k.unsqueeze(2).transpose(-2, -1)).flatten(1, 2)  # (n, B*Hq, bq, keys)
    scores = scores.mul_(plan.kernel_scale)
    if mask is not None:
        scores = scores.add_(mask)
    if run.causal:
        tril = torch.ones(bq, run.keys, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill_(~tril, float("-inf"))
    probs = torch.exp_(scores.sub_(lse.unsqueeze(-1)))
    d_probs = torch.matmul(by_group(d_out.to(acc_dtype)), v.unsqueeze(2).transpose(-2, -1)).flatten(1, 2)
    return probs, d_probs  # (n, B*Hq, bq, keys) each


def _add_tile_gradients(tile: Tensor, leaves: list, d_scores: Tensor, d_params: list) -> None:
    """Carry the scores' gradient ``(n, B*Hq, bq, keys)`` through the tile of the mod's term
    ``(n|1, B*Hq|1, bq, keys)`` (a term shared by pieces or heads gets their sum) into the
    gradient of each mod tensor that learns."""
    dims = tuple(d for d in range(2) if tile.shape[d] == 1 and d_scores.shape[d] != 1)
    d_tile = d_scores.sum(dim=dims, keepdim=True) if dims else d_scores
    wanted = [(i, leaf) for i, leaf in enumerate(leaves) if leaf.requires_grad]
    grads = torch.autograd.grad(tile, [leaf for _, leaf in wanted], d_tile.to(tile.dtype), allow_unused=True)
    for (i, _), grad in zip(wanted, grads):
        if grad is not None:
            d_params[i].add_(grad)


def blocks_gradients(call: AttentionCall, *, out: Tensor, lse: Tensor, d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``call.q``, ``call.k``, ``call.v`` from ``d_out``, given ``out`` and ``lse``
    (the twin of :func:`attnlab.backends.chunked.chunked_gradients`).

    ``out`` and ``lse`` may be a larger computation's (a ring step's global rows). For calls
    without a score mod or sinks.

    Shapes:
        out ``(B, Hq, Tq, Dv)``, lse ``(B, Hq, Tq)``, d_out like out -> dq, dk, dv like q, k, v.

    Example:
        >>> from attnlab._call import build_call
        >>> x = torch.randn(1, 1, 6, 4, dtype=torch.float64, requires_grad=True)
        >>> call = build_call(x, x, x, causal=True)
        >>> r = blocks_attention(build_call(x.detach(), x.detach(), x.detach(), causal=True), block=4)
        >>> dq, dk, dv = blocks_gradients(call, out=r.out, lse=r.lse, d_out=torch.ones_like(r.out))
        >>> ref = torch.autograd.grad(blocks_attention(call, block=4).out.sum(), x)[0]
        >>> bool(torch.allclose(dq + dk + dv, ref))
        True
    """
    if call.score_mod is not None or call.sinks is not None:
        raise ValueError("blocks_gradients: a call with a score mod or sinks differentiates through "
                         "blocks_attention itself")
    runs = () if call.batch == 0 else _planned_runs(call, _planned_mod(call), None)
    return _block_backward(_Plan(call, runs, 1.0, call.scale), d_out, (call.q, call.k, call.v), out, lse, None, False,
                           frozenset(), ())[:3]


def blocks_attention(call: AttentionCall, *, block: int | None = None) -> AttentionResult:
    """Attention for ``call`` by query blocks over their reachable key spans (see the module doc).

    Shapes:
        call.q ``(B, Hq, Tq, D)``, call.k ``(B, Hkv, Tk, D)``, call.v ``(B, Hkv, Tk, Dv)`` ->
        out ``(B, Hq, Tq, Dv)``, lse ``(B, Hq, Tq)`` (fp32, fp64 for fp64 inputs).

    Args:
        call: a call :class:`BlocksBackend` serves (``not_supported_reasons`` empty).
        block: queries per block (None: :func:`choose_block`); changes results only by rounding.

    Example:
        >>> from attnlab._call import build_call
        >>> x = torch.randn(1, 1, 9, 4, dtype=torch.float64)
        >>> r = blocks_attention(build_call(x, x, x, causal=True), block=4)
        >>> bool(torch.allclose(r.out[0, 0, 0], x[0, 0, 0]))   # the first query sees only itself
        True
    """
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be a positive int or None, got {block!r}")
    # An empty batch gets no runs (zeros out, -inf lse, zero grads): the kernel divides by B*H.
    runs = () if call.batch == 0 else _planned_runs(call, _planned_mod(call), block)
    return _run_blocks(call, (runs, *kernel_scales(call), kernel_keeps_rows(call.device)))


def _run_blocks(call: AttentionCall, decided: tuple) -> AttentionResult:
    """The kernel on each run of ``decided = (runs, factor, kernel_scale, keeps_rows)``."""
    runs, factor, kernel_scale, keeps_rows = decided
    params = call.score_mod.params() if call.score_mod is not None else ()
    out, lse = _BlocksFunction.apply(_Plan(call, runs, factor, kernel_scale), call.q, call.k, call.v, call.sinks,
                                     *params)
    # A NaN query row is NaN in every run that reads it, and merges keep it NaN; only a kernel
    # that zeroes such rows needs the output pass that restores them.
    return AttentionResult(out=out if keeps_rows else keep_nan_rows(call.q, out), lse=lse)


class BlocksBackend(Backend):
    """The fused dense kernel on each query block's reachable key span (mask mods with bounds).

    Example:
        >>> import attnlab
        >>> from attnlab import masks
        >>> q = torch.randn(1, 2, 40, 8)
        >>> attnlab.attention(q, q, q, causal=True, backend="blocks").shape
        torch.Size([1, 2, 40, 8])
    """

    name = "blocks"
    passes_over = True
    memory = "linear"
    devices = ("cpu",)
    dtypes = {"cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16)}
    dropout = False
    needs_bounds = True  # auto picks it for mask mods with kv_bounds only; attnlab.verify sweeps those
    plans_masks = True  # plans from a PreparedMask: dispatch prepares tensor-free mods once per route
    description = (
        "block-sparse: the fused SDPA kernel per query block on only the keys its mask mod's "
        "kv_bounds reach (causal, windows, documents, prefix-LM); additive score mods in the "
        "kernel's mask and sinks through the lse; forward and backward, GQA; O(T) memory"
    )

    def unavailable_reason(self) -> str | None:
        if _FLASH is None or _FLASH_BACKWARD is None:
            return f"torch {torch.__version__} has no CPU flash-attention op"
        return None

    def limits(self, call: AttentionCall) -> list[str]:
        """What blocks cannot compute: a score mod that is not additive (the kernel's mask
        carries it), a dense float mask."""
        mod = call.score_mod
        if mod is not None and not mod.additive:
            return [f"blocks adds a score mod only through the kernel's float mask; {mod!r} is not "
                    "additive (chunked serves it in O(T) memory)"]
        if call.mask_kind == "float":
            return ["blocks plans from a mask mod or a bool mask; a dense float mask is neither "
                    "(sdpa and chunked serve it)"]
        return []

    def passed_over(self, call: AttentionCall) -> list[str]:
        """Only mask mods with bounds are worth it; named, blocks serves the rest exactly (a
        decoding step, a padding mask) as one span of every key."""
        if call.mask_kind == "bool":
            return ["blocks skips key blocks by a mask mod's kv_bounds; a dense bool mask declares "
                    "none (pass a mask mod from attnlab.masks)"]
        if call.mask_kind == "none":
            return ["blocks has nothing to skip without a mask mod or causal (sdpa runs it densely)"]
        if _bounds_missing(call.mask_mod(), call.tq):
            return ["blocks cannot skip: the mask mod declares no kv_bounds (a plain function, or "
                    "an or-combination with such a part), so every key block is reachable"]
        return []

    def memory_use(self, call: AttentionCall, *, words: bool = False) -> MemoryUse:
        """O(T): one block's mask (or score-mod term) at a time; the words say how much it visits."""
        return memory_of_class(self.memory, call, _memory_words(call) if words else "")

    def cost(self, call: AttentionCall) -> float:
        return _fastest(call)[0]

    def plan(self, call: AttentionCall) -> tuple | None:
        """The runs of blocks, the kernel's scales and whether it keeps empty rows, where the
        signature decides them: a mask that holds no tensor of the caller (causal, a mod by
        value, dispatch's prepared mask). A bool mask's runs follow its values: None, planned
        per call.

        Example:
            >>> from attnlab._call import build_call
            >>> q = torch.randn(1, 1, 8, 4)
            >>> len(BlocksBackend().plan(build_call(q, q, q, causal=True)))
            4
        """
        if call.mask_kind in ("bool", "float") or call.batch == 0:
            return None
        runs = _planned_runs(call, _planned_mod(call), None)
        return (runs, *kernel_scales(call), kernel_keeps_rows(call.device))

    def execute(self, call: AttentionCall, plan: tuple | None) -> AttentionResult:
        return blocks_attention(call) if plan is None else _run_blocks(call, plan)

    def forward(self, call: AttentionCall) -> AttentionResult:
        return blocks_attention(call)


def _memory_words(call: AttentionCall) -> str:
    """How much of the score matrix blocks visits for ``call``, and what it holds, in words."""
    block = choose_block(call)
    held = "one block's mask at a time"
    if call.score_mod is not None and not call.score_mod.relative:
        held = "the score mod's term on one run of same-shaped blocks at a time"
    return (f"visits {visited_fraction(call, block=block):.0%} of the Tq x Tk scores in "
            f"{block}-query blocks, {held}")


def _bounds_missing(mod: Callable, tq: int) -> bool:
    """Whether ``mod`` declares no bounds (checked on the first query block)."""
    return not isinstance(mod, _masks.MaskMod) or mod.kv_bounds(0, max(1, min(tq, BLOCK_SIZES[-1]))) is None


def choose_block(call: AttentionCall) -> int:
    """The queries per block of :data:`BLOCK_SIZES` that the cost model expects to be fastest.

    Short spans (sliding windows) favour small blocks, which visit fewer masked-out keys; long
    spans (causal, documents) and backward passes favour large ones, where the kernel is faster.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 8, 8192, 64)
        >>> choose_block(build_call(q, q, q, mask=_masks.sliding_window_mod(8192, 8192, 256)))
        32
        >>> choose_block(build_call(q, q, q, causal=True))
        256
    """
    return _fastest(call)[1]


def _fastest(call: AttentionCall) -> tuple[float, int]:
    """The cost model's ``(seconds, block)`` for the fastest of :data:`BLOCK_SIZES` (the smaller
    block on a tie): one estimate per size serves both :func:`choose_block` and the cost."""
    return min((_estimated_seconds(call, block), block) for block in BLOCK_SIZES)


def _estimated_seconds(call: AttentionCall, block: int) -> float:
    """Visited FLOPs at the kernel's measured rate for ``block``-query blocks (slower on long
    spans), times the forward+backward factor when gradients are needed, plus a cost per block
    and per call."""
    rates = RATES["blocks"]
    spans = block_spans(call.mask_mod(), call.tq, call.tk, block)
    per_pair = 2.0 * call.batch * call.q_heads * (call.head_dim + call.value_dim)
    seconds = len(spans) * rates["seconds_per_block"]
    for qs, qe, lo, hi in spans:
        factor = 1.0 if hi - lo <= rates["short_span_keys"] else rates["long_span_factor"]
        seconds += per_pair * (qe - qs) * (hi - lo) / (rates["flops_per_s"][block] * factor)
    if call.requires_grad:
        seconds *= rates["forward_backward_factor"][block]
    return rates["call_overhead_s"] + seconds


register(BlocksBackend())
