"""The chunked backend: FlashAttention's algorithm written in PyTorch, O(T) memory, any mask.

Query blocks visit key tiles one at a time with an *online softmax* (a running row max, sum
and weighted sum of values), so the score matrix never exists at full size: O(T·D) plus one
tile. The backward pass is FlashAttention-2's, from q, k, v, the output and the row
log-sum-exp (kept as max and log-sum, exact at a row held at ``finfo.min``)::

    dV += P^T dO        dS = P * (dO V^T - D_i)        dQ += dS K * scale      dK += dS^T Q * scale

Tiles no query may attend are skipped both ways: key ranges from the mask mod's ``kv_bounds``
and any tile whose combined mask allows nothing. Dropout bits are a hash of
``(seed, batch*head, query, key)``, independent of the tiling (:func:`dropout_keep`). Each tile
is a few dozen small ops: on an oversubscribed CPU set ``torch.set_num_threads(1)``.

Example:
    >>> import torch
    >>> from attnlab.backends import build_call
    >>> q, k, v = torch.randn(1, 2, 50, 8), torch.randn(1, 2, 70, 8), torch.randn(1, 2, 70, 4)
    >>> result = chunked_attention(build_call(q, k, v, causal=True), q_block=16, kv_block=16)
    >>> result.out.shape, result.lse.shape
    (torch.Size([1, 2, 50, 4]), torch.Size([1, 2, 50]))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab._call import AttentionCall
from attnlab._checks import has_values, positive_int
from attnlab._math import repeat_kv, score_dtype, sum_kv_groups
from attnlab.backends._lse import (kernel_function, online_finish, online_start, online_step, row_delta, row_parts,
                                   score_gradient_, sink_row_gradient)
from attnlab.backends.base import AttentionResult, Backend
from attnlab.backends.rates import RATES
from attnlab.backends.registry import register
from attnlab.scores import ScoreMod, apply_tile, captures_grad, sink_gradient, sink_logits

__all__ = [
    "ChunkedBackend",
    "chunked_attention",
    "chunked_gradients",
    "dropout_keep",
    "draw_dropout_seed",
    "DEFAULT_Q_BLOCK",
    "DEFAULT_KV_BLOCK",
]

# Large tiles amortise the Python work each tile costs; past 256 a tile's scores no longer fit
# in cache and the gain stops (git show 541b99b:BENCHMARKS.md, "Chunked tile size").
DEFAULT_Q_BLOCK = 256
DEFAULT_KV_BLOCK = 256

TileHook = Callable[[str, int, int], None]

_MASK32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- dropout
def draw_dropout_seed(generator: torch.Generator | None) -> int:
    """Draw the one 32-bit seed a dropout call uses from ``generator`` (default generator if None).

    Example:
        >>> g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
        >>> draw_dropout_seed(g1) == draw_dropout_seed(g2)
        True
    """
    return int(torch.randint(0, 2**32, (), generator=generator, dtype=torch.int64))


# Odd multipliers below 2**31: products of 32-bit values stay below 2**63, so int64 never wraps.
_MIX1, _MIX2 = 0x7FEB352D, 0x2C1B3C6D


def _mix32_(x: Tensor) -> Tensor:
    """Multiply-xorshift mixing of 32-bit values held in an int64 tensor, in place."""
    x.mul_(_MIX1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    return x.mul_(_MIX2).bitwise_and_(_MASK32)


def _hash32(x: Tensor) -> Tensor:
    """A full 32-bit hash (mix, then fold the high bits down) of int64 values < 2**32."""
    x = _mix32_(x.clone())
    return x.bitwise_xor_(x >> 16)


def dropout_keep(
    seed: int, p: float, *, batch: int, heads: int, q_idx: Tensor, kv_idx: Tensor
) -> Tensor:
    """Which attention weights dropout keeps, as a pure function of the seed and the indices.

    A 32-bit hash of ``(seed, b * heads + h, i)`` mixed with one of ``j``, compared with
    ``p * 2**32``: independent of the tiling, so full index ranges give the call's whole mask.

    Args:
        seed: the call's seed from :func:`draw_dropout_seed`.
        p: dropout probability in ``[0, 1)``.
        batch, heads: sizes B and Hq of the call.
        q_idx: ``(tq,)`` int64 query positions; kv_idx: ``(tk,)`` int64 key positions.

    Returns:
        Bool tensor ``(batch, heads, tq, tk)``, True = kept.

    Example:
        >>> keep = dropout_keep(7, 0.25, batch=1, heads=2, q_idx=torch.arange(300),
        ...                     kv_idx=torch.arange(300))
        >>> keep.shape, abs(keep.float().mean().item() - 0.75) < 0.01
        (torch.Size([1, 2, 300, 300]), True)
    """
    device = q_idx.device
    bh = torch.arange(batch * heads, device=device, dtype=torch.int64).view(batch, heads, 1, 1)
    row = _hash32(_hash32(bh) ^ (seed & _MASK32))  # (B, H, 1, 1)
    row = _hash32(row ^ q_idx.to(torch.int64).view(1, 1, -1, 1))  # (B, H, tq, 1)
    col = _hash32(kv_idx.to(device=device, dtype=torch.int64).view(1, 1, 1, -1) ^ 0x5BD1E995)
    bits = _mix32_(row ^ col)  # (B, H, tq, tk); the high bits are the well-mixed ones
    return bits >= round(p * 2**32)


# ----------------------------------------------------------------------------- tiles
@dataclass(frozen=True)
class _Plan:
    """Everything a tile needs besides q, k, v and the tensor masks (bool and float)."""

    scale: float
    mod: Callable | None  # causal AND the user's mask mod
    q_block: int
    kv_block: int
    dropout_p: float
    seed: int | None
    acc_dtype: torch.dtype
    tile_hook: TileHook | None
    score_mod: ScoreMod | None = None  # holds the call's tensors; tiles use the Function's inputs

    def q_blocks(self, tq: int) -> Iterator[tuple[int, int]]:
        for qs in range(0, tq, self.q_block):
            yield qs, min(qs + self.q_block, tq)

    def kv_blocks(self, qs: int, qe: int, tk: int) -> Iterator[tuple[int, int]]:
        """Key blocks a query block may reach: all of them, or the mask mod's bounds."""
        lo, hi = _masks.kv_range(self.mod, qs, qe, tk)
        for ks in range(lo, hi, self.kv_block):
            yield ks, min(ks + self.kv_block, hi)


class _TensorMasks(NamedTuple):
    """The call's tensor masks, each ``(B|1, H|1, Tq|1, Tk|1)`` or None, and what changes the
    scores. Inputs of the autograd Function, not parts of the plan, so that ``torch.func.vmap``
    maps a vmapped mask with q, k, v."""

    allowed: Tensor | None  # bool, True = may attend
    bias: Tensor | None  # float, added to the scores
    score_mod: ScoreMod | None = None  # holding the Function's own parameter inputs
    sinks: Tensor | None = None  # (Hq,) or (B|1, Hq|1, Tq) sink logits


def _slice_tile(mask: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """A ``(B|1, H|1, Tq|1, Tk|1)`` mask (or its gradient) cut to one tile, a view; broadcast
    dims stay size 1. ``narrow``, not indexing: see :func:`_backward_tiles`."""
    rows = mask if mask.shape[2] == 1 else mask.narrow(2, qs, qe - qs)
    return rows if rows.shape[3] == 1 else rows.narrow(3, ks, ke - ks)


def _tile_allowed(plan: _Plan, bool_mask: Tensor | None, bias_tile: Tensor | None, shape: tuple,
                  qs: int, qe: int, ks: int, ke: int, device: torch.device) -> Tensor | None:
    """Combined bool mask of one tile (None = everything allowed)."""
    parts = []
    if plan.mod is not None:
        parts.append(_masks.evaluate(plan.mod, q_range=(qs, qe), kv_range=(ks, ke),
                                     batch=shape[0], heads=shape[1], device=device))
    if bool_mask is not None:
        parts.append(_slice_tile(bool_mask, qs, qe, ks, ke))
    if bias_tile is not None:
        parts.append(bias_tile > float("-inf"))
    allowed = _masks.and_masks(*parts)
    return None if allowed is None or (has_values(allowed) and bool(allowed.all())) else allowed


@dataclass
class _Tile:
    """One tile, ready for the online softmax or its backward pass.

    scores: ``(B, Hq, bq, bk)`` scaled scores plus bias, ``-inf`` where blocked.
    q: ``(B, Hq, bq, D)`` query rows, zeroed in rows that may attend no key of the tile.
    k, v: ``(B, Hq, bk, D|Dv)`` key/value rows repeated over a query group, zeroed in key
        columns no query of the tile may attend (NaN padding cannot leak through ``0 * NaN``,
        nor NaN queries of masked rows into ``dK``).
    keep_scale: ``(B, Hq, bq, bk)`` dropout factor ``keep / (1 - p)`` or None.
    raw: ``(B, Hq, bq, bk)`` scaled scores before the score mod (None without one, or with an
        ``in_place`` mod), for the backward pass through it.
    mod_derivative: ``(B, Hq, bq, bk)`` ``d modded / d raw`` of an ``in_place`` score mod
        (:attr:`attnlab.scores.ScoreMod.in_place`), kept instead of ``raw``.
    """

    scores: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    keep_scale: Tensor | None
    raw: Tensor | None = None
    mod_derivative: Tensor | None = None


def _make_tile(plan: _Plan, q_tile: Tensor, k: Tensor, v: Tensor, masks: _TensorMasks,
               qs: int, qe: int, ks: int, ke: int, *, keep_raw: bool = True) -> _Tile | None:
    """Build the tile (qs:qe, ks:ke), or None when its mask allows nothing. ``keep_raw``: keep
    what the backward pass needs of the score mod (the scores before it, or an ``in_place``
    mod's derivative)."""
    B, Hq = q_tile.shape[:2]
    bool_mask, bias, score_mod, _ = masks
    bias_tile = None if bias is None else _slice_tile(bias, qs, qe, ks, ke).to(plan.acc_dtype)
    allowed = _tile_allowed(plan, bool_mask, bias_tile, (B, Hq), qs, qe, ks, ke, q_tile.device)
    if allowed is not None and has_values(allowed) and not bool(allowed.any()):
        return None
    k_tile = repeat_kv(k[:, :, ks:ke].to(plan.acc_dtype), Hq)  # (B, Hq, bk, D)
    v_tile = repeat_kv(v[:, :, ks:ke].to(plan.acc_dtype), Hq)  # (B, Hq, bk, Dv)
    if allowed is not None:
        col_live = allowed.any(dim=-2, keepdim=True).transpose(-2, -1)  # (B|1, H|1, bk|1, 1)
        if not (has_values(col_live) and bool(col_live.all())):
            k_tile = torch.where(col_live, k_tile, 0.0)
            v_tile = torch.where(col_live, v_tile, 0.0)
        row_live = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, bq|1, 1)
        if not (has_values(row_live) and bool(row_live.all())):
            q_tile = torch.where(row_live, q_tile, 0.0)
    attn_scores = torch.matmul(q_tile, k_tile.transpose(-2, -1)).mul_(plan.scale)  # (B,Hq,bq,bk)
    raw = derivative = None
    if score_mod is not None and score_mod.in_place:  # e.g. softcap: evaluated once, in place
        attn_scores = score_mod.apply_in_place(attn_scores)
        derivative = score_mod.derivative(attn_scores) if keep_raw else None
    elif score_mod is not None:
        raw = attn_scores
        attn_scores = apply_tile(score_mod, raw, q_start=qs, kv_start=ks).to(plan.acc_dtype, copy=True)
    if bias_tile is not None:
        attn_scores = attn_scores.add_(bias_tile)
    if allowed is not None:
        attn_scores = attn_scores.masked_fill_(~allowed, float("-inf"))
    keep_scale = None
    if plan.dropout_p > 0.0:
        keep = dropout_keep(
            plan.seed, plan.dropout_p, batch=B, heads=Hq,
            q_idx=torch.arange(qs, qe, device=q_tile.device),
            kv_idx=torch.arange(ks, ke, device=q_tile.device),
        )
        keep_scale = keep.to(plan.acc_dtype).div_(1.0 - plan.dropout_p)
    return _Tile(attn_scores, q_tile, k_tile, v_tile, keep_scale, raw, derivative)


def _tiles(plan: _Plan, q_tile: Tensor, k: Tensor, v: Tensor, masks: _TensorMasks,
           qs: int, qe: int, stage: str) -> Iterator[tuple[int, int, _Tile]]:
    """The non-empty tiles of one query block, reported to the tile hook."""
    for ks, ke in plan.kv_blocks(qs, qe, k.shape[2]):
        tile = _make_tile(plan, q_tile, k, v, masks, qs, qe, ks, ke, keep_raw=stage != "forward")
        if tile is None:
            continue
        if plan.tile_hook is not None:
            plan.tile_hook(stage, qs, ks)
        yield ks, ke, tile


# ----------------------------------------------------------------------------- forward
def _forward_tiles(plan: _Plan, q: Tensor, k: Tensor, v: Tensor,
                   masks: _TensorMasks) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Online-softmax forward. Returns out ``(B, Hq, Tq, Dv)``, lse ``(B, Hq, Tq)``, the lse in
    two parts for the backward (:func:`attnlab.backends._lse.online_finish`, ``(B, Hq, Tq, 2)``) and, for fp16/bf16
    inputs, out before its rounding to their dtype (else None): the backward's
    ``D_i = rowsum(dO * O)`` from the rounded out would carry each row's rounding into every
    score's gradient, which a score-mod tensor (ALiBi's slope) multiplies by its distance."""
    B, Hq, Tq, _ = q.shape
    Dv = v.shape[-1]
    out = q.new_empty(B, Hq, Tq, Dv, dtype=plan.acc_dtype)
    lse = torch.empty(B, Hq, Tq, dtype=plan.acc_dtype, device=q.device)
    parts = torch.empty(B, Hq, Tq, 2, dtype=plan.acc_dtype, device=q.device)
    for qs, qe in plan.q_blocks(Tq):
        q_tile = q[:, :, qs:qe].to(plan.acc_dtype)  # (B, Hq, bq, D)
        state = online_start((B, Hq, qe - qs), Dv, plan.acc_dtype, q.device)
        for _, _, tile in _tiles(plan, q_tile, k, v, masks, qs, qe, "forward"):
            state = online_step(state, tile.scores, tile.v, tile.keep_scale)
        sink = None if masks.sinks is None else _sink_rows(masks.sinks, plan, qs, qe)  # (B|1, Hq|1, bq|1)
        out[:, :, qs:qe], lse[:, :, qs:qe], parts[:, :, qs:qe] = online_finish(state, sink)
    return (out, lse, parts, None) if out.dtype == q.dtype else (out.to(q.dtype), lse, parts, out)


def _sink_rows(sinks: Tensor, plan: _Plan, qs: int, qe: int) -> Tensor:
    """The sink logits of queries ``qs:qe``, ``(B|1, Hq|1, bq|1)`` in the accumulation dtype
    (infinite ones as :func:`attnlab.scores.sink_logits` says)."""
    logits = sink_logits(sinks, plan.acc_dtype)  # (B|1, Hq|1, Tq|1)
    return logits if logits.shape[2] == 1 else logits.narrow(2, qs, qe - qs)


# ----------------------------------------------------------------------------- backward
def _reduce_to(t: Tensor, shape: tuple) -> Tensor:
    """Sum ``t`` over the dims where ``shape`` has size 1 (undo broadcasting)."""
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and t.shape[d] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t


def _backward_tiles(plan: _Plan, saved: tuple, masks: _TensorMasks, d_out: Tensor,
                    need_bias_grad: bool, need_sinks_grad: bool = False,
                    need_params: frozenset = frozenset()) -> tuple:
    """FlashAttention-2 backward by recomputation; grads in the accumulation dtype.

    Returns dq, dk, dv, the float mask's gradient, the sinks' gradient per row ``(B, Hq, Tq)``
    (``-p_sink * D_i``; ``lse`` includes the sinks) and each score-mod tensor's gradient (None
    where not needed; tile by tile, :func:`_through_mod`). Buffers come from ``d_out`` and rows
    are cut with ``narrow``, so that batched gradcheck's vmap applies.
    """
    q, k, v, out, lse = saved
    bias = masks.bias
    B, Hkv = k.shape[:2]
    d_params = [torch.zeros_like(p, dtype=plan.acc_dtype) if i in need_params else None
                for i, p in enumerate(masks.score_mod.params() if masks.score_mod is not None else ())]
    d_sinks = (d_out.new_zeros(d_out.shape[:3], dtype=plan.acc_dtype)  # per row (B, Hq, Tq)
               if masks.sinks is not None and need_sinks_grad else None)
    dq = d_out.new_zeros(q.shape, dtype=plan.acc_dtype)  # (B, Hq, Tq, D)
    dk = d_out.new_zeros(k.shape, dtype=plan.acc_dtype)  # (B, Hkv, Tk, D)
    dv = d_out.new_zeros(v.shape, dtype=plan.acc_dtype)  # (B, Hkv, Tk, Dv)
    d_bias = d_out.new_zeros(bias.shape, dtype=plan.acc_dtype) if need_bias_grad else None
    for qs, qe in plan.q_blocks(q.shape[2]):
        q_tile = q[:, :, qs:qe].to(plan.acc_dtype)  # (B, Hq, bq, D)
        do_tile = d_out.narrow(2, qs, qe - qs).to(plan.acc_dtype)  # (B, Hq, bq, Dv)
        delta = row_delta(do_tile, out[:, :, qs:qe], plan.acc_dtype).unsqueeze(-1)  # (B, Hq, bq, 1)
        shift, rest = row_parts(lse, qs, qe)  # (B, Hq, bq, 1) each: P = exp(S - shift - rest)
        if d_sinks is not None:
            sink = _sink_rows(masks.sinks, plan, qs, qe).unsqueeze(-1)  # (B|1, Hq|1, bq|1, 1)
            d_sinks.narrow(2, qs, qe - qs).add_(sink_row_gradient(sink - shift, rest, delta).squeeze(-1))
        for ks, ke, tile in _tiles(plan, q_tile, k, v, masks, qs, qe, "backward"):
            probs = torch.exp_(tile.scores.sub_(shift).sub_(rest))  # (B, Hq, bq, bk)
            kept = probs if tile.keep_scale is None else probs * tile.keep_scale
            d_values = torch.matmul(kept.transpose(-2, -1), do_tile)  # (B, Hq, bk, Dv)
            dv.narrow(2, ks, ke - ks).add_(sum_kv_groups(d_values, Hkv))
            d_probs = torch.matmul(do_tile, tile.v.transpose(-2, -1))  # (B, Hq, bq, bk)
            if tile.keep_scale is not None:
                d_probs = d_probs.mul_(tile.keep_scale)
            d_scores = score_gradient_(probs, d_probs, delta)  # dS = P * (dP - D_i), in dP
            if d_bias is not None:
                _slice_tile(d_bias, qs, qe, ks, ke).add_(_reduce_to(d_scores, bias.shape))
            if tile.mod_derivative is not None:  # an in-place mod: its derivative was kept
                d_scores = d_scores.mul_(tile.mod_derivative)
            elif tile.raw is not None:
                d_scores = _through_mod(masks.score_mod, tile.raw, d_scores, qs, ks, d_params)
            dq.narrow(2, qs, qe - qs).add_(torch.matmul(d_scores, tile.k))
            d_keys = torch.matmul(d_scores.transpose(-2, -1), tile.q)  # (B, Hq, bk, D)
            dk.narrow(2, ks, ke - ks).add_(sum_kv_groups(d_keys, Hkv))
    return dq.mul_(plan.scale), dk.mul_(plan.scale), dv, d_bias, d_sinks, d_params


def _through_mod(mod: ScoreMod, raw: Tensor, d_scores: Tensor, qs: int, ks: int, d_params: list) -> Tensor:
    """The gradient of one tile's raw scores ``(B, Hq, bq, bk)`` from that of the modded scores,
    adding the gradient of each of the mod's tensors that needs one into ``d_params``.

    The mod is evaluated again on the tile with autograd and differentiated there, so any mod
    (a user's function included) gets its exact gradient; an additive mod passes ``d_scores``
    through unchanged and is only differentiated for its tensors."""
    wanted = [d is not None for d in d_params]
    if mod.additive and not any(wanted):
        return d_scores
    with torch.enable_grad():
        raw = raw.detach().requires_grad_(not mod.additive)
        params = [p.detach().requires_grad_(want) for p, want in zip(mod.params(), wanted)]
        modded = apply_tile(mod.with_params(params), raw, q_start=qs, kv_start=ks)
        inputs = ([] if mod.additive else [raw]) + [p for p, want in zip(params, wanted) if want]
        grads = list(torch.autograd.grad(modded, inputs, d_scores.to(modded.dtype), allow_unused=True))
    d_raw = d_scores if mod.additive else grads.pop(0)
    for i, want in enumerate(wanted):
        if want:
            grad = grads.pop(0)
            if grad is not None:
                d_params[i].add_(grad)
    return d_scores if d_raw is None else d_raw.to(d_scores.dtype)


def _chunked_forward(plan: _Plan, q, k, v, allowed, bias, sinks, *params):
    """The kernel's forward: out, lse, the lse's parts and the unrounded out (see :func:`_forward_tiles`)."""
    return _forward_tiles(plan, q, k, v, _masks_of(allowed, bias, sinks, plan, params))


def _chunked_gradients(plan: _Plan, needs: frozenset, d_out: Tensor, tensors: tuple, outputs: tuple) -> tuple:
    """The gradients of q, k, v, the bool mask (None), the float mask, the sinks and each score-mod
    tensor, in the inputs' dtypes (None where not needed); the backward recomputes tile by tile."""
    q, k, v, allowed, bias, sinks, *params = tensors
    out, _, parts, unrounded = outputs
    masks = _masks_of(allowed, bias, sinks, plan, params)
    need_params = frozenset(i - 6 for i in needs if i >= 6)
    saved = (q, k, v, out if unrounded is None else unrounded, parts)
    dq, dk, dv, d_bias, d_sinks, d_params = _backward_tiles(
        plan, saved, masks, d_out, bias is not None and 4 in needs, sinks is not None and 5 in needs, need_params)
    d_bias = None if d_bias is None else d_bias.to(bias.dtype)
    d_sinks = None if d_sinks is None else sink_gradient(d_sinks, sinks)  # summed to the sinks' shape
    d_params = [None if d is None else d.to(p.dtype) for d, p in zip(d_params, params)]
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, d_bias, d_sinks, *d_params)


def _masks_of(allowed, bias, sinks, plan: _Plan, params: tuple) -> _TensorMasks:
    """The Function's inputs as one :class:`_TensorMasks`, the score mod holding ``params``."""
    mod = None if plan.score_mod is None else plan.score_mod.with_params(params)
    return _TensorMasks(allowed, bias, mod, sinks)


# ``apply(plan, q, k, v, allowed, bias, sinks, *score-mod tensors)``: saves its inputs, out and
# the lse; the backward recomputes tile by tile (a Function of its own, for torch.func).
_ChunkedFunction = kernel_function("chunked", _chunked_forward, _chunked_gradients)


# ----------------------------------------------------------------------------- entry points
def chunked_attention(
    call: AttentionCall,
    *,
    q_block: int | None = None,
    kv_block: int | None = None,
    tile_hook: TileHook | None = None,
) -> AttentionResult:
    """Attention for ``call`` by tiles with an online softmax; O(T·D) memory forward and backward.

    Shapes:
        call.q ``(B, Hq, Tq, D)``, call.k ``(B, Hkv, Tk, D)``, call.v ``(B, Hkv, Tk, Dv)``
        -> out ``(B, Hq, Tq, Dv)`` (input dtype), lse ``(B, Hq, Tq)`` (fp32 for fp16/bf16/fp32
        inputs, fp64 for fp64; ``-inf`` on rows with nothing to attend).

    Args:
        call: a validated call from :func:`attnlab.backends.build_call`.
        q_block: queries per tile (default :data:`DEFAULT_Q_BLOCK`).
        kv_block: keys per tile (default :data:`DEFAULT_KV_BLOCK`). Block sizes change
            results only by rounding.
        tile_hook: called as ``tile_hook(stage, q_start, kv_start)`` for every tile computed,
            with ``stage`` ``"forward"`` or ``"backward"``; skipped tiles are not reported.

    Returns:
        :class:`AttentionResult` with ``out`` and ``lse`` (no weights; rebuild them with
        :func:`attnlab.attention_weights` from ``lse``).

    Example:
        >>> from attnlab.backends import build_call
        >>> x = torch.randn(1, 1, 9, 4, dtype=torch.float64)
        >>> visited = []
        >>> r = chunked_attention(build_call(x, x, x, causal=True), q_block=3, kv_block=3,
        ...                       tile_hook=lambda *t: visited.append(t))
        >>> len(visited)   # 6 of the 9 tiles lie on or below the diagonal
        6
        >>> torch.allclose(r.out[0, 0, 0], x[0, 0, 0])   # the first query sees only itself
        True
    """
    return _run_plan(call, _plan_of(call, q_block, kv_block, tile_hook))


def _run_plan(call: AttentionCall, plan: _Plan) -> AttentionResult:
    """The tiles of ``call`` under ``plan`` (made for its signature, :meth:`ChunkedBackend.plan`,
    or for this call by :func:`_plan_of`): the call's own dropout seed (drawn here unless the
    plan has it) and score mod go in, nothing else is decided."""
    if (call.dropout_p > 0.0 and plan.seed is None) or call.score_mod is not plan.score_mod:
        seed = draw_dropout_seed(call.generator) if call.dropout_p > 0.0 and plan.seed is None else plan.seed
        plan = dataclasses.replace(plan, seed=seed, score_mod=call.score_mod)
    params = call.score_mod.params() if call.score_mod is not None else ()
    bool_mask = call.mask if call.mask_kind == "bool" else None
    bias = call.mask if call.mask_kind == "float" else None
    out, lse, *_ = _ChunkedFunction.apply(plan, call.q, call.k, call.v, bool_mask, bias, call.sinks, *params)
    return AttentionResult(out=out, lse=lse)


def chunked_gradients(
    call: AttentionCall,
    *,
    out: Tensor,
    lse: Tensor,
    d_out: Tensor,
    q_block: int | None = None,
    kv_block: int | None = None,
    tile_hook: TileHook | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``call.q``, ``call.k``, ``call.v`` from ``d_out``, given ``out`` and ``lse``.

    The FlashAttention-2 backward, tile by tile. With a larger attention's ``out`` and ``lse``
    (ring attention's global rows) it gives this key block's share of the gradients.

    Shapes:
        out ``(B, Hq, Tq, Dv)``, lse ``(B, Hq, Tq)``, d_out ``(B, Hq, Tq, Dv)`` ->
        dq ``(B, Hq, Tq, D)``, dk ``(B, Hkv, Tk, D)``, dv ``(B, Hkv, Tk, Dv)``, all in the
        accumulation dtype (fp32 for fp16/bf16, else the input dtype). No dropout, float mask or
        sinks; a score mod only when none of its tensors requires grad (they get no gradient here).

    Example:
        >>> from attnlab.backends import build_call
        >>> q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
        >>> r = chunked_attention(build_call(q, k, v, causal=True))
        >>> d_out = torch.randn_like(r.out)
        >>> dq, dk, dv = chunked_gradients(build_call(q, k, v, causal=True), out=r.out.detach(),
        ...                                lse=r.lse, d_out=d_out)
        >>> expected = torch.autograd.grad(r.out, (q, k, v), d_out)
        >>> all(torch.allclose(a, b) for a, b in zip((dq, dk, dv), expected))
        True
    """
    learnable_mod = call.score_mod is not None and any(p.requires_grad for p in call.score_mod.params())
    if call.dropout_p > 0.0 or call.mask_kind == "float" or learnable_mod or call.sinks is not None:
        raise ValueError("chunked_gradients serves calls without dropout, a float mask, sinks or a score "
                         "mod with tensors that require grad")
    plan = _plan_of(call, q_block, kv_block, tile_hook)
    saved = (call.q, call.k, call.v, out, lse)
    dq, dk, dv, *_ = _backward_tiles(plan, saved, _tensor_masks(call), d_out, False)
    return dq, dk, dv


def _plan_of(call: AttentionCall, q_block: int | None, kv_block: int | None,
             tile_hook: TileHook | None) -> _Plan:
    return _Plan(
        scale=call.scale,
        mod=call.mask_mod(),
        q_block=positive_int("q_block", DEFAULT_Q_BLOCK if q_block is None else q_block),
        kv_block=positive_int("kv_block", DEFAULT_KV_BLOCK if kv_block is None else kv_block),
        dropout_p=call.dropout_p,
        seed=draw_dropout_seed(call.generator) if call.dropout_p > 0.0 else None,
        acc_dtype=score_dtype(call.dtype),
        tile_hook=tile_hook,
        score_mod=call.score_mod,
    )


def _tensor_masks(call: AttentionCall) -> _TensorMasks:
    return _TensorMasks(call.mask if call.mask_kind == "bool" else None, call.bias(), call.score_mod,
                        call.sinks)


class ChunkedBackend(Backend):
    """Tiled online-softmax attention (FlashAttention's algorithm); every mask, O(T) memory.

    Example:
        >>> import attnlab
        >>> q = torch.randn(2, 3, 40, 8)
        >>> out = attnlab.attention(q, q, q, mask=lambda b, h, i, j: (i - j).abs() < 4,
        ...                         backend="chunked")
        >>> out.shape
        torch.Size([2, 3, 40, 8])
    """

    name = "chunked"
    plan_fixes_tk = False  # its plan reads no key length
    memory = "linear"
    description = (
        "tiled online softmax (FlashAttention-2 forward and backward in PyTorch); any mask, "
        "any score mod and sinks (with gradients), dropout, GQA; skips masked tiles; O(T) memory"
    )

    def cost(self, call: AttentionCall) -> float:
        return _estimated_seconds(call)

    def limits(self, call: AttentionCall) -> list[str]:
        """A score mod that closes over a tensor requiring grad it does not declare."""
        if call.score_mod is not None and torch.is_grad_enabled() and captures_grad(call.score_mod):
            return ["chunked differentiates a score mod tile by tile and must know its tensors: this "
                    "function closes over a tensor that requires grad (declare it with "
                    "attnlab.scores.function(make, params=[...]))"]
        return []

    def plan(self, call: AttentionCall) -> _Plan:
        """Tile sizes, the mask mod (causal folded in), the accumulation dtype: per signature.
        The dropout seed and the score mod (which may hold the caller's tensors) are the call's.

        Example:
            >>> from attnlab.backends import build_call
            >>> q = torch.randn(1, 1, 4, 8)
            >>> ChunkedBackend().plan(build_call(q, q, q, causal=True)).q_block
            256
        """
        return _Plan(scale=call.scale, mod=call.mask_mod(), q_block=DEFAULT_Q_BLOCK, kv_block=DEFAULT_KV_BLOCK,
                     dropout_p=call.dropout_p, seed=None, acc_dtype=score_dtype(call.dtype), tile_hook=None)

    def execute(self, call: AttentionCall, plan: _Plan) -> AttentionResult:
        return _run_plan(call, plan)

    def forward(self, call: AttentionCall) -> AttentionResult:
        return chunked_attention(call)




def _visited_keys(call: AttentionCall, q_block: int, kv_block: int) -> tuple[int, int]:
    """Keys summed over query rows, and the number of tiles, after skipping by kv_bounds."""
    mod = call.mask_mod()
    keys = tiles = 0
    for qs in range(0, call.tq, q_block):
        qe = min(qs + q_block, call.tq)
        lo, hi = _masks.kv_range(mod, qs, qe, call.tk)
        keys += (qe - qs) * (hi - lo)
        tiles += math.ceil((hi - lo) / kv_block)
    return keys, tiles


def _estimated_seconds(call: AttentionCall) -> float:
    """Expected wall time in seconds on the CPU the rates were measured on (the unit of every cost).

    Tiles that ``kv_bounds`` rules out (causal, sliding window) are not counted; a dense mask
    is assumed to leave every tile alive.
    """
    rates = RATES["chunked"]
    keys, tiles = _visited_keys(call, DEFAULT_Q_BLOCK, DEFAULT_KV_BLOCK)
    flops = 2 * call.batch * call.q_heads * keys * (call.head_dim + call.value_dim)
    seconds = flops / rates["forward_flops_per_s"] + tiles * rates["seconds_per_tile"]
    seconds *= rates["mask_factor"][call.mask_kind]
    if call.dropout_p > 0.0:
        seconds *= rates["dropout_factor"]
    return seconds * (rates["forward_backward_factor"] if call.requires_grad else 1.0)


register(ChunkedBackend())
