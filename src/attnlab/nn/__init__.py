"""Attention modules built on :func:`attnlab.attention`."""

from attnlab.nn.multihead import MultiHeadAttention

__all__ = ["MultiHeadAttention"]
