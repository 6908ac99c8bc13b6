"""The backend protocol and the registry every backend adds itself to."""

from __future__ import annotations

from dataclasses import dataclass

import torch  # noqa: F401  (the doctest examples use it)
from torch import Tensor

from attnlab._call import AttentionCall

__all__ = ["AttentionResult", "Backend", "register", "registry", "call_flops"]


@dataclass
class AttentionResult:
    """What a backend returns.

    Attributes:
        out: ``(B, Hq, Tq, Dv)`` context vectors.
        lse: optional ``(B, Hq, Tq)`` log-sum-exp of the scaled, masked scores (``-inf`` for
            fully masked rows); lets the weights be recomputed without a second softmax pass.
        weights: optional ``(B, Hq, Tq, Tk)`` attention weights (before dropout).

    Example:
        >>> AttentionResult(out=torch.zeros(1, 1, 2, 4)).lse is None
        True
    """

    out: Tensor
    lse: Tensor | None = None
    weights: Tensor | None = None


class Backend:
    """One way of computing attention under attnlab's single contract.

    Subclasses set ``name``, ``memory`` (``"quadratic"`` or ``"linear"`` in the sequence
    length), ``description``, and implement :meth:`forward`. They override
    :meth:`not_supported_reasons` to decline calls they cannot serve exactly and
    :meth:`unavailable_reason` when they cannot run in this installation at all.

    Example:
        >>> class Zeros(Backend):
        ...     name, memory = "zeros", "linear"
        ...     def forward(self, call):
        ...         return AttentionResult(out=call.q.new_zeros(*call.q.shape[:3], call.value_dim))
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 3, 4)
        >>> Zeros().forward(build_call(q, q, q)).out.shape
        torch.Size([1, 1, 3, 4])
    """

    name: str = ""
    memory: str = "quadratic"
    description: str = ""

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run here at all (None when it can)."""
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        """Every reason this backend cannot serve ``call`` exactly; empty when it can."""
        return []

    def cost(self, call: AttentionCall) -> float:
        """Relative expected time for ``call``; lower wins under ``backend="auto"``."""
        return 1.0

    def forward(self, call: AttentionCall) -> AttentionResult:
        raise NotImplementedError


def call_flops(call: AttentionCall, *, causal: bool | None = None) -> float:
    """FLOPs ``call`` will cost under DESIGN.md's convention, for backends' cost estimates.

    Forward only, or forward+backward (3.5x) when the call needs gradients.

    Args:
        call: the call.
        causal: whether to halve the count for a causal mask the kernel really skips; defaults
            to ``call.causal``.

    Example:
        >>> from attnlab._call import build_call
        >>> q = torch.randn(1, 1, 4, 8)
        >>> call_flops(build_call(q, q, q, causal=True))
        256.0
    """
    from attnlab.bench import attention_flops

    return attention_flops(
        call.batch, call.q_heads, call.tq, call.tk, call.head_dim, call.value_dim,
        causal=call.causal if causal is None else causal,
        mode="fwd+bwd" if call.requires_grad else "fwd",
    )


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` to the registry under ``backend.name`` (replacing one of that name).

    Example:
        >>> register(registry()["reference"]).name
        'reference'
    """
    if not backend.name:
        raise ValueError("backend.name must be a non-empty string")
    _REGISTRY[backend.name] = backend
    return backend


def registry() -> dict[str, Backend]:
    """The registered backends by name, in registration order.

    Example:
        >>> list(registry())[0]
        'reference'
    """
    return dict(_REGISTRY)
