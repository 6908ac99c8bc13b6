"""Attention modules built on :func:`attnlab.attention`."""

from attnlab.nn.blocks import FeedForward, TransformerBlock, TransformerDecoder, TransformerEncoder
from attnlab.nn.cache import KVCache
from attnlab.nn.multihead import MultiHeadAttention
from attnlab.nn.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    alibi_bias,
    alibi_slopes,
)
from attnlab.nn.tutorial import (
    AttentionHead,
    CausalAttention,
    CrossAttention,
    MultiHeadAttentionWrapper,
    ScoreVariance,
    SelfAttention,
    SimpleSelfAttention,
    causal_average,
    cross_attention,
    multi_head_attention,
    project,
    score_variance,
    softmax_peakiness,
)

__all__ = [
    "MultiHeadAttention",
    "KVCache",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "LearnedPositionalEmbedding",
    "alibi_bias",
    "alibi_slopes",
    "FeedForward",
    "TransformerBlock",
    "TransformerEncoder",
    "TransformerDecoder",
    "AttentionHead",
    "SimpleSelfAttention",
    "SelfAttention",
    "CausalAttention",
    "CrossAttention",
    "MultiHeadAttentionWrapper",
    "project",
    "multi_head_attention",
    "cross_attention",
    "causal_average",
    "ScoreVariance",
    "score_variance",
    "softmax_peakiness",
]
