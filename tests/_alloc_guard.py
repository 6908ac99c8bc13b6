"""Fail a test, instead of the machine, when code under test tries to allocate a lot.

Loader tests feed configs that ask for terabytes; if a loader ever builds the model before
checking them again, the test must fail at once with an AssertionError, not swap or get killed.
Every torch factory the modules use to create parameters and buffers is wrapped; the total
number of elements asked for is capped.
"""

from __future__ import annotations

import math

import torch

FACTORIES = ("empty", "zeros", "ones", "randn", "rand", "full")


def forbid_large_allocations(monkeypatch, *, limit: int = 1_000_000) -> None:
    """Patch torch's factories so that more than ``limit`` elements in all raise ``AssertionError``."""
    total = [0]
    for name in FACTORIES:
        monkeypatch.setattr(torch, name, _guarded(getattr(torch, name), name, total, limit))


def _guarded(factory, name, total, limit):
    def guarded(*args, **kwargs):
        numel = _numel(args, kwargs)
        total[0] += numel
        if total[0] > limit:
            raise AssertionError(f"torch.{name} asked for {numel} elements ({total[0]} in all, limit {limit})")
        return factory(*args, **kwargs)

    return guarded


def _numel(args, kwargs) -> int:
    size = kwargs.get("size", args[0] if args else ())
    if isinstance(size, (tuple, list, torch.Size)):
        return math.prod(int(s) for s in size)
    return math.prod(int(s) for s in args if isinstance(s, int))
