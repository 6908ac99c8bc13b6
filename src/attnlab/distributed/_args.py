"""Argument checks of attnlab.distributed: a value of the wrong kind is a ``TypeError``, a bad
value of the right kind a ``ValueError``; both name the argument.

Example:
    >>> choice("layout", "zigzag", ("zigzag", "contiguous"))
    'zigzag'
    >>> integer("rank", 1.5)
    Traceback (most recent call last):
    ...
    TypeError: rank must be an int, got float
"""

from __future__ import annotations

import torch

from attnlab._checks import instance_of, one_of

__all__ = ["choice", "integer", "number", "timeout_seconds"]


def choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``.

    Example:
        >>> choice("method", "ring", ("ring", "ulysses"))
        'ring'
    """
    return one_of(name, instance_of(name, value, str, "a str"), choices)


def integer(name: str, value: object) -> int:
    """``value`` if it is an int (a bool is not).

    Example:
        >>> integer("dim", -1)
        -1
    """
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):  # SymInt: a size under compile
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def number(name: str, value: object) -> float:
    """``value`` if it is a real number (a bool is not).

    Example:
        >>> number("timeout", 2.5)
        2.5
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return value


def timeout_seconds(timeout: object) -> float | None:
    """``timeout`` if it is a positive number of seconds or None.

    Example:
        >>> timeout_seconds(2), timeout_seconds(None)
        (2, None)
    """
    if timeout is None:
        return None
    if not number("timeout", timeout) > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return timeout
