"""Held-out evaluation: a model's loss and accuracy on the scored positions.

Example:
    >>> from attnlab.models import GPT
    >>> model = GPT(vocab_size=4, max_len=3, d_model=8, num_layers=1, num_heads=2)
    >>> loss, accuracy = evaluate(model, torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, -100]]))
    >>> loss > 0.0
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.models import GPT
from attnlab.lab.train.tasks import IGNORE


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
