"""The backend protocol: what a backend declares, and the refusal reasons derived from it.

A backend states its capabilities as class attributes (devices, dtypes, dropout, where its
backward runs, its memory class); :meth:`Backend.not_supported_reasons` turns them into
reasons in words and adds whatever :meth:`Backend.limits` says about one call. A backend
plans a call's signature once (:meth:`Backend.plan`) and runs its kernel on it
(:meth:`Backend.execute`); :meth:`Backend.prepare` binds the two into the run a route or a
held plan calls. Dispatch (:mod:`attnlab.backends.dispatch`) reads this interface only: what a
backend claims (:meth:`Backend.claims`, ``claim_order``), its memory (:meth:`Backend.memory_use`)
and cost; it names no backend.

Example:
    >>> import torch
    >>> from attnlab._call import build_call
    >>> class CpuOnly(Backend):
    ...     name, devices, dropout = "cpu-only", ("cpu",), False
    >>> q = torch.randn(1, 1, 3, 4)
    >>> CpuOnly().not_supported_reasons(build_call(q, q, q, dropout_p=0.1))
    ['cpu-only has no dropout (dropout_p > 0)']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab import masks as _masks
from attnlab import scores as _scores
from attnlab._call import AttentionCall, bind_call, call_template
from attnlab._flops import attention_flops
from attnlab._math import masked_scores, repeat_kv, softmax_rows

__all__ = ["AttentionResult", "Backend", "call_flops", "MEMORY_CLASSES", "io_bytes", "scores_bytes",
           "weights_of", "mask_is_fixed", "MemoryUse", "memory_of_class"]

MEMORY_CLASSES = ("linear", "quadratic")  # extra memory in the sequence length: O(T), O(T^2)


@dataclass
class AttentionResult:
    """What a backend returns.

    Attributes:
        out: ``(B, Hq, Tq, Dv)`` context vectors.
        lse: optional ``(B, Hq, Tq)`` log-sum-exp of the scaled, masked scores (``-inf`` for
            fully masked rows), for merging partial results (ring attention).
        weights: optional ``(B, Hq, Tq, Tk)`` attention weights (before dropout).

    Example:
        >>> AttentionResult(out=torch.zeros(1, 1, 2, 4)).lse is None
        True
    """

    out: Tensor
    lse: Tensor | None = None
    weights: Tensor | None = None


class MemoryUse(NamedTuple):
    """What :meth:`Backend.memory_use` answers: the memory class, estimated bytes, and why.

    Example:
        >>> MemoryUse("linear", 1024).kind, MemoryUse("linear", 1024).note
        ('linear', '')
    """

    kind: str
    nbytes: int
    note: str = ""


def memory_of_class(kind: str, call: AttentionCall, note: str = "") -> MemoryUse:
    """The bytes a backend of memory class ``kind`` needs for ``call``: a row max and sum (or
    lse) in fp32 per query row for ``"linear"``, two score matrices for ``"quadratic"``.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> memory_of_class("linear", build_call(q, q, q)).nbytes
        24
    """
    nbytes = 8 * call.batch * call.q_heads * call.tq if kind == "linear" else scores_bytes(call)
    return MemoryUse(kind, nbytes, note)


class Backend:
    """One way of computing attention under attnlab's single contract.

    Subclasses set ``name`` and ``description``, declare their capabilities, and implement
    :meth:`forward` and :meth:`cost`. Where a capability depends on more than these attributes,
    :meth:`limits` adds reasons for one call and :meth:`unavailable_reason` says why the backend
    cannot run in this installation at all.

    Attributes:
        name: registry key, as passed to ``attnlab.attention(..., backend=name)``.
        description: one line for ``attnlab backends``.
        memory: ``"linear"`` or ``"quadratic"`` extra memory in T, unless :meth:`memory_use`
            refines it per call.
        devices: device types it runs on (``None``: any).
        dtypes: per device type, the dtypes it supports (a device not listed: every float dtype).
        dropout: whether it implements ``dropout_p > 0``.
        backward_devices: device types where its output can be differentiated (``None``: any).
        traceable: whether its forward reads no tensor values, so that it runs inside
            ``torch.compile(fullgraph=True)``, ``torch.func`` transforms and ``torch.export``;
            one that is not declines calls made while compiling.
        plans_masks: whether its forward derives a plan from the mask (blocks' runs, flex's
            block mask) that it keeps on a :class:`~attnlab.masks.PreparedMask`: dispatch then
            prepares a mask mod that holds no tensor (and ``causal``) once per route, and later
            calls of that signature pass the prepared mask instead.
        passes_over: whether auto may pass it over for a call it computes exactly
            (:meth:`passed_over` says why); a caller who names it is served all the same.
        dense_mask: whether it reads the call's dense mask (:meth:`AttentionCall.allowed`):
            a prepared run builds it once where the mask holds no tensor.
        claim_order: where auto asks this backend's :meth:`claims` (lowest first), or None:
            it claims nothing and competes on memory and cost. Dispatch names no backend.
        plan_fixes_tk: whether :meth:`plan` depends on the key length ``Tk`` for a call with
            no mask or a tensor mask. A decoding step (one query) is remembered per class of
            cache lengths; where this is True its run serves only the ``Tk`` it was made for.

    Example:
        >>> class Zeros(Backend):
        ...     name, memory = "zeros", "linear"
        ...     def forward(self, call):
        ...         return AttentionResult(out=call.q.new_zeros(*call.q.shape[:3], call.value_dim))
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> Zeros().forward(build_call(q, q, q)).out.shape
        torch.Size([1, 1, 3, 4])
    """

    name: str = ""
    description: str = ""
    memory: str = "quadratic"
    devices: tuple[str, ...] | None = None
    dtypes: dict[str, tuple[torch.dtype, ...]] = {}
    dropout: bool = True
    backward_devices: tuple[str, ...] | None = None
    traceable: bool = False
    plans_masks: bool = False
    passes_over: bool = False
    dense_mask: bool = False
    plan_fixes_tk: bool = True
    claim_order: int | None = None

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run in this installation at all (None when it can).

        Example:
            >>> Backend().unavailable_reason() is None
            True
        """
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        """Every reason this backend cannot serve ``call`` exactly; empty when it can.

        Derived from the declared capabilities, then :meth:`limits`; never from tensor values.

        Example:
            >>> from attnlab._call import build_call
            >>> q = torch.randn(1, 1, 3, 4)
            >>> Backend().not_supported_reasons(build_call(q, q, q))
            []
        """
        if not self.traceable and torch.compiler.is_compiling():  # its limits may read values too
            return [f"{self.name} reads tensor values to plan its work, which torch.compile cannot trace"]
        device = _device_word(call.device.type)
        found = []
        if self.devices is not None and call.device.type not in self.devices:
            found.append(f"{self.name} runs on {'/'.join(map(_device_word, self.devices))} only, not {device}")
        allowed_dtypes = self.dtypes.get(call.device.type)
        if allowed_dtypes is not None and call.dtype not in allowed_dtypes:
            names = "/".join(str(d).replace("torch.", "") for d in allowed_dtypes)
            found.append(f"{self.name} supports {names} on {device}, not {call.dtype}")
        if not self.dropout and call.dropout_p > 0.0:
            found.append(f"{self.name} has no dropout (dropout_p > 0)")
        if (call.requires_grad and self.backward_devices is not None
                and call.device.type not in self.backward_devices):
            found.append(f"{self.name} has no backward on {device}")
        return found + self.limits(call)

    def limits(self, call: AttentionCall) -> list[str]:
        """Reasons beyond the declared capabilities why ``call`` cannot be served (default none).

        Example:
            >>> from attnlab._call import build_call
            >>> q = torch.randn(1, 1, 3, 4)
            >>> Backend().limits(build_call(q, q, q))
            []
        """
        return []

    def passed_over(self, call: AttentionCall) -> list[str]:
        """Why ``backend="auto"`` passes this backend over for ``call`` although it computes
        the call exactly (default none): a cost, not a correctness limit, so a caller who
        names the backend is served (a module's decoding step with nothing to skip). Dispatch
        asks it only of a backend that declares ``passes_over = True``.

        Example:
            >>> from attnlab._call import build_call
            >>> q = torch.randn(1, 1, 3, 4)
            >>> Backend().passed_over(build_call(q, q, q))
            []
        """
        return []

    def memory_use(self, call: AttentionCall, *, words: bool = False) -> MemoryUse:
        """The extra memory this backend needs for ``call`` beyond its inputs and output: its
        class (``"linear"`` or ``"quadratic"`` in T), estimated bytes (per-row statistics for an
        O(T) path, the scores and weights for an O(T^2) one: :func:`scores_bytes`) and, with
        ``words``, why in a few words (``""`` when there is nothing to add). Auto compares the
        bytes with the memory budget (:func:`attnlab.backends.dispatch.memory_budget`);
        :func:`attnlab.backends.why` shows all three.

        Example:
            >>> from attnlab._call import build_call
            >>> q = torch.randn(1, 1, 3, 4)
            >>> Backend().memory_use(build_call(q, q, q))  # 2 score matrices of 3 x 3 fp32
            MemoryUse(kind='quadratic', nbytes=72, note='')
        """
        return memory_of_class(self.memory, call)

    def claims(self, call: AttentionCall) -> str | None:
        """Why auto runs this backend for ``call`` without asking the others, in words, or None
        (the default: it competes on memory and cost). Asked only of a backend that declares a
        ``claim_order``, lowest first.

        Example:
            >>> from attnlab._call import build_call
            >>> q = torch.randn(1, 1, 3, 4)
            >>> Backend().claims(build_call(q, q, q)) is None
            True
        """
        return None

    def cost(self, call: AttentionCall) -> float:
        """Estimated seconds for ``call`` (rates in :mod:`attnlab.backends.rates`); lower wins.

        Example:
            >>> from attnlab._call import build_call
            >>> q = torch.randn(1, 1, 3, 4)
            >>> Backend().cost(build_call(q, q, q))
            1.0
        """
        return 1.0

    def reset(self) -> None:
        """Forget whatever this backend remembers between calls (default: nothing to forget).

        :func:`attnlab.backends.dispatch.clear_plans`, the one reset, calls it on every backend.

        Example:
            >>> Backend().reset()
        """

    def plan(self, call: AttentionCall) -> object:
        """What this backend decides from ``call``'s signature alone (tile sizes, a kernel's
        options, runs of blocks), once per route or plan; it must hold no tensor of the call nor
        object of the caller. :meth:`execute` receives it. Default None (nothing to decide).

        Example:
            >>> Backend().plan(None) is None
            True
        """
        return None

    def execute(self, call: AttentionCall, plan: object) -> AttentionResult:
        """Compute ``call`` with ``plan`` from :meth:`plan` for its signature: the kernel only,
        no check, no planning. Default: :meth:`forward` (a backend with nothing to plan)."""
        return self.forward(call)

    def forward(self, call: AttentionCall) -> AttentionResult:
        """Compute ``call``; only called after :meth:`not_supported_reasons` came back empty.
        A backend that plans defines it as ``self.execute(call, self.plan(call))``."""
        raise NotImplementedError(f"backend {self.name!r} does not implement forward")

    def prepare(self, call: AttentionCall, *, mask_fixed: bool | None = None) -> Callable:
        """``run(q, k, v, mask, sinks=None, score_mod=None)`` for every call of ``call``'s
        signature, taking the caller's 4-D tensors as given: :meth:`plan` made once, the call's
        signature fields kept (:func:`attnlab._call.call_template`), a mask that holds no tensor
        (causal, a mod keyed by value, the route's own prepared mask) bound, and the dense mask
        this backend reads from such a mask (``dense_mask``) built once. Returns the output, or
        ``(out, weights)`` when the call returns weights. Holds no tensor or object of the caller.
        ``mask_fixed``: whether the call's mask is kept (None: :func:`mask_is_fixed`; dispatch
        says True for the :class:`~attnlab.masks.PreparedMask` it made for the route).

        Example:
            >>> from attnlab._call import build_call
            >>> from attnlab.backends.registry import get
            >>> q = torch.randn(1, 2, 5, 8)
            >>> run = get("reference").prepare(build_call(q, q, q, causal=True))
            >>> torch.allclose(run(q, q, q, None), get("reference").forward(build_call(q, q, q, causal=True)).out)
            True
        """
        plan, execute, weights = self.plan(call), self.execute, call.return_weights
        fixed = mask_is_fixed(call) if mask_fixed is None else mask_fixed
        mask = call.mask if fixed else None
        memo = {"sinks_through_lse": call._memo["sinks_through_lse"]} if "sinks_through_lse" in call._memo else {}
        if (fixed or call.mask_kind == "causal") and self.dense_mask:
            memo["allowed"] = call.allowed()  # (B|1, H|1, Tq, Tk), built from no user tensor
        score = call.score_mod if _score_mod_is_fixed(call.score_mod) else None
        template = call_template(call, memo=memo)
        dtype = torch.float32 if call.dtype in (torch.float16, torch.bfloat16) else call.dtype
        device = call.device

        def run(q: Tensor, k: Tensor, v: Tensor, given: object, sinks: Tensor | None = None,
                score_mod: object = None):
            if score_mod is not None and score is None:  # held by the caller: as build_call makes it
                score_mod = _scores.as_score_mod(score_mod).for_call(dtype=dtype, device=device)
            bound = bind_call(template, q, k, v, mask if fixed else given, sinks,
                              score if score is not None else score_mod)
            result = execute(bound, plan)
            if not weights:
                return result.out  # (B, Hq, Tq, Dv)
            return result.out, result.weights if result.weights is not None else weights_of(bound)

        return run


def mask_is_fixed(call: AttentionCall) -> bool:
    """Whether ``call``'s mask is one a prepared run may keep: a mask mod keyed by value (causal
    folded in), which holds no tensor of the caller. (A :class:`~attnlab.masks.PreparedMask`
    is kept only where dispatch made it: :meth:`Backend.prepare`'s ``mask_fixed``.)

    Example:
        >>> from attnlab._call import build_call
        >>> from attnlab import masks
        >>> q = torch.randn(1, 1, 4, 8)
        >>> mask_is_fixed(build_call(q, q, q, mask=masks.sliding_window_mod(4, 4, window=2)))
        True
        >>> mask_is_fixed(build_call(q, q, q, mask=masks.padding_mod(torch.tensor([3]))))
        False
    """
    return call.mask_kind == "mod" and _masks.value_only_key(call.mask) is not None


def _score_mod_is_fixed(mod: object) -> bool:
    """Whether a score mod says all it does by its settings: no tensor, no user function."""
    return mod is not None and not mod.params() and not _scores.has_function(mod)


def weights_of(call: AttentionCall) -> Tensor:
    """Weights ``(B, Hq, Tq, Tk)`` of a validated call: the softmax of its recomputed scores.

    A backend's row log-sum-exp is not reused (``exp(scores - lse)``): at large scores an lse
    that rounded differently from the recomputed scores scales whole rows, which then no longer
    sum to 1. Scores and softmax stay in fp32 for half inputs. Rows with nothing to attend are
    zeros; a NaN score gives a NaN row.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> weights_of(build_call(q, q, q, causal=True))[0, 0, 0].tolist()
        [1.0, 0.0, 0.0]
    """
    with torch.no_grad():
        attn_scores = masked_scores(call, call.q, repeat_kv(call.k, call.q_heads))  # (B, H, Tq, Tk)
        return softmax_rows(attn_scores, call.sinks).to(call.dtype)


def io_bytes(call: AttentionCall) -> int:
    """Bytes of ``call``'s q, k, v and output (what the caller holds whatever the backend).

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> io_bytes(build_call(q, q, q))
        192
    """
    size = torch.empty((), dtype=call.dtype).element_size()
    rows = call.batch * (call.q_heads * call.tq * (call.head_dim + call.value_dim)
                         + call.kv_heads * call.tk * (call.head_dim + call.value_dim))
    return size * rows


def scores_bytes(call: AttentionCall, copies: int = 2) -> int:
    """Bytes of ``copies`` ``(B, Hq, Tq, Tk)`` score matrices in fp32 (fp64 for fp64 calls):
    the scores and the weights an unfused path keeps, the autograd graph holding them.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(2, 4, 8, 16)
        >>> scores_bytes(build_call(q, q, q), copies=1)
        2048
    """
    size = 8 if call.dtype == torch.float64 else 4
    return copies * size * call.batch * call.q_heads * call.tq * call.tk


def _device_word(device_type: str) -> str:
    return device_type.upper() if device_type in ("cpu", "cuda", "mps", "xpu") else device_type


def call_flops(call: AttentionCall, *, causal: bool | None = None) -> float:
    """FLOPs ``call`` will cost under attnlab's convention, for backends' cost estimates.

    Forward only, or forward+backward (3.5x) when the call needs gradients.

    Args:
        call: the call.
        causal: whether to halve the count for a causal mask the kernel really skips; defaults
            to whether the call has a causal part.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 4, 8)
        >>> call_flops(build_call(q, q, q, causal=True))
        256.0
    """
    return attention_flops(
        call.batch, call.q_heads, call.tq, call.tk, call.head_dim, call.value_dim,
        causal=call.causal_offset is not None if causal is None else causal,
        mode="fwd+bwd" if call.requires_grad else "fwd",
    )
