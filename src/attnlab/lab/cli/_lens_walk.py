"""``attnlab explain --model DIR`` for any transformers checkpoint: every layer and head, and generation.

A directory whose ``config.json`` names a model type attnlab's own models do not read (``bert``,
``attnlab-gpt``) is opened through transformers with ``attn_implementation="attnlab"``
(:mod:`attnlab.lab.lens`): GPT-2, Llama, Qwen2, Mistral, ... It prints the tokens and, per layer, the
head with the strongest link from the query token, and writes ``model.html`` (every layer x head,
click to enlarge); with ``--generate N`` a decoder generates N tokens greedily and
``generation.html`` shows, per generated token, where each head looked. ``--format png`` or ``svg``
writes those views as ``model.png``/``generation.png`` (or ``.svg``) instead, ``all`` in the three
formats; any but ``html`` adds the layers x heads grid as ``heads.png``.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch

from safetensors import SafetensorError

from attnlab.lab.cli import _kernel as kernel
from attnlab.lab.cli._errors import fail
from attnlab.lab.cli._trained_walk import truncation_note, view_formats
from attnlab.lab.lens import ModelLens, open_model
from attnlab.lab.trained import best_head, pad_heads
from attnlab.lab.viz.heatmap import block_labels
from attnlab.lab.viz.recompute import LazyWeights
from attnlab.lab.viz.views import overview_block

OWN_MODEL_TYPES = ("bert", "attnlab-gpt")  # read by attnlab.models (the word-level walk)


def wants_lens(model: str) -> bool:
    """Whether ``--model`` is a directory for transformers: a ``config.json`` of another model type."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return False
    try:
        kind = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False  # the walk's loader says what is wrong with the file
    return isinstance(kind, str) and kind not in OWN_MODEL_TYPES


def load(model: str) -> ModelLens:
    """The model on attnlab, or one ``error:`` line saying why it cannot be (a damaged weights
    file included: transformers lets safetensors' own error through)."""
    _quiet_transformers()
    try:
        return open_model(model)
    except (ValueError, ImportError) as err:
        fail(f"--model {model!r}: {err}")
    except SafetensorError as err:
        files = sorted(Path(model).glob("*.safetensors"))
        named = repr(str(files[0])) if len(files) == 1 else "a *.safetensors file in it"
        fail(f"--model {model!r}: {named} is truncated or corrupted (not a valid safetensors file): {err}")


def _quiet_transformers() -> None:
    """No progress bars or warnings from transformers between our lines."""
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _refuse(err: ValueError) -> None:
    fail(str(err).replace("truncate=True (--truncate)", "--truncate"))


def _truncation(lens: ModelLens, text: str) -> str | None:
    """The line saying what ``--truncate`` cuts from ``text`` (None: it fits, or the walk refuses it)."""
    try:
        every = lens.uncut_ids(text)
    except ValueError:
        return None
    kept = len(every) if lens.max_positions is None else min(len(every), lens.max_positions)
    return truncation_note(kept, len(every), lens.labels(every[kept:]), "tokens")


def walk(console, lens: ModelLens, text: str, *, query: str | None, truncate: bool, generate: int | None,
         out: Path, fmt: str) -> list[Path]:
    """Print the model's heads for ``text`` and write its views; returns the files written."""
    if generate is not None and not lens.decoder:
        fail(f"--generate: {lens.name} is an encoder ({type(lens.model).__name__}); only a decoder generates")
    cut = _truncation(lens, text) if truncate else None
    try:
        if generate:
            result, prompt = lens.generate(text, generate, truncate=truncate)
            weights = result.weights  # (L, H, T, T)
        else:
            calls = []
            with console.status(f"running {lens.name} on the text"):
                weights, prompt = lens.record(text, truncate=truncate, calls=calls), None  # LazyWeights: any length
    except ValueError as err:
        _refuse(err)
    tokens = weights.tokens if prompt is None else result.tokens
    focus = _focus(tokens[:prompt], query)
    heads = weights.heads if prompt is None else [weights.shape[1]] * weights.shape[0]
    console.rule(f"[bold]attnlab explain[/bold]: {lens.name}, {len(heads)} layers x {max(heads)} heads")
    if cut is not None:
        console.print(cut, markup=False, soft_wrap=True)
    console.print(f"{type(lens.model).__name__} with attn_implementation='attnlab': every weight below comes from "
                  "attnlab.attention.", markup=False, soft_wrap=True)
    console.print(f"Tokens ({len(tokens[:prompt])}): " + _listed(tokens[:prompt]), markup=False, soft_wrap=True)
    console.print(f"Where '{tokens[focus]}' looks, per layer (the head with the strongest link to another token):",
                  markup=False)
    for layer in range(len(heads)):
        row = _row(weights, layer, focus)  # (H, T)
        if row.shape[-1] > 1:
            row[:, focus] = -1  # itself does not count
        head, key = best_head(row)
        console.print(f"  layer {layer}: head {head} -> '{tokens[key]}' ({float(_row(weights, layer, focus)[head, key]):.3f})",
                      markup=False)
    if prompt is None and calls and calls[0][3].get("indices") is None:  # top-k calls open no backend range
        q, k, v, options = calls[0]
        console.rule("[bold]Which kernel ran[/bold] (layer 0's attnlab.attention call, again under the profiler)")
        for line in kernel.kernel_lines(q, k, v, {name: value for name, value in options.items() if name != "indices"}):
            console.print(line, markup=False, soft_wrap=True)
    written = _write(console, lens, weights, tokens, prompt, out, fmt)
    if prompt is not None:
        console.print(f"Generated ({generate}): " + " | ".join(tokens[prompt:]), markup=False, soft_wrap=True)
    return written


SHOWN_TOKENS = 48  # a longer input prints its first and last SHOWN_TOKENS // 2 tokens


def _listed(tokens: list[str]) -> str:
    """The tokens joined with `` | ``, the middle of a long input left out and counted."""
    if len(tokens) <= SHOWN_TOKENS:
        return " | ".join(tokens)
    half = SHOWN_TOKENS // 2
    return " | ".join(tokens[:half]) + f" | ... {len(tokens) - 2 * half} more ... | " + " | ".join(tokens[-half:])


def _row(weights, layer: int, query: int):
    """Every head's weights of one query ``(H, T)``, from dense weights or recomputed."""
    if isinstance(weights, LazyWeights):
        n = len(weights.tokens)
        return torch.stack([weights.tile(layer, h, rows=(query, query + 1), cols=(0, n))[0]
                            for h in range(weights.heads[layer])])
    return weights[layer, :, query].clone()


def _focus(tokens: list[str], query: str | None) -> int:
    """The query token: ``query`` as written, else without space marks and case; default the last."""
    if query is None:
        return len(tokens) - 1
    if query in tokens:
        return tokens.index(query)
    plain = [t.strip("\u00b7").lower() for t in tokens]
    if query.lower() in plain:
        return plain.index(query.lower())
    fail(f"--query {query!r} is not a token of the input; tokens are {tokens}")


def _write(console, lens: ModelLens, weights, tokens: list[str], prompt: int | None, out: Path, fmt: str) -> list[Path]:
    from attnlab.lab.viz.views import generation_view, model_view

    title = f"{lens.name}: every layer and head"
    written = []
    try:
        with _progress(console, weights) as progress:
            view = model_view(weights, None if prompt is None else tokens, title=title, progress=progress)
        written += [view.save(out / f"model.{ext}") for ext in view_formats(fmt)]
        if prompt is not None:
            view = generation_view(weights, tokens, prompt_length=prompt,
                                   title=f"{lens.name}: {len(tokens) - prompt} generated tokens")
            written += [view.save(out / f"generation.{ext}") for ext in view_formats(fmt)]
        if fmt != "html":  # png, svg or all: the grid as a PNG
            from attnlab.lab.viz.headview import head_grid
            from attnlab.lab.viz.heatmap import save_figure

            figure = head_grid(_dense_or_overview(weights), _grid_labels(weights, tokens), title=title)
            written += save_figure(figure, out / "heads", formats=("png",))
    except OSError as err:
        fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")
    return written


@contextmanager
def _progress(console, weights):
    """A progress bar over the layers while a long input's overview is computed (nothing for dense weights)."""
    if not isinstance(weights, LazyWeights) or len(weights.tokens) < PROGRESS_TOKENS:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("recomputing every head's overview"), BarColumn(), TextColumn("layer {task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("overview", total=len(weights.layers))
        yield lambda done, total: bar.update(task, completed=done)


PROGRESS_TOKENS = 2048  # inputs this long show a progress bar while their overview is computed


def _dense_or_overview(weights):
    """``(L, H, n, n)`` for the PNG grid: dense weights, or a long input's overview (the view's cached maps)."""
    if not isinstance(weights, LazyWeights):
        return weights
    cells = math.ceil(len(weights.tokens) / overview_block(weights))
    maps = [weights.block_map(layer, cells=cells) for layer in range(len(weights.layers))]
    return pad_heads(maps)


def _grid_labels(weights, tokens: list[str]) -> list[str]:
    if not isinstance(weights, LazyWeights):
        return tokens
    return list(block_labels(tokens, overview_block(weights)))
