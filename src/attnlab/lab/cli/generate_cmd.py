"""``attnlab generate``: continue a prompt with a checkpoint from ``attnlab train``, token by token.

Text checkpoints (``--task text``) take the prompt as text and print characters as they come;
checkpoints of the synthetic tasks take whitespace-separated token ids. A prompt the model
cannot encode, or a length past the model's positions, is one ``error:`` line (exit 2).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import typer

from attnlab._checks import positive_int
from attnlab.lab.cli._errors import MAX_SEED, check_seed, fail, option_errors
from attnlab.lab.cli._help import HelpCommand


def generate(
    model: Path = typer.Option(..., "--model", help="A checkpoint folder written by `attnlab train` (or any GPT)."),
    prompt: str = typer.Option(..., "--prompt", help="Text (text checkpoints) or token ids separated by spaces."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", help="Tokens to generate."),
    temperature: float = typer.Option(0.8, "--temperature", help="0 = greedy; higher = more varied."),
    top_k: int = typer.Option(None, "--top-k", help="Sample only among the K most likely tokens."),
    seed: int = typer.Option(0, "--seed", help=f"Sampling seed, 0 to {MAX_SEED}."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Recompute every position at every step (slow)."),
) -> None:
    """Continue --prompt with a trained GPT, printing each token as it comes and tokens/s at the end."""
    check_seed(seed)
    with option_errors():
        positive_int("--max-new-tokens", max_new_tokens)
        if top_k is not None:
            positive_int("--top-k", top_k)
        if not temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    from attnlab.models import GPT

    try:
        gpt = GPT.from_pretrained(model)
    except (FileNotFoundError, ValueError) as err:
        fail(f"--model {str(model)!r}: {err}")
    chars = gpt.extra.get("chars")
    ids = _encode(prompt, chars, gpt.config["vocab_size"])
    room = gpt.max_len - ids.shape[1]
    if max_new_tokens > room:
        fail(f"--max-new-tokens {max_new_tokens} is too many: the model takes {gpt.max_len} positions and the "
             f"prompt uses {ids.shape[1]}; ask for at most {max(room, 0)}")
    generator = torch.Generator().manual_seed(seed)
    with option_errors():
        tokens = gpt.stream(ids, max_new_tokens, temperature=temperature, top_k=top_k, use_cache=not no_cache,
                            generator=generator)
    _print_stream(prompt, tokens, chars)


def _encode(prompt: str, chars: list[str] | None, vocab_size: int) -> torch.Tensor:
    """``(1, T)`` ids: characters of a text model, or integers for the synthetic tasks."""
    if not prompt:
        fail("--prompt must not be empty")
    if chars is not None:
        unknown = sorted(set(prompt) - set(chars))
        if unknown:
            fail(f"--prompt has characters the model never saw: {''.join(unknown)!r}")
        index = {c: i for i, c in enumerate(chars)}
        return torch.tensor([[index[c] for c in prompt]])
    try:
        ids = [int(piece) for piece in prompt.split()]
    except ValueError:
        fail(f"--prompt must be token ids in 0..{vocab_size - 1} separated by spaces for this model "
             f"(it has no text vocabulary); got {prompt!r}")
    if not ids or not all(0 <= i < vocab_size for i in ids):
        fail(f"--prompt token ids must be in 0..{vocab_size - 1}; got {prompt!r}")
    return torch.tensor([ids])


def _print_stream(prompt: str, tokens, chars: list[str] | None) -> None:
    out = sys.stdout
    out.write(prompt if chars is not None else prompt.strip())
    out.flush()
    start, count = time.perf_counter(), 0
    for token in tokens:
        value = int(token[0, 0])
        out.write(chars[value] if chars is not None else f" {value}")
        out.flush()
        count += 1
    seconds = time.perf_counter() - start
    out.write("\n")
    out.flush()  # the rate goes to stderr: keep it after the text
    typer.echo(f"{count} tokens in {seconds:.2f} s: {count / max(seconds, 1e-9):,.1f} tokens/s", err=True)


def register(app: typer.Typer) -> None:
    """Add the ``generate`` command to ``app``."""
    app.command("generate", cls=HelpCommand)(generate)
