"""Backends behind :func:`attnlab.attention`, the dispatch that chooses between them, and why.

Every backend keeps one contract (``docs/contract.md``) or declines the call with
reasons. The package is laid out as xformers lays out its attention ops:

* :mod:`~attnlab.backends.base` -- the protocol: capabilities declared on the class, refusal
  reasons derived from them;
* :mod:`~attnlab.backends.registry` -- registration and lookup by name;
* :mod:`~attnlab.backends.dispatch` -- which backend runs a call;
* :mod:`~attnlab.backends.verdicts` -- :func:`why` and the per-backend verdicts in words;
* :mod:`~attnlab.backends.rates` -- the cost model's measured rates;
* one module per backend: ``reference``, ``sdpa``, ``chunked``, ``blocks``, ``flex``.

Example:
    >>> import torch, attnlab.backends as backends
    >>> "reference" in backends.available()
    True
    >>> q = torch.randn(1, 2, 5, 8)
    >>> backends.select(backends.build_call(q, q, q), "auto").name in backends.available()
    True
"""

from __future__ import annotations

import torch  # noqa: F401  (the doctest examples use it)

from attnlab._call import AttentionCall, build_call
from attnlab.backends.base import AttentionResult, Backend
from attnlab.backends.registry import available, get, names, register, registry, unregister

# Registration order is the order `attnlab backends` lists them in.
from attnlab.backends.reference import ReferenceBackend
from attnlab.backends.sdpa import SdpaBackend
from attnlab.backends.chunked import ChunkedBackend
from attnlab.backends.blocks import BlocksBackend
from attnlab.backends.flex import FlexBackend
from attnlab.backends.dispatch import (check_backend_name, memory_budget, memory_class, reasons, select,
                                       set_memory_budget)
from attnlab.backends.verdicts import Verdict, verdicts, why

__all__ = [
    "AttentionResult",
    "Backend",
    "AttentionCall",
    "build_call",
    "register",
    "unregister",
    "registry",
    "names",
    "available",
    "get",
    "check_backend_name",
    "select",
    "reasons",
    "memory_class",
    "memory_budget",
    "set_memory_budget",
    "Verdict",
    "verdicts",
    "why",
    "ReferenceBackend",
    "SdpaBackend",
    "ChunkedBackend",
    "BlocksBackend",
    "FlexBackend",
]
