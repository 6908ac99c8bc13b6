"""Score mods: how each score is changed before the softmax (``attnlab.attention(score_mod=...)``).

A score mod has FlexAttention's signature ``(score, b, h, q_idx, kv_idx) -> score``: it maps the
scaled score of query ``q_idx`` and key ``kv_idx`` (batch ``b``, query head ``h``) to the score
the softmax sees, before the float mask and the masking. Masks say *which* keys a query sees; a
score mod says *how much*. The mods here broadcast, so they run on whole tiles (``score``
``(B, H, bq, bk)``, indices ``(B, 1, 1, 1)``, ``(1, H, 1, 1)``, ``(1, 1, bq, 1)``,
``(1, 1, 1, bk)``) as well as on 0-d indices:

* :func:`softcap` ``cap * tanh(score / cap)`` (Gemma 2);
* :func:`alibi` ``score - slope_h * (i - j)`` (causal) or ``- slope_h * |i - j|`` (symmetric);
* :func:`relative_bias` T5's learned bias ``table[bucket(j - i), h]``;
* :func:`bias` a (learnable) additive tensor broadcasting to ``(B, H, Tq, Tk)``;
* :func:`compose` (or ``a + b``) applies mods left to right; :func:`function` wraps a user's own
  function and declares the tensors it learns.

An *additive* mod (alibi, relative_bias, bias, their sums) adds a term independent of the score
(:meth:`ScoreMod.bias`), which a kernel taking a float mask can apply. :meth:`ScoreMod.params`
lists a mod's tensors, so tiled backends differentiate it tile by tile.

Example:
    >>> import torch, attnlab
    >>> q = torch.randn(1, 4, 6, 8)
    >>> mod = softcap(30.0) + alibi(4)
    >>> attnlab.attention(q, q, q, causal=True, score_mod=mod).shape
    torch.Size([1, 4, 6, 8])
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attnlab._checks import broadcast_shape, int_value, positive_int, positive_number
from attnlab.masks import _IndexWithTensors, _first_line, _unevaluable

__all__ = [
    "ScoreMod",
    "Softcap",
    "Alibi",
    "RelativeBias",
    "Bias",
    "Composed",
    "FunctionMod",
    "softcap",
    "alibi",
    "alibi_slopes",
    "relative_bias",
    "relative_position_bucket",
    "bias",
    "compose",
    "additive_term",
    "function",
    "as_score_mod",
    "has_function",
    "captures_grad",
    "check_function",
    "grid",
    "apply_tile",
    "check_sinks",
    "sink_logits",
    "sink_gradient",
]


def grid(batch: int, heads: int, q_range: tuple[int, int], kv_range: tuple[int, int],
         device: torch.device | str | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tensors ``b, h, q_idx, kv_idx`` of one tile, shaped to broadcast to ``(B, H, bq, bk)``.

    Example:
        >>> [tuple(t.shape) for t in grid(2, 3, (0, 4), (2, 7))]
        [(2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 4, 1), (1, 1, 1, 5)]
    """
    (qs, qe), (ks, ke) = q_range, kv_range
    return (torch.arange(batch, device=device).view(batch, 1, 1, 1),
            torch.arange(heads, device=device).view(1, heads, 1, 1),
            torch.arange(qs, qe, device=device).view(1, 1, qe - qs, 1),
            torch.arange(ks, ke, device=device).view(1, 1, 1, ke - ks))


def _tensor_sig(t: Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)


class ScoreMod:
    """A change of every score before the softmax, ``(score, b, h, q_idx, kv_idx) -> score``.

    Subclasses implement :meth:`__call__` (or, when ``additive``, :meth:`bias`), and list the
    tensors they hold in :meth:`params` / :meth:`with_params`.

    Attributes:
        additive: whether the mod adds a term that does not depend on the score.
        relative: whether that term depends only on ``kv_idx - q_idx`` and ``h`` (ALiBi, T5's
            bias), so that tiles of equal query and key offsets share it.
        in_place: whether the mod is a tensor-free function of the score with an in-place
            form (:meth:`apply_in_place`) and a derivative from its output (:meth:`derivative`).
        user_function: whether the mod is, or composes, a function of the user's own
            (:class:`FunctionMod`): code attnlab has not verified on every kernel.

    Example:
        >>> class Double(ScoreMod):
        ...     def __call__(self, score, b, h, q_idx, kv_idx):
        ...         return score * 2
        >>> apply_tile(Double() + softcap(1.0), torch.tensor([[[[0.0, 5.0]]]]), q_start=0, kv_start=0)
        tensor([[[[0., 1.]]]])
    """

    additive: bool = False
    relative: bool = False
    in_place: bool = False
    user_function: bool = False

    def __call__(self, score: Tensor, b, h, q_idx, kv_idx) -> Tensor:
        if self.additive:
            return score + self.bias(b, h, q_idx, kv_idx)
        raise NotImplementedError(type(self).__name__)

    def apply_in_place(self, score: Tensor) -> Tensor:
        """The mod written into ``score`` itself (``in_place`` mods only); returns ``score``.

        Example:
            >>> alibi(1).apply_in_place(torch.zeros(1))
            Traceback (most recent call last):
            TypeError: Alibi has no in-place form
        """
        raise TypeError(f"{type(self).__name__} has no in-place form")

    def derivative(self, modded: Tensor) -> Tensor:
        """``d modded / d score`` at each position, from the modded scores (``in_place`` mods only).

        Example:
            >>> alibi(1).derivative(torch.zeros(1))
            Traceback (most recent call last):
            TypeError: Alibi has no derivative in terms of its output
        """
        raise TypeError(f"{type(self).__name__} has no derivative in terms of its output")

    def bias(self, b, h, q_idx, kv_idx) -> Tensor:
        """The additive term at the broadcast indices (additive mods only)."""
        raise TypeError(f"{type(self).__name__} is not additive: it has no bias of its own")

    def params(self) -> tuple[Tensor, ...]:
        """Every tensor the mod holds, in a fixed order (what a backward pass may differentiate)."""
        return ()

    def with_params(self, params: Sequence[Tensor]) -> ScoreMod:
        """The same mod holding ``params`` (in :meth:`params`' order) instead of its own tensors."""
        return self

    def constants(self) -> tuple:
        """The mod's Python settings (not tensors), for :meth:`signature`."""
        return ()

    def for_call(self, *, dtype: torch.dtype, device: torch.device) -> ScoreMod:
        """The mod as a call computing scores in ``dtype`` on ``device`` uses it: tensors attnlab
        made from Python numbers (ALiBi's slopes from floats or a head count) follow the call,
        as a float literal in the reference's arithmetic would; the caller's tensors are kept.

        Example:
            >>> alibi([0.5]).for_call(dtype=torch.float64, device=torch.device("cpu")).slopes.dtype
            torch.float64
        """
        return self

    def signature(self) -> tuple:
        """What dispatch keys on: the kind, its Python settings, and each tensor's shape, dtype,
        device and ``requires_grad`` -- never a tensor value.

        Example:
            >>> softcap(20).signature() == softcap(20).signature() != softcap(30).signature()
            True
        """
        return (type(self).__name__, self.constants(), tuple(_tensor_sig(p) for p in self.params()))

    def check(self, *, batch: int, heads: int, tq: int, tk: int, device: torch.device) -> None:
        """Refuse a mod that cannot serve a call of these sizes (``ValueError`` naming ``score_mod``)."""
        for p in self.params():
            if p.device != device:
                raise ValueError(f"score_mod: {type(self).__name__} holds a tensor on {p.device}, "
                                 f"not on q's device {device}")

    def __add__(self, other: object) -> ScoreMod:
        return compose(self, other)

    def __radd__(self, other: object) -> ScoreMod:
        return compose(other, self)


class Softcap(ScoreMod):
    """``cap * tanh(score / cap)``: scores squashed into ``(-cap, cap)`` (Gemma 2, Grok).

    Example:
        >>> Softcap(10.0).signature()
        ('Softcap', (10.0,), ())
    """

    in_place = True

    def __init__(self, cap: float):
        self.cap = positive_number("softcap", cap)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return torch.tanh(score / self.cap) * self.cap

    def apply_in_place(self, score: Tensor) -> Tensor:
        """``cap * tanh(score / cap)`` in three in-place passes.

        Example:
            >>> Softcap(2.0).apply_in_place(torch.tensor([0.0, 1.0, 100.0]))
            tensor([0.0000, 0.9242, 2.0000])
        """
        return score.div_(self.cap).tanh_().mul_(self.cap)

    def derivative(self, modded: Tensor) -> Tensor:
        """``1 - tanh(score / cap)**2 = 1 - (modded / cap)**2``, in one pass over ``modded``.

        Example:
            >>> Softcap(2.0).derivative(torch.tensor([0.0, 1.0, 2.0]))
            tensor([1.0000, 0.7500, 0.0000])
        """
        return torch.addcmul(modded.new_ones(()), modded, modded, value=-1.0 / self.cap ** 2)

    def constants(self) -> tuple:
        return (self.cap,)

    def __repr__(self) -> str:
        return f"softcap({self.cap:g})"


def softcap(cap: float) -> Softcap:
    """Gemma 2's logit soft-capping, ``cap * tanh(score / cap)``.

    Args:
        cap: a positive finite number.

    Raises:
        ValueError: ``cap <= 0`` (the message names ``softcap``).

    Example:
        >>> mod = softcap(2.0)
        >>> mod(torch.tensor([0.0, 1.0, 100.0]), 0, 0, 0, 0)
        tensor([0.0000, 0.9242, 2.0000])
    """
    return Softcap(cap)


def alibi_slopes(num_heads: int, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-head ALiBi slopes: the geometric sequence ``2**(-8 i / n)``, ``i = 1..n``.

    For a head count that is not a power of two, the slopes of the closest lower power of two
    are followed by every other slope of the next power of two (as in the paper's code).

    Shapes:
        returns ``(num_heads,)`` in ``dtype`` (float32 by default).

    Example:
        >>> alibi_slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    positive_int("num_heads", num_heads)

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=dtype)


class Alibi(ScoreMod):
    """ALiBi: ``-slope_h * (i + offset - j)`` (causal) or ``-slope_h * |i + offset - j|``.

    Example:
        >>> mod = alibi(torch.tensor([1.0]), symmetric=True)
        >>> mod.bias(*grid(1, 1, (0, 1), (0, 3)))
        tensor([[[[-0., -1., -2.]]]])
    """

    additive = True
    relative = True

    def __init__(self, slopes: Tensor, *, symmetric: bool, offset: int, numbers: tuple[float, ...] | None = None):
        self.slopes, self.symmetric, self.offset = slopes, symmetric, offset
        self.numbers = numbers  # the Python floats the slopes were made from, if they were

    def for_call(self, *, dtype, device):
        if self.numbers is None or (self.slopes.dtype, self.slopes.device) == (dtype, device):
            return self
        slopes = torch.tensor(self.numbers, dtype=dtype, device=device)
        return Alibi(slopes, symmetric=self.symmetric, offset=self.offset, numbers=self.numbers)

    def bias(self, b, h, q_idx, kv_idx):
        distance = q_idx + self.offset - kv_idx
        distance = distance.abs() if self.symmetric else distance
        return -self.slopes[h] * distance.to(self.slopes.dtype)

    def params(self):
        return (self.slopes,)

    def with_params(self, params):
        return Alibi(params[0], symmetric=self.symmetric, offset=self.offset)

    def constants(self):
        return (self.symmetric, self.offset)

    def check(self, *, batch, heads, tq, tk, device):
        super().check(batch=batch, heads=heads, tq=tq, tk=tk, device=device)
        if tuple(self.slopes.shape) != (heads,):
            raise ValueError(f"score_mod: alibi slopes of shape {tuple(self.slopes.shape)} do not "
                             f"match the {heads} query heads (one slope per head, shape ({heads},))")

    def __repr__(self) -> str:
        return f"alibi(<{self.slopes.shape[0]} slopes>, symmetric={self.symmetric}, offset={self.offset})"


def _float_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating-point dtype, got {value.dtype}")
    return value


def alibi(slopes: Tensor | Sequence[float] | int, *, symmetric: bool = False, offset: int = 0) -> Alibi:
    """ALiBi (Press et al.): a per-head linear penalty on the query-key distance.

    Query ``i`` sits at position ``i + offset`` (pass ``offset = Tk - Tq`` for new tokens after a
    KV cache). Causal (the default, BLOOM/MPT): ``score - slope_h * (i + offset - j)``, to be used
    with causal masking; symmetric (encoders): ``score - slope_h * |i + offset - j|``. A slopes
    tensor that requires grad gets a gradient.

    Args:
        slopes: ``(Hq,)`` float tensor, a sequence of floats, or a head count for the standard
            geometric slopes (:func:`alibi_slopes`).
        symmetric: distance ``|i - j|`` instead of ``i - j``.
        offset: position of query 0.

    Raises:
        TypeError: slopes of another kind or dtype. The head count is checked against the call.

    Example:
        >>> mod = alibi(torch.tensor([0.5]))
        >>> mod(torch.zeros(1, 1, 2, 2), *grid(1, 1, (0, 2), (0, 2)))[0, 0]
        tensor([[ 0.0000,  0.5000],
                [-0.5000,  0.0000]])
    """
    numbers = None
    if isinstance(slopes, int) and not isinstance(slopes, bool):
        numbers = tuple(alibi_slopes(slopes, dtype=torch.float64).tolist())
    elif isinstance(slopes, (list, tuple)):
        numbers = tuple(float(s) for s in slopes)
    if numbers is not None:  # float32 until a call gives them its dtype (ScoreMod.for_call)
        slopes = torch.tensor(numbers, dtype=torch.float32)
    slopes = _float_tensor("slopes", slopes)
    if slopes.ndim != 1:
        raise ValueError(f"slopes must have shape (heads,), got {tuple(slopes.shape)}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
    return Alibi(slopes, symmetric=symmetric, offset=int_value("offset", offset), numbers=numbers)


def relative_position_bucket(relative_position: Tensor, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Tensor:
    """T5's bucket of each relative position ``key - query``, exactly as T5 computes it.

    Half the buckets (of each direction when ``bidirectional``) are exact distances, the rest
    grow logarithmically up to ``max_distance``; farther positions share the last bucket. The
    logarithm is taken in fp32, as T5 does, so bucket boundaries match T5's.

    Example:
        >>> relative_position_bucket(torch.tensor([-3, -1, 0, 1, 3, 200]), bidirectional=True,
        ...                          num_buckets=8, max_distance=16)
        tensor([2, 1, 0, 5, 6, 7])
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(relative_position.dtype) * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.clamp_max(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    # clamp_min(1): log(0) would be cast to an int (undefined); those positions are small anyway.
    large = max_exact + (
        torch.log(relative_position.clamp_min(1).float() / max_exact)
        / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(relative_position.dtype)
    large = torch.clamp_max(large, num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


class RelativeBias(ScoreMod):
    """T5's relative position bias: ``table[bucket(j - (i + offset)), h]``.

    Example:
        >>> mod = relative_bias(torch.zeros(8, 2), num_buckets=8, max_distance=16, bidirectional=False)
        >>> mod.bias(*grid(1, 2, (0, 3), (0, 3))).shape
        torch.Size([1, 2, 3, 3])
    """

    additive = True
    relative = True

    def __init__(self, table: Tensor, *, num_buckets: int, max_distance: int, bidirectional: bool,
                 offset: int):
        self.table, self.num_buckets, self.max_distance = table, num_buckets, max_distance
        self.bidirectional, self.offset = bidirectional, offset

    def bias(self, b, h, q_idx, kv_idx):
        bucket = relative_position_bucket(
            kv_idx - (q_idx + self.offset), bidirectional=self.bidirectional,
            num_buckets=self.num_buckets, max_distance=self.max_distance)
        return self.table[bucket, h]

    def params(self):
        return (self.table,)

    def with_params(self, params):
        return RelativeBias(params[0], num_buckets=self.num_buckets, max_distance=self.max_distance,
                            bidirectional=self.bidirectional, offset=self.offset)

    def constants(self):
        return (self.num_buckets, self.max_distance, self.bidirectional, self.offset)

    def check(self, *, batch, heads, tq, tk, device):
        super().check(batch=batch, heads=heads, tq=tq, tk=tk, device=device)
        if self.table.shape[1] != heads:
            raise ValueError(f"score_mod: relative_bias table of shape {tuple(self.table.shape)} has "
                             f"{self.table.shape[1]} heads, the call has {heads} query heads")

    def __repr__(self) -> str:
        return (f"relative_bias(<table {tuple(self.table.shape)}>, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional})")


def relative_bias(table: Tensor, *, num_buckets: int, max_distance: int, bidirectional: bool,
                  offset: int = 0) -> RelativeBias:
    """T5's learned relative position bias (``relative_attention_bias.weight`` is ``table``).

    Args:
        table: ``(num_buckets, Hq)`` float tensor; it gets a gradient when it requires one.
        num_buckets, max_distance, bidirectional: T5's ``relative_attention_num_buckets``,
            ``relative_attention_max_distance`` and ``is_decoder`` negated.
        offset: position of query 0 (T5's cache position when decoding).

    Raises:
        TypeError: a table of another kind or dtype.
        ValueError: a table of another shape, sizes out of range.

    Example:
        >>> table = torch.arange(8.0)[:, None]              # bucket b has bias b, one head
        >>> mod = relative_bias(table, num_buckets=8, max_distance=16, bidirectional=True)
        >>> mod.bias(*grid(1, 1, (0, 2), (0, 3)))[0, 0]
        tensor([[0., 5., 6.],
                [1., 0., 5.]])
    """
    table = _float_tensor("table", table)
    positive_int("num_buckets", num_buckets)
    positive_int("max_distance", max_distance)
    if not isinstance(bidirectional, bool):
        raise TypeError(f"bidirectional must be a bool, got {type(bidirectional).__name__}")
    if table.ndim != 2 or table.shape[0] != num_buckets:
        raise ValueError(f"table must have shape (num_buckets={num_buckets}, heads), got {tuple(table.shape)}")
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_exact < 1 or max_distance <= max_exact:
        raise ValueError(f"max_distance must exceed the {max_exact} exact buckets (num_buckets="
                         f"{num_buckets}, bidirectional={bidirectional}), got {max_distance}")
    return RelativeBias(table, num_buckets=num_buckets, max_distance=max_distance,
                        bidirectional=bidirectional, offset=int_value("offset", offset))


class Bias(ScoreMod):
    """An additive tensor ``tensor[b, h, q_idx, kv_idx]`` (size-1 dims broadcast, and stay
    size 1 in :meth:`bias`: a tile of a ``(Tk,)`` bias is one row).

    Example:
        >>> Bias(torch.arange(3.0)).bias(*grid(1, 1, (0, 2), (1, 3)))
        tensor([[[[1., 2.]]]])
    """

    additive = True

    def __init__(self, tensor: Tensor):
        self.tensor = tensor

    def bias(self, b, h, q_idx, kv_idx):
        t = self.tensor.reshape((1,) * (4 - self.tensor.ndim) + tuple(self.tensor.shape))  # (B|1, H|1, Tq|1, Tk|1)
        # A broadcast dim reads index 0 through an all-size-1 index: the result keeps size 1 there.
        # An empty dim (B, Tq or Tk of 0) is indexed by its own empty indices, never by index 0.
        index = [i if n != 1 else i.new_zeros((1,) * i.ndim) if isinstance(i, Tensor) else 0
                 for i, n in zip((b, h, q_idx, kv_idx), t.shape)]
        return t[tuple(index)]

    def params(self):
        return (self.tensor,)

    def with_params(self, params):
        return Bias(params[0])

    def check(self, *, batch, heads, tq, tk, device):
        super().check(batch=batch, heads=heads, tq=tq, tk=tk, device=device)
        target = (batch, heads, tq, tk)
        if self.tensor.ndim > 4 or broadcast_shape([tuple(self.tensor.shape), target]) != target:
            raise ValueError(f"score_mod: bias of shape {tuple(self.tensor.shape)} does not broadcast "
                             f"to (B, Hq, Tq, Tk) = {target}")

    def __repr__(self) -> str:
        return f"bias(<tensor {tuple(self.tensor.shape)}>)"


def bias(tensor: Tensor) -> Bias:
    """A (learnable) additive bias broadcasting to ``(B, Hq, Tq, Tk)``, added to the scores.

    Unlike a float ``mask`` it composes with other mods in order (``softcap(c) + bias(t)`` caps
    first, then adds). ``B`` is the flattened batch for rank-5 inputs.

    Example:
        >>> t = torch.tensor([[0.0, -1.0]])                  # (Tq=1, Tk=2)
        >>> bias(t)(torch.zeros(1, 1, 1, 2), *grid(1, 1, (0, 1), (0, 2)))
        tensor([[[[ 0., -1.]]]])
    """
    return Bias(_float_tensor("bias", tensor))


class Composed(ScoreMod):
    """Mods applied left to right; additive when every part is.

    Example:
        >>> (alibi(2) + bias(torch.zeros(1))).additive, (alibi(2) + softcap(5.0)).additive
        (True, False)
    """

    def __init__(self, mods: tuple[ScoreMod, ...]):
        self.mods = mods
        self.additive = all(m.additive for m in mods)
        self.relative = all(m.relative for m in mods)
        self.user_function = any(m.user_function for m in mods)

    def __call__(self, score, b, h, q_idx, kv_idx):
        for mod in self.mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    def bias(self, b, h, q_idx, kv_idx, *, dtype: torch.dtype | None = None):
        """The parts' terms summed, each first cast to ``dtype`` when given: a kernel that takes
        the sum as its float mask passes its computation dtype, so that bf16 parts in an fp32
        call (or fp32 parts in an fp64 one) add up as they do on the scores, not in their own
        dtype."""
        if not self.additive:
            return super().bias(b, h, q_idx, kv_idx)
        terms = (mod.bias(b, h, q_idx, kv_idx) for mod in self.mods)
        if dtype is not None:
            terms = (term.to(dtype) for term in terms)
        total = next(terms)
        for term in terms:
            total = total + term
        return total

    def params(self):
        return tuple(p for m in self.mods for p in m.params())

    def for_call(self, *, dtype, device):
        parts = tuple(mod.for_call(dtype=dtype, device=device) for mod in self.mods)
        return self if all(a is b for a, b in zip(parts, self.mods)) else Composed(parts)

    def with_params(self, params):
        parts, at = [], 0
        for mod in self.mods:
            n = len(mod.params())
            parts.append(mod.with_params(params[at:at + n]))
            at += n
        return Composed(tuple(parts))

    def signature(self):
        return ("Composed", tuple(m.signature() for m in self.mods))

    def check(self, **sizes):
        for mod in self.mods:
            mod.check(**sizes)

    def __repr__(self) -> str:
        return " + ".join(map(repr, self.mods))


def additive_term(mod: ScoreMod, b, h, q_idx, kv_idx, *, dtype: torch.dtype) -> Tensor:
    """An additive mod's term at the broadcast indices in ``dtype``, a composition's parts each
    cast to ``dtype`` before they are summed (what adding them one by one to ``dtype`` scores
    gives, as the reference does).

    Example:
        >>> parts = bias(torch.tensor(1.0, dtype=torch.bfloat16)) + bias(torch.tensor(2**-9, dtype=torch.bfloat16))
        >>> additive_term(parts, *grid(1, 1, (0, 1), (0, 1)), dtype=torch.float32).item()
        1.001953125
    """
    if isinstance(mod, Composed):
        return mod.bias(b, h, q_idx, kv_idx, dtype=dtype)
    return mod.bias(b, h, q_idx, kv_idx).to(dtype)


def compose(*mods: ScoreMod | Callable) -> ScoreMod:
    """One mod applying ``mods`` left to right (``a + b`` is ``compose(a, b)``).

    Example:
        >>> mod = compose(softcap(1.0), bias(torch.tensor(2.0)))
        >>> mod(torch.tensor([[[[100.0]]]]), *grid(1, 1, (0, 1), (0, 1))).item()
        3.0
    """
    if not mods:
        raise ValueError("compose needs at least one score mod")
    flat = []
    for mod in map(as_score_mod, mods):
        flat.extend(mod.mods if isinstance(mod, Composed) else (mod,))
    return flat[0] if len(flat) == 1 else Composed(tuple(flat))


def _dead() -> None:
    return None


class _Identity:
    """A key part that compares and hashes by an object's identity through a weak reference:
    a remembered key never keeps a user's function alive, and one whose function died equals
    nothing (a new object at the same address does not match it), as does one whose object
    takes no weak reference (such a call is never found again)."""

    __slots__ = ("ref", "hash")

    def __init__(self, obj: object):
        try:
            self.ref = weakref.ref(obj)
        except TypeError:  # no weak reference: equal to nothing rather than kept alive
            self.ref = _dead
        self.hash = id(obj)

    @property
    def obj(self) -> object:
        """The object, or None once it died (or when it takes no weak reference)."""
        return self.ref()

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Identity):
            return False
        mine = self.ref()
        return mine is not None and mine is other.ref()


class FunctionMod(ScoreMod):
    """A user's function ``(score, b, h, q_idx, kv_idx) -> score`` and the tensors it learns.

    Example:
        >>> FunctionMod(lambda s, b, h, i, j: s - abs(i - j))(torch.zeros(()), 0, 0, 3, 1)
        tensor(-2.)
    """

    user_function = True

    def __init__(self, fn: Callable, params: tuple[Tensor, ...] = (), make: Callable | None = None):
        self.fn, self._params, self.make = fn, params, make

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx, kv_idx)

    def params(self):
        return self._params

    def with_params(self, params):
        if self.make is None:
            return self
        return FunctionMod(self.make(*params), tuple(params), self.make)

    def signature(self) -> tuple:
        """The function by weak reference (:class:`_Identity`), its tensors by shape."""
        return ("FunctionMod", _Identity(self.make or self.fn), tuple(_tensor_sig(p) for p in self._params))

    def __repr__(self) -> str:
        return f"function({getattr(self.fn, '__qualname__', repr(self.fn))})"


def function(fn: Callable, *, params: Sequence[Tensor] = ()) -> FunctionMod:
    """A user's score mod, with the tensors it learns declared.

    A plain function passed as ``score_mod`` is wrapped this way with no parameters. A tiled
    backend differentiates a mod tile by tile, so it must know the tensors to differentiate:
    pass ``fn`` as a *maker* ``fn(*params) -> mod`` together with ``params``, or a mod that
    closes over no tensor requiring grad (else only the reference backend serves the call).

    Args:
        fn: ``(score, b, h, q_idx, kv_idx) -> score``, or with ``params`` a function of the
            params that returns such a mod.
        params: the tensors the mod learns.

    Example:
        >>> w = torch.tensor(0.5, requires_grad=True)
        >>> mod = function(lambda w: lambda s, b, h, i, j: s * w, params=[w])
        >>> mod(torch.tensor(4.0), 0, 0, 0, 0)
        tensor(2., grad_fn=<MulBackward0>)
    """
    if not callable(fn):
        raise TypeError(f"score_mod must be callable, got {type(fn).__name__}")
    params = tuple(params)
    for p in params:
        _float_tensor("params", p)
    if not params:
        return FunctionMod(fn)
    return FunctionMod(fn(*params), params, fn)


def as_score_mod(value: object) -> ScoreMod:
    """``value`` as a :class:`ScoreMod` (a plain callable becomes :func:`function`'s wrapper).

    Raises:
        TypeError: neither a ScoreMod nor a callable (the message names ``score_mod``).

    Example:
        >>> as_score_mod(lambda s, b, h, i, j: s).signature()[0]
        'FunctionMod'
    """
    if isinstance(value, ScoreMod):
        return value
    if callable(value):
        return FunctionMod(value)
    raise TypeError(f"score_mod must be a score mod (see attnlab.scores) or a callable "
                    f"(score, b, h, q_idx, kv_idx) -> score, got {type(value).__name__}")


def has_function(mod: ScoreMod) -> bool:
    """Whether ``mod`` is or contains a user's function (whose shapes only a call can tell).

    Example:
        >>> has_function(softcap(5.0)), has_function(softcap(5.0) + (lambda s, b, h, i, j: s))
        (False, True)
    """
    parts = mod.mods if isinstance(mod, Composed) else (mod,)
    return any(isinstance(part, FunctionMod) for part in parts)


def check_function(mod: ScoreMod, *, tq: int, tk: int, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a mod with a user's function that does not give one score per position.

    Evaluated once on a tile of up to 2 x 2 distinct scores, then at each of its positions on
    0-d indices (FlexAttention's meaning of a mod); both must agree. Catches a function that
    returns another shape, a non-float, or mixes positions (``score.sum()``, ``score[..., :1]``).

    Raises:
        ValueError: naming ``score_mod``: a function that does not map each score on its own, or
            (from :func:`apply_tile`) returns a shape that does not broadcast to the tile's.
        TypeError: from :func:`apply_tile`: it returns a non-tensor or a non-float tensor.

    Example:
        >>> check_function(as_score_mod(lambda s, b, h, i, j: s.mean()), tq=4, tk=4,
        ...                device=torch.device("cpu"), dtype=torch.float32)
        Traceback (most recent call last):
        ...
        ValueError: score_mod: function(<lambda>) does not give one score per position: ...
    """
    bq, bk = min(tq, 2), min(tk, 2)
    probe = (torch.arange(bq * bk, dtype=dtype, device=device).view(1, 1, bq, bk) - 1.25) * 0.75
    with torch.no_grad():
        tiled = apply_tile(mod, probe, q_start=0, kv_start=0)
        zero = torch.zeros((), dtype=torch.long, device=device)
        for i in range(bq):
            for j in range(bk):
                try:
                    one = mod(probe[0, 0, i, j], zero, zero, zero + i, zero + j)
                    ok = isinstance(one, Tensor) and one.numel() == 1 and bool(
                        torch.isclose(one.reshape(()).to(tiled.dtype), tiled[0, 0, i, j], rtol=1e-5,
                                      atol=1e-6, equal_nan=True))
                    why = "" if ok else f"at position ({i}, {j}) it gives {one!r} alone, {tiled[0, 0, i, j]!r} in a tile"
                except Exception as err:  # noqa: BLE001
                    why = f"on one position (0-d indices) it raises {type(err).__name__}: {err}"
                if why:
                    raise ValueError(f"score_mod: {mod!r} does not give one score per position: {why}; "
                                     "a score mod maps each score on its own, as in FlexAttention")


def captures_grad(mod: ScoreMod) -> bool:
    """Whether ``mod`` gives scores that require grad through a tensor it does not list in
    :meth:`ScoreMod.params` (a user's function closing over a parameter): evaluated once on a
    1x1 tile with its own tensors detached.

    Example:
        >>> w = torch.ones((), requires_grad=True)
        >>> captures_grad(as_score_mod(lambda s, b, h, i, j: s * w))
        True
        >>> captures_grad(function(lambda w: lambda s, b, h, i, j: s * w, params=[w]))
        False
    """
    if not has_function(mod) or not torch.is_grad_enabled():
        return False
    params = mod.params()
    device = params[0].device if params else None
    probe = mod.with_params([p.detach() for p in params])
    return apply_tile(probe, torch.zeros(1, 1, 1, 1, device=device), q_start=0, kv_start=0).requires_grad


def apply_tile(mod: ScoreMod, score: Tensor, *, q_start: int, kv_start: int) -> Tensor:
    """``mod`` on a tile of scores ``(B, H, bq, bk)`` whose first query is ``q_start`` and first
    key ``kv_start``; the result has the tile's shape.

    Called once on the tile's index grid; a function written for 0-d indices (it raises or
    returns another shape there) is mapped per position with ``torch.vmap``, as FlexAttention
    does. A composition applies its parts one by one.

    Raises:
        ValueError: the mod returned a shape that does not broadcast to the tile's (names
            ``score_mod``).
        TypeError: it returned a non-tensor or a non-float tensor, or a function can be
            evaluated neither way (``int(q_idx)``, a Python ``if`` on an index).

    Example:
        >>> apply_tile(alibi(torch.tensor([1.0])), torch.zeros(1, 1, 1, 3), q_start=2, kv_start=0)
        tensor([[[[-2., -1.,  0.]]]])
    """
    if isinstance(mod, Composed) and mod.user_function:
        for part in mod.mods:
            score = apply_tile(part, score, q_start=q_start, kv_start=kv_start)
        return score
    B, H, bq, bk = score.shape
    b, h, q_idx, kv_idx = grid(B, H, (q_start, q_start + bq), (kv_start, kv_start + bk), score.device)
    if isinstance(mod, FunctionMod):
        return _checked(mod, _function_tile(mod, score, b, h, q_idx, kv_idx), score)
    return _checked(mod, mod(score, b, h, q_idx, kv_idx), score)


def _fits(result: object, score: Tensor) -> bool:
    """Whether ``result`` is a tensor broadcasting to ``score``'s shape."""
    return isinstance(result, Tensor) and broadcast_shape([tuple(result.shape), tuple(score.shape)]) == tuple(score.shape)


def _function_tile(mod: FunctionMod, score: Tensor, b, h, q_idx, kv_idx) -> Tensor:
    """A user's function on the tile's grid, or mapped per position when the grid call fails."""
    try:
        result = mod(score, b, h, q_idx, kv_idx)
        if _fits(result, score):
            return result
        grid_error: Exception = ValueError(f"it returned shape {tuple(getattr(result, 'shape', ()))}")
    except Exception as err:  # noqa: BLE001 -- written for 0-d indices: map it as FlexAttention does
        grid_error = err
    try:
        return _vmapped(mod, score, b, h, q_idx, kv_idx)
    except Exception as scalar_err:  # noqa: BLE001
        if _first_line(scalar_err) == _first_line(grid_error):
            raise  # the function's own error, whichever way it is called: the user's to see
        raise _unevaluable(f"score_mod: {mod!r}", "a score mod", scalar_err, grid_error) from scalar_err


def _vmapped(mod: ScoreMod, score: Tensor, b, h, q_idx, kv_idx) -> Tensor:
    """``mod`` per position through four nested ``torch.vmap`` over ``(B, H, bq, bk)``, indexing
    with tensors as FlexAttention does (``bias[b][q_idx]`` maps)."""
    fn = mod
    for dims in ((0, None, None, None, 0), (0, None, None, 0, None), (0, None, 0, None, None),
                 (0, 0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims)
    with _IndexWithTensors():
        return fn(score, b.flatten(), h.flatten(), q_idx.flatten(), kv_idx.flatten())


def _checked(mod: ScoreMod, result: object, score: Tensor) -> Tensor:
    if not isinstance(result, Tensor) or not result.dtype.is_floating_point:
        kind = type(result).__name__ if not isinstance(result, Tensor) else f"a {result.dtype} tensor"
        raise TypeError(f"score_mod: {mod!r} must return a float tensor of scores, got {kind}")
    if result.shape != score.shape:
        if broadcast_shape([tuple(result.shape), tuple(score.shape)]) != tuple(score.shape):
            raise ValueError(f"score_mod: {mod!r} returned shape {tuple(result.shape)} for scores of "
                             f"shape {tuple(score.shape)}; a score mod returns one score per position")
        result = result.expand(score.shape)
    return result


def check_sinks(sinks: object, *, heads: int, device: torch.device, batch: int | None = None,
                tq: int | None = None) -> Tensor | None:
    """``sinks`` if it is a float tensor of a sinks shape on ``device`` (or None); the error names
    ``sinks`` and the shapes seen.

    A sinks shape is ``(Hq,)``, one logit per query head (gpt-oss's ``s_aux``), or, when the
    call's ``batch`` and ``tq`` are given, ``(B|1, Hq|1, Tq)``: one logit per query (a sink
    computed from each token, as Inkling2's ``sink_proj``), broadcasting over batch and heads.

    Example:
        >>> check_sinks(torch.zeros(2, 1, 5), heads=4, device=torch.device("cpu"), batch=2, tq=5).shape
        torch.Size([2, 1, 5])
        >>> check_sinks(torch.zeros(3), heads=4, device=torch.device("cpu"))
        Traceback (most recent call last):
        ...
        ValueError: sinks must have shape (Hq,) = (4,), one logit per query head; got (3,)
    """
    if sinks is None:
        return None
    sinks = _float_tensor("sinks", sinks)
    shape = tuple(sinks.shape)
    per_query = batch is not None and tq is not None
    if per_query and sinks.ndim == 3:
        if shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2] != tq:
            raise ValueError(f"sinks of rank 3 must have shape (B|1, Hq|1, Tq) with (B, Hq, Tq) = "
                             f"({batch}, {heads}, {tq}), one logit per query; got {shape}")
    elif shape != (heads,):
        also = f", or (B|1, Hq|1, Tq) = ({batch}|1, {heads}|1, {tq}) per query" if per_query else ""
        raise ValueError(f"sinks must have shape (Hq,) = ({heads},), one logit per query head{also}; "
                         f"got {shape}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on q's device {device}, got {sinks.device}")
    return sinks


def sink_logits(sinks: Tensor, dtype: torch.dtype) -> Tensor:
    """Checked ``sinks`` as logits ``(B|1, Hq|1, Tq|1)`` in ``dtype`` (a view of ``(Hq,)`` ones),
    with ``±inf`` replaced by ``±`` a quarter of the dtype's largest finite value.

    Every backend's rule for infinite sinks: ``+inf`` takes all the mass (zero row, zero
    gradients), ``-inf`` is no sink, and no step forms ``inf - inf``. NaN stays NaN.

    Example:
        >>> logits = sink_logits(torch.tensor([float("inf"), 0.0, float("-inf")]), torch.float32)
        >>> big = torch.finfo(torch.float32).max / 4
        >>> logits.shape, logits.flatten().tolist() == [big, 0.0, -big]
        (torch.Size([1, 3, 1]), True)
    """
    big = torch.finfo(dtype).max / 4
    rows = sinks.view(1, -1, 1) if sinks.ndim == 1 else sinks  # (B|1, Hq|1, Tq|1)
    return rows.to(dtype).clamp(-big, big)


def sink_gradient(rows: Tensor, sinks: Tensor) -> Tensor:
    """The sinks' gradient from each query row's ``(B, Hq, Tq)``: summed over what the sinks
    broadcast over (batch and queries for ``(Hq,)``), in the sinks' shape and dtype.

    Example:
        >>> sink_gradient(torch.ones(2, 3, 4), torch.zeros(3)).tolist()
        [8.0, 8.0, 8.0]
    """
    shape = (1, sinks.shape[0], 1) if sinks.ndim == 1 else tuple(sinks.shape)
    return rows.sum_to_size(shape).reshape(sinks.shape).to(sinks.dtype)
