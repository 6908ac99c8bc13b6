"""Linear attention: attention written as a recurrence over one ``(Dk, Dv)`` state per head.

:func:`linear_attention` is the one function of the recurrent family (linear attention, RetNet's
retention, lightning attention, Mamba-2's scalar decay, GLA's per-channel decay, DeltaNet, Gated
DeltaNet, Kimi Delta Attention): which rule runs follows from ``decay`` and ``beta``. Every backend
keeps the contract of the fp64 recurrence in :mod:`attnlab.linear.reference`:

=============  ==========================================================================
backend        what it is for
=============  ==========================================================================
reference      the fp64 oracle, one step at a time (slow; tests and ``attnlab verify``)
recurrent      one step at a time in fp32: decoding, one token per call
chunked        within-chunk parallel form (the WY/UT form for delta rules): training, prefill
auto           recurrent for a handful of tokens, chunked otherwise
=============  ==========================================================================

Example:
    >>> import torch, attnlab
    >>> q = k = torch.randn(1, 2, 8, 4); v = torch.randn(1, 2, 8, 4)
    >>> decay = -torch.rand(1, 2, 8)                     # log-decay per step (<= 0)
    >>> out, state = attnlab.linear_attention(q, k, v, decay=decay, return_state=True)
    >>> out.shape, state.shape
    (torch.Size([1, 2, 8, 4]), torch.Size([1, 2, 4, 4]))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnlab._checks import one_of
from attnlab.linear._call import LinearCall, empty_result, linear_call
from attnlab.linear.chunked import run_chunked
from attnlab.linear.reference import linear_attention_reference, run_reference, run_step

__all__ = ["linear_attention", "linear_attention_reference", "LinearCall", "BACKENDS"]

Run = Callable[[LinearCall], "tuple[torch.Tensor, torch.Tensor]"]


def _recurrent(call: LinearCall) -> tuple[torch.Tensor, torch.Tensor]:
    if call.q.shape[2] == 1 and call.cu_seqlens is None:  # a decoding step
        return run_step(call)
    return run_reference(call, dtype=call.state_dtype)


# name -> run(call) -> (out (B, Hv, T, Dv) in q's dtype, final state in call.state_dtype)
#: The backends by name (``backend=``); "auto" chooses between "recurrent" and "chunked".
BACKENDS: dict[str, Run] = {"reference": run_reference, "recurrent": _recurrent, "chunked": run_chunked}


STEPS_UP_TO = 16  # "auto" runs up to this many tokens a step at a time (decoding), more in chunks


def _choose(call: LinearCall) -> str:
    """``auto``: a step at a time for a few tokens (decoding), the chunked form for more."""
    return "chunked" if call.q.shape[2] > STEPS_UP_TO else "recurrent"


def linear_attention(q, k, v, *, decay=None, beta=None, scale=None, initial_state=None, return_state=False,
                     cu_seqlens=None, backend="auto"):
    """Linear attention over a ``(Dk, Dv)`` state per value head: every rule of the recurrent family.

    Per value head, with ``S_0 = initial_state`` (or zeros)::

        S'_t = diag(exp(decay_t)) S_{t-1}
        S_t  = S'_t + k_t v_tᵀ                         (beta None: additive)
        S_t  = S'_t + beta_t k_t (v_t - S'_tᵀ k_t)ᵀ    (beta given: delta rule)
        o_t  = scale · S_tᵀ q_t

    Args:
        q, k: ``(B, H, T, Dk)``.
        v: ``(B, Hv, T, Dv)``, ``Hv`` a multiple of ``H``: query/key head ``i`` serves value heads
            ``i * Hv/H … (i+1) * Hv/H - 1`` (Qwen3-Next's grouped value heads).
        decay: None; ``(B, Hv, T)`` log-decay per step (<= 0: RetNet, lightning, Mamba-2, Gated
            DeltaNet); or ``(B, Hv, T, Dk)`` per key channel (GLA, KDA).
        beta: None (additive) or ``(B, Hv, T)`` in [0, 1] (delta rule).
        scale: the output's factor; ``Dk ** -0.5`` by default.
        initial_state: ``(B, Hv, Dk, Dv)`` (or ``(N, Hv, Dk, Dv)`` with ``cu_seqlens``); zeros if None.
        return_state: also return the final state (fp32, fp64 for fp64 inputs).
        cu_seqlens: 1-D int tensor ``[0, …, T]`` of packed documents' starts (``B == 1``); the state
            restarts at each.
        backend: "auto", "chunked", "recurrent" or "reference".

    Returns:
        ``out`` ``(B, Hv, T, Dv)`` in q's dtype, or ``(out, state)`` with ``return_state=True``.

    Raises:
        TypeError, ValueError: a bad argument, named (decay > 0, beta outside [0, 1], NaN, shapes).

    Example:
        >>> import torch, attnlab
        >>> q = k = torch.randn(1, 1, 6, 4, dtype=torch.float64); v = torch.randn(1, 1, 6, 2, dtype=torch.float64)
        >>> beta = torch.full((1, 1, 6), 0.5, dtype=torch.float64)
        >>> whole = attnlab.linear_attention(q, k, v, beta=beta)
        >>> first, state = attnlab.linear_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], beta=beta[..., :3],
        ...                                         return_state=True)
        >>> second = attnlab.linear_attention(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], beta=beta[..., 3:],
        ...                                   initial_state=state)
        >>> torch.allclose(torch.cat([first, second], dim=2), whole)
        True
    """
    out, state = _run(q, k, v, decay=decay, beta=beta, scale=scale, initial_state=initial_state,
                      cu_seqlens=cu_seqlens, backend=backend, values=True)
    return (out, state) if return_state else out


def _run(q, k, v, *, decay, beta, scale, initial_state, cu_seqlens, backend, values):
    """:func:`linear_attention` returning ``(out, state)``; ``values=False`` leaves out the checks
    that read values (for a layer whose decay, beta and state are valid by construction and whose
    input it checked itself: a decoding step pays no NaN scan of its own tensors)."""
    if backend != "auto" and backend not in BACKENDS:  # (a list built only to word the error)
        one_of("backend", backend, ["auto", *BACKENDS])
    call = linear_call(q, k, v, decay=decay, beta=beta, scale=scale, initial_state=initial_state,
                       cu_seqlens=cu_seqlens, values=values)
    if call.q.shape[2] == 0:
        return empty_result(call)
    return BACKENDS[_choose(call) if backend == "auto" else backend](call)
