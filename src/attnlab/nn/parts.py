"""The parts :class:`~attnlab.nn.MultiHeadAttention` is built from: its projections (:class:`QKV`),
its standing pattern (``"causal"``, None, :class:`Window`, :class:`Chunk`), its query/key
normalisation (:class:`QKNorm`) and one call's mask in parts (:class:`CallMask`), with the checks
of each and the refusal of the keywords they replaced.

Example:
    >>> pattern_of(causal=True, window=4), QKV(num_kv_heads=2).num_kv_heads
    (Window(size=4), 2)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from attnlab import masks as _masks
from attnlab._checks import divisible, instance_of, one_of, positive_int, positive_number

__all__ = ["QKV", "QKNorm", "Window", "Chunk", "CallMask", "KVShare", "pattern_of", "head_sizes"]


@dataclass(frozen=True)
class QKV:
    """The projections part of :class:`MultiHeadAttention`: key/value heads, input widths, biases.

    Args:
        num_kv_heads: key/value heads for grouped-query attention (``1`` = multi-query); must
            divide ``num_heads``. None: ``num_heads``.
        kdim: width of the key input (``context``); None: ``d_in``.
        vdim: width of the value input; None: ``kdim``. When it differs from ``kdim`` pass the
            values' input as ``forward(..., value_input=...)``.
        bias: bias in the query/key/value projections (the old ``qkv_bias``).
        out_bias: bias in ``out_proj``.
        qk_norm: a :class:`QKNorm` normalising each projected query and key head (Qwen3,
            Gemma 3) or the whole projection (OLMo-2), or None (no norm, no parameters).
        head_dim: features of each query/key/value head; None: ``d_out // num_heads``. Given,
            ``num_heads * head_dim`` need not be ``d_out``: the queries project to
            ``num_heads * head_dim`` features, the keys and values to ``num_kv_heads * head_dim``,
            and ``out_proj`` maps the heads' ``num_heads * head_dim`` back to ``d_out`` (Gemma 3,
            Gemma 4, Llama 4, Qwen3 size heads so).

    Example:
        >>> from attnlab.nn import MultiHeadAttention
        >>> MultiHeadAttention(8, 8, num_heads=4, qkv=QKV(num_kv_heads=2, bias=True)).in_proj_bias.shape
        torch.Size([16])
        >>> wide = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(head_dim=512))   # Gemma 4's global heads
        >>> wide.in_proj_weight.shape, wide.out_proj.weight.shape
        (torch.Size([3072, 8]), torch.Size([8, 1024]))
    """

    num_kv_heads: int | None = None
    kdim: int | None = None
    vdim: int | None = None
    bias: bool = False
    out_bias: bool = True
    qk_norm: QKNorm | None = None
    head_dim: int | None = None

    def __post_init__(self):
        for name in ("num_kv_heads", "kdim", "vdim", "head_dim"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        instance_of("bias", self.bias, bool, "a bool")
        instance_of("out_bias", self.out_bias, bool, "a bool")
        if self.qk_norm is not None:
            instance_of("qk_norm", self.qk_norm, QKNorm, "an attnlab.nn.QKNorm (or None)")


@dataclass(frozen=True)
class QKNorm:
    """QK-norm, the ``qk_norm`` of :class:`MultiHeadAttention`'s projections part (:class:`QKV`):
    an RMSNorm of the projected queries and keys with a learnable weight, applied after the
    projections and before the rotary embedding, as transformers' Qwen3 and OLMo-2 do. With
    ``over="head"`` it normalises each head's ``head_dim`` features, with a weight ``(head_dim,)``
    shared by the heads (the parameters ``q_norm.weight`` and ``k_norm.weight``); with
    ``over="all"`` the whole projection at once (OLMo-2: the ``num_heads * head_dim`` query
    features of a token, before they are split into heads), with weights
    ``(num_heads * head_dim,)`` and ``(num_kv_heads * head_dim,)``.

    ``rms(x) = x / sqrt(mean(x**2) + eps)``, computed in fp32 for half-precision inputs; the output
    is ``weight * rms(x)`` (Qwen3, OLMo-2; weight starts at 1) or, with ``unit_offset=True``,
    ``(1 + weight) * rms(x)`` (Gemma 3, Qwen3.5, Qwen3-Next; weight starts at 0).

    Models: Qwen3 and Qwen3-MoE match ``QKNorm()``; Gemma 3, Qwen3.5 and Qwen3-Next (without their
    output gate) ``QKNorm(unit_offset=True)``; OLMo-2 and OLMo-3 ``QKNorm(over="all")``. Not
    these: Gemma 4 adds a weightless norm of the values and scores with scale 1.

    Args:
        eps: the epsilon inside the square root (Qwen3's ``rms_norm_eps``).
        unit_offset: scale by ``1 + weight`` (weight initialised to 0) instead of ``weight``.
        over: ``"head"`` (each head's features) or ``"all"`` (the token's whole projection).

    Example:
        >>> import torch
        >>> from attnlab.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(qk_norm=QKNorm(eps=1e-6)), positions="rope")
        >>> mha.q_norm.weight.shape, mha(torch.randn(1, 3, 8)).shape
        (torch.Size([4]), torch.Size([1, 3, 8]))
        >>> olmo2 = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(num_kv_heads=1, qk_norm=QKNorm(over="all")))
        >>> olmo2.q_norm.weight.shape, olmo2.k_norm.weight.shape
        (torch.Size([8]), torch.Size([4]))
    """

    eps: float = 1e-6
    unit_offset: bool = False
    over: str = "head"

    def __post_init__(self):
        positive_number("QKNorm eps", self.eps)
        instance_of("QKNorm unit_offset", self.unit_offset, bool, "a bool")
        one_of("QKNorm over", self.over, ("head", "all"))


@dataclass(frozen=True)
class Window:
    """A causal sliding window of ``size`` keys, as :class:`MultiHeadAttention`'s ``pattern``:
    query ``i`` sees keys ``i - size + 1`` to ``i`` (:func:`attnlab.masks.sliding_window_mod`); a
    :class:`~attnlab.nn.WindowedKVCache` of ``size`` slots is then its whole cache.

    Example:
        >>> from attnlab.nn import MultiHeadAttention
        >>> MultiHeadAttention(8, 8, num_heads=2, pattern=Window(4)).window
        4
    """

    size: int

    def __post_init__(self):
        positive_int("window", self.size)


@dataclass(frozen=True)
class Chunk:
    """Causal chunked-local attention (Llama 4's local layers), as :class:`MultiHeadAttention`'s
    ``pattern``: query ``i`` sees keys from the start of its ``size``-sized block to ``i``
    (:func:`attnlab.masks.chunked_local_mod`); a :class:`~attnlab.nn.ChunkedKVCache` is its cache.

    Example:
        >>> from attnlab.nn import MultiHeadAttention
        >>> MultiHeadAttention(8, 8, num_heads=2, pattern=Chunk(4)).chunk
        4
    """

    size: int

    def __post_init__(self):
        positive_int("chunk", self.size)


@dataclass(frozen=True)
class CallMask:
    """One call's mask of :meth:`MultiHeadAttention.forward` in parts: a mask, key padding and
    packed documents, ANDed (True = may attend).

    Args:
        mask: a bool/float tensor broadcastable to ``(B, H, Tq, Tk)`` or a mask mod, or None.
        padding: ``(B, Tk)`` bool, True at real key tokens (cached + new with a cache) -- the
            **opposite** of ``torch.nn.MultiheadAttention(key_padding_mask=...)``.
        documents: ``(T,)`` or ``(B, T)`` integer ids of the document of each token of a packed
            sequence (self-attention, no cache): attention stays inside each document and rotary
            positions restart at 0 at each document start.

    Example:
        >>> import torch
        >>> from attnlab.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 8, num_heads=2)
        >>> x, real = torch.randn(2, 3, 8), torch.tensor([[True, True, False], [True, True, True]])
        >>> mha(x, mask=CallMask(padding=real)).shape
        torch.Size([2, 3, 8])
    """

    mask: object = None
    padding: Tensor | None = None
    documents: Tensor | None = None


_REMOVED = {
    "qkv_bias": "qkv=QKV(bias=...)", "num_kv_heads": "qkv=QKV(num_kv_heads=...)", "kdim": "qkv=QKV(kdim=...)",
    "vdim": "qkv=QKV(vdim=...)", "out_bias": "qkv=QKV(out_bias=...)",
    "causal": "pattern='causal' (the default) or pattern=None (every query sees every key)",
    "window": "pattern=Window(size)", "chunk": "pattern=Chunk(size)",
}


def _refuse_removed(kwargs: dict) -> None:
    """``TypeError`` naming the new spelling of each constructor keyword the module no longer takes."""
    old = [name for name in kwargs if name in _REMOVED]
    if old:
        moves = "; ".join(f"{name}= is now {_REMOVED[name]}" for name in old)
        raise TypeError(f"MultiHeadAttention no longer takes {', '.join(old)}: {moves} "
                        "(QKV, Window, Chunk from attnlab.nn; see README 'Modules')")


def _check_pattern(pattern: object) -> str | Window | Chunk | None:
    """The standing pattern: ``"causal"``, None (full), a :class:`Window` or a :class:`Chunk`."""
    if pattern is None or pattern == "causal" or isinstance(pattern, (Window, Chunk)):
        return pattern
    raise ValueError(f"pattern must be 'causal', None (no mask), Window(size) or Chunk(size); got {pattern!r}")


def pattern_of(causal: bool = True, window: int | None = None, chunk: int | None = None) -> str | Window | Chunk | None:
    """The ``pattern`` of :class:`MultiHeadAttention` from the flags a block or model still takes.

    Example:
        >>> pattern_of(True, 4), pattern_of(False), pattern_of(chunk=8)
        (Window(size=4), None, Chunk(size=8))
    """
    instance_of("causal", causal, bool, "a bool")
    window, chunk = _check_window(window, causal), _check_chunk(chunk, causal, window)
    if window is not None:
        return Window(window)
    if chunk is not None:
        return Chunk(chunk)
    return "causal" if causal else None


def _mask_parts(mask: object, causal: bool) -> tuple[object, object, Tensor | None]:
    """``forward(mask=...)`` as ``(mask, padding, documents)``: a :class:`CallMask` in its parts,
    a :func:`~attnlab.masks.padding_mod` as key padding, a :func:`~attnlab.masks.document_mod`
    as packed documents (its causality is the module's), anything else as the mask."""
    if isinstance(mask, CallMask):
        return mask.mask, mask.padding, mask.documents
    if isinstance(mask, _masks.PaddingMod):
        return None, ("lengths", mask.lengths), None
    if isinstance(mask, _masks.DocumentMod):
        if mask.causal != causal:
            raise ValueError(f"document_mod(causal={mask.causal}) on a module with pattern "
                             f"{'causal' if causal else None}: the module's pattern rules causality; pass "
                             f"document_mod(ids, causal={causal}) or CallMask(documents=ids)")
        if mask.offset:
            raise ValueError(f"a document_mod with offset={mask.offset} cannot be a module's documents; pass "
                             "CallMask(documents=ids) for the tokens of this call")
        return None, None, mask.ids
    return mask, None, None


def _check_window(window: object, causal: bool) -> int | None:
    """``window`` checked: None, or a positive int on a causal module."""
    if window is None:
        return None
    positive_int("window", window)
    if not causal:
        raise ValueError(f"window={window} is a causal sliding window; it needs causal=True")
    return window


def _check_chunk(chunk: object, causal: bool, window: object) -> int | None:
    """``chunk`` checked: None, or a positive int on a causal module without a window."""
    if chunk is None:
        return None
    positive_int("chunk", chunk)
    if not causal:
        raise ValueError(f"chunk={chunk} is causal chunked-local attention; it needs causal=True")
    if window is not None:
        raise ValueError(f"chunk={chunk} with window={window}: a layer is chunked or sliding, not both")
    return chunk


def head_sizes(d_model: int, num_heads: int, group_heads: int | None, head_dim: int | None, *,
               group_name: str) -> tuple[int, int]:
    """``(group_heads, head_dim)`` of a layer whose ``num_heads`` share ``group_heads`` heads (key/value
    heads, or query/key heads of a recurrent layer) of ``head_dim`` features, checked and defaulted:
    ``group_heads`` to ``num_heads``, ``head_dim`` to ``d_model // num_heads``.

    Example:
        >>> head_sizes(64, 8, 2, None, group_name="num_kv_heads")
        (2, 8)
        >>> head_sizes(64, 8, 3, None, group_name="num_kv_heads")
        Traceback (most recent call last):
        ...
        ValueError: num_heads (8) must be a multiple of num_kv_heads (3)
    """
    positive_int("d_model", d_model)
    positive_int("num_heads", num_heads)
    group_heads = num_heads if group_heads is None else positive_int(group_name, group_heads)
    divisible("num_heads", num_heads, group_name, group_heads)
    if head_dim is None:
        divisible("d_model", d_model, "num_heads", num_heads)
        head_dim = d_model // num_heads
    return group_heads, positive_int("head_dim", head_dim)


@dataclass
class KVShare:
    """One source layer's keys and values of one call, for the layers that read them.

    The source (a :class:`~attnlab.nn.MultiHeadAttention` called with ``kv=``) fills it; each
    :class:`~attnlab.nn.SharedKVAttention` called with the same object reads it
    (:mod:`attnlab.nn.kv_sharing`).

    Attributes:
        keys: ``(B, Hkv, Tk, hd)`` rotated keys every query of the call may see (cached + new).
        values: ``(B, Hkv, Tk, hd)``.
        lengths: ``(B,)`` each row's real keys when the rows of a paged batch differ, else None.
        positions: the call's query positions: an int offset, or ``(B|1, Tq)`` (ragged rows,
            packed documents).

    Example:
        >>> import torch
        >>> from attnlab.nn import MultiHeadAttention
        >>> share = KVShare()
        >>> _ = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(num_kv_heads=1))(torch.randn(1, 3, 8), kv=share)
        >>> share.filled, share.keys.shape, share.positions
        (True, torch.Size([1, 1, 3, 4]), 0)
    """

    keys: Tensor | None = None
    values: Tensor | None = None
    lengths: Tensor | None = None
    positions: int | Tensor = 0

    @property
    def filled(self) -> bool:
        """Whether a source layer has written this call's keys and values."""
        return self.keys is not None
