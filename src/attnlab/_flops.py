"""The FLOP convention every cost estimate and benchmark in attnlab uses.

Forward attention costs ``2*B*H*Tq*Tk*(D + Dv)`` multiply-adds counted as two FLOPs each
(``4*B*H*Tq*Tk*D`` when ``Dv == D``), halved for a causal mask the kernel really skips; the
backward pass counts 2.5x the forward. ``docs/contract.md`` states the same rule; BENCHMARKS.md
quotes it next to every figure.

Example:
    >>> attention_flops(1, 1, 2, 2, 4)
    64.0
"""

from __future__ import annotations

__all__ = ["attention_flops", "MODES"]

MODES = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(b: int, h: int, tq: int, tk: int, d: int, dv: int | None = None, *,
                    causal: bool = False, mode: str = "fwd") -> float:
    """FLOPs of one attention call under attnlab's convention.

    Args:
        b, h, tq, tk, d: batch, query heads, query/key lengths, head dim.
        dv: value head dim (defaults to ``d``).
        causal: halve the count (half the score matrix is skipped).
        mode: ``"fwd"``, ``"bwd"`` (2.5x forward) or ``"fwd+bwd"`` (3.5x).

    Example:
        >>> attention_flops(1, 1, 2, 2, 4, mode="fwd+bwd")
        224.0
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    dv = d if dv is None else dv
    forward = 2.0 * b * h * tq * tk * (d + dv)
    if causal:
        forward /= 2
    return forward * MODES[mode]
