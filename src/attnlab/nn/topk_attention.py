"""DSA attention (DeepSeek-V3.2): each query attends only to the ``topk`` keys a lightning indexer picks.

A :class:`~attnlab.nn.LightningIndexer` scores every (query, earlier key) pair with a few small
heads; each query keeps its ``topk`` best allowed keys, and the main heads (q/k/v/o projections,
grouped-query, rotary positions: :class:`~attnlab.nn.gated._ProjectedAttention`'s) attend over
those only, through ``attnlab.attention(q, k, v, indices=..., causal=True)`` (O(T*k)). With
``T <= topk`` every earlier key is kept: plain causal attention. The indices are integers, so the
language-model loss never reaches the indexer; :meth:`TopkAttention.indexer_loss` is its own
training signal (DeepSeek-V3.2's KL to the main attention). With ``index_loss_weight`` the module
adds it itself: in training, the forward computes the loss and its backward adds ``weight`` times
the loss's gradient, as if the loss had been added to whatever loss the output reaches (the way
DeepSeek's own model code adds its MoE balance loss); the output's value is unchanged.

A decoder's cache is a :class:`~attnlab.nn.BranchCache` of two parts: ``keys`` (the heads'
keys and values) and ``index`` (one index key per token, :meth:`LightningIndexer.keys`).

Example:
    >>> attn = TopkAttention(32, 4, num_kv_heads=2, topk=4, index_heads=2, index_dim=8)
    >>> cache = attn.new_cache(batch_size=1, max_len=8)
    >>> with torch.no_grad():
    ...     _ = attn(torch.randn(1, 6, 32), cache=cache)
    ...     step = attn(torch.randn(1, 1, 32), cache=cache)    # attends to 4 of the 7 keys
    >>> step.shape, cache.length, cache.names
    (torch.Size([1, 1, 32]), 7, ('keys', 'index'))
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab._checks import instance_of, non_negative_int, non_negative_number, positive_int
from attnlab.backends.topk import indices_mask
from attnlab.functional import attention, attention_weights
from attnlab.nn.cache import BranchCache, Cache, KVCache, _cache_options
from attnlab.nn.gated import _ProjectedAttention
from attnlab.nn.indexer import LightningIndexer, select_topk
from attnlab.nn.latent import _check_x
from attnlab.nn.multihead import _check_padding_type

__all__ = ["TopkAttention"]


class TopkAttention(_ProjectedAttention):
    """Causal self-attention over each query's ``topk`` keys chosen by a lightning indexer (DSA).

    **Parameters**: ``q_proj`` ``(H * head_dim, d_model)``, ``k_proj``, ``v_proj``
    ``(Hkv * head_dim, d_model)``, ``o_proj`` ``(d_model, H * head_dim)``; ``indexer``, a
    :class:`~attnlab.nn.LightningIndexer` (``index_heads`` heads of ``index_dim`` features).

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``. The cache holds ``keys``
        ``(B, Hkv, max_len, head_dim)`` keys and values and ``index`` ``(B, 1, max_len, index_dim)``.

    Args:
        d_model: input and output width.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads (divides ``num_heads``; default ``num_heads``).
        head_dim: features per head (default ``d_model // num_heads``).
        topk: keys each query attends to (the indexer's ``index_topk``).
        index_heads: the indexer's heads.
        index_dim: the indexer's features per head (default ``head_dim``).
        index_rope_dim: the indexer's rotated features with ``positions="rope"`` (default half of
            ``index_dim``, even; DeepSeek-V3.2 rotates 64 of 128); 0 without positions.
        positions: ``"rope"`` or None.
        rotary_dim: the heads' rotated features (default all of ``head_dim``).
        rope_base: the rotary wavelength base (heads and indexer).
        bias: biases in the q/k/v/o projections.
        index_loss_weight: in training (grad enabled, no cache), the dense :meth:`indexer_loss` times
            this is added to the loss through the output's backward (module docstring); 0: never.
        backend: ``"auto"`` (the top-k kernel) or ``"reference"`` (the dense fp64 oracle).

    Example:
        >>> attn = TopkAttention(16, 2, topk=8, index_heads=2, index_dim=4)
        >>> x = torch.randn(2, 5, 16)                     # T <= topk: plain causal attention
        >>> attn(x).shape, attn.indexer.topk
        (torch.Size([2, 5, 16]), 8)
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, topk: int = 64, index_heads: int = 4, index_dim: int | None = None,
                 index_rope_dim: int | None = None, positions: str | None = "rope", rotary_dim: int | None = None,
                 rope_base: float = 10000.0, bias: bool = False, backend: str = "auto",
                 index_loss_weight: float = 0.0):
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend must be 'auto' (the top-k kernel) or 'reference' for TopkAttention, "
                             f"got {backend!r}")
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, q_parts=1, bias=bias,
                         positions=positions, rotary_dim=rotary_dim, rope_base=rope_base, causal=True,
                         window=None, dropout_p=0.0, backend=backend)
        index_dim = self.head_dim if index_dim is None else positive_int("index_dim", index_dim)
        self.indexer = LightningIndexer(d_model, heads=positive_int("index_heads", index_heads), head_dim=index_dim,
                                        topk=positive_int("topk", topk), rope_base=rope_base,
                                        rope_dim=_index_rope_dim(index_rope_dim, index_dim, positions))
        self.index_loss_weight = non_negative_number("index_loss_weight", index_loss_weight)

    # ------------------------------------------------------------------ the path
    def forward(self, x: Tensor, *, mask: Tensor | None = None, padding_mask: Tensor | None = None,
                cache: Cache | None = None, document_ids: Tensor | None = None) -> Tensor:
        """Self-attention over ``x`` ``(B, T, d_model)`` (and a cache's earlier tokens) -> ``(B, T, d_model)``.

        Args:
            x: ``(B, T, d_model)``.
            mask: bool (True = may attend) or float tensor broadcastable to ``(B, 1, T, T)``, one for
                every head (the indexer picks keys for all of them); the indexer picks among the
                keys it allows. No mask mod, and none with a cache.
            padding_mask: ``(B, T)`` bool, True at real key tokens (no cache).
            cache: from :meth:`new_cache`; the new keys, values and index keys are appended.
            document_ids: ``(T,)`` or ``(B, T)`` ids of packed documents (no cache).

        Example:
            >>> attn = TopkAttention(16, 2, topk=2, index_heads=2, index_dim=4)
            >>> padded = torch.tensor([[True, True, True, False]])          # row 0's last token is padding
            >>> attn(torch.randn(1, 4, 16), padding_mask=padded).shape
            torch.Size([1, 4, 16])
        """
        if mask is not None and not isinstance(mask, Tensor):
            raise ValueError(f"mask must be a bool or float tensor for TopkAttention (its indexer picks keys for "
                             f"every head at once and cannot evaluate a mask mod); got {type(mask).__name__}")
        if isinstance(mask, Tensor) and mask.ndim == 4 and mask.shape[1] != 1:
            raise ValueError(f"mask must be one mask for every head, (B|1, 1, T, Tk): the indexer picks one key set "
                             f"per query for all heads; got shape {tuple(mask.shape)}")
        if cache is not None:
            self._check_branches(cache, x)
        out = self._run(x, mask, padding_mask, cache, document_ids, None)
        if self.training and self.index_loss_weight and cache is None and torch.is_grad_enabled():
            if mask is not None or document_ids is not None:
                raise ValueError("index_loss_weight: the indexer's loss is built for causal (padded) sequences; "
                                 "train without mask/document_ids or with index_loss_weight=0")
            loss = self.indexer_loss(x, padding_mask=padding_mask)
            out = _WithLoss.apply(out, loss, self.index_loss_weight)
        return out

    def _attend_all(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, *, mask, cache: Cache | None) -> Tensor:
        """The indexer's top-k keys of each query, then one top-k attention call ``(B, H, T, D)``."""
        B, T, _ = x.shape
        past = None
        if cache is not None:
            offset = cache.length
            past = cache["index"].filled()[0][:, 0] if offset else None  # (B, Tp, Di)
            new_index = self.indexer.keys(x, offset=offset)  # (B, T, Di)
            cache["index"].update(new_index[:, None], new_index.new_zeros(B, 1, T, 0))
            k, v = cache["keys"].update(k, v)  # (B, Hkv, Tp + T, D)
        allowed = _index_mask(mask, batch=B, tq=T, tk=k.shape[2], device=x.device)  # (B|1, T|1, Tk) or None
        indices = self.indexer(x, past_keys=past, mask=allowed)  # (B, 1, T, k)
        return attention(q, k, v, mask=mask, causal=True, align="bottom_right", indices=indices,
                         backend=self.backend)

    # ------------------------------------------------------------------ the indexer's loss
    def indexer_loss(self, x: Tensor, *, sparse: bool = False, padding_mask: Tensor | None = None) -> Tensor:
        """DeepSeek-V3.2's indexer loss: KL(main attention || softmax of the index scores), per query.

        The target ``p[t, s]`` is the heads' causal attention weights summed over heads and L1-normalised
        (detached); the indexer's distribution is ``softmax_s I[t, s]`` over the same keys. Dense
        (``sparse=False``, the warm-up): over every earlier key. Sparse: over the selected keys ``S_t``
        only, each head's softmax taken over ``S_t`` as the top-k attention computes it (Megatron-LM's
        form). The result is the mean over (real) queries of ``sum_s p log(p / q)`` (the paper writes the
        sum over queries; the mean keeps its scale independent of ``T``). Gradients reach the indexer's
        parameters only (its input is detached, as in DeepSeek-V3.2); add it to the training loss.

        Args:
            x: ``(B, T, d_model)``.
            sparse: the sparse stage's loss (over the selected keys) instead of the dense warm-up's.
            padding_mask: ``(B, T)`` bool, True at real tokens: padded keys are never attended and
                padded queries leave the mean.

        Returns:
            a scalar tensor.

        Example:
            >>> attn = TopkAttention(16, 2, topk=2, index_heads=2, index_dim=4)
            >>> loss = attn.indexer_loss(torch.randn(1, 5, 16))
            >>> loss.backward(); attn.q_proj.weight.grad is None, attn.indexer.wk.weight.grad is not None
            (True, True)
        """
        _check_x(x, self.o_proj.weight, self.d_model)
        instance_of("sparse", sparse, bool, "a bool")
        B, T, _ = x.shape
        real = _check_padding(padding_mask, B, T)  # (B, T) or None
        allowed = torch.ones(1, T, T, dtype=torch.bool, device=x.device).tril()  # (1, T, T)
        if real is not None:
            allowed = allowed & real[:, None, :]  # (B, T, T)
        scores = self.indexer.scores(x.detach())  # (B, T, T), grads reach the indexer only
        if sparse:
            chosen = select_topk(scores, self.indexer.topk, mask=None if real is None else real[:, None, :])
            allowed = allowed & indices_mask(chosen, T)[:, 0]  # (B, T, T)
        target = self._target(x, allowed)  # (B, T, T)
        log_q = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        kl = (torch.xlogy(target, target) - target * log_q.masked_fill(~allowed, 0.0)).sum(-1)  # (B, T)
        weight = torch.ones_like(kl) if real is None else real.to(kl.dtype)  # (B, T)
        return (kl * weight).sum() / weight.sum().clamp_min(1.0)

    @torch.no_grad()
    def _target(self, x: Tensor, allowed: Tensor) -> Tensor:
        """The heads' weights over ``allowed`` ``(B|1, T, T)``, summed over heads, L1-normalised ``(B, T, T)``."""
        q, k, _, _ = self._project(x, None, None)  # (B, H, T, D), (B, Hkv, T, D)
        weights = attention_weights(q, k, mask=allowed[:, None]).sum(1)  # (B, T, T)
        scores_dtype = torch.promote_types(x.dtype, torch.float32)
        return (weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)).to(scores_dtype)

    # ------------------------------------------------------------------ the cache
    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, windowed: bool | None = None,
                  page_size: int | None = None) -> BranchCache:
        """An empty cache: ``keys`` (the heads' keys and values, counting positions) and ``index``.

        Raises:
            ValueError: ``page_size`` (no paged top-k cache is built) or ``windowed=True`` (no window).

        Example:
            >>> TopkAttention(16, 4, num_kv_heads=2, index_dim=3).new_cache(1, 8).nbytes  # (2*2*4 + 3) * 8 * 4
            608
        """
        if page_size is not None:
            raise ValueError(f"page_size={page_size!r}: TopkAttention has no paged cache; leave page_size None")
        if windowed is not None:
            instance_of("windowed", windowed, bool, "a bool or None")
        if windowed:
            raise ValueError("windowed=True needs a module with a window; TopkAttention has none")
        options = _cache_options(self.o_proj.weight, dtype, device)
        return BranchCache(keys=KVCache(batch_size, self.num_kv_heads, max_len, self.head_dim, **options),
                           index=KVCache(batch_size, 1, max_len, self.indexer.head_dim, value_dim=0, **options))

    def _check_branches(self, cache: object, x: object) -> None:
        """``cache`` is this module's (parts ``keys`` and ``index`` of its sizes, x's dtype)."""
        instance_of("cache", cache, BranchCache, "a BranchCache from TopkAttention.new_cache")
        parts = dict(zip(cache.names, (cache[name] for name in cache.names)))
        index = parts.get("index")
        if (tuple(parts) != ("keys", "index") or not all(type(p) is KVCache for p in parts.values())
                or (index.num_kv_heads, index.head_dim, index.value_dim) != (1, self.indexer.head_dim, 0)
                or index.max_len != parts["keys"].max_len or index.length != parts["keys"].length):
            raise ValueError(f"cache must be this module's BranchCache(keys=KVCache, index=KVCache(B, 1, max_len, "
                             f"{self.indexer.head_dim}, value_dim=0)) from new_cache; got {cache!r}")
        if isinstance(x, Tensor) and x.dtype != cache.dtype:
            raise TypeError(f"cache holds {cache.dtype} but x is {x.dtype}; create it with new_cache(dtype={x.dtype})")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, topk={self.indexer.topk}, index_loss_weight={self.index_loss_weight:g}"


class _WithLoss(torch.autograd.Function):
    """``out`` unchanged; the backward gives ``loss`` the gradient ``weight``: ``weight * loss``
    joins whatever loss ``out`` reaches."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor, weight: float) -> Tensor:
        ctx.weight = weight
        ctx.loss_shape = loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_full(ctx.loss_shape, ctx.weight), None


def _index_rope_dim(index_rope_dim: int | None, index_dim: int, positions: str | None) -> int:
    """The indexer's rotated features: half of ``index_dim`` (even) by default with rope, else 0."""
    if index_rope_dim is None:
        return 0 if positions is None else index_dim // 2 // 2 * 2
    non_negative_int("index_rope_dim", index_rope_dim)
    if positions is None and index_rope_dim:
        raise ValueError(f"index_rope_dim={index_rope_dim} needs positions='rope'")
    return index_rope_dim  # the indexer checks even and <= index_dim


def _index_mask(mask, *, batch: int, tq: int, tk: int, device) -> Tensor | None:
    """The attention mask as the indexer's ``(B|1, Tq|1, Tk)`` bool: the keys a query may pick."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):  # packed documents (and their padding) as a mod: one per batch row
        mask = _masks.materialize(mask, tq=tq, tk=tk, batch=batch, device=device)  # (B, 1, Tq, Tk)
    allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
    allowed = allowed.reshape((1,) * (4 - allowed.ndim) + tuple(allowed.shape))  # (B|1, 1, Tq|1, Tk|1)
    return torch.broadcast_to(allowed[:, 0], (allowed.shape[0], allowed.shape[2], tk))  # (B|1, Tq|1, Tk)


def _check_padding(padding_mask: object, batch: int, tokens: int) -> Tensor | None:
    if padding_mask is None:
        return None
    _check_padding_type(padding_mask, "padding_mask")
    if tuple(padding_mask.shape) != (batch, tokens):
        raise ValueError(f"padding_mask must be (B, T) = {(batch, tokens)}, got {tuple(padding_mask.shape)}")
    return padding_mask
