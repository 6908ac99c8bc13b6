"""Conformance sweep: every backend against the fp64 reference, forward and backward.

One mechanism serves ``attnlab verify`` and ``tests/test_conformance.py``:

* :func:`configs` draws seeded random configurations: odd sizes (T in {1, 2, 3, 17, 113, 1023},
  the big ones rare), D in {1, 3, 40, 64, 111}, Dv != D, Tq != Tk, H in {1, 3, 5}, grouped-query,
  bool/float masks, padding masks, mask mods, sliding windows, causal in both alignments, and
  rows with nothing to attend; dropout off (dropout is tested separately: its random mask
  differs by backend).
* :func:`check` runs one backend on one configuration in one dtype and compares it with the
  reference run in fp64 -- the DESIGN.md rule: the backend's max error is at most 2x the
  error of the reference computed in the same dtype, plus a floor; gradients at most 3x.
* :func:`sweep` runs many checks and reports progress.

Floors are ``base * max(1, m) * sqrt(K)`` with ``m`` the largest fp64 value among out, dq,
dk, dv of the configuration and ``K = max(D, Dv, Tk)`` the longest reduction (rounding error
of a K-term sum grows like sqrt(K)); base: fp32 ``1e-6``;
bf16 ``2**-7`` (two bf16 units in the last place at magnitude 1: a fused kernel rounds its
inputs and its output once each, which the reference's own error does not bound on tiny
configurations where the reference happens to be exact). Backends that decline a call skip
it; a backend that cannot differentiate on this device (flex on CPU) is checked forward only.

Example:
    >>> import torch
    >>> result = check("sdpa", configs(1, seed=3)[0], torch.float32)
    >>> result.passed
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab import backends as _backends
from attnlab import masks as _masks
from attnlab._call import build_call
from attnlab.functional import attention

__all__ = ["Config", "CheckResult", "configs", "check", "sweep", "floor_for", "FLEX_SHAPE"]

_SEQ_LENGTHS = (1, 2, 3, 17, 113, 1023)
_SEQ_WEIGHTS = (0.15, 0.15, 0.15, 0.3, 0.22, 0.03)  # 1023 is rare: keep the sweep fast
_HEAD_DIMS = (1, 3, 40, 64, 111)
_MASKS = ("none", "bool", "padding", "float", "mod_window", "mod_lambda", "mod_padding")
FLEX_SHAPE = (2, 3, 1, 17, 23, 40, 40)  # B, Hq, Hkv, Tq, Tk, D, Dv: flex compiles per shape
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

    def label(self) -> str:
        """A short readable id, e.g. ``B1 H2/1 T3x5 D4/4 causal:bottom_right none``."""
        causal = f" causal:{self.align}" if self.causal else ""
        dead = " dead-rows" if self.dead_rows else ""
        return (f"B{self.batch} H{self.q_heads}/{self.kv_heads} T{self.tq}x{self.tk} "
                f"D{self.head_dim}/{self.value_dim}{causal} {self.mask}{dead}")


def _draw_config(rng: torch.Generator, seed: int, shape: tuple | None) -> Config:
    def pick(options, weights=None):
        w = torch.tensor(weights if weights else [1.0] * len(options))
        return options[int(torch.multinomial(w, 1, generator=rng))]

    if shape is None:
        tq, tk = pick(_SEQ_LENGTHS, _SEQ_WEIGHTS), pick(_SEQ_LENGTHS, _SEQ_WEIGHTS)
        kv_heads, groups = pick((1, 3, 5)), pick((1, 1, 3))
        q_heads = kv_heads * groups if kv_heads * groups <= 5 else kv_heads  # H in {1,3,5}
        big = max(tq, tk) >= 113
        batch = 1 if big else pick((1, 2, 3))
        head_dim = pick(_HEAD_DIMS)
        value_dim = head_dim if bool(torch.rand((), generator=rng) < 0.6) else pick(_HEAD_DIMS)
    else:
        batch, q_heads, kv_heads, tq, tk, head_dim, value_dim = shape
    mask = pick(_MASKS)
    causal = bool(torch.rand((), generator=rng) < 0.4)
    align = pick(("top_left", "bottom_right"))
    dead_rows = mask in ("bool", "float", "padding") and bool(torch.rand((), generator=rng) < 0.3)
    scale = None if bool(torch.rand((), generator=rng) < 0.7) else float(torch.rand((), generator=rng)) + 0.05
    return Config(seed, batch, q_heads, kv_heads, tq, tk, head_dim, value_dim, mask, causal,
                  align, dead_rows, scale)


def configs(n: int, *, seed: int = 0, shape: tuple | None = None, small: bool = False) -> list[Config]:
    """``n`` seeded random configurations.

    Args:
        n: how many.
        seed: seed of the draw (the same seed gives the same list).
        shape: fix ``(B, Hq, Hkv, Tq, Tk, D, Dv)`` and vary only masks and options (for
            backends that compile per shape, such as flex).
        small: redraw configurations whose sequences exceed 113 (quick sweeps).

    Example:
        >>> len(configs(5)), configs(3) == configs(3)
        (5, True)
    """
    rng = torch.Generator().manual_seed(seed)
    result = []
    while len(result) < n:
        config = _draw_config(rng, seed * 100_003 + len(result), shape)
        if small and max(config.tq, config.tk) > 113:
            continue
        result.append(config)
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
    return None


@functools.lru_cache(maxsize=512)
def _inputs(config: Config):
    """fp64 q, k, v, output-gradient weights and the mask of a configuration (cached)."""
    gen = torch.Generator().manual_seed(config.seed)
    q = torch.randn(config.batch, config.q_heads, config.tq, config.head_dim, generator=gen,
                    dtype=torch.float64)
    k = torch.randn(config.batch, config.kv_heads, config.tk, config.head_dim, generator=gen,
                    dtype=torch.float64)
    v = torch.randn(config.batch, config.kv_heads, config.tk, config.value_dim, generator=gen,
                    dtype=torch.float64)
    grad_weights = torch.randn(config.batch, config.q_heads, config.tq, config.value_dim,
                               generator=gen, dtype=torch.float64)
    return q, k, v, grad_weights, _mask_for(config, gen)


def _run(config: Config, dtype: torch.dtype, backend: str, with_grad: bool) -> list[Tensor]:
    """Output (and q/k/v gradients) of one backend, in fp64 for comparison."""
    q64, k64, v64, grad_weights, mask = _inputs(config)
    q, k, v = (t.to(dtype, copy=True).requires_grad_(with_grad) for t in (q64, k64, v64))
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    options = dict(mask=mask, causal=config.causal, align=config.align, scale=config.scale)
    with torch.set_grad_enabled(with_grad):
        out = attention(q, k, v, backend=backend, **options)
    if not with_grad:
        return [out.detach().double()]
    grads = torch.autograd.grad((out * grad_weights.to(dtype)).sum(), (q, k, v))
    return [t.detach().double() for t in (out, *grads)]


@functools.lru_cache(maxsize=1024)
def _oracle(config: Config, dtype: torch.dtype, with_grad: bool) -> tuple:
    """(fp64 reference results, same-dtype reference results), cached across backends."""
    return (_run(config, torch.float64, "reference", with_grad),
            _run(config, dtype, "reference", with_grad))


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

    def worst_ratio(self) -> float:
        """Largest error / allowed ratio (1.0 or more fails)."""
        return max((e / a for e, a in zip(self.errors, self.allowed)), default=0.0)


def _serves(config: Config, dtype: torch.dtype, backend: str, with_grad: bool) -> list[str]:
    q64, k64, v64, _, mask = _inputs(config)
    q, k, v = (t.to(dtype, copy=True).requires_grad_(with_grad) for t in (q64, k64, v64))
    with torch.set_grad_enabled(with_grad):
        call = build_call(q, k, v, mask=mask, causal=config.causal, align=config.align,
                          scale=config.scale)
        return _backends.reasons(call)[backend]


def check(backend: str, config: Config, dtype: torch.dtype) -> CheckResult:
    """Run ``backend`` on ``config`` in ``dtype`` and compare with the fp64 reference.

    Forward and backward when the backend can differentiate the call, else forward only;
    a declined call returns ``served=False``.

    Example:
        >>> check("reference", configs(1)[0], torch.float32).passed
        True
    """
    with_grad = not _serves(config, dtype, backend, True)
    if not with_grad and _serves(config, dtype, backend, False):
        note = "; ".join(_serves(config, dtype, backend, False))
        return CheckResult(backend, _dtype_name(dtype), config.label(), False, False, (), (),
                           True, note)
    exact, same_dtype = _oracle(config, dtype, with_grad)
    got = _run(config, dtype, backend, with_grad)
    errors, allowed = [], []
    # Gradient noise scales with the problem's largest quantities, not with each gradient
    # (dq, dk are exactly 0 with one key, yet a fused kernel's rounding is not).
    magnitude = max((float(t.abs().max()) for t in exact if t.numel()), default=0.0)
    floor = floor_for(dtype, magnitude, reduction=max(config.head_dim, config.value_dim, config.tk))
    for i, (want, ref, have) in enumerate(zip(exact, same_dtype, got)):
        factor = 2.0 if i == 0 else 3.0
        allowed.append(factor * _max_err(ref, want) + floor)
        errors.append(_max_err(have, want))
    passed = all(e <= a for e, a in zip(errors, allowed))
    return CheckResult(backend, _dtype_name(dtype), config.label(), True, with_grad,
                       tuple(errors), tuple(allowed), passed, "")


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
    """Check every backend on ``n`` configurations per dtype (flex: ``flex_n`` at one shape).

    Example:
        >>> results = sweep(["sdpa"], [torch.float32], n=3, small=True)
        >>> all(r.passed for r in results)
        True
    """
    results = []
    for dtype in dtypes:
        for name in backend_names:
            count = n if name != "flex" else (flex_n if flex_n is not None else n)
            shape = FLEX_SHAPE if name == "flex" else None
            for config in configs(count, seed=seed, shape=shape, small=small):
                result = check(name, config, dtype)
                results.append(result)
                if progress is not None:
                    progress(result)
    return results
