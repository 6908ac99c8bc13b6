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
from collections import OrderedDict

import torch
from torch import Tensor

from attnlab._call import AttentionCall
from attnlab._checks import one_of
from attnlab.backends.base import MEMORY_CLASSES, Backend
from attnlab.backends.registry import generation, get, registry

__all__ = ["check_backend_name", "reasons", "reasons_of", "memory_class", "select", "clear_plans",
           "PLAN_CACHE_SIZE"]

# The one cache on the hot path: auto's choice per call signature (shapes, dtypes, device,
# mask kind, options, grad mode, registry generation; never tensor values), LRU-bounded.
# Thread-safety rule: every read-modify-write of it holds _LOCK; two threads missing the same
# signature at once both compute the (identical) choice and the later one stores it.
PLAN_CACHE_SIZE = 512
_PLANS: OrderedDict = OrderedDict()
_LOCK = threading.Lock()


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
    """The backend that will run ``call``.

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
        >>> select(build_call(q, q, q), "auto").name in registry()
        True
    """
    if name == "auto":
        return _cached_auto(call)
    return _select(call, name)


def _select(call: AttentionCall, name: str) -> Backend:
    """:func:`select` without the plan cache."""
    if check_backend_name(name) != "auto":
        backend = get(name)
        why_not = reasons_of(backend, call)  # only the named backend's, not every one's
        if why_not:
            raise ValueError(f"backend {name!r} cannot serve this call: " + "; ".join(why_not))
        return backend
    serving = [registry()[n] for n, why_not in reasons(call).items() if not why_not]
    if not serving:  # the reference serves every valid call; this is a programming error
        raise RuntimeError("no attention backend can serve this call")
    best = min(MEMORY_CLASSES.index(memory_class(b, call)) for b in serving)
    candidates = [b for b in serving if MEMORY_CLASSES.index(memory_class(b, call)) == best]
    preferred = [b for b in candidates if b.preferred(call)]
    return preferred[0] if preferred else min(candidates, key=lambda b: b.cost(call))


def _signature(call: AttentionCall) -> tuple:
    """Everything of ``call`` that a backend's capabilities, limits or cost may depend on,
    except a mask mod's identity (kept in the cache entry, so that a recycled ``id`` cannot
    match another mod). Shapes, dtypes, devices and options only: no tensor value."""
    mask = call.mask
    if isinstance(mask, Tensor):
        mask_sig = ("tensor", tuple(mask.shape), mask.dtype, mask.requires_grad)
    else:
        mask_sig = ("mod" if mask is not None else "none", id(mask))
    return (generation(), tuple(call.q.shape), tuple(call.k.shape), tuple(call.v.shape), call.dtype,
            call.device, mask_sig, call.causal, call.align, call.scale, call.dropout_p > 0.0,
            None if call.generator is None else call.generator.device.type, call.return_weights,
            call.requires_grad, torch.is_grad_enabled())


def _cached_auto(call: AttentionCall) -> Backend:
    """``select(call, "auto")`` remembered per call signature (LRU of :data:`PLAN_CACHE_SIZE`).

    The choice follows from the signature alone, so a hit is returned as it is, except for a
    backend whose limits depend on its own state (``Backend.stateful_limits``: flex's budget
    of compiled variants), which is asked again. Under ``torch.compile`` the choice is made
    afresh and not stored: the compiled graph keeps it, and the cache stays out of the trace.
    """
    if torch.compiler.is_compiling():
        return _select(call, "auto")
    key = _signature(call)
    mod = call.mask if call.mask_kind == "mod" else None
    with _LOCK:
        entry = _PLANS.get(key)
        if entry is not None:
            _PLANS.move_to_end(key)
    if entry is not None and entry[1] is mod and not (entry[0].stateful_limits and reasons_of(entry[0], call)):
        return entry[0]
    backend = _select(call, "auto")
    with _LOCK:
        _PLANS[key] = (backend, mod)
        if len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return backend


def clear_plans() -> None:
    """Forget every remembered dispatch decision and whatever the backends remember
    (:meth:`Backend.reset`): one reset for all of attnlab's state.

    Example:
        >>> clear_plans()
    """
    with _LOCK:
        _PLANS.clear()
    for backend in registry().values():
        backend.reset()
