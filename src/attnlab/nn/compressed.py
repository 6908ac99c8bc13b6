"""DeepSeek-V4's compressed attention: CSA (compressed sparse) and HCA (heavily compressed) layers.

DeepSeek-V4 keeps one shared key/value head (keys are values, multi-query) and lets each query
attend to three things at once:

* **the window**: its own token and the ``window - 1`` before it (the keys themselves);
* **compressed entries**: every ``compress_rate`` tokens are pooled into one entry by a gated
  softmax over the tokens (per channel), RMS-normalised and rotated at the window's first
  position. HCA (``kind="hca"``, rate 128 in V4) pools each window alone and every query reads
  every *closed* entry (entry ``w`` is closed for query ``t`` when ``(w + 1) * rate <= t + 1``).
  CSA (``kind="csa"``, rate 4) pools two overlapping series (window ``w - 1``'s first half of the
  projected channels and window ``w``'s second half, ``2 * rate`` slots) and a lightning indexer
  (its own compressor at ``index_dim`` features, ``index_heads`` heads scoring
  ``sum_h w_h ReLU(q_h . k)``) picks each query's ``topk`` best closed entries;
* **a sink**: one logit per head that takes probability mass and adds nothing.

``kind="sliding"`` is V4's third layer kind: the window and the sink only.

**How it maps onto attnlab's kernels.** The keys of one call are the window keys (a cache's last
``window - 1`` plus the new tokens) followed by the compressed entries, ``(B, 1, Lw + T + N, D)``;
each query gets one index list ``(B|1, 1, T, w + n)``: its ``w = min(window, Lw + T)`` window
positions (``-1`` before the first token) and its ``n`` compressed entries (HCA: all ``N``,
``-1`` where not yet closed; CSA: the indexer's ``min(topk, N)``, ``-1`` where it found fewer).
One ``attnlab.attention(q, keys, keys, indices=..., sinks=sinks)`` then runs the window, the
entries and the sink as one softmax (the heads enter as more queries of the one key head, the
sink as a per-query logit, so the kernel never repeats the keys per head), in O(T * (window + n))
memory: no ``(T, T)`` mask or score matrix exists (queries go in blocks so that no block holds
more than ``2**18`` scores, and the indexer scores blocks of queries the same way). HCA's
``n = N = T / rate`` is dense over the entries by definition (64 per query at T = 8192, rate 128).
Equal index scores keep the earlier entry (a ReLU score is exactly 0 when every index head's is;
transformers' ``topk`` breaks such ties either way), so a prefill and a decoding step choose alike.

The rest is DeepSeek-V4's: a low-rank query (``q_a_proj``, RMSNorm, ``q_b_proj``, then an
unweighted RMSNorm per head), interleaved-pair RoPE on the last ``rope_dim`` features of queries,
keys and entries (and the inverse rotation at the query's position on the output, since values
are rotated keys), and a grouped low-rank output projection (``o_groups`` groups of heads, each
to ``o_rank`` features by ``o_a_proj``, then ``o_b_proj``).

A decoder's cache is a :class:`CompressedCache` (:meth:`CompressedAttention.new_cache`): the
window's last keys, the compressed entries, the tokens of the window not yet closed (projections
and gates) and, for CSA, the last closed window's first series (the overlap), for the main
compressor and the indexer's. A step computes its new state aside and stores it only when the
whole step succeeded.

Example:
    >>> attn = CompressedAttention(32, 4, head_dim=16, rope_dim=8, q_rank=12, o_groups=2, o_rank=8,
    ...                            window=4, kind="csa", compress_rate=2, topk=3, index_heads=2, index_dim=8)
    >>> x = torch.randn(1, 9, 32)
    >>> cache = attn.new_cache(batch_size=1)
    >>> with torch.no_grad():
    ...     full = attn(x)
    ...     prefill = attn(x[:, :5], cache=cache)                  # then one token at a time
    ...     steps = torch.cat([prefill] + [attn(x[:, t:t + 1], cache=cache) for t in range(5, 9)], 1)
    >>> bool(torch.allclose(full, steps, atol=1e-5)), cache.length, cache.entries.shape
    (True, 9, torch.Size([1, 4, 16]))
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab._checks import instance_of, non_negative_number, one_of, positive_int, positive_number
from attnlab.functional import attention
from attnlab.nn.cache import Cache, _dtype_device
from attnlab.nn.indexer import lightning_scores, select_topk
from attnlab.nn.latent import _check_x

__all__ = ["CompressedAttention", "CompressedCache", "model_sizes"]

BLOCK_SCORES = 2**18  # the most scores (attention or index) one block of queries holds at once
KINDS = ("csa", "hca", "sliding")
_LAYER_KINDS = {"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca",
                "sliding_attention": "sliding"}


# ---------------------------------------------------------------------- the pieces
class _RMSNorm(nn.Module):
    """RMSNorm over the last axis in fp32, with a weight (``weighted=True``) or without."""

    def __init__(self, dim: int, eps: float, *, weighted: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if weighted else None
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        work = x.float()
        out = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out if self.weight is None else self.weight * out).to(x.dtype)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved-pair RoPE on the last ``2 * cos.shape[-1]`` features of ``x`` (DeepSeek-V4's layout).

    Pair ``i`` is features ``(2i, 2i + 1)`` of the rotated tail, turned by the angle whose cosine
    and sine are ``cos[..., i]``, ``sin[..., i]``; the leading features are left alone. Computed
    in fp32, returned in ``x``'s dtype.

    Shapes:
        x: ``(..., T, D)``; cos, sin: ``(T, R / 2)`` (broadcast over the leading dims) -> ``(..., T, D)``.

    Example:
        >>> x = torch.tensor([[5.0, 1.0, 2.0]])              # one nope feature, one pair
        >>> rotate_pairs(x, torch.tensor([[0.0]]), torch.tensor([[1.0]])).tolist()   # a quarter turn
        [[5.0, -2.0, 1.0]]
    """
    r = 2 * cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - r], x[..., x.shape[-1] - r:]
    pairs = rope.float().unflatten(-1, (-1, 2))  # (..., T, R/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)  # (..., T, R)
    return torch.cat([nope, turned.to(x.dtype)], dim=-1)


@dataclass(frozen=True)
class _Stream:
    """One compressor's state between calls (all ``(B, ...)``; None before any token).

    ``pending_kv``/``pending_gate`` ``(B, P, width)``: the tokens of the window not closed yet
    (``P < rate``); ``carry_kv``/``carry_gate`` ``(B, rate, dim)``: the last closed window's first
    series (CSA's overlap; gates with the position bias added); ``entries`` ``(B, N, dim)``."""

    pending_kv: Tensor | None = None
    pending_gate: Tensor | None = None
    carry_kv: Tensor | None = None
    carry_gate: Tensor | None = None
    entries: Tensor | None = None

    @property
    def count(self) -> int:
        return 0 if self.entries is None else self.entries.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, f.name) for f in fields(self))
                   if t is not None)


class _Compressor(nn.Module):
    """Pools every ``rate`` tokens into one entry of ``dim`` features (module docstring).

    **Parameters** (transformers' names): ``kv_proj``, ``gate_proj`` ``(width, d_model)``,
    ``position_bias`` ``(rate, width)``, ``kv_norm`` (``dim``), with ``width = 2 * dim`` for the
    overlapping two series (CSA) and ``dim`` for one (HCA).
    """

    def __init__(self, d_model: int, dim: int, rate: int, *, overlap: bool, eps: float):
        super().__init__()
        width = dim * (2 if overlap else 1)
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(d_model, width, bias=False)
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = _RMSNorm(dim, eps)

    def step(self, x: Tensor, state: _Stream, rotary: Callable[[Tensor], tuple[Tensor, Tensor]]) -> _Stream:
        """The state after the tokens ``x`` ``(B, T, d_model)``: every window they close pooled and appended."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)  # (B, T, width)
        if state.pending_kv is not None:
            kv, gate = torch.cat([state.pending_kv, kv], 1), torch.cat([state.pending_gate, gate], 1)
        n = kv.shape[1] // self.rate
        used = n * self.rate
        # copies, not views: a view would keep the whole call's projections alive in the cache
        new = replace(state, pending_kv=kv[:, used:].clone(), pending_gate=gate[:, used:].clone())
        if n == 0:
            return new
        windows_kv = kv[:, :used].unflatten(1, (n, self.rate))  # (B, n, rate, width)
        windows_gate = gate[:, :used].unflatten(1, (n, self.rate)) + self.position_bias
        if self.overlap:
            windows_kv, windows_gate, new = self._two_series(windows_kv, windows_gate, new)  # (B, n, 2 rate, dim)
        weights = windows_gate.softmax(dim=2, dtype=torch.float32).to(windows_kv.dtype)
        pooled = self.kv_norm((windows_kv * weights).sum(dim=2))  # (B, n, dim)
        cos, sin = rotary((state.count + torch.arange(n, device=x.device)) * self.rate)
        pooled = rotate_pairs(pooled, cos, sin)
        entries = pooled if state.entries is None else torch.cat([state.entries, pooled], 1)  # (B, N, dim)
        return replace(new, entries=entries)

    def _two_series(self, kv: Tensor, gate: Tensor, new: _Stream) -> tuple[Tensor, Tensor, _Stream]:
        """Window ``w``'s slots: window ``w - 1``'s first series then window ``w``'s second (2 * rate)."""
        B, n, rate, _ = kv.shape
        first_kv, first_gate = kv[..., : self.dim], gate[..., : self.dim]  # (B, n, rate, dim)
        if new.carry_kv is None:  # before the first window: weight 0
            before_kv = kv.new_zeros(B, 1, rate, self.dim)
            before_gate = gate.new_full((B, 1, rate, self.dim), float("-inf"))
        else:
            before_kv, before_gate = new.carry_kv[:, None].to(kv.dtype), new.carry_gate[:, None].to(gate.dtype)
        previous_kv = torch.cat([before_kv, first_kv[:, :-1]], 1)  # (B, n, rate, dim)
        previous_gate = torch.cat([before_gate, first_gate[:, :-1]], 1)
        slots_kv = torch.cat([previous_kv, kv[..., self.dim:]], 2)  # (B, n, 2 rate, dim)
        slots_gate = torch.cat([previous_gate, gate[..., self.dim:]], 2)
        return slots_kv, slots_gate, replace(new, carry_kv=first_kv[:, -1].clone(),
                                                     carry_gate=first_gate[:, -1].clone())


class _Indexer(nn.Module):
    """CSA's lightning indexer over the compressed entries: each query's ``topk`` best closed entries.

    **Parameters** (transformers' names): ``compressor`` (its own, ``index_dim`` features, two
    series), ``q_b_proj`` ``(heads * index_dim, q_rank)``, ``weights_proj`` ``(heads, d_model)``.
    """

    def __init__(self, d_model: int, q_rank: int, *, heads: int, dim: int, rate: int, topk: int, eps: float):
        super().__init__()
        self.heads, self.dim, self.topk, self.rate = heads, dim, topk, rate
        self.compressor = _Compressor(d_model, dim, rate, overlap=True, eps=eps)
        self.q_b_proj = nn.Linear(q_rank, heads * dim, bias=False)
        self.weights_proj = nn.Linear(d_model, heads, bias=False)

    def select(self, x: Tensor, q_latent: Tensor, positions: Tensor, entries: Tensor | None,
               cos: Tensor, sin: Tensor) -> Tensor:
        """Entry indices ``(B, T, min(topk, N))`` per query, ``-1`` where it has fewer closed entries.

        Equal scores keep the earlier entry (a stable sort), so a prefill and a decoding step agree."""
        B, T, _ = x.shape
        count = 0 if entries is None else entries.shape[1]
        if count == 0:
            return torch.empty(B, T, 0, dtype=torch.long, device=x.device)
        q = self.q_b_proj(q_latent).unflatten(-1, (self.heads, self.dim))  # (B, T, Hi, Di)
        q = rotate_pairs(q.transpose(1, 2), cos, sin).transpose(1, 2)  # rotated at the query positions
        weights = self.weights_proj(x) * self.heads ** -0.5  # (B, T, Hi)
        closed = (positions + 1) // self.rate  # (T,): entries closed for each query
        allowed = torch.arange(count, device=x.device) < closed[:, None]  # (T, N)
        scores = lightning_scores(q, entries, weights)  # (B, T, N), one index head at a time
        return select_topk(scores, self.topk, mask=allowed[None], causal=False)[:, 0]  # (B, T, k)


# ---------------------------------------------------------------------- the cache
@dataclass(frozen=True)
class _State:
    length: int = 0
    window: Tensor | None = None  # (B, 1, Lw, D), Lw <= window - 1: the last rotated keys
    main: _Stream = _Stream()
    index: _Stream | None = None


class CompressedCache(Cache):
    """A :class:`CompressedAttention` layer's decoding state (module docstring), from its ``new_cache``.

    It grows by one compressed entry every ``compress_rate`` tokens (and one index key for CSA); the
    window part stays at ``window - 1`` keys. :attr:`nbytes` counts every tensor it holds.

    Example:
        >>> attn = CompressedAttention(16, 2, head_dim=8, rope_dim=4, q_rank=8, o_groups=1, o_rank=8,
        ...                            window=3, kind="hca", compress_rate=4)
        >>> cache = attn.new_cache(batch_size=1)
        >>> with torch.no_grad():
        ...     _ = attn(torch.randn(1, 10, 16), cache=cache)
        >>> # bytes: (2 window keys + 2 entries + 2 open-window tokens x (kv, gate)) x 8 features x 4
        >>> cache.length, cache.entries.shape, cache.nbytes
        (10, torch.Size([1, 2, 8]), 256)
    """

    def __init__(self, batch_size: int, *, head_dim: int, window: int, kind: str, index_dim: int = 0,
                 dtype: torch.dtype | None = None, device=None):
        self.batch_size = positive_int("batch_size", batch_size)
        self.head_dim, self.value_dim, self.num_kv_heads = head_dim, head_dim, 1
        self.window_size, self.kind, self.index_dim = window, kind, index_dim
        self.dtype, device = _dtype_device(dtype, device)
        self.device = torch.device("cpu") if device is None else device
        self._state = _State(index=_Stream() if kind == "csa" else None)

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return (self._state.length,) * self.batch_size

    @property
    def entries(self) -> Tensor | None:
        """The compressed entries so far ``(B, N, head_dim)`` (None before the first closed window)."""
        return self._state.main.entries

    @property
    def index_entries(self) -> Tensor | None:
        """CSA's index keys ``(B, N, index_dim)`` (None for HCA or before the first closed window)."""
        return None if self._state.index is None else self._state.index.entries

    def check_room(self, num_new: int) -> None:
        """Always room: the cache grows with the sequence (one entry per ``compress_rate`` tokens)."""

    def extend(self, k_new: Tensor, v_new: Tensor):
        raise TypeError("a CompressedCache is written by its CompressedAttention's forward, not by extend")

    @property
    def nbytes(self) -> int:
        state = self._state
        window = 0 if state.window is None else state.window.numel() * state.window.element_size()
        return window + state.main.nbytes + (0 if state.index is None else state.index.nbytes)

    def reset(self) -> None:
        """Empty the cache."""
        self._state = _State(index=_Stream() if self.kind == "csa" else None)

    def _snapshot(self, num_new: int) -> Callable[[], None]:
        state = self._state  # immutable: the state is replaced, never written

        def restore() -> None:
            self._state = state
        return restore

    # ------------------------------------------------------------------ transformers' V4 cache layers
    @classmethod
    def from_transformers(cls, cache_layer: object, attn: "CompressedAttention", *, batch_size: int,
                          dtype: torch.dtype, device) -> "CompressedCache":
        """The state a transformers DeepSeek-V4 cache layer holds, as this cache (its tensors, not copies).

        ``cache_layer`` is what ``DynamicCache(config=...)`` builds for ``attn``'s kind:
        ``DeepseekV4CSACache`` (CSA), ``DeepseekV4HCACache`` (HCA) or ``DynamicSlidingWindowLayer``
        (sliding). Both keep the same things (module docstring): the window's last keys
        (``keys``), the count (``cumulative_length``) and, per compressor name (``"compressor"``,
        ``"indexer"``), the open window's projections and gates (``buffer_kv``/``buffer_gate``), the
        entries (``compressed_kv``) and CSA's overlap (``overlap_kv``/``overlap_gate``, gates with the
        position bias added, as here). :meth:`to_transformers` writes a state back.

        Raises:
            ValueError: a cache layer of another kind, or one recording its past (assisted decoding).

        Example:
            >>> attn = CompressedAttention(16, 2, head_dim=8, rope_dim=4, q_rank=8, o_groups=1, o_rank=8,
            ...                            window=3, kind="sliding")
            >>> CompressedCache.from_transformers(object(), attn, batch_size=1, dtype=torch.float32, device="cpu")
            Traceback (most recent call last):
            ...
            ValueError: cache_layer must be a transformers DynamicSlidingWindowLayer for a sliding layer, got object
        """
        _check_cache_layer(cache_layer, attn.kind)
        cache = attn.new_cache(batch_size, dtype=dtype, device=device)
        keys = cache_layer.keys if getattr(cache_layer, "is_initialized", False) else None
        window = keys if isinstance(keys, Tensor) and keys.ndim == 4 else None  # (B, 1, <= window - 1, D)
        state = replace(cache._state, length=int(cache_layer.cumulative_length), window=window)
        if attn.kind != "sliding":
            state = replace(state, main=_stream_of(cache_layer, "compressor"))
        if attn.kind == "csa":
            state = replace(state, index=_stream_of(cache_layer, "indexer"))
        cache._state = state
        return cache

    def to_transformers(self, cache_layer: object) -> None:
        """Write this cache's state into a transformers DeepSeek-V4 cache layer (:meth:`from_transformers`)."""
        _check_cache_layer(cache_layer, self.kind)
        state = self._state
        if state.window is not None:
            if not cache_layer.is_initialized:
                cache_layer.lazy_initialization(state.window, state.window)
            cache_layer.keys = cache_layer.values = state.window  # keys are values in V4
        cache_layer.cumulative_length = state.length
        streams = {"compressor": state.main} if self.kind != "sliding" else {}
        if state.index is not None:
            streams["indexer"] = state.index
        for name, stream in streams.items():
            cache_layer.buffer_kv[name], cache_layer.buffer_gate[name] = stream.pending_kv, stream.pending_gate
            cache_layer.compressed_kv[name], cache_layer.entry_count[name] = stream.entries, stream.count
            if self.kind == "csa":
                cache_layer.overlap_kv[name], cache_layer.overlap_gate[name] = stream.carry_kv, stream.carry_gate

    def __repr__(self) -> str:
        return (f"CompressedCache(kind={self.kind!r}, batch_size={self.batch_size}, length={self._state.length}, "
                f"entries={self._state.main.count}, nbytes={self.nbytes})")


_CACHE_LAYERS = {"csa": "DeepseekV4CSACache", "hca": "DeepseekV4HCACache", "sliding": "DynamicSlidingWindowLayer"}


def _check_cache_layer(cache_layer: object, kind: str) -> None:
    """``ValueError`` unless ``cache_layer`` is the transformers cache layer of a ``kind`` layer (not recording)."""
    wanted = _CACHE_LAYERS[kind]
    if type(cache_layer).__name__ != wanted:
        raise ValueError(f"cache_layer must be a transformers {wanted} for a {kind} layer, "
                         f"got {type(cache_layer).__name__}")
    if getattr(cache_layer, "record_past", False):
        raise ValueError("cache_layer records its past (assisted decoding keeps every key until a crop); "
                         "a compressed layer's cache holds only its window")


def _stream_of(cache_layer: object, name: str) -> _Stream:
    """One compressor's state (``"compressor"`` or ``"indexer"``) as a transformers V4 cache layer keeps it."""
    overlap_kv, overlap_gate = getattr(cache_layer, "overlap_kv", {}), getattr(cache_layer, "overlap_gate", {})
    return _Stream(pending_kv=cache_layer.buffer_kv[name], pending_gate=cache_layer.buffer_gate[name],
                   carry_kv=overlap_kv.get(name), carry_gate=overlap_gate.get(name),
                   entries=cache_layer.compressed_kv[name])


# ---------------------------------------------------------------------- the layer
class CompressedAttention(nn.Module):
    """DeepSeek-V4's attention layer, CSA, HCA or sliding (module docstring for the math and the mapping).

    **Parameters** (transformers' ``DeepseekV4Attention`` names): ``q_a_proj`` ``(q_rank, d_model)``,
    ``q_a_norm``, ``q_b_proj`` ``(H * head_dim, q_rank)``, ``kv_proj`` ``(head_dim, d_model)``,
    ``kv_norm``, ``o_a_proj`` ``(o_groups * o_rank, H * head_dim / o_groups)`` (one block per group),
    ``o_b_proj`` ``(d_model, o_groups * o_rank)``, ``sinks`` ``(H,)``; ``compressor`` (CSA, HCA)
    and ``indexer`` (CSA). No biases, no dropout.

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``.

    Args:
        d_model: input and output width.
        num_heads: query heads ``H`` (one shared key/value head).
        head_dim: features per head ``D``.
        rope_dim: the rotated (last) features of each head, even, ``<= head_dim`` (and ``<= index_dim``).
        q_rank: the low-rank query's width.
        o_groups: groups of the output projection (divides ``H * head_dim``).
        o_rank: each group's projected width.
        window: keys of the sliding window (the token itself included).
        kind: ``"csa"``, ``"hca"`` or ``"sliding"``.
        compress_rate: tokens per compressed entry (CSA, HCA; default V4's 4 and 128; refused for sliding).
        topk: compressed entries each query reads (CSA only; default 512).
        index_heads: the indexer's heads (CSA only; default 64).
        index_dim: the indexer's features per head (CSA only; default 128).
        rope_base: the rotary wavelength base (V4's ``compress_rope_theta`` for CSA/HCA).
        rope_scale: multiplier of the rotary cosines and sines (YaRN's attention factor; V4 uses 1).
        eps: the RMSNorms' epsilon.

    Example:
        >>> attn = CompressedAttention(32, 4, head_dim=16, rope_dim=8, q_rank=12, o_groups=2, o_rank=8,
        ...                            window=8, kind="hca", compress_rate=4)
        >>> attn(torch.randn(2, 11, 32)).shape
        torch.Size([2, 11, 32])
    """

    def __init__(self, d_model: int, num_heads: int, *, head_dim: int, rope_dim: int, q_rank: int,
                 o_groups: int, o_rank: int, window: int, kind: str = "csa", compress_rate: int | None = None,
                 topk: int | None = None, index_heads: int | None = None, index_dim: int | None = None,
                 rope_base: float = 160000.0, rope_scale: float = 1.0, eps: float = 1e-6):
        super().__init__()
        self.d_model, self.num_heads = positive_int("d_model", d_model), positive_int("num_heads", num_heads)
        self.head_dim, self.window = positive_int("head_dim", head_dim), positive_int("window", window)
        self.kind = one_of("kind", kind, KINDS)
        compress_rate, topk, index_heads, index_dim = _kind_options(kind, compress_rate, topk, index_heads, index_dim)
        self.rope_dim = _rope_dim(rope_dim, head_dim, index_dim)
        self.o_groups, self.o_rank = positive_int("o_groups", o_groups), positive_int("o_rank", o_rank)
        if num_heads * head_dim % o_groups:
            raise ValueError(f"o_groups={o_groups} must divide num_heads * head_dim = {num_heads * head_dim}")
        eps = non_negative_number("eps", eps)
        self.q_a_proj = nn.Linear(d_model, positive_int("q_rank", q_rank), bias=False)
        self.q_a_norm = _RMSNorm(q_rank, eps)
        self.q_b_proj = nn.Linear(q_rank, num_heads * head_dim, bias=False)
        self.q_b_norm = _RMSNorm(head_dim, eps, weighted=False)
        self.kv_proj = nn.Linear(d_model, head_dim, bias=False)
        self.kv_norm = _RMSNorm(head_dim, eps)
        self.o_a_proj = nn.Linear(num_heads * head_dim // o_groups, o_groups * o_rank, bias=False)
        self.o_b_proj = nn.Linear(o_groups * o_rank, d_model, bias=False)
        self.sinks = nn.Parameter(torch.zeros(num_heads))
        self.compress_rate = compress_rate
        self.compressor = (None if kind == "sliding" else
                           _Compressor(d_model, head_dim, compress_rate, overlap=kind == "csa", eps=eps))
        self.indexer = (_Indexer(d_model, q_rank, heads=index_heads, dim=index_dim, rate=compress_rate, topk=topk,
                                 eps=eps) if kind == "csa" else None)
        base = positive_number("rope_base", rope_base)
        self.rope_scale = non_negative_number("rope_scale", rope_scale)
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, self.rope_dim, 2).float() / self.rope_dim),
                             persistent=False)

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_transformers(cls, layer: nn.Module, *, share: bool = False) -> "CompressedAttention":
        """This module with the weights of a transformers ``DeepseekV4Attention`` (any of its kinds).

        The rotary frequencies are the layer's own (its compressor's ``compress`` rotary, so YaRN's
        are kept; a sliding layer's ``main`` rotary must be the default one).

        Args:
            layer: a ``DeepseekV4Attention`` (or a subclass of it).
            share: False (default) copies the weights; True makes this module's parameters the
                layer's own ``Parameter`` objects (no copy, nothing allocated for them): training or
                editing one changes the other. The rotary frequencies are always a copy.

        Raises:
            TypeError: ``layer`` is not a ``DeepseekV4Attention``; ``share`` is not a bool.
            ValueError: attention dropout, or a rotary that changes with the sequence length
                (``dynamic``, ``longrope``), which this module does not reproduce.

        Example:
            >>> CompressedAttention.from_transformers(nn.Linear(2, 2))
            Traceback (most recent call last):
            ...
            TypeError: from_transformers takes a transformers DeepseekV4Attention, got Linear
        """
        if not any(base.__name__ == "DeepseekV4Attention" for base in type(layer).__mro__):
            raise TypeError(f"from_transformers takes a transformers DeepseekV4Attention, got {type(layer).__name__}")
        if not isinstance(share, bool):
            raise TypeError(f"share must be a bool, got {type(share).__name__}")
        config, kind = layer.config, _LAYER_KINDS.get(layer.layer_type)
        if kind is None:
            raise ValueError(f"layer_type={layer.layer_type!r} is not one of {tuple(_LAYER_KINDS)}")
        if config.attention_dropout:
            raise ValueError(f"attention_dropout={config.attention_dropout}: CompressedAttention has no dropout")
        inv_freq, scale = _layer_rotary(layer)
        options = {} if kind == "sliding" else {"compress_rate": config.compress_rates[layer.layer_type]}
        if kind == "csa":
            options.update(topk=config.index_topk, index_heads=config.index_n_heads, index_dim=config.index_head_dim)
        weight = layer.kv_proj.weight
        with torch.device("meta" if share else weight.device):
            module = cls(config.hidden_size, config.num_attention_heads, head_dim=config.head_dim,
                         rope_dim=2 * inv_freq.numel(), q_rank=config.q_lora_rank, o_groups=config.o_groups,
                         o_rank=config.o_lora_rank, window=config.sliding_window, kind=kind, rope_scale=scale,
                         eps=config.rms_norm_eps, **options)
        if share:
            _share_parameters(module, layer)
        else:
            module.to(dtype=weight.dtype)
            module.load_state_dict({_our_name(name): value for name, value in layer.state_dict().items()})
        module.inv_freq = inv_freq.detach().clone().float().to(weight.device)
        return module

    # ------------------------------------------------------------------ the path
    def forward(self, x: Tensor, *, cache: CompressedCache | None = None, mask: None = None,
                padding_mask: None = None, document_ids: None = None) -> Tensor:
        """Causal self-attention of ``x`` ``(B, T, d_model)`` over its window, entries and sink.

        Args:
            x: ``(B, T, d_model)``.
            cache: from :meth:`new_cache`: ``x`` continues the tokens it holds, and it is updated
                (only if the whole call succeeds).
            mask, padding_mask, document_ids: taken for a block's one call and refused unless None:
                every row is one sequence of the same length (a padded key or a document boundary
                would change which tokens a compressed entry pools).

        Raises:
            ValueError: ``mask``, ``padding_mask`` or ``document_ids`` given.

        Example:
            >>> attn = CompressedAttention(16, 2, head_dim=8, rope_dim=4, q_rank=8, o_groups=1, o_rank=8,
            ...                            window=3, kind="sliding")
            >>> attn(torch.randn(1, 0, 16)).shape                 # no tokens, no work
            torch.Size([1, 0, 16])
        """
        for name, value in (("mask", mask), ("padding_mask", padding_mask), ("document_ids", document_ids)):
            if value is not None:
                raise ValueError(f"{name} is not supported by CompressedAttention (kind={self.kind!r}): its "
                                 "compressed entries pool every token of a row; give rows of one length without "
                                 f"{name}, got a {type(value).__name__}")
        _check_x(x, self.o_b_proj.weight, self.d_model)
        state = self._check_cache(cache, x)
        B, T, _ = x.shape
        if T == 0:
            return x.new_zeros(B, 0, self.d_model)
        positions = state.length + torch.arange(T, device=x.device)  # (T,)
        cos, sin = self._cos_sin(positions)
        q_latent = self.q_a_norm(self.q_a_proj(x))  # (B, T, q_rank)
        q = self.q_b_norm(self.q_b_proj(q_latent).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2))
        q = rotate_pairs(q, cos, sin)  # (B, H, T, D)
        kv = rotate_pairs(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)  # (B, 1, T, D)
        past = kv[:, :, :0] if state.window is None else state.window.to(kv.dtype)
        keys = torch.cat([past, kv], 2)  # (B, 1, Lw + T, D)
        kept = keys[:, :, max(0, keys.shape[2] - self.window + 1):].clone()  # (B, 1, <= window - 1, D), a copy
        new = replace(state, length=state.length + T, window=kept)
        if self.compressor is not None:
            new = replace(new, main=self.compressor.step(x, state.main, self._cos_sin))
        if self.indexer is not None:
            new = replace(new, index=self.indexer.compressor.step(x, state.index, self._cos_sin))
        entries = new.main.entries
        if entries is not None:
            keys = torch.cat([keys, entries[:, None]], 2)  # (B, 1, Lw + T + N, D)
        out = self._attend(x, q_latent, q, keys, positions, cos, sin, past.shape[2], new)  # (B, H, T, D)
        del q, q_latent, keys  # freed before the output's copies (peak memory)
        out = rotate_pairs(out, cos, -sin).transpose(1, 2)  # (B, T, H, D): the values' rotation undone
        out = self._project_out(out.reshape(B, T, self.o_groups, -1))  # (B, T, d_model)
        if cache is not None:
            cache._state = new
        return out

    def _attend(self, x: Tensor, q_latent: Tensor, q: Tensor, keys: Tensor, positions: Tensor, cos: Tensor,
                sin: Tensor, held: int, new: _State) -> Tensor:
        """Per block of queries: CSA's chosen entries, the key lists, one top-k attention call.

        A block holds at most ``BLOCK_SCORES`` attention scores (``B * H * (w + n)`` per query) and
        index scores (``B * N`` per query and index head, one head at a time): one block, one call,
        for a decoding step or a short prefill."""
        B, H, T, _ = q.shape
        count = new.main.count
        listed = min(self.window, held + T) + (count if self.indexer is None else min(self.indexer.topk, count))
        block = max(1, BLOCK_SCORES // (B * max(H * listed, count)))
        if block >= T:
            block = T
        out = None if block == T else q.new_empty(B, H, T, self.head_dim)  # blocks written in place
        for s in range(0, T, block):
            part = slice(s, s + block)
            chosen = None if self.indexer is None else self.indexer.select(
                x[:, part], q_latent[:, part], positions[part], new.index.entries, cos[part], sin[part])
            indices = self._indices(positions[part], held, s, T, count, chosen)  # (B|1, 1, block, w + n)
            part_out = self._one_call(q[:, :, part], keys, indices)  # (B, H, Tb, D)
            if out is None:
                return part_out
            out[:, :, part] = part_out
        return out  # (B, H, T, D)

    def _one_call(self, q: Tensor, keys: Tensor, indices: Tensor) -> Tensor:
        """One top-k call with the heads as more queries of the one key head: their lists and keys
        are shared, so the kernel never repeats the keys per head; the sink is a per-query logit.

        Shapes:
            q: ``(B, H, Tb, D)``; keys: ``(B, 1, Tk, D)``; indices: ``(B|1, 1, Tb, L)`` -> ``(B, H, Tb, D)``.
        """
        B, H, Tb, D = q.shape
        rows = q.reshape(B, 1, H * Tb, D)  # (B, 1, H*Tb, D), head-major
        lists = indices.expand(-1, H, -1, -1).reshape(indices.shape[0], 1, H * Tb, -1)  # (B|1, 1, H*Tb, L)
        sinks = self.sinks[:, None].expand(H, Tb).reshape(1, 1, H * Tb)  # (1, 1, H*Tb)
        out = attention(rows, keys, keys, indices=lists, sinks=sinks, scale=self.head_dim ** -0.5)
        return out.view(B, H, Tb, D)

    def _indices(self, positions: Tensor, held: int, first: int, T: int, count: int,
                 chosen: Tensor | None) -> Tensor:
        """Key lists over ``[window keys | entries]`` of the queries at ``positions`` (the call's
        ``first``-th on): ``(B|1, 1, Tb, w + n)``, ``-1`` = none."""
        device = positions.device
        width = min(self.window, held + T)
        mine = held + first + torch.arange(positions.shape[0], device=device)  # each query's own key
        window = mine[:, None] - torch.arange(width, device=device)  # (Tb, w)
        window = window.masked_fill(window < 0, -1)[None]  # (1, Tb, w)
        if self.compressor is None or count == 0:
            return window[:, None]  # (1, 1, Tb, w)
        offset = held + T  # the entries' first key
        if chosen is None:  # HCA: every entry, -1 until it is closed
            listed = torch.arange(count, device=device)  # (N,)
            closed = listed < ((positions + 1) // self.compress_rate)[:, None]  # (Tb, N)
            entry_list = torch.where(closed, offset + listed, -1)[None]  # (1, Tb, N)
        else:
            entry_list = torch.where(chosen >= 0, offset + chosen, -1)  # (B, Tb, k)
        window = window.expand(entry_list.shape[0], -1, -1)
        return torch.cat([window, entry_list], -1)[:, None]  # (B|1, 1, Tb, w + n)

    def _project_out(self, grouped: Tensor) -> Tensor:
        """``o_a_proj`` per group then ``o_b_proj``: ``(B, T, G, H*D/G)`` -> ``(B, T, d_model)``."""
        weight = self.o_a_proj.weight.unflatten(0, (self.o_groups, self.o_rank))  # (G, r, H*D/G)
        mixed = torch.einsum("btgi,gri->btgr", grouped, weight).flatten(2)  # (B, T, G*r)
        return self.o_b_proj(mixed)

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Cosines and sines ``(T, rope_dim / 2)`` at ``positions`` ``(T,)``, fp32."""
        angles = positions[:, None].float() * self.inv_freq.float()
        return angles.cos() * self.rope_scale, angles.sin() * self.rope_scale

    # ------------------------------------------------------------------ the cache
    def new_cache(self, batch_size: int, max_len: int | None = None, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, page_size: int | None = None) -> CompressedCache:
        """An empty :class:`CompressedCache` for this layer (the weights' dtype and device by default).

        ``max_len`` (a model's one call for every layer) is checked and sizes nothing: the cache
        grows with the tokens. ``page_size`` is refused: the cache has no pages, so prompts of
        different lengths (a paged model's rows, prefilled alone) cannot share it.

        Example:
            >>> attn = CompressedAttention(16, 2, head_dim=8, rope_dim=4, q_rank=8, o_groups=1, o_rank=8,
            ...                            window=3, kind="csa", compress_rate=2, topk=2, index_heads=1, index_dim=4)
            >>> attn.new_cache(2)
            CompressedCache(kind='csa', batch_size=2, length=0, entries=0, nbytes=0)
        """
        if max_len is not None:
            positive_int("max_len", max_len)
        if page_size is not None:
            raise ValueError(f"page_size={page_size!r}: a CompressedCache has no pages (its rows share one length); "
                             "give prompts as one (B, T) tensor without page_size")
        weight = self.o_b_proj.weight
        return CompressedCache(batch_size, head_dim=self.head_dim, window=self.window, kind=self.kind,
                               index_dim=0 if self.indexer is None else self.indexer.dim,
                               dtype=weight.dtype if dtype is None else dtype,
                               device=weight.device if device is None else device)

    def _check_cache(self, cache: object, x: Tensor) -> _State:
        if cache is None:
            return _State(index=_Stream() if self.kind == "csa" else None)
        instance_of("cache", cache, CompressedCache, "a CompressedCache from CompressedAttention.new_cache")
        sizes = (cache.kind, cache.head_dim, cache.window_size, cache.index_dim)
        ours = (self.kind, self.head_dim, self.window, 0 if self.indexer is None else self.indexer.dim)
        if sizes != ours:
            raise ValueError(f"cache holds (kind, head_dim, window, index_dim) = {sizes}, this layer needs {ours}; "
                             "make it with this layer's new_cache")
        if cache.batch_size != x.shape[0]:
            raise ValueError(f"cache holds batch {cache.batch_size} but x has batch {x.shape[0]}")
        if cache.dtype != x.dtype or cache.device != x.device:
            raise TypeError(f"cache holds {cache.dtype} on {cache.device} but x is {x.dtype} on {x.device}; "
                            f"create it with new_cache(dtype=x.dtype, device=x.device)")
        return cache._state

    def extra_repr(self) -> str:
        extra = "" if self.kind == "sliding" else f", compress_rate={self.compress_rate}"
        if self.indexer is not None:
            extra += f", topk={self.indexer.topk}, index_heads={self.indexer.heads}, index_dim={self.indexer.dim}"
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"rope_dim={self.rope_dim}, window={self.window}, kind={self.kind!r}{extra}")


def model_sizes(d_model: int, num_heads: int, *, kind: str) -> dict:
    """The sizes :class:`~attnlab.models.GPT` gives its compressed layers from its width and heads.

    ``head_dim = d_model / num_heads``, half of each head rotated (``rope_dim``, even, at least 2),
    a low-rank query and output of ``d_model / 2`` (``q_rank``, ``o_rank``), the heads' outputs in
    two groups when ``num_heads`` is even (V4 groups them; one group otherwise) and, for CSA, an
    indexer of ``num_heads`` heads of ``head_dim`` features. The window, ``compress_rate`` and
    ``topk`` are the model's options, not derived.

    Raises:
        ValueError: ``num_heads`` does not divide ``d_model``, or a head of fewer than 2 features
            (the rotation turns pairs).

    Example:
        >>> model_sizes(64, 4, kind="csa")
        {'head_dim': 16, 'rope_dim': 8, 'q_rank': 32, 'o_groups': 2, 'o_rank': 32, 'index_heads': 4, 'index_dim': 16}
        >>> model_sizes(64, 4, kind="hca")["rope_dim"], "index_dim" in model_sizes(64, 4, kind="hca")
        (8, False)
    """
    one_of("kind", kind, ("csa", "hca"))
    positive_int("d_model", d_model)
    if d_model % positive_int("num_heads", num_heads):
        raise ValueError(f"num_heads={num_heads} must divide d_model={d_model}")
    head_dim = d_model // num_heads
    if head_dim < 2:
        raise ValueError(f"a compressed layer needs head_dim = d_model / num_heads >= 2 (its rotary turns pairs), "
                         f"got {d_model} / {num_heads}")
    rank = max(1, d_model // 2)
    sizes = dict(head_dim=head_dim, rope_dim=max(2, head_dim // 4 * 2), q_rank=rank,
                 o_groups=2 if num_heads % 2 == 0 else 1, o_rank=rank)
    return {**sizes, **(dict(index_heads=num_heads, index_dim=head_dim) if kind == "csa" else {})}


def _kind_options(kind: str, compress_rate, topk, index_heads, index_dim) -> tuple:
    """``(compress_rate, topk, index_heads, index_dim)`` checked for ``kind``: V4's defaults where
    None; an option the kind has no use for is refused rather than ignored."""
    given = {"compress_rate": compress_rate, "topk": topk, "index_heads": index_heads, "index_dim": index_dim}
    unused = [name for name, value in given.items()
              if value is not None and (kind == "sliding" or (kind == "hca" and name != "compress_rate"))]
    if unused:
        raise ValueError(f"{unused[0]}={given[unused[0]]!r} has no meaning for kind={kind!r} "
                         f"({'no compressed entries' if kind == 'sliding' else 'no indexer: HCA reads every entry'})")
    if kind == "sliding":
        return None, None, None, None
    rate = positive_int("compress_rate", {"csa": 4, "hca": 128}[kind] if compress_rate is None else compress_rate)
    if kind == "hca":
        return rate, None, None, None
    return (rate, positive_int("topk", 512 if topk is None else topk),
            positive_int("index_heads", 64 if index_heads is None else index_heads),
            positive_int("index_dim", 128 if index_dim is None else index_dim))


def _rope_dim(rope_dim: int, head_dim: int, index_dim: int | None) -> int:
    positive_int("rope_dim", rope_dim)
    limit = head_dim if index_dim is None else min(head_dim, index_dim)
    if rope_dim % 2 or rope_dim > limit:
        raise ValueError(f"rope_dim must be even and at most head_dim{'' if index_dim is None else ' and index_dim'} "
                         f"= {limit}, got {rope_dim}")
    return rope_dim


def _layer_rotary(layer: nn.Module) -> tuple[Tensor, float]:
    """The layer's rotary inverse frequencies and cos/sin scale (its compressor's, or the config's main)."""
    config = layer.config
    label = "main" if layer.compressor is None else "compress"
    params = config.rope_parameters[label]
    rope_type = params.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type={rope_type!r} changes with the sequence length; CompressedAttention keeps "
                         "fixed rotary frequencies")
    if layer.compressor is not None:
        rotary = layer.compressor.rotary_emb
        return getattr(rotary, f"{label}_inv_freq"), float(getattr(rotary, f"{label}_attention_scaling"))
    if rope_type != "default":
        raise ValueError(f"a sliding layer's rope_type={rope_type!r}: only the default rotary is read from its config")
    dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    return 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim), 1.0


def _our_name(name: str) -> str:
    """transformers' parameter name -> this module's (the indexer sits under the compressor there)."""
    if name.startswith("compressor.indexer."):
        rest = name[len("compressor.indexer."):]
        if rest.startswith("scorer."):
            return "indexer." + rest[len("scorer."):]
        return "indexer." + (rest if rest.startswith("q_b_proj") else "compressor." + rest)
    return name


def _share_parameters(module: nn.Module, layer: nn.Module) -> None:
    """Make each of ``module``'s parameters (built on the meta device) the ``Parameter`` of ``layer``
    at the matching transformers name; every one must be found."""
    for name, param in layer.named_parameters():
        owner, _, leaf = _our_name(name).rpartition(".")
        target = module.get_submodule(owner)
        if getattr(target, leaf, None) is None or getattr(target, leaf).shape != param.shape:
            raise ValueError(f"{type(layer).__name__}'s parameter {name} of shape {tuple(param.shape)} has no "
                             "counterpart in CompressedAttention")
        setattr(target, leaf, param)
    missing = [name for name, param in module.named_parameters() if param.is_meta]
    if missing:
        raise ValueError(f"{type(layer).__name__} has no parameter for {missing[0]}")
