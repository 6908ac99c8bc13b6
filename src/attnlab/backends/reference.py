"""The reference backend: attention as the textbook writes it.

scores -> scale -> mask -> softmax -> dropout -> weighted sum of values. It materialises the
``(B, H, Tq, Tk)`` score matrix, so it is O(T^2) in memory, and it is the oracle every other
backend is checked against (run it in fp64 for that).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._call import AttentionCall
from attnlab.backends.base import AttentionResult, Backend, call_flops, register

__all__ = ["ReferenceBackend", "repeat_kv", "masked_scores", "softmax_rows", "apply_dropout"]


def repeat_kv(t: Tensor, q_heads: int) -> Tensor:
    """Repeat key/value heads for grouped-query attention: ``(B, Hkv, T, D) -> (B, Hq, T, D)``.

    Query head ``h`` uses key/value head ``h // (Hq // Hkv)``, as in PyTorch's ``enable_gqa``.

    Example:
        >>> repeat_kv(torch.zeros(1, 2, 3, 4), 6).shape
        torch.Size([1, 6, 3, 4])
    """
    groups = q_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def masked_scores(call: AttentionCall, q: Tensor, k: Tensor) -> Tensor:
    """Scaled scores with every mask applied; blocked positions are ``-inf``.

    Args:
        call: the call (for scale, masks and causal alignment).
        q: ``(B, H, Tq, D)``; k: ``(B, H, Tk, D)`` with heads already repeated.

    Returns:
        ``(B, H, Tq, Tk)`` scores.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.ones(1, 1, 2, 4)
        >>> masked_scores(build_call(q, q, q, causal=True), q, q)
        tensor([[[[2., -inf],
                  [2., 2.]]]])
    """
    attn_scores = (q @ k.transpose(-2, -1)) * call.scale  # (B, H, Tq, Tk)
    bias = call.bias()
    if bias is not None:
        attn_scores = attn_scores + bias.to(attn_scores.dtype)
    allowed = call.allowed()
    if allowed is not None:
        attn_scores = attn_scores.masked_fill(~allowed, float("-inf"))
    return attn_scores


def softmax_rows(attn_scores: Tensor) -> Tensor:
    """Softmax over keys that gives all-zero rows (and zero gradient) where every key is blocked.

    A plain softmax of a row of ``-inf`` is NaN. Such rows are replaced by zeros before the
    softmax (so the backward pass sees finite numbers) and multiplied by 0 afterwards.

    Example:
        >>> softmax_rows(torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]]))
        tensor([[0.5000, 0.5000],
                [0.0000, 0.0000]])
    """
    row_alive = (attn_scores > float("-inf")).any(dim=-1, keepdim=True)  # (B, H, Tq, 1)
    safe_scores = torch.where(row_alive, attn_scores, torch.zeros_like(attn_scores))
    return torch.softmax(safe_scores, dim=-1) * row_alive


def apply_dropout(attn_weights: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """Zero each weight with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    Draws the keep-mask with ``bernoulli_`` on ``generator`` (PyTorch's default generator when
    None), which consumes random numbers exactly as ``torch.nn.Dropout`` does on CPU, so the
    seed documents' dropout outputs are reproduced.

    Example:
        >>> kept = apply_dropout(torch.ones(1000), 0.5, torch.Generator().manual_seed(0))
        >>> sorted(set(kept.tolist()))
        [0.0, 2.0]
    """
    if p == 0.0:
        return attn_weights
    keep = torch.empty_like(attn_weights).bernoulli_(1.0 - p, generator=generator)
    return attn_weights * keep.div_(1.0 - p)


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
    memory = "quadratic"
    description = "explicit softmax(q k^T * scale + mask) v; O(T^2) memory; the fp64 oracle"

    # Unfused matmul + softmax + matmul on CPU, measured like the other backends' rates.
    cpu_rate = 15e9
    cuda_rate = 5e12

    def cost(self, call: AttentionCall) -> float:
        """Estimated seconds: every score is computed (no causal saving) at an unfused rate."""
        rate = self.cuda_rate if call.device.type == "cuda" else self.cpu_rate
        return call_flops(call, causal=False) / rate

    def forward(self, call: AttentionCall) -> AttentionResult:
        q, k, v = call.q, repeat_kv(call.k, call.q_heads), repeat_kv(call.v, call.q_heads)
        attn_scores = masked_scores(call, q, k)  # (B, H, Tq, Tk)
        attn_weights = softmax_rows(attn_scores)
        dropped = apply_dropout(attn_weights, call.dropout_p, call.generator)
        context = dropped @ v  # (B, H, Tq, Dv)
        return AttentionResult(out=context, weights=attn_weights if call.return_weights else None)


register(ReferenceBackend())
