"""Production attention modules built on :func:`attnlab.attention`.

Multi-head (grouped-query, cross, sliding-window) attention, multi-head latent attention (MLA),
differential (DiffLlama) and gated (Qwen3-Next) attention, DeepSeek-V4's compressed attention,
the recurrent (linear-attention) layers of the hybrids (Gated DeltaNet, Kimi Delta Attention),
the KV caches (contiguous, windowed ring buffer, paged), positional encodings and transformer
blocks. The tutorials' small teaching modules live in :mod:`attnlab.tutorial`.

Example:
    >>> import torch
    >>> from attnlab.nn import MultiHeadAttention
    >>> MultiHeadAttention(16, 16, 32, 0.0, 4)(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
"""

from attnlab.nn.blocks import FeedForward, TransformerBlock, TransformerDecoder, TransformerEncoder
from attnlab.nn.cache import (BranchCache, Cache, ChunkedKVCache, KVCache, PagedKVCache, RecurrentCache,
                              WindowedKVCache)
from attnlab.nn.compressed import CompressedAttention, CompressedCache
from attnlab.nn.indexer import LightningIndexer
from attnlab.nn.latent import LatentAttention
from attnlab.nn.gated import GatedAttention
from attnlab.nn.recurrent import DecayedLinearAttention, GatedDeltaNet, KimiDeltaAttention
from attnlab.nn.differential import DifferentialAttention
from attnlab.nn.multihead import QKV, CallMask, Chunk, MultiHeadAttention, QKNorm, Window
from attnlab.nn.kv_sharing import KVShare, SharedKVAttention
from attnlab.nn.native_sparse import NativeSparseAttention
from attnlab.nn.topk_attention import TopkAttention
from attnlab.nn.convert import from_torch, to_torch
from attnlab.nn.positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    QueryTemperature,
    RotaryEmbedding,
    SinusoidalPositionalEmbedding,
    alibi_bias,
    alibi_slopes,
)

__all__ = [
    "MultiHeadAttention",
    "QKV",
    "QKNorm",
    "Window",
    "Chunk",
    "CallMask",
    "KVShare",
    "SharedKVAttention",
    "from_torch",
    "to_torch",
    "LatentAttention",
    "DifferentialAttention",
    "GatedAttention",
    "GatedDeltaNet",
    "DecayedLinearAttention",
    "KimiDeltaAttention",
    "NativeSparseAttention",
    "TopkAttention",
    "LightningIndexer",
    "CompressedAttention",
    "CompressedCache",
    "Cache",
    "KVCache",
    "WindowedKVCache",
    "ChunkedKVCache",
    "BranchCache",
    "PagedKVCache",
    "RecurrentCache",
    "RotaryEmbedding",
    "ALiBi",
    "QueryTemperature",
    "SinusoidalPositionalEmbedding",
    "LearnedPositionalEmbedding",
    "alibi_bias",
    "alibi_slopes",
    "FeedForward",
    "TransformerBlock",
    "TransformerEncoder",
    "TransformerDecoder",
]
