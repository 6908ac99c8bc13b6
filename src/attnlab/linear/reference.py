"""The oracle: linear attention as the recurrence it is, one step at a time, in fp64.

Every backend of :func:`attnlab.linear_attention` is checked against this loop. Per value head,
with ``S`` the ``(Dk, Dv)`` state (``S_0`` = ``initial_state`` or zeros)::

    S'_t = diag(exp(decay_t)) S_{t-1}                 decay: none, one per step, or one per key channel
    S_t  = S'_t + k_t v_tᵀ                             additive rule
    S_t  = S'_t + beta_t k_t (v_t - S'_tᵀ k_t)ᵀ        delta rule: write only what S' mispredicts
    o_t  = scale · S_tᵀ q_t

Softmax attention keeps every key; this keeps one matrix, so a step costs O(Dk·Dv) at any length
("Transformers are RNNs", Katharopoulos et al. 2020).

Example:
    >>> import torch
    >>> q = k = v = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    >>> out, state = linear_attention_reference(q, k, v, return_state=True)
    >>> manual = sum(torch.outer(k[0, 0, t], v[0, 0, t]) for t in range(4))   # additive: S = Σ k vᵀ
    >>> torch.allclose(state[0, 0], manual)
    True
"""

from __future__ import annotations

import torch

from attnlab.linear._call import LinearCall, linear_call


def _step(S, q_t, k_t, v_t, decay_t, beta_t, scale):
    """One step for every (batch row, value head): ``S`` ``(N, Hv, Dk, Dv)``, vectors ``(N, Hv, D)``."""
    if decay_t is not None:
        gate = decay_t.exp()  # (N, Hv) or (N, Hv, Dk)
        S = S * (gate[..., None, None] if gate.dim() == 2 else gate[..., None])
    if beta_t is None:
        S = S + k_t[..., :, None] * v_t[..., None, :]
    else:
        predicted = (k_t[..., None, :] @ S)[..., 0, :]  # S'ᵀ k: (N, Hv, Dv)
        S = S + k_t[..., :, None] * (beta_t[..., None] * (v_t - predicted))[..., None, :]
    out = scale * (q_t[..., None, :] @ S)[..., 0, :]  # Sᵀ q: (N, Hv, Dv)
    return S, out


def run_step(call: LinearCall) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (``T == 1``, no ``cu_seqlens``) in the call's ``state_dtype``: :func:`_step` once,
    with nothing stacked or copied around it (the ``recurrent`` backend's decoding step).

    Example:
        >>> q = torch.randn(1, 1, 1, 3, dtype=torch.float64)
        >>> call = linear_call(q, q, q, decay=None, beta=None, scale=None, initial_state=None, cu_seqlens=None)
        >>> all(torch.allclose(a, b) for a, b in zip(run_step(call), run_reference(call)))
        True
    """
    B, H, Hv, _, Dk, Dv = call.sizes
    dtype = call.state_dtype
    q, k = (x[:, :, 0].to(dtype) for x in (call.q, call.k))  # (B, H, Dk)
    if call.groups > 1:  # (B, Hv, Dk): value head j reads query/key head j // groups
        q, k = (x[:, :, None].expand(B, H, call.groups, Dk).reshape(B, Hv, Dk) for x in (q, k))
    at = lambda x: None if x is None else x[:, :, 0].to(dtype)  # noqa: E731  (B, Hv[, D])
    S = (call.initial_state.to(dtype) if call.initial_state is not None
         else q.new_zeros(B, Hv, Dk, Dv))
    S, out = _step(S, q, k, at(call.v), at(call.decay), at(call.beta), call.scale)
    return out[:, :, None].to(call.q.dtype), S  # (B, Hv, 1, Dv)


def run_reference(call: LinearCall, *, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of a checked call: ``(out (B, Hv, T, Dv) in q's dtype, final state)``.

    Args:
        call: a checked call. dtype: the precision of the loop: fp64 for the oracle, the call's
            ``state_dtype`` for the ``recurrent`` backend (decoding: one step per token).

    Example:
        >>> import torch
        >>> q = torch.randn(1, 1, 2, 2)
        >>> call = linear_call(q, q, q, decay=None, beta=None, scale=None, initial_state=None, cu_seqlens=None)
        >>> run_reference(call)[0].dtype
        torch.float32
    """
    B, _, Hv, T, Dk, Dv = call.sizes
    q, k, v, decay, beta = (None if x is None else x.to(dtype)
                            for x in (call.q, call.k, call.v, call.decay, call.beta))
    q, k = (x.repeat_interleave(call.groups, dim=1) for x in (q, k))  # (B, Hv, T, Dk): head j reads j // groups
    S0 = (call.initial_state.to(dtype) if call.initial_state is not None
          else q.new_zeros(call.state_shape))  # (B or N, Hv, Dk, Dv)
    # Without cu_seqlens every row is one sequence, all stepped together; with it, row 0 holds N documents.
    spans = ([(slice(0, 1), s, e) for s, e in zip(call.starts[:-1], call.starts[1:])] if call.cu_seqlens is not None
             else [(slice(None), 0, T)])
    pieces, finals = [], []
    for i, (rows, start, end) in enumerate(spans):
        S = S0[i:i + 1] if call.cu_seqlens is not None else S0
        steps = []
        for t in range(start, end):
            at = lambda x: None if x is None else x[rows, :, t]  # noqa: E731  (N, Hv[, D])
            S, out_t = _step(S, *(at(x) for x in (q, k, v, decay, beta)), call.scale)
            steps.append(out_t.reshape(-1, Hv, Dv))
        pieces.append(torch.stack(steps, dim=2) if steps else q.new_zeros(S.shape[0], Hv, 0, Dv))
        finals.append(S)
    out = torch.cat(pieces, dim=2 if call.cu_seqlens is not None else 0)  # (B, Hv, T, Dv)
    state = torch.cat(finals)  # (B or N, Hv, Dk, Dv)
    return out.to(call.q.dtype), state.to(call.state_dtype)


def linear_attention_reference(q, k, v, *, decay=None, beta=None, scale=None, initial_state=None,
                               return_state=False, cu_seqlens=None):
    """:func:`attnlab.linear_attention` computed by the fp64 recurrence (the oracle; slow).

    Args and returns as :func:`attnlab.linear_attention`.

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
        >>> linear_attention_reference(q, q, q).shape
        torch.Size([1, 2, 3, 4])
    """
    call = linear_call(q, k, v, decay=decay, beta=beta, scale=scale, initial_state=initial_state,
                       cu_seqlens=cu_seqlens)
    out, state = run_reference(call)
    return (out, state) if return_state else out
