"""Backends behind :func:`attnlab.attention` and the dispatch that chooses between them.

Every backend keeps one contract (DESIGN.md, "Semantics") or declines the call with reasons.
``backend="auto"`` picks, among the backends that serve a call, the cheapest one whose memory
class is the best available (never an O(T^2) path when an O(T) one serves).

Example:
    >>> import torch, attnlab.backends as backends
    >>> "reference" in backends.available()
    True
    >>> q = torch.randn(1, 2, 5, 8)
    >>> backends.select(backends.build_call(q, q, q), "auto").name in backends.available()
    True
"""

from __future__ import annotations

from attnlab._call import AttentionCall, build_call
from attnlab.backends.base import AttentionResult, Backend, register, registry

# Importing a backend module registers it. Order is the order `attnlab backends` lists them in.
from attnlab.backends import reference  # noqa: E402,F401  (registers "reference")
from attnlab.backends import chunked  # noqa: E402,F401

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
]

_MEMORY_RANK = {"linear": 0, "quadratic": 1}


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
        >>> q = torch.randn(1, 1, 4, 8)
        >>> reasons(build_call(q, q, q))["reference"]
        []
    """
    result = {}
    for name, backend in registry().items():
        unavailable = backend.unavailable_reason()
        result[name] = [unavailable] if unavailable else backend.not_supported_reasons(call)
    return result


def select(call: AttentionCall, name: str = "auto") -> Backend:
    """The backend that will run ``call``.

    Args:
        call: a validated call from :func:`build_call`.
        name: ``"auto"`` or a backend name.

    Raises:
        ValueError: the named backend cannot serve the call (the message lists why), or the
            name is unknown.

    Example:
        >>> q = torch.randn(1, 1, 4, 8)
        >>> select(build_call(q, q, q), "reference").name
        'reference'
    """
    if name != "auto":
        backend = get(name)
        why_not = reasons(call)[name]
        if why_not:
            raise ValueError(f"backend {name!r} cannot serve this call: " + "; ".join(why_not))
        return backend
    serving = [registry()[n] for n, why_not in reasons(call).items() if not why_not]
    if not serving:  # the reference serves every valid call; this is a programming error
        raise RuntimeError("no attention backend can serve this call")
    return min(serving, key=lambda b: (_MEMORY_RANK.get(b.memory, 1), b.cost(call)))
