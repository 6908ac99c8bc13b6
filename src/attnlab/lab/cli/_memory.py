"""Refuse a size that cannot fit in memory by its option's name, before anything is allocated.

Without this, ``attnlab train --d-model 10000000`` asks the allocator for 1.2 PB and only then
answers "out of memory", after seconds of work and without saying which option to change. A
command estimates what its options need, compares it with the device's total memory (physical
RAM for the CPU, the GPU's memory for CUDA) and names the option that makes it too big.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from attnlab.lab.cli._errors import fail

__all__ = ["total_memory", "format_bytes", "refuse_if_too_big"]


def total_memory(device: str) -> int | None:
    """Bytes of memory ``device`` has in all (None where it cannot be told: then nothing is refused).

    Example:
        >>> total_memory("cpu") > 0
        True
    """
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    if device != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows) or no such name
        return None


def format_bytes(count: float) -> str:
    """``count`` bytes as people read them (powers of 1000; past 1000 PB, in powers of ten).

    Example:
        >>> format_bytes(1.2e15), format_bytes(512), format_bytes(4.26e28)
        ('1.2 PB', '512 B', '4.3e+28 bytes')
    """
    if count >= 1e18:
        return f"{count:.1e} bytes"
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if count < 1000 or unit == "PB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def refuse_if_too_big(need: Callable[[dict], int], options: dict, defaults: dict, *, device: str, what: str,
                      shown: Callable[[str, object], str] = lambda option, value: f"{option} {value}") -> None:
    """A one-line refusal, naming the options to lower, when ``need(options)`` bytes exceed the device's memory.

    The options named are found greedily: the one whose default shrinks the need most, then the
    next, until the need fits (or every option given is named).

    Args:
        need: the estimated bytes for a dict of option values (``{"--d-model": 64, ...}``).
        options: the values given; defaults: each option's default (an option at its default is never named).
        device: where the bytes would be allocated.
        what: what needs them (``"training this model"``).
        shown: an option and its value as the user typed them.

    Example:
        >>> refuse_if_too_big(lambda o: o["--n"] * 8, {"--n": 10}, {"--n": 1}, device="cpu", what="a list")
    """
    limit = total_memory(device)
    total = need(options)
    if limit is None or total <= limit:
        return
    culprits, smaller = [], dict(options)
    left = [option for option, value in options.items() if value != defaults[option]]
    while left and need(smaller) > limit:
        option = min(left, key=lambda o: need({**smaller, o: defaults[o]}))
        culprits.append(option)
        left.remove(option)
        smaller[option] = defaults[option]
    named = " and ".join(shown(option, options[option]) for option in culprits) or "the default sizes"
    fail(f"{named}: {what} would take about {format_bytes(total)}, more than the {format_bytes(limit)} of memory "
         f"of this machine's {device.split(':')[0].upper()}; choose a smaller {' and '.join(culprits) or 'size'}")
