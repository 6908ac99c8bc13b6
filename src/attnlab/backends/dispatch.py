"""Dispatch: which backend runs a call, from what the backends declare; it names none::

    backend="auto"                                     backend="sdpa" (a name)
         |                                                  |
    the claimers (claim_order set), lowest first:      that backend's reasons only:
         | it claims the call (Backend.claims), it         none -> it runs
         | serves it (no reasons) within the budget?       some -> ValueError listing them
    yes -> it runs (no other backend is asked)
    no  -> every backend's reasons; among those that serve, the ones whose extra memory fits
           the memory budget (:func:`memory_budget`; none fits: the O(T) ones);
           a claim there, else the lowest estimated cost

Routes are remembered per argument signature (:func:`argument_key`), holding no user object.

Example:
    >>> import torch
    >>> from attnlab._call import build_call
    >>> q = torch.randn(1, 2, 5, 8)
    >>> select(build_call(q, q, q), "reference").name
    'reference'
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab._call import AttentionCall
from attnlab._checks import one_of
from attnlab._checks import non_negative_int
from attnlab.backends.base import MEMORY_CLASSES, Backend, io_bytes, mask_is_fixed
from attnlab.backends.registry import _GENERATION, claimers, get, registry  # (the counter read in place: every call)
from attnlab.scores import _Identity, ScoreMod, as_score_mod

__all__ = ["check_backend_name", "reasons", "reasons_of", "memory_class", "select", "clear_plans",
           "claimed", "claim_words", "within_budget", "PLAN_CACHE_SIZE", "Route", "argument_key", "remembered", "route",
           "fresh_route", "prepared_run", "prepared_mask", "memory_budget", "default_memory_budget", "set_memory_budget",
           "budget_words", "key_of", "lookup"]


def claim_words(backend: Backend, call: AttentionCall) -> str:
    """Why ``backend`` claims ``call`` (:meth:`Backend.claims`), in words (for :func:`why`);
    ``""`` when it does not.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 6, 4)
        >>> claim_words(get("sdpa"), build_call(q, q, q, causal=True))
        "the mask reaches it as the caller holds it: nothing to skip, PyTorch's own kernel"
    """
    return (backend.claims(call) or "") if backend.claim_order is not None else ""


# The one cache on the hot path: per argument signature (shapes, dtypes, devices, the mask's
# kind and shape, a mask mod by value, options, grad mode, registry generation; never a tensor
# value nor a user's object), the route chosen. Bounded; cleared by clear_plans().
# Thread-safety rule: a read is one dict lookup (atomic in CPython); every write holds _LOCK;
# two threads missing one signature at once both compute the (identical) route and the later
# one stores it. Full, it drops its oldest entry (insertion order).
PLAN_CACHE_SIZE = 512
_ROUTES: dict = {}
lookup = _ROUTES.get  # remembered() without a Python frame: attnlab.attention reads it on every call
_LOCK = threading.Lock()

# The memory budget set by set_memory_budget (one int of bytes), or None for the default.
_BUDGET: list = [None]
_MIB = 1 << 20


@dataclass(frozen=True)
class Route:
    """What dispatch remembers for one argument signature (no user tensor or object).

    Attributes:
        backend: the backend that serves it.
        run: the backend's prepared run (:meth:`Backend.prepare`) with every decision bound,
            or None (the user's tensors were not the call's, or the mask holds the caller's
            tensors): then each call is built and planned.
        mask: for a backend that plans from masks (``Backend.plans_masks``), the call's mask
            mod (one keyed by value, causal folded in) or causal alone as one
            :class:`~attnlab.masks.PreparedMask`, kept by the run (a call without a run passes
            it instead, with ``causal=False``), so its plans are made once.
        keeps_mask: whether the run keeps the call's mask and ignores the one it is handed
            (a mask mod keyed by value or causal prepared): a plan holding another mask must
            not use it.
        tk: the key length the run was planned for, where its backend's plan depends on it
            (``Backend.plan_fixes_tk``); None where any length of the key's class is served.

    Example:
        >>> Route(backend=get("reference"), run=None).backend.name
        'reference'
    """

    backend: Backend
    run: Callable | None
    mask: _masks.PreparedMask | None = None
    keeps_mask: bool = False
    tk: int | None = None


def _device_memory(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes (the machine's RAM for CPU), or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX system
            return None
    return None


def default_memory_budget(call: AttentionCall) -> int:
    """The budget auto uses unless one is set: 4x the call's own tensors (q, k, v and the
    output), at least 64 MiB, at most 1/8 of the device's memory.

    So a mask or score matrix comparable to what the caller already holds may be built where it
    is faster, and never one that could exhaust the machine.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 8, 4)
        >>> default_memory_budget(build_call(q, q, q)) >= 64 * 2**20
        True
    """
    budget = max(64 * _MIB, 4 * io_bytes(call))
    total = _device_memory(call.device)
    return budget if total is None else min(budget, max(total // 8, 64 * _MIB))


def memory_budget(call: AttentionCall) -> int:
    """Bytes auto may spend on ``call`` beyond its tensors: the budget set by
    :func:`set_memory_budget`, else :func:`default_memory_budget`.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 8, 4)
        >>> previous = set_memory_budget(0)
        >>> memory_budget(build_call(q, q, q))
        0
        >>> _ = set_memory_budget(previous)
    """
    return _BUDGET[0] if _BUDGET[0] is not None else default_memory_budget(call)


def set_memory_budget(nbytes: int | None) -> int | None:
    """Set the bytes ``backend="auto"`` may spend on one call beyond its tensors (a dense mask,
    a score matrix); None restores the default (:func:`default_memory_budget`). 0 keeps every
    call on an O(T) path where one serves. Returns the previous setting, to restore it.

    Within the budget the estimated time decides; over it, a path is taken only when nothing
    else serves. Named backends ignore it. Process-wide: every path (modules, caches, context
    parallelism, transformers) dispatches through here.

    Raises:
        TypeError: ``nbytes`` is not an int or None.
        ValueError: ``nbytes`` is negative.

    Example:
        >>> previous = set_memory_budget(256 * 2**20)
        >>> set_memory_budget(previous)
        268435456
    """
    if nbytes is not None:
        non_negative_int("nbytes", nbytes)
    with _LOCK:
        previous = _BUDGET[0]
        _BUDGET[0] = nbytes
        _ROUTES.clear()  # routes chosen under the old budget
    return previous


def budget_words(call: AttentionCall) -> str:
    """The call's memory budget in words, as :func:`attnlab.backends.why` shows it.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 8, 4)
        >>> budget_words(build_call(q, q, q)).startswith("memory budget 64.0 MiB")
        True
    """
    how = ("set by attnlab.backends.set_memory_budget" if _BUDGET[0] is not None else
           "default: 4x the call's tensors, at least 64 MiB, at most 1/8 of the device's memory")
    return f"memory budget {memory_budget(call) / _MIB:.1f} MiB ({how})"


def check_backend_name(name: object) -> str:
    """``name`` if it is ``"auto"`` or a registered backend; ``ValueError`` listing them otherwise.

    Example:
        >>> check_backend_name("auto")
        'auto'
    """
    return one_of("backend", name, ("auto", *registry()))


def reasons_of(backend: Backend, call: AttentionCall, *, named: bool = False) -> list[str]:
    """Why ``backend`` cannot serve ``call`` (empty list: it can): for ``backend="auto"``
    (the default) what it cannot compute exactly and what auto passes it over for
    (:meth:`Backend.passed_over`), for a caller who ``named`` it the first only.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> reasons_of(get("reference"), build_call(q, q, q))
        []
        >>> reasons_of(get("blocks"), build_call(q, q, q)), reasons_of(get("blocks"), build_call(q, q, q), named=True)
        (['blocks has nothing to skip without a mask mod or causal (sdpa runs it densely)'], [])
    """
    unavailable = backend.unavailable_reason()
    if unavailable:
        return [unavailable]
    found = backend.not_supported_reasons(call)
    if named or found or not backend.passes_over:  # only a backend that declares it is asked
        return found
    return backend.passed_over(call)


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
    return backend.memory_use(call).kind


def select(call: AttentionCall, name: str = "auto") -> Backend:
    """The backend that will run ``call``: a named one if it serves, else auto's choice.

    Auto asks the backends that declare a ``claim_order`` (:func:`~attnlab.backends.registry.claimers`),
    lowest first: the first that claims the call (:meth:`Backend.claims`) and serves it within
    the memory budget (:func:`memory_budget`) wins, and no other backend is asked. Otherwise
    every backend's reasons are read: among those serving the call whose extra memory
    (:meth:`Backend.memory_use`) fits the budget (none fits: those of the best memory class),
    a claimed one, else the lowest estimated time (:meth:`Backend.cost`).

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
    if name != "auto":
        backend = get(check_backend_name(name))
        why_not = reasons_of(backend, call, named=True)  # only the named backend's, not every one's
        if why_not:
            raise ValueError(f"backend {name!r} cannot serve this call: " + "; ".join(why_not))
        return backend
    compiling = torch.compiler.is_compiling()  # sizes may be symbolic: memory by class, not bytes
    budget = None if compiling else memory_budget(call)
    for backend in claimers():
        if backend.claims(call) is not None and not reasons_of(backend, call):
            use = backend.memory_use(call)
            if use.kind == MEMORY_CLASSES[0] if compiling else use.nbytes <= budget:
                return backend
    return _by_memory_and_cost(call, budget)


def within_budget(serving: list[Backend], call: AttentionCall, budget: int | None) -> list[Backend]:
    """The backends of ``serving`` whose extra memory fits ``budget``; where none fits, or with
    ``budget`` None (compiling: sizes may be symbolic), those of the best memory class.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 6, 4)
        >>> [b.name for b in within_budget([get("reference"), get("chunked")], build_call(q, q, q), 0)]
        ['chunked']
    """
    fits = [] if budget is None else [b for b in serving if b.memory_use(call).nbytes <= budget]
    if fits:
        return fits
    # Plain loops, not min(key=...): torch.compile traces them (it refuses min with a key).
    classes = [MEMORY_CLASSES.index(memory_class(b, call)) for b in serving]
    return [b for b, c in zip(serving, classes) if c == min(classes)]


def _by_memory_and_cost(call: AttentionCall, budget: int | None) -> Backend:
    """Auto's choice when no preferred backend claims ``call`` within the budget."""
    serving = [registry()[n] for n, why_not in reasons(call).items() if not why_not]
    if not serving:  # the reference serves every valid call; this is a programming error
        raise RuntimeError("no attention backend can serve this call")
    candidates = within_budget(serving, call, budget)
    for backend in candidates:
        if claimed(backend, call):
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


def claimed(backend: Backend, call: AttentionCall) -> bool:
    """Whether ``backend`` declares a ``claim_order`` and claims ``call`` (:meth:`Backend.claims`).

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 6, 4)
        >>> claimed(get("sdpa"), build_call(q, q, q, causal=True)), claimed(get("chunked"), build_call(q, q, q))
        (True, False)
    """
    return backend.claim_order is not None and backend.claims(call) is not None


def argument_key(q: object, k: object, v: object, *, mask: object, causal: object, align: object,
                 scale: object, dropout_p: object, generator: object, backend: object,
                 return_weights: object, score_mod: object = None, sinks: object = None) -> tuple | None:
    """The signature of :func:`attnlab.attention`'s arguments under which a route is remembered.

    Everything validation and dispatch read, and nothing else: shapes, dtypes, devices and
    ``requires_grad`` of q, k, v, a tensor mask and the sinks, a mask mod by value
    (:func:`attnlab.masks.value_only_key`: causal, windows, prefixes, chunks, so a new
    ``sliding_window_mod(T, T, 256)`` per step finds its route), a score mod's
    :meth:`~attnlab.scores.ScoreMod.signature` (a user's function through a weak reference),
    the options, grad mode and the registry's generation. A key never holds a user's tensor or
    keeps a user's object alive: any other mask mod (one that holds tensors, a held
    ``PreparedMask``, a function) is keyed by weak identity, so a dead one matches nothing and a
    per-batch ``document_mod(ids)`` leaves only dead keys, dropped as the cache turns over.
    None (nothing remembered) for arguments of unusual types
    (tensor subclasses, ``causal=1``: validation must see them each time) and a dropout
    generator (its device is part of what is checked).

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
    return key_of(q, k, v, mask, causal, align, scale, dropout_p, generator, backend, return_weights,
                  score_mod, sinks, False)


def key_of(q: object, k: object, v: object, mask: object, causal: object, align: object, scale: object,
           dropout_p: object, generator: object, backend: object, return_weights: object,
           score_mod: object, sinks: object, as_given: bool) -> tuple | None:
    """:func:`argument_key` with positional arguments, as :func:`attnlab.attention` calls it on
    every call (each keyword matched costs a decoding step time). With ``as_given``, None also
    for tensors that :func:`attnlab._call.sdpa_aligned` would reshape (mixed ranks, one query
    head over several key heads): the caller aligns them and asks again, so a key made of the
    tensors as given holds for the tensors a run receives.

    Example:
        >>> import torch
        >>> q, k = torch.randn(2, 8), torch.randn(1, 2, 3, 8)
        >>> key_of(q, k, k, None, False, "top_left", None, 0.0, None, "auto", False, None, None, True) is None
        True
    """
    if torch.compiler.is_compiling():  # the compiled graph keeps its own choice
        return None
    if (type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or generator is not None
            or (causal is not True and causal is not False) or type(align) is not str
            or (scale is not None and type(scale) is not float) or type(backend) is not str
            or type(dropout_p) not in (float, int) or (return_weights is not True and return_weights is not False)):
        return None
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape  # (each read makes a Size: once)
    if as_given and not (len(q_shape) == len(k_shape) == len(v_shape)
                         and (len(q_shape) < 4 or q_shape[-3] != 1 or k_shape[-3] == 1)):
        return None  # sdpa_aligned would reshape them (its test, on the sizes read here)
    tensor_mask = type(mask) is Tensor
    if mask is None or tensor_mask:
        mask_key = None
    elif callable(mask):  # by value, else by weak identity (a held PreparedMask, a reused mod)
        mask_key = _masks.value_only_key(mask) or _Identity(mask)
    else:
        return None
    mask_shape = mask.shape if tensor_mask else None
    if (len(q_shape) == 4 and q_shape[2] == 1 and len(k_shape) == 4 and len(v_shape) == 4
            and (causal is False or align == "bottom_right") and (mask is None or (tensor_mask and len(mask_shape) == 4))):
        # A decoding step: one query over a cache that grows by one key a step. Its causal part
        # blocks nothing, so the key holds Tk's class (minus its bit length: no real size is
        # negative), not Tk: one route serves a range of lengths. What the exact shapes
        # guaranteed is checked here (k and v of one length, a mask of length 1 or Tk): a miss
        # (None) lets validation refuse it. Sizes by index, not slices (a slice of a Size costs more).
        tk = k_shape[2]
        if v_shape[2] != tk:
            return None
        length = -tk.bit_length()
        k_shape, v_shape = (k_shape[0], k_shape[1], length, k_shape[3]), (v_shape[0], v_shape[1], length, v_shape[3])
        if tensor_mask and mask_shape[3] != 1:
            if mask_shape[3] != tk:
                return None
            mask_shape = (mask_shape[0], mask_shape[1], mask_shape[2], length)
    if tensor_mask:
        mask_key = (mask_shape, mask.dtype, mask.device, mask.requires_grad)
    # One flat tuple: this runs on every call, and each nested call or tuple costs a decoding step.
    # Under no_grad no input's requires_grad changes the call (call.requires_grad is then False):
    # None stands for all three, unread (a decoding step, under no_grad, saves their reads).
    wants = (q.requires_grad, k.requires_grad, v.requires_grad) if torch.is_grad_enabled() else None
    key = (q_shape, k_shape, v_shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
           wants, mask_key, causal, align, scale, dropout_p, backend, return_weights, _GENERATION[0], _BUDGET[0])
    if score_mod is None and sinks is None:
        return key
    return _with_scores(key, score_mod, sinks)


def _with_scores(key: tuple, score_mod: object, sinks: object) -> tuple | None:
    """``key`` extended by the score mod's signature and the sinks' shape (None: not keyable)."""
    if sinks is not None and type(sinks) is not Tensor:
        return None
    sinks_key = None if sinks is None else (sinks.shape, sinks.dtype, sinks.device, sinks.requires_grad)
    mod_key = None
    if score_mod is not None:
        if not isinstance(score_mod, ScoreMod) and not callable(score_mod):
            return None
        mod = score_mod if isinstance(score_mod, ScoreMod) else as_score_mod(score_mod)
        if type(mod).signature is ScoreMod.signature and not mod.params():
            mod_key = (type(mod).__name__, mod.constants(), ())  # its signature, without a generator
        else:
            mod_key = mod.signature()  # a user's function by weak reference
    return (*key, mod_key, sinks_key)


def remembered(key: tuple | None) -> Route | None:
    """The route stored under ``key`` (from :func:`argument_key`), or None.

    Example:
        >>> remembered(None) is None
        True
    """
    # (argument_key gives None while compiling: the compiled graph keeps its own choice)
    return None if key is None else _ROUTES.get(key)


def route(key: tuple | None, call: AttentionCall, name: str, *, direct: bool) -> Route:
    """A fresh route for ``call``: :func:`select`'s backend and, when ``direct`` (the user's
    tensors are the call's, 4-D and unbroadcast, so a run can take them as given), its prepared
    run (:func:`prepared_run`); a backend that plans from masks gets the mask prepared once
    (:func:`prepared_mask`), which the run keeps. Remembered under ``key``.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 6, 4)
        >>> route(None, build_call(q, q, q), "auto", direct=True).backend.name
        'sdpa'
    """
    fresh = fresh_route(call, select(call, name), direct=direct)
    if key is not None and not torch.compiler.is_compiling():
        with _LOCK:
            _ROUTES[key] = fresh
            while len(_ROUTES) > PLAN_CACHE_SIZE:
                del _ROUTES[next(iter(_ROUTES))]
    return fresh


def fresh_route(call: AttentionCall, backend: Backend, *, direct: bool) -> Route:
    """``backend``'s route for ``call`` (see :func:`route`), remembered nowhere: what
    :class:`attnlab.AttentionPlan` holds.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 6, 4)
        >>> fresh_route(build_call(q, q, q, causal=True), get("chunked"), direct=True).run is not None
        True
    """
    if torch.compiler.is_compiling():  # traced into the graph: nothing to remember or prepare
        return Route(backend, None)
    planned = prepared_mask(backend, call)
    if planned is not None:  # the backend plans from it once; the run keeps it
        call = dataclasses.replace(call, mask=planned, causal_offset=None, _memo={})
    run = prepared_run(backend, call, mask_fixed=True if planned is not None else None) if direct else None
    keeps = planned is not None or mask_is_fixed(call)
    return Route(backend, run, planned, keeps_mask=keeps,
                 tk=call.tk if backend.plan_fixes_tk else None)


def prepared_run(backend: Backend, call: AttentionCall, *, mask_fixed: bool | None = None) -> Callable | None:
    """``backend``'s run for every call of ``call``'s signature (:meth:`Backend.prepare`), or
    None where the call's mask holds the caller's tensors (a padding or document mod, a
    caller's prepared mask: keyed by weak identity, planned per call) or a dropout generator.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> from attnlab import masks
        >>> q = torch.randn(1, 2, 6, 4)
        >>> prepared_run(get("reference"), build_call(q, q, q)) is not None
        True
        >>> prepared_run(get("reference"), build_call(q, q, q, mask=masks.padding_mod(torch.tensor([3])))) is None
        True
    """
    if mask_fixed is None:
        mask_fixed = mask_is_fixed(call)
    if (call.mask_kind in ("mod", "prepared") and not mask_fixed) or call.generator is not None:
        return None  # (a run keeps no generator: the caller's, read per call)
    return backend.prepare(call, mask_fixed=mask_fixed)


def prepared_mask(backend: Backend, call: AttentionCall) -> _masks.PreparedMask | None:
    """The call's mask and ``causal`` prepared once for a backend that plans from masks, when
    they hold no tensor (a mod keyed by value, or ``causal`` alone); else None.

    Example:
        >>> import torch
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 2, 6, 4)
        >>> prepared_mask(get("blocks"), build_call(q, q, q, causal=True)) is not None
        True
    """
    if not backend.plans_masks or call.batch == 0:
        return None
    if not (mask_is_fixed(call) or call.mask_kind == "causal"):  # a mod keyed by value, or causal alone
        return None
    mod = call.mask_mod()  # an OR has no interval form: planned per call
    return _masks.prepare(mod, tq=call.tq, tk=call.tk, device=call.device) if _masks.has_row_ranges(mod) else None


def clear_plans() -> None:
    """Forget every remembered route and whatever the backends remember (:meth:`Backend.reset`):
    the one reset of attnlab's state.

    Example:
        >>> clear_plans()
    """
    with _LOCK:
        _ROUTES.clear()
    for backend in registry().values():
        backend.reset()
