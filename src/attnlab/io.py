"""Save and load module weights as safetensors -- never with pickle.

A safetensors file is an 8-byte header length, a JSON header and raw tensor bytes; reading
one cannot execute code. ``torch.load`` on a ``.pt``/``.pth`` file can (it unpickles), so
attnlab refuses such files with a clear error instead of falling back to it.

Errors name the file. A file that is not safetensors, or is truncated or corrupted, raises
``ValueError``. A path that cannot be read or written (missing, a directory, no permission)
raises the ``OSError`` subclass the system reported (``FileNotFoundError``,
``PermissionError``, ...), with ``filename`` set to the path the caller gave and a message
saying what attnlab was doing -- an I/O failure stays an ``OSError`` so that ``except
OSError`` keeps working. :func:`save` writes a temporary file beside the destination and
renames it into place, so a failed save never leaves a half-written file behind, and
:func:`load` checks every tensor against the module before copying any, so a failed load
leaves the module unchanged.

Example:
    >>> import tempfile, os, torch
    >>> from attnlab.nn import MultiHeadAttention
    >>> path = os.path.join(tempfile.mkdtemp(), "mha.safetensors")
    >>> save(MultiHeadAttention(8, 8, num_heads=2), path)
    >>> restored = load(MultiHeadAttention(8, 8, num_heads=2), path)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
from collections.abc import Iterator
from typing import NamedTuple

import safetensors
import safetensors.torch
import torch
from torch import Tensor, nn

from attnlab._checks import instance_of

__all__ = ["save", "load", "save_state_dict", "load_state_dict", "write_atomically", "check_safetensors",
           "read_metadata", "read_header", "TensorInfo"]

_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


class TensorInfo(NamedTuple):
    """One tensor of a safetensors header: its dtype (safetensors' name: ``"F32"``, ``"I64"``, ...) and shape.

    Example:
        >>> TensorInfo("BF16", (4, 2)).floating, TensorInfo("I64", (3,)).floating
        (True, False)
    """

    dtype: str
    shape: tuple[int, ...]

    @property
    def floating(self) -> bool:
        """Whether the dtype is a floating-point one (``F64``, ``F32``, ``F16``, ``BF16``, ``F8_*``)."""
        return self.dtype.startswith(("F", "BF"))


def check_safetensors(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` unless ``path`` starts like a safetensors file.

    Reads only the first bytes; a pickle/zip checkpoint (``torch.save``) is named as such, and
    a file too short for its own header is reported as truncated or corrupted.

    Example:
        >>> import tempfile, os
        >>> bad = os.path.join(tempfile.mkdtemp(), "x.pt")
        >>> torch.save({"w": torch.zeros(1)}, bad)
        >>> check_safetensors(bad)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ... is not a safetensors file (it looks like a torch.save zip/pickle checkpoint); ...
    """
    with _reading(path):
        with open(path, "rb") as f:
            head = f.read(9)
        size = os.path.getsize(path)
    kind = _describe_pickle(head)
    if kind is not None:
        raise ValueError(
            f"{os.fspath(path)!r} is not a safetensors file ({kind}); attnlab only loads "
            "safetensors and never unpickles. Convert trusted checkpoints with "
            "attnlab.io.save(module, path) after loading them yourself."
        )
    damage = _describe_damage(head, size)
    if damage is not None:
        raise ValueError(
            f"{os.fspath(path)!r} is truncated or corrupted (not a valid safetensors file): {damage}"
        )


def _describe_pickle(head: bytes) -> str | None:
    # A safetensors header (a JSON object) starts at byte 8 whatever its 8-byte length reads as:
    # lengths whose first byte is 0x80 or "PK" are legal, so that byte decides first.
    if head[8:9] == b"{":
        return None
    if head[:2] == b"PK":
        return "it looks like a torch.save zip/pickle checkpoint"
    if head[:1] == b"\x80":
        return "it looks like a pickle"
    return None


def _describe_damage(head: bytes, size: int) -> str | None:
    """Why the first bytes cannot start a safetensors file of ``size`` bytes, or None."""
    if len(head) < 9:
        return f"it has only {size} bytes"
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > _MAX_HEADER or head[8:9] != b"{":
        return "it does not start with a safetensors JSON header"
    if header_len + 8 > size:
        return f"its header needs {header_len + 8} bytes but the file has {size}"
    return None


@contextlib.contextmanager
def _reading(path: str | os.PathLike) -> Iterator[None]:
    """Turn the errors of reading ``path`` into ones that name it (see the module docstring)."""
    try:
        yield
    except OSError as err:
        raise _naming(err, path, "read a safetensors file") from err
    except safetensors.SafetensorError as err:
        raise ValueError(
            f"{os.fspath(path)!r} is truncated or corrupted (not a valid safetensors file): {err}"
        ) from err


def _naming(err: OSError, path: str | os.PathLike, doing: str) -> OSError:
    """An OSError of ``err``'s kind whose message and ``filename`` name ``path``."""
    try:
        return type(err)(err.errno, f"{err.strerror or err} (could not {doing})", os.fspath(path))
    except TypeError:  # an OSError subclass with its own constructor
        return OSError(err.errno, f"{err.strerror or err} (could not {doing})", os.fspath(path))


def _key(tensor: Tensor) -> tuple:
    """What makes two state-dict entries the same tensor (an alias, e.g. tied weights)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def _state_for_saving(module: nn.Module) -> dict[str, Tensor]:
    """The state dict with aliases stored once, and partial overlaps stored as copies.

    safetensors refuses two entries sharing memory. An exact alias (tied weights) is dropped
    and restored on load through :func:`_aliases`; a tensor that only overlaps another (a
    buffer that is a slice of a parameter) is saved as its own copy, and loading copies both
    back into the shared memory, which restores it.
    """
    state, seen, storages = {}, set(), set()
    for name, tensor in module.state_dict().items():
        _check_materialized(name, tensor)
        if tensor.numel() and _key(tensor) in seen:
            continue
        seen.add(_key(tensor))
        storage = tensor.untyped_storage().data_ptr()
        tensor = tensor.detach().to("cpu")
        shared = tensor.numel() and storage in storages
        state[name] = tensor.clone() if shared else tensor.contiguous()
        storages.add(storage)
    return state


def _check_materialized(name: str, tensor: Tensor) -> None:
    """A meta tensor has a shape and no values: saving it is always a mistake, said by name."""
    if tensor.is_meta:
        raise ValueError(f"{name} is on the meta device; load or materialize weights first "
                         f"(e.g. module.to_empty(device='cpu') and load a checkpoint)")


def _check_metadata(metadata: object) -> dict[str, str]:
    if metadata is None:
        return {}
    instance_of("metadata", metadata, dict, "a dict of str to str")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str; got {key!r}: {value!r}")
    return metadata


def write_atomically(data: bytes | str, path: str | os.PathLike, *, what: str = "a file") -> None:
    """Write ``data`` (bytes, or text as UTF-8) so that ``path`` is either the old file or the new one.

    The data goes to a temporary file beside ``path``, is flushed to disk, then renamed over
    ``path``; an interrupted or failed write removes the temporary file and leaves ``path`` as
    it was. An ``OSError`` keeps its subclass and names ``path`` and ``what`` was being written.

    Example:
        >>> import tempfile, os
        >>> target = os.path.join(tempfile.mkdtemp(), "a.json")
        >>> write_atomically("{}", target); open(target).read()
        '{}'
    """
    data = data.encode("utf-8") if isinstance(data, str) else data
    path = os.fspath(path)
    folder, base = os.path.split(os.path.abspath(path))
    temp = os.path.join(folder, f".{base}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "xb") as f:  # "x": never clobber; default permissions, unlike mkstemp
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(temp)
        if isinstance(err, OSError):
            raise _naming(err, path, f"write {what}") from err
        raise


def save(module: nn.Module, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> None:
    """Write ``module.state_dict()`` to ``path`` in safetensors format.

    Tensors that alias another entry (tied weights) are stored once; tensors that share
    memory only in part (a buffer that is a view of another) are stored as copies and
    restored by :func:`load`. ``metadata`` (string keys and values) goes into the file header.
    The file appears at ``path`` only when it is complete (written beside it, then renamed).

    Args:
        module: any ``torch.nn.Module`` (attnlab modules included).
        path: destination file (conventionally ``*.safetensors``).
        metadata: optional string-to-string header entries.

    Raises:
        TypeError: ``module`` is not a module, or ``metadata`` is not a str-to-str dict.
        ValueError: a parameter or buffer is on the meta device (it has no values to save).
        OSError: ``path`` cannot be written (its subclass says why; the message names ``path``).

    Example:
        >>> import tempfile, os
        >>> save(nn.Linear(2, 2), os.path.join(tempfile.mkdtemp(), "lin.safetensors"))
    """
    instance_of("module", module, nn.Module, "a torch.nn.Module")
    meta = {"attnlab_class": type(module).__name__, **_check_metadata(metadata)}
    save_state_dict(_state_for_saving(module), path, metadata=meta)


def save_state_dict(tensors: dict[str, Tensor], path: str | os.PathLike, *,
                    metadata: dict[str, str] | None = None) -> None:
    """Write named tensors to ``path`` in safetensors format, atomically (see :func:`write_atomically`).

    The counterpart of :func:`load_state_dict`, for tensors that are not a module's state
    (an optimizer's, say). Tensors must not share memory; ``metadata`` goes into the header.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
        >>> save_state_dict({"w": torch.ones(2)}, path, metadata={"step": "3"})
        >>> load_state_dict(path)["w"].tolist()
        [1.0, 1.0]
    """
    meta = {"format": "pt", **_check_metadata(metadata)}
    for name, tensor in tensors.items():
        _check_materialized(name, tensor)
    write_atomically(safetensors.torch.save(tensors, metadata=meta), path, what="a safetensors file")


def load_state_dict(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Read the tensors of a safetensors file (no pickle, no code execution).

    Raises:
        ValueError: the file is not a safetensors file (e.g. a ``torch.save`` checkpoint), or
            is truncated or corrupted.
        OSError: the file cannot be read (the message names it).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "lin.safetensors")
        >>> save(nn.Linear(2, 3), path)
        >>> sorted(load_state_dict(path))
        ['bias', 'weight']
    """
    check_safetensors(path)
    with _reading(path):
        return safetensors.torch.load_file(os.fspath(path), device=str(device))


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The name, dtype and shape of every tensor in a safetensors file, without reading the tensors.

    Only the header is parsed (safetensors checks it whole: every tensor's bytes must lie
    inside the file and the tensors must cover it exactly), so a loader can compare the
    shapes with what it expects before it allocates anything.

    Raises:
        ValueError: not a safetensors file, or a truncated or corrupted one (the message names it).
        OSError: the file cannot be read (the message names it).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "lin.safetensors")
        >>> save(nn.Linear(2, 3), path)
        >>> read_header(path)["weight"]
        TensorInfo(dtype='F32', shape=(3, 2))
    """
    check_safetensors(path)
    with _reading(path):
        with safetensors.safe_open(os.fspath(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: TensorInfo(s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}


def load(module: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a safetensors file written by :func:`save` into ``module`` (in place) and return it.

    Tensors are copied to the module's device and dtype. Tied weights stored once are filled
    through their aliases. The file's header is checked against the module before any tensor
    is read, so a file that does not fit costs no memory and leaves the module unchanged.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
        ValueError: not a safetensors file, a truncated or corrupted one, or tensors that do
            not fit the module: wrong shapes, integer data for a floating-point tensor (or the
            reverse), or (when ``strict``) missing or unexpected keys.
        OSError: the file cannot be read (the message names it).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "lin.safetensors")
        >>> save(nn.Linear(2, 3), path)
        >>> load(nn.Linear(2, 3), path).weight.shape
        torch.Size([3, 2])
    """
    instance_of("module", module, nn.Module, "a torch.nn.Module")
    header = read_header(path)
    expected = module.state_dict()
    aliases = {name: original for name, original in _aliases(expected).items()
               if name not in header and original in header}
    _check_fits({**header, **{name: header[original] for name, original in aliases.items()}},
                expected, module, path, strict=strict)
    state = load_state_dict(path)
    for name, original in aliases.items():
        state[name] = state[original]
    module.load_state_dict(state, strict=strict)
    return module


def _check_fits(header: dict[str, TensorInfo], expected: dict[str, Tensor], module: nn.Module,
                path: str | os.PathLike, *, strict: bool) -> None:
    """``ValueError`` naming the file and every key that would not load (before any read or copy).

    ``load_state_dict`` copies what fits before it reports what does not, which would leave
    the module half loaded; and it casts integers into floats (or back) without a word.
    """
    problems = []
    for name, tensor in expected.items():
        if name not in header:
            continue
        info = header[name]
        if info.shape != tuple(tensor.shape):
            problems.append(f"{name}: file {info.shape} vs module {tuple(tensor.shape)}")
        elif info.floating != tensor.is_floating_point():
            problems.append(f"{name}: file dtype {info.dtype} vs module {tensor.dtype}")
    if strict:
        problems += [f"missing from the file: {name}" for name in expected if name not in header]
        problems += [f"unexpected in the file: {name}" for name in header if name not in expected]
    if problems:
        shown = "; ".join(problems[:10]) + ("; ..." if len(problems) > 10 else "")
        raise ValueError(
            f"{os.fspath(path)!r} does not fit {type(module).__name__} "
            f"({len(problems)} problem(s)): {shown}"
        )


def _aliases(state: dict[str, Tensor]) -> dict[str, str]:
    """Map each state-dict entry that aliases an earlier one to that earlier name."""
    first, result = {}, {}
    for name, tensor in state.items():
        key = _key(tensor)
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
    with _reading(path):
        with safetensors.safe_open(os.fspath(path), framework="pt") as f:
            return f.metadata() or {}  # safe_open validates the whole header
