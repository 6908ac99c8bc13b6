"""Attention modules built on :func:`attnlab.attention`."""

from attnlab.nn.cache import KVCache
from attnlab.nn.multihead import MultiHeadAttention

__all__ = ["MultiHeadAttention", "KVCache"]
