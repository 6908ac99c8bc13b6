"""The reference backend: attention as the textbook writes it.

scores -> scale -> score mod -> mask -> softmax (with the sinks' column) -> dropout -> weighted
sum of values. It materialises the
``(B, H, Tq, Tk)`` score matrix, so it is O(T^2) in memory, and it is the oracle every other
backend is checked against (run it in fp64 for that). For fp16/bf16 inputs the scores, the
float mask and the softmax are computed in fp32 and the weights rounded back to the input
dtype before ``weights @ v``, as fused kernels do. Keys no query may attend and queries with
nothing to attend are zeroed first, so NaN/inf stored there reach neither output nor gradient.
"""

from __future__ import annotations

import torch  # noqa: F401  (the doctest examples use it)

from attnlab._call import AttentionCall
from attnlab._math import (
    apply_dropout,
    blocked_positions,
    live,
    masked_scores,
    repeat_kv,
    softmax_rows,
    zero_dead,
)
from attnlab.backends.base import AttentionResult, Backend, call_flops
from attnlab.backends.rates import RATES
from attnlab.backends.registry import register

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """Explicit math on the full score matrix; supports every option; returns weights.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
        >>> result = ReferenceBackend().forward(build_call(q, q, q, return_weights=True))
        >>> result.out.shape, result.weights.shape
        (torch.Size([1, 2, 5, 8]), torch.Size([1, 2, 5, 5]))
    """

    name = "reference"
    traceable = True
    dense_mask = True
    plan_fixes_tk = False  # its plan reads no key length
    memory = "quadratic"
    description = ("explicit softmax(score_mod(q k^T * scale) + mask) v, sinks in the softmax; any score "
                   "mod (autograd through it); O(T^2) memory; the fp64 oracle")

    def cost(self, call: AttentionCall) -> float:
        """Estimated seconds: every score is computed (no causal saving) at an unfused rate."""
        rate = RATES["reference"]["cuda" if call.device.type == "cuda" else "cpu"]
        return RATES["reference"]["call_overhead_s"] + call_flops(call, causal=False) / rate

    def forward(self, call: AttentionCall) -> AttentionResult:
        blocked = blocked_positions(call)
        allowed = None if blocked is None else ~blocked
        keys_live = None if allowed is None else live(allowed.any(dim=-2))  # keys some query may attend
        q = zero_dead(call.q, None if allowed is None else live(allowed.any(dim=-1)))  # rows with a key
        k = zero_dead(repeat_kv(call.k, call.q_heads), keys_live)  # (B, Hq, Tk, D)
        v = zero_dead(repeat_kv(call.v, call.q_heads), keys_live)  # (B, Hq, Tk, Dv)
        attn_scores = masked_scores(call, q, k)  # (B, H, Tq, Tk)
        attn_weights = softmax_rows(attn_scores, call.sinks).to(call.dtype)
        dropped = apply_dropout(attn_weights, call.dropout_p, call.generator)
        context = dropped @ v  # (B, H, Tq, Dv)
        return AttentionResult(out=context, weights=attn_weights if call.return_weights else None)


register(ReferenceBackend())
