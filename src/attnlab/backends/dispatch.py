"""Dispatch: which backend runs a call.

``backend="auto"`` picks, among the backends that serve a call, the one with the best memory
class for *this call* (never an O(T^2) path when an O(T) one serves) and, within that class,
the lowest estimated time (:meth:`Backend.cost`). A named backend runs if it can serve the call
and raises ``ValueError`` with its reasons otherwise.

Example:
    >>> import torch
    >>> from attnlab._call import build_call
    >>> q = torch.randn(1, 2, 5, 8)
    >>> select(build_call(q, q, q), "reference").name
    'reference'
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab._call import AttentionCall
from attnlab._checks import one_of
from attnlab.backends.base import MEMORY_CLASSES, Backend
from attnlab.backends.registry import generation, get, registry
from attnlab.scores import ScoreMod, as_score_mod

__all__ = ["check_backend_name", "reasons", "reasons_of", "memory_class", "select", "clear_plans",
           "PLAN_CACHE_SIZE", "Route", "argument_key", "remembered", "route"]

# The one cache on the hot path: per argument signature (shapes, dtypes, devices, the mask's
# kind and shape, options, grad mode, registry generation; never a tensor value), the backend
# auto or a name chose and, where the backend offers one, its prepared run or the prepared mask
# it plans from (with the plans kept on it). Bounded.
# Thread-safety rule: a read is one dict lookup (atomic in CPython); every write holds _LOCK;
# two threads missing one signature at once both compute the (identical) route and the later
# one stores it. Full, it drops its oldest entry (insertion order).
PLAN_CACHE_SIZE = 512
_ROUTES: dict = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Route:
    """What dispatch remembers for one argument signature.

    Attributes:
        backend: the backend that serves it.
        run: ``backend.prepare(call)``: the kernel call with every decision bound, or None.
        mod: the mask mod it was chosen for when the key holds the mod's ``id`` (kept alive, so
            the id is not reused); None when the key holds the mask by value.
        mask: for a backend that plans from masks (``Backend.plans_masks``), the call's mask
            and ``causal`` as one :class:`~attnlab.masks.PreparedMask` that later calls pass
            instead (with ``causal=False``), so its plans are made once; else None.

    Example:
        >>> Route(backend=get("reference"), run=None, mod=None).backend.name
        'reference'
    """

    backend: Backend
    run: Callable | None
    mod: object
    mask: _masks.PreparedMask | None = None


def check_backend_name(name: object) -> str:
    """``name`` if it is ``"auto"`` or a registered backend; ``ValueError`` listing them otherwise.

    Example:
        >>> check_backend_name("auto")
        'auto'
    """
    return one_of("backend", name, ("auto", *registry()))


def reasons_of(backend: Backend, call: AttentionCall) -> list[str]:
    """Why ``backend`` cannot serve ``call`` (empty list: it can).

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> reasons_of(get("reference"), build_call(q, q, q))
        []
    """
    unavailable = backend.unavailable_reason()
    return [unavailable] if unavailable else backend.not_supported_reasons(call)


def reasons(call: AttentionCall) -> dict[str, list[str]]:
    """For every registered backend, why it cannot serve ``call`` (empty list: it can).

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> reasons(build_call(q, q, q))["reference"]
        []
    """
    return {name: reasons_of(backend, call) for name, backend in registry().items()}


def memory_class(backend: Backend, call: AttentionCall) -> str:
    """``"linear"`` or ``"quadratic"``: the extra memory ``backend`` needs for ``call``.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> memory_class(get("reference"), build_call(q, q, q))
        'quadratic'
    """
    return backend.memory_for(call)


def select(call: AttentionCall, name: str = "auto") -> Backend:
    """The backend that will run ``call``: a named one if it serves, else auto's choice.

    Auto takes the backends that serve the call in the best memory class (never an O(T^2)
    path when an O(T) one serves); among them one whose :meth:`Backend.preferred` rule claims
    the call, else the lowest estimated time (:meth:`Backend.cost`).

    Args:
        call: a validated call from :func:`attnlab._call.build_call`.
        name: ``"auto"`` or a backend name.

    Raises:
        ValueError: the named backend cannot serve the call (the message lists why), or the
            name is unknown.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 6, 4)
        >>> select(build_call(q, q, q), "auto").name
        'sdpa'
    """
    if check_backend_name(name) != "auto":
        backend = get(name)
        why_not = reasons_of(backend, call)  # only the named backend's, not every one's
        if why_not:
            raise ValueError(f"backend {name!r} cannot serve this call: " + "; ".join(why_not))
        return backend
    serving = [registry()[n] for n, why_not in reasons(call).items() if not why_not]
    if not serving:  # the reference serves every valid call; this is a programming error
        raise RuntimeError("no attention backend can serve this call")
    # Plain loops, not min(key=...): torch.compile traces them (it refuses min with a key).
    classes = [MEMORY_CLASSES.index(memory_class(b, call)) for b in serving]
    candidates = [b for b, c in zip(serving, classes) if c == min(classes)]
    for backend in candidates:
        if backend.preferred(call):
            return backend
    if torch.compiler.is_compiling():
        # Sizes may be symbolic (torch.export's dynamic dims): comparing costs would guard on
        # them. The reference is the slowest of any class, so the first other candidate wins.
        fused = [b for b in candidates if b.name != "reference"]
        return fused[0] if fused else candidates[0]
    chosen, chosen_cost = candidates[0], candidates[0].cost(call)
    for backend in candidates[1:]:
        cost = backend.cost(call)
        if cost < chosen_cost:
            chosen, chosen_cost = backend, cost
    return chosen


def argument_key(q: object, k: object, v: object, *, mask: object, causal: object, align: object,
                 scale: object, dropout_p: object, generator: object, backend: object,
                 return_weights: object, score_mod: object = None, sinks: object = None) -> tuple | None:
    """The signature of :func:`attnlab.attention`'s arguments under which a route is remembered.

    Everything validation and dispatch read, and nothing else: shapes, dtypes, devices and
    ``requires_grad`` of q, k, v, a tensor mask and the sinks, a mask mod (by value when it
    holds no tensor -- causal, windows, prefixes, chunks: :func:`attnlab.masks.value_only_key`,
    so a new ``sliding_window_mod(T, T, 256)`` per step finds its route -- else by its ``id``),
    a score mod's :meth:`~attnlab.scores.ScoreMod.signature` (its kind, settings and tensors'
    shapes; a user's function by identity), the options, grad mode and the registry's
    generation. None (nothing remembered) for arguments of unusual
    types (tensor subclasses, ``causal=1``: validation must see them each time) and for a
    dropout generator (its device is part of what is checked).

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 1, 8)
        >>> options = dict(mask=None, causal=False, align="top_left", scale=None, dropout_p=0.0,
        ...                generator=None, backend="auto", return_weights=False)
        >>> argument_key(q, q, q, **options) == argument_key(torch.randn(1, 2, 1, 8), q, q, **options)
        True
        >>> argument_key(q, q, q, **{**options, "causal": 1}) is None
        True
    """
    if torch.compiler.is_compiling():  # the compiled graph keeps its own choice (remembered)
        return None
    if (type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or generator is not None
            or (causal is not True and causal is not False) or type(align) is not str
            or (scale is not None and type(scale) is not float) or type(backend) is not str
            or type(dropout_p) not in (float, int) or (return_weights is not True and return_weights is not False)):
        return None
    if mask is None:
        mask_key = None
    elif type(mask) is Tensor:
        mask_key = (mask.shape, mask.dtype, mask.device, mask.requires_grad)
    elif callable(mask):
        mask_key = _masks.value_only_key(mask) or id(mask)
    else:
        return None
    # One flat tuple: this runs on every call, and each nested call or tuple costs a decoding step.
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
           q.requires_grad, k.requires_grad, v.requires_grad, mask_key, causal, align, scale,
           dropout_p, backend, return_weights, torch.is_grad_enabled(), generation())
    if score_mod is None and sinks is None:
        return key
    return _with_scores(key, score_mod, sinks)


def _with_scores(key: tuple, score_mod: object, sinks: object) -> tuple | None:
    """``key`` extended by the score mod's signature and the sinks' shape (None: not keyable)."""
    if sinks is not None and type(sinks) is not Tensor:
        return None
    sinks_key = None if sinks is None else (sinks.shape, sinks.dtype, sinks.device, sinks.requires_grad)
    if score_mod is None:
        mod_key = None
    elif isinstance(score_mod, ScoreMod):
        mod_key = score_mod.signature()
    elif callable(score_mod):
        mod_key = as_score_mod(score_mod).signature()  # the function by identity, kept alive
    else:
        return None
    return (*key, mod_key, sinks_key)


def remembered(key: tuple | None, mask: object) -> Route | None:
    """The route stored under ``key`` for this ``mask`` (a mod must be the very object), or None.

    Example:
        >>> remembered(None, None) is None
        True
    """
    if key is None or torch.compiler.is_compiling():  # the compiled graph keeps its own choice
        return None
    route = _ROUTES.get(key)
    if route is None or (route.mod is not None and route.mod is not mask):
        return None
    return route


def route(key: tuple | None, known: Route | None, call: AttentionCall, name: str, *, direct: bool) -> Route:
    """The route for ``call``: ``known`` (what :func:`remembered` found under ``key``) if still
    valid, else a fresh :func:`select`, remembered (with ``backend.prepare(call)`` when
    ``direct``: the user's tensors are the call's, 4-D and unbroadcast, so a run can take them
    as given).

    A backend whose limits depend on its own state (``Backend.stateful_limits``: flex's budget
    of compiled variants) is asked again on every call.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 6, 4)
        >>> route(None, None, build_call(q, q, q), "auto", direct=True).backend.name
        'sdpa'
    """
    if known is not None and not (known.backend.stateful_limits and reasons_of(known.backend, call)):
        return known
    backend = select(call, name)
    mod = call.mask if call.mask_kind == "mod" else None
    if torch.compiler.is_compiling():  # traced into the graph: nothing to remember or prepare
        return Route(backend, None, mod)
    by_value = mod is not None and _masks.value_only_key(mod) is not None
    plain = mod is None and call.score_mod is None  # a run takes (q, k, v, mask[, sinks])
    fresh = Route(backend, backend.prepare(call) if direct and plain else None,
                  None if by_value else mod, _prepared_mask(backend, call, by_value))
    if key is not None:
        with _LOCK:
            _ROUTES[key] = fresh
            while len(_ROUTES) > PLAN_CACHE_SIZE:
                del _ROUTES[next(iter(_ROUTES))]
    return fresh


def _prepared_mask(backend: Backend, call: AttentionCall, by_value: bool) -> _masks.PreparedMask | None:
    """The call's mask and ``causal`` prepared once for a backend that plans from masks, when
    they hold no tensor (a mod keyed by value, or ``causal`` alone); else None."""
    if not backend.plans_masks or call.batch == 0:
        return None
    if not (by_value or (call.mask_kind == "none" and call.causal)):
        return None
    mod = call.mask_mod()  # an OR has no interval form: planned per call
    return _masks.prepare(mod, tq=call.tq, tk=call.tk, device=call.device) if _masks.has_row_ranges(mod) else None


def clear_plans() -> None:
    """Forget every remembered route and whatever the backends remember
    (:meth:`Backend.reset`): one reset for all of attnlab's state.

    Example:
        >>> clear_plans()
    """
    with _LOCK:
        _ROUTES.clear()
    for backend in registry().values():
        backend.reset()
