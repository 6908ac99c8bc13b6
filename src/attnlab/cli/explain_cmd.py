"""``attnlab explain``: walk a sentence through attention step by step."""

from __future__ import annotations

import typer
from rich.console import Console

DEFAULT_SENTENCE = "The chef prepared a delicious meal, and it was served with wine."


def explain(
    sentence: str = typer.Argument(DEFAULT_SENTENCE, help="The sentence to walk through."),
    seed: int = typer.Option(123, "--seed", help="Random seed for embeddings and weights."),
    causal: bool = typer.Option(False, "--causal", help="Mask future tokens."),
) -> None:
    """Walk SENTENCE through scaled dot-product self-attention, printing every step."""
    import torch

    import attnlab

    console = Console()
    words = sentence.replace(",", "").replace(".", "").split()
    torch.manual_seed(seed)
    x = torch.nn.Embedding(len(words), 3)(torch.arange(len(words))).detach()
    out, weights = attnlab.attention(x, x, x, causal=causal, return_weights=True)
    console.print(f"tokens: {words}")
    console.print(f"weights {tuple(weights.shape)}:\n{weights}")
    console.print(f"context vectors {tuple(out.shape)}:\n{out}")


def register(app: typer.Typer) -> None:
    """Add the ``explain`` command to ``app``."""
    app.command("explain")(explain)
