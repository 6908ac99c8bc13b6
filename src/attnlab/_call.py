"""Validation and normalisation of one attention call, shared by every backend.

``build_call`` checks the user's arguments once and returns an :class:`AttentionCall`: q
``(B, Hq, Tq, D)``, k ``(B, Hkv, Tk, D)``, v ``(B, Hkv, Tk, Dv)`` (broadcast batch dims as
stride-0 views, rank 5 flattened into ``B``) and the mask as one value. Backends read this
object and never re-validate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab import scores as _scores
from attnlab._checks import broadcast_shape, finite_number, instance_of, probability
from attnlab.masks.patterns import ALIGNMENTS as _ALIGNMENTS

__all__ = ["AttentionCall", "build_call", "sdpa_aligned", "batch_shape", "MEMO_KEYS", "call_template", "bind_call"]

# What a call may remember once computed: the dense mask of attendable positions and sdpa's
# plan (the kernel choice, asked for by dispatch's memory and cost questions), whether sinks go
# through the kernel's lse, and how the mask reaches SDPA.
MEMO_KEYS = ("allowed", "sdpa_plan", "sinks_through_lse", "sdpa_source")


@dataclass(frozen=True)
class AttentionCall:
    """One attention call with 4-D tensors and resolved options.

    Attributes:
        q: queries ``(B, Hq, Tq, D)``.
        k: keys ``(B, Hkv, Tk, D)``; ``Hq`` is a multiple of ``Hkv`` (grouped-query).
        v: values ``(B, Hkv, Tk, Dv)``.
        mask: the call's mask as one value, of the kind ``mask_kind`` names (see below).
        causal_offset: None, or the causal part of the mask: query ``i`` sees keys
            ``j <= i + causal_offset`` (the alignment folded in).
        align: ``"top_left"`` or ``"bottom_right"`` causal alignment.
        scale: multiplier of ``q @ k^T``.
        dropout_p: probability of dropping an attention weight.
        generator: random generator for dropout (``None`` = PyTorch's default).
        input_rank: rank of the user's q (2 to 5), to restore the output layout.
        return_weights: whether the caller also wants the attention weights.
        batch_shape: the broadcast batch dims of the user's inputs (``()`` for rank 2,
            ``(B,)`` for ranks 3 and 4, ``(A, B)`` for rank 5), flattened into ``B``.
        score_mod: a :class:`attnlab.scores.ScoreMod` applied to the scaled scores, or None.
        sinks: sink logits ``(Hq,)`` or ``(B|1, Hq|1, Tq)`` (one more key of value 0), or None.

    The mask is one value, normalised by :func:`build_call`; backends switch on ``mask_kind``:
    ``"none"``; ``"causal"`` (``mask`` None); ``"bool"`` or ``"float"`` (a tensor
    ``(B|1, Hq|1, Tq|1, Tk|1)``, ANDed with causal when ``causal_offset`` is set); ``"mod"`` (a
    mask mod with causal already ANDed in; ``causal_offset`` still names it); ``"prepared"`` (a
    :class:`~attnlab.masks.PreparedMask`, causal inside it).

    The one taxonomy of masks: ``mask_form`` says what structure the mask has, for backends
    that run some structures their own way (they switch on it and inspect no mod class):
    ``"none"``; ``"causal"`` (causal alone, at ``causal_offset``); ``"given"`` (a tensor alone,
    as the caller holds it); ``"keys"`` (a bool key mask ``(B|1, 1, 1, Tk)`` beside top-left
    causal); ``"rows"`` (a bool ``(B|1, 1, T, T)`` mask alone, which may be causal AND a key
    mask); ``"padding"`` (a padding mod, alone or with top-left causal: its
    :meth:`~attnlab.masks.MaskMod.form` gives the lengths); ``"varlen"`` (a varlen causal mod
    without a window); ``"dense"`` (any other: a backend materialises or plans it).

    Derived once, when the call is made (plain fields, read freely): the sizes ``batch``,
    ``q_heads``, ``kv_heads``, ``tq``, ``tk``, ``head_dim``, ``value_dim``; ``dtype``, ``device``;
    ``requires_grad`` (grad mode is on and a tensor of the call wants a gradient); ``mask_kind``,
    ``mask_form``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | Callable | None
    causal_offset: int | None
    align: str
    scale: float
    dropout_p: float
    generator: torch.Generator | None
    input_rank: int
    return_weights: bool = False
    batch_shape: tuple = ()
    score_mod: _scores.ScoreMod | None = None
    sinks: Tensor | None = None
    _memo: dict = field(default_factory=dict, compare=False, repr=False)
    # Read by every backend several times per call: plain fields, computed once in __post_init__
    # (so that dataclasses.replace recomputes them too).
    batch: int = field(init=False)
    q_heads: int = field(init=False)
    kv_heads: int = field(init=False)
    tq: int = field(init=False)
    tk: int = field(init=False)
    head_dim: int = field(init=False)
    value_dim: int = field(init=False)
    dtype: torch.dtype = field(init=False)
    device: torch.device = field(init=False)
    requires_grad: bool = field(init=False)
    mask_kind: str = field(init=False)
    mask_form: str = field(init=False)

    def __post_init__(self) -> None:
        q, k, v, mask, mod, sinks = self.q, self.k, self.v, self.mask, self.score_mod, self.sinks
        kind = ("none" if self.causal_offset is None else "causal") if mask is None else _mask_kind(mask, self.causal_offset)
        # A backward pass may follow when grad mode is on and an input of the call wants one.
        grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or (kind == "float" and mask.requires_grad) or (sinks is not None and sinks.requires_grad)
            or (mod is not None and any(p.requires_grad for p in mod.params())))
        tq, tk = q.shape[2], k.shape[2]
        form = kind if mask is None else _mask_form(kind, mask, self.causal_offset, tq, tk)
        values = dict(batch=q.shape[0], q_heads=q.shape[1], kv_heads=k.shape[1], tq=tq, tk=tk,
                      head_dim=q.shape[3], value_dim=v.shape[3], dtype=q.dtype, device=q.device,
                      requires_grad=grad, mask_kind=kind, mask_form=form)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def memo(self, key: str, compute: Callable[[], object]):
        """The value of ``compute()`` under ``key`` (one of :data:`MEMO_KEYS`), computed once per call.

        Example:
            >>> q = torch.randn(1, 1, 2, 4)
            >>> call = build_call(q, q, q)
            >>> call.memo("sdpa_plan", lambda: "plan"), call.memo("sdpa_plan", lambda: "other")
            ('plan', 'plan')
        """
        if key not in MEMO_KEYS:
            raise KeyError(f"memo key must be one of {MEMO_KEYS}, got {key!r}")
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def mask_mod(self) -> Callable | None:
        """Every mask of the call but a dense tensor, as one mask mod; None when there is none."""
        if self.mask_kind in ("mod", "prepared"):
            return self.mask
        return None if self.causal_offset is None else _masks.CausalMod(self.causal_offset)

    def allowed(self) -> Tensor | None:
        """Dense bool mask of attendable positions, broadcastable to ``(B, Hq, Tq, Tk)``.

        Combines ``causal``, a bool mask and a mask mod; a float mask is not included (see
        :meth:`bias`). Returns ``None`` when nothing is masked. Cached per call.
        """
        return self.memo("allowed", self._dense_allowed)

    def _dense_allowed(self) -> Tensor | None:
        parts = []
        mod = self.mask_mod()
        if mod is not None:
            parts.append(
                _masks.materialize(
                    mod, tq=self.tq, tk=self.tk, batch=self.batch, heads=self.q_heads,
                    device=self.device,
                )
            )
        if self.mask_kind == "bool":
            parts.append(self.mask)
        return _masks.and_masks(*parts)

    def bias(self) -> Tensor | None:
        """The float (additive) mask, broadcastable to ``(B, Hq, Tq, Tk)``, or None."""
        return self.mask if self.mask_kind == "float" else None


def _mask_form(kind: str, mask: object, offset: int | None, tq: int, tk: int) -> str:
    """The structure of a call's mask, read from its kind, shape and the mod's own
    :meth:`~attnlab.masks.MaskMod.form` (the table of :class:`AttentionCall`)."""
    if kind == "bool" and mask.shape[1] == 1:
        if offset == 0 and mask.shape[2] == 1 and mask.shape[3] == tk:
            return "keys"
        if offset is None and mask.shape[2] == tq == tk == mask.shape[3] and tq > 1:
            return "rows"
    if kind in ("bool", "float"):
        return "given" if offset is None else "dense"
    if kind == "mod" and isinstance(mask, _masks.MaskMod):
        form = mask.form()
        if form[0] == "padding" and offset in (None, 0):
            return "padding"
        if form[0] == "varlen" and offset is None:
            return "varlen"
    return "dense"


def _mask_kind(mask: object, causal_offset: int | None) -> str:
    """The kind of a normalised mask value (the table of :class:`AttentionCall`)."""
    if mask is None:
        return "none" if causal_offset is None else "causal"
    if isinstance(mask, Tensor):
        return "bool" if mask.dtype == torch.bool else "float"
    return "prepared" if type(mask) is _masks.PreparedMask else "mod"


# The fields of a call that follow from its signature alone (no tensor, no user object): what a
# prepared run keeps, to bind each later call's tensors to (:func:`bind_call`).
_SIGNATURE_FIELDS = ("causal_offset", "align", "scale", "dropout_p", "input_rank", "return_weights",
                     "batch_shape", "batch", "q_heads", "kv_heads", "tq", "head_dim", "value_dim", "dtype",
                     "device", "requires_grad", "mask_kind", "mask_form")


def call_template(call: AttentionCall, *, memo: dict | None = None) -> dict:
    """The fields of ``call`` that its signature decides, for :func:`bind_call`: no tensor of
    the call, no object of the caller (the mask, sinks and score mod are bound per call).

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> template = call_template(build_call(q, q, q, causal=True))
        >>> template["mask_kind"], any(isinstance(v, Tensor) for v in template.values())
        ('causal', False)
    """
    fields = {name: getattr(call, name) for name in _SIGNATURE_FIELDS}
    fields["generator"] = None  # a call with a generator is never prepared (its key is None)
    fields["_template_memo"] = dict(memo or {})
    return fields


def bind_call(template: dict, q: Tensor, k: Tensor, v: Tensor, mask: object, sinks: Tensor | None,
              score_mod: _scores.ScoreMod | None) -> AttentionCall:
    """A call of ``template``'s signature on these tensors, without checking them again: the
    caller (a prepared run) was reached through a key that guarantees what the checks found.
    Only ``Tk`` is read from ``k`` (a decoding step's run serves a class of cache lengths); grad
    need is the template's (the key holds grad mode and every ``requires_grad``, a score mod's too).

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> call = bind_call(call_template(build_call(q, q, q)), q, q[:, :, :3], q[:, :, :3], None, None, None)
        >>> call.tk, call.mask_kind
        (3, 'none')
    """
    call = object.__new__(AttentionCall)
    fields = call.__dict__
    fields.update(template)
    memo = fields.pop("_template_memo")
    fields.update(q=q, k=k, v=v, mask=mask, sinks=sinks, score_mod=score_mod, tk=k.shape[2], _memo=dict(memo))
    return call


def _check_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must have a floating-point dtype, got {value.dtype}")
    if value.ndim not in (2, 3, 4, 5):
        raise ValueError(
            f"{name} must have rank 2 (T, D), 3 (B, T, D), 4 (B, H, T, D) or 5 (A, B, H, T, D); "
            f"got rank {value.ndim} with shape {tuple(value.shape)}"
        )
    return value


def _shapes(q: Tensor, k: Tensor, v: Tensor) -> str:
    """The shapes for an error message (built only when one is raised: this runs on every call)."""
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """Refuse q, k, v that no backend can take; return their broadcast batch dims.

    The common call (three float tensors of one rank, dtype and device, equal batch dims, sizes
    that fit) is told by one expression; any other is checked by the rules below, one by one,
    so that each refusal names its argument."""
    if (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and q.ndim == k.ndim == v.ndim == 4
            and q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point and q.device == k.device == v.device
            and q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1] and k.shape[2] == v.shape[2]
            and q.shape[3] == k.shape[3] and q.shape[3] and v.shape[3] and k.shape[1] and q.shape[1] and q.shape[1] % k.shape[1] == 0):
        return (q.shape[0],)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k and v must have the same rank; got {_shapes(q, k, v)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device; got q {q.device}, k {k.device}, v {v.device}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k must have the same last dim D as q; got {_shapes(q, k, v)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"v must have as many positions Tk as k; got {_shapes(q, k, v)}")
    lead = q.ndim - (2 if q.ndim <= 3 else 3)  # the batch dims, which broadcast
    if k.shape[lead:-1] != v.shape[lead:-1]:
        raise ValueError(f"v must match k in every dim but the batch dims and the last; got {_shapes(q, k, v)}")
    batch = batch_shape(q, k, v)
    if batch is None:
        raise ValueError(f"the batch dims of q and k/v must be equal or 1 (they broadcast); got {_shapes(q, k, v)}")
    _check_sizes(q, k, v)
    if q.ndim >= 4 and q.shape[-3] % k.shape[-3] != 0:
        raise ValueError(
            f"the number of query heads ({q.shape[-3]}) must be a multiple of the number of "
            f"key/value heads ({k.shape[-3]}); got {_shapes(q, k, v)}"
        )
    return batch


def sdpa_aligned(q: object, k: object, v: object) -> tuple:
    """q, k and v aligned as ``F.scaled_dot_product_attention`` aligns them (views, free).

    Leading dims count from the right, so a tensor of lower rank gets size-1 dims in front: q
    ``(H, Tq, D)`` with k, v ``(B, H, Tk, D)`` is q ``(1, H, Tq, D)``, one query set meeting every
    key set of the batch. A single query head against several key/value heads broadcasts too
    (expanded with stride 0; its gradient sums over the heads it served); otherwise query heads
    must be a multiple of key/value heads (grouped-query attention). Anything that is not a
    tensor of rank 2 to 5 is returned as it is, for :func:`build_call` to refuse by name.

    Example:
        >>> q, k = torch.ones(5, 8), torch.ones(2, 4, 7, 8)
        >>> [tuple(t.shape) for t in sdpa_aligned(q, k, k)]
        [(1, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8)]
    """
    tensors = (q, k, v)
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return tensors
    if q.ndim == k.ndim == v.ndim and (q.ndim < 4 or q.shape[-3] != 1 or k.shape[-3] == 1):
        return tensors  # the common call: nothing to align (this runs on every call)
    if not all(2 <= t.ndim <= 5 for t in tensors):
        return tensors
    rank = max(t.ndim for t in tensors)
    q, k, v = (t.reshape((1,) * (rank - t.ndim) + tuple(t.shape)) if t.ndim < rank else t
               for t in tensors)
    if rank >= 4 and q.shape[-3] == 1 < k.shape[-3]:
        q = q.expand(*q.shape[:-3], k.shape[-3], *q.shape[-2:])  # (..., Hkv, Tq, D), stride 0
    return q, k, v


def batch_shape(q: Tensor, k: Tensor, v: Tensor) -> tuple | None:
    """The broadcast batch dims of q, k and v of one rank (all dims before the heads, or
    before ``T`` for rank 3), or None when they do not broadcast.

    Example:
        >>> batch_shape(torch.ones(2, 4, 5, 8), torch.ones(1, 1, 7, 8), torch.ones(1, 1, 7, 8))
        (2,)
    """
    lead = q.ndim - (2 if q.ndim <= 3 else 3)
    return broadcast_shape([tuple(q.shape[:lead]), tuple(k.shape[:lead]), tuple(v.shape[:lead])])


def _check_sizes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Refuse a head dim, value dim or head count of 0 (a slicing mistake; ``1/sqrt(0)``);
    B, Tq or Tk of 0 are legal and give an empty (or zero) output."""
    if q.shape[-1] == 0 or k.shape[-1] == 0:
        raise ValueError(f"q and k must have a head dim D >= 1 (last dim); got {_shapes(q, k, v)}")
    if v.shape[-1] == 0:
        raise ValueError(f"v must have a value dim Dv >= 1 (last dim); got {_shapes(q, k, v)}")
    if q.ndim >= 4 and (q.shape[-3] == 0 or k.shape[-3] == 0):
        raise ValueError(
            f"q and k/v must have at least one head (dim -3 of a 4-D or 5-D tensor); got {_shapes(q, k, v)}"
        )


def _to_4d(t: Tensor, batch: tuple = ()) -> Tensor:
    """``t`` as ``(B, H, T, X)``, its batch dims expanded to ``batch`` (a stride-0 view where
    they are 1: broadcast keys are read, never repeated) and flattened into one."""
    if t.ndim == 2:
        return t[None, None]  # (1, 1, T, D)
    if tuple(t.shape[:len(batch)]) != batch:
        t = t.expand(*batch, *t.shape[len(batch):])
    if t.ndim == 3:
        return t[:, None]  # (B, 1, T, D)
    if t.ndim == 5:  # a view when the two batch dims merge, else a copy
        return t.flatten(0, 1)  # (A*B, H, T, D)
    return t


def _normalize_mask(mask: object, q: Tensor, tk: int, batch: tuple = ()) -> Tensor | Callable | None:
    """Check a mask against the output's leading dims (q's, with the broadcast ``batch``) and
    return it 4-D (dims 1 or full size)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        if callable(mask):
            if isinstance(mask, _masks.MaskMod):
                B, H, Tq, _ = _to_4d(q, batch).shape
                mask.check_sizes(batch=B, heads=H, tq=Tq, tk=tk)
            return mask
        raise TypeError(
            f"mask must be a bool/float tensor or a mask mod callable, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"mask must be bool (True = may attend) or floating point (added to the scores); "
            f"got dtype {mask.dtype}. Use mask.bool() for a 0/1 mask."
        )
    if mask.device != q.device:
        raise ValueError(f"mask must be on q's device {q.device}, got {mask.device}")
    target = (*batch, *q.shape[len(batch):-1], tk)  # (..., Tq, Tk)
    if broadcast_shape([tuple(mask.shape), target]) != target:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (..., Tq, Tk) = {target}"
        )
    if mask.ndim < len(target):
        mask = mask.reshape((1,) * (len(target) - mask.ndim) + tuple(mask.shape))
    if mask.ndim == 5:  # (A|1, B|1, ...): flatten the batch dims unless both are 1
        mask = mask[0, :1] if mask.shape[:2] == (1, 1) else mask.expand(*batch, *mask.shape[2:])
        return mask.flatten(0, 1) if mask.ndim == 5 else mask  # (A*B|1, H|1, Tq|1, Tk|1)
    return _to_4d(mask)  # (B|1, H|1, Tq|1, Tk|1)


def _check_options(causal: object, align: object, scale: object, dropout_p: object) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _masks.check_align(align)  # type: ignore[arg-type]
    if scale is not None:
        finite_number("scale", scale)
    probability("dropout_p", dropout_p)


def _check_score_mod(score_mod: object, q4: Tensor, tk: int) -> _scores.ScoreMod | None:
    """The score mod as a :class:`~attnlab.scores.ScoreMod`, checked against the call's sizes and,
    for a user's function, evaluated on a small tile and its positions so that a wrong shape is
    refused here (:func:`attnlab.scores.check_function`)."""
    if score_mod is None:
        return None
    mod = _scores.as_score_mod(score_mod).for_call(dtype=_score_probe_dtype(q4.dtype), device=q4.device)
    B, H, Tq, _ = q4.shape
    mod.check(batch=B, heads=H, tq=Tq, tk=tk, device=q4.device)
    if _scores.has_function(mod) and min(B, H, Tq, tk) > 0:
        _scores.check_function(mod, tq=Tq, tk=tk, device=q4.device, dtype=_score_probe_dtype(q4.dtype))
    return mod


def _score_probe_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_generator(generator: object, device: torch.device) -> None:
    # Checked even when dropout_p == 0: a wrong generator is a bug whether or not it is used yet.
    if generator is None:
        return
    instance_of("generator", generator, torch.Generator, "a torch.Generator or None")
    if generator.device.type != device.type:
        raise ValueError(
            f"generator must be on q's device type {device.type!r}, got a generator on "
            f"{generator.device}"
        )


def _causal_offset(causal: bool, align: str, tq: int, tk: int) -> int | None:
    """The causal part's offset (query ``i`` sees keys ``j <= i + offset``), or None when
    ``causal`` is off or blocks no key (e.g. one new token over a KV cache)."""
    offset = tk - tq if align == "bottom_right" else 0
    return offset if causal and offset < tk - 1 else None


def build_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: object = None,
    causal: bool = False,
    align: str = "top_left",
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
    score_mod: object = None,
    sinks: object = None,
) -> AttentionCall:
    """Validate the arguments of :func:`attnlab.attention` and return a 4-D :class:`AttentionCall`.

    The one place the mask is normalised: causal becomes ``causal_offset`` (None when it blocks
    no key), and a mask mod with causal becomes one mod holding both.

    Raises:
        TypeError: a non-tensor, a non-float or mixed dtype, an integer mask, a wrong
            ``generator``, ``score_mod`` or ``sinks``.
        ValueError: wrong rank, mismatched sizes, a zero head dim, value dim or head count, a
            mask that does not broadcast, options out of range. Each message names the argument
            and the shapes seen; empty batches and sequences are legal.

    Example:
        >>> from attnlab import masks
        >>> q = torch.randn(2, 5, 8)                              # (B, T, D)
        >>> call = build_call(q, q, q, mask=masks.sliding_window_mod(5, 5, window=2), causal=True)
        >>> call.q.shape, call.mask_kind, call.causal_offset
        (torch.Size([2, 1, 5, 8]), 'mod', 0)
    """
    batch = _check_qkv(q, k, v)
    if not ((causal is True or causal is False) and align in _ALIGNMENTS and scale is None
            and type(dropout_p) is float and 0.0 <= dropout_p < 1.0):  # else each option by its rule
        _check_options(causal, align, scale, dropout_p)
    if generator is not None:
        _check_generator(generator, q.device)
    norm_mask = None if mask is None else _normalize_mask(mask, q, k.shape[-2], batch)
    offset = _causal_offset(causal, align, q.shape[-2], k.shape[-2]) if causal else None
    if offset is not None and norm_mask is not None and not isinstance(norm_mask, Tensor):
        norm_mask = _masks.and_masks(_masks.CausalMod(offset), norm_mask)  # one mod: its bounds hold both
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    plain = q.ndim == 4 and len(batch) == 1 and q.shape[0] == k.shape[0] == v.shape[0]  # nothing to lay out
    q4 = q if plain else _to_4d(q, batch)
    mod = None if score_mod is None else _check_score_mod(score_mod, q4, k.shape[-2])
    if sinks is not None:
        sinks = _scores.check_sinks(sinks, heads=q4.shape[1], device=q.device, batch=q4.shape[0], tq=q4.shape[2])
    return AttentionCall(
        q=q4,
        k=k if plain else _to_4d(k, batch),
        v=v if plain else _to_4d(v, batch),
        mask=norm_mask,
        causal_offset=offset,
        align=align,
        scale=scale,
        dropout_p=float(dropout_p),
        generator=generator,
        input_rank=q.ndim,
        return_weights=return_weights,
        batch_shape=batch,
        score_mod=mod,
        sinks=sinks,
    )
