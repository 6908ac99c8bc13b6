"""A BERT-family encoder built from attnlab modules, loading Hugging Face BERT checkpoints.

:class:`BertEncoder` is word + position + token-type embeddings and a LayerNorm, then
post-norm :class:`~attnlab.nn.TransformerBlock` s (``norm_first=False``) whose attention is
:class:`~attnlab.nn.MultiHeadAttention` (non-causal, biased Q/K/V) and whose MLP uses BERT's
exact-erf GELU. :meth:`BertEncoder.from_pretrained` reads ``config.json`` and
``model.safetensors`` (never a pickle) and, for sentence-transformers checkpoints,
``modules.json``, ``1_Pooling/config.json`` and ``sentence_bert_config.json`` so that
:meth:`BertEncoder.encode` gives the same sentence embeddings as sentence-transformers.

Example:
    >>> enc = BertEncoder(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
    ...                   intermediate_size=32)
    >>> ids = torch.randint(0, 50, (2, 7))
    >>> real = torch.ones(2, 7, dtype=torch.long)
    >>> hidden, weights = enc(ids, real, return_weights=True)
    >>> hidden.shape, len(weights), weights[0].shape
    (torch.Size([2, 7, 16]), 2, torch.Size([2, 2, 7, 7]))
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import has_values, one_of, positive_int, positive_number, probability, same_device
from attnlab.models import _hub, _inputs
from attnlab.nn.blocks import TransformerBlock

__all__ = ["BertEncoder"]

# transformers' hidden_act names -> attnlab FeedForward activations ("gelu" is the exact erf
# GELU in transformers' ACT2FN; "gelu_new" and "gelu_pytorch_tanh" are the tanh approximation).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu"}
_CONFIG_FIELDS = {"hidden_size": int, "num_attention_heads": int, "num_hidden_layers": int,
                  "intermediate_size": int, "max_position_embeddings": int, "type_vocab_size": int,
                  "vocab_size": int, "layer_norm_eps": float, "hidden_act": str}
# config.json size -> the tensor (transformers' names) that holds it, checked before building.
_SIZES = {"vocab_size": _hub.Dim("embeddings.word_embeddings.weight", 0),
          "hidden_size": _hub.Dim("embeddings.word_embeddings.weight", 1),
          "max_position_embeddings": _hub.Dim("embeddings.position_embeddings.weight", 0),
          "type_vocab_size": _hub.Dim("embeddings.token_type_embeddings.weight", 0),
          "num_hidden_layers": _hub.Count("encoder.layer."),
          "intermediate_size": _hub.Dim("encoder.layer.0.intermediate.dense.weight", 0),
          "num_attention_heads": None}
# sentence-transformers' Pooling flags, in the order it concatenates them.
_POOLING_FLAGS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                  "mean": "pooling_mode_mean_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens"}
_PROGRESS_MIN_BATCHES = 20
V = TypeVar("V")


class BertEncoder(nn.Module):
    """BERT encoder: embeddings + LayerNorm, then post-norm attnlab Transformer layers.

    Shapes:
        input_ids, attention_mask, token_type_ids: ``(B, T)`` -> hidden states ``(B, T, hidden)``;
        with ``return_weights`` also one ``(B, H, T, T)`` weight tensor per layer.

    Args:
        vocab_size, hidden_size, num_layers, num_heads, intermediate_size: the sizes of
            ``config.json`` (``num_hidden_layers``, ``num_attention_heads``).
        max_position_embeddings: longest input, in tokens.
        type_vocab_size: number of token types (segments).
        layer_norm_eps: epsilon of every LayerNorm.
        activation: the MLP's activation, an attnlab name (``"gelu"`` = exact erf GELU).
        dropout_p: embedding, attention and residual dropout (training only).
        backend: attention backend for every layer (``"auto"``).

    Attributes:
        pooling: sentence pooling modes for :meth:`encode` (default ``("mean",)``).
        normalize: L2-normalise sentence embeddings in :meth:`encode`.
        max_seq_length: default truncation length of :meth:`tokenize` / :meth:`encode`.

    Example:
        >>> enc = BertEncoder(vocab_size=30, hidden_size=8, num_layers=1, num_heads=2,
        ...                   intermediate_size=16)
        >>> enc(torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 8])
        >>> mini = BertEncoder.from_pretrained("minilm")               # doctest: +SKIP
        >>> mini.encode(["Attention is all you need."]).shape          # doctest: +SKIP
        torch.Size([1, 384])
    """

    def __init__(
        self, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
        intermediate_size: int, max_position_embeddings: int = 512, type_vocab_size: int = 2,
        layer_norm_eps: float = 1e-12, activation: str = "gelu", dropout_p: float = 0.0,
        backend: str = "auto",
    ):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size),
                            ("num_layers", num_layers), ("num_heads", num_heads),
                            ("intermediate_size", intermediate_size),
                            ("max_position_embeddings", max_position_embeddings),
                            ("type_vocab_size", type_vocab_size)):
            positive_int(name, value)
        positive_number("layer_norm_eps", layer_norm_eps)
        probability("dropout_p", dropout_p)
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(max_position_embeddings, hidden_size)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden_size)
        self.embedding_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.embedding_dropout = nn.Dropout(dropout_p)
        self.layers = nn.ModuleList(
            TransformerBlock(hidden_size, num_heads, d_ff=intermediate_size, dropout_p=dropout_p,
                             causal=False, bias=True, norm_eps=layer_norm_eps, norm_first=False,
                             activation=activation, backend=backend)
            for _ in range(num_layers)
        )
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.max_position_embeddings = max_position_embeddings
        self.max_seq_length = max_position_embeddings
        self.pooling: tuple[str, ...] = ("mean",)
        self.normalize = False
        self.tokenizer_path: Path | None = None
        self._tokenizer = None

    # ------------------------------------------------------------------ forward
    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None, *, return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """Last hidden states ``(B, T, hidden)`` (and per-layer attention weights).

        Args:
            input_ids: ``(B, T)`` token ids.
            attention_mask: ``(B, T)``, nonzero/True at real tokens (transformers' convention);
                padded keys are never attended. None = all real.
            token_type_ids: ``(B, T)`` segment ids; None = all zeros.
            return_weights: also return a tuple of ``(B, H, T, T)`` weights, one per layer,
                from the same attention calls that produce the output.

        Example:
            >>> enc = BertEncoder(vocab_size=30, hidden_size=8, num_layers=1, num_heads=2,
            ...                   intermediate_size=16)
            >>> enc(torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]])).shape
            torch.Size([1, 3, 8])
        """
        padding_mask = self._check_inputs(input_ids, attention_mask, token_type_ids)
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(types)
        x = self.embedding_dropout(self.embedding_norm(x + self.position_embeddings(positions)))
        weights = []
        for layer in self.layers:
            if return_weights:
                x, layer_weights = layer(x, padding_mask=padding_mask, return_weights=True)
                weights.append(layer_weights)
            else:
                x = layer(x, padding_mask=padding_mask)
        return (x, tuple(weights)) if return_weights else x

    def _check_inputs(self, input_ids, attention_mask, token_type_ids) -> Tensor | None:
        """Validate shapes and ids; the padding mask as bool ``(B, T)``, or None when nothing is padded."""
        _inputs.integer_ids("input_ids", input_ids)
        if input_ids.shape[1] > self.max_position_embeddings:
            raise ValueError(
                f"input_ids has {input_ids.shape[1]} positions; the model has "
                f"max_position_embeddings={self.max_position_embeddings}"
            )
        if attention_mask is not None and (not isinstance(attention_mask, Tensor)
                                           or attention_mask.shape != input_ids.shape):
            raise ValueError(f"attention_mask must be a tensor of input_ids' shape "
                             f"{tuple(input_ids.shape)}, got {_inputs.describe(attention_mask)}")
        _inputs.ids_in_range("input_ids", input_ids, self.word_embeddings.num_embeddings, "vocab_size")
        if token_type_ids is not None:
            _inputs.integer_ids("token_type_ids", token_type_ids, tuple(input_ids.shape))
            _inputs.ids_in_range("token_type_ids", token_type_ids, self.token_type_embeddings.num_embeddings,
                                 "type_vocab_size")
        for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask),
                            ("token_type_ids", token_type_ids)):
            if value is not None:
                same_device(name, value, self.word_embeddings.weight.device, "the model's weights")
        if attention_mask is None:
            return None
        padding_mask = attention_mask.bool()
        # No padding at all: pass no mask, so the attention backend may take its unmasked path.
        return None if has_values(padding_mask) and bool(padding_mask.all()) else padding_mask

    # -------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, name_or_dir: str | os.PathLike = "minilm", *, backend: str = "auto") -> "BertEncoder":
        """Load a BERT checkpoint: ``"minilm"`` (the installed all-MiniLM-L6-v2) or a directory.

        The directory needs ``config.json`` and ``model.safetensors`` with transformers' BERT
        names (optionally prefixed ``bert.``); ``tokenizer.json`` enables :meth:`tokenize`, and
        sentence-transformers' ``modules.json`` / ``1_Pooling/config.json`` /
        ``sentence_bert_config.json`` set :attr:`pooling`, :attr:`normalize` and
        :attr:`max_seq_length`. Nothing is downloaded and nothing is unpickled. The model is
        returned in eval mode.

        Raises:
            FileNotFoundError: no such directory, no ``config.json``/weights, or ``"minilm"``
                without its distribution installed.
            ValueError: a malformed config, a pickle checkpoint (``pytorch_model.bin``), a
                truncated or corrupted safetensors file, missing or mis-shaped tensors.

        Example:
            >>> enc = BertEncoder.from_pretrained("minilm")        # doctest: +SKIP
            >>> enc.hidden_size, len(enc.layers), enc.pooling        # doctest: +SKIP
            (384, 6, ('mean',))
        """
        directory = _hub.model_dir(name_or_dir)
        config = _hub.read_config(directory, _CONFIG_FIELDS)
        act = config["hidden_act"]
        if act not in _ACTIVATIONS:
            raise ValueError(f"{str(directory / 'config.json')!r}: hidden_act {act!r} is not supported "
                             f"(one of {sorted(_ACTIVATIONS)})")
        if config["hidden_size"] % config["num_attention_heads"]:
            raise ValueError(f"{str(directory / 'config.json')!r}: hidden_size {config['hidden_size']} is "
                             f"not a multiple of num_attention_heads {config['num_attention_heads']}")
        header = _own_names(_hub.read_header(directory))
        _hub.check_sizes(directory, config, _SIZES, header)  # before anything is allocated
        model = cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config["max_position_embeddings"],
            type_vocab_size=config["type_vocab_size"], layer_norm_eps=float(config["layer_norm_eps"]),
            activation=_ACTIVATIONS[act], backend=backend,
        )
        sources = _name_table(len(model.layers))
        _hub.check_tensors(directory, header, _source_shapes(sources, model.state_dict()), ignored=_unused)
        model.load_state_dict(_from_hf_names(_own_names(_hub.load_weights(directory)), sources))
        model._read_sentence_config(directory)
        return model.eval()

    def _read_sentence_config(self, directory: Path) -> None:
        """Tokenizer path, pooling, normalisation and max length from sentence-transformers files."""
        tokenizer = directory / "tokenizer.json"
        self.tokenizer_path = tokenizer if tokenizer.is_file() else None
        modules = _read_modules(directory / "modules.json")
        self.normalize = any(kind.endswith(".Normalize") for kind, _ in modules)
        pooling_dir = next((path for kind, path in modules if kind.endswith(".Pooling")), "1_Pooling")
        pooling = _hub.read_json(directory / pooling_dir / "config.json", required=False)
        if isinstance(pooling, dict):
            modes = tuple(mode for mode, flag in _POOLING_FLAGS.items() if pooling.get(flag))
            if not modes:
                raise ValueError(f"{str(directory / pooling_dir / 'config.json')!r}: no supported pooling "
                                 f"mode is set (one of {sorted(_POOLING_FLAGS.values())})")
            self.pooling = modes
        path = directory / "sentence_bert_config.json"
        sbert = _hub.read_json(path, required=False)
        if isinstance(sbert, dict) and sbert.get("max_seq_length") is not None:
            length = sbert["max_seq_length"]
            if not isinstance(length, int) or isinstance(length, bool) or length < 1:
                raise ValueError(f"{str(path)!r}: max_seq_length must be a positive int, got {length!r}")
            self.max_seq_length = min(length, self.max_position_embeddings)

    # ------------------------------------------------------------ tokenizing
    def tokenize(self, sentences: str | Sequence[str], *, max_length: int | None = None,
                 truncate: bool = True) -> dict[str, Tensor]:
        """Token ids, attention mask and token types of ``sentences``, padded to the longest.

        Uses the ``tokenizers`` library on the checkpoint's ``tokenizer.json``.

        Args:
            sentences: one string or a sequence of strings.
            max_length: longest output in tokens (special tokens included); defaults to
                :attr:`max_seq_length`; at most ``max_position_embeddings``.
            truncate: cut longer inputs to ``max_length`` (True) or raise ``ValueError``.

        Returns:
            ``{"input_ids", "attention_mask", "token_type_ids"}``, each ``(N, T)`` int64.

        Example:
            >>> enc = BertEncoder.from_pretrained("minilm")                    # doctest: +SKIP
            >>> enc.tokenize(["a b", "a"])["attention_mask"].tolist()          # doctest: +SKIP
            [[1, 1, 1, 1], [1, 1, 1, 0]]
        """
        encodings = self._encode_texts(_sentence_list(sentences), max_length, truncate)
        return _pad(encodings, range(len(encodings)), self._pad_id())

    def word_pieces(self, sentence: str, *, truncate: bool = False) -> tuple[list[str], list, list[int]]:
        """One sentence's word pieces, the word each belongs to (None for special tokens), and ids.

        The limit is the model's ``max_position_embeddings`` (512 for BERT): longer sentences
        are cut when ``truncate`` and refused with ``ValueError`` otherwise.

        Example:
            >>> enc = BertEncoder.from_pretrained("minilm")                    # doctest: +SKIP
            >>> enc.word_pieces("attends")[:2]                                 # doctest: +SKIP
            (['[CLS]', 'attend', '##s', '[SEP]'], [None, 0, 0, None])
        """
        if not isinstance(sentence, str) or not sentence.strip():
            raise ValueError(f"sentence must be a non-empty string, got {sentence!r}")
        encoding = self._encode_texts([sentence], self.max_position_embeddings, truncate)[0]
        return list(encoding.tokens), list(encoding.word_ids), list(encoding.ids)

    def pieces(self, sentence: str) -> list[str]:
        """Every word piece of ``sentence``, [CLS] and [SEP] included, however many: what
        :meth:`word_pieces` cuts at (or refuses past) ``max_position_embeddings``.

        Example:
            >>> BertEncoder.from_pretrained("minilm").pieces("attends")       # doctest: +SKIP
            ['[CLS]', 'attend', '##s', '[SEP]']
        """
        tokenizer = self._get_tokenizer()
        tokenizer.no_padding()
        tokenizer.no_truncation()
        return list(tokenizer.encode(sentence).tokens)

    def _encode_texts(self, sentences: list[str], max_length: int | None, truncate: bool):
        limit = self.max_seq_length if max_length is None else positive_int("max_length", max_length)
        if limit > self.max_position_embeddings:
            raise ValueError(f"max_length must be at most max_position_embeddings "
                             f"({self.max_position_embeddings}), got {limit}")
        tokenizer = self._get_tokenizer()
        tokenizer.no_padding()  # tokenizer.json may fix a padding length; we pad per batch
        if truncate:
            tokenizer.enable_truncation(limit)
        else:
            tokenizer.no_truncation()
        encodings = tokenizer.encode_batch(sentences)
        too_long = [(i, len(e.ids)) for i, e in enumerate(encodings) if len(e.ids) > limit]
        if too_long:
            index, length = too_long[0]
            raise ValueError(f"sentences[{index}] has {length} tokens, more than max_length={limit} "
                             f"({len(too_long)} such sentence(s)); pass truncate=True to cut them")
        return encodings

    def _get_tokenizer(self):
        if self._tokenizer is None:
            if self.tokenizer_path is None:
                raise ValueError("this encoder has no tokenizer.json (load it with from_pretrained "
                                 "from a directory that has one)")
            try:
                from tokenizers import Tokenizer  # optional dependency, needed only to tokenize
            except ImportError:
                raise ImportError(f"tokenize/encode need the tokenizers library: {_hub.INSTALL_HINT}") from None
            try:
                self._tokenizer = Tokenizer.from_file(os.fspath(self.tokenizer_path))
            except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
                raise ValueError(f"{str(self.tokenizer_path)!r} is not a valid tokenizer file: {exc}") from None
        return self._tokenizer

    def _pad_id(self) -> int:
        padding = self._get_tokenizer().padding
        if padding is not None:
            return int(padding.get("pad_id", 0))
        token_id = self._get_tokenizer().token_to_id("[PAD]")
        return 0 if token_id is None else token_id

    # -------------------------------------------------------------- encoding
    def encode(self, sentences: str | Sequence[str], batch_size: int = 32, *,
               progress: bool | None = None) -> Tensor:
        """Sentence embeddings ``(N, hidden * len(pooling))``, as sentence-transformers' ``encode``.

        Sentences are sorted by token length so each batch has little padding, run in eval mode
        without gradients, pooled over real tokens (:attr:`pooling`) and L2-normalised when
        :attr:`normalize`; rows come back in input order. The module's train/eval mode is
        restored afterwards.

        Args:
            sentences: one string or a sequence of strings.
            batch_size: sentences per forward pass.
            progress: count the batches on stderr; None = only for many batches on a terminal.

        Example:
            >>> enc = BertEncoder.from_pretrained("minilm")                   # doctest: +SKIP
            >>> enc.encode(["a cat", "a dog", "stocks fell"]).shape           # doctest: +SKIP
            torch.Size([3, 384])
        """
        positive_int("batch_size", batch_size)
        sentences = _sentence_list(sentences)
        encodings = self._encode_texts(sentences, None, True)
        order = sorted(range(len(encodings)), key=lambda i: -len(encodings[i].ids))
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        device = self.word_embeddings.weight.device
        was_training, pad_id = self.training, self._pad_id()
        pooled = [None] * len(sentences)
        self.eval()
        try:
            with torch.inference_mode():
                for batch in _maybe_progress(batches, progress):
                    inputs = {k: v.to(device) for k, v in _pad(encodings, batch, pad_id).items()}
                    embeddings = self.pool(self(**inputs), inputs["attention_mask"])
                    for row, index in enumerate(batch):
                        pooled[index] = embeddings[row]
        finally:
            self.train(was_training)
        if not pooled:
            return torch.empty(0, self.hidden_size * len(self.pooling))
        return torch.stack(pooled)

    def pool(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """Sentence vectors from hidden states ``(B, T, hidden)`` over real tokens -> ``(B, hidden * k)``.

        The modes of :attr:`pooling` are concatenated (sentence-transformers' order), then
        L2-normalised if :attr:`normalize`.

        Example:
            >>> enc = BertEncoder(vocab_size=9, hidden_size=4, num_layers=1, num_heads=1,
            ...                   intermediate_size=8)
            >>> hidden = torch.tensor([[[1.0] * 4, [3.0] * 4, [9.0] * 4]])
            >>> enc.pool(hidden, torch.tensor([[1, 1, 0]])).tolist()
            [[2.0, 2.0, 2.0, 2.0]]
        """
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        vectors = []
        for mode in self.pooling:
            one_of("pooling", mode, _POOLING_FLAGS)
            if mode == "cls":
                vectors.append(hidden[:, 0])
            elif mode == "max":
                vectors.append(hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values)
            else:
                count = torch.clamp(mask.sum(dim=1), min=1e-9)  # (B, 1)
                total = (hidden * mask).sum(dim=1)  # (B, hidden)
                vectors.append(total / (count if mode == "mean" else torch.sqrt(count)))
        out = torch.cat(vectors, dim=-1)
        return F.normalize(out, p=2, dim=-1) if self.normalize else out


def _own_names(named: dict[str, V]) -> dict[str, V]:
    """transformers' BERT names without a ``bert.`` prefix; a prefixed checkpoint's task heads dropped."""
    named = {_canonical(name): value for name, value in named.items()}
    if any(name.startswith("bert.") for name in named):
        named = {name[len("bert."):]: value for name, value in named.items() if name.startswith("bert.")}
    return named


def _unused(name: str) -> bool:
    """Tensors of transformers' BertModel that the encoder does not use (pooler, an old buffer)."""
    return name.startswith("pooler.") or name == "embeddings.position_ids"


def _source_shapes(sources: dict[str, list[str]], expected: dict[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """The shape each transformers tensor must have: fused Q/K/V parts are a third of the rows."""
    shapes = {}
    for ours, names in sources.items():
        rows, *rest = expected[ours].shape
        for name in names:
            shapes[name] = (rows // len(names), *rest)
    return shapes


def _from_hf_names(state: dict[str, Tensor], sources: dict[str, list[str]]) -> dict[str, Tensor]:
    """transformers' BERT tensors (already checked) -> this module's state dict, Q/K/V fused."""
    return {ours: state[names[0]] if len(names) == 1 else torch.cat([state[n] for n in names])  # rows: q, k, v
            for ours, names in sources.items()}


def _canonical(name: str) -> str:
    # Old TensorFlow-converted checkpoints call LayerNorm parameters gamma/beta.
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def _name_table(num_layers: int) -> dict[str, list[str]]:
    """attnlab parameter name -> the transformers names it is made of (in order)."""
    table = {
        "word_embeddings.weight": ["embeddings.word_embeddings.weight"],
        "position_embeddings.weight": ["embeddings.position_embeddings.weight"],
        "token_type_embeddings.weight": ["embeddings.token_type_embeddings.weight"],
        "embedding_norm.weight": ["embeddings.LayerNorm.weight"],
        "embedding_norm.bias": ["embeddings.LayerNorm.bias"],
    }
    for i in range(num_layers):
        hf, ours = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            table[f"{ours}attn.in_proj_{kind}"] = [f"{hf}attention.self.{p}.{kind}" for p in ("query", "key", "value")]
            table[f"{ours}attn.out_proj.{kind}"] = [f"{hf}attention.output.dense.{kind}"]
            table[f"{ours}norm_attn.{kind}"] = [f"{hf}attention.output.LayerNorm.{kind}"]
            table[f"{ours}mlp.fc_in.{kind}"] = [f"{hf}intermediate.dense.{kind}"]
            table[f"{ours}mlp.fc_out.{kind}"] = [f"{hf}output.dense.{kind}"]
            table[f"{ours}norm_mlp.{kind}"] = [f"{hf}output.LayerNorm.{kind}"]
    return table


def _read_modules(path: Path) -> list[tuple[str, str]]:
    """(type, path) of each module in sentence-transformers' ``modules.json`` (none if absent)."""
    modules = _hub.read_json(path, required=False)
    if modules is None:
        return []
    if not isinstance(modules, list):
        raise ValueError(f"{str(path)!r} must be a list of module objects, got {type(modules).__name__}")
    entries = []
    for module in modules:
        kind = module.get("type") if isinstance(module, dict) else None
        folder = module.get("path", "") if isinstance(module, dict) else None
        inside = isinstance(folder, str) and not Path(folder).is_absolute() and ".." not in Path(folder).parts
        if not isinstance(kind, str) or not inside:
            raise ValueError(f"{str(path)!r} must be a list of objects with a string 'type' and a 'path' "
                             f"inside the model directory, got {module!r}")
        entries.append((kind, folder))
    return entries


def _sentence_list(sentences: str | Sequence[str]) -> list[str]:
    if isinstance(sentences, str):
        return [sentences]
    if not isinstance(sentences, Sequence) or not all(isinstance(s, str) for s in sentences):
        raise TypeError(f"sentences must be a string or a sequence of strings, got {type(sentences).__name__}")
    return list(sentences)


def _pad(encodings, rows, pad_id: int) -> dict[str, Tensor]:
    """Right-pad the chosen encodings to their longest: ids, mask and types ``(N, T)``."""
    rows = list(rows)
    T = max((len(encodings[i].ids) for i in rows), default=0)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    types = torch.zeros((len(rows), T), dtype=torch.long)
    for row, i in enumerate(rows):
        n = len(encodings[i].ids)
        ids[row, :n] = torch.tensor(encodings[i].ids, dtype=torch.long)
        mask[row, :n] = 1
        types[row, :n] = torch.tensor(encodings[i].type_ids, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _maybe_progress(batches: list, progress: bool | None):
    if progress is None:
        progress = len(batches) >= _PROGRESS_MIN_BATCHES and sys.stderr.isatty()
    return _counted(batches, "encoding") if progress else batches


def _counted(items: list, what: str):
    """Yield ``items`` while one stderr line counts them (``encoding 3/40``), erased at the end.

    Plain text rather than a rich bar: the library does not import the lab's display packages.
    """
    line = ""
    try:
        for done, item in enumerate(items):
            line = f"\r{what} {done}/{len(items)}"
            sys.stderr.write(line)
            sys.stderr.flush()
            yield item
    finally:
        sys.stderr.write("\r" + " " * len(line) + "\r")
        sys.stderr.flush()
