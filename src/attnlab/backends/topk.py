"""Exact top-k sparse attention: each query attends to its own listed keys (``attention(indices=...)``).

Query ``i`` attends to the keys ``indices[..., i, :]`` that the call's mask and ``causal`` also
allow (the intersection: DeepSeek-V3.2 passes the causal/padding mask with top-k lists that may
name masked keys when a row has fewer than k valid ones). ``-1`` means "no key" (FlashMLA's
padding); a key listed twice counts once (a set, as a bool mask scattered from the list is).

Nothing of size ``(Tq, Tk)`` is built: the pairs are a sparse pattern with ``k`` entries per
query row. The scores are a sampled matrix product at those pairs (``torch.sparse.sampled_addmm``),
the weighted sum of values is an ``F.embedding_bag`` with the weights as per-sample weights, so
the selected keys are never copied out either; memory is O(B·H·Tq·k) for the scores and
weights plus O(T·D) for the inputs. The backward is analytic (the softmax gradient at the
pairs) with the same two primitives; key and value gradients sum each key's bag of queries,
the pairs sorted by key once per distinct list and one ``embedding_bag`` per gradient over every
(batch, head). The causal rule is evaluated once per distinct list. Keys that are not listed are never read;
a listed key the mask blocks enters with weight 0 (NaN stored there reaches the output, as
with the fused kernels, docs/contract.md "Non-finite values").

Example:
    >>> import torch
    >>> from attnlab._call import build_call
    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> idx = torch.tensor([[0, -1], [0, 1], [1, 1], [2, 3]]).view(1, 1, 4, 2)   # (B, H, Tq, k)
    >>> call = build_call(q, k, v, causal=True)
    >>> out, _ = topk_attention(call, check_indices(idx, call, rank=4))
    >>> bool(torch.allclose(out[:, :, 0], v[:, :, 0]))      # query 0 sees key 0 alone
    True
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._call import AttentionCall
from attnlab._checks import has_values, integer_dtype
from attnlab._math import repeat_kv, score_dtype, sum_kv_groups
from attnlab.masks import apply_mod
from attnlab.scores import sink_gradient, sink_logits

__all__ = ["check_indices", "indices_mask", "topk_attention", "refusal"]


def check_indices(indices: object, call: AttentionCall, *, rank: int) -> Tensor:
    """``indices`` checked against the call and laid out 4-D ``(B|1, Hkv|1, Tq, k)``, int64.

    Args:
        indices: integer tensor ``(..., Tq, k)`` in the layout of the user's q of rank ``rank``
            (2 to 5); leading dims may be fewer (they align from the right) and each is 1 or
            the call's size, the head dim 1 or ``Hkv``.
        call: the validated call.
        rank: the rank of the user's q.

    Raises:
        TypeError: not a tensor, or not a signed integer dtype.
        ValueError: wrong rank or sizes, ``k > Tk``, another device, or values outside
            ``[-1, Tk)`` (one min/max read of the values).

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(2, 3, 5, 4)
        >>> check_indices(torch.zeros(5, 2, dtype=torch.long), build_call(q, q, q), rank=4).shape
        torch.Size([1, 1, 5, 2])
    """
    if not isinstance(indices, Tensor):
        raise TypeError(f"indices must be an integer tensor (..., Tq, k), got {type(indices).__name__}")
    integer_dtype("indices", indices)
    if indices.device != call.device:
        raise ValueError(f"indices must be on q's device {call.device}, got {indices.device}")
    shape = tuple(indices.shape)
    if not 2 <= indices.ndim <= rank:
        raise ValueError(f"indices must have rank 2 to {rank} (..., Tq, k) like q, got shape {shape}")
    idx = indices.reshape((1,) * (rank - indices.ndim) + shape)
    lead = rank - (2 if rank <= 3 else 3)  # the batch dims
    expected = (*call.batch_shape, *((call.kv_heads,) if rank >= 4 else ()), call.tq)
    for axis, (got, want) in enumerate(zip(idx.shape[:-1], expected)):
        if got != want and (got != 1 or axis == len(expected) - 1):
            what = "Tq" if axis == len(expected) - 1 else ("heads (Hkv or 1)" if axis == lead else "batch")
            raise ValueError(f"indices of shape {shape} does not fit (..., Hkv, Tq, k) = "
                             f"({', '.join(map(str, expected))}, k): its {what} dim is {got}, expected {want}")
    if idx.shape[-1] > call.tk:
        raise ValueError(f"indices selects k={idx.shape[-1]} keys per query but there are only Tk={call.tk} keys")
    _check_values(idx, call.tk)
    return _to_4d(idx, rank, call.batch_shape).long()


def _check_values(idx: Tensor, tk: int) -> None:
    """One min/max read: every entry in ``[-1, Tk)``."""
    if idx.numel() == 0 or not has_values(idx):
        return
    low, high = (int(x) for x in torch.aminmax(idx))
    if low < -1 or high >= tk:
        bad = low if low < -1 else high
        raise ValueError(f"indices must hold key positions in [0, Tk={tk}) or -1 for no key, got {bad}")


def _to_4d(idx: Tensor, rank: int, batch: tuple) -> Tensor:
    if rank == 2:
        return idx[None, None]  # (1, 1, Tq, k)
    if rank == 3:
        return idx[:, None]  # (B|1, 1, Tq, k)
    if rank == 5:
        if idx.shape[:2] == (1, 1):
            return idx[0]  # (1, H|1, Tq, k): shared by every batch row
        return idx.expand(*batch, *idx.shape[2:]).flatten(0, 1)  # (A*B, H|1, Tq, k)
    return idx


def refusal(call: AttentionCall, backend: str) -> str | None:
    """Why a call with ``indices`` cannot be served, in words naming the option, or None.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> refusal(build_call(q, q, q, dropout_p=0.1), "auto")
        'dropout_p=0.1 is not supported with indices (top-k attention has no dropout)'
    """
    if backend not in ("auto", "reference"):
        return (f"backend={backend!r} cannot serve a call with indices: use 'auto' (the gathered top-k "
                f"kernel) or 'reference' (the dense fp64 oracle, O(Tq*Tk) memory)")
    if call.dropout_p > 0:
        return f"dropout_p={call.dropout_p} is not supported with indices (top-k attention has no dropout)"
    if backend == "auto" and call.score_mod is not None:
        return ("score_mod is not supported with indices on backend='auto' (the top-k kernel has no score "
                "mod); backend='reference' applies it on the dense scores")
    if backend == "auto" and call.mask_kind == "float" and call.mask.requires_grad:
        return "mask requires grad: the top-k kernel does not differentiate a float mask (pass mask.detach())"
    return None


def indices_mask(indices: Tensor, tk: int) -> Tensor:
    """The dense bool mask ``(..., Tq, Tk)`` of the listed keys (-1 entries skipped): O(Tq*Tk).

    What the reference path and the tests compare against; the top-k kernel never builds it.

    Example:
        >>> indices_mask(torch.tensor([[1, -1], [0, 0]]), 3).int()
        tensor([[0, 1, 0],
                [1, 0, 0]], dtype=torch.int32)
    """
    listed = torch.zeros(*indices.shape[:-1], tk + 1, dtype=torch.bool, device=indices.device)
    listed.scatter_(-1, torch.where(indices < 0, tk, indices), True)  # -1 lands in the extra column
    return listed[..., :tk]


@dataclass(frozen=True)
class _Pattern:
    """The pairs of one call: ``cols (B, Hq, Tq, k)`` key positions (0 where none), the distinct
    lists they expand ``lists (B|1, Hkv|1, Tq, k)``, ``allowed`` (broadcasts to cols) and the float
    mask at the pairs (or None)."""

    cols: Tensor
    lists: Tensor
    allowed: Tensor
    bias: Tensor | None


def _pattern(call: AttentionCall, idx: Tensor) -> _Pattern:
    """Deduplicate the lists (sorted, so a repeat follows its first), then AND the mask at the pairs.

    The causal rule reads only positions, so it is evaluated once per distinct list; any other
    mask mod once per (batch, query head)."""
    listed = idx.sort(dim=-1).values  # (B|1, Hkv|1, Tq, k)
    allowed = listed >= 0
    allowed[..., 1:] &= listed[..., 1:] != listed[..., :-1]  # a repeated key counts once
    # int32 positions where they fit: half the memory per pair, and every primitive here takes them
    small = call.batch * call.kv_heads * call.tk < 2**31
    lists = listed.clamp(min=0).to(torch.int32 if small else torch.int64)
    del listed
    mod = call.mask_mod()  # causal and a mask mod, one mechanism
    q_idx = torch.arange(call.tq, device=call.device).view(1, 1, -1, 1)
    if call.mask_form == "causal":  # positions only: once per distinct list
        allowed &= torch.as_tensor(apply_mod(mod, 0, 0, q_idx, lists), device=call.device)
        mod = None
    cols = lists
    if cols.shape[1] > 1:  # per kv head: one list per query head
        cols, allowed = repeat_kv(cols, call.q_heads), repeat_kv(allowed, call.q_heads)  # (B|1, Hq, Tq, k)
    if mod is not None:
        b = torch.arange(call.batch, device=call.device).view(-1, 1, 1, 1)
        h = torch.arange(call.q_heads, device=call.device).view(1, -1, 1, 1)
        allowed = allowed & torch.as_tensor(apply_mod(mod, b, h, q_idx, cols), device=call.device)
    bias = None
    if isinstance(call.mask, Tensor):
        at_pairs = _gather_mask(call.mask, cols)
        if call.mask.dtype == torch.bool:
            allowed = allowed & at_pairs
        else:
            bias = at_pairs
    cols = cols.expand(call.batch, call.q_heads, call.tq, cols.shape[-1])  # (B, Hq, Tq, k)
    return _Pattern(cols=cols, lists=lists, allowed=allowed, bias=bias)


def _gather_mask(mask: Tensor, cols: Tensor) -> Tensor:
    """A mask ``(B|1, H|1, Tq|1, Tk|1)`` read at the pairs: ``(B|., H|., Tq, k)``."""
    if mask.shape[-1] == 1:
        return mask  # the same for every key
    batch, heads = max(mask.shape[0], cols.shape[0]), max(mask.shape[1], cols.shape[1])
    full = mask.expand(batch, heads, cols.shape[2], mask.shape[-1])  # stride-0 views, nothing copied
    return full.gather(-1, cols.long().expand(batch, heads, *cols.shape[2:]))


def _csr(cols: Tensor) -> tuple[Tensor, Tensor]:
    """The pairs as a batched CSR pattern's ``crow (B*Hq, Tq+1)`` and ``col (B*Hq, Tq*k)``, k entries per row."""
    B, H, Tq, K = cols.shape
    crow = torch.arange(0, Tq * K + 1, K, dtype=cols.dtype, device=cols.device).expand(B * H, Tq + 1)  # (B*H, Tq+1)
    return crow.contiguous(), cols.reshape(B * H, Tq * K)


def _sampled(csr: tuple[Tensor, Tensor], a: Tensor, b: Tensor, *, alpha: float = 1.0) -> Tensor:
    """``alpha * (a @ b^T)`` at the pairs: a ``(B, Hq, Tq, X)``, b ``(B, Hq, Tk, X)`` -> ``(B, Hq, Tq, k)``.

    Written into a fresh zero-valued pattern (``out=``, so the pattern is not copied; its values
    must be zeros: ``beta=0`` still carries a NaN there)."""
    B, H, Tq, X = a.shape
    crow, col = csr
    with warnings.catch_warnings():  # "sparse CSR support is in beta": an implementation detail here
        warnings.simplefilter("ignore", UserWarning)
        product = torch.sparse_csr_tensor(crow, col, a.new_zeros(col.shape), size=(B * H, Tq, b.shape[2]),
                                          check_invariants=False)
        torch.sparse.sampled_addmm(product, a.reshape(B * H, Tq, X), b.reshape(B * H, -1, X).transpose(1, 2),
                                   beta=0.0, alpha=alpha, out=product)
    return product.values().view(B, H, Tq, -1)


def _bag_rows(cols: Tensor, kv_heads: int, tk: int) -> Tensor:
    """Row numbers into a ``(B*Hkv*Tk, X)`` table: ``(B*Hq*Tq, k)``."""
    B, H, Tq, K = cols.shape
    head = torch.arange(H, dtype=cols.dtype, device=cols.device) // (H // kv_heads)
    base = (torch.arange(B, dtype=cols.dtype, device=cols.device).view(-1, 1) * kv_heads + head) * tk  # (B, Hq)
    return (cols + base.view(B, H, 1, 1)).reshape(B * H * Tq, K)


def _weighted_rows(rows: Tensor, table: Tensor, weights: Tensor) -> Tensor:
    """``sum_j weights[r, j] * table[rows[r, j]]`` per row r, without copying the rows out."""
    return F.embedding_bag(rows, table, per_sample_weights=weights.reshape(rows.shape), mode="sum")


def _softmax(call: AttentionCall, scores: Tensor) -> tuple[Tensor, Tensor | None]:
    """Weights ``(B, Hq, Tq, k)`` (empty rows zero) and the sinks' share ``(B, Hq, Tq)`` or None
    (sinks per head or per query; infinite ones as :func:`attnlab.scores.sink_logits` says)."""
    if call.sinks is None:
        return _row_softmax(scores), None
    logits = sink_logits(call.sinks, scores.dtype)  # (B|1, Hq|1, Tq|1)
    column = logits.unsqueeze(-1).expand(*scores.shape[:-1], 1)  # (B, Hq, Tq, 1)
    both = _row_softmax(torch.cat([scores, column], dim=-1))  # (B, Hq, Tq, k + 1)
    return both[..., :-1], both[..., -1]


def _row_softmax(scores: Tensor) -> Tensor:
    """:func:`attnlab._math.softmax_rows` without autograd (the backward here is analytic), so in
    place: a row of ``-inf`` gives zeros, a NaN propagates."""
    empty = scores.amax(dim=-1, keepdim=True) == float("-inf")  # (B, Hq, Tq, 1)
    return torch.softmax(scores, dim=-1).masked_fill_(empty, 0.0)


class _TopK(torch.autograd.Function):
    """Forward and analytic backward at the pairs; saves the weights (O(T·k)), never the scores' inputs."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call, pattern):
        work = score_dtype(q.dtype)
        qw, kw, vw = (t.to(work) for t in (q, k, v))
        B, Hq, Tq, _ = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        csr = _csr(pattern.cols)
        scores = _sampled(csr, qw, repeat_kv(kw, Hq), alpha=call.scale)  # (B, Hq, Tq, k)
        if pattern.bias is not None:
            scores += pattern.bias.to(work)
        scores.masked_fill_(~pattern.allowed, float("-inf"))
        weights, sink_share = _softmax(call, scores)
        rows = _bag_rows(pattern.cols, Hkv, Tk)
        out = _weighted_rows(rows, vw.reshape(B * Hkv * Tk, -1), weights).view(B, Hq, Tq, -1)  # (B, Hq, Tq, Dv)
        ctx.save_for_backward(qw, kw, vw, weights, out, sinks, sink_share)
        ctx.extra = (call.scale, pattern.lists, csr, rows, q.dtype)
        ctx.mark_non_differentiable(weights)
        return out.to(q.dtype), weights

    @staticmethod
    def backward(ctx, grad_out, _grad_weights):
        qw, kw, vw, weights, out, sinks, sink_share = ctx.saved_tensors
        scale, lists, csr, rows, dtype = ctx.extra
        B, Hq, Tq, _ = qw.shape
        Hkv, Tk = kw.shape[1], kw.shape[2]
        dout = grad_out.to(qw.dtype).contiguous()  # an expanded grad (out.sum()) reads slowly as a table
        delta = (dout.unsqueeze(-2) @ out.unsqueeze(-1)).squeeze(-1)  # rowsum(dO * O) (B, Hq, Tq, 1), no temporary
        dscores = _sampled(csr, dout, repeat_kv(vw, Hq))  # dP (B, Hq, Tq, k), in place into dS below
        dscores.sub_(delta).mul_(weights).masked_fill_(~(weights > 0), 0.0)  # NaN at a weight-0 pair stays out
        dq = _weighted_rows(rows, kw.reshape(B * Hkv * Tk, -1), dscores).view_as(qw).mul_(scale)
        bags = _key_bags(lists, B, Hq, Tk)
        dk = _bag_sums(bags, qw, dscores, Hkv).mul_(scale)
        del dscores
        dv = _bag_sums(bags, dout, weights, Hkv)
        dsinks = None if sinks is None else sink_gradient(-(sink_share * delta[..., 0]), sinks)  # sinks' shape
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), dsinks, None, None


class _Nothing(torch.autograd.Function):
    """A call without a single pair: a zero output whose inputs get zero gradients."""

    @staticmethod
    def forward(ctx, q, k, v, sinks):
        ctx.save_for_backward(q, k, v, sinks)
        return q.new_zeros(*q.shape[:-1], v.shape[-1])  # (B, Hq, Tq, Dv)

    @staticmethod
    def backward(ctx, grad_out):
        return tuple(None if t is None else torch.zeros_like(t) for t in ctx.saved_tensors)


@dataclass(frozen=True)
class _KeyBags:
    """The pairs of every (batch, query head) grouped by key, for one ``embedding_bag`` per gradient:
    ``order (B|1, Hkv|1, 1, Tq*k)`` sorts each distinct list's pairs by key, ``samples`` are their
    rows in a ``(B*Hq*Tq, X)`` table, ``offsets`` start a bag per (b, h, key), then the end."""

    order: Tensor
    samples: Tensor
    offsets: Tensor


def _key_bags(lists: Tensor, batch: int, heads: int, tk: int) -> _KeyBags:
    """Sort once per distinct list ``(B|1, Hkv|1, Tq, k)``; query head h reads list head h // G."""
    lb, lh, Tq, K = lists.shape
    group, pairs = heads // lh, Tq * K
    index = torch.int32 if batch * heads * pairs < 2**31 else torch.int64  # embedding_bag takes either
    flat = lists.reshape(lb, lh, 1, pairs)  # (B|1, Hkv|1, 1, Tq*k)
    order = flat.argsort(dim=-1, stable=True)  # stable: one order of equal keys, whatever the sort kernel
    counts = torch.zeros(lb, lh, 1, tk, dtype=index, device=lists.device)
    counts.scatter_add_(-1, flat.long(), torch.ones(1, dtype=index, device=lists.device).expand(flat.shape))
    bag = torch.arange(batch * heads, dtype=index, device=lists.device).view(batch, lh, group, 1)  # (b, h)
    samples = (order // K).to(index) + bag * Tq  # (B, Hkv|1, G, Tq*k): query rows in (B*Hq*Tq, X)
    starts = counts.cumsum(-1, dtype=index) - counts + bag * pairs  # (B, Hkv|1, G, Tk)
    offsets = torch.cat([starts.reshape(-1), starts.new_full((1,), batch * heads * pairs)])
    return _KeyBags(order=order, samples=samples.reshape(-1), offsets=offsets)


def _bag_sums(bags: _KeyBags, table: Tensor, pair_values: Tensor, kv_heads: int) -> Tensor:
    """``(B, Hkv, Tk, X)``: per key, the sum of ``pair_values (B, Hq, Tq, k)`` times its queries' rows of ``table``."""
    B, Hq, Tq, K = pair_values.shape
    lh = bags.order.shape[1]
    order = bags.order.expand(B, lh, Hq // lh, Tq * K)
    chosen = pair_values.reshape(B, lh, Hq // lh, Tq * K).gather(-1, order)  # (B, Hkv|1, G, Tq*k) by key
    rows = F.embedding_bag(bags.samples, table.reshape(B * Hq * Tq, -1), bags.offsets, mode="sum",
                           per_sample_weights=chosen.reshape(-1), include_last_offset=True)
    return sum_kv_groups(rows.view(B, Hq, -1, table.shape[-1]), kv_heads)  # (B, Hkv, Tk, X)


def topk_attention(call: AttentionCall, indices: Tensor) -> tuple[Tensor, Tensor | None]:
    """Attention of each query over its listed keys ∩ the call's mask.

    Args:
        call: a validated call (no dropout, no score mod: see :func:`refusal`).
        indices: ``(B|1, Hkv|1, Tq, k)`` int64 from :func:`check_indices`.

    Returns:
        ``out (B, Hq, Tq, Dv)`` and, when ``call.return_weights``, the dense weights
        ``(B, Hq, Tq, Tk)`` (zeros outside the set), else None. A query with no key gets zeros
        and zero gradient.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> call = build_call(q, q, q, return_weights=True)
        >>> out, weights = topk_attention(call, check_indices(torch.tensor([[2], [-1], [0]]), call, rank=4))
        >>> weights[0, 0].tolist()       # one listed key each; the second query has none
        [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    """
    B, Hq, Tq, _ = call.q.shape
    if min(call.q.numel(), call.k.numel(), indices.shape[-1]) == 0:  # no pair at all: zeros, zero gradient
        out = _Nothing.apply(call.q, call.k, call.v, call.sinks)
        return out, call.q.new_zeros(B, Hq, Tq, call.tk) if call.return_weights else None
    pattern = _pattern(call, indices)
    out, weights = _TopK.apply(call.q, call.k, call.v, call.sinks, call, pattern)
    if not call.return_weights:
        return out, None
    dense = weights.new_zeros(B, Hq, Tq, call.tk).scatter_add_(-1, pattern.cols, weights.detach())
    return out, dense.to(call.dtype)
