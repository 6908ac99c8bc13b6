"""Position information for attention: absolute embeddings, rotary embeddings (RoPE), ALiBi.

* **Sinusoidal** (Vaswani et al., 2017) and **learned** absolute embeddings are added to the
  token embeddings before the first layer.
* **Rotary embeddings** (Su et al., 2021) rotate each query and key head so that
  ``q_m . k_n`` depends on the positions only through ``m - n``. attnlab pairs feature ``i``
  with feature ``i + D/2`` (the "rotate half" layout of GPT-NeoX and Llama) and rotates the
  pair by ``position * base**(-2i/D)``. Under a KV cache the new tokens' positions start at
  the cache length (``offset``).
* **ALiBi** (Press et al., 2022) adds ``-slope_h * |i - j|`` to the scores of head ``h``; pass
  :func:`alibi_bias` as a float ``mask`` (any backend that accepts float masks serves it).
* **Query temperature** (Llama 4's NoPE layers): :class:`QueryTemperature` scales each query
  by a step function of its position, the positions part of a layer without rotary positions.

Example:
    >>> rope = RotaryEmbedding(8)
    >>> q = torch.randn(1, 2, 5, 8)                     # (B, H, T, D)
    >>> rope(q, offset=3).shape                         # positions 3..7
    torch.Size([1, 2, 5, 8])
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab._checks import (has_values, instance_of, integer_dtype, non_negative_int, one_of, positive_int,
                             positive_number)
from attnlab.scores import alibi_slopes  # one home for the slopes: attnlab.scores

__all__ = [
    "sinusoidal_table",
    "SinusoidalPositionalEmbedding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "ALiBi",
    "QueryTemperature",
    "apply_rotary",
    "alibi_slopes",
    "alibi_bias",
]


_CPU = torch.device("cpu")
TABLE_CACHE = 1 << 16  # positions whose rotary tables a RotaryEmbedding keeps per dtype and device


def _check_input(x: object, dim: int) -> Tensor:
    """``x`` if it is a floating-point tensor of at least 2 dims whose last dim is ``dim``."""
    instance_of("x", x, Tensor, "a torch.Tensor")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must have a floating-point dtype, got {x.dtype}")
    if x.ndim < 2 or x.shape[-1] != dim:
        raise ValueError(f"x must be (..., T, {dim}), got shape {tuple(x.shape)}")
    return x


def _angle_dtype(device: torch.device) -> torch.dtype:
    # Angles grow with the position; compute them in fp64 where the device has it.
    return torch.float32 if device.type == "mps" else torch.float64


def sinusoidal_table(
    num_positions: int,
    dim: int,
    *,
    offset: int = 0,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The sinusoidal position table of "Attention Is All You Need".

    ``P[pos, 2i] = sin(pos / base**(2i/dim))`` and ``P[pos, 2i+1] = cos(pos / base**(2i/dim))``
    for positions ``offset .. offset + num_positions - 1``.

    Shapes:
        returns ``(num_positions, dim)``.

    Example:
        >>> sinusoidal_table(3, 4)[0]
        tensor([0., 1., 0., 1.])
    """
    non_negative_int("num_positions", num_positions)
    positive_int("dim", dim)
    non_negative_int("offset", offset)
    positive_number("base", base)
    device = torch.device("cpu") if device is None else torch.device(device)
    work = _angle_dtype(device)
    pos = torch.arange(offset, offset + num_positions, dtype=work, device=device)
    even = torch.arange(0, dim, 2, dtype=work, device=device)  # the "2i" of the formula
    angles = pos[:, None] / base ** (even / dim)  # (T, ceil(dim/2))
    table = torch.empty(num_positions, dim, dtype=work, device=device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return table.to(dtype)


class SinusoidalPositionalEmbedding(nn.Module):
    """Adds the fixed sinusoidal table (:func:`sinusoidal_table`) to token embeddings.

    Shapes:
        x: ``(B, T, C)`` or ``(T, C)`` -> same shape; positions ``offset .. offset + T - 1``.

    Args:
        dim: ``C``, the embedding width.
        base: the wavelength base (10000 in the paper).

    Example:
        >>> emb = SinusoidalPositionalEmbedding(4)
        >>> emb(torch.zeros(2, 3, 4))[0, 0]
        tensor([0., 1., 0., 1.])
    """

    def __init__(self, dim: int, *, base: float = 10000.0):
        super().__init__()
        positive_int("dim", dim)
        self.dim, self.base = dim, positive_number("base", base)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        _check_input(x, self.dim)
        table = sinusoidal_table(
            x.shape[-2], self.dim, offset=offset, base=self.base, dtype=x.dtype, device=x.device
        )
        return x + table  # broadcasts over the batch


class LearnedPositionalEmbedding(nn.Module):
    """Adds a trained embedding per absolute position (GPT-2 / BERT style).

    Shapes:
        x: ``(B, T, C)`` or ``(T, C)`` -> same shape; positions ``offset .. offset + T - 1``
        must be below ``max_len``.

    Args:
        max_len: number of positions with an embedding.
        dim: ``C``, the embedding width.

    Example:
        >>> emb = LearnedPositionalEmbedding(16, 4)
        >>> emb(torch.zeros(2, 3, 4)).shape
        torch.Size([2, 3, 4])
    """

    def __init__(self, max_len: int, dim: int):
        super().__init__()
        positive_int("max_len", max_len)
        positive_int("dim", dim)
        self.embedding = nn.Embedding(max_len, dim)

    def forward(self, x: Tensor, *, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Add the embeddings of positions ``offset..offset+T-1``, or of ``positions`` ``(T,)``
        when given (a shard of a longer sequence holds scattered positions)."""
        _check_input(x, self.embedding.embedding_dim)
        non_negative_int("offset", offset)
        T = x.shape[-2]
        max_len = self.embedding.num_embeddings
        if positions is not None:
            if tuple(positions.shape) != (T,):
                raise ValueError(f"positions must have shape ({T},), got {tuple(positions.shape)}")
            integer_dtype("positions", positions)  # uint8 would index as a bool mask
            if T and has_values(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < max_len:
                raise ValueError(f"positions {int(positions.min())}..{int(positions.max())} are outside the "
                                 f"{max_len} learned positions")
            return x + self.embedding.weight[positions]  # (T, C) broadcasts
        if offset + T > max_len:
            raise ValueError(
                f"positions {offset}..{offset + T - 1} are outside the {max_len} learned positions"
            )
        return x + self.embedding.weight[offset : offset + T]  # (T, C) broadcasts


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate feature pairs ``(i, i + R/2)`` of the first ``R = 2 * cos.shape[-1]`` features of
    ``x`` by the angles whose cos/sin are given; features ``R..D-1`` pass through (partial RoPE).

    ``R = D`` is the usual rotation; a narrower table rotates the first ``R`` features only, in
    the layout of transformers' ``apply_rotary_pos_emb`` with a ``partial_rotary_factor``
    (Qwen3.5, Qwen3-Next, GLM, Phi): "rotate half" over ``x[..., :R]``, ``x[..., R:]`` unchanged.

    Shapes:
        x: ``(..., T, D)``; cos, sin: ``(T, R/2)`` with ``1 <= R/2 <= D/2``, or with leading dims
        that broadcast against ``x``'s (``(B, 1, T, R/2)``: each batch row at its own positions)
        -> ``(..., T, D)``.

    Raises:
        ValueError: ``D`` or ``R`` odd, ``R > D``, or the tables' shapes do not match ``x``'s.

    Example:
        >>> x = torch.tensor([[1.0, 0.0]])                 # one position, one pair
        >>> apply_rotary(x, torch.zeros(1, 1), torch.ones(1, 1))   # 90 degrees
        tensor([[0., 1.]])
        >>> x = torch.tensor([[1.0, 0.0, 5.0, 6.0]])       # R = 2 of D = 4: the last two pass
        >>> apply_rotary(x, torch.zeros(1, 1), torch.ones(1, 1))
        tensor([[0., 1., 5., 6.]])
    """
    D, half = x.shape[-1], cos.shape[-1] if cos.ndim else 0
    if (D % 2 or x.ndim < 2 or cos.ndim < 2 or not 0 < half <= D // 2 or cos.shape[-2:-1] != x.shape[-2:-1]
            or cos.shape != sin.shape or cos.ndim > max(x.ndim, 2)):
        raise ValueError(
            f"apply_rotary needs x (..., T, D) with D even and cos, sin (..., T, R/2) with 1 <= R/2 <= D/2, "
            f"T = {x.shape[-2] if x.ndim > 1 else None}; got x {tuple(x.shape)}, cos {tuple(cos.shape)}, "
            f"sin {tuple(sin.shape)}"
        )
    if 2 * half < D:  # partial: rotate the first R features, pass the rest
        rotated = apply_rotary(x[..., : 2 * half], cos, sin)  # (..., T, R)
        return torch.cat((rotated, x[..., 2 * half :]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)  # (..., T, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) for query and key heads.

    Pair ``(i, i + R/2)`` of the first ``R = rotary_dim`` features of the vector at position
    ``p`` is rotated by ``p * base**(-2i/R)``, so the dot product of a rotated query at ``m`` and
    key at ``n`` depends only on ``m - n``; features ``R..D-1`` pass through unchanged (partial
    RoPE: Qwen3.5 and Qwen3-Next rotate a quarter of each head, GLM and Phi a fraction; the
    layout and frequencies of transformers' ``partial_rotary_factor``). The module has no
    parameters; angles are computed in fp64 (fp32 on MPS) and cast to the input's dtype.

    Shapes:
        x: ``(..., T, D)`` (typically ``(B, H, T, D)``) -> same shape, positions
        ``offset .. offset + T - 1``. With a KV cache, ``offset`` is the cache length.
        :meth:`cos_sin` gives ``(T, R/2)`` tables.

    Args:
        head_dim: ``D``, even.
        base: the wavelength base (10000 in RoFormer and Llama 2).
        rotary_dim: ``R``, the leading features that rotate: even, ``2 <= R <= D``; None: ``D``.

    Raises:
        ValueError: ``head_dim`` or ``rotary_dim`` not a positive even int, or ``rotary_dim > head_dim``.

    Example:
        >>> rope = RotaryEmbedding(4)
        >>> x = torch.randn(1, 1, 6, 4)
        >>> torch.allclose(rope(x)[..., 2:, :], rope(x[..., 2:, :], offset=2))
        True
        >>> quarter = RotaryEmbedding(8, rotary_dim=2)          # Qwen3.5: a quarter of each head
        >>> torch.equal(quarter(x.repeat(1, 1, 1, 2), offset=5)[..., 2:], x.repeat(1, 1, 1, 2)[..., 2:])
        True
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, rotary_dim: int | None = None):
        super().__init__()
        positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.head_dim, self.base = head_dim, positive_number("base", base)
        if rotary_dim is not None and (positive_int("rotary_dim", rotary_dim) % 2 or rotary_dim > head_dim):
            raise ValueError(f"rotary_dim must be an even int of at most head_dim={head_dim}, got {rotary_dim}")
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim

    def cos_sin(self, num_positions: int, *, offset: int = 0, dtype=torch.float32, device=None):
        """``(cos, sin)`` tables of shape ``(num_positions, R/2)`` for positions from ``offset``.

        The tables are built once per dtype and device for the first :data:`TABLE_CACHE` positions
        (grown by doubling, never past that bound) and sliced per call: a decoding step reads
        one row instead of recomputing its angles. Slices equal the freshly computed rows exactly
        (the same elementwise fp64 angles); positions past the bound, and calls while compiling,
        are computed as before.

        Example:
            >>> cos, sin = RotaryEmbedding(4).cos_sin(3)
            >>> cos.shape
            torch.Size([3, 2])
            >>> rope = RotaryEmbedding(8)
            >>> torch.equal(rope.cos_sin(2, offset=5)[1], rope._angles(2, 5, torch.float32, torch.device("cpu"))[1])
            True
        """
        if type(num_positions) is not int or type(offset) is not int or num_positions < 0 or offset < 0:
            non_negative_int("num_positions", num_positions)
            non_negative_int("offset", offset)
        device = _CPU if device is None else torch.device(device)
        stop = offset + num_positions
        if stop > TABLE_CACHE or torch.compiler.is_compiling():
            return self._angles(num_positions, offset, dtype, device)
        tables = self.__dict__.setdefault("_tables", {})  # (dtype, device) -> (cos, sin), not state
        table = tables.get((dtype, device))
        if table is None or table[0].shape[0] < stop:
            size = min(TABLE_CACHE, max(stop, 64, 2 * (0 if table is None else table[0].shape[0])))
            with torch.inference_mode(False), torch.no_grad():  # usable outside inference mode too
                table = tables[(dtype, device)] = self._angles(size, 0, dtype, device)
        return table[0][offset:stop], table[1][offset:stop]  # (num_positions, R/2) each

    def _angles(self, num_positions: int, offset: int, dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` ``(num_positions, R/2)`` computed: fp64 angles (fp32 on MPS), cast to ``dtype``."""
        work = _angle_dtype(device)
        pos = torch.arange(offset, offset + num_positions, dtype=work, device=device)
        inv_freq = self.base ** (-torch.arange(0, self.rotary_dim, 2, dtype=work, device=device)
                                 / self.rotary_dim)  # (R/2,)
        angles = pos[:, None] * inv_freq[None, :]  # (T, R/2)
        return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """Rotate ``x`` ``(..., T, D)`` as positions ``offset .. offset + T - 1``.

        Raises:
            ValueError: ``offset`` is not a non-negative int, or ``x`` is not ``(..., T, D)``.

        Example:
            >>> RotaryEmbedding(4)(torch.zeros(3, 4), offset=2).shape
            torch.Size([3, 4])
        """
        _check_input(x, self.head_dim)
        non_negative_int("offset", offset)
        cos, sin = self.cos_sin(x.shape[-2], offset=offset, dtype=x.dtype, device=x.device)
        return apply_rotary(x, cos, sin)

    def at(self, x: Tensor, positions: int | Tensor) -> Tensor:
        """Rotate ``x`` ``(B, H, T, D)`` from an int offset, or at per-token ``(B|1, T)`` positions.

        Example:
            >>> rope, x = RotaryEmbedding(4), torch.randn(2, 1, 3, 4)
            >>> torch.allclose(rope.at(x, 2), rope.at(x, torch.arange(2, 5).expand(2, 3)))
            True
        """
        if isinstance(positions, int):
            return self(x, offset=positions)
        if not has_values(positions):  # meta: only the shapes matter, any table length serves
            span = positions.shape[-1]
        else:
            span = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self.cos_sin(span, dtype=x.dtype, device=x.device)  # (span, R/2)
        return apply_rotary(x, cos[positions][:, None], sin[positions][:, None])  # (B|1, 1, T, R/2) per row

    def extra_repr(self) -> str:
        partial = f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else ""
        return f"head_dim={self.head_dim}, base={self.base}{partial}"


class QueryTemperature(nn.Module):
    """Llama 4's attention temperature tuning, as the positions part of a layer without rotary
    positions (NoPE): the query at position ``p`` is multiplied by
    ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1`` (transformers'
    ``Llama4TextAttention`` with ``attn_temperature_tuning``), so attention sharpens as the
    context grows: scale 1 up to position ``floor_scale - 2``, then a step at each multiple.
    Keys and values are unchanged; the module has no parameters. The scale is computed in fp32
    (fp64 for fp64 queries) and the product cast back to the queries' dtype, as transformers does.

    Args:
        floor_scale: the positions per step (Llama 4: 8192).
        attn_scale: the log's factor (Llama 4: 0.1), >= 0.

    Shapes:
        x: ``(B, H, T, D)`` at positions ``offset .. offset + T - 1`` or per-token ``(B|1, T)``
        positions (:meth:`at`) -> same shape.

    Example:
        >>> part = QueryTemperature(floor_scale=2, attn_scale=0.5)
        >>> part.scales(torch.arange(5))
        tensor([1.0000, 1.3466, 1.3466, 1.5493, 1.5493])
        >>> part.at(torch.ones(1, 1, 5, 2), 0)[0, 0, :, 0]
        tensor([1.0000, 1.3466, 1.3466, 1.5493, 1.5493])
    """

    def __init__(self, floor_scale: float, attn_scale: float):
        super().__init__()
        self.floor_scale = positive_number("floor_scale", floor_scale)
        if isinstance(attn_scale, bool) or not isinstance(attn_scale, (int, float)) or not (
                math.isfinite(attn_scale) and attn_scale >= 0):
            raise ValueError(f"attn_scale must be a finite number >= 0, got {attn_scale!r}")
        self.attn_scale = attn_scale

    def scales(self, positions: Tensor, dtype=torch.float32) -> Tensor:
        """The query scales at integer ``positions`` (any shape), in ``dtype``."""
        pos = positions.to(dtype)
        return torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def at(self, x: Tensor, positions: int | Tensor) -> Tensor:
        """Scale the queries ``x`` ``(B, H, T, D)`` from an int offset, or at per-token
        ``(B|1, T)`` positions.

        Example:
            >>> part, x = QueryTemperature(1, 1.0), torch.ones(2, 1, 3, 4)
            >>> torch.equal(part.at(x, 2), part.at(x, torch.arange(2, 5).expand(2, 3)))
            True
        """
        work = torch.promote_types(x.dtype, torch.float32)
        if isinstance(positions, int):
            scale = self.scales(torch.arange(positions, positions + x.shape[-2], device=x.device), work)[:, None]
        else:
            scale = self.scales(positions, work)[:, None, :, None]  # (B|1, 1, T, 1)
        return (x * scale).to(x.dtype)  # (T, 1) or (B|1, 1, T, 1) scales

    def extra_repr(self) -> str:
        return f"floor_scale={self.floor_scale}, attn_scale={self.attn_scale}"


class ALiBi(nn.Module):
    """ALiBi as a module's positions part: per-head slopes (a buffer, not saved), no rotation.

    :class:`~attnlab.nn.MultiHeadAttention` turns the slopes into a score mod
    (:func:`attnlab.scores.alibi`) at the queries' positions, so no dense bias is built.

    Example:
        >>> ALiBi(4).slopes
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = positive_int("num_heads", num_heads)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


def alibi_bias(
    num_heads: int,
    tq: int,
    tk: int | None = None,
    *,
    align: str = "bottom_right",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """ALiBi score bias ``-slope_h * |pos(i) - j|``, to pass as a float ``mask``.

    Query ``i`` sits at position ``i + tk - tq`` with ``align="bottom_right"`` (the default:
    new tokens after a KV cache) and at ``i`` with ``"top_left"``. Combine with ``causal=True``
    for decoders; without it the bias is symmetric (encoders).

    Shapes:
        returns ``(1, num_heads, tq, tk)``.

    Example:
        >>> alibi_bias(1, 2, 3)[0, 0]
        tensor([[-0.0039, -0.0000, -0.0039],
                [-0.0078, -0.0039, -0.0000]])
    """
    tk = tq if tk is None else tk
    non_negative_int("tq", tq)
    non_negative_int("tk", tk)
    one_of("align", align, ("top_left", "bottom_right"))
    offset = tk - tq if align == "bottom_right" else 0
    q_pos = torch.arange(tq, device=device)[:, None] + offset  # (Tq, 1)
    k_pos = torch.arange(tk, device=device)[None, :]  # (1, Tk)
    distance = (q_pos - k_pos).abs().to(dtype)  # (Tq, Tk)
    slopes = alibi_slopes(num_heads).to(device=device, dtype=dtype)
    return -(slopes[:, None, None] * distance)[None]  # (1, H, Tq, Tk)
