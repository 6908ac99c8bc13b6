"""The math every backend and the weight views share: GQA head repetition, masked scores,
a softmax that keeps fully masked rows at zero, and dropout.

These are the textbook steps; the reference backend is built from them, and
:func:`attnlab.attention_weights` and :mod:`attnlab.explain` reuse them so that every view of
the weights agrees with the oracle.

Example:
    >>> import torch
    >>> softmax_rows(torch.tensor([[0.0, 0.0]]))
    tensor([[0.5000, 0.5000]])
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._call import AttentionCall

__all__ = ["repeat_kv", "masked_scores", "softmax_rows", "apply_dropout"]


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
