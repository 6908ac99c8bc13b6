"""The ``flex`` backend: ``torch.nn.attention.flex_attention``, compiled, with block-sparse masks.

The call's mask reaches the kernel by one of two paths (:func:`_mask_path`, from ``call.mask_kind``):

* ``"rows"``, O(T) memory: causal, attnlab's own mask mods and ANDs of them, and a
  :class:`~attnlab.masks.PreparedMask` go in as a prepared mask (one key interval per query row,
  :func:`attnlab.masks.prepare`). The ``BlockMask`` is built from it one 128-query block at a
  time, never as a dense ``(Tq, Tk)`` mask, and kept on the prepared mask (``PreparedMask.memo``).
  A prepared mask holds tensors only, so every such mask of one shape shares one compilation.
* ``"dense"``, O(Tq*Tk) memory: tensor masks, ORs of mods and a user's own mask mods are folded
  into one additive ``(B, Hq, Tq, Tk)`` bias read by one score mod class (:class:`BiasScoreMod`),
  so the compiled kernel is reused.

Score mods are FlexAttention's own ``score_mod`` (:class:`ScoreThenBias`), so a window with ALiBi
still skips whole blocks. Declined: sinks and dropout (the kernel has neither), gradients on CPU
(no backward there), a score mod whose tensors need a gradient or are float64, a user's function
in fp16/bf16 on CPU, on CPU a ``Tk`` that is not a multiple of the 128-key block, empty sequences,
and a float mask that requires grad. A user's function Inductor cannot lower raises ``ValueError``
and is declined from then on, until :func:`attnlab.backends.dispatch.clear_plans`.

Each shape, dtype, mask path and score-mod signature compiles once (``dynamic=False``), at most
``_RECOMPILE_LIMIT`` variants; until then the cost estimate adds the compile time. Set the thread
count before the first flex call: Inductor's CPU code keeps the count it was compiled under.

Example:
    >>> import torch, attnlab
    >>> "flex" in attnlab.backends.available()
    True
"""

from __future__ import annotations

import math
import shutil
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import masks as _masks
from attnlab import scores as _scores
from attnlab._call import AttentionCall
from attnlab._math import keep_nan_rows, score_dtype
from attnlab.backends.base import AttentionResult, Backend, MemoryUse, call_flops, memory_of_class
from attnlab.backends.blocks import block_spans
from attnlab.backends.rates import RATES
from attnlab.backends.registry import register

try:  # FlexAttention appeared in PyTorch 2.5
    from torch.nn.attention import flex_attention as _flex_module
except ImportError:  # pragma: no cover - depends on the installed torch
    _flex_module = None

__all__ = ["FlexBackend", "BiasScoreMod", "ScoreThenBias"]


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


class ScoreThenBias:
    """A FlexAttention score mod: attnlab's score mod, then a dense mask's bias (either may be None).

    attnlab adds a float mask after the score mod (as the tiled backend does), so a softcap caps
    the scores and the mask's ``-inf`` still blocks. No dtype conversion is written here: the
    kernel's scores are float32, which every mod flex is handed returns.

    Example:
        >>> from attnlab import scores
        >>> mod = ScoreThenBias(scores.softcap(1.0), torch.tensor([[[[0.5, float("-inf")]]]]))
        >>> i = torch.tensor(0)
        >>> round(float(mod(torch.tensor(100.0), i, i, i, i)), 4), float(mod(torch.tensor(0.0), i, i, i, i + 1))
        (1.5, -inf)
    """

    def __init__(self, score_mod, bias: Tensor | None):
        self.score_mod, self.bias = score_mod, bias

    def __call__(self, score, b, h, q_idx, kv_idx):
        if self.score_mod is not None:
            score = self.score_mod(score, b, h, q_idx, kv_idx)
        if self.bias is not None:
            score = score + self.bias[b, h, q_idx, kv_idx]
        return score


def _direct_mod(call: AttentionCall):
    """The call's mask as a mod flex takes directly (causal folded in), or None: no mask, a
    tensor mask, or a mod of the user's own (those go through the dense bias, see the module doc)."""
    if call.mask_kind not in ("causal", "mod", "prepared"):
        return None
    mod = call.mask_mod()
    return mod if _masks.has_row_ranges(mod) else None


def _mask_path(call: AttentionCall) -> str | None:
    """How the call's mask reaches the kernel: ``"rows"`` (a direct mod, as a prepared mask,
    O(T)), ``"dense"`` (:class:`BiasScoreMod`, O(Tq*Tk)) or None (nothing is masked)."""
    if _direct_mod(call) is not None:
        return "rows"
    return None if call.mask_kind == "none" else "dense"


def _block_mask_of(prepared: _masks.PreparedMask, call: AttentionCall):
    """FlexAttention's ``BlockMask`` for a prepared mask with the call's batch rows, evaluated
    one 128-query block at a time.

    Only the key blocks the mask's bounds reach are evaluated: O(B * 128 * Tk) memory at most,
    never a dense ``(Tq, Tk)`` mask as torch's eager ``create_block_mask`` builds. Positions past
    ``Tq`` or ``Tk`` count as masked, as in ``create_block_mask``,
    so a block holding them is partial, never full.
    """
    size, device, kernel_mod = _KV_BLOCK, call.device, prepared
    n_q, n_k = -(-call.tq // size), -(-call.tk // size)
    partial = torch.zeros(call.batch, 1, n_q, n_k, dtype=torch.bool, device=device)  # (B, 1, nq, nk)
    full = torch.zeros_like(partial)
    for block, (qs, qe, lo, hi) in enumerate(block_spans(prepared, call.tq, call.tk, size)):
        first, last = lo // size, -(-hi // size)  # key blocks [first, last)
        if last <= first:
            continue
        allowed = _masks.evaluate(kernel_mod, q_range=(qs, qe),
                                  kv_range=(first * size, min(call.tk, last * size)),
                                  batch=call.batch, device=device)
        allowed = allowed.expand(call.batch, 1, qe - qs, -1)
        allowed = F.pad(allowed, (0, (last - first) * size - allowed.shape[-1], 0, size - allowed.shape[-2]))
        tiles = allowed.reshape(call.batch, 1, size, last - first, size)  # (B, 1, q, key block, k)
        seen, every = tiles.any(dim=4).any(dim=2), tiles.all(dim=4).all(dim=2)  # (B, 1, key block)
        partial[:, :, block, first:last] = seen & ~every
        full[:, :, block, first:last] = every
    return _flex_module.BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=size, mask_mod=kernel_mod,
        seq_lengths=(call.tq, call.tk),
    )


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(count, indices) per query block of a ``(B, H, nq, nk)`` bool block matrix: the
    ``BlockMask`` layout (the blocks present first, in ascending order), int32."""
    as_int = blocks.to(torch.int32)
    indices = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


def _dense_bias(call: AttentionCall) -> Tensor | None:
    """Every mask of the call (causal, bool, float, mask mod) as one additive ``(B, Hq, Tq, Tk)``.

    For tensor masks and the user's own mask mods (see :func:`_direct_mod`). One score mod class
    and one layout for all of them means the compiled kernel is reused: a new mask-mod
    *function* would otherwise cost a recompilation.
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


def _shape_limits(call: AttentionCall) -> list[str]:
    """Sequence lengths the compiled kernel is not exact on (see ``_KV_BLOCK``)."""
    if call.tq == 0 or call.tk == 0:  # the CPU kernel divides by the block count: SIGFPE
        return [f"flex cannot run an empty sequence (Tq={call.tq}, Tk={call.tk})"]
    if call.device.type == "cpu" and call.tk % _KV_BLOCK != 0:
        return [f"flex on CPU is exact only when Tk is a multiple of its {_KV_BLOCK}-key block "
                f"(Tk={call.tk}): torch's compiled CPU kernel is wrong on some partial blocks"]
    return []


def _symbolic(call: AttentionCall) -> bool:
    """Whether a size of q, k or v is symbolic: being traced with a length unknown until run time."""
    return any(isinstance(size, torch.SymInt) for t in (call.q, call.k, call.v) for size in t.shape)


def _mask_limits(call: AttentionCall) -> list[str]:
    """A mask that needs a gradient: the kernel takes the bias as a constant."""
    if call.mask_kind == "float" and call.mask.requires_grad and torch.is_grad_enabled():
        return ["flex cannot differentiate a float mask that requires grad (e.g. a learnable bias)"]
    return []


def _score_limits(call: AttentionCall) -> list[str]:
    """Sinks, and score mods whose tensors flex would not handle exactly."""
    found = []
    if call.sinks is not None:
        found.append("flex does not apply sinks: its compiled CPU kernel returns no log-sum-exp to fold "
                     "them in (sdpa, blocks and chunked serve sinks)")
    params = call.score_mod.params() if call.score_mod is not None else ()
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        found.append("flex takes the score mod's tensors as constants: it cannot differentiate them "
                     "(chunked and blocks can)")
    if any(p.dtype == torch.float64 for p in params):
        found.append("flex computes scores in float32: the score mod's float64 tensors would be rounded")
    half = call.dtype in (torch.float16, torch.bfloat16)
    if half and call.device.type == "cpu" and call.score_mod is not None and call.score_mod.user_function:
        found.append("torch's compiled CPU flex kernel miscomputes some score-mod functions in half precision "
                     "(`(score + t[h]).to(score.dtype)` was off by 3.6 in bf16): a function of your own is "
                     "left to chunked there; attnlab's structured mods are served")
    return found



def _prescaled_q(call: AttentionCall) -> Tensor:
    """q such that FlexAttention's default scale 1/sqrt(D) gives ``call.scale``.

    torch.compile guards on a float ``scale`` argument, so passing each user scale would
    recompile per value; the default scale is passed as None and a custom one folded into q
    (one extra rounding of q in its dtype).
    """
    factor = call.scale * math.sqrt(call.head_dim)
    return call.q if abs(factor - 1.0) < 1e-12 else call.q * factor


def _standard_strides(t: Tensor) -> Tensor:
    """``t`` itself if its strides are those of a fresh contiguous tensor of its shape, else a
    contiguous copy (size-1 dims included: ``is_contiguous`` ignores their strides, Dynamo does not).

    Example:
        >>> t = torch.zeros(2, 5, 1, 4).transpose(1, 2)  # (2, 1, 5, 4), strides (20, 4, 4, 1)
        >>> t.is_contiguous(), _standard_strides(t).stride()
        (True, (20, 20, 4, 1))
    """
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= max(size, 1)
    return t if tuple(reversed(expected)) == t.stride() else t.clone(memory_format=torch.contiguous_format)


# torch.compile's CPU code generation needs a C++ compiler; looked up once, at import, so that
# neither dispatch nor a torch.compile'd caller ever traces the lookup.
_HAS_CPP_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None

# Past Dynamo's recompile limit flex_attention would run unfused (O(T^2)): the kernel call raises
# the limit for flex alone, and past it flex drops its own compiled variants and compiles anew.
_RECOMPILE_LIMIT = 64

# FlexAttention's 128-key block. On CPU only full key blocks are trusted: the compiled kernel
# returned wrong values on some partial last blocks, depending on the ISA Inductor builds for.
_KV_BLOCK = 128


def _memory_words(call: AttentionCall, path: str | None) -> str:
    """Why a call has its memory class on flex, in words."""
    if path == "rows":
        return "fused kernel, block mask built from the mask mod, O(T) memory"
    if path is None:
        return "fused kernel, O(T) memory"
    if call.mask_kind == "mod":
        return ("this mask mod is held as a dense (B, H, Tq, Tk) bias: flex takes attnlab's mods "
                "and ANDs of them directly, not ORs or mods of the user's own")
    return "the mask is held as a dense (B, H, Tq, Tk) tensor for the block mask / score mod"


def _weak_key(key):
    """``key`` (a score mod's signature) with each object it keeps alive by identity (a user's
    function) held by a weak reference instead, so flex's bookkeeping keeps no user tensor alive.

    Example:
        >>> fn = lambda s, b, h, i, j: s
        >>> key = _weak_key(_scores.function(fn).signature())
        >>> key == _weak_key(_scores.function(fn).signature()), key[1]() is fn
        (True, True)
    """
    if isinstance(key, tuple):
        return tuple(_weak_key(part) for part in key)
    if isinstance(key, _scores._Identity):
        try:
            return weakref.ref(key.obj)
        except TypeError:  # not weakly referable (a builtin): it holds no tensor of the user's
            return key
    return key


def _drop_compiled() -> None:
    """Drop every compiled variant of ``flex_attention`` (its code object's Dynamo cache only;
    ``torch._dynamo.reset()``, which drops every compiled function, where torch lacks that)."""
    reset_code = getattr(torch._dynamo.eval_frame, "reset_code", None)
    if reset_code is None:  # pragma: no cover - depends on the installed torch
        torch._dynamo.reset()
    else:
        reset_code(_flex_module.flex_attention.__code__)


class FlexBackend(Backend):
    """FlexAttention, compiled per variant; block masks from prepared masks (O(T), kept on the
    prepared mask) or a dense bias; CPU forward only.

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
    plans_masks = True  # reads a PreparedMask: dispatch prepares tensor-free mods once per route
    description = (
        "torch.nn.attention.flex_attention compiled with torch.compile; block-sparse masks "
        "(from prepared masks); score mods as its score_mod (no sinks); CPU: forward only, no lse; no dropout"
    )

    def __init__(self):
        self._compiled = None
        # Bookkeeping, at most _RECOMPILE_LIMIT entries each, keys without tensors (_weak_key),
        # forgotten by reset(): compile failures by device type, a user's score mod Inductor
        # could not lower by signature, and the variants compiled (for the cost estimate).
        self._compile_error: dict[str, str] = {}
        self._mod_errors: dict[tuple, str] = {}
        self._variants: set[tuple] = set()

    def unavailable_reason(self) -> str | None:
        if _flex_module is None:
            return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs 2.5+)"
        return None

    def limits(self, call: AttentionCall) -> list[str]:
        """Compiler and earlier compile failures (capabilities cover the rest)."""
        if _symbolic(call):  # before anything below compares or hashes a size
            return ["flex compiles its kernel per static shape (and on CPU needs Tk known to be a multiple "
                    f"of {_KV_BLOCK}); these sizes are symbolic (torch.export with a Dim, or torch.compile "
                    "with dynamic shapes)"]
        found = []
        device = call.device.type
        if device == "cpu" and not _HAS_CPP_COMPILER:
            found.append("torch.compile on CPU needs a C++ compiler and none was found")
        if device in self._compile_error:
            found.append(f"torch.compile(flex_attention) failed here: {self._compile_error[device]}")
        failed = None if call.score_mod is None else self._mod_errors.get(_weak_key(call.score_mod.signature()))
        if failed is not None:
            found.append(failed)
        return found + _shape_limits(call) + _mask_limits(call) + _score_limits(call)

    def memory_use(self, call: AttentionCall, *, words: bool = False) -> MemoryUse:
        """O(T) unmasked, causal or with one of attnlab's mask mods (the block mask is built from
        the mod); O(T^2) for a tensor mask or a user's own mod (held densely for the kernel).

        Deliberately independent of the block-mask cache, so that dispatch does not change
        between two identical calls.
        """
        path = _mask_path(call)
        return memory_of_class("quadratic" if path == "dense" else "linear", call,
                               _memory_words(call, path) if words else "")

    def _variant(self, call: AttentionCall) -> tuple:
        """What the compiled kernel is specialised on (static shapes, see the module doc): the
        mask path (:func:`_mask_path`), the score mod's signature (its kind and settings) and
        whether gradients are needed (the grad mode the kernel runs under)."""
        mod = None if call.score_mod is None else _weak_key(call.score_mod.signature())
        return (call.device.type, call.dtype, _mask_path(call), tuple(call.q.shape), tuple(call.k.shape),
                tuple(call.v.shape), mod, call.requires_grad)

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

    @property
    def compiled_variants(self) -> int:
        """How many kernel variants flex has compiled and holds (at most ``_RECOMPILE_LIMIT``, 64).

        Example:
            >>> from attnlab.backends import get
            >>> get("flex").compiled_variants >= 0
            True
        """
        return len(self._variants)

    def reset(self) -> None:
        """Forget the compile failures seen and the variants counted (what
        :func:`attnlab.backends.dispatch.clear_plans` clears); compiled kernels stay.

        Example:
            >>> from attnlab.backends import get
            >>> get("flex").reset()
        """
        self._variants.clear()
        self._compile_error.clear()
        self._mod_errors.clear()

    def reset_compiled(self) -> None:
        """:meth:`reset`, and drop every compiled flex kernel (flex_attention's compiled code
        only: other functions the process compiled are kept).

        Example:
            >>> from attnlab.backends import get
            >>> get("flex").reset_compiled()
        """
        self.reset()
        _drop_compiled()

    def _mod_failed(self, mod, error: str) -> str:
        """Remember that Inductor could not lower ``mod`` (a user's function: code attnlab has
        not verified), so that flex declines that mod alone from now on; the reason, as the
        ``ValueError`` of a declined call words it."""
        reason = (f"torch.compile could not lower the score mod {mod!r} into flex's kernel ({error}); "
                  "chunked and the reference evaluate it eagerly")
        if len(self._mod_errors) >= _RECOMPILE_LIMIT:  # bounded: the oldest is forgotten
            del self._mod_errors[next(iter(self._mod_errors))]
        self._mod_errors[_weak_key(mod.signature())] = reason
        return f"backend 'flex' cannot serve this call: {reason}"

    def _run_kernel(self, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, options: dict):
        """The compiled kernel on the call, under flex's recompile limit and the call's grad mode."""
        # Past the limit Dynamo would run the kernel unfused: an error is better than that.
        fail = {"fail_on_recompile_limit_hit": True} if hasattr(
            torch._dynamo.config, "fail_on_recompile_limit_hit") else {}
        # Grad mode as the call needs it: Dynamo guards on it, so a forward-only call made
        # with grad enabled would otherwise compile a second kernel for the same variant.
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, **fail), \
                torch.set_grad_enabled(call.requires_grad):
            return self._kernel()(q, k, v, **options)

    def _kernel(self):
        if self._compiled is None:
            self._compiled = torch.compile(_flex_module.flex_attention, dynamic=False)
        return self._compiled

    def _mods(self, call: AttentionCall):
        """(score_mod, block_mask) for the call; each None when not needed. A direct mod's
        block mask is kept on its prepared mask; a dense one is built per call. The call's own
        score mod runs first, then a dense mask's bias (:class:`ScoreThenBias`)."""
        mod = _direct_mod(call)
        if mod is not None:
            prepared = _masks.prepare(mod, tq=call.tq, tk=call.tk, batch=call.batch, device=call.device)
            rows = prepared.rows(call.batch)  # the kernel indexes the mask's tensors by b
            block_mask = prepared.remember(("flex", call.batch, call.device), lambda: _block_mask_of(rows, call))
            return self._score_mod(call, None), block_mask
        bias = _dense_bias(call)
        if bias is None:
            return self._score_mod(call, None), None
        allows = BiasScoreMod(bias).allows
        return self._score_mod(call, bias), _flex_module.create_block_mask(
            allows, call.batch, call.q_heads, call.tq, call.tk, device=call.device, BLOCK_SIZE=_KV_BLOCK,
        )

    @staticmethod
    def _score_mod(call: AttentionCall, bias: Tensor | None):
        """The kernel's score mod: None, the dense bias alone (one class for every mask, so the
        compiled kernel is shared), or the call's score mod then the bias (its tensors detached
        when the call needs no gradient, as q, k and v are)."""
        if call.score_mod is None:
            return None if bias is None else BiasScoreMod(bias)
        mod = call.score_mod
        if not call.requires_grad and any(p.requires_grad for p in mod.params()):
            mod = mod.with_params([p.detach() for p in mod.params()])
        return ScoreThenBias(mod, bias)

    def forward(self, call: AttentionCall) -> AttentionResult:
        score_mod, block_mask = self._mods(call)
        want_lse = call.device.type == "cuda"
        # Standard strides: the kernel is compiled with static shapes, so Dynamo guards on every
        # stride and would compile again for each layout (a transposed, sliced or expanded k);
        # past recompile_limit it silently runs flex_attention unfused, in the inputs' dtype.
        q, k, v = (_standard_strides(t) for t in (_prescaled_q(call), call.k, call.v))
        if not call.requires_grad:  # e.g. under no_grad: the compiled CPU kernel refuses inputs
            q, k, v = q.detach(), k.detach(), v.detach()  # that require grad, even with no graph
        options = dict(score_mod=score_mod, block_mask=block_mask, scale=None,
                       enable_gqa=call.q_heads != call.kv_heads, return_lse=want_lse)
        try:
            try:
                result = self._run_kernel(call, q, k, v, options)
            except Exception as error:
                if "RecompileLimit" not in type(error).__name__:
                    raise
                self._variants.clear()  # flex's variants fill Dynamo's limit: compile this one afresh
                _drop_compiled()
                result = self._run_kernel(call, q, k, v, options)
        except Exception as error:  # compile failures surface here; decline from now on
            if not any(word in type(error).__name__ for word in ("Inductor", "Backend", "RecompileLimit")):
                raise
            first = (str(error).strip().splitlines() or [""])[0][:200]
            if call.score_mod is not None and call.score_mod.user_function:
                raise ValueError(self._mod_failed(call.score_mod, f"{type(error).__name__}: {first}")) from error
            self._compile_error[call.device.type] = first
            raise
        if len(self._variants) >= _RECOMPILE_LIMIT:
            self._variants.clear()
        self._variants.add(self._variant(call))
        out, lse = result if want_lse else (result, None)  # lse: natural log, -inf on dead rows
        return AttentionResult(out=keep_nan_rows(call.q, out), lse=lse)  # the kernel hides NaN rows


register(FlexBackend())
