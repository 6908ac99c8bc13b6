"""The log-sum-exp algebra of attention written once: partial results, sinks, empty rows.

A partial result over some keys is ``(out, lse)``: the rows' softmax-weighted values and the
log of their mass. Partials over disjoint keys merge by their lse (ring attention's shards,
blocks' kernel runs), an online softmax builds one tile by tile (chunked), and a sink is one
more key of value 0 folded into the normalisation (every backend with sinks). A row that saw
no key has ``lse = -inf`` and ``out = 0``, and stays so through every function here, never
NaN. The backward's shared pieces (``D = rowsum(dO * O)``, ``dS = P (dP - D)``, the sinks'
gradient) and the autograd skeleton of the tiled kernels live here too.

Example:
    >>> import torch
    >>> s, v = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    >>> halves = [(torch.softmax(s[:, i], -1) @ v[i], s[:, i].logsumexp(-1)) for i in (slice(0, 5), slice(5, 8))]
    >>> out, lse = merge(halves)
    >>> bool(torch.allclose(out, torch.softmax(s, -1) @ v)), bool(torch.allclose(lse, s.logsumexp(-1)))
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab.backends.transforms import gradients_function, vmap_by_slices
from attnlab.scores import sink_gradient, sink_logits

__all__ = ["merge", "merge_", "fold_sinks", "sinks_gradient", "sink_row_gradient", "row_delta", "score_gradient_",
           "Online", "online_start", "online_step", "online_finish", "lift", "row_parts", "kernel_function"]

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- merging partials
def merge(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Partials ``(out, lse)`` over disjoint keys merged into one, shifted by the rows' max.

    Shapes: each out ``(..., T, Dv)``, lse ``(..., T)`` -> the same. Differentiable; a row empty
    in every partial gives out 0 and lse ``-inf`` with zero gradient.

    Example:
        >>> empty = (torch.zeros(1, 2), torch.tensor([float("-inf")]))
        >>> merge([empty, empty])
        (tensor([[0., 0.]]), tensor([-inf]))
    """
    outs, lses = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])  # (n, ..., T[, Dv])
    top = lses.amax(dim=0)  # (..., T)
    alive = top != _NEG_INF
    shift = torch.where(alive, top, 0.0)
    weights = torch.exp(lses - shift)  # (n, ..., T); 0 for an empty partial
    total = weights.sum(dim=0)
    lse = torch.where(alive, shift + torch.log(torch.where(alive, total, 1.0)), _NEG_INF)
    out = (outs * (weights / torch.where(alive, total, 1.0)).unsqueeze(-1).to(outs.dtype)).sum(dim=0)
    return out, lse


def merge_(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """Fold one partial into the running ``out`` ``(..., T, Dv)`` and ``lse`` ``(..., T)``, in place
    (``part_out`` is consumed, so a merge allocates nothing of the output's size).

    Example:
        >>> out, lse = torch.zeros(1, 1), torch.tensor([float("-inf")])  # nothing seen yet
        >>> merge_(out, lse, torch.ones(1, 1), torch.zeros(1))
        >>> out, lse
        (tensor([[1.]]), tensor([0.]))
    """
    new = torch.logaddexp(lse, part_lse)  # (..., T); -inf only where both are
    safe = new.masked_fill(new == _NEG_INF, 0.0)
    old_weight = torch.exp(lse - safe).unsqueeze(-1)  # (..., T, 1); 0 while nothing was seen
    out.mul_(old_weight).add_(part_out.to(out.dtype).mul_(torch.exp(part_lse - safe).unsqueeze(-1)))
    lse.copy_(new)


# ----------------------------------------------------------------------------- sinks
def fold_sinks(out: Tensor, lse: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the keys with each row's sink (a key of logit ``logits``, value 0) added.

    The lse grows to ``logaddexp(lse, sink)`` and out shrinks by the keys' share
    ``exp(lse - new lse)``; a row with no key gets 0 (the sink takes all the mass).

    Args:
        out: ``(..., T, Dv)``; lse: ``(..., T)``.
        logits: broadcastable to lse, from :func:`sink_logits` (so ``±inf`` are finite stand-ins).

    Example:
        >>> fold_sinks(torch.ones(1, 2), torch.zeros(1), torch.zeros(1))   # one key, one sink: halves
        (tensor([[0.5000, 0.5000]]), tensor([0.6931]))
    """
    total = torch.logaddexp(lse, logits)  # (..., T)
    share = torch.where(lse == _NEG_INF, 0.0, torch.exp(lse - total))  # the keys' share
    return out * share.unsqueeze(-1).to(out.dtype), total


def sinks_gradient(sinks: Tensor, logits: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """The sinks' gradient ``-sum p_sink * D``, in the sinks' shape and dtype.

    A sink's value is 0, so its logit's gradient per row is ``-exp(sink - lse) * D`` with ``lse``
    including the sinks and ``D = rowsum(dO * O)`` (:func:`row_delta`), summed over what the sinks
    broadcast over.

    Args:
        sinks: ``(Hq,)`` or ``(B|1, Hq|1, Tq)``; logits: theirs from :func:`sink_logits`.
        lse, delta: ``(B, Hq, Tq)``.

    Example:
        >>> sinks_gradient(torch.zeros(1), torch.zeros(1, 1, 1), torch.zeros(1, 1, 2), torch.ones(1, 1, 2))
        tensor([-2.])
    """
    return sink_gradient(sink_row_gradient(logits, lse, delta), sinks)


def sink_row_gradient(logits: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """Each row's ``-exp(sink - lse) * D`` (shapes broadcast), before :func:`sinks_gradient` sums it.

    Example:
        >>> sink_row_gradient(torch.zeros(1), torch.zeros(1), torch.ones(1))
        tensor([-1.])
    """
    return (torch.exp(logits - lse) * delta).neg_()


# ----------------------------------------------------------------------------- backward pieces
def row_delta(d_out: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """``D = rowsum(dO * O)`` ``(..., T)`` in ``dtype``: FlashAttention's backward term.

    Example:
        >>> row_delta(torch.ones(1, 2), torch.full((1, 2), 3.0), torch.float64)
        tensor([6.], dtype=torch.float64)
    """
    return (d_out.to(dtype) * out.to(dtype)).sum(dim=-1)


def score_gradient_(probs: Tensor, d_probs: Tensor, delta: Tensor) -> Tensor:
    """``dS = P * (dP - D)`` ``(..., bq, bk)`` of one tile, written into ``d_probs``.

    delta: ``(..., bq, 1)``.

    Example:
        >>> score_gradient_(torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 3.0]]), torch.tensor([[2.0]]))
        tensor([[-0.5000,  0.5000]])
    """
    return d_probs.sub_(delta).mul_(probs)


# ----------------------------------------------------------------------------- the online softmax
class Online(NamedTuple):
    """One query block's running softmax: row max and sum ``(B, H, bq, 1)``, unnormalised out
    ``(B, H, bq, Dv)``."""

    row_max: Tensor
    row_sum: Tensor
    acc: Tensor


def online_start(shape: tuple, width: int, dtype: torch.dtype, device: torch.device) -> Online:
    """An empty running softmax for rows ``shape`` ``(B, H, bq)`` and values of ``width``.

    Example:
        >>> online_start((1, 1, 2), 3, torch.float32, torch.device("cpu")).acc.shape
        torch.Size([1, 1, 2, 3])
    """
    row_max = torch.full((*shape, 1), _NEG_INF, dtype=dtype, device=device)
    return Online(row_max, torch.zeros_like(row_max), torch.zeros(*shape, width, dtype=dtype, device=device))


def lift(t: Tensor) -> Tensor:
    """``-inf`` (a row with nothing seen) lifted to the lowest finite value, so that ``exp(s - t)``
    is 0 for blocked scores, never NaN; finite values, however negative, are unchanged.

    Example:
        >>> lift(torch.tensor([float("-inf"), -1.0])).tolist() == [torch.finfo(torch.float32).min, -1.0]
        True
    """
    return t.clamp_min(torch.finfo(t.dtype).min)


def online_step(state: Online, scores: Tensor, v: Tensor, keep_scale: Tensor | None = None) -> Online:
    """Fold one tile of scores ``(B, H, bq, bk)`` (consumed: ``-inf`` where blocked) and its values
    ``(B, H, bk, Dv)`` into the running softmax; ``keep_scale`` is dropout's factor on the weights.

    Example:
        >>> state = online_start((1, 1, 1), 1, torch.float32, torch.device("cpu"))
        >>> state = online_step(state, torch.zeros(1, 1, 1, 2), torch.tensor([[[[1.0], [3.0]]]]))
        >>> online_finish(state)[0].item()
        2.0
    """
    row_max, row_sum, acc = state
    new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
    safe_max = lift(new_max)
    probs = torch.exp_(scores.sub_(safe_max))  # (B, H, bq, bk), in place
    rescale = torch.exp(row_max - safe_max)  # 0 while nothing was seen
    row_sum = row_sum.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
    if keep_scale is not None:
        probs = probs.mul_(keep_scale)
    return Online(new_max, row_sum, acc.mul_(rescale).add_(torch.matmul(probs, v)))


def online_finish(state: Online, sink: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The block's out ``(B, H, bq, Dv)`` and lse ``(B, H, bq)``, the sinks ``(B|1, H|1, bq|1)``
    (logits) folded in, and the lse in two parts ``(B, H, bq, 2)`` for the backward.

    The parts are ``(shift, rest)``, each weight being ``exp(s - shift - rest)``: the row's max
    and the log of its sum (the sinks included). ``lse = max + log(sum)`` rounds to the max when
    the max is huge (a float mask row held at ``finfo.min``: its weights are a uniform 1/Tk, and
    ``exp(s - lse)`` gave each key weight 1); the two parts keep it exact. A row with no key has
    shift 0 and rest the sink's logit, or ``+inf`` (weights 0) without sinks.

    Example:
        >>> state = online_start((1, 1, 1), 1, torch.float32, torch.device("cpu"))
        >>> online_finish(state)[:2]     # nothing seen: a zero row, lse -inf
        (tensor([[[[0.]]]]), tensor([[[-inf]]]))
    """
    row_max, row_sum, acc = state
    alive = row_sum != 0  # (B, H, bq, 1); NaN (from NaN or inf - inf) propagates
    out = torch.where(alive, acc / torch.where(alive, row_sum, 1.0), 0.0)
    lse = torch.where(alive, row_max + torch.log(row_sum), _NEG_INF)[..., 0]  # (B, H, bq)
    shift = torch.where(alive, row_max, 0.0)  # (B, H, bq, 1)
    rest = torch.where(alive, torch.log(row_sum), _NEG_INF)
    if sink is not None:
        rest = torch.logaddexp(rest, sink.unsqueeze(-1) - shift)
        out, lse = fold_sinks(out, lse, sink)
    rest = rest.masked_fill(rest == _NEG_INF, float("inf"))
    return out, lse, torch.cat([shift, rest], dim=-1)


def row_parts(lse: Tensor, qs: int, qe: int) -> tuple[Tensor, Tensor]:
    """``(shift, rest)`` ``(B, H, bq, 1)`` of rows ``qs:qe`` from :func:`online_finish`'s parts
    ``(B, H, Tq, 2)``, or from an lse ``(B, H, Tq)`` (a caller's: shift the lifted lse, rest 0).

    Example:
        >>> shift, rest = row_parts(torch.tensor([[[1.0, 2.0]]]), 1, 2)
        >>> shift.flatten().tolist(), rest.item()
        ([2.0], 0.0)
    """
    if lse.dim() == 4:
        part = lse[:, :, qs:qe]  # (B, H, bq, 2)
        return part[..., :1], part[..., 1:]
    return lift(lse[:, :, qs:qe, None]), lse.new_zeros(())


# ----------------------------------------------------------------------------- the autograd skeleton
def kernel_function(name: str, forward: Callable, gradients: Callable) -> type:
    """The ``torch.autograd.Function`` of a kernel that returns ``(out, lse, *extra)``.

    ``apply(plan, *tensors)``: ``forward(plan, *tensors) -> (out, lse, *extra)``, every output
    but ``out`` not differentiable. The backward pass is a Function of its own
    (:func:`attnlab.backends.transforms.gradients_function`):
    ``gradients(plan, needs, d_out, tensors, outputs)`` returns one gradient per tensor (None
    where not needed), ``needs`` being the frozenset of the tensors' positions that need one. Both
    map ``torch.func.vmap`` slice by slice (:func:`attnlab.backends.transforms.vmap_by_slices`).

    Example:
        >>> Twice = kernel_function("twice", lambda plan, x: (x * plan, x.sum(-1)),
        ...                         lambda plan, needs, d_out, tensors, outputs: (d_out * plan,))
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> out, lse = Twice.apply(2.0, x)
        >>> torch.autograd.grad(out.sum(), x)[0].tolist()
        [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """
    # A frozenset, not a tuple: torch.func would map a tuple's entries as vmapped arguments.
    Gradients = gradients_function(name, lambda d_out, plan, needs, count, *saved: gradients(
        plan, needs, d_out, saved[:count], saved[count:]))

    class Kernel(torch.autograd.Function):
        @staticmethod
        def forward(plan, *tensors):
            return forward(plan, *tensors)

        @staticmethod
        def setup_context(ctx, inputs, output):
            plan, *tensors = inputs
            ctx.save_for_backward(*tensors, *output)
            ctx.plan, ctx.count = plan, len(tensors)
            ctx.mark_non_differentiable(*(t for t in output[1:] if t is not None))

        @staticmethod
        def backward(ctx, d_out, *_):
            needs = frozenset(i for i, need in enumerate(ctx.needs_input_grad[1:]) if need)
            return None, *Gradients.apply(d_out, ctx.plan, needs, ctx.count, *ctx.saved_tensors)

        @staticmethod
        def vmap(info, in_dims, *args):
            return vmap_by_slices(Kernel.apply, info, in_dims, *args)

    Kernel.__name__ = Kernel.__qualname__ = f"{name.capitalize()}Function"
    return Kernel
