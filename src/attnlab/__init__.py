"""attnlab: attention mechanisms on PyTorch, readable, proven fast, and visible.

The package has two parts. The **library** (the core) is what a model needs:

* :func:`attnlab.attention` -- scaled dot-product attention with one contract on every backend;
  :func:`attnlab.attention_weights` -- its weights alone; :func:`attnlab.plan` -- one call's
  signature decided once, an :class:`~attnlab.functional.AttentionPlan` the caller holds;
* :func:`attnlab.linear_attention` -- the recurrent family (linear attention, retention, Mamba-2's
  decay, DeltaNet, Gated DeltaNet, KDA) as one function over a state per head (:mod:`attnlab.linear`);
* :mod:`attnlab.masks` -- masks and mask mods (True = may attend);
* :mod:`attnlab.scores` -- score mods (softcap, ALiBi, T5 relative bias, learnable biases)
  and their composition, for ``attention(score_mod=...)``; sinks are ``attention(sinks=...)``;
* :mod:`attnlab.backends` -- the backends, dispatch, and :func:`attnlab.backends.why`;
* :mod:`attnlab.nn` -- production modules (multi-head / grouped-query attention, KV cache,
  positions, blocks);
* :mod:`attnlab.io`, :mod:`attnlab.models`, :mod:`attnlab.integrations`,
  :mod:`attnlab.distributed` -- safetensors I/O, whole models, transformers, context parallelism.

The **lab** (:mod:`attnlab.lab`) teaches and measures: :mod:`attnlab.lab.tutorial` (the tutorials'
small modules, reproducing their printed numbers), :mod:`attnlab.lab.explain`, :mod:`attnlab.lab.viz`,
:mod:`attnlab.lab.train`, :mod:`attnlab.lab.verify`, :mod:`attnlab.lab.bench` and the ``attnlab``
command (:mod:`attnlab.lab.cli`). ``import attnlab`` loads the library only. ``attnlab.tutorial``
and ``attnlab.show`` (inline views of any weights, :func:`attnlab.lab.viz.views.show`) are still
attributes: they are imported on first use (PEP 562); the other lab modules are imported by name
from ``attnlab.lab`` (README.md lists the old paths and the new).

Example:
    >>> import torch, attnlab
    >>> x = torch.randn(6, 4)                       # (T, D): six tokens
    >>> attnlab.attention(x, x, x, causal=True).shape
    torch.Size([6, 4])
    >>> attnlab.tutorial.CausalAttention(4, 2, 6, 0.0)(x).shape    # the lab, loaded here
    torch.Size([6, 2])
"""

from attnlab import backends, masks, nn, scores
from attnlab.functional import AttentionPlan, attention, attention_weights, plan
from attnlab.linear import linear_attention

__version__ = "0.1.0"

__all__ = ["attention", "attention_weights", "plan", "AttentionPlan", "linear_attention", "masks", "scores", "backends", "nn", "__version__"]


def __getattr__(name: str):
    """``attnlab.tutorial`` and ``attnlab.show`` without importing the lab in ``import attnlab`` (PEP 562)."""
    if name == "tutorial":
        import attnlab.lab.tutorial  # the library's imports of the lab: these two (tests/test_layers.py)

        return attnlab.lab.tutorial
    if name == "show":
        import attnlab.lab.viz.views

        return attnlab.lab.viz.views.show
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "tutorial", "show"])
