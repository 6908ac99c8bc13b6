"""Checkpoints: the files a run writes beside its model and how they are read back.

A checkpoint folder holds the model (``model.safetensors``, ``config.json`` with the run's
:class:`~attnlab.lab.train.config.TrainConfig`), AdamW's state as safetensors
(:data:`OPTIMIZER_FILE`, never pickle; the step in its header) and the metrics
(:data:`METRICS_FILE`). :meth:`Trainer.save <attnlab.lab.train.loop.Trainer.save>` writes them,
:func:`read_checkpoint` reads the config and the step without loading any weight.

Example:
    >>> OPTIMIZER_FILE, METRICS_FILE
    ('optimizer.safetensors', 'metrics.json')
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from attnlab import io as _io
from attnlab.models import _hub
from attnlab.lab.train.config import TrainConfig


OPTIMIZER_FILE = "optimizer.safetensors"


METRICS_FILE = "metrics.json"


def read_checkpoint(directory: str | os.PathLike) -> tuple[TrainConfig, int, list[str] | None]:
    """A train checkpoint's resolved config, its step and its text task's characters (None for others).

    Reads ``config.json`` and the optimizer file's header only: no weights are loaded, nothing is written.

    Example:
        >>> import tempfile
        >>> from attnlab.lab.train import Trainer
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
