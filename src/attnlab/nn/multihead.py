"""Multi-head attention as one production module on top of :func:`attnlab.attention`.

The module keeps the tutorials' constructor ``MultiHeadAttention(d_in, d_out,
context_length, dropout_p, num_heads)`` (the tutorials' positional call) and grows into what a model needs: one fused Q/K/V
projection, grouped-query and multi-query attention (``num_kv_heads``), cross-attention to a
``context`` of another width, padding masks, a KV cache for decoding, rotary embeddings, and
conversion to and from ``torch.nn.MultiheadAttention`` (:mod:`attnlab.nn.convert`).

Masks follow attnlab's polarity everywhere: **True = may be attended**. ``padding_mask`` is
True at real tokens. This is the opposite of ``torch.nn.MultiheadAttention``'s
``key_padding_mask`` (True = ignore), which is why the argument has a different name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import (divisible, instance_of, integer_dtype, one_of, positive_int,
                             positive_number, probability)
from attnlab.backends import build_call, check_backend_name
from attnlab.backends import get as get_backend
from attnlab.backends.dispatch import reasons_of
from attnlab import masks as _masks
from attnlab import scores as _scores
from attnlab.functional import attention
from attnlab.nn.cache import (Cache, ChunkedKVCache, KVCache, PagedKVCache, WindowedKVCache, _cache_options,
                               _restore_on_error, new_positions)
from attnlab.nn.positional import ALiBi, QueryTemperature, RotaryEmbedding, apply_rotary

from attnlab.nn.parts import (QKV, CallMask, Chunk, KVShare, QKNorm, Window, _check_chunk, _check_pattern,  # noqa: F401
                               _check_window, _mask_parts, _refuse_removed, pattern_of)

__all__ = ["MultiHeadAttention", "QKV", "QKNorm", "Window", "Chunk", "CallMask", "pattern_of"]

_PARTS = ("query", "key", "value")


class _KeyPaddingMod(_masks.MaskMod):
    """A ``(B, Tk)`` padding tensor as a mask mod, to combine with a user's mask mod."""

    def __init__(self, padding_mask: Tensor):
        self.padding_mask = padding_mask

    def __call__(self, b, h, q_idx, kv_idx):
        return self.padding_mask[b, kv_idx]


class HeadRMSNorm(nn.Module):
    """RMSNorm of a :class:`QKNorm`, its ``q_norm``/``k_norm``: over the last axis (a head's
    ``dim`` features) or, for ``QKNorm(over="all")``, over the last two (a token's ``heads`` heads).

    ``weight * x / sqrt(mean(x**2) + eps)`` (or ``(1 + weight) * ...`` with ``unit_offset``),
    normalised in fp32 for half-precision inputs, each form rounded where its model rounds:
    Qwen3 casts the normalised ``x`` back before the weight, Gemma 3 / Qwen3.5 / OLMo-2 after it.

    Shapes:
        x: ``(..., dim)`` (``(..., heads, dim)`` over all heads) -> same shape; weight ``(dim,)``
        (``(heads * dim,)``).

    Example:
        >>> HeadRMSNorm(4, QKNorm(eps=1e-12))(torch.tensor([2.0, -2.0, 2.0, 2.0]))
        tensor([ 1., -1.,  1.,  1.], grad_fn=<MulBackward0>)
        >>> HeadRMSNorm(2, QKNorm(eps=1e-12, over="all"), heads=2)(torch.tensor([[4.0, 4.0], [0.0, 0.0]]))
        tensor([[1.4142, 1.4142],
                [0.0000, 0.0000]], grad_fn=<MulBackward0>)
    """

    def __init__(self, dim: int, part: QKNorm, *, heads: int = 1):
        super().__init__()
        self.eps, self.unit_offset, self.over = part.eps, part.unit_offset, part.over
        size = dim * heads if part.over == "all" else dim
        self.weight = nn.Parameter(torch.zeros(size) if part.unit_offset else torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        work = torch.promote_types(x.dtype, torch.float32)  # half precision normalises in fp32
        x32 = x.to(work)
        every = self.over == "all"
        normed = x32 * torch.rsqrt(x32.pow(2).mean((-2, -1) if every else -1, keepdim=True) + self.eps)
        weight = self.weight.view(x.shape[-2:]) if every else self.weight  # (heads, dim) or (dim,)
        if self.unit_offset:
            return (normed * (1.0 + weight.to(work))).to(x.dtype)
        if every:  # OLMo-2 rounds after the weight
            return (weight.to(work) * normed).to(x.dtype)
        return weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, eps={self.eps}" + (", unit_offset=True" if self.unit_offset else "")
                + (", over='all'" if self.over == "all" else ""))


class MultiHeadAttention(nn.Module):
    """Multi-head attention: self-attention (causal by default) or cross-attention.

    ``x`` is projected to ``num_heads`` query heads and ``num_kv_heads`` key/value heads of
    ``head_dim`` features (``d_out // num_heads`` unless ``QKV(head_dim=)`` sets it), each query head attends (through
    :func:`attnlab.attention`, on ``backend``), the heads are concatenated and projected by
    ``out_proj``. With ``context`` the keys and values come from ``context`` instead
    (cross-attention).

    **Weights.** When keys and values have the input's width (``kdim == vdim == d_in``) the
    three projections are stored fused in ``in_proj_weight`` ``(d_q + 2 * d_kv, d_in)``
    (rows: query, key, value; ``d_q = num_heads * head_dim``, which is ``d_out`` unless
    ``QKV(head_dim=)`` sets the heads' width; ``d_kv = num_kv_heads * head_dim``) and
    ``in_proj_bias``, so self-attention is one matmul; ``out_proj`` maps ``d_q`` to ``d_out``.
    Otherwise they are ``q_proj_weight`` ``(d_q, d_in)``,
    ``k_proj_weight`` ``(d_kv, kdim)``, ``v_proj_weight`` ``(d_kv, vdim)`` plus
    ``in_proj_bias`` -- the layout of ``torch.nn.MultiheadAttention``; :meth:`projection`
    gives one part's ``(weight, bias)``. The parameters are initialised exactly as the
    tutorials' three ``nn.Linear`` layers created in that order, then ``out_proj``: after
    ``torch.manual_seed(s)`` the module reproduces the documents' outputs. A ``state_dict``
    saved from the tutorials' module (keys ``W_query.weight``, ...) loads with
    :func:`attnlab.tutorial.load_tutorial_state_dict`; :class:`attnlab.tutorial.Projections`
    shows the parts under the tutorials' names.

    **Masks** (True = may attend) come in two places. The standing ``pattern`` (constructor):
    ``"causal"``, None (every query sees every key), :class:`Window` or :class:`Chunk`. The
    call's ``mask`` (:meth:`forward`): a tensor broadcastable to ``(B, H, Tq, Tk)`` (bool, or a
    float bias), a mask mod, :func:`attnlab.masks.padding_mod` / :func:`attnlab.masks.document_mod`,
    or a :class:`CallMask` of a mask, key ``padding`` ``(B, Tk)`` (True at real key tokens -- the
    **opposite** of ``torch.nn.MultiheadAttention(key_padding_mask=...)``; convert with
    ``~key_padding_mask``) and packed ``documents``. A query with nothing to attend to gets a
    zero context vector (so its output is ``out_proj.bias``), never NaN.

    **Causal** applies to self-attention only: query ``i`` sees keys up to its own position,
    aligned bottom-right when a KV cache holds earlier tokens. With ``context``
    (cross-attention) the pattern is ignored -- every query may see every real context token;
    pass ``mask`` for any other pattern.

    Shapes:
        x: ``(B, Tq, d_in)`` or unbatched ``(Tq, d_in)``.
        context: ``(B, Tk, kdim)`` / ``(Tk, kdim)``; keys and values both read ``context``.
        mask: broadcastable to ``(B, H, Tq, Tk)``; padding: ``(B, Tk)`` / ``(Tk,)``.
        output: ``(B, Tq, d_out)`` / ``(Tq, d_out)``; weights: ``(B, H, Tq, Tk)`` /
        ``(H, Tq, Tk)``. With a cache, ``Tk`` = cached length + ``Tq``.

    Args:
        d_in: width of ``x`` (the query input).
        d_out: width of the output; ``num_heads`` heads of ``d_out // num_heads`` features (or of
            ``QKV(head_dim=)``).
        context_length: optional bound on the number of (cached + new) tokens.
        dropout_p: dropout probability on the attention weights, applied in training only.
        num_heads: number of query heads.
        qkv: the projections part, a :class:`QKV` (key/value heads for grouped-query
            attention, key and value input widths, the Q/K/V and output biases, QK-norm); None:
            ``QKV()``, every head its own keys, inputs of width ``d_in``, no Q/K/V bias, no norm.
            ``QKV(qk_norm=QKNorm())`` (Qwen3, Gemma 3) normalises each projected query and key
            head with an RMSNorm (parameters ``q_norm.weight``, ``k_norm.weight`` ``(head_dim,)``)
            before the rotation; without it the module has no such parameters.
        pattern: the standing mask of self-attention: ``"causal"`` (the default, as in the
            tutorials), None (bidirectional), :class:`Window` ``(size)`` (a causal sliding
            window: query ``i`` sees keys ``i - size + 1 .. i``, which the block-sparse backend
            serves by skipping the blocks outside the band; a :class:`~attnlab.nn.WindowedKVCache`
            of ``size`` slots is then the whole cache it needs, :meth:`new_cache` with
            ``windowed=True``) or :class:`Chunk` ``(size)`` (chunked-local attention, Llama 4's
            local layers: query ``i`` sees keys from ``i - i % size`` to ``i``; a
            :class:`~attnlab.nn.ChunkedKVCache` of ``size`` slots is its whole cache).
        positions: the positions part of self-attention, or None. ``"rope"`` (or a
            :class:`~attnlab.nn.positional.RotaryEmbedding` of ``head_dim``) rotates queries and
            keys; ``"alibi"`` (or an :class:`~attnlab.nn.positional.ALiBi` of ``num_heads``) adds
            ALiBi to the scores (causal or, for a non-causal module, symmetric; a KV cache's
            earlier tokens keep their distances; with a cache, a :class:`KVCache`). Partial RoPE
            (Qwen3.5, GLM): ``RotaryEmbedding(head_dim, rotary_dim=R)`` rotates the first ``R``
            features of each head. A :class:`~attnlab.nn.positional.QueryTemperature` (Llama 4's
            NoPE layers) scales each query by a step function of its position (self-attention only).
        backend: ``"auto"`` or an attention backend name passed to :func:`attnlab.attention`.
        softcap: cap every score with ``softcap * tanh(score / softcap)`` (Gemma 2), or None.
        sinks: give each query head a learnable sink logit (gpt-oss), the parameter ``sinks``
            ``(num_heads,)`` initialised to 0: a key of value 0 that only takes probability mass.
            Score mods and sinks apply before masks (see :mod:`attnlab.scores`).
        attention: the attention function part, with :func:`attnlab.attention`'s signature
            (the default). Every call of the module goes through it, so a wrapper swaps it to
            change how heads attend: :func:`attnlab.distributed.context_parallel` puts a sharded
            one in. A part with ``shards = True`` runs over a sequence split across processes:
            the module then asks it for its tokens' positions (``part.positions(T, device=)``)
            and passes it the layer's whole rule (causal, window, score mods, sinks), never a
            cache, mask, ``context`` or weights.

    The constructor keywords of earlier versions (``qkv_bias``, ``num_kv_heads``, ``kdim``,
    ``vdim``, ``out_bias``, ``causal``, ``window``, ``chunk``) raise a ``TypeError`` naming their
    new spelling.

    Example:
        >>> torch.manual_seed(1240)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> mha = MultiHeadAttention(3, 2, 12, 0.0, 2)        # the tutorials' call
        >>> mha(torch.rand(2, 12, 3)).shape
        torch.Size([2, 12, 2])
        >>> gqa = MultiHeadAttention(64, 64, num_heads=8, qkv=QKV(num_kv_heads=2), positions="rope")
        >>> cache = gqa.new_cache(batch_size=1, max_len=16)
        >>> with torch.no_grad():
        ...     prefill = gqa(torch.randn(1, 5, 64), cache=cache)
        ...     step = gqa(torch.randn(1, 1, 64), cache=cache)
        >>> cache.length, step.shape
        (6, torch.Size([1, 1, 64]))
        >>> gemma_like = MultiHeadAttention(16, 16, num_heads=4, softcap=50.0, sinks=True, positions="alibi")
        >>> gemma_like(torch.randn(2, 5, 16)).shape, gemma_like.sinks.shape
        (torch.Size([2, 5, 16]), torch.Size([4]))
    """

    def __new__(cls, *args, **kwargs):
        _refuse_removed(kwargs)  # the old keywords get their new spelling, not Python's bare TypeError
        return super().__new__(cls)

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int | None = None,
        dropout_p: float = 0.0,
        num_heads: int = 1,
        *,
        qkv: QKV | None = None,
        pattern: str | Window | Chunk | None = "causal",
        positions: str | RotaryEmbedding | ALiBi | None = None,
        backend: str = "auto",
        softcap: float | None = None,
        sinks: bool = False,
        attention: Callable = attention,
    ):
        super().__init__()
        qkv = QKV() if qkv is None else instance_of("qkv", qkv, QKV, "an attnlab.nn.QKV (or None)")
        num_kv_heads = num_heads if qkv.num_kv_heads is None else qkv.num_kv_heads
        kdim = d_in if qkv.kdim is None else qkv.kdim
        vdim = kdim if qkv.vdim is None else qkv.vdim
        self._check_args(d_in, d_out, context_length, dropout_p, num_heads, num_kv_heads, kdim, vdim, qkv.head_dim)
        check_backend_name(backend)
        self.pattern = _check_pattern(pattern)
        self.causal = pattern is not None
        self.window = pattern.size if isinstance(pattern, Window) else None
        self.chunk = pattern.size if isinstance(pattern, Chunk) else None
        self.d_in, self.d_out, self.kdim, self.vdim = d_in, d_out, kdim, vdim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_out // num_heads if qkv.head_dim is None else qkv.head_dim
        self.d_q, self.d_kv = num_heads * self.head_dim, num_kv_heads * self.head_dim  # d_q: d_out unless head_dim
        self.context_length, self.dropout_p = context_length, float(dropout_p)
        self.backend = backend
        self.fused = kdim == d_in and vdim == d_in
        self._make_projections(qkv.bias)
        self.out_proj = nn.Linear(self.d_q, d_out, bias=qkv.out_bias)
        self.positions = self._make_positions(positions)
        self._make_qk_norm(qkv.qk_norm)
        self.softcap = None if softcap is None else positive_number("softcap", softcap)
        instance_of("sinks", sinks, bool, "a bool")
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None
        if not callable(attention):
            raise TypeError(f"attention must be a function with attnlab.attention's signature, got "
                            f"{type(attention).__name__}")
        self.attention = attention
        self._refuse_backend()

    @property
    def qkv(self) -> QKV:
        """The projections part as given (heads and widths resolved)."""
        return QKV(num_kv_heads=self.num_kv_heads, kdim=self.kdim, vdim=self.vdim,
                   bias=self.in_proj_bias is not None, out_bias=self.out_proj.bias is not None,
                   qk_norm=self.qk_norm, head_dim=None if self.d_q == self.d_out else self.head_dim)

    def _make_positions(self, positions) -> RotaryEmbedding | ALiBi | QueryTemperature | None:
        """The positions part from its name or as given (its sizes checked)."""
        if isinstance(positions, str):
            one_of("positions", positions, ("rope", "alibi"))
            return RotaryEmbedding(self.head_dim) if positions == "rope" else ALiBi(self.num_heads)
        if (positions is None or (isinstance(positions, RotaryEmbedding) and positions.head_dim == self.head_dim)
                or (isinstance(positions, ALiBi) and positions.num_heads == self.num_heads)
                or isinstance(positions, QueryTemperature)):
            return positions
        raise ValueError(f"positions must be None, 'rope', 'alibi', a QueryTemperature, a RotaryEmbedding(head_dim="
                         f"{self.head_dim}) or an ALiBi(num_heads={self.num_heads}); got {positions!r}")

    def _make_qk_norm(self, part: object) -> None:
        """``q_norm`` and ``k_norm`` of ``head_dim`` from a :class:`QKNorm`; None for None (no parameters)."""
        if part is None:
            self.q_norm = self.k_norm = None
            return
        self.q_norm = HeadRMSNorm(self.head_dim, part, heads=self.num_heads)
        self.k_norm = HeadRMSNorm(self.head_dim, part, heads=self.num_kv_heads)

    @property
    def qk_norm(self) -> QKNorm | None:
        """The projections part's QK-norm, or None."""
        norm = self.q_norm
        return None if norm is None else QKNorm(eps=norm.eps, unit_offset=norm.unit_offset, over=norm.over)

    @property
    def rope(self) -> RotaryEmbedding | None:
        """The positions part when it rotates queries and keys, else None."""
        return self.positions if isinstance(self.positions, RotaryEmbedding) else None

    @property
    def alibi_slopes(self) -> Tensor | None:
        """ALiBi's slopes ``(num_heads,)`` when the positions part is ALiBi, else None."""
        return self.positions.slopes if isinstance(self.positions, ALiBi) else None

    def _refuse_backend(self) -> None:
        """``ValueError`` when the named backend declines what every call of this module
        carries (its softcap, ALiBi or sinks): refused here, not at its first call. Asked of
        a small CPU call with and without them, so only the reasons they add count."""
        if self.backend == "auto":
            return
        q = torch.zeros(1, self.num_heads, 2, 2)  # (B, H, T, D)
        sinks = None if self.sinks is None else self.sinks.detach().cpu()
        backend = get_backend(self.backend)
        plain = reasons_of(backend, build_call(q, q, q), named=True)
        added = [reason for reason in reasons_of(backend, build_call(
            q, q, q, score_mod=self._score_mod(0, False), sinks=sinks), named=True) if reason not in plain]
        if added:
            raise ValueError(f"backend={self.backend!r} cannot serve this module's calls (softcap="
                             f"{self.softcap}, sinks={self.sinks is not None}, positions="
                             f"{type(self.positions).__name__ if self.positions is not None else None}): "
                             + "; ".join(added))

    def _score_mod(self, offset: int, cross: bool) -> _scores.ScoreMod | None:
        """The softcap, then ALiBi at query positions ``offset + i`` (self-attention only)."""
        mods = []
        if self.softcap is not None:
            mods.append(_scores.softcap(self.softcap))
        if self.alibi_slopes is not None:
            if cross:
                raise ValueError("positions='alibi' applies to self-attention; cross-attention "
                                 "(context=) has no distance between query and key positions")
            mods.append(_scores.alibi(self.alibi_slopes, symmetric=not self.causal, offset=offset))
        return _scores.compose(*mods) if mods else None

    @staticmethod
    def _check_args(d_in, d_out, context_length, dropout_p, num_heads, num_kv_heads, kdim, vdim, head_dim):
        for name, size in (("d_in", d_in), ("d_out", d_out), ("num_heads", num_heads),
                           ("num_kv_heads", num_kv_heads), ("kdim", kdim), ("vdim", vdim)):
            positive_int(name, size)
        if head_dim is None:  # heads of their own width need not divide d_out
            divisible("d_out", d_out, "num_heads", num_heads)
        divisible("num_heads", num_heads, "num_kv_heads", num_kv_heads)
        if context_length is not None:
            positive_int("context_length", context_length)
        probability("dropout_p", dropout_p)

    def _make_projections(self, qkv_bias: bool) -> None:
        """Create the Q/K/V parameters and initialise them as three ``nn.Linear`` in order."""
        sizes = (self.d_q, self.d_kv, self.d_kv)
        if self.fused:
            self.in_proj_weight = nn.Parameter(torch.empty(sum(sizes), self.d_in))
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(self.d_q, self.d_in))
            self.k_proj_weight = nn.Parameter(torch.empty(self.d_kv, self.kdim))
            self.v_proj_weight = nn.Parameter(torch.empty(self.d_kv, self.vdim))
        self.in_proj_bias = nn.Parameter(torch.empty(sum(sizes))) if qkv_bias else None
        self._reset_qkv()

    def _reset_qkv(self) -> None:
        # nn.Linear.reset_parameters on each part in turn: same random numbers, same values.
        with torch.no_grad():
            for part in _PARTS:
                weight, bias = self.projection(part)
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
                if bias is not None:
                    bound = 1.0 / math.sqrt(weight.shape[1])
                    nn.init.uniform_(bias, -bound, bound)

    def projection(self, part: str) -> tuple[Tensor, Tensor | None]:
        """``(weight, bias)`` of the ``"query"``, ``"key"`` or ``"value"`` projection.

        When the weights are fused these are views of rows of ``in_proj_weight`` and
        ``in_proj_bias``: they share storage, so an in-place edit under ``torch.no_grad()``
        edits the module. The projection is ``F.linear(x, weight, bias)``.

        Shapes:
            query: weight ``(d_q, d_in)``, bias ``(d_q,)`` (``d_q = num_heads * head_dim``, ``d_out`` unless
            ``QKV(head_dim=)`` says otherwise); key: ``(d_kv, kdim)``,
            ``(d_kv,)``; value: ``(d_kv, vdim)``, ``(d_kv,)``. ``bias`` is None without
            ``qkv_bias``.

        Example:
            >>> mha = MultiHeadAttention(4, 6, num_heads=2, qkv=QKV(num_kv_heads=1, bias=True))
            >>> weight, bias = mha.projection("key")
            >>> weight.shape, torch.equal(weight, mha.in_proj_weight[6:9]), bias.shape
            (torch.Size([3, 4]), True, torch.Size([3]))
        """
        index = _PARTS.index(one_of("part", part, _PARTS))
        starts = (0, self.d_q, self.d_q + self.d_kv, self.d_q + 2 * self.d_kv)
        rows = slice(starts[index], starts[index + 1])
        if self.fused:
            weight = self.in_proj_weight[rows]
        else:
            weight = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)[index]
        bias = None if self.in_proj_bias is None else self.in_proj_bias[rows]
        return weight, bias

    # ----------------------------------------------------------------- projections
    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention projections, one matmul when the weights are fused.

        Shapes:
            x: ``(B, T, d_in)`` -> q ``(B, H, T, hd)``, k and v ``(B, Hkv, T, hd)``.

        Example:
            >>> q, k, v = MultiHeadAttention(8, 8, num_heads=4, qkv=QKV(num_kv_heads=2)).project_qkv(
            ...     torch.randn(1, 3, 8))
            >>> q.shape, k.shape
            (torch.Size([1, 4, 3, 2]), torch.Size([1, 2, 3, 2]))
        """
        if not self.fused:
            return self.project_q(x), *self.project_kv(x)
        B, T, _ = x.shape
        hd, d_q, d_kv = self.head_dim, self.d_q, self.d_kv
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # (B, T, d_q + 2 d_kv)
        q, k, v = qkv.split((d_q, d_kv, d_kv), dim=-1)
        q, k = q.view(B, T, self.num_heads, hd), k.view(B, T, self.num_kv_heads, hd)  # (B, T, H|Hkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return (q.transpose(1, 2),  # (B, H, T, hd)
                k.transpose(1, 2),  # (B, Hkv, T, hd)
                v.view(B, T, self.num_kv_heads, hd).transpose(1, 2))

    def project_q(self, x: Tensor) -> Tensor:
        """Query projection ``(B, T, d_in) -> (B, H, T, hd)``.

        Example:
            >>> MultiHeadAttention(8, 8, num_heads=4).project_q(torch.randn(1, 3, 8)).shape
            torch.Size([1, 4, 3, 2])
        """
        B, T, _ = x.shape
        q = F.linear(x, *self.projection("query")).view(B, T, self.num_heads, self.head_dim)  # (B, T, H, hd)
        return (q if self.q_norm is None else self.q_norm(q)).transpose(1, 2)  # (B, H, T, hd)

    def project_kv(self, context: Tensor, value_input: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Key and value projections of ``context`` (values of ``value_input`` if given).

        Shapes:
            context: ``(B, Tk, kdim)``; value_input: ``(B, Tk, vdim)`` -> k, v ``(B, Hkv, Tk, hd)``.

        Example:
            >>> k, v = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(kdim=5)).project_kv(torch.randn(1, 3, 5))
            >>> k.shape
            torch.Size([1, 2, 3, 4])
        """
        if self.fused and value_input is None:
            weight, bias = self.in_proj_weight[self.d_q :], None
            if self.in_proj_bias is not None:
                bias = self.in_proj_bias[self.d_q :]
            k, v = F.linear(context, weight, bias).split((self.d_kv, self.d_kv), dim=-1)
        else:
            k = F.linear(context, *self.projection("key"))
            v = F.linear(context if value_input is None else value_input, *self.projection("value"))
        B, T, _ = k.shape
        k = k.view(B, T, self.num_kv_heads, self.head_dim)  # (B, Tk, Hkv, hd)
        return ((k if self.k_norm is None else self.k_norm(k)).transpose(1, 2),  # (B, Hkv, Tk, hd)
                v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2))

    # --------------------------------------------------------------------- forward
    def forward(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | Callable | CallMask | None = None,
        cache: KVCache | None = None,
        return_weights: bool = False,
        value_input: Tensor | None = None,
        kv: KVShare | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend and project; see the class docstring for shapes and mask polarity.

        The common call (self-attention, no cache, mask, positions or window) is checked once
        and goes straight to the attention part: project, attend, out-project. A decoding step
        (one new token per row, a :class:`KVCache`, no mask) takes :meth:`_decode_step`.

        Args:
            x: queries' input ``(B, Tq, d_in)`` or ``(Tq, d_in)``.
            context: keys' and values' input for cross-attention; None = self-attention.
            mask: this call's mask, ANDed with the module's ``pattern``: a bool (True = may
                attend) / float (added to scores) tensor broadcastable to ``(B, H, Tq, Tk)``, a
                mask mod ``(b, h, q_idx, kv_idx) -> bool``, :func:`attnlab.masks.padding_mod`
                (key lengths ``(B,)``), :func:`attnlab.masks.document_mod` (packed documents, its
                ``causal`` the module's), or a :class:`CallMask` of a mask, key ``padding``
                ``(B, Tk)`` (True at real keys; cached + new with a cache) and ``documents``.
                Documents go with self-attention and no cache; rotary positions restart at 0 at
                each document start.
            cache: a :class:`~attnlab.nn.Cache` from :meth:`new_cache`; the new keys/values are
                appended and the queries attend to everything cached they may see
                (self-attention only). A mask goes with a :class:`KVCache` only; a paged cache's
                rows may hold different lengths and return no weights.
            return_weights: also return the per-head attention weights ``(B, H, Tq, Tk)``
                (before dropout); ``out`` is computed exactly as without them.
            value_input: values' input ``(B, Tk, vdim)`` when it differs from ``context``.
            kv: a :class:`~attnlab.nn.kv_sharing.KVShare` to fill with the keys and values this
                call attends with (cached + new) and its query positions, for the later layers
                that read them (cross-layer KV sharing; self-attention, unsharded).

        Returns:
            ``out`` ``(B, Tq, d_out)``, or ``(out, weights)`` when ``return_weights``.
        """
        shared = kv is None or kv.__class__ is KVShare  # anything else: the general path refuses it
        if cache.__class__ is KVCache and mask is None and context is None and not return_weights and shared:
            step = self._decode_step(x, cache)  # None: not a plain decoding step, the general path below
            if step is not None:  # the one query is the newest token: it sees every cached key, no mask
                if kv is not None:  # a source layer: its readers attend over these keys, at its position
                    kv.keys, kv.values, kv.lengths, kv.positions = step[1], step[2], None, cache.length - 1
                out = self.attention(*step, causal=False, dropout_p=0.0, backend=self.backend,
                                     sinks=self.sinks)  # (B, H, 1, hd)
                return self.out_proj(out.reshape(x.shape[0], 1, self.d_q))  # (B, 1, d_out); T = 1: no transpose
        self._check_inputs(x, context, value_input)
        if (context is None and mask is None and cache is None and shared
                and not return_weights and x.ndim == 3 and self.fused
                and (self.positions is None or isinstance(self.positions, RotaryEmbedding))
                and self.window is None and self.chunk is None and self.softcap is None
                and (self.context_length is None or x.shape[1] <= self.context_length)
                and not getattr(self.attention, "shards", False)):
            B, T, _ = x.shape
            q, k, v = self.project_qkv(x)  # (B, H, T, hd), (B, Hkv, T, hd) x2
            if self.positions is not None:  # rotary, positions 0 .. T - 1
                cos, sin = self.positions.cos_sin(T, dtype=q.dtype, device=q.device)  # (T, hd/2)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if kv is not None:  # a source layer: its readers attend over these keys, positions from 0
                kv.keys, kv.values, kv.lengths, kv.positions = k, v, None, 0
            out = self.attention(q, k, v, causal=self.causal, dropout_p=self.dropout_p if self.training else 0.0,
                                 backend=self.backend, sinks=self.sinks)  # (B, H, T, hd)
            return self.out_proj(out.transpose(1, 2).reshape(B, T, self.d_q))  # (B, T, d_out)
        mask, padding_mask, document_ids = _mask_parts(mask, self.causal)
        unbatched = x.ndim == 2
        x, context, value_input, mask, padding_mask = _batch_inputs(x, context, value_input, mask, padding_mask,
                                                                     unbatched)
        if kv is not None:
            _check_share(kv, context, self.attention)
        if getattr(self.attention, "shards", False):
            out, weights = self._attend_shards(x, context, mask, padding_mask, cache, return_weights, document_ids)
        else:
            documents = _check_documents(document_ids, x, context, cache, "documents (CallMask(documents=...))")
            if documents is not None and self.chunk is not None:
                raise ValueError(f"documents with pattern=Chunk({self.chunk}): chunks count from each row's start, "
                                 "not each document's; run the documents as rows of their own")
            if cache is not None:
                _check_cache(cache, x, context, self.num_kv_heads, self.window, self.chunk)
                _check_cache_options(cache, mask, padding_mask, return_weights, self.alibi_slopes is not None)
            # Everything that can be checked is checked before the cache is written; the guard
            # puts the cache back if attention itself fails afterwards.
            with _restore_on_error([cache], x.shape[1]):
                q, k, v, options = self._prepare(x, context, value_input, mask, padding_mask, cache,
                                                 return_weights, documents, kv)
                result = self.attention(q, k, v, **options)  # (B, H, Tq, hd), weights (B, H, Tq, Tk)
                out, weights = result if return_weights else (result, None)
                out = self.out_proj(out.transpose(1, 2).reshape(*x.shape[:2], self.d_q))  # (B, Tq, d_out)
        if unbatched:
            out, weights = out[0], None if weights is None else weights[0]
        return (out, weights) if return_weights else out

    def _decode_step(self, x: Tensor, cache: KVCache) -> tuple[Tensor, Tensor, Tensor] | None:
        """One decoding step's ``(q, keys, values)`` for the attention part, ``x`` ``(B, 1, d_in)``
        written to a :class:`KVCache`; None when the call is not one (the general path then checks
        it and raises what is wrong). :meth:`forward` calls the part itself, one frame below it.

        The step :meth:`forward` takes when it can: fused projections, rotary or no positions, the
        causal pattern, no score mods, an unsharded part, eval (or no dropout). Everything the
        general path would check is checked here with attribute reads only, before the cache is
        written; the rotary tables are the positions part's cached ones, sliced at the new position.

        Shapes:
            x: ``(B, 1, d_in)`` -> q ``(B, H, 1, hd)``, keys and values ``(B, Hkv, length + 1, hd)``.
        """
        weight = self.out_proj.weight
        length = cache.length
        if not (isinstance(x, Tensor) and x.ndim == 3 and x.shape[1] == 1 and x.shape[2] == self.d_in and self.fused
                and x.dtype == weight.dtype and x.device == weight.device and self.pattern == "causal"
                and self.softcap is None and type(self.positions) in (type(None), RotaryEmbedding, QueryTemperature)
                and (not self.training or self.dropout_p == 0.0) and not getattr(self.attention, "shards", False)
                and cache.keys.shape[:2] == (x.shape[0], self.num_kv_heads) and cache.keys.dtype == x.dtype
                and cache.keys.device == x.device and length < cache.keys.shape[2]
                and (self.context_length is None or length < self.context_length)):
            return None
        B, H, qk = x.shape[0], self.num_heads, self.num_heads + self.num_kv_heads
        heads = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(B, qk + self.num_kv_heads, 1, self.head_dim)
        # (B, H + 2 Hkv, 1, hd): query, key, value heads in the fused rows' order (T = 1: no transpose)
        if self.q_norm is not None:  # normed heads, then rotated: H + Hkv new rows; (B, 1, H|Hkv, hd) for the norms
            heads = torch.cat((self.q_norm(heads[:, :H].transpose(1, 2)).transpose(1, 2),
                               self.k_norm(heads[:, H:qk].transpose(1, 2)).transpose(1, 2), heads[:, qk:]), dim=1)
        if self.rope is not None:  # queries and keys rotated in one call
            cos, sin = self.positions.cos_sin(1, offset=length, dtype=x.dtype, device=x.device)  # (1, hd/2)
            rotated = apply_rotary(heads[:, :qk], cos, sin)  # (B, H + Hkv, 1, hd)
            q, k = rotated[:, :H], rotated[:, H:]
        else:
            q, k = heads[:, :H], heads[:, H:qk]
            if self.positions is not None:  # a QueryTemperature: the query scaled at its position
                q = self.positions.at(q, length)
        return (q, *cache.append(k, heads[:, qk:]))  # keys, values (B, Hkv, length + 1, hd)

    def _prepare(self, x, context, value_input, mask, padding_mask, cache, return_weights, documents=None,
                 kv=None):
        """Project, rotate and cache; ``(q, k, v, options)`` for the attention part (the module's rule).

        Kept out of the call itself, so the part runs one frame below :meth:`forward`.
        ``documents``: ``(B|1, T)`` int64 document ids of a packed batch, or None. ``kv``: a
        :class:`~attnlab.nn.kv_sharing.KVShare` to fill with the keys and values the rule gets."""
        B, Tq, _ = x.shape
        cached = 0 if cache is None else max(cache.row_lengths, default=0)
        Tk = cached + Tq if context is None else context.shape[1]
        if self.context_length is not None and context is None and Tk > self.context_length:
            raise ValueError(f"{Tk} tokens (cached + new) exceed context_length={self.context_length}")
        if documents is not None:
            mask = _with_documents(mask, documents, tq=Tq)
        mask = _combine_masks(mask, padding_mask, batch=B, tk=Tk)
        alibi_offset = 0 if cache is None or self.alibi_slopes is None else cache.length  # a KVCache
        score_mod = self._score_mod(alibi_offset, context is not None)
        q, k, v = self._qkv(x, context, value_input, cache, documents)
        lengths = None
        if kv is not None:  # the queries' positions, read before the cache grows
            kv.positions = (_masks.document_positions(documents) if documents is not None
                            else new_positions(cache, Tq, device=x.device))
        if cache is not None:
            k, v, lengths = cache.extend(k, v)  # every key the new queries may see
        if kv is not None:
            kv.keys, kv.values, kv.lengths = k, v, lengths
        own = context is None
        k, v, rule = causal_rule(q, k, v, mask=mask, causal=self.causal and own, window=self.window if own else None,
                                 chunk=self.chunk if own else None, key_lengths=lengths,
                                 keep_keys=return_weights or score_mod is not None)
        return q, k, v, dict(rule, dropout_p=self.dropout_p if self.training else 0.0, backend=self.backend,
                             return_weights=return_weights, score_mod=score_mod, sinks=self.sinks)

    def attend_heads(self, q: Tensor, k: Tensor, v: Tensor, *, mask=None, self_attention: bool = True,
                     return_weights: bool = False, scale: float | None = None, score_mod=None,
                     key_lengths: Tensor | None = None):
        """The module's attention over given heads: its causal rule or window, sinks, dropout,
        backend, and ``score_mod`` (the module's softcap/ALiBi, :meth:`_score_mod`).

        Queries are aligned bottom-right on the keys (the last query is the newest token), so
        ``k`` may start with cached positions; with a ``window`` the sliding window on that
        diagonal replaces the causal mask. ``key_lengths`` (``(B,)``): each row's real keys,
        right-padded to ``Tk``; the rule then aligns on each row's own length (a paged batch).

        Shapes:
            q: ``(B, H, Tq, D)``; k: ``(B, Hkv, Tk, D)``; v: ``(B, Hkv, Tk, Dv)`` ->
            ``(B, H, Tq, Dv)`` (and weights ``(B, H, Tq, Tk)``).

        Example:
            >>> import attnlab
            >>> mha = MultiHeadAttention(8, 8, num_heads=2, pattern=Window(2))
            >>> q = k = v = torch.randn(1, 2, 4, 4)
            >>> torch.allclose(mha.attend_heads(q, k, v), attnlab.attention(
            ...     q, k, v, mask=attnlab.masks.sliding_window_mod(4, 4, 2)), atol=1e-6)
            True
        """
        return attend_causal(q, k, v, mask=mask, causal=self.causal and self_attention, window=self.window
                             if self_attention else None, chunk=self.chunk if self_attention else None, scale=scale, backend=self.backend,
                             dropout_p=self.dropout_p if self.training else 0.0, return_weights=return_weights,
                             score_mod=score_mod, sinks=self.sinks, key_lengths=key_lengths, attend=self.attention)

    def _attend_shards(self, x, context, mask, padding_mask, cache, return_weights, document_ids):
        """Self-attention on this rank's shard ``x`` ``(B, T_local, d_in)`` through a sharded
        attention part: the layer's whole rule (causal, window, softcap, ALiBi, rotary positions
        and sinks) over the global sequence, whose positions the part gives."""
        refused = [name for name, value in (("context", context), ("mask", mask), ("padding", padding_mask),
                                            ("cache", cache), ("documents", document_ids)) if value is not None]
        refused += ["return_weights"] if return_weights else []
        refused += ["attention dropout in training"] if self.training and self.dropout_p > 0 else []
        if refused:
            raise ValueError(f"a sharded attention part ({self.attention!r}) runs the layer's own attention "
                             f"over shards; it cannot take {', '.join(refused)}")
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)  # (B, H, T_local, hd), (B, Hkv, T_local, hd) x2
        positions = self.attention.positions(T, device=x.device)  # (T_local,) global positions
        if self.rope is not None:
            q, k = self.rope.at(q, positions[None]), self.rope.at(k, positions[None])
        elif isinstance(self.positions, QueryTemperature):
            q = self.positions.at(q, positions[None])
        # A window is a mask mod over global positions: with top-left alignment and Tq == Tk its
        # offset is 0, whatever the length, so the part evaluates it at global positions.
        window = None if self.window is None else _masks.sliding_window_mod(T, T, self.window)
        if self.chunk is not None:  # chunks of global positions too
            window = _masks.chunked_local_mod(T, T, self.chunk)
        out = self.attention(q, k, v, causal=self.causal, mask=window, score_mod=self._score_mod(0, False),
                             sinks=self.sinks)  # (B, H, T_local, hd)
        out = out.transpose(1, 2).reshape(B, T, self.d_q)  # (B, T_local, H * hd)
        return self.out_proj(out), None

    def _qkv(self, x, context, value_input, cache, documents=None):
        """Project, apply RoPE at the right positions, and append to the cache."""
        if context is None:
            if x.shape[-1] != self.d_in or not self.fused:
                raise ValueError(
                    f"self-attention needs x (B, T, {self.d_in}) and kdim == vdim == d_in; got x "
                    f"{tuple(x.shape)}, kdim={self.kdim}, vdim={self.vdim} (pass context=)"
                )
            q, k, v = self.project_qkv(x)
        else:
            if x.shape[-1] != self.d_in or context.shape[-1] != self.kdim or context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"x must be (B, Tq, {self.d_in}) and context (B, Tk, {self.kdim}); got x "
                    f"{tuple(x.shape)}, context {tuple(context.shape)}"
                )
            expected = (*context.shape[:2], self.vdim)
            if value_input is not None and tuple(value_input.shape) != expected:
                raise ValueError(
                    f"value_input must be (B, Tk, vdim) = {expected} to match context "
                    f"{tuple(context.shape)}; got {tuple(value_input.shape)}"
                )
            if isinstance(self.positions, QueryTemperature):
                raise ValueError("positions=QueryTemperature applies to self-attention; cross-attention "
                                 "(context=) has no query positions")
            return self.project_q(x), *self.project_kv(context, value_input)
        if self.rope is None and not isinstance(self.positions, QueryTemperature):
            return q, k, v  # k, v: the new tokens' only; the cache adds what it holds
        if documents is not None:
            positions = _masks.document_positions(documents)  # (B|1, T), 0 at each document start
        else:
            positions = new_positions(cache, x.shape[1], device=x.device)  # int, or (B, T) for ragged rows
        if self.rope is not None:
            return self.rope.at(q, positions), self.rope.at(k, positions), v
        return self.positions.at(q, positions), k, v  # a QueryTemperature scales the queries only

    def _check_inputs(self, x, context, value_input) -> None:
        """Tensors of the module's floating dtype (or any float under autocast), on its device,
        ``x`` of rank 2 or 3 and width ``d_in``: one function, no helper calls (every forward
        pays for it)."""
        weight = self.out_proj.weight
        for name, t in (("x", x), ("context", context), ("value_input", value_input)):
            if t is None and name != "x":
                continue
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
            if t.device != weight.device:
                raise ValueError(f"{name} is on {t.device} but the module's weights are on {weight.device}; "
                                 f"move one of them (module.to(...) or {name}.to(...))")
            if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
                raise TypeError(
                    f"{name} has dtype {t.dtype} but the module's weights are {weight.dtype}; "
                    f"convert one of them (e.g. module.to({t.dtype}))"
                )
        if x.ndim not in (2, 3):
            raise ValueError(f"x must be (B, T, d_in) or (T, d_in), got shape {tuple(x.shape)}")
        if context is None and (x.shape[-1] != self.d_in or not self.fused):
            raise ValueError(
                f"self-attention needs x (B, T, {self.d_in}) and kdim == vdim == d_in; got x "
                f"{tuple(x.shape)}, kdim={self.kdim}, vdim={self.vdim} (pass context=)"
            )

    # ------------------------------------------------------------------- helpers
    def new_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None, windowed: bool | None = None,
        page_size: int | None = None,
    ) -> Cache:
        """An empty cache for this module (``num_kv_heads`` heads of ``head_dim``).

        A :class:`KVCache` of ``max_len`` slots by default; with ``page_size`` a
        :class:`PagedKVCache` whose pool holds ``max_len`` slots per row (rounded up to whole
        pages); for a module with a ``window`` (unless ``windowed=False`` or paged) a
        :class:`WindowedKVCache` of ``window`` slots, or a :class:`KVCache` of ``max_len`` slots
        when the window is wider than ``max_len`` (it never slides; ``windowed=True`` forces the ring).

        Example:
            >>> MultiHeadAttention(8, 8, num_heads=4, qkv=QKV(num_kv_heads=1)).new_cache(2, 32)
            KVCache(batch_size=2, num_kv_heads=1, length=0, max_len=32, head_dim=2, dtype=torch.float32)
            >>> MultiHeadAttention(8, 8, num_heads=4, pattern=Window(4)).new_cache(1, 32).window
            4
        """
        return make_cache(batch_size, self.num_kv_heads, max_len, self.head_dim,
                          window=self.window, chunk=self.chunk, windowed=windowed, page_size=page_size,
                          **_cache_options(self.out_proj.weight, dtype, device))

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, "
            f"causal={self.causal}, dropout_p={self.dropout_p}, backend={self.backend!r}"
            + (f", window={self.window}" if self.window is not None else "")
            + (f", head_dim={self.head_dim}" if self.d_q != self.d_out else "")
            + (f", chunk={self.chunk}" if self.chunk is not None else "")
        )


def _check_share(kv: object, context: object, attention: object) -> None:
    """``kv=``: a :class:`~attnlab.nn.kv_sharing.KVShare`, for self-attention with an unsharded part."""
    instance_of("kv", kv, KVShare, "an attnlab.nn.KVShare (or None)")
    if context is not None or getattr(attention, "shards", False):
        raise ValueError("kv (cross-layer KV sharing) is for self-attention with an unsharded attention part; got "
                         + ("context" if context is not None else f"the sharded part {attention!r}"))


def _batch_inputs(x, context, value_input, mask, padding_mask, unbatched):
    """Add a batch axis of 1 to unbatched inputs (and masks)."""
    if context is not None and context.ndim != x.ndim:
        raise ValueError(
            f"context must have x's rank; got x {tuple(x.shape)}, context {tuple(context.shape)}"
        )
    if isinstance(mask, Tensor) and mask.ndim == 3 and not unbatched:
        raise ValueError(
            f"a 3-D mask {tuple(mask.shape)} is ambiguous for batched input; pass (Tq, Tk) "
            "or (B|1, H|1, Tq, Tk)"
        )
    if not unbatched:
        return x, context, value_input, mask, padding_mask
    if isinstance(mask, Tensor) and mask.ndim == 3:
        mask = mask[None]  # (1, H, Tq, Tk)
    if padding_mask is not None and not isinstance(padding_mask, tuple):  # a padding_mod's lengths stay (1,)
        _check_padding_type(padding_mask)
        padding_mask = padding_mask[None]  # (1, Tk)
    add = (lambda t: None if t is None else t[None])
    return add(x), add(context), add(value_input), mask, padding_mask


def attend_causal(q: Tensor, k: Tensor, v: Tensor, *, mask=None, causal: bool = True, window: int | None = None,
                  chunk: int | None = None, scale: float | None = None, backend: str = "auto", dropout_p: float = 0.0,
                  return_weights: bool = False, score_mod=None, sinks: Tensor | None = None,
                  key_lengths: Tensor | None = None, attend: Callable = attention):
    """:func:`attnlab.attention` with the queries aligned bottom-right on the keys (the last
    query is the newest token, so ``k`` may start with cached positions), and with ``window``
    the causal sliding window on that diagonal in place of the causal mask. ``mask`` (a tensor
    or a mask mod) is ANDed in. The one attention call of the modules in :mod:`attnlab.nn` beyond
    their common call; ``attend`` is the attention function part (:func:`attnlab.attention`).

    With ``key_lengths`` (``(B,)`` int64) row ``b`` holds ``key_lengths[b]`` real keys followed
    by padding (a paged batch's rows gathered to the longest): the rule aligns on each row's own
    length instead, as a ``(B, 1, Tq, Tk)`` bool mask (:func:`lengths_mask`), which SDPA serves.

    Shapes:
        q: ``(B, H, Tq, D)``; k: ``(B, Hkv, Tk, D)``; v: ``(B, Hkv, Tk, Dv)`` -> ``(B, H, Tq, Dv)``.

    Example:
        >>> q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 5, 4)
        >>> out = attend_causal(q, k, k, window=2)        # the newest query sees the last 2 keys
        >>> torch.allclose(out, attend_causal(q, k[:, :, 3:], k[:, :, 3:]), atol=1e-6)
        True
        >>> padded = attend_causal(q, k, k, window=2, key_lengths=torch.tensor([3]))  # keys 3, 4: padding
        >>> torch.allclose(padded, attend_causal(q, k[:, :, 1:3], k[:, :, 1:3]), atol=1e-6)
        True
    """
    k, v, rule = causal_rule(q, k, v, mask=mask, causal=causal, window=window, chunk=chunk, key_lengths=key_lengths,
                             keep_keys=return_weights or score_mod is not None)
    return attend(q, k, v, **rule, scale=scale, dropout_p=dropout_p, backend=backend,
                  return_weights=return_weights, score_mod=score_mod, sinks=sinks)


def causal_rule(q: Tensor, k: Tensor, v: Tensor, *, mask=None, causal: bool = True, window: int | None = None,
                chunk: int | None = None, key_lengths: Tensor | None = None, keep_keys: bool = False) -> tuple[Tensor, Tensor, dict]:
    """The rule of :func:`attend_causal` as ``(k, v, options)`` for the attention call (``mask``,
    ``causal``, ``align``): a module computes it, then calls its attention part itself.

    A window drops the keys no query sees unless ``keep_keys`` (weights or a score mod index
    every key); with ``key_lengths`` the options hold one ``(B, 1, Tq, Tk)`` bool mask. With ``chunk``
    (causal) each query sees its own chunk only, counted from the first key: the keys must start
    on a chunk boundary (position 0, or a :class:`~attnlab.nn.ChunkedKVCache`'s chunk start).

    Example:
        >>> q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 5, 4)
        >>> k2, _, options = causal_rule(q, k, k, window=2)   # a decoding step: the last 2 keys
        >>> k2.shape[-2], options
        (2, {'mask': None, 'causal': True, 'align': 'bottom_right'})
    """
    tq, tk = q.shape[-2], k.shape[-2]
    if key_lengths is not None:
        rows = lengths_mask(key_lengths, tq=tq, tk=tk, causal=causal, window=window, chunk=chunk)  # (B, 1, Tq, Tk)
        return k, v, {"mask": _masks.and_masks(mask, rows)}
    if chunk is not None and causal:
        k, v, mask, chunk = _within_chunk(q, k, v, mask, chunk, keep_keys=keep_keys)
        tk = k.shape[-2]
    if window is not None and causal:
        q, k, v, mask, window = _within_window(q, k, v, mask, window, keep_keys=keep_keys)
        tk = k.shape[-2]
    align = "bottom_right" if causal and tk != tq else "top_left"
    band = None if window is None else _masks.sliding_window_mod(tq, tk, window, align=align)
    if chunk is not None and causal:
        band = _masks.chunked_local_mod(tq, tk, chunk, align=align)
    if band is not None:
        if isinstance(mask, Tensor):
            band = _masks.materialize(band, tq=tq, tk=tk, batch=1, device=q.device)  # (1, 1, Tq, Tk)
        mask, causal = _masks.and_masks(mask, band), False  # the band is causal itself
    return k, v, {"mask": mask, "causal": causal, "align": align}  # a causal mask that blocks nothing is dropped there


def _within_window(q, k, v, mask, window: int, *, keep_keys: bool):
    """A causal sliding window on the bottom-right diagonal, cut to what it needs: keys before the
    first query's window are dropped (none of the queries sees them; a decoding step over a
    contiguous cache then reads ``window`` keys, not all of them; kept with ``keep_keys``, whose
    weights index every key, or a mask mod, which indexes positions), and a window that reaches
    the first key from every query is no mask beyond the causal one (None: a decoding step over a
    ring buffer is an unmasked call, which SDPA serves)."""
    tq, tk = q.shape[-2], k.shape[-2]
    first = tk - tq - window + 1  # keys before it are outside every query's window
    if first > 0 and not keep_keys and (mask is None or isinstance(mask, Tensor)):
        k, v = k[..., first:, :], v[..., first:, :]  # (B, Hkv, Tq + window - 1, D)
        if isinstance(mask, Tensor) and mask.shape[-1] == tk:
            mask = mask[..., first:]
        tk -= first
    return q, k, v, mask, (None if tk <= window else window)


def _within_chunk(q, k, v, mask, chunk: int, *, keep_keys: bool):
    """A causal chunked rule on the bottom-right diagonal, cut to what it needs: keys before the
    first query's chunk are dropped (the cut is on a chunk boundary, so chunks keep their places;
    kept with ``keep_keys`` or a mask mod, as in :func:`_within_window`), and queries that all lie in
    one chunk with every key need no mask beyond the causal one (None)."""
    tq, tk = q.shape[-2], k.shape[-2]
    first = ((tk - tq) // chunk) * chunk  # the first query's chunk starts here
    if first > 0 and not keep_keys and (mask is None or isinstance(mask, Tensor)):
        k, v = k[..., first:, :], v[..., first:, :]  # (B, Hkv, Tk - first, D)
        if isinstance(mask, Tensor) and mask.shape[-1] == tk:
            mask = mask[..., first:]
        tk -= first
    return k, v, mask, (None if tk <= chunk else chunk)


def lengths_mask(key_lengths: Tensor, *, tq: int, tk: int, causal: bool = True, window: int | None = None,
                 chunk: int | None = None) -> Tensor:
    """Bool ``(B, 1, Tq, Tk)`` mask of a batch whose row ``b`` holds ``key_lengths[b]`` real keys,
    its ``Tq`` queries the newest of them: :func:`attnlab.masks.varlen_causal_mod`'s rule with
    ``q_lengths = Tq`` (every query real), built directly (a decoding step pays for it in every
    layer). ``causal=False``: each query sees its row's real keys.

    Example:
        >>> lengths_mask(torch.tensor([3, 1]), tq=1, tk=3, window=2)[:, 0, 0].int()
        tensor([[0, 1, 1],
                [1, 0, 0]], dtype=torch.int32)
    """
    device = key_lengths.device
    keys = torch.arange(tk, device=device)  # (Tk,)
    if not causal:
        return keys < key_lengths.view(-1, 1, 1, 1)  # (B, 1, 1, Tk)
    own = key_lengths.view(-1, 1, 1, 1) - tq + torch.arange(tq, device=device).view(1, 1, tq, 1)  # (B, 1, Tq, 1)
    allowed = keys <= own  # (B, 1, Tq, Tk)
    if chunk is not None:
        allowed = allowed & (keys >= own - own % chunk)  # the query's own chunk
    return allowed if window is None else allowed & (keys > own - window)


def make_cache(batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *, window: int | None = None,
               chunk: int | None = None, windowed: bool | None = None, page_size: int | None = None, value_dim: int | None = None,
               dtype=None, device=None) -> Cache:
    """The cache a layer of this shape takes: contiguous, windowed ring buffer, or paged.

    ``windowed`` defaults to ``window is not None`` (a sliding-window layer needs only its
    window); ``page_size`` asks for a :class:`PagedKVCache` of ``max_len`` slots per row,
    rounded up to whole pages. A window wider than ``max_len`` never slides within ``max_len``
    positions: such a layer gets a :class:`KVCache` of ``max_len`` slots unless ``windowed=True``
    (a huge window must not size the buffer).

    Example:
        >>> make_cache(2, 1, 10, 4, page_size=4).free_pages      # 2 rows x 3 pages
        6
        >>> make_cache(1, 1, 16, 4, window=10**9)
        KVCache(batch_size=1, num_kv_heads=1, length=0, max_len=16, head_dim=4, dtype=torch.float32)
    """
    positive_int("max_len", max_len)
    if windowed is not None:
        instance_of("windowed", windowed, bool, "a bool or None")
    if page_size is not None:
        positive_int("page_size", page_size)
        pages = -(-max_len // page_size) * positive_int("batch_size", batch_size)
        return PagedKVCache(batch_size, num_kv_heads, pages * page_size, head_dim, page_size=page_size,
                            value_dim=value_dim, dtype=dtype, device=device)
    if chunk is not None and windowed is not False and chunk <= max_len:  # a longer chunk never restarts
        return ChunkedKVCache(batch_size, num_kv_heads, chunk, head_dim, value_dim=value_dim, dtype=dtype,
                              device=device)
    if windowed and window is None:
        raise ValueError("windowed=True needs a module with a window")
    if window is not None and (windowed or (windowed is None and window <= max_len)):
        return WindowedKVCache(batch_size, num_kv_heads, window, head_dim, value_dim=value_dim,
                               dtype=dtype, device=device)
    return KVCache(batch_size, num_kv_heads, max_len, head_dim, value_dim=value_dim, dtype=dtype,
                   device=device)


def _check_cache(cache: object, x: Tensor, context: Tensor | None, num_kv_heads: int,
                 window: int | None = None, chunk: int | None = None) -> None:
    """The cache fits a self-attention call on ``x`` ``(B, T, d_in)``; the rest is update's."""
    instance_of("cache", cache, Cache, "a KVCache, WindowedKVCache or PagedKVCache (from module.new_cache)")
    if context is not None:
        raise ValueError("cache is for self-attention; it cannot be used with context")
    batch = x.shape[0]
    if cache.batch_size != batch or cache.num_kv_heads != num_kv_heads:
        raise ValueError(
            f"cache holds batch {cache.batch_size} x {cache.num_kv_heads} kv heads; the input "
            f"needs batch {batch} x {num_kv_heads} kv heads"
        )
    if isinstance(cache, WindowedKVCache) and (window is None or window > cache.window):
        raise ValueError(
            f"a WindowedKVCache of window {cache.window} holds too few keys for a layer with "
            f"window={window} (None: every earlier key); use a KVCache or a PagedKVCache"
        )
    if isinstance(cache, WindowedKVCache) and chunk is not None:
        raise ValueError(f"a WindowedKVCache keeps the last keys, not chunk={chunk}'s own chunk in order; "
                         "use a ChunkedKVCache (module.new_cache), a KVCache or a PagedKVCache")
    if isinstance(cache, ChunkedKVCache) and cache.chunk != chunk:
        raise ValueError(f"a ChunkedKVCache of chunk {cache.chunk} serves a layer with chunk={cache.chunk}; "
                         f"this layer has chunk={chunk} (None: every earlier key)")
    cache.check_room(x.shape[1])


def _check_cache_options(cache: Cache, mask, padding_mask, return_weights: bool, alibi: bool = False) -> None:
    """``mask``/``padding_mask`` and ALiBi's distances index the contiguous cache's keys in
    order; a paged call has ragged weights."""
    if alibi and not isinstance(cache, KVCache):
        raise ValueError(f"positions='alibi' needs a KVCache (keys in position order); got a "
                         f"{type(cache).__name__}")
    if not isinstance(cache, KVCache) and (mask is not None or padding_mask is not None):
        raise ValueError(f"a mask or padding (padding_mask, CallMask(padding=...)) goes with a KVCache, whose "
                         f"keys it indexes; got a "
                         f"{type(cache).__name__}")
    if isinstance(cache, PagedKVCache) and return_weights:
        raise ValueError("return_weights with a PagedKVCache: its rows have different lengths; "
                         "use a KVCache to read weights")


def _check_documents(document_ids: object, x: Tensor, context, cache, name: str = "document_ids") -> Tensor | None:
    """``document_ids`` as ``(B|1, T)`` int64 after checking it against ``x`` (None passes); errors
    name ``name``, the argument the caller was given (the module's: ``documents``)."""
    if document_ids is None:
        return None
    if context is not None or cache is not None:
        raise ValueError(f"{name} packs documents for self-attention; it cannot be combined with context= or cache=")
    instance_of(name, document_ids, Tensor, "an integer tensor (T,) or (B, T)")
    integer_dtype(name, document_ids, unsigned=True)  # ids are only compared
    ids = document_ids if document_ids.ndim != 1 else document_ids[None]  # (B|1, T)
    B, T = x.shape[:2]
    if ids.ndim != 2 or ids.shape[1] != T or ids.shape[0] not in (1, B):
        raise ValueError(
            f"{name} must be an integer tensor (T,) or (B, T) with T = {T}, B = {B}; got "
            f"shape {tuple(document_ids.shape)} dtype {document_ids.dtype}"
        )
    return ids.to(device=x.device, dtype=torch.int64)


def _with_documents(mask, documents: Tensor, *, tq: int):
    """AND the user's mask with the packed documents' mask mod (made dense for a dense mask)."""
    mod = _masks.document_mod(documents, causal=False)  # causality stays attention's causal flag
    if mask is None or not isinstance(mask, Tensor):
        return _masks.and_masks(mask, mod)
    dense = _masks.materialize(mod, tq=tq, tk=tq, batch=documents.shape[0], device=documents.device)
    return _masks.and_masks(mask, dense)  # (B|1, 1, T, T) with the user's dense mask


def _check_padding_type(padding_mask: object, name: str = "padding (CallMask(padding=...))") -> None:
    """``TypeError`` naming ``name`` unless ``padding_mask`` is a bool tensor (a module's or model's
    ``padding_mask=`` argument passes its own name)."""
    if not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor, True at real tokens (the opposite of torch's "
            f"key_padding_mask); got {type(padding_mask).__name__} "
            f"{getattr(padding_mask, 'dtype', '')}"
        )


def _combine_masks(mask, padding_mask, *, batch: int, tk: int):
    """AND the user's mask with the key padding mask ``(B, Tk)`` (True = real token)."""
    if padding_mask is None:
        return mask
    if isinstance(padding_mask, tuple):  # a padding_mod's key lengths (B,)
        lengths = padding_mask[1]
        if lengths.numel() != batch:
            raise ValueError(f"padding_mod's lengths must be (B,) = ({batch},), got {tuple(lengths.shape)}")
        padding_mask = torch.arange(tk, device=lengths.device) < lengths.reshape(batch, 1)  # (B, Tk)
    _check_padding_type(padding_mask)
    if tuple(padding_mask.shape) != (batch, tk):
        raise ValueError(
            f"the mask's padding must be (B, Tk) = {(batch, tk)}, got {tuple(padding_mask.shape)}"
        )
    if mask is not None and not isinstance(mask, Tensor):
        return _masks.and_masks(mask, _KeyPaddingMod(padding_mask))
    try:
        return _masks.and_masks(mask, padding_mask[:, None, None, :])  # (B, 1, 1, Tk)
    except ValueError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast with the padding "
            f"(B, Tk) = {(batch, tk)} to (B, H, Tq, Tk)"
        ) from None
