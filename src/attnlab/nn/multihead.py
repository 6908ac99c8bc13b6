"""Multi-head attention as one module on top of :func:`attnlab.attention`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional import attention

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with the seed documents' constructor.

    Projects ``x`` to queries, keys and values, splits ``d_out`` into ``num_heads`` heads of
    ``d_out // num_heads`` features, attends per head, merges the heads and applies an output
    projection. ``W_query``, ``W_key``, ``W_value`` and ``out_proj`` are created in that order,
    so ``torch.manual_seed(s)`` before construction reproduces the documents' printed numbers.

    Shapes:
        x: ``(B, T, d_in)`` or unbatched ``(T, d_in)`` -> ``(B, T, d_out)`` / ``(T, d_out)``.

    Args:
        d_in: input features.
        d_out: output features; a multiple of ``num_heads``.
        context_length: optional bound on the sequence length.
        dropout: dropout on the attention weights, applied in training mode only.
        num_heads: number of heads.
        qkv_bias: bias in the query/key/value projections.
        causal: mask future tokens (the documents' GPT-style module is causal).

    Example:
        >>> torch.manual_seed(1240)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> mha = MultiHeadAttention(3, 2, 12, 0.0, 2)
        >>> mha(torch.rand(2, 12, 3)).shape
        torch.Size([2, 12, 2])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int | None = None,
        dropout: float = 0.0,
        num_heads: int = 1,
        *,
        qkv_bias: bool = False,
        causal: bool = True,
    ):
        super().__init__()
        if num_heads < 1 or d_out % num_heads != 0:
            raise ValueError(f"d_out ({d_out}) must be a positive multiple of num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_out, self.num_heads = d_out, num_heads
        self.head_dim = d_out // num_heads
        self.context_length, self.dropout, self.causal = context_length, dropout, causal
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def _split_heads(self, t: Tensor) -> Tensor:
        B, T, _ = t.shape
        return t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)

    def forward(self, x: Tensor) -> Tensor:
        unbatched = x.ndim == 2
        if unbatched:
            x = x.unsqueeze(0)  # (1, T, d_in)
        B, T, _ = x.shape
        if self.context_length is not None and T > self.context_length:
            raise ValueError(f"x has {T} tokens, more than context_length={self.context_length}")
        q = self._split_heads(self.W_query(x))
        k = self._split_heads(self.W_key(x))
        v = self._split_heads(self.W_value(x))
        p = self.dropout if self.training else 0.0
        context = attention(q, k, v, causal=self.causal, dropout_p=p)  # (B, H, T, hd)
        context = context.transpose(1, 2).reshape(B, T, self.d_out)  # (B, T, d_out)
        out = self.out_proj(context)
        return out[0] if unbatched else out
