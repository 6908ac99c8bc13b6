"""Dispatch explained: each backend's standing for one call, and :func:`why` in words.

Example:
    >>> import torch
    >>> q = torch.randn(1, 2, 6, 4)
    >>> why(q, q, q).splitlines()[2].startswith("runs on ")
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch  # noqa: F401  (the doctest examples use it)

from attnlab._call import AttentionCall, build_call
from attnlab.backends.dispatch import (budget_words, claim_words, claimed, memory_budget, memory_class, reasons,
                                       select)
from attnlab.backends.registry import registry

__all__ = ["Verdict", "verdicts", "why"]

_MEMORY_WORDS = {"linear": "O(T)", "quadratic": "O(T^2)"}


@dataclass(frozen=True)
class Verdict:
    """One backend's standing for one call, as :func:`why` reports it.

    Attributes:
        name: the backend.
        chosen: whether this backend runs the call.
        serves: whether it could serve the call at all.
        memory: ``"linear"``/``"quadratic"`` for this call (``""`` when it cannot serve).
        memory_bytes: estimated bytes beyond the call's tensors (None when it cannot serve).
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
    memory_bytes: int | None
    cost_s: float | None
    reason: str


def _format_seconds(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def _format_bytes(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


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
    chosen_cost, budget = chosen.cost(call), memory_budget(call)
    fits = chosen.memory_bytes(call) <= budget
    result = []
    for backend_name, why_not in reasons(call).items():
        backend = registry()[backend_name]
        if why_not:
            result.append(Verdict(backend_name, False, False, "", None, None,
                                  "cannot serve: " + "; ".join(why_not)))
            continue
        memory, size, cost = memory_class(backend, call), backend.memory_bytes(call), backend.cost(call)
        note = f" ({backend.memory_note(call)})" if backend.memory_note(call) else ""
        needs = f"{_MEMORY_WORDS[memory]} memory, {_format_bytes(size)}{note}"
        if backend is chosen:
            if name != "auto":
                how = "named explicitly"
            elif claimed(backend, call):
                how = claim_words(backend, call)
            else:
                how = "fastest within the memory budget" if fits else "fastest O(T) path: none fits the memory budget"
            reason = f"chosen ({how}): {needs}, est. {_format_seconds(cost)}"
        elif name != "auto":
            reason = f"not asked for (backend={name!r})"
        elif size > budget and (fits or memory_class(backend, call) != memory_class(chosen, call)):
            reason = f"over the memory budget: {needs}"
        elif claimed(chosen, call):
            reason = f"passed over for {chosen.name!r}, which takes this mask as given (est. {_format_seconds(cost)})"
        else:
            reason = f"slower: cost {_format_seconds(cost)} vs {_format_seconds(chosen_cost)}"
        result.append(Verdict(backend_name, backend is chosen, True, memory, size, cost, reason))
    return result


def why(q, k, v, *, backend: str = "auto", echo: bool = False, **options) -> str:
    """Explain which backend :func:`attnlab.attention` would run for these arguments, and why.

    Args:
        q, k, v: the tensors you would pass to :func:`attnlab.attention`.
        backend: ``"auto"`` or a backend name, as in :func:`attnlab.attention`.
        echo: also print the explanation.
        **options: any keyword option of :func:`attnlab.attention` (mask, causal, align,
            scale, dropout_p, generator, return_weights, score_mod, sinks).

    Returns:
        A few lines: the call's shape, the memory budget, the backend that runs, and one line
        per other backend (cannot serve: reasons / over the memory budget / slower: cost).

    Example:
        >>> q = torch.randn(1, 8, 256, 64)
        >>> text = why(q, q, q, causal=True)
        >>> text.splitlines()[2].startswith("runs on ")
        True
    """
    call = build_call(q, k, v, **options)
    lines = [_describe(call), budget_words(call)]
    table = verdicts(call, backend)
    chosen = next(verdict for verdict in table if verdict.chosen)
    lines.append(f"runs on {chosen.name!r}: {chosen.reason}")
    lines += [f"  {verdict.name}: {verdict.reason}" for verdict in table if not verdict.chosen]
    text = "\n".join(lines)
    if echo:
        print(text)
    return text


# The mask argument's kind as why() names it: causal alone is "no mask" and "causal (align)".
_MASK_WORD = {"causal": "none"}


def _describe(call: AttentionCall) -> str:
    """One line naming the call's sizes and options."""
    parts = [
        f"B={call.batch} Hq={call.q_heads} Hkv={call.kv_heads} Tq={call.tq} Tk={call.tk} "
        f"D={call.head_dim} Dv={call.value_dim} {str(call.dtype).replace('torch.', '')} "
        f"on {call.device.type}",
        f"mask={_MASK_WORD.get(call.mask_kind, call.mask_kind)}"
        + (f" {tuple(call.mask.shape)}" if call.mask_kind in ("bool", "float") else ""),
    ]
    if call.causal_offset is not None:
        parts.append(f"causal ({call.align})")
    if call.score_mod is not None:
        parts.append(f"score_mod={call.score_mod!r}")
    if call.sinks is not None:
        parts.append(f"sinks {tuple(call.sinks.shape)}")
    if call.dropout_p:
        parts.append(f"dropout_p={call.dropout_p}")
    if call.requires_grad:
        parts.append("needs grad")
    return "call: " + ", ".join(parts)

