"""The fast paths walked step by step on the explain sentence: flash tiles, top-k keys, a linear state.

:func:`attnlab.lab.explain.trace` shows attention the textbook way: the whole score matrix, its
softmax, the weighted sum. The library's fast paths reach the same numbers another way; each
function here takes a trace (its queries, keys and values, head by head) and redoes the
computation the fast way, keeping every intermediate as a :class:`~attnlab.lab.explain.Step`:

* :func:`flash_walk`: FlashAttention's online softmax, one query tile and key tile at a time:
  the tile's scores, the new running maximum ``m``, the rescale factor ``exp(m_old - m_new)``,
  the running sum ``l`` and the partial output; tiles the mask leaves empty are skipped exactly
  as the ``chunked`` backend skips them (key tiles start at the first key the query tile may
  reach, :func:`attnlab.masks.block_spans`). Ends with ``O / l`` and ``lse`` beside the
  textbook's; optionally the backward's ``D = rowsum(dO * O)`` and ``dS = P (dP - D)`` beside
  autograd's.
* :func:`sparse_walk`: DeepSeek's lightning indexer scores every (query, key) pair, each query
  keeps its ``topk`` best keys and attention runs over those only (``attnlab.attention(indices=)``);
  the difference from dense attention is shown.
* :func:`linear_walk`: linear attention's state ``S_t`` after each token (its decay and the delta
  rule's correction ``v - S'^T k``), its output equal to the parallel form and to
  :func:`attnlab.linear_attention`.

Each returns a :class:`Walk`: its steps, its output ``(Tq, heads * d_v)``, the output it must equal
(``reference``) and the named differences (``checks``).

Example:
    >>> from attnlab.lab.explain import trace
    >>> w = flash_walk(trace("The sun rises in the east", mode="causal"), tile=2)
    >>> w.skipped, w.visited, w.checks["output vs textbook"] < 1e-6
    (3, 6, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab._checks import non_negative_int, positive_int
from attnlab._math import softmax_rows
from attnlab.backends import build_call
from attnlab.backends.blocks import visited_fraction
from attnlab.functional import attention
from attnlab.lab.explain import Step, Trace
from attnlab.lab.viz import html as _html
from attnlab.linear import linear_attention
from attnlab.nn import LightningIndexer

__all__ = ["WALKS", "LINEAR_RULES", "PRECISIONS", "Tile", "Walk", "flash_walk", "flash_mask", "blocks_share",
           "sparse_walk", "linear_walk"]

WALKS = ("textbook", "flash", "sparse", "linear")
LINEAR_RULES = ("additive", "decay", "delta", "gated-delta")
PRECISIONS = {"fp32": torch.float32, "fp64": torch.float64}
PAD = "<pad>"


@dataclass(frozen=True)
class Tile:
    """One (query tile, key tile) of the flash walk: the queries ``[qs, qe)``, the keys ``[ks, ke)``.

    ``status``: ``"full"`` (every pair allowed), ``"partial"`` (some pairs masked) or ``"empty"``
    (nothing allowed: skipped, as the ``chunked`` backend skips it).

    Example:
        >>> Tile(0, 4, 0, 4, "partial").cells
        16
    """

    qs: int
    qe: int
    ks: int
    ke: int
    status: str

    @property
    def cells(self) -> int:
        return (self.qe - self.qs) * (self.ke - self.ks)


@dataclass
class Walk:
    """A fast path walked on a trace's sentence.

    Attributes:
        kind: ``"flash"``, ``"sparse"`` or ``"linear"``.
        trace: the textbook trace whose queries, keys and values were used.
        tokens, context_tokens: query-side and key-side labels (with ``<pad>`` tokens when padded).
        heads: the trace's heads; steps of every head are kept, per-head steps carry ``head``.
        steps: the walk, in order.
        output: ``(Tq, heads * d_v)``.
        reference: what ``output`` must equal, same shape (the textbook, or the parallel form).
        checks: name -> largest absolute difference (e.g. ``"output vs textbook"``).
        dtype: the precision of the walk.
        tile, window, pad: flash: the tile size, the window (or None) and the padded keys.
        tiles: flash: the key tiles visited per query tile (head 0);
            empty_tiles: flash: tiles inside a query tile's reach whose mask allows nothing (skipped);
            spans: flash: ``(qs, qe, lo, hi)`` per query tile, the keys it may reach
            (:func:`attnlab.masks.block_spans`; keys outside are never read);
            allowed: flash: ``(Tq, Tk)`` bool, which pairs the mask allows; skipped, visited: flash:
            the tiles skipped and computed per head, against the ``ceil(Tq/tile) * ceil(Tk/tile)``
            tiles of an unmasked call; row_stats: flash: ``(Tq, 3)`` final ``m``, ``l``, ``lse`` of head 0.
        kept: sparse: ``(Tq, Tk)`` bool, the keys each query keeps.
        notes: one-line facts the terminal prints after the steps.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> w = linear_walk(trace("The sun rises"), rule="delta")
        >>> w.kind, w.output.shape, w.checks["output vs attnlab.linear_attention"] < 1e-6
        ('linear', torch.Size([3, 4]), True)
    """

    kind: str
    trace: Trace
    tokens: list[str]
    context_tokens: list[str]
    heads: int
    dtype: torch.dtype
    steps: list[Step] = field(default_factory=list)
    output: Tensor | None = None
    reference: Tensor | None = None
    checks: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tile: int | None = None
    window: int | None = None
    pad: int = 0
    tiles: list[Tile] = field(default_factory=list)
    empty_tiles: list[Tile] = field(default_factory=list)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    allowed: Tensor | None = None
    skipped: int = 0
    visited: int = 0
    row_stats: Tensor | None = None
    kept: Tensor | None = None

    def _repr_html_(self) -> str:
        """The walk, rendered where a notebook shows it: its checks, tile grid (flash) and steps."""
        return _html.fast_walk_view(self)

    def __repr__(self) -> str:
        return f"<Walk: {self.kind} attention of {self.trace.sentence!r}, {len(self.steps)} steps>"


# ----------------------------------------------------------------------------- shared
def _check_trace(trace: Trace, kind: str) -> None:
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be an attnlab.lab.explain.Trace, got {type(trace).__name__}")
    used = [name for name, value in (("dropout", trace.dropout_p > 0), ("a score mod", trace.score_mod is not None),
                                     ("sinks", trace.sinks is not None)) if value]
    if used:
        raise ValueError(f"the {kind} walk redoes plain attention; the trace has {', '.join(used)}")


def _dtype(precision: str) -> torch.dtype:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    return PRECISIONS[precision]


def _qkv(trace: Trace, h: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Head ``h``'s queries ``(Tq, d_kq)``, keys ``(Tk, d_kq)`` and values ``(Tk, d_v)`` in ``dtype``."""
    return tuple(trace.step(name, h).tensor.to(dtype) for name in ("queries", "keys", "values"))


def _labels(prefix: str, start: int, end: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(start, end))


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# ----------------------------------------------------------------------------- flash
def flash_walk(trace: Trace, *, tile: int = 4, window: int | None = None, pad: int = 0, backward: bool = False,
               precision: str = "fp32") -> Walk:
    """The trace's attention computed FlashAttention's way, tile by tile, every running statistic kept.

    Per query tile ``[qs, qe)`` the running maximum ``m`` starts at ``-inf``, the running sum ``l``
    and the accumulator ``acc`` at 0. For each key tile ``[ks, ke)`` the tile may reach (key tiles start
    at the first key reachable, :func:`attnlab.masks.block_spans`, as the ``chunked`` backend's do)::

        S = Q_i K_j^T / sqrt(d)       m_new = max(m_old, rowmax(S))      r = exp(m_old - m_new)
        P = exp(S - m_new)            l = r l + rowsum(P)                acc = r acc + P V_j

    and at the end ``O = acc / l``, ``lse = m + log l``. A tile whose mask allows nothing is skipped.

    Args:
        trace: a trace without dropout, score mod or sinks.
        tile: queries and keys per tile.
        window: a causal sliding window of this many keys (None: the trace's own mask).
        pad: pad the keys (and, for self-attention, the queries) with this many zero vectors,
            masked out as a padded batch row's keys are.
        backward: add the backward's ``D = rowsum(dO * O)`` and ``dS = P (dP - D)`` for a seeded
            ``dO``, beside autograd's gradient of the scores.
        precision: ``"fp32"`` or ``"fp64"``.

    Returns:
        a :class:`Walk`; ``checks["output vs textbook"]`` and ``checks["lse vs textbook"]`` are the
        largest differences from the dense softmax (<= 1e-6 in fp32, rounding only in fp64).

    Raises:
        TypeError: ``trace`` is not a Trace. ValueError: a bad ``tile``, ``window``, ``pad`` or
        ``precision``, or a trace with dropout, a score mod or sinks.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> w = flash_walk(trace("The sun rises in the east", mode="causal"), tile=4, precision="fp64")
        >>> [(t.qs, t.ks, t.status) for t in w.tiles], w.checks["output vs textbook"] < 1e-12
        ([(0, 0, 'partial'), (4, 0, 'full'), (4, 4, 'partial')], True)
    """
    _check_trace(trace, "flash")
    positive_int("tile", tile)
    if window is not None:
        positive_int("window", window)
    non_negative_int("pad", pad)
    dtype = _dtype(precision)
    self_like = trace.mode != "cross"
    tq, tk = len(trace.tokens) + (pad if self_like else 0), len(trace.context_tokens) + pad
    mod = flash_mask(trace, window=window, pad=pad)
    allowed = torch.ones(tq, tk, dtype=torch.bool) if mod is None else _masks.materialize(mod, tq=tq, tk=tk)[0, 0]
    walk = Walk("flash", trace, trace.tokens + [PAD] * (tq - len(trace.tokens)),
                trace.context_tokens + [PAD] * pad, trace.heads, dtype, tile=tile, window=window, pad=pad,
                allowed=allowed)
    spans = walk.spans = _masks.block_spans(mod, tq, tk, tile)
    outputs, references = [], []
    for h in range(trace.heads):
        q, k, v = (_padded(x, n) for x, n in zip(_qkv(trace, h, dtype), (tq, tk, tk)))
        out, lse, tiles = _flash_head(walk, h, q, k, v, spans)
        dense_out, dense_lse, weights = _dense(q, k, v, allowed)
        walk.checks["output vs textbook"] = max(walk.checks.get("output vs textbook", 0.0), _max_diff(out, dense_out))
        walk.checks["lse vs textbook"] = max(walk.checks.get("lse vs textbook", 0.0),
                                             _max_diff(*_finite_lse(lse, dense_lse)))
        if h == 0:
            walk.tiles = tiles
            walk.visited = len(tiles)
            walk.skipped = math.ceil(tq / tile) * math.ceil(tk / tile) - len(tiles) if tq and tk else 0
        beside = torch.cat([out, dense_out, lse[:, None], dense_lse[:, None]], dim=-1)  # (Tq, 2 d_v + 2)
        cols = _labels("O", 0, out.shape[1]) + _labels("textbook", 0, out.shape[1]) + ("lse", "textbook lse")
        walk.steps.append(Step("beside_textbook", "Beside the textbook  O = acc / l  vs  softmax(S) V", beside,
                               "The tiled result and the textbook's, column by column: equal up to rounding.",
                               tuple(walk.tokens), cols, h))
        if backward:
            _flash_backward(walk, h, q, k, v, out, lse, allowed, weights)
        outputs.append(out)
        references.append(dense_out)
    walk.output = torch.cat(outputs, dim=-1)  # (Tq, heads * d_v)
    walk.reference = torch.cat(references, dim=-1)
    _flash_summary(walk)
    if window is not None or pad:
        parts = ([f"a causal window of {window}"] if window is not None else []) + (
            [f"{pad} padded keys"] if pad else [])
        walk.notes.append(f"the textbook here is the dense softmax under the same mask ({' and '.join(parts)})")
    return walk


def flash_mask(trace: Trace, *, window: int | None = None, pad: int = 0):
    """The mask mod the flash walk uses: the trace's causal mask or a window, and key padding; None if none.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> flash_mask(trace("a b c", mode="causal"), pad=1)
        CombinedMod(CausalMod(offset=0), PaddingMod(lengths=[3]), op='and')
    """
    tq = len(trace.tokens) + (pad if trace.mode != "cross" else 0)
    tk = len(trace.context_tokens) + pad
    parts = []
    if window is not None:
        parts.append(_masks.sliding_window_mod(tq, tk, window))
    elif trace.causal:
        parts.append(_masks.causal_mod(tq, tk))
    if pad:
        parts.append(_masks.padding_mod(torch.tensor([len(trace.context_tokens)])))
    return None if not parts else parts[0] if len(parts) == 1 else _masks.and_masks(*parts)


def _padded(x: Tensor, rows: int) -> Tensor:
    """``x`` ``(T, D)`` with zero rows appended up to ``rows``."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if rows > x.shape[0] else x


def _dense(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The textbook: ``softmax(Q K^T / sqrt(d))`` masked, times V; returns (out, lse, weights)."""
    scores = (q @ k.T / math.sqrt(k.shape[-1])).masked_fill(~allowed, float("-inf"))  # (Tq, Tk)
    weights = softmax_rows(scores)
    return weights @ v, torch.logsumexp(scores, dim=-1), weights


def _finite_lse(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Two lse vectors with rows that attend nothing (-inf in both) left out."""
    live = torch.isfinite(b)
    return a[live], b[live]


def _flash_head(walk: Walk, h: int, q: Tensor, k: Tensor, v: Tensor, spans) -> tuple[Tensor, Tensor, list[Tile]]:
    """One head's online softmax over ``spans``; records each visited tile's steps for head ``h``."""
    tile, allowed = walk.tile, walk.allowed
    scale = 1.0 / math.sqrt(k.shape[-1])
    out, lse = q.new_zeros(q.shape[0], v.shape[1]), q.new_full((q.shape[0],), float("-inf"))
    tiles, stats = [], q.new_zeros(q.shape[0], 3)
    for row, (qs, qe, lo, hi) in enumerate(spans):
        m = q.new_full((qe - qs,), float("-inf"))
        l, acc = q.new_zeros(qe - qs), q.new_zeros(qe - qs, v.shape[1])  # (tile,), (tile, d_v)
        for ks in range(lo, hi, tile):
            ke = min(ks + tile, hi)
            cell = allowed[qs:qe, ks:ke]
            if not bool(cell.any()):
                if h == 0:
                    walk.empty_tiles.append(Tile(qs, qe, ks, ke, "empty"))
                continue  # chunked skips a tile its mask leaves empty
            tiles.append(Tile(qs, qe, ks, ke, "full" if bool(cell.all()) else "partial"))
            scores = (q[qs:qe] @ k[ks:ke].T * scale).masked_fill(~cell, float("-inf"))  # (tile, tile)
            m_new = torch.maximum(m, scores.max(dim=-1).values)
            rescale = torch.exp(m - m_new).nan_to_num(0.0)  # m_old = -inf: nothing to rescale yet
            p = torch.exp(scores - m_new[:, None]).nan_to_num(0.0)
            l = rescale * l + p.sum(-1)
            acc = rescale[:, None] * acc + p @ v[ks:ke]  # (tile, d_v)
            _tile_steps(walk, h, Tile(qs, qe, ks, ke, tiles[-1].status), row, scores, m, m_new, rescale, p, l, acc)
            m = m_new
        live = l > 0
        out[qs:qe] = torch.where(live[:, None], acc / l.clamp_min(torch.finfo(l.dtype).tiny)[:, None], 0.0)
        lse[qs:qe] = torch.where(live, m + torch.log(l), float("-inf"))
        stats[qs:qe] = torch.stack([m, l, lse[qs:qe]], dim=-1)
    if h == 0:
        walk.row_stats = stats
    walk.steps.append(Step("flash_output", "Output  O = acc / l", out, "Each row's accumulated values divided by its "
                           "running sum: the softmax's normalisation, done once at the end.",
                           tuple(walk.tokens), _labels("z", 0, v.shape[1]), h))
    walk.steps.append(Step("flash_lse", "Log-sum-exp  lse = m + log l", lse, "What the backward keeps instead of the "
                           "weights: P = exp(S - lse) rebuilds any tile's weights.", None, tuple(walk.tokens), h))
    return out, lse, tiles


def _tile_steps(walk: Walk, h: int, t: Tile, row: int, scores, m_old, m_new, rescale, p, l, acc) -> None:
    """The scores of one tile and its rows' running statistics, as two steps of head ``h``."""
    q_labels, k_labels = tuple(walk.tokens[t.qs:t.qe]), tuple(walk.context_tokens[t.ks:t.ke])
    where = f"query tile {row} (tokens {t.qs}-{t.qe - 1}) x keys {t.ks}-{t.ke - 1}"
    walk.steps.append(Step(f"tile_{t.qs}_{t.ks}_scores", f"Tile scores  S = Q K^T / sqrt(d), {where}", scores,
                           f"Only this {t.qe - t.qs} x {t.ke - t.ks} tile of scores exists now ({t.status}: "
                           + ("every pair allowed)." if t.status == "full" else "masked pairs are -inf)."),
                           q_labels, k_labels, h, first_row=t.qs))
    stats = torch.cat([torch.stack([m_old, m_new, rescale, p.sum(-1), l], dim=-1), acc], dim=-1)  # (tile, 5 + d_v)
    cols = ("m_old", "m_new", "exp(m_old-m_new)", "rowsum(P)", "l") + _labels("acc", 0, acc.shape[1])
    walk.steps.append(Step(f"tile_{t.qs}_{t.ks}_stats", f"Running statistics  after keys {t.ks}-{t.ke - 1}", stats,
                           "m_new = max(m_old, rowmax S); the old sum and accumulator shrink by exp(m_old - m_new) "
                           "(1 when the maximum did not move), then this tile's P = exp(S - m_new) is added.",
                           q_labels, cols, h, first_row=t.qs))


def _flash_backward(walk: Walk, h: int, q, k, v, out, lse, allowed, weights) -> None:
    """``D = rowsum(dO * O)`` and ``dS = P (dP - D)`` for a seeded ``dO``, beside autograd's dS."""
    generator = torch.Generator().manual_seed(walk.trace.seed + h)
    d_out = torch.randn(out.shape, generator=generator, dtype=out.dtype)  # (Tq, d_v)
    delta = (d_out * out).sum(-1)  # (Tq,)
    scale = 1.0 / math.sqrt(k.shape[-1])
    probs = torch.exp(q @ k.T * scale - lse[:, None]).masked_fill(~allowed, 0.0).nan_to_num(0.0)  # (Tq, Tk)
    d_scores = probs * (d_out @ v.T - delta[:, None])
    scores = (q @ k.T * scale).requires_grad_()
    with torch.enable_grad():
        dense = softmax_rows(scores.masked_fill(~allowed, float("-inf"))) @ v
        (autograd,) = torch.autograd.grad(dense, scores, d_out)
    walk.checks["dS vs autograd"] = max(walk.checks.get("dS vs autograd", 0.0), _max_diff(d_scores, autograd))
    rows, cols = tuple(walk.tokens), tuple(walk.context_tokens)
    walk.steps.append(Step("backward_delta", "Backward  D = rowsum(dO * O)", delta, "One number per query: the "
                           "output gradient dotted with the output (dO is seeded random here).", None, rows, h))
    walk.steps.append(Step("backward_dS", "Backward  dS = P * (dO V^T - D)", d_scores, "The scores' gradient from P "
                           "(rebuilt from lse), never needing the softmax's Jacobian.", rows, cols, h))
    walk.steps.append(Step("backward_autograd", "Autograd's dS  (to compare)", autograd,
                           "The same gradient through the textbook softmax by autograd.", rows, cols, h))


def _flash_summary(walk: Walk) -> None:
    tq, tk, t = len(walk.tokens), len(walk.context_tokens), walk.tile
    total = math.ceil(tq / t) * math.ceil(tk / t) if tq and tk else 0
    partial = sum(tile.status == "partial" for tile in walk.tiles)
    walk.notes.append(f"tiles of {t}: {walk.visited} of {total} computed ({partial} partial), {walk.skipped} skipped"
                      + (" per head" if walk.heads > 1 else ""))
    computed = sum(tile.cells for tile in walk.tiles)
    walk.notes.append(f"{computed} of {tq * tk} scores computed ({computed / max(1, tq * tk):.0%}); the blocks "
                      f"backend, query blocks of {t}, computes {blocks_share(walk):.0%} (each block's reach, "
                      "without skipping tiles its mask leaves empty)")


def blocks_share(walk: Walk) -> float:
    """The share of the flash walk's score matrix the ``blocks`` backend computes with blocks of its tile.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> blocks_share(flash_walk(trace("a b c d", mode="causal"), tile=2))
        0.75
    """
    tq, tk = len(walk.tokens), len(walk.context_tokens)
    if walk.kind != "flash":
        raise ValueError(f"blocks_share is for a flash walk; this walk is {walk.kind!r}")
    x, y = torch.zeros(1, 1, tq, 1), torch.zeros(1, 1, tk, 1)  # only the sizes matter
    mod = flash_mask(walk.trace, window=walk.window, pad=walk.pad)
    return visited_fraction(build_call(x, y, y, mask=mod), block=walk.tile)


# ----------------------------------------------------------------------------- sparse
def sparse_walk(trace: Trace, *, topk: int = 4, index_heads: int = 2, index_dim: int = 4,
                precision: str = "fp32") -> Walk:
    """The trace's attention over each query's ``topk`` keys, chosen by a seeded lightning indexer (DSA).

    The indexer (:class:`attnlab.nn.LightningIndexer`, built under the trace's seed) scores every
    (query, key) pair from the embeddings; each query keeps its ``topk`` best allowed keys (fewer
    where fewer are allowed); attention runs over only those, and the result is compared with
    ``attnlab.attention(q, k, v, indices=...)`` and with the dense textbook.

    Args:
        trace: a self-attention trace (``self``, ``causal`` or ``multihead``) without dropout,
            score mod or sinks.
        topk: keys kept per query.
        index_heads, index_dim: the indexer's heads and features per head.
        precision: ``"fp32"`` or ``"fp64"``.

    Raises:
        TypeError, ValueError: a bad trace or option, a cross-attention trace.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> w = sparse_walk(trace("The sun rises in the east", mode="causal"), topk=2)
        >>> w.kept.sum(-1).tolist(), w.checks["output vs attnlab.attention(indices=)"] < 1e-6
        ([1, 2, 2, 2, 2, 2], True)
    """
    _check_trace(trace, "sparse")
    if trace.mode == "cross":
        raise ValueError("the sparse walk is self-attention (the indexer scores a sequence against itself); "
                         "mode is 'cross'")
    for name, value in (("topk", topk), ("index_heads", index_heads), ("index_dim", index_dim)):
        positive_int(name, value)
    dtype = _dtype(precision)
    walk = Walk("sparse", trace, list(trace.tokens), list(trace.context_tokens), trace.heads, dtype)
    x = trace.step("embeddings").tensor.to(dtype)[None]  # (1, T, d_model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(trace.seed)
        indexer = LightningIndexer(trace.d_model, heads=index_heads, head_dim=index_dim, topk=topk).to(dtype)
    with torch.no_grad():
        index_scores = indexer.scores(x)[0]  # (T, T)
        indices = indexer(x, causal=trace.causal)  # (1, 1, T, k), -1 = no key
    t = len(trace.tokens)
    kept = torch.zeros(t, t, dtype=torch.bool)
    for i, row in enumerate(indices[0, 0].tolist()):
        kept[i, [j for j in row if j >= 0]] = True
    walk.kept = kept
    rows, cols = tuple(trace.tokens), tuple(trace.context_tokens)
    shown = index_scores.masked_fill(~torch.ones_like(kept).tril(), float("-inf")) if trace.causal else index_scores
    walk.steps.append(Step("index_scores", "Index scores  I = sum_h w_h ReLU(q_h k / sqrt(d))", shown,
                           f"{index_heads} small index heads score every pair cheaply (DeepSeek-V3.2's lightning "
                           "indexer, seeded random here)" + ("; future keys are not scored." if trace.causal else "."),
                           rows, cols))
    walk.steps.append(Step("kept", f"Kept keys  top-{topk} of each row of I", kept,
                           f"Each query keeps its {topk} best-scored keys (all of them where it has fewer); "
                           "attention reads only these.", rows, cols))
    outputs, library, dense = [], [], []
    for h in range(trace.heads):
        q, k, v = _qkv(trace, h, dtype)
        allowed = kept & (torch.ones_like(kept).tril() if trace.causal else torch.ones_like(kept))
        scores = (q @ k.T / math.sqrt(k.shape[-1])).masked_fill(~allowed, float("-inf"))  # (T, T)
        weights = softmax_rows(scores)
        outputs.append(weights @ v)
        walk.steps.append(Step("sparse_weights", "Sparse weights  softmax over the kept keys", weights,
                               "The softmax of each row over its kept keys only: every other key gets exactly 0.",
                               rows, cols, h))
        dense_weights = softmax_rows((q @ k.T / math.sqrt(k.shape[-1])).masked_fill(
            ~torch.ones_like(kept).tril() if trace.causal else torch.zeros_like(kept), float("-inf")))
        walk.steps.append(Step("weight_change", "Change from dense  A_sparse - A_dense", weights - dense_weights,
                               "Positive where a kept key gained the weight the dropped keys lost.", rows, cols, h))
        dense.append(dense_weights @ v)
        four = [x[None, None] for x in (q, k, v)]  # (1, 1, T, D)
        library.append(attention(*four, indices=indices, causal=trace.causal)[0, 0])
    walk.output, walk.reference = torch.cat(outputs, -1), torch.cat(library, -1)  # (T, heads * d_v)
    walk.steps.append(Step("sparse_output", "Output  A_sparse V", walk.output,
                           "Each query's weighted sum of the values of its kept keys.", rows,
                           _labels("o", 0, walk.output.shape[1])))
    walk.checks["output vs attnlab.attention(indices=)"] = _max_diff(walk.output, walk.reference)
    walk.checks["output vs dense (what top-k changes)"] = _max_diff(walk.output, torch.cat(dense, -1))
    allowed_pairs = int(torch.ones_like(kept).tril().sum()) if trace.causal else t * t
    walk.notes.append(f"{int(kept.sum())} of the {allowed_pairs} allowed (query, key) pairs are read "
                      f"(top-{topk} of each row)")
    return walk


# ----------------------------------------------------------------------------- linear
def linear_walk(trace: Trace, *, rule: str = "decay", precision: str = "fp32") -> Walk:
    """The trace's queries, keys and values through linear attention: the state ``S_t`` token by token.

    Per head, from ``S_0 = 0`` (``g_t`` = the decay, ``b_t`` = the delta rule's beta, seeded)::

        S'_t = g_t S_{t-1}      S_t = S'_t + k_t v_t^T   (additive, decay)
                                S_t = S'_t + b_t k_t (v_t - S'_t^T k_t)^T   (delta, gated-delta)
        o_t = S_t^T q_t / sqrt(d)

    Delta rules normalise q and k to unit length, as DeltaNet does. The output equals the parallel
    form ``((Q K^T) * M) V / sqrt(d)`` (``M[t, s] = g_{s+1} ... g_t`` for ``s <= t``, else 0) for the
    additive and decay rules, and :func:`attnlab.linear_attention` for every rule.

    Args:
        trace: a self-attention trace without dropout, score mod or sinks (linear attention is
            causal by construction, whatever the trace's mask).
        rule: ``"additive"``, ``"decay"``, ``"delta"`` or ``"gated-delta"``.
        precision: ``"fp32"`` or ``"fp64"``.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> w = linear_walk(trace("The sun rises in the east"), rule="decay", precision="fp64")
        >>> w.checks["output vs parallel form"] < 1e-12
        True
    """
    _check_trace(trace, "linear")
    if rule not in LINEAR_RULES:
        raise ValueError(f"rule must be one of {', '.join(LINEAR_RULES)}; got {rule!r}")
    if trace.mode == "cross":
        raise ValueError("the linear walk is causal self-attention (one state over one sequence); mode is 'cross'")
    dtype = _dtype(precision)
    walk = Walk("linear", trace, list(trace.tokens), list(trace.context_tokens), trace.heads, dtype)
    t = len(trace.tokens)
    generator = torch.Generator().manual_seed(trace.seed)
    log_decay = -(0.05 + 0.45 * torch.rand(trace.heads, t, generator=generator, dtype=dtype))  # (H, T), <= 0
    beta = torch.sigmoid(torch.randn(trace.heads, t, generator=generator, dtype=dtype))  # (H, T) in (0, 1)
    decays = rule in ("decay", "gated-delta")
    delta = rule in ("delta", "gated-delta")
    outputs, parallel, library = [], [], []
    for h in range(trace.heads):
        q, k, v = _qkv(trace, h, dtype)
        if delta:
            q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
        g = log_decay[h] if decays else None
        b = beta[h] if delta else None
        outputs.append(_linear_head(walk, h, q, k, v, g, b))
        if not delta:
            parallel.append(_parallel_form(q, k, v, g))
        four = [x[None, None] for x in (q, k, v)]  # (1, 1, T, D)
        library.append(linear_attention(*four, decay=None if g is None else g[None, None],
                                                beta=None if b is None else b[None, None], backend="reference")[0, 0])
    walk.output, walk.reference = torch.cat(outputs, -1), torch.cat(library, -1)  # (T, heads * d_v)
    if parallel:
        walk.checks["output vs parallel form"] = _max_diff(walk.output, torch.cat(parallel, -1))
    walk.checks["output vs attnlab.linear_attention"] = _max_diff(walk.output, walk.reference)
    d_kq = trace.d_kq
    if not trace.causal:
        walk.notes.append(f"linear attention is causal by construction: token t reads a state of tokens 0..t "
                          f"(the trace's mode {trace.mode!r} lets the textbook read every token)")
    walk.notes.append(f"the state is {d_kq} x {trace.d_v} numbers per head at every length; softmax attention "
                      f"keeps {t} keys and values ({t} x {d_kq + trace.d_v}) and grows with each token")
    return walk


def _linear_head(walk: Walk, h: int, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None,
                 beta: Tensor | None) -> Tensor:
    """Run the recurrence for head ``h``, recording ``S_t`` after each token; return ``(T, d_v)``."""
    tokens = walk.tokens
    scale = k.shape[-1] ** -0.5
    state = q.new_zeros(k.shape[-1], v.shape[-1])  # (d_kq, d_v)
    outs, corrections, gates = [], [], []
    for t, word in enumerate(tokens):
        gate = float(torch.exp(log_decay[t])) if log_decay is not None else 1.0
        state = state * gate
        write = v[t]
        if beta is not None:
            correction = v[t] - state.T @ k[t]  # what S' mispredicts for this key (d_v,)
            corrections.append(correction)
            write = beta[t] * correction
        state = state + torch.outer(k[t], write)
        outs.append(scale * state.T @ q[t])
        gates.append(gate)
        text = f"The state after '{word}': " + (f"the old state times g = {gate:.4g}, "
                                                  if log_decay is not None else "")
        text += (f"plus k v^T weighted by beta = {float(beta[t]):.4g} of the correction v - S'^T k."
                 if beta is not None else "plus k_t v_t^T: the state adds this token's key-value pair.")
        walk.steps.append(Step("state", f"State  S_{t} (token '{word}')", state.clone(), text,
                               _labels("k", 0, k.shape[-1]), _labels("v", 0, v.shape[-1]), h, first_row=None))
    if log_decay is not None:
        walk.steps.append(Step("gates", "Decay  g_t = exp(decay_t)", torch.tensor(gates, dtype=q.dtype),
                               "How much of the old state each token keeps (seeded here; a model computes it from "
                               "the token).", None, tuple(tokens), h))
    if beta is not None:
        walk.steps.append(Step("corrections", "Delta rule's correction  v_t - S'_t^T k_t", torch.stack(corrections),
                               "What the state predicted wrongly for each key: the delta rule writes only this, "
                               "so a repeated key overwrites instead of piling up.", tuple(tokens),
                               _labels("v", 0, v.shape[-1]), h))
    out = torch.stack(outs)  # (T, d_v)
    walk.steps.append(Step("linear_output", "Output  o_t = S_t^T q_t / sqrt(d)", out,
                           "Each token reads the state it just updated: no score matrix, no softmax.",
                           tuple(tokens), _labels("o", 0, v.shape[-1]), h))
    return out


def _parallel_form(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None) -> Tensor:
    """``((Q K^T) * M) V / sqrt(d)`` with the causal decay mask ``M`` ``(T, T)``."""
    t = q.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    if log_decay is None:
        decay_mask = causal.to(q.dtype)
    else:
        total = torch.cumsum(log_decay, 0)  # (T,): log of g_1 ... g_t
        decay_mask = torch.exp((total[:, None] - total[None, :]).masked_fill(~causal, float("-inf")))
    return ((q @ k.T) * decay_mask) @ v * k.shape[-1] ** -0.5
