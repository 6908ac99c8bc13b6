"""Argument checks shared by every layer: one home, one wording for each kind of bad value.

Every check raises ``ValueError`` (or ``TypeError`` for a value of the wrong kind) whose message
names the argument and shows the value seen, as the contract in ``docs/contract.md`` asks.

Example:
    >>> positive_int("num_heads", 4)
    4
    >>> positive_int("num_heads", 0)
    Traceback (most recent call last):
    ...
    ValueError: num_heads must be a positive int, got 0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "positive_int",
    "non_negative_int",
    "probability",
    "one_of",
    "divisible",
    "finite_number",
    "positive_number",
    "instance_of",
    "int_value",
    "per_layer",
    "integer_dtype",
    "has_values",
    "broadcast_shape",
    "same_device",
]


# The largest magnitude an int argument may have. Sizes, offsets and windows become int64 index
# arithmetic (``q_idx + offset - window``), where a Python int past 2**63 raises OverflowError and
# one near it wraps around silently; no sequence comes near 2**62, so larger values are refused.
MAX_INT = 2**62


def _is_int(value: object) -> bool:
    # A SymInt is a size under torch.compile's dynamic shapes: an int as far as callers know.
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def int_value(name: str, value: object) -> int:
    """``value`` if it is an int (any sign); ``TypeError`` naming ``name`` otherwise.

    Example:
        >>> int_value("offset", -2)
        -2
        >>> int_value("offset", 1.5)
        Traceback (most recent call last):
        ...
        TypeError: offset must be an int, got 1.5
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return _bounded(name, value)


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int ``>= 1``; ``TypeError`` (not an int) or ``ValueError`` (below 1)
    naming ``name`` otherwise.

    Example:
        >>> positive_int("d_model", 8)
        8
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return _bounded(name, value)


def non_negative_int(name: str, value: object) -> int:
    """``value`` if it is an int ``>= 0``; ``TypeError`` (not an int) or ``ValueError`` (negative)
    naming ``name`` otherwise.

    Example:
        >>> non_negative_int("offset", 0)
        0
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return _bounded(name, value)


def _bounded(name: str, value: int) -> int:
    if isinstance(value, int) and abs(value) > MAX_INT:  # a SymInt is a real size: never this large
        raise ValueError(f"{name} must be at most 2**62 in magnitude (values become int64), got {value!r}")
    return value


def probability(name: str, value: object) -> float:
    """``value`` as a float in ``[0, 1)`` (a dropout probability); ``TypeError``/``ValueError``.

    Example:
        >>> probability("dropout_p", 0.1)
        0.1
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def finite_number(name: str, value: object) -> float:
    """``value`` as a float if it is a finite real number; ``TypeError`` (not a number) or
    ``ValueError`` (NaN or infinite) naming ``name`` otherwise.

    Example:
        >>> finite_number("scale", 0.5)
        0.5
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def positive_number(name: str, value: object) -> float:
    """``value`` as a float if it is a finite real number ``> 0``; ``ValueError`` otherwise.

    Example:
        >>> positive_number("base", 10000)
        10000.0
    """
    if finite_number(name, value) <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def non_negative_number(name: str, value: object) -> float:
    """``value`` as a float if it is a finite real number ``>= 0``; ``ValueError`` otherwise.

    Example:
        >>> non_negative_number("weight", 0)
        0.0
    """
    if finite_number(name, value) < 0:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return float(value)


def instance_of(name: str, value: object, kind: type | tuple[type, ...], what: str) -> object:
    """``value`` if it is an instance of ``kind``; ``TypeError`` naming ``name`` and ``what`` otherwise.

    Example:
        >>> instance_of("cache", {}, int, "a KVCache")
        Traceback (most recent call last):
        ...
        TypeError: cache must be a KVCache, got dict
    """
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def one_of(name: str, value: object, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``; ``ValueError`` listing them otherwise.

    Example:
        >>> one_of("align", "top_left", ("top_left", "bottom_right"))
        'top_left'
    """
    choices = tuple(choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def divisible(name: str, value: int, divisor_name: str, divisor: int) -> None:
    """``ValueError`` unless ``value`` is a multiple of ``divisor`` (both already positive).

    Example:
        >>> divisible("d_model", 12, "num_heads", 4)
    """
    if value % divisor != 0:
        raise ValueError(f"{name} ({value}) must be a multiple of {divisor_name} ({divisor})")


def per_layer(name: str, value: object, layers: int) -> tuple[int, ...]:
    """One positive int per layer: an int means every layer, a sequence gives each layer its own.

    ``ValueError`` naming ``name`` for a sequence of the wrong length or an entry that is not a
    positive int.

    Example:
        >>> per_layer("num_heads", 2, 3), per_layer("num_heads", [2, 1], 2)
        ((2, 2, 2), (2, 1))
        >>> per_layer("num_heads", (2, 1), 3)
        Traceback (most recent call last):
        ...
        ValueError: num_heads must have one entry per layer (3), got 2: (2, 1)
    """
    if _is_int(value):
        return (positive_int(name, value),) * layers
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a positive int or one per layer, got {value!r}")
    if len(value) != layers:
        raise ValueError(f"{name} must have one entry per layer ({layers}), got {len(value)}: {value!r}")
    for index, entry in enumerate(value):
        positive_int(f"{name}[{index}]", entry)
    return tuple(value)


def integer_dtype(name: str, value: torch.Tensor, *, unsigned: bool = False) -> torch.Tensor:
    """``value`` if its dtype is a signed integer (or any integer with ``unsigned``); ``TypeError``
    naming ``name`` otherwise.

    Lengths and positions are subtracted from each other, and unsigned integers wrap around
    there (``uint8``: ``3 - 5 == 254``), so they are refused unless the caller converts to
    int64 itself; bool, floating and complex dtypes are never counts.

    Example:
        >>> integer_dtype("lengths", torch.tensor([3], dtype=torch.uint8))
        Traceback (most recent call last):
        ...
        TypeError: lengths must have a signed integer dtype (int8/16/32/64), got torch.uint8: unsigned integers wrap around when subtracted (convert with .long())
    """
    dtype = value.dtype
    integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    if integer and (unsigned or dtype.is_signed):
        return value
    kind = "an integer dtype" if unsigned else "a signed integer dtype (int8/16/32/64)"
    why = ": unsigned integers wrap around when subtracted (convert with .long())" if integer else ""
    raise TypeError(f"{name} must have {kind}, got {dtype}{why}")


def has_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values that may be read: False on the meta device, where a tensor
    has only a shape and a dtype, so a decision that reads values must take the general path.

    Example:
        >>> has_values(torch.ones(2)), has_values(torch.ones(2, device="meta"))
        (True, False)
    """
    return t.device.type != "meta"


def same_device(name: str, value: torch.Tensor, device: torch.device, owner: str = "the module's weights") -> None:
    """``ValueError`` naming ``name`` unless ``value`` is on ``device`` (where ``owner`` lives).

    A meta input to a module with real weights (or the reverse) is refused here rather than
    half-computed: some layers would return meta, others (an embedding) a real tensor.

    Example:
        >>> same_device("x", torch.ones(1, device="meta"), torch.device("cpu"))
        Traceback (most recent call last):
        ...
        ValueError: x is on meta but the module's weights are on cpu; move one of them (module.to(...) or x.to(...))
    """
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but {owner} are on {device}; move one of them "
                         f"(module.to(...) or {name}.to(...))")


def broadcast_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to, aligned from the right, or None when they do not.

    ``torch.broadcast_shapes`` in plain Python, a tenth of its cost: it runs on every attention
    call and per tile of a mask mod, and ``torch.compile`` traces it as size comparisons.

    Example:
        >>> broadcast_shape([(2, 1, 1), (1, 3), ()]), broadcast_shape([(2,), (3,)])
        ((2, 1, 3), None)
    """
    rank = 0
    for one in shapes:  # a plain loop: torch.compile refuses max(map(...), default=...)
        rank = len(one) if len(one) > rank else rank
    shape = [1] * rank
    for one in shapes:
        for axis, size in enumerate(one, start=rank - len(one)):
            if size == 1 if type(size) is int else _is_one(size):  # plain ints: no call per dim
                continue
            have = shape[axis]
            if type(have) is int and type(size) is int:
                if have != 1 and have != size:
                    return None
            elif not _is_one(have) and not _same(have, size):
                return None
            shape[axis] = size
    return tuple(shape)


def _is_one(size) -> bool:
    """``size == 1``; a size that depends on data while ``torch.export`` traces (an unbacked
    symbol, ``q[:n.item()]``) is taken as not 1 without a guard, as PyTorch's own broadcasting
    takes it."""
    if isinstance(size, int):
        return size == 1
    return torch.fx.experimental.symbolic_shapes.guard_or_false(size == 1)  # loaded: size is symbolic


def _same(a, b) -> bool:
    """``a == b`` for sizes; two data-dependent sizes that tracing cannot tell apart are taken
    as equal and checked when the traced program runs (``torch._check``)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if not torch.fx.experimental.symbolic_shapes.guard_or_true(a == b):
        return False
    torch._check(a == b)
    return True
