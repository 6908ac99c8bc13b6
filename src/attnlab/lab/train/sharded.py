"""Training across ranks: every rank of a context-parallel run trains on its shard of each
sequence (``attnlab train --context-parallel P``).

Example:
    >>> from attnlab.lab.train.config import TrainConfig
    >>> ShardedRun(config=TrainConfig(d_model=8, heads=2).resolved(), method="ring").threads
    1
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attnlab._checks import one_of
from attnlab.distributed import ContextParallel
from attnlab.lab.train.config import TrainConfig
from attnlab.lab.train.loop import Trainer


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
