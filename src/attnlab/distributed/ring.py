"""Ring attention: each rank keeps its queries while the key/value shards travel round the ring.

Forward, on rank ``r`` of ``P``: at step ``s`` it holds the key/value shard of rank ``r - s``.
It starts sending that shard to rank ``r + 1`` (and receiving the next one from ``r - 1``),
computes its queries against the shard it holds with PyTorch's fused CPU flash kernel, or
attnlab's tiled kernel on other devices and on NaN/inf inputs (both return the row log-sum-exp), and merges the partial result into its running output by the log-sum-exp rule::

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Under a causal mask, a (query chunk, key chunk) pair entirely in the future is skipped, and with
the zigzag layout every rank does the same work. Backward runs the ring again: the key/value
shards travel as in the forward, and each shard's ``dK``/``dV`` accumulator travels with it one
step behind, so no rank ever gathers the full keys, values or their gradients.

Example:
    >>> ring_pieces(rank=1, source=0, world=2, layout="zigzag", causal=True, chunk=4)
    [(slice(0, 8, None), slice(0, 4, None), False)]
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

import torch.nn.functional as F

from attnlab._call import build_call
from attnlab._checks import instance_of, positive_int
from attnlab._math import repeat_kv, score_dtype, sum_kv_groups
from attnlab.backends.chunked import chunked_attention, chunked_gradients
from attnlab.distributed._comm import CommStats, Peers, exchange
from attnlab.distributed.layout import chunk_ids

__all__ = ["ring_pieces"]

# PyTorch's fused CPU flash kernel and its backward (both take the row log-sum-exp).
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

# Point-to-point tags: the key/value shard and its gradient accumulator never cross-match.
_TAG_KV, _TAG_DKV = 0, 2


def ring_pieces(*, rank: int, source: int, world: int, layout: str, causal: bool,
                chunk: int) -> list[tuple[slice, slice, bool]]:
    """The work of rank ``rank`` against the key/value shard of rank ``source``.

    Returns ``(query rows, key rows, causal)`` triples in local indices; key rows whose chunk
    lies wholly after a query chunk are left out under ``causal``. Against its own shard a rank
    runs one causal call (local order is global order), otherwise full pieces that touch are
    merged into one.

    Example:
        >>> ring_pieces(rank=0, source=1, world=2, layout="zigzag", causal=True, chunk=4)
        [(slice(4, 8, None), slice(0, 8, None), False)]
        >>> ring_pieces(rank=0, source=1, world=2, layout="contiguous", causal=True, chunk=4)
        []
    """
    positive_int("chunk", chunk)
    instance_of("causal", causal, bool, "a bool")
    q_chunks = chunk_ids(layout, rank=rank, world=world)
    if causal and source == rank:
        return [(slice(0, len(q_chunks) * chunk), slice(0, len(q_chunks) * chunk), True)]
    kv_chunks = chunk_ids(layout, rank=source, world=world)
    blocks = [(i, i + 1, j, j + 1) for i, cq in enumerate(q_chunks) for j, ck in enumerate(kv_chunks)
              if not (causal and ck > cq)]
    blocks = _merge(_merge(blocks, along="kv"), along="q")
    return [(slice(a * chunk, b * chunk), slice(c * chunk, d * chunk), False) for a, b, c, d in blocks]


def _merge(blocks: list[tuple[int, int, int, int]], *, along: str) -> list[tuple[int, int, int, int]]:
    """Join blocks ``(q_lo, q_hi, kv_lo, kv_hi)`` that touch along one axis and match on the other."""
    merged: list[tuple[int, int, int, int]] = []
    for block in blocks:
        if merged:
            a, b, c, d = merged[-1]
            if along == "kv" and (a, b) == block[:2] and d == block[2]:
                merged[-1] = (a, b, c, block[3])
                continue
            if along == "q" and (c, d) == block[2:] and b == block[0]:
                merged[-1] = (a, block[1], c, d)
                continue
        merged.append(block)
    return merged


def _merge_into(out: Tensor, lse: Tensor, rows: slice, part_out: Tensor, part_lse: Tensor) -> None:
    """Fold a partial result into the running ``out``/``lse`` rows by the log-sum-exp rule.

    In place (``part_out`` is consumed), so a merge allocates nothing of the output's size."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, part_lse)  # (B, Hq, rows); -inf only if both are
    safe = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    old_w = torch.exp(old_lse - safe).unsqueeze(-1)  # (B, Hq, rows, 1); 0 while nothing was seen
    new_w = torch.exp(part_lse - safe).unsqueeze(-1)
    out[:, :, rows].mul_(old_w).add_(part_out.mul_(new_w))
    lse[:, :, rows] = new_lse


class _Setup:
    """What both passes need: peers, layout, mask and scale, and where to count."""

    def __init__(self, who: Peers, *, layout: str, causal: bool, scale: float,
                 stats: CommStats | None):
        self.who, self.layout, self.causal, self.scale, self.stats = who, layout, causal, scale, stats

    def pieces(self, source: int, local_len: int) -> list[tuple[slice, slice, bool]]:
        chunk = local_len // (2 if self.layout == "zigzag" else 1)
        return ring_pieces(rank=self.who.rank, source=source, world=self.who.world,
                           layout=self.layout, causal=self.causal, chunk=chunk)

    def count(self, stage: str, rows: int, cols: int, causal: bool) -> None:
        """Add the query-key scores a piece computes (a causal square: its lower triangle)."""
        if self.stats is not None:
            self.stats.scores[stage] += rows * (rows + 1) // 2 if causal else rows * cols


def _all_finite(t: Tensor) -> bool:
    """Whether ``t`` holds no NaN or inf. NaN and inf reach any sum, so a finite sum proves it
    at the cost of one read; only a non-finite sum (or finite values that overflow it) pays for
    the full-size ``isfinite`` check.

    Example:
        >>> _all_finite(torch.ones(3)), _all_finite(torch.tensor([1.0, float("inf")]))
        (True, False)
    """
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())


def _fused(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the fused CPU kernel serves this piece exactly: on CPU, with finite inputs (it
    returns zeros for a NaN query row, where attnlab's contract wants NaN; the tiled kernel keeps it)."""
    return _FLASH is not None and q.device.type == "cpu" and all(_all_finite(t) for t in (q, k, v))


def _same_width(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad q/k or v to one head size (the fused kernel needs ``Dv == D``); exact. The
    kernel reads any strides but the last dim's, which must be 1 (a permuted input is copied)."""
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda t: t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    dense = lambda t: t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)  # noqa: E731
    return dense(pad(q)), dense(pad(k)), dense(pad(v))


def _piece_forward(setup: _Setup, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """out ``(B, Hq, rows, Dv)`` and lse ``(B, Hq, rows)`` of one piece."""
    setup.count("forward", q.shape[2], k.shape[2], causal)
    if _fused(q, k, v):
        qp, kp, vp = _same_width(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]))
        out, lse = _FLASH(qp, kp, vp, is_causal=causal, scale=setup.scale)
        return out[..., :v.shape[-1]], lse
    part = chunked_attention(build_call(q, k, v, causal=causal, scale=setup.scale))
    return part.out, part.lse


def _piece_backward(setup: _Setup, q: Tensor, k: Tensor, v: Tensor, causal: bool, out: Tensor,
                    lse: Tensor, d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """This piece's share of dq, dk, dv, from the global ``out`` and ``lse`` of its rows."""
    setup.count("backward", q.shape[2], k.shape[2], causal)
    if _fused(q, k, v):
        Hkv, D, Dv = k.shape[1], q.shape[-1], v.shape[-1]
        qp, kp, vp = _same_width(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]))
        out_p, d_out_p = (t if t.shape[-1] == qp.shape[-1] else F.pad(t, (0, qp.shape[-1] - Dv))
                          for t in (out, d_out))
        dq, dk, dv = _FLASH_BACKWARD(d_out_p.contiguous(), qp, kp, vp, out_p.contiguous(), lse.contiguous(),
                                     0.0, causal, attn_mask=None, scale=setup.scale)
        return dq[..., :D], sum_kv_groups(dk[..., :D], Hkv), sum_kv_groups(dv[..., :Dv], Hkv)
    return chunked_gradients(build_call(q, k, v, causal=causal, scale=setup.scale), out=out, lse=lse,
                             d_out=d_out)


def _forward(setup: _Setup, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Ring forward. Returns out ``(B, Hq, T, Dv)`` and lse ``(B, Hq, T)`` in the accumulation dtype."""
    who, acc = setup.who, score_dtype(q.dtype)
    B, Hq, T, _ = q.shape
    qa = q.to(acc)
    out = q.new_zeros(B, Hq, T, v.shape[-1], dtype=acc)
    lse = torch.full((B, Hq, T), float("-inf"), dtype=acc, device=q.device)
    held = [k, v]
    for step in range(who.world):
        source = (who.rank - step) % who.world
        coming = (exchange(held, who, tag=_TAG_KV, what=f"forward step {step}: key/value exchange",
                           stats=setup.stats) if step < who.world - 1 else None)
        for rows, cols, causal in setup.pieces(source, T):
            part_out, part_lse = _piece_forward(setup, qa[:, :, rows], held[0][:, :, cols].to(acc),
                                                held[1][:, :, cols].to(acc), causal)
            _merge_into(out, lse, rows, part_out, part_lse)
        if coming is not None:
            held = coming.wait()
    return out, lse


def _backward(setup: _Setup, d_out: Tensor, saved: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """Ring backward: ``dq`` stays here; each shard's ``dk``/``dv`` travels with it, a step behind."""
    q, k, v, out, lse = saved
    who, acc = setup.who, out.dtype
    T = q.shape[2]
    qa, d_out = q.to(acc), d_out.to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    held, grads_coming = [k, v], None
    for step in range(who.world):
        source = (who.rank - step) % who.world
        coming = (exchange(held, who, tag=_TAG_KV, what=f"backward step {step}: key/value exchange",
                           stats=setup.stats) if step < who.world - 1 else None)
        dk = dv = None
        for rows, cols, causal in setup.pieces(source, T):
            gq, gk, gv = _piece_backward(setup, qa[:, :, rows], held[0][:, :, cols].to(acc),
                                         held[1][:, :, cols].to(acc), causal, out[:, :, rows],
                                         lse[:, :, rows], d_out[:, :, rows])
            dq[:, :, rows] += gq
            if dk is None and cols == slice(0, T):  # one piece over every key: its grads are the sums
                dk, dv = gk, gv
            else:
                if dk is None:
                    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
                    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
                dk[:, :, cols] += gk
                dv[:, :, cols] += gv
            del gq, gk, gv  # free them before the next piece allocates its own
        if dk is None:  # every key of this shard is in the future of every query here
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        held = held if coming is not None else None  # the last shard is done with
        if grads_coming is not None:  # the accumulator of the shard held now, from rank r - 1
            dk_in, dv_in = grads_coming.wait()
            dk, dv = dk.add_(dk_in), dv.add_(dv_in)
        grads_coming = exchange([dk, dv], who, tag=_TAG_DKV, stats=setup.stats,
                                what=f"backward step {step}: gradient exchange")
        del dk, dv  # the exchange holds what it sends (a contiguous copy, if the kernel's was not)
        if coming is not None:
            held = coming.wait()
    dk, dv = grads_coming.wait()  # this rank's own shard's accumulator, complete
    return dq, dk, dv


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup):
        out, lse = _forward(setup, q, k, v)
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.setup, d_out, (q, k, v, out, lse))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, who: Peers, layout: str, causal: bool,
                   scale: float, stats: CommStats | None = None) -> Tensor:
    """Ring attention on checked shards; see :func:`attnlab.distributed.context_parallel_attention`."""
    setup = _Setup(who, layout=layout, causal=causal, scale=scale, stats=stats)
    return _RingFunction.apply(q, k, v, setup)
