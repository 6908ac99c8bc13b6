"""Run Hugging Face transformers models on :func:`attnlab.attention`: ``register()``.

Tested with transformers 5.23.0 and 5.24.0 (torch 2.13 CPU); it needs transformers 5.x, whose attention
layers call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` and whose mask builders
(``masking_utils.create_causal_mask`` / ``create_bidirectional_mask`` / the sliding-window one)
call ``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]``.

**Mechanism.** :func:`register` registers two things under one name:

1. :func:`attention_forward` with ``transformers.AttentionInterface``: it receives
   ``query (B, H, Tq, D)``, ``key``/``value`` ``(B, Hkv, Tk, D)`` and the prepared mask, calls
   :func:`attnlab.attention` (grouped-query heads, ``scaling``, dropout in training) and returns
   ``(out (B, Tq, H, D), weights or None)``.
2. transformers' own ``sdpa_mask`` with ``AttentionMaskInterface``. This is required: for a name
   missing there, transformers builds **no mask at all** (its ``_preprocess_mask_arguments``
   returns None for unknown implementations), so a padded batch would silently attend to its
   padding and a causal model would rely on ``is_causal`` alone. ``sdpa_mask`` yields a bool
   ``(B, 1, Tq, Tk)`` mask with transformers' polarity **True = attend** -- attnlab's polarity --
   with causality, padding and sliding windows folded in, or None when the pattern is plain
   causal / full without padding; then, as transformers' sdpa path does, causality comes from
   ``is_causal`` (or ``module.is_causal``) and applies when ``Tq > 1``, aligned top-left. A
   layer's ``sliding_window`` then applies on the same diagonal (one decoding query sees the last
   ``sliding_window`` keys); a prepared mask already holds the window, as in transformers' eager
   and sdpa paths.

A layer's ``softcap`` (Gemma 2, Gemma 3), ``s_aux`` (gpt-oss's per-head sinks) and
``position_bias`` (T5's relative bias, already a dense ``(1, H, Tq, Tk)`` tensor, with its
gradient into the bias table) become :func:`attnlab.attention`'s ``score_mod`` and ``sinks``:
softcap first, then the bias, then the mask, as the models' eager code applies them.

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

import torch
from torch import Tensor, nn

from attnlab import masks as _masks
from attnlab import scores as _scores
from attnlab.functional import attention

__all__ = ["register", "attention_forward", "DEFAULT_NAME", "TESTED_VERSIONS"]

DEFAULT_NAME = "attnlab"
TESTED_VERSIONS = ("5.23.0", "5.24.0")
# transformers' built-in names: registering over them would change every model that uses them.
_RESERVED = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
             "flash_attention_4", "paged|eager")


def attention_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature, computed by :func:`attnlab.attention`.

    Shapes:
        query ``(B, H, Tq, D)``; key, value ``(B, Hkv, Tk, D)`` (``H`` a multiple of ``Hkv``);
        attention_mask broadcastable to ``(B, H, Tq, Tk)`` (bool, True = attend; or float,
        added) or None -> ``(out (B, Tq, H, D), weights (B, H, Tq, Tk) or None)``.

    Args:
        module: the calling attention layer (``is_causal``, ``training``, ``config`` are read).
        query, key, value: projected heads.
        attention_mask: the mask transformers prepared, or None.
        scaling: score multiplier (default ``1 / sqrt(D)``).
        dropout: attention dropout, applied only when ``module.training``.
        **kwargs: ``is_causal``, ``sliding_window`` (the keys a query sees, ending at its own
            position; applied when there is no prepared mask), ``output_attentions``,
            ``softcap`` (a float), ``s_aux`` (``(H,)`` sink logits) and ``position_bias`` (an
            additive tensor broadcasting to ``(B, H, Tq, Tk)``) are honoured.

    Example:
        >>> layer = nn.Module()
        >>> layer.is_causal = True
        >>> q, kv = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)   # 4 query heads, 2 kv heads
        >>> out, weights = attention_forward(layer, q, kv, kv, None)
        >>> out.shape, weights is None
        (torch.Size([1, 5, 4, 8]), True)
    """
    _check_kinds(module, query, key, value, attention_mask)
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    tq, tk = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is not None and mask.shape[-1] > tk:
        mask = mask[..., :tk]  # a static cache's mask can be longer than the keys filled so far
    # As transformers' sdpa path: a prepared mask already holds the causal pattern; without one,
    # causality applies only to several queries (one decoding query sees every cached key).
    causal = bool(is_causal) and mask is None and tq > 1
    window = kwargs.get("sliding_window")
    if bool(is_causal) and mask is None and window is not None:
        mask = _window_mod(tq, tk, window)
        causal = causal and mask is None
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    want_weights = _wants_weights(module, kwargs)
    result = attention(
        query, key, value, mask=mask, causal=causal, align="top_left", scale=scaling,
        dropout_p=dropout if module.training else 0.0, return_weights=want_weights,
        score_mod=_score_mod(kwargs, tk), sinks=kwargs.get("s_aux"),
    )
    out, weights = result if want_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights  # (B, Tq, H, D)


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

    An ``output_attentions`` keyword decides when the layer passes one. Models whose forward is
    wrapped in transformers' ``capture_outputs`` (GPT-2 pops the keyword before its layers run)
    record the weights a layer returns through forward hooks, only while its output collector
    holds an ``...attentions`` entry; that collector is what transformers itself consults, so it
    decides next. Outside such a forward, ``config.output_attentions`` does.
    """
    asked = kwargs.get("output_attentions")
    if asked is not None:
        return bool(asked)
    recording = _recorded_outputs()
    if recording is not None:
        return any(key.endswith("attentions") for key in recording)
    return bool(getattr(getattr(module, "config", None), "output_attentions", False))


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


def register(name: str = DEFAULT_NAME) -> str:
    """Make ``attn_implementation=name`` run transformers models on :func:`attnlab.attention`.

    Registers :func:`attention_forward` with ``transformers.AttentionInterface`` and
    transformers' ``sdpa_mask`` (bool masks, True = attend) with ``AttentionMaskInterface``
    under ``name``; calling it again is harmless.

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
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError(
            f"register needs transformers 5.x (tested {', '.join(TESTED_VERSIONS)}): "
            f"pip install 'attnlab[hf]' ({exc})"
        ) from None
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
