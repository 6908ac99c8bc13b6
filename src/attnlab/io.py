"""Save and load module weights as safetensors -- never with pickle.

A safetensors file is an 8-byte header length, a JSON header and raw tensor bytes; reading
one cannot execute code. ``torch.load`` on a ``.pt``/``.pth`` file can (it unpickles), so
attnlab refuses such files with a clear error instead of falling back to it.

Example:
    >>> import tempfile, os, torch
    >>> from attnlab.nn import MultiHeadAttention
    >>> path = os.path.join(tempfile.mkdtemp(), "mha.safetensors")
    >>> save(MultiHeadAttention(8, 8, num_heads=2), path)
    >>> restored = load(MultiHeadAttention(8, 8, num_heads=2), path)
"""

from __future__ import annotations

import json
import os
import struct

import safetensors.torch
import torch
from torch import Tensor, nn

__all__ = ["save", "load", "load_state_dict", "check_safetensors", "read_metadata"]

_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def check_safetensors(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` unless ``path`` starts like a safetensors file.

    Reads only the header; a pickle/zip checkpoint (``torch.save``) is named as such.

    Example:
        >>> import tempfile, os
        >>> bad = os.path.join(tempfile.mkdtemp(), "x.pt")
        >>> torch.save({"w": torch.zeros(1)}, bad)
        >>> check_safetensors(bad)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ... is not a safetensors file (it looks like a torch.save zip/pickle checkpoint); ...
    """
    with open(path, "rb") as f:
        head = f.read(9)
    kind = _describe_non_safetensors(path, head)
    if kind is not None:
        raise ValueError(
            f"{os.fspath(path)!r} is not a safetensors file ({kind}); attnlab only loads "
            "safetensors and never unpickles. Convert trusted checkpoints with "
            "attnlab.io.save(module, path) after loading them yourself."
        )


def _describe_non_safetensors(path, head: bytes) -> str | None:
    if head[:2] == b"PK":
        return "it looks like a torch.save zip/pickle checkpoint"
    if head[:1] == b"\x80":
        return "it looks like a pickle"
    if len(head) < 9:
        return "it is too short"
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > _MAX_HEADER or header_len + 8 > os.path.getsize(path) or head[8:9] != b"{":
        return "its header is not a safetensors JSON header"
    return None


def _state_for_saving(module: nn.Module) -> dict[str, Tensor]:
    """The state dict with shared tensors stored once (tied weights) and contiguous copies."""
    state, seen = {}, {}
    for name, tensor in module.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and key in seen:
            continue  # an alias of an earlier tensor (e.g. tied embeddings); loaded via the other
        seen[key] = name
        state[name] = tensor.detach().to("cpu").contiguous()
    return state


def save(module: nn.Module, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> None:
    """Write ``module.state_dict()`` to ``path`` in safetensors format.

    Tensors that alias another entry (tied weights) are stored once. ``metadata`` (string
    keys and values) goes into the file header.

    Args:
        module: any ``torch.nn.Module`` (attnlab modules included).
        path: destination file (conventionally ``*.safetensors``).
        metadata: optional string-to-string header entries.

    Example:
        >>> import tempfile, os
        >>> save(nn.Linear(2, 2), os.path.join(tempfile.mkdtemp(), "lin.safetensors"))
    """
    meta = {"format": "pt", "attnlab_class": type(module).__name__, **(metadata or {})}
    safetensors.torch.save_file(_state_for_saving(module), os.fspath(path), metadata=meta)


def load_state_dict(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Read the tensors of a safetensors file (no pickle, no code execution).

    Raises:
        ValueError: the file is not a safetensors file (e.g. a ``torch.save`` checkpoint).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "lin.safetensors")
        >>> save(nn.Linear(2, 3), path)
        >>> sorted(load_state_dict(path))
        ['bias', 'weight']
    """
    check_safetensors(path)
    return safetensors.torch.load_file(os.fspath(path), device=str(device))


def load(module: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a safetensors file written by :func:`save` into ``module`` (in place) and return it.

    Tensors are copied to the module's device and dtype. Tied weights stored once are filled
    through their aliases.

    Raises:
        ValueError: not a safetensors file.
        RuntimeError: missing or unexpected keys / wrong shapes (when ``strict``).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "lin.safetensors")
        >>> save(nn.Linear(2, 3), path)
        >>> load(nn.Linear(2, 3), path).weight.shape
        torch.Size([3, 2])
    """
    state = load_state_dict(path)
    expected = module.state_dict()
    aliases = _aliases(expected)
    for name, original in aliases.items():
        if name not in state and original in state:
            state[name] = state[original]
    module.load_state_dict(state, strict=strict)
    return module


def _aliases(state: dict[str, Tensor]) -> dict[str, str]:
    """Map each state-dict entry that aliases an earlier one to that earlier name."""
    first, result = {}, {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and key in first:
            result[name] = first[key]
        else:
            first.setdefault(key, name)
    return result


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata stored in a safetensors header.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "lin.safetensors")
        >>> save(nn.Linear(2, 3), path, metadata={"note": "hi"})
        >>> read_metadata(path)["note"]
        'hi'
    """
    check_safetensors(path)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return header.get("__metadata__", {})
