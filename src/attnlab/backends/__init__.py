"""Backends behind :func:`attnlab.attention` and the dispatch that chooses between them.

Every backend keeps one contract (DESIGN.md, "Semantics") or declines the call with reasons.
``backend="auto"`` picks, among the backends that serve a call, the one with the best memory
class for *this call* (never an O(T^2) path when an O(T) one serves) and, within that class,
the lowest estimated time. Each backend estimates its time in seconds with :meth:`Backend.cost`
(FLOPs at rates measured on the machine of BENCHMARKS.md plus per-call/per-tile overheads) and
may refine its memory class per call with ``memory_for(call)`` -- SDPA, for example, is O(T)
for causal calls but O(T^2) when a mask mod has to be materialised.

:func:`why` explains a decision in words: which backend runs and why each other one was passed
over (cannot serve, unavailable, O(T^2) where O(T) serves, or slower by its cost estimate).

Example:
    >>> import torch, attnlab.backends as backends
    >>> "reference" in backends.available()
    True
    >>> q = torch.randn(1, 2, 5, 8)
    >>> backends.select(backends.build_call(q, q, q), "auto").name in backends.available()
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch  # noqa: F401  (the doctest examples use it)

from attnlab._call import AttentionCall, build_call
from attnlab.backends.base import AttentionResult, Backend, register, registry

# Importing a backend module registers it. Order is the order `attnlab backends` lists them in.
from attnlab.backends import reference  # noqa: E402,F401  (registers "reference")
from attnlab.backends import sdpa  # noqa: E402,F401  (registers "sdpa")
from attnlab.backends import chunked  # noqa: E402,F401
from attnlab.backends import flex  # noqa: E402,F401  (registers "flex")

__all__ = [
    "AttentionResult",
    "Backend",
    "AttentionCall",
    "build_call",
    "register",
    "registry",
    "available",
    "get",
    "select",
    "reasons",
    "memory_class",
    "Verdict",
    "verdicts",
    "why",
]

_MEMORY_RANK = {"linear": 0, "quadratic": 1}
_MEMORY_WORDS = {"linear": "O(T)", "quadratic": "O(T^2)"}


def available() -> list[str]:
    """Names of the backends that can run in this installation.

    Example:
        >>> available()[0]
        'reference'
    """
    return [name for name, b in registry().items() if b.unavailable_reason() is None]


def get(name: str) -> Backend:
    """The registered backend called ``name``; ``ValueError`` listing the names otherwise.

    Example:
        >>> get("reference").memory
        'quadratic'
    """
    backends = registry()
    if name not in backends:
        raise ValueError(f"backend must be 'auto' or one of {sorted(backends)}, got {name!r}")
    return backends[name]


def reasons(call: AttentionCall) -> dict[str, list[str]]:
    """For every registered backend, why it cannot serve ``call`` (empty list: it can).

    Example:
        >>> q = torch.randn(1, 1, 3, 4)
        >>> reasons(build_call(q, q, q))["reference"]
        []
    """
    return {name: _reasons_of(backend, call) for name, backend in registry().items()}


def _reasons_of(backend: Backend, call: AttentionCall) -> list[str]:
    unavailable = backend.unavailable_reason()
    return [unavailable] if unavailable else backend.not_supported_reasons(call)


def memory_class(backend: Backend, call: AttentionCall) -> str:
    """``"linear"`` or ``"quadratic"``: the extra memory ``backend`` needs for ``call``.

    A backend may define ``memory_for(call)`` when its class depends on the call (a mask
    that must be materialised); otherwise its fixed ``memory`` attribute applies.

    Example:
        >>> q = torch.randn(1, 1, 3, 4)
        >>> memory_class(get("reference"), build_call(q, q, q))
        'quadratic'
    """
    per_call = getattr(backend, "memory_for", None)
    return per_call(call) if per_call is not None else backend.memory


def _memory_note(backend: Backend, call: AttentionCall) -> str:
    note = getattr(backend, "memory_note", None)
    return f" ({note(call)})" if note is not None else ""


def select(call: AttentionCall, name: str = "auto") -> Backend:
    """The backend that will run ``call``.

    Args:
        call: a validated call from :func:`build_call`.
        name: ``"auto"`` or a backend name.

    Raises:
        ValueError: the named backend cannot serve the call (the message lists why), or the
            name is unknown.

    Example:
        >>> q = torch.randn(1, 2, 6, 4)
        >>> select(build_call(q, q, q), "reference").name
        'reference'
    """
    if name != "auto":
        backend = get(name)
        why_not = _reasons_of(backend, call)  # only the named backend's, not every one's
        if why_not:
            raise ValueError(f"backend {name!r} cannot serve this call: " + "; ".join(why_not))
        return backend
    serving = [registry()[n] for n, why_not in reasons(call).items() if not why_not]
    if not serving:  # the reference serves every valid call; this is a programming error
        raise RuntimeError("no attention backend can serve this call")
    return min(serving, key=lambda b: (_MEMORY_RANK.get(memory_class(b, call), 1), b.cost(call)))


@dataclass(frozen=True)
class Verdict:
    """One backend's standing for one call, as :func:`why` reports it.

    Attributes:
        name: the backend.
        chosen: whether this backend runs the call.
        serves: whether it could serve the call at all.
        memory: ``"linear"``/``"quadratic"`` for this call (``""`` when it cannot serve).
        cost_s: estimated seconds (None when it cannot serve).
        reason: one line: why chosen, or why passed over.

    Example:
        >>> q = torch.randn(1, 2, 6, 4)
        >>> any(v.chosen for v in verdicts(build_call(q, q, q)))
        True
    """

    name: str
    chosen: bool
    serves: bool
    memory: str
    cost_s: float | None
    reason: str


def _format_seconds(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def verdicts(call: AttentionCall, name: str = "auto") -> list[Verdict]:
    """Every registered backend's :class:`Verdict` for ``call`` under ``backend=name``.

    Raises:
        ValueError: as :func:`select`, when a named backend cannot serve the call.

    Example:
        >>> q = torch.randn(1, 2, 6, 4)
        >>> [v.name for v in verdicts(build_call(q, q, q))][0]
        'reference'
    """
    chosen = select(call, name)
    chosen_memory, chosen_cost = memory_class(chosen, call), chosen.cost(call)
    result = []
    for backend_name, why_not in reasons(call).items():
        backend = registry()[backend_name]
        if why_not:
            result.append(Verdict(backend_name, False, False, "", None,
                                  "cannot serve: " + "; ".join(why_not)))
            continue
        memory, cost = memory_class(backend, call), backend.cost(call)
        note = _memory_note(backend, call)
        if backend is chosen:
            how = "named explicitly" if name != "auto" else "fastest of the best memory class"
            reason = f"chosen ({how}): {_MEMORY_WORDS[memory]} memory{note}, est. {_format_seconds(cost)}"
        elif name != "auto":
            reason = f"not asked for (backend={name!r})"
        elif _MEMORY_RANK[memory] > _MEMORY_RANK[chosen_memory]:
            reason = f"O(T^2) memory where an O(T) path serves{note}"
        else:
            reason = f"slower: cost {_format_seconds(cost)} vs {_format_seconds(chosen_cost)}"
        result.append(Verdict(backend_name, backend is chosen, True, memory, cost, reason))
    return result


def why(q, k, v, *, backend: str = "auto", echo: bool = False, **options) -> str:
    """Explain which backend :func:`attnlab.attention` would run for these arguments, and why.

    Args:
        q, k, v: the tensors you would pass to :func:`attnlab.attention`.
        backend: ``"auto"`` or a backend name, as in :func:`attnlab.attention`.
        echo: also print the explanation.
        **options: any keyword option of :func:`attnlab.attention` (mask, causal, align,
            scale, dropout_p, generator, return_weights).

    Returns:
        A few lines: the call's shape, the backend that runs, and one line per other backend
        (cannot serve: reasons / O(T^2) memory where an O(T) path serves / slower: cost).

    Example:
        >>> q = torch.randn(1, 8, 256, 64)
        >>> text = why(q, q, q, causal=True)
        >>> text.splitlines()[1].startswith("runs on ")
        True
    """
    call = build_call(q, k, v, **options)
    lines = [_describe(call)]
    table = verdicts(call, backend)
    chosen = next(verdict for verdict in table if verdict.chosen)
    lines.append(f"runs on {chosen.name!r}: {chosen.reason}")
    lines += [f"  {verdict.name}: {verdict.reason}" for verdict in table if not verdict.chosen]
    text = "\n".join(lines)
    if echo:
        print(text)
    return text


def _describe(call: AttentionCall) -> str:
    """One line naming the call's sizes and options."""
    parts = [
        f"B={call.batch} Hq={call.q_heads} Hkv={call.kv_heads} Tq={call.tq} Tk={call.tk} "
        f"D={call.head_dim} Dv={call.value_dim} {str(call.dtype).replace('torch.', '')} "
        f"on {call.device.type}",
        f"mask={call.mask_kind}" + (f" {tuple(call.mask.shape)}" if call.mask_kind in ("bool", "float") else ""),
    ]
    if call.causal:
        parts.append(f"causal ({call.align})")
    if call.dropout_p:
        parts.append(f"dropout_p={call.dropout_p}")
    if call.requires_grad:
        parts.append("needs grad")
    return "call: " + ", ".join(parts)

