"""``attnlab explain --model DIR`` for any transformers checkpoint: every layer and head, and generation.

A directory whose ``config.json`` names a model type attnlab's own models do not read (``bert``,
``attnlab-gpt``) is opened through transformers with ``attn_implementation="attnlab"``
(:mod:`attnlab.lens`): GPT-2, Llama, Qwen2, Mistral, ... It prints the tokens and, per layer, the
head with the strongest link from the query token, and writes ``model.html`` (every layer x head,
click to enlarge); with ``--generate N`` a decoder generates N tokens greedily and
``generation.html`` shows, per generated token, where each head looked. ``--format png``/``all``
adds the layers x heads grid as ``heads.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError

from attnlab.cli._errors import fail
from attnlab.lens import ModelLens, open_model
from attnlab.trained import best_head

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


def walk(console, lens: ModelLens, text: str, *, query: str | None, truncate: bool, generate: int | None,
         out: Path, fmt: str) -> list[Path]:
    """Print the model's heads for ``text`` and write its views; returns the files written."""
    if generate is not None and not lens.decoder:
        fail(f"--generate: {lens.name} is an encoder ({type(lens.model).__name__}); only a decoder generates")
    try:
        result, prompt = lens.generate(text, generate, truncate=truncate) if generate else \
            (lens.attention(text, truncate=truncate), None)
    except ValueError as err:
        _refuse(err)
    tokens, weights = result.tokens, result.weights  # (L, H, T, T)
    focus = _focus(tokens[:prompt], query)
    layers, heads = weights.shape[:2]
    console.rule(f"[bold]attnlab explain[/bold]: {lens.name}, {layers} layers x {heads} heads")
    console.print(f"{type(lens.model).__name__} with attn_implementation='attnlab': every weight below comes from "
                  "attnlab.attention.", markup=False, soft_wrap=True)
    console.print(f"Tokens ({len(tokens[:prompt])}): " + " | ".join(tokens[:prompt]), markup=False, soft_wrap=True)
    console.print(f"Where '{tokens[focus]}' looks, per layer (the head with the strongest link to another token):",
                  markup=False)
    for layer in range(layers):
        row = weights[layer, :, focus].clone()  # (H, T)
        if row.shape[-1] > 1:
            row[:, focus] = -1  # itself does not count
        head, key = best_head(row)
        weight = float(weights[layer, head, focus, key])
        console.print(f"  layer {layer}: head {head} -> '{tokens[key]}' ({weight:.3f})", markup=False)
    written = _write(lens, result, prompt, out, fmt)
    if prompt is not None:
        console.print(f"Generated ({generate}): " + " | ".join(tokens[prompt:]), markup=False, soft_wrap=True)
    return written


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


def _write(lens: ModelLens, result, prompt: int | None, out: Path, fmt: str) -> list[Path]:
    from attnlab.viz.views import generation_view, model_view

    written = []
    try:
        if fmt in ("html", "all"):
            written.append(model_view(result.weights, result.tokens, title=f"{lens.name}: every layer and head")
                           .save(out / "model.html"))
            if prompt is not None:
                view = generation_view(result.weights, result.tokens, prompt_length=prompt,
                                       title=f"{lens.name}: {len(result.tokens) - prompt} generated tokens")
                written.append(view.save(out / "generation.html"))
        if fmt != "html":  # png, svg or all: the grid as a PNG
            from attnlab.viz.headview import head_grid
            from attnlab.viz.heatmap import save_figure

            figure = head_grid(result.weights, result.tokens, title=f"{lens.name}: every layer and head")
            written += save_figure(figure, out / "heads", formats=("png",))
    except OSError as err:
        fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")
    return written
