"""Attention masks with one polarity, True = may attend: dense tensors and mask mods.

A **dense mask** broadcasts to ``(B, H, Tq, Tk)``: bool says which keys a query may attend, float
is added to the scores (``-inf`` blocks). A **mask mod** ``mod(b, h, q_idx, kv_idx) -> bool``
means what it returns for one position (FlexAttention's rule, so FlexAttention's mods run
unchanged); attnlab's mods also know which keys a block of queries can reach, so tiled backends
skip whole tiles. One constructor per pattern:

==================  ==========================  ===========================
pattern             mask mod                    dense bool tensor
==================  ==========================  ===========================
causal              :func:`causal_mod`          :func:`causal_mask`
sliding window      :func:`sliding_window_mod`  :func:`sliding_window_mask`
key padding         :func:`padding_mod`         :func:`padding_mask`
varlen causal       :func:`varlen_causal_mod`   :func:`materialize` the mod
packed documents    :func:`document_mod`        :func:`materialize` the mod
prefix-LM           :func:`prefix_lm_mod`       :func:`materialize` the mod
chunked local       :func:`chunked_local_mod`   :func:`materialize` the mod
combination         :func:`and_masks`,          either form
                    :func:`or_masks`
prepared per shape  :func:`prepare`             a mod, or an AND of them
==================  ==========================  ===========================

The modules: :mod:`~attnlab.masks.evaluation` (a mod on index grids), :mod:`~attnlab.masks.mods`
(:class:`MaskMod`, its bounds and value key, and/or), :mod:`~attnlab.masks.patterns` (the
patterns), :mod:`~attnlab.masks.prepared` (:func:`prepare`), :mod:`~attnlab.masks.dense`,
:mod:`~attnlab.masks.spans` (:func:`block_spans`: the keys each block of queries may reach).
The classes the functions return (``CausalMod``, ``DocumentMod``, ...) stay importable here as
types, for ``isinstance``.

Example:
    >>> from attnlab import masks
    >>> masks.causal_mask(2, 3, align="bottom_right")
    tensor([[ True,  True, False],
            [ True,  True,  True]])
    >>> mod = masks.and_masks(masks.causal_mod(4, 4), masks.sliding_window_mod(4, 4, window=2))
    >>> masks.materialize(mod, tq=4, tk=4).int()
    tensor([[[[1, 0, 0, 0],
              [1, 1, 0, 0],
              [0, 1, 1, 0],
              [0, 0, 1, 1]]]], dtype=torch.int32)
"""

from attnlab.masks.dense import causal_mask, padding_mask, sliding_window_mask
from attnlab.masks.evaluation import _first_line, _IndexWithTensors, _unevaluable, apply_mod, evaluate, materialize
from attnlab.masks.mods import (
    CombinedMod,
    MaskLike,
    MaskMod,
    and_masks,
    kv_range,
    mod_tensors,
    or_masks,
    value_only_key,
)
from attnlab.masks.patterns import (
    ALIGNMENTS,
    CausalMod,
    ChunkedLocalMod,
    DocumentMod,
    PaddingMod,
    PrefixLMMod,
    SlidingWindowMod,
    VarlenCausalMod,
    _occurrence_bounds,
    causal_mod,
    causal_offset,
    check_align,
    chunked_local_mod,
    document_mod,
    document_positions,
    padding_mod,
    prefix_lm_mod,
    sliding_window_mod,
    varlen_causal_mod,
)
from attnlab.masks.prepared import PreparedMask, has_row_ranges, prepare
from attnlab.masks.spans import block_spans

__all__ = [
    # the patterns, one constructor each (mask mods, then dense tensors)
    "causal_mod",
    "sliding_window_mod",
    "padding_mod",
    "varlen_causal_mod",
    "document_mod",
    "prefix_lm_mod",
    "chunked_local_mod",
    "causal_mask",
    "sliding_window_mask",
    "padding_mask",
    "and_masks",
    "or_masks",
    "prepare",
    # alignment, positions
    "ALIGNMENTS",
    "causal_offset",
    "document_positions",
    # writing and reading mods
    "MaskMod",
    "materialize",
    "evaluate",
    "apply_mod",
    "kv_range",
    "value_only_key",
    "has_row_ranges",
    "block_spans",
]
