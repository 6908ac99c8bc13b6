"""Transformer blocks and encoder/decoder stacks built from attnlab modules.

By default each block is ``x + Attn(LN(x))`` [``+ CrossAttn(LN(.), context)``] ``+ MLP(LN(.))``
(the "pre-norm" arrangement of GPT-2 and most later models) and the stacks end with a LayerNorm.
``TransformerBlock(..., norm_first=False)`` is the post-norm arrangement of the original
Transformer and BERT: ``LN(x + Attn(x))``, then ``LN(. + MLP(.))``.
Masks follow attnlab's polarity: ``padding_mask`` is True at real tokens.

Example:
    >>> enc = TransformerEncoder(2, 32, 4)
    >>> dec = TransformerDecoder(2, 32, 4, cross_attention=True)
    >>> src, tgt = torch.randn(2, 7, 32), torch.randn(2, 5, 32)
    >>> src_real = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    >>> context = enc(src, padding_mask=src_real)
    >>> dec(tgt, context=context, context_padding_mask=src_real).shape
    torch.Size([2, 5, 32])
"""

from __future__ import annotations

from collections.abc import Callable

import torch  # noqa: F401  (the doctest examples use it)
from torch import Tensor, nn

from attnlab._checks import instance_of, one_of, positive_int, positive_number, probability
from attnlab.nn.cache import Cache, KVCache, _restore_on_error
from attnlab.nn.kv_sharing import KVShare, SharedKVAttention
from attnlab.nn.multihead import QKV, CallMask, MultiHeadAttention, QKNorm, pattern_of

__all__ = ["FeedForward", "TransformerBlock", "TransformerEncoder", "TransformerDecoder"]

# "gelu" is the exact erf form, as BERT and transformers' ACT2FN["gelu"] (nn.functional.gelu);
# "gelu_tanh" is GPT-2's approximation (transformers' "gelu_new" / "gelu_pytorch_tanh").
_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
}


class FeedForward(nn.Module):
    """The position-wise MLP: ``Linear(d, d_ff) -> activation -> Linear(d_ff, d) -> Dropout``.

    Shapes:
        x: ``(..., d_model)`` -> ``(..., d_model)``.

    Args:
        d_model: input and output width.
        d_ff: hidden width (default ``4 * d_model``).
        dropout_p: dropout after the second linear layer (training only).
        bias: biases in both linear layers.
        activation: ``"gelu"`` (exact erf GELU, the default and BERT's), ``"gelu_tanh"``,
            ``"relu"`` or ``"silu"``.

    Example:
        >>> FeedForward(8, d_ff=32)(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
        >>> FeedForward(8, activation="relu").act
        ReLU()
    """

    def __init__(self, d_model: int, *, d_ff: int | None = None, dropout_p: float = 0.0, bias: bool = True,
                 activation: str = "gelu"):
        super().__init__()
        d_ff = 4 * positive_int("d_model", d_model) if d_ff is None else d_ff
        positive_int("d_ff", d_ff)
        probability("dropout_p", dropout_p)
        one_of("activation", activation, _ACTIVATIONS)
        self.fc_in = nn.Linear(d_model, d_ff, bias=bias)
        self.act = _ACTIVATIONS[activation]()
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


class TransformerBlock(nn.Module):
    """One Transformer layer: self-attention, optional cross-attention, MLP (pre- or post-norm).

    ``norm_first=True`` (default, pre-norm): ``x + Attn(LN(x))``, ``. + MLP(LN(.))``.
    ``norm_first=False`` (post-norm, BERT): ``LN(x + Attn(x))``, ``LN(. + MLP(.))``. Both use
    the same parameters (``norm_attn``, ``attn``, ``norm_cross``, ``cross_attn``, ``norm_mlp``,
    ``mlp``), so only where each LayerNorm sits changes.

    Shapes:
        x: ``(B, T, d_model)``; context: ``(B, Tc, d_context)``; padding_mask: ``(B, T)`` (or
        ``(B, cached + T)`` with a cache); context_padding_mask: ``(B, Tc)`` -> ``(B, T, d_model)``.

    Args:
        d_model: width of the residual stream.
        num_heads: attention heads.
        d_ff: hidden width of the MLP (default ``4 * d_model``).
        dropout_p: attention-weight and residual dropout (training only).
        causal: causal self-attention (decoders) or not (encoders).
        num_kv_heads: grouped-query key/value heads (default ``num_heads``).
        cross_attention: add a cross-attention sub-layer reading ``context``.
        d_context: width of ``context`` (default ``d_model``).
        bias: biases in the linear layers.
        norm_eps: LayerNorm epsilon.
        norm_first: pre-norm (True) or post-norm (False) residual arrangement.
        activation: the MLP's activation (see :class:`FeedForward`).
        backend: attention backend name or ``"auto"``.
        mlp: include the MLP sub-layer. ``mlp=False`` gives an attention-only block
            (``norm_mlp`` and ``mlp`` are None), the setting of circuit studies, where every
            path from input to output goes through attention heads.
        window: a causal sliding window for the self-attention (local layers).
        chunk: chunked-local self-attention, each query within its ``chunk``-sized block (Llama 4's
            local layers; see :class:`~attnlab.nn.MultiHeadAttention`).
        attn: a self-attention module to use instead of the ``MultiHeadAttention`` the block
            would build (e.g. a :class:`~attnlab.nn.LatentAttention`); it takes the keyword
            arguments ``mask``, ``padding_mask``, ``cache``, ``return_weights``, ``document_ids``.
        positions, softcap, sinks: self-attention's positions part (``"rope"``, ``"alibi"``, a
            ``RotaryEmbedding`` or an ``ALiBi``; see :class:`MultiHeadAttention`), score softcap and
            learnable sinks (see :class:`~attnlab.nn.MultiHeadAttention`).
        qk_norm: the self-attention's QK-norm part, a :class:`~attnlab.nn.QKNorm` (Qwen3), or None;
            an option of the block's own ``MultiHeadAttention`` (refused with ``attn``).
        head_dim: the self-attention's head width (``QKV(head_dim=)``; None: ``d_model // num_heads``);
            an option of the block's own ``MultiHeadAttention`` (refused with ``attn``).
        shared_kv: the block's self-attention is a :class:`~attnlab.nn.SharedKVAttention` (the
            same options, a query projection only): it reads an earlier layer's keys and values,
            handed over as ``kv=`` (cross-layer KV sharing; refused with ``attn``).

    Example:
        >>> TransformerBlock(16, 2, mlp=False).mlp is None
        True
        >>> block = TransformerBlock(16, 2, causal=True)
        >>> block(torch.randn(3, 5, 16)).shape
        torch.Size([3, 5, 16])
        >>> bert_layer = TransformerBlock(16, 2, causal=False, norm_first=False)
        >>> out, weights = bert_layer(torch.randn(3, 5, 16), return_weights=True)
        >>> weights.shape
        torch.Size([3, 2, 5, 5])
    """

    def __init__(
        self, d_model: int, num_heads: int, *, d_ff: int | None = None, dropout_p: float = 0.0,
        causal: bool = True, num_kv_heads: int | None = None, cross_attention: bool = False,
        d_context: int | None = None, bias: bool = True,
        norm_eps: float = 1e-5, norm_first: bool = True, activation: str = "gelu", backend: str = "auto",
        mlp: bool = True, window: int | None = None,
        attn: nn.Module | None = None, positions: str | nn.Module | None = None, softcap: float | None = None,
        sinks: bool = False, chunk: int | None = None, qk_norm: QKNorm | None = None, head_dim: int | None = None,
        shared_kv: bool = False,
    ):
        super().__init__()
        positive_number("norm_eps", norm_eps)
        self.norm_first = bool(norm_first)
        self.norm_attn = nn.LayerNorm(d_model, eps=norm_eps)
        instance_of("shared_kv", shared_kv, bool, "a bool")
        if attn is not None:
            instance_of("attn", attn, nn.Module, "an attention nn.Module (e.g. LatentAttention) or None")
            for name, value in (("qk_norm", qk_norm), ("head_dim", head_dim), ("shared_kv", shared_kv or None)):
                if value is not None:
                    raise ValueError(f"{name}={value!r} is an option of the block's own MultiHeadAttention; "
                                     f"the given attn ({type(attn).__name__}) has its own projections")
            self.attn = attn
        else:
            self.attn = (SharedKVAttention if shared_kv else MultiHeadAttention)(
                d_model, d_model, None, dropout_p, num_heads,
                qkv=QKV(num_kv_heads=num_kv_heads, bias=bias, out_bias=bias, qk_norm=qk_norm, head_dim=head_dim),
                pattern=pattern_of(causal, window, chunk), positions=positions, softcap=softcap, sinks=sinks,
                backend=backend,
            )
        self.norm_cross = self.cross_attn = None
        if cross_attention:
            self.norm_cross = nn.LayerNorm(d_model, eps=norm_eps)
            self.cross_attn = MultiHeadAttention(
                d_model, d_model, None, dropout_p, num_heads, pattern=None, backend=backend,
                qkv=QKV(num_kv_heads=num_kv_heads, kdim=d_context, bias=bias, out_bias=bias),
            )
        instance_of("mlp", mlp, bool, "a bool")
        self.norm_mlp = self.mlp = None
        if mlp:
            self.norm_mlp = nn.LayerNorm(d_model, eps=norm_eps)
            self.mlp = FeedForward(d_model, d_ff=d_ff, dropout_p=dropout_p, bias=bias, activation=activation)
        self.residual_dropout = nn.Dropout(dropout_p)

    def forward(
        self, x: Tensor, *, padding_mask: Tensor | None = None, mask: Tensor | Callable | None = None,
        context: Tensor | None = None, context_padding_mask: Tensor | None = None,
        cache: Cache | None = None, return_weights: bool = False,
        document_ids: Tensor | None = None, kv: KVShare | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Run the layer; with ``return_weights`` also the self-attention weights ``(B, H, T, Tk)``.

        The weights come from the attention call that produces the output (see
        :meth:`MultiHeadAttention.forward`), so asking for them does not change the output.
        ``document_ids`` ``(T,)``/``(B, T)`` packs documents: self-attention stays inside each
        one and rotary positions restart (see :meth:`MultiHeadAttention.forward`). ``kv``: the
        :class:`~attnlab.nn.KVShare` the self-attention fills (a source layer) or reads (a
        ``shared_kv`` block), see :mod:`attnlab.nn.kv_sharing`.

        Example:
            >>> TransformerBlock(8, 2)(torch.randn(1, 3, 8)).shape
            torch.Size([1, 3, 8])
        """
        if (context is None) != (self.cross_attn is None):
            raise ValueError(
                "context must be given exactly when the block has cross-attention; "
                f"cross_attention={self.cross_attn is not None}, context given={context is not None}"
            )
        instance_of("x", x, Tensor, "a torch.Tensor")
        d_model = self.norm_attn.normalized_shape[0]
        if x.ndim not in (2, 3) or x.shape[-1] != d_model:
            raise ValueError(f"x must be (B, T, {d_model}) or (T, {d_model}), got shape {tuple(x.shape)}")
        # Self-attention writes the cache; a failing cross-attention or MLP must undo that.
        with _restore_on_error([cache], _num_new(x)):
            return self._layers(x, padding_mask, mask, context, context_padding_mask, cache, return_weights,
                                document_ids, kv)

    def decode_step(self, x: Tensor, cache: Cache | None, kv: KVShare | None = None) -> Tensor:
        """The block on one decoding step's ``x`` ``(B, 1, d_model)``, writing ``cache``: what
        ``self(x, cache=cache)`` computes, without the checks and the cache guard of a user's
        call (the caller owns the cache, as :meth:`attnlab.models.GPT.generate` does). A
        post-norm or cross-attention block, or one in training, takes :meth:`forward`.

        Example:
            >>> block = TransformerBlock(8, 2).eval()
            >>> cache, x = block.attn.new_cache(1, 4), torch.randn(1, 1, 8)
            >>> torch.equal(block.decode_step(x, cache), block(x, cache=block.attn.new_cache(1, 4)))
            True
        """
        if not self.norm_first or self.cross_attn is not None or self.training:
            return self(x, cache=cache, kv=kv)
        shared = {} if kv is None else {"kv": kv}  # attention modules of their own take no kv
        x = x + self.attn(self.norm_attn(x), cache=cache, **shared)  # (B, 1, d_model)
        mlp = self.mlp  # its dropout is the identity out of training
        if type(mlp) is not FeedForward:
            return x if mlp is None else x + mlp(self.norm_mlp(x))
        return x + mlp.fc_out(mlp.act(mlp.fc_in(self.norm_mlp(x))))

    def _layers(self, x, padding_mask, mask, context, context_padding_mask, cache, return_weights,
                document_ids=None, kv=None):
        weights = None
        shared = {} if kv is None else {"kv": kv}
        if kv is not None and not isinstance(self.attn, MultiHeadAttention):
            raise ValueError(f"kv (cross-layer KV sharing) is for multi-head self-attention; this block's attention "
                             f"is a {type(self.attn).__name__}")

        def self_attention(h: Tensor) -> Tensor:
            nonlocal weights
            weights_asked = {"return_weights": True} if return_weights else {}  # modules without weights
            if not isinstance(self.attn, MultiHeadAttention):
                result = self.attn(h, mask=mask, padding_mask=padding_mask, cache=cache, document_ids=document_ids,
                                   **weights_asked)
            else:
                result = self.attn(h, mask=_call_mask(mask, padding_mask, document_ids), cache=cache, **weights_asked,
                                   **shared)
            if not return_weights:
                return result
            result, weights = result
            return result

        x = self._residual(x, self.norm_attn, self_attention, self.residual_dropout)
        if self.cross_attn is not None:
            x = self._residual(
                x, self.norm_cross,
                lambda h: self.cross_attn(h, context=context, mask=_call_mask(None, context_padding_mask, None)),
                self.residual_dropout,
            )
        if self.mlp is not None:
            x = self._residual(x, self.norm_mlp, self.mlp, None)  # the MLP applies its own dropout
        return (x, weights) if return_weights else x

    def _residual(self, x: Tensor, norm: nn.LayerNorm, sublayer: Callable[[Tensor], Tensor],
                  dropout: nn.Module | None) -> Tensor:
        """``x + sublayer(norm(x))`` (pre-norm) or ``norm(x + sublayer(x))`` (post-norm)."""
        drop = dropout if dropout is not None else (lambda t: t)
        if self.norm_first:
            return x + drop(sublayer(norm(x)))
        return norm(x + drop(sublayer(x)))


def _call_mask(mask, padding_mask, document_ids):
    """A :class:`MultiHeadAttention` call's one mask from the block's three (None when all are)."""
    if padding_mask is None and document_ids is None:
        return mask
    return CallMask(mask, padding=padding_mask, documents=document_ids)


def _num_new(x: object) -> int:
    """Tokens a call on ``x`` ``(B, T, C)``/``(T, C)`` appends to a cache (0 if x is not a tensor)."""
    return x.shape[-2] if isinstance(x, Tensor) and x.ndim >= 2 else 0


class _Stack(nn.Module):
    """``num_layers`` blocks and a final LayerNorm; the encoder and decoder configure it."""

    def __init__(self, num_layers: int, d_model: int, num_heads: int, *, causal: bool,
                 cross_attention: bool, norm_eps: float = 1e-5, **block_options):
        super().__init__()
        positive_int("num_layers", num_layers)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, causal=causal, cross_attention=cross_attention,
                             norm_eps=norm_eps, **block_options)
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model, eps=norm_eps)

    def _run(self, x: Tensor, caches: list[KVCache] | None, **kwargs) -> Tensor:
        if caches is None:
            caches = [None] * len(self.layers)
        instance_of("caches", caches, (list, tuple), "a list of one KVCache per layer")
        if len(caches) != len(self.layers):
            raise ValueError(f"caches must hold one KVCache per layer ({len(self.layers)}), got {len(caches)}")
        # A layer that fails after earlier layers wrote their caches puts all of them back.
        with _restore_on_error(caches, _num_new(x)):
            for layer, cache in zip(self.layers, caches):
                x = layer(x, cache=cache, **kwargs)
        return self.norm(x)


class TransformerEncoder(_Stack):
    """A stack of non-causal pre-norm blocks (BERT-style encoder) with a final LayerNorm.

    Padded positions (``padding_mask`` False) are never attended, so they do not change the
    outputs at real positions; their own outputs are computed but meaningless.

    Shapes:
        x: ``(B, T, d_model)``; padding_mask: ``(B, T)`` True at real tokens -> ``(B, T, d_model)``.

    Args:
        num_layers: number of blocks.
        d_model, num_heads: width and heads.
        **options: keyword-only :class:`TransformerBlock` options (``d_ff``, ``dropout_p``,
            ``num_kv_heads``, ``positions``, ``bias``, ``norm_eps``, ``backend``, ``mlp``).

    Example:
        >>> enc = TransformerEncoder(2, 16, 2, d_ff=32)
        >>> enc(torch.randn(2, 6, 16), padding_mask=torch.ones(2, 6, dtype=torch.bool)).shape
        torch.Size([2, 6, 16])
    """

    def __init__(self, num_layers: int, d_model: int, num_heads: int, **options):
        super().__init__(num_layers, d_model, num_heads, causal=False, cross_attention=False, **options)

    def forward(self, x: Tensor, *, padding_mask: Tensor | None = None,
                mask: Tensor | Callable | None = None) -> Tensor:
        return self._run(x, None, padding_mask=padding_mask, mask=mask)


class TransformerDecoder(_Stack):
    """A stack of causal pre-norm blocks (GPT-style), optionally cross-attending to a context.

    Shapes:
        x: ``(B, T, d_model)``; context: ``(B, Tc, d_context)``; padding_mask: ``(B, T)`` (or
        ``(B, cached + T)`` with caches); context_padding_mask: ``(B, Tc)`` -> ``(B, T, d_model)``.

    Args:
        num_layers: number of blocks.
        d_model, num_heads: width and heads.
        cross_attention: each block also attends to ``context`` (encoder-decoder models).
        **options: keyword-only :class:`TransformerBlock` options (``d_ff``, ``dropout_p``,
            ``num_kv_heads``, ``d_context``, ``positions``, ``bias``, ``norm_eps``, ``backend``, ``mlp``).

    Example:
        >>> dec = TransformerDecoder(2, 16, 2, positions="rope")
        >>> caches = dec.new_cache(1, max_len=8)
        >>> with torch.no_grad():
        ...     _ = dec(torch.randn(1, 3, 16), caches=caches)
        ...     step = dec(torch.randn(1, 1, 16), caches=caches)
        >>> step.shape, caches[0].length
        (torch.Size([1, 1, 16]), 4)
    """

    def __init__(self, num_layers: int, d_model: int, num_heads: int, *,
                 cross_attention: bool = False, **options):
        super().__init__(num_layers, d_model, num_heads, causal=True,
                         cross_attention=cross_attention, **options)

    def forward(
        self, x: Tensor, *, context: Tensor | None = None, padding_mask: Tensor | None = None,
        context_padding_mask: Tensor | None = None, caches: list[KVCache] | None = None,
    ) -> Tensor:
        return self._run(x, caches, padding_mask=padding_mask, context=context,
                         context_padding_mask=context_padding_mask)

    def new_cache(self, batch_size: int, max_len: int, **options) -> list[KVCache]:
        """One empty self-attention :class:`KVCache` per layer.

        Example:
            >>> len(TransformerDecoder(3, 8, 2).new_cache(1, 4))
            3
        """
        return [layer.attn.new_cache(batch_size, max_len, **options) for layer in self.layers]
