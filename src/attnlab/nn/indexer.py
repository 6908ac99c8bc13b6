"""DeepSeek-V3.2's lightning indexer (DSA): which ``k`` keys each query attends to.

A few small index heads score every (query, key) pair cheaply; each query keeps its ``k`` best keys
and the main attention runs on those only (``attnlab.attention(..., indices=...)``, O(T*k)). The
index score, as in transformers' ``DeepseekV32Indexer``, is

    ``I[t, s] = sum_h w[t, h] * ReLU(q_I[t, h] . k_I[s] / sqrt(D_I))``,  ``w = W_w x / sqrt(H_I)``,

with per-head queries ``q_I = W_q x_q`` (``x_q`` is DeepSeek's low-rank query latent, or ``x``),
one key per token ``k_I = LayerNorm(W_k x)`` shared by the heads, and the first ``rope_dim``
features of both rotated (half-split pairs as DeepSeek-V3.2; ``interleaved`` pairs as GLM-MoE-DSA).
Scores are fp32 (or fp64 for fp64 inputs). A query only indexes keys at or before it (``causal``)
and that ``mask`` allows; ``k = min(topk, Tk)``, as transformers clamps it; where a query has fewer
allowed keys than ``k``, the extra entries are ``-1`` ("no key"), which ``attention`` skips
(transformers lists masked keys there and relies on its mask; the attention is the same). Equal
scores keep the earlier key, so a prefill and a decoding step pick the same keys.

Example:
    >>> import torch, attnlab
    >>> indexer = LightningIndexer(16, heads=2, head_dim=8, topk=3)
    >>> x = torch.randn(1, 5, 16)
    >>> idx = indexer(x)                                   # (B, 1, Tq, k)
    >>> idx.shape, idx[0, 0, 0].tolist()                   # query 0 has one key: itself
    (torch.Size([1, 1, 5, 3]), [0, -1, -1])
    >>> q = k = v = torch.randn(1, 4, 5, 8)
    >>> attnlab.attention(q, k, v, indices=idx, causal=True).shape
    torch.Size([1, 4, 5, 8])
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab._checks import instance_of, non_negative_int, positive_int, positive_number
from attnlab.nn.positional import RotaryEmbedding

__all__ = ["LightningIndexer", "lightning_scores", "select_topk"]

QUERY_BLOCK = 512  # queries whose (block, Tk) index scores the indexer's forward holds at once


def lightning_scores(q: Tensor, k: Tensor, weights: Tensor) -> Tensor:
    """Index scores ``sum_h weights[h] * ReLU(q_h . k / sqrt(D))`` in fp32 (fp64 stays fp64).

    Args:
        q: index queries ``(B, Tq, H, D)``.
        k: index keys ``(B, Tk, D)``, one per token, shared by the heads.
        weights: per-query head weights ``(B, Tq, H)``.

    Returns:
        ``(B, Tq, Tk)``; differentiable (DSA trains the indexer on these scores).

    Example:
        >>> q, k = torch.ones(1, 1, 2, 4), torch.ones(1, 3, 4)
        >>> lightning_scores(q, k, torch.tensor([[[1.0, -0.5]]])).tolist()
        [[[1.0, 1.0, 1.0]]]
    """
    work = torch.promote_types(q.dtype, torch.float32)
    q, keys_t, weights = q.to(work) * q.shape[-1] ** -0.5, k.to(work).transpose(1, 2), weights.to(work)
    total = None
    for h in range(q.shape[2]):  # one head at a time: (B, Tq, Tk) at once, never (B, Tq, H, Tk)
        part = torch.matmul(q[:, :, h], keys_t).relu() * weights[:, :, h, None]  # (B, Tq, Tk)
        total = part if total is None else total + part
    return total


def select_topk(scores: Tensor, topk: int, *, mask: Tensor | None = None, causal: bool = True,
                query_start: int | None = None) -> Tensor:
    """Each query's ``min(topk, Tk)`` best keys ``(B, 1, Tq, k)``; ``-1`` where it has fewer allowed.

    Args:
        scores: ``(B, Tq, Tk)``.
        topk: keys kept per query, positive.
        mask: bool ``(B|1, Tq|1, Tk)``, True where a query may read a key (padding), or None.
        causal: query ``i`` reads keys ``<= query_start + i``.
        query_start: the first query's position among the keys (default ``Tk - Tq``: the queries
            are the last ``Tq`` positions).

    Raises:
        TypeError: ``mask`` is not a bool tensor.
        ValueError: ``topk`` not positive, ``mask`` of the wrong shape.

    Example:
        >>> select_topk(torch.tensor([[[3.0, 1.0, 2.0], [1.0, 2.0, 3.0]]]), 2, causal=False).tolist()
        [[[[0, 2], [2, 1]]]]
    """
    positive_int("topk", topk)
    B, Tq, Tk = scores.shape
    allowed = torch.ones(1, Tq, Tk, dtype=torch.bool, device=scores.device)
    if causal:
        allowed = allowed.tril(Tk - Tq if query_start is None else non_negative_int("query_start", query_start))
    if mask is not None:
        allowed = allowed & _check_mask(mask, B, Tq, Tk)
    # A stable sort, not topk: equal scores (ReLU heads give many zeros) keep the earlier key, so a
    # query picks the same keys whether its row is a prefill's (masked past its position) or a decoding step's.
    values, order = scores.detach().masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True, stable=True)
    k = min(topk, Tk)
    return order[..., :k].masked_fill(values[..., :k] == float("-inf"), -1).unsqueeze(1)  # (B, 1, Tq, k)


def _check_mask(mask: object, B: int, Tq: int, Tk: int) -> Tensor:
    instance_of("mask", mask, Tensor, "a bool tensor (B|1, Tq|1, Tk)")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = may read the key), got dtype {mask.dtype}")
    shape = tuple(mask.shape)
    if mask.ndim != 3 or shape[0] not in (1, B) or shape[1] not in (1, Tq) or shape[2] != Tk:
        raise ValueError(f"mask must be (B|1, Tq|1, Tk) = ({B}|1, {Tq}|1, {Tk}), got shape {shape}")
    return mask


class LightningIndexer(nn.Module):
    """DSA's lightning indexer (module docstring): projections, index scores, top-k.

    The forward scores :data:`QUERY_BLOCK` queries at a time, so choosing the keys holds
    ``(B, QUERY_BLOCK, Tk)`` scores, not ``(B, T, Tk)``; :meth:`scores` returns them all.

    **Parameters** (transformers' names): ``wq_b`` ``(H*D, query_dim)``, ``wk`` ``(D, d_model)``,
    ``k_norm`` LayerNorm(D, eps 1e-6), ``weights_proj`` ``(H, d_model)``; no biases.

    Shapes:
        x: ``(B, T, d_model)``; query_input: ``(B, T, query_dim)``; past_keys ``(B, Tp, D)`` ->
        indices ``(B, 1, T, k)`` over the ``Tp + T`` keys (queries at positions ``Tp..Tp+T-1``).

    Args:
        d_model: features of ``x``.
        heads: index heads ``H``.
        head_dim: ``D``, at least ``rope_dim``.
        topk: keys kept per query (``index_topk``).
        query_dim: features of ``query_input`` (DeepSeek's ``q_lora_rank``); default ``d_model``.
        rope_dim: leading features of each index query and key that are rotated (even, may be 0).
        rope_base: the rotary wavelength base.
        interleaved: rotate pairs ``(2i, 2i+1)`` (GLM-MoE-DSA) instead of ``(i, i+rope_dim/2)``.

    Example:
        >>> indexer = LightningIndexer(8, heads=2, head_dim=4, topk=2, rope_dim=2)
        >>> x = torch.randn(1, 3, 8)
        >>> past = indexer.keys(x[:, :2])                         # a decoder's index-key cache
        >>> torch.equal(indexer(x[:, 2:], past_keys=past), indexer(x)[:, :, 2:])
        True
    """

    def __init__(self, d_model: int, *, heads: int, head_dim: int, topk: int, query_dim: int | None = None,
                 rope_dim: int = 0, rope_base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        for name, value in (("d_model", d_model), ("heads", heads), ("head_dim", head_dim), ("topk", topk)):
            positive_int(name, value)
        query_dim = d_model if query_dim is None else positive_int("query_dim", query_dim)
        non_negative_int("rope_dim", rope_dim)
        if rope_dim % 2 or rope_dim > head_dim:
            raise ValueError(f"rope_dim must be even and at most head_dim={head_dim}, got {rope_dim}")
        self.heads, self.head_dim, self.topk, self.rope_dim = heads, head_dim, topk, rope_dim
        self.interleaved = bool(interleaved)
        self.rope = RotaryEmbedding(rope_dim, base=positive_number("rope_base", rope_base)) if rope_dim else None
        self.wq_b = nn.Linear(query_dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(d_model, heads, bias=False)

    def _rotate(self, x: Tensor, offset: int) -> Tensor:
        """Rotate the first ``rope_dim`` features of ``x`` ``(B, T, ..., D)`` at positions ``offset..``."""
        if self.rope is None:
            return x
        rot, rest = x[..., :self.rope_dim], x[..., self.rope_dim:]
        if self.interleaved:  # pairs (2i, 2i+1) laid out as (evens, odds): then half-split pairs
            rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        heads_last = rot.movedim(1, -2)  # (B, ..., T, rope_dim)
        rot = self.rope(heads_last, offset=offset).movedim(-2, 1)  # (B, T, ..., rope_dim)
        return torch.cat([rot, rest], dim=-1)

    def keys(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """Index keys ``(B, T, D)`` of ``x`` ``(B, T, d_model)`` at positions ``offset..``: what a cache holds.

        Example:
            >>> LightningIndexer(8, heads=2, head_dim=4, topk=2).keys(torch.randn(2, 3, 8)).shape
            torch.Size([2, 3, 4])
        """
        _check_input("x", x, self.wk.in_features)
        return self._rotate(self.k_norm(self.wk(x)), non_negative_int("offset", offset))  # (B, T, D)

    def scores(self, x: Tensor, *, query_input: Tensor | None = None, past_keys: Tensor | None = None) -> Tensor:
        """Index scores ``(B, T, Tp + T)`` (see :func:`lightning_scores`); no mask applied.

        Example:
            >>> LightningIndexer(8, heads=2, head_dim=4, topk=2).scores(torch.randn(1, 3, 8)).shape
            torch.Size([1, 3, 3])
        """
        return lightning_scores(*self._parts(x, query_input, past_keys))

    def _parts(self, x: Tensor, query_input: Tensor | None, past_keys: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Checked inputs -> index queries ``(B, T, H, D)``, keys ``(B, Tp + T, D)``, head weights ``(B, T, H)``."""
        _check_input("x", x, self.wk.in_features)
        B, T, _ = x.shape
        source = x if query_input is None else query_input
        _check_input("query_input", source, self.wq_b.in_features, (B, T))
        past = 0 if past_keys is None else _check_input("past_keys", past_keys, self.head_dim, (B,)).shape[1]
        q = self._rotate(self.wq_b(source).view(B, T, self.heads, self.head_dim), past)  # (B, T, H, D)
        k = self.keys(x, offset=past)
        if past_keys is not None:
            k = torch.cat([past_keys.to(k.dtype), k], dim=1)  # (B, Tp + T, D)
        weights = self.weights_proj(x).to(torch.promote_types(x.dtype, torch.float32)) * self.heads ** -0.5  # (B, T, H)
        return q, k, weights

    def forward(self, x: Tensor, *, query_input: Tensor | None = None, past_keys: Tensor | None = None,
                mask: Tensor | None = None, causal: bool = True) -> Tensor:
        """Top-k key indices ``(B, 1, T, k)`` (int64, -1 = no key) for ``attnlab.attention(indices=...)``.

        Args:
            x: ``(B, T, d_model)``.
            query_input: the queries' source ``(B, T, query_dim)``; default ``x``.
            past_keys: earlier positions' index keys ``(B, Tp, D)`` (from :meth:`keys`), or None.
            mask: bool ``(B|1, T|1, Tp + T)``, True where a query may read a key, or None.
            causal: a query indexes only keys at or before its position.

        Example:
            >>> LightningIndexer(8, heads=2, head_dim=4, topk=5)(torch.randn(2, 3, 8)).shape  # k = min(5, 3)
            torch.Size([2, 1, 3, 3])
        """
        with torch.no_grad():
            q, k, weights = self._parts(x, query_input, past_keys)
        T, Tk = q.shape[1], k.shape[1]
        if mask is not None:
            _check_mask(mask, x.shape[0], T, Tk)
        chosen = []
        for start in range(0, T, QUERY_BLOCK):  # the scores of one block of queries at a time: O(block * Tk)
            rows = slice(start, min(T, start + QUERY_BLOCK))
            with torch.no_grad():
                scores = lightning_scores(q[:, rows], k, weights[:, rows])  # (B, block, Tk)
            block_mask = None if mask is None else mask[:, rows] if mask.shape[1] == T else mask
            chosen.append(select_topk(scores, self.topk, mask=block_mask, causal=causal, query_start=Tk - T + start))
        return torch.cat(chosen, dim=2) if chosen else select_topk(q.new_zeros(x.shape[0], 0, Tk), self.topk)

    def extra_repr(self) -> str:
        return (f"d_model={self.wk.in_features}, heads={self.heads}, head_dim={self.head_dim}, topk={self.topk}, "
                f"query_dim={self.wq_b.in_features}, rope_dim={self.rope_dim}, interleaved={self.interleaved}")


def _check_input(name: str, x: object, features: int, lead: tuple = ()) -> Tensor:
    """``x`` if it is a floating-point ``(B, T, features)`` tensor whose leading sizes are ``lead``."""
    instance_of(name, x, Tensor, "a torch.Tensor")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")
    if x.ndim != 3 or x.shape[-1] != features or tuple(x.shape[:len(lead)]) != lead:
        want = ", ".join([*map(str, lead), *("B", "T")[len(lead):], str(features)])
        raise ValueError(f"{name} must be ({want}), got shape {tuple(x.shape)}")
    return x
