"""Cross-layer KV sharing (Gemma 3n, Gemma 4): later layers attend with an earlier layer's keys and values.

With ``num_kv_shared_layers = N`` the last ``N`` layers of a stack project no keys or values of
their own (no key/value weights): each reads those of the last earlier layer of its own kind
that is not shared (:func:`kv_sharing_plan`, transformers' ``kv_sharing_modes`` rule; a local
layer reads a local one, a global one a global one). In one call the source layer attends first
and hands what it attended with to its readers through a :class:`KVShare`: its keys and values
(with a cache: everything cached it may see, this call's tokens included; the cache is written
once per step, by the source) and the positions of this call's queries. A reader is a
:class:`SharedKVAttention`: a :class:`~attnlab.nn.MultiHeadAttention` with the query projection
only, whose own rule (causal, window, chunk, softcap, sinks, rotary queries) runs over those keys.

Example:
    >>> kv_sharing_plan("LGLG", 2)      # layers 2 (L) and 3 (G) read layers 0 (L) and 1 (G)
    (None, None, 0, 1)
    >>> source = MultiHeadAttention(8, 8, num_heads=2, positions="rope")
    >>> reader = SharedKVAttention(8, 8, num_heads=2, positions="rope")
    >>> share, x = KVShare(), torch.randn(1, 3, 8)
    >>> _ = source(x, kv=share)          # fills share with its keys and values
    >>> reader(x, kv=share).shape, reader.in_proj_weight.shape   # the query rows only
    (torch.Size([1, 3, 8]), torch.Size([8, 8]))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
import torch
from torch import Tensor, nn

from attnlab.nn.multihead import (MultiHeadAttention, _batch_inputs, _check_documents, _combine_masks, _mask_parts,
                                  _with_documents, causal_rule)
from attnlab.nn.parts import KVShare
from attnlab.nn.positional import QueryTemperature

__all__ = ["KVShare", "SharedKVAttention", "kv_shares", "kv_sharing_plan"]


def kv_sharing_plan(kinds: Sequence[str], num_shared: object, *, shareable: str = "GLCN",
                    heads: Sequence[int] | None = None, name: str = "num_kv_shared_layers") -> tuple[int | None, ...]:
    """Each layer's source layer (None: it computes its own keys and values) for ``num_shared`` shared layers.

    Gemma 3n's and Gemma 4's rule: the last ``num_shared`` layers read the last earlier layer of
    their own letter among the first ``len(kinds) - num_shared`` (none of them shared).

    Args:
        kinds: each layer's letter (:data:`attnlab.models.gpt.LAYER_TABLE`).
        num_shared: the shared layers, ``0 <= num_shared < len(kinds)``.
        shareable: the letters whose keys and values are plain per-token heads (the others are
            refused: latent, recurrent, compressed, sparse layers make theirs their own way).
        heads: each layer's head count; a reader must have its source's.
        name: the option the errors name.

    Raises:
        ValueError: ``num_shared`` out of range, a shared layer's letter not shareable, no earlier
            layer of its letter, or head counts that differ.
        TypeError: ``num_shared`` not an int.

    Example:
        >>> kv_sharing_plan("LLLLG", 0)
        (None, None, None, None, None)
        >>> kv_sharing_plan("LLLLG" * 2, 4)[6:]     # layers 6-8 (L) read layer 5, layer 9 (G) layer 4
        (5, 5, 5, 4)
        >>> kv_sharing_plan("LLLLG", 3)
        Traceback (most recent call last):
        ...
        ValueError: num_kv_shared_layers=3: shared layer 4 ('G') has no earlier 'G' layer among the first 2 to read keys and values from
    """
    if isinstance(num_shared, bool) or not isinstance(num_shared, int):
        raise TypeError(f"{name} must be an int, got {type(num_shared).__name__} {num_shared!r}")
    layers = len(kinds)
    if not 0 <= num_shared < layers:
        raise ValueError(f"{name} must be in [0, num_layers - 1] = [0, {layers - 1}] (at least one "
                         f"layer computes keys and values), got {num_shared}")
    first = layers - num_shared
    last = {letter: layer for layer, letter in enumerate(kinds[:first])}  # each letter's last unshared layer
    plan: list[int | None] = [None] * layers
    for layer in range(first, layers):
        letter = kinds[layer]
        if letter not in shareable:
            raise ValueError(f"{name}={num_shared}: layer {layer} is {letter!r}, whose keys and values "
                             f"are not plain heads; only {', '.join(repr(k) for k in shareable)} layers share theirs")
        if letter not in last:
            raise ValueError(f"{name}={num_shared}: shared layer {layer} ({letter!r}) has no earlier "
                             f"{letter!r} layer among the first {first} to read keys and values from")
        plan[layer] = last[letter]
        if heads is not None and heads[layer] != heads[plan[layer]]:
            raise ValueError(f"{name}={num_shared}: layer {layer} has {heads[layer]} heads and its "
                             f"source layer {plan[layer]} {heads[plan[layer]]}; a shared layer needs its source's heads")
    return tuple(plan)


def kv_shares(plan: Sequence[int | None]) -> list[KVShare | None]:
    """A fresh :class:`KVShare` for each source layer of ``plan``, given to it and to its readers (None elsewhere).

    Example:
        >>> shares = kv_shares((None, None, 0))
        >>> shares[0] is shares[2], shares[1]
        (True, None)
    """
    made = {source: KVShare() for source in plan if source is not None}
    return [made[source] if source is not None else made.get(layer) for layer, source in enumerate(plan)]


class SharedKVAttention(MultiHeadAttention):
    """Multi-head attention over another layer's keys and values: a query projection, no key/value ones.

    Built like :class:`~attnlab.nn.MultiHeadAttention` (self-attention: ``d_in`` inputs, its
    ``pattern``, ``positions``, ``softcap``, ``sinks``, ``qkv``'s ``num_kv_heads``, bias and a
    QK-norm, of which only the query norm exists), its ``in_proj_weight`` ``(d_q, d_in)`` (``d_q``: heads times head width) holds
    the query rows only. :meth:`forward` takes ``kv=``, a :class:`KVShare` its source layer filled
    in the same call; the queries are rotated at the positions the source gives. It holds no
    cache (its source's cache serves it).

    Shapes:
        x: ``(B, Tq, d_in)`` or ``(Tq, d_in)`` -> ``(B, Tq, d_out)``; the share's keys
        ``(B, num_kv_heads, Tk, head_dim)``.

    Example:
        >>> reader = SharedKVAttention(8, 8, num_heads=2)
        >>> reader.projection("key")
        Traceback (most recent call last):
        ...
        ValueError: part='key': a SharedKVAttention has no key/value projections; it reads its source layer's
    """

    def _make_projections(self, qkv_bias: bool) -> None:
        self.in_proj_weight = nn.Parameter(torch.empty(self.d_q, self.d_in))  # the query rows only
        self.in_proj_bias = nn.Parameter(torch.empty(self.d_q)) if qkv_bias else None
        self._reset_qkv()

    def _reset_qkv(self) -> None:
        with torch.no_grad():  # nn.Linear's initialisation of the query projection
            nn.init.kaiming_uniform_(self.in_proj_weight, a=math.sqrt(5))
            if self.in_proj_bias is not None:
                nn.init.uniform_(self.in_proj_bias, -1.0 / math.sqrt(self.d_in), 1.0 / math.sqrt(self.d_in))

    def _make_qk_norm(self, part: object) -> None:
        super()._make_qk_norm(part)
        self.k_norm = None  # the keys come normed from the source

    def projection(self, part: str) -> tuple[Tensor, Tensor | None]:
        """``(weight, bias)`` of the ``"query"`` projection; a ``ValueError`` for the others."""
        if part != "query":
            raise ValueError(f"part={part!r}: a SharedKVAttention has no key/value projections; it reads its "
                             "source layer's")
        return self.in_proj_weight, self.in_proj_bias

    def project_qkv(self, x: Tensor):
        raise ValueError("a SharedKVAttention projects queries only (project_q); its keys and values are its "
                         "source layer's")

    project_kv = project_qkv

    def new_cache(self, *args, **kwargs):
        raise ValueError("a SharedKVAttention holds no cache: it reads its source layer's (GPT.new_cache gives it "
                         "the source's cache object)")

    def forward(self, x: Tensor, *, context: Tensor | None = None, mask=None, cache=None,
                return_weights: bool = False, value_input: Tensor | None = None,
                kv: KVShare | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x``'s queries to the keys and values of ``kv`` (see the class docstring).

        Raises:
            ValueError: ``kv`` missing or not filled by its source in this call, or of other heads or
                batch; ``context``, ``value_input`` or ``cache`` given; a sharded attention part.
        """
        refused = [name for name, value in (("context", context), ("value_input", value_input), ("cache", cache))
                   if value is not None]
        if refused or getattr(self.attention, "shards", False):
            raise ValueError(f"a SharedKVAttention is self-attention over its source's keys, without a cache of its "
                             f"own or a sharded part; got {', '.join(refused) or repr(self.attention)}")
        if not isinstance(kv, KVShare) or not kv.filled:
            raise ValueError(f"kv must be a KVShare its source layer filled in this call (GPT does this), got {kv!r}")
        self._check_inputs(x, None, None)
        mask, padding_mask, document_ids = _mask_parts(mask, self.causal)
        unbatched = x.ndim == 2
        x, _, _, mask, padding_mask = _batch_inputs(x, None, None, mask, padding_mask, unbatched)
        B, Tq, _ = x.shape
        keys, values = kv.keys, kv.values
        if keys.shape[0] != B or keys.shape[1] != self.num_kv_heads or keys.shape[-1] != self.head_dim:
            raise ValueError(f"kv holds keys {tuple(keys.shape)}; this layer needs (B={B}, {self.num_kv_heads}, Tk, "
                             f"{self.head_dim})")
        documents = _check_documents(document_ids, x, None, None, "documents (CallMask(documents=...))")
        if documents is not None:
            mask = _with_documents(mask, documents, tq=Tq)
        mask = _combine_masks(mask, padding_mask, batch=B, tk=keys.shape[-2])
        score_mod = self._score_mod(kv.positions if isinstance(kv.positions, int) else 0, False)
        q = self.project_q(x)  # (B, H, Tq, hd)
        if self.rope is not None:
            q = self.rope.at(q, kv.positions)
        elif isinstance(self.positions, QueryTemperature):  # Llama 4's NoPE layers: scaled at the same positions
            q = self.positions.at(q, kv.positions)
        keys, values, rule = causal_rule(q, keys, values, mask=mask, causal=self.causal, window=self.window,
                                         chunk=self.chunk, key_lengths=kv.lengths,
                                         keep_keys=return_weights or score_mod is not None)
        result = self.attention(q, keys, values, **rule, dropout_p=self.dropout_p if self.training else 0.0,
                                backend=self.backend, return_weights=return_weights, score_mod=score_mod,
                                sinks=self.sinks)  # (B, H, Tq, hd), weights (B, H, Tq, Tk)
        out, weights = result if return_weights else (result, None)
        out = self.out_proj(out.transpose(1, 2).reshape(B, Tq, self.d_q))  # (B, Tq, d_out)
        if unbatched:
            out, weights = out[0], None if weights is None else weights[0]
        return (out, weights) if return_weights else out
