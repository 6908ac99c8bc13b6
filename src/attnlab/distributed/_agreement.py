"""The agreement check: every rank of a context-parallel call must pass the same options.

Each rank reduces every option that changes the result (shapes, dtype, scale, causal, method,
layout, the mask and what it holds, grad mode) to a 128-bit digest of a canonical encoding of
its value; one all-gather of those digests compares them. When they differ, a second
all-gather (taken by every rank, since every rank sees the same table) carries each rank's
description of the options that differ, so every rank raises the same ``ValueError`` naming
them, before any attention work.

What a digest sees: numbers, strings, dtypes, shapes; a tensor's dtype, shape and values; a
mask mod's type and attributes (attnlab's mods, or any object with attributes); a function's
code, defaults and closure; of a module a mod is bound to, its public attributes (not its
weights). It cannot see state a function reads from elsewhere (its module's globals, a file):
such a mask mod agrees when its code does. The values of tensors are read on the CPU, once per
call with more than one rank: a dense mask costs a copy of its bytes.

Example:
    >>> fingerprint(0.125) == fingerprint(0.125), fingerprint(0.125) == fingerprint(0.5)
    (True, False)
    >>> from attnlab import masks
    >>> a, b = masks.sliding_window_mod(8, 8, 3), masks.sliding_window_mod(8, 8, 4)
    >>> fingerprint(a) == fingerprint(masks.sliding_window_mod(8, 8, 3)), fingerprint(a) == fingerprint(b)
    (True, False)
"""

from __future__ import annotations

import functools
import hashlib
import types

import torch
import torch.distributed as dist
from torch import Tensor

from attnlab.distributed._comm import Peers, _start, _wait

__all__ = ["check_agreement", "fingerprint", "describe"]

_MAX_DEPTH = 12  # how deep a mask mod's attributes and closures are followed
_TEXT_BYTES = 2048  # room for one rank's description of the options that differ
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def fingerprint(value: object) -> bytes:
    """A canonical encoding of ``value``: equal on two ranks when the values act alike.

    Example:
        >>> fingerprint(torch.tensor([1, 2])) == fingerprint(torch.tensor([1, 3]))
        False
    """
    out = bytearray()
    _feed(value, out, 0, set())
    return bytes(out)


def _feed(value: object, out: bytearray, depth: int, seen: set[int]) -> None:
    kind = type(value)
    out += f"<{kind.__module__}.{kind.__qualname__}>".encode()
    if isinstance(value, _SCALARS):
        out += repr(value).encode()  # repr of a float round-trips exactly
        return
    if isinstance(value, Tensor):
        out += repr((value.dtype, tuple(value.shape))).encode() + _tensor_bytes(value)
        return
    if depth >= _MAX_DEPTH or id(value) in seen:
        out += b"<not followed>"
        return
    seen.add(id(value))
    for part in _parts(value):
        _feed(part, out, depth + 1, seen)
        out += b","


def _parts(value: object) -> list:
    """What two values of one type must agree on (their type is already encoded)."""
    if isinstance(value, (tuple, list)):
        return list(value)
    if isinstance(value, dict):
        return [item for key in sorted(value, key=repr) for item in (key, value[key])]
    if isinstance(value, functools.partial):
        return [value.func, value.args, value.keywords]
    if isinstance(value, types.MethodType):
        return [value.__func__, value.__self__]
    if isinstance(value, types.FunctionType):
        cells = [_cell(cell) for cell in value.__closure__ or ()]
        return [value.__module__, value.__qualname__, value.__code__, value.__defaults__,
                value.__kwdefaults__, cells]
    if isinstance(value, types.CodeType):
        return [value.co_code, value.co_consts, value.co_names]
    if isinstance(value, torch.nn.Module):  # a mod bound to a model: its options, not its weights
        return [{key: item for key, item in vars(value).items() if not key.startswith("_")}]
    return [vars(value)] if hasattr(value, "__dict__") else []


def _cell(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return "<empty cell>"


def _tensor_bytes(t: Tensor) -> bytes:
    """The values' bytes (read on the CPU); none for meta and non-strided tensors."""
    if t.device.type == "meta" or t.layout != torch.strided:
        return b"<values unknown>"
    flat = t.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8).cpu().numpy().tobytes() if flat.numel() else b""


def _digest(value: object) -> list[int]:
    raw = hashlib.blake2b(fingerprint(value), digest_size=16).digest()
    return [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)]


def describe(value: object) -> str:
    """A short, readable form of an option; values that print alike get their digest appended.

    Example:
        >>> describe(torch.float64), describe((1, 2, 4, 8)), describe(0.5)
        ('float64', '(1, 2, 4, 8)', '0.5')
    """
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (bool, int, float, str, tuple)) or value is None:
        return repr(value)
    if isinstance(value, Tensor):
        text = f"{describe(value.dtype)} tensor of shape {tuple(value.shape)}"
    elif isinstance(value, (types.FunctionType, types.MethodType)):
        text = f"function {value.__qualname__}"  # its default repr holds an address, never alike
    elif type(value).__repr__ is object.__repr__:
        text = f"a {type(value).__qualname__}"
    else:
        text = repr(value)
    return f"{text[:200]} #{_digest(value)[0] & 0xFFFFFFFF:08x}"


def check_agreement(options: dict[str, object], who: Peers, device: torch.device) -> None:
    """One small all-gather: every rank's ``options`` must match, or every rank raises alike.

    ``options`` maps a name to a value :func:`fingerprint` encodes; every rank passes the same
    names in the same order. Costs one collective of two int64 per option.

    Raises:
        ValueError: the ranks disagree; the message names each option that differs and each
            rank's value of it.
    """
    if who.world == 1:
        return
    mine = torch.tensor([word for value in options.values() for word in _digest(value)],
                        dtype=torch.int64, device=device)
    rows = [row.view(-1, 2).tolist() for row in _all_gather(mine, who, "the agreement check (all-gather)")]
    names = list(options)
    differ = [name for i, name in enumerate(names) if any(row[i] != rows[0][i] for row in rows)]
    if not differ:
        return
    text = ", ".join(f"{name}={describe(options[name])}" for name in differ)
    seen = [_decode(row) for row in _all_gather(_encode(text, device), who, "the agreement check (details)")]
    lines = "; ".join(f"rank {r}: {line}" for r, line in enumerate(seen))
    raise ValueError(f"context-parallel attention: the ranks disagree on {', '.join(differ)} ({lines}); "
                     "every rank must pass shards of the same shape and dtype, and the same options")


def _all_gather(mine: Tensor, who: Peers, what: str) -> list[Tensor]:
    table = [torch.empty_like(mine) for _ in range(who.world)]
    work = _start(lambda: dist.all_gather(table, mine, group=who.group, async_op=True), who, what)
    _wait(work, who, what, None)
    return table


def _encode(text: str, device: torch.device) -> Tensor:
    raw = text.encode()[:_TEXT_BYTES]
    return torch.tensor(list(raw) + [0] * (_TEXT_BYTES - len(raw)), dtype=torch.int64, device=device)


def _decode(row: Tensor) -> str:
    return bytes(b for b in row.tolist() if b).decode(errors="replace")
