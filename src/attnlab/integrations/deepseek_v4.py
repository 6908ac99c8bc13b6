"""DeepSeek-V4 through ``attn_implementation="attnlab"``: its layers on CompressedAttention's math.

transformers' ``DeepseekV4Attention`` runs its compressor and lightning indexer *before* it calls the
attention interface, and builds dense tensors for them: the model's sliding-window mask
``(B, 1, T, T)`` (``create_sliding_window_causal_mask``, eager's float convention, since V4 has no
sdpa path), each compressed layer's block bias ``(B, 1, T, N)`` concatenated onto it
(``N = T / compress_rate``: T / 4 for CSA), the indexer's scores ``(B, T, index_heads, N)``. A function
behind the attention interface sees only the result, so it cannot avoid them. Here the whole layer
runs as :class:`attnlab.nn.CompressedAttention` (window, compressed entries and sink as one top-k
softmax, O(T * (window + k)) memory), on the layer's own parameters.

**Mechanism** (documented, reversible, nothing in transformers is patched):

1. :func:`adapt` (run by :func:`attnlab.integrations.transformers.register`'s build check, once the
   layers exist: on the model's first forward, or at ``set_attn_implementation``) changes the class of
   each ``DeepseekV4Attention`` instance to :class:`AttnlabDeepseekV4Attention`, a subclass whose
   ``forward`` is the parent's unless the config's implementation is an attnlab name *and* the mask it
   gets is None. Parameters, state dict, hooks and ``isinstance`` are unchanged; with ``eager`` (or any
   other implementation) the layer is transformers' own. A layer CompressedAttention cannot reproduce
   (attention dropout, a ``dynamic``/``longrope`` rotary) keeps the dense path, and so does its model.
2. The mask builder gives a config whose layers were all adapted **no mask** (None) when the mask
   would be the plain sliding-window causal one: no padding (``attention_mask`` absent or all ones),
   no packed sequences or mask overlays (transformers then forbids the skip), and no attention
   weights asked for. Otherwise it builds eager's dense mask and the layer runs transformers' dense
   path on :func:`~attnlab.integrations.transformers.attention_forward`, as before.
3. The layer's view (:func:`view`): ``CompressedAttention.from_transformers(layer, share=True)``, whose
   parameters are the layer's ``Parameter`` objects (no copy), kept per layer and rebuilt when the
   layer's parameters or device change. A transformers V4 cache layer is read and written through
   :meth:`attnlab.nn.CompressedCache.from_transformers` / ``to_transformers``, so ``generate`` and a
   cache filled by eager work unchanged.

The attnlab path refuses, with ``ValueError`` naming the value, what it cannot honour with no mask:
``position_ids`` other than the cache length onwards in every row (a model builds a mask for packed
or padded rows, so this means positions given by hand), and any keyword transformers' eager layer
would not ignore.

Example:
    >>> import torch
    >>> from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    >>> from attnlab.integrations.transformers import register
    >>> config = DeepseekV4Config(
    ...     vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, head_dim=8, q_lora_rank=8,
    ...     o_groups=1, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=2, n_routed_experts=2,
    ...     num_experts_per_tok=1, moe_intermediate_size=8, sliding_window=4, mlp_layer_types=["moe", "moe"],
    ...     compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    ...     layer_types=["compressed_sparse_attention", "heavily_compressed_attention"])
    >>> model = DeepseekV4ForCausalLM._from_config(config, attn_implementation=register()).eval()
    >>> model(torch.randint(0, 32, (1, 12))).logits.shape
    torch.Size([1, 12, 32])
    >>> served(model.config), type(model.model.layers[0].self_attn).__name__
    (True, 'AttnlabDeepseekV4Attention')
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from attnlab.integrations._refusals import IGNORED_KEYWORDS, describe, refusal
from attnlab.nn.compressed import CompressedAttention, CompressedCache

__all__ = ["AttnlabDeepseekV4Attention", "adapt", "view", "served"]

LAYER_CLASS = "DeepseekV4Attention"
# The implementation names register() registered: a layer takes the attnlab path only under them.
_NAMES: set[str] = set()
# Configs whose every attention layer was adapted, by id with a weak reference (as _EAGER_CONFIGS).
_SERVED: dict[int, weakref.ref] = {}
# Each adapted layer's view (a CompressedAttention sharing its parameters) and the parameters it was
# built on, kept while the layer lives.
_VIEWS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
_ADAPTED_CLASSES: dict[type, type] = {}


def register_name(name: str) -> None:
    """Let layers take the attnlab path under implementation ``name`` (called by ``register``)."""
    _NAMES.add(name)


def served(config: object) -> bool:
    """Whether ``config``'s model has every DeepSeek-V4 attention layer on the attnlab path.

    Example:
        >>> served(object())                  # no model was adapted with this config
        False
    """
    ref = _SERVED.get(id(config))
    return ref is not None and ref() is config


def _serve(config: object, yes: bool) -> None:
    key = id(config)
    if not yes:
        _SERVED.pop(key, None)
    elif not served(config):
        _SERVED[key] = weakref.ref(config, lambda dead, key=key: _SERVED.pop(key, None) if _SERVED.get(key) is dead
                                   else None)


def unadapted(module: nn.Module) -> bool:
    """Whether ``module`` is a DeepSeek-V4 attention layer left on transformers' path while its config
    is served (so the model built no mask that it needs)."""
    return (served(getattr(module, "config", None)) and not isinstance(module, AttnlabDeepseekV4Attention)
            and any(c.__name__ == LAYER_CLASS for c in type(module).__mro__))


def view(layer: nn.Module) -> CompressedAttention:
    """``layer``'s :class:`CompressedAttention`, sharing its parameters (built once, rebuilt when the
    layer's parameters are other objects or were moved to another device).

    Raises:
        ValueError: a layer CompressedAttention does not reproduce (``from_transformers``'s refusals).

    Example:
        >>> from transformers import DeepseekV4Config
        >>> from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention
        >>> config = DeepseekV4Config(hidden_size=16, num_attention_heads=2, head_dim=8, q_lora_rank=8, o_groups=1,
        ...                           o_lora_rank=8, sliding_window=4, num_hidden_layers=1, mlp_layer_types=["moe"],
        ...                           layer_types=["heavily_compressed_attention"])
        >>> layer = DeepseekV4Attention(config, 0)
        >>> module = view(layer)
        >>> module.kind, module.kv_proj.weight is layer.kv_proj.weight, view(layer) is module
        ('hca', True, True)
    """
    params = tuple(layer.parameters())
    held = _VIEWS.get(layer)
    if held is not None and len(held[1]) == len(params) and all(a is b for a, b in zip(held[1], params)) \
            and held[0].inv_freq.device == layer.kv_proj.weight.device:
        return held[0]
    module = CompressedAttention.from_transformers(layer, share=True)
    _VIEWS[layer] = (module, params)
    return module


def adapt(model: nn.Module) -> bool:
    """Put every DeepSeek-V4 attention layer of ``model`` on the attnlab path where it can go (see the
    module docstring); returns whether all of them could (then the mask builder leaves the mask out).

    Idempotent; a model without such layers is left alone (False).

    Example:
        >>> adapt(nn.Linear(2, 2))
        False
    """
    layers = [m for m in model.modules() if any(c.__name__ == LAYER_CLASS for c in type(m).__mro__)]
    if not layers:
        return False
    every = True
    for layer in layers:
        try:
            view(layer)
        except ValueError:
            every = False  # this layer keeps transformers' dense path (it gets a mask)
            continue
        if not isinstance(layer, AttnlabDeepseekV4Attention):
            layer.__class__ = _adapted_class(type(layer))
    config = layers[0].config
    _serve(config, every and all(layer.config is config for layer in layers))
    return served(config)


def _adapted_class(base: type) -> type:
    """The subclass of ``base`` (transformers' ``DeepseekV4Attention``) with
    :class:`AttnlabDeepseekV4Attention`'s forward, one per class."""
    adapted = _ADAPTED_CLASSES.get(base)
    if adapted is None:
        adapted = type("AttnlabDeepseekV4Attention", (AttnlabDeepseekV4Attention, base), {})
        adapted.__module__ = __name__
        _ADAPTED_CLASSES[base] = adapted
    return adapted


class AttnlabDeepseekV4Attention(nn.Module):
    """Mixed into transformers' ``DeepseekV4Attention`` by :func:`adapt`: its own forward unless the
    implementation is attnlab's and no mask was built; then CompressedAttention's on its parameters.

    Example:
        >>> from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention
        >>> adapted = _adapted_class(DeepseekV4Attention)
        >>> [cls.__name__ for cls in adapted.__mro__[:3]]
        ['AttnlabDeepseekV4Attention', 'AttnlabDeepseekV4Attention', 'DeepseekV4Attention']
    """

    def forward(self, hidden_states: Tensor, position_embeddings=None, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, cache=None, **kwargs):
        if "past_key_values" in kwargs and cache is None:  # transformers' deprecated name of ``cache``
            cache = kwargs.pop("past_key_values")
        if attention_mask is not None or self.config._attn_implementation not in _NAMES:
            return super().forward(hidden_states, position_embeddings, position_ids, attention_mask,
                                   cache=cache, **kwargs)
        return _compressed_forward(self, hidden_states, position_ids, cache, kwargs), None


def _compressed_forward(layer: nn.Module, x: Tensor, position_ids: Tensor | None, cache, kwargs: dict) -> Tensor:
    """CompressedAttention's forward on ``layer``'s parameters, reading and writing its cache layer."""
    for name, value in kwargs.items():
        if value is not None and name not in IGNORED_KEYWORDS:
            raise refusal(type(layer).__name__, f"it passes the keyword {name}, which attnlab's compressed path "
                                                  f"does not apply (its value: {describe(value)})")
    module = view(layer)
    if cache is not None and len(getattr(cache, "layers", ())) <= layer.layer_idx:
        raise ValueError(f"cache has no layer {layer.layer_idx}: give DeepSeek-V4 a DynamicCache(config=model.config) "
                         f"(its compressed layers' caches), got {type(cache).__name__}")
    cache_layer = None if cache is None else cache.layers[layer.layer_idx]
    ours = None if cache_layer is None else CompressedCache.from_transformers(
        cache_layer, module, batch_size=x.shape[0], dtype=x.dtype, device=x.device)
    _check_positions(layer, position_ids, 0 if ours is None else ours.length, x.shape[1])
    out = module(x, cache=ours)  # (B, T, d_model)
    if ours is not None:
        ours.to_transformers(cache_layer)
    return out


def _check_positions(layer: nn.Module, position_ids: object, past: int, T: int) -> None:
    """``ValueError`` unless every row's positions are ``past, past + 1, ...`` (what the path computes)."""
    if position_ids is None:
        return
    expected = past + torch.arange(T, device=position_ids.device)
    if position_ids.shape[-1] != T or not bool((position_ids == expected).all()):
        raise refusal(type(layer).__name__, f"its position_ids do not run from the cache length {past} by one "
                                              "in every row; with no mask (no padding), attnlab's compressed path "
                                              "places tokens by the cache alone; pass an attention_mask for "
                                              "padded rows, or use attn_implementation='eager'")
