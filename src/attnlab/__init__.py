"""attnlab: attention mechanisms on PyTorch, readable, proven fast, and visible.

Example:
    >>> import torch, attnlab
    >>> x = torch.randn(6, 4)                       # (T, D): six tokens
    >>> attnlab.attention(x, x, x, causal=True).shape
    torch.Size([6, 4])
"""

from attnlab import masks
from attnlab.functional import attention, attention_weights

__version__ = "0.1.0"

__all__ = ["attention", "attention_weights", "masks", "__version__"]
