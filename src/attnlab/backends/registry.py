"""The registry every backend adds itself to, and lookups by name.

Example:
    >>> "reference" in names()
    True
"""

from __future__ import annotations

from attnlab._checks import one_of
from attnlab.backends.base import Backend

__all__ = ["register", "unregister", "registry", "names", "get", "available", "generation", "claimers"]

_REGISTRY: dict[str, Backend] = {}
_GENERATION = [0]  # bumped by every change, so that remembered dispatch decisions expire
_CLAIMERS: dict[int, tuple[Backend, ...]] = {}  # per generation: the backends that claim calls, in order


def generation() -> int:
    """A number that changes whenever a backend is registered or unregistered.

    Example:
        >>> before = generation()
        >>> _ = register(registry()["reference"])
        >>> generation() != before
        True
    """
    return _GENERATION[0]


def register(backend: Backend) -> Backend:
    """Add ``backend`` to the registry under ``backend.name`` (replacing one of that name).

    Example:
        >>> register(registry()["reference"]).name
        'reference'
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be an attnlab Backend, got {type(backend).__name__}")
    if not backend.name or backend.name == "auto":
        raise ValueError(f"backend.name must be a non-empty string other than 'auto', got {backend.name!r}")
    _REGISTRY[backend.name] = backend
    _GENERATION[0] += 1
    return backend


def unregister(name: str) -> Backend:
    """Remove the backend called ``name`` and return it (``ValueError`` if there is none).

    Example:
        >>> from attnlab.backends.base import Backend
        >>> class Noop(Backend):
        ...     name = "noop"
        >>> unregister(register(Noop()).name).name
        'noop'
    """
    backend = _REGISTRY.pop(one_of("backend", name, _REGISTRY))
    _GENERATION[0] += 1
    return backend


def claimers() -> tuple[Backend, ...]:
    """The registered backends that declare a ``claim_order``, lowest first (registration order
    on a tie): those auto asks whether they claim a call (:meth:`Backend.claims`).

    Example:
        >>> [b.name for b in claimers()]
        ['sdpa']
    """
    found = _CLAIMERS.get(_GENERATION[0])
    if found is None:
        ordered = sorted((b for b in _REGISTRY.values() if b.claim_order is not None), key=lambda b: b.claim_order)
        _CLAIMERS.clear()
        found = _CLAIMERS[_GENERATION[0]] = tuple(ordered)
    return found


def registry() -> dict[str, Backend]:
    """The registered backends by name, in registration order.

    Example:
        >>> list(registry())[0]
        'reference'
    """
    return dict(_REGISTRY)


def names() -> list[str]:
    """Every registered backend's name, available here or not.

    Example:
        >>> names()[:2]
        ['reference', 'sdpa']
    """
    return list(_REGISTRY)


def get(name: str) -> Backend:
    """The registered backend called ``name``; ``ValueError`` listing the names otherwise.

    Example:
        >>> get("reference").memory
        'quadratic'
    """
    return _REGISTRY[one_of("backend", name, _REGISTRY)]


def available() -> list[str]:
    """Names of the backends that can run in this installation.

    Example:
        >>> available()[0]
        'reference'
    """
    return [name for name, b in _REGISTRY.items() if b.unavailable_reason() is None]
