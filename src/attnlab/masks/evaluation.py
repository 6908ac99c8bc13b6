"""Evaluating a mask mod on index grids, by FlexAttention's semantics.

A mod means what it returns for one position (0-d indices). A plain callable is therefore
evaluated through ``torch.vmap``; a mod that declares ``broadcasts = True`` (attnlab's own) is
called once on broadcast index tensors, the fast path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnlab._checks import broadcast_shape, non_negative_int


class _IndexWithTensors(torch.overrides.TorchFunctionMode):
    """``x[i]`` with integer or tensor indices becomes ``aten.index``, as FlexAttention does.

    Python indexing turns a 0-d index tensor into a Python int (``.item()``), which ``vmap``
    refuses; ``aten.index`` keeps it a tensor, so ``intervals[image_of[kv_idx]]`` maps. This is
    the rule of torch's ``TransformGetItemToIndex``, which ``create_mask`` runs mods under,
    written here because that class is private.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is Tensor.__getitem__:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if all(isinstance(i, (Tensor, int)) and not isinstance(i, bool) for i in index):
                device = args[0].device
                return torch.ops.aten.index(args[0], [
                    i if isinstance(i, Tensor) else torch.tensor(i, device=device) for i in index])
        return func(*args, **(kwargs or {}))


class _NotOneValue(ValueError):
    """A mod returned more than one value for one position: no evaluation can make it a mask."""


def _scalar_call(mod: Callable) -> Callable:
    """``mod`` called on 0-d indices; what vmap maps. One value per position, or an error."""

    def call(*indices):
        allowed = mod(*(i.reshape(()) if isinstance(i, Tensor) and i.dim() else i for i in indices))
        if isinstance(allowed, Tensor) and allowed.numel() != 1:
            raise _NotOneValue(f"returned shape {tuple(allowed.shape)} for one position")
        return allowed.reshape(()) if isinstance(allowed, Tensor) else allowed

    return call


def _mod_indices_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The broadcast shape of a mask mod's index tensors (ValueError when they do not broadcast)."""
    shape = broadcast_shape(shapes)
    if shape is None:
        raise ValueError(f"mask mod indices of shapes {shapes} do not broadcast")
    return shape


def _vmapped(mod: Callable, indices: tuple) -> Tensor:
    """``mod`` on each position of the broadcast index tensors, through nested ``torch.vmap``.

    FlexAttention's ``create_mask`` nests one vmap per axis of ``(b, h, q_idx, kv_idx)``; here
    an axis is mapped only where some index varies along it, and each index tensor only along
    the axes where it is longer than 1, so the result keeps size 1 (or a stride-0 axis, cut
    back to size 1) where the mod ignores an axis, and no full index grid is ever built.
    """
    tensors = [i for i in indices if isinstance(i, Tensor)]
    shape = _mod_indices_shape([tuple(t.shape) for t in tensors])
    padded = [i.view((1,) * (len(shape) - i.dim()) + tuple(i.shape)) if isinstance(i, Tensor) else i
              for i in indices]
    if 0 in shape:
        return torch.zeros(shape, dtype=torch.bool, device=tensors[0].device)
    axes = [axis for axis, size in enumerate(shape) if size > 1]
    fn = _scalar_call(mod)
    for axis in reversed(axes):  # the last wrapped vmap is the outermost: axes[0]
        in_dims = tuple(
            axis - sum(1 for a in axes if a < axis and i.shape[a] > 1)  # axes outer levels took
            if isinstance(i, Tensor) and i.shape[axis] > 1 else None for i in padded)
        fn = torch.vmap(fn, in_dims=in_dims)
    with _IndexWithTensors():
        allowed = fn(*padded)
    allowed = allowed.reshape(shape)
    for axis in axes:
        if allowed.stride(axis) == 0:  # the mod ignores this axis: vmap expanded it
            allowed = allowed.narrow(axis, 0, 1)
    return allowed


def _on_grid(mod: Callable, indices: tuple) -> Tensor:
    """``mod`` called once on the index tensors; its result must broadcast to their shape."""
    allowed = mod(*indices)
    shape = _mod_indices_shape([tuple(i.shape) for i in indices if isinstance(i, Tensor)])
    got = tuple(torch.as_tensor(allowed).shape)
    if len(got) > len(shape) or broadcast_shape([got, shape]) != shape:
        raise ValueError(f"returned shape {got} for index tensors of shape {shape}")
    return allowed


def _unevaluable(subject: str, kind: str, scalar_err: BaseException, grid_err: BaseException) -> TypeError:
    """The one error for a user's mod that fails both on 0-d indices under vmap and on index grids
    (mask mods here, score mods in :mod:`attnlab.scores`)."""
    return TypeError(
        f"{subject} cannot be evaluated. attnlab evaluates {kind} as FlexAttention does, once per "
        f"position on 0-d index tensors under torch.vmap, where {_first_line(scalar_err)}; called on "
        f"whole index tensors instead, {_first_line(grid_err)}. Write it with tensor operations on the "
        "indices (torch.where for choices; no .item(), int(), bool() or Python if/while on index values)")


def _first_line(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0].split(". ")[0]  # vmap's text goes on
    return f"{type(err).__name__}: {first}"


def apply_mod(mod: Callable, b, h, q_idx, kv_idx) -> Tensor:
    """A mask mod at every position of broadcast index tensors, by FlexAttention's semantics.

    A mod means what it returns on 0-d indices, so a plain callable is mapped with ``torch.vmap``
    over the axes its indices vary along (a FlexAttention mod such as
    ``intervals[image_of[kv_idx]]`` and an elementwise ``kv_idx <= q_idx`` both work); a mod
    with ``broadcasts = True`` is called once on the grids (the fast path), and so is a callable
    vmap refuses (``.numpy()``, data-dependent shapes).

    Args:
        mod: a mask mod ``(b, h, q_idx, kv_idx) -> bool``.
        b, h, q_idx, kv_idx: ints or index tensors that broadcast together.

    Returns:
        The mod's values, broadcastable to the indices' broadcast shape (size 1 along an axis
        the mod ignores).

    Raises:
        TypeError: the mod can be evaluated neither way; the message names ``mask``, the mod
            and both errors. An error the mod raises the same way both times (its own
            ``raise``) propagates as it is.

    Example:
        >>> intervals = torch.tensor([[0, 2], [2, 4]])     # image i is seen by queries [lo, hi)
        >>> image_of = torch.tensor([0, 0, 1])              # image of each key (attention-gym)
        >>> def flamingo(b, h, q_idx, kv_idx):
        ...     interval = intervals[image_of[kv_idx]]
        ...     return (q_idx >= interval[0]) & (q_idx < interval[1])
        >>> apply_mod(flamingo, 0, 0, torch.arange(4)[:, None], torch.arange(3)).int()
        tensor([[1, 1, 0],
                [1, 1, 0],
                [0, 0, 1],
                [0, 0, 1]], dtype=torch.int32)
    """
    indices = (b, h, q_idx, kv_idx)
    if getattr(mod, "broadcasts", False) or all(
            not isinstance(i, Tensor) or i.dim() == 0 for i in indices):  # one position: call it
        return mod(*indices)
    name = getattr(mod, "__qualname__", None) or repr(mod)
    try:
        return _vmapped(mod, indices)
    except _NotOneValue as err:
        raise TypeError(f"mask: the mask mod {name} {err} (b, h, q_idx, kv_idx); a mask mod "
                        f"returns one bool per position, as in FlexAttention") from None
    except Exception as scalar_err:  # noqa: BLE001 -- any failure under vmap: try the grid
        try:
            return _on_grid(mod, indices)
        except Exception as grid_err:  # noqa: BLE001
            if _first_line(grid_err) == _first_line(scalar_err):
                raise  # the mod's own error, whichever way it is called: the user's to see
            raise _unevaluable(f"mask: the mask mod {name}", "a mask mod", scalar_err, grid_err) from scalar_err


def evaluate(
    mod: Callable,
    *,
    q_range: tuple[int, int],
    kv_range: tuple[int, int],
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluate a mask mod on the index grid ``q_range x kv_range`` (one tile or the whole matrix).

    Each position gets the value the mod gives it on 0-d indices (see :func:`apply_mod`).

    Args:
        mod: a mask mod ``(b, h, q_idx, kv_idx) -> bool``.
        q_range, kv_range: ``(start, end)`` query and key indices (end excluded).
        batch, heads: sizes of the batch and head axes to evaluate.
        device: where to build the index tensors.

    Returns:
        Bool tensor broadcastable to ``(batch, heads, q_end - q_start, kv_end - kv_start)``
        (axes the mod ignores stay size 1), True = may attend.

    Example:
        >>> evaluate(lambda b, h, q, kv: kv <= q, q_range=(2, 4), kv_range=(0, 4)).int()
        tensor([[[[1, 1, 1, 0],
                  [1, 1, 1, 1]]]], dtype=torch.int32)
    """
    (qs, qe), (ks, ke) = q_range, kv_range
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    q_idx = torch.arange(qs, qe, device=device).view(1, 1, qe - qs, 1)
    kv_idx = torch.arange(ks, ke, device=device).view(1, 1, 1, ke - ks)
    allowed = torch.as_tensor(apply_mod(mod, b, h, q_idx, kv_idx), device=device)
    if allowed.dtype != torch.bool:
        raise TypeError(f"mask mod {mod!r} must return a bool tensor, got dtype {allowed.dtype}")
    return allowed


def materialize(
    mod: Callable,
    *,
    tq: int,
    tk: int,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluate a mask mod on every index and return a dense bool mask.

    Args:
        mod: a mask mod ``(b, h, q_idx, kv_idx) -> bool``.
        tq, tk: numbers of queries and keys.
        batch, heads: sizes of the batch and head axes to evaluate.
        device: where to build the index tensors.

    Returns:
        Bool tensor of shape ``(batch, heads, tq, tk)`` (a broadcast view where the mod
        ignores an axis), True = may attend.

    Example:
        >>> materialize(lambda b, h, q, kv: kv <= q, tq=2, tk=3, batch=2).shape
        torch.Size([2, 1, 2, 3])
    """
    if not callable(mod):
        raise TypeError(f"mod must be a mask mod (b, h, q_idx, kv_idx) -> bool, got {mod!r}")
    for name, size in (("tq", tq), ("tk", tk), ("batch", batch), ("heads", heads)):
        non_negative_int(name, size)
    allowed = evaluate(mod, q_range=(0, tq), kv_range=(0, tk), batch=batch, heads=heads, device=device)
    return allowed.expand(batch, heads, tq, tk)
