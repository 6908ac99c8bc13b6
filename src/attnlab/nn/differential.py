"""Differential attention (Ye et al. 2024, "Differential Transformer"; transformers' DiffLlama).

Query heads come in pairs, as do key heads: differential head ``i`` has queries ``Q1`` (head
``i``) and ``Q2`` (head ``i + H/2``), keys ``K1``/``K2`` likewise on the key heads, and one value
of ``2 * head_dim`` features (key/value heads ``j`` and ``j + Hkv/2`` side by side). Then

    ``out_i = (1 - λ_init) · RMSNorm((softmax(Q1 K1ᵀ s) - λ softmax(Q2 K2ᵀ s)) V)``,
    ``λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init``,  ``λ_init = 0.8 - 0.6 exp(-0.3 layer_idx)``,

with ``s = head_dim ** -0.5`` and an RMSNorm without weight over the ``2 * head_dim`` features
("subln"). Each softmax is one :func:`attnlab.attention` call, so masks, causality, windows and
the backend reach both. This follows ``DiffLlamaAttention`` (its head pairing ``(i, i + H/2)``,
its λ vectors shared by every head, its parameter names): its ``state_dict`` loads as is.

Example:
    >>> diff = DifferentialAttention(32, 4, num_kv_heads=2, layer_idx=3)
    >>> round(diff.lambda_init, 4), diff(torch.randn(2, 5, 32)).shape
    (0.5561, torch.Size([2, 5, 32]))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import finite_number, instance_of, non_negative_int, positive_number
from attnlab.nn.gated import _ProjectedAttention

__all__ = ["DifferentialAttention", "lambda_init_for"]


def lambda_init_for(layer_idx: int) -> float:
    """The paper's ``λ_init = 0.8 - 0.6 exp(-0.3 (l - 1))`` for layer ``l = layer_idx + 1``.

    Example:
        >>> round(lambda_init_for(0), 6), round(lambda_init_for(3), 4)
        (0.2, 0.5561)
    """
    return 0.8 - 0.6 * math.exp(-0.3 * non_negative_int("layer_idx", layer_idx))


class DifferentialAttention(_ProjectedAttention):
    """Causal differential self-attention (see the module docstring for the arithmetic).

    **Parameters** (DiffLlama's names): ``q_proj`` ``(H * head_dim, d_model)``; ``k_proj``,
    ``v_proj`` ``(Hkv * head_dim, d_model)``; ``o_proj`` ``(d_model, H * head_dim)``;
    ``lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` ``(head_dim,)``, drawn from
    ``N(0, lambda_std)``. ``H`` counts query heads: ``H / 2`` differential heads.

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``. A dense ``mask`` broadcasts to
        ``(B, 1, T, Tk)`` or ``(B, H/2, T, Tk)``. The cache holds ``(B, Hkv/2, length,
        2 * head_dim)`` keys and values: both halves' keys side by side, read by both calls.

    Args:
        d_model: input and output width.
        num_heads: query heads ``H``, even.
        num_kv_heads: key/value heads, even, dividing ``num_heads`` (default ``num_heads``).
        head_dim: features per query head (default ``d_model // num_heads``).
        layer_idx: the layer's 0-based index, giving ``λ_init`` (:func:`lambda_init_for`).
        lambda_init: ``λ_init`` itself, instead of ``layer_idx``.
        lambda_std: standard deviation of the λ vectors' initial values.
        norm_eps: epsilon of the per-head RMSNorm.
        positions: ``"rope"`` or None; rotary_dim, rope_base: as in :class:`~attnlab.nn.GatedAttention`.
        bias: biases in every projection.
        causal, window, backend: as in :class:`~attnlab.nn.GatedAttention`.

    Example:
        >>> diff = DifferentialAttention(16, 4, lambda_init=0.5)
        >>> cache = diff.new_cache(batch_size=1, max_len=8)
        >>> with torch.no_grad():
        ...     _ = diff(torch.randn(1, 3, 16), cache=cache)
        ...     step = diff(torch.randn(1, 1, 16), cache=cache)
        >>> step.shape, cache.keys.shape
        (torch.Size([1, 1, 16]), torch.Size([1, 2, 8, 8]))
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, layer_idx: int | None = None, lambda_init: float | None = None,
                 lambda_std: float = 0.1, norm_eps: float = 1e-5, positions: str | None = "rope",
                 rotary_dim: int | None = None, rope_base: float = 10000.0, bias: bool = False,
                 causal: bool = True, window: int | None = None, backend: str = "auto"):
        super().__init__(d_model, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, q_parts=1, bias=bias,
                         positions=positions, rotary_dim=rotary_dim, rope_base=rope_base, causal=causal,
                         window=window, dropout_p=0.0, backend=backend)
        for name, heads in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads)):
            if heads % 2:
                raise ValueError(f"{name} must be even (differential heads pair heads i and i + {name} / 2), "
                                 f"got {heads}")
        self.lambda_init = _lambda_init(layer_idx, lambda_init)
        self.norm_eps = positive_number("norm_eps", norm_eps)
        std = positive_number("lambda_std", lambda_std)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.normal(0.0, std, size=(self.head_dim,))))

    def lambda_full(self) -> Tensor:
        """``λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init``, a 0-d tensor.

        Example:
            >>> diff = DifferentialAttention(8, 2, lambda_init=0.3)
            >>> with torch.no_grad():
            ...     diff.lambda_q1.zero_(); diff.lambda_q2.zero_()   # doctest: +ELLIPSIS
            Parameter...
            >>> round(float(diff.lambda_full().detach()), 6)     # exp(0) - exp(0) + lambda_init
            0.3
        """
        first = torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
        second = torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
        return first - second + self.lambda_init

    def _cache_layout(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # key/value heads j and j + Hkv/2 side by side: (B, Hkv/2, T, 2D)
        return torch.cat(k.chunk(2, dim=1), dim=-1), torch.cat(v.chunk(2, dim=1), dim=-1)

    def _heads(self, q: Tensor, k: Tensor, v: Tensor, *, mask, key_lengths: Tensor | None) -> Tensor:
        """Both softmaxes over the paired keys ``(B, Hkv/2, Tk, 2D)``, combined and normalised:
        ``(B, H/2, Tq, 2D)``."""
        D = self.head_dim
        q1, q2 = q.chunk(2, dim=1)  # (B, H/2, Tq, D) each
        first = self._attend(q1, k[..., :D], v, mask=mask, key_lengths=key_lengths)  # (B, H/2, Tq, 2D)
        second = self._attend(q2, k[..., D:], v, mask=mask, key_lengths=key_lengths)
        out = first - self.lambda_full().to(first.dtype) * second
        return (1.0 - self.lambda_init) * F.rms_norm(out, (2 * D,), eps=self.norm_eps)

    def _cache_shape(self) -> tuple[int, int, int]:
        return self.num_kv_heads // 2, 2 * self.head_dim, 2 * self.head_dim

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lambda_init={self.lambda_init:.4g}"


def _lambda_init(layer_idx: object, lambda_init: object) -> float:
    """``λ_init`` from ``lambda_init`` or ``layer_idx`` (not both; neither: layer 0)."""
    if layer_idx is not None and lambda_init is not None:
        raise ValueError(f"give lambda_init or layer_idx, not both; got lambda_init={lambda_init!r}, "
                         f"layer_idx={layer_idx!r}")
    if lambda_init is None:
        return lambda_init_for(0 if layer_idx is None else layer_idx)
    instance_of("lambda_init", lambda_init, (int, float), "a real number")
    value = finite_number("lambda_init", lambda_init)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"lambda_init must be in [0, 1) (the output is scaled by 1 - lambda_init), got {value}")
    return value
