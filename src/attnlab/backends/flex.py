"""The ``flex`` backend: ``torch.nn.attention.flex_attention``, compiled, with block-sparse masks.

FlexAttention takes the mask as a *mask mod* and skips whole blocks that no query of a block
may attend (a ``BlockMask`` built with ``create_block_mask``). attnlab folds causal (either
alignment), bool masks and mask mods into one dense bool mask read by a single mask mod class
and a float mask into one score mod (:class:`BiasScoreMod`); GQA uses
``enable_gqa=True``. One mask mod *class* for every mask means the compiled kernel is reused:
each new mask-mod function would otherwise cost a recompilation. Block sparsity
is kept -- the block mask is computed from the dense mask. Masked calls therefore hold an
O(Tq*Tk) mask (reported by :meth:`FlexBackend.memory_for`); unmasked calls are O(T). Block
masks are cached per (mask identity, sizes, causal offset) and served again only while the
mask's contents (a mask mod's: its dense mask, evaluated afresh) are unchanged.

Declined, because the result would not be exact: on CPU, any ``Tk`` that is not a multiple of
the 128-key block (torch's compiled CPU kernel returns wrong values or NaN on some partial
blocks, e.g. ``Tk = 8, 24, 136``); empty sequences (the kernel divides by zero); and a float
mask that requires grad while gradients are on.

``flex_attention`` is compiled once with ``torch.compile``. Limits found on this
installation (torch 2.13, CPU): the compiled CPU kernel is inference only and cannot return
the log-sum-exp, so on CPU this backend declines calls that need gradients ("FlexAttention
has no backward on CPU") and returns no ``lse`` (``return_weights`` recomputes the weights).
Compilation is static (``dynamic=False``): with dynamic shapes, Inductor's CPU code for a
score/mask mod that reads a captured tensor fails to build here (``cur_kvSplitSize`` not
declared), so each new shape/dtype/masked-or-not variant compiles once. Compiling takes seconds
(the measured times are in :mod:`attnlab.backends.rates`); the cost estimate adds them until a
variant has been compiled, so ``backend="auto"`` does not pick flex for one-off shapes on CPU.
FlexAttention has no dropout, so calls with ``dropout_p > 0`` are declined. On CUDA forward and backward
run and the ``lse`` is returned.

Example:
    >>> import torch, attnlab
    >>> "flex" in attnlab.backends.available()
    True
"""

from __future__ import annotations

import math
import shutil
from collections import OrderedDict

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab._call import AttentionCall
from attnlab._math import score_dtype
from attnlab.backends.base import AttentionResult, Backend, call_flops
from attnlab.backends.rates import RATES
from attnlab.backends.registry import register

try:  # FlexAttention appeared in PyTorch 2.5
    from torch.nn.attention import flex_attention as _flex_module
except ImportError:  # pragma: no cover - depends on the installed torch
    _flex_module = None

__all__ = ["FlexBackend", "BiasScoreMod"]

_BLOCK_CACHE_SIZE = 32


class BiasScoreMod:
    """A float mask ``(B, Hq, Tq, Tk)`` added to each score (a FlexAttention score mod).

    Blocked positions hold ``-inf``; :meth:`allows` is the matching mask mod, so the block
    mask and the scores come from one tensor.

    Example:
        >>> mod = BiasScoreMod(torch.tensor([[[[-1.0, float("-inf")]]]]))
        >>> i = torch.tensor(0)
        >>> float(mod(torch.tensor(0.5), i, i, i, i)), bool(mod.allows(i, i, i, torch.tensor(1)))
        (-0.5, False)
    """

    def __init__(self, bias: Tensor):
        self.bias = bias

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.bias[b, h, q_idx, kv_idx].to(score.dtype)

    @property
    def allows(self) -> "_FiniteBias":
        """The mask mod "this score is not blocked" over the same tensor."""
        return _FiniteBias(self.bias)


class _FiniteBias(_masks.MaskMod):
    """Mask mod: True where the dense bias is finite (create_block_mask wants a plain callable)."""

    def __init__(self, bias: Tensor):
        self.bias = bias

    def __call__(self, b, h, q_idx, kv_idx):
        return self.bias[b, h, q_idx, kv_idx] > float("-inf")


def _dense_bias(call: AttentionCall) -> Tensor | None:
    """Every mask of the call (causal, bool, float, mask mod) as one additive ``(B, Hq, Tq, Tk)``.

    One score mod class and one layout for every mask means the compiled kernel is reused:
    a new mask-mod *function* would otherwise cost a recompilation.
    """
    allowed, bias = call.allowed(), call.bias()  # broadcastable to (B, Hq, Tq, Tk)
    if allowed is None and bias is None:
        return None
    shape = (call.batch, call.q_heads, call.tq, call.tk)
    # fp32 for half inputs: a bias such as ALiBi's -130 + slope * distance loses its low bits in bf16.
    dense = torch.zeros(shape, dtype=score_dtype(call.dtype), device=call.device)
    if bias is not None:
        dense += bias.to(dense.dtype)
    if allowed is not None:
        dense.masked_fill_(~allowed, float("-inf"))
    return dense  # (B, Hq, Tq, Tk), contiguous: torch.compile guards on strides


class _BlockMaskCache:
    """(score mod, block mask) pairs, served again only while the mask's contents are unchanged.

    An entry is found by the mask's identity and the sizes, then confirmed by content: a tensor
    mask is compared with a copy taken when the entry was made, a mask mod by its freshly
    materialised dense mask. Identity and ``_version`` are not enough: a mask mod reads state the
    cache cannot see (a ``PaddingMod``'s ``lengths`` edited in place, a variable a lambda
    captured), and a tensor written through ``.data`` or numpy keeps its ``_version``.
    """

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    @staticmethod
    def owner(call: AttentionCall):
        """The user's object behind the call's mask (the call holds a reshaped view of it)."""
        mask = call.mask
        return mask._base if isinstance(mask, Tensor) and mask._base is not None else mask

    @staticmethod
    def key(call: AttentionCall) -> tuple | None:
        if call.mask_kind == "none" and not call.causal:
            return None
        shape = tuple(call.mask.shape) if isinstance(call.mask, Tensor) else None
        offset = call.causal_offset if call.causal else None
        return (id(_BlockMaskCache.owner(call)), call.mask_kind, shape, offset, call.batch,
                call.q_heads, call.tq, call.tk, call.dtype, str(call.device))

    @staticmethod
    def contents(call: AttentionCall) -> Tensor | None:
        """What the block mask was computed from: the tensor mask, or the mod's dense mask."""
        if call.mask_kind == "mod":
            return call.allowed()  # memoised on the call: a miss builds the bias from it
        return call.mask if isinstance(call.mask, Tensor) else None

    def get(self, call: AttentionCall):
        key = self.key(call)
        entry = None if key is None else self.entries.get(key)
        if entry is None:
            return None
        seen, mods = entry
        if not _same_contents(seen, self.contents(call)):
            return None
        self.entries.move_to_end(key)
        return mods

    def put(self, call: AttentionCall, mods) -> None:
        contents = self.contents(call)
        seen = None if contents is None else contents.detach().clone()
        self.entries[self.key(call)] = (seen, mods)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


def _same_contents(seen: Tensor | None, now: Tensor | None) -> bool:
    """Equal shapes and values (NaN never equals, so a NaN mask is never reused)."""
    if seen is None or now is None:
        return seen is None and now is None
    return seen.shape == now.shape and bool(torch.equal(seen, now))


def _shape_limits(call: AttentionCall) -> list[str]:
    """Sequence lengths the compiled kernel is not exact on (see ``_KV_BLOCK``)."""
    if call.tq == 0 or call.tk == 0:  # the CPU kernel divides by the block count: SIGFPE
        return [f"flex cannot run an empty sequence (Tq={call.tq}, Tk={call.tk})"]
    if call.device.type == "cpu" and call.tk % _KV_BLOCK != 0:
        return [f"flex on CPU is exact only when Tk is a multiple of its {_KV_BLOCK}-key block "
                f"(Tk={call.tk}): torch's compiled CPU kernel is wrong on some partial blocks"]
    return []


def _mask_limits(call: AttentionCall) -> list[str]:
    """A mask that needs a gradient: the kernel takes the bias as a constant."""
    mask = call.mask
    if isinstance(mask, Tensor) and mask.requires_grad and torch.is_grad_enabled():
        return ["flex cannot differentiate a float mask that requires grad (e.g. a learnable bias)"]
    return []


def _prescaled_q(call: AttentionCall) -> Tensor:
    """q such that FlexAttention's default scale 1/sqrt(D) gives ``call.scale``.

    torch.compile guards on a float ``scale`` argument, so passing each user scale would
    recompile per value; the default scale is passed as None and a custom one folded into q
    (one extra rounding of q in its dtype).
    """
    factor = call.scale * math.sqrt(call.head_dim)
    return call.q if abs(factor - 1.0) < 1e-12 else call.q * factor


# torch.compile's CPU code generation needs a C++ compiler; looked up once, at import, so that
# neither dispatch nor a torch.compile'd caller ever traces the lookup.
_HAS_CPP_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None

# Dynamo compiles at most `recompile_limit` (default 8) variants of one function per process and
# then silently runs flex_attention unfused, materialising the O(T^2) scores. The kernel call
# raises that limit for flex alone, and the backend declines a new variant past this bound.
_MAX_VARIANTS = 64

# FlexAttention's block: the block mask and the CPU kernel work on 128-key blocks. Measured on
# this installation (torch 2.13, AVX2 CPU), the compiled CPU kernel returns wrong values or NaN,
# nondeterministically, whenever the last key block is partial with a length of 8 mod 16 (Tk = 8,
# 24, 40, 72, 88, 104, 120, 136; D = 8 or 16), whatever the mask and Tq; a partial block holds
# a vector tail, and its failing length depends on the vector width, so only full blocks are
# trusted on CPU (Tk = 128, 256, ... were exact in every trial).
_KV_BLOCK = 128


class FlexBackend(Backend):
    """FlexAttention, compiled once; block-sparse masks cached per mask; CPU forward only.

    Example:
        >>> import attnlab
        >>> q = torch.randn(1, 2, 128, 16)  # on CPU Tk must be a multiple of 128
        >>> with torch.no_grad():
        ...     out = attnlab.attention(q, q, q, causal=True, backend="flex")
        >>> torch.allclose(out, attnlab.attention(q, q, q, causal=True, backend="reference"), atol=1e-5)
        True
    """

    name = "flex"
    memory = "linear"
    devices = ("cpu", "cuda")
    dtypes = {"cpu": (torch.float32, torch.bfloat16, torch.float16)}
    dropout = False
    backward_devices = ("cuda",)  # torch.compile's CPU flex kernel is inference only
    non_finite_inputs = False  # the compiled kernel hides NaN rows and lets masked keys' NaN through
    description = (
        "torch.nn.attention.flex_attention compiled with torch.compile; block-sparse masks "
        "(cached); CPU: forward only, no lse; no dropout"
    )

    def __init__(self):
        self._compiled = None
        self._compile_error: dict[str, str] = {}
        self._variants: set[tuple] = set()
        self._block_masks = _BlockMaskCache(_BLOCK_CACHE_SIZE)

    def unavailable_reason(self) -> str | None:
        if _flex_module is None:
            return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs 2.5+)"
        return None

    def limits(self, call: AttentionCall) -> list[str]:
        """Compiler, variant budget and earlier compile failures (capabilities cover the rest)."""
        found = []
        device = call.device.type
        if device == "cpu" and not _HAS_CPP_COMPILER:
            found.append("torch.compile on CPU needs a C++ compiler and none was found")
        if self._variant(call) not in self._variants and len(self._variants) >= _MAX_VARIANTS:
            found.append(f"{_MAX_VARIANTS} shapes are compiled in this process already; another would "
                         "run FlexAttention unfused with O(T^2) memory")
        if device in self._compile_error:
            found.append(f"torch.compile(flex_attention) failed here: {self._compile_error[device]}")
        return found + _shape_limits(call) + _mask_limits(call)

    def memory_for(self, call: AttentionCall) -> str:
        """O(T^2) for any masked call (the mask is held densely for the kernel), else O(T).

        Deliberately independent of the block-mask cache, so that dispatch does not change
        between two identical calls.
        """
        return "linear" if call.mask_kind == "none" and not call.causal else "quadratic"

    def memory_note(self, call: AttentionCall) -> str:
        if self.memory_for(call) == "quadratic":
            return "the mask is held as a dense (B, H, Tq, Tk) tensor for the block mask / score mod"
        return "fused kernel, O(T) memory"

    def _variant(self, call: AttentionCall) -> tuple:
        """What the compiled kernel is specialised on (static shapes, see the module doc)."""
        masked = call.mask_kind != "none" or call.causal
        return (call.device.type, call.dtype, masked, tuple(call.q.shape), tuple(call.k.shape),
                tuple(call.v.shape))

    def compiled(self, call: AttentionCall) -> bool:
        """Whether the kernel variant ``call`` needs is compiled in this process already.

        Example:
            >>> from attnlab.backends import get, build_call
            >>> q = torch.randn(1, 1, 3, 5)  # a shape nothing compiles
            >>> get("flex").compiled(build_call(q, q, q))
            False
        """
        return self._variant(call) in self._variants

    def cost(self, call: AttentionCall) -> float:
        """Estimated seconds: FLOPs at the kernel's rate, plus compilation while not yet compiled."""
        rates = RATES["flex"]
        seconds = rates["call_overhead_s"] + call_flops(call) / rates[call.device.type]
        if self._variant(call) not in self._variants:
            seconds += rates["compile_variant_s" if self._compiled is not None else "compile_first_s"]
        return seconds

    def _kernel(self):
        if self._compiled is None:
            self._compiled = torch.compile(_flex_module.flex_attention, dynamic=False)
        return self._compiled

    def _mods(self, call: AttentionCall):
        """(score_mod, block_mask) for the call; both None when nothing is masked."""
        cached = self._block_masks.get(call)
        if cached is not None:
            return cached
        bias = _dense_bias(call)
        if bias is None:
            return None, None
        score_mod = BiasScoreMod(bias)
        block_mask = _flex_module.create_block_mask(
            score_mod.allows, call.batch, call.q_heads, call.tq, call.tk, device=call.device,
            BLOCK_SIZE=_KV_BLOCK,
        )
        self._block_masks.put(call, (score_mod, block_mask))
        return score_mod, block_mask

    def forward(self, call: AttentionCall) -> AttentionResult:
        score_mod, block_mask = self._mods(call)
        want_lse = call.device.type == "cuda"
        try:
            with torch._dynamo.config.patch(recompile_limit=_MAX_VARIANTS):
                result = self._kernel()(
                    _prescaled_q(call), call.k, call.v, score_mod=score_mod, block_mask=block_mask,
                    scale=None, enable_gqa=call.q_heads != call.kv_heads, return_lse=want_lse,
                )
        except Exception as error:  # compile failures surface here; decline from now on
            if "Inductor" in type(error).__name__ or "Backend" in type(error).__name__:
                self._compile_error[call.device.type] = str(error).splitlines()[0][:200]
            raise
        self._variants.add(self._variant(call))
        out, lse = result if want_lse else (result, None)  # lse: natural log, -inf on dead rows
        return AttentionResult(out=out, lse=lse)


register(FlexBackend())
