"""Key/value caches for incremental (token-by-token) decoding, behind one interface.

* :class:`KVCache` -- one preallocated contiguous buffer per batch row (``max_len`` slots each);
* :class:`WindowedKVCache` -- a ring buffer of the last ``window`` positions, exact for a
  causal sliding-window layer at any generated length, its memory flat in that length;
* :class:`ChunkedKVCache` -- the current chunk of a chunked-local layer (Llama 4's local layers),
  ``chunk`` slots at any generated length;
* :class:`BranchCache` -- named caches that advance together, one per part of a layer that keeps
  more than one set of keys (a top-k layer's index keys, NSA's three branches);
* :class:`PagedKVCache` -- a pool of fixed-size pages shared by the rows, each row owning a block
  table (its list of pages); rows of different lengths hold only the pages they fill, and a
  finished row's pages go back to the pool for the next sequence (vLLM's paged attention);
* :class:`RecurrentCache` -- a linear-attention layer's state (its short convolution's last inputs
  and one ``(Dk, Dv)`` matrix per head): constant bytes at any length, no keys at all.

Every cache is a :class:`Cache`: the modules call :meth:`Cache.attend` with the queries and the
new keys/values, and the cache stores them and runs the module's attention over what the queries
may see. A call that raises leaves any cache exactly as it was (checks come before writes, and
the modules' guard restores the slots a failing call wrote).

Example:
    >>> cache = WindowedKVCache(batch_size=1, num_kv_heads=1, window=4, head_dim=2)
    >>> for _ in range(10):
    ...     k, v = cache.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    >>> cache.length, k.shape[2]                  # 10 positions seen, the last 4 held
    (10, 4)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

from attnlab._checks import instance_of, non_negative_int, positive_int

__all__ = ["Cache", "KVCache", "WindowedKVCache", "ChunkedKVCache", "BranchCache", "PagedKVCache", "RecurrentCache",
           "new_positions"]

# attend(q, keys, values) -> out; a ragged paged batch adds key_lengths= (see Cache.attend).
Attend = Callable[..., Tensor]


def _dtype_device(dtype, device) -> tuple[torch.dtype, torch.device | None]:
    """The checked dtype (floating point) and device of a cache's buffers."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    instance_of("dtype", dtype, torch.dtype, "a torch.dtype")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype (keys are floats), got {dtype}")
    try:
        device = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must name a torch device, got {device!r}") from err
    return dtype, device


def _cache_options(weight: Tensor, dtype, device) -> dict:
    """A module's cache buffers' ``dtype`` and ``device``: the ones given, else its ``weight``'s."""
    return {"dtype": weight.dtype if dtype is None else dtype, "device": weight.device if device is None else device}


def _check_sizes(**sizes: int) -> None:
    """Positive sizes; ``value_dim`` may be 0 (a cache of keys only, as MLA's latent)."""
    for name, size in sizes.items():
        (non_negative_int if name == "value_dim" else positive_int)(name, size)


class Cache:
    """The interface every KV cache offers the attention modules (see the module docstring).

    A subclass holds ``keys``-like buffers of ``dtype`` on ``device`` and implements
    :attr:`row_lengths`, :meth:`check_room`, :meth:`extend`, ``reset``, :attr:`nbytes`
    and :meth:`_snapshot`.

    Example:
        >>> isinstance(KVCache(1, 1, 4, 2), Cache)
        True
    """

    batch_size: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def row_lengths(self) -> tuple[int, ...]:
        """Positions cached so far in each batch row (the next token's position)."""
        raise NotImplementedError

    @property
    def length(self) -> int:
        """Positions cached so far, the same in every row (``ValueError`` for a ragged cache)."""
        lengths = set(self.row_lengths)
        if len(lengths) > 1:
            raise ValueError(f"the rows of this cache hold different lengths {self.row_lengths}; "
                             "read row_lengths")
        return lengths.pop() if lengths else 0

    def check_room(self, num_new: int) -> None:
        """``ValueError`` if ``num_new`` more positions per row do not fit; writes nothing."""
        raise NotImplementedError

    def extend(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store ``k_new``/``v_new`` and return the keys and values the new queries may see.

        The third value is None when every row holds the same length; a cache whose rows differ
        (:class:`PagedKVCache`) right-pads them to the longest and returns each row's real key
        count ``(B,)`` int64, on which the module aligns its rule (:func:`attnlab.nn.multihead.causal_rule`).

        Shapes:
            k_new: ``(B, Hkv, T_new, D)``; v_new: ``(B, Hkv, T_new, Dv)`` -> keys ``(B, Hkv, L, D)``,
            values ``(B, Hkv, L, Dv)``, lengths ``(B,)`` or None.
        """
        raise NotImplementedError

    def attend(self, q: Tensor, k_new: Tensor, v_new: Tensor, attend: Attend) -> Tensor:
        """:meth:`extend`, then ``attend(q, keys, values)`` (with ``key_lengths=`` for ragged rows).

        Shapes:
            q: ``(B, H, T_new, D)``; k_new: ``(B, Hkv, T_new, D)``; v_new: ``(B, Hkv, T_new, Dv)``
            -> ``(B, H, T_new, Dv)``.
        """
        keys, values, lengths = self.extend(k_new, v_new)
        if lengths is None:
            return attend(q, keys, values)
        return attend(q, keys, values, key_lengths=lengths)  # (B, H, T_new, Dv)

    @property
    def nbytes(self) -> int:
        """Bytes of the key/value storage the cache holds now."""
        raise NotImplementedError

    def _snapshot(self, num_new: int) -> Callable[[], None]:
        """A function that puts back what the next ``num_new`` positions per row would change."""
        raise NotImplementedError

    def _check_new(self, k_new: Tensor, v_new: Tensor) -> None:
        for name, new in (("k_new", k_new), ("v_new", v_new)):
            instance_of(name, new, Tensor, "a torch.Tensor")
            if new.dtype != self.dtype:
                raise TypeError(
                    f"{name} has dtype {new.dtype} but the cache holds {self.dtype}; create "
                    "the cache with the dtype of the keys (module.new_cache does)"
                )
            if new.device != self.device:
                raise ValueError(f"{name} is on {new.device} but the cache is on {self.device}")
        expected_k = (self.batch_size, self.num_kv_heads, self.head_dim)
        expected_v = (self.batch_size, self.num_kv_heads, self.value_dim)
        seen_k = (k_new.shape[0], k_new.shape[1], k_new.shape[3]) if k_new.ndim == 4 else None
        seen_v = (v_new.shape[0], v_new.shape[1], v_new.shape[3]) if v_new.ndim == 4 else None
        if seen_k != expected_k or seen_v != expected_v or k_new.shape[2] != v_new.shape[2]:
            raise ValueError(
                f"k_new/v_new must be (B, Hkv, T_new, D)/(B, Hkv, T_new, Dv) with B, Hkv, D, Dv = "
                f"{expected_k + expected_v[2:]}; got k_new {tuple(k_new.shape)}, "
                f"v_new {tuple(v_new.shape)}"
            )


def new_positions(cache: Cache | None, num_new: int, *, device=None) -> int | Tensor:
    """Positions of ``num_new`` tokens appended to ``cache``: an int offset when every row is at
    the same length, else a ``(B, num_new)`` int64 tensor (a ragged paged batch).

    Example:
        >>> new_positions(None, 3), new_positions(KVCache(1, 1, 4, 2), 2)
        (0, 0)
    """
    if cache is None:
        return 0
    lengths = cache.row_lengths
    if len(set(lengths)) <= 1:
        return lengths[0] if lengths else 0
    start = torch.tensor(lengths, dtype=torch.int64, device=device)
    return start[:, None] + torch.arange(num_new, device=device)  # (B, T_new)


class _BufferCache(Cache):
    """A cache of two preallocated buffers ``keys (B, Hkv, slots, D)`` and ``values (B, Hkv,
    slots, Dv)`` with one length for every row: what :class:`KVCache` and
    :class:`WindowedKVCache` share (sizes read off the buffers, bytes, reset)."""

    length: int = 0  # an attribute here (the base class derives it from row_lengths)

    def _allocate(self, batch_size: int, num_kv_heads: int, slots: int, head_dim: int,
                  value_dim: int | None, dtype, device, **size_names: int) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        _check_sizes(batch_size=batch_size, num_kv_heads=num_kv_heads, **size_names,
                     head_dim=head_dim, value_dim=value_dim)
        dtype, device = _dtype_device(dtype, device)
        self.keys = torch.zeros(batch_size, num_kv_heads, slots, head_dim, dtype=dtype,
                                device=device)  # (B, Hkv, slots, D)
        self.values = torch.zeros(batch_size, num_kv_heads, slots, value_dim, dtype=dtype,
                                  device=device)  # (B, Hkv, slots, Dv)
        self.length = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    @property
    def value_dim(self) -> int:
        return self.values.shape[3]

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return (self.length,) * self.batch_size

    @property
    def nbytes(self) -> int:
        """Bytes of both buffers (every slot is allocated up front, whatever the length).

        Example:
            >>> KVCache(1, 2, 8, 4).nbytes   # 2 buffers x 2 heads x 8 slots x 4 floats x 4 bytes
            512
            >>> WindowedKVCache(1, 1, 4, 2).nbytes
            64
        """
        return self.keys.nbytes + self.values.nbytes

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept).

        Example:
            >>> cache = KVCache(1, 1, 4, 2)
            >>> _ = cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
            >>> cache.reset(); cache.length
            0
        """
        self.length = 0


class KVCache(_BufferCache):
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
        self._allocate(batch_size, num_kv_heads, max_len, head_dim, value_dim, dtype, device, max_len=max_len)

    def check_room(self, num_new: int) -> None:
        if self.length + num_new > self.max_len:
            raise ValueError(
                f"KV cache overflow: {self.length} positions cached + {num_new} new > "
                f"max_len={self.max_len}; create the cache with a larger max_len or reset() it"
            )

    def extend(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, None]:
        return (*self.update(k_new, v_new), None)  # (B, Hkv, length, D), (B, Hkv, length, Dv)

    def _snapshot(self, num_new: int) -> Callable[[], None]:
        return _Slots(self, num_new).restore

    @property
    def max_len(self) -> int:
        """Number of positions the cache can hold."""
        return self.keys.shape[2]

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
        self.check_room(k_new.shape[2])
        start, stop = self.length, self.length + k_new.shape[2]
        self.keys[:, :, start:stop].copy_(k_new)
        self.values[:, :, start:stop].copy_(v_new)
        self.length = stop
        return self.filled()

    def append(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`update` for a caller that has checked the new keys and values (shapes, dtype,
        device) and the room left: a decoding step's write, without the checks.

        Example:
            >>> cache = KVCache(1, 1, 4, 2)
            >>> k, v = cache.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
            >>> cache.length, k.shape
            (1, torch.Size([1, 1, 1, 2]))
        """
        start, stop = self.length, self.length + k_new.shape[2]
        self.keys[:, :, start:stop] = k_new
        self.values[:, :, start:stop] = v_new
        self.length = stop
        return self.keys[:, :, :stop], self.values[:, :, :stop]

    def __repr__(self) -> str:
        return (
            f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
            f"length={self.length}, max_len={self.max_len}, head_dim={self.keys.shape[3]}, "
            f"dtype={self.keys.dtype})"
        )


class _SlotCache(_BufferCache):
    """A buffer cache that overwrites slots (a window's ring, a chunk's restart): a failed call
    puts back only the slots ``_written_slots(num_new)`` it would overwrite, and the length."""

    def _written_slots(self, num_new: int) -> slice | Tensor:
        raise NotImplementedError

    def extend(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, None]:
        return (*self.update(k_new, v_new), None)

    def _snapshot(self, num_new: int) -> Callable[[], None]:
        length, slots = self.length, self._written_slots(max(0, num_new))
        keys, values = self.keys[:, :, slots].clone(), self.values[:, :, slots].clone()

        def restore() -> None:
            with torch.no_grad():
                self.keys[:, :, slots] = keys
                self.values[:, :, slots] = values
            self.length = length
        return restore


class WindowedKVCache(_SlotCache):
    """A ring buffer of the last ``window`` keys/values: a sliding-window layer's whole cache.

    A causal sliding-window layer lets the query at position ``p`` see keys ``p - window + 1 ..
    p`` only, so nothing older is ever read again: position ``p`` is stored in slot ``p %
    window``, overwriting position ``p - window``. Memory stays ``window`` slots however many
    tokens are generated, and the layer's output is exactly that of a full recomputation with the
    same window (the module checks that its window is at most the cache's).

    :meth:`update` returns the keys the new queries may reach: positions ``length - window + 1
    .. length + T_new - 1`` (those that exist), in chronological order; for one new token the
    returned views are the ring itself, in slot order (every key in it is visible to that
    token, and attention does not depend on the order of the keys it sees), so decoding copies
    nothing.

    Shapes:
        keys: ``(B, Hkv, window, D)``; values: ``(B, Hkv, window, Dv)``. :meth:`update` takes
        ``(B, Hkv, T_new, D)`` / ``(B, Hkv, T_new, Dv)`` and returns ``(B, Hkv, Tk, D)`` /
        ``(B, Hkv, Tk, Dv)`` with ``Tk = min(length, window - 1) + T_new``.

    Args:
        batch_size: ``B``.
        num_kv_heads: ``Hkv``.
        window: positions kept (the sliding window of the layer it serves, or more).
        head_dim: ``D``.
        value_dim: ``Dv`` (defaults to ``head_dim``; 0 for a cache of keys only).
        dtype, device: of the buffers.

    Example:
        >>> cache = WindowedKVCache(batch_size=1, num_kv_heads=1, window=3, head_dim=1)
        >>> k, _ = cache.update(torch.arange(5.0).view(1, 1, 5, 1), torch.zeros(1, 1, 5, 1))
        >>> k.flatten().tolist(), cache.keys.flatten().tolist()   # positions 3, 4 live in slots 0, 1
        ([0.0, 1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 2.0])
    """

    def __init__(self, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        self._allocate(batch_size, num_kv_heads, window, head_dim, value_dim, dtype, device, window=window)
        self.window = window  # positions kept; ``length`` counts every position seen

    def check_room(self, num_new: int) -> None:
        """A ring never overflows: the oldest positions make room."""

    def _written_slots(self, num_new: int) -> slice | Tensor:
        """Slots the last ``min(num_new, window)`` new positions go to, in order: a slice unless
        they wrap around the ring (a decoding step's one slot is a plain copy, not an index_put)."""
        kept = min(num_new, self.window)
        first = (self.length + num_new - kept) % self.window
        if first + kept <= self.window:
            return slice(first, first + kept)
        return torch.arange(first, first + kept, device=self.device) % self.window  # (kept,)

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new positions and return every key/value they may see (see the class).

        Example:
            >>> cache = WindowedKVCache(1, 1, 2, 1)
            >>> _ = cache.update(torch.ones(1, 1, 3, 1), torch.ones(1, 1, 3, 1))
            >>> cache.update(torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1))[0].shape
            torch.Size([1, 1, 2, 1])
        """
        self._check_new(k_new, v_new)
        num_new = k_new.shape[2]
        old = min(self.length, self.window - 1)
        slots, kept = self._written_slots(num_new), min(num_new, self.window)
        if num_new == 1:
            self.keys[:, :, slots] = k_new  # slot = length % window
            self.values[:, :, slots] = v_new
            self.length += 1
            stop = min(self.length, self.window)
            return self.keys[:, :, :stop], self.values[:, :, :stop]
        earlier = torch.arange(self.length - old, self.length, device=self.device) % self.window
        keys = torch.cat([self.keys[:, :, earlier], k_new], dim=2)  # (B, Hkv, old + T_new, D)
        values = torch.cat([self.values[:, :, earlier], v_new], dim=2)  # (B, Hkv, old + T_new, Dv)
        self.keys[:, :, slots] = k_new[:, :, num_new - kept:]
        self.values[:, :, slots] = v_new[:, :, num_new - kept:]
        self.length += num_new
        return keys, values

    def __repr__(self) -> str:
        return (f"WindowedKVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"length={self.length}, window={self.window}, head_dim={self.head_dim}, dtype={self.dtype})")


class ChunkedKVCache(_SlotCache):
    """The current chunk's keys/values: a chunked-local layer's whole cache (Llama 4's local layers).

    A chunked-local layer lets the query at position ``p`` see keys ``p - p % chunk .. p`` only
    (its own chunk, causally), so a key is never read once its chunk is over: position ``p`` lives
    in slot ``p % chunk`` and each chunk starts over at slot 0. Memory stays ``chunk`` slots however
    many tokens are generated.

    :meth:`update` returns the keys the new queries may reach, in order: from the start of the
    first new position's chunk to the newest position. They start on a chunk boundary, as the
    module's rule (:func:`attnlab.nn.multihead.causal_rule` with ``chunk``) expects; a decoding
    step gets a view of the held slots, copying nothing.

    Shapes:
        keys: ``(B, Hkv, chunk, D)``; values: ``(B, Hkv, chunk, Dv)``. :meth:`update` takes
        ``(B, Hkv, T_new, D)`` / ``(B, Hkv, T_new, Dv)`` and returns ``(B, Hkv, length % chunk +
        T_new, D)`` / ``(..., Dv)`` (``length`` before the update).

    Args:
        batch_size, num_kv_heads, head_dim: ``B``, ``Hkv``, ``D``.
        chunk: the chunk of the layer it serves.
        value_dim: ``Dv`` (defaults to ``head_dim``).
        dtype, device: of the buffers.

    Example:
        >>> cache = ChunkedKVCache(batch_size=1, num_kv_heads=1, chunk=3, head_dim=1)
        >>> k, _ = cache.update(torch.arange(5.0).view(1, 1, 5, 1), torch.zeros(1, 1, 5, 1))
        >>> k.flatten().tolist(), cache.keys.flatten()[:2].tolist()   # positions 3, 4: chunk 1
        ([0.0, 1.0, 2.0, 3.0, 4.0], [3.0, 4.0])
        >>> cache.update(torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1))[0].flatten().tolist()
        [3.0, 4.0, 1.0]
    """

    def __init__(self, batch_size: int, num_kv_heads: int, chunk: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        self._allocate(batch_size, num_kv_heads, chunk, head_dim, value_dim, dtype, device, chunk=chunk)
        self.chunk = chunk  # positions per chunk; ``length`` counts every position seen

    def check_room(self, num_new: int) -> None:
        """Never full: a new chunk starts over at slot 0."""

    def _written_slots(self, num_new: int) -> slice:
        """Slots the new positions of the last chunk they reach go to."""
        held = self.length % self.chunk
        if held + num_new <= self.chunk:
            return slice(held, held + num_new)
        return slice(0, (self.length + num_new) % self.chunk)

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new positions of the last chunk they reach; return every key they may see."""
        self._check_new(k_new, v_new)
        num_new, held = k_new.shape[2], self.length % self.chunk
        slots = self._written_slots(num_new)
        if held + num_new <= self.chunk:  # one chunk: the held slots and the new ones, in place
            self.keys[:, :, slots].copy_(k_new)
            self.values[:, :, slots].copy_(v_new)
            self.length += num_new
            return self.keys[:, :, : held + num_new], self.values[:, :, : held + num_new]
        keys = torch.cat([self.keys[:, :, :held], k_new], dim=2)  # (B, Hkv, held + T_new, D)
        values = torch.cat([self.values[:, :, :held], v_new], dim=2)  # (B, Hkv, held + T_new, Dv)
        tail = slots.stop  # the new positions of the last chunk
        self.keys[:, :, slots].copy_(k_new[:, :, num_new - tail:])
        self.values[:, :, slots].copy_(v_new[:, :, num_new - tail:])
        self.length += num_new
        return keys, values

    def __repr__(self) -> str:
        return (f"ChunkedKVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"length={self.length}, chunk={self.chunk}, head_dim={self.head_dim}, dtype={self.dtype})")


class BranchCache(Cache):
    """Named caches that advance together: a layer that keeps more than one set of keys per token
    (a DSA layer's keys and index keys; NSA's compressed, selected and window branches) holds one
    part per set and writes each itself through the part's own ``update``.

    The first part counts the positions (:attr:`row_lengths`, :meth:`check_room`, ``dtype``,
    ``device``, ``batch_size``, ``num_kv_heads``, ``head_dim``, ``value_dim``); a part that holds
    fewer entries than positions (compressed blocks) is sized by its module. :attr:`nbytes` sums the
    parts, :meth:`reset` empties them all, and a failing call puts every part back.

    Args:
        parts: name -> a :class:`KVCache`, :class:`WindowedKVCache` or :class:`ChunkedKVCache`, at
            least one; all of one batch size, dtype and device.

    Example:
        >>> cache = BranchCache(keys=KVCache(1, 2, 8, 4), index=KVCache(1, 1, 8, 3, value_dim=0))
        >>> _ = cache["index"].update(torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2, 0))
        >>> _ = cache["keys"].update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
        >>> cache.length, cache.names, cache.nbytes    # 2 x 2 x 8 x 4 x 4 bytes + 8 x 3 x 4 bytes
        (2, ('keys', 'index'), 608)
    """

    def __init__(self, **parts: Cache):
        if not parts:
            raise ValueError("BranchCache needs at least one part (name=cache)")
        for name, part in parts.items():
            instance_of(name, part, _BufferCache, "a KVCache, WindowedKVCache or ChunkedKVCache")
        first = next(iter(parts.values()))
        for name, part in parts.items():
            if (part.batch_size, part.dtype, part.device) != (first.batch_size, first.dtype, first.device):
                raise ValueError(f"part {name!r} holds batch {part.batch_size}, {part.dtype} on {part.device}; "
                                 f"the first part holds batch {first.batch_size}, {first.dtype} on {first.device}")
        self._parts = dict(parts)
        self._first = first

    def __getitem__(self, name: str) -> Cache:
        if name not in self._parts:
            raise KeyError(f"this BranchCache has no part {name!r}; its parts are {self.names}")
        return self._parts[name]

    @property
    def names(self) -> tuple[str, ...]:
        """The parts' names, the position-counting one first."""
        return tuple(self._parts)

    def __getattr__(self, name: str):
        if name in ("dtype", "device", "batch_size", "num_kv_heads", "head_dim", "value_dim"):
            return getattr(self._first, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return self._first.row_lengths

    def check_room(self, num_new: int) -> None:
        self._first.check_room(num_new)

    def extend(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        raise TypeError(f"a BranchCache holds parts {self.names}; write each part (cache[name].update)")

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self._parts.values())

    def reset(self) -> None:
        """Empty every part."""
        for part in self._parts.values():
            part.reset()

    def _snapshot(self, num_new: int) -> Callable[[], None]:
        restores = [part._snapshot(num_new) for part in self._parts.values()]

        def restore() -> None:
            for undo in restores:
                undo()
        return restore

    def __repr__(self) -> str:
        return f"BranchCache({', '.join(f'{name}={part!r}' for name, part in self._parts.items())})"


class _Pool:
    """The pages a :class:`PagedKVCache` and the views :meth:`PagedKVCache.select` makes share."""

    def __init__(self, num_pages, page_size, num_kv_heads, head_dim, value_dim, dtype, device):
        slots = num_pages * page_size
        self.keys = torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device)  # (S, Hkv, D)
        self.values = torch.zeros(slots, num_kv_heads, value_dim, dtype=dtype, device=device)  # (S, Hkv, Dv)
        self.page_size, self.num_pages = page_size, num_pages
        self.free = list(range(num_pages))  # lowest page first: allocation is deterministic


class _Sequence:
    """One row of a paged cache: its block table (pages in order), their slots, its length."""

    def __init__(self, device):
        self.pages: list[int] = []
        self.slots = torch.zeros(0, dtype=torch.int64, device=device)  # (len(pages) * P,)
        self.length = 0

    def state(self):
        return list(self.pages), self.slots, self.length

    def set_state(self, state) -> None:
        self.pages, self.slots, self.length = list(state[0]), state[1], state[2]


class PagedKVCache(Cache):
    """Keys/values in fixed-size pages from a shared pool; each row has its own block table.

    The pool holds ``capacity`` token slots cut into pages of ``page_size``. A row takes a page
    from the pool when its last page is full, so it holds ``ceil(length / page_size)`` pages,
    whatever the other rows hold: a batch of prompts of different lengths stores no padding.
    Attention is one call for the whole batch: :meth:`padded` gathers each row's pages into a
    transient ``(B, Hkv, L_max, D)`` copy (pages are zeroed when a row takes them, so no row reads
    another row's keys, even a released one's) and the module masks each row past its own length.
    :meth:`release` gives a finished row's pages back for the next sequence; :meth:`select`
    gives a view of some rows (sharing the pool), e.g. to prefill each prompt alone.

    Shapes:
        pool: ``keys`` ``(capacity, Hkv, D)``, ``values`` ``(capacity, Hkv, Dv)`` (slot ``s`` of
        page ``p`` is ``p * page_size + s``). :meth:`update` takes ``(B, Hkv, T_new, D)`` /
        ``(B, Hkv, T_new, Dv)`` (the same number of new tokens in every row) and returns one
        ``((1, Hkv, L_b, D), (1, Hkv, L_b, Dv))`` pair per row ``b`` of length ``L_b``.

    Args:
        batch_size: rows (sequences).
        num_kv_heads: ``Hkv``.
        capacity: token slots in the pool, shared by all rows; a multiple of ``page_size``.
        head_dim: ``D``.
        page_size: slots per page.
        value_dim: ``Dv`` (defaults to ``head_dim``; 0 for a cache of keys only).
        dtype, device: of the pool.

    Raises:
        ValueError: ``capacity`` is not a multiple of ``page_size``; an update needs more pages
            than the pool has free (nothing is written).

    Example:
        >>> cache = PagedKVCache(batch_size=2, num_kv_heads=1, capacity=16, head_dim=2, page_size=4)
        >>> _ = cache.select([0]).update(torch.ones(1, 1, 6, 2), torch.ones(1, 1, 6, 2))
        >>> _ = cache.select([1]).update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
        >>> cache.row_lengths, cache.block_tables, cache.free_pages
        ((6, 1), [[0, 1], [2]], 1)
        >>> cache.release(0); cache.free_pages
        3
    """

    def __init__(self, batch_size: int, num_kv_heads: int, capacity: int, head_dim: int, *,
                 page_size: int = 16, value_dim: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        value_dim = head_dim if value_dim is None else value_dim
        _check_sizes(batch_size=batch_size, num_kv_heads=num_kv_heads, capacity=capacity,
                     head_dim=head_dim, page_size=page_size, value_dim=value_dim)
        if capacity % page_size:
            raise ValueError(f"capacity ({capacity}) must be a multiple of page_size ({page_size}): "
                             "the pool is cut into whole pages")
        dtype, device = _dtype_device(dtype, device)
        pool = _Pool(capacity // page_size, page_size, num_kv_heads, head_dim, value_dim, dtype, device)
        self._attach(pool, [_Sequence(pool.keys.device) for _ in range(batch_size)])

    def _attach(self, pool: _Pool, rows: list[_Sequence]) -> None:
        self.pool, self.rows = pool, rows
        self.batch_size, self.num_kv_heads = len(rows), pool.keys.shape[1]
        self.head_dim, self.value_dim = pool.keys.shape[2], pool.values.shape[2]
        self.dtype, self.device, self.page_size = pool.keys.dtype, pool.keys.device, pool.page_size

    def select(self, rows: Iterable[int]) -> "PagedKVCache":
        """A cache of the given rows only, sharing this one's pool and block tables.

        Raises:
            TypeError: ``rows`` is not a list (an iterable) of ints.
            ValueError: no row, a row out of range, or a repeated row (two rows of the view would be
                one sequence, and one update would append both rows' keys to it).

        Example:
            >>> cache = PagedKVCache(3, 1, 8, 2, page_size=4)
            >>> cache.select([2]).batch_size
            1
        """
        if isinstance(rows, (str, bytes, Tensor)) or not isinstance(rows, Iterable):
            raise TypeError(f"rows must be a list of row indices, got {type(rows).__name__}")
        rows = [self._row_index(row) for row in rows]
        if not rows or len(set(rows)) < len(rows):
            raise ValueError(f"rows must name at least one row and repeat none (each is one sequence), got {rows}")
        view = object.__new__(PagedKVCache)
        view._attach(self.pool, [self.rows[row] for row in rows])
        return view

    def _row_index(self, row: object) -> int:
        non_negative_int("row", row)
        if row >= self.batch_size:
            raise ValueError(f"row must be below batch_size={self.batch_size}, got {row}")
        return row

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return tuple(seq.length for seq in self.rows)

    @property
    def block_tables(self) -> list[list[int]]:
        """Each row's pages, in the order its positions fill them."""
        return [list(seq.pages) for seq in self.rows]

    @property
    def free_pages(self) -> int:
        """Pages of the pool no row holds."""
        return len(self.pool.free)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages the rows hold (the pool's free pages are not counted).

        Example:
            >>> cache = PagedKVCache(1, 1, 8, 2, page_size=4)
            >>> _ = cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
            >>> cache.nbytes   # one page: 4 slots x (2 + 2) floats x 4 bytes
            64
        """
        per_slot = (self.pool.keys[0].nbytes + self.pool.values[0].nbytes)
        return sum(len(seq.pages) for seq in self.rows) * self.page_size * per_slot

    def _pages_needed(self, num_new: int) -> list[int]:
        size = self.page_size
        return [max(0, -(-(seq.length + num_new) // size) - len(seq.pages)) for seq in self.rows]

    def check_room(self, num_new: int) -> None:
        needed = sum(self._pages_needed(num_new))
        if needed > len(self.pool.free):
            raise ValueError(
                f"KV cache overflow: {num_new} new positions per row need {needed} more pages of "
                f"{self.page_size} but the pool has {len(self.pool.free)} free (capacity "
                f"{self.pool.num_pages * self.page_size}); release() finished rows or make a larger cache")

    def _allocate(self, num_new: int) -> None:
        """Give each row the pages ``num_new`` more positions need, zeroed: the slots of a row's
        pages it has not written yet hold zeros, never a released row's keys (what :meth:`padded`
        reads past a row's length)."""
        offsets = torch.arange(self.page_size, device=self.device)
        for seq, count in zip(self.rows, self._pages_needed(num_new)):
            if not count:
                continue
            pages, self.pool.free = self.pool.free[:count], self.pool.free[count:]
            seq.pages += pages
            fresh = (torch.tensor(pages, dtype=torch.int64, device=self.device)[:, None] * self.page_size
                     + offsets).flatten()  # (count * P,)
            self.pool.keys[fresh], self.pool.values[fresh] = 0, 0
            seq.slots = torch.cat([seq.slots, fresh])

    def update(self, k_new: Tensor, v_new: Tensor, *, gather: bool = True) -> list[tuple[Tensor, Tensor]] | None:
        """Append ``T_new`` positions to every row; return each row's keys/values so far
        (None with ``gather=False``: :meth:`attend` reads them with :meth:`padded`).

        Example:
            >>> cache = PagedKVCache(2, 1, 8, 2, page_size=2)
            >>> [k.shape[2] for k, _ in cache.update(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2))]
            [3, 3]
        """
        self._check_new(k_new, v_new)
        num_new = k_new.shape[2]
        self.check_room(num_new)
        self._allocate(num_new)
        for b, seq in enumerate(self.rows):
            slots = seq.slots[seq.length : seq.length + num_new]
            self.pool.keys[slots] = k_new[b].transpose(0, 1)  # (T_new, Hkv, D)
            self.pool.values[slots] = v_new[b].transpose(0, 1)
            seq.length += num_new
        return self._gather() if gather else None

    def _gather(self) -> list[tuple[Tensor, Tensor]]:
        """Each row's keys/values ``(1, Hkv, L_b, D)``: views of :meth:`padded`'s one gather."""
        keys, values, _ = self.padded()
        return [(keys[b : b + 1, :, :length], values[b : b + 1, :, :length])
                for b, length in enumerate(self.row_lengths)]

    def _padded_table(self) -> Tensor:
        """``(B, pages)`` each row's block table, padded to the longest with its own first page."""
        width = max((len(seq.pages) for seq in self.rows), default=0)
        return torch.tensor([seq.pages + seq.pages[:1] * (width - len(seq.pages)) if seq.pages else [0] * width
                             for seq in self.rows], dtype=torch.int64, device=self.device)  # (B, pages)

    def padded(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Every row's keys/values gathered from its pages, right-padded to the longest row.

        Returns:
            ``keys`` ``(B, Hkv, L_max, D)`` and ``values`` ``(B, Hkv, L_max, Dv)`` (transient
            copies, not cache memory), and the ``(B,)`` int64 lengths of the rows, or None when
            every row has the same length (nothing is padded). Whole pages are gathered (a few
            large copies, not one per position): past its length a row reads the zeros of its
            last page's unwritten slots, then its own first page again; never another row's data,
            and masked by the lengths.

        Example:
            >>> cache = PagedKVCache(2, 1, 8, 1, page_size=2)
            >>> _ = cache.select([0]).update(torch.ones(1, 1, 3, 1), torch.ones(1, 1, 3, 1))
            >>> _ = cache.select([1]).update(torch.full((1, 1, 1, 1), 2.0), torch.ones(1, 1, 1, 1))
            >>> keys, values, lengths = cache.padded()
            >>> keys[:, 0, :, 0].tolist(), lengths.tolist()
            ([[1.0, 1.0, 1.0], [2.0, 0.0, 2.0]], [3, 1])
        """
        table = self._padded_table()
        lengths, pages = self.row_lengths, self.pool.num_pages
        longest, (batch, width) = max(lengths, default=0), table.shape
        index = table.flatten()
        per_page = self.page_size * self.num_kv_heads
        keys = self.pool.keys.view(pages, per_page * self.head_dim).index_select(0, index)  # (B * pages, P * Hkv * D)
        values = self.pool.values.view(pages, per_page * self.value_dim).index_select(0, index)  # (B * pages, P * Hkv * Dv)
        keys = keys.view(batch, width * self.page_size, self.num_kv_heads, self.head_dim)[:, :longest]
        values = values.view(batch, width * self.page_size, self.num_kv_heads, self.value_dim)[:, :longest]
        ragged = None if len(set(lengths)) <= 1 else torch.tensor(lengths, dtype=torch.int64, device=self.device)
        return keys.transpose(1, 2), values.transpose(1, 2), ragged  # (B, Hkv, L_max, D), (B, Hkv, L_max, Dv)

    def extend(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Every row's keys over :meth:`padded` pages, for one call for the whole batch."""
        self.update(k_new, v_new, gather=False)
        return self.padded()  # (B, Hkv, L_max, D), (B, Hkv, L_max, Dv), (B,) or None

    def release(self, row: int) -> None:
        """Give row ``row``'s pages back to the pool and empty it (its sequence is done).

        Example:
            >>> cache = PagedKVCache(1, 1, 4, 2, page_size=2)
            >>> _ = cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
            >>> cache.release(0); cache.row_lengths, cache.free_pages
            ((0,), 2)
        """
        seq = self.rows[self._row_index(row)]
        self.pool.free = sorted(self.pool.free + seq.pages)
        seq.set_state(([], seq.slots[:0], 0))

    def reset(self) -> None:
        """Release every row.

        Example:
            >>> cache = PagedKVCache(2, 1, 4, 2, page_size=2)
            >>> _ = cache.update(torch.ones(2, 1, 1, 2), torch.ones(2, 1, 1, 2))
            >>> cache.reset(); cache.free_pages
            2
        """
        for row in range(self.batch_size):
            self.release(row)

    def _snapshot(self, num_new: int) -> Callable[[], None]:
        free, states = list(self.pool.free), [seq.state() for seq in self.rows]
        needed = self._pages_needed(max(0, num_new))
        pages = [p for seq in self.rows for p in seq.pages[-1:]] + free[: sum(needed)]
        slots = (torch.tensor(pages, dtype=torch.int64, device=self.device)[:, None] * self.page_size
                 + torch.arange(self.page_size, device=self.device)).flatten()  # pages that may be written
        keys, values = self.pool.keys[slots].clone(), self.pool.values[slots].clone()

        def restore() -> None:
            with torch.no_grad():
                self.pool.keys[slots] = keys
                self.pool.values[slots] = values
            self.pool.free = free
            for seq, state in zip(self.rows, states):
                seq.set_state(state)
        return restore

    def __repr__(self) -> str:
        return (f"PagedKVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"row_lengths={self.row_lengths}, page_size={self.page_size}, "
                f"free_pages={self.free_pages}/{self.pool.num_pages}, head_dim={self.head_dim}, "
                f"dtype={self.dtype})")


class RecurrentCache(Cache):
    """A linear-attention layer's whole cache: the last ``kernel_size - 1`` inputs of its short
    convolution and its state ``S``, one ``(Dk, Dv)`` matrix per value head.

    A recurrent layer (:class:`~attnlab.nn.GatedDeltaNet`, :class:`~attnlab.nn.KimiDeltaAttention`)
    folds every token it has seen into ``S``, so decoding keeps no keys: **the cache's bytes are
    constant in the number of tokens** (:attr:`nbytes` is the same at length 0 and length 10^6),
    where a :class:`KVCache` grows by one key and value per token and layer. The state is kept in
    fp32 (fp64 for an fp64 layer) whatever the layer's dtype; the convolution's window in the layer's.

    The layer computes the new window and state from the old ones and then :meth:`advance` s the
    cache, replacing both tensors (never writing into them): a call that fails before that leaves
    the cache as it was, and a snapshot (:class:`Cache`'s guard for a model's layers) is the two
    references and the rows' lengths. Under autograd the state keeps its graph from call to call (detach
    it, e.g. ``cache.advance(cache.conv.detach(), cache.state.detach(), num_new=0)``, to cut it).

    Shapes:
        conv: ``(B, channels, kernel_size - 1)``; state: ``(B, num_heads, head_dim, value_dim)``.

    Args:
        batch_size: ``B``.
        channels: the convolution's channels (the layer's q, k and v features together).
        kernel_size: the convolution's width (the window holds ``kernel_size - 1`` earlier inputs).
        num_heads: value heads ``Hv``, one state matrix each.
        head_dim: ``Dk``, key features per head. value_dim: ``Dv`` (default ``head_dim``).
        dtype, device: the layer's (the window's dtype; the state is fp32, or fp64 for fp64).

    Example:
        >>> cache = RecurrentCache(1, channels=12, kernel_size=4, num_heads=2, head_dim=2)
        >>> cache.nbytes                 # 12 x 3 window floats + 2 x 2 x 2 state floats, 4 bytes each
        176
        >>> cache.advance(cache.conv, cache.state + 1, num_new=1000)
        >>> cache.length, cache.nbytes   # a thousand tokens later: the same bytes
        (1000, 176)
    """

    def __init__(self, batch_size: int, *, channels: int, kernel_size: int, num_heads: int, head_dim: int,
                 value_dim: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        value_dim = head_dim if value_dim is None else value_dim
        _check_sizes(batch_size=batch_size, channels=channels, kernel_size=kernel_size, num_heads=num_heads,
                     head_dim=head_dim, value_dim=value_dim)
        if value_dim == 0:
            raise ValueError("value_dim must be positive for a recurrent state, got 0")
        dtype, device = _dtype_device(dtype, device)
        self.kernel_size = kernel_size
        self.state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self._sizes = (batch_size, channels, num_heads, head_dim, value_dim)
        self._dtype, self._device = dtype, device
        self.reset()

    def reset(self) -> None:
        """Back to no tokens: a zero window and a zero state (fresh tensors).

        Example:
            >>> cache = RecurrentCache(1, channels=2, kernel_size=2, num_heads=1, head_dim=1)
            >>> cache.advance(cache.conv + 1, cache.state + 1, num_new=3); cache.reset()
            >>> cache.length, cache.state.abs().sum().item(), cache.conv.abs().sum().item()
            (0, 0.0, 0.0)
        """
        B, C, H, Dk, Dv = self._sizes
        self.conv = torch.zeros(B, C, self.kernel_size - 1, dtype=self._dtype, device=self._device)
        self.state = torch.zeros(B, H, Dk, Dv, dtype=self.state_dtype, device=self._device)
        self.lengths = [0] * B  # tokens each row has seen (rows prefilled alone may differ)

    # Cache's sizes, read off the tensors
    @property
    def dtype(self) -> torch.dtype:
        return self.conv.dtype

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    @property
    def channels(self) -> int:
        return self.conv.shape[1]

    @property
    def num_heads(self) -> int:
        return self.state.shape[1]

    @property
    def head_dim(self) -> int:
        return self.state.shape[2]

    @property
    def value_dim(self) -> int:
        return self.state.shape[3]

    @property
    def row_lengths(self) -> tuple[int, ...]:
        return tuple(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of the window and the state, the same at every length."""
        return self.conv.nbytes + self.state.nbytes

    def check_room(self, num_new: int) -> None:
        """Nothing to check: a recurrent state takes any number of tokens in the same bytes."""

    def extend(self, k_new: Tensor, v_new: Tensor):
        raise TypeError("a RecurrentCache holds a linear-attention layer's state, not keys and values; "
                        "give it to GatedDeltaNet or KimiDeltaAttention (their new_cache makes one)")

    def advance(self, conv: Tensor, state: Tensor, *, num_new: int) -> None:
        """Take the window and state after ``num_new`` more tokens (the layer has checked them).

        Shapes:
            conv: ``(B, channels, kernel_size - 1)``; state: ``(B, num_heads, head_dim, value_dim)``.
        """
        self.conv, self.state = conv, state.to(self.state_dtype)
        self.lengths = [length + num_new for length in self.lengths]

    def select(self, rows: Iterable[int]) -> "RecurrentCache":
        """A cache of the given rows only, reading and advancing this one's (e.g. to prefill each
        prompt of a batch alone, as :meth:`PagedKVCache.select`); the rows' lengths may then differ.

        Raises:
            TypeError: ``rows`` is not a list of ints. ValueError: no row, one out of range, a repeat.

        Example:
            >>> cache = RecurrentCache(2, channels=2, kernel_size=2, num_heads=1, head_dim=1)
            >>> row = cache.select([1])
            >>> row.advance(row.conv + 1, row.state + 1, num_new=3)
            >>> cache.row_lengths, cache.state.flatten().tolist()
            ((0, 3), [0.0, 1.0])
        """
        if isinstance(rows, (str, bytes, Tensor)) or not isinstance(rows, Iterable):
            raise TypeError(f"rows must be a list of row indices, got {type(rows).__name__}")
        rows = [non_negative_int("row", row) for row in rows]
        if not rows or len(set(rows)) < len(rows) or max(rows) >= self.batch_size:
            raise ValueError(f"rows must name at least one row below batch_size={self.batch_size} and repeat none, "
                             f"got {rows}")
        return _RecurrentRows(self, rows)

    def _snapshot(self, num_new: int) -> Callable[[], None]:
        conv, state, lengths = self.conv, self.state, self.lengths  # never written in place: references suffice

        def restore() -> None:
            self.conv, self.state, self.lengths = conv, state, lengths
        return restore

    def __repr__(self) -> str:
        lengths = self.row_lengths
        shown = f"length={lengths[0]}" if len(set(lengths)) == 1 else f"row_lengths={lengths}"
        return (f"RecurrentCache(batch_size={self.batch_size}, channels={self.channels}, "
                f"kernel_size={self.kernel_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, {shown}, dtype={self.dtype})")


class _RecurrentRows(RecurrentCache):
    """Some rows of a :class:`RecurrentCache` (:meth:`RecurrentCache.select`): it reads copies of
    them and advances them in the whole cache (whose tensors it replaces, as the cache does)."""

    def __init__(self, whole: RecurrentCache, rows: list[int]):  # sizes come from the whole cache
        self.whole, self.rows = whole, rows
        self.kernel_size, self.state_dtype = whole.kernel_size, whole.state_dtype
        self._index = torch.tensor(rows, dtype=torch.int64, device=whole.device)

    @property
    def conv(self) -> Tensor:
        return self.whole.conv.index_select(0, self._index)  # (rows, C, K - 1)

    @property
    def state(self) -> Tensor:
        return self.whole.state.index_select(0, self._index)  # (rows, Hv, Dk, Dv)

    @property
    def lengths(self) -> list[int]:
        return [self.whole.lengths[row] for row in self.rows]

    def reset(self) -> None:
        """Forget these rows' tokens (the other rows keep theirs)."""
        self.advance(torch.zeros_like(self.conv), torch.zeros_like(self.state), num_new=0)
        self.whole.lengths = [0 if row in self.rows else n for row, n in enumerate(self.whole.lengths)]

    def advance(self, conv: Tensor, state: Tensor, *, num_new: int) -> None:
        whole = self.whole
        whole.conv = whole.conv.index_copy(0, self._index, conv.to(whole.conv.dtype))
        whole.state = whole.state.index_copy(0, self._index, state.to(whole.state_dtype))
        whole.lengths = [n + num_new if row in self.rows else n for row, n in enumerate(whole.lengths)]

    def _snapshot(self, num_new: int) -> Callable[[], None]:
        return self.whole._snapshot(num_new)


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
    """Put every :class:`Cache` in ``caches`` back bitwise if the body raises.

    A module appends to its cache before attending, and attention (or a later layer) may still
    fail; each cache copies only what ``num_new`` more positions per row could change. Entries
    that are not caches (None) are skipped.
    """
    restores = [cache._snapshot(num_new) for cache in caches if isinstance(cache, Cache)]
    try:
        yield
    except BaseException:
        for restore in restores:
            restore()
        raise
