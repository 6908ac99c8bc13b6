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

from collections import OrderedDict

import torch
from torch import Tensor

from attnlab._call import AttentionCall
from attnlab._checks import one_of
from attnlab.backends.base import MEMORY_CLASSES, Backend
from attnlab.backends.registry import generation, get, registry

__all__ = ["check_backend_name", "reasons", "reasons_of", "memory_class", "select", "clear_plans",
           "PLAN_CACHE_SIZE", "run_key", "prepared_run", "remember_run"]

# Decoding calls the same signature thousands of times; asking every backend each time (flex's
# NaN scan alone reads all of k and v) costs more than a short attention call itself.
PLAN_CACHE_SIZE = 512
_PLANS: OrderedDict = OrderedDict()
# Prepared runs (Backend.prepare) by run_key: a hit skips validation and dispatch altogether.
_RUNS: dict = {}
# Signatures seen once, not yet prepared. A run is kept from the second sighting on: a decoding
# loop whose Tk grows meets most signatures once per layer, and thousands of long-lived entries
# would cost more in Python's garbage collection (full passes over every object) than they save.
_SEEN: set = set()
_SEEN_SIZE = 64


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
    return min(serving, key=lambda b: (MEMORY_CLASSES.index(memory_class(b, call)), b.cost(call)))


def _signature(call: AttentionCall) -> tuple:
    """Everything of ``call`` that a backend's capabilities, limits or cost may depend on,
    except the tensors' values (see :func:`_cached_auto`) and a mask mod's identity (kept in
    the cache entry, so that a recycled ``id`` cannot match another mod)."""
    mask = call.mask
    if isinstance(mask, Tensor):
        mask_sig = ("tensor", tuple(mask.shape), mask.dtype, mask.requires_grad)
    else:
        mask_sig = ("mod" if mask is not None else "none", id(mask))
    backends = tuple((n, id(b)) for n, b in registry().items())  # (un)registering invalidates
    return (backends, tuple(call.q.shape), tuple(call.k.shape), tuple(call.v.shape), call.dtype,
            call.device, mask_sig, call.causal, call.align, call.scale, call.dropout_p > 0.0,
            None if call.generator is None else call.generator.device.type, call.return_weights,
            call.requires_grad, torch.is_grad_enabled())


def _cached_auto(call: AttentionCall) -> Backend:
    """``select(call, "auto")`` remembered per call signature (LRU of :data:`PLAN_CACHE_SIZE`).

    A hit re-asks only the remembered backend whether it serves this call, so a limit that
    depends on the values (NaN/inf inputs) or on state (flex's compiled variants) still
    declines; then the full dispatch runs again. Every backend is exact, so a remembered choice
    can only differ from a fresh one in speed, never in the contract.
    """
    key = _signature(call)
    mod = call.mask if call.mask_kind == "mod" else None
    entry = _PLANS.get(key)
    if entry is not None and entry[1] is mod and not reasons_of(entry[0], call):
        _PLANS.move_to_end(key)
        return entry[0]
    backend = _select(call, "auto")
    _PLANS[key] = (backend, mod)
    if len(_PLANS) > PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return backend


def run_key(q: object, k: object, v: object, *, mask: object, causal: object, align: object,
            scale: object, dropout_p: object, generator: object, backend: object,
            return_weights: object) -> tuple | None:
    """The signature under which a prepared run of :func:`attnlab.attention` is remembered.

    None when the arguments cannot take a shortcut: a mask (its contents could change between
    calls), dropout, a generator, weights, inputs that are not plain tensors, or options of a
    type other than the one validation accepts (``causal=1`` must still raise its TypeError).
    Everything validation and dispatch read is in the key, values aside: shapes, dtypes,
    devices, the options, whether gradients will be recorded, and the registry's generation.

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 1, 8)
        >>> options = dict(mask=None, causal=False, align="top_left", scale=None, dropout_p=0.0,
        ...                generator=None, backend="auto", return_weights=False)
        >>> run_key(q, q, q, **options) == run_key(torch.randn(1, 2, 1, 8), q, q, **options)
        True
        >>> run_key(q, q, q, **{**options, "causal": 1}) is None
        True
    """
    if (mask is not None or generator is not None or return_weights is not False
            or type(dropout_p) not in (float, int) or dropout_p != 0
            or type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor
            or (causal is not True and causal is not False) or type(align) is not str
            or (scale is not None and type(scale) is not float) or type(backend) is not str):
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            causal, align, scale, backend, grad, generation())


def prepared_run(key: tuple | None):
    """The run remembered under ``key`` by :func:`remember_run`, or None.

    Example:
        >>> prepared_run(None) is None
        True
    """
    return None if key is None else _RUNS.get(key)


def remember_run(key: tuple | None, backend: Backend, call: AttentionCall) -> None:
    """Remember ``backend.prepare(call)`` under ``key`` (nothing when either is None).

    ``call`` must be the validated call of the arguments ``key`` came from, and ``backend``
    the one :func:`select` chose for it. A signature is prepared the second time it is seen
    (among the last few dozen new ones), so that one-off signatures leave nothing behind.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 1, 8)
        >>> key = run_key(q, q, q, mask=None, causal=False, align="top_left", scale=None,
        ...               dropout_p=0.0, generator=None, backend="sdpa", return_weights=False)
        >>> remember_run(key, get("sdpa"), build_call(q, q, q))  # seen once: not yet
        >>> prepared_run(key) is None
        True
        >>> remember_run(key, get("sdpa"), build_call(q, q, q))
        >>> prepared_run(key) is not None
        True
    """
    if key is None:
        return
    if key not in _SEEN:
        if len(_SEEN) >= _SEEN_SIZE:
            _SEEN.clear()
        _SEEN.add(key)
        return
    _SEEN.discard(key)  # discard, not remove: another thread may have taken it already
    run = backend.prepare(call)
    if run is None:
        return
    if len(_RUNS) >= PLAN_CACHE_SIZE:
        _RUNS.clear()  # signatures rarely churn; starting afresh is simpler than an LRU here
    _RUNS[key] = run


def clear_plans() -> None:
    """Forget every remembered dispatch decision and prepared run.

    Example:
        >>> clear_plans()
    """
    _PLANS.clear()
    _RUNS.clear()
    _SEEN.clear()
