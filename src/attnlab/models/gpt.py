"""A decoder-only (GPT) language model built from attnlab modules, with ``generate``.

:class:`GPT` is a token embedding, learned or rotary positions, pre-norm
:class:`~attnlab.nn.TransformerBlock` s (causal; optionally attention-only, optionally with
grouped-query attention), a final LayerNorm and an output projection tied to the token
embedding. :meth:`GPT.generate` decodes greedily or by sampling, with a KV cache by default.
:meth:`GPT.from_pretrained` reads attnlab's own directories (:meth:`GPT.save_pretrained`) and
Hugging Face GPT-2 directories (``config.json`` + ``model.safetensors``; the ``Conv1D``
weights, stored ``(in, out)``, are transposed into ``nn.Linear``'s ``(out, in)``). Nothing is
ever downloaded or unpickled.

Example:
    >>> model = GPT(vocab_size=20, max_len=16, d_model=16, num_layers=2, num_heads=2)
    >>> model(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 20])
    >>> model.generate(torch.tensor([[1, 2, 3]]), 4).shape
    torch.Size([1, 7])
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import io as _io
from attnlab._checks import (divisible, finite_number, instance_of, one_of, per_layer, positive_int,
                             probability, same_device)
from attnlab.models import _hub, _inputs
from attnlab import masks as _masks
from attnlab.nn.blocks import TransformerBlock
from attnlab.nn.cache import Cache, KVCache, RecurrentCache, _restore_on_error, new_positions
from attnlab.nn.compressed import CompressedAttention, CompressedCache, model_sizes
from attnlab.nn.differential import DifferentialAttention
from attnlab.nn.gated import GatedAttention
from attnlab.nn.kv_sharing import kv_shares, kv_sharing_plan
from attnlab.nn.latent import LatentAttention
from attnlab.nn.multihead import QKNorm, _check_documents, _check_padding_type
from attnlab.nn.native_sparse import NativeSparseAttention, paper_sizes
from attnlab.nn.positional import LearnedPositionalEmbedding, QueryTemperature, RotaryEmbedding
from attnlab.nn.recurrent import DecayedLinearAttention, GatedDeltaNet, KimiDeltaAttention
from attnlab.nn.topk_attention import TopkAttention

__all__ = ["GPT"]

MODEL_TYPE = "attnlab-gpt"  # config.json's model_type for attnlab's own layout
POSITIONS = ("learned", "rope", "alibi")


class LayerKind(NamedTuple):
    """One ``layer_pattern`` letter: its name, the GPT option its layers need (and only they take),
    whether ``positions="rope"``/``"alibi"`` acts in its layers (False: NoPE), the attention
    module its layers are built with (None: the block's own multi-head attention), whether
    they return one weight matrix (``return_weights``) and take attention dropout, and the other
    GPT options they need (``extra``; an option may be needed by several letters)."""

    name: str
    option: str | None = None
    positions: bool = True
    module: str | None = None
    weights: bool = True
    dropout: bool = True
    extra: tuple[str, ...] = ()

    @property
    def options(self) -> tuple[str, ...]:
        """Every GPT option this letter's layers need."""
        return ((self.option,) if self.option else ()) + self.extra


# layer_pattern letters, the one table every letter goes through (a new letter is a new row).
LAYER_TABLE = {
    "G": LayerKind("global"),
    "L": LayerKind("local (sliding window)", "window"),
    "M": LayerKind("latent (MLA)", "latent_dim", module="latent"),
    "C": LayerKind("chunked local", "chunk"),
    "N": LayerKind("global without positions (NoPE)", positions=False),
    "D": LayerKind("differential (DiffLlama)", module="differential", weights=False, dropout=False),
    "Q": LayerKind("gated output (Qwen3-Next)", module="gated", weights=False),
    "T": LayerKind("sparse top-k (DSA)", "topk", module="topk", weights=False, dropout=False),
    "S": LayerKind("native sparse (NSA)", "nsa_block", module="native_sparse", weights=False, dropout=False),
    "R": LayerKind("Gated DeltaNet (Qwen3.5)", positions=False, module="gated_delta", weights=False, dropout=False),
    "K": LayerKind("Kimi Delta Attention (KDA)", positions=False, module="kda", weights=False, dropout=False),
    "A": LayerKind("linear attention (additive rule)", positions=False, module="linear", weights=False, dropout=False),
    "V": LayerKind("compressed sparse (DeepSeek-V4 CSA)", "compress_rate", module="csa", weights=False,
                   dropout=False, extra=("window", "topk")),
    "H": LayerKind("heavily compressed (DeepSeek-V4 HCA)", "compress_rate", module="hca", weights=False,
                   dropout=False, extra=("window",)),
}
LAYER_KINDS = {letter: kind.name for letter, kind in LAYER_TABLE.items()}  # letter -> its name
# transformers' activation_function names -> attnlab FeedForward activations.
_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                   "relu": "relu", "silu": "silu"}
_GPT2_FIELDS = {"vocab_size": int, "n_positions": int, "n_embd": int, "n_layer": int, "n_head": int,
                "layer_norm_epsilon": float, "activation_function": str}
# config.json size -> the tensor (transformers' names, ``transformer.`` removed) that holds it.
_GPT2_SIZES = {"vocab_size": _hub.Dim("wte.weight", 0), "n_embd": _hub.Dim("wte.weight", 1),
               "n_positions": _hub.Dim("wpe.weight", 0), "n_layer": _hub.Count("h."), "n_head": None}
# config.json flags whose other value changes the model into one attnlab's GPT is not (absent: the value shown).
_GPT2_NEEDED = {"scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False, "scale_attn_weights": True}
_GPT2_BUFFER = re.compile(r"h\.\d+\.attn\.(masked_)?bias")  # causal-mask buffers older transformers saved
V = TypeVar("V")
_INIT_STD = 0.02  # GPT-2's embedding init; torch's N(0, 1) makes tied logits huge at the start


class GPT(nn.Module):
    """Decoder-only transformer: embeddings, causal pre-norm attnlab blocks, tied output layer.

    Shapes:
        input_ids: ``(B, T)`` int -> logits ``(B, T, vocab_size)``; with ``return_weights``
        also one ``(B, H_l, T, Tk)`` weight tensor per layer (``H_l``: that layer's heads).

    Args:
        vocab_size: number of token ids.
        max_len: longest sequence (prompt + generated tokens) the model takes.
        d_model: width of the residual stream.
        num_layers: depth.
        num_heads: heads of every layer (an int), or one count per layer (a sequence of
            ``num_layers`` ints, e.g. ``(2, 1)``); each must divide ``d_model`` in the layers whose
            heads have no width of their own (``head_dim``, ``global_head_dim``). A sequence is
            stored in :attr:`config` as a list, an int as an int.
        num_kv_heads: grouped-query key/value heads (default: each layer's ``num_heads``); must
            divide every layer's head count.
        d_ff: MLP hidden width (default ``4 * d_model``).
        attention_only: blocks without MLP (for circuit studies such as induction heads).
        positions: ``"learned"`` (GPT-2's absolute embeddings), ``"rope"`` (rotary, in attention)
            or ``"alibi"`` (a linear distance penalty on the scores, BLOOM's; no embedding).
        softcap: cap attention scores with ``softcap * tanh(score / softcap)`` (Gemma 2), or None.
        sinks: a learnable sink logit per head in every layer (gpt-oss).
        rope_fraction: partial RoPE (``positions="rope"`` only): rotate the first
            ``rope_fraction * head_dim`` features of each head, which must be an even int in every
            layer (Qwen3.5: 0.25); the rest carry no position. None: the whole head.
        qk_norm: QK-norm of the multi-head layers, an RMSNorm of ``norm_eps`` with a learnable weight
            after the projections and before the rotation (:class:`~attnlab.nn.QKNorm`), in one of
            three forms: ``True`` or ``"qwen3"`` (each query and key head, ``weight``), ``"gemma"``
            (each head, ``1 + weight``: Gemma 3, Qwen3.5) or ``"olmo2"`` (a token's whole query and
            whole key projection at once). False: none.
        head_dim: the head width of every multi-head layer (``G``, ``L``, ``C``, ``N``; the layers
            with their own attention module refuse it): queries project to ``heads * head_dim``,
            keys and values to ``num_kv_heads * head_dim``, the output back to ``d_model``
            (``QKV(head_dim=)``). None: ``d_model // heads``.
        global_head_dim: the ``G`` layers' head width, over ``head_dim`` (Gemma 4: 512 on its
            full-attention layers, ``head_dim=256`` on its sliding ones).
        nope_temperature: ``(floor_scale, attn_scale)``: Llama 4's attention temperature tuning on
            the ``N`` layers (:class:`~attnlab.nn.QueryTemperature`; Llama 4: ``(8192, 0.1)``):
            the query at position ``p`` scaled by ``log(floor((p + 1) / floor_scale) + 1) *
            attn_scale + 1``. None: no scaling.
        dropout_p: embedding, attention and residual dropout (training only).
        bias: biases in the linear layers.
        norm_eps: LayerNorm epsilon.
        activation: the MLP activation (``"gelu_tanh"`` is GPT-2's).
        tie_embeddings: the output projection shares the token embedding's weight.
        backend: attention backend (``"auto"``).
        layer_pattern: each layer's attention, one letter per layer, repeated over the depth
            (``"LLLLLG"``: five local layers to one global, Gemma 3's pattern): ``G`` global
            (``num_heads``/``num_kv_heads`` causal attention), ``L`` local (the same with a causal
            sliding ``window``; its cache is a :class:`~attnlab.nn.WindowedKVCache`), ``M``
            multi-head latent attention (:class:`~attnlab.nn.LatentAttention` of ``latent_dim``),
            ``C`` chunked local (causal within blocks of ``chunk`` tokens, Llama 4's local layers;
            its cache is a :class:`~attnlab.nn.ChunkedKVCache` of ``chunk`` slots), ``N`` global
            without positions (NoPE: ``positions="rope"``/``"alibi"`` act in the other layers, not
            in these; learned positions, added to the input, reach every layer), ``D`` differential
            (:class:`~attnlab.nn.DifferentialAttention`), ``Q`` gated output
            (:class:`~attnlab.nn.GatedAttention`), ``T`` sparse top-k (:class:`~attnlab.nn.TopkAttention`,
            DeepSeek-V3.2's DSA: each query attends to the ``topk`` keys a lightning indexer picks; in
            training the indexer learns from its KL loss, added to the model's loss) and ``S`` native
            sparse attention (:class:`~attnlab.nn.NativeSparseAttention` sized by ``nsa_block``);
            ``R`` Gated DeltaNet (:class:`~attnlab.nn.GatedDeltaNet`) and ``K`` Kimi Delta Attention
            (:class:`~attnlab.nn.KimiDeltaAttention`), linear-attention layers: no positions (NoPE), no
            weights, no attention dropout, ``num_heads`` value heads and ``num_kv_heads`` query/key heads
            (the grouped value heads of Qwen3.5), a constant-size :class:`~attnlab.nn.RecurrentCache`.
            ``A`` is plain causal linear attention (:class:`~attnlab.nn.DecayedLinearAttention` with
            ``decay="none"``: no decay, no delta rule; the same cache), the baseline that fails
            associative recall once the pairs outnumber its state's room.
            Llama 4's text model is ``"CCCN"``, Qwen3.5's ``"RRRQ"`` and Kimi Linear's ``"KKKM"``.
            ``V`` compressed sparse (DeepSeek-V4's CSA) and ``H`` heavily compressed (HCA) layers are
            :class:`~attnlab.nn.CompressedAttention` s sized by :func:`~attnlab.nn.compressed.model_sizes`
            (one key/value head whatever ``num_kv_heads``, their own rotary whatever ``positions``, no
            biases whatever ``bias``, no attention dropout): every ``compress_rate`` tokens pooled into
            one entry, a sliding ``window`` and a sink; a ``V`` query reads its ``topk`` best entries
            (a lightning indexer picks them), an ``H`` query every closed one. Their cache is a
            :class:`~attnlab.nn.CompressedCache`; they take no ``padding_mask``, ``document_ids`` or
            ``page_size`` (rows of one length). V4 alternates them: ``"VH"``.
            Default: every layer ``G``.
        window: the local layers' sliding window (keys per query, the query's own included); the
            ``V``/``H`` layers' window too.
        chunk: the ``C`` layers' chunk (tokens per block; a query sees its block's earlier keys).
        latent_dim: the ``M`` layers' latent width.
        latent_rope_dim: the ``M`` layers' decoupled rotary width (default: half a head, even).
        topk: the ``T`` layers' keys per query; the ``V`` layers' compressed entries per query.
        nsa_block: the ``S`` layers' selection block ``l'`` (a multiple of 4); the rest keeps the
            NSA paper's proportions: compressed blocks of ``l'/2`` tokens every ``l'/4``, 16 selected
            blocks (block 0 and the 2 newest among them) and a window of ``8 l'`` tokens
            (``nsa_block=64`` is the paper's 32, 16, 64, 16, 512).
        compress_rate: the ``V``/``H`` layers' tokens per compressed entry (DeepSeek-V4: 4 for CSA,
            128 for HCA; one rate for both here).
        num_kv_shared_layers: cross-layer KV sharing (Gemma 3n, Gemma 4): the last this many layers
            have no key/value projections and attend with the keys and values of the last earlier
            layer of their own letter that is not shared (:func:`~attnlab.nn.kv_sharing.kv_sharing_plan`;
            ``G``, ``L``, ``C``, ``N`` layers, each with its source's head count). Their cache is
            their source's cache object (:meth:`new_cache`), written once per step. 0: none.

    Attributes:
        config: the constructor's arguments, as saved in ``config.json``.
        extra: other ``config.json`` entries of a loaded directory (e.g. a text model's vocabulary).

    Example:
        >>> model = GPT(vocab_size=10, max_len=8, d_model=8, num_layers=2, num_heads=2,
        ...             attention_only=True, positions="rope")
        >>> logits, weights = model(torch.tensor([[1, 2, 3]]), return_weights=True)
        >>> logits.shape, len(weights), weights[0].shape
        (torch.Size([1, 3, 10]), 2, torch.Size([1, 2, 3, 3]))
        >>> ragged = GPT(vocab_size=10, max_len=8, d_model=8, num_layers=2, num_heads=(2, 1))
        >>> [w.shape[1] for w in ragged(torch.tensor([[1, 2, 3]]), return_weights=True)[1]]
        [2, 1]
        >>> mixed = GPT(vocab_size=10, max_len=8, d_model=8, num_layers=3, num_heads=2,
        ...             layer_pattern="LGM", window=2, latent_dim=4)
        >>> [type(c).__name__ for c in mixed.new_cache(1)]
        ['WindowedKVCache', 'KVCache', 'KVCache']
        >>> llama4 = GPT(vocab_size=10, max_len=8, d_model=8, num_layers=4, num_heads=2,
        ...              positions="rope", layer_pattern="CCCN", chunk=4)
        >>> [type(c).__name__ for c in llama4.new_cache(1)], llama4.blocks[3].attn.rope
        (['ChunkedKVCache', 'ChunkedKVCache', 'ChunkedKVCache', 'KVCache'], None)
        >>> gemma4 = GPT(vocab_size=10, max_len=8, d_model=8, num_layers=2, num_heads=2, layer_pattern="LG",
        ...              window=4, head_dim=16, global_head_dim=32, qk_norm="gemma")
        >>> [block.attn.head_dim for block in gemma4.blocks], gemma4.blocks[1].attn.out_proj.weight.shape
        ([16, 32], torch.Size([8, 64]))
        >>> qwen35 = GPT(vocab_size=10, max_len=8, d_model=8, num_layers=4, num_heads=2, layer_pattern="RRRQ")
        >>> [type(c).__name__ for c in qwen35.new_cache(1)]
        ['RecurrentCache', 'RecurrentCache', 'RecurrentCache', 'KVCache']
    """

    def __init__(
        self, vocab_size: int, *, max_len: int = 256, d_model: int = 128, num_layers: int = 2,
        num_heads: int | Sequence[int] = 4, num_kv_heads: int | None = None, d_ff: int | None = None,
        attention_only: bool = False, positions: str = "learned", dropout_p: float = 0.0, bias: bool = True,
        norm_eps: float = 1e-5, activation: str = "gelu_tanh", tie_embeddings: bool = True,
        backend: str = "auto",
        layer_pattern: str | None = None, window: int | None = None, latent_dim: int | None = None,
        latent_rope_dim: int | None = None, softcap: float | None = None, sinks: bool = False,
        chunk: int | None = None, topk: int | None = None, nsa_block: int | None = None,
        compress_rate: int | None = None, rope_fraction: float | None = None, qk_norm: bool | str = False,
        head_dim: int | None = None, global_head_dim: int | None = None,
        nope_temperature: Sequence[float] | None = None, num_kv_shared_layers: int = 0,
    ):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("max_len", max_len), ("d_model", d_model),
                            ("num_layers", num_layers)):
            positive_int(name, value)
        sizes = {"window": window, "latent_dim": latent_dim, "chunk": chunk, "topk": topk, "nsa_block": nsa_block,
                 "compress_rate": compress_rate}
        kinds = _layer_kinds(layer_pattern, num_layers, sizes, latent_rope_dim)
        head_dims = _head_dims(kinds, layer_pattern, head_dim, global_head_dim)
        heads = _check_heads(num_heads, num_layers, d_model, num_kv_heads, head_dims)
        one_of("positions", positions, POSITIONS)
        probability("dropout_p", dropout_p)
        for name, value in (("attention_only", attention_only), ("tie_embeddings", tie_embeddings), ("bias", bias)):
            instance_of(name, value, bool, "a bool")
        self.config = dict(  # an int num_heads is saved as an int: older readers expect one
            vocab_size=vocab_size, max_len=max_len, d_model=d_model, num_layers=num_layers,
            num_heads=num_heads if isinstance(num_heads, int) else list(heads), num_kv_heads=num_kv_heads,
            d_ff=d_ff, attention_only=attention_only,
            positions=positions, dropout_p=float(dropout_p), bias=bias, norm_eps=float(norm_eps),
            activation=activation, tie_embeddings=tie_embeddings, layer_pattern=layer_pattern, window=window,
            latent_dim=latent_dim, latent_rope_dim=latent_rope_dim,
        )
        _check_score_options(kinds, positions, softcap, sinks, dropout_p)
        if softcap is not None or sinks:  # only then: configs saved before these options stay as they were
            self.config.update(softcap=softcap, sinks=sinks)
        widths = [d_model // count if own is None else own for count, own in zip(heads, head_dims)]
        rotary_dims = _check_head_options(kinds, widths, positions, rope_fraction, qk_norm)
        temperature = _nope_temperature(nope_temperature, kinds, layer_pattern)
        self.config.update({name: value for name, value in (
            ("rope_fraction", rope_fraction), ("qk_norm", qk_norm), ("head_dim", head_dim),
            ("global_head_dim", global_head_dim),
            ("nope_temperature", None if temperature is None else list(nope_temperature)))
            if value is not None and value is not False})  # only when set, as above
        # only when given: configs saved before these options stay as they were
        self.config.update({name: sizes[name] for name in ("chunk", "topk", "nsa_block", "compress_rate")
                            if sizes[name] is not None})
        self.kv_sources = kv_sharing_plan(kinds, num_kv_shared_layers, heads=heads,
                                          shareable="".join(k for k, row in LAYER_TABLE.items() if not row.module))
        if num_kv_shared_layers:  # only when set, as above
            self.config["num_kv_shared_layers"] = num_kv_shared_layers
        self.extra: dict = {}
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = LearnedPositionalEmbedding(max_len, d_model) if positions == "learned" else None
        self.dropout = nn.Dropout(dropout_p)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, layer_heads, d_ff=d_ff, dropout_p=dropout_p, causal=True,
                             num_kv_heads=num_kv_heads, bias=bias,
                             norm_eps=norm_eps, activation=activation, backend=backend,
                             mlp=not attention_only,
                             attn=_attention_module(kind, d_model, layer_heads, layer=layer, num_kv_heads=num_kv_heads,
                                                    positions=positions, sizes=sizes,
                                                    latent_rope_dim=latent_rope_dim, dropout_p=dropout_p, bias=bias,
                                                    backend=backend),
                             softcap=softcap, sinks=sinks, shared_kv=self.kv_sources[layer] is not None,
                             **{**_layer_options(kind, sizes, positions),
                                **_head_options(kind, width, own, rotary, qk_norm, norm_eps, temperature)})
            for layer, (layer_heads, kind, rotary, width, own) in enumerate(
                zip(heads, kinds, rotary_dims, widths, head_dims))
        )
        self.layer_kinds = kinds
        self.norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_embeddings()
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def _shard_positions(self, local_len: int, device) -> Tensor | None:
        """Global positions ``(local_len,)`` of this rank's tokens when the layers attend over
        shards (:func:`attnlab.distributed.context_parallel`), else None."""
        for block in self.blocks:
            part = getattr(block.attn, "attention", None)
            if getattr(part, "shards", False):
                return part.positions(local_len, device=device)
        return None

    def _init_embeddings(self) -> None:
        with torch.no_grad():
            self.tok_emb.weight.normal_(0.0, _INIT_STD)
            if self.pos_emb is not None:
                self.pos_emb.embedding.weight.normal_(0.0, _INIT_STD)

    @property
    def heads_per_layer(self) -> tuple[int, ...]:
        """The number of attention heads of each layer.

        Example:
            >>> GPT(vocab_size=5, max_len=4, d_model=8, num_layers=2, num_heads=[2, 1]).heads_per_layer
            (2, 1)
        """
        return tuple(block.attn.num_heads for block in self.blocks)

    @property
    def max_len(self) -> int:
        """Longest sequence the model takes (prompt + generated tokens)."""
        return self.config["max_len"]

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: Tensor, *, caches: list[Cache] | None = None,
                return_weights: bool = False, document_ids: Tensor | None = None,
                padding_mask: Tensor | None = None) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """Logits ``(B, T, vocab_size)`` for every position (and the per-layer attention weights).

        Args:
            input_ids: ``(B, T)`` token ids.
            caches: one cache per layer from :meth:`new_cache`; the tokens continue the cached
                ones (their positions start at each row's cached length).
            return_weights: also return a tuple of ``(B, H_l, T, Tk)`` weights, one per layer.
            document_ids: ``(T,)`` or ``(B, T)`` ids of the documents packed into each row
                (no cache): attention stays inside each document and positions restart at 0 at
                each document start, so a packed row gives what each document gives alone.
            padding_mask: ``(B, T)`` bool, True at real tokens (no cache, no documents): no
                query attends a padded key. Right padding keeps every real token's logits as
                the row alone gives them (positions count from the row's start).

        Raises:
            ValueError: ``padding_mask`` with ``caches`` or ``document_ids``, or not ``(B, T)``;
                ``return_weights`` with differential or gated layers (they return none).
            TypeError: ``padding_mask`` is not a bool tensor.

        Example:
            >>> GPT(vocab_size=5, max_len=4, d_model=8, num_layers=1, num_heads=2)(
            ...     torch.tensor([[0, 4]])).shape
            torch.Size([1, 2, 5])
        """
        positions = self._check_ids(input_ids, caches)
        if padding_mask is not None:
            _check_padding(padding_mask, input_ids, caches, document_ids)
        if return_weights:
            _check_weights(self.layer_kinds)
        x = self.tok_emb(input_ids)  # (B, T, d_model)
        if document_ids is not None:
            documents = _check_documents(document_ids, x, None, caches)
            positions = _masks.document_positions(documents)  # (B|1, T)
        shard_positions = None if self.pos_emb is None else self._shard_positions(x.shape[1], x.device)
        if shard_positions is not None:
            x = self.pos_emb(x, positions=shard_positions)
        elif self.pos_emb is not None and isinstance(positions, int):
            x = self.pos_emb(x, offset=positions)
        elif self.pos_emb is not None:
            x = x + self.pos_emb.embedding.weight[positions]  # (B|1, T, d_model): each row its own
        x = self.dropout(x)
        weights = []
        # A block failing after earlier blocks wrote their caches puts every cache back.
        with _restore_on_error(caches or [], input_ids.shape[1]):
            for block, cache, kv in zip(self.blocks, self._own_caches(caches), kv_shares(self.kv_sources)):
                x = block(x, cache=cache, return_weights=return_weights, document_ids=document_ids,
                          padding_mask=padding_mask, kv=kv)
                if return_weights:
                    x, layer_weights = x
                    weights.append(layer_weights)
        logits = self.lm_head(self.norm(x))  # (B, T, vocab)
        return (logits, tuple(weights)) if return_weights else logits

    def _own_caches(self, caches: list[Cache] | None) -> list[Cache | None]:
        """Each layer's cache to write: None for a shared layer (its source writes the cache it reads)."""
        caches = caches or [None] * len(self.blocks)
        return [None if source is not None else cache for cache, source in zip(caches, self.kv_sources)]

    def _check_ids(self, input_ids: object, caches: list[Cache] | None) -> int | Tensor:
        """The positions of the new tokens (an int offset, or ``(B, T)`` for a ragged paged batch);
        ValueError for bad ids, caches or lengths."""
        _inputs.integer_ids("input_ids", input_ids)
        same_device("input_ids", input_ids, self.tok_emb.weight.device, "the model's weights")
        _inputs.ids_in_range("input_ids", input_ids, self.config["vocab_size"], "vocab_size")
        longest = 0
        if caches is not None:
            instance_of("caches", caches, (list, tuple), "a list of one cache per layer")
            if len(caches) != len(self.blocks):
                raise ValueError(f"caches must hold one cache per layer ({len(self.blocks)}), got {len(caches)}")
            for layer, (cache, source) in enumerate(zip(caches, self.kv_sources)):
                instance_of(f"caches[{layer}]", cache, Cache, "a cache (from GPT.new_cache)")
                if source is not None and cache is not caches[source]:
                    raise ValueError(f"caches[{layer}] must be caches[{source}]: layer {layer} shares the keys and "
                                     f"values of layer {source} (num_kv_shared_layers; GPT.new_cache does this)")
            if len({cache.row_lengths for cache in caches}) > 1:
                raise ValueError("caches hold different lengths: they must come from one new_cache call "
                                 "and be used together")
            longest = max(caches[0].row_lengths, default=0)
        if longest + input_ids.shape[1] > self.max_len:
            raise ValueError(f"{longest + input_ids.shape[1]} tokens (cached + new) exceed the model's "
                             f"max_len={self.max_len}")
        return new_positions(caches[0] if caches else None, input_ids.shape[1], device=input_ids.device)

    def new_cache(self, batch_size: int, max_len: int | None = None, *,
                  page_size: int | None = None) -> list[Cache]:
        """One empty cache per layer, on the model's device and dtype.

        A :class:`~attnlab.nn.KVCache` of ``max_len`` slots per global or latent layer and a
        :class:`~attnlab.nn.WindowedKVCache` of ``window`` slots per local layer and a
        :class:`~attnlab.nn.ChunkedKVCache` of ``chunk`` slots per chunked layer (a
        :class:`~attnlab.nn.KVCache` of ``max_len`` slots if the window or chunk is wider), a
        :class:`~attnlab.nn.RecurrentCache` (constant bytes) per linear layer (``R``, ``K``); a
        shared layer (``num_kv_shared_layers``) gets its source layer's cache object, nothing of its own; with
        ``page_size``, a :class:`~attnlab.nn.PagedKVCache` per layer whose pool holds
        ``batch_size * max_len`` slots (rounded up to whole pages) shared by the rows (a linear
        layer's state has no pages: its cache is a :class:`~attnlab.nn.RecurrentCache` there too).

        Example:
            >>> len(GPT(vocab_size=5, max_len=4, d_model=8, num_layers=3, num_heads=2).new_cache(1))
            3
        """
        max_len = self.max_len if max_len is None else positive_int("max_len", max_len)
        weight = self.tok_emb.weight
        caches: list[Cache] = []
        for block, source in zip(self.blocks, self.kv_sources):
            caches.append(caches[source] if source is not None else block.attn.new_cache(
                batch_size, max_len, dtype=weight.dtype, device=weight.device, page_size=page_size))
        return caches

    # --------------------------------------------------------------- generation
    def generate(self, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, use_cache: bool = True, generator: torch.Generator | None = None,
                 page_size: int | None = None) -> Tensor | list[Tensor]:
        """The prompt followed by ``max_new_tokens`` generated tokens, ``(B, T + max_new_tokens)``.

        Greedy at ``temperature=0``; otherwise samples from ``softmax(logits / temperature)``,
        restricted to the ``top_k`` most likely tokens if given. With ``use_cache`` (default)
        each step feeds only the newest token and reads earlier keys/values from a KV cache;
        without it every step recomputes the whole sequence (same tokens, much slower).

        **Prompts of different lengths.** Given a list of 1-D prompts, the model generates for
        all of them at once with paged caches (:class:`~attnlab.nn.PagedKVCache`, ``page_size``
        slots a page, 16 by default): each prompt is prefilled alone, then every step decodes
        one token per row at that row's own position. No row is padded, in compute or memory,
        and each gets the tokens it gets alone; the result is a list of 1-D sequences.
        ``page_size`` with a ``(B, T)`` tensor uses paged caches for that batch too.

        Raises:
            ValueError: the prompt plus ``max_new_tokens`` would exceed ``max_len`` (checked
                before anything is generated), or a bad option.

        Example:
            >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
            <torch._C.Generator object at ...>
            >>> model = GPT(vocab_size=9, max_len=12, d_model=8, num_layers=2, num_heads=2)
            >>> prompt = torch.tensor([[1, 2, 3]])
            >>> torch.equal(model.generate(prompt, 5), model.generate(prompt, 5, use_cache=False))
            True
            >>> both = model.generate([torch.tensor([1, 2, 3]), torch.tensor([4])], 5)
            >>> [len(s) for s in both], torch.equal(both[1], model.generate(torch.tensor([[4]]), 5)[0])
            ([8, 6], True)
        """
        if isinstance(input_ids, Tensor):
            new = list(self.stream(input_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                                   use_cache=use_cache, generator=generator, page_size=page_size))
            return torch.cat([input_ids, *new], dim=1)
        prompts = _check_prompts(input_ids)
        if not use_cache:
            raise ValueError("prompts of different lengths are generated with paged caches; use_cache=False "
                             "needs a (B, T) tensor")
        new = list(self.stream(prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                               generator=generator, page_size=16 if page_size is None else page_size))
        tokens = torch.cat(new, dim=1) if new else None  # (B, max_new_tokens)
        return [torch.cat([prompt, tokens[b]]) for b, prompt in enumerate(prompts)]

    def stream(self, input_ids: Tensor | Sequence[Tensor], max_new_tokens: int, *, temperature: float = 0.0,
               top_k: int | None = None, use_cache: bool = True,
               generator: torch.Generator | None = None, page_size: int | None = None) -> Iterator[Tensor]:
        """Yield the generated tokens one step at a time, each ``(B, 1)``; see :meth:`generate`.

        The model runs in eval mode without gradients while the iterator is consumed; its
        train/eval mode is restored when the iterator finishes or is closed.

        Example:
            >>> model = GPT(vocab_size=9, max_len=12, d_model=8, num_layers=1, num_heads=2)
            >>> [t.shape for t in model.stream(torch.tensor([[1, 2]]), 2)]
            [torch.Size([1, 1]), torch.Size([1, 1])]
        """
        positive_int("max_new_tokens", max_new_tokens)
        temperature = finite_number("temperature", temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k is not None:
            positive_int("top_k", top_k)
        if page_size is not None:
            positive_int("page_size", page_size)
        prompts = [input_ids] if isinstance(input_ids, Tensor) else _check_prompts(input_ids)
        for prompt in prompts:
            self._check_ids(prompt if isinstance(input_ids, Tensor) else prompt[None], None)
        longest = max(prompt.shape[-1] for prompt in prompts)
        if min(prompt.shape[-1] for prompt in prompts) == 0:
            raise ValueError("input_ids needs at least one prompt token")
        if longest + max_new_tokens > self.max_len:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs "
                f"{longest + max_new_tokens} positions, more than the model's max_len={self.max_len}; ask for at most "
                f"{self.max_len - longest} new tokens")
        if not use_cache and page_size is not None:
            raise ValueError("page_size sets the paged caches; it needs use_cache=True")
        return self._decode(input_ids, max_new_tokens, temperature, top_k, use_cache, generator, page_size)

    def _decode(self, input_ids, max_new_tokens, temperature, top_k, use_cache, generator,
                page_size=None) -> Iterator[Tensor]:
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                if isinstance(input_ids, Tensor):
                    yield from self._decode_batch(input_ids, max_new_tokens, temperature, top_k, use_cache,
                                                  generator, page_size)
                else:
                    yield from self._decode_ragged(input_ids, max_new_tokens, temperature, top_k, generator,
                                                   page_size)
        finally:
            self.train(was_training)

    def _decode_batch(self, input_ids, max_new_tokens, temperature, top_k, use_cache, generator, page_size):
        caches = self.new_cache(input_ids.shape[0], input_ids.shape[1] + max_new_tokens, page_size=page_size) \
            if use_cache else None
        sequence, step_input = input_ids, input_ids
        for step in range(max_new_tokens):
            if step and use_cache:
                logits = self._step_logits(step_input, caches)  # (B, vocab)
            else:
                logits = self(step_input if use_cache else sequence, caches=caches)[:, -1]  # (B, vocab)
            token = _next_token(logits, temperature, top_k, generator)  # (B, 1)
            sequence, step_input = torch.cat([sequence, token], dim=1), token
            yield token

    def _step_logits(self, token: Tensor, caches: list[Cache]) -> Tensor:
        """Last-position logits ``(B, vocab)`` of one generated token ``(B, 1)`` after the cached
        ones: :meth:`forward`'s computation for a decoding step of :meth:`generate`, whose tokens
        and caches it made itself (so none of forward's checks can fail; a full cache or a paged
        one takes :meth:`forward`, which says so). Positions are the cached length."""
        first = caches[0]
        length = first.length if type(first) is KVCache else (
            first.lengths[0] if type(first) is RecurrentCache and len(set(first.lengths)) == 1 else
            first.row_lengths[0] if type(first) is CompressedCache else None)
        if length is None or length + 1 > self.max_len or self.training:
            return self(token, caches=caches)[:, -1]
        x = self.tok_emb(token)  # (B, 1, d_model)
        if self.pos_emb is not None:
            x = x + self.pos_emb.embedding.weight[length:length + 1]  # the token's position
        for block, cache, kv in zip(self.blocks, self._own_caches(caches), kv_shares(self.kv_sources)):
            x = block.decode_step(x, cache, kv)
        return self.lm_head(self.norm(x))[:, -1]  # (B, vocab), as forward computes it

    def _decode_ragged(self, prompts, max_new_tokens, temperature, top_k, generator, page_size):
        """Prefill each prompt alone into its rows' pages, then decode every row at once."""
        pages = sum(-(-(len(prompt) + max_new_tokens) // page_size) for prompt in prompts)
        per_row = -(-pages // len(prompts)) * page_size  # the pool: the pages the rows will fill
        caches = self.new_cache(len(prompts), per_row, page_size=page_size)
        last = [self(prompt[None], caches=_select(caches, b))[:, -1] for b, prompt in enumerate(prompts)]  # (1, vocab)
        token = _next_token(torch.cat(last), temperature, top_k, generator)  # (B, 1)
        yield token
        for _ in range(max_new_tokens - 1):
            token = _next_token(self(token, caches=caches)[:, -1], temperature, top_k, generator)
            yield token

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, directory: str | os.PathLike, *, extra: dict | None = None) -> Path:
        """Write ``config.json`` (attnlab's layout) and ``model.safetensors`` into ``directory``.

        Both files are written beside their destination and renamed into place, so an
        interrupted save never leaves a half-written file. ``extra`` (JSON-serialisable) is
        stored in ``config.json`` too and comes back as :attr:`extra`.

        Example:
            >>> import tempfile
            >>> model = GPT(vocab_size=5, max_len=4, d_model=8, num_layers=1, num_heads=2)
            >>> folder = model.save_pretrained(tempfile.mkdtemp(), extra={"tokens": list("abcde")})
            >>> GPT.from_pretrained(folder).extra["tokens"][:2]
            ['a', 'b']
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"model_type": MODEL_TYPE, **self.config, **(extra if extra is not None else self.extra)}
        _io.save(self, directory / _hub.WEIGHTS, metadata={"model_type": MODEL_TYPE})
        _io.write_atomically(json.dumps(config, indent=2) + "\n", directory / "config.json", what="a config file")
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, backend: str = "auto") -> "GPT":
        """Load attnlab's own layout or a Hugging Face GPT-2 directory; returned in eval mode.

        ``config.json``'s ``model_type`` decides: ``"attnlab-gpt"`` (from :meth:`save_pretrained`)
        or ``"gpt2"`` (transformers' ``GPT2LMHeadModel``/``GPT2Model`` saved with safetensors).

        Raises:
            FileNotFoundError: no such directory, ``config.json`` or ``model.safetensors``.
            ValueError: an unknown ``model_type``, a malformed config, a pickle checkpoint,
                missing or mis-shaped tensors.

        Example:
            >>> import tempfile
            >>> folder = GPT(vocab_size=5, max_len=4, d_model=8, num_layers=1,
            ...              num_heads=2).save_pretrained(tempfile.mkdtemp())
            >>> GPT.from_pretrained(folder).config["num_layers"]
            1
        """
        directory = _hub.model_dir(os.fspath(directory))
        config = _hub.read_config(directory, {"model_type": str})
        kind = config["model_type"]
        if kind == "gpt2":
            return _from_gpt2(directory, backend).eval()
        if kind != MODEL_TYPE:
            raise ValueError(f"{str(directory / 'config.json')!r}: model_type {kind!r} is not a GPT "
                             f"(expected {MODEL_TYPE!r} or 'gpt2')")
        parameters = {n: p.default for n, p in inspect.signature(cls).parameters.items() if n != "backend"}
        options = {k: v for k, v in config.items() if k in parameters}
        settings = {**parameters, **options}  # what the constructor will see, defaults included
        _hub.check_sizes(directory, settings, _attnlab_sizes(settings), _hub.read_header(directory))
        try:
            model = cls(**options, backend=backend)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{str(directory / 'config.json')!r}: {err}") from None
        model.extra = {k: v for k, v in config.items() if k not in parameters and k != "model_type"}
        _io.load(model, directory / _hub.WEIGHTS)  # checks the header against the model first
        return model.eval()


def _attnlab_sizes(config: dict) -> dict[str, _hub.Dim | _hub.Count | None]:
    """The sizes of attnlab's own config.json and the tensors that hold them (see ``_hub.check_sizes``)."""
    sizes = {"vocab_size": _hub.Dim("tok_emb.weight", 0), "d_model": _hub.Dim("tok_emb.weight", 1),
             "num_layers": _hub.Count("blocks."),
             "max_len": _hub.Dim("pos_emb.embedding.weight", 0) if config["positions"] == "learned" else None}
    if config["d_ff"] is not None:
        sizes["d_ff"] = None if config["attention_only"] is True else _hub.Dim("blocks.0.mlp.fc_in.weight", 0)
    if config["num_kv_heads"] is not None:
        sizes["num_kv_heads"] = None
    return sizes


def _select(caches: list[Cache], row: int) -> list[Cache]:
    """Row ``row`` of each cache, one view per cache object (a shared layer's is its source's)."""
    views: dict[int, Cache] = {}
    return [views.setdefault(id(cache), cache.select([row])) for cache in caches]


def _check_prompts(prompts: object) -> list[Tensor]:
    """A non-empty list of 1-D token-id tensors (each prompt's ids)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError(f"input_ids must be a (B, T) tensor or a non-empty list of 1-D tensors, got {prompts!r}")
    for b, prompt in enumerate(prompts):
        instance_of(f"input_ids[{b}]", prompt, Tensor, "a 1-D tensor of token ids")
        if prompt.ndim != 1:
            raise ValueError(f"input_ids[{b}] must be a 1-D tensor of token ids, got shape {tuple(prompt.shape)}")
    return list(prompts)


def _layer_options(letter: str, sizes: dict, positions: str) -> dict:
    """A layer's :class:`~attnlab.nn.TransformerBlock` options from its :data:`LAYER_TABLE` row:
    its ``window``/``chunk`` (None unless the row names it) and its positions part."""
    kind = LAYER_TABLE[letter]
    rotates = kind.positions and positions in ("rope", "alibi")
    return {**{name: sizes[name] if kind.option == name else None for name in ("window", "chunk")},
            "positions": positions if rotates else None}


def _check_head_options(kinds: tuple[str, ...], widths: list[int], positions: str,
                        rope_fraction: object, qk_norm: object) -> list[int | None]:
    """Each layer's rotary width for ``rope_fraction`` of its head ``widths`` (None: the whole head),
    with the checks of ``rope_fraction`` and ``qk_norm``: options of the multi-head layers (the rows
    without a module of their own, or without positions), ``rope_fraction`` with ``positions="rope"`` only."""
    if not isinstance(qk_norm, bool):
        instance_of("qk_norm", qk_norm, str, f"a bool or one of {', '.join(map(repr, QK_NORMS))}")
        one_of("qk_norm", qk_norm, QK_NORMS)
    if rope_fraction is not None:
        if positions != "rope":
            raise ValueError(f"rope_fraction={rope_fraction!r} needs positions='rope', got positions={positions!r}")
        if isinstance(rope_fraction, bool) or not 0 < finite_number("rope_fraction", rope_fraction) <= 1:
            raise ValueError(f"rope_fraction must be a number in (0, 1], got {rope_fraction!r}")
    used = [name for name, on in (("rope_fraction", rope_fraction is not None), ("qk_norm", qk_norm is not False))
            if on]
    own = sorted({k for k in kinds if LAYER_TABLE[k].module and LAYER_TABLE[k].positions})
    if used and own:
        raise ValueError(f"{', '.join(used)}: options of the multi-head layers, not of "
                         f"{', '.join(LAYER_KINDS[k] for k in own)} layers (their own attention modules); "
                         f"use a layer_pattern without {', '.join(repr(k) for k in own)}")
    if used and all(LAYER_TABLE[k].module for k in kinds):
        raise ValueError(f"{', '.join(used)}: layer_pattern {''.join(kinds)!r} has no multi-head layer to take it")
    if rope_fraction is None:
        return [None] * len(kinds)
    dims = []
    for head_dim in widths:
        rotary = head_dim * rope_fraction
        if rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"rope_fraction={rope_fraction!r} of head_dim={head_dim} is {rotary:g} features; it "
                             "must give an even int (rotary embeddings turn features in pairs)")
        dims.append(int(rotary))
    return dims


# GPT's qk_norm forms (True: "qwen3") -> the QKNorm fields of each (the eps is norm_eps).
QK_NORMS = {"qwen3": {}, "olmo2": {"over": "all"}, "gemma": {"unit_offset": True}}


def _head_options(letter: str, head_dim: int, own_dim: int | None, rotary_dim: int | None, qk_norm: bool | str,
                  norm_eps: float, temperature: QueryTemperature | None) -> dict:
    """A multi-head layer's head width (when set), partial rotary part, QK-norm part and NoPE
    temperature (none for the other rows)."""
    kind = LAYER_TABLE[letter]
    if kind.module:
        return {}
    options = {} if own_dim is None else {"head_dim": own_dim}
    if qk_norm is not False:
        options["qk_norm"] = QKNorm(eps=norm_eps, **QK_NORMS["qwen3" if qk_norm is True else qk_norm])
    if rotary_dim is not None and kind.positions:
        options["positions"] = RotaryEmbedding(head_dim, rotary_dim=rotary_dim)
    if temperature is not None and not kind.positions:
        options["positions"] = temperature
    return options


def _head_dims(kinds: tuple[str, ...], pattern: object, head_dim: object, global_head_dim: object) -> list[int | None]:
    """Each layer's own head width (None: ``d_model // heads``): ``global_head_dim`` for the G
    layers, ``head_dim`` for the other multi-head layers (the rows without a module of their own)."""
    multi = sorted({k for k in kinds if not LAYER_TABLE[k].module}, key=list(LAYER_TABLE).index)
    own = sorted({k for k in kinds if LAYER_TABLE[k].module}, key=list(LAYER_TABLE).index)
    sized = [k for k in multi if k != "G" or global_head_dim is None]  # global_head_dim sizes the G layers over it
    for name, value, letters in (("head_dim", head_dim, sized), ("global_head_dim", global_head_dim,
                                                                  [k for k in multi if k == "G"])):
        if value is None:
            continue
        positive_int(name, value)
        if own:
            raise ValueError(f"{name}={value!r} sizes the heads of the multi-head layers (G, L, C, N), not of "
                             f"{', '.join(LAYER_KINDS[k] for k in own)} layers (their own attention modules); "
                             f"use a layer_pattern without {', '.join(repr(k) for k in own)}")
        if not letters:
            what = "G layers" if name == "global_head_dim" else "L, C, N and G layers (global_head_dim sizes the G ones)"
            raise ValueError(f"{name}={value!r} is for {what}, and layer_pattern {pattern!r} has none")
    return [global_head_dim if k == "G" and global_head_dim is not None else
            None if LAYER_TABLE[k].module else head_dim for k in kinds]


def _nope_temperature(value: object, kinds: tuple[str, ...], pattern: object) -> QueryTemperature | None:
    """The N layers' :class:`~attnlab.nn.positional.QueryTemperature` from ``(floor_scale, attn_scale)``."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"nope_temperature must be a pair (floor_scale, attn_scale), e.g. (8192, 0.1) as Llama 4; "
                        f"got {value!r}")
    if "N" not in kinds:
        raise ValueError(f"nope_temperature={value!r} scales the queries of N layers (NoPE), and layer_pattern "
                         f"{pattern!r} has none")
    return QueryTemperature(*value)


def _attention_module(letter: str, d_model: int, heads: int, *, layer: int, num_kv_heads, positions: str,
                      sizes: dict, latent_rope_dim, dropout_p: float, bias: bool, backend: str) -> nn.Module | None:
    """The attention module of a layer whose :data:`LAYER_TABLE` row names one (None: the block's
    multi-head attention). The modules other than the latent one rotate their own queries and keys."""
    module = LAYER_TABLE[letter].module
    rope = "rope" if positions == "rope" else None
    if module == "latent":
        return LatentAttention(d_model, heads, latent_dim=sizes["latent_dim"], rope_dim=latent_rope_dim,
                               dropout_p=dropout_p, bias=bias, backend=backend)
    if module == "topk":
        return TopkAttention(d_model, heads, num_kv_heads=num_kv_heads, topk=sizes["topk"], positions=rope, bias=bias,
                             backend=backend, index_loss_weight=INDEX_LOSS_WEIGHT)
    if module == "native_sparse":
        return NativeSparseAttention(d_model, heads, num_kv_heads=num_kv_heads, positions=rope, bias=bias,
                                     **paper_sizes(sizes["nsa_block"]))
    if module == "differential":
        return DifferentialAttention(d_model, heads, num_kv_heads=num_kv_heads, layer_idx=layer, positions=rope,
                                     bias=bias, backend=backend)
    if module in _RECURRENT_LAYERS:  # NoPE, no dropout: the table's row says so
        return _RECURRENT_LAYERS[module](d_model, heads, num_key_heads=num_kv_heads, bias=bias, backend=backend)
    if module in ("csa", "hca"):  # one key/value head, their own rotary, no biases: DeepSeek-V4's layer
        return CompressedAttention(d_model, heads, window=sizes["window"], kind=module,
                                   compress_rate=sizes["compress_rate"], **model_sizes(d_model, heads, kind=module),
                                   **({"topk": sizes["topk"]} if module == "csa" else {}))
    if module == "gated":
        return GatedAttention(d_model, heads, num_kv_heads=num_kv_heads, positions=rope, dropout_p=dropout_p,
                              bias=bias, backend=backend)
    return None


# The recurrent letters' layers; "linear" is plain causal linear attention ("Transformers are RNNs": no
# decay, no delta rule), the baseline of the associative-recall studies.
_RECURRENT_LAYERS = {"gated_delta": GatedDeltaNet, "kda": KimiDeltaAttention,
                     "linear": functools.partial(DecayedLinearAttention, decay="none")}
INDEX_LOSS_WEIGHT = 1.0  # the T layers' indexer KL, added to the training loss with this weight


def _check_weights(kinds: tuple[str, ...]) -> None:
    """``return_weights`` needs every layer to return its weights."""
    lacking = sorted({k for k in kinds if not LAYER_TABLE[k].weights})
    if lacking:
        raise ValueError(f"return_weights: {', '.join(LAYER_KINDS[k] for k in lacking)} layers return no single "
                         "weight matrix (a differential layer has two softmaxes, a sparse one reads a few keys per "
                         "query, NSA mixes three branches); use a layer_pattern without "
                         f"{', '.join(repr(k) for k in lacking)} to read weights")


def _check_score_options(kinds: list[str], positions: str, softcap, sinks: bool, dropout_p: float = 0.0) -> None:
    """ALiBi, softcap and sinks are options of the multi-head layers: the layers built with their
    own module (latent, differential, gated, sparse) take none, the rows without ``dropout`` no
    attention dropout, and ALiBi's distances need the contiguous cache local and chunked layers do not use."""
    used = [name for name, on in (("positions='alibi'", positions == "alibi"), ("softcap", softcap is not None),
                                  ("sinks", sinks)) if on]
    own = sorted({letter for letter in kinds if LAYER_TABLE[letter].module})
    if used and own:
        raise ValueError(f"{', '.join(used)}: not available on {', '.join(LAYER_KINDS[k] for k in own)} layers; "
                         f"use a layer_pattern without {', '.join(repr(k) for k in own)}")
    undropped = sorted({letter for letter in kinds if not LAYER_TABLE[letter].dropout})
    if dropout_p and undropped:
        raise ValueError(f"dropout_p={dropout_p}: {', '.join(LAYER_KINDS[k] for k in undropped)} layers define no "
                         f"attention dropout (as DiffLlama, DeepSeek-V3.2, NSA); use dropout_p=0 or a layer_pattern "
                         f"without {', '.join(repr(k) for k in undropped)}")
    for letter in ("L", "C"):
        if positions == "alibi" and letter in kinds:
            raise ValueError(f"positions='alibi' with {LAYER_KINDS[letter]} layers: their cache does not keep "
                             "keys from position 0; use rope or learned positions with a layer_pattern")


def option_letters() -> dict[str, list[str]]:
    """Each GPT option a :data:`LAYER_TABLE` letter needs -> the letters that need it (table order).

    Example:
        >>> option_letters()["window"], option_letters()["compress_rate"]
        (['L', 'V', 'H'], ['V', 'H'])
    """
    needed: dict[str, list[str]] = {}
    for letter, kind in LAYER_TABLE.items():
        for name in kind.options:
            needed.setdefault(name, []).append(letter)
    return needed


def _layer_kinds(pattern: object, num_layers: int, sizes: dict, latent_rope_dim: object) -> tuple[str, ...]:
    """Each layer's letter of :data:`LAYER_TABLE`; ``sizes`` (``window``, ``latent_dim``, ``chunk``)
    checked against the letters that need them."""
    if pattern is None:
        pattern = "G"
    instance_of("layer_pattern", pattern, str, f"a string of the letters {''.join(LAYER_KINDS)}")
    unknown = sorted(set(pattern) - set(LAYER_KINDS))
    if not pattern or unknown:
        raise ValueError(f"layer_pattern must be a non-empty string of the letters "
                         f"{', '.join(f'{k} ({v})' for k, v in LAYER_KINDS.items())}; got {pattern!r}"
                         + (f" with unknown {''.join(unknown)!r}" if unknown else ""))
    kinds = tuple(pattern[layer % len(pattern)] for layer in range(num_layers))
    for name, letters in option_letters().items():
        value, present = sizes[name], [letter for letter in letters if letter in kinds]
        if present and value is None:
            raise ValueError(f"layer_pattern {pattern!r} has {present[0]} layers: give {name}")
        if not present and value is not None:
            others = f" (and {', '.join(letters[1:])} layers)" if len(letters) > 1 else ""
            raise ValueError(f"{name}={value!r} is for {letters[0]} layers{others}, and layer_pattern {pattern!r} "
                             f"has none over {num_layers} layers")
        if value is not None:
            positive_int(name, value)
    if sizes.get("nsa_block") is not None:
        paper_sizes(sizes["nsa_block"], name="nsa_block")
    if latent_rope_dim is not None and "M" not in kinds:
        raise ValueError(f"latent_rope_dim={latent_rope_dim!r} is for M layers, and layer_pattern {pattern!r} has none")
    if latent_rope_dim is not None and positive_int("latent_rope_dim", latent_rope_dim) % 2:
        raise ValueError(f"latent_rope_dim must be even (rotary embeddings turn features in pairs), "
                         f"got {latent_rope_dim}")
    return kinds


def _check_heads(num_heads: object, num_layers: int, d_model: int, num_kv_heads: object,
                 head_dims: Sequence[int | None]) -> tuple[int, ...]:
    """Each layer's head count, checked: it divides ``d_model`` (unless the layer's ``head_dims``
    entry gives its heads their own width), and ``num_kv_heads`` divides it."""
    heads = per_layer("num_heads", num_heads, num_layers)
    if num_kv_heads is not None:
        positive_int("num_kv_heads", num_kv_heads)
    for layer, count in enumerate(heads):
        name = "num_heads" if isinstance(num_heads, int) else f"num_heads[{layer}]"
        if head_dims[layer] is None:
            divisible("d_model", d_model, name, count)
        if num_kv_heads is not None:
            divisible(name, count, "num_kv_heads", num_kv_heads)
    return heads


def _next_token(logits: Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> Tensor:
    """Greedy (temperature 0) or sampled next token ``(B, 1)`` from last-position logits ``(B, V)``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


# ----------------------------------------------------------------- GPT-2 layout
def _from_gpt2(directory: Path, backend: str) -> GPT:
    """A :class:`GPT` with the weights of a transformers GPT-2 directory."""
    path = directory / "config.json"
    config = _hub.read_config(directory, _GPT2_FIELDS)
    act = config["activation_function"]
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"{str(path)!r}: activation_function {act!r} is not supported "
                         f"(one of {sorted(_HF_ACTIVATIONS)})")
    for flag, default in {"tie_word_embeddings": True, **_GPT2_NEEDED}.items():
        if not isinstance(config.get(flag, default), bool):  # a string "false" is truthy
            raise ValueError(f"{str(path)!r}: {flag} must be true or false, got {config[flag]!r}")
    for flag, fine in _GPT2_NEEDED.items():
        if config.get(flag, fine) != fine:
            raise ValueError(f"{str(path)!r}: {flag}={config[flag]} is not supported (attnlab's GPT "
                             f"needs {flag}={fine})")
    if config["n_embd"] % config["n_head"]:
        raise ValueError(f"{str(path)!r}: n_embd {config['n_embd']} is not a multiple of n_head {config['n_head']}")
    header = _gpt2_names(_hub.read_header(directory))
    inner = {"n_inner": _hub.Dim("h.0.mlp.c_fc.weight", 1)} if config.get("n_inner") is not None else {}
    _hub.check_sizes(directory, config, {**_GPT2_SIZES, **inner}, header)  # before anything is allocated
    model = GPT(config["vocab_size"], max_len=config["n_positions"], d_model=config["n_embd"],
                num_layers=config["n_layer"], num_heads=config["n_head"], d_ff=config.get("n_inner"),
                norm_eps=float(config["layer_norm_epsilon"]), activation=_HF_ACTIVATIONS[act],
                tie_embeddings=config.get("tie_word_embeddings", True), backend=backend)
    tied = model.config["tie_embeddings"]
    table = _gpt2_table(len(model.blocks), tied)
    expected = model.state_dict()
    shapes = {hf: tuple(reversed(expected[ours].shape)) if conv else tuple(expected[ours].shape)
              for ours, (hf, conv) in table.items()}  # Conv1D stores (in, out); Linear has (out, in)
    _hub.check_tensors(directory, header, shapes, what="GPT-2 tensor",
                       ignored=lambda name: bool(_GPT2_BUFFER.fullmatch(name)) or (tied and name == "lm_head.weight"))
    model.load_state_dict(_from_gpt2_names(_gpt2_names(_hub.load_weights(directory)), table, tied))
    return model


def _gpt2_names(named: dict[str, V]) -> dict[str, V]:
    """GPT-2 names without ``transformer.``; other heads of a prefixed checkpoint dropped, but ``lm_head``."""
    if not any(name.startswith("transformer.") for name in named):
        return named
    return {name.removeprefix("transformer."): value for name, value in named.items()
            if name.startswith("transformer.") or name == "lm_head.weight"}


def _gpt2_table(num_layers: int, tied: bool) -> dict[str, tuple[str, bool]]:
    """attnlab name -> (GPT-2 name without ``transformer.``, stored as Conv1D (in, out)?)."""
    table = {"tok_emb.weight": ("wte.weight", False), "pos_emb.embedding.weight": ("wpe.weight", False),
             "norm.weight": ("ln_f.weight", False), "norm.bias": ("ln_f.bias", False)}
    if not tied:
        table["lm_head.weight"] = ("lm_head.weight", False)
    for i in range(num_layers):
        ours, hf = f"blocks.{i}.", f"h.{i}."
        pairs = {"norm_attn": "ln_1", "attn.in_proj": "attn.c_attn", "attn.out_proj": "attn.c_proj",
                 "norm_mlp": "ln_2", "mlp.fc_in": "mlp.c_fc", "mlp.fc_out": "mlp.c_proj"}
        for a, b in pairs.items():
            conv = not a.startswith("norm")
            weight = f"{ours}{a}_weight" if a == "attn.in_proj" else f"{ours}{a}.weight"
            bias = f"{ours}{a}_bias" if a == "attn.in_proj" else f"{ours}{a}.bias"
            table[weight] = (f"{hf}{b}.weight", conv)
            table[bias] = (f"{hf}{b}.bias", False)
    return table


def _from_gpt2_names(state: dict[str, Tensor], table: dict[str, tuple[str, bool]], tied: bool) -> dict[str, Tensor]:
    """transformers' GPT-2 tensors (already checked) -> this module's state dict."""
    mapped = {ours: (state[hf].t() if conv else state[hf]).contiguous() for ours, (hf, conv) in table.items()}
    if tied:
        mapped["lm_head.weight"] = mapped["tok_emb.weight"]
    return mapped


def _check_padding(padding_mask: object, input_ids: Tensor, caches: object, document_ids: object) -> None:
    """A GPT's ``padding_mask``: a bool ``(B, T)`` tensor, without caches or documents."""
    if caches is not None or document_ids is not None:
        given = "caches" if caches is not None else "document_ids"
        raise ValueError(f"padding_mask is for a padded batch without caches or documents; got it with {given} "
                         "(a cache holds each row's own length; documents mask their own boundaries)")
    _check_padding_type(padding_mask, "padding_mask")
    if tuple(padding_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"padding_mask must be (B, T) = {tuple(input_ids.shape)} like input_ids, "
                         f"got {tuple(padding_mask.shape)}")
