"""The modules attnlab's MultiHeadAttention is compared with, written as their authors wrote them.

* :class:`SeedMultiHeadAttention` -- the multi-head module of the tutorial "Attention for your
  Transformers": three projections and an explicit masked softmax over the full score matrix.
* :class:`NanoGPTAttention` -- nanoGPT's ``CausalSelfAttention``: one fused projection and
  ``F.scaled_dot_product_attention(is_causal=True)``.

The benchmark suite times them; the tests use them as independent references.

Example:
    >>> import torch
    >>> NanoGPTAttention(8, 2)(torch.randn(1, 5, 8)).shape
    torch.Size([1, 5, 8])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SeedMultiHeadAttention", "NanoGPTAttention"]


class SeedMultiHeadAttention(nn.Module):
    """The tutorial "Attention for your Transformers"'s MultiHeadAttention as written: explicit masked softmax, O(T^2) scores.

    Shapes:
        x: ``(B, T, d_in)`` -> ``(B, T, d_out)``.

    Example:
        >>> SeedMultiHeadAttention(8, 8, 16, 0.0, 2)(torch.randn(1, 5, 8)).shape
        torch.Size([1, 5, 8])
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, x: Tensor) -> Tensor:
        b, num_tokens, _ = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        shape = (b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.view(shape).transpose(1, 2)  # (b, H, T, hd)
        queries = queries.view(shape).transpose(1, 2)
        values = values.view(shape).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, H, T, T)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / self.head_dim**0.5, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2).contiguous()  # (b, T, H, hd)
        return self.out_proj(context_vec.view(b, num_tokens, self.d_out))


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: fused ``c_attn``, SDPA with ``is_causal=True``, ``c_proj``.

    Shapes:
        x: ``(B, T, C)`` -> ``(B, T, C)``.

    Example:
        >>> NanoGPTAttention(8, 2)(torch.randn(1, 5, 8)).shape
        torch.Size([1, 5, 8])
    """

    def __init__(self, n_embd: int, n_head: int, *, bias: bool = True):
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        heads = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))  # (B, T, C)
