"""The textbook steps the reference backend is built from, shared with every view of the
weights so that they agree with the oracle: GQA head repetition, masked scores, a softmax that
keeps fully masked rows at zero, dead-key zeroing, dropout and the fused kernels' scale rule.

Example:
    >>> import torch
    >>> softmax_rows(torch.tensor([[0.0, 0.0]]))
    tensor([[0.5000, 0.5000]])
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab._call import AttentionCall
from attnlab.scores import apply_tile, sink_logits

__all__ = [
    "repeat_kv",
    "sum_kv_groups",
    "score_dtype",
    "blocked_positions",
    "live",
    "keep_nan_rows",
    "zero_dead",
    "masked_scores",
    "softmax_rows",
    "apply_dropout",
    "folds_scale",
    "kernel_scales",
]


def repeat_kv(t: Tensor, q_heads: int) -> Tensor:
    """Repeat key/value heads for grouped-query attention: ``(B, Hkv, T, D) -> (B, Hq, T, D)``.

    Query head ``h`` uses key/value head ``h // (Hq // Hkv)``, as in PyTorch's ``enable_gqa``.

    Example:
        >>> repeat_kv(torch.zeros(1, 2, 3, 4), 6).shape
        torch.Size([1, 6, 3, 4])
    """
    groups = q_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def sum_kv_groups(t: Tensor, kv_heads: int) -> Tensor:
    """Add up the query heads that share a key/value head: ``(B, Hq, T, X) -> (B, Hkv, T, X)``.

    The adjoint of :func:`repeat_kv`: the gradient of repeated keys/values flows back this way.

    Example:
        >>> sum_kv_groups(torch.ones(1, 6, 3, 4), 2)[0, :, 0, 0]
        tensor([3., 3.])
    """
    B, Hq, T, X = t.shape
    return t if Hq == kv_heads else t.view(B, kv_heads, Hq // kv_heads, T, X).sum(dim=2)  # (B, Hkv, T, X)


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and softmax are computed in: fp32 for fp16/bf16 inputs, else ``dtype``.

    Half-precision scores would round a float mask and overflow fp16; fused kernels use fp32 too.

    Example:
        >>> score_dtype(torch.bfloat16), score_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def blocked_positions(call: AttentionCall) -> Tensor | None:
    """Dense bool mask of blocked positions (``~allowed`` or a ``-inf`` bias), or None.

    Broadcastable to ``(B, Hq, Tq, Tk)``, for the quadratic paths (reference, weight views).

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.ones(1, 1, 2, 4)
        >>> blocked_positions(build_call(q, q, q, causal=True))[0, 0]
        tensor([[False,  True],
                [False, False]])
    """
    allowed, bias = call.allowed(), call.bias()
    blocked = None if allowed is None else ~allowed
    if bias is not None:
        minus_inf = bias == float("-inf")
        blocked = minus_inf if blocked is None else blocked | minus_inf
    return blocked


def live(reached: Tensor) -> Tensor:
    """Reached flags ``(B|1, H|1, T|1)`` as ``(B|1, H|1, T|1, 1)`` for :func:`zero_dead`.

    ``reached`` says per key whether some query may attend it, or per query whether it may
    attend some key. No value is read (a branch on it would stop ``torch.compile``).

    Example:
        >>> allowed = torch.tensor([[[[True, False], [True, False]]]])        # (1, 1, Tq, Tk)
        >>> live(allowed.any(dim=-2)).flatten().tolist()
        [True, False]
    """
    return reached.unsqueeze(-1)


def keep_nan_rows(q: Tensor, out: Tensor) -> Tensor:
    """``out`` ``(B, Hq, Tq, Dv)`` with NaN in every row whose query ``(B, Hq, Tq, D)`` holds a NaN.

    For kernels that return a zero row for a NaN query, which would pass for a fully masked
    row. Value-free, O(Tq * D).

    Example:
        >>> q = torch.tensor([[[[1.0], [float("nan")]]]])
        >>> keep_nan_rows(q, torch.zeros(1, 1, 2, 1)).flatten().tolist()
        [0.0, nan]
    """
    return torch.where(q.isnan().any(dim=-1, keepdim=True), float("nan"), out)  # (B, Hq, Tq, Dv)


def zero_dead(t: Tensor, live: Tensor | None) -> Tensor:
    """``t`` ``(B, H, T, X)`` with the positions that are not ``live`` set to 0.

    Blocked keys enter ``weights @ v`` with a factor 0, and ``0 * NaN`` is NaN: zeroing them
    keeps NaN/inf stored there (padding, unused cache slots) out, with zero gradient. With
    grouped-query heads a key/value head is live where any of its query heads is.

    Args:
        t: ``(B, H, T, X)`` keys, values or queries.
        live: ``(B|1, Hq|H|1, T|1, 1)`` bool from :func:`live`, or None.

    Example:
        >>> zero_dead(torch.tensor([[[[1.0], [float("nan")]]]]), torch.tensor([[[[True], [False]]]]))
        tensor([[[[1.],
                  [0.]]]])
    """
    if live is None:
        return t
    heads = t.shape[1]
    if live.shape[1] not in (1, heads):
        live = live.unflatten(1, (heads, -1)).any(dim=2)  # (B|1, Hkv, T|1, 1)
    return torch.where(live, t, 0.0)


def masked_scores(call: AttentionCall, q: Tensor, k: Tensor) -> Tensor:
    """Scaled scores with every mask applied; blocked positions are ``-inf``.

    In :func:`score_dtype`; the score mod applies first, then the float mask, then the
    blocking. A NaN score at an allowed position stays NaN.

    Args:
        call: the call (for scale, masks and causal alignment).
        q: ``(B, H, Tq, D)``; k: ``(B, H, Tk, D)`` with heads already repeated.

    Returns:
        ``(B, H, Tq, Tk)`` scores in ``score_dtype(q.dtype)``.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.ones(1, 1, 2, 4)
        >>> masked_scores(build_call(q, q, q, causal=True), q, q)
        tensor([[[[2., -inf],
                  [2., 2.]]]])
    """
    work = score_dtype(q.dtype)
    attn_scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * call.scale  # (B, H, Tq, Tk)
    if call.score_mod is not None:
        attn_scores = apply_tile(call.score_mod, attn_scores, q_start=0, kv_start=0).to(work)
    bias = call.bias()
    if bias is not None:
        attn_scores = attn_scores + bias.to(work)
    blocked = blocked_positions(call)
    if blocked is not None:  # also overwrites NaN scores of blocked (e.g. padded) keys
        attn_scores = attn_scores.masked_fill(blocked, float("-inf"))
    return attn_scores


def softmax_rows(attn_scores: Tensor, sinks: Tensor | None = None) -> Tensor:
    """Softmax over keys that gives all-zero rows (and zero gradient) where every key is blocked.

    A row of ``-inf`` (a plain softmax gives NaN) is computed on zeros and multiplied by 0; a
    NaN score propagates. ``sinks`` ``(H,)`` or ``(B|1, H|1, Tq)`` add one key per row of that
    logit, normalised with the others and dropped from the result
    (:func:`attnlab.scores.sink_logits`).

    Example:
        >>> softmax_rows(torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]]))
        tensor([[0.5000, 0.5000],
                [0.0000, 0.0000]])
        >>> softmax_rows(torch.zeros(1, 1, 1, 3), sinks=torch.zeros(1)).flatten().tolist()
        [0.25, 0.25, 0.25]
    """
    if sinks is not None:
        logits = sink_logits(sinks, attn_scores.dtype)  # (B|1, H|1, Tq|1)
        column = logits.unsqueeze(-1).expand(*attn_scores.shape[:-1], 1)  # (B, H, Tq, 1)
        return softmax_rows(torch.cat([attn_scores, column], dim=-1))[..., :-1]  # (B, H, Tq, Tk)
    row_alive = (attn_scores != float("-inf")).any(dim=-1, keepdim=True)  # (B, H, Tq, 1)
    safe_scores = torch.where(row_alive, attn_scores, torch.zeros_like(attn_scores))
    return torch.softmax(safe_scores, dim=-1) * row_alive


def apply_dropout(attn_weights: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """Zero each weight with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    ``bernoulli_`` on ``generator`` draws as ``torch.nn.Dropout`` does on CPU.

    Example:
        >>> kept = apply_dropout(torch.ones(1000), 0.5, torch.Generator().manual_seed(0))
        >>> sorted(set(kept.tolist()))
        [0.0, 2.0]
    """
    if p == 0.0:
        return attn_weights
    keep = torch.empty_like(attn_weights).bernoulli_(1.0 - p, generator=generator)
    return attn_weights * keep.div_(1.0 - p)


def kernel_scales(call: AttentionCall) -> tuple[float, float]:
    """``(factor, scale)``: a fused kernel gets ``q * factor`` and ``scale`` (factor 1: q as it is).

    PyTorch's CPU flash kernel scales its causal ``-inf`` fill (scale 0 gives NaN) and its
    backward rounds the scores another way than its forward: fp32/fp64 calls fold the whole
    scale into q when it is <= 0 or a backward will run. fp16/bf16 fold only what is exact (a
    sign, or 0). Decided from the float, the dtype and grad mode (docs/contract.md, "Scale").

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> kernel_scales(build_call(q, q, q, scale=-2.0)), kernel_scales(build_call(q.half(), q.half(), q.half(), scale=-2.0))
        ((-2.0, 1.0), (-1.0, 2.0))
    """
    scale = call.scale
    if scale == 0.0:
        return 0.0, 1.0
    if call.dtype in (torch.float16, torch.bfloat16):
        return (-1.0, -scale) if scale < 0.0 else (1.0, scale)
    if scale < 0.0 or (call.requires_grad and scale != 1.0):
        return scale, 1.0
    return 1.0, scale


def folds_scale(call: AttentionCall) -> bool:
    """Whether a fused kernel gets q multiplied by anything (see :func:`kernel_scales`).

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> folds_scale(build_call(q, q, q, scale=0.0)), folds_scale(build_call(q, q, q))
        (True, False)
    """
    return kernel_scales(call)[0] != 1.0
