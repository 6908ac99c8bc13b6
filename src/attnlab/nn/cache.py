"""A preallocated key/value cache for incremental (token-by-token) decoding."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from attnlab._checks import instance_of, positive_int

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of the tokens seen so far, in preallocated buffers updated in place.

    The buffers have room for ``max_len`` positions; :meth:`update` writes new keys/values
    after the ones already stored and returns only the *filled* slice, so positions beyond
    the current length are never read. Writing past ``max_len`` raises instead of wrapping
    around or overwriting anything. With grouped-query attention the cache holds the
    ``Hkv`` key/value heads only (that is its memory saving).

    A cache is meant for inference (under ``torch.no_grad()``): it is written in place. A call
    that raises leaves it exactly as it was: :meth:`update` checks everything before writing.

    Shapes:
        keys: ``(B, Hkv, max_len, D)``; values: ``(B, Hkv, max_len, Dv)``.
        :meth:`update` takes ``(B, Hkv, T_new, D)`` / ``(B, Hkv, T_new, Dv)`` and returns
        ``(B, Hkv, length, D)`` / ``(B, Hkv, length, Dv)`` views of the filled slots.

    Args:
        batch_size: ``B``.
        num_kv_heads: ``Hkv``, the number of key/value heads.
        max_len: number of positions the cache can hold.
        head_dim: ``D``, features per key head.
        value_dim: ``Dv``, features per value head (defaults to ``head_dim``).
        dtype, device: of the buffers.

    Example:
        >>> cache = KVCache(batch_size=1, num_kv_heads=2, max_len=8, head_dim=4)
        >>> k, v = cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
        >>> cache.length, k.shape
        (3, torch.Size([1, 2, 3, 4]))
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        value_dim = head_dim if value_dim is None else value_dim
        sizes = dict(batch_size=batch_size, num_kv_heads=num_kv_heads, max_len=max_len,
                     head_dim=head_dim, value_dim=value_dim)
        for name, size in sizes.items():
            positive_int(name, size)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        instance_of("dtype", dtype, torch.dtype, "a torch.dtype")
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype (keys are floats), got {dtype}")
        try:
            device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device must name a torch device, got {device!r}") from err
        self.keys = torch.zeros(batch_size, num_kv_heads, max_len, head_dim, dtype=dtype,
                                device=device)  # (B, Hkv, max_len, D)
        self.values = torch.zeros(batch_size, num_kv_heads, max_len, value_dim, dtype=dtype,
                                  device=device)  # (B, Hkv, max_len, Dv)
        self.length = 0

    @property
    def max_len(self) -> int:
        """Number of positions the cache can hold."""
        return self.keys.shape[2]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept).

        Example:
            >>> cache = KVCache(1, 1, 4, 2)
            >>> _ = cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
            >>> cache.reset(); cache.length
            0
        """
        self.length = 0

    def filled(self) -> tuple[Tensor, Tensor]:
        """Views of the filled slots: ``(B, Hkv, length, D)`` and ``(B, Hkv, length, Dv)``.

        Example:
            >>> KVCache(1, 1, 4, 2).filled()[0].shape
            torch.Size([1, 1, 0, 2])
        """
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``T_new`` positions and return every filled position so far.

        Args:
            k_new: ``(B, Hkv, T_new, D)`` keys of the new tokens.
            v_new: ``(B, Hkv, T_new, Dv)`` values of the new tokens.

        Returns:
            ``(keys, values)`` views ``(B, Hkv, length, D)``, ``(B, Hkv, length, Dv)`` where
            ``length`` is the new length (old length + ``T_new``).

        Raises:
            TypeError: ``k_new``/``v_new`` are not tensors of the cache's dtype.
            ValueError: their shapes or device do not match the cache, or the cache would
                overflow. Nothing is written in any of these cases.

        Example:
            >>> cache = KVCache(1, 1, 2, 2)
            >>> _ = cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
            >>> cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: KV cache overflow: 2 positions cached + 1 new > max_len=2; ...
        """
        self._check_new(k_new, v_new)
        start, stop = self.length, self.length + k_new.shape[2]
        if stop > self.max_len:
            raise ValueError(
                f"KV cache overflow: {start} positions cached + {k_new.shape[2]} new > "
                f"max_len={self.max_len}; create the cache with a larger max_len or reset() it"
            )
        self.keys[:, :, start:stop].copy_(k_new)
        self.values[:, :, start:stop].copy_(v_new)
        self.length = stop
        return self.filled()

    def _check_new(self, k_new: Tensor, v_new: Tensor) -> None:
        for name, new in (("k_new", k_new), ("v_new", v_new)):
            instance_of(name, new, Tensor, "a torch.Tensor")
            if new.dtype != self.keys.dtype:
                raise TypeError(
                    f"{name} has dtype {new.dtype} but the cache holds {self.keys.dtype}; create "
                    "the cache with the dtype of the keys (module.new_cache does)"
                )
            if new.device != self.keys.device:
                raise ValueError(
                    f"{name} is on {new.device} but the cache is on {self.keys.device}"
                )
        expected_k = (self.batch_size, self.num_kv_heads, self.keys.shape[3])
        expected_v = (self.batch_size, self.num_kv_heads, self.values.shape[3])
        seen_k = (k_new.shape[0], k_new.shape[1], k_new.shape[3]) if k_new.ndim == 4 else None
        seen_v = (v_new.shape[0], v_new.shape[1], v_new.shape[3]) if v_new.ndim == 4 else None
        if seen_k != expected_k or seen_v != expected_v or k_new.shape[2] != v_new.shape[2]:
            raise ValueError(
                f"k_new/v_new must be (B, Hkv, T_new, D)/(B, Hkv, T_new, Dv) with B, Hkv, D, Dv = "
                f"{expected_k + expected_v[2:]}; got k_new {tuple(k_new.shape)}, "
                f"v_new {tuple(v_new.shape)}"
            )

    def __repr__(self) -> str:
        return (
            f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
            f"length={self.length}, max_len={self.max_len}, head_dim={self.keys.shape[3]}, "
            f"dtype={self.keys.dtype})"
        )


class _Slots:
    """The length of a cache and copies of the slots the next ``num_new`` positions would use."""

    def __init__(self, cache: KVCache, num_new: int):
        self.cache, self.length = cache, cache.length
        stop = min(cache.max_len, cache.length + max(0, num_new))
        self.keys = cache.keys[:, :, self.length : stop].clone()
        self.values = cache.values[:, :, self.length : stop].clone()

    def restore(self) -> None:
        stop = self.length + self.keys.shape[2]
        with torch.no_grad():
            self.cache.keys[:, :, self.length : stop].copy_(self.keys)
            self.cache.values[:, :, self.length : stop].copy_(self.values)
        self.cache.length = self.length


@contextlib.contextmanager
def _restore_on_error(caches: Iterable[object], num_new: int) -> Iterator[None]:
    """Put every :class:`KVCache` in ``caches`` back bitwise if the body raises.

    A module appends to its cache before attending, and attention (or a later layer) may still
    fail; only the ``num_new`` slots after the current length can be written, so only they are
    copied. Entries that are not caches (None) are skipped.
    """
    saved = [_Slots(cache, num_new) for cache in caches if isinstance(cache, KVCache)]
    try:
        yield
    except BaseException:
        for slots in saved:
            slots.restore()
        raise
