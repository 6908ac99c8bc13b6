"""Any transformers model's heads, weights from attnlab's fast path: ``attnlab explain --model DIR``.

:func:`open_model` opens a transformers checkpoint directory (GPT-2, Llama, Qwen2, Mistral, BERT,
... saved with ``save_pretrained``) with ``attn_implementation="attnlab"``
(:func:`attnlab.integrations.transformers.register`), so every attention layer runs on
:func:`attnlab.attention` and the weights it returns are the fast path's own
(``return_weights=True`` recomputes them next to the kernel's output; it never changes the output).

* :meth:`ModelLens.attention` -- one text's tokens and weights ``(L, H, T, T)``;
* :meth:`ModelLens.record` -- one text's queries, keys and masks as the fast path received them
  (:class:`~attnlab.lab.viz.recompute.LazyWeights`): any weight recomputed on demand, nothing ``T x T``
  kept, so a text of 32k tokens can be looked at;
* :meth:`ModelLens.view` -- the model view of a text (every layer x head, click to enlarge, click
  again to zoom), built from :meth:`ModelLens.record` at any length;
* :meth:`ModelLens.generate` -- for a decoder, generate tokens greedily and show, per generated
  token, where each head looked (the generation view).

A directory without a tokenizer takes token ids written as text (``"3 17 5 3"``). Everything that
cannot work is refused with ``ValueError`` naming the reason in one sentence: a directory that is
not a model, a model or a keyword the integration refuses (one wording, "... cannot run on attnlab:
..."): a model that computes attention in its own layers instead of through transformers'
attention interface (BLOOM, MPT and Falcon, whose ALiBi lives there: ``attn_implementation`` never
reaches attnlab, so its weights would not be the fast path's), a layer passing a keyword
:func:`attnlab.attention` does not apply, an input longer than the model's positions without
``truncate=True``.

Example:
    >>> lens = open_model("path/to/checkpoint")                       # doctest: +SKIP
    >>> lens.attention("The chef made a meal").weights.shape          # doctest: +SKIP
    torch.Size([12, 12, 7, 7])
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from attnlab.integrations.transformers import DEFAULT_NAME, REFUSAL, recording, register
from attnlab.lab.viz.recompute import LazyWeights, record
from attnlab.lab.viz.views import ZOOM_MB, View, generation_view, model_view

__all__ = ["ModelLens", "Attention", "open_model", "TOKENIZER_FILES", "DENSE_BYTES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")
DENSE_BYTES = 1 << 30  # the most (L, H, T, T) float32 weights attention() builds; record() has no such limit
_DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_SPACE_MARKS = ("\u0120", "\u2581")  # GPT-2's byte-level space, SentencePiece's word start


@dataclass(frozen=True)
class Attention:
    """One text through a model: its tokens and every layer's weights.

    Attributes:
        tokens: ``T`` labels (the tokenizer's pieces, space marks shown as ``·``).
        ids: the ``T`` token ids.
        weights: ``(L, H, T, T)``, rows are queries, from ``attnlab.attention(..., return_weights=True)``.

    Example:
        >>> a = Attention(["a", "b"], [0, 1], torch.full((1, 1, 2, 2), 0.5))
        >>> a.weights.shape[0]
        1
    """

    tokens: list[str]
    ids: list[int]
    weights: Tensor


class ModelLens:
    """A transformers model running on attnlab, with its tokenizer; built by :func:`open_model`.

    Attributes:
        name: the directory's name; config: the transformers config; decoder: a causal language model;
        max_positions: the longest input the model takes (None: no limit read from its config).

    Example:
        >>> lens = open_model("path/to/a/gpt2")                                    # doctest: +SKIP
        >>> lens.decoder, lens.max_positions                                       # doctest: +SKIP
        (True, 1024)
    """

    def __init__(self, model, tokenizer, *, name: str):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.config = model.config
        architectures = getattr(self.config, "architectures", None) or []
        self.decoder = any(a.endswith(_DECODER_SUFFIXES) for a in [*architectures, type(model).__name__])
        self.max_positions = _max_positions(model)

    def ids(self, text: str, *, truncate: bool = False) -> list[int]:
        """The token ids of ``text`` (ids written as text when the directory has no tokenizer), cut to
        the model's positions with ``truncate`` and refused past them without."""
        ids = self.uncut_ids(text)
        if self.max_positions is not None and len(ids) > self.max_positions:
            if not truncate:
                raise ValueError(f"the input has {len(ids)} tokens, more than the model's {self.max_positions} "
                                 "positions; pass truncate=True (--truncate) to cut it")
            ids = ids[:self.max_positions]
        return ids

    def uncut_ids(self, text: str) -> list[int]:
        """Every token id of ``text``, however many: what :meth:`ids` cuts at the model's positions."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"text must be a non-empty string, got {text!r}")
        if self.tokenizer is not None:
            ids = list(self.tokenizer(text)["input_ids"])
        else:
            try:
                ids = [int(piece) for piece in text.split()]
            except ValueError:
                raise ValueError(f"{self.name} has no tokenizer: give token ids separated by spaces "
                                 f"(e.g. '3 17 5'), got {text!r}") from None
            vocab = int(getattr(self.config, "vocab_size", 0) or 0)
            if vocab and not all(0 <= i < vocab for i in ids):
                raise ValueError(f"token ids must be in 0..{vocab - 1}, got {ids}")
        return ids

    def labels(self, ids: list[int]) -> list[str]:
        """Display labels of ``ids``: the tokenizer's pieces with space marks as ``·``."""
        if self.tokenizer is None:
            return [str(i) for i in ids]
        pieces = self.tokenizer.convert_ids_to_tokens(ids)
        for mark in _SPACE_MARKS:
            pieces = [p.replace(mark, "\u00b7") for p in pieces]
        return [p if p.strip() else repr(p) for p in pieces]

    def attention(self, text: str, *, truncate: bool = False) -> Attention:
        """Run ``text`` once and return its tokens and weights ``(L, H, T, T)``.

        Raises:
            ValueError: the weights would pass :data:`DENSE_BYTES` (use :meth:`record`).
        """
        ids = self.ids(text, truncate=truncate)
        self._check_dense(len(ids))
        return Attention(self.labels(ids), ids, self._weights(torch.tensor([ids])))

    def _check_dense(self, n_tokens: int) -> None:
        layers = int(getattr(self.config, "num_hidden_layers", 0) or getattr(self.config, "n_layer", 0) or 1)
        heads = int(getattr(self.config, "num_attention_heads", 0) or getattr(self.config, "n_head", 0) or 1)
        size = 4 * layers * heads * n_tokens ** 2
        if size > DENSE_BYTES:
            raise ValueError(f"{n_tokens} tokens' weights take {size / 2 ** 30:.1f} GiB ({layers} layers x {heads} "
                             f"heads x T^2): use record() (or view()), which recomputes weights on demand")

    def record(self, text: str, *, truncate: bool = False, calls: list | None = None) -> LazyWeights:
        """Run ``text`` once, keeping each layer's queries, keys and mask rule: weights on demand.

        ``calls``, a list, receives the first layer's call ``(q, k, v, options)`` as
        :func:`attnlab.attention` got it (``attnlab explain`` runs it again under the profiler).

        Example:
            >>> lazy = open_model("path/to/a/gpt2").record(open("book.txt").read(), truncate=True)  # doctest: +SKIP
            >>> lazy.tile(0, 3, rows=(1000, 1010), cols=(0, 1010)).shape                          # doctest: +SKIP
            torch.Size([10, 1010])
        """
        ids = self.ids(text, truncate=truncate)
        return self._record(torch.tensor([ids]), self.labels(ids), calls)

    def _record(self, input_ids: Tensor, labels: list[str], calls: list | None) -> LazyWeights:
        layers = []

        def keep(module, query, key, value, **options):
            if calls is not None and not layers:  # the first layer's call as attnlab.attention got it
                calls.append((query, key, value, options))
            try:
                layers.append(record(query, key, **options))
            except ValueError as err:
                raise ValueError(f"{self.name}, {type(module).__name__} {len(layers)}: {err}") from None

        with self._on_attnlab(), recording(keep):
            self.model(input_ids=input_ids)
        if not layers:
            raise ValueError(f"{self.name}: no layer called attnlab.attention, so there are no weights to show")
        return LazyWeights(labels, layers)

    @contextmanager
    def _on_attnlab(self):
        """A model whose attention asks for what attnlab.attention lacks is refused by name."""
        try:
            with torch.no_grad():
                yield
        except ValueError as err:
            if REFUSAL in str(err):
                raise ValueError(f"{self.name}: {err}") from None
            raise

    def _weights(self, input_ids: Tensor) -> Tensor:
        with self._on_attnlab():
            output = self.model(input_ids=input_ids, output_attentions=True)
        layers = getattr(output, "attentions", None)
        if not layers or any(w is None for w in layers):
            raise ValueError(f"{self.name} returned no attention weights through attn_implementation='attnlab'")
        return torch.stack([w[0].float() for w in layers])  # (L, H, T, T)

    def view(self, text: str, *, truncate: bool = False, title: str | None = None, layer: int = 0, head: int = 0,
             reduce: str = "mean", zoom_mb: float = ZOOM_MB) -> View:
        """The model view of ``text`` at any length: every layer x head, click to enlarge, click the
        enlarged head to zoom (:func:`attnlab.lab.viz.views.model_view` on :meth:`record`)."""
        return model_view(self.record(text, truncate=truncate), layer=layer, head=head, reduce=reduce,
                          zoom_mb=zoom_mb, title=title or f"{self.name}: every layer and head")

    def generate(self, text: str, max_new_tokens: int, *, truncate: bool = False) -> tuple[Attention, int]:
        """Greedy generation, then the weights of the whole sequence: ``(attention, prompt_length)``.

        A causal model's weights for the query at position ``p`` are the same whether computed during
        generation (one query over the cache) or over the whole sequence at once; the latter is one call.
        """
        if not self.decoder:
            raise ValueError(f"{self.name} is not a decoder (a causal language model): it does not generate")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        ids = self.ids(text, truncate=truncate)
        if self.max_positions is not None and len(ids) + max_new_tokens > self.max_positions:
            raise ValueError(f"the prompt's {len(ids)} tokens and {max_new_tokens} new ones exceed the model's "
                             f"{self.max_positions} positions")
        prompt = torch.tensor([ids])
        pad = getattr(self.config, "pad_token_id", None)
        eos = getattr(self.config, "eos_token_id", None)
        with self._on_attnlab():
            sequence = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                           max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                           pad_token_id=pad if pad is not None else (eos if eos is not None else 0))
        full = sequence[0].tolist()
        return Attention(self.labels(full), full, self._weights(sequence[:, :len(full)])), len(ids)

    def generation_view(self, text: str, max_new_tokens: int, *, truncate: bool = False) -> View:
        """Generate ``max_new_tokens`` and show, per generated token, where every head looked."""
        result, prompt_length = self.generate(text, max_new_tokens, truncate=truncate)
        return generation_view(result.weights, result.tokens, prompt_length=prompt_length,
                               title=f"{self.name}: the prompt and {max_new_tokens} generated tokens")


def _max_positions(model) -> int | None:
    """The longest input ``model`` takes: its config's positions, less the ids a RoBERTa-style
    embedding skips (its positions start at ``padding_idx + 1``: 514 rows hold 512 tokens)."""
    config = model.config
    limit = next((int(getattr(config, key)) for key in ("max_position_embeddings", "n_positions")
                  if isinstance(getattr(config, key, None), int)), None)
    for module in model.modules():
        table, pad = getattr(module, "position_embeddings", None), getattr(module, "padding_idx", None)
        if hasattr(module, "create_position_ids_from_input_ids") and isinstance(table, torch.nn.Embedding) \
                and isinstance(pad, int):
            usable = table.num_embeddings - pad - 1  # (num_embeddings,) rows, ids pad + 1 .. pad + T
            limit = usable if limit is None else min(limit, usable)
    return limit


@contextmanager
def _no_progress_bars():
    """transformers' loading bars (written to stderr) off for the block, then as they were."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def open_model(directory: str | Path, *, name: str | None = None) -> ModelLens:
    """Open a transformers checkpoint directory with its attention on attnlab.

    Raises:
        ValueError: not a model directory, or a model transformers cannot run with
            ``attn_implementation="attnlab"``.
        ImportError: transformers is not installed (``pip install 'attnlab[hf]'``).

    Example:
        >>> import tempfile
        >>> open_model(tempfile.mkdtemp())
        Traceback (most recent call last):
        ...
        ValueError: '...' is not a model directory: it has no config.json
    """
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{str(directory)!r} is not a model directory: it has no config.json")
    try:
        json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_file}: not a JSON config ({err})") from None
    register()
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(directory)
        architectures = getattr(config, "architectures", None) or []
        loader = AutoModelForCausalLM if any(a.endswith(_DECODER_SUFFIXES) for a in architectures) else AutoModel
        with _no_progress_bars():
            model = loader.from_pretrained(directory, attn_implementation=DEFAULT_NAME).eval()
    except (OSError, ValueError, KeyError) as err:
        if REFUSAL in str(err):  # the integration's own refusal, one wording
            raise ValueError(f"{name or directory.name}: {err}") from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{str(directory)!r}: transformers cannot open it with attn_implementation='attnlab': "
                         f"{first}") from None
    tokenizer = None
    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(directory)
    return ModelLens(model, tokenizer, name=name or directory.name)
