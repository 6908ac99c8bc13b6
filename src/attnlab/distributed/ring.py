"""Ring attention: each rank keeps its queries while the key/value shards travel round the ring.

Forward, on rank ``r`` of ``P``: at step ``s`` it holds the key/value shard of rank ``r - s``.
It starts sending that shard to rank ``r + 1`` (and receiving the next one from ``r - 1``),
computes its queries against the shard it holds with PyTorch's fused CPU flash kernel, or
attnlab's tiled kernel on other devices and on NaN/inf inputs (both return the row log-sum-exp), and merges the partial result into its running output by the log-sum-exp rule
(:func:`attnlab.backends._lse.merge_`)::

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

from dataclasses import dataclass

import torch
from torch import Tensor

import torch.nn.functional as F

from attnlab import masks as _masks
from attnlab._call import build_call
from attnlab._checks import instance_of, positive_int
from attnlab._math import repeat_kv, score_dtype, sum_kv_groups
from attnlab.backends._lse import fold_sinks, kernel_function, merge_, row_delta, sinks_gradient
from attnlab.backends.blocks import blocks_attention, blocks_gradients
from attnlab.backends.chunked import chunked_attention, chunked_gradients
from attnlab.distributed._comm import CommStats, Peers, Pending, transfer
from attnlab.distributed._global import global_mod
from attnlab.distributed.layout import check_length, chunk_ids, chunks_per_rank, positions
from attnlab.scores import sink_logits

__all__ = ["ring_pieces", "RingPlan", "ring_plan", "head_chunks_of"]

# PyTorch's fused CPU flash kernel and its backward (both take the row log-sum-exp).
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

# Point-to-point tags: the key/value shard, its gradient accumulator on the way, and the finished
# accumulator on its way home never cross-match.
_TAG_KV, _TAG_DKV, _TAG_HOME = 0, 2, 4


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


@dataclass(frozen=True)
class RingPlan:
    """What every rank computes against every key/value shard, and so what the ring sends.

    Built the same on every rank from the mask and the layout (no communication): rank ``r``
    needs shard ``s`` when ``pairs[r][s] > 0``. Shard ``s`` travels ``hops[s]`` ranks along the
    ring, as far as the last rank that needs it, and no further; the ring runs ``steps`` steps.
    Without a mask every shard goes round (``hops = P - 1``); a sliding window narrower than a
    shard needs one hop (contiguous layout), so the other sends are skipped.

    Attributes:
        pairs: ``pairs[r][s]``, the (query, key) pairs rank ``r``'s queries may attend among
            shard ``s``'s keys (per sequence; summed over batch rows when the mask differs by row).
        hops: ``hops[s]``, how many ranks past its owner shard ``s`` travels (0: never sent).

    Example:
        >>> from attnlab import masks
        >>> plan = ring_plan(world=4, layout="contiguous", length=32, mask=masks.sliding_window_mod(32, 32, 3))
        >>> plan.hops, plan.steps, plan.sends, plan.skipped
        ((1, 1, 1, 0), 2, 3, 9)
    """

    pairs: tuple[tuple[int, ...], ...]
    hops: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.hops)

    @property
    def steps(self) -> int:
        return 1 + max(self.hops)

    @property
    def sends(self) -> int:
        """Key/value shard sends per pass, over all ranks (a full ring makes ``P * (P - 1)``)."""
        return sum(self.hops)

    @property
    def skipped(self) -> int:
        return self.world * (self.world - 1) - self.sends

    def holds(self, rank: int, step: int) -> bool:
        """Whether ``rank`` holds shard ``rank - step`` at ``step``."""
        return step <= self.hops[(rank - step) % self.world]

    def forwards(self, rank: int, step: int) -> bool:
        """Whether ``rank`` sends the shard it holds at ``step`` on to ``rank + 1``."""
        return step < self.hops[(rank - step) % self.world]

    def describe(self) -> str:
        """One line per step: which shard each rank computes on, sends, or has skipped.

        Example:
            >>> print(ring_plan(world=2, layout="contiguous", length=8, causal=True).describe())
            step 0: rank 0 computes shard 0 (10 pairs), sends it to rank 1; rank 1 computes shard 1 (10 pairs)
            step 1: rank 1 computes shard 0 (16 pairs)
            1 of 2 key/value sends skipped per pass
        """
        lines = []
        for step in range(self.steps):
            parts = []
            for rank in range(self.world):
                source = (rank - step) % self.world
                if not self.holds(rank, step):
                    continue
                pairs = self.pairs[rank][source]
                part = f"rank {rank} " + (f"computes shard {source} ({pairs} pairs)" if pairs
                                          else f"holds shard {source} (0 pairs)")
                if self.forwards(rank, step):
                    part += f", sends it to rank {(rank + 1) % self.world}"
                parts.append(part)
            lines.append(f"step {step}: " + "; ".join(parts))
        lines.append(f"{self.skipped} of {self.world * (self.world - 1)} key/value sends skipped per pass")
        return "\n".join(lines)


def _hops(pairs: list[list[int]]) -> tuple[int, ...]:
    """How far each shard must travel: to the farthest rank along the ring that needs it."""
    world = len(pairs)
    return tuple(max([(r - s) % world for r in range(world) if pairs[r][s] > 0], default=0)
                 for s in range(world))


# A unit of work against one source shard: query rows, key rows, a causal square, a mask over
# them (a PreparedMask in local indices, or None) and the pairs it visits.
_Piece = tuple[slice, slice, bool, object, int]


def _plain_pieces(rank: int, source: int, world: int, layout, causal: bool, chunk: int) -> list[_Piece]:
    """The causal or unmasked pieces, each with its pair count."""
    out = []
    for rows, cols, diag in ring_pieces(rank=rank, source=source, world=world, layout=layout,
                                        causal=causal, chunk=chunk):
        n, m = rows.stop - rows.start, cols.stop - cols.start
        out.append((rows, cols, diag, None, n * (n + 1) // 2 if diag else n * m))
    return out


def _local_masks(prepared: _masks.PreparedMask, q_pos: Tensor, k_pos: Tensor,
                 device) -> tuple[int, _masks.PreparedMask]:
    """The global mask restricted to queries ``q_pos`` and keys ``k_pos`` (both increasing), in
    local indices: a global key interval meets increasing positions in one local interval."""
    lo = torch.searchsorted(k_pos, prepared.lo[:, q_pos].contiguous())  # (R, Tq_local): first key >= lo
    hi = torch.searchsorted(k_pos, prepared.hi[:, q_pos].contiguous(), right=True) - 1  # last key <= hi
    pairs = int((hi - lo + 1).clamp(min=0).sum())
    local = _masks.PreparedMask(*(t.contiguous().to(device) for t in (
        lo, hi, prepared.q_segment[:, q_pos], prepared.k_segment[:, k_pos])), source="ring shard")
    return pairs, local


def _plan_ring(*, rank: int | None, world: int, layout, length: int, causal: bool, mask,
               batch: int, device=None) -> tuple[RingPlan, dict[int, list[_Piece]]]:
    """The plan (every rank's pairs) and, for ``rank``, its pieces against each source shard."""
    local_len = length // world
    if mask is None:
        chunk = local_len // chunks_per_rank(layout)
        table = [[_plain_pieces(r, s, world, layout, causal, chunk) for s in range(world)]
                 for r in range(world)]
        pairs = [[sum(p[4] for p in row[s]) for s in range(world)] for row in table]
        mine = {} if rank is None else {s: table[rank][s] for s in range(world)}
        return RingPlan(tuple(map(tuple, pairs)), _hops(pairs)), mine
    full = _masks.and_masks(mask, _masks.causal_mod(length, length)) if causal else mask
    with torch.no_grad():
        prepared = _masks.prepare(full, tq=length, tk=length, batch=batch)
        pos = [positions(length, layout=layout, rank=r, world=world) for r in range(world)]
        pairs, mine = [], {}
        for r in range(world):
            row = []
            for s in range(world):
                count, local = _local_masks(prepared, pos[r], pos[s], device)
                row.append(count)
                if r == rank and count:
                    everything = slice(0, local_len)
                    mine[s] = [(everything, everything, False, local, count)]
                elif r == rank:
                    mine[s] = []
            pairs.append(row)
    return RingPlan(tuple(map(tuple, pairs)), _hops(pairs)), mine


def ring_plan(*, world: int, layout="zigzag", length: int, causal: bool = False, mask=None,
              batch: int = 1) -> RingPlan:
    """The :class:`RingPlan` of a ring call, without a process group: what each rank computes,
    sends and skips for ``length`` tokens over ``world`` ranks (``mask``: one of attnlab's mask
    mods over the global sequence, or an AND of them).

    Example:
        >>> ring_plan(world=2, length=8, causal=True).pairs      # zigzag: equal work
        ((10, 8), (8, 10))
    """
    positive_int("world", world)
    check_length(length, layout=layout, world=world)
    return _plan_ring(rank=None, world=world, layout=layout, length=length, causal=causal, mask=mask,
                      batch=batch)[0]


class _Setup:
    """What both passes need: peers, plan, this rank's pieces, scale, the score mod, and where to count."""

    def __init__(self, who: Peers, *, plan: RingPlan, pieces: dict[int, list[_Piece]], scale: float,
                 stats: CommStats | None, shapes: list[Tensor], score_mod=None, where=None,
                 head_offset: int = 0, heads: int = 0):
        self.who, self.plan, self.pieces, self.scale, self.stats = who, plan, pieces, scale, stats
        self.shapes = shapes  # this rank's k and v (of the heads in flight): every shard has their shapes
        self.counting = True  # False on the second and later head chunks: scores are per (query, key) pair
        self.score_mod, self.where = score_mod, where  # where: each rank's global positions (T_local,)
        self.head_offset, self.heads = head_offset, heads  # global number of local head 0; global count
        self.head_start = 0  # the first local head of the chunk of heads in flight

    def piece_mod(self, source: int, rows: slice, cols: slice):
        """The score mod of one piece, at its queries' and keys' global positions and heads."""
        if self.score_mod is None:
            return None
        return global_mod(self.score_mod, q_pos=self.where[self.who.rank][rows], k_pos=self.where[source][cols],
                          head_offset=self.head_offset + self.head_start, heads=self.heads,
                          length=len(self.where[0]) * self.who.world)

    def count(self, stage: str, pairs: int) -> None:
        if self.stats is not None and self.counting:
            self.stats.scores[stage] += pairs

    def count_skipped(self) -> None:
        """Add the shard sends a full ring would make from this rank and this plan leaves out."""
        if self.stats is not None and self.counting:
            made = sum(self.plan.forwards(self.who.rank, step) for step in range(self.who.world - 1))
            self.stats.sends_skipped += self.who.world - 1 - made

    def pass_on(self, held: list[Tensor], step: int, stage: str) -> Pending:
        """Send the shard held at ``step`` on if a rank further along needs it; receive the
        next one if this rank will hold it."""
        who, plan = self.who, self.plan
        send = held if plan.forwards(who.rank, step) else None
        coming = plan.forwards(who.rank - 1, step)
        like = [(t.shape, t.dtype) for t in self.shapes] if coming else None
        return transfer(send, to=who.rank + 1, receive=like, source=who.rank - 1, who=who, tag=_TAG_KV,
                        what=f"{stage} step {step}: key/value exchange", stats=self.stats,
                        device=self.shapes[0].device)


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


def _masked_call(setup: _Setup, q: Tensor, k: Tensor, v: Tensor, mask, fused: bool):
    """The block-sparse call of a masked piece: on the fused path the scale is folded into q
    (both passes then compute the same products; see attnlab._math.folds_scale)."""
    if fused:
        return build_call(q * setup.scale, k, v, mask=mask, scale=1.0)
    return build_call(q, k, v, mask=mask, scale=setup.scale)


def _piece_forward(setup: _Setup, q: Tensor, k: Tensor, v: Tensor, causal: bool, mask,
                   mod=None) -> tuple[Tensor, Tensor]:
    """out ``(B, Hq, rows, Dv)`` and lse ``(B, Hq, rows)`` of one piece (``mod``: its score mod)."""
    if mod is not None:  # the tiled kernel: the fused ones take no score mod
        part = chunked_attention(build_call(q, k, v, causal=causal, mask=mask, scale=setup.scale, score_mod=mod))
        return part.out, part.lse
    fused = _fused(q, k, v)
    if mask is not None:  # the block-sparse path: only the key blocks the mask reaches
        call = _masked_call(setup, q, k, v, mask, fused)
        part = blocks_attention(call) if fused else chunked_attention(call)
        return part.out, part.lse
    if fused:
        qp, kp, vp = _same_width(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]))
        out, lse = _FLASH(qp, kp, vp, is_causal=causal, scale=setup.scale)
        return out[..., :v.shape[-1]], lse
    part = chunked_attention(build_call(q, k, v, causal=causal, scale=setup.scale))
    return part.out, part.lse


def _piece_backward(setup: _Setup, q: Tensor, k: Tensor, v: Tensor, causal: bool, mask, out: Tensor,
                    lse: Tensor, d_out: Tensor, mod=None) -> tuple[Tensor, Tensor, Tensor]:
    """This piece's share of dq, dk, dv, from the global ``out`` and ``lse`` of its rows."""
    if mod is not None:
        call = build_call(q, k, v, causal=causal, mask=mask, scale=setup.scale, score_mod=mod)
        return chunked_gradients(call, out=out, lse=lse, d_out=d_out)  # the mod's tensors need none
    fused = _fused(q, k, v)
    if mask is not None:
        call = _masked_call(setup, q, k, v, mask, fused)
        if not fused:
            return chunked_gradients(call, out=out, lse=lse, d_out=d_out)
        # blocks' own backward, given this ring's global out and lse (the twin of chunked_gradients)
        dq, dk, dv = blocks_gradients(call, out=out, lse=lse, d_out=d_out)
        return dq.mul_(setup.scale), dk, dv
    if fused:
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
    setup.shapes = [k, v]  # what every shard in flight looks like (this chunk's heads)
    qa = q.to(acc)
    out = q.new_zeros(B, Hq, T, v.shape[-1], dtype=acc)
    lse = torch.full((B, Hq, T), float("-inf"), dtype=acc, device=q.device)
    held = [k, v]  # empty at a step where this rank holds no shard
    for step in range(setup.plan.steps):
        source = (who.rank - step) % who.world
        coming = setup.pass_on(held, step, "forward")
        for rows, cols, causal, mask, pairs in (setup.pieces[source] if held else ()):
            setup.count("forward", pairs)
            part_out, part_lse = _piece_forward(setup, qa[:, :, rows], held[0][:, :, cols].to(acc),
                                                held[1][:, :, cols].to(acc), causal, mask,
                                                setup.piece_mod(source, rows, cols))
            merge_(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
        held = coming.wait()
    setup.count_skipped()
    return out, lse


def _shard_gradients(setup: _Setup, source: int, held: list[Tensor], qa: Tensor, dq: Tensor, out: Tensor,
                     lse: Tensor, d_out: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's ``dk``/``dv`` for the keys of shard ``source`` (``dq`` accumulates in place)."""
    k, v = held
    acc, T = out.dtype, k.shape[2]
    dk = dv = None
    for rows, cols, causal, mask, pairs in setup.pieces[source]:
        setup.count("backward", pairs)
        gq, gk, gv = _piece_backward(setup, qa[:, :, rows], k[:, :, cols].to(acc), v[:, :, cols].to(acc),
                                     causal, mask, out[:, :, rows], lse[:, :, rows], d_out[:, :, rows],
                                     setup.piece_mod(source, rows, cols))
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
    if dk is None:  # no query here reaches a key of this shard
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    return dk, dv


def _backward(setup: _Setup, d_out: Tensor, saved: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """Ring backward: ``dq`` stays here; each shard's ``dk``/``dv`` travels with it, a step behind,
    and the last rank that needs the shard sends the finished accumulator home to its owner."""
    q, k, v, out, lse = saved
    who, plan, acc = setup.who, setup.plan, out.dtype
    setup.shapes = [k, v]
    qa, d_out = q.to(acc), d_out.to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    grads = [(k.shape, acc), (v.shape, acc)]
    home = None  # this rank's own accumulator, finished by the last rank that needs the shard
    if plan.hops[who.rank]:
        home = transfer(None, to=who.rank, receive=grads, source=who.rank + plan.hops[who.rank], who=who,
                        tag=_TAG_HOME, what="backward: gradient of this rank's keys and values",
                        stats=setup.stats, device=k.device)
    held, grads_coming, sent, own = [k, v], None, None, None
    for step in range(plan.steps):
        source = (who.rank - step) % who.world
        coming = setup.pass_on(held, step, "backward")
        if held:
            dk, dv = _shard_gradients(setup, source, held, qa, dq, out, lse, d_out)
            if grads_coming is not None:  # the accumulator of the shard held now, from rank r - 1
                dk_in, dv_in = grads_coming.wait()
                dk, dv = dk.add_(dk_in), dv.add_(dv_in)
                del dk_in, dv_in
            if sent is not None:
                sent.wait()  # the previous accumulator has left: its buffers may go
            onward = plan.forwards(who.rank, step)
            if onward or step:
                sent = transfer([dk, dv], to=who.rank + 1 if onward else source, receive=None, source=0,
                                who=who, tag=_TAG_DKV if onward else _TAG_HOME, stats=setup.stats,
                                what=f"backward step {step}: gradient exchange")
            else:
                own = (dk, dv)
            del dk, dv
        grads_coming = (transfer(None, to=0, receive=grads, source=who.rank - 1, who=who, tag=_TAG_DKV,
                                 what=f"backward step {step}: gradient exchange", stats=setup.stats,
                                 device=k.device)
                        if plan.forwards(who.rank - 1, step) else None)
        held = coming.wait()
    if sent is not None:
        sent.wait()
    setup.count_skipped()
    dk, dv = home.wait() if home is not None else own
    return dq, dk, dv


def head_chunks_of(q_heads: int, kv_heads: int, chunks: int) -> list[tuple[slice, slice]]:
    """``(query heads, key/value heads)`` of each of ``chunks`` runs of the ring (at most one per
    key/value head; a query head goes with its key/value head, as in grouped-query attention).

    Example:
        >>> head_chunks_of(8, 2, 4)     # two key/value heads: two chunks at most
        [(slice(0, 4, None), slice(0, 1, None)), (slice(4, 8, None), slice(1, 2, None))]
    """
    chunks, group = min(positive_int("head_chunks", chunks), kv_heads), q_heads // kv_heads
    edges = [kv_heads * i // chunks for i in range(chunks + 1)]
    return [(slice(a * group, b * group), slice(a, b)) for a, b in zip(edges, edges[1:])]


def _forward_by_heads(setup: _Setup, q: Tensor, k: Tensor, v: Tensor,
                      chunks: list[tuple[slice, slice]]) -> tuple[Tensor, Tensor]:
    """:func:`_forward` once per chunk of heads: the ring's buffers hold one chunk's heads."""
    if len(chunks) == 1:
        return _forward(setup, q, k, v)
    B, Hq, T, _ = q.shape
    out = q.new_empty(B, Hq, T, v.shape[-1], dtype=score_dtype(q.dtype))  # (B, Hq, T, Dv)
    lse = q.new_empty(B, Hq, T, dtype=out.dtype)
    for i, (hq, hkv) in enumerate(chunks):
        setup.counting, setup.head_start = i == 0, hq.start
        out[:, hq], lse[:, hq] = _forward(setup, q[:, hq], k[:, hkv], v[:, hkv])
    setup.head_start = 0
    return out, lse


def _backward_by_heads(setup: _Setup, d_out: Tensor, saved: tuple,
                       chunks: list[tuple[slice, slice]]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_backward` once per chunk of heads, into whole-size gradients."""
    if len(chunks) == 1:
        return _backward(setup, d_out, saved)
    q, k, v, out, lse = saved
    dq, dk, dv = (torch.empty(t.shape, dtype=out.dtype, device=t.device) for t in (q, k, v))
    for i, (hq, hkv) in enumerate(chunks):
        setup.counting, setup.head_start = i == 0, hq.start
        dq[:, hq], dk[:, hkv], dv[:, hkv] = _backward(
            setup, d_out[:, hq], (q[:, hq], k[:, hkv], v[:, hkv], out[:, hq], lse[:, hq]))
    setup.head_start = 0
    return dq, dk, dv


def _ring_forward(plan: tuple, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple:
    """out in q's dtype, then the merged out (None when already in q's dtype) and lse, in the
    accumulation dtype, the sinks folded in: every piece's backward, given them, is exact."""
    setup, chunks = plan
    out, lse = _forward_by_heads(setup, q, k, v, chunks)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sink_logits(sinks, lse.dtype))
    return out.to(q.dtype), lse, None if out.dtype == q.dtype else out


def _ring_gradients(plan: tuple, needs: frozenset, d_out: Tensor, tensors: tuple, outputs: tuple) -> tuple:
    """The ring run again for dq, dk, dv; the sinks' gradient from this rank's queries."""
    setup, chunks = plan
    q, k, v, sinks = tensors
    out = outputs[0] if outputs[2] is None else outputs[2]
    lse = outputs[1]
    dq, dk, dv = _backward_by_heads(setup, d_out, (q, k, v, out, lse), chunks)
    d_sinks = None
    if sinks is not None and 3 in needs:
        d_sinks = sinks_gradient(sinks, sink_logits(sinks, lse.dtype), lse, row_delta(d_out, out, out.dtype))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sinks


# ``apply((setup, head chunks), q, k, v, sinks)``: the ring forward, its backward the ring again.
_RingFunction = kernel_function("ring", _ring_forward, _ring_gradients)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, who: Peers, layout, causal: bool,
                   scale: float, mask=None, stats: CommStats | None = None, head_chunks: int = 1,
                   score_mod=None, sinks: Tensor | None = None, head_offset: int = 0,
                   heads: int | None = None) -> Tensor:
    """Ring attention on checked shards; see :func:`attnlab.distributed.context_parallel_attention`.

    ``score_mod`` is evaluated at global positions and at global heads ``head_offset + h`` of
    ``heads`` (default: ``q``'s, all of them); ``sinks`` ``(Hq,)`` are those of ``q``'s heads."""
    length = q.shape[2] * who.world
    plan, pieces = _plan_ring(rank=who.rank, world=who.world, layout=layout, length=length,
                              causal=causal, mask=mask, batch=q.shape[0], device=q.device)
    if stats is not None:
        stats.plan = plan
    where = None
    if score_mod is not None:
        where = [positions(length, layout=layout, rank=r, world=who.world, device=q.device) for r in range(who.world)]
    setup = _Setup(who, plan=plan, pieces=pieces, scale=scale, stats=stats, shapes=[k, v], score_mod=score_mod,
                   where=where, head_offset=head_offset, heads=q.shape[1] if heads is None else heads)
    return _RingFunction.apply((setup, head_chunks_of(q.shape[1], k.shape[1], head_chunks)), q, k, v, sinks)[0]
