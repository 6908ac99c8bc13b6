"""The backends' autograd Functions under ``torch.func`` transforms.

A backend whose kernel is a ``torch.autograd.Function`` (``chunked``, ``blocks``) writes it in
the form ``torch.func`` asks for: ``forward`` without ``ctx``, a ``setup_context``, and a
``vmap`` rule. The rule is :func:`vmap_by_slices`: the kernel runs once per slice of the
vmapped dim, on plain tensors, and the results are stacked, so a kernel written with in-place
updates, strided views and fused ops never sees a batched tensor. The backward pass is a
second Function with the same rule (:func:`gradients_function`), so ``vmap`` over ``grad`` (``jacrev``, per-sample
gradients) maps it the same way. Each slice is exactly the call without the transform.
What a backend derives from a call's mask and sizes alone (blocks' plan) is computed
:func:`outside_transforms`, a constant to every transform.

Example:
    >>> import torch
    >>> class Double(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(x):
    ...         return x * 2
    ...     @staticmethod
    ...     def setup_context(ctx, inputs, output):
    ...         pass
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return grad * 2
    ...     @staticmethod
    ...     def vmap(info, in_dims, x):
    ...         return vmap_by_slices(Double.apply, info, in_dims, x)
    >>> torch.func.vmap(Double.apply)(torch.ones(3, 2)).tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["vmap_by_slices", "gradients_function", "outside_transforms"]


def vmap_by_slices(apply: Callable, info: Any, in_dims: tuple, *args: Any) -> tuple:
    """The ``vmap`` staticmethod of a kernel Function: ``apply`` once per slice, stacked.

    Args:
        apply: the Function's ``apply``.
        info: torch.func's ``VmapInfo`` (``batch_size``, ``randomness``).
        in_dims: the vmapped dim of each argument, None for an argument not vmapped (and for
            every non-tensor).
        *args: the Function's arguments, unwrapped by torch.func.

    Returns:
        ``(outputs, out_dims)`` as torch.func wants them: each tensor output stacked along dim 0
        (out dim 0), a None output left None (out dim None). A kernel that draws its random
        numbers before ``apply`` (chunked's dropout seed) gives every slice the same ones, the
        rule of ``randomness="same"``.

    Example:
        >>> info = type("Info", (), {"batch_size": 2, "randomness": "error"})()
        >>> out, dims = vmap_by_slices(torch.add, info, (0, None), torch.ones(2, 3), torch.ones(3))
        >>> out.shape, dims
        (torch.Size([2, 3]), 0)
    """
    if info.batch_size == 0:
        raise ValueError("vmap over a dim of size 0 is not supported by attnlab's kernels")
    per_slice = [apply(*(arg if dim is None else arg.select(dim, i) for arg, dim in zip(args, in_dims)))
                 for i in range(info.batch_size)]
    if not isinstance(per_slice[0], tuple):
        return torch.stack(per_slice), 0
    outputs = tuple(None if column[0] is None else torch.stack(column) for column in zip(*per_slice))
    return outputs, tuple(None if out is None else 0 for out in outputs)


def gradients_function(name: str, compute: Callable) -> type:
    """A backend's backward pass as a ``torch.autograd.Function`` written for ``torch.func``:
    ``forward`` is ``compute``, ``vmap`` maps it slice by slice (:func:`vmap_by_slices`), and
    asking it for gradients of gradients raises a clear error (its backward is a kernel of its
    own, not differentiable).

    Args:
        name: the backend, for the error.
        compute: ``compute(*args) -> tensors``, the gradients from the saved inputs and ``d_out``.

    Example:
        >>> Twice = gradients_function("demo", lambda d_out, x: d_out * 2)
        >>> torch.func.vmap(Twice.apply, in_dims=(0, None))(torch.ones(3, 2), torch.ones(2)).tolist()
        [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """

    class Gradients(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            return compute(*args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, *grads):
            raise RuntimeError(f"{name}: gradients of gradients (double backward) are not implemented; "
                               "its backward pass is a kernel of its own (backend='reference' "
                               "differentiates twice)")

        @staticmethod
        def vmap(info, in_dims, *args):
            return vmap_by_slices(Gradients.apply, info, in_dims, *args)

    Gradients.__name__ = Gradients.__qualname__ = f"{name.capitalize()}Gradients"
    return Gradients


def outside_transforms():
    """A context in which ``torch.func``'s transforms are paused: tensors made there are plain.

    For what depends on a call's mask and sizes only, never on q, k or v (the blocks backend's
    plan of kernel calls). Made under ``torch.func.grad`` it would consist of the transform's
    wrapper tensors, which hold no data (``.numpy()`` fails), cannot enter a kernel that runs
    below the transform, and must not outlive it in a cache. (torch offers no public name for
    this; ``torch.testing`` and dynamo use the same guard.) Outside any transform it is a no-op,
    so that a plan may still use ``torch.vmap`` itself (a FlexAttention-style mask mod is evaluated
    through it); inside one, such a mod cannot be planned.

    Example:
        >>> seen = []
        >>> def f(x):
        ...     with outside_transforms():
        ...         seen.append(torch.arange(3).numpy())  # plain, so it has data for numpy
        ...     return x.sum()
        >>> _ = torch.func.grad(f)(torch.ones(2))
        >>> seen[0].tolist()
        [0, 1, 2]
    """
    if torch._C._functorch.maybe_current_level() is None:  # no transform is active
        return contextlib.nullcontext()
    return torch._C._DisableFuncTorch()
