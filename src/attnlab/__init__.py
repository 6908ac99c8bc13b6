"""attnlab: attention mechanisms on PyTorch, readable, proven fast, and visible.

The public API:

* :func:`attnlab.attention` -- scaled dot-product attention with one contract on every backend;
  :func:`attnlab.attention_weights` -- its weights alone;
* :mod:`attnlab.masks` -- masks and mask mods (True = may attend);
* :mod:`attnlab.backends` -- the backends, dispatch, and :func:`attnlab.backends.why`;
* :mod:`attnlab.nn` -- production modules (multi-head / grouped-query attention, KV cache,
  positions, blocks);
* :mod:`attnlab.tutorial` -- the tutorials' small modules, reproducing their printed numbers.

Example:
    >>> import torch, attnlab
    >>> x = torch.randn(6, 4)                       # (T, D): six tokens
    >>> attnlab.attention(x, x, x, causal=True).shape
    torch.Size([6, 4])
"""

from attnlab import backends, masks, nn, tutorial
from attnlab.functional import attention, attention_weights

__version__ = "0.1.0"

__all__ = ["attention", "attention_weights", "masks", "backends", "nn", "tutorial", "__version__"]
