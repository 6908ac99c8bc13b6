"""The training loop: :class:`Trainer` (a model, its optimizer and its task, trained step by step,
saved and resumed) and :class:`TrainResult`.

The batch of step ``s`` is drawn from a generator seeded by ``(seed, s)``, so a run resumed from a
checkpoint at step ``s`` sees the same data as an uninterrupted one; held-out data comes from a
separate stream that training never draws from.

Example:
    >>> from attnlab.lab.train.config import TrainConfig
    >>> Trainer(TrainConfig(steps=2, batch_size=2, d_model=8, heads=2, eval_sequences=4)).train().step
    2
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from attnlab import io as _io
from attnlab._checks import positive_int
from attnlab.distributed import context_parallel as _context_parallel, ContextParallel
from attnlab.distributed.layout import check_length
from attnlab.models import _hub, GPT
from attnlab.lab.train.checkpoints import (METRICS_FILE, OPTIMIZER_FILE, _load_optimizer, _save_optimizer, _steps_of,
                                           read_checkpoint)
from attnlab.lab.train.config import TrainConfig
from attnlab.lab.train.evaluation import _accuracy, evaluate
from attnlab.lab.train.tasks import IGNORE, Task, TextTask, make_task


_EVAL_STREAM = 1 << 40  # held-out data is drawn from seeds training never uses


_STEP_SEED = 1_000_003


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
                             sinks=c.sinks, chunk=c.chunk, topk=c.topk, nsa_block=c.nsa_block,
                             compress_rate=c.compress_rate, num_kv_shared_layers=c.kv_shared_layers).to(c.device)
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
