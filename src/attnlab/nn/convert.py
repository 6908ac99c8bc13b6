"""Conversion between :class:`~attnlab.nn.MultiHeadAttention` and ``torch.nn.MultiheadAttention``.

The two share the projection parameters' names by design, so a conversion copies them one by one.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.functional import attention
from attnlab.nn.kv_sharing import SharedKVAttention
from attnlab.nn.multihead import QKV, MultiHeadAttention

__all__ = ["from_torch", "to_torch"]


def from_torch(module: nn.MultiheadAttention, *, backend: str = "auto") -> MultiHeadAttention:
    """An equivalent attnlab module built from a ``torch.nn.MultiheadAttention``.

    The copy is non-causal (as torch's module is), has torch's ``kdim``/``vdim``, biases,
    dropout, dtype and device, and the same weights. attnlab modules are always batch
    first: for a torch module with ``batch_first=False`` transpose ``(T, B, C)`` inputs.
    torch's ``key_padding_mask`` (True = ignore) becomes ``mask=CallMask(padding=~key_padding_mask)``,
    and its ``key``/``value`` arguments become ``context=key, value_input=value``.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.MultiheadAttention``.
        ValueError: it uses ``add_bias_kv`` or ``add_zero_attn`` (no attnlab equivalent).

    Example:
        >>> ref = nn.MultiheadAttention(8, 2, batch_first=True).eval()
        >>> mha = from_torch(ref)
        >>> x = torch.randn(2, 5, 8)
        >>> torch.allclose(mha(x), ref(x, x, x, need_weights=False)[0], atol=1e-6)
        True
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("torch modules with add_bias_kv or add_zero_attn have no attnlab equivalent")
    weight = module.out_proj.weight
    new = MultiHeadAttention(
        module.embed_dim, module.embed_dim, None, module.dropout, module.num_heads, pattern=None, backend=backend,
        qkv=QKV(bias=module.in_proj_bias is not None, kdim=module.kdim, vdim=module.vdim,
                out_bias=module.out_proj.bias is not None),
    ).to(device=weight.device, dtype=weight.dtype)
    _copy_projections(new, module, to_torch=False)
    return new.train(module.training)


def to_torch(mha: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """An equivalent ``torch.nn.MultiheadAttention`` with the same weights.

    torch's module has one ``bias`` switch: when only one of ``qkv_bias``/``out_bias`` is
    set, the other bias is created as zeros (same outputs). torch's module is never causal
    by itself: for a causal attnlab module pass ``attn_mask``/``is_causal`` when calling it.

    Raises:
        TypeError: ``mha`` is not a :class:`~attnlab.nn.MultiHeadAttention`.
        ValueError: a setting torch's module cannot express, each named with its value:
            ``d_in != d_out``, heads of their own width (``QKV(head_dim=)``), grouped-query heads,
            a positions part (RoPE, ALiBi, a query temperature), a
            ``window``, a ``chunk``, a ``softcap``, learned ``sinks``, a ``qk_norm``, or an attention part
            other than :func:`attnlab.attention` (context parallelism's), a
            :class:`~attnlab.nn.SharedKVAttention` (no key/value projections). ``context_length``
            (a length check) and ``backend`` do not change outputs and are not carried.

    Example:
        >>> mha = MultiHeadAttention(8, 8, num_heads=2, pattern=None).eval()
        >>> ref = to_torch(mha)
        >>> x = torch.randn(2, 5, 8)
        >>> torch.allclose(mha(x), ref(x, x, x, need_weights=False)[0], atol=1e-6)
        True
    """
    if not isinstance(mha, MultiHeadAttention):
        raise TypeError(f"mha must be an attnlab MultiHeadAttention, got {type(mha).__name__}")
    inexpressible = _inexpressible(mha)
    if inexpressible:
        raise ValueError(f"torch.nn.MultiheadAttention cannot express {', '.join(inexpressible)} "
                         f"of this module (it needs d_in == d_out, num_kv_heads == num_heads, no positions, "
                         "window, chunk, softcap, sinks or qk_norm, and attnlab.attention as the attention part)")
    weight = mha.out_proj.weight
    has_bias = mha.in_proj_bias is not None or mha.out_proj.bias is not None
    module = nn.MultiheadAttention(
        mha.d_out, mha.num_heads, dropout=mha.dropout_p, bias=has_bias, kdim=mha.kdim,
        vdim=mha.vdim, batch_first=batch_first, device=weight.device, dtype=weight.dtype,
    )
    _copy_projections(mha, module, to_torch=True)
    return module.train(mha.training)


def _inexpressible(mha: MultiHeadAttention) -> list[str]:
    """``name=value`` of each of ``mha``'s settings that torch's module has no counterpart for.

    Every other attribute is carried: the projections and biases, ``kdim``/``vdim``, dropout,
    dtype, device and training mode; the scale is ``1/sqrt(head_dim)`` on both. ``causal`` is
    an argument of torch's call (``attn_mask``), ``context_length`` a length check only, and
    ``backend`` where attnlab computes, none of them a change of the output."""
    found = [] if mha.d_in == mha.d_out else [f"d_in={mha.d_in} != d_out={mha.d_out}"]
    if mha.d_q != mha.d_out:
        found.append(f"head_dim={mha.head_dim} (num_heads * head_dim = {mha.d_q}, not d_out={mha.d_out})")
    if mha.num_kv_heads != mha.num_heads:
        found.append(f"num_kv_heads={mha.num_kv_heads} (grouped heads)")
    for name in ("positions", "window", "chunk", "softcap", "sinks", "qk_norm"):  # qk_norm: the QKV part's
        value = getattr(mha, name)
        if value is not None:
            found.append("sinks (learned)" if name == "sinks" else f"{name}={value!r}")
    if isinstance(mha, SharedKVAttention):
        found.append("shared keys and values (a SharedKVAttention projects queries only)")
    if mha.attention is not attention:
        found.append(f"attention={getattr(mha.attention, '__qualname__', mha.attention)!r}")
    return found


def _copy_projections(ours: MultiHeadAttention, theirs: nn.MultiheadAttention, *, to_torch: bool) -> None:
    """Copy Q/K/V and output weights between the two layouts (they share names by design)."""
    names = ["in_proj_weight"] if ours.fused else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    pairs = [(getattr(ours, n), getattr(theirs, n)) for n in names]
    pairs += [(ours.in_proj_bias, theirs.in_proj_bias), (ours.out_proj.weight, theirs.out_proj.weight),
              (ours.out_proj.bias, theirs.out_proj.bias)]
    with torch.no_grad():
        for mine, other in pairs:
            source, target = (mine, other) if to_torch else (other, mine)
            if target is None:
                continue
            target.copy_(torch.zeros_like(target) if source is None else source)
