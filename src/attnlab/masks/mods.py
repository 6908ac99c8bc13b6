"""The mask-mod protocol (:class:`MaskMod`), its key ranges and value key, and combinators.

A mask mod ``mod(b, h, q_idx, kv_idx) -> bool`` says which keys a query may attend (True =
attend). :class:`MaskMod` adds what lets a backend skip work: the key range of a block of
queries (``kv_bounds``) and one key interval per query row (``row_ranges``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

import torch
from torch import Tensor

from attnlab.masks.evaluation import apply_mod

MaskLike = Union[Tensor, Callable, None]


class MaskMod:
    """Base class of a mask mod that knows which keys its queries can reach.

    A subclass implements ``__call__(b, h, q_idx, kv_idx)`` with tensor operations (True = may
    attend) and may add :meth:`kv_bounds` (lets tiled backends skip key blocks),
    :meth:`row_ranges` (lets :func:`~attnlab.masks.prepare` plan it) and :meth:`check_sizes`.
    With ``broadcasts = True`` (the default) it promises that one call on broadcast index
    grids ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``q_idx (1,1,Tq,1)``, ``kv_idx (1,1,1,Tk)`` gives
    every position's value, the fast path; ``broadcasts = False`` has it evaluated per position
    under ``torch.vmap``, like any plain callable (:func:`~attnlab.masks.apply_mod`).

    Example:
        >>> from attnlab.masks import materialize
        >>> class EvenKeys(MaskMod):
        ...     def __call__(self, b, h, q_idx, kv_idx):
        ...         return kv_idx % 2 == 0
        >>> materialize(EvenKeys() & (lambda b, h, q, kv: kv <= q), tq=3, tk=3)[0, 0].int()
        tensor([[1, 0, 0],
                [1, 0, 0],
                [1, 0, 1]], dtype=torch.int32)
    """

    broadcasts = True

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def kv_bounds(self, q_start: int, q_end: int) -> tuple[int, int] | None:
        """Half-open key range ``[lo, hi)`` that queries ``q_start..q_end-1`` may reach; None
        (the default) when the mod cannot tell."""
        return None

    def form(self) -> tuple:
        """The mask's structure, stated by the mod so that no backend inspects mod classes:
        ``("causal", offset)``; ``("padding", lengths, causal)`` (each row's first ``lengths[b]``
        keys, with top-left causal when ``causal``); ``("varlen", q_lengths, k_lengths)``
        (causal within each row's real queries and keys, bottom-right); ``("mod",)`` for any
        other mask, the default. Only attnlab's own classes state a form (a subclass may
        change what it masks: it is ``("mod",)``).

        Example:
            >>> import torch
            >>> from attnlab.masks import causal_mod, padding_mod
            >>> (causal_mod(4, 4) & padding_mod(torch.tensor([3]))).form()[0::2]
            ('padding', True)
        """
        return ("mod",)

    def row_ranges(self, q: Tensor, tk: int) -> tuple | None:
        """The mod as one key interval per query row and, optionally, a segment per position.

        Query ``q`` of batch row ``b`` may attend key ``j`` exactly when ``lo[b, q] <= j <=
        hi[b, q]`` and, with segments, ``q_segment[b, q] == k_segment[b, j]`` (an empty row has
        ``hi < lo``). Every attnlab pattern and an AND of them has this form; an OR or a mod of
        your own returns None (the default).

        Args:
            q: ``(1, n)`` int64 query positions.
            tk: the number of keys.

        Returns:
            ``(lo, hi, segments)``: ints or int64 tensors broadcasting to ``(B|1, n)``, and None
            or ``(q_segment (B|1, n), k_segment (B|1, tk))``; or None.

        Example:
            >>> from attnlab.masks import sliding_window_mod
            >>> lo, hi, _ = sliding_window_mod(4, 4, 2).row_ranges(torch.arange(4).view(1, -1), 4)
            >>> lo.tolist(), hi.tolist()
            ([[-1, 0, 1, 2]], [[0, 1, 2, 3]])
        """
        return None

    def check_sizes(self, *, batch: int, heads: int, tq: int, tk: int) -> None:
        """Raise ``ValueError`` naming ``mask`` if the mod cannot serve a call of these sizes.

        Called once per call, before any backend evaluates the mod, so a mod that would index
        out of range fails with a message, not an ``IndexError`` inside a kernel.

        Example:
            >>> from attnlab.masks import padding_mod
            >>> padding_mod(torch.tensor([2, 3])).check_sizes(batch=3, heads=1, tq=4, tk=4)
            Traceback (most recent call last):
            ...
            ValueError: mask: PaddingMod has 2 lengths but the batch has 3 rows
        """

    def __and__(self, other: Callable) -> "CombinedMod":
        return CombinedMod((self, other), "and")

    def __or__(self, other: Callable) -> "CombinedMod":
        return CombinedMod((self, other), "or")


class CombinedMod(MaskMod):
    """Logical AND or OR of several mask mods (what :func:`and_masks` / :func:`or_masks` make);
    the bounds are combined when every part has some.

    Example:
        >>> from attnlab.masks import causal_mod, sliding_window_mod
        >>> (causal_mod(8, 8) & sliding_window_mod(8, 8, 2)).kv_bounds(4, 6)
        (3, 6)
    """

    def __init__(self, mods: tuple[Callable, ...], op: str):
        if op not in ("and", "or"):
            raise ValueError(f"op must be 'and' or 'or', got {op!r}")
        self.mods = tuple(mods)
        self.op = op

    def __call__(self, b, h, q_idx, kv_idx):
        result = apply_mod(self.mods[0], b, h, q_idx, kv_idx)
        for mod in self.mods[1:]:
            other = apply_mod(mod, b, h, q_idx, kv_idx)
            result = (result & other) if self.op == "and" else (result | other)
        return result

    def kv_bounds(self, q_start, q_end):
        bounds = [_bounds_of(mod, q_start, q_end) for mod in self.mods]
        known = [bound for bound in bounds if bound is not None]
        if self.op == "and":
            if not known:
                return None
            lo = max(bound[0] for bound in known)
            return lo, max(lo, min(bound[1] for bound in known))
        if len(known) < len(bounds):
            return None
        return min(bound[0] for bound in known), max(bound[1] for bound in known)

    def form(self):
        """A padding mod ANDed with top-left causal is a padded causal batch; else ``("mod",)``."""
        if self.op != "and" or type(self) is not CombinedMod:
            return ("mod",)
        forms = [part.form() if isinstance(part, MaskMod) else ("mod",) for part in self.mods]
        padding = [form for form in forms if form[0] == "padding" and not form[2]]
        if len(padding) == 1 and all(form == ("causal", 0) for form in forms if form[0] != "padding"):
            return ("padding", padding[0][1], len(forms) > 1)
        return ("mod",)

    def row_ranges(self, q, tk):
        """An AND intersects its parts' intervals and pairs their segments; an OR has no form."""
        if self.op != "and":
            return None
        lo, hi, segments = 0, tk - 1, None
        for part in self.mods:
            ranges = part.row_ranges(q, tk) if isinstance(part, MaskMod) else None
            if ranges is None:
                return None
            lo = torch.maximum(torch.as_tensor(lo), torch.as_tensor(ranges[0]))
            hi = torch.minimum(torch.as_tensor(hi), torch.as_tensor(ranges[1]))
            segments = _pair_segments(segments, ranges[2])
        return lo, hi, segments

    def check_sizes(self, *, batch, heads, tq, tk):
        for mod in self.mods:
            if isinstance(mod, MaskMod):
                mod.check_sizes(batch=batch, heads=heads, tq=tq, tk=tk)

    def __repr__(self) -> str:
        return f"CombinedMod({', '.join(map(repr, self.mods))}, op={self.op!r})"


def _bounds_of(mod: Callable, q_start: int, q_end: int) -> tuple[int, int] | None:
    return mod.kv_bounds(q_start, q_end) if isinstance(mod, MaskMod) else None


def mod_tensors(mod: Callable) -> tuple[Tensor, ...]:
    """Every tensor one of attnlab's mask mods holds (through and/or), in a fixed order.

    Example:
        >>> from attnlab.masks import padding_mod, sliding_window_mod
        >>> [t.tolist() for t in mod_tensors(padding_mod(torch.tensor([3, 5])) & sliding_window_mod(6, 6, 2))]
        [[3, 5]]
    """
    if type(mod) is CombinedMod:
        return tuple(t for part in mod.mods for t in mod_tensors(part))
    return tuple(value for _, value in sorted(vars(mod).items()) if isinstance(value, Tensor))


def value_only_key(mod: object) -> tuple | None:
    """The mask's identity by value, for a mod whose value says all it masks by; else None.

    The one key of a mask mod (dispatch keys routes by it): the class and its public options
    for attnlab's own patterns that hold no tensor (causal, windows, prefixes, chunks) and
    ANDs/ORs of them; None for a mod holding a tensor (padding, varlen, documents: nothing
    compares tensor values), a :class:`~attnlab.masks.PreparedMask`, a subclass or a function
    (state no key can see). Two mods with equal keys are the same mask.

    Example:
        >>> from attnlab.masks import CausalMod, causal_mod, padding_mod
        >>> value_only_key(causal_mod(8, 8)) == value_only_key(causal_mod(4, 4)), value_only_key(CausalMod(0))
        (True, ('CausalMod', ('offset', 0)))
        >>> value_only_key(padding_mod(torch.tensor([3]))) is None
        True
    """
    # Plain loops, no generator: dispatch asks this on every call with a mask mod.
    if type(mod) is CombinedMod:
        parts = [mod.op]
        for part in mod.mods:
            key = value_only_key(part)
            if key is None:
                return None
            parts.append(key)
        return ("CombinedMod", *parts)
    if not type(mod).__dict__.get("_keyed", False):
        return None
    options = []
    for name, value in vars(mod).items():
        if isinstance(value, Tensor):
            return None
        if not name.startswith("_"):
            options.append((name, value))
    return (type(mod).__name__, *sorted(options))


def _pair_segments(first, second):
    """One segment id per position for two (q, k) segmentings: equal ids = equal in both."""
    if first is None or second is None:
        return second if first is None else first
    rows = max(first[0].shape[0], second[0].shape[0])
    q_pairs, k_pairs = (torch.stack(torch.broadcast_tensors(a, b), dim=-1).expand(rows, -1, 2)
                        for a, b in zip(first, second))  # (B, T, 2)
    _, ids = torch.unique(torch.cat([q_pairs, k_pairs], dim=1).reshape(-1, 2), dim=0, return_inverse=True)
    ids = ids.view(rows, -1)  # (B, Tq + Tk)
    return ids[:, : q_pairs.shape[1]], ids[:, q_pairs.shape[1]:]


def kv_range(mod: Callable | None, q_start: int, q_end: int, tk: int) -> tuple[int, int]:
    """The keys ``[lo, hi)`` that queries ``q_start..q_end-1`` may reach, clipped to ``[0, tk)``.

    All keys unless ``mod`` is a :class:`MaskMod` that declares :meth:`MaskMod.kv_bounds`.

    Example:
        >>> from attnlab.masks import causal_mod
        >>> kv_range(causal_mod(16, 16), 4, 8, 16)
        (0, 8)
        >>> kv_range(None, 4, 8, 16)
        (0, 16)
    """
    bounds = _bounds_of(mod, q_start, q_end) if mod is not None else None
    if bounds is None:
        return 0, tk
    lo = min(tk, max(0, bounds[0]))
    return lo, max(lo, min(tk, bounds[1]))


def _as_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as an additive bias (0 where allowed, -inf elsewhere); float masks cast."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def and_masks(*masks: MaskLike) -> MaskLike:
    """Combine masks so that a position may be attended only if every mask allows it.

    All dense tensors: bool masks are ANDed; if any is a float mask the result is a float mask
    (bool masks become 0 / ``-inf`` and the biases add). All callables: a :class:`CombinedMod`.
    ``None`` entries are skipped. Mixing tensors and mask mods is a ``TypeError``: materialize
    the mod first.

    Example:
        >>> and_masks(torch.tensor([[True, False], [True, True]]), torch.tensor([[True, True], [False, True]])).int()
        tensor([[1, 0],
                [0, 1]], dtype=torch.int32)
    """
    return _combine(masks, "and")


def or_masks(*masks: MaskLike) -> MaskLike:
    """Combine bool masks or mask mods: a position may be attended if any mask allows it.

    Example:
        >>> or_masks(torch.tensor([[True, False], [True, True]]), torch.tensor([[False, True], [False, False]])).int()
        tensor([[1, 1],
                [1, 1]], dtype=torch.int32)
    """
    return _combine(masks, "or")


def _combine(masks: tuple[MaskLike, ...], op: str) -> MaskLike:
    parts = [mask for mask in masks if mask is not None]
    if not parts:
        return None
    if all(callable(mask) and not isinstance(mask, Tensor) for mask in parts):
        return parts[0] if len(parts) == 1 else CombinedMod(tuple(parts), op)
    if not all(isinstance(mask, Tensor) for mask in parts):
        raise TypeError(
            "masks to combine must be all tensors or all mask mods; materialize() a mod to mix"
        )
    try:
        torch.broadcast_shapes(*(mask.shape for mask in parts))
    except RuntimeError:
        shapes = ", ".join(str(tuple(mask.shape)) for mask in parts)
        raise ValueError(f"masks to combine must broadcast together; got shapes {shapes}") from None
    if all(mask.dtype == torch.bool for mask in parts):
        result = parts[0]
        for mask in parts[1:]:
            result = (result & mask) if op == "and" else (result | mask)
        return result
    if op == "or":
        raise TypeError("or_masks combines bool masks or mask mods only, not float masks")
    dtype = next(mask.dtype for mask in parts if mask.dtype != torch.bool)
    result = _as_additive(parts[0], dtype)
    for mask in parts[1:]:
        result = result + _as_additive(mask, dtype)
    return result
