"""Dense bool masks ``(Tq, Tk)`` / ``(B, 1, 1, Tk)`` of the patterns that have a common dense form.

Each is its mask mod materialized (:func:`~attnlab.masks.evaluation.materialize`), so the two
forms agree by construction.
"""

from __future__ import annotations

from torch import Tensor

from attnlab._checks import has_values, non_negative_int
from attnlab.masks.evaluation import materialize
from attnlab.masks.patterns import PaddingMod, causal_mod, sliding_window_mod


def causal_mask(tq: int, tk: int | None = None, *, align: str = "top_left", device=None) -> Tensor:
    """Dense causal mask ``(tq, tk)``, True = may attend.

    Example:
        >>> causal_mask(3).int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    tk = tq if tk is None else tk
    return materialize(causal_mod(tq, tk, align=align), tq=tq, tk=tk, device=device)[0, 0]


def sliding_window_mask(
    tq: int, tk: int, window: int, *, align: str = "top_left", device=None
) -> Tensor:
    """Dense causal sliding-window mask ``(tq, tk)``: each query sees its last ``window`` keys.

    Example:
        >>> sliding_window_mask(3, 3, 2).int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [0, 1, 1]], dtype=torch.int32)
    """
    mod = sliding_window_mod(tq, tk, window, align=align)
    return materialize(mod, tq=tq, tk=tk, device=device)[0, 0]


def padding_mask(lengths: Tensor, max_len: int | None = None) -> Tensor:
    """Dense key-padding mask of shape ``(B, 1, 1, max_len)`` for ``(B, H, T, D)`` inputs.

    Position ``j`` of batch row ``b`` is True (may be attended) when ``j < lengths[b]``.
    For 3-D inputs ``(B, T, D)`` take ``mask[:, 0]``, shape ``(B, 1, max_len)``.

    Args:
        lengths: 1-D integer tensor ``(B,)`` of real sequence lengths (non-negative).
        max_len: padded length; defaults to ``lengths.max()``. Required when ``lengths`` is
            empty (a batch of 0 rows gives a mask of shape ``(0, 1, 1, max_len)``).

    Raises:
        TypeError: ``lengths`` is not a tensor of a signed integer dtype.
        ValueError: ``lengths`` is not 1-D, has a negative entry, or is empty (or on the meta
            device) without ``max_len``; ``max_len`` is not a non-negative int.

    Example:
        >>> padding_mask(torch.tensor([1, 3]), 3)[:, 0, 0]
        tensor([[ True, False, False],
                [ True,  True,  True]])
    """
    mod = PaddingMod(lengths)
    if max_len is None:
        if mod.lengths.numel() == 0 or not has_values(mod.lengths):
            raise ValueError(
                f"padding_mask cannot infer max_len from {'empty' if has_values(mod.lengths) else 'meta'} "
                f"lengths of shape {tuple(mod.lengths.shape)}; pass max_len"
            )
        max_len = int(mod.lengths.max())
    non_negative_int("max_len", max_len)
    dense = materialize(mod, tq=1, tk=max_len, batch=len(mod.lengths), device=mod.lengths.device)
    return dense.contiguous()  # (B, 1, 1, Tk)
