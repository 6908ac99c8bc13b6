"""The ``sdpa`` backend: PyTorch's fused ``scaled_dot_product_attention`` kernels.

On CPU PyTorch runs a flash-attention kernel (O(T) memory) for unmasked and top-left causal
calls and for calls with an explicit ``attn_mask``, and falls back to its "math" path (the
full score matrix, O(T^2)) for dropout and for ``Dv != D``. On CUDA it chooses between
flash, memory-efficient, cuDNN and math kernels. This module translates an attnlab call into
SDPA's arguments faithfully:

* bool masks keep their polarity (SDPA's bool ``attn_mask`` also means True = attend);
  float masks are passed as additive biases in the query dtype, except that fp16/bf16 calls
  on CPU get them in fp32 (a bias near -130 has a bf16 step of 1; PyTorch's CPU kernels take
  an fp32 mask with half inputs);
* ``causal`` with ``align="top_left"`` (or any alignment when ``Tq == Tk``) and no other mask
  uses ``is_causal=True``; bottom-right causal with ``Tq != Tk``, causal together with a mask,
  and mask mods are materialised into one dense mask -- O(Tq*Tk) memory, and
  :meth:`SdpaBackend.memory_for` says so for that call;
* grouped-query attention uses ``enable_gqa=True`` (heads are repeated on PyTorch < 2.5);
* a scale <= 0, and any scale when a backward pass will run, is folded into q (``q * scale``
  with scale 1 passed): the CPU kernel scales causally blocked ``-inf`` scores (``-inf * 0``
  is NaN) and its backward recomputes the scores with different rounding (see
  :func:`attnlab._math.folds_scale`);
* rows with no attendable key are given a harmless mask row (and a zero query) before the
  kernel runs and are zeroed afterwards with ``torch.where``, so they are zeros with zero
  gradient whatever the PyTorch version does with fully masked rows;
* keys no query may attend are zeroed in k and v (O(Tk*D), found by reductions over the
  mask), so NaN/inf stored there cannot leak through ``0 * NaN``;
* a query row holding NaN gives a NaN output row (SDPA's CPU flash kernel returns zeros
  there, which would pass for a fully masked row);
* dropout: SDPA draws from PyTorch's global RNG. With a ``generator`` the call draws one seed
  from it and runs SDPA under a forked, freshly seeded global RNG, so the same generator seed
  gives bitwise the same output and the caller's global RNG is untouched. Without one, SDPA
  uses the global RNG as usual. (SDPA's dropout mask differs from the reference's; both keep
  each weight with probability ``1 - p`` and scale by ``1 / (1 - p)``.)

SDPA does not expose the row log-sum-exp, so ``return_weights`` recomputes the weights with
:func:`attnlab.attention_weights`; ``out`` is computed exactly as without weights.

Example:
    >>> import torch, attnlab
    >>> q = torch.randn(1, 4, 16, 8)
    >>> out = attnlab.attention(q, q, q, causal=True, backend="sdpa")
    >>> torch.allclose(out, attnlab.attention(q, q, q, causal=True, backend="reference"), atol=1e-6)
    True
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._call import AttentionCall
from attnlab._checks import has_values
from attnlab._math import folds_scale, live, repeat_kv, zero_dead
from attnlab.backends.base import AttentionResult, Backend, call_flops
from attnlab.backends.rates import RATES
from attnlab.backends.registry import register

__all__ = ["SdpaBackend", "sdpa_plan", "SdpaPlan", "kernel_for"]

_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
_HAS_GQA = _TORCH_VERSION >= (2, 5)  # enable_gqa= appeared in PyTorch 2.5



@dataclass(frozen=True)
class SdpaPlan:
    """How one call is handed to SDPA, decided without building any tensor.

    Attributes:
        mask_source: ``"none"`` (no mask), ``"is_causal"`` (SDPA's own top-left causal),
            ``"user"`` (the user's bool/float mask passed as is) or ``"materialised"``
            (causal/mask mod/bottom-right folded into one dense mask).
        kernel: the SDPA kernel PyTorch will pick (``"flash"``, ``"efficient"``, ``"cudnn"``
            or ``"math"``).
        memory: ``"linear"`` or ``"quadratic"`` extra memory in the sequence length.
        memory_note: why, in words.

    Example:
        >>> from attnlab.backends import build_call
        >>> q = torch.randn(1, 2, 8, 4)
        >>> sdpa_plan(build_call(q, q, q, mask=lambda b, h, i, j: i >= j)).mask_source
        'materialised'
    """

    mask_source: str
    kernel: str
    memory: str
    memory_note: str


def _mask_source(call: AttentionCall) -> str:
    if call.mask_kind == "none":
        if not call.causal:
            return "none"
        return "is_causal" if call.causal_offset == 0 else "materialised"
    if call.mask_kind in ("bool", "float") and not call.causal:
        return "user"
    return "materialised"


def _mask_stand_in(call: AttentionCall, source: str) -> Tensor | None:
    """A zero-stride tensor with the shape/dtype of the mask SDPA will see (for kernel choice)."""
    if source in ("none", "is_causal"):
        return None
    if source == "user":
        shape = tuple(call.mask.shape)
        dtype = torch.bool if call.mask_kind == "bool" else _mask_dtype(call)
    else:
        shape = (call.batch, call.q_heads, call.tq, call.tk)
        dtype = _mask_dtype(call) if call.mask_kind == "float" else torch.bool
    return torch.zeros((), dtype=dtype, device=call.device).expand(shape)


def kernel_for(call: AttentionCall) -> str:
    """The SDPA kernel PyTorch will choose for ``call``: flash, efficient, cudnn or math.

    Uses PyTorch's own selector (``torch._fused_sdp_choice``) where it exists; otherwise the
    documented CPU rules (math for dropout and for ``Dv != D``, flash otherwise).

    Example:
        >>> from attnlab.backends import build_call
        >>> q = torch.randn(1, 2, 8, 4)
        >>> kernel_for(build_call(q, q, q))
        'flash'
    """
    source = _mask_source(call)
    gqa = call.q_heads != call.kv_heads
    k, v = (call.k, call.v) if (_HAS_GQA or not gqa) else (
        repeat_kv(call.k, call.q_heads), repeat_kv(call.v, call.q_heads))
    chooser = getattr(torch, "_fused_sdp_choice", None)
    if chooser is not None:
        extra = {"enable_gqa": True} if (gqa and _HAS_GQA) else {}
        try:
            index = chooser(
                call.q, k, v, _mask_stand_in(call, source), call.dropout_p,
                source == "is_causal", scale=call.scale, **extra,
            )
            name = torch.nn.attention.SDPBackend(index).name
            return {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
                    "CUDNN_ATTENTION": "cudnn"}.get(name, "math")
        except (RuntimeError, TypeError, ValueError, AttributeError):
            pass
    if call.dropout_p > 0.0 or call.value_dim != call.head_dim:
        return "math"
    return "flash"


def sdpa_plan(call: AttentionCall) -> SdpaPlan:
    """Decide how SDPA will run ``call`` and which memory class that is.

    Example:
        >>> from attnlab.backends import build_call
        >>> q = torch.randn(1, 2, 8, 4)
        >>> sdpa_plan(build_call(q, q, q, causal=True)).memory
        'linear'
    """
    return call.memo("sdpa_plan", lambda: _plan(call))  # dispatch asks from memory_for and cost


def _plan(call: AttentionCall) -> SdpaPlan:
    source = _mask_source(call)
    kernel = kernel_for(call)
    if kernel == "math":
        return SdpaPlan(source, kernel, "quadratic",
                        "SDPA's math kernel materialises the (Tq, Tk) scores")
    if source == "materialised":
        return SdpaPlan(source, kernel, "quadratic",
                        "the causal/mask-mod mask is materialised as a dense (Tq, Tk) mask")
    if source == "user" and _full_size(call.mask, call) and (
        call.mask_kind == "bool" or call.mask.dtype != _mask_dtype(call)
    ):
        return SdpaPlan(source, kernel, "quadratic",
                        "the dense (Tq, Tk) mask is converted to an additive mask")
    return SdpaPlan(source, kernel, "linear", f"SDPA's {kernel} kernel keeps O(T) memory")


def _full_size(mask: Tensor, call: AttentionCall) -> bool:
    """Whether a user mask spans both sequence axes (so a converted copy is O(Tq*Tk))."""
    return mask.shape[-2] == call.tq > 1 and mask.shape[-1] == call.tk > 1


def _mask_dtype(call: AttentionCall) -> torch.dtype:
    """dtype of the float ``attn_mask``: the query's, or fp32 for a half-precision CPU call
    whose mask is not already in the query dtype (rounding the bias to fp16/bf16 would cost up
    to half a unit of the bias, e.g. 0.5 near -130 in bf16). CUDA keeps the query dtype: its
    memory-efficient kernel requires a bias in the query dtype."""
    half = call.dtype in (torch.float16, torch.bfloat16)
    if half and call.device.type == "cpu" and call.mask_kind == "float" and call.mask.dtype != call.dtype:
        return torch.float32
    return call.dtype


@dataclass(frozen=True)
class _Masking:
    """What :func:`sdpa_forward` passes and patches.

    attn_mask: bool (True = attend) or float, broadcastable to ``(B, Hq, Tq, Tk)``, or None.
    row_alive: ``(B|1, H|1, Tq|1, 1)`` rows that may attend a key; None when all may.
    keys_live: ``(B|1, H|1, Tk|1, 1)`` keys some query may attend; None when all are.
    """

    attn_mask: Tensor | None = None
    row_alive: Tensor | None = None
    keys_live: Tensor | None = None


def _build_mask(call: AttentionCall, source: str) -> _Masking:
    """The ``attn_mask`` to pass, the rows that may attend a key and the keys that may be attended.

    Dead rows get a harmless all-allowed mask row. Reductions only (``any``/``amax``): no
    temporary the size of the mask.
    """
    if source == "none":
        return _Masking()
    if source == "is_causal":  # top-left: keys j >= Tq are never attended
        if call.tq >= call.tk:
            return _Masking()
        keys = torch.arange(call.tk, device=call.device)
        return _Masking(keys_live=(keys < call.tq).view(1, 1, call.tk, 1))
    allowed = call.allowed()  # bool (causal, bool mask, mask mod) or None
    bias = call.bias()
    if bias is None:
        keys_live = live(allowed.any(dim=-2))  # (B|1, H|1, Tk|1)
        row_alive = live(allowed.any(dim=-1))  # (B|1, H|1, Tq|1)
        if row_alive is None:
            return _Masking(allowed, None, keys_live)
        return _Masking(allowed | ~row_alive, row_alive, keys_live)
    attn_mask = bias.to(_mask_dtype(call))
    if allowed is not None:
        attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))  # (B|1, H|1, Tq, Tk)
    keys_live = live(attn_mask.amax(dim=-2) > float("-inf"))  # (B|1, H|1, Tk|1)
    row_alive = live(attn_mask.amax(dim=-1) > float("-inf"))  # (B|1, H|1, Tq|1)
    if row_alive is None:
        return _Masking(attn_mask, None, keys_live)
    return _Masking(torch.where(row_alive, attn_mask, 0.0), row_alive, keys_live)


def _dropout_rng(call: AttentionCall):
    """Context in which SDPA's dropout draws from a seed taken from ``call.generator``."""
    if call.dropout_p == 0.0 or call.generator is None:
        return contextlib.nullcontext()
    gen = call.generator
    seed = int(torch.randint(0, 2**62, (), generator=gen, device=gen.device, dtype=torch.int64))
    return _seeded(call.device, seed)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int):
    if device.type == "cuda":
        with torch.random.fork_rng(devices=[device.index or 0], device_type="cuda"):
            torch.cuda.manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield


def sdpa_forward(call: AttentionCall) -> Tensor:
    """Run ``call`` through SDPA and return out ``(B, Hq, Tq, Dv)``.

    Example:
        >>> from attnlab.backends import build_call
        >>> q = torch.randn(2, 3, 5, 4)
        >>> sdpa_forward(build_call(q, q, q)).shape
        torch.Size([2, 3, 5, 4])
    """
    source = _mask_source(call)
    masking = _build_mask(call, source)
    scale = call.scale
    q = zero_dead(call.q, masking.row_alive)  # a NaN query of a dead row must not reach dK
    if folds_scale(call):  # scale <= 0 with is_causal, or scores the backward must recompute exactly
        q, scale = q * call.scale, 1.0
    k = zero_dead(call.k, masking.keys_live)  # (B, Hkv, Tk, D)
    v = zero_dead(call.v, masking.keys_live)  # (B, Hkv, Tk, Dv)
    extra = {}
    if call.q_heads != call.kv_heads:
        if _HAS_GQA:
            extra["enable_gqa"] = True
        else:
            k, v = repeat_kv(k, call.q_heads), repeat_kv(v, call.q_heads)  # (B, Hq, Tk, D)
    with _dropout_rng(call):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=masking.attn_mask, dropout_p=call.dropout_p,
            is_causal=source == "is_causal", scale=scale, **extra,
        )  # (B, Hq, Tq, Dv)
    out = _nan_query_rows(q, out)
    if masking.row_alive is not None:
        out = torch.where(masking.row_alive, out, 0.0)  # zeros, zero gradient
    return out


def _nan_query_rows(q: Tensor, out: Tensor) -> Tensor:
    """``out`` with NaN in every row whose query holds a NaN (SDPA's CPU flash kernel gives
    zeros there). On CPU one sum skips the per-row pass in the common case (a NaN anywhere
    makes the sum NaN; a sum made NaN by ``inf - inf`` only costs the pass); on CUDA the pass
    runs unconditionally, as reading the sum would synchronise the device."""
    if q.device.type == "cpu":
        total = float((q.detach() if q.requires_grad else q).sum())
        if total == total:  # not NaN: no query holds a NaN
            return out
    return torch.where(q.isnan().any(dim=-1, keepdim=True), float("nan"), out)  # (B, Hq, Tq, Dv)


_NAN_ROWS_KEPT: dict = {}  # probe results by signature less Tk (a decoding loop's Tk grows each step)


def _kernel_keeps_nan_rows(call: AttentionCall, options: dict) -> bool:
    """Whether SDPA itself returns a NaN row for a NaN query row at ``call``'s signature.

    Probed once per signature less the key length (the kernel's per-row NaN handling does not
    depend on how many keys it loops over, and a decoding loop meets a new length every step):
    NaN in the first and the last query row of the first and the last head, every other row
    finite. Where the kernel keeps the rule, a prepared inference run needs no check of its own
    (one reduction and a read of its result per call, a sixth of a decoding step at Tk=64 on
    CPU); where it hides such a row (some CPU builds' flash kernel returns zeros), the check
    stays. With gradients the check always stays, so that a NaN row's gradient is what the full
    path gives.
    """
    if call.batch == 0 or call.tq == 0 or call.tk == 0 or not has_values(call.q):  # nothing to probe with
        return False
    key = (F.scaled_dot_product_attention, call.device, call.dtype, call.batch, call.q_heads, call.kv_heads,
           call.tq, call.head_dim, call.value_dim, tuple(sorted(options.items())))
    if key not in _NAN_ROWS_KEPT:
        _NAN_ROWS_KEPT[key] = _probe_nan_rows(call, options)
    return _NAN_ROWS_KEPT[key]


def _probe_nan_rows(call: AttentionCall, options: dict) -> bool:
    """One SDPA call on inputs of ``call``'s shapes with NaN query rows: are they NaN, and only they?"""
    q = call.q.new_zeros(call.q.shape)  # (B, Hq, Tq, D)
    k, v = call.k.new_ones(call.k.shape), call.v.new_ones(call.v.shape)  # (B, Hkv, Tk, D|Dv)
    q[0, 0, 0, 0] = q[-1, -1, -1, 0] = float("nan")  # the first and the last query row
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v, **options)  # (B, Hq, Tq, Dv)
    nan_query_rows = q.isnan().any(dim=-1, keepdim=True).expand_as(out)  # (B, Hq, Tq, Dv)
    return bool(torch.equal(out.isnan(), nan_query_rows))


class SdpaBackend(Backend):
    """PyTorch's ``scaled_dot_product_attention`` (CPU flash; CUDA flash/efficient/cuDNN).

    Example:
        >>> import attnlab
        >>> q = torch.randn(2, 4, 12, 16)
        >>> attnlab.attention(q, q, q, mask=torch.rand(12, 12) > 0.3, backend="sdpa").shape
        torch.Size([2, 4, 12, 16])
    """

    name = "sdpa"
    memory = "linear"
    description = (
        "torch.nn.functional.scaled_dot_product_attention (CPU flash; CUDA flash, efficient, "
        "cuDNN); O(T) memory unless a mask must be materialised or the math kernel runs"
    )

    def unavailable_reason(self) -> str | None:
        if not _HAS_SDPA:
            return f"torch {torch.__version__} has no scaled_dot_product_attention (needs 2.0+)"
        return None

    def memory_for(self, call: AttentionCall) -> str:
        """Memory class of this call: ``"linear"`` or ``"quadratic"`` (see :func:`sdpa_plan`)."""
        return sdpa_plan(call).memory

    def memory_note(self, call: AttentionCall) -> str:
        """Why the call has its memory class, in words."""
        return sdpa_plan(call).memory_note

    def cost(self, call: AttentionCall) -> float:
        """Estimated seconds: attention FLOPs at the kernel's measured rate plus call overhead."""
        plan = sdpa_plan(call)
        rates = RATES["sdpa"]
        on_cuda = call.device.type == "cuda"
        if on_cuda:
            rate = rates["cuda"].get(plan.kernel, rates["cuda"]["math"])
        elif plan.kernel == "flash":
            rate = rates["cpu_flash"][plan.mask_source]
        else:
            rate = rates["cpu_math"]
        flops = call_flops(call, causal=plan.mask_source == "is_causal")
        return rates["call_overhead_s"]["cuda" if on_cuda else "cpu"] + flops / rate

    def prepare(self, call: AttentionCall):
        """For unmasked calls (plain or top-left causal) without dropout or weights: SDPA itself.

        Such a call's kernel, scale and GQA flag follow from its signature, and SDPA serves
        every valid one, whatever the values, so the validated choice can be reused as is.

        Example:
            >>> q = torch.randn(1, 2, 1, 8)
            >>> from attnlab.backends import build_call
            >>> run = SdpaBackend().prepare(build_call(q, q, q))
            >>> torch.equal(run(q, q, q), sdpa_forward(build_call(q, q, q)))
            True
        """
        source = _mask_source(call)
        gqa = call.q_heads != call.kv_heads
        if (call.input_rank != 4 or source not in ("none", "is_causal") or call.dropout_p > 0.0
                or call.return_weights or (gqa and not _HAS_GQA)):
            return None
        fold = folds_scale(call)  # as sdpa_forward does
        options = dict(is_causal=source == "is_causal", scale=1.0 if fold else call.scale,
                       **({"enable_gqa": True} if gqa else {}))
        if not fold and not call.requires_grad and _kernel_keeps_nan_rows(call, options):
            return functools.partial(F.scaled_dot_product_attention, **options)  # (B, Hq, Tq, Dv)
        q_factor = call.scale if fold else None

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q = q if q_factor is None else q * q_factor
            return _nan_query_rows(q, F.scaled_dot_product_attention(q, k, v, **options))  # (B, Hq, Tq, Dv)

        return run

    def forward(self, call: AttentionCall) -> AttentionResult:
        return AttentionResult(out=sdpa_forward(call))


register(SdpaBackend())
