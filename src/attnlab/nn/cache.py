"""A preallocated key/value cache for incremental (token-by-token) decoding."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of the tokens seen so far, in preallocated buffers updated in place.

    The buffers have room for ``max_len`` positions; :meth:`update` writes new keys/values
    after the ones already stored and returns only the *filled* slice, so positions beyond
    the current length are never read. Writing past ``max_len`` raises instead of wrapping
    around or overwriting anything. With grouped-query attention the cache holds the
    ``Hkv`` key/value heads only (that is its memory saving).

    A cache is meant for inference (under ``torch.no_grad()``): it is written in place.

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
        sizes = dict(batch_size=batch_size, num_kv_heads=num_kv_heads, max_len=max_len,
                     head_dim=head_dim)
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        value_dim = head_dim if value_dim is None else value_dim
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
            ValueError: the shapes do not match the cache, or the cache would overflow
                (nothing is written in that case).

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
