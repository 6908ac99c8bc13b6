"""Run Hugging Face transformers models on :func:`attnlab.attention`: ``register()``.

Tested with transformers 5.23.0, 5.24.0 and 5.25.0 (torch 2.13 CPU); it needs transformers 5.x, whose
attention layers call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` and whose mask builders
(``masking_utils.create_causal_mask`` / ``create_bidirectional_mask`` / the sliding-window one)
call ``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]``.

**Mechanism.** :func:`register` registers, under one name:

1. :func:`attention_forward` with ``transformers.AttentionInterface``: it receives
   ``query (B, H, Tq, D)``, ``key``/``value`` ``(B, Hkv, Tk, D)``, the prepared mask and the
   layer's keywords, calls :func:`attnlab.attention` (grouped-query heads, ``scaling``, dropout
   in training) and returns ``(out (B, Tq, H, D), weights or None)``. Every keyword is either
   applied (:data:`HONOURED_KEYWORDS`), known to change nothing in transformers' eager path
   (:data:`IGNORED_KEYWORDS`), None, or refused with ``ValueError`` naming the module's class and
   the keyword: never dropped.
2. A mask builder with ``AttentionMaskInterface``. This is required: for a name missing there,
   transformers builds **no mask at all**, so a padded batch would silently attend to its
   padding. A model transformers runs with sdpa gets ``sdpa_mask``: bool ``(B, 1, Tq, Tk)``,
   True = attend (attnlab's polarity), or None for a plain causal / full pattern; then, as
   transformers' sdpa path does, causality comes from ``is_causal`` (or ``module.is_causal``)
   and applies when ``Tq > 1``, aligned top-left, and a layer's ``sliding_window`` on the same
   diagonal. A model without sdpa support was written for eager: it gets ``eager_mask``
   (additive floats, always built when eager builds one) and no mask means full attention.
3. A check while a model is built: a model whose layers compute attention outside the
   interface (``attn_implementation`` would never reach attnlab; BLOOM, MPT, GIT, SAM, ...) is
   refused with ``ValueError``.
4. DeepSeek-V4, whose layers build dense compressed masks before they call the interface: its
   attention layers run as :class:`attnlab.nn.CompressedAttention` on their own parameters and the
   mask builder leaves the plain sliding-window mask out (:mod:`attnlab.integrations.deepseek_v4`).

A layer's ``softcap`` (Gemma 2, Gemma 3), ``s_aux`` (gpt-oss's per-head sinks) and
``position_bias`` (T5's relative bias, already a dense ``(1, H, Tq, Tk)`` tensor, with its
gradient into the bias table) become :func:`attnlab.attention`'s ``score_mod`` and ``sinks``:
softcap first, then the bias, then the mask, as the models' eager code applies them.
Weights returned with sinks are attnlab's: the softmax over the keys and the sink, the sink's
column dropped (rows sum to less than 1), as gpt-oss's eager code returns them. Granite-SWA's eager
code returns the softmax over the keys alone and applies the sink to the output afterwards: the
outputs agree, its returned weights are these divided by their row sums.

Packed documents (``cu_seq_lens_q/k``, or ``position_ids`` restarting at 0 inside a row) are kept
apart: each token's document ANDs "same document" with the call's mask, causality and window, as
attnlab's ``document_mod`` where the model built no dense mask, so logits and gradients equal each
document run alone (docs/models.md, "Packed training"). MiniMax-M3's ``block_indices`` become the
keys of each selected block on :func:`attnlab.attention`'s top-k path (``indices=``).

Where transformers' sdpa path differs from its eager path, attnlab (on sdpa's masks) follows sdpa:
a padded query with no key to attend gets a zero row (eager spreads it over every key, so padded
positions differ), and AIMv2's text layers, which declare ``is_causal=False`` and take a causal mask,
attend both ways when the mask is all ones and sdpa's builder leaves the plain causal mask out.

A float mask (e.g. made by "eager" mask builders or passed by the user as a prepared 4-D mask)
is added to the scores, as transformers does. When weights are asked for (an
``output_attentions`` keyword, or transformers' ``capture_outputs`` recording ``attentions``:
GPT-2 pops the keyword and records each layer's returned weights with hooks) they come from
``attnlab.attention(..., return_weights=True)``: the output still comes from the fast path.

Example:
    >>> from attnlab.integrations.transformers import register
    >>> register()                                     # doctest: +SKIP
    'attnlab'
    >>> # AutoModel.from_pretrained(path, attn_implementation="attnlab")
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import warnings
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from attnlab import masks as _masks
from attnlab import scores as _scores
from attnlab.functional import attention
from attnlab.integrations import deepseek_v4
from attnlab.integrations._refusals import IGNORED_KEYWORDS, REFUSAL
from attnlab.integrations._refusals import describe as _describe
from attnlab.integrations._refusals import refusal as _refusal

__all__ = ["register", "attention_forward", "recording", "DEFAULT_NAME", "TESTED_VERSIONS", "HONOURED_KEYWORDS",
           "IGNORED_KEYWORDS", "REFUSAL"]

DEFAULT_NAME = "attnlab"
TESTED_VERSIONS = ("5.23.0", "5.24.0", "5.25.0")
# transformers' built-in names: registering over them would change every model that uses them.
_RESERVED = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
             "flash_attention_4", "paged|eager")

# Keywords attention_forward applies, each as transformers' eager/sdpa paths do.
HONOURED_KEYWORDS = (
    "is_causal", "sliding_window", "softcap", "s_aux", "position_bias", "output_attentions",
    "cu_seq_lens_q", "cu_seq_lens_k",  # packed documents, kept apart (docs/models.md, "Packed training")
    "position_ids",  # packed documents where they restart inside a row (Tq == Tk)
    "indices",  # sparse attention's top-k keys per query (DeepSeek-V3.2), (B, Tq, k)
    "block_indices",  # top-k key blocks per query and key head (MiniMax-M3), (B, Hkv, Tq, k)
    "sinks",  # per-query sink logits (Inkling2), (B, H, Tq, 1)
)
# Any other keyword with a value other than None is refused, naming the module and the keyword.


def attention_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature, computed by :func:`attnlab.attention`.

    Shapes:
        query ``(B, H, Tq, D)``; key, value ``(B, Hkv, Tk, D)`` (``H`` a multiple of ``Hkv``);
        attention_mask broadcastable to ``(B, H, Tq, Tk)`` (bool, True = attend; or float,
        added) or None -> ``(out (B, Tq, H, D), weights (B, H, Tq, Tk) or None)``.

    Returns:
        The output and, when asked for, the weights: the softmax over the keys and, with sinks
        (``s_aux``, ``sinks``), the sink's column dropped, so each row sums to 1 minus the sink's
        share. gpt-oss's and Inkling2's eager code return the same; Granite-SWA's eager returns
        the softmax over the keys alone (rows sum to 1), which is these divided by their row sums.

    Args:
        module: the calling attention layer (``is_causal``, ``training``, ``config`` are read).
        query, key, value: projected heads.
        attention_mask: the mask transformers prepared, or None.
        scaling: score multiplier (default ``1 / sqrt(D)``).
        dropout: attention dropout, applied only when ``module.training``.
        **kwargs: :data:`HONOURED_KEYWORDS` are applied: ``is_causal``, ``sliding_window`` (the
            keys a query sees, ending at its own position; applied when there is no prepared
            mask), ``softcap`` (a float), ``s_aux`` (``(H,)`` sink logits), ``sinks`` (``(B, H, Tq, 1)``, one per query), ``position_bias``
            (an additive tensor broadcasting to ``(B, H, Tq, Tk)``), ``indices`` (``(B, Tq, k)``
            top-k keys per query, intersected with the mask), ``block_indices`` (``(B, Hkv, Tq, k)``
            top-k blocks of ``config.index_block_size`` keys, ``-1`` for none: MiniMax-M3),
            ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``position_ids`` (packed documents, kept
            apart: :func:`_document_ids`), ``output_attentions``;
            :data:`IGNORED_KEYWORDS` change nothing, as in transformers' eager path.

    Raises:
        ValueError: any other keyword whose value is not None, naming the module's class.

    Example:
        >>> layer = nn.Module()
        >>> layer.is_causal = True
        >>> q, kv = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)   # 4 query heads, 2 kv heads
        >>> out, weights = attention_forward(layer, q, kv, kv, None)
        >>> out.shape, weights is None
        (torch.Size([1, 5, 4, 8]), True)
        >>> attention_forward(layer, q, kv, kv, None, band_mask=torch.zeros(1, 4, 5, 2))
        Traceback (most recent call last):
        ...
        ValueError: Module cannot run on attnlab: it passes the keyword band_mask, which attnlab does not apply ...
    """
    _check_kinds(module, query, key, value, attention_mask)
    _check_keywords(module, kwargs)
    if attention_mask is None and deepseek_v4.unadapted(module):
        raise _refusal(type(module).__name__, "its model's mask was left out for attnlab's compressed path, but this "
                                              "layer is not on it (its model shares the config of one built with "
                                              "attnlab?), so its compressed entries would come without their block "
                                              "mask; give each model its own config")
    tq, tk = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is not None and mask.shape[-1] > tk:
        mask = mask[..., :tk]  # a static cache's mask can be longer than the keys filled so far
    causal = False
    if mask is None and not _eager_masks(getattr(module, "config", None)):
        mask, causal = _sdpa_rule(module, kwargs, tq, tk)
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    documents = _document_ids(module, kwargs, mask, batch=query.shape[0], tq=tq, tk=tk)
    if documents is not None:
        mask, causal = _keep_apart(mask, causal, documents)
    want_weights = _wants_weights(module, kwargs)
    options = dict(mask=mask, causal=causal, align="top_left", scale=scaling, score_mod=_score_mod(kwargs, tk),
                   sinks=_sinks(kwargs), indices=_indices(module, kwargs, tk))
    recorder = _RECORDER.get()
    if recorder is not None:
        recorder(module, query, key, value, **options)
    result = attention(query, key, value, dropout_p=dropout if module.training else 0.0,
                       return_weights=want_weights, **options)
    out, weights = result if want_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights  # (B, Tq, H, D)


_RECORDER: ContextVar[Callable | None] = ContextVar("attnlab_transformers_recorder", default=None)


@contextmanager
def recording(recorder: Callable):
    """While active, every layer's call is shown to ``recorder`` before it runs (what a lens records).

    ``recorder(module, query, key, value, *, mask, causal, align, scale, score_mod, sinks, indices)``
    gets exactly what :func:`attention_forward` passes to :func:`attnlab.attention`, so the queries
    and keys a view keeps (after rotary embeddings, before grouped-query repetition) and the rules it
    recomputes weights with are the fast path's own. Scoped to this context (and thread); the
    output is unchanged.

    Example:
        >>> seen = []
        >>> layer = nn.Module(); layer.is_causal = True
        >>> with recording(lambda module, q, k, v, **options: seen.append((q.shape, options["causal"]))):
        ...     _ = attention_forward(layer, torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4),
        ...                           torch.randn(1, 2, 3, 4), None)
        >>> seen
        [(torch.Size([1, 2, 3, 4]), True)]
    """
    if not callable(recorder):
        raise TypeError(f"recorder must be callable, got {type(recorder).__name__}")
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def _sinks(kwargs: dict) -> Tensor | None:
    """A layer's sink logits as :func:`attnlab.attention` takes them: gpt-oss's per-head ``s_aux``
    ``(H,)``, or per-query ``sinks`` ``(B, H, Tq, 1)`` (Inkling2) as ``(B, H, Tq)``."""
    per_head, per_query = kwargs.get("s_aux"), kwargs.get("sinks")
    if per_query is None:
        return per_head
    if per_head is not None:
        raise ValueError("s_aux and sinks were both passed; a layer has one sink logit per row")
    if not isinstance(per_query, Tensor) or per_query.ndim != 4 or per_query.shape[-1] != 1:
        raise ValueError(f"sinks must be a (B, H, Tq, 1) tensor of sink logits, got {_describe(per_query)}")
    return per_query.squeeze(-1)  # (B, H, Tq)


def _indices(module: nn.Module, kwargs: dict, tk: int) -> Tensor | None:
    """Sparse attention's selected keys as :func:`attnlab.attention` takes them, ``(B, 1|Hkv, Tq, k)``,
    ``-1`` for none; the call's mask still applies to them.

    DeepSeek-V3.2's ``indices`` ``(B, Tq, k)`` list keys, one list per query shared by the heads.
    MiniMax-M3's ``block_indices`` ``(B, Hkv, Tq, k)`` list blocks of ``config.index_block_size``
    keys per key head (``-1``: none), which its eager code expands to every key of each block:
    so are they here, the slots past the last key dropped.
    """
    indices, blocks = kwargs.get("indices"), kwargs.get("block_indices")
    if indices is not None and blocks is not None:
        raise ValueError("indices and block_indices were both passed; a layer selects keys one way")
    if blocks is not None:
        return _keys_of_blocks(module, blocks, tk)
    if indices is None:
        return None
    if not isinstance(indices, Tensor) or indices.ndim != 3:
        raise ValueError(f"indices must be a (B, Tq, k) tensor of key positions, got {_describe(indices)}")
    return indices.unsqueeze(1)  # (B, 1, Tq, k)


def _keys_of_blocks(module: nn.Module, blocks: object, tk: int) -> Tensor:
    """``block_indices`` ``(B, Hkv, Tq, kb)`` as the keys of those blocks ``(B, Hkv, Tq, min(kb * size, Tk))``."""
    size = getattr(getattr(module, "config", None), "index_block_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise _refusal(type(module).__name__, "it passes block_indices but its config has no positive "
                                              f"index_block_size (got {size!r}), so its blocks' keys are unknown")
    if not isinstance(blocks, Tensor) or blocks.ndim != 4 or blocks.is_floating_point():
        raise ValueError(f"block_indices must be a (B, Hkv, Tq, k) integer tensor of key blocks, "
                         f"got {_describe(blocks)}")
    offsets = torch.arange(size, device=blocks.device)
    keys = blocks.long()[..., None] * size + offsets  # (B, Hkv, Tq, kb, size)
    keys = keys.masked_fill((blocks[..., None] < 0) | (keys >= tk), -1).flatten(-2)  # (B, Hkv, Tq, kb * size)
    if keys.shape[-1] > tk:  # a last block cut short: at most tk keys are listed, -1 sorted last
        keys = keys.sort(dim=-1, descending=True).values[..., :tk]
    return keys


def _sdpa_rule(module: nn.Module, kwargs: dict, tq: int, tk: int) -> tuple[_masks.MaskMod | None, bool]:
    """What transformers' sdpa path applies when it gets no mask: ``(mask, causal)``.

    The sdpa mask builder leaves out a plain causal mask, so causality comes from ``is_causal``
    (or ``module.is_causal``) and applies to several queries only, aligned top-left (one decoding
    query sees every cached key); a layer's ``sliding_window`` then applies on the same diagonal.
    """
    is_causal = kwargs.get("is_causal")
    is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    causal = is_causal and tq > 1
    window = kwargs.get("sliding_window")
    if is_causal and window is not None:
        mod = _window_mod(tq, tk, window)
        if mod is not None:
            return mod, False
    return None, causal


def _document_ids(module: nn.Module, kwargs: dict, mask: object, *, batch: int, tq: int, tk: int) -> Tensor | None:
    """The document of each token of a packed call, ``(B|1, T)`` int64, or None when it packs none.

    From ``cu_seq_lens_q``/``cu_seq_lens_k`` (the boundaries flash paths receive; they index the
    ``B * T`` tokens flattened, and tokens past the last boundary form one more document), else
    from ``position_ids`` ``(B|1, T)``: a document starts at each real token of position 0 inside a
    row, as DataCollatorWithFlattening writes them. A padded token (a key the model's dense
    ``mask`` shows to no query) starts none: ``generate`` gives padded tokens position 0 or 1,
    and a right-padded row's last, padded query must still see the real keys, as in eager. A
    step up by more than one (a grid of image patches) starts none either. Positions are read
    only when queries and keys are the same tokens (``Tq == Tk``): with a cache, the cached
    keys' documents are unknown and the model's mask alone applies, as in transformers' eager
    and sdpa paths.

    Raises:
        ValueError: boundaries that are not a 1-D ascending integer tensor from 0 within the
            ``B * T`` tokens, or that cannot keep documents apart (queries and keys of
            different lengths or with different boundaries), naming the module's class.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        return _ids_from_boundaries(type(module).__name__, cu_q, cu_k, batch=batch, tq=tq, tk=tk)
    positions = kwargs.get("position_ids")
    if tq != tk or tq < 2 or not isinstance(positions, Tensor) or positions.ndim != 2 \
            or positions.shape[-1] != tq or positions.is_floating_point():
        return None
    restarts = positions[:, 1:] == 0  # (B|1, T - 1)
    if not bool(restarts.any()):  # the common unpacked call: no O(T^2) scan of the mask below
        return None
    if isinstance(mask, Tensor) and mask.ndim == 4:
        seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        restarts = restarts & seen.any(dim=-2).any(dim=1)[:, 1:]  # real keys only, (B|1, T - 1)
        if not bool(restarts.any()):
            return None
    return torch.cat([torch.zeros_like(restarts[:, :1]), restarts], dim=1).cumsum(1)  # (B|1, T)


def _ids_from_boundaries(owner: str, cu_q: object, cu_k: object, *, batch: int, tq: int, tk: int) -> Tensor:
    """Document ids ``(B, T)`` from ``cu_seq_lens`` (see :func:`_document_ids`)."""
    for name, value in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(value, Tensor) or value.ndim != 1 or value.numel() < 2 or value.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor of document boundaries, got {_describe(value)}")
    if tq != tk or cu_q.shape != cu_k.shape or not torch.equal(cu_q.to(torch.int64), cu_k.to(torch.int64)):
        raise _refusal(owner, "its packed documents cannot be kept apart: cu_seq_lens_q and cu_seq_lens_k "
                              f"differ (or queries {tq} and keys {tk} differ in length), so a query's own "
                              "document among the keys is unknown")
    bounds = cu_q.to(torch.int64)
    if bounds[0].item() != 0 or bool((bounds.diff() < 0).any()) or bounds[-1].item() > batch * tq:
        raise ValueError(f"cu_seq_lens_q must ascend from 0 to at most the {batch * tq} tokens of the call, "
                         f"got {bounds.tolist()}")
    flat = torch.arange(batch * tq, device=bounds.device)
    return torch.searchsorted(bounds[1:], flat, right=True).view(batch, tq)  # (B, T)


def _keep_apart(mask: Tensor | _masks.MaskMod | None, causal: bool, documents: Tensor):
    """``(mask, causal)`` ANDed with "a query sees only keys of its own document".

    A dense mask the model built stays dense (the other documents' keys become False, or
    ``-inf`` in a float mask) beside ``causal``; otherwise the rule is attnlab's document mask
    mod, causal as the call is, ANDed with a window mod, so the fast paths skip other documents.
    """
    if isinstance(mask, Tensor):
        same = documents[:, None, :, None] == documents[:, None, None, :]  # (B|1, 1, T, T)
        if mask.dtype == torch.bool:
            return mask & same, causal
        return mask.masked_fill(~same, float("-inf")), causal
    apart = _masks.document_mod(documents, causal=causal)
    return (apart if mask is None else apart & mask), False


def _check_keywords(module: nn.Module, kwargs: dict) -> None:
    """Refuse, rather than drop, a keyword attnlab does not apply (one whose value is not None)."""
    for name, value in kwargs.items():
        if value is None or name in IGNORED_KEYWORDS:
            continue
        if name not in HONOURED_KEYWORDS:
            raise _refusal(type(module).__name__,
                           f"it passes the keyword {name}, which attnlab does not apply (its value: "
                           f"{_describe(value)}); computing without it would give another attention")


def _score_mod(kwargs: dict, tk: int) -> _scores.ScoreMod | None:
    """A layer's ``softcap`` and ``position_bias`` as one score mod, in the models' order."""
    mods = []
    softcap = kwargs.get("softcap")
    if softcap is not None:
        mods.append(_scores.softcap(softcap))
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        if position_bias.shape[-1] > tk:  # as the mask: a static cache's can be longer
            position_bias = position_bias[..., :tk]
        mods.append(_scores.bias(position_bias))
    return _scores.compose(*mods) if mods else None


def _check_kinds(module: object, query: object, key: object, value: object, mask: object) -> None:
    """``TypeError`` naming the argument for a value of the wrong kind (sizes are checked later)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be the calling torch.nn.Module, got {type(module).__name__}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if mask is not None and not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if query.ndim != 4 or key.ndim != 4:
        raise ValueError(f"query and key must be (B, H, T, D); got query of shape {tuple(query.shape)} "
                         f"and key of shape {tuple(key.shape)}")


def _window_mod(tq: int, tk: int, window: object) -> _masks.SlidingWindowMod | None:
    """The causal window a layer without a prepared mask asks for, on the diagonal causality uses
    (None when every key is inside it).

    transformers' window (``masking_utils.sliding_window_overlay``) lets a query see the
    ``window`` keys ending at its own position. Several queries are placed top-left, as the
    causal rule above (sdpa's ``is_causal``, a static cache's prefill); one decoding query is
    the newest token, so it sees the last ``window`` keys (bottom-right).
    """
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"sliding_window must be an int, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"sliding_window must be a positive int, got {window}")
    align = "top_left" if tq > 1 else "bottom_right"
    if tq + _masks.causal_offset(tq, tk, align) <= window:
        return None  # the last query's window starts at key 0: the causal rule alone serves
    return _masks.sliding_window_mod(tq, tk, window, align=align)


def _wants_weights(module: nn.Module, kwargs: dict) -> bool:
    """Whether the caller will use the attention weights.

    Models whose forward is wrapped in transformers' ``capture_outputs`` record the weights a
    layer returns through forward hooks while its output collector holds an ``...attentions``
    entry, whatever keyword the layer passes (GPT-2 pops it; Voxtral's encoder layers pass
    ``output_attentions=False`` themselves): the collector is what transformers consults, so it
    decides first. Then an ``output_attentions`` keyword; then the layer's own ``output_attentions``
    parameter where it keeps it from the attention function (:func:`_layer_parameter`, Falcon);
    outside all of them, ``config.output_attentions``.
    """
    asked = kwargs.get("output_attentions")
    recording = _recorded_outputs()
    if recording is not None and any(key.endswith("attentions") for key in recording):
        return True
    if asked is None and recording is None:
        asked = _layer_parameter(module, "output_attentions")
    if asked is not None or recording is not None:
        return bool(asked)
    return bool(getattr(getattr(module, "config", None), "output_attentions", False))


def _layer_parameter(module: nn.Module, name: str, *, depth: int = 8) -> object:
    """The value of parameter ``name`` of ``module``'s own ``forward`` in the call running now, or None.

    Falcon's attention layer takes ``output_attentions`` as a parameter of its ``forward`` and
    calls the attention function without it, while its model returns each layer's weights when
    it is True: the layer's frame is the only place that says so. Only a frame running
    ``type(module).forward``'s own code (decorators unwrapped) among the ``depth`` nearest
    callers is read, and only a name that ``forward`` declares.
    """
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None or name not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        return None
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is code and frame.f_locals.get("self") is module:
            return frame.f_locals.get(name)
        frame = frame.f_back
    return None


def _recorded_outputs() -> dict | None:
    """The outputs transformers' active ``capture_outputs`` collects, or None outside one."""
    for where in ("transformers.utils.output_capturing", "transformers.utils.generic"):
        try:
            collector = getattr(importlib.import_module(where), "_active_collector", None)
        except ImportError:
            continue
        if collector is not None:
            recording = collector.get()
            return recording if isinstance(recording, dict) else None
    return None


# The configs of models transformers has not validated with sdpa: they get eager's masks. Kept
# here, by the config's id with a weak reference to it, never on the config itself: an attribute
# there was written into config.json by save_pretrained (a config is unhashable, so no
# WeakKeyDictionary). An entry goes with its config.
_EAGER_CONFIGS: dict[int, weakref.ref] = {}
_SDPA_CONFIGS: dict[int, weakref.ref] = {}  # and those given sdpa's
# Per config class, whether every model checked with one got eager's masks: a config no model was
# checked with (``copy.deepcopy`` of a model copies its config) then gets eager's too, not sdpa's.
_EAGER_CLASSES: dict[type, bool] = {}
# A dict of attention classes keyed by implementation name (GIT, SAM, SuperGlue, ...).
_CLASS_TABLE = re.compile(r"_ATTENTION_CLASSES\s*\[\s*(self\.)?config\._attn_implementation")
_OWN_ATTENTION = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)


def _eager_masks(config: object) -> bool:
    """Whether ``config`` belongs to a model that gets eager's mask convention (see :func:`register`);
    a config no model was checked with gets eager's if every model of its class did (:data:`_EAGER_CLASSES`)."""
    if _known(_EAGER_CONFIGS, config):
        return True
    return _EAGER_CLASSES.get(type(config), False) and not _known(_SDPA_CONFIGS, config)


def _known(table: dict, config: object) -> bool:
    ref = table.get(id(config))
    return ref is not None and ref() is config


def _remember_masks(config: object, *, eager: bool) -> None:
    """Remember ``config``'s mask convention for as long as ``config`` lives (nothing is written on it),
    and its class's."""
    _EAGER_CLASSES[type(config)] = eager and _EAGER_CLASSES.get(type(config), True)
    key = id(config)
    if eager:
        _SDPA_CONFIGS.pop(key, None)
        if not _known(_EAGER_CONFIGS, config):
            _EAGER_CONFIGS[key] = weakref.ref(config, lambda dead, key=key: _forget(_EAGER_CONFIGS, key, dead))
    else:
        _EAGER_CONFIGS.pop(key, None)
        if not _known(_SDPA_CONFIGS, config):
            _SDPA_CONFIGS[key] = weakref.ref(config, lambda dead, key=key: _forget(_SDPA_CONFIGS, key, dead))


def _forget(table: dict, key: int, dead: weakref.ref) -> None:
    """Drop a dead config's entry (unless its id already serves a newer config)."""
    if table.get(key) is dead:
        del table[key]


def _attention_outside_interface(model_class: type) -> str | None:
    """Why ``model_class``'s own layers compute attention without transformers' attention
    interface (so ``attn_implementation`` never reaches attnlab there), or None.

    transformers' own test (``PreTrainedModel._can_set_attn_implementation``): the modeling
    module defines ``*Attention*(nn.Module)`` classes but never calls
    ``ALL_ATTENTION_FUNCTIONS.get_interface``; or it picks attention classes from a table keyed by
    the implementation's name, which has no entry for attnlab. A module without readable source
    (a class defined in a notebook) is given the benefit of the doubt.
    """
    try:
        code = inspect.getsource(sys.modules[model_class.__module__])
    except (KeyError, OSError, TypeError):
        return None
    if _CLASS_TABLE.search(code):
        return "it picks attention classes from a table keyed by the implementation's name"
    if _OWN_ATTENTION.search(code) and "ALL_ATTENTION_FUNCTIONS.get_interface(" not in code:
        return "it computes attention in its own layers, not through transformers' attention interface"
    return None


def _check_model(model: nn.Module) -> None:
    """At build time: refuse a model attnlab cannot serve; choose its mask convention.

    A model transformers runs with sdpa gets sdpa's masks (bool, None for a plain causal or
    full pattern; :func:`attention_forward` applies ``is_causal`` as sdpa does). A model without
    sdpa support was written for eager, whose masks are always built and additive: DeepSeek-V4
    and BigBird-Pegasus add floats to them, NLLB-MoE's decoder relies on them for causality,
    Splinter and BridgeTower declare no ``is_causal`` on bidirectional layers. It gets eager's.
    """
    reason = _attention_outside_interface(type(model))
    if reason is not None:
        raise _refusal(type(model).__name__, reason + "; load it with attn_implementation='eager'")
    _remember_masks(model.config, eager=not getattr(model, "_supports_sdpa", False))
    if type(model).__module__.endswith(".modeling_deepseek_v4"):
        _compressed_layers(model)


def _compressed_layers(model: nn.Module) -> None:
    """DeepSeek-V4's layers on CompressedAttention (:mod:`attnlab.integrations.deepseek_v4`): now if
    they exist (``set_attn_implementation``), else on the model's first forward (a hook that then
    removes itself), since transformers checks the implementation before it builds the layers."""
    if deepseek_v4.adapt(model) or getattr(model, "_attnlab_adapt_hook", None) is not None:
        return

    def adapt_once(module: nn.Module, args: tuple) -> None:
        deepseek_v4.adapt(module)
        module.__dict__.pop("_attnlab_adapt_hook").remove()

    model.__dict__["_attnlab_adapt_hook"] = model.register_forward_pre_hook(adapt_once)


def _install_build_check(pretrained_model: type, names: set) -> None:
    """Wrap ``PreTrainedModel.get_correct_attn_implementation`` -- where transformers checks an
    implementation name while a model is built (``from_pretrained``, ``from_config``, the
    constructor) or switched (``set_attn_implementation``) -- so that it also runs
    :func:`_check_model` for a name :func:`register` registered. transformers accepts any
    registered name without asking the model; this is the one place it could."""
    original = pretrained_model.get_correct_attn_implementation
    if getattr(original, "_attnlab_names", None) is not None:
        original._attnlab_names.update(names)
        return

    def get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
        applicable = original(self, requested_attention, is_init_check)
        if applicable in get_correct_attn_implementation._attnlab_names:
            _check_model(self)
        return applicable

    get_correct_attn_implementation._attnlab_names = set(names)
    get_correct_attn_implementation.__doc__ = original.__doc__
    pretrained_model.get_correct_attn_implementation = get_correct_attn_implementation


def _mask_builder(sdpa_mask, eager_mask):
    """transformers' mask builder for a registered name: eager's for the configs
    :func:`_check_model` gave eager's convention, sdpa's otherwise; none at all for a DeepSeek-V4
    model on attnlab's compressed path when the mask would be the plain sliding-window one
    (:func:`_plain_compressed_call`)."""
    def attnlab_mask(*args, config=None, **kwargs):
        if _plain_compressed_call(config, kwargs):
            return None
        build = eager_mask if _eager_masks(config) else sdpa_mask
        return build(*args, config=config, **kwargs)
    return attnlab_mask


def _plain_compressed_call(config: object, kwargs: dict) -> bool:
    """Whether a mask for ``config`` can be left out because its layers compute it themselves:
    every DeepSeek-V4 layer is on the compressed path, transformers allows the skip (no packed
    sequences, no mask overlays), no row is padded and no attention weights are asked for."""
    if not deepseek_v4.served(config) or not kwargs.get("allow_is_causal_skip", True):
        return False
    padding = kwargs.get("attention_mask")
    if isinstance(padding, Tensor) and not bool(padding.all()):
        return False
    recording = _recorded_outputs()
    if recording is not None:
        return not any(key.endswith("attentions") for key in recording)
    return not getattr(config, "output_attentions", False)


def register(name: str = DEFAULT_NAME) -> str:
    """Make ``attn_implementation=name`` run transformers models on :func:`attnlab.attention`.

    Registers :func:`attention_forward` with ``transformers.AttentionInterface`` and a mask
    builder with ``AttentionMaskInterface`` under ``name``, and has transformers check each model
    built with ``name``: one whose layers compute attention outside transformers' attention
    interface (BLOOM, MPT, Longformer, GIT, SAM, ...) is refused with ``ValueError``; one
    transformers runs with sdpa gets sdpa's bool masks (True = attend; None for a plain causal or
    full pattern); any other gets eager's additive float masks, as its eager code expects.
    Calling it again is harmless.

    Raises:
        ImportError: transformers is not installed (``pip install 'attnlab[hf]'``) or too old.
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is empty or one of transformers' built-in implementations.

    Example:
        >>> from attnlab.integrations.transformers import register
        >>> register("attnlab")                                          # doctest: +SKIP
        'attnlab'
        >>> # model = AutoModel.from_pretrained(path, attn_implementation="attnlab")
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or name in _RESERVED:
        raise ValueError(f"name must be a non-empty string other than {', '.join(_RESERVED)}; got {name!r}")
    try:  # imported here: attnlab itself never needs transformers
        with warnings.catch_warnings():  # its tqdm.auto warns on stderr in a notebook without ipywidgets
            warnings.filterwarnings("ignore", message="IProgress not found")
            from transformers import AttentionInterface, PreTrainedModel
            from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    except ImportError as exc:
        raise ImportError(
            f"register needs transformers 5.x (tested {', '.join(TESTED_VERSIONS)}): "
            f"pip install 'attnlab[hf]' ({exc})"
        ) from None
    deepseek_v4.register_name(name)
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _mask_builder(sdpa_mask, eager_mask))
    _install_build_check(PreTrainedModel, {name})
    return name
