"""``attnlab explain``'s "which kernel ran": the walk's attention call, run once under
torch.profiler through :func:`attnlab.attention`, beside what dispatch predicts for it
(:mod:`attnlab.backends.observed`; a difference is warned about and said in the text).

Example:
    >>> from attnlab.lab.explain import trace
    >>> lines = kernel_lines(*walk_call(trace("The sun rises", mode="causal")))
    >>> lines[0].startswith("predicted: 'sdpa'"), lines[-1].startswith("matches the prediction")
    (True, True)
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.backends import build_call
from attnlab.backends.observed import observe
from attnlab.backends.verdicts import ran_lines, verdicts
from attnlab.functional import attention

__all__ = ["kernel_lines", "walk_call", "narrate"]


def walk_call(result) -> tuple[Tensor, Tensor, Tensor, dict]:
    """The :func:`attnlab.attention` call a tutorial walk (:func:`attnlab.lab.explain.trace`) computes
    step by step: its queries, keys and values ``(1, H, T, D)`` and its options."""
    heads = range(result.heads)
    q, k, v = (torch.stack([result.step(name, h).tensor for h in heads])[None]  # (1, H, T, D|Dv)
               for name in ("queries", "keys", "values"))
    options = dict(causal=result.causal, score_mod=result.score_mod, sinks=result.sinks)
    if result.dropout_p > 0:  # its own generator: the caller's random state stays as it was
        options.update(dropout_p=result.dropout_p, generator=torch.Generator().manual_seed(result.seed))
    return q, k, v, options


def kernel_lines(q: Tensor, k: Tensor, v: Tensor, options: dict) -> list[str]:
    """The predicted backend, then what ran under the profiler and whether it matches (warning,
    ``RuntimeWarning``, where it does not)."""
    call = build_call(q, k, v, **options)
    chosen = next(verdict for verdict in verdicts(call) if verdict.chosen)
    _, ran = observe(attention, q, k, v, **options)
    return [f"predicted: {chosen.name!r}, {chosen.reason}", *ran_lines(ran, chosen.name, call)]


def narrate(console, result) -> None:
    """Print the walk's call's kernel lines under their own rule."""
    console.print()
    console.rule("[bold]Which kernel ran[/bold] (attnlab.attention on these queries, keys and values)")
    for line in kernel_lines(*walk_call(result)):
        console.print(line, markup=False, soft_wrap=True)
