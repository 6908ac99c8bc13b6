"""The training data: the tasks a small GPT learns, each a stream of ``(inputs, targets)`` batches.

Every task is next-token prediction scored only where the answer is determined by the input
(elsewhere the target is :data:`IGNORE`): ``induction``, ``recall``, ``reverse``, ``sort`` and
``text`` (:data:`TASKS`; :func:`make_task` builds one by name). :data:`TASK_DEFAULTS` holds each
task's model and training sizes, :func:`default_heads` its head counts at a given depth.

Example:
    >>> task = make_task("induction")
    >>> inputs, targets = task.batch(2, torch.Generator().manual_seed(0))
    >>> inputs.shape == targets.shape == (2, task.seq_len)
    True
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from attnlab._checks import one_of


TASKS = ("induction", "recall", "reverse", "sort", "text")


IGNORE = -100  # F.cross_entropy's ignore_index: positions whose next token is not determined


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
    """Random tokens with one segment of distinct tokens repeated; scored on the repeat.

    Example:
        >>> task = InductionTask(vocab_size=16, seq_len=24, min_segment=4, max_segment=6)
        >>> inputs, targets = task.batch(3, torch.Generator().manual_seed(0))
        >>> inputs.shape, 3 <= int((targets != IGNORE).sum(dim=1).min()) <= 6
        (torch.Size([3, 24]), True)
    """

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

    Example:
        >>> task = RecallTask(pairs=4, queries=2)
        >>> inputs, targets = task.batch(2, torch.Generator().manual_seed(0))
        >>> (targets != IGNORE).sum(dim=1).tolist()
        [2, 2]
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
    """``x1 .. xn SEP xn .. x1``: the sequence, then reversed.

    Example:
        >>> inputs, targets = ReverseTask(length=3).batch(1, torch.Generator().manual_seed(0))
        >>> torch.equal(targets[0, 3:6], inputs[0, :3].flip(0))  # (T,) = (2n + 1,)
        True
    """

    name = "reverse"

    def transform(self, x):
        return x.flip(1)


class SortTask(_SequenceTask):
    """``x1 .. xn SEP sorted(x)``: the sequence, then sorted.

    Example:
        >>> inputs, targets = SortTask(length=4).batch(1, torch.Generator().manual_seed(0))
        >>> torch.equal(targets[0, 4:8], inputs[0, :4].sort().values)  # (T,) = (2n + 1,)
        True
    """

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
