"""Train a small GPT on a task that needs attention, on a CPU, and find the heads that do it.

Tasks (:data:`TASKS`); every one is a next-token task scored only where the answer is
determined by the input (elsewhere the target is :data:`IGNORE`):

* ``induction`` (default): random tokens in which a segment of distinct tokens occurs twice;
  scored on the second occurrence, whose next token can only be found by looking back at the
  first one (an induction head: Olsson et al., 2022). The segment's place and length vary, so
  "copy from a fixed distance back" does not work.
* ``recall``: multi-query associative recall: key-value pairs, then some of the keys again
  (without their values); scored on each queried key's value.
* ``reverse`` / ``sort``: a sequence, a separator, then the sequence reversed / sorted.
* ``text``: a character-level language model of a UTF-8 text file (last 10 % held out).

Training is deterministic for a seed on CPU: the model is initialised from the seed, and the
batch of step ``s`` is drawn from a generator seeded by ``(seed, s)``, so a run resumed from a
checkpoint at step ``s`` sees the same data and gives the same losses as an uninterrupted one.
Held-out data comes from a separate stream that training never draws from.

:class:`LiveProgress` draws the progress bar and the curves in a notebook while a model trains.
After training, :func:`head_scores` measures each head's previous-token and induction scores,
:func:`ablate_heads` re-evaluates with one head's output zeroed at a time, and
:func:`summarize` names the heads that do the task, with the numbers.

Example:
    >>> config = TrainConfig(task="induction", steps=3, batch_size=4, d_model=16, heads=2,
    ...                      eval_sequences=8)
    >>> run = Trainer(config)
    >>> result = run.train()
    >>> result.step, 0.0 <= result.metrics["accuracy"] <= 1.0
    (3, True)
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from attnlab import io as _io
from attnlab.distributed import ContextParallel, context_parallel as _context_parallel
from attnlab.distributed.layout import check_length
from attnlab._checks import divisible, instance_of, one_of, per_layer, positive_int, positive_number
from attnlab.models import GPT
from attnlab.models import _hub
from attnlab.models.gpt import LAYER_KINDS, LAYER_TABLE, POSITIONS
from attnlab.lab.trained import ROLE_THRESHOLD, best_head, count_heads, head_roles, pad_heads, sink_shares, unpad_heads
from attnlab.lab.viz.headview import head_grid
from attnlab.lab.viz.heatmap import heatmap, save_figure

__all__ = ["TASKS", "POSITIONS", "IGNORE", "TrainConfig", "default_heads", "Task", "make_task", "Trainer",
           "TrainResult", "head_scores", "ablate_heads", "summarize", "evaluate", "analyze", "write_figures",
           "TextTask", "memory_estimate", "read_checkpoint", "ShardedRun", "train_sharded", "LiveProgress"]

TASKS = ("induction", "recall", "reverse", "sort", "text")
IGNORE = -100  # F.cross_entropy's ignore_index: positions whose next token is not determined
OPTIMIZER_FILE = "optimizer.safetensors"
METRICS_FILE = "metrics.json"
_EVAL_STREAM = 1 << 40  # held-out data is drawn from seeds training never uses
_STEP_SEED = 1_000_003


# ------------------------------------------------------------------------- tasks
class Task:
    """A source of ``(inputs, targets)`` batches ``(B, T)``; targets are :data:`IGNORE` where unscored.

    Attributes:
        name: the task's name in :data:`TASKS`.
        vocab_size, seq_len: the model sizes the task needs.

    Example:
        >>> task = make_task("reverse")
        >>> inputs, targets = task.batch(2, torch.Generator().manual_seed(0))
        >>> inputs.shape == targets.shape == (2, task.seq_len)
        True
    """

    name = "task"
    vocab_size = seq_len = 0

    def batch(self, batch_size: int, generator: torch.Generator, *, held_out: bool = False) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def labels(self, ids: Tensor) -> list[str]:
        """Display labels for a ``(T,)`` sequence of ids (plots and explain).

        Example:
            >>> make_task("sort").labels(torch.tensor([0, 1]))
            ['0', '1']
        """
        return [str(int(i)) for i in ids]


def _randperm_rows(batch_size: int, n: int, generator: torch.Generator) -> Tensor:
    """``batch_size`` independent random permutations of ``range(n)``, ``(B, n)``."""
    return torch.rand(batch_size, n, generator=generator).argsort(dim=1)


class InductionTask(Task):
    """Random tokens with one segment of distinct tokens repeated; scored on the repeat."""

    name = "induction"

    def __init__(self, *, vocab_size: int = 64, seq_len: int = 64, min_segment: int = 8, max_segment: int = 16):
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.min_segment, self.max_segment = min_segment, max_segment

    def batch(self, batch_size, generator, *, held_out=False):
        B, T, V = batch_size, self.seq_len, self.vocab_size
        lengths = torch.randint(self.min_segment, self.max_segment + 1, (B,), generator=generator)
        perm = _randperm_rows(B, V, generator)  # segment = first L of a permutation: distinct tokens
        fill_pick = torch.randint(0, V - self.max_segment, (B, T), generator=generator)
        starts = torch.rand(B, 2, generator=generator)
        inputs, targets = torch.empty(B, T, dtype=torch.long), torch.full((B, T), IGNORE)
        for b in range(B):
            L = int(lengths[b])
            segment, fillers = perm[b, :L], perm[b, L:]  # fillers never equal a segment token
            row = fillers[fill_pick[b] % (V - L)]
            gap = T - 2 * L  # free positions around the two copies
            first = int(starts[b, 0] * (gap + 1))
            second = first + L + int(starts[b, 1] * (gap - first + 1))
            row[first:first + L], row[second:second + L] = segment, segment
            inputs[b] = row
            # at the k-th token of the repeat, the answer is the (k+1)-th token of the segment
            targets[b, second:second + L - 1] = segment[1:]
        return inputs, targets


class RecallTask(Task):
    """``k1 v1 k2 v2 ... kn vn | q1 q2 ... qm``: at each query key, predict its value.

    Keys are distinct within a sequence and each is asked at most once. The answers are never
    shown after the queries (as in Zoology's MQAR): were they, a model could exclude the values
    already given and guess among the rest (42 % at 8 pairs) instead of looking the key up.
    """

    name = "recall"

    def __init__(self, *, num_keys: int = 16, num_values: int = 16, pairs: int = 8, queries: int = 8):
        if queries > pairs:
            raise ValueError(f"queries ({queries}) must be at most pairs ({pairs}): each key is asked once")
        if pairs > num_keys:
            raise ValueError(f"pairs ({pairs}) must be at most num_keys ({num_keys}): keys are distinct")
        self.num_keys, self.num_values, self.pairs, self.queries = num_keys, num_values, pairs, queries
        self.vocab_size = num_keys + num_values + 1  # keys, values, separator
        self.seq_len = 2 * pairs + 1 + queries

    def batch(self, batch_size, generator, *, held_out=False):
        B, n, q = batch_size, self.pairs, self.queries
        keys = _randperm_rows(B, self.num_keys, generator)[:, :n]  # distinct keys per sequence
        values = self.num_keys + torch.randint(0, self.num_values, (B, n), generator=generator)
        asked = _randperm_rows(B, n, generator)[:, :q]  # distinct queries, in random order
        sep = torch.full((B, 1), self.vocab_size - 1)
        pairs = torch.stack([keys, values], dim=2).reshape(B, 2 * n)  # (B, 2n): k v k v ...
        inputs = torch.cat([pairs, sep, keys.gather(1, asked)], dim=1)  # (B, T)
        targets = torch.full_like(inputs, IGNORE)
        targets[:, 2 * n + 1:] = values.gather(1, asked)  # at each query key: its value
        return inputs, targets


class _SequenceTask(Task):
    """``x1 .. xn SEP f(x)_1 .. f(x)_n``, scored on every token after the separator."""

    def __init__(self, *, num_symbols: int = 16, length: int = 12):
        self.num_symbols, self.length = num_symbols, length
        self.vocab_size, self.seq_len = num_symbols + 1, 2 * length + 1

    def transform(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def batch(self, batch_size, generator, *, held_out=False):
        n = self.length
        x = torch.randint(0, self.num_symbols, (batch_size, n), generator=generator)
        sep = torch.full((batch_size, 1), self.num_symbols)
        answer = self.transform(x)
        inputs = torch.cat([x, sep, answer], dim=1)  # (B, 2n + 1)
        targets = torch.full_like(inputs, IGNORE)
        targets[:, n:2 * n] = answer  # from the separator on, predict the next answer token
        return inputs, targets

    def labels(self, ids):
        return ["|" if int(i) == self.num_symbols else str(int(i)) for i in ids]


class ReverseTask(_SequenceTask):
    name = "reverse"

    def transform(self, x):
        return x.flip(1)


class SortTask(_SequenceTask):
    name = "sort"

    def transform(self, x):
        return x.sort(dim=1).values


class TextTask(Task):
    """Character-level language modelling of a text; the last 10 % is held out.

    Example:
        >>> task = TextTask("to be or not to be " * 20, seq_len=8)
        >>> inputs, targets = task.batch(2, torch.Generator().manual_seed(0))
        >>> torch.equal(inputs[:, 1:], targets[:, :-1])
        True
    """

    name = "text"

    def __init__(self, text: str, *, seq_len: int = 128, chars: list[str] | None = None):
        self.chars = sorted(set(text)) if chars is None else list(chars)
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size, self.seq_len = len(self.chars), seq_len
        data = torch.tensor([self.index[c] for c in text], dtype=torch.long)
        split = int(len(data) * 0.9)
        self.train_data, self.held_out_data = data[:split], data[split:]
        for name, part in (("the training part", self.train_data), ("the held-out part", self.held_out_data)):
            if len(part) < seq_len + 1:
                raise ValueError(f"the text is too short: {name} has {len(part)} characters, a window "
                                 f"needs {seq_len + 1} (give a longer --text file)")

    @classmethod
    def from_file(cls, path: str | os.PathLike, **options) -> "TextTask":
        """Read a UTF-8 text file; an empty, missing or non-UTF-8 file raises ``ValueError`` naming it.

        Example:
            >>> import tempfile
            >>> path = Path(tempfile.mkdtemp()) / "t.txt"
            >>> _ = path.write_text("abcabc" * 100, encoding="utf-8")
            >>> TextTask.from_file(path, seq_len=16).chars
            ['a', 'b', 'c']
        """
        path = Path(path)
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--text {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
        except OSError as err:
            raise ValueError(f"--text {str(path)!r} cannot be read: {err.strerror or err}") from None
        if not text.strip():
            raise ValueError(f"--text {str(path)!r} is empty")
        return cls(text, **options)

    def encode(self, text: str) -> Tensor:
        """``(len(text),)`` ids; a character outside the vocabulary raises ``ValueError``.

        Example:
            >>> TextTask("ab" * 200, seq_len=8).encode("ba").tolist()
            [1, 0]
        """
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters {''.join(unknown)!r} are not in the model's vocabulary")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def batch(self, batch_size, generator, *, held_out=False):
        data = self.held_out_data if held_out else self.train_data
        starts = torch.randint(0, len(data) - self.seq_len, (batch_size,), generator=generator)
        windows = torch.stack([data[s:s + self.seq_len + 1] for s in starts.tolist()])  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]

    def labels(self, ids):
        return [repr(self.chars[int(i)])[1:-1] for i in ids]


def make_task(name: str, *, text: str | os.PathLike | None = None, chars: list[str] | None = None) -> Task:
    """The task called ``name`` at its default size (``text``: a file path for ``"text"``).

    Example:
        >>> make_task("recall").vocab_size
        33
    """
    one_of("task", name, TASKS)
    if name == "text":
        if text is None:
            raise ValueError("the text task needs a UTF-8 text file (--text FILE)")
        return TextTask.from_file(text) if chars is None else TextTask.from_file(text, chars=chars)
    return {"induction": InductionTask, "recall": RecallTask, "reverse": ReverseTask, "sort": SortTask}[name]()


# ----------------------------------------------------------------------- config
# Per-task defaults. Rotary positions make the previous-token head easy to learn: with them the
# induction task's phase change comes after ~500 steps (learned positions: none in 1500). Recall's
# lookup appears after 500-2000 steps depending on the seed; 4000 leave room (~40 s on one core).
# Induction has two heads in layer 0 and one in layer 1: two layer-1 heads both learn the whole
# induction job, so that ablating either alone costs nothing (docs/train.md). A per-layer default
# that does not fit a changed --layers gives every layer its first count (see TrainConfig). With
# one layer-1 head the previous-token head sharpens more slowly: at 1500 steps its score was
# 0.75 / 0.81 / 0.89 for seeds 0 / 1 / 2, at 2000 steps 0.92 / 0.89 / 0.91 (~65 s on one core).
TASK_DEFAULTS = {
    "induction": dict(layers=2, heads=(2, 1), d_model=64, attention_only=True, steps=2000, batch_size=32, lr=3e-3,
                      positions="rope", eval_sequences=512),
    "recall": dict(layers=2, heads=2, d_model=64, attention_only=True, steps=4000, batch_size=32, lr=3e-3,
                   positions="rope", eval_sequences=512),
    "reverse": dict(layers=2, heads=4, d_model=64, attention_only=False, steps=1500, batch_size=32, lr=3e-3,
                  positions="rope", eval_sequences=512),
    "sort": dict(layers=2, heads=4, d_model=64, attention_only=False, steps=1500, batch_size=32, lr=3e-3,
                  positions="rope", eval_sequences=512),
    "text": dict(layers=4, heads=4, d_model=128, attention_only=False, steps=2000, batch_size=32, lr=1e-3,
                 positions="learned", eval_sequences=64),  # 64 windows of 128 characters: 8k held-out predictions
}


def default_heads(task: str, layers: int) -> int | tuple[int, ...]:
    """The head counts ``task`` trains with at depth ``layers`` when none are given.

    The task's default, unless it is given per layer for another depth: then its first count,
    in every layer.

    Example:
        >>> default_heads("induction", 2), default_heads("induction", 1), default_heads("sort", 3)
        ((2, 1), 2, 4)
    """
    heads = TASK_DEFAULTS[one_of("task", task, TASKS)]["heads"]
    return heads if isinstance(heads, int) or len(heads) == layers else heads[0]


@dataclass
class TrainConfig:
    """What to train and how; None means the task's default (see :meth:`resolved`).

    ``kv_heads``, ``layer_pattern``, ``window``, ``latent_dim``, ``chunk``, ``topk`` and
    ``nsa_block`` choose the attention variant (grouped-query heads, local/global/latent/chunked/NoPE,
    differential, gated, sparse top-k and native sparse layers; see :class:`~attnlab.models.GPT`);
    None trains plain multi-head attention.

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
        for layer, count in enumerate(counts):
            divisible("d_model", config.d_model, "heads" if isinstance(config.heads, int) else f"heads[{layer}]",
                      count)
        if not isinstance(config.heads, int):
            config.heads = counts  # a list read back from config.json becomes the tuple it was
        positive_number("lr", config.lr)
        one_of("positions", config.positions, POSITIONS)
        if config.softcap is not None:
            config.softcap = positive_number("softcap", config.softcap)
        instance_of("sinks", config.sinks, bool, "a bool")
        return config

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
    per_block = 4 * d * d + 6 * d + (0 if c.attention_only else 8 * d * d + 7 * d)
    parameters = vocab_size * d + (seq_len * d if c.positions == "learned" else 0) + layers * per_block + 2 * d
    kept = batch * seq_len * (layers * _KEPT_PER_LAYER[bool(c.attention_only)] * d + 2 * vocab_size)
    weights = 2 * batch * layers * most_heads * seq_len * seq_len  # scores and probabilities
    return {"parameters": _FLOAT_BYTES * _FLOATS_PER_PARAMETER * parameters,
            "activations": _FLOAT_BYTES * (kept + weights)}


@dataclass
class TrainResult:
    """The outcome of :meth:`Trainer.train`.

    Example:
        >>> TrainResult(step=0, interrupted=False, metrics={}).step
        0
    """

    step: int
    interrupted: bool
    metrics: dict = field(default_factory=dict)


# ---------------------------------------------------------------------- trainer
class Trainer:
    """A model, its optimizer and its task, trained step by step; saves and resumes checkpoints.

    Args:
        config: the run's :class:`TrainConfig`.
        task: a ready :class:`Task` (default: :func:`make_task` of ``config.task``).
        context_parallel: shard each training sequence across a process group (every rank runs
            this trainer with the same config): each rank feeds its shard of the batch, the loss
            is the global mean (local sums all-reduced) and the parameter gradients are summed
            across ranks, so every rank takes the single-process step. Evaluation runs whole on
            every rank; only rank 0 writes checkpoints. How a run is sharded is not part of its
            checkpoint: a run may resume on another number of ranks.

    Example:
        >>> run = Trainer(TrainConfig(steps=2, batch_size=2, d_model=8, heads=2, eval_sequences=4))
        >>> run.train().step
        2
    """

    def __init__(self, config: TrainConfig, *, task: Task | None = None,
                 context_parallel: ContextParallel | None = None):
        self.config = config.resolved()
        c = self.config
        self.task = task if task is not None else make_task(c.task, text=c.text)
        with torch.random.fork_rng(devices=[]):  # the seed decides the initial weights, nothing else
            torch.manual_seed(c.seed)
            self.model = GPT(self.task.vocab_size, max_len=self.task.seq_len, d_model=c.d_model,
                             num_layers=c.layers, num_heads=c.heads, attention_only=c.attention_only,
                             positions=c.positions, num_kv_heads=c.kv_heads, layer_pattern=c.layer_pattern,
                             window=c.window, latent_dim=c.latent_dim, softcap=c.softcap,
                             sinks=c.sinks, chunk=c.chunk, topk=c.topk, nsa_block=c.nsa_block).to(c.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr, betas=(0.9, 0.98), weight_decay=0.01)
        self.step = 0
        self.seconds = 0.0
        self.history: dict[str, list] = {"step": [], "train_loss": [], "eval_step": [], "eval_loss": [],
                                         "eval_accuracy": []}
        self._eval_set: tuple[Tensor, Tensor] | None = None
        self.context_parallel = context_parallel
        if context_parallel is not None:
            world = context_parallel.world_and_rank()[0]
            check_length(self.task.seq_len, layout=context_parallel.sequence_layout(world), world=world,
                         name=f"context_parallel over {world} ranks: the task's sequence length")
            _context_parallel(self.model, context_parallel)

    @property
    def writes(self) -> bool:
        """Whether this process writes checkpoints (rank 0 of a sharded run, or the only process)."""
        return self.context_parallel is None or self.context_parallel.world_and_rank()[1] == 0

    # ------------------------------------------------------------- data
    def train_batch(self, step: int) -> tuple[Tensor, Tensor]:
        """The batch of training step ``step`` (the same for every run with this seed).

        Example:
            >>> run = Trainer(TrainConfig(batch_size=2, d_model=8, heads=2))
            >>> torch.equal(run.train_batch(5)[0], run.train_batch(5)[0])
            True
        """
        generator = torch.Generator().manual_seed(self.config.seed * _STEP_SEED + step)
        inputs, targets = self.task.batch(self.config.batch_size, generator)
        return inputs.to(self.config.device), targets.to(self.config.device)

    def eval_set(self) -> tuple[Tensor, Tensor]:
        """The held-out ``(inputs, targets)``, ``config.eval_sequences`` rows from a separate stream.

        Example:
            >>> Trainer(TrainConfig(d_model=8, heads=2, eval_sequences=3)).eval_set()[0].shape[0]
            3
        """
        if self._eval_set is None:
            generator = torch.Generator().manual_seed(_EVAL_STREAM + self.config.seed)
            inputs, targets = self.task.batch(self.config.eval_sequences, generator, held_out=True)
            self._eval_set = inputs.to(self.config.device), targets.to(self.config.device)
        return self._eval_set

    # ------------------------------------------------------------ steps
    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to a tenth of ``lr`` at the last step.

        Example:
            >>> run = Trainer(TrainConfig(steps=100, lr=1.0, warmup=10, d_model=8, heads=2))
            >>> run.learning_rate(0), run.learning_rate(99) < 0.11
            (0.1, True)
        """
        c = self.config
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        progress = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def train_step(self) -> tuple[float, float]:
        """One optimizer step on :meth:`train_batch`; returns ``(loss, accuracy)`` on that batch.

        Example:
            >>> run = Trainer(TrainConfig(batch_size=2, d_model=8, heads=2))
            >>> loss, accuracy = run.train_step(); run.step
            1
        """
        self.model.train()
        inputs, targets = self.train_batch(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        if self.context_parallel is not None:
            return self._sharded_step(inputs, targets)
        logits = self.model(inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return loss.item(), _accuracy(logits.detach(), targets)

    def _sharded_step(self, inputs: Tensor, targets: Tensor) -> tuple[float, float]:
        """:meth:`train_step` on this rank's shard of every sequence: the global mean loss from
        all-reduced sums, and each parameter's gradient summed over the ranks before the step."""
        cp = self.context_parallel
        inputs, targets = (cp.shard(t, dim=1) for t in (inputs, targets))  # (B, T_local)
        logits = self.model(inputs)  # (B, T_local, V); positions are global inside the model
        scored = targets != IGNORE
        loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        right = (logits.detach().argmax(-1)[scored] == targets[scored]).sum()
        totals = torch.stack([loss_sum.detach(), scored.sum().to(loss_sum.dtype), right.to(loss_sum.dtype)])
        dist.all_reduce(totals, group=cp.group)  # (loss sum, scored, right) over every rank
        count = max(1.0, totals[1].item())
        self.optimizer.zero_grad(set_to_none=True)
        (loss_sum / count).backward()
        for parameter in self.model.parameters():  # each rank's share of the gradient, summed
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=cp.group)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return totals[0].item() / count, (totals[2].item() / count if totals[1].item() else 0.0)

    def evaluate(self) -> tuple[float, float]:
        """Held-out ``(loss, accuracy)`` on the scored positions.

        Example:
            >>> loss, accuracy = Trainer(TrainConfig(d_model=8, heads=2, eval_sequences=4)).evaluate()
            >>> 0.0 <= accuracy <= 1.0
            True
        """
        _context_parallel(self.model, None)  # whole, on every rank
        try:
            return evaluate(self.model, *self.eval_set())
        finally:
            if self.context_parallel is not None:
                _context_parallel(self.model, self.context_parallel)

    def train(self, *, on_step: Callable[[int, float, float, float], None] | None = None,
              should_stop: Callable[[], bool] | None = None, out: str | os.PathLike | None = None) -> TrainResult:
        """Train up to ``config.steps``; evaluate every ``eval_every`` steps and at the end.

        Args:
            on_step: called after each step with ``(step, loss, accuracy, tokens_per_second)``.
            should_stop: checked after each step; True stops early (e.g. on Ctrl-C), and the
                checkpoint written to ``out`` resumes from that step.
            out: a directory to write the checkpoint into when training stops or ends.

        Example:
            >>> run = Trainer(TrainConfig(steps=4, batch_size=2, d_model=8, heads=2, eval_sequences=4))
            >>> run.train(should_stop=lambda: run.step == 2)
            TrainResult(step=2, interrupted=True, metrics={...})
        """
        tokens = self.config.batch_size * self.task.seq_len
        interrupted = False
        while self.step < self.config.steps:
            start = time.perf_counter()
            loss, accuracy = self.train_step()
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            self.history["step"].append(self.step)
            self.history["train_loss"].append(loss)
            if self.step % self.config.eval_every == 0 or self.step == self.config.steps:
                self._record_eval()
            if on_step is not None:
                on_step(self.step, loss, accuracy, tokens / max(elapsed, 1e-9))
            if should_stop is not None and self.step < self.config.steps and should_stop():
                interrupted = True
                break
        if not self.history["eval_step"] or self.history["eval_step"][-1] != self.step:
            self._record_eval()
        metrics = self.metrics(finished=not interrupted)
        if out is not None and self.writes:
            self.save(out, metrics=metrics)
        return TrainResult(step=self.step, interrupted=interrupted, metrics=metrics)

    def _record_eval(self) -> None:
        loss, accuracy = self.evaluate()
        for key, value in (("eval_step", self.step), ("eval_loss", loss), ("eval_accuracy", accuracy)):
            self.history[key].append(value)

    def metrics(self, *, finished: bool = True) -> dict:
        """The run's figures: task, steps, seconds, held-out loss and accuracy, history.

        Example:
            >>> sorted(Trainer(TrainConfig(d_model=8, heads=2, eval_sequences=4)).metrics())[:3]
            ['accuracy', 'config', 'finished']
        """
        if not self.history["eval_step"] or self.history["eval_step"][-1] != self.step:
            self._record_eval()
        tokens = self.step * self.config.batch_size * self.task.seq_len
        return {
            "task": self.config.task, "steps": self.step, "seconds": round(self.seconds, 3),
            "loss": self.history["eval_loss"][-1], "accuracy": self.history["eval_accuracy"][-1],
            "train_loss": self.history["train_loss"][-1] if self.history["train_loss"] else None,
            "tokens_per_second": round(tokens / self.seconds, 1) if self.seconds else None,
            "finished": finished, "config": dataclasses.asdict(self.config), "history": self.history,
        }

    # ------------------------------------------------------- checkpoints
    def save(self, directory: str | os.PathLike, *, metrics: dict | None = None) -> Path:
        """Write model, optimizer state, config and metrics into ``directory`` (each file atomically).

        Example:
            >>> import tempfile
            >>> run = Trainer(TrainConfig(d_model=8, heads=2, eval_sequences=4))
            >>> sorted(p.name for p in run.save(tempfile.mkdtemp()).iterdir())
            ['config.json', 'metrics.json', 'model.safetensors', 'optimizer.safetensors']
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        extra = {"task": self.config.task, "train": dataclasses.asdict(self.config), "step": self.step}
        if isinstance(self.task, TextTask):
            extra["chars"] = self.task.chars
        self.model.save_pretrained(directory, extra=extra)
        _save_optimizer(self.optimizer, directory / OPTIMIZER_FILE, step=self.step, seconds=self.seconds)
        metrics = self.metrics(finished=False) if metrics is None else metrics
        _io.write_atomically(json.dumps(metrics, indent=1) + "\n", directory / METRICS_FILE, what="the metrics")
        return directory

    @classmethod
    def resume(cls, directory: str | os.PathLike, *, steps: int | None = None, device: str | None = None,
               context_parallel: ContextParallel | None = None) -> "Trainer":
        """A trainer continuing the checkpoint in ``directory`` at its step (``steps``: a new total).

        Example:
            >>> import tempfile
            >>> run = Trainer(TrainConfig(steps=3, batch_size=2, d_model=8, heads=2, eval_sequences=4))
            >>> _ = run.train(should_stop=lambda: run.step == 1, out=(folder := tempfile.mkdtemp()))
            >>> again = Trainer.resume(folder); again.step, again.train().step
            (1, 3)
        """
        directory = _hub.model_dir(os.fspath(directory))
        config, step, chars = read_checkpoint(directory)
        if steps is not None and positive_int("steps", steps) < step:
            raise ValueError(f"steps ({steps}) must be at least the checkpoint's step ({step}): a resumed run "
                             "can only go on")
        config = dataclasses.replace(config, steps=steps or config.steps, device=device or config.device)
        task = make_task(config.task, text=config.text, chars=chars)
        trainer = cls(config, task=task, context_parallel=context_parallel)
        _io.load(trainer.model, directory / _hub.WEIGHTS)
        trainer.step, trainer.seconds = _load_optimizer(trainer.optimizer, directory / OPTIMIZER_FILE)
        metrics = _hub.read_json(directory / METRICS_FILE, required=False)
        if isinstance(metrics, dict) and isinstance(metrics.get("history"), dict):
            trainer.history = {k: [v for v, s in zip(metrics["history"][k], _steps_of(metrics["history"], k))
                                   if s <= trainer.step] for k in trainer.history}
        return trainer


def read_checkpoint(directory: str | os.PathLike) -> tuple[TrainConfig, int, list[str] | None]:
    """A train checkpoint's resolved config, its step and its text task's characters (None for others).

    Reads ``config.json`` and the optimizer file's header only: no weights are loaded, nothing is written.

    Example:
        >>> import tempfile
        >>> run = Trainer(TrainConfig(steps=2, batch_size=2, d_model=8, heads=2, eval_sequences=4))
        >>> _ = run.train(out=(folder := tempfile.mkdtemp()))
        >>> config, step, chars = read_checkpoint(folder)
        >>> config.d_model, step, chars
        (8, 2, None)
    """
    directory = _hub.model_dir(os.fspath(directory))
    saved = _hub.read_config(directory, {"model_type": str})
    if not isinstance(saved.get("train"), dict):
        raise ValueError(f"{str(directory / 'config.json')!r} is not an attnlab train checkpoint (no 'train' entry)")
    options = {k: v for k, v in saved["train"].items() if k in {f.name for f in dataclasses.fields(TrainConfig)}}
    step = int(_io.read_metadata(directory / OPTIMIZER_FILE)["step"])
    return TrainConfig(**options).resolved(), step, saved.get("chars")


# ------------------------------------------------------------ across ranks
@dataclass(frozen=True)
class ShardedRun:
    """What every rank of a context-parallel training run does (``attnlab train --context-parallel P``).

    Picklable, so :func:`~attnlab.distributed.launch.run_local` can hand it to spawned ranks.

    Attributes:
        config: the resolved config of a new run (None with ``resume``).
        resume: a checkpoint folder to continue instead (its own config).
        steps: with ``resume``: the new total (None: the checkpoint's).
        method, ulysses: the :class:`~attnlab.distributed.ContextParallel` setting.
        out: the folder rank 0 writes the checkpoint into (None: none written).
        threads: CPU threads of each rank.
        dtype: ``"float32"`` (as ``attnlab train``), or ``"float64"`` for exactness checks (new runs).
        stop_on_interrupt: on Ctrl-C, every rank stops after the same step (they agree once a step).

    Example:
        >>> ShardedRun(config=TrainConfig(d_model=8, heads=2).resolved(), method="ulysses").method
        'ulysses'
    """

    config: TrainConfig | None = None
    resume: str | None = None
    steps: int | None = None
    method: str = "ring"
    ulysses: int | None = None
    out: str | None = None
    threads: int = 1
    dtype: str = "float32"
    stop_on_interrupt: bool = False

    def __post_init__(self):
        if (self.config is None) == (self.resume is None):
            raise ValueError("ShardedRun needs config (a new run) or resume (a checkpoint folder), not both")
        one_of("dtype", self.dtype, ("float32", "float64"))
        ContextParallel(method=self.method, ulysses=self.ulysses)  # checks method and ulysses

    def trainer(self) -> Trainer:
        """This rank's trainer (needs torch.distributed initialised)."""
        setting = ContextParallel(method=self.method, ulysses=self.ulysses)
        if self.resume is not None:
            trainer = Trainer.resume(self.resume, steps=self.steps, device="cpu", context_parallel=setting)
        else:
            trainer = Trainer(self.config, context_parallel=setting)
        trainer.model.to(getattr(torch, self.dtype))  # parameters change in place: the optimizer keeps them
        return trainer


def train_sharded(rank: int, world: int, run: ShardedRun) -> dict:
    """One rank of a context-parallel training run; every rank of the world calls it.

    Each rank trains on its shard of every sequence (:class:`Trainer` with ``context_parallel``),
    so every rank takes the single-process step; rank 0 writes the checkpoint. Returns the step
    reached, whether the run was interrupted, the per-step training losses, and (rank 0) the
    metrics.

    Example (what each rank runs; :func:`~attnlab.distributed.launch.run_local` starts them)::

        run_local(train_sharded, world=2, args=(ShardedRun(config=TrainConfig().resolved()),))
    """
    torch.set_num_threads(run.threads)
    trainer = run.trainer()
    should_stop = _agreed_interrupt(trainer.context_parallel.group) if run.stop_on_interrupt else None
    result = trainer.train(should_stop=should_stop, out=run.out)
    return {"rank": rank, "step": result.step, "interrupted": result.interrupted,
            "train_loss": list(trainer.history["train_loss"]), "metrics": result.metrics if rank == 0 else None}


def _agreed_interrupt(group) -> Callable[[], bool]:
    """A ``should_stop`` that turns Ctrl-C on any rank into a stop after the same step on every rank.

    The first SIGINT is noted (the step finishes); a second one raises ``KeyboardInterrupt``.
    """
    asked = {"stop": False}

    def on_sigint(signum, frame):
        if asked["stop"]:
            raise KeyboardInterrupt
        asked["stop"] = True

    signal.signal(signal.SIGINT, on_sigint)

    def should_stop() -> bool:
        flag = torch.tensor([1.0 if asked["stop"] else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # one rank asked: all stop
        return bool(flag.item())

    return should_stop


def _steps_of(history: dict, key: str) -> list[int]:
    return history["eval_step"] if key.startswith("eval") else history["step"]


def _save_optimizer(optimizer: torch.optim.Optimizer, path: Path, *, step: int, seconds: float) -> None:
    """AdamW's per-parameter state as safetensors (never pickle); the step in the header."""
    tensors = {f"{index}.{key}": value.detach().cpu().contiguous().reshape(value.shape)
               for index, state in optimizer.state_dict()["state"].items() for key, value in state.items()}
    _io.save_state_dict(tensors, path, metadata={"step": str(step), "seconds": repr(seconds)})


def _load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> tuple[int, float]:
    """Restore what :func:`_save_optimizer` wrote; returns ``(step, seconds)``."""
    tensors = _io.load_state_dict(path)
    metadata = _io.read_metadata(path)
    state: dict[int, dict] = {}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    saved = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    return int(metadata["step"]), float(metadata["seconds"])


# -------------------------------------------------------------- evaluation
def _accuracy(logits: Tensor, targets: Tensor) -> float:
    scored = targets != IGNORE
    if not bool(scored.any()):
        return 0.0
    return float((logits.argmax(-1)[scored] == targets[scored]).float().mean())


def evaluate(model: GPT, inputs: Tensor, targets: Tensor, *, batch_size: int = 256) -> tuple[float, float]:
    """``(loss, accuracy)`` of ``model`` on the scored positions of ``(inputs, targets)``, eval mode.

    Example:
        >>> model = GPT(vocab_size=4, max_len=3, d_model=8, num_layers=1, num_heads=2)
        >>> loss, accuracy = evaluate(model, torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, -100]]))
        >>> accuracy in (0.0, 0.5, 1.0)
        True
    """
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    try:
        with torch.no_grad():
            for start in range(0, inputs.shape[0], batch_size):
                logits = model(inputs[start:start + batch_size])  # (b, T, V)
                target = targets[start:start + batch_size]
                scored = target != IGNORE
                total_loss += float(F.cross_entropy(logits[scored], target[scored], reduction="sum"))
                correct += int((logits.argmax(-1)[scored] == target[scored]).sum())
                count += int(scored.sum())
    finally:
        model.train(was_training)
    return total_loss / max(count, 1), correct / max(count, 1)


def head_scores(model: GPT, inputs: Tensor) -> dict[str, Tensor]:
    """Per-head ``previous_token``, ``current_token`` and ``induction`` scores ``(L, H)`` on ``inputs`` ``(B, T)``.

    * previous-token: the mean weight a query at ``t >= 1`` puts on position ``t - 1``;
    * current-token: the mean weight a query puts on its own position;
    * induction: over queries ``t`` whose token occurred before at some ``j < t - 1`` (the
      latest such ``j``), the mean weight on ``j + 1`` -- the token that followed it then.

    Also returns ``sink_share`` ``(L, H)``, the mean share of a query's mass that went to no key
    (the sink's, for a model with sinks; 0 within rounding otherwise: :func:`attnlab.lab.trained.sink_shares`),
    and ``weights`` ``(L, H, T, T)``, the attention of the first sequence. When layers
    have different numbers of heads, ``H`` is the largest and the heads a layer lacks are NaN
    (:func:`attnlab.lab.trained.pad_heads`).

    Example:
        >>> model = GPT(vocab_size=5, max_len=6, d_model=8, num_layers=2, num_heads=(2, 1))
        >>> scores = head_scores(model, torch.tensor([[1, 2, 3, 1, 2, 3]]))
        >>> scores["induction"].shape, bool(scores["induction"][1, 1].isnan())
        (torch.Size([2, 2]), True)
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, weights = model(inputs, return_weights=True)
    finally:
        model.train(was_training)
    target, has = _induction_targets(inputs)  # (B, T)
    per_layer = [_layer_scores(w.float(), target, has) for w in weights]  # L x ((H_l,), (H_l,))
    return {"previous_token": pad_heads([previous for previous, _ in per_layer]),
            "current_token": pad_heads([w.float().diagonal(dim1=-2, dim2=-1).mean(dim=(0, 2)) for w in weights]),
            "induction": pad_heads([induction for _, induction in per_layer]),
            "sink_share": pad_heads([sink_shares(w.float()).mean(dim=(0, 2)) for w in weights]),  # (B, H, T) -> (H,)
            "weights": pad_heads([w[0].float() for w in weights])}


def _layer_scores(weights: Tensor, target: Tensor, has: Tensor) -> tuple[Tensor, Tensor]:
    """Previous-token and induction scores ``(H,)`` of one layer's weights ``(B, H, T, T)``."""
    T = weights.shape[-1]
    t = torch.arange(1, T)
    previous = weights[..., t, t - 1].mean(dim=(0, 2))  # (H,)
    index = target.clamp(min=0)[:, None, :, None].expand(*weights.shape[:-1], 1)  # (B, H, T, 1)
    picked = weights.gather(-1, index)[..., 0]  # (B, H, T): weight on the induction target of each query
    mask = has[:, None, :].float()
    induction = (picked * mask).sum(dim=(0, 2)) / mask.sum().clamp(min=1)  # mask sums over (b, t) only
    return previous, induction


def _induction_targets(inputs: Tensor) -> tuple[Tensor, Tensor]:
    """For each query ``t``: ``j + 1`` for the latest ``j < t - 1`` with the same token; and whether one exists."""
    B, T = inputs.shape
    same = inputs[:, :, None] == inputs[:, None, :]  # (B, Tq, Tk)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    earlier = same & (k < q - 1)
    latest = torch.where(earlier, k.expand(T, T), torch.full((T, T), -1)).amax(dim=-1)  # (B, T)
    return latest + 1, latest >= 0


def ablate_heads(model: GPT, inputs: Tensor, targets: Tensor) -> Tensor:
    """Held-out accuracy ``(L, H)`` with each head's output zeroed in turn (one at a time).

    A head's context vector occupies features ``[h * head_dim, (h + 1) * head_dim)`` of the
    input of its layer's ``out_proj``; a forward pre-hook zeroes that slice. When layers have
    different numbers of heads, the heads a layer lacks are NaN.

    Example:
        >>> model = GPT(vocab_size=4, max_len=3, d_model=8, num_layers=2, num_heads=(2, 1))
        >>> ablate_heads(model, torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, -100]])).isnan().tolist()
        [[False, False], [False, True]]
    """
    return pad_heads([torch.tensor([_ablate_group(model, inputs, targets, [(layer, head)]) for head in range(count)])
                      for layer, count in enumerate(model.heads_per_layer)])


def summarize(task: str, accuracy: float, scores: dict[str, Tensor], ablated: Tensor) -> str:
    """One paragraph naming the heads that do the task, with their scores and ablation figures.

    ``ablated`` holds the held-out accuracy *left* when one head's output is zeroed; the paragraph
    says so, beside the full model's accuracy, and says what each head that costs more than 5
    points does, from its scores (``current_token`` is optional: :func:`head_scores` gives it).

    Example:
        >>> scores = {"previous_token": torch.tensor([[0.9, 0.1], [0.2, 0.1]]),
        ...           "induction": torch.tensor([[0.0, 0.1], [0.1, 0.95]])}
        >>> print(summarize("induction", 0.99, scores, torch.tensor([[0.2, 0.98], [0.97, 0.1]])))
        ... # doctest: +NORMALIZE_WHITESPACE
        Held-out accuracy 99.0 %. Layer 1 head 1 is an induction head (induction score 0.95; accuracy
        left without it: 10.0 %). Layer 0 head 0 is a previous-token head (previous-token score 0.90;
        accuracy left without it: 20.0 %). Ablating one head at a time (its output zeroed) and measuring
        the accuracy left, against the full model's 99.0 %: without L0H0 it is 20.0 % (L0H0 is a
        previous-token head, score 0.90: it writes each position's previous token, which the induction
        head's keys are matched on); without L1H1 it is 10.0 % (L1H1 is an induction head, score 0.95: it
        finds the earlier copy of the current token and copies the token that followed it). Every other
        head costs at most 5 points.
    """
    parts = [f"Held-out accuracy {100 * accuracy:.1f} %."]
    induction, previous = scores["induction"], scores["previous_token"]
    layers = induction.shape[0]
    if task in ("induction", "recall") and layers > 1:
        l_ind, h_ind = best_head(induction[1:])
        l_ind += 1  # the induction head is looked for after the first layer
        l_prev, h_prev = best_head(previous[:l_ind])
        parts.append(_named(l_ind, h_ind, "an induction head", "induction", float(induction[l_ind, h_ind]),
                            float(ablated[l_ind, h_ind])))
        parts.append(_named(l_prev, h_prev, "a previous-token head", "previous-token",
                            float(previous[l_prev, h_prev]), float(ablated[l_prev, h_prev])))
    costly = [(l, h) for l, count in enumerate(count_heads(ablated)) for h in range(count)
              if accuracy - float(ablated[l, h]) > 0.05]
    if costly:
        parts.append(f"Ablating one head at a time (its output zeroed) and measuring the accuracy left, against "
                     f"the full model's {100 * accuracy:.1f} %: " + "; ".join(
                         f"without L{l}H{h} it is {100 * float(ablated[l, h]):.1f} % (L{l}H{h} is "
                         f"{_role(l, h, scores)})" for l, h in costly) + "."
                     + (" Every other head costs at most 5 points." if len(costly) < sum(count_heads(ablated)) else ""))
    else:
        parts.append(f"No single head's ablation costs more than 5 points of the full model's {100 * accuracy:.1f} %: "
                     "the task is spread over heads.")
    return " ".join(parts)


def _role(layer: int, head: int, scores: dict[str, Tensor]) -> str:
    """What a head does, read from its scores: induction (after the first layer), previous-token,
    current-token (when ``scores`` has it), or none of them (its scores named)."""
    named = {name: float(scores[name][layer, head]) for name in ("previous_token", "induction", "current_token")
             if name in scores}
    if layer > 0 and named["induction"] >= ROLE_THRESHOLD:
        return (f"an induction head, score {named['induction']:.2f}: it finds the earlier copy of the current token "
                "and copies the token that followed it")
    if named["previous_token"] >= ROLE_THRESHOLD:
        return (f"a previous-token head, score {named['previous_token']:.2f}: it writes each position's previous "
                "token, which the induction head's keys are matched on")
    if named.get("current_token", 0.0) >= ROLE_THRESHOLD:
        return (f"a current-token head, score {named['current_token']:.2f}: it attends to the token itself and "
                "writes it once more into the next layer's input, a copy the later heads evidently read")
    return "none of these roles: " + ", ".join(f"{name.replace('_', '-')} score {value:.2f}"
                                               for name, value in named.items())


# ------------------------------------------------------------------ analysis
def _named(layer: int, head: int, role: str, score_name: str, score: float, ablated: float) -> str:
    """``Layer l head h is <role> (...)`` when its score reaches the role threshold, else that no head is one yet."""
    figures = f"{score_name} score {score:.2f}; accuracy left without it: {100 * ablated:.1f} %"
    if score >= ROLE_THRESHOLD:
        return f"Layer {layer} head {head} is {role} ({figures})."
    return f"No head is {role} yet (the closest, layer {layer} head {head}: {figures})."


def analyze(trainer: Trainer, *, sequences: int = 64) -> dict:
    """Head scores, single-head ablation and the summary of a trained run, as JSON-ready lists.

    ``sequences`` held-out rows give the scores; ablation uses the whole held-out set. The
    heads after the first layer whose induction score is at least 0.5 are also ablated together
    (``induction_heads_ablated``): several heads can share one job, and then zeroing any single
    one of them costs little; the summary then says so, with both figures. A model trained with
    sinks also gets ``heads["sink_share"]``, each head's mean sink share, and a sentence on it.
    A model with differential, gated or sparse layers (they return no weights) gets empty ``heads`` and a
    summary saying why (and :func:`write_figures` draws its curves only).

    Example:
        >>> run = Trainer(TrainConfig(d_model=8, heads=2, eval_sequences=4))
        >>> sorted(analyze(run)["heads"])
        ['ablation_accuracy', 'induction', 'previous_token']
    """
    inputs, targets = trainer.eval_set()
    silent = [name for name in trainer.model.layer_kinds if not LAYER_TABLE[name].weights]
    if silent:  # differential, gated and sparse layers return no weight matrix to score
        accuracy = trainer.history["eval_accuracy"][-1] if trainer.history["eval_accuracy"] else trainer.evaluate()[1]
        return {"heads": {}, "example": inputs[0], "summary": (
            f"Held-out accuracy {100 * accuracy:.1f} %. No head scores or ablation: the layer_pattern's "
            f"{', '.join(sorted(set(silent)))} layers ({', '.join(LAYER_KINDS[k] for k in sorted(set(silent)))}) "
            "return no single weight matrix.")}
    scores = head_scores(trainer.model, inputs[:sequences])
    ablated = ablate_heads(trainer.model, inputs, targets)
    accuracy = trainer.history["eval_accuracy"][-1] if trainer.history["eval_accuracy"] else trainer.evaluate()[1]
    text = summarize(trainer.config.task, accuracy, scores, ablated)
    result = {"heads": {"previous_token": _rounded(scores["previous_token"]),
                        "induction": _rounded(scores["induction"]), "ablation_accuracy": _rounded(ablated)},
              "summary": text, "weights": scores["weights"], "example": inputs[0]}
    if trainer.config.sinks:
        result["heads"]["sink_share"] = _rounded(scores["sink_share"])
        result["summary"] += " " + _sink_sentence(scores["sink_share"])
    later = torch.nonzero(scores["induction"][1:] >= ROLE_THRESHOLD).tolist()  # (layer - 1, head) rows
    group = [(layer + 1, head) for layer, head in later]
    if group:
        together = _ablate_group(trainer.model, inputs, targets, group)
        names = ", ".join(f"L{l}H{h}" for l, h in group)
        result["induction_heads_ablated"] = {"heads": names, "accuracy": round(together, 4)}
        if len(group) > 1:
            alone = [100 * float(ablated[l, h]) for l, h in group]
            result["summary"] += (f" The {len(group)} heads with induction score >= {ROLE_THRESHOLD} ({names}) share the job: "
                                  f"ablating one alone leaves {min(alone):.1f}-{max(alone):.1f} %, ablating them "
                                  f"together drops accuracy to {100 * together:.1f} %.")
    return result


def _sink_sentence(share: Tensor) -> str:
    """Where the sinks took the most and the least of the mass, from the ``(L, H)`` mean shares.

    Example:
        >>> print(_sink_sentence(torch.tensor([[0.1, 0.6], [0.3, float("nan")]])))
        The sink takes on average 0.60 of a query's attention in layer 0 head 1 (the most) and 0.10 in layer 0 head 0 (the least).
    """
    (lm, hm), (ll, hl) = best_head(share), best_head(-share)
    return (f"The sink takes on average {float(share[lm, hm]):.2f} of a query's attention in layer {lm} head {hm} "
            f"(the most) and {float(share[ll, hl]):.2f} in layer {ll} head {hl} (the least).")


def _rounded(t: Tensor) -> list:
    """An ``(L, H)`` table as JSON-ready lists, one per layer with that layer's heads (never NaN)."""
    return [[round(float(v), 4) for v in row] for row in unpad_heads(t)]


def _ablate_group(model: GPT, inputs: Tensor, targets: Tensor, heads: list[tuple[int, int]]) -> float:
    """Held-out accuracy with all ``heads`` ``(layer, head)`` zeroed at once."""
    handles = []
    for layer, head in heads:
        attn = model.blocks[layer].attn  # a latent layer's heads give value_dim features each, not head_dim
        head_dim = attn.out_proj.in_features // attn.num_heads

        def zero_head(module, args, lo=head * head_dim, hi=(head + 1) * head_dim):
            x = args[0].clone()
            x[..., lo:hi] = 0
            return (x,)

        handles.append(model.blocks[layer].attn.out_proj.register_forward_pre_hook(zero_head))
    try:
        return evaluate(model, inputs, targets)[1]
    finally:
        for handle in handles:
            handle.remove()


def write_figures(trainer: Trainer, analysis: dict, directory: str | os.PathLike) -> list[Path]:
    """The loss/accuracy curves and every layer's and head's attention on a held-out example (PNG).

    Example:
        >>> import tempfile
        >>> run = Trainer(TrainConfig(steps=2, batch_size=2, d_model=8, heads=2, eval_sequences=4))
        >>> _ = run.train()
        >>> [p.name for p in write_figures(run, analyze(run), tempfile.mkdtemp())][:2]
        ['curves.png', 'heads.png']
    """
    directory = Path(directory)
    written = save_figure(_curves(trainer), directory / "curves", formats=("png",))
    if "weights" not in analysis:  # a model whose layers return no weights: the curves only
        return written
    labels = trainer.task.labels(analysis["example"])
    weights = analysis["weights"]  # (L, H, T, T)
    name = f"{trainer.config.task}, step {trainer.step}"
    accuracy = 100 * trainer.history["eval_accuracy"][-1]
    grid = head_grid(weights, labels, captions=_head_captions(analysis["heads"]),
                     title=f"{trainer.config.task}: every head on a held-out example\n"
                           f"step {trainer.step}, held-out accuracy {accuracy:.1f} %")
    written += save_figure(grid, directory / "heads", formats=("png",))
    for layer, layer_weights in enumerate(unpad_heads(weights)):  # (H_layer, T, T) each
        figure = heatmap(layer_weights, rows=labels, cols=labels, title=f"{name}: layer {layer}",
                         annotate=False)
        written += save_figure(figure, directory / f"attention-layer{layer}", formats=("png",))
    return written


def _head_captions(heads: dict) -> list[list[str]]:
    """Per layer, per head: its role and score (:func:`attnlab.lab.trained.head_roles`) and its ablation figure."""
    previous = pad_heads([torch.tensor(row) for row in heads["previous_token"]])  # (L, H), NaN: missing
    induction = pad_heads([torch.tensor(row) for row in heads["induction"]])
    captions = []
    for layer, roles in enumerate(head_roles(previous, induction)):
        row = []
        for head, (role, score) in enumerate(roles):
            named = (f"{role} {score:.2f}" if role else
                     f"no role (prev {previous[layer, head]:.2f}, ind {induction[layer, head]:.2f})")
            row.append(f"{named}\naccuracy if ablated: {100 * heads['ablation_accuracy'][layer][head]:.1f} %")
        captions.append(row)
    return captions


def _curves(trainer: Trainer):
    """Training and held-out loss (left) and held-out accuracy (right) against the step."""
    from matplotlib.figure import Figure

    h = trainer.history
    fig = Figure(figsize=(9, 3.4), dpi=110, layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(h["step"], h["train_loss"], lw=0.8, alpha=0.6, label="training batch")
    loss_ax.plot(h["eval_step"], h["eval_loss"], lw=1.6, label="held out")
    loss_ax.set(xlabel="step", ylabel="loss (scored positions)", yscale="log")
    loss_ax.legend(fontsize=8)
    acc_ax.plot(h["eval_step"], [100 * a for a in h["eval_accuracy"]], lw=1.6, color="C1")
    acc_ax.set(xlabel="step", ylabel="held-out accuracy (%)", ylim=(0, 101))
    fig.suptitle(f"attnlab train --task {trainer.config.task}", fontsize=11)
    return fig


# ------------------------------------------------------- live progress in a notebook
_CURVE_POINTS = 200  # the training loss is averaged into at most this many points per frame
_PANEL = dict(width=300, height=150, left=44, right=8, top=18, bottom=26)  # one panel of the SVG, in px
_BATCH, _HELD_OUT = "#3b78c2", "#e07b00"  # the colours of the training-batch and held-out curves


class LiveProgress:
    """An ``on_step`` for :meth:`Trainer.train`: a progress bar and the loss and accuracy curves,
    drawn while the model trains and replaced in place a few times a second.

    In a notebook the frame is one HTML output (a bar and an inline SVG: no widget, no script, no
    stderr), shown by ``IPython.display.display(..., display_id=True)`` and replaced through its
    handle. Elsewhere (no IPython, or no running shell) each frame prints as one line. A frame is
    drawn at the first step, then at most once every ``interval`` seconds, and at the last step.

    Args:
        trainer: the run drawn: its ``config.steps`` and its ``history`` (held-out points included).
        interval: the fewest seconds between two frames.
        clock: the time in seconds, for the interval (default ``time.monotonic``; a test passes its own).

    Example:
        >>> run = Trainer(TrainConfig(steps=3, batch_size=2, d_model=8, heads=2, eval_sequences=4))
        >>> live = LiveProgress(run, interval=60.0)
        >>> _ = run.train(on_step=live)  # doctest: +ELLIPSIS
        induction: step 1 / 3, ...
        induction: step 3 / 3, ... held-out accuracy ...
        >>> live.frames, "<svg" in live.frame()._repr_html_()
        (2, True)
    """

    def __init__(self, trainer: Trainer, *, interval: float = 0.25, clock: Callable[[], float] = time.monotonic):
        self.trainer = trainer
        self.interval = positive_number("interval", interval)
        self.clock = clock
        self.frames = 0
        self._handle = None
        self._last: float | None = None
        self._batch_accuracy: list[tuple[int, float]] = []

    def __call__(self, step: int, loss: float, accuracy: float, tokens_per_second: float) -> None:
        now = self.clock()
        self._batch_accuracy.append((step, accuracy))
        last = step >= self.trainer.config.steps
        if self._last is None or last or now - self._last >= self.interval:
            self._last = now
            self.draw()

    def draw(self) -> None:
        """Show the current frame now (the first call displays it, later ones replace it)."""
        frame = self.frame()
        self.frames += 1
        if self._handle is not None:
            self._handle.update(frame)
            return
        try:
            from IPython.display import display  # optional: only a notebook draws the frame
        except ImportError:
            print(frame)
            return
        self._handle = display(frame, display_id=True)  # None outside a running IPython: it printed

    def frame(self) -> "_Frame":
        """The frame for the run as it stands: HTML for a notebook, one line of text otherwise."""
        t, c, h = self.trainer, self.trainer.config, self.trainer.history
        status = f"{c.task}: step {t.step} / {c.steps}, {t.seconds:.1f} s"  # training time, as metrics()
        if h["train_loss"]:
            status += f", training loss {h['train_loss'][-1]:.3g}"
        if h["eval_accuracy"]:
            status += f", held-out accuracy {100 * h['eval_accuracy'][-1]:.1f} % (step {h['eval_step'][-1]})"
        width = 2 * _PANEL["width"]
        bar = (f'<div style="width:{width}px;height:8px;background:#e4e4e4;border-radius:4px">'
               f'<div style="width:{100 * min(1.0, t.step / c.steps):.1f}%;height:8px;background:{_BATCH};'
               f'border-radius:4px"></div></div>')
        batch_accuracy = [(s, 100 * a) for s, a in _averaged(*zip(*self._batch_accuracy), _CURVE_POINTS)] \
            if self._batch_accuracy else []
        loss = _svg_panel(0, "loss (log scale)", [(_averaged(h["step"], h["train_loss"], _CURVE_POINTS), _BATCH, 0.7),
                                                  (list(zip(h["eval_step"], h["eval_loss"])), _HELD_OUT, 1.0)],
                          x_max=c.steps, log=True)
        accuracy = _svg_panel(_PANEL["width"], "accuracy (%)", [
            (batch_accuracy, _BATCH, 0.7), ([(s, 100 * a) for s, a in zip(h["eval_step"], h["eval_accuracy"])],
                                            _HELD_OUT, 1.0)], x_max=c.steps, y_range=(0.0, 100.0))
        svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{_PANEL["height"]}" '
               f'font-family="sans-serif" font-size="10">{loss}{accuracy}</svg>')
        legend = (f'<span style="color:{_BATCH}">training batch</span> · '
                  f'<span style="color:{_HELD_OUT}">held out</span>')
        return _Frame(f'<div class="attnlab-train-progress" style="font-family:sans-serif;font-size:12px">'
                      f'<div>{html.escape(status)}</div>{bar}{svg}<div>{legend}</div></div>', status)


class _Frame:
    """One frame of :class:`LiveProgress`: HTML for a notebook, its status line as text."""

    def __init__(self, html_text: str, text: str):
        self.html_text, self.text = html_text, text

    def _repr_html_(self) -> str:
        return self.html_text

    def __repr__(self) -> str:
        return self.text


def _averaged(xs, ys, points: int) -> list[tuple[float, float]]:
    """``(x, y)`` pairs averaged in consecutive groups so that at most ``points`` remain."""
    xs, ys = list(xs), list(ys)
    size = max(1, math.ceil(len(xs) / points))
    return [(sum(xs[i:i + size]) / len(xs[i:i + size]), sum(ys[i:i + size]) / len(ys[i:i + size]))
            for i in range(0, len(xs), size)]


def _svg_panel(x0: float, title: str, series: list, *, x_max: int, log: bool = False,
               y_range: tuple[float, float] | None = None) -> str:
    """One plot of the SVG, ``x0`` px from its left: steps 0 to ``x_max`` across, each series
    ``(points, colour, opacity)`` one polyline; ``log``: a log scale from power of ten to power of ten."""
    p = _PANEL
    if y_range is None:
        values = [y for points, _, _ in series for _, y in points if y > 0] or [0.1, 10.0]
        y_range = (10 ** math.floor(math.log10(min(values))), 10 ** math.ceil(math.log10(max(values))))
    to_axis = (lambda y: math.log10(max(y, y_range[0]))) if log else (lambda y: y)
    lo, hi = to_axis(y_range[0]), to_axis(y_range[1])
    hi = hi if hi > lo else lo + 1
    left, width, height = x0 + p["left"], p["width"] - p["left"] - p["right"], p["height"] - p["top"] - p["bottom"]

    def px(x: float) -> float:
        return left + width * x / max(x_max, 1)

    def py(y: float) -> float:
        return p["top"] + height * (hi - to_axis(y)) / (hi - lo)

    ticks = ([10 ** e for e in range(round(lo), round(hi) + 1)] if log else
             [y_range[0] + (y_range[1] - y_range[0]) * i / 4 for i in range(5)])
    parts = [f'<text x="{left}" y="12">{html.escape(title)}</text>',
             f'<rect x="{left}" y="{p["top"]}" width="{width}" height="{height}" fill="none" stroke="#999"/>']
    parts += [f'<text x="{left - 4}" y="{py(tick) + 3:.1f}" text-anchor="end">{tick:g}</text>' for tick in ticks]
    parts += [f'<text x="{px(step):.1f}" y="{p["height"] - 12}" text-anchor="middle">{step}</text>'
              for step in (0, x_max)]
    parts.append(f'<text x="{left + width / 2:.1f}" y="{p["height"] - 2}" text-anchor="middle">step</text>')
    for points, colour, opacity in series:
        if points:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-opacity="{opacity}"/>')
    return "".join(parts)
