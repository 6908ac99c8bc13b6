"""Checks of the token ids a model is given: one wording for every model and every kind of id.

An id outside its embedding table would make ``nn.Embedding`` raise a bare ``IndexError`` on
CPU (and a device-side assert on CUDA), so the models refuse it first, naming the argument, the
table's size and the values seen.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._checks import has_values

__all__ = ["integer_ids", "ids_in_range", "describe"]


def integer_ids(name: str, ids: object, shape: tuple[int, ...] | None = None) -> Tensor:
    """``ids`` if it is an integer (not bool) tensor ``(B, T)`` (of ``shape`` if given); ``ValueError`` otherwise.

    Example:
        >>> integer_ids("input_ids", torch.tensor([[1.0]]))
        Traceback (most recent call last):
        ...
        ValueError: input_ids must be an integer tensor (B, T), got torch.float32 tensor of shape (1, 1)
    """
    ok = isinstance(ids, Tensor) and ids.ndim == 2 and not ids.is_floating_point() \
        and not ids.is_complex() and ids.dtype != torch.bool
    if not ok or (shape is not None and tuple(ids.shape) != tuple(shape)):
        wanted = "(B, T)" if shape is None else f"of input_ids' shape {tuple(shape)}"
        raise ValueError(f"{name} must be an integer tensor {wanted}, got {describe(ids)}")
    return ids


def ids_in_range(name: str, ids: Tensor, size: int, size_name: str) -> None:
    """``ValueError`` unless every value of ``ids`` is in ``0..size-1`` (``size_name``: the table's size).

    This reads the values (one ``aminmax``, one transfer to the host), the only value read a
    model's forward makes before its embeddings. A meta tensor has no values: it is skipped so
    that shape propagation on the meta device (as transformers does before loading weights)
    still works.

    Example:
        >>> ids_in_range("input_ids", torch.tensor([[0, 5]]), 5, "vocab_size")
        Traceback (most recent call last):
        ...
        ValueError: input_ids must be in 0..4 (vocab_size=5), got values 0..5
    """
    if not has_values(ids) or ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < 0 or high >= size:
        raise ValueError(f"{name} must be in 0..{size - 1} ({size_name}={size}), got values {low}..{high}")


def describe(value: object) -> str:
    """A tensor's dtype and shape, or another value's type name, for error messages."""
    if isinstance(value, Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
