"""The ``blocks`` backend: masked attention at the fused dense kernel's speed.

For a call whose mask mod declares :meth:`~attnlab.masks.MaskMod.kv_bounds` (causal, sliding
window, documents, prefix-LM, chunked-local and their combinations), the queries are cut into
blocks and, for each block, PyTorch's fused CPU flash kernel (the one behind
``scaled_dot_product_attention``) runs once on only the keys that block can reach. A key span
that every query of the block sees in full runs without any mask; a span that is partly visible
gets a small ``(bq, span)`` additive mask. The work is the visited tiles, not ``Tq * Tk``.

Forward and backward both call the fused kernel (its ``_for_cpu`` op and that op's backward),
so the backward pass is the kernel's own, block by block, with gradients of the reached key
span accumulated into ``dk``/``dv``. The kernel's row log-sum-exp comes for free and is
returned (``-inf`` on rows with nothing to attend).

The contract (``docs/design.md``) is kept exactly, or the call is declined:

* a query row with no attendable key gets zeros and zero gradient: it runs with a harmless
  all-visible mask row, its output is zeroed and its output gradient is zeroed before the
  kernel's backward (so it adds nothing to ``dk``/``dv``);
* keys outside a block's span are never read, keys inside it that are masked get weight 0;
* NaN/inf in q, k or v is declined (the fused kernel returns zeros for a NaN query row, which
  would pass for a fully masked row), as are dropout, dense masks and bounds-less mods;
* grouped-query attention folds a query group into the block's rows
  ``(B, Hkv, G*bq, D)``, so keys and values are never repeated;
* ``Dv != D`` (which the kernel refuses) pads the shorter of q/k or v with zeros: exact.

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
from torch.autograd.function import once_differentiable

from attnlab import masks as _masks
from attnlab._call import AttentionCall
from attnlab.backends.base import AttentionResult, Backend
from attnlab.backends.rates import RATES
from attnlab.backends.registry import register

__all__ = ["BlocksBackend", "blocks_attention", "block_spans", "DEFAULT_BLOCK"]

# Queries per block. A 256-key sliding window at T=8192 (B=1 H=8 D=64 fp32, one thread, load
# ~2.6) took 247/222/197 ms with blocks of 64/128/256 and causal 2.5/1.8/1.9 s with 128/256/512
# (two threads, noisier): smaller blocks visit fewer masked-out keys but call the kernel more.
DEFAULT_BLOCK = 256

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def block_spans(mod: Callable | None, tq: int, tk: int, block: int) -> list[tuple[int, int, int, int]]:
    """``(q_start, q_end, kv_lo, kv_hi)`` for each query block: the keys it may reach.

    Example:
        >>> block_spans(_masks.CausalMod(0), 6, 6, 4)
        [(0, 4, 0, 4), (4, 6, 0, 6)]
    """
    spans = []
    for qs in range(0, tq, block):
        qe = min(qs + block, tq)
        spans.append((qs, qe, *_masks.kv_range(mod, qs, qe, tk)))
    return spans


def visited_fraction(call: AttentionCall, block: int = DEFAULT_BLOCK) -> float:
    """Share of the ``Tq x Tk`` score matrix the backend computes for ``call`` (1.0 = all).

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 512, 4)
        >>> visited_fraction(build_call(q, q, q, causal=True), block=256)
        0.75
    """
    if call.tq == 0 or call.tk == 0:
        return 0.0
    spans = block_spans(call.mask_mod(), call.tq, call.tk, block)
    return sum((qe - qs) * (hi - lo) for qs, qe, lo, hi in spans) / (call.tq * call.tk)


@dataclass
class _Piece:
    """One kernel call of a tile: keys ``[ks, ke)`` (tensors in the grouped layout).

    mask: additive 0/-inf mask ``(B|1, Hkv|1, G*bq, ke-ks)`` or None when all is visible.
    dead: ``(B|1, Hkv|1, G*bq)`` rows that see no key of this piece (given a harmless full
        mask row; their lse is -inf in the merge and their gradient is zeroed), or None.
    """

    ks: int
    ke: int
    mask: Tensor | None
    dead: Tensor | None


@dataclass
class _Tile:
    """One query block: its pieces, and ``dead`` ``(B|1, Hq|1, bq, 1)``, the rows that see no
    key at all (zero output, zero gradient), or None."""

    qs: int
    qe: int
    pieces: tuple
    dead: Tensor | None


def _group(t: Tensor, kv_heads: int) -> Tensor:
    """``(B, Hq, bq, X) -> (B, Hkv, G*bq, X)``: query head ``h`` joins key/value head ``h // G``."""
    B, H, bq, X = t.shape
    if H == kv_heads:
        return t
    return t.reshape(B, kv_heads, (H // kv_heads) * bq, X)  # (B, Hkv, G*bq, X)


def _ungroup(t: Tensor, q_heads: int) -> Tensor:
    """``(B, Hkv, G*bq, X) -> (B, Hq, bq, X)``, the inverse of :func:`_group`."""
    B, Hkv, rows, X = t.shape
    return t.reshape(B, q_heads, rows * Hkv // q_heads, X)  # (B, Hq, bq, X)


def _grouped(t: Tensor, call: AttentionCall, bq: int) -> Tensor:
    """A ``(B|1, Hq|1, bq|1, X)`` mask-like tensor in the grouped layout ``(B|1, Hkv|1, G*bq, X)``."""
    t = t.expand(t.shape[0], t.shape[1], bq, t.shape[3])  # (B|1, Hq|1, bq, X)
    if t.shape[1] == 1:  # the same rows for every head of a group
        return t.repeat(1, 1, call.q_heads // call.kv_heads, 1)  # (B|1, 1, G*bq, X)
    return _group(t.contiguous(), call.kv_heads)  # (B|1, Hkv, G*bq, X)


# A run of at least this many keys that every query of a block sees is given its own, unmasked
# kernel call: the kernel adds a mask to every score, so a long causal span is far faster split
# into its visible part and the diagonal than run whole with a mask.
_MIN_FULL_RUN = 32


def _full_run(allowed: Tensor) -> tuple[int, int]:
    """The longest run ``[a, b)`` of key columns every query (every batch row and head) sees.

    ``allowed``: ``(B|1, Hq|1, bq, span)`` bool.
    """
    full = allowed.flatten(0, 2).all(dim=0).to(torch.int8)  # (span,)
    edges = torch.diff(F.pad(full, (1, 1)))  # +1 where a run starts, -1 one past its end
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    if starts.numel() == 0:
        return 0, 0
    longest = int(torch.argmax(ends - starts))
    return int(starts[longest]), int(ends[longest])


def _piece(call: AttentionCall, allowed: Tensor, ks: int, ke: int, dtype: torch.dtype,
           bq: int) -> _Piece:
    """A masked piece of keys ``[ks, ke)`` from its ``(B|1, Hq|1, bq|1, ke-ks)`` allowed mask."""
    allowed = allowed.expand(*allowed.shape[:3], ke - ks)
    alive = allowed.any(dim=-1, keepdim=True)  # (B|1, Hq|1, bq|1, 1)
    dead = None if bool(alive.all()) else ~alive
    visible = allowed if dead is None else allowed | dead  # dead rows: a harmless full row
    bias = torch.zeros(visible.shape, dtype=dtype, device=call.device).masked_fill_(~visible, float("-inf"))
    dead_rows = None if dead is None else _grouped(dead, call, bq)[..., 0]  # (B|1, Hkv|1, G*bq)
    return _Piece(ks, ke, _grouped(bias, call, bq), dead_rows)


def _make_tile(call: AttentionCall, mod: Callable, span: tuple[int, int, int, int],
               dtype: torch.dtype) -> _Tile | None:
    """Evaluate the mask on one block's span; None when the block may attend nothing."""
    qs, qe, lo, hi = span
    if hi <= lo:
        return None
    allowed = _masks.evaluate(mod, q_range=(qs, qe), kv_range=(lo, hi), batch=call.batch,
                              heads=call.q_heads, device=call.device)  # (B|1, Hq|1, bq|1, span|1)
    allowed = allowed.expand(*allowed.shape[:2], qe - qs, hi - lo)  # (B|1, Hq|1, bq, span)
    if bool(allowed.all()):
        return _Tile(qs, qe, (_Piece(lo, hi, None, None),), None)
    alive = allowed.any(dim=-1, keepdim=True)  # (B|1, Hq|1, bq, 1)
    if not bool(alive.any()):
        return None
    dead = None if bool(alive.all()) else ~alive
    a, b = _full_run(allowed)
    if b - a < _MIN_FULL_RUN:
        return _Tile(qs, qe, (_piece(call, allowed, lo, hi, dtype, qe - qs),), dead)
    pieces = [_Piece(lo + a, lo + b, None, None)]
    for start, stop in ((0, a), (b, hi - lo)):
        if stop > start:
            pieces.append(_piece(call, allowed[..., start:stop], lo + start, lo + stop, dtype, qe - qs))
    return _Tile(qs, qe, tuple(pieces), dead)


def _padded(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with a common head size (the kernel needs ``Dv == D``); zero columns are exact."""
    q, k, v = call.q, call.k, call.v
    width = max(call.head_dim, call.value_dim)
    if call.head_dim < width:
        q, k = (F.pad(t, (0, width - call.head_dim)) for t in (q, k))
    if call.value_dim < width:
        v = F.pad(v, (0, width - call.value_dim))
    return q, k, v


@dataclass(frozen=True)
class _Plan:
    """What the autograd function needs besides the tensors."""

    call: AttentionCall
    tiles: tuple


def _merge(outs: list, lses: list, pieces: tuple, lse_dtype: torch.dtype):
    """Combine the pieces of one tile: lse = logsumexp of theirs, out = their lse-weighted sum.

    Returns out and lse ``(B, Hkv, G*bq, .)``, and per piece the lse its backward must use: the
    tile's, except on rows dead in that piece, which keep the piece's own finite lse (their
    output gradient is zeroed there, so they add nothing).
    """
    if len(outs) == 1:
        return outs[0], lses[0], [lses[0]]
    live = [l if p.dead is None else l.masked_fill(p.dead, float("-inf")) for l, p in zip(lses, pieces)]
    lse = torch.logsumexp(torch.stack(live), dim=0)  # (B, Hkv, G*bq); -inf: dead in every piece
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    out = sum(o.to(lse_dtype) * torch.exp(l - safe).unsqueeze(-1) for o, l in zip(outs, live))
    backward_lse = [lse if p.dead is None else torch.where(p.dead, l, lse) for l, p in zip(lses, pieces)]
    return out.to(outs[0].dtype), lse, backward_lse


def _block_forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor):
    """Run every tile. Returns out ``(B, Hq, Tq, W)``, lse ``(B, Hq, Tq)`` and per-tile saves."""
    call = plan.call
    B, Hq, Tq, W = q.shape
    out = q.new_zeros(B, Hq, Tq, W)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((B, Hq, Tq), float("-inf"), dtype=lse_dtype, device=q.device)
    saved = []
    for tile in plan.tiles:
        q_blk = _group(q[:, :, tile.qs:tile.qe], call.kv_heads)  # (B, Hkv, G*bq, W)
        outs, lses = [], []
        for piece in tile.pieces:
            o_p, l_p = _FLASH(q_blk, k[:, :, piece.ks:piece.ke], v[:, :, piece.ks:piece.ke],
                              attn_mask=piece.mask, scale=call.scale)  # (B, Hkv, G*bq, W|)
            outs.append(o_p)
            lses.append(l_p)
        o_blk, l_blk, backward_lse = _merge(outs, lses, tile.pieces, lse_dtype)
        saved.append((q_blk, o_blk, backward_lse))
        o_rows = _ungroup(o_blk, Hq)  # (B, Hq, bq, W)
        l_rows = _ungroup(l_blk.unsqueeze(-1), Hq)  # (B, Hq, bq, 1)
        if tile.dead is not None:
            o_rows = o_rows.masked_fill(tile.dead, 0.0)
            l_rows = l_rows.masked_fill(tile.dead, float("-inf"))
        out[:, :, tile.qs:tile.qe] = o_rows
        lse[:, :, tile.qs:tile.qe] = l_rows[..., 0]
    return out, lse, saved


class _BlocksFunction(torch.autograd.Function):
    """Forward: the fused kernel per query block. Backward: the kernel's backward per block."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        call = plan.call
        qp, kp, vp = _padded(call)
        out, lse, saved = _block_forward(plan, qp, kp, vp)
        ctx.plan, ctx.saved = plan, saved
        ctx.save_for_backward(kp, vp)
        ctx.mark_non_differentiable(lse)
        return out[..., :call.value_dim], lse

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, _d_lse):
        plan, call = ctx.plan, ctx.plan.call
        k, v = ctx.saved_tensors
        W = k.shape[-1]
        d_out = F.pad(d_out, (0, W - d_out.shape[-1])) if d_out.shape[-1] < W else d_out
        dq = torch.zeros(call.batch, call.q_heads, call.tq, W, dtype=k.dtype, device=k.device)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for tile, (q_blk, o_blk, backward_lse) in zip(plan.tiles, ctx.saved):
            do_rows = d_out[:, :, tile.qs:tile.qe]  # (B, Hq, bq, W)
            if tile.dead is not None:  # a zeroed output row passes no gradient back
                do_rows = do_rows.masked_fill(tile.dead, 0.0)
            do_blk = _group(do_rows.contiguous(), call.kv_heads)  # (B, Hkv, G*bq, W)
            gq_sum = None
            for piece, l_p in zip(tile.pieces, backward_lse):
                do_p = do_blk if piece.dead is None else do_blk.masked_fill(piece.dead.unsqueeze(-1), 0.0)
                gq, gk, gv = _FLASH_BACKWARD(do_p, q_blk, k[:, :, piece.ks:piece.ke],
                                             v[:, :, piece.ks:piece.ke], o_blk, l_p, 0.0, False,
                                             attn_mask=piece.mask, scale=call.scale)
                gq_sum = gq if gq_sum is None else gq_sum + gq
                dk[:, :, piece.ks:piece.ke] += gk
                dv[:, :, piece.ks:piece.ke] += gv
            dq[:, :, tile.qs:tile.qe] = _ungroup(gq_sum, call.q_heads)
        return (dq[..., :call.head_dim], dk[..., :call.head_dim], dv[..., :call.value_dim], None)


def blocks_attention(call: AttentionCall, *, block: int = DEFAULT_BLOCK) -> AttentionResult:
    """Attention for ``call`` by query blocks over their reachable key spans (see the module doc).

    Shapes:
        call.q ``(B, Hq, Tq, D)``, call.k ``(B, Hkv, Tk, D)``, call.v ``(B, Hkv, Tk, Dv)`` ->
        out ``(B, Hq, Tq, Dv)``, lse ``(B, Hq, Tq)`` (fp32, fp64 for fp64 inputs).

    Args:
        call: a call :class:`BlocksBackend` serves (``not_supported_reasons`` empty).
        block: queries per block; changes results only by rounding.

    Example:
        >>> from attnlab._call import build_call
        >>> x = torch.randn(1, 1, 9, 4, dtype=torch.float64)
        >>> r = blocks_attention(build_call(x, x, x, causal=True), block=4)
        >>> bool(torch.allclose(r.out[0, 0, 0], x[0, 0, 0]))   # the first query sees only itself
        True
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    mod = call.mask_mod()
    mask_dtype = call.dtype
    tiles = []
    for span in block_spans(mod, call.tq, call.tk, block):
        tile = _make_tile(call, mod, span, mask_dtype)
        if tile is not None:
            tiles.append(tile)
    out, lse = _BlocksFunction.apply(call.q, call.k, call.v, _Plan(call, tuple(tiles)))
    return AttentionResult(out=out, lse=lse)


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
    memory = "linear"
    devices = ("cpu",)
    dtypes = {"cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16)}
    dropout = False
    non_finite_inputs = False  # the fused kernel returns zeros for a NaN query row
    needs_bounds = True  # serves only mask mods with kv_bounds (attnlab.verify sweeps those)
    description = (
        "block-sparse: the fused SDPA kernel per query block on only the keys its mask mod's "
        "kv_bounds reach (causal, windows, documents, prefix-LM); forward and backward, GQA; "
        "O(T) memory"
    )

    def unavailable_reason(self) -> str | None:
        if _FLASH is None or _FLASH_BACKWARD is None:
            return f"torch {torch.__version__} has no CPU flash-attention op"
        return None

    def limits(self, call: AttentionCall) -> list[str]:
        """Only mask mods with bounds are worth it (NaN/inf inputs: see ``non_finite_inputs``)."""
        if call.mask_kind in ("bool", "float"):
            return [f"blocks skips key blocks by a mask mod's kv_bounds; a dense {call.mask_kind} "
                    "mask declares none (pass a mask mod from attnlab.masks)"]
        mod = call.mask_mod()
        if mod is None:
            return ["blocks has nothing to skip without a mask mod or causal (sdpa runs it densely)"]
        if _bounds_missing(mod, call.tq):
            return ["blocks cannot skip: the mask mod declares no kv_bounds (a plain function, or "
                    "an or-combination with such a part), so every key block is reachable"]
        return []

    def memory_note(self, call: AttentionCall) -> str:
        return (f"visits {visited_fraction(call):.0%} of the Tq x Tk scores in "
                f"{DEFAULT_BLOCK}-query blocks, one block's mask at a time")

    def cost(self, call: AttentionCall) -> float:
        return _estimated_seconds(call)

    def forward(self, call: AttentionCall) -> AttentionResult:
        return blocks_attention(call)


def _bounds_missing(mod: Callable, tq: int) -> bool:
    """Whether ``mod`` declares no bounds (checked on the first query block)."""
    return not isinstance(mod, _masks.MaskMod) or mod.kv_bounds(0, max(1, min(tq, DEFAULT_BLOCK))) is None


def _estimated_seconds(call: AttentionCall) -> float:
    """Visited FLOPs at the kernel's measured masked rate, plus a cost per block and per call."""
    rates = RATES["blocks"]
    spans = block_spans(call.mask_mod(), call.tq, call.tk, DEFAULT_BLOCK)
    per_pair = 2.0 * call.batch * call.q_heads * (call.head_dim + call.value_dim)
    seconds = len(spans) * rates["seconds_per_block"]
    for qs, qe, lo, hi in spans:  # long spans run mostly unmasked, nearer the kernel's peak
        rate = rates["flops_per_s"]["short" if hi - lo <= rates["short_span_keys"] else "long"]
        seconds += per_pair * (qe - qs) * (hi - lo) / rate
    if call.requires_grad:
        seconds *= rates["forward_backward_factor"]
    return rates["call_overhead_s"] + seconds


register(BlocksBackend())
