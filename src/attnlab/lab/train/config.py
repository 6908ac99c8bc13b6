"""The model setup: :class:`TrainConfig` (what to train and how, the task's defaults filled in)
and :func:`memory_estimate` (the bytes one step needs, from the sizes alone).

Example:
    >>> TrainConfig(task="sort").resolved().heads
    4
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attnlab._checks import divisible, instance_of, one_of, per_layer, positive_int, positive_number
from attnlab.models.gpt import POSITIONS
from attnlab.lab.train.tasks import TASKS, TASK_DEFAULTS, default_heads


@dataclass
class TrainConfig:
    """What to train and how; None means the task's default (see :meth:`resolved`).

    ``kv_heads``, ``layer_pattern``, ``window``, ``latent_dim``, ``chunk``, ``topk``, ``nsa_block``,
    ``compress_rate`` and ``kv_shared_layers`` (the GPT's ``num_kv_shared_layers``) choose the attention variant (grouped-query heads, local/global/latent/chunked/NoPE,
    differential, gated, sparse top-k, native sparse and DeepSeek-V4's compressed layers; see
    :class:`~attnlab.models.GPT`);
    None trains plain multi-head attention.

    ``rope_fraction``, ``qk_norm`` (a form: ``"qwen3"``, ``"olmo2"``, ``"gemma"``), ``head_dim``,
    ``global_head_dim`` and ``nope_temperature`` (``(floor_scale, attn_scale)``) are the GPT options
    of the same names; with ``head_dim`` or ``global_head_dim`` the heads need not divide ``d_model``
    where they have their own width (:class:`~attnlab.models.GPT` checks the layers that do not).

    ``softcap`` caps every attention score with ``softcap * tanh(score / softcap)`` (Gemma 2) and
    ``sinks`` gives every head a learnable sink logit (gpt-oss); :func:`analyze` then reports each
    head's sink share, where the mass it does not give to tokens goes.

    ``heads`` is the head count of every layer (an int) or one per layer (a tuple of ``layers``
    ints); each must divide ``d_model``. When ``heads`` is left to a task default given per layer
    and ``layers`` is not the default's depth, every layer gets the default's first count: the
    induction task's ``(2, 1)`` becomes 2 heads in each layer of ``layers=1`` (the one-layer
    control) or ``layers=3``.

    Example:
        >>> TrainConfig(task="induction").resolved().heads
        (2, 1)
        >>> TrainConfig(task="induction", layers=1).resolved().heads
        2
    """

    task: str = "induction"
    layers: int | None = None
    heads: int | tuple[int, ...] | None = None
    d_model: int | None = None
    attention_only: bool | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    device: str = "cpu"
    positions: str | None = None
    text: str | None = None
    eval_every: int = 100
    eval_sequences: int | None = None
    warmup: int = 50
    kv_heads: int | None = None
    layer_pattern: str | None = None
    window: int | None = None
    latent_dim: int | None = None
    softcap: float | None = None
    sinks: bool = False
    chunk: int | None = None
    topk: int | None = None
    nsa_block: int | None = None
    compress_rate: int | None = None
    rope_fraction: float | None = None
    qk_norm: str | None = None
    head_dim: int | None = None
    global_head_dim: int | None = None
    nope_temperature: tuple[float, float] | None = None
    kv_shared_layers: int = 0

    def resolved(self) -> "TrainConfig":
        """A copy with every None filled from the task's defaults, checked.

        Example:
            >>> TrainConfig(task="text", text="x.txt", steps=5).resolved().steps
            5
        """
        config = self._filled()
        for name in ("layers", "d_model", "steps", "batch_size", "eval_every", "eval_sequences"):
            positive_int(name, getattr(config, name))
        counts = per_layer("heads", config.heads, config.layers)
        for layer, count in enumerate(counts if config.head_dim is None and config.global_head_dim is None else ()):
            divisible("d_model", config.d_model, "heads" if isinstance(config.heads, int) else f"heads[{layer}]",
                      count)
        if not isinstance(config.heads, int):
            config.heads = counts  # a list read back from config.json becomes the tuple it was
        positive_number("lr", config.lr)
        one_of("positions", config.positions, POSITIONS)
        if config.softcap is not None:
            config.softcap = positive_number("softcap", config.softcap)
        instance_of("sinks", config.sinks, bool, "a bool")
        if config.nope_temperature is not None:  # a list read back from config.json becomes the pair it was
            config.nope_temperature = tuple(config.nope_temperature)
        return config

    def model_options(self) -> dict:
        """The :class:`~attnlab.models.GPT` keywords this (resolved) config sets, all but the
        vocabulary and length, which are the task's.

        Example:
            >>> TrainConfig(task="sort", qk_norm="olmo2").resolved().model_options()["qk_norm"]
            'olmo2'
        """
        return dict(d_model=self.d_model, num_layers=self.layers, num_heads=self.heads,
                    attention_only=self.attention_only, positions=self.positions, num_kv_heads=self.kv_heads,
                    layer_pattern=self.layer_pattern, window=self.window, latent_dim=self.latent_dim,
                    softcap=self.softcap, sinks=self.sinks, chunk=self.chunk, topk=self.topk,
                    nsa_block=self.nsa_block, compress_rate=self.compress_rate, rope_fraction=self.rope_fraction,
                    qk_norm=False if self.qk_norm is None else self.qk_norm, head_dim=self.head_dim,
                    global_head_dim=self.global_head_dim, nope_temperature=self.nope_temperature,
                    num_kv_shared_layers=self.kv_shared_layers)

    def _filled(self) -> "TrainConfig":
        """A copy with every None filled from the task's defaults; only the task is checked."""
        one_of("task", self.task, TASKS)
        filled = {k: (v if getattr(self, k) is None else getattr(self, k)) for k, v in TASK_DEFAULTS[self.task].items()}
        config = dataclasses.replace(self, **filled)
        if self.heads is None:
            config.heads = default_heads(self.task, config.layers)
        return config


_FLOAT_BYTES = 4  # the model trains in float32


# Weights, their gradients and AdamW's two moments: four floats per parameter.
_FLOATS_PER_PARAMETER = 4


# Floats one layer keeps per token for the backward pass, in units of d_model: the norm's output,
# q, k, v, the context, the projection and the residual; an MLP adds its 4 d_model hidden twice.
_KEPT_PER_LAYER = {True: 8, False: 18}


def memory_estimate(config: TrainConfig, *, vocab_size: int, seq_len: int) -> dict[str, int]:
    """Rough bytes one training step needs, by part, from the sizes alone (nothing is allocated).

    ``parameters``: the weights with their gradients and AdamW's moments; ``activations``: what
    one batch keeps for the backward pass, the attention weights ``(B, H, T, T)`` of every layer
    and the logits. Options left None take the task's defaults; nothing else is checked, so an
    estimate can be asked for any mix of sizes (to find the one that does not fit). It errs low
    (torch's temporaries are left out), so a limit on it refuses only what cannot fit.

    Example:
        >>> parts = memory_estimate(TrainConfig(heads=2), vocab_size=64, seq_len=64)
        >>> sorted(parts), parts["parameters"] == 16 * (64 * 64 + 2 * (4 * 64 * 64 + 6 * 64) + 2 * 64)
        (['activations', 'parameters'], True)
    """
    c = config._filled()
    layers, d, batch = c.layers, c.d_model, c.batch_size
    most_heads = c.heads if isinstance(c.heads, int) else max(c.heads)
    widest = max(c.head_dim or 0, c.global_head_dim or 0)  # heads of their own width: q, k, v, o of H * D
    attention = 4 * d * d if not widest else 4 * d * most_heads * widest
    per_block = attention + 6 * d + (0 if c.attention_only else 8 * d * d + 7 * d)
    parameters = vocab_size * d + (seq_len * d if c.positions == "learned" else 0) + layers * per_block + 2 * d
    kept = batch * seq_len * (layers * _KEPT_PER_LAYER[bool(c.attention_only)] * d + 2 * vocab_size)
    weights = 2 * batch * layers * most_heads * seq_len * seq_len  # scores and probabilities
    return {"parameters": _FLOAT_BYTES * _FLOATS_PER_PARAMETER * parameters,
            "activations": _FLOAT_BYTES * (kept + weights)}
