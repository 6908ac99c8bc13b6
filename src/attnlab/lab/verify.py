"""Conformance sweep: every backend against the fp64 reference, forward and backward.

One mechanism serves ``attnlab verify`` and ``tests/test_conformance.py``:

* :func:`configs` draws seeded random configurations: every small length (T in 1..40) and a
  few others (8, 16, 24, 113, 128, 1023, the big ones rare), Tq != Tk,
  D in {1, 3, 8, 16, 40, 64, 111}, Dv != D, H in {1, 3, 5}, grouped-query, every mask kind --
  none, bool, padding, float, mask mods (window, lambda, padding, combined, packed documents,
  prefix-LM, chunked local, varlen causal per sequence) -- each without causal and with causal
  in both alignments, and rows with nothing to attend. Every other configuration hands q
  (with the output gradient) and k/v in memory layouts (:data:`LAYOUTS`: transposed from
  ``(B, T, H, D)``, sliced or strided heads, a storage offset, a sliced or strided last dim,
  other permutations, batch-1 or one-head inputs expanded with stride 0; the same values in
  every layout), crossed with one, two and all key/value heads and batch 1 and 2-3. Mask kind
  and causal mode are cycled, not drawn: the first 12 configurations hold every mask kind and
  every causal mode, the first 36 every pairing of the two. Dropout off (dropout is tested
  separately: its random mask differs by backend). Every fourth configuration adds a score
  mod or sinks, cycled through :data:`SCORE_KINDS` (softcap, ALiBi both ways, T5's relative
  bias, an additive bias, a composition, a user's function, sinks alone and with mods, sinks
  per query broadcasting over batch or heads, infinite ones, and ``"mixed"``: ALiBi plus a bias
  held in a dtype other than the call's), so that they meet every mask kind, fully masked rows
  included; their learnable tensors (slopes, table, bias, sink logits, in the call's dtype:
  bf16 in a bf16 sweep) are checked in the backward pass like q, k and v. What issue 30's fuzz
  found bugs with is drawn too, from a generator of its own: values near 1 (v = 1 + 0.01 noise)
  on one configuration in 8 and every other one with ALiBi, an empty batch, query or key
  sequence on one in 16, and a scale of 40 (large logits, in half precision too) among the
  custom scales. The rule adds, for dq and dk, the FlashAttention-2 backward's documented
  bound (docs/contract.md, "Scale").
* a backend that serves only mask mods with bounds (``needs_bounds = True``: blocks) is swept
  over :data:`BOUNDED_MASKS`, so that it is checked on as many configurations as the others,
  score mods and sinks included (blocks declines the ones that are not additive).
* flex compiles one kernel per shape, so it is swept over the fixed shapes of
  :data:`FLEX_SHAPES` (small and block-sized, Tq != Tk, grouped-query), masks varying, with
  the score mods it serves (:data:`FLEX_SCORE_KINDS`: every kind but sinks; in fp16/bf16
  :data:`FLEX_HALF_SCORE_KINDS`, without a user's function).
* :func:`check` runs one backend on one configuration in one dtype and compares it with the
  reference run in fp64 -- the conformance rule: the backend's max error is at most 2x the
  error of the reference computed in the same dtype, plus a floor; gradients at most 3x.
* :func:`check_grad_mode` runs one configuration with grad mode on or off and
  ``requires_grad`` on some of q, k, v (:data:`GRAD_MODES`): a backend decides from what the
  call needs, and never accepts a call it then fails on.
* :func:`sweep` runs many checks and reports progress; it crosses the first
  ``GRAD_MODE_CONFIGS`` configurations each backend serves with every grad mode.

Floors are ``base * max(1, m) * sqrt(K)`` with ``m`` the largest fp64 value among out, dq,
dk, dv of the configuration and ``K = max(D, Dv, Tk)`` the longest reduction (rounding error
of a K-term sum grows like sqrt(K)); base: fp32 ``1e-6``;
bf16 ``2**-7`` (two bf16 units in the last place at magnitude 1: a fused kernel rounds its
inputs and its output once each, which the reference's own error does not bound on tiny
configurations where the reference happens to be exact). Backends that decline a call skip
it; a backend that cannot differentiate on this device (flex on CPU) is checked forward only.
A quick sweep (``small=True``) checks flex only on kernel variants this process has compiled
already: a first compilation takes longer than the whole quick sweep may.

Example:
    >>> import torch
    >>> result = check("sdpa", configs(1, seed=3)[0], torch.float32)
    >>> result.passed
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab import backends as _backends
from attnlab import masks as _masks
from attnlab import scores as _scores
from attnlab._call import build_call
from attnlab._checks import positive_int
from attnlab.functional import attention
from attnlab import linear
from attnlab.linear import linear_attention
from attnlab.linear._call import linear_call
from attnlab.linear.reference import run_reference

__all__ = ["Config", "CheckResult", "configs", "check", "check_grad_mode", "sweep", "GRAD_MODES", "GRAD_MODE_CONFIGS", "floor_for", "allowed_error", "FORWARD_FACTOR", "GRADIENT_FACTOR", "FLEX_SHAPES",
           "SMALL_MAX", "BOUNDED_MASKS", "LAYOUTS", "relayout", "broadcastable", "SCORE_KINDS", "flash_backward_bound",
           "FLEX_SCORE_KINDS", "FLEX_HALF_SCORE_KINDS", "LinearConfig", "LINEAR_RULES", "LINEAR_DTYPES",
           "LINEAR_PREFIX", "linear_backends", "linear_configs", "check_linear", "sweep_linear", "one_of_linear"]

SMALL_MAX = 40  # lengths 1..SMALL_MAX are drawn uniformly: kernels break on short, odd tails
# Multiples of the 8/16-lane vector widths are where fused kernels' tails go wrong.
_SEQ_LENGTHS = ("small", 1, 2, 8, 16, 24, 113, 128, 1023)
_SEQ_WEIGHTS = (0.45, 0.07, 0.07, 0.07, 0.05, 0.07, 0.1, 0.09, 0.03)  # 1023 rare: keep it fast
_HEAD_DIMS = (1, 3, 8, 16, 40, 64, 111)
_MASKS = ("none", "bool", "padding", "float", "mod_window", "mod_lambda", "mod_padding",
          "mod_combined", "mod_document", "mod_prefix", "mod_chunked", "mod_varlen")
# The mask kinds whose mod declares kv_bounds whatever the causal mode: what a backend that
# only serves bounded mods (``needs_bounds = True``, e.g. blocks) is swept over.
BOUNDED_MASKS = ("mod_window", "mod_combined", "mod_document", "mod_prefix", "mod_chunked",
                 "mod_varlen")
_CAUSAL = ((False, "top_left"), (True, "top_left"), (True, "bottom_right"))
# Score mods and sinks, cycled on every fourth configuration (sdpa and blocks serve 9 of the 13).
# Sinks are per head, except query_sinks (one logit per query, (B|1, H|1, Tq)) and
# infinite_sinks (per query, a quarter of them +inf and a quarter -inf).
SCORE_KINDS = ("softcap", "alibi", "sinks", "relative", "bias", "composed", "alibi_symmetric",
               "function", "softcap_sinks", "alibi_sinks", "query_sinks", "infinite_sinks", "mixed")
# The score kinds flex serves (it declines sinks), and in fp16/bf16 (where it also declines a
# user's function on CPU: torch's compiled kernel miscomputes some).
FLEX_SCORE_KINDS = tuple(kind for kind in SCORE_KINDS if "sinks" not in kind)
FLEX_HALF_SCORE_KINDS = tuple(kind for kind in FLEX_SCORE_KINDS if kind != "function")
# B, Hq, Hkv, Tq, Tk, D, Dv. flex compiles per shape, so it is swept over these only: small
# lengths with odd and even tails, Tq != Tk both ways, grouped-query, and whole 128-key blocks.
FLEX_SHAPES = (
    (2, 3, 1, 17, 23, 40, 40),
    (1, 2, 2, 8, 8, 16, 16),
    (1, 4, 2, 24, 17, 8, 8),
    (1, 2, 1, 33, 128, 40, 24),
    (1, 2, 2, 128, 128, 16, 16),
)
# Memory layouts of q, k, v that hold the same values (see :func:`relayout`). Backends that
# view tensors by their strides (merging batch and heads, blocks of rows) must read each right.
LAYOUTS = ("contiguous", "transposed", "heads_sliced", "heads_strided", "offset", "last_dim_sliced",
           "last_dim_strided", "permuted", "heads_outer", "batch_expanded", "heads_expanded")
_LAYOUT_WEIGHTS = (0.1, 0.2, *(0.7 / (len(LAYOUTS) - 2),) * (len(LAYOUTS) - 2))  # q's draw
# Where each layout keeps its values: the memory order of the (B, H, T, X) dims, or a wider
# tensor that is sliced back.
_MEMORY_ORDERS = {"transposed": (0, 2, 1, 3), "permuted": (2, 0, 3, 1), "heads_outer": (1, 0, 2, 3)}
_SLICES = {  # (growth of each dim, the slice back to the tensor)
    "heads_sliced": ((0, 1, 0, 0), (slice(None), slice(0, -1))),
    "offset": ((0, 0, 17, 0), (slice(None), slice(None), slice(17, None))),
    "last_dim_sliced": ((0, 0, 0, 3), (..., slice(0, -3))),
}
_LAYOUT_HEADS = ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4))  # (Hq, Hkv): 1, 2 and all kv heads
_STRIDED = {"heads_strided": 1, "last_dim_strided": 3}  # every other entry of this dim
_EXPANDED = {"batch_expanded": 0, "heads_expanded": 1}  # stride 0 along this dim

_FLOORS = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9,
           torch.float64: 1e-12}


@dataclass(frozen=True)
class Config:
    """One seeded configuration of :func:`attnlab.attention` (dtype chosen at check time).

    Example:
        >>> Config(seed=1, batch=1, q_heads=2, kv_heads=1, tq=3, tk=5, head_dim=4,
        ...        value_dim=4, mask="none", causal=True, align="bottom_right",
        ...        dead_rows=False, scale=None).label()[:12]
        'B1 H2/1 T3x5'
    """

    seed: int
    batch: int
    q_heads: int
    kv_heads: int
    tq: int
    tk: int
    head_dim: int
    value_dim: int
    mask: str
    causal: bool
    align: str
    dead_rows: bool
    scale: float | None
    q_layout: str = "contiguous"
    kv_layout: str = "contiguous"
    score: str = "none"
    values: str = "normal"

    def label(self) -> str:
        """A short readable id, e.g. ``B1 H2/1 T3x5 D4/4 causal:bottom_right none``."""
        causal = f" causal:{self.align}" if self.causal else ""
        dead = " dead-rows" if self.dead_rows else ""
        scale = "" if self.scale is None else f" scale={self.scale:.3g}"
        layouts = "" if self.q_layout == self.kv_layout == "contiguous" else \
            f" q:{self.q_layout} kv:{self.kv_layout}"
        score = "" if self.score == "none" else f" score:{self.score}"
        values = "" if self.values == "normal" else f" v:{self.values}"
        return (f"B{self.batch} H{self.q_heads}/{self.kv_heads} T{self.tq}x{self.tk} "
                f"D{self.head_dim}/{self.value_dim}{causal} {self.mask}{dead}{scale}{layouts}{score}{values}")


def _draw_config(rng: torch.Generator, seed: int, index: int, shape: tuple | None,
                 mask_kinds: tuple = _MASKS, scores: tuple = SCORE_KINDS) -> Config:
    """Configuration number ``index``: mask kind and causal mode cycle, the rest is drawn."""
    def pick(options, weights=None):
        w = torch.tensor(weights if weights else [1.0] * len(options))
        return options[int(torch.multinomial(w, 1, generator=rng))]

    def length():
        t = pick(_SEQ_LENGTHS, _SEQ_WEIGHTS)
        return int(torch.randint(1, SMALL_MAX + 1, (), generator=rng)) if t == "small" else t

    if shape is None:
        tq, tk = length(), length()
        kv_heads, groups = pick((1, 3, 5)), pick((1, 1, 3))
        q_heads = kv_heads * groups if kv_heads * groups <= 5 else kv_heads  # H in {1,3,5}
        big = max(tq, tk) >= 113
        batch = 1 if big else pick((1, 2, 3))
        head_dim = pick(_HEAD_DIMS)
        value_dim = head_dim if bool(torch.rand((), generator=rng) < 0.6) else pick(_HEAD_DIMS)
    else:
        batch, q_heads, kv_heads, tq, tk, head_dim, value_dim = shape
    turn, kind = divmod(index, len(mask_kinds))
    mask = mask_kinds[kind]
    causal, align = _CAUSAL[(kind + turn) % len(_CAUSAL)]  # each turn shifts the pairing
    # Drawn for every kind, so that the shapes drawn do not depend on the list of mask kinds.
    dead_rows = bool(torch.rand((), generator=rng) < 0.3) and mask in ("bool", "float", "padding")
    scale = None if bool(torch.rand((), generator=rng) < 0.7) else _scale_of(float(torch.rand((), generator=rng)))
    q_layout, kv_layout, heads = _draw_layouts(seed, index)
    if shape is None and heads is not None:
        batch, q_heads, kv_heads = heads
    score = scores[(index // 4) % len(scores)] if scores and index % 4 == 3 else "none"
    return Config(seed, batch, q_heads, kv_heads, tq, tk, head_dim, value_dim, mask, causal,
                  align, dead_rows, scale, q_layout, kv_layout, score)


def _with_extremes(config: Config, index: int, fixed: bool) -> Config:
    """``config`` with :func:`_draw_extremes` applied (after the quick sweep's size filter, so
    that every other draw stays as it was); an empty size only where the shape is drawn."""
    values, empty = _draw_extremes(config.seed, index, config.score)
    if fixed or empty is None:
        return dataclasses.replace(config, values=values)
    sizes = dict(batch=config.batch, tq=config.tq, tk=config.tk)
    sizes[("batch", "tq", "tk")[empty]] = 0  # an empty batch or sequence, every 16th draw
    return dataclasses.replace(config, values=values, **sizes)


def _draw_extremes(seed: int, index: int, score: str) -> tuple[str, int | None]:
    """What issue 30's fuzz found bugs with, drawn from a generator of its own (every other
    draw stays as it was): values near 1 (``"near_one"``: v = 1 + 0.01 * noise, so that the
    rounding of the output to bf16 is large against the weights' gradient, which a learnable
    ALiBi slope multiplies by the distance) on one draw in 8 and on every other one with ALiBi,
    and on one in 16 an empty batch (0), query (1) or key (2) sequence."""
    rng = torch.Generator().manual_seed(seed + 104_729)
    u = torch.rand(2, generator=rng)
    slopes = "alibi" in score or score == "mixed"
    values = "near_one" if float(u[0]) < 0.125 or (slopes and float(u[1]) < 0.5) else "normal"
    return values, (index // 16) % 3 if index % 16 == 13 else None  # not a score configuration (index % 4 == 3)


def _draw_layouts(seed: int, index: int) -> tuple[str, str, tuple | None]:
    """The q and k/v layouts of configuration ``index`` and the ``(B, Hq, Hkv)`` to use instead
    of the drawn ones (None: keep them).

    Even configurations are contiguous, as drawn. Layout bugs hide in how batch and heads
    merge, so on odd ones the k/v layout, the head counts and the batch cycle with coprime
    periods: every layout within 22 configurations, each crossed with one, two and all
    key/value heads at batch 2-3 and with batch 1 within 220. The q layout is drawn from a
    generator of its own, which keeps every other draw as it was.
    """
    if index % 2 == 0:
        return "contiguous", "contiguous", None
    rng = torch.Generator().manual_seed(seed + 7919)
    q_layout = LAYOUTS[int(torch.multinomial(torch.tensor(_LAYOUT_WEIGHTS), 1, generator=rng))]
    turn = index // 2
    kv_layout = LAYOUTS[(turn + 1) % len(LAYOUTS)]  # transposed first: the commonest layout
    batch = (2, 1, 3, 2)[turn % 4]
    return q_layout, kv_layout, (batch, *_LAYOUT_HEADS[turn % len(_LAYOUT_HEADS)])


def _scale_of(u: float) -> float:
    """A custom scale from a uniform draw ``u``: mostly in [0.35, 1.05), sometimes 0 (uniform
    weights: with causal, the running mean), negative (fused kernels mask before scaling) or
    40 (large logits)."""
    if u < 0.1:
        return 0.0
    if u < 0.25:
        return -4.0 * u
    return 40.0 if u < 0.3 else u + 0.05  # 40: large logits, where half-precision q * scale misleads


def configs(
    n: int, *, seed: int = 0, shape: tuple | None = None, shapes: tuple | None = None,
    small: bool = False, masks: tuple | None = None, scores: bool | tuple = True,
) -> list[Config]:
    """``n`` seeded random configurations.

    Args:
        n: how many (at least 1).
        seed: seed of the draw (the same seed gives the same list).
        shape: fix ``(B, Hq, Hkv, Tq, Tk, D, Dv)`` and vary only masks and options (for
            backends that compile per shape, such as flex).
        shapes: several such shapes, used in turn (overrides ``shape``).
        small: redraw drawn (not fixed) shapes whose sequences exceed 128 (quick sweeps).
        masks: the mask kinds to cycle through (default every kind).
        scores: add score mods and sinks to every fourth configuration: True for every kind
            of :data:`SCORE_KINDS`, a tuple of some of them, or False for none.

    Raises:
        ValueError: ``n`` is not a positive int.

    Example:
        >>> len(configs(5)), configs(3) == configs(3)
        (5, True)
    """
    positive_int("n", n)
    kinds = SCORE_KINDS if scores is True else tuple(scores or ())
    unknown = sorted(set(kinds) - set(SCORE_KINDS))
    if unknown:
        raise ValueError(f"scores: unknown score kinds {unknown}; choose from {SCORE_KINDS}")
    rng = torch.Generator().manual_seed(seed)
    result = []
    while len(result) < n:
        index = len(result)
        fixed = shapes[index % len(shapes)] if shapes else shape
        config = _draw_config(rng, seed * 100_003 + index, index, fixed, masks or _MASKS, kinds)
        if small and fixed is None and max(config.tq, config.tk) > 128:
            continue
        result.append(_with_extremes(config, index, fixed is not None))
    return result


def _mask_for(config: Config, gen: torch.Generator):
    """The mask argument of a configuration (tensor, mask mod or None)."""
    B, H, tq, tk = config.batch, config.q_heads, config.tq, config.tk
    if config.mask == "bool":
        mask = torch.rand(B, 1, tq, tk, generator=gen) < 0.7
        if config.dead_rows:
            mask[:, :, :: 3] = False
        return mask
    if config.mask == "padding":
        lengths = torch.randint(1, tk + 1, (B,), generator=gen)
        if config.dead_rows:
            lengths[0] = 0
        return _masks.padding_mask(lengths, tk)  # (B, 1, 1, Tk)
    if config.mask == "float":
        bias = torch.randn(1, H, tq, tk, generator=gen, dtype=torch.float64)
        bias = bias.masked_fill(torch.rand(1, H, tq, tk, generator=gen) < 0.2, float("-inf"))
        if config.dead_rows:
            bias[:, :, :: 4] = float("-inf")
        return bias
    if config.mask == "mod_window":
        return _masks.sliding_window_mod(tq, tk, int(torch.randint(1, 6, (), generator=gen)),
                                         align=config.align)
    if config.mask == "mod_lambda":
        width = int(torch.randint(1, 5, (), generator=gen))
        return lambda b, h, i, j: (i - j).abs() < width
    if config.mask == "mod_padding":
        return _masks.padding_mod(torch.randint(0, tk + 1, (B,), generator=gen))
    if config.mask == "mod_combined":
        window = _masks.sliding_window_mod(tq, tk, int(torch.randint(1, 9, (), generator=gen)),
                                           align=config.align)
        lengths = torch.randint(0, tk + 1, (B,), generator=gen)
        return _masks.and_masks(window, _masks.padding_mod(lengths))
    if config.mask == "mod_document":  # sorted ids: contiguous documents, as packing makes them
        ids = torch.randint(0, 4, (B, max(tq, tk)), generator=gen).sort(dim=1).values
        return _masks.document_mod(ids, causal=bool(torch.rand((), generator=gen) < 0.5))
    if config.mask == "mod_prefix":
        return _masks.prefix_lm_mod(tq, tk, int(torch.randint(0, tk + 1, (), generator=gen)),
                                    align=config.align)
    if config.mask == "mod_chunked":
        return _masks.chunked_local_mod(tq, tk, int(torch.randint(1, 12, (), generator=gen)),
                                        align=config.align)
    if config.mask == "mod_varlen":  # its own lengths per row; some rows empty, some Tq > Tk
        q_lengths = torch.randint(0, tq + 1, (B,), generator=gen)
        k_lengths = torch.randint(0, tk + 1, (B,), generator=gen)
        window = int(torch.randint(1, 9, (), generator=gen)) if bool(torch.rand((), generator=gen) < 0.5) else None
        return _masks.varlen_causal_mod(q_lengths, k_lengths, window=window)
    return None


def relayout(t: Tensor, layout: str) -> Tensor:
    """The values of ``t`` ``(B, H, T, X)`` in the memory layout ``layout`` (one of :data:`LAYOUTS`).

    The expanded layouts read ``t[:1]`` (``batch_expanded``) or ``t[:, :1]`` (``heads_expanded``)
    with stride 0: they equal ``t`` only when ``t`` is the same along that dim
    (:func:`broadcastable` makes it so).

    Example:
        >>> t = torch.arange(24.0).view(2, 3, 4, 1)
        >>> u = relayout(t, "transposed")
        >>> torch.equal(u, t), u.stride()
        (True, (12, 1, 3, 1))
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout in _MEMORY_ORDERS:
        order = _MEMORY_ORDERS[layout]
        back = tuple(order.index(dim) for dim in range(4))
        memory = torch.empty([t.shape[dim] for dim in order], dtype=t.dtype, device=t.device)
        return memory.permute(back).copy_(t)  # (B, H, T, X) view of the permuted memory
    if layout in _SLICES:
        growth, back = _SLICES[layout]
        wide = torch.zeros([n + g for n, g in zip(t.shape, growth)], dtype=t.dtype, device=t.device)
        return wide[back].copy_(t)
    if layout in _STRIDED:
        dim = _STRIDED[layout]
        wide = torch.zeros([2 * n if d == dim else n for d, n in enumerate(t.shape)], dtype=t.dtype,
                           device=t.device)
        return wide.unflatten(dim, (t.shape[dim], 2)).select(dim + 1, 0).copy_(t)
    if layout in _EXPANDED:
        dim = _EXPANDED[layout]
        return t.narrow(dim, 0, min(1, t.shape[dim])).clone().expand(t.shape)
    return t.clone(memory_format=torch.contiguous_format)


def broadcastable(t: Tensor, layout: str) -> Tensor:
    """``t`` made equal along the dim ``layout`` expands (the first entry repeated), else ``t``.

    Example:
        >>> broadcastable(torch.arange(4.0).view(2, 2, 1, 1), "batch_expanded").flatten().tolist()
        [0.0, 1.0, 0.0, 1.0]
    """
    if layout not in _EXPANDED:
        return t
    dim = _EXPANDED[layout]
    return t.narrow(dim, 0, min(1, t.shape[dim])).expand(t.shape).contiguous()


class _Memo:
    """One sweep's drawn inputs and reference results, each computed once and dropped with the
    sweep (nothing outlives it); at most ``size`` of each, the oldest forgotten first.

    Example:
        >>> memo = _Memo()
        >>> memo.inputs(configs(1)[0]) is memo.inputs(configs(1)[0])
        True
    """

    def __init__(self, size: int = 1024):
        self.size, self._inputs, self._oracles, self._weights = size, {}, {}, {}

    def inputs(self, config: Config) -> tuple:
        """:func:`_inputs` of ``config``."""
        return self._kept(self._inputs, config, lambda: _inputs(config))

    def oracle(self, config: Config, dtype: torch.dtype, with_grad: bool) -> tuple:
        """(fp64 reference results, same-dtype reference results), shared across backends."""
        return self._kept(self._oracles, (config, dtype, with_grad), lambda: (
            _run(config, torch.float64, "reference", with_grad, self, laid_out=False, oracle_of=dtype),
            _run(config, dtype, "reference", with_grad, self, laid_out=False)))

    def weights(self, config: Config) -> Tensor:
        """The fp64 reference's weights ``(B, Hq, Tq, Tk)`` of ``config`` (sinks excluded)."""
        def make() -> Tensor:
            q, k, v, _ = _laid_out(config, torch.float64, False, False, self)
            options, _ = _options(config, torch.float64, False, self)
            with torch.no_grad():
                return attention(q, k, v, backend="reference", return_weights=True, **options)[1]
        return self._kept(self._weights, config, make)

    def _kept(self, store: dict, key, make):
        if key not in store:
            if len(store) >= self.size:
                del store[next(iter(store))]
            store[key] = make()
        return store[key]


def _inputs(config: Config):
    """fp64 q, k, v, output-gradient weights and the mask of a configuration; q and the output
    gradient are broadcastable to the q layout, k and v to the kv layout."""
    q, k, v, grad_weights, mask, score_tensors = _drawn_inputs(config)
    q, grad_weights = (broadcastable(t, config.q_layout) for t in (q, grad_weights))
    k, v = (broadcastable(t, config.kv_layout) for t in (k, v))
    return q, k, v, grad_weights, mask, score_tensors


def _drawn_inputs(config: Config):
    gen = torch.Generator().manual_seed(config.seed)
    q = torch.randn(config.batch, config.q_heads, config.tq, config.head_dim, generator=gen,
                    dtype=torch.float64)
    k = torch.randn(config.batch, config.kv_heads, config.tk, config.head_dim, generator=gen,
                    dtype=torch.float64)
    v = torch.randn(config.batch, config.kv_heads, config.tk, config.value_dim, generator=gen,
                    dtype=torch.float64)
    if config.values == "near_one":
        v = 1.0 + 0.01 * v
    grad_weights = torch.randn(config.batch, config.q_heads, config.tq, config.value_dim,
                               generator=gen, dtype=torch.float64)
    return q, k, v, grad_weights, _mask_for(config, gen), _score_tensors(config, gen)


def _score_tensors(config: Config, gen: torch.Generator) -> dict:
    """The fp64 tensors of the configuration's score mod and sinks, drawn after everything else."""
    kind, H = config.score, config.q_heads
    found = {}
    if "sinks" in kind:
        found["sinks"] = _sink_logits(config, gen)
    if "alibi" in kind or kind in ("composed", "mixed"):
        found["slopes"] = torch.rand(H, generator=gen, dtype=torch.float64)
    if kind == "relative":
        found["table"] = torch.randn(8, H, generator=gen, dtype=torch.float64)
    if kind in ("bias", "composed", "mixed"):
        found["bias"] = torch.randn(config.batch, H, config.tq, config.tk, generator=gen, dtype=torch.float64)
    if kind == "mixed":  # values bf16 holds exactly: the fp64 oracle sees the same parts
        found = {name: t.to(torch.bfloat16).double() * (8.0 if name == "bias" else 1.0) for name, t in found.items()}
    return found


def _sink_logits(config: Config, gen: torch.Generator) -> Tensor:
    """The configuration's fp64 sinks: ``(H,)``, or per query ``(B|1, H|1, Tq)`` (which dims
    broadcast is drawn), with ``+inf`` (all the mass) and ``-inf`` (no sink) for infinite_sinks."""
    if config.score not in ("query_sinks", "infinite_sinks"):
        return torch.randn(config.q_heads, generator=gen, dtype=torch.float64) * 2
    full = torch.rand(2, generator=gen) < 0.5  # whether the batch and the head dims are full
    shape = (config.batch if full[0] else 1, config.q_heads if full[1] else 1, config.tq)
    sinks = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    if config.score == "infinite_sinks":
        u = torch.rand(shape, generator=gen)
        sinks = sinks.masked_fill(u < 0.25, float("inf")).masked_fill(u >= 0.75, float("-inf"))
    return sinks


def _score_options(config: Config, tensors: dict) -> dict:
    """``score_mod`` and ``sinks`` of the configuration, built on ``tensors`` (any dtype)."""
    kind = config.score
    offset = config.tk - config.tq if config.align == "bottom_right" else 0
    mods = []
    if kind.startswith("softcap") or kind == "composed":
        mods.append(_scores.softcap(1.5))
    if kind.startswith("alibi") or kind in ("composed", "mixed"):
        mods.append(_scores.alibi(tensors["slopes"], symmetric=kind != "alibi", offset=offset))
    if kind == "relative":
        mods.append(_scores.relative_bias(tensors["table"], num_buckets=8, max_distance=12,
                                          bidirectional=not config.causal, offset=offset))
    if kind in ("bias", "composed", "mixed"):
        mods.append(_scores.bias(tensors["bias"]))
    if kind == "function":
        mods.append(_scores.function(_wavy))
    return dict(score_mod=_scores.compose(*mods) if mods else None, sinks=tensors.get("sinks"))


def _wavy(score, b, h, q_idx, kv_idx):
    """A user's score mod (one function for every configuration: dispatch keys on its identity)."""
    return score * 0.75 + 0.5 * torch.sin((q_idx - kv_idx + h).to(score.dtype))


def _laid_out(config: Config, dtype: torch.dtype, with_grad: bool, laid_out: bool, memo: _Memo) -> tuple:
    """q, k, v (leaves) and the output gradient in ``dtype``, in the configuration's layouts
    when ``laid_out`` (else contiguous)."""
    q64, k64, v64, grad_weights, *_ = memo.inputs(config)
    q_layout, kv_layout = (config.q_layout, config.kv_layout) if laid_out else ("contiguous",) * 2
    q, k, v, d_out = (relayout(t.to(dtype), layout) for t, layout in
                      ((q64, q_layout), (k64, kv_layout), (v64, kv_layout), (grad_weights, q_layout)))
    return (*(t.requires_grad_(with_grad) for t in (q, k, v)), d_out)


def _run(config: Config, dtype: torch.dtype, backend: str, with_grad: bool, memo: _Memo, *,
         laid_out: bool = True, oracle_of: torch.dtype | None = None) -> list[Tensor]:
    """Output (and q/k/v gradients) of one backend, in fp64 for comparison."""
    q, k, v, d_out = _laid_out(config, dtype, with_grad, laid_out, memo)
    options, learned = _options(config, dtype, with_grad, memo, oracle_of=oracle_of)
    with torch.set_grad_enabled(with_grad):
        out = attention(q, k, v, backend=backend, **options)
    if not with_grad:
        return [out.detach().double()]
    # d_out in q's layout: its layout must not matter. The score mod's tensors and the sinks
    # come after dq, dk, dv.
    # A backend that leaves a tensor out of its graph gives it zero gradient (and fails).
    inputs = (q, k, v, *learned)
    grads = torch.autograd.grad(out, inputs, d_out, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]
    return [t.detach().double() for t in (out, *grads)]


def _options(config: Config, dtype: torch.dtype, learn: bool, memo: _Memo | None = None, *,
             oracle_of: torch.dtype | None = None) -> tuple[dict, list[Tensor]]:
    """The keyword options of the configuration's call in ``dtype``, and the tensors of its score
    mod and sinks (leaves requiring grad when ``learn``, in a fixed order). ``oracle_of``: the
    call is the oracle of a check in that dtype, and gets the values that check's tensors hold
    (:func:`_parts_dtype`) in ``dtype``."""
    mask, score_tensors = (memo or _Memo()).inputs(config)[4:]
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    parts = _parts_dtype(config, oracle_of or dtype)
    held = dtype if oracle_of is not None or parts is None else parts
    tensors = {name: (t if parts is None else t.to(parts)).to(held, copy=True).requires_grad_(learn)
               for name, t in score_tensors.items()}
    options = dict(mask=mask, causal=config.causal, align=config.align, scale=config.scale,
                   **_score_options(config, tensors))
    return options, [tensors[name] for name in sorted(tensors)]


def _parts_dtype(config: Config, dtype: torch.dtype) -> torch.dtype | None:
    """For ``"mixed"``, the dtype its tensors are held in, other than the call's (fp32 in an fp64
    call, bf16 in fp16/fp32 calls, fp32 in bf16 ones: a model holding bf16 biases calls in
    fp32); None for the other kinds (held in the call's dtype)."""
    if config.score != "mixed":
        return None
    return {torch.float64: torch.float32, torch.bfloat16: torch.float32}.get(dtype, torch.bfloat16)


FORWARD_FACTOR = 2.0  # a fast path may err at most 2x the plain computation's error (outputs) ...
GRADIENT_FACTOR = 3.0  # ... and 3x for gradients, plus the floor


def allowed_error(plain_error: float, dtype: torch.dtype, magnitude: float, *, reduction: int = 1,
                  gradient: bool = False) -> float:
    """The largest error vs fp64 a fast path may make: the one tolerance rule of attnlab.

    ``factor * plain_error + floor_for(dtype, magnitude, reduction=reduction)``, where
    ``plain_error`` is the error of the plain computation (the reference backend, or plain
    PyTorch) at the same dtype and ``factor`` is 2 for outputs, 3 for gradients.

    Example:
        >>> allowed_error(1e-6, torch.float32, 1.0)
        3e-06
        >>> allowed_error(1e-6, torch.float32, 1.0, gradient=True)
        4e-06
    """
    factor = GRADIENT_FACTOR if gradient else FORWARD_FACTOR
    return factor * plain_error + floor_for(dtype, magnitude, reduction=reduction)


def floor_for(dtype: torch.dtype, magnitude: float, *, reduction: int = 1) -> float:
    """Absolute error floor for ``dtype`` (see the module doc).

    ``base(dtype) * max(1, magnitude) * sqrt(reduction)``: rounding error of a sum of
    ``reduction`` terms grows like its square root.

    Example:
        >>> floor_for(torch.float32, 0.5), floor_for(torch.float32, 4.0, reduction=4)
        (1e-06, 8e-06)
    """
    return _FLOORS[dtype] * max(1.0, magnitude) * math.sqrt(max(1, reduction))


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one backend on one configuration in one dtype.

    ``errors``/``allowed`` hold the max abs error and its bound for out, dq, dk, dv (only out
    when ``grad`` is False). ``served`` is False when the backend declined (then nothing ran).

    Example:
        >>> r = CheckResult("sdpa", "float32", "x", True, False, (1e-7,), (3e-7,), True, "")
        >>> r.worst_ratio()
        0.3333333333333333
    """

    backend: str
    dtype: str
    config: str
    served: bool
    grad: bool
    errors: tuple
    allowed: tuple
    passed: bool
    note: str
    grad_mode: str = ""  # set by check_grad_mode, e.g. "no_grad, requires_grad: qkv"

    def worst_ratio(self) -> float:
        """Largest error / allowed ratio (1.0 or more fails)."""
        return max((e / a for e, a in zip(self.errors, self.allowed)), default=0.0)


def _serves(config: Config, dtype: torch.dtype, backend: str, with_grad: bool, memo: _Memo) -> list[str]:
    q, k, v, _ = _laid_out(config, dtype, with_grad, True, memo)
    options, _ = _options(config, dtype, with_grad, memo)
    with torch.set_grad_enabled(with_grad):
        return _backends.reasons(build_call(q, k, v, **options))[backend]


def check(backend: str, config: Config, dtype: torch.dtype, *, memo: _Memo | None = None) -> CheckResult:
    """Run ``backend`` on ``config`` in ``dtype`` and compare with the fp64 reference.

    Forward and backward when the backend can differentiate the call, else forward only;
    a declined call returns ``served=False``. ``memo``: the sweep's inputs and reference
    results (default: computed for this check alone).

    Example:
        >>> check("reference", configs(1)[0], torch.float32).passed
        True
    """
    memo = _Memo() if memo is None else memo
    with_grad = not _serves(config, dtype, backend, True, memo)
    if not with_grad and _serves(config, dtype, backend, False, memo):
        note = "; ".join(_serves(config, dtype, backend, False, memo))
        return CheckResult(backend, _dtype_name(dtype), config.label(), False, False, (), (),
                           True, note)
    got = _run(config, dtype, backend, with_grad, memo)
    errors, allowed = _compare(config, dtype, memo, memo.oracle(config, dtype, with_grad), got, range(len(got)))
    passed = all(e <= a for e, a in zip(errors, allowed))
    return CheckResult(backend, _dtype_name(dtype), config.label(), True, with_grad,
                       tuple(errors), tuple(allowed), passed, "")


def _compare(config: Config, dtype: torch.dtype, memo: _Memo, oracle: tuple, got: list[Tensor],
             which: Iterable[int]) -> tuple[tuple, tuple]:
    """(errors, allowed) of ``got``: the results ``which`` (0 out, 1 dq, 2 dk, 3 dv) of a run,
    against the fp64 reference and the same-dtype reference of ``oracle``."""
    exact, same_dtype = oracle
    # Gradient noise scales with the problem's largest quantities, not with each gradient
    # (dq, dk are exactly 0 with one key, yet a fused kernel's rounding is not).
    magnitude = max((float(t.abs().max()) for t in exact[:4] if t.numel()), default=0.0)
    reduction = max(config.head_dim, config.value_dim, config.tk)
    bound = _flash_backward_bound(config, dtype, memo, reduction) if len(got) > 1 else {}
    errors, allowed = [], []
    for i, have in zip(which, got):
        size, terms, held = magnitude, reduction, dtype
        if i >= 4:  # a score mod's tensor or the sinks: a sum over every query (and key) it meets
            size = max(magnitude, float(exact[i].abs().max()) if exact[i].numel() else 0.0)
            terms = reduction * config.tq * config.batch
            held = _coarser(dtype, _parts_dtype(config, dtype))  # its gradient is rounded to its dtype
        allowed.append(allowed_error(_max_err(same_dtype[i], exact[i]), held, size,
                                     reduction=terms, gradient=i > 0) + bound.get(i, 0.0))
        errors.append(_max_err(have, exact[i]))
    return tuple(errors), tuple(allowed)


def _coarser(dtype: torch.dtype, other: torch.dtype | None) -> torch.dtype:
    """Of ``dtype`` and ``other`` (None: none), the one with the larger floor."""
    return dtype if other is None or _FLOORS[dtype] >= _FLOORS[other] else other


def _flash_backward_bound(config: Config, dtype: torch.dtype, memo: _Memo, reduction: int) -> dict[int, float]:
    """:func:`flash_backward_bound` of ``config``'s inputs (dq, dk)."""
    q, k, v, d_out = memo.inputs(config)[:4]
    if min(t.numel() for t in (q, k, v)) == 0:
        return {}
    scale = 1.0 / math.sqrt(config.head_dim) if config.scale is None else config.scale
    return flash_backward_bound(q, k, v, d_out, memo.weights(config), scale=scale, dtype=dtype, reduction=reduction)


def flash_backward_bound(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, weights: Tensor, *, scale: float,
                         dtype: torch.dtype, reduction: int | None = None) -> dict[int, float]:
    """The extra error a FlashAttention-2 backward may add to dq (1) and dk (2) in
    ``dtype``'s arithmetic (fp32 for half inputs), beyond the testing rule (docs/contract.md,
    "Scale"), from the exact problem (``u`` the unit roundoff, ``K = max(D, Dv, Tk)``):

    * ``D = rowsum(dO * O)`` is rounded another way than ``dP``: ``u * max|dO| * max|v| * sqrt(K)``
      per score;
    * each weight is recomputed as ``exp(s - lse)`` from rounded scores and a rounded lse, a
      relative error of up to ``delta = u * (max|s| + max|lse|)`` (over attended pairs):
      ``dS = P (dP - D)`` then errs by ``delta`` times ``A = P * |dP - D|``, which row ``i``
      sums for dq and the rows reading key ``j`` (every query head of its group) sum for dk.

    dq adds ``|scale| * max|k|`` times the per-row sum, dk ``|scale| * max|q|`` times the
    per-key one. At moderate logits ``delta`` is a few ``u``; it grows with the logits, where
    the textbook backward's own error does not.

    Args:
        q, k, v, d_out: the call's fp64 tensors ``(B, Hq, Tq, D)``, ``(B, Hkv, Tk, D|Dv)``,
            ``(B, Hq, Tq, Dv)``.
        weights: the exact weights ``(B, Hq, Tq, Tk)`` (fp64 reference, sinks excluded); the
            scores are recomputed from q and k, so a score mod's terms are not counted in ``s``.
        scale: the call's scale; dtype: the compared dtype; reduction: ``K`` (default from the shapes).

    Example:
        >>> q, k, v = (torch.randn(1, 1, 4, 8, dtype=torch.float64) for _ in range(3))
        >>> w = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        >>> bound = flash_backward_bound(q, k, v, torch.ones_like(q), w, scale=1.0, dtype=torch.float32)
        >>> sorted(bound), all(0 < b < 1e-3 for b in bound.values())
        ([1, 2], True)
    """
    unit = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    groups = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(groups, 1) for t in (k, v))  # (B, Hq, Tk, D|Dv)
    tk = k.shape[-2]
    reduction = max(q.shape[-1], v.shape[-1], tk) if reduction is None else reduction
    d_probs = d_out @ values.transpose(-2, -1)  # dP (B, Hq, Tq, Tk)
    delta_row = (weights * d_probs).sum(-1, keepdim=True)  # D (B, Hq, Tq, 1)
    spread = weights * (d_probs - delta_row).abs()  # A (B, Hq, Tq, Tk)
    scores = scale * (q @ keys.transpose(-2, -1))  # s (B, Hq, Tq, Tk), score mods left out
    top = weights.argmax(-1, keepdim=True)  # each row's heaviest key: lse = s - log P there
    heaviest = weights.gather(-1, top)
    lse = torch.where(heaviest > 0, scores.gather(-1, top) - heaviest.clamp_min(1e-300).log(), 0.0)
    visible = torch.where(weights > 0, scores.abs(), 0.0)
    rel = unit * (float(visible.max()) + float(lse.abs().max()))  # delta = u (max|s| + max|lse|)
    per_key = (lambda t: t.unflatten(1, (k.shape[1], groups)).sum(dim=(2, 3)))  # (B, Hkv, Tk)
    rounding = unit * float(d_out.abs().max() * v.abs().max()) * math.sqrt(reduction)
    return {1: abs(scale) * float(k.abs().max()) * (rounding + rel * float(spread.sum(-1).max())),
            2: abs(scale) * float(q.abs().max()) * (rounding + rel * float(per_key(spread).max()))}


# Grad mode crossed with the inputs that require grad, as (grad enabled, inputs): a backend
# must decide from what the call will need (flex once served a no_grad call whose inputs
# required grad, and PyTorch's CPU kernel then raised).
GRAD_MODES = ((False, "qkv"), (False, "q"), (True, ""), (True, "q"), (True, "k"), (True, "v"),
              (True, "qkv"))
GRAD_MODE_CONFIGS = 2  # served configurations per backend and dtype that sweep crosses with them


def check_grad_mode(backend: str, config: Config, dtype: torch.dtype, *, grad_enabled: bool,
                    inputs: str, memo: _Memo | None = None) -> CheckResult:
    """Run ``backend`` on ``config`` with grad mode ``grad_enabled`` and ``requires_grad`` on
    the inputs named in ``inputs`` (``"qkv"``, ``"k"``, ``""``), and compare with fp64
    (``memo`` as in :func:`check`).

    Passes when the backend declines with a reason, or serves without an error, records a
    graph exactly when the call needs one, and gives the output and the gradient of each input
    that requires grad within the rule of :func:`check`.

    Example:
        >>> config = configs(1, seed=3)[0]
        >>> check_grad_mode("sdpa", config, torch.float32, grad_enabled=False, inputs="qkv").passed
        True
    """
    mode = f"{'grad' if grad_enabled else 'no_grad'}, requires_grad: {inputs or '-'}"
    label = f"{config.label()} [{mode}]"

    def result(*fields) -> CheckResult:
        return CheckResult(backend, _dtype_name(dtype), label, *fields, grad_mode=mode)

    memo = _Memo() if memo is None else memo
    q64, k64, v64, grad_weights, *_ = memo.inputs(config)
    tensors = [t.to(dtype, copy=True).requires_grad_(name in inputs) for name, t in zip("qkv", (q64, k64, v64))]
    options, _ = _options(config, dtype, False, memo)
    with torch.set_grad_enabled(grad_enabled):
        why_not = _backends.reasons(build_call(*tensors, **options))[backend]
        if why_not:
            return result(False, False, (), (), True, "; ".join(why_not))
        try:
            out = attention(*tensors, backend=backend, **options)
        except Exception as error:  # noqa: BLE001 - a backend that serves a call must not fail on it
            return result(True, False, (), (), False, f"{type(error).__name__}: {error}")
    needed = grad_enabled and bool(inputs)
    if out.requires_grad != needed:
        return result(True, needed, (), (), False, f"the output's requires_grad is {out.requires_grad}")
    which = [0] + [i + 1 for i, name in enumerate("qkv") if needed and name in inputs]
    got = [out.detach().double()]
    if needed:
        leaves = [tensors[i - 1] for i in which[1:]]
        got += [g.double() for g in torch.autograd.grad((out * grad_weights.to(dtype)).sum(), leaves)]
    errors, allowed = _compare(config, dtype, memo, memo.oracle(config, dtype, True), got, which)
    return result(True, needed, errors, allowed, all(e <= a for e, a in zip(errors, allowed)), "")


def _max_err(a: Tensor, b: Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    diff = (a - b).abs()
    return float("inf") if not bool(torch.isfinite(a).all()) else float(diff.max())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def sweep(
    backend_names: Iterable[str],
    dtypes: Iterable[torch.dtype],
    *,
    n: int,
    seed: int = 0,
    small: bool = False,
    flex_n: int | None = None,
    progress: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Check every backend on ``n`` configurations per dtype (flex: ``flex_n`` over its shapes).

    Args:
        backend_names: backends to check.
        dtypes: dtypes to check each in.
        n: configurations per backend and dtype (at least 1).
        seed: seed of the configuration draw.
        small: a quick sweep: lengths up to 128, and a backend that compiles per shape
            (flex) is checked only on variants compiled in this process already (the others
            come back unserved, with a note).
        flex_n: configurations for flex (default ``n``), drawn over :data:`FLEX_SHAPES`.
        progress: called with each result.

    Raises:
        ValueError: ``n`` or ``flex_n`` is not a positive int.

    Example:
        >>> results = sweep(["sdpa"], [torch.float32], n=3, small=True)
        >>> all(r.passed for r in results)
        True
    """
    positive_int("n", n)
    if flex_n is not None:
        positive_int("flex_n", flex_n)
    results, memo = [], _Memo()  # the sweep's inputs and oracles, dropped when it returns
    for dtype in dtypes:
        for name in backend_names:
            # flex declines sinks (no log-sum-exp from its CPU kernel), and functions in half
            # precision: its sweep draws the other mods.
            if name == "flex":
                kinds = FLEX_SCORE_KINDS if dtype in (torch.float32, torch.float64) else FLEX_HALF_SCORE_KINDS
                draw = configs(flex_n or n, seed=seed, shapes=FLEX_SHAPES, small=small, scores=kinds)
            elif getattr(_backends.get(name), "needs_bounds", False):
                draw = configs(n, seed=seed, small=small, masks=BOUNDED_MASKS)
            else:
                draw = configs(n, seed=seed, small=small)
            crossed = 0
            for config in draw:
                result = _not_compiled(name, config, dtype, memo) if small else None
                result = result or check(name, config, dtype, memo=memo)
                found = [result]
                if result.served and crossed < GRAD_MODE_CONFIGS:
                    crossed += 1
                    found += [check_grad_mode(name, config, dtype, grad_enabled=enabled, inputs=inputs, memo=memo)
                              for enabled, inputs in GRAD_MODES]
                for result in found:
                    results.append(result)
                    if progress is not None:
                        progress(result)
    return results


def _not_compiled(backend: str, config: Config, dtype: torch.dtype, memo: _Memo) -> CheckResult | None:
    """An unserved result when ``backend`` would have to compile a new kernel for ``config``."""
    compiled = getattr(_backends.get(backend), "compiled", None)
    if compiled is None:
        return None
    q, k, v, _ = _laid_out(config, dtype, False, True, memo)
    options, _ = _options(config, dtype, False, memo)
    with torch.no_grad():
        call = build_call(q, k, v, **options)
    if compiled(call) or _backends.reasons(call)[backend]:
        return None  # compiled already, or declined anyway: check() reports it as usual
    return CheckResult(backend, _dtype_name(dtype), config.label(), False, False, (), (), True,
                       "not compiled in this process; a quick sweep does not compile")


# ----------------------------------------------------------------------------- linear attention
# attnlab.linear_attention's backends against its fp64 recurrence (attnlab.linear.reference),
# under the same rule: every rule of the recurrent family, the final state and the gradients
# of q, k, v, decay, beta and initial_state, with packed documents (cu_seqlens).

LINEAR_PREFIX = "linear:"  # a linear backend's name in verify's report: "linear:recurrent"
LINEAR_RULES = ("additive", "decay", "channel", "delta", "gated_delta", "kda")
LINEAR_DTYPES = (torch.float64, torch.float32, torch.bfloat16)  # bf16: tiny configurations only
# Chunked forms cut T into chunks of 16..64: lengths at and around the boundaries, and one
# spanning several chunks, beside every small length.
_LINEAR_LENGTHS = ("small", 1, 63, 64, 65, 128, 200)
_LINEAR_WEIGHTS = (0.5, 0.05, 0.1, 0.1, 0.1, 0.08, 0.07)
_LINEAR_DIMS = (1, 3, 8, 16, 32, 64)
_LINEAR_TINY = 16  # bf16 configurations: T and head dims at most this (the recurrence rounds every step)


@dataclass(frozen=True)
class LinearConfig:
    """One seeded configuration of :func:`attnlab.linear_attention` (dtype chosen at check time).

    ``documents``: the packed documents' lengths (``cu_seqlens``; ``batch == 1``), or ().
    ``decay_scale``: log-decays are drawn in ``[-decay_scale, 0]`` (8: the state forgets within a
    few steps, where a chunked form's cumulative decays underflow).

    Example:
        >>> LinearConfig(seed=1, batch=1, heads=2, value_heads=4, t=5, key_dim=3, value_dim=2,
        ...              rule="kda").label()
        'B1 H2/4 T5 D3/2 kda'
    """

    seed: int
    batch: int
    heads: int
    value_heads: int
    t: int
    key_dim: int
    value_dim: int
    rule: str
    initial_state: bool = False
    documents: tuple[int, ...] = ()
    scale: float | None = None
    decay_scale: float = 0.5
    transposed: bool = False  # q, k, v handed as (B, T, H, D) memory, as transformers holds them

    def label(self) -> str:
        """A short readable id, e.g. ``B1 H2/4 T5 D3/2 kda state docs:2,3``."""
        extras = [" state" if self.initial_state else "",
                  f" docs:{','.join(map(str, self.documents))}" if self.documents else "",
                  "" if self.scale is None else f" scale={self.scale:.3g}",
                  f" decay<={-self.decay_scale:g}" if self.decay_scale != 0.5 and "decay" in self._gates() else "",
                  " q,k,v:(B,T,H,D)" if self.transposed else ""]
        return (f"B{self.batch} H{self.heads}/{self.value_heads} T{self.t} D{self.key_dim}/{self.value_dim} "
                f"{self.rule}{''.join(extras)}")

    def _gates(self) -> str:
        """Which of decay and beta the rule takes (``"decay beta"``, ``"beta"``, ...)."""
        decay = self.rule in ("decay", "channel", "gated_delta", "kda")
        beta = self.rule in ("delta", "gated_delta", "kda")
        return " ".join(name for name, used in (("decay", decay), ("beta", beta)) if used)


def linear_backends() -> list[str]:
    """The backends of :data:`attnlab.linear.BACKENDS` the sweep checks (all but the oracle), as
    verify names them (``"linear:recurrent"``, ...): a backend registered there is swept.

    Example:
        >>> "linear:recurrent" in linear_backends(), "linear:reference" in linear_backends()
        (True, False)
    """
    return [LINEAR_PREFIX + name for name in linear.BACKENDS if name != "reference"]


def linear_configs(n: int, *, seed: int = 0, small: bool = False, tiny: bool = False) -> list[LinearConfig]:
    """``n`` seeded configurations of the recurrent family.

    The rule cycles (every rule in each 6 configurations); an initial state and packed documents
    cycle on top of it (each rule with none, a state, documents, both within 36). Lengths are
    drawn at and around chunk boundaries (63, 64, 65, 128) and below 40, with 200 (several
    chunks) and 1; head dims in {1, 3, 8, 16, 32, 64}; 1-2 key heads each serving 1-2 value
    heads; a custom scale on 1 in 4; log-decays down to -8 per step on 1 in 6; q, k, v as
    transposed views of ``(B, T, H, D)`` memory on 1 in 3; an empty document on 1 in 3 packings.

    Args:
        n: how many (at least 1). seed: seed of the draw.
        small: lengths up to 128 (quick sweeps). tiny: lengths and head dims up to 16 (bf16).

    Raises:
        ValueError: ``n`` is not a positive int.

    Example:
        >>> sorted({c.rule for c in linear_configs(6)}) == sorted(LINEAR_RULES)
        True
    """
    positive_int("n", n)
    rng = torch.Generator().manual_seed(seed + 31_337)
    found: list[LinearConfig] = []
    while len(found) < n:
        config = _draw_linear(rng, seed * 100_003 + len(found), len(found))
        if (small and config.t > 128) or (tiny and max(config.t, config.key_dim, config.value_dim) > _LINEAR_TINY):
            continue
        found.append(config)
    return found


def _draw_linear(rng: torch.Generator, seed: int, index: int) -> LinearConfig:
    """Configuration number ``index``: rule, state and documents cycle, the rest is drawn."""
    def pick(options, weights=None):
        w = torch.tensor(weights if weights else [1.0] * len(options))
        return options[int(torch.multinomial(w, 1, generator=rng))]

    def uniform() -> float:
        return float(torch.rand((), generator=rng))

    length = pick(_LINEAR_LENGTHS, _LINEAR_WEIGHTS)
    t = int(torch.randint(1, SMALL_MAX + 1, (), generator=rng)) if length == "small" else length
    heads, groups = pick((1, 2)), pick((1, 1, 2))
    key_dim = pick(_LINEAR_DIMS)
    value_dim = key_dim if uniform() < 0.6 else pick(_LINEAR_DIMS)
    scale = None if uniform() < 0.75 else 0.25 + uniform()
    decay_scale = 8.0 if uniform() < 1 / 6 else 0.5
    transposed = uniform() < 1 / 3
    turn = index // len(LINEAR_RULES)
    documents: tuple[int, ...] = ()
    if turn % 3 == 2:  # packed: 1-4 documents cut at drawn points, one empty on 1 in 3
        cuts = sorted(int(c) for c in torch.randint(0, t + 1, (int(torch.randint(0, 4, (), generator=rng)),),
                                                    generator=rng))
        if uniform() < 1 / 3:
            cuts.append(cuts[-1] if cuts else 0)
        points = [0, *sorted(cuts), t]
        documents = tuple(b - a for a, b in zip(points, points[1:]))
    batch = 1 if documents else pick((1, 2))
    return LinearConfig(seed, batch, heads, heads * groups, t, key_dim, value_dim, LINEAR_RULES[index % len(LINEAR_RULES)],
                        initial_state=turn % 2 == 1, documents=documents, scale=scale, decay_scale=decay_scale,
                        transposed=transposed)


def _linear_inputs(config: LinearConfig) -> dict[str, Tensor]:
    """The configuration's fp64 tensors: q, k, v, decay, beta, initial_state (those it uses), the
    weights of the output and of the final state in the loss (``d_out``, ``d_state``) and
    ``cu_seqlens``. Delta rules get l2-normalised keys, as every model feeds them (beta |k|^2 > 2
    would make the state grow without bound)."""
    gen = torch.Generator().manual_seed(config.seed)
    B, H, Hv, T, Dk, Dv = (config.batch, config.heads, config.value_heads, config.t, config.key_dim,
                           config.value_dim)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    found = dict(q=randn(B, H, T, Dk), k=randn(B, H, T, Dk), v=randn(B, Hv, T, Dv))
    gates = config._gates()
    if "beta" in gates:
        found["k"] = torch.nn.functional.normalize(found["k"], dim=-1)
        beta = rand(B, Hv, T)
        edge = rand(B, Hv, T)  # a tenth of the steps at the ends of [0, 1]: no write, overwrite
        found["beta"] = beta.masked_fill(edge < 0.05, 0.0).masked_fill(edge > 0.95, 1.0)
    if "decay" in gates:
        shape = (B, Hv, T, Dk) if config.rule in ("channel", "kda") else (B, Hv, T)
        decay = -config.decay_scale * rand(*shape)
        found["decay"] = decay.masked_fill(rand(*shape) < 0.1, 0.0)  # some steps keep everything
    rows = len(config.documents) if config.documents else B
    if config.initial_state:
        found["initial_state"] = randn(rows, Hv, Dk, Dv)
    found["d_out"], found["d_state"] = randn(B, Hv, T, Dv), randn(rows, Hv, Dk, Dv)
    if config.documents:
        found["cu_seqlens"] = torch.tensor([0, *config.documents], dtype=torch.int64).cumsum(0)
    return found


_LINEAR_LEARNED = ("q", "k", "v", "decay", "beta", "initial_state")  # the gradients compared, in this order


def _plain_recurrence(q, k, v, *, decay=None, beta=None, initial_state=None, scale, cu_seqlens,
                      return_state) -> tuple[Tensor, Tensor]:
    """The recurrence computed in the call's own precision (the state in fp32 for fp32 and half
    inputs): the plain computation whose error a backend's is measured against. Called directly,
    not through the registry, so that a broken backend cannot lower its own bar."""
    call = linear_call(q, k, v, decay=decay, beta=beta, scale=scale, initial_state=initial_state,
                       cu_seqlens=cu_seqlens)
    return run_reference(call, dtype=call.state_dtype)


def _linear_run(config: LinearConfig, dtype: torch.dtype, backend: str | None, inputs: dict[str, Tensor]) -> list[Tensor]:
    """out, final state and the gradients of every input the call takes, in fp64, of one run of
    ``backend`` (a name of :data:`attnlab.linear.BACKENDS`; None: the recurrence in the call's own
    precision, :func:`_plain_recurrence`) in ``dtype``. Gates and the initial state are held as a
    model holds them: the decay and the state in fp32 in a bf16 call."""
    run = _plain_recurrence if backend is None else functools.partial(linear_attention, backend=backend)
    wide = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    held = {"q": dtype, "k": dtype, "v": dtype, "beta": dtype, "decay": wide, "initial_state": wide}
    leaves = {name: inputs[name].to(held[name], copy=True).requires_grad_(True)
              for name in _LINEAR_LEARNED if name in inputs}
    given = dict(leaves)
    if config.transposed:  # (B, H, T, D) views of (B, T, H, D) memory
        given.update({name: relayout(leaves[name], "transposed") for name in "qkv"})
    out, state = run(given.pop("q"), given.pop("k"), given.pop("v"), **given, scale=config.scale,
                     cu_seqlens=inputs.get("cu_seqlens"), return_state=True)
    loss = (out.double() * inputs["d_out"]).sum() + (state.double() * inputs["d_state"]).sum()
    grads = [torch.zeros_like(t) for t in leaves.values()]
    if loss.requires_grad:  # T = 0 without a state: nothing to differentiate
        found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(found, leaves.values())]
    return [t.detach().double() for t in (out, state, *grads)]


def _linear_names(config: LinearConfig) -> list[str]:
    """What each entry of a run is: ``["out", "state", "dq", "dk", "dv", ...]``."""
    return ["out", "state", *(f"d{name}" for name in _LINEAR_LEARNED if name in _linear_inputs_names(config))]


def _linear_inputs_names(config: LinearConfig) -> set[str]:
    gates = config._gates().split()
    return {"q", "k", "v", *gates, *(["initial_state"] if config.initial_state else [])}


def check_linear(backend: str, config: LinearConfig, dtype: torch.dtype, *,
                 memo: dict | None = None) -> CheckResult:
    """Run a linear backend (``"linear:recurrent"``) on ``config`` in ``dtype`` and compare the
    output, the final state and every gradient with the fp64 recurrence.

    The rule of :func:`check`: each error at most :func:`allowed_error` of the recurrence run in
    the same precision (fp32 state for fp32 and bf16 inputs, as the contract keeps it), with
    ``K = max(Dk, Dv, T)``; the final state and the gradients of decay, beta and the initial
    state, which sum over every later step, are bounded with ``K * T`` terms and their own
    magnitude. ``memo``: the sweep's inputs and oracles (default: computed for this check alone).

    Example:
        >>> check_linear("linear:recurrent", linear_configs(1)[0], torch.float32).passed
        True
    """
    memo = {} if memo is None else memo
    inputs = _kept(memo, ("inputs", config), lambda: _linear_inputs(config))
    exact = _kept(memo, ("oracle", config), lambda: _linear_run(config, torch.float64, "reference", inputs))
    plain = exact if dtype == torch.float64 else _kept(  # the recurrence in the checked precision
        memo, ("plain", config, dtype), lambda: _linear_run(config, dtype, None, inputs))
    name = backend.removeprefix(LINEAR_PREFIX)
    try:
        got = _linear_run(config, dtype, name, inputs)
    except Exception as error:  # noqa: BLE001 - a backend must serve every call of the contract
        return CheckResult(backend, _dtype_name(dtype), config.label(), True, True, (), (), False,
                           f"{type(error).__name__}: {error}")
    magnitude = max((float(t.abs().max()) for t in exact[:5] if t.numel()), default=0.0)
    reduction = max(config.key_dim, config.value_dim, config.t)
    errors, allowed = [], []
    for i, (have, want, same) in enumerate(zip(got, exact, plain)):
        long_sum = i == 1 or i >= 5  # the state, d decay, d beta, d initial_state: sums over every step
        size = max(magnitude, float(want.abs().max()) if want.numel() else 0.0) if long_sum else magnitude
        terms = reduction * max(1, config.t) if long_sum else reduction
        allowed.append(allowed_error(_max_err(same, want), dtype, size, reduction=terms, gradient=i >= 2))
        errors.append(_max_err(have, want) if have.shape == want.shape else float("inf"))
    passed = all(e <= a for e, a in zip(errors, allowed))
    return CheckResult(backend, _dtype_name(dtype), config.label(), True, True, tuple(errors), tuple(allowed),
                       passed, "" if passed else _linear_worst(config, errors, allowed))


def _linear_worst(config: LinearConfig, errors: list[float], allowed: list[float]) -> str:
    """The note of a failed check: which result is furthest over its bound."""
    ratios = [e / a for e, a in zip(errors, allowed)]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    return f"{_linear_names(config)[worst]} off by {errors[worst]:.2e} (allowed {allowed[worst]:.2e})"


def _kept(memo: dict, key, make):
    if key not in memo:
        memo[key] = make()
    return memo[key]


def sweep_linear(backend_names: Iterable[str], dtypes: Iterable[torch.dtype] = LINEAR_DTYPES, *, n: int,
                 seed: int = 0, small: bool = False,
                 progress: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Check every linear backend (``"linear:recurrent"``, ...) on ``n`` configurations per dtype.

    bf16 is checked on tiny configurations (:func:`linear_configs` with ``tiny=True``), fp64 and
    fp32 on the full draw (``small``: lengths up to 128).

    Raises:
        ValueError: ``n`` is not a positive int, or a name is not a linear backend.

    Example:
        >>> results = sweep_linear(["linear:recurrent"], [torch.float32], n=3, small=True)
        >>> len(results), all(r.passed for r in results)
        (3, True)
    """
    positive_int("n", n)
    names = list(backend_names)
    for name in names:
        one_of_linear(name)
    results, memo = [], {}
    for dtype in dtypes:
        draw = linear_configs(n, seed=seed, small=small, tiny=dtype in (torch.bfloat16, torch.float16))
        for name in names:
            for config in draw:
                results.append(check_linear(name, config, dtype, memo=memo))
                if progress is not None:
                    progress(results[-1])
    return results


def one_of_linear(name: str) -> str:
    """``name`` if it names a linear backend verify sweeps (:func:`linear_backends`), else ValueError.

    Example:
        >>> one_of_linear("linear:reference")
        Traceback (most recent call last):
        ...
        ValueError: backend must be one of 'linear:recurrent'...; got 'linear:reference' (linear:reference is the oracle every linear backend is checked against)
    """
    choices = linear_backends()
    if name not in choices:
        why = " (linear:reference is the oracle every linear backend is checked against)" \
            if name == LINEAR_PREFIX + "reference" else ""
        raise ValueError(f"backend must be one of {', '.join(map(repr, choices))}; got {name!r}{why}")
    return name
