"""Argument checks of attnlab.distributed that :mod:`attnlab._checks` has no twin for: timeouts.

A value of the wrong kind is a ``TypeError``, a bad value of the right kind a ``ValueError``;
both name the argument (ints, choices and instances go through :mod:`attnlab._checks`).

Example:
    >>> timeout_seconds(2.5)
    2.5
    >>> number("timeout", "5")
    Traceback (most recent call last):
    ...
    TypeError: timeout must be a number, got str
"""

from __future__ import annotations

__all__ = ["number", "timeout_seconds"]


def number(name: str, value: object) -> float:
    """``value`` if it is a real number (a bool is not); infinity is allowed (wait forever).

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
