"""One linear-attention call, checked once: shapes, dtypes, devices and values, named when wrong.

``linear_call`` turns the arguments of :func:`attnlab.linear_attention` into a :class:`LinearCall`
whose fields every backend reads and none recomputes. Bad input raises ``ValueError`` (or
``TypeError`` for a wrong kind) naming the argument and the value seen; nothing is computed first.

Example:
    >>> import torch
    >>> q = k = torch.randn(1, 2, 5, 4); v = torch.randn(1, 2, 5, 3)
    >>> call = linear_call(q, k, v, decay=None, beta=None, scale=None, initial_state=None,
    ...                    cu_seqlens=None)
    >>> call.rule, call.groups, call.state_shape
    ('additive', 1, (1, 2, 4, 3))
    >>> linear_call(q, k, v, decay=torch.ones(1, 2, 5), beta=None, scale=None,
    ...             initial_state=None, cu_seqlens=None)
    Traceback (most recent call last):
    ...
    ValueError: decay must be <= 0 (a log-decay per step: the state is multiplied by exp(decay)), got a largest value of 1.0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab._checks import finite_number

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class LinearCall:
    """A checked call: the tensors and every size and option, computed once.

    Attributes:
        q, k: ``(B, H, T, Dk)``. v: ``(B, Hv, T, Dv)``, ``Hv`` a multiple of ``H``.
        decay: None, ``(B, Hv, T)`` (scalar per step) or ``(B, Hv, T, Dk)`` (per key channel).
        beta: None (additive update) or ``(B, Hv, T)`` (delta rule).
        scale: the output's factor. initial_state: None or ``state_shape``.
        cu_seqlens: None or a 1-D int64 tensor of document starts (``B == 1``); ``starts`` its values.
        rule: "additive", "decay" (scalar), "channel" (per-channel decay), "delta", "gated_delta"
            (scalar decay with beta) or "kda" (per-channel decay with beta).
        groups: ``Hv // H``, the value heads each query/key head serves (consecutive heads).
        state_dtype: fp64 for fp64 inputs, fp32 otherwise (the state is never kept in half precision).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    decay: torch.Tensor | None
    beta: torch.Tensor | None
    scale: float
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    starts: tuple[int, ...]
    rule: str
    groups: int
    state_dtype: torch.dtype

    @property
    def sizes(self) -> tuple[int, int, int, int, int, int]:
        """``(B, H, Hv, T, Dk, Dv)``."""
        B, H, T, Dk = self.q.shape
        return B, H, self.v.shape[1], T, Dk, self.v.shape[-1]

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """The state's shape, ``(B, Hv, Dk, Dv)``, or ``(N, Hv, Dk, Dv)`` for N packed documents."""
        B, _, Hv, _, Dk, Dv = self.sizes
        return (len(self.starts) - 1 if self.cu_seqlens is not None else B), Hv, Dk, Dv


RULES = {(False, False, False): "additive", (True, False, False): "decay", (True, True, False): "channel",
         (False, False, True): "delta", (True, False, True): "gated_delta", (True, True, True): "kda"}


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOATS:
        raise TypeError(f"{name} must be a floating-point tensor (float16, bfloat16, float32, float64), got {x.dtype}")
    return x


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], words: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {words} = {tuple(expected)}, got {tuple(x.shape)}")


def _finite(name: str, x: torch.Tensor) -> None:
    # A finite sum means every value is finite (NaN and inf propagate); only a non-finite sum, an
    # overflow of finite values included, pays for the elementwise check.
    if not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} has NaN or infinite values; linear attention carries a state through every "
                         f"step, so one non-finite value would spread to every later output")


def _check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, heads, T, head_dim), got shape {tuple(x.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    B, H, T, Dk = q.shape
    _shape("k", k, (B, H, T, Dk), "q's (B, H, T, Dk)")
    if v.shape[0] != B or v.shape[2] != T:
        raise ValueError(f"v must have shape (B, Hv, T, Dv) with q's B={B} and T={T}, got {tuple(v.shape)}")
    Hv, Dv = v.shape[1], v.shape[3]
    if H == 0 or Hv % H:
        raise ValueError(f"v's heads (Hv={Hv}) must be a positive multiple of q's and k's heads (H={H}): "
                         f"each query/key head serves Hv // H consecutive value heads")
    if Dk == 0 or Dv == 0:
        raise ValueError(f"head dims must be positive, got Dk={Dk} (q, k) and Dv={Dv} (v)")
    return B, H, Hv, T, Dk, Dv


def _check_side(name, x, expected, words, device) -> torch.Tensor:
    _tensor(name, x)
    _shape(name, x, expected, words)
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")
    return x


def _check_cu_seqlens(cu_seqlens, B: int, T: int, device) -> tuple[int, ...]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor of document starts, got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs documents along T of one row: q must have B=1, got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries (0, ..., T), got shape "
                         f"{tuple(cu_seqlens.shape)}")
    starts = tuple(int(s) for s in cu_seqlens.tolist())
    if starts[0] != 0 or starts[-1] != T or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T} without going down, got {list(starts)}")
    return starts


def _check_values(call: LinearCall) -> None:
    """The checks that read values: skipped while torch.compile traces (they would break the graph)."""
    for name in ("q", "k", "v", "decay", "beta", "initial_state"):
        x = getattr(call, name)
        if x is not None and x.numel():
            _finite(name, x)
    if call.decay is not None and call.decay.numel() and call.decay.max().item() > 0:
        raise ValueError(f"decay must be <= 0 (a log-decay per step: the state is multiplied by exp(decay)), "
                         f"got a largest value of {call.decay.max().item()}")
    if call.beta is not None and call.beta.numel() and not 0 <= call.beta.min().item() <= call.beta.max().item() <= 1:
        raise ValueError(f"beta must lie in [0, 1] (the delta rule's step size), got values from "
                         f"{call.beta.min().item()} to {call.beta.max().item()}")


def linear_call(q, k, v, *, decay, beta, scale, initial_state, cu_seqlens, values: bool = True) -> LinearCall:
    """Check every argument of ``linear_attention`` once and return the call.

    Args:
        q, k, v, decay, beta, scale, initial_state, cu_seqlens: as :func:`attnlab.linear_attention`.
        values: also read the values (NaN/inf, decay <= 0, beta in [0, 1]); False only for callers
            whose values hold by construction (a layer's sigmoid beta, its checked input).

    Returns:
        LinearCall: the tensors as given, and every size and option.

    Raises:
        TypeError: a non-tensor or non-float tensor, mixed q/k/v dtypes.
        ValueError: a bad shape, device, decay > 0, beta outside [0, 1], NaN/inf, bad cu_seqlens.

    Example:
        >>> import torch
        >>> q = torch.randn(1, 1, 3, 2)
        >>> linear_call(q, q, q, decay=None, beta=torch.full((1, 1, 3), 0.5), scale=None,
        ...             initial_state=None, cu_seqlens=None).rule
        'delta'
    """
    B, H, Hv, T, Dk, Dv = _check_qkv(q, k, v)
    device = q.device
    if decay is not None:
        _tensor("decay", decay)
        per_channel = decay.dim() == 4
        expected, words = ((B, Hv, T, Dk), "(B, Hv, T, Dk)") if per_channel else ((B, Hv, T), "(B, Hv, T)")
        _check_side("decay", decay, expected, words + " (per key channel or per step)", device)
    if beta is not None:
        _check_side("beta", beta, (B, Hv, T), "(B, Hv, T)", device)
    scale = Dk ** -0.5 if scale is None else finite_number("scale", scale)
    starts: tuple[int, ...] = ()
    if cu_seqlens is not None:
        starts = _check_cu_seqlens(cu_seqlens, B, T, device)
    rows = len(starts) - 1 if cu_seqlens is not None else B
    if initial_state is not None:
        words = "(N documents, Hv, Dk, Dv)" if cu_seqlens is not None else "(B, Hv, Dk, Dv)"
        _check_side("initial_state", initial_state, (rows, Hv, Dk, Dv), words, device)
    rule = RULES[(decay is not None, decay is not None and decay.dim() == 4, beta is not None)]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    call = LinearCall(q, k, v, decay, beta, scale, initial_state, cu_seqlens, starts, rule, Hv // H, state_dtype)
    if values and not torch.compiler.is_compiling():
        _check_values(call)
    return call


def empty_result(call: LinearCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and final state of a call with ``T == 0``: no output, the state unchanged."""
    B, _, Hv, T, Dk, Dv = call.sizes
    out = call.v.new_zeros(B, Hv, T, Dv)
    state = (call.initial_state.to(call.state_dtype) if call.initial_state is not None
             else call.q.new_zeros(call.state_shape, dtype=call.state_dtype))
    return out, state

