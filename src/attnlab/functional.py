"""``attnlab.attention``: one function, one set of semantics, several backends."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd import profiler as _profiler

from attnlab._call import AttentionCall, build_call, sdpa_aligned
from attnlab._math import repeat_kv
from attnlab.backends import topk
from attnlab.backends.base import Backend, weights_of
from attnlab.backends.dispatch import Route, fresh_route, key_of, lookup, route, select
from attnlab.backends.observed import labelled
from attnlab.backends.registry import get
from attnlab.scores import ScoreMod

__all__ = ["attention", "attention_weights", "plan", "AttentionPlan"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Callable | None = None,
    causal: bool = False,
    align: str = "top_left",
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    return_weights: bool = False,
    score_mod: ScoreMod | Callable | None = None,
    sinks: Tensor | None = None,
    indices: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention, ``softmax(score_mod(q k^T * scale) + mask) v``.

    Stateless: no tensor or object of the caller is kept once it returns. A caller who repeats
    one call (a module, a training loop) may hold a :func:`plan` of it instead.

    Shapes (``...`` is nothing, ``B``, ``B, H`` or ``A, B, H``; lower ranks align from the
    right and batch dims broadcast, as in ``F.scaled_dot_product_attention``; the contract in
    full is docs/design.md, "The contract"):

        q ``(..., Tq, D)``, k ``(..., Tk, D)``, v ``(..., Tk, Dv)`` -> out ``(..., Tq, Dv)``.
        With heads (rank 4, 5), k and v may have fewer (grouped-query): ``Hq`` a multiple of
        ``Hkv``, query head ``h`` reads key/value head ``h // (Hq // Hkv)``.

    Args:
        q, k, v: query, key and value tensors of one floating dtype on one device.
        mask: a **bool** tensor (True = may attend) or a **float** tensor (added to the scaled
            scores), broadcasting to ``(..., Tq, Tk)`` (padding: ``(B, 1, 1, Tk)``), or a
            **mask mod** ``(b, h, q_idx, kv_idx) -> bool`` (:mod:`attnlab.masks`).
        causal: also block future keys, ANDed with ``mask``.
        align: ``"top_left"`` (query ``i`` sees keys ``<= i``, PyTorch's ``is_causal``) or
            ``"bottom_right"`` (keys ``<= i + Tk - Tq``: decoding over a KV cache).
        scale: multiplier of the scores; defaults to ``1 / sqrt(D)``.
        dropout_p: probability of zeroing each weight, in ``[0, 1)``; 0 in evaluation.
        generator: random generator for dropout; same seed, same output.
        backend: ``"auto"`` (the fastest backend that serves the call, never an O(T^2)-memory
            one when an O(T) one serves) or a name from :func:`attnlab.backends.available`,
            which raises ``ValueError`` with its reasons when it cannot serve the call.
        return_weights: also return the weights ``(..., Hq, Tq, Tk)`` per head, before dropout.
        score_mod: changes each scaled score before masking: one of :mod:`attnlab.scores` or a
            function ``(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's signature).
        sinks: sink logits ``(Hq,)`` or ``(B|1, Hq|1, Tq)``: one more key per row, of that
            logit and value 0, which only takes probability mass (``+inf`` takes it all,
            ``-inf`` is no sink); the weights returned leave its share out.
        indices: top-k sparse attention, ``(B|1, Hkv|1, Tq, k)`` key indices per query
            (``-1``: none), ANDed with the masks, in O(Tq*k) memory (docs/sparse.md).

    Returns:
        ``out`` ``(..., Tq, Dv)``, or ``(out, weights)`` with ``return_weights``. A query with
        no key to attend gets a zero row and zero gradient; finite values at blocked keys
        have no influence (docs/design.md, "Non-finite values").

    Raises:
        TypeError: non-tensor input, a non-float or mixed dtype, an integer mask.
        ValueError: wrong rank, mismatched sizes, batch dims that do not broadcast, heads not
            divisible, a mask that does not broadcast, ``dropout_p`` outside ``[0, 1)``, an
            unknown or unable backend, a score mod or sinks that do not match the call.

    Example:
        >>> import torch, attnlab
        >>> q = torch.randn(2, 4, 10, 16)                    # (B, H, T, D)
        >>> k, v = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 8)   # 2 key/value heads
        >>> out, weights = attnlab.attention(q, k, v, causal=True, return_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 4, 10, 8]), torch.Size([2, 4, 10, 10]))
        >>> bool(weights[0, 0, 0, 1:].eq(0).all())           # the first token sees only itself
        True
        >>> shared = torch.randn(1, 2, 10, 16)                # one prompt's keys for the batch
        >>> attnlab.attention(q, shared, shared).shape
        torch.Size([2, 4, 10, 16])
        >>> sinks = torch.zeros(4, requires_grad=True)          # one sink logit per query head
        >>> out = attnlab.attention(q, k, v, causal=True, sinks=sinks,
        ...                         score_mod=attnlab.scores.softcap(20.0))
        >>> out.sum().backward(); sinks.grad.shape
        torch.Size([4])
        >>> per_query = torch.zeros(2, 1, 10, requires_grad=True)  # (B, 1, Tq): one logit per query
        >>> attnlab.attention(q, k, v, causal=True, sinks=per_query).sum().backward()
        >>> per_query.grad.shape
        torch.Size([2, 1, 10])
    """
    if indices is not None:  # top-k: its own kernel, never the dense dispatch
        return _attention_at(*sdpa_aligned(q, k, v), indices, backend=backend, mask=mask, causal=causal,
                             align=align, scale=scale, dropout_p=dropout_p, generator=generator,
                             return_weights=return_weights, score_mod=score_mod, sinks=sinks)
    # The key of the tensors as given (positional: this runs on every call); None when they need
    # aligning first (mixed ranks align from the right, as SDPA's) or cannot be keyed.
    key = key_of(q, k, v, mask, causal, align, scale, dropout_p, generator, backend, return_weights,
                 score_mod, sinks, True)
    if key is None:
        q, k, v = sdpa_aligned(q, k, v)
        key = key_of(q, k, v, mask, causal, align, scale, dropout_p, generator, backend, return_weights,
                     score_mod, sinks, False)
    known = lookup(key)  # (None for a key of None: no route is stored under it)
    if known is not None and known.tk is not None and known.tk != k.shape[-2]:
        known = None  # a decoding step's route planned for another cache length: made afresh
    if known is not None and known.run is not None:  # validated before: nothing reads values
        if _profiler._is_profiler_enabled:
            return _call_run(known, q, k, v, mask, sinks, score_mod)
        if score_mod is not None:  # (a call with a score mod has the protocol's run)
            return known.run(q, k, v, mask, sinks, score_mod)
        # sdpa's run may be SDPA itself (4 or 5 arguments): no frame of attnlab's on this path
        return known.run(q, k, v, mask) if sinks is None else known.run(q, k, v, mask, sinks)  # (B, Hq, Tq, Dv)
    if known is not None and known.mask is not None:  # the same mask, prepared: plans made once
        mask, causal = known.mask, False
    call = build_call(
        q, k, v, mask=mask, causal=causal, align=align, scale=scale, dropout_p=dropout_p,
        generator=generator, return_weights=return_weights, score_mod=score_mod, sinks=sinks,
    )
    if known is None:  # a new signature: choose, and remember where the key holds no user object
        known = route(key, call, backend, direct=_direct(call, q, k, v, mask, sinks))
        if known.run is not None:  # the first call runs as every later one will
            return _call_run(known, q, k, v, mask, sinks, score_mod)
        if known.mask is not None:  # the first call plans from the prepared mask too
            call = build_call(q, k, v, mask=known.mask, causal=False, align=align, scale=scale,
                              dropout_p=dropout_p, generator=generator, return_weights=return_weights,
                              score_mod=score_mod, sinks=sinks)
    return _run(known.backend, call)


def _direct(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, mask: object, sinks: object) -> bool:
    """Whether a run may take the caller's tensors as given: they are the call's (4-D, nothing
    broadcast or reshaped), and a tensor mask too (a mask mod is kept by the run or planned)."""
    return (call.q is q and call.k is k and call.v is v and call.sinks is sinks
            and (call.mask is mask or not isinstance(mask, Tensor)))


def _call_run(known: Route, q: Tensor, k: Tensor, v: Tensor, mask: object, sinks: object, score_mod: object):
    """A route's prepared run on the caller's tensors (sdpa's may be SDPA itself: four or five
    arguments); as a labelled range when a profiler is on (observed.py)."""
    args = (q, k, v, mask) if score_mod is None and sinks is None else (
        (q, k, v, mask, sinks) if score_mod is None else (q, k, v, mask, sinks, score_mod))
    if _profiler._is_profiler_enabled:
        return labelled(known.backend.name, known.run, *args)
    return known.run(*args)  # (B, Hq, Tq, Dv), or (out, weights)


def _run(backend: Backend, call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """``backend`` on a validated call; the output (and weights) in the user's layout."""
    # A profiler is on: the backend as a range. Compiling, the flag is not read (a guard on it
    # would recompile the graph whenever a profiler starts or stops).
    if not torch.compiler.is_compiling() and _profiler._is_profiler_enabled:
        result = labelled(backend.name, backend.forward, call)
    else:
        result = backend.forward(call)
    out = _restore_rank(result.out, call)
    if not call.return_weights:
        return out
    weights = result.weights if result.weights is not None else weights_of(call)
    return out, _restore_rank(weights, call)


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Callable | None = None,
    causal: bool = False,
    align: str = "top_left",
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    return_weights: bool = False,
    score_mod: ScoreMod | Callable | None = None,
    sinks: Tensor | None = None,
) -> AttentionPlan:
    """:func:`attention` for these arguments, decided once: an :class:`AttentionPlan` to hold.

    A caller who repeats a call (a module per shape, a training loop) holds the plan, as
    FlexAttention's users hold a ``BlockMask``: the backend is chosen here, SDPA's run is bound,
    and nothing is kept in module state. Arguments mean what they mean for :func:`attention`;
    only the tensors' shapes, dtypes and devices are fixed (and ``mask``/``sinks`` are the
    plan's defaults).

    Example:
        >>> import torch, attnlab
        >>> q = torch.randn(2, 4, 10, 16)                       # (B, H, T, D)
        >>> causal = attnlab.plan(q, q, q, causal=True)
        >>> causal.backend
        'sdpa'
        >>> k, v = torch.randn(2, 4, 10, 16), torch.randn(2, 4, 10, 16)
        >>> torch.allclose(causal(q, k, v), attnlab.attention(q, k, v, causal=True))
        True
    """
    q, k, v = sdpa_aligned(q, k, v)
    options = dict(causal=causal, align=align, scale=scale, dropout_p=dropout_p, generator=generator,
                   return_weights=return_weights, score_mod=score_mod)
    return AttentionPlan(build_call(q, k, v, mask=mask, sinks=sinks, **options), q, k, v, mask, sinks,
                         options, backend)


class AttentionPlan:
    """One :func:`attention` signature with its backend chosen once (made by :func:`plan`).

    ``plan(q, k, v, mask=None, sinks=None)`` runs it on tensors of the planned shapes, dtypes
    and devices (``ValueError`` naming the argument otherwise); ``mask`` and ``sinks`` default
    to the planned ones, and another mask must be of the same kind (a tensor of the same
    shape and dtype, or a mask mod). Each grad setting (grad mode, which inputs require grad)
    is decided once, on its first call.

    Attributes:
        backend: the name of the backend that runs the planned call.

    Example:
        >>> import torch, attnlab
        >>> q = torch.randn(1, 2, 8, 4)
        >>> padded = attnlab.plan(q, q, q, mask=torch.ones(1, 1, 1, 8, dtype=torch.bool))
        >>> keep = torch.tensor([True] * 5 + [False] * 3).view(1, 1, 1, 8)
        >>> torch.allclose(padded(q, q, q, mask=keep), attnlab.attention(q, q, q, mask=keep))
        True
        >>> padded(torch.randn(1, 2, 9, 4), q, q)
        Traceback (most recent call last):
        ValueError: q: the plan was made for shape (1, 2, 8, 4) float32 on cpu, got shape (1, 2, 9, 4) float32 on cpu
    """

    def __init__(self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, mask: object, sinks: object,
                 options: dict, name: str):
        self._signature = _signature(q, k, v)
        self._mask, self._sinks, self._options, self._name = mask, sinks, options, name
        self._routes: dict[tuple, Route] = {}  # per grad setting: at most a handful
        self.backend = self._route(call, _grads(q, k, v, mask, sinks), q, k, v, mask, sinks).backend.name

    def _route(self, call: AttentionCall, grads: tuple, q: Tensor, k: Tensor, v: Tensor, mask: object,
               sinks: object) -> Route:
        """Choose the backend for ``call`` (the first of its grad setting) and keep the route."""
        direct = _direct(call, q, k, v, mask, sinks) and mask is self._mask
        self._routes[grads] = fresh_route(call, select(call, self._name), direct=direct)
        return self._routes[grads]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Callable | None = None,
                 sinks: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        try:  # _signature inline (this runs on every call); tensors of the planned shapes are aligned already
            signature = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)
        except AttributeError:
            signature = None
        if signature != self._signature:
            q, k, v = sdpa_aligned(q, k, v)  # mixed ranks align from the right, as SDPA's
            if _signature(q, k, v) != self._signature:
                self._refuse(q, k, v)
        mask = self._mask if mask is None else _like("mask", mask, self._mask)
        sinks = self._sinks if sinks is None else _like("sinks", sinks, self._sinks)
        grads = _grads(q, k, v, mask, sinks)
        known = self._routes.get(grads)
        if known is not None and known.run is not None and (mask is self._mask or not known.keeps_mask):
            if torch.compiler.is_compiling():
                return _run(known.backend, self._call(q, k, v, mask, sinks, None))
            score_mod = self._options["score_mod"]
            if _profiler._is_profiler_enabled:
                return _call_run(known, q, k, v, mask, sinks, score_mod)
            if score_mod is not None:  # nothing to decide
                return known.run(q, k, v, mask, sinks, score_mod)
            return known.run(q, k, v, mask) if sinks is None else known.run(q, k, v, mask, sinks)
        prepared = known.mask if known is not None and mask is self._mask else None
        call = self._call(q, k, v, mask, sinks, prepared)
        chosen = known.backend if known is not None else self._route(call, grads, q, k, v, mask, sinks).backend
        return _run(chosen, call)

    def _call(self, q: Tensor, k: Tensor, v: Tensor, mask: object, sinks: object, prepared: object) -> AttentionCall:
        """The checked call, on the route's prepared mask where there is one."""
        return build_call(q, k, v, mask=mask if prepared is None else prepared, sinks=sinks,
                          **(self._options if prepared is None else {**self._options, "causal": False}))

    def _refuse(self, q: object, k: object, v: object) -> None:
        for i, (name, given) in enumerate(zip("qkv", (q, k, v))):
            want = self._signature[i::3]
            if not isinstance(given, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(given).__name__}")
            if (given.shape, given.dtype, given.device) != want:
                raise ValueError(f"{name}: the plan was made for {_words(want)}, got {_words(given)}")

    def __repr__(self) -> str:
        return f"AttentionPlan(backend={self.backend!r}, q {_words(self._signature[::3])})"


def _words(t: Tensor | tuple) -> str:
    """``shape (...) dtype on device`` of a tensor or of its ``(shape, dtype, device)``."""
    shape, dtype, device = (t.shape, t.dtype, t.device) if isinstance(t, Tensor) else t
    return f"shape {tuple(shape)} {str(dtype).replace('torch.', '')} on {device}"


def _like(name: str, given: object, planned: object) -> object:
    """``given`` if it has the planned argument's kind (and a tensor its shape, dtype, device)."""
    if isinstance(planned, Tensor) and isinstance(given, Tensor):
        want, got = (planned.shape, planned.dtype, planned.device), (given.shape, given.dtype, given.device)
        if got != want:
            raise ValueError(f"{name}: the plan was made for {_words(want)}, got {_words(given)}")
        return given
    if planned is not None and not isinstance(planned, Tensor) and not isinstance(given, Tensor):
        return given  # a mask mod for a mask mod: checked by build_call
    what = "none" if planned is None else "a tensor" if isinstance(planned, Tensor) else "a mask mod"
    raise ValueError(f"{name}: the plan was made with {what}, got a {type(given).__name__}; "
                     f"make another plan for it")


def _signature(q: object, k: object, v: object) -> tuple | None:
    """Shapes, dtypes and devices of q, k and v as one flat tuple (None if one is no tensor)."""
    try:
        return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)
    except AttributeError:
        return None


def _grads(q: Tensor, k: Tensor, v: Tensor, mask: object, sinks: object) -> tuple:
    """What decides a backend beyond the signature: grad mode and which inputs want a gradient."""
    return (torch.is_grad_enabled(), q.requires_grad, k.requires_grad, v.requires_grad,
            isinstance(mask, Tensor) and mask.requires_grad, isinstance(sinks, Tensor) and sinks.requires_grad)


# Compiled code runs it eagerly: it reads the index values and builds sparse tensors. torch._disable_dynamo
# is torch.compiler.disable importing torch._dynamo on the first call, not here: `import attnlab` stays
# clear of the compiler (seconds of start-up for every command line and script).
@torch._disable_dynamo
def _attention_at(q: Tensor, k: Tensor, v: Tensor, indices: object, *, backend: str, **options):
    """:func:`attention` with ``indices``: validated, then the top-k kernel or the dense oracle."""
    call = build_call(q, k, v, **options)
    idx = topk.check_indices(indices, call, rank=q.ndim)
    why_not = topk.refusal(call, backend)
    if why_not is not None:
        raise ValueError(why_not)
    if backend == "reference":
        out, weights = _dense_at(call, idx)
    else:
        out, weights = topk.topk_attention(call, idx)
    out = _restore_rank(out, call)
    return (out, _restore_rank(weights, call)) if call.return_weights else out


def _dense_at(call: AttentionCall, idx: Tensor) -> tuple[Tensor, Tensor | None]:
    """The reference backend on the dense mask of the listed keys ∩ the call's masks: O(Tq*Tk)."""
    listed = topk.indices_mask(repeat_kv(idx, call.q_heads) if idx.shape[1] > 1 else idx, call.tk)
    allowed = call.allowed()
    allowed = listed if allowed is None else allowed & listed  # (B|1, Hq|1, Tq, Tk)
    bias = call.bias()
    mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
    dense = dataclasses.replace(call, mask=mask, causal_offset=None, _memo={})
    result = get("reference").forward(dense)
    return result.out, result.weights


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Callable | None = None,
    causal: bool = False,
    align: str = "top_left",
    scale: float | None = None,
    score_mod: ScoreMod | Callable | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The attention weights ``softmax(score_mod(q k^T * scale) + mask)`` that :func:`attention` applies.

    The same weights as ``attention(..., return_weights=True)`` returns, without computing the
    output: rows sum to 1, blocked keys get 0, and a query with no attendable key gets a zero
    row. With ``sinks``, rows sum to 1 minus the sink's share (``1 - weights.sum(-1)`` is it).
    Arguments mean what they mean for :func:`attention`; no gradient is recorded.

    Shapes:
        q ``(..., Tq, D)``, k ``(..., Tk, D)`` -> weights ``(..., Hq, Tq, Tk)`` for rank-4 input,
        ``(..., Tq, Tk)`` for rank 2 and 3.

    Example:
        >>> q = torch.randn(1, 2, 3, 4)                 # (B, H, T, D)
        >>> weights = attention_weights(q, q, causal=True)
        >>> weights.shape, bool(torch.allclose(weights.sum(-1), torch.ones(1, 2, 3)))
        (torch.Size([1, 2, 3, 3]), True)
        >>> from attnlab.scores import softcap
        >>> capped = attention_weights(q * 100, q, causal=True, score_mod=softcap(1.0))
        >>> bool(capped[0, 0, 2].max() < 0.79)  # scores in (-1, 1): at most e / (e + 2/e) of 3 keys
        True
    """
    # v only fixes the shapes for validation; it is never read.
    v = k.new_zeros(()).expand(k.shape) if isinstance(k, Tensor) else k
    q, k, v = sdpa_aligned(q, k, v)
    call = build_call(q, k, v, mask=mask, causal=causal, align=align, scale=scale,
                      score_mod=score_mod, sinks=sinks)
    return _restore_rank(weights_of(call), call)


def _restore_rank(t: Tensor, call: AttentionCall) -> Tensor:
    """A 4-D result ``(B, H, T, X)`` in the layout of the user's inputs (rank 2 to 5)."""
    if call.input_rank == 2:
        return t[0, 0]  # (T, D)
    if call.input_rank == 3:
        return t[:, 0]  # (B, T, D)
    if call.input_rank == 5:
        return t.unflatten(0, call.batch_shape)  # (A, B, H, T, D)
    return t
