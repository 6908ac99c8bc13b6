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

The package, by concern (every public name is importable from ``attnlab.lab.train``):

* :mod:`~attnlab.lab.train.tasks` -- the data: the tasks, :data:`TASK_DEFAULTS`, :func:`make_task`;
* :mod:`~attnlab.lab.train.config` -- the model setup: :class:`TrainConfig`, :func:`memory_estimate`;
* :mod:`~attnlab.lab.train.loop` -- :class:`Trainer` (steps, evaluation, save and resume);
* :mod:`~attnlab.lab.train.checkpoints` -- the checkpoint files and :func:`read_checkpoint`;
* :mod:`~attnlab.lab.train.evaluation` -- held-out loss and accuracy (:func:`evaluate`);
* :mod:`~attnlab.lab.train.sharded` -- one rank of a context-parallel run (:func:`train_sharded`);
* :mod:`~attnlab.lab.train.analysis` -- head scores, ablation, the summary (:func:`analyze`);
* :mod:`~attnlab.lab.train.report` -- the PNG figures and :class:`LiveProgress` in a notebook.
"""

from attnlab.models.gpt import POSITIONS
from attnlab.lab.train.tasks import (IGNORE, TASK_DEFAULTS, TASKS, InductionTask, RecallTask, ReverseTask, SortTask,
                                     Task, TextTask, default_heads, make_task)  # noqa: F401 (importable as before)
from attnlab.lab.train.config import TrainConfig, memory_estimate
from attnlab.lab.train.checkpoints import METRICS_FILE, OPTIMIZER_FILE, read_checkpoint  # noqa: F401
from attnlab.lab.train.evaluation import evaluate
from attnlab.lab.train.loop import Trainer, TrainResult
from attnlab.lab.train.sharded import ShardedRun, train_sharded
from attnlab.lab.train.analysis import ablate_heads, analyze, head_scores, summarize
from attnlab.lab.train.report import LiveProgress, write_figures

__all__ = ["TASKS", "POSITIONS", "IGNORE", "TrainConfig", "default_heads", "Task", "make_task", "Trainer",
           "TrainResult", "head_scores", "ablate_heads", "summarize", "evaluate", "analyze", "write_figures",
           "TextTask", "memory_estimate", "read_checkpoint", "ShardedRun", "train_sharded", "LiveProgress"]
