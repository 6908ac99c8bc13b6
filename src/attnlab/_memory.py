"""Peak tensor memory of a block of PyTorch code, on any device, CPU included.

PyTorch reports peak memory only for CUDA. :class:`PeakMemory` watches every operator that runs
inside its ``with`` block (a ``TorchDispatchMode``, so autograd's backward ops are seen too) and
records each new tensor storage the ops return: its size is added to the live total, and a
``weakref.finalize`` on the storage subtracts it when the last tensor using it is freed (PyTorch
keeps one Python object per storage alive as long as the storage lives, so the finalizer fires
exactly at the free). The peak of the live total is the answer.

It counts storages created inside the block; tensors that already existed are not counted, and
scratch buffers a kernel allocates and frees inside one operator are invisible (the
operators' outputs, autograd's saved tensors and gradients are all seen).

Example:
    >>> import torch
    >>> with PeakMemory() as meter:
    ...     x = torch.ones(1024, 1024)        # 4 MiB of float32
    ...     y = x * 2                         # another 4 MiB while both live
    ...     del x, y
    ...     z = torch.ones(256, 1024)         # 1 MiB
    >>> meter.peak_bytes / 2**20, meter.current_bytes / 2**20
    (8.0, 1.0)
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakMemory"]


class PeakMemory(TorchDispatchMode):
    """Context manager measuring the peak bytes of tensor storage allocated inside it.

    Attributes:
        peak_bytes: highest total of live storages created in the block, in bytes.
        current_bytes: total of those storages still alive (updated on every free).

    Example:
        >>> with PeakMemory() as meter:
        ...     a = torch.zeros(1024, 1024)   # 4 MiB
        >>> meter.peak_bytes == 1024 * 1024 * 4
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak_bytes = 0
        self.current_bytes = 0
        self._sizes: dict[int, int] = {}  # storage address -> bytes counted
        self._existing: set[int] = set()  # storages that were there before the block

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, torch.Tensor):
                self._note_existing(value)
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return result

    def _note_existing(self, tensor: torch.Tensor) -> None:
        """An input whose storage the block did not create: a view of it (an alias, a no-op
        ``.to``) returned by an op is not new memory."""
        if tensor.layout != torch.strided:
            for part in _parts(tensor):
                self._note_existing(part)
            return
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if storage.nbytes() and key not in self._sizes and key not in self._existing:  # 0 bytes: an out= may grow it
            self._existing.add(key)
            weakref.finalize(storage, self._existing.discard, key)

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.layout != torch.strided:  # a sparse tensor has no storage: its parts have
            for part in _parts(tensor):
                self._track(part)
            return
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._existing:
            return
        size = storage.nbytes()
        previous = self._sizes.get(key)
        if previous is None:
            if size == 0:
                return
            weakref.finalize(storage, self._release, key)
        if previous != size:  # new storage, or one resized in place (out= ops)
            self._sizes[key] = size
            self.current_bytes += size - (previous or 0)
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _release(self, key: int) -> None:
        self.current_bytes -= self._sizes.pop(key, 0)


def _parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors that hold a sparse CSR/COO tensor's data (indices and values)."""
    if tensor.layout == torch.sparse_coo:
        return (tensor._indices(), tensor._values())
    if tensor.layout == torch.sparse_csr:
        return (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    return ()
