"""How many bytes a KV cache holds: the arithmetic behind ``attnlab kv-memory`` and the variants suite.

:func:`kv_cache_bytes` is the formula: what a layer's cache holds per token
(:func:`layer_bytes_per_token`), times the tokens it holds, summed over the layers, for every
layer kind of :class:`~attnlab.models.GPT` (global, sliding-window, chunked, latent, sparse); a
recurrent layer (Gated DeltaNet, KDA) holds no tokens but a state of constant size
(:func:`recurrent_state_bytes`), whatever the context; a compressed layer (DeepSeek-V4's CSA, HCA)
a window of keys and one entry per ``compress_rate`` tokens (:func:`compressed_cache_bytes`).

Example:
    >>> kv_cache_bytes(context=131072, layers=35, kv_heads=8, head_dim=256, dtype_bytes=2) / 1e9
    37.58096384
"""

from __future__ import annotations

from attnlab._checks import positive_int
from attnlab.nn.kv_sharing import kv_sharing_plan
from attnlab.nn.native_sparse import paper_sizes

__all__ = ["DTYPE_BYTES", "compressed_cache_bytes", "kv_cache_bytes", "layer_bytes_per_token",
           "recurrent_state_bytes"]

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


def layer_bytes_per_token(kind: str, *, kv_heads: int = 1, head_dim: int = 1, latent_dim: int = 0,
                          rope_dim: int = 0, dtype_bytes: int = 2) -> int:
    """Bytes one layer caches per token: ``2 * kv_heads * head_dim`` numbers (a key and a value per
    KV head) for ``"G"``/``"L"`` layers, ``latent_dim + rope_dim`` for an ``"M"`` (latent) layer.

    Example:
        >>> layer_bytes_per_token("G", kv_heads=8, head_dim=128), layer_bytes_per_token("M", latent_dim=512, rope_dim=64)
        (4096, 1152)
    """
    numbers = latent_dim + rope_dim if kind == "M" else 2 * kv_heads * head_dim
    return numbers * dtype_bytes


def recurrent_state_bytes(*, value_heads: int, key_heads: int, head_dim: int, value_dim: int | None = None,
                          kernel_size: int = 4, dtype_bytes: int = 2) -> int:
    """Bytes one recurrent layer (:class:`~attnlab.nn.GatedDeltaNet`, :class:`~attnlab.nn.KimiDeltaAttention`)
    holds per sequence at any context: the state ``Hv·Dk·Dv`` in fp32 and the short convolution's
    last ``kernel_size - 1`` inputs (``2·H·Dk + Hv·Dv`` channels) in the model's dtype, as its
    :class:`~attnlab.nn.RecurrentCache` holds them.

    Example:
        >>> recurrent_state_bytes(value_heads=32, key_heads=16, head_dim=128) / 2**20   # a Qwen3.5 layer, bf16
        2.046875
    """
    for name, value in (("value_heads", value_heads), ("key_heads", key_heads), ("head_dim", head_dim),
                        ("kernel_size", kernel_size), ("dtype_bytes", dtype_bytes)):
        positive_int(name, value)
    value_dim = head_dim if value_dim is None else positive_int("value_dim", value_dim)
    channels = 2 * key_heads * head_dim + value_heads * value_dim
    return value_heads * head_dim * value_dim * 4 + channels * (kernel_size - 1) * dtype_bytes


def compressed_cache_bytes(*, context: int, head_dim: int, window: int, compress_rate: int, index_dim: int = 0,
                           dtype_bytes: int = 2) -> int:
    """Bytes one :class:`~attnlab.nn.CompressedAttention` layer's cache holds for one sequence of
    ``context`` tokens, as its :class:`~attnlab.nn.CompressedCache` holds them (all in the model's dtype).

    With ``n = context // compress_rate`` closed windows and ``p = context % compress_rate`` tokens
    of the open one, it holds the window's last ``min(window - 1, context)`` keys of ``head_dim``
    and, for its compressor (and for CSA's indexer, at ``index_dim``), ``n`` entries of ``dim``
    numbers, the open window's ``p`` projections and gates (``2 p width``, ``width = 2 dim`` for
    CSA's two overlapping series, ``dim`` for HCA) and, for CSA once a window has closed, that
    window's first series and gates (``2 compress_rate dim``). ``index_dim > 0`` means CSA, 0 HCA.

    Example:
        >>> compressed_cache_bytes(context=10, head_dim=8, window=3, compress_rate=4, dtype_bytes=4)  # HCA
        256
        >>> csa = compressed_cache_bytes(context=2**20, head_dim=512, window=128, compress_rate=4, index_dim=128)
        >>> hca = compressed_cache_bytes(context=2**20, head_dim=512, window=128, compress_rate=128)
        >>> round(csa / 2**20, 1), round(hca / 2**20, 1)         # MiB a sequence of 1M tokens, bf16
        (320.1, 8.1)
    """
    for name, value in (("context", context), ("head_dim", head_dim), ("window", window),
                        ("compress_rate", compress_rate), ("dtype_bytes", dtype_bytes)):
        positive_int(name, value)
    if index_dim < 0:
        raise ValueError(f"index_dim must be >= 0 (0: HCA, no indexer), got {index_dim}")
    closed, open_tokens = divmod(context, compress_rate)
    csa = index_dim > 0

    def stream(dim: int, overlap: bool) -> int:  # one compressor's entries, open window and overlap
        carry = 2 * compress_rate * dim if overlap and closed else 0
        return closed * dim + 2 * open_tokens * dim * (2 if overlap else 1) + carry

    numbers = min(window - 1, context) * head_dim + stream(head_dim, csa) + (stream(index_dim, True) if csa else 0)
    return numbers * dtype_bytes


def kv_cache_bytes(*, context: int, layers: int, kv_heads: int = 1, head_dim: int = 1, dtype_bytes: int = 2,
                   batch: int = 1, pattern: str = "G", window: int | None = None, latent_dim: int = 0,
                   rope_dim: int = 0, kv_layers: int | None = None, chunk: int | None = None, index_dim: int = 0,
                   index_bytes: int = 1, nsa_block: int | None = None, linear_state: int | None = None,
                   compress_rate: int | None = None, kv_shared_layers: int = 0) -> int:
    """Bytes of KV cache for ``batch`` sequences of ``context`` tokens.

    ``pattern`` gives each layer's kind as in :class:`~attnlab.models.GPT` (tiled over ``layers``):
    a ``G`` or ``N`` (global, NoPE) layer holds ``context`` tokens, an ``L`` layer
    ``min(window, context)``, a ``C`` (chunked-local, Llama 4) layer its current chunk,
    ``min(chunk, context)``, an ``M`` layer ``context`` latents. ``kv_layers`` counts the layers that
    produce (and cache) keys and values when later layers reuse an earlier layer's (cross-layer KV
    sharing); the first ``kv_layers`` layers of the pattern are those. ``kv_shared_layers`` says the
    same as :class:`~attnlab.models.GPT`'s ``num_kv_shared_layers`` (Gemma 3n, Gemma 4): the last that
    many layers hold no cache, each reading the last earlier layer of its letter (``G``, ``L``, ``C``,
    ``N``; :func:`~attnlab.nn.kv_sharing.kv_sharing_plan` refuses the rest), so the first
    ``layers - kv_shared_layers`` are counted once. A ``T`` (sparse top-k) layer
    holds every token, as a global one; ``index_dim`` adds that many numbers of ``index_bytes`` a token
    a layer (DeepSeek-V3.2's lightning-indexer keys, fp8 there). An ``S`` (native sparse) layer of
    ``nsa_block`` (sizes as :func:`attnlab.nn.native_sparse.paper_sizes`) holds keys and values for
    each branch: every token (selected), the last ``8 nsa_block`` (window), the newest ``nsa_block/2``
    (the block being compressed) and one per complete compressed block (every ``nsa_block/4`` tokens).
    An ``R`` or ``K`` (recurrent) layer holds ``linear_state`` bytes per sequence
    (:func:`recurrent_state_bytes`) at any context. A ``V`` (DeepSeek-V4's CSA) or ``H`` (HCA) layer
    holds :func:`compressed_cache_bytes` of ``window``, ``compress_rate`` and one key head of
    ``head_dim`` (``kv_heads`` is for the other layers); a ``V`` layer's indexer keys have ``index_dim``
    numbers of ``dtype_bytes`` (its cache keeps them in the model's dtype; ``index_bytes`` is DSA's).

    Example:
        >>> kv_cache_bytes(context=8192, layers=48, pattern="M", latent_dim=1024) / 1e9     # MLA
        0.805306368
        >>> kv_cache_bytes(context=4096, layers=6, kv_heads=1, head_dim=64, pattern="LLLLLG", window=1024)
        2359296
        >>> kv_cache_bytes(context=4096, layers=12, kv_heads=1, head_dim=64, pattern="LLLLLG", window=1024,
        ...                kv_shared_layers=6)        # Gemma's rule: layers 6-11 read layers 4 (L) and 5 (G)
        2359296
        >>> kv_cache_bytes(context=4096, layers=4, kv_heads=1, head_dim=64, pattern="CCCN", chunk=1024)
        1835008
        >>> kv_cache_bytes(context=4096, layers=1, head_dim=64, pattern="S", nsa_block=64) // (2 * 64 * 2)  # pairs held
        4895
        >>> state = recurrent_state_bytes(value_heads=2, key_heads=1, head_dim=64)
        >>> kv_cache_bytes(context=4096, layers=4, kv_heads=1, head_dim=64, pattern="RRRG", linear_state=state)
        1151488
        >>> kv_cache_bytes(context=4096, layers=2, head_dim=64, pattern="VH", window=128, compress_rate=4,
        ...                index_dim=64) == sum(compressed_cache_bytes(context=4096, head_dim=64, window=128,
        ...                compress_rate=4, index_dim=i) for i in (64, 0))
        True
    """
    for name, value in (("context", context), ("layers", layers), ("batch", batch), ("dtype_bytes", dtype_bytes)):
        positive_int(name, value)
    if set(pattern) - set(LAYER_HELD):
        raise ValueError(f"pattern must be letters of {''.join(LAYER_HELD)}, got {pattern!r}")
    kinds = [pattern[layer % len(pattern)] for layer in range(layers)]
    if kv_shared_layers and kv_layers is not None:
        raise ValueError(f"kv_layers={kv_layers} and kv_shared_layers={kv_shared_layers} both say which layers hold a "
                         "cache; give one")
    kv_sharing_plan(kinds, kv_shared_layers, name="kv_shared_layers")  # refuses what a GPT refuses (letters, no earlier layer of the kind)
    kinds = kinds[: layers - kv_shared_layers if kv_layers is None else kv_layers]
    total = 0
    for kind in kinds:
        held = LAYER_HELD[kind](context, window=window, chunk=chunk, nsa_block=nsa_block)
        total += held * layer_bytes_per_token(kind, kv_heads=kv_heads, head_dim=head_dim, latent_dim=latent_dim,
                                              rope_dim=rope_dim, dtype_bytes=dtype_bytes)
        total += min(held, context) * index_dim * index_bytes
        if kind in RECURRENT:
            total += _needs("linear_state", linear_state)
        if kind in COMPRESSED:
            total += compressed_cache_bytes(context=context, head_dim=head_dim, window=_needs("window", window),
                                            compress_rate=_needs("compress_rate", compress_rate),
                                            index_dim=index_dim if kind == "V" else 0, dtype_bytes=dtype_bytes)
    return batch * total


def _needs(name: str, value: int | None) -> int:
    if value is None:
        raise ValueError(f"{name} must be given for this layer pattern, got None")
    return value


# Tokens a layer of each kind holds at ``context``.
LAYER_HELD = {
    "G": lambda context, **_: context,
    "N": lambda context, **_: context,
    "D": lambda context, **_: context,  # differential: the grouped-query layer's cache
    "Q": lambda context, **_: context,  # gated: likewise
    "M": lambda context, **_: context,
    "L": lambda context, *, window, **_: min(_needs("window", window), context),
    "C": lambda context, *, chunk, **_: min(_needs("chunk", chunk), context),
    "T": lambda context, **_: context,  # sparse top-k: any earlier key may be picked later
    "S": lambda context, *, nsa_block, **_: _nsa_held(context, _needs("nsa_block", nsa_block)),
    "R": lambda context, **_: 0,  # Gated DeltaNet: no tokens, a state of constant size (linear_state)
    "K": lambda context, **_: 0,  # Kimi Delta Attention: likewise
    "A": lambda context, **_: 0,  # plain linear attention: likewise
    "V": lambda context, **_: 0,  # DeepSeek-V4's CSA: its window and entries (compressed_cache_bytes)
    "H": lambda context, **_: 0,  # HCA: likewise, without the indexer
}
RECURRENT = ("R", "K", "A")
COMPRESSED = ("V", "H")


def _nsa_held(context: int, block: int) -> int:
    """Key/value pairs an NSA layer holds: selected (every token), window, compression tail, compressed."""
    sizes = paper_sizes(block, name="nsa_block")
    blocks = max(0, (context - sizes["compress_block"]) // sizes["compress_stride"] + 1)
    return context + min(sizes["window"], context) + min(sizes["compress_block"], context) + blocks
