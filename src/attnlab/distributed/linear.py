"""Context parallelism for linear attention: each rank's chunk in parallel, the state passed as a prefix.

Linear attention's state is an affine function of the state it starts from. Over one rank's
contiguous chunk, every rule of :func:`attnlab.linear_attention` gives::

    S_end = A · S_in + B          A (Dk, Dk): the chunk's transition,  B (Dk, Dv): its own writes
    o_t   = o_t(S_in = 0) + r_t · S_in      r_t (Dk,): what step t reads of the incoming state

so every rank runs its chunk twice at once, independently: once from a zero state (``o(0)`` and
``B``) and once on zero values from the identity (``r`` and ``A``: the state then stays the pure
transition). One all-gather of ``(A, B)`` from every rank follows, and each rank folds the prefix
``S_in(r) = A_{r-1} S_in(r-1) + B_{r-1}`` over the ranks before it (``S_in(0)`` =
``initial_state``): a few ``(Dk, Dk) x (Dk, Dv)`` products, no waiting ring. The result equals one
process on the whole sequence, forward and backward (the all-gather's backward is one all-reduce).
The cost is the second, value-free run (``Dk`` wide instead of ``Dv``) and one message of
``P · (Dk + Dv) · Dk`` numbers per head.

Example (run under ``torchrun --nproc-per-node 2``)::

    import torch, torch.distributed as dist, attnlab
    from attnlab.distributed import context_parallel_linear_attention, shard, unshard
    dist.init_process_group("gloo")
    torch.manual_seed(0)                                          # the same global tensors everywhere
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    decay = -torch.rand(1, 2, 64)
    local = lambda t: shard(t, dim=2, layout="contiguous")
    out_l = context_parallel_linear_attention(local(q), local(k), local(v), decay=local(decay))
    out = unshard(out_l, dim=2, layout="contiguous")              # == attnlab.linear_attention(q, k, v, decay=decay)
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.distributed._agreement import check_agreement
from attnlab.distributed._comm import CommStats, all_gather, peers
from attnlab.linear import _run
from attnlab.linear._call import linear_call

__all__ = ["context_parallel_linear_attention"]


class _Joined(torch.autograd.Function):
    """``out`` unchanged, tied to the gathered table, so that the all-gather's backward (an
    all-reduce every rank must join) runs on every rank, rank 0 included, whose output reads no
    other rank's state. The tie adds no gradient."""

    @staticmethod
    def forward(ctx, out, table):
        ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.table_shape, dtype=ctx.table_dtype)


def context_parallel_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, decay: Tensor | None = None,
                                      beta: Tensor | None = None, scale: float | None = None,
                                      initial_state: Tensor | None = None, return_state: bool = False,
                                      backend: str = "auto", group=None, timeout: float | None = None,
                                      stats: CommStats | None = None):
    """This rank's shard of :func:`attnlab.linear_attention` over a sequence split across ``group``.

    The sequence is split in contiguous chunks in rank order (``shard(x, dim=2,
    layout="contiguous")``): rank ``r`` holds positions ``r·T_local … (r+1)·T_local - 1``.

    Shapes (this rank's shards): q, k ``(B, H, T_local, Dk)``, v ``(B, Hv, T_local, Dv)``, decay
    ``(B, Hv, T_local)`` or ``(B, Hv, T_local, Dk)``, beta ``(B, Hv, T_local)`` -> out
    ``(B, Hv, T_local, Dv)``.

    Args:
        q, k, v, decay, beta, scale, backend: as :func:`attnlab.linear_attention`, this rank's part.
        initial_state: the state before the global sequence's first token ``(B, Hv, Dk, Dv)``; every
            rank passes the same one (its gradient on each rank is that rank's share: sum it across
            ranks, as for the weights every rank holds).
        return_state: also return the state after the global sequence's last token (the same on
            every rank: put it in one rank's loss, or each rank's divided by the world size, for
            the gradient one process would have).
        group: process group (default: the world). timeout: seconds to wait for a peer (default 300).
        stats: a :class:`~attnlab.distributed.CommStats` to add this call's bytes and messages to.

    Returns:
        This rank's output shard, or ``(out, final_state)``; differentiable in every tensor (every
        rank must run backward: the gradients of the gathered states are summed across ranks).

    Raises:
        TypeError, ValueError: a bad argument (as :func:`attnlab.linear_attention`); ranks that
            disagree on shapes, dtype, options or the initial state.
        RuntimeError: torch.distributed not initialised; a peer failed or timed out.

    Example (under ``torchrun``; see the module docstring)::

        out_l, state = context_parallel_linear_attention(q_l, k_l, v_l, beta=beta_l, return_state=True)
    """
    who = peers(group, timeout)
    call = linear_call(q, k, v, decay=decay, beta=beta, scale=scale, initial_state=initial_state, cu_seqlens=None)
    if stats is not None and not isinstance(stats, CommStats):
        raise TypeError(f"stats must be a CommStats or None, got {type(stats).__name__}")
    check_agreement({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "dtype": q.dtype,
                     "decay": None if decay is None else tuple(decay.shape),
                     "beta": None if beta is None else tuple(beta.shape), "scale": call.scale,
                     "initial_state": initial_state, "backend": backend, "return_state": return_state,
                     "grad": torch.is_grad_enabled()}, who, q.device)
    B, _, Hv, T, Dk, Dv = call.sizes
    # The arguments were checked above: the two runs read no values again (_run(values=False)).
    options = dict(decay=decay, beta=beta, scale=call.scale, cu_seqlens=None, backend=backend, values=False)
    own, writes = _run(q, k, v, initial_state=None, **options)  # from a zero state: o(0), B
    eye = torch.eye(Dk, dtype=call.state_dtype, device=q.device).expand(B, Hv, Dk, Dk)
    reads, transition = _run(q, k, q.new_zeros(B, Hv, T, Dk), initial_state=eye, **options)  # r, A
    table = all_gather(torch.cat([transition, writes], dim=-1), who, what="linear attention: the chunk states",
                       stats=stats)  # (P, B, Hv, Dk, Dk + Dv)
    # The state entering rank 0, 1, ...: S_in(r + 1) = A_r S_in(r) + B_r, up to this rank (or past the last).
    states = [initial_state.to(call.state_dtype) if initial_state is not None else writes.new_zeros(B, Hv, Dk, Dv)]
    for rank in range(who.world if return_state else who.rank):
        states.append(table[rank, ..., :Dk] @ states[-1] + table[rank, ..., Dk:])  # (B, Hv, Dk, Dv)
    out = own + (reads.to(call.state_dtype) @ states[who.rank]).to(own.dtype)  # (B, Hv, T, Dk) @ (B, Hv, Dk, Dv)
    out = _Joined.apply(out, table)
    return (out, states[-1]) if return_state else out
