"""Recurrent (linear-attention) layers of 2026's hybrid models: Gated DeltaNet, Kimi Delta Attention and
the scalar-decay layer of Mamba-2 and RetNet.

The layers are one mechanism, :class:`_DeltaLayer`; each says only how it makes its inputs:

1. project ``x`` ``(B, T, d_model)`` to the features of q, k and v (``(B, T, channels)``);
2. a short causal depthwise convolution over them, then SiLU (its last ``kernel_size - 1``
   inputs are the cache's window);
3. split into heads, l2-normalise q and k;
4. :func:`attnlab.linear_attention` with the layer's ``decay`` and ``beta`` (the delta rule; no
   beta: the additive update), from the cache's state ``S`` and back into it;
5. a gated RMSNorm per value head (normalise, ``* weight``, ``* act(gate)``) and the output projection.

* :class:`GatedDeltaNet` (Qwen3-Next, Qwen3.5): one log-decay per value head and step,
  ``-exp(A_log) * softplus(a + dt_bias)`` with ``a`` projected from x; the output gate ``silu(z)``.
* :class:`KimiDeltaAttention` (Kimi Linear): a log-decay per key channel,
  ``-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`` (a low-rank forget gate); the output gate
  ``sigmoid(g_b(g_a(x)))``.

``beta = sigmoid(b)`` in both. The layers take no positions (NoPE: order lives in the recurrence)
and have no attention weights to return. ``from_transformers`` builds either from a transformers
layer with equal weights.

Example:
    >>> layer = GatedDeltaNet(32, 4, num_key_heads=2)
    >>> x = torch.randn(1, 6, 32)
    >>> cache = layer.new_cache(1)
    >>> with torch.no_grad():
    ...     whole = layer(x)
    ...     steps = torch.cat([layer(x[:, :4], cache=cache), layer(x[:, 4:5], cache=cache),
    ...                        layer(x[:, 5:], cache=cache)], dim=1)
    >>> torch.allclose(whole, steps, atol=1e-5), cache.length
    (True, 6)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import linear as _linear
from attnlab._checks import instance_of, one_of, positive_int, positive_number
from attnlab.nn.cache import RecurrentCache, _cache_options
from attnlab.nn.latent import _check_x
from attnlab.nn.multihead import _check_documents, _check_padding_type
from attnlab.nn.parts import head_sizes

__all__ = ["GatedDeltaNet", "KimiDeltaAttention", "DecayedLinearAttention"]

# The l2 norm of q and k: x / sqrt(sum x^2 + eps), as fla and transformers (Qwen's layers write it
# x * rsqrt(...), Kimi's x / sqrt(...): the same number up to the last bit; this is Qwen's form).
_L2_EPS = 1e-6
# Up to this many new tokens the short convolution is K products and a sum: PyTorch's depthwise
# conv1d costs 0.2-10 ms a call on a CPU for one token of 256 channels (its thread pool and
# kernel setup), the products 40 µs (AVX2 EPYC, torch 2.13); beyond, conv1d wins.
_TAPS_UP_TO = 16


class _Inputs(NamedTuple):
    """What a layer makes of ``x`` ``(B, T, d_model)`` before the shared path.

    mixed: ``(B, T, channels)`` q, k and v features before the convolution (q, then k, then v).
    decay: None, ``(B, T, Hv)`` or ``(B, T, Hv, Dk)`` log-decays (<= 0). beta: None (the additive
    update) or ``(B, T, Hv)`` in [0, 1] (the delta rule).
    gate: ``(B, T, Hv, Dv)`` the output gate's logits.
    """

    mixed: Tensor
    decay: Tensor | None
    beta: Tensor | None
    gate: Tensor


class _GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's features, times ``weight``, times ``act(gate)`` (fp32 inside).

    Example:
        >>> norm = _GatedRMSNorm(2, 0.0, "sigmoid")
        >>> norm(torch.tensor([[3.0, -3.0]]), torch.zeros(1, 2)).tolist()   # unit RMS, sigmoid(0) = 0.5
        [[0.5, -0.5]]
    """

    def __init__(self, dim: int, eps: float, activation: str):
        super().__init__()
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        work = torch.promote_types(x.dtype, torch.float32)  # half precision normalises in fp32
        x32 = x.to(work)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(work)
        act = F.silu if self.activation == "silu" else torch.sigmoid
        return (normed * act(gate.to(work))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation!r}"


def _l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last axis, computed in (at least) fp32."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + _L2_EPS)).to(x.dtype)


def _softplus_decay(A_log: Tensor, logits: Tensor) -> Tensor:
    """``-exp(A_log) * softplus(logits)``, the log-decay of Mamba-2's discretisation, in >= fp32."""
    work = torch.promote_types(logits.dtype, torch.float32)
    return -A_log.to(work).exp() * F.softplus(logits.to(work))


def _heads_first(x: Tensor | None) -> Tensor | None:
    """``(B, T, Hv[, Dk])`` -> ``(B, Hv, T[, Dk])`` (None stays None: no decay, or no beta)."""
    return None if x is None else x.transpose(1, 2)


def _init_dt_bias(size: int, low: float = 1e-3, high: float = 0.1) -> Tensor:
    """Mamba's ``dt_bias``: ``softplus(dt_bias)`` log-uniform in ``[low, high]`` at the start."""
    dt = torch.exp(torch.rand(size) * (math.log(high) - math.log(low)) + math.log(low))
    return dt + torch.log(-torch.expm1(-dt))  # softplus's inverse


def _document_conv(full: Tensor, weight: Tensor, documents: Tensor) -> Tensor:
    """The causal depthwise convolution with each tap cut where it would reach into an earlier document.

    Shapes:
        full: ``(B, C, K - 1 + T)`` (zeros, then the inputs); weight: ``(C, 1, K)``; documents:
        ``(B|1, T)`` -> ``(B, C, T)``.
    """
    K, T = weight.shape[-1], documents.shape[-1]
    out = full[..., K - 1:] * weight[:, 0, K - 1, None]  # tap 0: the token itself
    for lag in range(1, min(K, T)):
        same = torch.zeros_like(documents, dtype=torch.bool)  # (B|1, T)
        same[:, lag:] = documents[:, lag:] == documents[:, :-lag]
        tap = full[..., K - 1 - lag:K - 1 - lag + T] * weight[:, 0, K - 1 - lag, None]  # (B, C, T)
        out = out + tap * same[:, None, :].to(tap.dtype)
    return out


def _cu_seqlens(documents: Tensor, B: int) -> Tensor:
    """Starts of every run of one document id in the rows laid end to end: ``[0, ..., B * T]``."""
    ids = documents.expand(B, -1)  # (B, T)
    T = ids.shape[1]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    flat = starts.flatten().nonzero().flatten()
    return torch.cat([flat, flat.new_tensor([B * T])])


def _own_storage(*tensors: Tensor) -> list[Tensor]:
    """Each tensor, copied if it is a view of a larger one: the cache's window, a slice of the whole
    prefill's inputs, must not keep them alive (its memory would grow with T)."""
    return [t.clone() if t.untyped_storage().nbytes() > t.nbytes else t for t in tensors]


def _packed(x: Tensor) -> Tensor:
    """``(B, H, T, ...)`` -> ``(1, H, B * T, ...)``: the rows laid end to end (for ``cu_seqlens``)."""
    return x.transpose(0, 1).flatten(1, 2)[None]


def _unpacked(x: Tensor, B: int) -> Tensor:
    """``(1, H, B * T, D)`` -> ``(B, H, T, D)``."""
    return x[0].unflatten(1, (B, -1)).transpose(0, 1)


class _DeltaLayer(nn.Module):
    """The shared path of the recurrent layers (see the module docstring); a subclass defines
    :meth:`_inputs` (its projections, decay, beta and gate) and ``_gate_activation``.

    Attributes:
        d_model, num_heads (value heads ``Hv``), num_key_heads (query/key heads ``H``), head_dim
        (``Dk``), value_dim (``Dv``), kernel_size, bias, backend (:func:`attnlab.linear_attention`'s).
    """

    _gate_activation = "silu"

    def __init__(self, d_model: int, num_heads: int, *, num_key_heads: int | None, head_dim: int | None,
                 value_dim: int | None, kernel_size: int, norm_eps: float, bias: bool, backend: str):
        super().__init__()
        num_key_heads, head_dim = head_sizes(d_model, num_heads, num_key_heads, head_dim, group_name="num_key_heads")
        value_dim = head_dim if value_dim is None else value_dim
        for name, size in (("value_dim", value_dim), ("kernel_size", kernel_size)):
            positive_int(name, size)
        positive_number("norm_eps", norm_eps)
        instance_of("bias", bias, bool, "a bool")
        one_of("backend", backend, ["auto", *_linear.BACKENDS])
        self.d_model, self.num_heads, self.num_key_heads = d_model, num_heads, num_key_heads
        self.head_dim, self.value_dim, self.kernel_size, self.backend = head_dim, value_dim, kernel_size, backend
        self.bias = bias
        self.channels = 2 * num_key_heads * head_dim + num_heads * value_dim  # q, k, v features
        self.conv1d = nn.Conv1d(self.channels, self.channels, kernel_size, groups=self.channels, bias=False,
                                padding=kernel_size - 1)  # transformers' layout; the padding is ours to apply
        self.A_log = nn.Parameter(torch.log(torch.empty(num_heads).uniform_(1.0, 16.0)))
        self.norm = _GatedRMSNorm(value_dim, norm_eps, self._gate_activation)
        self.out_proj = nn.Linear(num_heads * value_dim, d_model, bias=bias)

    def _inputs(self, x: Tensor) -> _Inputs:
        raise NotImplementedError

    # ------------------------------------------------------------------ the path
    def forward(self, x: Tensor, *, cache: RecurrentCache | None = None, padding_mask: Tensor | None = None,
                document_ids: Tensor | None = None, mask: None = None) -> Tensor:
        """The layer over ``x`` ``(B, T, d_model)`` -> ``(B, T, d_model)``, continuing ``cache``'s tokens.

        Args:
            x: ``(B, T, d_model)``.
            cache: a :class:`~attnlab.nn.RecurrentCache` from :meth:`new_cache`: the tokens continue the
                ones it holds, and it holds them all after (a call that raises leaves it unchanged).
            padding_mask: ``(B, T)`` bool, True at real tokens (no cache): a padded token is skipped, its
                convolution input zero and the state passing it unchanged, so every real token's output
                is the row's alone with left or right padding.
            document_ids: ``(T,)`` or ``(B, T)`` ids of packed documents (no cache): the state and the
                convolution restart at each document, so each gets what it gets alone.
            mask: refused (a recurrent layer is causal by construction; there is no score to mask).

        Raises:
            ValueError, TypeError: a bad ``x``, cache, ``padding_mask`` or ``document_ids``, or a mask.
        """
        documents = self._check_call(x, cache, padding_mask, document_ids, mask)
        B, T, _ = x.shape
        inputs = self._inputs(x)
        mixed = inputs.mixed if padding_mask is None else inputs.mixed * padding_mask[..., None].to(x.dtype)
        window = cache.conv if cache is not None else mixed.new_zeros(B, self.channels, self.kernel_size - 1)
        full = torch.cat([window, mixed.transpose(1, 2)], dim=2)  # (B, C, K - 1 + T)
        features = F.silu(self._conv(full, documents)).transpose(1, 2)  # (B, T, C)
        q, k, v = self._heads(features, padding_mask)  # (B, H, T, Dk), (B, H, T, Dk), (B, Hv, T, Dv)
        decay = self._skip(inputs.decay, padding_mask)
        out, state = self._attend(q, k, v, _heads_first(decay), _heads_first(inputs.beta),
                                  None if cache is None else cache.state, documents)  # (B, Hv, T, Dv)
        out = self.norm(out.transpose(1, 2), inputs.gate).flatten(2)  # (B, T, Hv * Dv)
        out = self.out_proj(out)
        if cache is not None:  # everything computed: only now does the cache move on
            cache.advance(*_own_storage(full[..., full.shape[2] - (self.kernel_size - 1):], state), num_new=T)
        return out

    def _conv(self, full: Tensor, documents: Tensor | None) -> Tensor:
        """The short causal convolution of ``full`` ``(B, C, K - 1 + T)`` (window, then inputs) -> ``(B, C, T)``."""
        weight = self.conv1d.weight.to(full.dtype)
        if documents is not None:
            return _document_conv(full, weight, documents)
        if full.shape[2] < self.kernel_size:  # T == 0: no output
            return full[..., :0]
        if full.shape[2] - self.kernel_size < _TAPS_UP_TO:  # decoding: K products, not a conv kernel call
            return (full.unfold(2, self.kernel_size, 1) * weight).sum(-1)  # (B, C, T, K) * (C, 1, K) -> (B, C, T)
        return F.conv1d(full, weight, groups=self.channels)

    def _heads(self, features: Tensor, padding_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """q, k ``(B, H, T, Dk)`` l2-normalised and v ``(B, Hv, T, Dv)`` from the convolved features
        ``(B, T, C)``; a padded token's key is zero (it writes nothing)."""
        keys = self.num_key_heads * self.head_dim
        q, k, v = features.split([keys, keys, self.num_heads * self.value_dim], dim=-1)
        q = _l2norm(q.unflatten(-1, (self.num_key_heads, self.head_dim)))  # (B, T, H, Dk)
        k = _l2norm(k.unflatten(-1, (self.num_key_heads, self.head_dim)))
        if padding_mask is not None:
            k = k * padding_mask[..., None, None].to(k.dtype)
        v = v.unflatten(-1, (self.num_heads, self.value_dim))  # (B, T, Hv, Dv)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def _skip(decay: Tensor | None, padding_mask: Tensor | None) -> Tensor | None:
        """No decay at padded tokens ``(B, T, Hv[, Dk])``: the state passes them unchanged (None: nothing to do)."""
        if decay is None or padding_mask is None:
            return decay
        keep = padding_mask.reshape(*padding_mask.shape, *([1] * (decay.dim() - 2)))
        return decay * keep.to(decay.dtype)

    def _attend(self, q, k, v, decay, beta, state, documents):
        """:func:`attnlab.linear_attention` (the layer's rule), packing documents' rows end to end.

        Shapes:
            q, k: ``(B, H, T, Dk)``; v: ``(B, Hv, T, Dv)``; decay None or ``(B, Hv, T[, Dk])``; beta None or
            ``(B, Hv, T)``;
            state: None or ``(B, Hv, Dk, Dv)`` -> ``out (B, Hv, T, Dv)``, ``state (B, Hv, Dk, Dv)``.
        """
        # decay <= 0 and beta in [0, 1] hold by construction and x was checked finite: linear_attention's
        # seven value checks are left out (_run(values=False)); a weight or a cached state gone bad
        # shows in the output or the new state, checked once below, before the cache moves on.
        options = dict(scale=None, backend=self.backend, values=False)
        if documents is None or q.shape[2] == 0:  # no tokens: no documents to restart at
            return self._finite(*_linear._run(q, k, v, decay=decay, beta=beta, initial_state=state, cu_seqlens=None,
                                             **options))
        B = q.shape[0]
        cu_seqlens = _cu_seqlens(documents, B)
        q, k, v, decay, beta = (None if t is None else _packed(t) for t in (q, k, v, decay, beta))  # (1, H, B * T, ...)
        out, _ = self._finite(*_linear._run(q, k, v, decay=decay, beta=beta, initial_state=None, cu_seqlens=cu_seqlens,
                                            **options))
        return _unpacked(out, B), None

    def _finite(self, out: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """``(out, state)``, or ValueError when either holds NaN/inf although x was finite."""
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(out).all() & torch.isfinite(state).all()):
            raise ValueError(f"{type(self).__name__}: linear attention gave NaN or infinite values from a finite x: "
                             f"a weight or the cache's state has gone bad (the cache is left as it was)")
        return out, state

    # ------------------------------------------------------------------ checks and cache
    def _check_call(self, x, cache, padding_mask, document_ids, mask) -> Tensor | None:
        """Every argument of :meth:`forward` checked; the documents as ``(B|1, T)`` int64 (or None)."""
        if mask is not None:
            raise ValueError(f"mask: a {type(self).__name__} layer is causal by construction and has no scores to "
                             f"mask; use padding_mask or document_ids, got a {type(mask).__name__}")
        _check_x(x, self.out_proj.weight, self.d_model)
        if x.numel() and not torch.compiler.is_compiling() and not bool(torch.isfinite(x).all()):
            raise ValueError("x has NaN or infinite values; a recurrent layer carries its state through every "
                             "token, so one would spread to every later output")
        documents = _check_documents(document_ids, x, None, cache)
        if cache is not None:
            self._check_cache(cache, x)
        if padding_mask is not None:
            self._check_padding(padding_mask, x, cache)
        return documents

    def _check_cache(self, cache: object, x: Tensor) -> None:
        instance_of("cache", cache, RecurrentCache, "a RecurrentCache (module.new_cache)")
        expected = (x.shape[0], self.channels, self.kernel_size, self.num_heads, self.head_dim, self.value_dim)
        seen = (cache.batch_size, cache.channels, cache.kernel_size, cache.num_heads, cache.head_dim, cache.value_dim)
        if seen != expected:
            raise ValueError(f"cache must hold (batch_size, channels, kernel_size, num_heads, head_dim, value_dim) = "
                             f"{expected} for this layer and x's batch (module.new_cache); got {seen}")
        if cache.dtype != x.dtype:
            raise TypeError(f"cache holds {cache.dtype} but x is {x.dtype}; make it with module.new_cache(dtype=...)")
        if cache.device != x.device:
            raise ValueError(f"cache is on {cache.device} but x is on {x.device}")

    @staticmethod
    def _check_padding(padding_mask: object, x: Tensor, cache: object) -> None:
        _check_padding_type(padding_mask, "padding_mask")
        if cache is not None:
            raise ValueError("padding_mask is for a padded batch without a cache (a cache holds one state per row: "
                             "prefill each row alone)")
        if tuple(padding_mask.shape) != tuple(x.shape[:2]) or padding_mask.device != x.device:
            raise ValueError(f"padding_mask must be (B, T) = {tuple(x.shape[:2])} on {x.device}, "
                             f"got {tuple(padding_mask.shape)} on {padding_mask.device}")

    def new_cache(self, batch_size: int, max_len: int | None = None, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, page_size: int | None = None) -> RecurrentCache:
        """An empty :class:`~attnlab.nn.RecurrentCache` for ``batch_size`` rows: constant bytes at any length.

        Args:
            batch_size: rows. max_len, page_size: accepted for the models' one call and checked, but they
                size nothing: the state holds any number of tokens, and has no pages (a paged model's
                rows, prefilled alone through :meth:`~attnlab.nn.RecurrentCache.select`, may differ in
                length). dtype, device: default the layer's.

        Example:
            >>> KimiDeltaAttention(16, 2).new_cache(1)   # doctest: +NORMALIZE_WHITESPACE
            RecurrentCache(batch_size=1, channels=48, kernel_size=4, num_heads=2, head_dim=8, value_dim=8,
                           length=0, dtype=torch.float32)
        """
        for name, size in (("max_len", max_len), ("page_size", page_size)):
            if size is not None:
                positive_int(name, size)
        return RecurrentCache(batch_size, channels=self.channels, kernel_size=self.kernel_size,
                              num_heads=self.num_heads, head_dim=self.head_dim, value_dim=self.value_dim,
                              **_cache_options(self.out_proj.weight, dtype, device))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, num_key_heads={self.num_key_heads}, "
                f"head_dim={self.head_dim}, value_dim={self.value_dim}, kernel_size={self.kernel_size}, "
                f"bias={self.bias}, backend={self.backend!r}")


# ---------------------------------------------------------------------------- transformers
def _transformers_layer(layer: object, names: tuple[str, ...], method: str) -> str:
    """The class name of a transformers layer among ``names``; TypeError naming the class otherwise."""
    kind = type(layer)
    if kind.__name__ not in names or not kind.__module__.startswith("transformers."):
        raise TypeError(f"{method} takes a transformers {' or '.join(names)}, got "
                        f"{kind.__module__}.{kind.__qualname__}")
    if getattr(layer, "activation", "silu") != "silu":
        raise ValueError(f"{method}: the layer's convolution activation is {layer.activation!r}; attnlab's layer "
                         "uses SiLU (the models' hidden_act)")
    if layer.conv1d.bias is not None:
        raise ValueError(f"{method}: the layer's convolution has a bias; the models' (and attnlab's) have none")
    return kind.__name__


def _load(module: nn.Module, tensors: dict[str, Tensor], like: Tensor) -> nn.Module:
    """``module`` on ``like``'s dtype and device with ``tensors`` (its whole state dict) copied in."""
    module = module.to(dtype=like.dtype, device=like.device)
    shapes = {name: t.shape for name, t in module.state_dict().items()}
    module.load_state_dict({name: t.detach().reshape(shapes[name]) for name, t in tensors.items()})
    return module


class GatedDeltaNet(_DeltaLayer):
    """Gated DeltaNet, the linear layer of Qwen3-Next and Qwen3.5 (three of every four layers).

    Per token: ``q, k, v = silu(conv(in_proj_qkv(x)))``, q and k l2-normalised; ``beta = sigmoid(in_proj_b(x))``;
    one log-decay per value head ``-exp(A_log) * softplus(in_proj_a(x) + dt_bias)``; the gated delta rule
    (:func:`attnlab.linear_attention`); then per value head ``RMSNorm(o) * weight * silu(in_proj_z(x))``
    and ``out_proj``. Each query/key head serves ``num_heads // num_key_heads`` consecutive value heads.

    **Parameters** (Qwen3.5's names and layout): ``in_proj_qkv`` ``(2 H Dk + Hv Dv, d_model)`` (q, k, v
    features), ``in_proj_z`` ``(Hv Dv, d_model)``, ``in_proj_b``/``in_proj_a`` ``(Hv, d_model)``, ``dt_bias``
    and ``A_log`` ``(Hv,)``, ``conv1d.weight`` ``(C, 1, kernel_size)``, ``norm.weight`` ``(Dv,)``,
    ``out_proj`` ``(d_model, Hv Dv)``. :meth:`from_transformers` reads Qwen3-Next's fused ``in_proj_qkvz``
    and ``in_proj_ba`` (grouped per key head) into these.

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``. Its cache: a window ``(B, C, kernel_size - 1)`` and
        the state ``(B, Hv, Dk, Dv)``, whatever the length.

    Args:
        d_model: input and output width.
        num_heads: value heads ``Hv`` (Qwen's ``linear_num_value_heads``).
        num_key_heads: query/key heads ``H`` (divides ``num_heads``; default ``num_heads``).
        head_dim: ``Dk`` (default ``d_model // num_heads``). value_dim: ``Dv`` (default ``head_dim``).
        kernel_size: the short convolution's width (4 in the models).
        norm_eps: the gated RMSNorm's epsilon.
        bias: biases in every projection (the models have none; the convolution never has one).
        backend: :func:`attnlab.linear_attention`'s backend (``"auto"``).

    Example:
        >>> layer = GatedDeltaNet(64, 8, num_key_heads=4, head_dim=16)
        >>> layer.in_proj_qkv.weight.shape, layer(torch.randn(2, 5, 64)).shape
        (torch.Size([256, 64]), torch.Size([2, 5, 64]))
    """

    def __init__(self, d_model: int, num_heads: int, *, num_key_heads: int | None = None, head_dim: int | None = None,
                 value_dim: int | None = None, kernel_size: int = 4, norm_eps: float = 1e-6, bias: bool = False,
                 backend: str = "auto"):
        super().__init__(d_model, num_heads, num_key_heads=num_key_heads, head_dim=head_dim, value_dim=value_dim,
                         kernel_size=kernel_size, norm_eps=norm_eps, bias=bias, backend=backend)
        self.in_proj_qkv = nn.Linear(d_model, self.channels, bias=bias)
        self.in_proj_z = nn.Linear(d_model, num_heads * self.value_dim, bias=bias)
        self.in_proj_b = nn.Linear(d_model, num_heads, bias=bias)
        self.in_proj_a = nn.Linear(d_model, num_heads, bias=bias)
        self.dt_bias = nn.Parameter(_init_dt_bias(num_heads))

    def _inputs(self, x: Tensor) -> _Inputs:
        gate = self.in_proj_z(x).unflatten(-1, (self.num_heads, self.value_dim))  # (B, T, Hv, Dv)
        decay = _softplus_decay(self.A_log, self.in_proj_a(x) + self.dt_bias)  # (B, T, Hv)
        return _Inputs(self.in_proj_qkv(x), decay, torch.sigmoid(self.in_proj_b(x)), gate)

    @classmethod
    def from_transformers(cls, layer: nn.Module, *, backend: str = "auto") -> "GatedDeltaNet":
        """The layer with the weights of a transformers ``Qwen3NextGatedDeltaNet`` or ``Qwen3_5GatedDeltaNet``.

        Its outputs equal the transformers layer's forward (up to rounding: transformers runs the
        chunked rule in fp32), on its dtype and device.

        Raises:
            TypeError: ``layer`` is another class (named). ValueError: a convolution bias or an
                activation other than SiLU.

        Example:
            >>> from transformers import Qwen3_5TextConfig
            >>> from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
            >>> config = Qwen3_5TextConfig(hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
            ...     linear_key_head_dim=8, linear_value_head_dim=8, num_hidden_layers=1,
            ...     layer_types=["linear_attention"])
            >>> theirs = Qwen3_5GatedDeltaNet(config, 0)
            >>> ours, x = GatedDeltaNet.from_transformers(theirs), torch.randn(1, 5, 32)
            >>> torch.allclose(ours(x), theirs(x), atol=1e-5)
            True
        """
        name = _transformers_layer(layer, ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet"),
                                   "GatedDeltaNet.from_transformers")
        H, Hv, Dk, Dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        module = cls(layer.hidden_size, Hv, num_key_heads=H, head_dim=Dk, value_dim=Dv,
                     kernel_size=layer.conv_kernel_size, norm_eps=layer.layer_norm_epsilon, backend=backend)
        tensors = {"conv1d.weight": layer.conv1d.weight, "A_log": layer.A_log, "dt_bias": layer.dt_bias,
                   "norm.weight": layer.norm.weight, "out_proj.weight": layer.out_proj.weight}
        if name == "Qwen3_5GatedDeltaNet":
            parts = ("qkv", "z", "b", "a")  # Qwen3.5's names are ours
            tensors.update({f"in_proj_{p}.weight": getattr(layer, f"in_proj_{p}").weight for p in parts})
        else:
            tensors.update(_unfuse_qwen3_next(layer.in_proj_qkvz.weight, layer.in_proj_ba.weight, H, Hv, Dk, Dv))
        return _load(module, tensors, layer.out_proj.weight)


def _unfuse_qwen3_next(qkvz: Tensor, ba: Tensor, H: int, Hv: int, Dk: int, Dv: int) -> dict[str, Tensor]:
    """Qwen3-Next's fused projections, grouped per key head (``[q, k, v, z]`` and ``[b, a]`` of each),
    as the separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (all q, all k, all v)."""
    g, d_model = Hv // H, qkvz.shape[1]
    q, k, v, z = qkvz.view(H, 2 * Dk + 2 * g * Dv, d_model).split([Dk, Dk, g * Dv, g * Dv], dim=1)  # (H, rows, d)
    b, a = ba.view(H, 2 * g, d_model).split([g, g], dim=1)  # (H, g, d): value head h * g + i
    qkv = torch.cat([q.reshape(H * Dk, d_model), k.reshape(H * Dk, d_model), v.reshape(Hv * Dv, d_model)])
    return {"in_proj_qkv.weight": qkv, "in_proj_z.weight": z.reshape(Hv * Dv, d_model),
            "in_proj_b.weight": b.reshape(Hv, d_model), "in_proj_a.weight": a.reshape(Hv, d_model)}


class KimiDeltaAttention(_DeltaLayer):
    """Kimi Delta Attention (KDA), the linear layer of Kimi Linear (three of every four layers).

    The gated delta rule with a decay per key channel: ``q, k, v = silu(conv([q_proj x, k_proj x,
    v_proj x]))``, q and k l2-normalised; ``beta = sigmoid(b_proj(x))``; the log-decay of value head
    ``h``'s key channel ``c`` is ``-exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)[h, c]`` (a low-rank
    forget gate); then per value head ``RMSNorm(o) * weight * sigmoid(g_b(g_a(x)))`` and ``out_proj``.

    **Parameters** (Kimi Linear's names, but the forget gate's and norm's, which carry no prefix here):
    ``q_proj``, ``k_proj`` ``(H Dk, d_model)``, ``v_proj`` ``(Hv Dv, d_model)``, ``f_a_proj`` ``(rank,
    d_model)``, ``f_b_proj`` ``(Hv Dk, rank)``, ``dt_bias`` ``(Hv Dk,)``, ``A_log`` ``(Hv,)``, ``b_proj``
    ``(Hv, d_model)``, ``g_a_proj`` ``(rank, d_model)``, ``g_b_proj`` ``(Hv Dv, rank)``, ``conv1d.weight``,
    ``norm.weight`` ``(Dv,)`` (Kimi's ``o_norm``), ``out_proj`` (Kimi's ``o_proj``).

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``; the cache as :class:`GatedDeltaNet`'s.

    Args:
        d_model: input and output width.
        num_heads: heads ``Hv`` (Kimi's ``linear_num_heads``).
        num_key_heads: query/key heads ``H`` (divides ``num_heads``; default ``num_heads``, Kimi's).
        head_dim: ``Dk`` (default ``d_model // num_heads``). value_dim: ``Dv`` (default ``head_dim``).
        rank: the forget and output gates' low rank (default ``head_dim``, Kimi's).
        kernel_size: the short convolution's width. norm_eps: the gated RMSNorm's epsilon.
        bias: biases in every projection (the models have none; the convolution never has one).
        backend: :func:`attnlab.linear_attention`'s backend (``"auto"``).

    Example:
        >>> layer = KimiDeltaAttention(32, 4)
        >>> layer.f_b_proj.weight.shape, layer(torch.randn(2, 5, 32)).shape
        (torch.Size([32, 8]), torch.Size([2, 5, 32]))
    """

    _gate_activation = "sigmoid"

    def __init__(self, d_model: int, num_heads: int, *, num_key_heads: int | None = None, head_dim: int | None = None,
                 value_dim: int | None = None, rank: int | None = None, kernel_size: int = 4, norm_eps: float = 1e-5,
                 bias: bool = False, backend: str = "auto"):
        super().__init__(d_model, num_heads, num_key_heads=num_key_heads, head_dim=head_dim, value_dim=value_dim,
                         kernel_size=kernel_size, norm_eps=norm_eps, bias=bias, backend=backend)
        rank = self.head_dim if rank is None else positive_int("rank", rank)
        Hv, Dk, Dv = num_heads, self.head_dim, self.value_dim
        self.q_proj = nn.Linear(d_model, self.num_key_heads * Dk, bias=bias)
        self.k_proj = nn.Linear(d_model, self.num_key_heads * Dk, bias=bias)
        self.v_proj = nn.Linear(d_model, Hv * Dv, bias=bias)
        self.f_a_proj = nn.Linear(d_model, rank, bias=bias)
        self.f_b_proj = nn.Linear(rank, Hv * Dk, bias=bias)
        self.dt_bias = nn.Parameter(_init_dt_bias(Hv * Dk))
        self.b_proj = nn.Linear(d_model, Hv, bias=bias)
        self.g_a_proj = nn.Linear(d_model, rank, bias=bias)
        self.g_b_proj = nn.Linear(rank, Hv * Dv, bias=bias)

    def _inputs(self, x: Tensor) -> _Inputs:
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (B, T, C)
        logits = (self.f_b_proj(self.f_a_proj(x)) + self.dt_bias).unflatten(-1, (self.num_heads, self.head_dim))
        decay = _softplus_decay(self.A_log[:, None], logits)  # (B, T, Hv, Dk)
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.num_heads, self.value_dim))  # (B, T, Hv, Dv)
        return _Inputs(mixed, decay, torch.sigmoid(self.b_proj(x)), gate)

    @classmethod
    def from_transformers(cls, layer: nn.Module, *, backend: str = "auto") -> "KimiDeltaAttention":
        """The layer with the weights of a transformers ``KimiLinearDeltaAttention``.

        Raises:
            TypeError: ``layer`` is another class (named). ValueError: a convolution bias or an
                activation other than SiLU.

        Example:
            >>> from transformers import KimiLinearConfig
            >>> from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
            >>> config = KimiLinearConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
            ...     linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4})
            >>> theirs = KimiLinearDeltaAttention(config, 0)
            >>> with torch.no_grad():    # transformers leaves these two uninitialised (torch.empty)
            ...     _ = theirs.forget_gate.A_log.uniform_(0, 1), theirs.forget_gate.dt_bias.uniform_(-1, 1)
            >>> ours, x = KimiDeltaAttention.from_transformers(theirs), torch.randn(1, 5, 32)
            >>> torch.allclose(ours(x), theirs(x), atol=1e-5)
            True
        """
        _transformers_layer(layer, ("KimiLinearDeltaAttention",), "KimiDeltaAttention.from_transformers")
        gate = layer.forget_gate
        module = cls(layer.hidden_size, layer.num_heads, head_dim=layer.head_dim, rank=gate.f_a_proj.out_features,
                     kernel_size=layer.conv_kernel_size, norm_eps=layer.layer_norm_epsilon, backend=backend)
        tensors = {name: getattr(layer, name).weight for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj",
                                                                   "g_b_proj", "conv1d")}
        tensors = {f"{name}.weight": t for name, t in tensors.items()}
        tensors.update({"f_a_proj.weight": gate.f_a_proj.weight, "f_b_proj.weight": gate.f_b_proj.weight,
                        "dt_bias": gate.dt_bias, "A_log": gate.A_log, "norm.weight": layer.o_norm.weight,
                        "out_proj.weight": layer.o_proj.weight})
        return _load(module, tensors, layer.o_proj.weight)


DECAYS = ("data", "fixed", "none")


class DecayedLinearAttention(_DeltaLayer):
    """Linear attention with a scalar decay per head: Mamba-2's, RetNet's and lightning's rule in one layer.

    The additive update of :func:`attnlab.linear_attention` (no ``beta``: ``S_t = exp(decay_t) S_{t-1} +
    k_t v_tᵀ``) inside the same layer as :class:`GatedDeltaNet` (short convolution, l2-normalised q
    and k, gated RMSNorm with ``silu(z)``, output projection, :class:`~attnlab.nn.RecurrentCache`);
    ``decay`` picks the rule:

    * ``"data"`` (Mamba-2's discretisation, as Gated DeltaNet's decay): ``-exp(A_log) ·
      softplus(a + dt_bias)`` with ``a`` projected from x, one per head and token;
    * ``"fixed"`` (RetNet's retention; lightning attention's constant per-head decays): head ``h``
      keeps ``1 - 2^(-5-h)`` of its state a step (``log`` of it as the decay), not learned;
    * ``"none"``: plain causal linear attention ("Transformers are RNNs").

    Shapes:
        x: ``(B, T, d_model)`` -> ``(B, T, d_model)``; its cache holds the conv window and the state
        ``(B, Hv, Dk, Dv)`` whatever the length.

    Args:
        d_model, num_heads, num_key_heads, head_dim, value_dim, kernel_size, norm_eps, bias, backend:
            as :class:`GatedDeltaNet`.
        decay: ``"data"``, ``"fixed"`` or ``"none"`` (see above).

    Example:
        >>> layer = DecayedLinearAttention(32, 4, decay="fixed")
        >>> [round(g, 4) for g in layer._inputs(torch.randn(1, 1, 32)).decay[0, 0].exp().tolist()]
        [0.9688, 0.9844, 0.9922, 0.9961]
        >>> cache, x = layer.new_cache(1), torch.randn(1, 5, 32)
        >>> with torch.no_grad():
        ...     steps = torch.cat([layer(x[:, t:t + 1], cache=cache) for t in range(5)], dim=1)
        ...     torch.allclose(steps, layer(x), atol=1e-5)
        True
    """

    def __init__(self, d_model: int, num_heads: int, *, decay: str = "data", num_key_heads: int | None = None,
                 head_dim: int | None = None, value_dim: int | None = None, kernel_size: int = 4,
                 norm_eps: float = 1e-6, bias: bool = False, backend: str = "auto"):
        super().__init__(d_model, num_heads, num_key_heads=num_key_heads, head_dim=head_dim, value_dim=value_dim,
                         kernel_size=kernel_size, norm_eps=norm_eps, bias=bias, backend=backend)
        self.decay = one_of("decay", decay, DECAYS)
        self.in_proj_qkv = nn.Linear(d_model, self.channels, bias=bias)
        self.in_proj_z = nn.Linear(d_model, num_heads * self.value_dim, bias=bias)
        if decay == "data":
            self.in_proj_a = nn.Linear(d_model, num_heads, bias=bias)
            self.dt_bias = nn.Parameter(_init_dt_bias(num_heads))
        else:  # no learned decay: A_log would be a parameter no gradient reaches
            del self.A_log
        retention = torch.log1p(-torch.exp2(-5.0 - torch.arange(num_heads, dtype=torch.float64)))
        self.register_buffer("fixed_decay", retention.float(), persistent=False)  # (Hv,) RetNet's log-gammas

    def _inputs(self, x: Tensor) -> _Inputs:
        gate = self.in_proj_z(x).unflatten(-1, (self.num_heads, self.value_dim))  # (B, T, Hv, Dv)
        if self.decay == "data":
            decay = _softplus_decay(self.A_log, self.in_proj_a(x) + self.dt_bias)  # (B, T, Hv)
        elif self.decay == "fixed":
            work = torch.promote_types(x.dtype, torch.float32)
            decay = self.fixed_decay.to(work).expand(*x.shape[:2], self.num_heads)  # (B, T, Hv)
        else:
            decay = None
        return _Inputs(self.in_proj_qkv(x), decay, None, gate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, decay={self.decay!r}"
