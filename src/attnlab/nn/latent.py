"""Multi-head latent attention (MLA, DeepSeek-V2): keys and values from one small cached latent.

Each token's keys and values come from a latent ``c = RMSNorm(W_DKV x)`` of ``latent_dim``
features, expanded per head by ``W_UK`` (``nope_dim`` key features) and ``W_UV`` (``value_dim``
value features). Position is carried by a separate, *decoupled* rotary part: ``rope_dim``
features per query head and ``rope_dim`` key features shared by every head (``W_KR x``, rotated),
appended to the unrotated part. A head's score is therefore

    ``q_h . k_h = q_nope_h . (W_UK_h c) + RoPE(q_rope_h) . RoPE(k_rope)``,  scaled by
    ``1 / sqrt(nope_dim + rope_dim)``,

and the cache holds only ``c`` and ``k_rope``: ``latent_dim + rope_dim`` numbers per token and
layer, whatever the number of heads. Decoding need not expand the cache either: since
``q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c``, the *absorbed* form moves ``W_UK`` onto the
query, attends over the latents themselves as one shared key/value head (multi-query attention
over ``[c, k_rope]``, values ``c``), and applies ``W_UV`` to each head's output. Prefill and
training expand (cheaper when many queries share the keys); a cache decodes absorbed.

Example:
    >>> mla = LatentAttention(32, 4, latent_dim=16, rope_dim=4)
    >>> cache = mla.new_cache(batch_size=1, max_len=8)
    >>> with torch.no_grad():
    ...     _ = mla(torch.randn(1, 5, 32), cache=cache)
    ...     step = mla(torch.randn(1, 1, 32), cache=cache)
    >>> step.shape, cache.keys.shape                # the cache: one latent + rope key per token
    (torch.Size([1, 1, 32]), torch.Size([1, 1, 8, 20]))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab import masks as _masks
from attnlab._checks import instance_of, positive_int, positive_number, probability
from attnlab.backends import check_backend_name
from attnlab.nn.cache import Cache, _cache_options, _restore_on_error, new_positions
from attnlab.nn.multihead import (_check_cache, _check_cache_options, _check_documents, _check_window,
                                  _combine_masks, _with_documents, attend_causal, make_cache)
from attnlab.nn.positional import RotaryEmbedding

__all__ = ["LatentAttention"]


class LatentAttention(nn.Module):
    """Causal multi-head latent attention with a decoupled rotary key (see the module docstring).

    **Parameters.** ``q_proj`` ``(H * (nope_dim + rope_dim), d_model)`` -- or, with
    ``q_latent_dim``, the low-rank ``q_down`` ``(q_latent_dim, d_model)``, ``q_norm`` and
    ``q_up`` ``(H * (nope_dim + rope_dim), q_latent_dim)``; ``kv_down`` ``(latent_dim +
    rope_dim, d_model)`` (the latent and the shared rotary key in one matmul); ``kv_norm``;
    ``kv_up`` ``(H * (nope_dim + value_dim), latent_dim)`` (per head: ``W_UK_h`` rows, then
    ``W_UV_h`` rows; no bias, so that it can be absorbed); ``out_proj`` ``(d_model, H *
    value_dim)``.

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``; weights ``(B, H, T, Tk)``. The cache
        holds ``(B, 1, length, latent_dim + rope_dim)`` keys (``[c, k_rope]``) and no values.

    Args:
        d_model: input and output width.
        num_heads: ``H``.
        latent_dim: ``d_c``, features of the cached key/value latent.
        q_latent_dim: low-rank query projection through this many features (None: a full
            ``q_proj``).
        nope_dim: per-head key/query features without position (default ``d_model // H``).
        rope_dim: per-head rotary query features and shared rotary key features, even
            (default ``nope_dim // 2``).
        value_dim: per-head value features (default ``nope_dim``).
        dropout_p: attention dropout (training only).
        bias: biases in ``q_proj``/``q_down``/``q_up``, ``kv_down`` and ``out_proj``.
        norm_eps: epsilon of the latents' RMSNorms.
        rope_base: the rotary wavelength base.
        window: a causal sliding window (as :class:`~attnlab.nn.MultiHeadAttention`'s).
        backend: attention backend for :func:`attnlab.attention`.

    Example:
        >>> mla = LatentAttention(64, 8, latent_dim=32, q_latent_dim=48, rope_dim=8)
        >>> mla(torch.randn(2, 7, 64)).shape, mla.cache_features
        (torch.Size([2, 7, 64]), 40)
    """

    def __init__(self, d_model: int, num_heads: int, *, latent_dim: int, q_latent_dim: int | None = None,
                 nope_dim: int | None = None, rope_dim: int | None = None, value_dim: int | None = None,
                 dropout_p: float = 0.0, bias: bool = False, norm_eps: float = 1e-6,
                 rope_base: float = 10000.0, window: int | None = None, backend: str = "auto"):
        super().__init__()
        for name, size in (("d_model", d_model), ("num_heads", num_heads), ("latent_dim", latent_dim)):
            positive_int(name, size)
        nope_dim = d_model // num_heads if nope_dim is None else nope_dim
        positive_int("nope_dim", nope_dim)
        rope_dim = max(2, nope_dim // 2 // 2 * 2) if rope_dim is None else rope_dim
        value_dim = nope_dim if value_dim is None else value_dim
        for name, size in (("rope_dim", rope_dim), ("value_dim", value_dim)):
            positive_int(name, size)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even (rotary embeddings turn features in pairs), got {rope_dim}")
        probability("dropout_p", dropout_p)
        positive_number("norm_eps", norm_eps)
        instance_of("bias", bias, bool, "a bool")
        check_backend_name(backend)
        self.d_model, self.num_heads, self.latent_dim = d_model, num_heads, latent_dim
        self.nope_dim, self.rope_dim, self.value_dim = nope_dim, rope_dim, value_dim
        self.q_latent_dim, self.dropout_p, self.backend = q_latent_dim, float(dropout_p), backend
        self.window, self.causal = _check_window(window, True), True
        q_width = num_heads * (nope_dim + rope_dim)
        if q_latent_dim is None:
            self.q_proj = nn.Linear(d_model, q_width, bias=bias)
        else:
            self.q_down = nn.Linear(d_model, positive_int("q_latent_dim", q_latent_dim), bias=bias)
            self.q_norm = nn.RMSNorm(q_latent_dim, eps=norm_eps)
            self.q_up = nn.Linear(q_latent_dim, q_width, bias=False)
        self.kv_down = nn.Linear(d_model, latent_dim + rope_dim, bias=bias)
        self.kv_norm = nn.RMSNorm(latent_dim, eps=norm_eps)
        self.kv_up = nn.Linear(latent_dim, num_heads * (nope_dim + value_dim), bias=False)
        self.out_proj = nn.Linear(num_heads * value_dim, d_model, bias=bias)
        self.rope = RotaryEmbedding(rope_dim, base=rope_base)

    @property
    def cache_features(self) -> int:
        """Numbers cached per token, the latent and the shared rotary key.

        Example:
            >>> LatentAttention(32, 4, latent_dim=16, rope_dim=4).cache_features
            20
        """
        return self.latent_dim + self.rope_dim

    # ------------------------------------------------------------------ weights
    def up_weights(self) -> tuple[Tensor, Tensor]:
        """``W_UK`` ``(H, nope_dim, latent_dim)`` and ``W_UV`` ``(H, value_dim, latent_dim)``, views
        of ``kv_up.weight``.

        Example:
            >>> [w.shape for w in LatentAttention(32, 4, latent_dim=16).up_weights()]
            [torch.Size([4, 8, 16]), torch.Size([4, 8, 16])]
        """
        per_head = self.kv_up.weight.view(self.num_heads, self.nope_dim + self.value_dim, self.latent_dim)
        return per_head[:, : self.nope_dim], per_head[:, self.nope_dim :]

    def project_q(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The queries' unrotated and rotary parts ``(B, H, T, nope_dim)``, ``(B, H, T, rope_dim)``
        (before rotation).

        Example:
            >>> [t.shape[-1] for t in LatentAttention(32, 4, latent_dim=16, rope_dim=4).project_q(
            ...     torch.randn(1, 3, 32))]
            [8, 4]
        """
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_latent_dim is None else self.q_up(self.q_norm(self.q_down(x)))
        q = q.view(B, T, self.num_heads, self.nope_dim + self.rope_dim).transpose(1, 2)  # (B, H, T, dn + dr)
        return q.split((self.nope_dim, self.rope_dim), dim=-1)

    def project_latent(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The normalised latent ``(B, T, latent_dim)`` and the shared rotary key ``(B, 1, T,
        rope_dim)`` (before rotation).

        Example:
            >>> c, k_rope = LatentAttention(32, 4, latent_dim=16, rope_dim=4).project_latent(
            ...     torch.randn(1, 3, 32))
            >>> c.shape, k_rope.shape
            (torch.Size([1, 3, 16]), torch.Size([1, 1, 3, 4]))
        """
        latent, k_rope = self.kv_down(x).split((self.latent_dim, self.rope_dim), dim=-1)
        return self.kv_norm(latent), k_rope[:, None]  # (B, T, dc), (B, 1, T, dr)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, *, mask: Tensor | Callable | None = None, padding_mask: Tensor | None = None,
                cache: Cache | None = None, return_weights: bool = False, document_ids: Tensor | None = None,
                absorb: bool | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Causal latent self-attention over ``x`` ``(B, T, d_model)`` (and a cache's tokens).

        Args:
            x: ``(B, T, d_model)``.
            mask, padding_mask, document_ids, return_weights: as in
                :meth:`MultiHeadAttention.forward` (``document_ids`` without a cache).
            cache: a cache from :meth:`new_cache`; it receives ``[c, k_rope]`` of the new tokens.
            absorb: attend in the absorbed form (``W_UK`` on the queries, ``W_UV`` on the
                outputs) rather than expanding the latents into per-head keys and values.
                Default: absorbed with a cache, expanded without. Both give the same output.

        Example:
            >>> mla = LatentAttention(16, 2, latent_dim=8).double()
            >>> x = torch.randn(1, 4, 16, dtype=torch.float64)
            >>> torch.allclose(mla(x), mla(x, absorb=True))
            True
        """
        _check_x(x, self.out_proj.weight, self.d_model)
        documents = _check_documents(document_ids, x, None, cache)
        if cache is not None:
            _check_cache(cache, x, None, 1, self.window)
            _check_cache_options(cache, mask, padding_mask, return_weights)
            if (cache.head_dim, cache.value_dim) != (self.cache_features, 0):
                raise ValueError(f"cache must hold {self.cache_features} key features and no values "
                                 f"(LatentAttention.new_cache); got {cache.head_dim} and {cache.value_dim}")
        absorb = cache is not None if absorb is None else instance_of("absorb", absorb, bool, "a bool or None")
        with _restore_on_error([cache], x.shape[1]):
            return self._attend(x, mask, padding_mask, cache, return_weights, documents, absorb)

    def _attend(self, x, mask, padding_mask, cache, return_weights, documents, absorb):
        B, T, _ = x.shape
        Tk = T + (0 if cache is None else max(cache.row_lengths, default=0))
        if documents is not None:
            mask = _with_documents(mask, documents, tq=T)
        mask = _combine_masks(mask, padding_mask, batch=B, tk=Tk)
        q_nope, q_rope = self.project_q(x)  # (B, H, T, dn), (B, H, T, dr)
        latent, k_rope = self.project_latent(x)  # (B, T, dc), (B, 1, T, dr)
        if documents is not None:
            positions = _masks.document_positions(documents)  # (B|1, T)
            q_rope, k_rope = self.rope.at(q_rope, positions), self.rope.at(k_rope, positions)
        else:
            offset = new_positions(cache, T, device=x.device)
            q_rope, k_rope = self.rope.at(q_rope, offset), self.rope.at(k_rope, offset)
        keys = torch.cat([latent[:, None], k_rope], dim=-1)  # (B, 1, T, dc + dr): what the cache holds
        no_values = keys[..., :0]  # (B, 1, T, 0)
        w_uk, w_uv = self.up_weights()
        if absorb:
            q = torch.cat([torch.matmul(q_nope, w_uk), q_rope], dim=-1)  # (B, H, T, dc + dr)
        else:
            q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, T, dn + dr)

        def attend(q: Tensor, keys: Tensor, _: Tensor, *, key_lengths: Tensor | None = None):
            return self._attend_latents(q, keys, mask, absorb, return_weights, key_lengths)

        result = attend(q, keys, no_values) if cache is None else cache.attend(q, keys, no_values, attend)
        out = result[0] if return_weights else result  # absorbed (B, H, T, dc); expanded (B, H, T, dv)
        if absorb:
            out = torch.matmul(out, w_uv.transpose(1, 2))  # (B, H, T, dv)
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.value_dim))  # (B, T, d_model)
        return (out, result[1]) if return_weights else out

    def _attend_latents(self, q: Tensor, keys: Tensor, mask, absorb: bool, return_weights: bool,
                        key_lengths: Tensor | None = None):
        """Attention of ``q`` over cached ``keys`` ``(B, 1, Tk, dc + dr)``, absorbed or expanded
        (``key_lengths``: a paged batch's real keys per row, see :func:`attend_causal`)."""
        scale = 1.0 / math.sqrt(self.nope_dim + self.rope_dim)
        latent, k_rope = keys.split((self.latent_dim, self.rope_dim), dim=-1)  # (B, 1, Tk, dc), (.., dr)
        if absorb:  # one shared key/value head: keys [c, k_rope], values c (a view, no copy)
            k, v = keys, latent
        else:
            B, _, Tk, _ = keys.shape
            kv = self.kv_up(latent[:, 0]).view(B, Tk, self.num_heads, self.nope_dim + self.value_dim)
            kv = kv.transpose(1, 2)  # (B, H, Tk, dn + dv)
            k_nope, v = kv.split((self.nope_dim, self.value_dim), dim=-1)
            k = torch.cat([k_nope, k_rope.expand(B, self.num_heads, Tk, self.rope_dim)], dim=-1)  # (B, H, Tk, dn + dr)
        return attend_causal(q, k, v, mask=mask, window=self.window, scale=scale, backend=self.backend,
                             dropout_p=self.dropout_p if self.training else 0.0, return_weights=return_weights,
                             key_lengths=key_lengths)

    # ------------------------------------------------------------------ caching
    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, windowed: bool | None = None,
                  page_size: int | None = None) -> Cache:
        """An empty cache of ``[c, k_rope]`` per token (one "head" of ``cache_features``, no values).

        Example:
            >>> LatentAttention(32, 4, latent_dim=16, rope_dim=4).new_cache(1, 8).nbytes   # 8 x 20 x 4
            640
        """
        return make_cache(batch_size, 1, max_len, self.cache_features, value_dim=0, window=self.window,
                          windowed=windowed, page_size=page_size, **_cache_options(self.out_proj.weight, dtype, device))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, latent_dim={self.latent_dim}, "
                f"q_latent_dim={self.q_latent_dim}, nope_dim={self.nope_dim}, rope_dim={self.rope_dim}, "
                f"value_dim={self.value_dim}, window={self.window}, backend={self.backend!r}")


def _check_x(x: object, weight: Tensor, d_model: int) -> None:
    instance_of("x", x, Tensor, "a torch.Tensor")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must have a floating-point dtype, got {x.dtype}")
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must be (B, T, {d_model}), got shape {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the module's weights are on {weight.device}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"x has dtype {x.dtype} but the module's weights are {weight.dtype}; convert one of them")
