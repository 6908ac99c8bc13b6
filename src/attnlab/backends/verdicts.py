"""Dispatch explained: each backend's standing for one call, and :func:`why` in words.

Example:
    >>> import torch
    >>> q = torch.randn(1, 2, 6, 4)
    >>> why(q, q, q).splitlines()[2].startswith("runs on ")
    True
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch  # noqa: F401  (the doctest examples use it)

from attnlab._call import AttentionCall, build_call
from attnlab.backends.dispatch import (argument_key, budget_words, claim_words, claimed, memory_budget, memory_class,
                                       reasons, remembered, route, select)
from attnlab.backends.observed import labelled, mismatch, observe
from attnlab.backends.registry import registry
from attnlab.backends.sdpa import sdpa_plan

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
    fits = chosen.memory_use(call).nbytes <= budget
    result = []
    for backend_name, why_not in reasons(call).items():
        backend = registry()[backend_name]
        if why_not:
            result.append(Verdict(backend_name, False, False, "", None, None,
                                  "cannot serve: " + "; ".join(why_not)))
            continue
        (memory, size, note), cost = backend.memory_use(call, words=True), backend.cost(call)
        note = f" ({note})" if note else ""
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


def why(q, k, v, *, backend: str = "auto", echo: bool = False, run: bool = False, **options) -> str:
    """Explain which backend :func:`attnlab.attention` would run for these arguments, and why.

    Args:
        q, k, v: the tensors you would pass to :func:`attnlab.attention`.
        backend: ``"auto"`` or a backend name, as in :func:`attnlab.attention`.
        echo: also print the explanation.
        run: also run the call once under torch.profiler and say which backend and kernels
            actually ran (:mod:`~attnlab.backends.observed`), warning (``RuntimeWarning``) where
            that differs from the prediction.
        **options: any keyword option of :func:`attnlab.attention` (mask, causal, align,
            scale, dropout_p, generator, return_weights, score_mod, sinks).

    Returns:
        A few lines: the call's shape, the memory budget, the backend that runs, and one line
        per other backend (cannot serve: reasons / over the memory budget / slower: cost);
        with ``run``, what ran and whether it matches.

    Example:
        >>> q = torch.randn(1, 8, 256, 64)
        >>> text = why(q, q, q, causal=True)
        >>> text.splitlines()[2].startswith("runs on ")
        True
        >>> print(why(q, q, q, causal=True, run=True).splitlines()[-2])
        ran 'sdpa' (1 call): SDPA's flash kernel for CPU x1 [aten::_scaled_dot_product_flash_attention_for_cpu]
    """
    call = build_call(q, k, v, **options)
    lines = [_describe(call), budget_words(call)]
    table = verdicts(call, backend)
    chosen = next(verdict for verdict in table if verdict.chosen)
    lines.append(f"runs on {chosen.name!r}: {chosen.reason}")
    lines += [f"  {verdict.name}: {verdict.reason}" for verdict in table if not verdict.chosen]
    if run:
        lines += ran_lines(*observe(_dispatched, q, k, v, call, backend, options)[1:], chosen.name, call)
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



def ran_lines(ran, backend: str, call: AttentionCall) -> list[str]:
    """What ran (:class:`~attnlab.backends.observed.Ran`) beside the prediction for ``call``
    (``backend``, and SDPA's kernel when it is sdpa), in lines; warns when they differ.

    Example:
        >>> import attnlab
        >>> q = torch.randn(1, 2, 6, 4)
        >>> _, ran = observe(attnlab.attention, q, q, q, backend="reference")
        >>> ran_lines(ran, "reference", build_call(q, q, q))[-1]
        "matches the prediction: 'reference'"
    """
    kernel = sdpa_plan(call).kernel if backend == "sdpa" else None
    differs = mismatch(ran, backend, kernel)
    if differs is not None:
        warnings.warn(f"attnlab: what ran differs from the prediction: {differs}", RuntimeWarning, stacklevel=3)
        return [*ran.lines(), f"DIFFERS from the prediction: {differs}"]
    if ran.backend is None:
        return [*ran.lines(), "not compared: no attnlab range was seen (a compiled graph keeps none)"]
    predicted = f"{backend!r}" + (f", SDPA's {kernel} kernel" if kernel is not None and ran.sdpa_kernel else "")
    return [*ran.lines(), f"matches the prediction: {predicted}"]


# attnlab.attention's defaults, for the signature a route is remembered under.
_DEFAULTS = dict(mask=None, causal=False, align="top_left", scale=None, dropout_p=0.0, generator=None,
                 return_weights=False, score_mod=None, sinks=None)


def _dispatched(q, k, v, call: AttentionCall, name: str, options: dict):
    """``call`` run as :func:`attnlab.attention` runs it: its remembered route or a fresh one
    (dispatch's own), then sdpa's prepared run or the backend's forward, labelled as there.
    (why sits below ``attnlab.functional`` in the layers, so it walks the same steps itself;
    the tests check that both report the same backend and kernels.)"""
    key = argument_key(q, k, v, backend=name, **{**_DEFAULTS, **options})
    known = remembered(key)
    if known is None:
        direct = call.q is q and call.k is k and call.v is v and call.mask is options.get("mask")
        known = route(key, call, name, direct=direct)
    if known.run is not None:
        sinks = () if call.sinks is None else (call.sinks,)
        return labelled(known.backend.name, known.run, call.q, call.k, call.v, call.mask, *sinks)
    if known.mask is not None:  # the mask as the route prepared it
        call = build_call(q, k, v, **{**options, "mask": known.mask, "causal": False})
    return labelled(known.backend.name, known.backend.forward, call)
