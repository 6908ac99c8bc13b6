"""``attnlab.attention``: one function, one set of semantics, several backends."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from attnlab._call import AttentionCall, build_call, sdpa_aligned
from attnlab._math import masked_scores, repeat_kv, softmax_rows
from attnlab.backends import topk
from attnlab.backends.dispatch import argument_key, remembered, route
from attnlab.backends.registry import get
from attnlab.scores import ScoreMod

__all__ = ["attention", "attention_weights"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Callable | None = None,
    causal: bool = False,
    align: str = "top_left",
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    return_weights: bool = False,
    score_mod: ScoreMod | Callable | None = None,
    sinks: Tensor | None = None,
    indices: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention, ``softmax(score_mod(q k^T * scale) + mask) v``.

    Shapes (``...`` is nothing, ``B``, ``B, H`` or ``A, B, H``; a tensor of lower rank than the
    others gets size-1 leading dims, as SDPA aligns them from the right):
        q: ``(..., Tq, D)``, k: ``(..., Tk, D)``, v: ``(..., Tk, Dv)`` -> out ``(..., Tq, Dv)``.
        With rank 4 or 5, k and v may have fewer heads than q (grouped-query attention): ``Hq``
        must be a multiple of ``Hkv`` and query head ``h`` reads key/value head
        ``h // (Hq // Hkv)``. The batch dims (``B``, or ``A, B``) broadcast as in
        ``torch.nn.functional.scaled_dot_product_attention``: keys and values of batch 1
        serve every query of a batch (a shared prompt) and are read in place, never copied
        (rank 5 copies them only when ``A`` is broadcast and ``B`` is not); their gradient is
        the sum over the batch they served. Mask mods see the flattened batch index
        ``b = a * B + b'`` for rank 5.

    Args:
        q, k, v: query, key and value tensors of one floating dtype on one device.
        mask: what each query may attend to. A **bool** tensor (True = may attend) or a
            **float** tensor (added to the scaled scores; ``-inf`` blocks), broadcasting to
            ``(..., Tq, Tk)``; or a **mask mod** ``(b, h, q_idx, kv_idx) -> bool`` written with
            tensor ops (see :mod:`attnlab.masks`). A padding mask for ``(B, H, T, D)`` inputs has
            shape ``(B, 1, 1, Tk)``.
        causal: also block future keys. It is ANDed with ``mask`` when both are given.
        align: causal alignment when ``Tq != Tk``: ``"top_left"`` (default, as PyTorch's
            ``is_causal``: query ``i`` sees keys ``<= i``) or ``"bottom_right"`` (query ``i``
            sees keys ``<= i + Tk - Tq``, what decoding with a KV cache needs).
        scale: multiplier of the scores; defaults to ``1 / sqrt(D)``.
        dropout_p: probability of zeroing each attention weight (the rest are scaled by
            ``1 / (1 - dropout_p)``); must be in ``[0, 1)``. Pass 0 in evaluation.
        generator: random generator for dropout; same seed, same output.
        backend: ``"auto"`` (the fastest backend that serves the call, never an O(T^2)-memory
            one when an O(T) one serves) or a name from :func:`attnlab.backends.available`.
            A named backend that cannot serve the call raises ``ValueError`` with its reasons.
        return_weights: also return the attention weights ``(..., Hq, Tq, Tk)`` per head (never
            averaged), before dropout. Asking for them does not change how ``out`` is computed.
        score_mod: how each scaled score is changed before the float mask and the masking: one
            of :mod:`attnlab.scores` (``softcap``, ``alibi``, ``relative_bias``, ``bias`` and
            their composition) or a function ``(score, b, h, q_idx, kv_idx) -> score``
            (FlexAttention's signature; ``h`` is the query head). Its tensors get gradients.
        sinks: sink logits, a float tensor: ``(Hq,)`` per head (gpt-oss's ``s_aux``), or
            ``(B|1, Hq|1, Tq)`` per query (computed from each token, as Inkling2's
            ``sink_proj``), broadcasting over batch and heads (``B`` is the batch dims
            flattened for rank 5). Each query row gets one more key of logit ``sinks[h]`` (or
            ``sinks[b, h, i]``) and value 0, which only takes probability mass; the gradient
            of a broadcast dim is summed. A query with every key masked then gives a zero row
            (the sink takes it all), as does a sink of ``+inf`` (with zero gradients, the
            sink's own included); a sink of ``-inf`` is no sink. The weights returned leave the
            sink's share out (rows sum to less than 1).
        indices: top-k sparse attention (docs/sparse.md, "Top-k attention"): an integer tensor
            ``(B|1, Hkv|1, Tq, k)`` (q's layout; leading dims may be 1 or left out) listing the
            keys each query attends to, ANDed with ``mask`` and ``causal``; ``-1`` is no key and
            a repeated key counts once. Runs an exact kernel at the listed pairs in O(Tq*k)
            memory (``backend="reference"``: the dense oracle). No ``dropout_p`` or
            ``score_mod`` (the reference takes a score mod), no gradient for a float mask.

    Returns:
        ``out`` of shape ``(..., Tq, Dv)``, or ``(out, weights)`` when ``return_weights``.
        A query that may attend to no key gets a zero output row and zero gradient.
        Values stored at keys no query may attend (padding, unused cache slots) have no
        influence when finite; NaN/inf there may reach the output on the fused backends, as
        with ``F.scaled_dot_product_attention`` (docs/design.md, "Non-finite values"). NaN in
        ``q`` makes its output row NaN, and inf in ``q`` gives what the math gives (NaN from
        ``inf - inf``), on every backend.

    Raises:
        TypeError: non-tensor input, a non-float or mixed dtype, an integer mask.
        ValueError: wrong rank, mismatched sizes, batch dims that do not broadcast, heads not
            divisible, a mask that does not broadcast, ``dropout_p`` outside ``[0, 1)``, an
            unknown or unable backend, a score mod or sinks that do not match the call.

    Example:
        >>> import torch, attnlab
        >>> q = torch.randn(2, 4, 10, 16)                    # (B, H, T, D)
        >>> k, v = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 8)   # 2 key/value heads
        >>> out, weights = attnlab.attention(q, k, v, causal=True, return_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 4, 10, 8]), torch.Size([2, 4, 10, 10]))
        >>> bool(weights[0, 0, 0, 1:].eq(0).all())           # the first token sees only itself
        True
        >>> shared = torch.randn(1, 2, 10, 16)                # one prompt's keys for the batch
        >>> attnlab.attention(q, shared, shared).shape
        torch.Size([2, 4, 10, 16])
        >>> sinks = torch.zeros(4, requires_grad=True)          # one sink logit per query head
        >>> out = attnlab.attention(q, k, v, causal=True, sinks=sinks,
        ...                         score_mod=attnlab.scores.softcap(20.0))
        >>> out.sum().backward(); sinks.grad.shape
        torch.Size([4])
        >>> per_query = torch.zeros(2, 1, 10, requires_grad=True)  # (B, 1, Tq): one logit per query
        >>> attnlab.attention(q, k, v, causal=True, sinks=per_query).sum().backward()
        >>> per_query.grad.shape
        torch.Size([2, 1, 10])
    """
    q, k, v = sdpa_aligned(q, k, v)  # mixed ranks align from the right, as SDPA's
    if indices is not None:  # top-k: its own kernel, never the dense dispatch
        return _attention_at(q, k, v, indices, backend=backend, mask=mask, causal=causal, align=align,
                             scale=scale, dropout_p=dropout_p, generator=generator,
                             return_weights=return_weights, score_mod=score_mod, sinks=sinks)
    key = argument_key(q, k, v, mask=mask, causal=causal, align=align, scale=scale, dropout_p=dropout_p,
                       generator=generator, backend=backend, return_weights=return_weights,
                       score_mod=score_mod, sinks=sinks)
    known = remembered(key)
    if known is not None and known.run is not None:  # validated before: nothing reads values
        return known.run(q, k, v, mask) if sinks is None else known.run(q, k, v, mask, sinks)  # (B, Hq, Tq, Dv)
    if known is not None and known.mask is not None:  # the same mask, prepared: plans made once
        mask, causal = known.mask, False
    call = build_call(
        q, k, v, mask=mask, causal=causal, align=align, scale=scale, dropout_p=dropout_p,
        generator=generator, return_weights=return_weights, score_mod=score_mod, sinks=sinks,
    )
    direct = call.q is q and call.k is k and call.v is v and call.mask is mask
    chosen_route = route(key, known, call, backend, direct=direct)  # known: no second lookup
    if chosen_route.mask is not None and known is None:  # the first call plans from it too
        call = build_call(q, k, v, mask=chosen_route.mask, causal=False, align=align, scale=scale,
                          dropout_p=dropout_p, generator=generator, return_weights=return_weights,
                          score_mod=score_mod, sinks=sinks)
    chosen = chosen_route.backend
    result = chosen.forward(call)
    out = _restore_rank(result.out, call)
    if not return_weights:
        return out
    weights = result.weights if result.weights is not None else _weights_of(call)
    return out, _restore_rank(weights, call)


def _attention_at(q: Tensor, k: Tensor, v: Tensor, indices: object, *, backend: str, **options):
    """:func:`attention` with ``indices``: validated, then the top-k kernel or the dense oracle."""
    call = build_call(q, k, v, **options)
    idx = topk.check_indices(indices, call, rank=q.ndim)
    why_not = topk.refusal(call, backend)
    if why_not is not None:
        raise ValueError(why_not)
    if backend == "reference":
        out, weights = _dense_at(call, idx)
    else:
        out, weights = topk.topk_attention(call, idx)
    out = _restore_rank(out, call)
    return (out, _restore_rank(weights, call)) if call.return_weights else out


def _dense_at(call: AttentionCall, idx: Tensor) -> tuple[Tensor, Tensor | None]:
    """The reference backend on the dense mask of the listed keys ∩ the call's masks: O(Tq*Tk)."""
    listed = topk.indices_mask(repeat_kv(idx, call.q_heads) if idx.shape[1] > 1 else idx, call.tk)
    allowed = call.allowed()
    allowed = listed if allowed is None else allowed & listed  # (B|1, Hq|1, Tq, Tk)
    bias = call.bias()
    mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
    dense = dataclasses.replace(call, mask=mask, causal=False, _memo={})
    result = get("reference").forward(dense)
    return result.out, result.weights


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Callable | None = None,
    causal: bool = False,
    align: str = "top_left",
    scale: float | None = None,
    score_mod: ScoreMod | Callable | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The attention weights ``softmax(score_mod(q k^T * scale) + mask)`` that :func:`attention` applies.

    The same weights as ``attention(..., return_weights=True)`` returns, without computing the
    output: rows sum to 1, blocked keys get 0, and a query with no attendable key gets a zero
    row. With ``sinks``, rows sum to 1 minus the sink's share (``1 - weights.sum(-1)`` is it).
    Arguments mean what they mean for :func:`attention`; no gradient is recorded.

    Shapes:
        q ``(..., Tq, D)``, k ``(..., Tk, D)`` -> weights ``(..., Hq, Tq, Tk)`` for rank-4 input,
        ``(..., Tq, Tk)`` for rank 2 and 3.

    Example:
        >>> q = torch.randn(1, 2, 3, 4)                 # (B, H, T, D)
        >>> weights = attention_weights(q, q, causal=True)
        >>> weights.shape, bool(torch.allclose(weights.sum(-1), torch.ones(1, 2, 3)))
        (torch.Size([1, 2, 3, 3]), True)
        >>> from attnlab.scores import softcap
        >>> capped = attention_weights(q * 100, q, causal=True, score_mod=softcap(1.0))
        >>> bool(capped[0, 0, 2].max() < 0.79)  # scores in (-1, 1): at most e / (e + 2/e) of 3 keys
        True
    """
    # v only fixes the shapes for validation; it is never read.
    v = k.new_zeros(()).expand(k.shape) if isinstance(k, Tensor) else k
    q, k, v = sdpa_aligned(q, k, v)
    call = build_call(q, k, v, mask=mask, causal=causal, align=align, scale=scale,
                      score_mod=score_mod, sinks=sinks)
    return _restore_rank(_weights_of(call), call)


def _weights_of(call: AttentionCall) -> Tensor:
    """Weights ``(B, Hq, Tq, Tk)`` of a validated call: the softmax of its recomputed scores.

    A backend's row log-sum-exp is not reused (``exp(scores - lse)``): at large scores (1e3 and
    beyond in fp32) an lse that rounded differently from the recomputed scores scales whole
    rows, which then sum to 0.94 or 1e-7 instead of 1. Scores and softmax stay in fp32 for half
    inputs; only the weights are rounded to the input dtype. Rows with nothing to attend are
    zeros; a NaN score gives a NaN row."""
    with torch.no_grad():
        attn_scores = masked_scores(call, call.q, repeat_kv(call.k, call.q_heads))  # (B, H, Tq, Tk)
        return softmax_rows(attn_scores, call.sinks).to(call.dtype)


def _restore_rank(t: Tensor, call: AttentionCall) -> Tensor:
    """A 4-D result ``(B, H, T, X)`` in the layout of the user's inputs (rank 2 to 5)."""
    if call.input_rank == 2:
        return t[0, 0]  # (T, D)
    if call.input_rank == 3:
        return t[:, 0]  # (B, T, D)
    if call.input_rank == 5:
        return t.unflatten(0, call.batch_shape)  # (A, B, H, T, D)
    return t
