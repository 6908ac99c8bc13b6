"""The FLOP convention every cost estimate and benchmark in attnlab uses.

Forward attention costs ``2*B*H*Tq*Tk*(D + Dv)`` multiply-adds counted as two FLOPs each
(``4*B*H*Tq*Tk*D`` when ``Dv == D``), halved for a causal mask the kernel really skips; the
backward pass counts 2.5x the forward. ``docs/contract.md`` states the same rule; BENCHMARKS.md
quotes it next to every figure.

Linear attention (:func:`linear_attention_flops`) is counted as the matmuls of its chunked form
at a fixed chunk of ``C = 64`` tokens, whatever chunk or loop an implementation runs, so that
GFLOP/s compare as speeds do. Per value head and chunk (``Q, K`` ``(C, Dk)``, ``V`` ``(C, Dv)``,
``S`` ``(Dk, Dv)``): the causal scores ``Q Kᵀ`` (``2 C² Dk``), their product with the values
(``2 C² Dv``), the inter-chunk output ``Q S`` and the state update ``Kᵀ V`` (``2 C Dk Dv`` each).
Delta rules add the WY/UT step: ``K Kᵀ`` (``2 C² Dk``), the triangular inverse (``C³ / 3``
multiply-adds), ``W = T (β K)`` and ``U = T (β V)`` (``2 C² (Dk + Dv)``), and the state's prediction
``W S`` (``2 C Dk Dv``). Decays (scalar or per channel) scale entries and are not counted. The
backward pass counts 2.5x the forward, as for attention.

Example:
    >>> attention_flops(1, 1, 2, 2, 4)
    64.0
"""

from __future__ import annotations

__all__ = ["attention_flops", "linear_attention_flops", "MODES", "LINEAR_CHUNK"]

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


LINEAR_CHUNK = 64  # the chunk linear_attention_flops counts the chunked form at


def linear_attention_flops(b: int, h: int, t: int, dk: int, dv: int | None = None, *, delta: bool = False,
                           mode: str = "fwd") -> float:
    """FLOPs of one linear-attention call under attnlab's convention (the chunked form at C=64).

    Per token and value head: ``2 C (Dk + Dv) + 4 Dk Dv`` for the additive and decayed rules;
    delta rules (``beta`` given) add ``2 C (2 Dk + Dv) + 2 Dk Dv + (2/3) C²`` (the WY/UT step).

    Args:
        b, h, t: batch, value heads, tokens. dk, dv: key and value head dims (``dv`` defaults to ``dk``).
        delta: a delta rule (DeltaNet, Gated DeltaNet, KDA).
        mode: ``"fwd"``, ``"bwd"`` (2.5x forward) or ``"fwd+bwd"`` (3.5x).

    Example:
        >>> linear_attention_flops(1, 1, 64, 2)    # 64 * (2*64*(2+2) + 4*2*2)
        33792.0
        >>> linear_attention_flops(1, 4, 4096, 128, delta=True) / 1e9   # Gated DeltaNet, H=4, D=128
        2.997...
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    dv = dk if dv is None else dv
    c = LINEAR_CHUNK
    per_token = 2.0 * c * (dk + dv) + 4.0 * dk * dv
    if delta:
        per_token += 2.0 * c * (2 * dk + dv) + 2.0 * dk * dv + 2.0 * c * c / 3
    return b * h * t * per_token * MODES[mode]
