"""Gated attention (Qwen3-Next): each head's output times ``sigmoid(gate)``, the gate projected from the input.

``q_proj`` yields, per head, ``head_dim`` query features followed by ``head_dim`` gate features
(Qwen3-Next's layout, so its ``state_dict`` loads as is); queries and keys may pass a per-head
RMSNorm (``qk_norm``, Qwen3-Next's ``(1 + weight)`` form) and a rotary embedding on their first
``rotary_dim`` features; the heads attend through :func:`attnlab.attention` and

    ``out = o_proj(concat_h(attention_h) * sigmoid(gate))``.

:class:`_ProjectedAttention`, the projections, positions, masks and cache path, is shared with
:class:`attnlab.nn.DifferentialAttention`, which changes only how the heads attend.

Example:
    >>> attn = GatedAttention(32, 4, num_kv_heads=2)
    >>> cache = attn.new_cache(batch_size=1, max_len=8)
    >>> with torch.no_grad():
    ...     _ = attn(torch.randn(1, 5, 32), cache=cache)
    ...     step = attn(torch.randn(1, 1, 32), cache=cache)
    >>> step.shape, cache.length
    (torch.Size([1, 1, 32]), 6)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab import masks as _masks
from attnlab._checks import instance_of, one_of, positive_int, positive_number, probability
from attnlab.backends import check_backend_name
from attnlab.nn.cache import Cache, _cache_options, _restore_on_error, new_positions
from attnlab.nn.latent import _check_x
from attnlab.nn.multihead import (HeadRMSNorm, QKNorm, _check_cache, _check_cache_options, _check_documents,
                                  _check_window, _combine_masks, _with_documents, attend_causal, make_cache)
from attnlab.nn.parts import head_sizes
from attnlab.nn.positional import RotaryEmbedding

__all__ = ["GatedAttention"]


class _ProjectedAttention(nn.Module):
    """Self-attention with separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (transformers'
    names), grouped-query heads, rotary positions, masks and a KV cache; subclasses say how the
    heads attend (:meth:`_heads`) and how the heads' output is finished (:meth:`_finish`).

    ``q_proj`` gives ``q_parts * head_dim`` features per head (the first ``head_dim`` are the query)."""

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None, head_dim: int | None,
                 q_parts: int, bias: bool, positions: str | None, rotary_dim: int | None, rope_base: float,
                 causal: bool, window: int | None, dropout_p: float, backend: str):
        super().__init__()
        num_kv_heads, head_dim = head_sizes(d_model, num_heads, num_kv_heads, head_dim, group_name="num_kv_heads")
        instance_of("bias", bias, bool, "a bool")
        instance_of("causal", causal, bool, "a bool")
        check_backend_name(backend)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.causal, self.window = causal, _check_window(window, causal)
        self.dropout_p, self.backend = probability("dropout_p", dropout_p), backend
        self.rope = _make_rope(positions, rotary_dim, head_dim, rope_base)
        self.q_proj = nn.Linear(d_model, num_heads * q_parts * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)

    # ------------------------------------------------------------------ hooks
    def _split_query(self, q: Tensor) -> tuple[Tensor, Tensor | None]:
        """``q_proj``'s output ``(B, T, H, q_parts * D)`` as the queries ``(B, T, H, D)`` and the rest."""
        return q, None

    def _norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def _cache_layout(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The new keys and values as the cache holds them (default: ``(B, Hkv, T, D)``)."""
        return k, v

    def _heads(self, q: Tensor, k: Tensor, v: Tensor, *, mask, key_lengths: Tensor | None) -> Tensor:
        """Every head's attention ``(B, H, Tq, D)`` over the cache-layout keys and values."""
        return self._attend(q, k, v, mask=mask, key_lengths=key_lengths)

    def _finish(self, out: Tensor, extra: Tensor | None) -> Tensor:
        """The heads' output ``(B, T, H * D)`` before ``o_proj``."""
        return out

    # ------------------------------------------------------------------ the path
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask, key_lengths: Tensor | None) -> Tensor:
        """One :func:`attnlab.attention` call with the module's rule (causal or window, dropout, backend)."""
        return attend_causal(q, k, v, mask=mask, causal=self.causal, window=self.window, backend=self.backend,
                             dropout_p=self.dropout_p if self.training else 0.0, key_lengths=key_lengths)

    def forward(self, x: Tensor, *, mask: Tensor | Callable | None = None, padding_mask: Tensor | None = None,
                cache: Cache | None = None, document_ids: Tensor | None = None) -> Tensor:
        """Self-attention over ``x`` ``(B, T, d_model)`` (and a cache's earlier tokens) -> ``(B, T, d_model)``.

        Args:
            x: ``(B, T, d_model)``.
            mask: bool (True = may attend) or float tensor broadcastable to ``(B, 1, T, Tk)``, or a
                mask mod; ANDed with the causal rule.
            padding_mask: ``(B, Tk)`` bool, True at real key tokens (cached + new with a cache).
            cache: a cache from :meth:`new_cache`; the new keys and values are appended.
            document_ids: ``(T,)`` or ``(B, T)`` ids of packed documents (no cache): attention
                stays inside each document and rotary positions restart at each one.
        """
        return self._run(x, mask, padding_mask, cache, document_ids, None)

    def _run(self, x, mask, padding_mask, cache, document_ids, gate: Tensor | None) -> Tensor:
        """Check, then attend with the cache restored if anything fails (``gate``: given gate logits)."""
        _check_x(x, self.o_proj.weight, self.d_model)
        documents = _check_documents(document_ids, x, None, cache)
        if cache is not None:
            _check_cache(cache, x, None, self._cache_shape()[0], self.window)
            _check_cache_options(cache, mask, padding_mask, False)
            if (cache.head_dim, cache.value_dim) != self._cache_shape()[1:]:
                raise ValueError(f"cache must hold (key, value) features {self._cache_shape()[1:]} per head "
                                 f"(module.new_cache); got {(cache.head_dim, cache.value_dim)}")
        with _restore_on_error([cache], x.shape[1]):
            return self._forward(x, mask, padding_mask, cache, documents, gate)

    def _forward(self, x, mask, padding_mask, cache, documents, gate):
        B, T, _ = x.shape
        Tk = T + (0 if cache is None else max(cache.row_lengths, default=0))
        if documents is not None:
            mask = _with_documents(mask, documents, tq=T)
        mask = _combine_masks(mask, padding_mask, batch=B, tk=Tk)
        q, k, v, extra = self._project(x, documents, cache)
        extra = extra if gate is None else gate
        out = self._attend_all(x, q, k, v, mask=mask, cache=cache)  # (B, H', T, D')
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, H * D)
        return self.o_proj(self._finish(out, extra))

    def _project(self, x: Tensor, documents: Tensor | None, cache: Cache | None):
        """Queries ``(B, H, T, D)``, keys and values in the cache layout, and ``q_proj``'s rest, of ``x``."""
        B, T, _ = x.shape
        q, extra = self._split_query(self.q_proj(x).unflatten(-1, (self.num_heads, -1)))  # (B, T, H, q_parts * D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = self._norm_qk(q, k)
        q, k = self._rotate(q.transpose(1, 2), k.transpose(1, 2), documents, cache)  # (B, H|Hkv, T, D)
        return (q, *self._cache_layout(k, v), extra)

    def _attend_all(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, *, mask, cache: Cache | None) -> Tensor:
        """Every head's output ``(B, H', T, D')``: :meth:`_heads` over the new keys and a cache's earlier
        ones (``x``, the layer's input ``(B, T, d_model)``, is for heads that read it: a top-k layer's indexer)."""

        def heads(q: Tensor, keys: Tensor, values: Tensor, *, key_lengths: Tensor | None = None) -> Tensor:
            return self._heads(q, keys, values, mask=mask, key_lengths=key_lengths)

        return heads(q, k, v) if cache is None else cache.attend(q, k, v, heads)  # (B, H', T, D')

    def _rotate(self, q: Tensor, k: Tensor, documents: Tensor | None, cache: Cache | None):
        """Rotary positions on the first ``rotary_dim`` features of ``q`` and ``k`` ``(B, H, T, D)``."""
        if self.rope is None:
            return q, k
        if documents is not None:
            positions = _masks.document_positions(documents)  # (B|1, T), 0 at each document start
        else:
            positions = new_positions(cache, q.shape[2], device=q.device)
        r = self.rope.head_dim
        if r == self.head_dim:
            return self.rope.at(q, positions), self.rope.at(k, positions)
        return tuple(torch.cat([self.rope.at(t[..., :r], positions), t[..., r:]], dim=-1) for t in (q, k))

    def _cache_shape(self) -> tuple[int, int, int]:
        """(kv heads, key features, value features) of one cached token."""
        return self.num_kv_heads, self.head_dim, self.head_dim

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, windowed: bool | None = None,
                  page_size: int | None = None) -> Cache:
        """An empty KV cache for this module (contiguous; ring buffer with a window; paged with ``page_size``).

        Example:
            >>> GatedAttention(16, 4, num_kv_heads=2).new_cache(1, 8)
            KVCache(batch_size=1, num_kv_heads=2, length=0, max_len=8, head_dim=4, dtype=torch.float32)
        """
        heads, key_dim, value_dim = self._cache_shape()
        return make_cache(batch_size, heads, max_len, key_dim, value_dim=value_dim, window=self.window,
                          windowed=windowed, page_size=page_size, **_cache_options(self.o_proj.weight, dtype, device))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, rotary_dim={None if self.rope is None else self.rope.head_dim}, "
                f"causal={self.causal}, window={self.window}, backend={self.backend!r}")


def _make_rope(positions: str | None, rotary_dim: int | None, head_dim: int, base: float) -> RotaryEmbedding | None:
    """The rotary part on the first ``rotary_dim`` features (all by default), or None."""
    if positions is None:
        if rotary_dim is not None:
            raise ValueError(f"rotary_dim={rotary_dim} needs positions='rope'")
        return None
    one_of("positions", positions, ("rope",))
    rotary_dim = head_dim if rotary_dim is None else positive_int("rotary_dim", rotary_dim)
    if rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and at most head_dim ({head_dim}), got {rotary_dim}")
    return RotaryEmbedding(rotary_dim, base=base)


class GatedAttention(_ProjectedAttention):
    """Qwen3-Next's gated attention: ``o_proj(concat_h(attention_h) * sigmoid(gate))``.

    **Parameters** (transformers' ``Qwen3NextAttention`` names and layout): ``q_proj``
    ``(H * 2 * head_dim, d_model)``, per head ``head_dim`` query rows then ``head_dim`` gate rows
    (without ``gate``: query rows only); ``k_proj``, ``v_proj`` ``(Hkv * head_dim, d_model)``;
    ``o_proj`` ``(d_model, H * head_dim)``; with ``qk_norm`` ``q_norm`` and ``k_norm``
    ``(head_dim,)``, RMSNorms scaled by ``1 + weight``. ``gate=False, qk_norm=False`` is plain
    grouped-query attention.

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``; the gate ``(B, T, H * head_dim)`` (one per
        head feature). The cache holds ``(B, Hkv, length, head_dim)`` keys and values.

    Args:
        d_model: input and output width.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads (divides ``num_heads``; default ``num_heads``).
        head_dim: features per head (default ``d_model // num_heads``; Qwen3-Next sets it apart).
        gate: the sigmoid output gate (False: plain attention).
        qk_norm: the per-head RMSNorm of queries and keys before the rotation.
        positions: ``"rope"`` or None (no positions).
        rotary_dim: rotate the first ``rotary_dim`` features only (Qwen3-Next: ``head_dim // 4``).
        rope_base: the rotary wavelength base.
        norm_eps: epsilon of ``q_norm``/``k_norm``.
        bias: biases in every projection.
        causal: causal self-attention (False: every query sees every real key).
        window: a causal sliding window, as :class:`~attnlab.nn.MultiHeadAttention`'s.
        dropout_p: attention dropout (training only).
        backend: attention backend for :func:`attnlab.attention`.

    Example:
        >>> qwen_like = GatedAttention(64, 4, num_kv_heads=2, head_dim=32, rotary_dim=8)
        >>> qwen_like.q_proj.weight.shape, qwen_like(torch.randn(2, 5, 64)).shape
        (torch.Size([256, 64]), torch.Size([2, 5, 64]))
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, gate: bool = True, qk_norm: bool = True,
                 positions: str | None = "rope", rotary_dim: int | None = None, rope_base: float = 10000.0,
                 norm_eps: float = 1e-6, bias: bool = False, causal: bool = True, window: int | None = None,
                 dropout_p: float = 0.0, backend: str = "auto"):
        instance_of("gate", gate, bool, "a bool")
        instance_of("qk_norm", qk_norm, bool, "a bool")
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, q_parts=2 if gate else 1,
                         bias=bias, positions=positions, rotary_dim=rotary_dim, rope_base=rope_base,
                         causal=causal, window=window, dropout_p=dropout_p, backend=backend)
        self.gate = gate
        if qk_norm:
            positive_number("norm_eps", norm_eps)
            norm = QKNorm(eps=norm_eps, unit_offset=True)  # Qwen3-Next's (1 + weight) form
            self.q_norm, self.k_norm = HeadRMSNorm(self.head_dim, norm), HeadRMSNorm(self.head_dim, norm)
        self.qk_norm = qk_norm

    def forward(self, x: Tensor, *, mask: Tensor | Callable | None = None, padding_mask: Tensor | None = None,
                cache: Cache | None = None, document_ids: Tensor | None = None,
                gate: Tensor | None = None) -> Tensor:
        """Gated self-attention over ``x`` ``(B, T, d_model)`` -> ``(B, T, d_model)``.

        Args:
            x, mask, padding_mask, cache, document_ids: as in :meth:`_ProjectedAttention.forward`.
            gate: gate logits to use instead of the projected ones: ``(B, T, H * head_dim)`` (one
                per head feature) or ``(B, T, H)`` (one per head).

        Example:
            >>> attn = GatedAttention(8, 2, gate=False)
            >>> x = torch.randn(1, 3, 8)
            >>> torch.allclose(attn(x, gate=torch.zeros(1, 3, 2)), 0.5 * attn(x))   # sigmoid(0), per head
            True
        """
        if gate is not None:
            gate = self._check_gate(gate, x)
        return self._run(x, mask, padding_mask, cache, document_ids, gate)

    def _check_gate(self, gate: object, x: Tensor) -> Tensor:
        """``gate`` checked against ``x`` ``(B, T, d_model)``, as ``(B, T, H * D)`` logits."""
        instance_of("gate", gate, Tensor, "a floating-point tensor")
        heads, features = self.num_heads, self.num_heads * self.head_dim
        lead = tuple(x.shape[:2]) if isinstance(x, Tensor) and x.ndim == 3 else None
        if (lead is None or not gate.dtype.is_floating_point or gate.ndim != 3 or tuple(gate.shape[:2]) != lead
                or gate.shape[2] not in (heads, features)):
            raise ValueError(f"gate must be floating-point (B, T, H * head_dim) = {(*(lead or ('B', 'T')), features)} "
                             f"or (B, T, H) = {(*(lead or ('B', 'T')), heads)}; got {tuple(gate.shape)} {gate.dtype}")
        if gate.shape[2] == heads:  # one gate per head, the same on each of its features
            gate = gate.repeat_interleave(self.head_dim, dim=2)  # (B, T, H * D)
        return gate

    def _split_query(self, q: Tensor) -> tuple[Tensor, Tensor | None]:
        if not self.gate:
            return q, None
        q, gate = q.chunk(2, dim=-1)  # (B, T, H, D) each: per head, query rows then gate rows
        return q, gate.flatten(2)  # (B, T, H * D)

    def _norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return (self.q_norm(q), self.k_norm(k)) if self.qk_norm else (q, k)

    def _finish(self, out: Tensor, extra: Tensor | None) -> Tensor:
        return out if extra is None else out * torch.sigmoid(extra)  # (B, T, H * D)
