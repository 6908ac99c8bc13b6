"""What a trained model's heads do with one sentence: word pieces merged into words, and tables.

A tokenizer splits words into pieces (``"attends"`` -> ``"at", "##tend", "##s"``) and adds
special tokens (``[CLS]``, ``[SEP]``). The weights a model returns are over pieces; people read
words. :func:`merge_pieces` turns piece-level weights into word-level ones with one rule:

* **keys: sum** over a word's pieces -- the weight a query gives a word is the weight it gives
  all of that word's pieces, so every row still sums to 1;
* **queries: mean** over a word's pieces -- a word attends the way its pieces do on average.

Special tokens stay units of their own. They soak up much of the attention in BERT-family models
(a head with nothing to do attends to ``[SEP]``), so the tables can leave them out
(``hide_special=True``): the remaining weights are shown as they are, not renormalised.

:class:`WordAttention` holds one sentence's word-level weights ``(L, H, W, W)`` and answers the
walk-through's questions: for a query word, which word each (layer, head) attends to most, and
which single head links it most strongly to each other word.

Layers may have different numbers of heads (``GPT(num_heads=(2, 1))``). Their weights and scores
are then held in one ``(L, H, ...)`` tensor, ``H`` the most heads of any layer, whose missing
heads are NaN (:func:`pad_heads`): :func:`count_heads` reads the counts back,
:func:`unpad_heads` gives each layer's heads back and :func:`best_head` never picks a missing
head. The NaN never leaves a tensor: tables, JSON and pictures show the heads a layer has and
nothing for the others.

Example:
    >>> import torch
    >>> pieces = ["[CLS]", "at", "##tend", "[SEP]"]
    >>> word_ids = [None, 0, 0, None]
    >>> weights = torch.full((1, 1, 4, 4), 0.25)                 # (L, H, T, T)
    >>> view = WordAttention.from_pieces(weights, pieces, word_ids)
    >>> view.words, view.weights[0, 0, 0].tolist()
    (['[CLS]', 'attend', '[SEP]'], [0.25, 0.5, 0.25])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["merge_pieces", "piece_groups", "WordAttention", "Link", "trace_model", "pad_heads", "count_heads",
           "unpad_heads", "best_head", "format_heads", "ROLE_THRESHOLD", "head_roles", "sink_shares"]

# The score from which a head is named for a role (summaries, tables and pictures agree on it).
ROLE_THRESHOLD = 0.5


def pad_heads(per_layer: Sequence[Tensor]) -> Tensor:
    """Stack per-layer ``(H_l, ...)`` tensors into ``(L, H, ...)``, ``H = max H_l``; missing heads are NaN.

    With the same count in every layer this is ``torch.stack``: nothing is NaN.

    Example:
        >>> pad_heads([torch.tensor([0.8, 0.1]), torch.tensor([0.9])])
        tensor([[0.8000, 0.1000],
                [0.9000,    nan]])
    """
    width = max(t.shape[0] for t in per_layer)
    padded = torch.full((len(per_layer), width, *per_layer[0].shape[1:]), float("nan"),
                        dtype=per_layer[0].dtype, device=per_layer[0].device)  # (L, H, ...)
    for layer, t in enumerate(per_layer):
        padded[layer, :t.shape[0]] = t
    return padded


def sink_shares(weights: Tensor) -> Tensor:
    """Each query's share of the mass no key received, ``1 - `` its row sum: with sinks, the sink's share.

    A model with sinks (gpt-oss's per-head logit, ``GPT(sinks=True)``) returns the real keys'
    weights, whose rows sum to 1 minus the sink's share; without sinks the share is 0 within
    rounding. Heads a layer lacks (NaN, :func:`pad_heads`) stay NaN.

    Shapes:
        weights ``(..., Tq, Tk)`` -> ``(..., Tq)``.

    Example:
        >>> sink_shares(torch.tensor([[0.5, 0.25], [0.5, 0.5]]))
        tensor([0.2500, 0.0000])
    """
    return 1.0 - weights.sum(dim=-1)


def count_heads(padded: Tensor) -> tuple[int, ...]:
    """The heads each layer of a :func:`pad_heads` tensor ``(L, H, ...)`` has: those not entirely NaN.

    Example:
        >>> count_heads(pad_heads([torch.ones(2, 3, 3), torch.ones(1, 3, 3)]))
        (2, 1)
    """
    present = ~torch.isnan(padded.reshape(*padded.shape[:2], -1)).all(dim=-1)  # (L, H)
    return tuple(int(n) for n in present.sum(dim=1))


def unpad_heads(padded: Tensor) -> list[Tensor]:
    """The inverse of :func:`pad_heads`: ``(L, H, ...)`` -> one ``(H_l, ...)`` view per layer, no NaN heads.

    Example:
        >>> [t.tolist() for t in unpad_heads(pad_heads([torch.tensor([0.5, 0.25]), torch.tensor([0.75])]))]
        [[0.5, 0.25], [0.75]]
    """
    return [layer[:count] for layer, count in zip(padded, count_heads(padded))]


def best_head(table: Tensor) -> tuple[int, int]:
    """``(layer, head)`` of the largest entry of an ``(L, H)`` table; NaN (a missing head) never wins.

    ``torch.argmax`` takes NaN for the largest value, so missing heads are set to -inf first.

    Example:
        >>> best_head(torch.tensor([[0.2, 0.3], [0.9, float("nan")]]))
        (1, 0)
    """
    flat = int(torch.argmax(table.nan_to_num(nan=-math.inf)))
    return divmod(flat, table.shape[1])


def format_heads(counts: Sequence[int]) -> str:
    """Head counts as people read them: ``"2"`` when every layer has 2, else ``"2,1"`` (``--heads``'s form).

    Example:
        >>> format_heads((2, 2)), format_heads((2, 1))
        ('2', '2,1')
    """
    return str(counts[0]) if len(set(counts)) == 1 else ",".join(map(str, counts))


def head_roles(previous_token: Tensor, induction: Tensor, *,
               threshold: float = ROLE_THRESHOLD) -> list[list[tuple[str | None, float]]]:
    """Each real head's role and the score behind it, from ``(L, H)`` score tables (:func:`pad_heads` form).

    A head is ``"induction"`` when its induction score reaches ``threshold`` (never in the first
    layer: an induction head needs a previous-token head before it), else ``"previous-token"``
    when that score does; otherwise its role is None and the score is the larger of the two.
    Missing heads (NaN) get no entry: one list per layer, as long as that layer's heads.

    Example:
        >>> previous = pad_heads([torch.tensor([0.9, 0.1]), torch.tensor([0.25])])
        >>> induction = pad_heads([torch.tensor([0.75, 0.0]), torch.tensor([0.5])])
        >>> head_roles(previous, induction)
        [[('previous-token', 0.8999999761581421), (None, 0.10000000149011612)], [('induction', 0.5)]]
    """
    roles = []
    for layer, count in enumerate(count_heads(previous_token)):
        row = []
        for head in range(count):
            prev, ind = float(previous_token[layer, head]), float(induction[layer, head])
            if layer > 0 and ind >= threshold:
                row.append(("induction", ind))
            elif prev >= threshold:
                row.append(("previous-token", prev))
            else:
                row.append((None, max(prev, ind)))
        roles.append(row)
    return roles


def piece_groups(word_ids) -> list[list[int]]:
    """Group piece positions into display units: one per word, one per special token (``None``).

    Example:
        >>> piece_groups([None, 0, 0, 1, None])
        [[0], [1, 2], [3], [4]]
    """
    groups: list[list[int]] = []
    last = object()
    for position, word in enumerate(word_ids):
        if word is not None and word == last:
            groups[-1].append(position)
        else:
            groups.append([position])
        last = word
    return groups


def merge_pieces(weights: Tensor, groups: list[list[int]]) -> Tensor:
    """Piece weights ``(..., T, T)`` -> unit weights ``(..., U, U)``: sum over keys, mean over queries.

    Example:
        >>> w = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
        >>> merge_pieces(w, [[0], [1, 2]])
        tensor([[0.5000, 0.5000],
                [0.2000, 0.8000]])
    """
    n = weights.shape[-1]
    if sorted(p for group in groups for p in group) != list(range(n)):
        raise ValueError(f"groups must cover the {n} positions exactly once, got {groups}")
    assign = torch.zeros(n, len(groups), dtype=weights.dtype, device=weights.device)  # (T, U)
    for unit, group in enumerate(groups):
        assign[group, unit] = 1.0
    summed_keys = weights @ assign  # (..., T, U)
    mean_queries = assign.T / assign.sum(0)[:, None]  # (U, T)
    return mean_queries @ summed_keys  # (..., U, U)


def _join_pieces(pieces: list[str]) -> str:
    return "".join(p[2:] if p.startswith("##") and i else p for i, p in enumerate(pieces))


@dataclass(frozen=True)
class Link:
    """One attention link: ``layer``/``head`` send ``weight`` from a query word to ``word``.

    Example:
        >>> Link(4, 1, "meal", 0.62).describe()
        'layer 4 head 1 -> meal (0.620)'
    """

    layer: int
    head: int
    word: str
    weight: float

    def describe(self) -> str:
        """One line, e.g. ``layer 4 head 1 -> meal (0.620)``."""
        return f"layer {self.layer} head {self.head} -> {self.word} ({self.weight:.3f})"


@dataclass(frozen=True)
class WordAttention:
    """Word-level attention of one sentence through every layer and head.

    Attributes:
        words: the display units (words, and special tokens as they are).
        special: per unit, whether it is a special token.
        weights: ``(L, H, W, W)`` word-level weights (rows are query words); NaN for the heads a
            layer lacks when layers have different numbers of heads (:func:`pad_heads`).
        pieces: the tokenizer's pieces; piece_weights: ``(L, H, T, T)`` as the model returned them.
        groups: for each unit, its piece positions.

    Example:
        >>> w = torch.eye(3).expand(2, 1, 3, 3)                      # (L, H, T, T): attend to self
        >>> view = WordAttention.from_pieces(w, ["[CLS]", "hi", "[SEP]"], [None, 0, None])
        >>> view.top_links(1)[0][0].word
        'hi'
    """

    words: list[str]
    special: list[bool]
    weights: Tensor
    pieces: list[str]
    piece_weights: Tensor
    groups: list[list[int]]
    ids: tuple = ()

    @classmethod
    def from_pieces(cls, piece_weights: Tensor, pieces: list[str], word_ids, *, ids=()) -> "WordAttention":
        """Merge ``(L, H, T, T)`` piece weights into words (see the module doc for the rule).

        Example:
            >>> v = WordAttention.from_pieces(torch.ones(1, 1, 2, 2) / 2, ["a", "##b"], [0, 0])
            >>> v.words, float(v.weights.sum())
            (['ab'], 1.0)
        """
        if piece_weights.ndim != 4 or piece_weights.shape[-1] != len(pieces) or len(word_ids) != len(pieces):
            raise ValueError(f"piece_weights must be (L, H, T, T) with T = {len(pieces)} pieces and "
                             f"{len(word_ids)} word ids; got {tuple(piece_weights.shape)}")
        groups = piece_groups(word_ids)
        words = [_join_pieces([pieces[p] for p in group]) for group in groups]
        special = [word_ids[group[0]] is None for group in groups]
        weights = merge_pieces(piece_weights.detach().float(), groups)
        return cls(words, special, weights, list(pieces), piece_weights.detach(), groups, tuple(ids))

    @property
    def layers(self) -> int:
        """Number of layers ``L``."""
        return self.weights.shape[0]

    @property
    def heads(self) -> int:
        """Heads per layer ``H`` (the most of any layer, when layers differ)."""
        return self.weights.shape[1]

    @property
    def heads_per_layer(self) -> tuple[int, ...]:
        """The heads of each layer (see :func:`count_heads`).

        Example:
            >>> w = pad_heads([torch.ones(2, 1, 1), torch.ones(1, 1, 1)])      # (L, H, T, T)
            >>> WordAttention.from_pieces(w, ["a"], [0]).heads_per_layer
            (2, 1)
        """
        return count_heads(self.weights)

    def index(self, word: str | None) -> int:
        """Position of ``word`` (case-insensitive; the first occurrence); ``ValueError`` listing the words.

        Without a word: ``"it"`` when present, else the last non-special word.

        Example:
            >>> v = WordAttention.from_pieces(torch.ones(1, 1, 2, 2) / 2, ["it", "rains"], [0, 1])
            >>> v.index("Rains"), v.index(None)
            (1, 0)
        """
        lowered = [w.lower() for w in self.words]
        if word is None:
            if "it" in lowered:
                return lowered.index("it")
            return max(i for i, s in enumerate(self.special) if not s) if not all(self.special) else 0
        if word.lower() not in lowered:
            shown = ", ".join(w for w, s in zip(self.words, self.special) if not s)
            raise ValueError(f"query word {word!r} is not in the sentence; its words are: {shown}")
        return lowered.index(word.lower())

    def sink_shares(self) -> Tensor:
        """Each query word's sink share per layer and head ``(L, H, W)`` (:func:`sink_shares`).

        Example:
            >>> w = torch.tensor([[[[0.6, 0.0], [0.3, 0.3]]]])          # (1, 1, 2, 2): a sink took the rest
            >>> WordAttention.from_pieces(w, ["a", "b"], [0, 1]).sink_shares()
            tensor([[[0.4000, 0.4000]]])
        """
        return sink_shares(self.weights)

    def word_shares(self) -> Tensor:
        """Each head's mean weight from a word to *other* words: ``(L, H)``, NaN for missing heads.

        Averaged over the sentence's words (special tokens are no query), the weight each puts on
        the other words, neither itself nor a special token: a head that parks on [CLS] or [SEP], or
        that each word spends on itself, scores near 0; one that links words scores near 1. A sentence
        with a single word counts every other unit, specials too.

        Example:
            >>> w = torch.tensor([[[[.1, .8, .1], [.1, .1, .8], [.8, .1, .1]],     # head 0: to the next unit
            ...                    [[.1, .1, .8], [.1, .1, .8], [.1, .1, .8]]]])   # head 1: to [SEP]
            >>> WordAttention.from_pieces(w, ["a", "b", "[SEP]"], [0, 1, None]).word_shares()
            tensor([[0.4500, 0.1000]])
        """
        special = torch.tensor(self.special, dtype=torch.bool)
        words = ~special if not bool(special.all()) else torch.ones_like(special)
        keys = words if int(words.sum()) > 1 else torch.ones_like(special)
        others = keys[None, :] & ~torch.eye(len(self.words), dtype=torch.bool)  # (W, W): another word
        return (self.weights * others).sum(-1)[..., words].mean(-1)  # (L, H, W) -> (L, H)

    def informative_head(self) -> tuple[int, int]:
        """``(layer, head)`` with the largest :meth:`word_shares`: the head a view opens on by default.

        Example:
            >>> w = torch.tensor([[[[.1, .8, .1], [.1, .1, .8], [.8, .1, .1]],
            ...                    [[.1, .1, .8], [.1, .1, .8], [.1, .1, .8]]]])
            >>> WordAttention.from_pieces(w, ["a", "b", "[SEP]"], [0, 1, None]).informative_head()
            (0, 0)
        """
        return best_head(self.word_shares())

    def _candidates(self, query: int, hide_special: bool) -> list[int]:
        return [j for j in range(len(self.words)) if not (hide_special and self.special[j])]

    def top_links(self, query: int, *, hide_special: bool = False) -> list[list[Link]]:
        """For every layer and head, the word ``query`` attends to most: L lists of each layer's heads' Links.

        Example:
            >>> w = torch.tensor([[[[0.2, 0.8], [0.5, 0.5]]]])          # (1, 1, 2, 2)
            >>> WordAttention.from_pieces(w, ["a", "b"], [0, 1]).top_links(0)[0][0].describe()
            'layer 0 head 0 -> b (0.800)'
        """
        keys = self._candidates(query, hide_special)
        table = []
        for layer, count in enumerate(self.heads_per_layer):
            row = []
            for head in range(count):
                weights = self.weights[layer, head, query, keys]
                best = int(torch.argmax(weights))
                row.append(Link(layer, head, self.words[keys[best]], float(weights[best])))
            table.append(row)
        return table

    def strongest_heads(self, query: int, *, hide_special: bool = False) -> list[Link]:
        """For every other word, the single (layer, head) linking ``query`` to it most strongly.

        Example:
            >>> w = torch.tensor([[[[0.1, 0.9], [0.5, 0.5]]], [[[0.7, 0.3], [0.5, 0.5]]]])  # (2, 1, 2, 2)
            >>> [l.describe() for l in WordAttention.from_pieces(w, ["a", "b"], [0, 1]).strongest_heads(0)]
            ['layer 0 head 0 -> b (0.900)']
        """
        links = []
        for key in self._candidates(query, hide_special):
            if key == query:
                continue
            per_head = self.weights[:, :, query, key]  # (L, H)
            layer, head = best_head(per_head)
            links.append(Link(layer, head, self.words[key], float(per_head[layer, head])))
        return links

    def link(self, query: int, key: int) -> Link:
        """The strongest (layer, head) from ``query`` to ``key``.

        Example:
            >>> w = torch.tensor([[[[0.1, 0.9], [0.5, 0.5]]]])
            >>> WordAttention.from_pieces(w, ["a", "b"], [0, 1]).link(0, 1).weight
            0.8999999761581421
        """
        per_head = self.weights[:, :, query, key]  # (L, H)
        layer, head = best_head(per_head)
        return Link(layer, head, self.words[key], float(per_head[layer, head]))


def trace_model(encoder, sentence: str, *, truncate: bool = False) -> WordAttention:
    """Run ``sentence`` through a trained encoder and return its word-level attention.

    Args:
        encoder: a model with ``word_pieces(sentence, truncate=...)`` and
            ``encoder(input_ids, attention_mask, return_weights=True) -> (hidden, weights)``,
            such as :class:`attnlab.models.BertEncoder`.
        sentence: the text.
        truncate: cut a sentence longer than the model's positions instead of refusing it.

    Example:
        >>> from attnlab.models import BertEncoder
        >>> view = trace_model(BertEncoder.from_pretrained("minilm"), "It rains.")  # doctest: +SKIP
        >>> view.words, tuple(view.weights.shape)                                   # doctest: +SKIP
        (['[CLS]', 'it', 'rains', '.', '[SEP]'], (6, 12, 5, 5))
    """
    pieces, word_ids, ids = encoder.word_pieces(sentence, truncate=truncate)
    input_ids = torch.tensor([ids])  # (1, T)
    with torch.no_grad():
        _, weights = encoder(input_ids, torch.ones_like(input_ids), return_weights=True)
    stacked = pad_heads([w[0] for w in weights])  # (L, H, T, T); NaN where a layer has fewer heads
    return WordAttention.from_pieces(stacked, pieces, word_ids, ids=ids)
