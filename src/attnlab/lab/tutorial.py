"""The tutorials' attention modules, written once, on top of :func:`attnlab.attention`.

attnlab grew out of five tutorials: "The Clear Tutorial for Attention Mechanism in
Transformers", "Attention for your Transformers", "Causal Self Attention", "Mathematical trick
in self-attention" and "Self-Attention and Multi-head Attention Mechanism". Each class or
function here is the readable version of one of their cells; constructed with the tutorial's
seed and arguments it reproduces the printed tensors. Every forward pass goes through the one
functional core, :func:`attnlab.attention`: the modules only project their inputs and pick
options (causal mask, dropout, scale). Where a tutorial has a bug, the code here does the right
thing and the docstring says what differs (see also ``docs/seeds.md``). Production modules
(grouped-query attention, KV cache, RoPE, blocks) live in :mod:`attnlab.nn`;
:class:`Projections` shows one of them under the tutorials' weight names, and
:func:`load_tutorial_state_dict` loads the tutorials' checkpoints into it.

Example:
    >>> import torch
    >>> torch.manual_seed(123)
    <torch._C.Generator object at ...>
    >>> CausalAttention(3, 2, 6, 0.0)(torch.rand(6, 3)).shape
    torch.Size([6, 2])

Conventions:
    ``x`` is ``(B, T, d_in)`` or unbatched ``(T, d_in)``; every module accepts both.
    ``init="uniform"`` creates ``nn.Parameter(torch.rand(d_in, d_out))`` weights used as
    ``x @ W`` ("Clear Tutorial" and "Attention for your Transformers"'s cross-attention); ``init="linear"`` creates
    ``nn.Linear(d_in, d_out)`` layers ("Attention for your Transformers" and "Causal Self Attention"). Query, key and value weights are
    always created in that order, so seeding before construction reproduces the documents.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnlab._checks import instance_of, probability
from attnlab.functional import attention
from attnlab.nn.multihead import MultiHeadAttention
from attnlab.nn.multihead import QKV

__all__ = [
    "SimpleSelfAttention",
    "AttentionHead",
    "SelfAttention",
    "CausalAttention",
    "CrossAttention",
    "MultiHeadAttentionWrapper",
    "Projections",
    "ProjectionView",
    "load_tutorial_state_dict",
    "project",
    "multi_head_attention",
    "cross_attention",
    "causal_average",
    "ScoreVariance",
    "score_variance",
    "softmax_peakiness",
    "Reproduction",
    "compare_printed",
]

INITS = ("uniform", "linear")


def _check_features(name: str, x: Tensor, d_in: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim not in (2, 3) or x.shape[-1] != d_in:
        raise ValueError(
            f"{name} must have shape (T, d_in) or (B, T, d_in) with d_in={d_in}; "
            f"got shape {tuple(x.shape)}"
        )


class SimpleSelfAttention(nn.Module):
    """Self-attention without trainable weights ("Attention for your Transformers", "Level 1").

    Scores are plain dot products ``x x^T`` (no ``1/sqrt(d)`` scaling, as in the document's
    code), softmax over keys, and a weighted sum of the inputs themselves.

    "Attention for your Transformers" shows the formula with ``1/sqrt(d_k)`` next to code that does not scale; the
    printed numbers come from the unscaled code, which is what this module computes.

    Shapes:
        x: ``(T, d)`` or ``(B, T, d)`` -> context vectors of the same shape.

    Example:
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        >>> SimpleSelfAttention()(x)
        tensor([[0.7311, 0.2689],
                [0.2689, 0.7311]])
    """

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attend ``x`` to itself; ``return_weights`` also returns ``(..., T, T)`` weights."""
        return attention(x, x, x, scale=1.0, return_weights=return_weights)


def _make_projection(d_in: int, d_out: int, *, init: str, bias: bool) -> nn.Module | nn.Parameter:
    if init == "uniform":
        if bias:
            raise ValueError("qkv_bias=True needs init='linear'; init='uniform' has no bias")
        return nn.Parameter(torch.rand(d_in, d_out))  # used as x @ W, (d_in, d_out)
    return nn.Linear(d_in, d_out, bias=bias)


def _apply_projection(weight: nn.Module | nn.Parameter, x: Tensor) -> Tensor:
    return x @ weight if isinstance(weight, nn.Parameter) else weight(x)


class AttentionHead(nn.Module):
    """One head of scaled dot-product attention with its own query/key/value projections.

    The single mechanism behind :class:`SelfAttention`, :class:`CausalAttention`,
    :class:`CrossAttention` and the heads of :class:`MultiHeadAttentionWrapper`: project,
    then call :func:`attnlab.attention` with scale ``1/sqrt(d_out_kq)``, an optional causal
    mask and dropout on the weights (training mode only).

    Shapes:
        x: ``(T, d_in)`` or ``(B, T, d_in)``; context (cross-attention): ``(Tk, d_in)`` or
        ``(B, Tk, d_in)`` -> ``(T, d_out_v)`` or ``(B, T, d_out_v)``.

    Args:
        d_in: input features.
        d_out_kq: features of queries and keys.
        d_out_v: features of values and of the output; defaults to ``d_out_kq``.
        causal: mask future keys.
        dropout_p: probability of dropping an attention weight in training mode.
        context_length: optional bound on the number of query tokens.
        qkv_bias: bias in the projections (``init="linear"`` only).
        init: ``"linear"`` (``nn.Linear`` layers) or ``"uniform"`` (``torch.rand`` matrices).

    Attributes:
        W_query, W_key, W_value: the projections, created in this order.
        backend: the :func:`attnlab.attention` backend, ``"reference"`` by default: the
            readable math, and the only one whose dropout draws random numbers exactly as
            ``nn.Dropout`` does (other backends use their own streams), which the documents'
            seeded dropout outputs need. Set it to ``"auto"`` for speed.

    Example:
        >>> head = AttentionHead(3, 2, 4, causal=True)
        >>> out, weights = head(torch.randn(5, 3), return_weights=True)
        >>> out.shape, bool(weights.triu(1).eq(0).all())
        (torch.Size([5, 4]), True)
    """

    def __init__(
        self,
        d_in: int,
        d_out_kq: int,
        d_out_v: int | None = None,
        *,
        causal: bool = False,
        dropout_p: float = 0.0,
        context_length: int | None = None,
        qkv_bias: bool = False,
        init: str = "linear",
    ):
        super().__init__()
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        probability("dropout_p", dropout_p)
        d_out_v = d_out_kq if d_out_v is None else d_out_v
        self.d_in, self.d_out_kq, self.d_out_v = d_in, d_out_kq, d_out_v
        self.causal, self.dropout_p, self.context_length = causal, dropout_p, context_length
        self.backend = "reference"
        self.W_query = _make_projection(d_in, d_out_kq, init=init, bias=qkv_bias)
        self.W_key = _make_projection(d_in, d_out_kq, init=init, bias=qkv_bias)
        self.W_value = _make_projection(d_in, d_out_v, init=init, bias=qkv_bias)

    def _check_inputs(self, x: Tensor, context: Tensor) -> None:
        if isinstance(x, Tensor) and isinstance(context, Tensor) and x.shape[-1] != context.shape[-1]:
            raise ValueError(
                f"x and context must have the same feature dim d_in; got x {tuple(x.shape)} "
                f"and context {tuple(context.shape)}"
            )
        _check_features("x", x, self.d_in)
        _check_features("context", context, self.d_in)
        if self.context_length is not None and x.shape[-2] > self.context_length:
            raise ValueError(
                f"x has {x.shape[-2]} tokens, more than context_length={self.context_length}"
            )

    def scores(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """Raw scores ``q k^T`` (unscaled, unmasked): the documents' ``omega``/``attn_scores``.

        Example:
            >>> AttentionHead(3, 2).scores(torch.randn(4, 3)).shape
            torch.Size([4, 4])
        """
        context = x if context is None else context
        self._check_inputs(x, context)
        queries = _apply_projection(self.W_query, x)  # (..., T, d_out_kq)
        keys = _apply_projection(self.W_key, context)  # (..., Tk, d_out_kq)
        return queries @ keys.transpose(-2, -1)  # (..., T, Tk)

    def forward(
        self, x: Tensor, context: Tensor | None = None, *, return_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to ``context`` (``x`` itself when None).

        Returns:
            ``(..., T, d_out_v)`` context vectors, or ``(context, weights)`` with weights
            ``(..., T, Tk)`` (before dropout) when ``return_weights``.
        """
        context = x if context is None else context
        self._check_inputs(x, context)
        queries = _apply_projection(self.W_query, x)  # (..., T, d_out_kq)
        keys = _apply_projection(self.W_key, context)  # (..., Tk, d_out_kq)
        values = _apply_projection(self.W_value, context)  # (..., Tk, d_out_v)
        return attention(
            queries, keys, values, causal=self.causal, scale=1.0 / math.sqrt(self.d_out_kq),
            dropout_p=self.dropout_p if self.training else 0.0, backend=self.backend,
            return_weights=return_weights,
        )


class SelfAttention(AttentionHead):
    """Scaled dot-product self-attention with trainable W_query, W_key, W_value.

    "Clear Tutorial"'s ``SelfAttention(d_in, d_out_kq, d_out_v)`` (``init="uniform"``) and
    "Attention for your Transformers" and "Causal Self Attention"'s ``SelfAttention(d_in, d_out)`` (``init="linear"``, the default).
    Unlike the documents' versions (``keys.T``), it also takes batched ``(B, T, d_in)`` input.

    Shapes:
        x: ``(T, d_in)`` or ``(B, T, d_in)`` -> ``(T, d_out_v)`` or ``(B, T, d_out_v)``.

    Args:
        d_in: input features.
        d_out_kq: features of queries and keys; the scores are scaled by ``1/sqrt(d_out_kq)``.
        d_out_v: output features; defaults to ``d_out_kq``.
        qkv_bias: bias in the ``nn.Linear`` projections.
        init: ``"linear"`` or ``"uniform"`` (see the module docstring).

    Example:
        >>> _ = torch.manual_seed(123)
        >>> x = torch.nn.Embedding(50_000, 3)(torch.tensor([0, 4, 3, 2, 5, 1])).detach()
        >>> _ = torch.manual_seed(123)
        >>> SelfAttention(3, 2, 4, init="uniform")(x)[2]   # "Clear Tutorial"'s context_vector_3
        tensor([-0.5296, -0.2799, -0.4107, -0.6006], grad_fn=<SelectBackward0>)
    """

    def __init__(
        self,
        d_in: int,
        d_out_kq: int,
        d_out_v: int | None = None,
        *,
        qkv_bias: bool = False,
        init: str = "linear",
    ):
        super().__init__(d_in, d_out_kq, d_out_v, qkv_bias=qkv_bias, init=init)

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attend ``x`` to itself (see :meth:`AttentionHead.forward`)."""
        return super().forward(x, return_weights=return_weights)


class CausalAttention(AttentionHead):
    """Causal (masked) self-attention with dropout on the weights ("Attention for your Transformers" and "Causal Self Attention").

    Query ``i`` attends to keys ``j <= i``. Dropout is applied to the attention weights in
    training mode only (``module.eval()`` turns it off), drawing random numbers exactly as the
    documents' ``nn.Dropout`` does, so ``torch.manual_seed(123)`` before construction
    reproduces "Causal Self Attention"'s dropout output.

    The documents keep a ``(context_length, context_length)`` mask buffer; attnlab builds the
    causal mask inside :func:`attnlab.attention` and only uses ``context_length`` to reject
    inputs longer than it (a clear ``ValueError`` rather than a shape error).

    Shapes:
        x: ``(T, d_in)`` or ``(B, T, d_in)`` with ``T <= context_length`` -> ``(..., T, d_out)``.

    Args:
        d_in: input features.
        d_out: features of queries, keys, values and output.
        context_length: the largest number of tokens accepted.
        dropout_p: probability of dropping an attention weight in training mode.
        qkv_bias: bias in the ``nn.Linear`` projections.
        init: ``"linear"`` (the documents') or ``"uniform"``.

    Example:
        >>> ca = CausalAttention(3, 2, context_length=6, dropout_p=0.5).eval()
        >>> x = torch.randn(2, 6, 3)
        >>> y = x.clone(); y[:, 4:] += 1.0                    # change only future tokens
        >>> torch.equal(ca(x)[:, :4], ca(y)[:, :4])
        True
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout_p: float = 0.0,
        *,
        qkv_bias: bool = False,
        init: str = "linear",
    ):
        super().__init__(
            d_in, d_out, causal=True, dropout_p=dropout_p, context_length=context_length,
            qkv_bias=qkv_bias, init=init,
        )

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Causal self-attention over ``x`` (see :meth:`AttentionHead.forward`)."""
        return super().forward(x, return_weights=return_weights)


class CrossAttention(AttentionHead):
    """Cross-attention: queries from ``x``, keys and values from ``context`` ("Clear Tutorial" and "Attention for your Transformers").

    The two sequences may differ in length but must share the feature dim ``d_in``; a
    mismatch raises ``ValueError`` naming both shapes (the documents only state the rule).

    Shapes:
        x: ``(Tq, d_in)`` or ``(B, Tq, d_in)``; context: ``(Tk, d_in)`` or ``(B, Tk, d_in)``
        -> ``(Tq, d_out_v)`` or ``(B, Tq, d_out_v)``.

    Args:
        d_in: input features of both sequences.
        d_out_kq: features of queries and keys; scale ``1/sqrt(d_out_kq)``.
        d_out_v: output features.
        init: ``"uniform"`` (both documents' ``torch.rand`` matrices, the default) or
            ``"linear"``.

    Example:
        >>> cross = CrossAttention(3, 2, 4)
        >>> cross(torch.randn(6, 3), torch.randn(8, 3)).shape
        torch.Size([6, 4])
    """

    def __init__(self, d_in: int, d_out_kq: int, d_out_v: int, *, init: str = "uniform"):
        super().__init__(d_in, d_out_kq, d_out_v, init=init)

    def forward(
        self, x: Tensor, context: Tensor, *, return_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to ``context`` (see :meth:`AttentionHead.forward`)."""
        return super().forward(x, context, return_weights=return_weights)

    def scores(self, x: Tensor, context: Tensor) -> Tensor:  # type: ignore[override]
        """Raw scores ``(..., Tq, Tk)`` between queries of ``x`` and keys of ``context``."""
        return super().scores(x, context)


class MultiHeadAttentionWrapper(nn.Module):
    """Multi-head attention as a list of independent heads ("Clear Tutorial").

    Each head is an :class:`AttentionHead` with its own projections, created in order; the
    heads' outputs are concatenated along the **feature** axis, giving
    ``(..., T, num_heads * d_out_v)``. "Clear Tutorial" concatenates along the token axis
    (``torch.cat(...)`` with the default ``dim=0``), which stacks the heads' tokens into a
    ``(num_heads * T, d_out_v)`` column; here column ``h`` is that document's ``h``-th block.

    Shapes:
        x: ``(T, d_in)`` or ``(B, T, d_in)`` -> ``(T, H * d_out_v)`` or ``(B, T, H * d_out_v)``.

    Args:
        d_in: input features.
        d_out_kq: query/key features per head.
        d_out_v: value/output features per head.
        num_heads: number of heads ``H``.
        causal: mask future tokens in every head.
        dropout_p: dropout probability on each head's weights in training mode.
        init: ``"uniform"`` ("Clear Tutorial"'s) or ``"linear"``.
        context_length: optional bound on the number of tokens.

    Example:
        >>> mha = MultiHeadAttentionWrapper(3, 2, 1, num_heads=4)
        >>> x = torch.randn(6, 3)
        >>> out = mha(x)
        >>> out.shape
        torch.Size([6, 4])
        >>> torch.equal(out[:, 1:2], mha.heads[1](x))        # column h is head h
        True
    """

    def __init__(
        self,
        d_in: int,
        d_out_kq: int,
        d_out_v: int,
        num_heads: int,
        *,
        causal: bool = False,
        dropout_p: float = 0.0,
        init: str = "uniform",
        context_length: int | None = None,
    ):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.heads = nn.ModuleList(
            AttentionHead(
                d_in, d_out_kq, d_out_v, causal=causal, dropout_p=dropout_p,
                context_length=context_length, init=init,
            )
            for _ in range(num_heads)
        )

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Run every head on ``x`` and concatenate their outputs along the feature axis.

        Returns:
            ``(..., T, H * d_out_v)``, or ``(out, weights)`` with weights ``(..., H, T, T)``.
        """
        results = [head(x, return_weights=return_weights) for head in self.heads]
        if not return_weights:
            return torch.cat(results, dim=-1)  # (..., T, H * d_out_v)
        outs, weights = zip(*results)
        return torch.cat(outs, dim=-1), torch.stack(weights, dim=-3)  # (..., H, T, T)


class ProjectionView:
    """One of the tutorials' query/key/value layers, read from the fused weights of a module.

    ``weight`` ``(d_out, d_in)`` and ``bias`` share storage with the module's parameters
    (editing them in place under ``torch.no_grad()`` edits the module); calling the view
    applies the projection, as calling the tutorials' ``nn.Linear`` does. Gradients
    accumulate on the module's parameters, not on the view.

    Example:
        >>> view = ProjectionView(torch.ones(2, 3), torch.zeros(2))
        >>> view, view(torch.ones(4, 3)).shape
        (ProjectionView(in_features=3, out_features=2, bias=True), torch.Size([4, 2]))
    """

    def __init__(self, weight: Tensor, bias: Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def __repr__(self) -> str:
        out_f, in_f = self.weight.shape
        return f"ProjectionView(in_features={in_f}, out_features={out_f}, bias={self.bias is not None})"


class Projections:
    """The tutorials' ``W_query``, ``W_key``, ``W_value`` of a :class:`attnlab.nn.MultiHeadAttention`.

    The tutorials' multi-head module holds three ``nn.Linear`` layers; the production module
    keeps them fused as rows of ``in_proj_weight`` so that self-attention is one matmul (its
    :meth:`~attnlab.nn.MultiHeadAttention.projection` gives one part). This view names the
    parts as the tutorials do, each a :class:`ProjectionView` (``.weight``, ``.bias``,
    callable) sharing storage with the module. Every access reads the module afresh, so the
    view follows ``.to()``, ``.double()`` and ``load_state_dict``. (A checkpoint saved from the
    tutorials' module loads with :func:`load_tutorial_state_dict`.)

    Shapes:
        W_query: ``(d_out, d_in)``; W_key: ``(num_kv_heads * head_dim, kdim)``;
        W_value: ``(num_kv_heads * head_dim, vdim)``.

    Example:
        >>> from attnlab.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(4, 6, num_heads=2, qkv=QKV(bias=True))
        >>> W = Projections(mha)
        >>> W.W_key
        ProjectionView(in_features=4, out_features=6, bias=True)
        >>> torch.equal(W.W_key.weight, mha.in_proj_weight[6:12])   # a view of the fused rows
        True
        >>> x = torch.randn(1, 3, 4)
        >>> queries = W.W_query(x)                                  # the tutorials' self.W_query(x)
        >>> torch.allclose(queries, mha.project_q(x).transpose(1, 2).flatten(-2))   # (B, T, H * hd)
        True
    """

    def __init__(self, module: MultiHeadAttention):
        instance_of("module", module, MultiHeadAttention, "an attnlab.nn.MultiHeadAttention")
        self.module = module

    @property
    def W_query(self) -> ProjectionView:
        """The query projection ``(d_out, d_in)``."""
        return ProjectionView(*self.module.projection("query"))

    @property
    def W_key(self) -> ProjectionView:
        """The key projection ``(num_kv_heads * head_dim, kdim)``."""
        return ProjectionView(*self.module.projection("key"))

    @property
    def W_value(self) -> ProjectionView:
        """The value projection ``(num_kv_heads * head_dim, vdim)``."""
        return ProjectionView(*self.module.projection("value"))


_PARTS = ("query", "key", "value")


def load_tutorial_state_dict(module: nn.Module, state_dict: dict, *, strict: bool = True):
    """Load a state dict saved from the tutorials' multi-head module into ``module``.

    The tutorials' module keeps ``W_query``, ``W_key``, ``W_value`` as three ``nn.Linear`` and
    saves its causal ``mask`` buffer; every :class:`attnlab.nn.MultiHeadAttention` in ``module``
    (at any depth) stores them fused as ``in_proj_weight`` rows (or ``q_proj_weight``, ... when
    not fused) and ``in_proj_bias``. Keys already in attnlab's layout pass unchanged.

    Returns:
        What ``module.load_state_dict`` returns (missing and unexpected keys).

    Example:
        >>> from attnlab.nn import MultiHeadAttention
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> state = {f"W_{p}.weight": torch.randn(2, 3) for p in ("query", "key", "value")}
        >>> mha = MultiHeadAttention(3, 2, 4, 0.0, 1)
        >>> load_tutorial_state_dict(mha, {**state, "out_proj.weight": torch.eye(2),
        ...                                "out_proj.bias": torch.zeros(2)})
        <All keys matched successfully>
        >>> torch.equal(mha.in_proj_weight, torch.cat(list(state.values())))
        True
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    state = dict(state_dict)
    for name, layer in module.named_modules():
        if isinstance(layer, MultiHeadAttention):
            _to_fused_names(state, f"{name}." if name else "", fused=layer.fused)
    return module.load_state_dict(state, strict=strict)


def _to_fused_names(state: dict, prefix: str, *, fused: bool) -> None:
    """Rename one layer's ``W_query.weight`` ... keys (under ``prefix``) in place; drop ``mask``."""
    state.pop(prefix + "mask", None)
    for kind in ("weight", "bias"):
        keys = [f"{prefix}W_{part}.{kind}" for part in _PARTS]
        if not all(key in state for key in keys):
            continue
        tensors = [state.pop(key) for key in keys]
        if kind == "bias":
            state[prefix + "in_proj_bias"] = torch.cat(tensors)  # (d_out + 2 d_kv,)
        elif fused:
            state[prefix + "in_proj_weight"] = torch.cat(tensors)  # (d_out + 2 d_kv, d_in)
        else:
            for part, tensor in zip(("q", "k", "v"), tensors):
                state[f"{prefix}{part}_proj_weight"] = tensor


def project(x: Tensor, weight: Tensor) -> Tensor:
    """Project tokens with "Self-Attention recap"'s ``W @ x`` convention, per head when W has a head axis.

    Shapes:
        x: ``(T, d_in)`` or ``(B, T, d_in)``.
        weight: ``(d_out, d_in)`` -> ``(T, d_out)`` / ``(B, T, d_out)``;
        or ``(H, d_out, d_in)`` -> ``(H, T, d_out)`` / ``(B, H, T, d_out)``.

    Example:
        >>> project(torch.ones(5, 3), torch.ones(2, 4, 3)).shape   # 2 heads
        torch.Size([2, 5, 4])
    """
    if not isinstance(weight, Tensor) or weight.ndim not in (2, 3):
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be (d_out, d_in) or (H, d_out, d_in); got {shape}")
    _check_features("x", x, weight.shape[-1])
    if weight.ndim == 2:
        return x @ weight.T  # (..., T, d_out)
    return x.unsqueeze(-3) @ weight.transpose(-2, -1)  # (..., H, T, d_out)


def multi_head_attention(
    x: Tensor,
    W_query: Tensor,
    W_key: Tensor,
    W_value: Tensor,
    *,
    context: Tensor | None = None,
    causal: bool = False,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Functional (multi-head) attention with explicit weight tensors ("Self-Attention recap").

    With 2-D weights this is "Self-Attention recap"'s ``calc_attn`` (one head); with 3-D weights its
    ``multi_head_attn``; with ``context`` its ``cross_attn``. Unlike the document, the weights are
    arguments (the document draws fresh random ones on every call), queries use ``W_query`` and
    keys ``W_key`` (the document swaps them in ``calc_attn`` and ``cross_attn``), and the scale
    is ``1/sqrt(d_k)`` of *these* weights (``multi_head_attn`` reads a global ``d_k``).

    Shapes:
        x: ``(T, d_in)`` or ``(B, T, d_in)``; context: ``(Tk, d_in)`` or ``(B, Tk, d_in)``.
        W_query, W_key: ``(d_k, d_in)`` or ``(H, d_k, d_in)``; W_value: ``(d_v, d_in)`` or
        ``(H, d_v, d_in)``.
        Output: ``(..., T, d_v)`` for one head, ``(..., H, T, d_v)`` with a head axis (the
        document's ``(h, T, d_v)``); weights ``(..., T, Tk)`` / ``(..., H, T, Tk)``.

    Example:
        >>> x = torch.randn(6, 16)
        >>> W_q, W_k, W_v = torch.randn(3, 24, 16), torch.randn(3, 24, 16), torch.randn(3, 28, 16)
        >>> multi_head_attention(x, W_q, W_k, W_v).shape
        torch.Size([3, 6, 28])
    """
    context = x if context is None else context
    if x.shape[-1] != context.shape[-1]:
        raise ValueError(
            f"x and context must have the same feature dim; got x {tuple(x.shape)}, "
            f"context {tuple(context.shape)}"
        )
    queries = project(x, W_query)  # (..., [H,] T, d_k)
    keys = project(context, W_key)  # (..., [H,] Tk, d_k)
    values = project(context, W_value)  # (..., [H,] Tk, d_v)
    return attention(queries, keys, values, causal=causal, return_weights=return_weights)


def cross_attention(
    x: Tensor, context: Tensor, W_query: Tensor, W_key: Tensor, W_value: Tensor
) -> Tensor:
    """Functional cross-attention: queries from ``x``, keys and values from ``context``.

    "Self-Attention recap"'s ``cross_attn`` with the query/key weights the right way round; the
    weights may carry a head axis as in :func:`multi_head_attention`.

    Shapes:
        x: ``(Tq, d_in)``, context: ``(Tk, d_in)`` (or batched) -> ``(Tq, d_v)``
        (``(H, Tq, d_v)`` with per-head weights).

    Example:
        >>> W_q, W_k, W_v = torch.randn(4, 3), torch.randn(4, 3), torch.randn(2, 3)
        >>> cross_attention(torch.randn(6, 3), torch.randn(9, 3), W_q, W_k, W_v).shape
        torch.Size([6, 2])
    """
    return multi_head_attention(x, W_query, W_key, W_value, context=context)


CAUSAL_AVERAGE_METHODS = ("loop", "matmul", "softmax")


def causal_average(x: Tensor, *, method: str = "softmax") -> Tensor:
    """Average every token with all tokens before it (the trick of "Mathematical trick").

    Three equal ways, as in the document: ``"loop"`` (explicit mean of ``x[:t+1]``),
    ``"matmul"`` (a row-normalised lower-triangular matrix times ``x``) and ``"softmax"``
    (uniform scores, causal mask, softmax: :func:`attnlab.attention` with zero queries and
    keys, i.e. self-attention whose affinities are all equal).

    Shapes:
        x: ``(T, C)`` or ``(B, T, C)`` -> same shape.

    Example:
        >>> x = torch.tensor([[1.0], [3.0], [5.0]])
        >>> causal_average(x, method="matmul").squeeze(-1)
        tensor([1., 2., 3.])
    """
    if method not in CAUSAL_AVERAGE_METHODS:
        raise ValueError(f"method must be one of {CAUSAL_AVERAGE_METHODS}, got {method!r}")
    if not isinstance(x, Tensor) or x.ndim not in (2, 3):
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must have shape (T, C) or (B, T, C); got {shape}")
    T = x.shape[-2]
    if method == "loop":
        return torch.stack([x[..., : t + 1, :].mean(dim=-2) for t in range(T)], dim=-2)
    if method == "matmul":
        tril = torch.tril(torch.ones(T, T, dtype=x.dtype, device=x.device))
        return (tril / tril.sum(dim=1, keepdim=True)) @ x  # (T, T) @ (..., T, C)
    zeros = x.new_zeros(x.shape[:-1] + (1,))  # (..., T, 1): every score is 0
    return attention(zeros, zeros, x, causal=True)


class ScoreVariance(NamedTuple):
    """Variances measured by :func:`score_variance`: of q, of k, of the raw and scaled scores.

    Example:
        >>> ScoreVariance(q=1.0, k=1.0, unscaled=16.0, scaled=1.0).scaled
        1.0
    """

    q: float
    k: float
    unscaled: float
    scaled: float


def score_variance(
    head_size: int,
    *,
    batch: int = 4,
    tokens: int = 8,
    generator: torch.Generator | None = None,
) -> ScoreVariance:
    """Why attention scales by ``1/sqrt(head_size)`` ("Mathematical trick", "scaled attention").

    With unit-variance queries and keys, ``q . k`` sums ``head_size`` unit-variance products,
    so its variance is about ``head_size``; multiplying by ``head_size**-0.5`` brings it back
    to about 1, which keeps the softmax from turning one-hot (see :func:`softmax_peakiness`).

    Shapes:
        draws q, k of shape ``(batch, tokens, head_size)``; scores ``(batch, tokens, tokens)``.

    Returns:
        :class:`ScoreVariance` with the variances of q, k and of the scores without and with
        the scale.

    Example:
        >>> gen = torch.Generator().manual_seed(0)
        >>> v = score_variance(64, batch=64, tokens=64, generator=gen)
        >>> 50 < v.unscaled < 80, 0.8 < v.scaled < 1.25
        (True, True)
    """
    q = torch.randn(batch, tokens, head_size, generator=generator)
    k = torch.randn(batch, tokens, head_size, generator=generator)
    attn_scores = q @ k.transpose(-2, -1)  # (B, T, T)
    return ScoreVariance(
        q=q.var().item(),
        k=k.var().item(),
        unscaled=attn_scores.var().item(),
        scaled=(attn_scores * head_size**-0.5).var().item(),
    )


def softmax_peakiness(logits: Tensor, *, factor: float = 8.0) -> tuple[Tensor, Tensor]:
    """Softmax of ``logits`` and of ``logits * factor``: large scores make softmax one-hot.

    "Mathematical trick"'s illustration: ``softmax([0.1, -0.2, 0.3, -0.2, 0.5])`` is diffuse, the same
    logits times 8 put most of the weight on the largest one.

    Shapes:
        logits: ``(..., N)`` -> two tensors ``(..., N)``.

    Example:
        >>> soft, peaky = softmax_peakiness(torch.tensor([0.1, -0.2, 0.3, -0.2, 0.5]))
        >>> soft
        tensor([0.1925, 0.1426, 0.2351, 0.1426, 0.2872])
        >>> peaky
        tensor([0.0326, 0.0030, 0.1615, 0.0030, 0.8000])
    """
    return torch.softmax(logits, dim=-1), torch.softmax(logits * factor, dim=-1)


class Reproduction(NamedTuple):
    """attnlab's values next to the ones a tutorial printed (:func:`compare_printed`).

    Attributes:
        ours: attnlab's tensor; printed: the tutorial's, as typed in from its output.
        max_error: the largest absolute difference; matches: ``max_error <= atol``.

    Example:
        >>> r = compare_printed(torch.tensor([0.31021]), [0.3102])
        >>> r.matches
        True
        >>> print(r)
        attnlab       printed
         0.3102        0.3102
        max |difference| 1.0e-05 <= 1e-04: matches
    """

    ours: Tensor
    printed: Tensor
    max_error: float
    atol: float

    @property
    def matches(self) -> bool:
        return self.max_error <= self.atol

    def __str__(self) -> str:
        ours, printed = self.ours.reshape(-1, self.ours.shape[-1] if self.ours.ndim else 1), self.printed
        printed = printed.reshape(ours.shape)
        width = 8 * ours.shape[1] + 6
        lines = [f"{'attnlab':<{width}}printed"]
        for mine, theirs in zip(ours.tolist(), printed.tolist()):
            left = " ".join(f"{v:7.4f}" for v in mine)
            lines.append(f"{left:<{width}}" + " ".join(f"{v:7.4f}" for v in theirs))
        verdict = "matches" if self.matches else "DOES NOT MATCH"
        lines.append(f"max |difference| {self.max_error:.1e} <= {self.atol:.0e}: {verdict}" if self.matches else
                     f"max |difference| {self.max_error:.1e} > {self.atol:.0e}: {verdict}")
        return "\n".join(line.rstrip() for line in lines)

    __repr__ = __str__


def compare_printed(ours: Tensor, printed, *, atol: float = 1e-4) -> Reproduction:
    """Put attnlab's values next to the values a tutorial printed (4 decimals: ``atol`` 1e-4).

    Shapes:
        ours: any shape; printed: nested lists of the same shape (as the tutorial printed them).

    Raises:
        ValueError: the shapes differ.

    Example:
        >>> compare_printed(torch.tensor([[1.0, 0.0]]), [[1.0, 0.0]]).matches
        True
    """
    instance_of("ours", ours, Tensor, "a torch.Tensor")
    expected = torch.as_tensor(printed, dtype=torch.float64)
    ours = ours.detach().double().cpu()
    if tuple(ours.shape) != tuple(expected.shape):
        raise ValueError(f"printed must have the shape of ours {tuple(ours.shape)}, got {tuple(expected.shape)}")
    finite = torch.isfinite(expected)
    same_inf = bool((ours[~finite] == expected[~finite]).all())
    error = float((ours[finite] - expected[finite]).abs().max()) if bool(finite.any()) else 0.0
    return Reproduction(ours, expected, error if same_inf else float("inf"), atol)
