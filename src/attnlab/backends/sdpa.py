"""The ``sdpa`` backend: PyTorch's fused ``scaled_dot_product_attention`` kernels.

An attnlab call becomes SDPA's arguments without reading a tensor value or copying one:

* the mask (:func:`_mask_source`, from ``call.mask_kind``): none, or top-left causal alone, is
  SDPA's own ``is_causal``; a bool or float tensor alone is passed as the caller holds it; any
  other mask (bottom-right causal, causal with a tensor, a mask mod, an additive score mod) is
  materialised into one dense mask, O(Tq*Tk), which :meth:`SdpaBackend.memory_use` reports.
  Float masks of fp16/bf16 calls reach the CPU kernels in fp32;
* grouped-query attention uses ``enable_gqa=True`` (heads repeated on PyTorch < 2.5);
* sinks fold into the CPU flash kernel's log-sum-exp where it allows (:func:`sinks_through_lse`),
  else they are one more key of value 0 whose logit is a float mask column;
* a scale <= 0, or any scale when a backward will run, is folded into q
  (:func:`attnlab._math.kernel_scales`);
* rows with no key to attend are zeros from the kernel itself on CPU with PyTorch 2.13+, else
  mended by two value-free ``torch.where`` (:func:`kernel_keeps_rows`); keys that top-left causal
  hides from every query are sliced off;
* dropout with a ``generator`` runs under the global RNG forked and seeded from it.

``return_weights`` recomputes the weights (:func:`attnlab.attention_weights`); ``out`` is the same.

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
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._call import AttentionCall
from attnlab import scores as _scores
from attnlab._math import kernel_scales, keep_nan_rows, repeat_kv, score_dtype
from attnlab.backends import _segments
from attnlab.backends._lse import fold_sinks, row_delta, sinks_gradient
from attnlab.backends.base import AttentionResult, Backend, MemoryUse, call_flops, memory_of_class, scores_bytes
from attnlab.backends.rates import RATES
from attnlab.backends.registry import register

__all__ = ["SdpaBackend", "sdpa_plan", "SdpaPlan", "kernel_for", "kernel_keeps_rows", "sinks_through_lse"]

_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
_HAS_GQA = _TORCH_VERSION >= (2, 5)  # enable_gqa= appeared in PyTorch 2.5
try:
    from torch._subclasses import fake_tensor as _fake_tensor
except ImportError:  # pragma: no cover - every supported torch has it
    _fake_tensor = None



@dataclass(frozen=True)
class SdpaPlan:
    """How one call is handed to SDPA, decided without building any tensor.

    Attributes:
        mask_source: ``"none"``, ``"is_causal"``, ``"user"`` or ``"materialised"`` (:func:`_mask_source`).
        kernel: the kernel PyTorch will pick: ``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``.
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


# PyTorch's CPU flash kernel as an op that also returns the row log-sum-exp (what
# scaled_dot_product_attention calls on CPU, minus the dispatch), with its backward.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def sinks_through_lse(call: AttentionCall) -> bool:
    """Whether ``call``'s sinks are applied through the CPU flash kernel's log-sum-exp
    (:data:`_SinksThroughLse`) rather than as one more key in a float mask.

    Needs: sinks, a CPU call on PyTorch 2.13+ (whose kernel gives dead rows zeros itself), no
    dropout, ``Dv == D`` (the flash kernel's own rule), no mask or score-mod tensor that wants a
    gradient (the kernel's backward gives none for its mask), and no empty size (the op,
    unlike SDPA's front end, divides by zero on an empty sequence or head count: SIGFPE).

    Example:
        >>> from attnlab.backends import build_call
        >>> q = torch.randn(1, 2, 8, 4)
        >>> sinks_through_lse(build_call(q, q, q, causal=True, sinks=torch.zeros(2)))
        True
    """
    if call.sinks is None:
        return False
    return call.memo("sinks_through_lse", lambda: (  # asked by every step that builds the call's mask
        call.device.type == "cpu" and _CPU_KERNEL_KEEPS_ROWS and _CPU_FLASH is not None
        and call.dropout_p == 0.0 and call.value_dim == call.head_dim
        and not _mask_needs_grad(call, sinks=False)
        and min(call.batch, call.q_heads, call.kv_heads, call.tq, call.tk) > 0))


def _sink_key(call: AttentionCall) -> bool:
    """Whether the call's sinks reach SDPA as one more key and a float mask column."""
    return call.sinks is not None and not sinks_through_lse(call)


def _mask_source(call: AttentionCall) -> str:
    """How the call's mask reaches SDPA: ``"none"``, ``"is_causal"``, ``"user"`` (the caller's
    tensor as it is), ``"segments"`` (a padded batch, as calls on the real keys:
    :mod:`attnlab.backends._segments`) or ``"materialised"`` (a dense mask built per call).
    Decided once per call (dispatch's questions and the run all ask it)."""
    memo = call._memo
    if "sdpa_source" not in memo:
        memo["sdpa_source"] = _source_of(call)
    return memo["sdpa_source"]


def _source_of(call: AttentionCall) -> str:
    form = call.mask_form
    if _segments_kind(call) is not None:
        return "segments"
    if call.score_mod is not None:  # a bias tensor the caller holds reaches SDPA as it is
        held = isinstance(call.score_mod, _scores.Bias) and form in ("none", "given", "rows")
        return "user" if held else "materialised"
    if form == "none":
        return "none"
    if form == "causal":  # is_causal takes no attn_mask, which the sinks' column needs
        return "is_causal" if call.causal_offset == 0 and not _sink_key(call) else "materialised"
    return "user" if form in ("given", "rows") else "materialised"


def _padding_lengths(mod: object) -> tuple[Tensor, bool]:
    """``(lengths, causal)`` of a mask whose form is ``"padding"`` (:meth:`~attnlab.masks.MaskMod.form`)."""
    _, lengths, causal = mod.form()
    return lengths, causal


# The call's mask forms SDPA runs as a padded batch (:mod:`attnlab.backends._segments`), by its name there.
_SEGMENT_FORMS = {"keys": "keys", "rows": "causal_4d", "padding": "padding", "varlen": "varlen"}


def _segments_kind(call: AttentionCall) -> str | None:
    """Which padded-batch form ``call``'s mask has (:mod:`attnlab.backends._segments`), from its
    ``mask_form``: ``"keys"`` (a bool key mask ``(B|1, 1, 1, Tk)`` with top-left causal),
    ``"padding"`` (a padding mod, with or without it), ``"varlen"`` (a varlen causal mod
    without a window), ``"causal_4d"`` (a bool ``(B|1, 1, T, T)`` mask alone, which may be
    causal AND a key mask); None otherwise.

    CPU only, where the kernel zeroes rows with no key (PyTorch 2.13+), its values can be read
    (not traced, fake, meta or under a ``torch.func`` transform) and nothing rides on the mask
    (score mod, sinks, dropout).
    """
    form = _SEGMENT_FORMS.get(call.mask_form)
    if form is None:
        return None
    if (call.device.type != "cpu" or not _CPU_KERNEL_KEEPS_ROWS or call.score_mod is not None
            or call.sinks is not None or call.dropout_p > 0.0 or min(call.batch, call.tq, call.tk) == 0
            or (call.q_heads != call.kv_heads and not _HAS_GQA)
            or torch.compiler.is_compiling() or _is_fake(call.q)
            or torch._C._functorch.maybe_current_level() is not None):  # under torch.func: values may be batched
        return None
    return form


def _mask_stand_in(call: AttentionCall, source: str) -> Tensor | None:
    """A zero-stride tensor with the shape/dtype of the mask SDPA will see (for kernel choice)."""
    sinks = _sink_key(call)
    if source in ("none", "is_causal", "segments") and not sinks:
        return None  # (the segments' calls take no mask)
    if call.score_mod is not None:
        shape, dtype = (call.batch, call.q_heads, call.tq, call.tk), _mask_dtype(call)
    elif source == "user":
        shape = tuple(call.mask.shape)
        dtype = torch.bool if call.mask_kind == "bool" else _mask_dtype(call)
    elif source == "none":
        shape = (1, call.q_heads, 1, call.tk)
        dtype = _mask_dtype(call)
    else:
        shape = (call.batch, call.q_heads, call.tq, call.tk)
        dtype = _materialised_dtype(call)
    if sinks:
        per_query = call.sinks.ndim == 3  # they fill the query dim, and the batch dim if theirs is full
        batch = call.batch if per_query and call.sinks.shape[0] != 1 else shape[0]
        rows = call.tq if per_query else shape[2]
        shape, dtype = (batch, call.q_heads, rows, shape[3] + 1), _mask_dtype(call)
    grad = torch.is_grad_enabled() and _mask_needs_grad(call)  # SDPA runs math to differentiate a mask
    return torch.zeros((), dtype=dtype, device=call.device, requires_grad=grad).expand(shape)


def _mask_elements(call: AttentionCall) -> int:
    """Elements of the dense mask a materialised call builds: ``(B, 1, Tq, Tk)``, per head
    with a score mod's bias."""
    heads = call.q_heads if call.score_mod is not None else 1
    return call.batch * heads * call.tq * (call.tk + (1 if _sink_key(call) else 0))


def _materialised_dtype(call: AttentionCall) -> torch.dtype:
    """The dtype of a materialised mask: bool, or float for a bias or the sinks' column."""
    return _mask_dtype(call) if _float_mask(call) else torch.bool


def _float_mask(call: AttentionCall) -> bool:
    """Whether SDPA gets a float mask: a float mask, a score mod's bias or the sinks' column."""
    return call.mask_kind == "float" or call.score_mod is not None or _sink_key(call)


def _mask_needs_grad(call: AttentionCall, *, sinks: bool = True) -> bool:
    """Whether a tensor of the mask wants a gradient (``sinks``: counting the sinks' column)."""
    return ((call.bias() is not None and call.bias().requires_grad)
            or (sinks and call.sinks is not None and call.sinks.requires_grad)
            or (call.score_mod is not None and any(p.requires_grad for p in call.score_mod.params())))


def _is_fake(t: Tensor) -> bool:
    """Whether ``t`` is a FakeTensor (shapes and dtypes only, as torch.export traces with)."""
    return _fake_tensor is not None and _fake_tensor.is_fake(t)


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
    if _sink_key(call):  # the kernel sees one more key (never read here: empty is enough)
        k = k.new_empty(*k.shape[:2], k.shape[2] + 1, k.shape[3])  # (B, H, Tk + 1, D)
        v = v.new_empty(*v.shape[:2], v.shape[2] + 1, v.shape[3])  # (B, H, Tk + 1, Dv)
    # PyTorch's selector returns a Python int, which torch.compile cannot trace, and answers
    # "math" for fake and meta tensors: the documented rule below stands in for those.
    shapes_only = torch.compiler.is_compiling() or call.device.type == "meta" or _is_fake(call.q)
    chooser = None if shapes_only else getattr(torch, "_fused_sdp_choice", None)
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
    return call.memo("sdpa_plan", lambda: _plan(call))  # dispatch asks from memory_use and cost


def _plan(call: AttentionCall) -> SdpaPlan:
    source = _mask_source(call)
    kernel = kernel_for(call)
    if kernel == "math":
        return SdpaPlan(source, kernel, "quadratic",
                        "SDPA's math kernel materialises the (Tq, Tk) scores")
    if call.score_mod is not None and source == "materialised":
        return SdpaPlan(source, kernel, "quadratic",
                        "the score mod's bias is materialised as a dense (Tq, Tk) float mask")
    if source == "materialised":
        return SdpaPlan(source, kernel, "quadratic",
                        "the causal/mask-mod mask is materialised as a dense (Tq, Tk) mask")
    if source == "segments":
        return SdpaPlan(source, kernel, "linear",
                        f"a padded batch: SDPA's {kernel} kernel on each row's real keys, no (Tq, Tk) mask built")
    if source == "user":
        # The caller already holds the mask; SDPA's additive copy of a bool one is the same
        # O(Tq*Tk) order, so the mask does not make this call's memory class worse.
        return SdpaPlan(source, kernel, "linear",
                        f"SDPA's {kernel} kernel keeps O(T) memory beyond the caller's own mask")
    return SdpaPlan(source, kernel, "linear", f"SDPA's {kernel} kernel keeps O(T) memory")


def _mask_dtype(call: AttentionCall) -> torch.dtype:
    """dtype of the float ``attn_mask``: the query's, or fp32 for a half-precision CPU call
    whose mask is not already in the query dtype (rounding the bias to fp16/bf16 would cost up
    to half a unit of the bias, e.g. 0.5 near -130 in bf16). CUDA keeps the query dtype: its
    memory-efficient kernel requires a bias in the query dtype."""
    half = call.dtype in (torch.float16, torch.bfloat16)
    if half and call.device.type == "cpu" and call.mask_kind == "float" and call.mask.dtype != call.dtype:
        return torch.float32
    if half and call.device.type == "cpu" and (call.score_mod is not None or _sink_key(call)):
        return torch.float32
    return call.dtype


# PyTorch's CPU kernels (flash and math) give a fully masked row a zero output and zero
# gradients and a NaN query row a NaN output on the versions the suite runs on (2.13, 2.14;
# tests/test_numerics.py pins it through attnlab on every backend), so attnlab adds nothing
# on that path. Older versions and other devices get the rows mended by two value-free
# ``where`` passes.
_CPU_KERNEL_KEEPS_ROWS = _TORCH_VERSION >= (2, 13)


def kernel_keeps_rows(device: torch.device) -> bool:
    """Whether SDPA on ``device`` itself zeroes fully masked rows and keeps NaN query rows NaN.

    Example:
        >>> kernel_keeps_rows(torch.device("meta"))
        False
    """
    return device.type == "cpu" and _CPU_KERNEL_KEEPS_ROWS


def _attn_mask(call: AttentionCall, source: str) -> Tensor | None:
    """The ``attn_mask`` SDPA gets: None, the user's mask, or the materialised causal /
    mask-mod mask (with a float mask's ``-inf`` at blocked pairs), plus a score mod's bias, and
    the sinks' column last."""
    mask = _keys_mask(call, source)
    if call.score_mod is not None:
        mask = _with_score_bias(call, mask)
    if _sink_key(call):
        mask = _with_sink_column(call, mask)
    return mask


def _with_score_bias(call: AttentionCall, mask: Tensor | None) -> Tensor:
    """``mask`` (bool, float or None) as a float mask with the additive score mod's bias added."""
    mod = call.score_mod
    if isinstance(mod, _scores.Bias):  # the caller's tensor as it is, its size-1 dims kept
        from_mod = mod.tensor.reshape((1,) * (4 - mod.tensor.ndim) + tuple(mod.tensor.shape))
    else:
        from_mod = _scores.additive_term(mod, *_scores.grid(call.batch, call.q_heads, (0, call.tq), (0, call.tk),
                                                            call.device), dtype=score_dtype(call.dtype))
    from_mod = from_mod.to(_mask_dtype(call))  # (B|1, H|1, Tq|1, Tk|1)
    if mask is None:
        return from_mod
    if mask.dtype == torch.bool:
        return from_mod.masked_fill(~mask, float("-inf"))  # (B|1, H|1, Tq, Tk)
    return mask.to(from_mod.dtype) + from_mod


def _with_sink_column(call: AttentionCall, mask: Tensor | None) -> Tensor:
    """``mask`` as a float mask ``(B|1, Hq, Tq|1, Tk + 1)`` whose last column is each row's sink
    logit (``sinks[h]``, or ``sinks[b, h, i]`` per query: then ``Tq``), the logit of the all-zero
    key the runner appends."""
    dtype = _mask_dtype(call)
    if mask is None:
        mask = torch.zeros(1, 1, 1, call.tk, dtype=dtype, device=call.device)
    elif mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=dtype, device=call.device).masked_fill(~mask, float("-inf"))
    mask = mask.to(dtype)
    logits = _scores.sink_logits(call.sinks, dtype)  # (B|1, Hq|1, Tq|1)
    shape = (mask.shape[0] if logits.shape[0] == 1 else logits.shape[0], call.q_heads,
             mask.shape[2] if logits.shape[2] == 1 else logits.shape[2])  # B|1, Hq, Tq|1 (0 stays 0)
    column = logits.unsqueeze(-1).expand(*shape, 1)  # (B|1, Hq, Tq|1, 1)
    return torch.cat([mask.expand(*shape, call.tk), column], dim=-1)  # (B|1, Hq, Tq|1, Tk + 1)


def _keys_mask(call: AttentionCall, source: str) -> Tensor | None:
    """The mask over the keys alone (see :func:`_attn_mask`)."""
    if source in ("none", "is_causal"):
        return None
    if source == "segments" and call.mask_kind == "mod":  # the runner reads the mod's lengths
        return None
    allowed = call.allowed() if source == "materialised" else None  # bool (B|1, H|1, Tq, Tk)
    bias = call.bias()
    if bias is None:
        return allowed if allowed is not None else call.mask
    if allowed is None:
        return bias  # put in _mask_dtype by the runner
    return bias.to(_mask_dtype(call)).masked_fill(~allowed, float("-inf"))  # (B|1, H|1, Tq, Tk)


def _row_alive(attn_mask: Tensor | None) -> Tensor | None:
    """``(B|1, H|1, Tq|1, 1)``: rows that may attend some key (None when no mask)."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return attn_mask.any(dim=-1, keepdim=True)
    return attn_mask.amax(dim=-1, keepdim=True) > float("-inf")


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

    No tensor value is read, so the call traces under ``torch.compile(fullgraph=True)``.
    Top-left causal with ``Tq < Tk`` hands SDPA only the first ``Tq`` keys (a view): the others
    are reached by no query and are never read.

    Example:
        >>> from attnlab.backends import build_call
        >>> q = torch.randn(2, 3, 5, 4)
        >>> sdpa_forward(build_call(q, q, q)).shape
        torch.Size([2, 3, 5, 4])
    """
    source = _mask_source(call)
    with _dropout_rng(call):
        sinks = () if call.sinks is None else (call.sinks,)  # a run without sinks may be SDPA itself
        return _runner(call, source)(call.q, call.k, call.v, _attn_mask(call, source), *sinks)


def _drop_defaults(options: dict, head_dim: int) -> None:
    """Leave out the SDPA options that equal its defaults: each keyword SDPA parses costs a
    decoding step time (the scale PyTorch computes itself is ``1 / sqrt(D)`` in double, as here)."""
    if options["dropout_p"] == 0.0:
        del options["dropout_p"]
    if not options["is_causal"]:
        del options["is_causal"]
    if options["scale"] == 1.0 / math.sqrt(head_dim):
        del options["scale"]


def _runner(call: AttentionCall, source: str) -> Callable[..., Tensor]:
    """``run(q, k, v, attn_mask, sinks=None) -> (B, Hq, Tq, Dv)``: SDPA with everything decided
    from ``call``'s signature (kernel options, scale folding, key slicing, row mending, how the
    sinks are applied) bound, so that any call of the same signature may run it with its own
    tensors."""
    keys = call.tq if source == "is_causal" and call.tq < call.tk else None
    factor, kernel_scale = kernel_scales(call)  # q * factor: scale <= 0, or a backward to recompute
    factor = None if factor == 1.0 else factor
    options = dict(dropout_p=call.dropout_p, is_causal=source == "is_causal", scale=kernel_scale)
    _drop_defaults(options, call.head_dim)
    gqa = call.q_heads != call.kv_heads
    if gqa and _HAS_GQA:
        options["enable_gqa"] = True
    if source == "segments":
        return _segments_runner(call, factor, options)
    repeat = call.q_heads if gqa and not _HAS_GQA else None
    float_dtype = _mask_dtype(call) if _float_mask(call) else None
    sink_key = _sink_key(call)  # one more key of zeros, its logit in the mask's last column
    by_lse = sinks_through_lse(call)  # or the kernel's lse (see _SinksThroughLse)
    lse_mask_dtype = _mask_dtype(call) if by_lse else None  # (run must not hold the call's tensors)
    mend = not kernel_keeps_rows(call.device)
    # SDPA's output of no element is connected to none of its inputs: learnable sinks would
    # then fail backward, so such an output is tied to them (with a zero gradient).
    tie_sinks = call.sinks is not None and call.batch * call.q_heads * call.tq == 0
    if (float_dtype is None and keys is None and factor is None and repeat is None and not mend
            and call.sinks is None):
        # Nothing to do around the kernel (the common call): SDPA itself, with its options
        # bound, so that a prepared run adds no Python frame of its own.
        return functools.partial(F.scaled_dot_product_attention, **options)  # (q, k, v, attn_mask)

    def run(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, sinks: Tensor | None = None) -> Tensor:
        if float_dtype is not None:
            attn_mask = attn_mask.to(float_dtype)  # (B|1, H|1, Tq|1, Tk)
        if keys is not None:
            k, v = k[:, :, :keys], v[:, :, :keys]  # (B, Hkv, Tq, D|Dv): no query reaches the rest
        if sink_key:
            k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)  # (B, Hkv, Tk + 1, D)
            v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)  # (B, Hkv, Tk + 1, Dv)
        row_alive = _row_alive(attn_mask) if mend else None
        if row_alive is not None:
            attn_mask = attn_mask | ~row_alive if attn_mask.dtype == torch.bool else torch.where(row_alive, attn_mask, 0.0)
            q = torch.where(row_alive, q, 0.0)  # a NaN query of a dead row must not reach dK
        if factor is not None:
            q = q * factor
        if repeat is not None:
            k, v = repeat_kv(k, repeat), repeat_kv(v, repeat)  # (B, Hq, Tk, D|Dv)
        if by_lse:
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # the op takes float masks only
                attn_mask = torch.zeros((), dtype=lse_mask_dtype, device=q.device).masked_fill(
                    ~attn_mask, float("-inf"))  # (B|1, H|1, Tq, Tk), as SDPA converts it
            # The op reads its inputs as if contiguous (a strided last dim gave wrong values;
            # scaled_dot_product_attention's front end copies them first): copies where they are not.
            q, k, v = (t.contiguous() for t in (q, k, v))
            arguments = ((options.get("is_causal", False), options.get("scale")), q, k, v, sinks, attn_mask)
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks)):
                return _SinksThroughLse.apply(*arguments)[0]  # (B, Hq, Tq, Dv)
            return _sinks_by_lse(*arguments)[0]  # nothing to differentiate: no autograd Function
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)  # (B, Hq, Tq, Dv)
        if tie_sinks:
            out = out + sinks.sum().to(out.dtype) * 0  # still no element
        if mend:
            out = keep_nan_rows(q, out)
            if row_alive is not None:
                out = torch.where(row_alive, out, 0.0)  # zeros, zero gradient
        return out

    return run


def _segments_runner(call: AttentionCall, factor: float | None, options: dict) -> Callable[..., Tensor]:
    """``run(q, k, v, mask)`` for a padded batch (:mod:`attnlab.backends._segments`): the bands'
    calls when each row's real keys are one run and the estimate favours them; else one fused
    call: a key mask (bool, a padding mod's, or the one a 4-D mask was found to be) reaches the
    CPU flash kernel as a ``(B|1, 1, 1, Tk)`` additive mask beside its own ``is_causal`` (no
    ``(Tq, Tk)`` mask, causal blocks still skipped), any other 4-D mask as given, a varlen mod
    as its dense mask.

    A bool form reads its spans from the ``mask`` handed to ``run`` (a prepared run holds no
    tensor of the call); a mask mod's are read from the mod, whose runs are made per call."""
    form = _segments_kind(call)
    long_enough = _segments.long_enough(call.tq)
    spans_of_mod = _mod_spans(call) if form in ("padding", "varlen") and long_enough else None
    causal = form in ("keys", "causal_4d", "varlen") or (form == "padding" and _padding_lengths(call.mask)[1])
    keys_of_mod = _padding_keys(call) if form == "padding" else None
    fused = call.value_dim == call.head_dim and _CPU_FLASH is not None  # the op takes keys beside causal
    varlen_dense = call.allowed if form == "varlen" else None  # (run must not hold a bool form's call)
    sizes = dict(batch=call.batch, heads=call.q_heads, tq=call.tq, tk=call.tk, dims=call.head_dim)
    options = {name: value for name, value in options.items() if name not in ("is_causal", "dropout_p")}

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: None = None) -> Tensor:
        if factor is not None:
            q = q * factor
        if keys_of_mod is not None:
            mask = keys_of_mod()  # (B, 1, 1, Tk)
        keys = mask if form in ("keys", "padding") else None  # (B|1, 1, 1, Tk)
        spans = None  # below long_enough one fused call wins: the spans are not even read
        if long_enough and spans_of_mod is not None:
            spans = spans_of_mod
        elif long_enough:
            valid = _segments.causal_key_mask(mask) if form == "causal_4d" else mask[:, 0, 0, :]  # (B|1, Tk)
            keys = keys if valid is None or form != "causal_4d" else valid[:, None, None, :]
            spans = None if valid is None else _segments.key_spans(valid)
        if spans is not None and len(spans) == 1 < q.shape[0]:
            spans = spans * q.shape[0]  # a mask of batch 1 holds for every row
        by_keys = fused and keys is not None
        groups = None if spans is None else _segments.plan_bands(spans, causal=causal, tq=q.shape[2])
        if groups is not None and _segments.cheaper_than_dense(groups, dense_causal=causal and by_keys, **sizes):
            return _segments.run_groups(q, k, v, groups, options)  # (B, Hq, Tq, Dv)
        if by_keys:
            return _keys_beside_causal(q, k, v, keys, causal, options.get("scale"))
        if varlen_dense is not None:
            mask = varlen_dense()  # (B, 1, Tq, Tk)
        elif form in ("keys", "padding"):  # no fused op for this call: causal AND the keys, (B|1, 1, Tq, Tk)
            mask = (torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril() if causal
                    else torch.ones((), dtype=torch.bool, device=q.device)) & mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)

    return run


def _keys_beside_causal(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, causal: bool, scale: float | None) -> Tensor:
    """``(B, Hq, Tq, Dv)``: PyTorch's CPU flash op with its own top-left ``is_causal`` and the key
    mask ``(B|1, 1, 1, Tk)`` as an additive one beside it (SDPA's front end refuses the two
    together; the op takes both, broadcasts the mask, and handles grouped heads itself)."""
    additive = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~keys, float("-inf"))  # (B|1, 1, 1, Tk)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the op needs a dense last dim
    return _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)[0]


def _padding_keys(call: AttentionCall) -> Callable[[], Tensor]:
    """Builds a padding mod's key mask ``(B, 1, 1, Tk)`` from its lengths (read at each call)."""
    lengths = _padding_lengths(call.mask)[0]

    def keys() -> Tensor:
        return torch.arange(call.tk, device=call.device) < lengths.to(call.device).view(-1, 1, 1, 1)  # (B, 1, 1, Tk)

    return keys


def _mod_spans(call: AttentionCall) -> list[tuple[int, int, int, int]]:
    """Each batch row's ``(q_len, start, end, offset)`` from a padding or varlen mask mod."""
    if call.mask_form == "varlen":
        _, q_lengths, k_lengths = call.mask.form()
        q_lengths, k_lengths = q_lengths.tolist(), k_lengths.tolist()
        return [(q_len, 0, k_len, k_len - q_len) for q_len, k_len in zip(q_lengths, k_lengths)]
    lengths = _padding_lengths(call.mask)[0].tolist()
    return [(call.tq, 0, min(length, call.tk), 0) for length in lengths]


def _sinks_by_lse(plan: tuple, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor,
                  attn_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """The CPU flash kernel's out and lse with the sinks folded in (:func:`attnlab.backends._lse.fold_sinks`).

    Shapes: q ``(B, Hq, Tq, D)``, k and v ``(B, Hkv, Tk, D)``, all contiguous; sinks ``(Hq,)`` or
    ``(B|1, Hq|1, Tq)``; attn_mask None or a float mask broadcastable to ``(B, Hq, Tq, Tk)``;
    plan ``(is_causal, scale)``. Returns out ``(B, Hq, Tq, D)`` and lse ``(B, Hq, Tq)`` (fp32; a
    row with no key keeps the kernel's lse, not ``-inf``: its out is 0 either way).
    """
    is_causal, scale = plan
    out, lse = _CPU_FLASH(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)  # lse (B, Hq, Tq) fp32
    return fold_sinks(out, lse, _scores.sink_logits(sinks, lse.dtype))


def _sinks_gradients(plan: tuple, needs: frozenset, d_out: Tensor, tensors: tuple, outputs: tuple) -> tuple:
    """The kernel's own backward given the folded out and lse (exact for the keys), and the sinks'
    gradient ``-p_sink * rowsum(dO * out)``; a row whose keys are all masked has out 0 from the
    kernel, so zero gradients (the sink takes the mass)."""
    q, k, v, sinks, attn_mask = tensors
    out, lse = outputs
    grad_q = grad_k = grad_v = grad_sinks = None
    if needs & {0, 1, 2}:
        grad_q, grad_k, grad_v = _CPU_FLASH_BACKWARD(
            d_out.contiguous(), q, k, v, out, lse, 0.0, plan[0], attn_mask=attn_mask, scale=plan[1])
    if 3 in needs:
        grad_sinks = sinks_gradient(sinks, _scores.sink_logits(sinks, lse.dtype), lse, row_delta(d_out, out, lse.dtype))
    return grad_q, grad_k, grad_v, grad_sinks, None


class _SinksThroughLse(torch.autograd.Function):
    """CPU flash attention with sinks through the kernel's row log-sum-exp: ``apply(plan, q, k,
    v, sinks, attn_mask)`` -> out, lse (:func:`_sinks_by_lse`, :func:`_sinks_gradients`).

    Written by hand, not by :func:`attnlab.backends._lse.kernel_function`: ``torch.compile``
    traces this path whole (``fullgraph=True``), and dynamo cannot resolve a Function class made
    by a factory; its ``vmap`` rule is generated from forward and backward.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(plan, q, k, v, sinks, attn_mask):
        return _sinks_by_lse(plan, q, k, v, sinks, attn_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        plan, *tensors = inputs
        ctx.save_for_backward(*tensors, *output)
        ctx.plan = plan
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, sinks, attn_mask, out, lse = ctx.saved_tensors
        needs = frozenset(i for i, need in enumerate(ctx.needs_input_grad[1:]) if need)
        return None, *_sinks_gradients(ctx.plan, needs, grad_out, (q, k, v, sinks, attn_mask), (out, lse))


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
    traceable = True
    dense_mask = True  # a materialised mask is the call's dense mask
    claim_order = 0  # the first backend auto asks (claims)
    plan_fixes_tk = False  # its plan reads no key length
    description = (
        "torch.nn.functional.scaled_dot_product_attention (CPU flash; CUDA flash, efficient, "
        "cuDNN); O(T) memory unless a mask must be materialised or the math kernel runs"
    )

    def unavailable_reason(self) -> str | None:
        if not _HAS_SDPA:
            return f"torch {torch.__version__} has no scaled_dot_product_attention (needs 2.0+)"
        return None

    def memory_use(self, call: AttentionCall, *, words: bool = False) -> MemoryUse:
        """The math kernel's scores, else a materialised mask's bytes, else the kernel's O(T)
        (the class and the words from :func:`sdpa_plan`)."""
        plan = sdpa_plan(call)
        note = plan.memory_note if words else ""
        if plan.kernel == "math":
            return MemoryUse(plan.memory, scores_bytes(call), note)
        if plan.mask_source == "materialised":
            size = torch.empty((), dtype=_materialised_dtype(call)).element_size()
            return MemoryUse(plan.memory, _mask_elements(call) * size, note)
        return memory_of_class(plan.memory, call, note)

    def cost(self, call: AttentionCall) -> float:
        """Estimated seconds: attention FLOPs at the kernel's measured rate plus call overhead."""
        plan = sdpa_plan(call)
        rates = RATES["sdpa"]
        on_cuda = call.device.type == "cuda"
        if on_cuda:
            rate = rates["cuda"].get(plan.kernel, rates["cuda"]["math"])
        elif plan.kernel == "flash":
            rate = rates["cpu_flash"]["is_causal" if plan.mask_source == "segments" else plan.mask_source]
        else:
            rate = rates["cpu_math"]
        flops = call_flops(call, causal=plan.mask_source in ("is_causal", "segments"))
        build = _mask_elements(call) * rates["mask_build_s_per_element"] if plan.mask_source == "materialised" else 0.0
        return rates["call_overhead_s"]["cuda" if on_cuda else "cpu"] + flops / rate + build

    def limits(self, call: AttentionCall) -> list[str]:
        """Score mods SDPA's float mask cannot carry exactly."""
        found = []
        mod = call.score_mod
        if mod is not None and not mod.additive:
            found.append(f"sdpa adds a score mod only as a float mask; {mod!r} is not additive "
                         "(softcap and functions change each score by its value)")
        half = call.dtype in (torch.float16, torch.bfloat16)
        if half and call.device.type != "cpu" and (mod is not None or call.sinks is not None):
            found.append(f"sdpa on {call.device.type} takes a float mask in the query dtype: the score "
                         f"mod's bias and the sinks would be rounded to {str(call.dtype).replace('torch.', '')}")
        return found

    def claims(self, call: AttentionCall) -> str | None:
        """SDPA wins whenever the mask reaches it as the caller holds it (none, top-left causal,
        a bool or float tensor, a padded batch run on each row's real keys) and PyTorch runs a
        fused kernel: no other backend can skip work there, and PyTorch's own kernel is the
        fastest on every machine measured. Mask mods and bottom-right causal, which SDPA would
        materialise, and calls its math kernel would run (on CPU: value features unlike the
        keys', as MLA and differential attention have) are left to the memory class and the
        cost model.

        Example:
            >>> from attnlab.backends import build_call
            >>> q = torch.randn(1, 2, 8, 4)
            >>> SdpaBackend().claims(build_call(q, q, q, causal=True))
            "the mask reaches it as the caller holds it: nothing to skip, PyTorch's own kernel"
            >>> SdpaBackend().claims(build_call(q, q, q, mask=torch.ones(1, 1, 1, 8, dtype=torch.bool), causal=True))
            "sdpa's rule claims padded batches"
        """
        source = _mask_source(call)
        if source == "materialised":
            return None
        # Only value features unlike the keys' or dropout can send PyTorch to its math kernel on
        # the calls left here; asking its selector for every call would cost the first call's path.
        unusual = call.v.shape[-1] != call.k.shape[-1] or call.dropout_p > 0
        if unusual and kernel_for(call) == "math":
            return None
        if source == "segments":
            return "sdpa's rule claims padded batches"
        return "the mask reaches it as the caller holds it: nothing to skip, PyTorch's own kernel"

    def prepare(self, call: AttentionCall, *, mask_fixed: bool | None = None) -> Callable[..., Tensor]:
        """``run(q, k, v, mask[, sinks[, score_mod]])`` for every call with ``call``'s signature.

        Where the mask reaches SDPA as the caller holds it (none, top-left causal, a bool or float
        tensor), without dropout, weights or a score mod, SDPA itself with every option bound
        (no Python frame of attnlab's own); otherwise the protocol's run
        (:meth:`Backend.prepare`) around :meth:`plan`'s runner, the dense mask of a mask that
        holds no tensor built once.

        Example:
            >>> from attnlab.backends import build_call
            >>> q = torch.randn(1, 2, 1, 8)
            >>> run = SdpaBackend().prepare(build_call(q, q, q))
            >>> torch.equal(run(q, q, q, None), sdpa_forward(build_call(q, q, q)))
            True
        """
        source = _mask_source(call)
        if (source == "materialised" or call.dropout_p > 0.0 or call.return_weights or _sink_key(call)
                or call.score_mod is not None):
            return super().prepare(call, mask_fixed=mask_fixed)
        return _runner(call, source)  # (sinks as a mask column need the mask rebuilt per call)

    def plan(self, call: AttentionCall) -> tuple:
        """How the mask reaches SDPA and the runner with every option bound (:func:`_runner`).

        Example:
            >>> from attnlab.backends import build_call
            >>> q = torch.randn(1, 2, 4, 8)
            >>> SdpaBackend().plan(build_call(q, q, q, causal=True))[0]
            'is_causal'
        """
        source = _mask_source(call)
        return source, _runner(call, source)

    def execute(self, call: AttentionCall, plan: tuple) -> AttentionResult:
        source, runner = plan
        with _dropout_rng(call):
            sinks = () if call.sinks is None else (call.sinks,)
            return AttentionResult(out=runner(call.q, call.k, call.v, _attn_mask(call, source), *sinks))

    def forward(self, call: AttentionCall) -> AttentionResult:
        return AttentionResult(out=sdpa_forward(call))


register(SdpaBackend())
