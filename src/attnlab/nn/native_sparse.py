"""Native Sparse Attention (NSA): compressed, selected and sliding-window branches with learned gates.

From "Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse Attention"
(Yuan et al., DeepSeek, 2025). Each query ``t`` and head ``h`` attends over three key/value sets,
each branch with its own key and value projections, and mixes the three results with gates:

    ``o_t = g_cmp * Attn(q_t, K_cmp, V_cmp) + g_slc * Attn(q_t, K_slc, V_slc) + g_win * Attn(q_t, K_win, V_win)``,
    ``(g_cmp, g_slc, g_win) = sigmoid(W_g x_t)`` per head.

* **Compressed.** Block ``i`` of ``l = compress_block`` tokens starting at ``i * d``
  (``d = compress_stride``) becomes one key ``phi(k_{id : id+l})`` (and one value): ``phi`` is
  an MLP over the block plus a learned intra-block position encoding, or a mean and a linear map.
  Query ``t`` sees the blocks that ended at or before it: ``i * d + l - 1 <= t``.
* **Selected.** The compressed branch's probabilities ``p_cmp`` score the selection blocks of
  ``l' = select_block`` tokens: the paper's equation (9), read as "each compressed block adds its
  probability once for every stride chunk ``[c d, c d + d)`` of block ``j`` it covers",
  ``p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + m - n]`` (the paper prints ``- m``;
  ``+ m`` walks the chunks inside block ``j``; both agree when ``l = l' = d``), summed over the query
  heads of a GQA group so the group shares one choice. The ``n = select_count`` best blocks that
  started at or before ``t`` are kept; block 0 and the ``select_local`` newest blocks always are
  (ties: the earlier block). Their tokens are attended causally at full resolution through
  :func:`attnlab.attention` with ``indices`` (O(T * n * l'), no ``(T, T)`` tensor). The choice is
  not differentiable: gradients reach the selected keys through the attention and the gates.
* **Window.** The causal sliding window of the last ``w = window`` tokens.

Positions: none by default (add them to ``x``), or ``positions="rope"``: the queries and every
branch's keys rotated at their positions, the compressed branch's before compression.

**Decoding.** :meth:`NativeSparseAttention.new_cache` gives a :class:`~attnlab.nn.BranchCache`;
each call then computes its new queries only: their compressed probabilities over the blocks
cached so far (a block is compressed once, when its last token arrives), their selection and the
two other branches over the cached keys, O(T / d + n * l' + w) per decoded token.

Example:
    >>> import torch
    >>> nsa = NativeSparseAttention(32, 4, num_kv_heads=2, compress_block=4, compress_stride=2,
    ...                             select_block=4, select_count=3, window=8)
    >>> x = torch.randn(2, 20, 32)
    >>> cache = nsa.new_cache(2, 20)
    >>> with torch.no_grad():
    ...     steps = [nsa(x[:, :12], cache=cache)] + [nsa(x[:, t:t + 1], cache=cache) for t in range(12, 20)]
    >>> torch.allclose(torch.cat(steps, dim=1), nsa(x), atol=1e-5), cache.length
    (True, 20)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import divisible, instance_of, non_negative_int, one_of, positive_int
from attnlab.functional import attention
from attnlab.nn.cache import BranchCache, KVCache, WindowedKVCache, _cache_options, _restore_on_error
from attnlab.nn.latent import _check_x
from attnlab.nn.multihead import attend_causal
from attnlab.nn.positional import RotaryEmbedding

__all__ = ["NativeSparseAttention", "NSABranches", "paper_sizes"]


def paper_sizes(select_block: int, *, name: str = "select_block") -> dict[str, int]:
    """NSA's sizes in the paper's proportions, scaled by the selection block ``l'`` (a multiple of
    4): compressed blocks of ``l'/2`` tokens every ``l'/4``, 16 selected blocks (block 0 and the 2
    newest among them) and a window of ``8 l'``; ``l' = 64`` gives the paper's 32, 16, 64, 16, 512.
    ``name`` is the argument a refusal names (``nsa_block``, ``--nsa-block``).

    Example:
        >>> paper_sizes(64)
        {'compress_block': 32, 'compress_stride': 16, 'select_block': 64, 'select_count': 16, 'select_local': 2, 'window': 512}
    """
    if positive_int(name, select_block) % 4:
        raise ValueError(f"{name} must be a multiple of 4 (compressed blocks of half of it every quarter), "
                         f"got {select_block}")
    return dict(compress_block=select_block // 2, compress_stride=select_block // 4, select_block=select_block,
                select_count=16, select_local=2, window=8 * select_block)


class NSABranches(NamedTuple):
    """The parts of one NSA forward, per query head, before the output projection.

    ``compressed``, ``selected``, ``window``: branch outputs ``(B, Hq, T, D)``; ``gates``
    ``(B, Hq, T, 3)`` in that order; ``blocks`` ``(B, Hkv, T, n)`` the selection blocks chosen per
    query (a block that started after the query may fill a slot when fewer exist; it is masked).

    Example:
        >>> nsa = NativeSparseAttention(8, 2, num_kv_heads=1, compress_block=2, compress_stride=2,
        ...                             select_block=2, select_count=2, select_local=1, window=2)
        >>> parts = nsa.branches(torch.randn(1, 6, 8))
        >>> parts.window.shape, parts.blocks.shape
        (torch.Size([1, 2, 6, 4]), torch.Size([1, 1, 6, 2]))
    """

    compressed: Tensor
    selected: Tensor
    window: Tensor
    gates: Tensor
    blocks: Tensor


class _Compressor(nn.Module):
    """``phi``: blocks ``(..., N, l, D)`` -> one vector each ``(..., N, D)``.

    ``"mlp"``: ``W2 gelu(W1 flatten(block + pos) + b1) + b2`` (the paper's MLP with an
    intra-block position encoding ``pos (l, D)``); ``"mean"``: ``W mean(block) + b``.
    """

    def __init__(self, block: int, dim: int, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "mlp":
            self.pos = nn.Parameter(torch.randn(block, dim) * 0.02)
            self.mlp = nn.Sequential(nn.Linear(block * dim, dim), nn.GELU(), nn.Linear(dim, dim))
        else:
            self.proj = nn.Linear(dim, dim)

    def forward(self, blocks: Tensor) -> Tensor:
        if self.kind == "mean":
            return self.proj(blocks.mean(dim=-2))
        return self.mlp((blocks + self.pos).flatten(-2))  # (..., N, l * D) -> (..., N, D)


class NativeSparseAttention(nn.Module):
    """Causal NSA self-attention with grouped-query heads (see the module docstring).

    **Parameters.** ``q_proj`` ``(Hq * D, d_model)``; ``kv_proj`` ``(3 * 2 * Hkv * D, d_model)``,
    rows in the order (branch: compressed, selected, window; keys then values; head; feature);
    ``compress_k``, ``compress_v`` (``phi``); ``gate_proj`` ``(Hq * 3, d_model)``, rows (head,
    branch); ``out_proj`` ``(d_model, Hq * D)``.

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``.

    Args:
        d_model: input and output width.
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (divides ``Hq``; default ``Hq``).
        head_dim: ``D`` (default ``d_model // num_heads``).
        compress_block: ``l``, tokens per compressed block (a multiple of ``compress_stride``).
        compress_stride: ``d``, tokens between compressed blocks.
        select_block: ``l'``, tokens per selection block (a multiple of ``compress_stride``).
        select_count: ``n``, selection blocks per query, forced ones included.
        select_local: newest blocks always selected (with block 0: at most ``select_count``).
        window: ``w``, the sliding window's tokens.
        compress: ``"mlp"`` or ``"mean"`` (mean pooling and a linear map).
        bias: biases in ``q_proj``, ``kv_proj`` and ``out_proj``.
        positions: None (no positions) or ``"rope"``: rotary positions on the queries and on every
            branch's keys (before compression), counted from the cache's length.
        rope_base: the rotary wavelength base.

    Example:
        >>> nsa = NativeSparseAttention(16, 2, compress_block=4, compress_stride=4, select_block=4,
        ...                             select_count=2, select_local=1, window=4, compress="mean")
        >>> parts = nsa.branches(torch.randn(1, 9, 16))
        >>> parts.selected.shape, parts.blocks[0, 0, 8].tolist()   # query 8: block 0 and its own
        (torch.Size([1, 2, 9, 8]), [0, 2])
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, compress_block: int = 32, compress_stride: int = 16,
                 select_block: int = 64, select_count: int = 16, select_local: int = 2,
                 window: int = 512, compress: str = "mlp", bias: bool = False, positions: str | None = None,
                 rope_base: float = 10000.0):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, size in (("d_model", d_model), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                           ("compress_block", compress_block), ("compress_stride", compress_stride),
                           ("select_block", select_block), ("select_count", select_count), ("window", window)):
            positive_int(name, size)
        head_dim = positive_int("head_dim", d_model // num_heads if head_dim is None else head_dim)
        divisible("num_heads", num_heads, "num_kv_heads", num_kv_heads)
        divisible("compress_block", compress_block, "compress_stride", compress_stride)
        divisible("select_block", select_block, "compress_stride", compress_stride)
        if non_negative_int("select_local", select_local) + 1 > select_count:
            raise ValueError(f"select_count ({select_count}) must hold block 0 and the select_local "
                             f"({select_local}) newest blocks")
        one_of("compress", compress, ("mlp", "mean"))
        if positions is not None:
            one_of("positions", positions, ("rope",))
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.compress_block, self.compress_stride = compress_block, compress_stride
        self.select_block, self.select_count, self.select_local = select_block, select_count, select_local
        self.window, self.positions = window, positions
        self.rope = None if positions is None else RotaryEmbedding(head_dim, base=rope_base)
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.kv_proj = nn.Linear(d_model, 3 * 2 * num_kv_heads * head_dim, bias=bias)
        self.compress_k = _Compressor(compress_block, head_dim, compress)
        self.compress_v = _Compressor(compress_block, head_dim, compress)
        self.gate_proj = nn.Linear(d_model, num_heads * 3)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)

    def forward(self, x: Tensor, *, mask: object = None, padding_mask: object = None,
                cache: BranchCache | None = None, document_ids: object = None) -> Tensor:
        """The gated sum of the three branches, projected out: ``(B, T, d_model)``.

        Args:
            x: ``(B, T, d_model)``, the tokens after the cache's (if any).
            mask, padding_mask, document_ids: must be None (a ``TransformerBlock`` passes them):
                compression and selection are defined on one unpadded causal sequence.
            cache: a cache from :meth:`new_cache`; the new tokens' keys are appended.

        Example:
            >>> NativeSparseAttention(8, 2, compress_block=2, compress_stride=2, select_block=2,
            ...                       select_count=2, select_local=1, window=2)(torch.randn(1, 5, 8)).shape
            torch.Size([1, 5, 8])
        """
        for name, value in (("mask", mask), ("padding_mask", padding_mask), ("document_ids", document_ids)):
            if value is not None:
                raise ValueError(f"{name} must be None for NativeSparseAttention (compression and selection are "
                                 f"defined on one unpadded causal sequence), got {type(value).__name__}")
        parts = self.branches(x, cache=cache)
        stacked = torch.stack(parts[:3], dim=-1)  # (B, Hq, T, D, 3)
        out = (stacked * parts.gates.unsqueeze(-2)).sum(-1)  # (B, Hq, T, D)
        return self.out_proj(out.transpose(1, 2).flatten(2))  # (B, T, Hq * D)

    def branches(self, x: Tensor, *, cache: BranchCache | None = None) -> NSABranches:
        """Each branch's output, the gates and the chosen blocks of the tokens ``x`` (see
        :class:`NSABranches`), after the cache's tokens when one is given.

        Raises:
            TypeError, ValueError: ``x`` not a floating ``(B, T, d_model)`` tensor like the weights;
                ``cache`` not this module's, of another dtype, or full (it is left as it was).

        Example:
            >>> nsa = NativeSparseAttention(8, 2, compress_block=2, compress_stride=1, select_block=2,
            ...                             select_count=2, select_local=1, window=2)
            >>> nsa.branches(torch.randn(1, 6, 8)).gates.shape
            torch.Size([1, 2, 6, 3])
        """
        _check_x(x, self.q_proj.weight, self.d_model)
        if cache is not None:
            self._check_cache(cache, x)
        with _restore_on_error([cache], x.shape[1]):
            return self._branches(x, cache)

    def _branches(self, x: Tensor, cache: BranchCache | None) -> NSABranches:
        B, T, _ = x.shape
        start = 0 if cache is None else cache.length  # the first new token's position
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        kv = self.kv_proj(x).view(B, T, 3, 2, self.num_kv_heads, self.head_dim)
        (kc, vc), (ks, vs), (kw, vw) = kv.permute(2, 3, 0, 4, 1, 5)  # each (B, Hkv, T, D)
        if self.rope is not None:
            q, kc, ks, kw = (self.rope.at(t, start) for t in (q, kc, ks, kw))
        o_cmp, p_cmp = self._compressed(q, kc, vc, start, cache)
        blocks = self.select(self.block_scores(p_cmp.detach(), start + T), start=start)
        o_slc = self._selected(q, *_stored(cache, "selected", ks, vs), blocks)
        o_win = attend_causal(q, *_stored(cache, "window", kw, vw), window=self.window)  # (B, Hq, T, D)
        gates = torch.sigmoid(self.gate_proj(x)).view(B, T, self.num_heads, 3).transpose(1, 2)  # (B, Hq, T, 3)
        return NSABranches(o_cmp, o_slc, o_win, gates, blocks)

    def compress(self, k: Tensor, phi: _Compressor) -> Tensor:
        """Keys or values ``(B, Hkv, T, D)`` -> one per compressed block ``(B, Hkv, Nc, D)``,
        ``Nc = (T - l) // d + 1`` (0 when ``T < l``).

        Example:
            >>> nsa = NativeSparseAttention(8, 2, compress_block=4, compress_stride=2, select_block=4,
            ...                             select_count=2, select_local=1, window=2)
            >>> nsa.compress(torch.randn(1, 2, 9, 4), nsa.compress_k).shape
            torch.Size([1, 2, 3, 4])
        """
        l, d = self.compress_block, self.compress_stride
        if k.shape[2] < l:
            return phi(k.new_zeros(*k.shape[:2], 0, l, k.shape[-1]))  # (B, Hkv, 0, D)
        return phi(k.unfold(2, l, d).transpose(-1, -2))  # (B, Hkv, Nc, l, D) -> (B, Hkv, Nc, D)

    def _compressed(self, q: Tensor, k: Tensor, v: Tensor, start: int,
                    cache: BranchCache | None) -> tuple[Tensor, Tensor]:
        """Attention of the queries at ``start ..`` over the compressed blocks that ended at or
        before each, and its probabilities ``(B, Hq, T, Nc)``; with a cache, only the blocks the
        new keys complete are compressed, and all are read from the cache."""
        if cache is None:
            kc, vc = self.compress(k, self.compress_k), self.compress(v, self.compress_v)
        else:
            kc, vc = self._compress_new(k, v, start, cache)  # (B, Hkv, Nc, D) each
        ends = torch.arange(kc.shape[2], device=q.device) * self.compress_stride + self.compress_block - 1
        visible = ends <= torch.arange(start, start + q.shape[2], device=q.device)[:, None]  # (T, Nc)
        return attention(q, kc, vc, mask=visible, return_weights=True)

    def _compress_new(self, k: Tensor, v: Tensor, start: int, cache: BranchCache) -> tuple[Tensor, Tensor]:
        """Append the raw keys/values ``(B, Hkv, T, D)`` at ``start ..``, compress the blocks they
        complete, and return every compressed key and value so far."""
        l, d = self.compress_block, self.compress_stride
        raw_k, raw_v = cache["raw"].update(k, v)  # positions first .. start + T - 1 (one step: ring order)
        if k.shape[2] == 1:
            raw_k, raw_v = _chronological(raw_k, cache["raw"]), _chronological(raw_v, cache["raw"])
        first = start - min(start, l - 1)
        done = (start - l) // d + 1 if start >= l else 0  # blocks ended before the new tokens
        begin = done * d - first
        new_k = self.compress(raw_k[:, :, begin:], self.compress_k)  # (B, Hkv, new blocks, D)
        new_v = self.compress(raw_v[:, :, begin:], self.compress_v)
        return cache["compressed"].update(new_k, new_v)  # (B, Hkv, Nc, D) each

    def block_scores(self, p_cmp: Tensor, length: int) -> Tensor:
        """Selection block importance ``(B, Hkv, T, Ns)``, ``Ns = ceil(T / l')``, from the
        compressed probabilities ``(B, Hq, T, Nc)`` (equation (9), summed over a GQA group).

        Example:
            >>> nsa = NativeSparseAttention(8, 2, num_kv_heads=1, compress_block=2, compress_stride=1,
            ...                             select_block=2, select_count=2, select_local=1, window=2)
            >>> p = torch.tensor([1.0, 10.0, 100.0]).view(1, 1, 1, 3).expand(1, 2, 1, 3)
            >>> nsa.block_scores(p, 4).tolist()   # chunks 0..3 covered by blocks (0), (0, 1), (1, 2), (2)
            [[[[24.0, 420.0]]]]
        """
        B, _, T, nc = p_cmp.shape
        per_chunk = self.compress_block // self.compress_stride  # compressed blocks covering one chunk
        chunks_per_block = self.select_block // self.compress_stride
        num_blocks = -(-length // self.select_block)
        chunks = num_blocks * chunks_per_block
        grouped = p_cmp.unflatten(1, (self.num_kv_heads, -1)).sum(2)  # (B, Hkv, T, Nc)
        if num_blocks == 0:  # an empty sequence
            return grouped.new_zeros(*grouped.shape[:-1], 0)  # (B, Hkv, 0, 0)
        padded = F.pad(grouped, (per_chunk - 1, chunks - nc))  # chunk c: compressed blocks c-l/d+1 .. c
        covered = padded.unfold(-1, per_chunk, 1).sum(-1)  # (B, Hkv, T, chunks)
        return covered.unflatten(-1, (num_blocks, chunks_per_block)).sum(-1)  # (B, Hkv, T, Ns)

    def select(self, scores: Tensor, *, start: int = 0) -> Tensor:
        """The ``select_count`` best blocks per query ``(B, Hkv, T, n)`` from ``scores``
        ``(B, Hkv, T, Ns)`` of the queries at positions ``start ..``: block 0 and the local blocks
        first, never one starting after the query while another remains (ties: the earlier block).

        Example:
            >>> nsa = NativeSparseAttention(8, 2, compress_block=2, compress_stride=2, select_block=2,
            ...                             select_count=3, select_local=1, window=2)
            >>> scores = torch.tensor([0.0, 1.0, 5.0, 9.0]).view(1, 1, 1, 4).expand(1, 1, 8, 4)
            >>> nsa.select(scores)[0, 0, 5].tolist()   # block 0, its own (2), then the best of the rest
            [0, 2, 1]
        """
        T, num_blocks = scores.shape[-2:]
        query = torch.arange(start, start + T, device=scores.device)[:, None]
        block = torch.arange(num_blocks, device=scores.device)
        current = query // self.select_block  # (T, 1)
        forced = (block == 0) | ((block <= current) & (block > current - self.select_local))  # (T, Ns)
        ranked = scores.masked_fill(forced, math.inf).masked_fill(block > current, -math.inf)
        order = ranked.sort(dim=-1, descending=True, stable=True).indices
        return order[..., :min(self.select_count, num_blocks)]  # (B, Hkv, T, n)

    def _selected(self, q: Tensor, k: Tensor, v: Tensor, blocks: Tensor) -> Tensor:
        """Causal attention of the newest queries over the chosen blocks' tokens of ``k`` ``(B, Hkv,
        N, D)``, as top-k ``indices`` (B, Hkv, T, n * l'); a token past the last key is -1 (none)."""
        N, size = k.shape[2], self.select_block
        offsets = torch.arange(size, device=k.device)
        indices = (blocks.unsqueeze(-1) * size + offsets).flatten(-2)  # (B, Hkv, T, n * l')
        indices = indices.masked_fill(indices >= N, -1)  # the last block's missing tokens
        if indices.shape[-1] > N:  # more slots than keys: at most N are listed, the -1s sort last
            indices = indices.sort(dim=-1, descending=True).values[..., :N]  # (B, Hkv, T, N)
        return attention(q, k, v, indices=indices, causal=True, align="bottom_right")

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, windowed: bool | None = None,
                  page_size: int | None = None) -> BranchCache:
        """An empty cache for ``max_len`` positions: a :class:`~attnlab.nn.BranchCache` of
        ``selected`` (KVCache, ``max_len``; it counts the positions), ``window`` (a ring of
        ``window`` slots; a KVCache of ``max_len`` when ``window >= max_len`` or ``windowed=False``),
        ``raw`` (the compressed branch's keys of the newest ``compress_block`` tokens) and
        ``compressed`` (KVCache of the :meth:`compressed_count` blocks ``max_len`` tokens make, at
        least 1). Not paged.

        Raises:
            ValueError: ``page_size`` is not None (paged NSA is not built); bad sizes.

        Example:
            >>> nsa = NativeSparseAttention(16, 2, compress_block=4, compress_stride=2, select_block=4,
            ...                             select_count=2, select_local=1, window=8)
            >>> nsa.new_cache(1, 64).names
            ('selected', 'window', 'raw', 'compressed')
        """
        if page_size is not None:
            raise ValueError(f"page_size must be None for NativeSparseAttention (a paged NSA cache is not "
                             f"built), got {page_size}")
        if windowed is not None:
            instance_of("windowed", windowed, bool, "a bool or None")
        positive_int("max_len", max_len)
        sizes = _cache_options(self.q_proj.weight, dtype, device)
        B, H, D = batch_size, self.num_kv_heads, self.head_dim
        ring = windowed or (windowed is None and self.window < max_len)
        return BranchCache(
            selected=KVCache(B, H, max_len, D, **sizes),
            window=WindowedKVCache(B, H, self.window, D, **sizes) if ring else KVCache(B, H, max_len, D, **sizes),
            raw=WindowedKVCache(B, H, self.compress_block, D, **sizes),
            compressed=KVCache(B, H, max(1, self.compressed_count(max_len)), D, **sizes))

    def compressed_count(self, length: int) -> int:
        """Compressed blocks that ``length`` tokens complete: ``(length - l) // d + 1`` (0 below ``l``).

        Example:
            >>> NativeSparseAttention(8, 2, compress_block=4, compress_stride=2, select_block=4,
            ...                       select_count=2, select_local=1, window=2).compressed_count(9)
            3
        """
        return max(0, (length - self.compress_block) // self.compress_stride + 1)

    def _check_cache(self, cache: object, x: Tensor) -> None:
        """``cache`` is one :meth:`new_cache` made for this module's sizes, ``x``'s batch and
        dtype, with room for ``x``'s tokens (nothing is written)."""
        instance_of("cache", cache, BranchCache, "a BranchCache (from NativeSparseAttention.new_cache)")
        if cache.names != ("selected", "window", "raw", "compressed") or not self._fits(cache):
            raise ValueError(f"cache must come from this module's new_cache (parts selected, window, raw, "
                             f"compressed with {self.num_kv_heads} kv heads of {self.head_dim} features, "
                             f"window {self.window}, compress_block {self.compress_block}); got {cache!r}")
        if cache.batch_size != x.shape[0]:
            raise ValueError(f"cache holds batch {cache.batch_size}; x has batch {x.shape[0]}")
        if cache.dtype != x.dtype or cache.device != x.device:
            raise TypeError(f"cache holds {cache.dtype} on {cache.device} but x is {x.dtype} on {x.device}; "
                            "create it with new_cache(dtype=..., device=...) like the module")
        cache.check_room(x.shape[1])

    def _fits(self, cache: BranchCache) -> bool:
        """Every part has this module's heads and features, and enough slots."""
        max_len = cache["selected"].max_len
        window, raw, compressed = cache["window"], cache["raw"], cache["compressed"]
        return (all((p.num_kv_heads, p.head_dim, p.value_dim) == (self.num_kv_heads, self.head_dim, self.head_dim)
                    for p in (cache[name] for name in cache.names))
                and isinstance(cache["selected"], KVCache) and isinstance(compressed, KVCache)
                and type(raw) is WindowedKVCache and raw.window == self.compress_block
                and compressed.max_len >= self.compressed_count(max_len)
                and (window.window >= self.window if isinstance(window, WindowedKVCache)
                     else isinstance(window, KVCache) and window.max_len >= max_len))


def _stored(cache: BranchCache | None, name: str, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The keys/values the new queries read: ``k``, ``v`` themselves, or the cache part ``name``
    after appending them."""
    return (k, v) if cache is None else cache[name].update(k, v)


def _chronological(ring: Tensor, part: WindowedKVCache) -> Tensor:
    """A ring's view after a one-token update ``(B, Hkv, slots, D)`` in position order
    (position ``p`` lives in slot ``p % window``)."""
    if part.length <= part.window:
        return ring
    return torch.roll(ring, shifts=-(part.length % part.window), dims=2)  # (B, Hkv, window, D)
