"""Step-by-step trace of one attention computation, for ``attnlab explain`` and the report.

:func:`trace` builds the tutorial module for a mode (self, causal, multihead, cross) with a fixed
seed, reads its weights, and recomputes the module's forward pass one readable step at a time on
the reference path, keeping every intermediate tensor with a name, token labels and a one-line
explanation. The last step equals the module's own output (the tests check it).

The text pipeline is the tutorials' one:

* **Tokens**: words with punctuation stripped, case kept (``"meal,"`` -> ``"meal"``; ``"don't"``
  stays one word). See :func:`tokenize`.
* **Vocabulary**: the sorted unique words, numbered from 0 (``{'The': 0, 'east': 1, ...}``).
* **Embeddings**: ``torch.nn.Embedding(vocab_size, d_model)`` created right after
  ``torch.manual_seed(seed)``. ``vocab_size`` defaults to the document's 50 000 rows, so
  ``trace("The sun rises in the east", seed=123)`` gives the document's printed embeddings.
* **Weights**: ``torch.manual_seed(seed)`` again, then the module is constructed (as the
  document does), so its W_q, W_k, W_v are the document's.

A score mod (``score_mod=``, e.g. ``attnlab.scores.softcap(5.0)``) adds the modified scores, the
weights without the mod and the change it made; sinks (``sinks=``, one logit per head) add the
weights with the sink as one more column, so each query's sink share is read off as its own
column. The last step then equals ``attnlab.attention(..., score_mod=..., sinks=...)`` on the
reference path (the tests check it).

The global random state is saved and restored around the trace.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attnlab import scores as score_mods
from attnlab.lab import tutorial
from attnlab._checks import finite_number
from attnlab._math import apply_dropout, softmax_rows
from attnlab.masks import causal_mask
from attnlab.lab.viz import html as _html
from attnlab.lab.viz.page import format_value

__all__ = [
    "DEFAULT_SENTENCE", "MODES", "Step", "Trace", "Link", "tokenize", "split_for_cross", "format_value", "trace",
]

DEFAULT_SENTENCE = "The chef prepared a delicious meal, and it was served with wine."
MODES = ("self", "causal", "multihead", "cross")
DOC_VOCAB_SIZE = 50_000  # "Clear Tutorial"'s embedding table size
_WORD = re.compile(r"\w+(?:['\u2019]\w+)*")


@dataclass(frozen=True)
class Step:
    """One named intermediate of the computation.

    Attributes:
        name: machine name, e.g. ``"weights"``.
        title: short human title with the formula, e.g. ``"Attention weights  A = softmax(S)"``.
        tensor: the values (1-D or 2-D).
        explanation: one sentence saying what the step does.
        rows: labels of the first dimension of a 2-D tensor (None for 1-D).
        cols: labels of the last dimension.
        head: the head this step belongs to, or None when shared by all heads.
        first_row: the token index of the first row (a flash tile's rows start at its first
            query), or None when the rows are not tokens (a linear state's key dimensions); views
            highlight the focused token's row by it.

    Example:
        >>> s = Step("ids", "Token ids", torch.tensor([0, 1]), "Look up each word.", None, ("a", "b"))
        >>> s.shape
        (2,)
    """

    name: str
    title: str
    tensor: Tensor
    explanation: str
    rows: tuple[str, ...] | None
    cols: tuple[str, ...]
    head: int | None = None
    first_row: int | None = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


@dataclass(frozen=True)
class Link:
    """How much one query token attends to one key token (a cell of the weight matrix).

    Example:
        >>> Link(key_index=5, key="meal", weight=0.31).key
        'meal'
    """

    key_index: int
    key: str
    weight: float


@dataclass
class Trace:
    """Everything one attention computation did, step by step.

    Attributes:
        mode: ``"self"``, ``"causal"``, ``"multihead"`` or ``"cross"``.
        causal: whether future keys were masked.
        sentence: the text the queries come from.
        context_sentence: the text keys and values come from (equal to ``sentence`` except in cross).
        tokens: query-side tokens; ``context_tokens``: key/value-side tokens.
        vocabulary: sorted unique word -> id.
        d_model, d_kq, d_v, heads, seed, dropout_p: the configuration.
        steps: every intermediate, in order.
        output: the final output ``(Tq, heads * d_v)``; equals the module's output.
        module: the tutorial module whose weights were used.
        score_mod: the score mod applied after scaling (a :class:`attnlab.scores.ScoreMod`), or None.
        sinks: the sink logit of each head ``(heads,)``, or None.

    Shapes:
        weights(): ``(heads, Tq, Tk)`` (the real keys' weights; with sinks rows sum to 1 minus the
        sink's share); allowed(): ``(Tq, Tk)`` bool or None; sink_shares(): ``(heads, Tq)`` or None.

    Example:
        >>> t = trace("The sun rises in the east", seed=123)
        >>> t.weights().shape
        torch.Size([1, 6, 6])
    """

    mode: str
    causal: bool
    sentence: str
    context_sentence: str
    tokens: list[str]
    context_tokens: list[str]
    vocabulary: dict[str, int]
    d_model: int
    d_kq: int
    d_v: int
    heads: int
    seed: int
    dropout_p: float
    steps: list[Step] = field(default_factory=list)
    output: Tensor | None = None
    module: nn.Module | None = None
    score_mod: score_mods.ScoreMod | None = None
    sinks: Tensor | None = None

    def step(self, name: str, head: int | None = None) -> Step:
        """The step called ``name`` (for per-head steps, of ``head``; default head 0)."""
        matches = [s for s in self.steps if s.name == name]
        if not matches:
            raise KeyError(f"no step named {name!r}; steps are {sorted({s.name for s in self.steps})}")
        per_head = [s for s in matches if s.head == (head or 0)]
        return per_head[0] if matches[0].head is not None and per_head else matches[0]

    def weights(self) -> Tensor:
        """Attention weights of every head (before dropout), ``(heads, Tq, Tk)``."""
        return torch.stack([self.step("weights", h).tensor for h in range(self.heads)])

    def sink_shares(self) -> Tensor | None:
        """Each query's share of the mass the sink took, per head ``(heads, Tq)``; None without sinks.

        Example:
            >>> t = trace("The sun rises", sinks=0.0)
            >>> t.sink_shares().shape, bool(((t.weights().sum(-1) + t.sink_shares()) - 1).abs().max() < 1e-6)
            (torch.Size([1, 3]), True)
        """
        if self.sinks is None:
            return None
        return torch.stack([self.step("sink_weights", h).tensor[:, -1] for h in range(self.heads)])

    def allowed(self) -> Tensor | None:
        """Which (query, key) pairs may attend, ``(Tq, Tk)`` bool, or None when nothing is masked."""
        return self.step("mask").tensor if self.causal else None

    def query_index(self, word: str | None = None) -> int:
        """Index of the focused query token.

        ``word`` matches a token exactly (first occurrence), else case-insensitively. With no word:
        ``"it"`` when present (the tutorial's example), else the last token.

        Raises:
            ValueError: ``word`` is not one of the tokens.
        """
        if word is None:
            return self.tokens.index("it") if "it" in self.tokens else len(self.tokens) - 1
        if word in self.tokens:
            return self.tokens.index(word)
        lowered = [t.lower() for t in self.tokens]
        if word.lower() in lowered:
            return lowered.index(word.lower())
        raise ValueError(f"--query {word!r} is not a token of the sentence; tokens are {self.tokens}")

    def links(self, query_index: int, head: int | None = None) -> list[Link]:
        """The focused token's weights to every key it may attend to, strongest first.

        Args:
            query_index: row of the weight matrix.
            head: one head, or None for the mean over heads.
        """
        weights = self.weights()  # (H, Tq, Tk)
        row = weights.mean(0)[query_index] if head is None else weights[head, query_index]
        allowed = self.allowed()
        ranked = _html.ranked_keys(row, None if allowed is None else allowed[query_index])
        return [Link(j, self.context_tokens[j], float(row[j])) for j in ranked]

    def _repr_html_(self) -> str:
        """The walk, rendered where a notebook shows it: the report's cards, offline, ids of its own."""
        return _html.walk_view(self)

    def __repr__(self) -> str:
        return (f"<Trace: {self.mode} attention of {self.sentence!r}, {self.heads} head(s), "
                f"{len(self.steps)} steps, seed {self.seed}>")


def tokenize(text: str) -> list[str]:
    """Split ``text`` into words: punctuation is stripped, case is kept, apostrophes stay inside.

    Example:
        >>> tokenize("The chef prepared a delicious meal, and it was served with wine.")[:6]
        ['The', 'chef', 'prepared', 'a', 'delicious', 'meal']
    """
    return _WORD.findall(text)


def split_for_cross(sentence: str) -> tuple[str, str]:
    """Split one sentence into two halves by words, as "Attention for your Transformers" does for cross-attention.

    Example:
        >>> split_for_cross("The chef prepared a delicious meal, and it was served with wine.")
        ('The chef prepared a delicious meal', 'and it was served with wine')
    """
    words = tokenize(sentence)
    if len(words) < 2:
        raise ValueError(f"cross mode needs two sequences: pass --context, or a sentence of 2+ words; got {sentence!r}")
    half = len(words) // 2
    return " ".join(words[:half]), " ".join(words[half:])


def trace(
    sentence: str = DEFAULT_SENTENCE,
    *,
    mode: str = "self",
    context: str | None = None,
    heads: int | None = None,
    d_model: int = 3,
    d_kq: int = 2,
    d_v: int = 4,
    seed: int = 123,
    causal: bool = False,
    dropout_p: float = 0.0,
    init: str = "uniform",
    vocab_size: int = DOC_VOCAB_SIZE,
    score_mod: object = None,
    sinks: float | Tensor | None = None,
) -> Trace:
    """Run one attention computation and record every intermediate.

    Args:
        sentence: the text the queries come from.
        mode: ``"self"``, ``"causal"`` (self + causal mask), ``"multihead"`` or ``"cross"``.
        context: cross mode only: the text keys and values come from. Default: the second half of
            ``sentence`` (queries from the first half), as "Attention for your Transformers" does.
        heads: number of heads (multihead: default 4; other modes: 1).
        d_model: embedding size (the documents use 3).
        d_kq: query/key size per head; ``d_v``: value size per head.
        seed: seeds the embedding table and, again, the module's weights.
        causal: mask future keys (``mode="causal"`` implies it; allowed with multihead).
        dropout_p: probability of dropping an attention weight (0 = off), drawn from a generator
            seeded with ``seed``.
        init: the tutorial modules' weight init, ``"uniform"`` (torch.rand, the first document)
            or ``"linear"`` (nn.Linear, the second document).
        vocab_size: rows of the embedding table (the first document's 50 000).
        score_mod: a score mod applied to the scaled scores before masking
            (:mod:`attnlab.scores`, or a function ``(score, b, h, q_idx, kv_idx) -> score``).
        sinks: a sink logit for every head (a number) or one per head (a ``(heads,)`` tensor): one
            more key of that logit and value 0 that takes part of each query's mass.

    Returns:
        a :class:`Trace`; ``trace.output`` is ``(Tq, heads * d_v)``.

    Raises:
        ValueError: empty sentence, unknown mode, bad sizes or a bad option combination; a
            score mod or sinks that do not fit the heads (named ``score_mod`` / ``sinks``).
        TypeError: a score mod or sinks of the wrong kind.

    Example:
        >>> t = trace("The sun rises in the east", mode="causal", seed=123)
        >>> [round(w, 4) for w in t.weights()[0, 1, :2].tolist()]
        [0.0532, 0.9468]
        >>> capped = trace("The sun rises in the east", score_mod=score_mods.softcap(0.5))
        >>> float(capped.step("modded_scores").tensor.abs().max()) < 0.5
        True
    """
    config = _resolve(sentence, mode, context, heads, causal, dropout_p, d_model, d_kq, d_v)
    query_text, kv_text, heads, causal = config
    mode = "causal" if mode == "self" and causal else mode  # --causal is the same as --mode causal
    tokens, kv_tokens = tokenize(query_text), tokenize(kv_text)
    vocabulary = {w: i for i, w in enumerate(sorted(set(tokens) | set(kv_tokens)))}
    if len(vocabulary) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the vocabulary ({len(vocabulary)} words)")
    result = Trace(mode, causal, query_text, kv_text, tokens, kv_tokens, vocabulary,
                   d_model, d_kq, d_v, heads, seed, dropout_p)
    result.score_mod, result.sinks = _score_options(score_mod, sinks, heads, len(tokens), len(kv_tokens))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        embed = nn.Embedding(vocab_size, d_model)
        torch.manual_seed(seed)
        result.module = _build_module(mode, d_model, d_kq, d_v, heads, causal, dropout_p, init)
    x, x_context = _embed_steps(result, embed)
    generator = torch.Generator().manual_seed(seed) if dropout_p > 0 else None
    contexts = [_head_steps(result, unit, h, x, x_context, generator) for h, unit in enumerate(_units(result.module))]
    result.output = torch.cat(contexts, dim=-1)  # (Tq, heads * d_v)
    if heads > 1:
        result.steps.append(_step("output", "Output  concat(heads)", result.output,
                                  f"The {heads} heads' context vectors side by side: each token gets "
                                  f"{heads} x {d_v} = {heads * d_v} numbers.", tokens, _dims("o", heads * d_v)))
    return result


def _resolve(sentence, mode, context, heads, causal, dropout_p, d_model, d_kq, d_v):
    """Check the options; return (query text, key/value text, heads, causal)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if not tokenize(sentence):
        raise ValueError(f"the sentence has no words: {sentence!r}")
    for name, value in (("d_model", d_model), ("d_kq", d_kq), ("d_v", d_v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    if heads is not None and heads < 1:
        raise ValueError(f"heads must be at least 1; got {heads}")
    if mode == "cross":
        if causal or (heads or 1) != 1:
            raise ValueError("cross mode is one unmasked head: --causal and --heads do not apply")
        if context is None:
            return (*split_for_cross(sentence), 1, False)
        if not tokenize(context):
            raise ValueError(f"the context sentence has no words: {context!r}")
        return sentence, context, 1, False
    if context is not None:
        raise ValueError(f"--context is for cross mode only; mode is {mode!r}")
    if mode != "multihead" and (heads or 1) != 1:
        raise ValueError(f"mode {mode!r} has one head; use --mode multihead for --heads {heads}")
    heads = heads or (4 if mode == "multihead" else 1)
    return sentence, sentence, heads, causal or mode == "causal"


def _score_options(score_mod, sinks, heads: int, tq: int, tk: int):
    """Check ``score_mod`` and ``sinks`` against the heads; return (ScoreMod or None, ``(heads,)`` or None)."""
    cpu = torch.device("cpu")
    if score_mod is not None:
        score_mod = score_mods.as_score_mod(score_mod)
        score_mod.check(batch=1, heads=heads, tq=tq, tk=tk, device=cpu)
        if score_mods.has_function(score_mod):
            score_mods.check_function(score_mod, tq=tq, tk=tk, device=cpu, dtype=torch.float32)
    if sinks is not None and not isinstance(sinks, Tensor):
        sinks = torch.full((heads,), finite_number("sinks", sinks))
    if sinks is not None:
        sinks = score_mods.check_sinks(sinks, heads=heads, device=cpu).detach().float()
        if not bool(torch.isfinite(sinks).all()):
            raise ValueError(f"sinks must be finite logits, got {sinks.tolist()}")
    return score_mod, sinks


def _dims(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


def _step(name, title, tensor, explanation, rows, cols, head=None, first_row=0) -> Step:
    rows = None if rows is None else tuple(rows)
    return Step(name, title, tensor.detach(), explanation, rows, tuple(cols), head, first_row)


def _build_module(mode: str, d_model: int, d_kq: int, d_v: int, heads: int, causal: bool,
                  dropout_p: float, init: str) -> nn.Module:
    """The tutorial module for ``mode`` (constructed under the caller's seed).

    self -> SelfAttention, cross -> CrossAttention, multihead -> MultiHeadAttentionWrapper, and
    causal (or any single head with dropout) -> AttentionHead, the mechanism behind
    CausalAttention that also allows d_v != d_kq. All create W_query, W_key, W_value in that
    order, so one seed gives every mode the same first-head weights.
    """
    if mode == "multihead":
        return tutorial.MultiHeadAttentionWrapper(d_model, d_kq, d_v, heads, causal=causal, dropout_p=dropout_p, init=init)
    if causal or dropout_p > 0:
        return tutorial.AttentionHead(d_model, d_kq, d_v, causal=causal, dropout_p=dropout_p, init=init)
    if mode == "cross":
        return tutorial.CrossAttention(d_model, d_kq, d_v, init=init)
    return tutorial.SelfAttention(d_model, d_kq, d_v, init=init)


def _units(module: nn.Module) -> list[nn.Module]:
    """The single-head modules that hold W_query/W_key/W_value (the wrapper's heads, or itself)."""
    return list(module.heads) if hasattr(module, "heads") else [module]


def _projection(weight: nn.Module | Tensor) -> tuple[Tensor, Tensor | None]:
    """A projection as ``(W (d_in, d_out), bias or None)``, from an ``nn.Parameter`` or ``nn.Linear``."""
    if isinstance(weight, nn.Linear):
        return weight.weight.detach().T, None if weight.bias is None else weight.bias.detach()
    return weight.detach(), None


def _embed_steps(result: Trace, embed: nn.Embedding) -> tuple[Tensor, Tensor]:
    """Vocabulary, token ids and embeddings; returns the query-side and key/value-side inputs."""
    vocab = list(result.vocabulary)
    result.steps.append(_step("vocabulary", "Vocabulary  sorted unique words", torch.arange(len(vocab)),
                              f"Every distinct word gets a number: the {len(vocab)} words sorted "
                              "(capitals first), numbered from 0.", None, vocab))
    sides = [("", result.tokens, result.sentence)]
    if result.mode == "cross":
        sides = [("", result.tokens, "the query sentence"), ("context_", result.context_tokens, "the context sentence")]
    inputs = []
    for prefix, tokens, what in sides:
        ids = torch.tensor([result.vocabulary[w] for w in tokens])
        x = embed(ids).detach()  # (T, d_model)
        result.steps.append(_step(f"{prefix}ids", "Token ids" + (" (context)" if prefix else ""), ids,
                                  f"Each word of {what!r} replaced by its vocabulary number.", None, tokens))
        result.steps.append(_step(f"{prefix}embeddings", "Embeddings  X = E[ids]" + (" (context)" if prefix else ""),
                                  x, f"Row i is token i's {result.d_model}-number vector from a seeded random "
                                  "embedding table (untrained: it carries no meaning yet).", tokens,
                                  _dims("x", result.d_model)))
        inputs.append(x)
    return inputs[0], inputs[-1]


def _head_steps(result: Trace, unit: nn.Module, h: int, x: Tensor, x_context: Tensor,
                generator: torch.Generator | None) -> Tensor:
    """Record one head's projections and attention; return its context vectors ``(Tq, d_v)``."""
    tq, tk = result.tokens, result.context_tokens
    projected = {}
    for key, attr, what, src, tokens in (("q", "W_query", "queries", x, tq), ("k", "W_key", "keys", x_context, tk),
                                          ("v", "W_value", "values", x_context, tk)):
        weight, bias = _projection(getattr(unit, attr))
        result.steps.append(_step(f"W_{key}", f"W_{key}  ({what} projection)", weight,
                                  f"A trainable {tuple(weight.shape)} matrix (seeded random here) that turns an "
                                  f"embedding into a {what[:-1] if what != 'queries' else 'query'}.",
                                  _dims("x", result.d_model), _dims(key, weight.shape[1]), h,
                                  first_row=None))  # rows are embedding features, not tokens
        out = src @ weight if bias is None else src @ weight + bias  # (T, d_kq or d_v)
        formula = {"q": "Q = X W_q", "k": "K = X W_k", "v": "V = X W_v"}[key]
        if result.mode == "cross" and key != "q":
            formula = formula.replace("X", "X_ctx")
        result.steps.append(_step(what, f"{what.capitalize()}  {formula}", out, _PROJECTION_TEXT[key],
                                  tokens, _dims(key, out.shape[1]), h))
        projected[key] = out
    return _attend_steps(result, h, projected["q"], projected["k"], projected["v"], generator)


_PROJECTION_TEXT = {
    "q": "What each token is looking for: its embedding times W_q.",
    "k": "What each token offers to be found by: its embedding times W_k.",
    "v": "What each token passes on when attended to: its embedding times W_v.",
}


def _attend_steps(result: Trace, h: int, queries: Tensor, keys: Tensor, values: Tensor,
                  generator: torch.Generator | None) -> Tensor:
    """Scores, scaling, masking, softmax, dropout and the weighted sum, recorded for head ``h``."""
    tq, tk = result.tokens, result.context_tokens

    def add(name, title, tensor, text, cols=tk):
        result.steps.append(_step(name, title, tensor, text, tq, cols, h))

    scores = queries @ keys.T  # (Tq, Tk)
    add("scores", "Scores  S = Q K^T", scores,
        "Row i, column j: dot product of query i with key j; larger = better match.")
    scale = 1.0 / math.sqrt(keys.shape[-1])
    scores = scores * scale
    add("scaled_scores", f"Scaled scores  S / sqrt(d_k) = S / {math.sqrt(keys.shape[-1]):.4g}", scores,
        f"Divided by sqrt(d_k) = sqrt({keys.shape[-1]}) so the softmax does not saturate as d_k grows.")
    plain = scores
    if result.score_mod is not None:
        scores = _modded(result.score_mod, scores, h, result.heads)
        add("modded_scores", f"Score mod  S' = {result.score_mod!r} applied to S", scores,
            f"Each scaled score changed by the score mod {result.score_mod!r} before the softmax "
            "(masks say which keys a query sees; a score mod says how much).")
    allowed = None
    if result.causal:
        allowed = causal_mask(len(tq), len(tk))  # (Tq, Tk) bool, True = may attend
        add("mask", "Causal mask  (True = may attend)", allowed,
            "Token i may only look at tokens 0..i: the future is hidden.")
        scores = scores.masked_fill(~allowed, float("-inf"))
        add("masked_scores", "Masked scores  -inf above the diagonal", scores,
            "Future positions set to -inf, so the softmax gives them exactly 0.")
    sink = None if result.sinks is None else result.sinks[h]
    if result.score_mod is not None:
        before = plain if allowed is None else plain.masked_fill(~allowed, float("-inf"))
        plain_weights = _softmax(before, sink)[0]
        add("plain_weights", "Weights without the score mod  softmax(S)", plain_weights,
            "The weights the plain scaled scores would give, to compare with the score mod's below.")
    weights, share = _softmax(scores, sink)  # (Tq, Tk), (Tq,)
    if sink is None:
        add("weights", "Attention weights  A = softmax(S) row by row", weights,
            "Each row turned into proportions that sum to 1: how much token i attends to each token j.")
    else:
        add("weights", "Attention weights  A = softmax([S, sink]) without the sink's column", weights,
            f"Each row turned into proportions over the keys and the sink (logit {float(sink):.4g}); "
            "the sink's part is dropped, so a row sums to 1 minus the sink's share.")
    if result.score_mod is not None:
        add("weight_change", "Change made by the score mod  A - softmax(S)", weights - plain_weights,
            "Positive where the score mod moved weight to a key, negative where it took weight away.")
    if sink is not None:
        add("sink_weights", "Weights with the sink  [A, sink share]", torch.cat([weights, share[:, None]], -1),
            "The sink is one more key of value 0: its column is how much of each query's attention "
            "goes nowhere. Each row of this table sums to 1.", cols=(*tk, "sink"))
    if result.dropout_p > 0:
        keep = apply_dropout(torch.ones_like(weights), result.dropout_p, generator)  # 0 or 1/(1-p)
        add("dropout_mask", f"Dropout mask  (p = {result.dropout_p})", keep,
            f"Each weight is dropped with probability {result.dropout_p}; survivors are scaled by 1/(1-p).")
        weights = weights * keep
        add("dropped_weights", "Weights after dropout", weights, "The weights actually used for the sum.")
    context = weights @ values  # (Tq, d_v)
    add("context", "Context vectors  Z = A V", context,
        "Row i is a weighted average of all value vectors, weighted by row i of A: the new, "
        "context-aware version of token i.", cols=_dims("z", values.shape[1]))
    return context


def _modded(mod: score_mods.ScoreMod, scores: Tensor, h: int, heads: int) -> Tensor:
    """``mod`` on head ``h``'s scaled scores ``(Tq, Tk)``, with that head's index."""
    tile = scores.new_zeros(1, heads, *scores.shape)  # (1, H, Tq, Tk): the other heads are unused
    tile[0, h] = scores
    with torch.no_grad():
        return score_mods.apply_tile(mod, tile, q_start=0, kv_start=0)[0, h]


def _softmax(scores: Tensor, sink: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Row softmax of ``scores`` ``(Tq, Tk)`` and, with a sink logit, each row's sink share ``(Tq,)``."""
    if sink is None:
        return softmax_rows(scores), None
    column = sink.to(scores.dtype).expand(scores.shape[0], 1)  # (Tq, 1)
    both = softmax_rows(torch.cat([scores, column], dim=-1))  # (Tq, Tk + 1)
    return both[:, :-1], both[:, -1]
