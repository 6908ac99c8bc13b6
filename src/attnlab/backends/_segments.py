"""Padded batches as a few fused calls on the real keys: sdpa's ``"segments"`` mask source.

A padded batch's mask is, in each batch row ``b``, causal ANDed with one run of real keys
``[s, e)`` (right padding: ``s = 0``; left padding: ``e = Tk``). Row by row the queries then
fall into three bands, each an ordinary SDPA call on slices (views, nothing copied):

    queries  [0, s)        attend nothing             -> zeros (zero gradient)
    queries  [s, e)        a causal triangle of [s, e) -> SDPA is_causal on q[s:e], k[s:e]
    queries  [e, Tq)       every real key             -> SDPA, no mask, on q[e:], k[s:e]

(top-left causal, ``j <= i``; without causal, one band sees ``[s, e)``). A varlen row
(:func:`~attnlab.masks.varlen_causal_mod`: ``q_len`` real queries on ``k_len`` real keys, the
last real query seeing them all) is the same with padded queries as zeros and, where it has
more keys than queries, the diagonal band aligned bottom-right (a ``(q_len, k_len)`` mask of
that row's own sizes). Rows with the same span run as one call. No ``(Tq, Tk)`` mask is
built, no padded key is read, and the causal band skips the upper triangle as SDPA's
``is_causal`` does, where a dense mask makes the kernel visit every pair. Outputs and
gradients are SDPA's own on the slices, so exact under the contract.

The spans are read from the mask's values (:func:`key_spans`): a key mask ``(B|1, 1, 1, Tk)``,
a :class:`~attnlab.masks.PaddingMod`, or a ``(B|1, 1, T, T)`` bool mask equal to causal AND
one key mask (what transformers builds for a padded batch; :func:`causal_key_mask`). Where the
real keys are not one run per row, the batch is short (:func:`long_enough`) or the estimate
(:func:`cheaper_than_dense`) says the extra calls' fixed cost outweighs the skipped work, sdpa
runs one fused call instead (:func:`attnlab.backends.sdpa` ``_segments_runner``).

Example:
    >>> import torch
    >>> spans = key_spans(torch.tensor([[True, True, False], [False, True, True]]))
    >>> spans
    [(0, 2), (1, 3)]
    >>> plan_bands(spans, causal=True, tq=3)[0].bands
    (('causal', 0, 2, 0, 2), ('full', 2, 3, 0, 2))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.backends.rates import RATES

__all__ = ["key_spans", "causal_key_mask", "Group", "plan_bands", "flash_pairs", "long_enough", "cheaper_than_dense",
           "run_groups"]


def key_spans(valid: Tensor) -> list[tuple[int, int]] | None:
    """Each batch row's run of real keys ``[s, e)``, or None when some row's are not one run.

    Args:
        valid: ``(B, Tk)`` bool, True at real keys.

    Returns:
        ``[(s, e), ...]`` one per row (``(0, 0)`` for a row without a real key), or None.

    Example:
        >>> key_spans(torch.tensor([[True, False, True]])) is None
        True
    """
    tk = valid.shape[-1]
    index = torch.arange(tk, device=valid.device)
    counts = valid.sum(-1)  # (B,)
    first = torch.where(valid, index, tk).amin(-1) if tk else counts
    last = torch.where(valid, index, -1).amax(-1) if tk else counts - 1
    one_run = (counts == 0) | (last - first + 1 == counts)
    if not bool(one_run.all()):
        return None
    starts = torch.where(counts == 0, 0, first).tolist()
    ends = torch.where(counts == 0, 0, last + 1).tolist()
    return list(zip(starts, ends))


def causal_key_mask(mask: Tensor) -> Tensor | None:
    """The key mask ``(B|1, Tk)`` when the 4-D bool ``mask`` ``(B|1, 1, T, T)`` is exactly
    top-left causal AND it (a padded batch's causal mask as transformers builds it); else None.

    The last query sees every real key, so its row is the key mask; a cheap column test
    (every query at or after the first real key sees it) turns windows and documents away
    before the full comparison.

    Example:
        >>> keys = torch.tensor([[False, True, True]])
        >>> full = torch.ones(3, 3, dtype=torch.bool).tril() & keys[:, None, :]
        >>> causal_key_mask(full[:, None])
        tensor([[False,  True,  True]])
    """
    batch, heads, tq, tk = mask.shape
    if heads != 1 or tq != tk or tq == 0:
        return None
    valid = mask[:, 0, -1, :]  # (B|1, Tk)
    first = valid.to(torch.int8).argmax(-1)  # (B|1,): first real key (0 when there is none)
    column = mask[:, 0, :, :].gather(2, first.view(-1, 1, 1).expand(batch, tq, 1))[..., 0]  # (B|1, Tq)
    seen = torch.arange(tq, device=mask.device) >= first.view(-1, 1)
    if not torch.equal(column, seen & valid.gather(1, first.view(-1, 1))):
        return None
    expected = torch.ones(tq, tk, dtype=torch.bool, device=mask.device).tril() & valid[:, None, :]
    return valid if torch.equal(mask[:, 0], expected) else None


@dataclass(frozen=True)
class Group:
    """Batch rows that share a span, and the bands their queries fall into.

    Attributes:
        rows: the batch rows, ascending.
        bands: ``(kind, q0, q1, k0, k1)`` with kind ``"zero"``, ``"causal"`` (top-left on a
            square slice), ``"bottom_right"`` (causal, more keys than queries) or ``"full"``;
            the query ranges tile ``[0, Tq)`` in order.

    Example:
        >>> Group(rows=(0,), bands=(("full", 0, 4, 0, 2),)).rows
        (0,)
    """

    rows: tuple[int, ...]
    bands: tuple[tuple[str, int, int, int, int], ...]


def _bands(span: tuple[int, int, int, int], *, causal: bool, tq: int) -> tuple[tuple[str, int, int, int, int], ...]:
    """One row's bands for ``span = (q_len, start, end, offset)``: queries ``[0, q_len)`` are real
    and see the real keys ``[start, end)``, with causal ``j <= i + offset``; later queries see
    nothing (see the module's table)."""
    q_len, start, end, offset = span
    if end <= start or q_len == 0:
        return (("zero", 0, tq, 0, 0),)
    if not causal:
        bands = [("full", 0, q_len, start, end)]
    else:
        cut_a = min(max(start - offset, 0), q_len)  # the first query that sees a key
        cut_b = min(max(end - offset, 0), q_len)  # the first query that sees them all
        keys = min(end, cut_b + offset) - start  # the keys the diagonal band reaches
        diagonal = "causal" if cut_b - cut_a == keys else "bottom_right"
        if cut_b - cut_a == 1:
            diagonal = "full"  # one query: every key it reaches
        bands = [("zero", 0, cut_a, 0, 0), (diagonal, cut_a, cut_b, start, start + keys), ("full", cut_b, q_len, start, end)]
    bands.append(("zero", q_len, tq, 0, 0))
    merged: list[tuple[str, int, int, int, int]] = []
    for band in bands:
        if band[2] <= band[1]:
            continue
        if merged and band[0] == merged[-1][0] == "zero":
            merged[-1] = ("zero", merged[-1][1], band[2], 0, 0)
        else:
            merged.append(band)
    return tuple(merged)


def plan_bands(spans: list[tuple[int, int]] | list[tuple[int, int, int, int]], *, causal: bool,
               tq: int) -> list[Group]:
    """The rows grouped by span, with their bands (top-left causal when ``causal``).

    Args:
        spans: per batch row ``(start, end)`` of its real keys (every query real, causal
            ``j <= i``), or ``(q_len, start, end, offset)``: real queries ``[0, q_len)``, causal
            ``j <= i + offset`` (a varlen row: ``(q_len, 0, k_len, k_len - q_len)``).
        causal: whether a causal diagonal applies.
        tq: the number of queries.

    Example:
        >>> [g.rows for g in plan_bands([(0, 2), (0, 3), (0, 2)], causal=False, tq=3)]
        [(0, 2), (1,)]
        >>> plan_bands([(2, 0, 4, 2)], causal=True, tq=3)[0].bands  # 2 real queries on 4 keys
        (('bottom_right', 0, 2, 0, 4), ('zero', 2, 3, 0, 0))
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, span in enumerate(spans):
        full = span if len(span) == 4 else (tq, *span, 0)
        groups.setdefault(tuple(full), []).append(row)
    return [Group(tuple(rows), _bands(span, causal=causal, tq=tq)) for span, rows in groups.items()]


def flash_pairs(q_len: int, k_len: int, *, causal: bool) -> int:
    """The (query, key) pairs PyTorch's CPU flash kernel visits: per block of queries (32, 64 or
    256 by ``q_len``), whole blocks of 512 keys (all keys when fewer) up to the diagonal when
    causal, every key otherwise (a mask skips nothing).

    Example:
        >>> flash_pairs(1024, 1024, causal=True) / (1024 * 1024)  # not the ideal half
        0.75
    """
    if not causal:
        return q_len * k_len
    q_split = 256 if q_len >= 768 else (64 if q_len >= 192 else 32)
    kv_split = min(512, k_len) or 1
    pairs = 0
    for first in range(0, q_len, q_split):
        rows = min(q_split, q_len - first)
        reach = min(first + rows, k_len)
        pairs += rows * min(k_len, -(-reach // kv_split) * kv_split)
    return pairs


def _band_seconds(kind: str, rows: int, q_len: int, k_len: int, heads: int, dims: int) -> float:
    """The cost model's estimate for one band's SDPA call."""
    if kind == "zero":
        return 0.0
    rates = RATES["sdpa"]
    pairs = flash_pairs(q_len, k_len, causal=kind == "causal")
    rate = rates["cpu_flash"]["user" if kind == "bottom_right" else "none"]
    return rates["call_overhead_s"]["cpu"] + 4.0 * rows * heads * pairs * dims / rate


def long_enough(tq: int) -> bool:
    """Whether ``tq`` queries are enough for bands to pay (``segments_min_queries``): below it
    the kernel visits a causal band's every key (one block of keys), small bands run under its
    rate, and one dense call wins, so the spans need not even be read.

    Example:
        >>> long_enough(256), long_enough(1024)
        (False, True)
    """
    return tq >= RATES["sdpa"]["segments_min_queries"]


def cheaper_than_dense(groups: list[Group], *, batch: int, heads: int, tq: int, tk: int, dims: int,
                       dense_causal: bool) -> bool:
    """Whether the bands' calls beat one fused call over every key with a mask (causal by the
    kernel when ``dense_causal``), by the cost model of :mod:`attnlab.backends.rates`. Never
    below :func:`long_enough`.

    Example:
        >>> cheaper_than_dense(plan_bands([(0, 64)], causal=True, tq=1024), batch=1, heads=8,
        ...                    tq=1024, tk=1024, dims=64, dense_causal=True)
        True
    """
    rates = RATES["sdpa"]
    if not long_enough(tq):
        return False
    pairs = batch * flash_pairs(tq, tk, causal=dense_causal)
    dense = rates["call_overhead_s"]["cpu"] + 4.0 * heads * pairs * dims / rates["cpu_flash"]["user"]
    bands = sum(_band_seconds(kind, len(g.rows), q1 - q0, k1 - k0, heads, dims)
                for g in groups for kind, q0, q1, k0, k1 in g.bands)
    return bands < dense


def _rows_of(t: Tensor, rows: tuple[int, ...]) -> Tensor:
    """``t``'s batch rows ``rows``: a view when they are consecutive (or ``t`` broadcasts)."""
    if t.shape[0] == 1:
        return t.expand(len(rows), *t.shape[1:])
    if rows == tuple(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]:rows[0] + len(rows)]
    return t[list(rows)]


def _group_out(q: Tensor, k: Tensor, v: Tensor, group: Group, options: dict) -> Tensor:
    """``(len(rows), Hq, Tq, Dv)``: the group's bands, joined along the queries."""
    q, k, v = (_rows_of(t, group.rows) for t in (q, k, v))
    pieces = []
    for kind, q0, q1, k0, k1 in group.bands:
        if kind == "zero":
            pieces.append(q.new_zeros(q.shape[0], q.shape[1], q1 - q0, v.shape[3]))  # (g, Hq, n, Dv)
            continue
        diagonal = None
        if kind == "bottom_right":  # more keys than queries: the last query sees every key
            diagonal = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril(k1 - k0 - (q1 - q0))
        pieces.append(F.scaled_dot_product_attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=diagonal, is_causal=kind == "causal",
            **options))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)  # (g, Hq, Tq, Dv)


def run_groups(q: Tensor, k: Tensor, v: Tensor, groups: list[Group], options: dict) -> Tensor:
    """``(B, Hq, Tq, Dv)``: every group's rows, back in batch order.

    ``options`` are SDPA's keywords (``scale``, ``enable_gqa``); q, k, v are ``(B, H, T, D)``.
    An output that no band connects to the inputs (every row empty) is tied to them with a zero
    gradient, so that a backward still runs.

    Example:
        >>> q = torch.randn(2, 1, 3, 4)
        >>> out = run_groups(q, q, q, plan_bands([(0, 3), (0, 0)], causal=True, tq=3), {})
        >>> torch.allclose(out[0], torch.nn.functional.scaled_dot_product_attention(q[:1], q[:1], q[:1], is_causal=True)[0]), out[1].abs().max().item()
        (True, 0.0)
    """
    outs = [_group_out(q, k, v, group, options) for group in groups]
    order = [row for group in groups for row in group.rows]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # (B, Hq, Tq, Dv), groups' order
    if order != sorted(order):
        out = out[torch.tensor(order, device=out.device).argsort()]
    if torch.is_grad_enabled() and not out.requires_grad and any(t.requires_grad for t in (q, k, v)):
        out = out + sum(t.narrow(-1, 0, 0).sum() for t in (q, k, v)).to(out.dtype)  # + 0, never NaN
    return out
