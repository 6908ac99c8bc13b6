"""A self-contained HTML report of one :class:`attnlab.lab.explain.Trace`, and its inline views.

One file that works from ``file://`` with no network: the CSS (``report.css``), the script
(``report.js``) and the data are inlined, the heatmaps are inline SVG, and only system fonts are
named. Without JavaScript the page still shows every number; with it, a head selector switches
heads and hovering (or clicking) a word shows where it attends.

The same cards render inside a notebook: :func:`walk_view` (a trace's walk, what
``Trace._repr_html_`` shows) and :func:`heads_view` (any ``(H, Tq, Tk)`` weights with their
tokens) return one ``<div>`` whose ids carry a prefix of their own (:mod:`attnlab.lab.viz.page`).

Every heatmap cell is an SVG ``<rect class="cell">`` carrying ``data-head``, ``data-row``,
``data-col``, ``data-value`` (4 decimals) and ``data-masked``, so tests can read what is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from attnlab.lab.trained import WordAttention, format_heads, unpad_heads
from attnlab.lab.viz.headview import HEAD_COLORS, MIN_ALPHA
from attnlab.lab.viz.heatmap import Blocks, aggregate_blocks
from attnlab.lab.viz.page import asset as _asset
from attnlab.lab.viz.page import document, format_value, fragment, new_prefix, to_json, viridis
from attnlab.lab.viz.page import escape as _e

__all__ = ["TrainedSection", "Weights", "ranked_keys", "build_report", "write_report", "walk_view", "heads_view",
           "trained_view", "viridis"]

MAX_TABLE = 24  # rows/columns shown per step table; longer tables are cut with a note
MAX_LINKS = 12  # bars in the "where it attends" list


@dataclass(frozen=True)
class TrainedSection:
    """What the report shows of a trained model: its word-level weights and where to start.

    Attributes:
        model: the model's name, as the reader should see it (e.g. ``"all-MiniLM-L6-v2"``).
        view: the sentence's word-level weights through every layer and head.
        focus: the query word shown first; layer: the layer shown first; heads: the heads ticked.
        hide_special: draw no lines to or from special tokens ([CLS], [SEP]).
        sinks: the model's heads have sinks (``GPT(sinks=True)``): the report adds where the
            mass goes, the sink's share per layer and head (rows of ``view`` then sum to 1 minus it).

    Example:
        >>> import torch
        >>> view = WordAttention.from_pieces(torch.full((1, 2, 2, 2), 0.5), ["hi", "there"], [0, 1])
        >>> TrainedSection("toy", view, focus=0, layer=0, heads=(1,)).heads
        (1,)
    """

    model: str
    view: WordAttention
    focus: int
    layer: int = 0
    heads: tuple = (0,)
    hide_special: bool = False
    sinks: bool = False


@dataclass(frozen=True)
class Weights:
    """What the walk's cards draw: one attention's per-head weights and the tokens on each side.

    Attributes:
        weights: ``(H, Tq, Tk)``, rows are queries.
        tokens: ``Tq`` query labels; context_tokens: ``Tk`` key labels.
        allowed: ``(Tq, Tk)`` bool (False = masked) or None.
        mode: ``"cross"`` when queries and keys come from different sequences (both are shown).
        untrained: the weights come from random projections (the card says the pattern is arbitrary).
        sink_shares: ``(H, Tq)``, each query's share of the mass a sink took, or None without sinks
            (rows of ``weights`` then sum to 1 minus it).

    Example:
        >>> w = Weights.of(torch.tensor([[0.9, 0.1], [0.5, 0.5]]), ["a", "b"])
        >>> w.heads, w.context_tokens
        (1, ('a', 'b'))
    """

    weights: Tensor
    tokens: tuple
    context_tokens: tuple
    allowed: Tensor | None = None
    mode: str = "self"
    untrained: bool = False
    sink_shares: Tensor | None = None

    @property
    def heads(self) -> int:
        return self.weights.shape[0]

    @classmethod
    def of(cls, weights: Tensor, tokens, *, context_tokens=None, allowed: Tensor | None = None,
           sink_shares: Tensor | None = None) -> "Weights":
        """Check ``weights`` ``(Tq, Tk)`` or ``(H, Tq, Tk)`` against the labels (``ValueError`` naming them);
        ``sink_shares`` ``(Tq,)`` or ``(H, Tq)``, when a sink took part of each row."""
        if not isinstance(weights, Tensor):
            raise TypeError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
        weights = weights.detach().float().cpu()
        weights = weights[None] if weights.ndim == 2 else weights  # (H, Tq, Tk)
        if weights.ndim != 3:
            raise ValueError(f"weights must be (Tq, Tk) or (H, Tq, Tk), got shape {tuple(weights.shape)}")
        cross = context_tokens is not None
        context_tokens = tokens if context_tokens is None else context_tokens
        if len(tokens) != weights.shape[1] or len(context_tokens) != weights.shape[2]:
            names = "tokens and context_tokens" if cross else "tokens"
            raise ValueError(f"{names} must label the weights' rows and columns {tuple(weights.shape[1:])}, got "
                             f"{len(tokens)} and {len(context_tokens)} labels")
        if allowed is not None and tuple(allowed.shape) != tuple(weights.shape[1:]):
            raise ValueError(f"allowed must be (Tq, Tk) = {tuple(weights.shape[1:])}, got {tuple(allowed.shape)}")
        if sink_shares is not None:
            sink_shares = _sink_shares(sink_shares, *weights.shape[:2])
        return cls(weights, tuple(map(str, tokens)), tuple(map(str, context_tokens)),
                   None if allowed is None else allowed.bool().cpu(), "cross" if cross else "self",
                   sink_shares=sink_shares)


def _sink_shares(shares: object, heads: int, tq: int) -> Tensor:
    """``shares`` ``(Tq,)`` or ``(H, Tq)`` as ``(H, Tq)`` float on the CPU (errors name ``sink_shares``)."""
    if not isinstance(shares, Tensor):
        raise TypeError(f"sink_shares must be a torch.Tensor, got {type(shares).__name__}")
    shares = shares.detach().float().cpu()
    shares = shares[None] if shares.ndim == 1 else shares  # (H or 1, Tq)
    if shares.ndim != 2 or shares.shape[1] != tq or shares.shape[0] not in (1, heads):
        raise ValueError(f"sink_shares must be (Tq,) or (H, Tq) = ({heads}, {tq}), got {tuple(shares.shape)}")
    return shares.expand(heads, tq)


def ranked_keys(row: Tensor, allowed_row: Tensor | None = None) -> list[int]:
    """The keys a query may attend to, strongest weight first (ties: lower position first).

    Example:
        >>> ranked_keys(torch.tensor([0.2, 0.5, 0.3]), torch.tensor([True, False, True]))
        [2, 0]
    """
    values = row.tolist()
    visible = [j for j in range(len(values)) if allowed_row is None or bool(allowed_row[j])]
    return sorted(visible, key=lambda j: (-values[j], j))


def write_report(trace, path: str | Path, *, focus: int | None = None,
                 trained: TrainedSection | None = None, walk=None) -> Path:
    """Write :func:`build_report`'s page to ``path`` (UTF-8) and return the path.

    Example:
        >>> import tempfile
        >>> from attnlab.lab.explain import trace
        >>> p = write_report(trace("The sun rises"), Path(tempfile.mkdtemp()) / "report.html")
        >>> p.read_text().startswith("<!DOCTYPE html>")
        True
    """
    path = Path(path)
    path.write_text(build_report(trace, focus=focus, trained=trained, walk=walk), encoding="utf-8")
    return path


def build_report(trace, *, focus: int | None = None, trained: TrainedSection | None = None, walk=None) -> str:
    """The report page as one HTML string (inline CSS, JS, data and SVG).

    Args:
        trace: the :class:`attnlab.lab.explain.Trace` to walk through (None: a page for the trained model alone).
        focus: index of the query token focused first (default: ``trace.query_index()``).
        trained: a trained model's head view, shown after the walk (or alone).
        walk: a :class:`attnlab.lab.walks.Walk` of ``trace`` (flash, sparse or linear), shown after
            the textbook steps: its checks, its tile grid (flash) and its steps.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> page = build_report(trace("The sun rises", mode="causal"))
        >>> page.count('class="cell'), "http" in page
        (9, False)
    """
    if trace is None:
        if trained is None:
            raise ValueError("build_report needs a trace, a trained section, or both")
        return _page(f"attnlab explain --model {trained.model}", _model_header(trained),
                     _trained_card(trained, ""), "", trained)
    focus = trace.query_index() if focus is None else focus
    ending = (_trained_card(trained, "") if trained else "") + _steps(trace, focus)  # head view, then the steps
    if walk is not None:
        ending += fast_walk_cards(walk, focus)
    cards, walk = _walk(_of_trace(trace), focus, "", steps=ending)
    return _page(f"attnlab explain: {trace.sentence}", _header(trace), cards, walk, trained)


def walk_view(trace, *, focus: int | None = None, steps: bool = True) -> str:
    """A trace's walk as one inline view (a notebook output): the report's cards, ids prefixed.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> a, b = walk_view(trace("The sun rises")), walk_view(trace("The sun rises"))
        >>> a.startswith('<div class="attnlab inline"'), a.count('id="attnlab-') == b.count('id="attnlab-') > 5
        (True, True)
        >>> set(a.split('id="')[1:]) & set(b.split('id="')[1:])    # no id shared by two views
        set()
    """
    focus = trace.query_index() if focus is None else focus
    prefix = new_prefix()
    cards, walk = _walk(_of_trace(trace), focus, prefix, steps=_steps(trace, focus) if steps else "")
    return fragment(cards, prefix=prefix, roles=("walk",), scripts=walk)


def heads_view(weights: Weights, *, focus: int | None = None) -> str:
    """Any weights with their tokens as one inline view: head selector, heatmap, where a token attends.

    Example:
        >>> view = heads_view(Weights.of(torch.softmax(torch.randn(2, 3, 3), -1), ["a", "b", "c"]))
        >>> view.count('class="token q"'), view.count('<option value=')
        (3, 2)
    """
    focus = len(weights.tokens) - 1 if focus is None else focus
    prefix = new_prefix()
    cards, walk = _walk(weights, focus, prefix, steps="")
    return fragment(cards, prefix=prefix, roles=("walk",), scripts=walk)


def _of_trace(trace) -> Weights:
    return Weights(trace.weights(), tuple(trace.tokens), tuple(trace.context_tokens), trace.allowed(),
                   "cross" if trace.mode == "cross" else "self", untrained=True, sink_shares=trace.sink_shares())


def _walk(view: Weights, focus: int, prefix: str, *, steps: str) -> tuple[str, str]:
    """The walk's cards and its data + script, ids starting with ``prefix``."""
    blocks = aggregate_blocks(view.weights, rows=view.tokens, cols=view.context_tokens, allowed=view.allowed)
    data = {
        "mode": view.mode, "heads": view.heads, "tokens": view.tokens, "context_tokens": view.context_tokens,
        "weights": [[[round(float(w), 4) for w in row] for row in head] for head in view.weights.tolist()],
        "allowed": None if view.allowed is None else view.allowed.tolist(),
        "focus": focus, "block": list(blocks.size), "max_links": MAX_LINKS,
    }
    cards = "\n".join([_sentence_card(view, focus, prefix), '<div class="grid2">', _heatmap_card(view, blocks, prefix),
                       _links_card(view, focus, prefix), "</div>", _sink_card(view, focus), steps])
    walk = (f'<script id="{prefix}attnlab-data" type="application/json">{to_json(data)}</script>\n'
            f"<script>{_asset('report.js')}</script>\n")
    return cards, walk


def _page(title: str, header: str, main: str, scripts: str, trained: TrainedSection | None) -> str:
    """One self-contained page: inline CSS, the sections, their data and scripts."""
    roles = ("walk",) if scripts else ()
    if trained is not None:
        scripts += _trained_scripts(trained, "")
        roles += ("heads",)
    body = f"{header}\n<main><div class=\"wrap\">\n{main}\n</div></main>\n{_footer()}"
    return document(title, body, roles=roles, scripts=scripts)


def _trained_scripts(section: TrainedSection, prefix: str) -> str:
    return (f'<script id="{prefix}attnlab-trained" type="application/json">{to_json(_trained_data(section))}'
            f"</script>\n<script>{_asset('headview.js')}</script>\n")


def trained_view(section: TrainedSection) -> str:
    """A trained model's head view (layer selector, head toggles, hover a word) as one inline view.

    Example:
        >>> view = WordAttention.from_pieces(torch.full((1, 2, 2, 2), 0.5), ["hi", "there"], [0, 1])
        >>> trained_view(TrainedSection("toy", view, focus=0)).count('class="hv-word q')
        2
    """
    prefix = new_prefix()
    return fragment(_trained_card(section, prefix), prefix=prefix, roles=("heads",),
                    scripts=_trained_scripts(section, prefix))


# Head-view geometry (SVG user units): word columns at LEFT/RIGHT, one ROW per word from TOP.
_HV = {"left": 160, "right": 420, "top": 24, "row": 24, "width": 580}


def _trained_data(section: TrainedSection) -> dict:
    view = section.view
    hidden = torch.tensor(view.special, dtype=torch.bool) if section.hide_special else torch.zeros(len(view.words),
                                                                                                    dtype=torch.bool)
    return {
        "words": view.words, "special": view.special, "hide_special": section.hide_special,
        "weights": [[drawn_links(head, hidden) for head in layer] for layer in unpad_heads(view.weights)],
        "layer": section.layer, "focus": section.focus, "colors": list(HEAD_COLORS), "min_alpha": MIN_ALPHA,
        **{key: _HV[key] for key in ("left", "right", "top", "row")},
    }


def drawn_links(weights: Tensor, hidden: Tensor) -> list[list[float]]:
    """What the head view reads of one head ``(T, T)``: per query, ``[key, weight, key, weight, ...]``
    for the weights it may draw (at least :data:`MIN_ALPHA`) and the query's strongest link to
    another shown word, weights rounded to 4 decimals. A page holds these, not ``T x T`` numbers:
    a row's weights sum to 1, so at most ``1 / MIN_ALPHA`` of them are drawn.

    Example:
        >>> drawn_links(torch.tensor([[0.99, 0.01], [0.015, 0.985]]), torch.tensor([False, False]))
        [[0, 0.99, 1, 0.01], [0, 0.015, 1, 0.985]]
    """
    n = weights.shape[-1]
    eligible = ~hidden[None, :] & ~torch.eye(n, dtype=torch.bool)  # (T, T): another word, shown
    strongest = torch.where(eligible, weights, -1.0).argmax(-1)  # (T,)
    keep = weights >= MIN_ALPHA
    keep[torch.arange(n), strongest] |= eligible[torch.arange(n), strongest]
    rows, keys = keep.nonzero(as_tuple=True)
    values = (weights[rows, keys].double() * 1e4).round() / 1e4  # fp64: 0.99 prints as 0.99
    pairs = torch.stack([keys.to(values.dtype), values], dim=-1)  # (kept, 2), row by row
    counts = torch.bincount(rows, minlength=n).tolist()
    return [[int(x) if i % 2 == 0 else x for i, x in enumerate(part.reshape(-1).tolist())]
            for part in pairs.split(counts)]


def _model_header(section: TrainedSection) -> str:
    view = section.view
    badges = [section.model, f"{view.layers} layers", f"{format_heads(view.heads_per_layer)} heads per layer",
              "trained weights"]
    return (
        '<header class="top"><div class="wrap"><h1>What a trained model attends to</h1>'
        f"<p>{_e(' '.join(w for w, s in zip(view.words, view.special) if not s))}</p>"
        f'<div class="badges">{"".join(f"<span class=badge>{_e(b)}</span>" for b in badges)}</div>'
        "</div></header>"
    )


def _trained_card(section: TrainedSection, prefix: str) -> str:
    """The head view: layer selector, head toggles, the two word columns; lines are drawn by headview.js."""
    view, geometry = section.view, _HV
    height = geometry["top"] * 2 + geometry["row"] * (len(view.words) - 1)
    options = "".join(f'<option value="{layer}"{" selected" if layer == section.layer else ""}>layer {layer}</option>'
                      for layer in range(view.layers))
    toggles = "".join(
        f'<label><input type="checkbox" class="hv-head" value="{h}"{" checked" if h in section.heads else ""}>'
        f'<span class="hv-swatch" style="background:{HEAD_COLORS[h % len(HEAD_COLORS)]}"></span>head {h}</label>'
        for h in range(view.heads))
    words = []
    for i, word in enumerate(view.words):
        y, cls = geometry["top"] + i * geometry["row"], " special" if view.special[i] else ""
        words.append(f'<text class="hv-word q{cls}" data-index="{i}" x="{geometry["left"] - 8}" y="{y}" '
                     f'text-anchor="end" dominant-baseline="middle">{_e(word)}</text>'
                     f'<text class="hv-word k{cls}" data-index="{i}" x="{geometry["right"] + 8}" y="{y}" '
                     f'dominant-baseline="middle">{_e(word)}</text>')
    return (
        f'<section class="card" id="{prefix}trained">'
        f"<h2>What the trained {_e(section.model)} does with this sentence</h2>"
        '<p class="muted">The head view: each line joins a word (left) to a word it attends to (right); its '
        "opacity is the attention weight, its colour the head. Hover a word on the left to see its lines. "
        "Word pieces are merged into words: a word receives the sum of the weights on its pieces, and attends "
        "as the mean of its pieces.</p>"
        f'<div class="hv-controls"><span><label for="{prefix}hv-layer">Layer</label>'
        f'<select id="{prefix}hv-layer">{options}</select></span><div class="hv-heads">{toggles}</div></div>'
        f'<p class="summary" id="{prefix}hv-best"></p>'
        f'<svg class="headview" id="{prefix}hv-svg" width="{geometry["width"]}" height="{height}" '
        f'viewBox="0 0 {geometry["width"]} {height}" role="img" aria-label="head view">'
        f'<g id="{prefix}hv-lines"></g>{"".join(words)}</svg></section>'
    ) + _trained_sink_card(section)


def _trained_sink_card(section: TrainedSection) -> str:
    """A trained model with sinks: the focus word's sink share per head (rows) and layer (columns),
    the mean over the sentence's words beside it ("" without sinks).

    Example:
        >>> w = torch.full((1, 2, 2, 2), 0.25)  # every row sums to 0.5: the sink took half
        >>> view = WordAttention.from_pieces(w, ["hi", "there"], [0, 1])
        >>> card = _trained_sink_card(TrainedSection("toy", view, focus=0, sinks=True))
        >>> card.count("0.500"), _trained_sink_card(TrainedSection("toy", view, focus=0))
        (4, '')
    """
    if not section.sinks:
        return ""
    view = section.view
    shares = view.sink_shares()  # (L, H, W); NaN for heads a layer lacks
    counts = view.heads_per_layer
    head = "".join(f"<th>layer {layer}</th>" for layer in range(view.layers))
    rows = []
    for h in range(view.heads):
        cells = "".join("<td></td>" if h >= counts[layer] else
                        _share_td(float(shares[layer, h, section.focus]), float(shares[layer, h].mean()))
                        for layer in range(view.layers))
        rows.append(f"<tr><th>head {h}</th>{cells}</tr>")
    word = view.words[section.focus]
    return (
        '<section class="card sinks"><h2>Where the mass goes: the sink</h2>'
        f"<p class=\"muted\">Each head of this model has a sink: one more key with a learned logit and value 0. "
        f"A cell is the share of &ldquo;{_e(word)}&rdquo;&rsquo;s attention that head gives its sink, in brackets "
        "the mean over the sentence&rsquo;s words: attention that goes to no word. The head view above draws "
        "the words&rsquo; part.</p>"
        f'<div class="table-box"><table class="values sink-shares"><thead><tr><th>head</th>{head}</tr></thead>'
        f'<tbody>{"".join(rows)}</tbody></table></div></section>'
    )


def _header(trace) -> str:
    kind = {"self": "self-attention", "causal": "causal self-attention", "multihead": "multi-head attention",
            "cross": "cross-attention"}[trace.mode]
    badges = [kind, f"{trace.heads} head{'s' if trace.heads > 1 else ''}", f"d_model = {trace.d_model}",
              f"d_k = {trace.d_kq}", f"d_v = {trace.d_v}", f"seed {trace.seed}"]
    if trace.causal and trace.mode != "causal":
        badges.append("causal mask")
    if trace.dropout_p:
        badges.append(f"dropout {trace.dropout_p}")
    if trace.score_mod is not None:
        badges.append(f"score mod {trace.score_mod!r}")
    if trace.sinks is not None:
        badges.append("sinks, logit " + ", ".join(f"{float(s):.4g}" for s in trace.sinks))
    badges.append("random, untrained weights")
    return (
        '<header class="top"><div class="wrap"><h1>Attention, step by step</h1>'
        f"<p>How {_e(kind)} turns each word of a sentence into a context-aware vector.</p>"
        f'<div class="badges">{"".join(f"<span class=badge>{_e(b)}</span>" for b in badges)}</div>'
        "</div></header>"
    )


def _chips(tokens, cls: str) -> str:
    return "".join(f'<span class="token {cls}" data-index="{i}">{_e(t)}<span class="w"></span></span>'
                   for i, t in enumerate(tokens))


def _sentence_card(trace: Weights, focus: int, prefix: str) -> str:
    options = "".join(f'<option value="{h}">head {h}</option>' for h in range(trace.heads))
    disabled = "" if trace.heads > 1 else " disabled"
    parts = ['<section class="card"><div class="controls">',
             f'<div><label for="{prefix}head-select">Head</label>'
             f'<select id="{prefix}head-select"{disabled}>{options}</select></div>',
             f'<div class="muted">Hover a word to see where it attends; click to pin it. '
             f'Pinned now: <b id="{prefix}pinned">{_e(trace.tokens[focus])}</b>.</div></div>']
    if trace.mode == "cross":
        parts += ['<div class="side-label">queries (from the first sentence)</div>',
                  f'<div class="sentence">{_chips(trace.tokens, "q")}</div>',
                  '<div class="side-label">keys and values (from the context sentence)</div>',
                  f'<div class="sentence">{_chips(trace.context_tokens, "k")}</div>']
    else:
        parts.append(f'<div class="sentence">{_chips(trace.tokens, "q")}</div>')
    parts.append("</section>")
    return "".join(parts)


def _heatmap_card(trace: Weights, blocks: Blocks, prefix: str) -> str:
    vmax = max(float(blocks.weights.max()), 1e-12)
    panels = "".join(
        f'<div class="per-head heatmap-box" data-head="{h}"{"" if h == 0 else " hidden"}>'
        f"{_heatmap_svg(blocks, h, vmax, prefix)}</div>" for h in range(trace.heads))
    note = ""
    if blocks.size != (1, 1):
        note = (f'<p class="note">{len(trace.tokens)} x {len(trace.context_tokens)} tokens are drawn in blocks '
                f"of {blocks.size[0]} x {blocks.size[1]}: a cell is a block's total weight, averaged over its "
                "queries.</p>")
    ramp = ", ".join(viridis(i / 8) for i in range(9))
    return (
        '<section class="card"><h2>Attention weights</h2>'
        '<p class="muted">Row = the word that looks (query); column = the word it looks at (key). '
        + ("Each row sums to 1." if trace.sink_shares is None else
           "Each row sums to 1 minus the sink's share (see &ldquo;Where the mass goes&rdquo;).") + "</p>"
        f"{panels}"
        f'<div class="legend"><span>0</span><span class="ramp" style="background: linear-gradient(90deg, {ramp})">'
        f"</span><span>{vmax:.2f}</span>"
        + ('<span class="hatch"></span><span>masked (not allowed to attend)</span>'
           if trace.allowed is not None else "")
        + f"</div>{note}</section>"
    )


def _heatmap_svg(blocks: Blocks, h: int, vmax: float, prefix: str) -> str:
    """One head's weights as SVG cells with token labels on both axes."""
    n_rows, n_cols = len(blocks.rows), len(blocks.cols)
    cell = max(8, min(40, 560 // max(n_rows, n_cols)))
    left = 12 + 7 * max(len(r) for r in blocks.rows)
    top = 16 + int(5.2 * max(len(c) for c in blocks.cols))
    width, height = left + n_cols * cell + 8, top + n_rows * cell + 8
    show_values = cell >= 34
    out = [f'<svg class="heatmap" data-head="{h}" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img">',
           f'<defs><pattern id="{prefix}hatch-{h}" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eceff3"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#b9bfca" stroke-width="2"/></pattern></defs>']
    label_size = 12 if cell >= 16 else 8
    for j, label in enumerate(blocks.cols):
        x, y = left + j * cell + cell / 2, top - 6
        out.append(f'<text class="col-label" data-col="{j}" x="{x:.1f}" y="{y}" font-size="{label_size}" '
                   f'transform="rotate(-45 {x:.1f} {y})">{_e(label)}</text>')
    values = blocks.weights[h].tolist()
    for i, label in enumerate(blocks.rows):
        y = top + i * cell
        out.append(f'<text class="row-label" data-row="{i}" x="{left - 6}" y="{y + cell / 2 + 4:.1f}" '
                   f'text-anchor="end" font-size="{label_size}">{_e(label)}</text>')
        for j, value in enumerate(values[i]):
            masked = blocks.allowed is not None and not bool(blocks.allowed[i, j])
            fill = f"url(#{prefix}hatch-{h})" if masked else viridis(value / vmax)
            text = "masked" if masked else format_value(value)
            out.append(f'<rect class="cell{" masked" if masked else ""}" data-head="{h}" data-row="{i}" '
                       f'data-col="{j}" data-value="{format_value(value)}" data-masked="{str(masked).lower()}" '
                       f'x="{left + j * cell}" y="{y}" width="{cell}" height="{cell}" fill="{fill}">'
                       f"<title>{_e(blocks.rows[i])} \u2192 {_e(blocks.cols[j])}: {text}</title></rect>")
            if show_values and not masked:
                ink = "#111827" if value / vmax > 0.6 else "#ffffff"
                out.append(f'<text class="v" x="{left + j * cell + cell / 2}" y="{y + cell / 2 + 3.5}" '
                           f'text-anchor="middle" fill="{ink}" style="fill:{ink}">{value:.2f}</text>')
    out.append("</svg>")
    return "".join(out)


def _links_card(trace: Weights, focus: int, prefix: str) -> str:
    row = trace.weights[0, focus]  # head 0: the one shown first
    keys = ranked_keys(row, None if trace.allowed is None else trace.allowed[focus])
    top, low = keys[0], keys[-1]
    word, cols = trace.tokens[focus], trace.context_tokens
    rows = "".join(
        f'<li><span class="word">{_e(cols[j])}</span><span class="bar"><span style="width:'
        f'{100 * float(row[j]) / (float(row[top]) or 1):.1f}%"></span></span>'
        f'<span class="val">{format_value(float(row[j]))}</span></li>' for j in keys[:MAX_LINKS])
    return (
        f'<section class="card"><h2>Where \u2018<span id="{prefix}links-word">{_e(word)}</span>\u2019 attends'
        f'<span id="{prefix}links-head">{" (head 0)" if trace.heads > 1 else ""}</span></h2>'
        f'<p class="summary" id="{prefix}links-summary">\u2018<b>{_e(word)}</b>\u2019 attends most to '
        f"\u2018<b>{_e(cols[top])}</b>\u2019 ({format_value(float(row[top]))}) and least to "
        f"\u2018<b>{_e(cols[low])}</b>\u2019 ({format_value(float(row[low]))}).</p>"
        f'<ul class="links" id="{prefix}links-list">{rows}</ul>'
        + (_UNTRAINED_NOTE + (" A trained model learns weights that make \u2018it\u2019 look at \u2018meal\u2019."
                              if {"it", "meal"} <= set(trace.tokens) else "") + "</p>" if trace.untrained else "")
        + "</section>"
    )


def _sink_card(view: Weights, focus: int) -> str:
    """Each query's sink share, one column per head ("" without sinks): the mass no key received."""
    if view.sink_shares is None:
        return ""
    shares = view.sink_shares.tolist()  # (H, Tq)
    head = "".join(f"<th>head {h}</th>" for h in range(view.heads))
    body = []
    for i, token in enumerate(view.tokens[:MAX_TABLE]):
        cells = "".join(_td(float(shares[h][i]), 1.0, "sink") for h in range(view.heads))
        hl = ' class="hl"' if i == focus else ""
        body.append(f'<tr data-row="{i}"{hl}><th>{_e(token)}</th>{cells}</tr>')
    note = (f'<div class="truncated">showing {MAX_TABLE} of {len(view.tokens)} queries</div>'
            if len(view.tokens) > MAX_TABLE else "")
    return (
        '<section class="card sinks"><h2>Where the mass goes: the sink</h2>'
        '<p class="muted">A sink is one more key with a learned logit and value 0: the share a query gives it '
        "is attention that goes nowhere. Each cell is a query&rsquo;s sink share; 1 minus it went to the words.</p>"
        f'<div class="table-box"><table class="values sink-shares"><thead><tr><th>query</th>{head}</tr></thead>'
        f'<tbody>{"".join(body)}</tbody></table></div>{note}</section>'
    )


_UNTRAINED_NOTE = '<p class="note">These weights come from random, untrained W_q and W_k, so the pattern is arbitrary.'


def _footer() -> str:
    return ('<footer>Made by <code>attnlab explain</code>. This page is one self-contained file: '
            "it loads nothing from the network.</footer>")


def _steps(trace, focus: int, title: str = "The computation, one step at a time") -> str:
    """One card per step; a per-head step has one card per head, only the selected head's shown."""
    names = list(dict.fromkeys(s.name for s in trace.steps))
    cards = [f'<h2 class="steps-title">{_e(title)}</h2><div class="steps">']
    for number, name in enumerate(names, start=1):
        for step in (s for s in trace.steps if s.name == name):
            per_head = step.head is not None and trace.heads > 1
            classes = "card step" + (" wide" if len(step.cols) > 6 else "") + (" per-head" if per_head else "")
            attrs = f' class="{classes}"' + (f' data-head="{step.head}"' if per_head else "")
            hidden = " hidden" if per_head and step.head != 0 else ""
            head_tag = f'<span class="headtag">head {step.head}</span>' if per_head else ""
            cards.append(
                f'<section{attrs} data-step="{_e(name)}"{hidden}><header><span class="num">{number}</span>'
                f"<h3>{_title(step.title)}</h3>{head_tag}"
                f'<span class="shape">shape {_e(tuple(step.shape))}</span></header>'
                f'<p class="explain">{_e(step.explanation)}</p>{_table(step, focus)}</section>')
    return "".join(cards) + "</div>"


def _title(title: str) -> str:
    name, _, formula = title.partition("  ")
    return _e(name) + (f' <code class="formula">{_e(formula)}</code>' if formula else "")


def _table(step, focus: int) -> str:
    """A step's tensor as a labelled table, tinted by value, cut to MAX_TABLE rows and columns."""
    values = step.tensor.tolist()
    matrix = values if step.tensor.ndim == 2 else [values]
    rows = list(step.rows) if step.rows is not None else [""]
    n_rows, n_cols = len(matrix), len(step.cols)
    floats = [v for row in matrix for v in row if isinstance(v, float) and abs(v) != float("inf")]
    scale = max((abs(v) for v in floats), default=1.0) or 1.0
    head = "".join(f"<th>{_e(c)}</th>" for c in step.cols[:MAX_TABLE])
    body = []
    for i, row in enumerate(matrix[:MAX_TABLE]):
        cells = "".join(_td(v, scale, step.name) for v in row[:MAX_TABLE])
        token = None if step.first_row is None else step.first_row + i  # the token this row is
        hl = ' class="hl"' if step.rows is not None and token == focus else ""
        tokens_row = step.rows is not None and len(step.rows) == n_rows and token is not None
        data_row = f' data-row="{token}"' if tokens_row else ""
        body.append(f"<tr{data_row}{hl}><th>{_e(rows[i])}</th>{cells}</tr>")
    note = ""
    if n_rows > MAX_TABLE or n_cols > MAX_TABLE:
        note = (f'<div class="truncated">showing {min(n_rows, MAX_TABLE)} of {n_rows} rows and '
                f"{min(n_cols, MAX_TABLE)} of {n_cols} columns</div>")
    return (f'<div class="table-box"><table class="values"><thead><tr><th></th>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>{note}')


def _share_td(share: float, mean: float) -> str:
    """A sink-share cell: the share shaded as the value cells are, the mean in brackets."""
    return f'<td style="{_shade(share, 1.0)}">{share:.3f} <span class="muted">({mean:.3f})</span></td>'


def _shade(value: float, scale: float) -> str:
    """A value cell's background: its sign's colour, stronger as ``|value| / scale`` grows to 1."""
    alpha = 0.06 + 0.5 * min(abs(value) / scale, 1.0)
    rgb = "var(--neg)" if value < 0 else "var(--pos)"
    return f"background: rgba({rgb}, {alpha:.2f})"


def _td(value, scale: float, name: str) -> str:
    text = format_value(value)
    if (isinstance(value, bool) and not value) or (isinstance(value, float) and value == float("-inf")):
        return f'<td class="masked">{text}</td>'
    if isinstance(value, (bool, int)):
        return f"<td>{text}</td>"
    return f'<td style="{_shade(value, scale)}">{text}</td>'


_WALK_TITLES = {"flash": "The same attention, FlashAttention's way (--walk flash)",
                "sparse": "The same attention over each query's top-k keys (--walk sparse)",
                "linear": "Linear attention on the same queries, keys and values (--walk linear)"}
_GRID_STYLE = (
    "<style>.attnlab table.tilegrid{border-collapse:collapse;font-size:12px}"
    ".attnlab table.tilegrid td.t{width:18px;height:18px;border:1px solid rgba(128,128,128,.25);padding:0}"
    ".attnlab table.tilegrid td.full{background:rgba(46,125,50,.55)}"
    ".attnlab table.tilegrid td.partial{background:rgba(239,160,0,.55)}"
    ".attnlab table.tilegrid td.partial.masked{background:repeating-linear-gradient(45deg,rgba(239,160,0,.55) 0 3px,"
    "transparent 3px 6px)}"
    ".attnlab table.tilegrid td.skipped{background:rgba(128,128,128,.12)}"
    ".attnlab table.tilegrid td.left{border-left:2px solid currentColor}"
    ".attnlab table.tilegrid td.top{border-top:2px solid currentColor}"
    ".attnlab table.tilegrid td.stat{padding:0 6px;text-align:right;font-variant-numeric:tabular-nums}"
    ".attnlab .legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}"
    "</style>")


def fast_walk_cards(walk, focus: int, prefix: str = "") -> str:
    """A fast walk's part of the report: its checks, its tile grid (flash) and its steps.

    Example:
        >>> from attnlab.lab.explain import trace
        >>> from attnlab.lab.walks import flash_walk
        >>> html = fast_walk_cards(flash_walk(trace("The sun rises", mode="causal"), tile=2), 0)
        >>> html.count('class="t full'), html.count('class="t partial'), html.count('class="t skipped')
        (3, 4, 2)
    """
    checks = "".join(f"<tr><th>{_e(name)}</th><td>{value:.3g}</td></tr>" for name, value in walk.checks.items())
    notes = "".join(f"<li>{_e(note)}</li>" for note in walk.notes)
    card = (f'<section class="card" id="{prefix}walk-checks"><h2>Beside the textbook</h2><ul>{notes}</ul>'
            f'<table class="values"><thead><tr><th>max |difference|</th><th></th></tr></thead>'
            f"<tbody>{checks}</tbody></table></section>")
    grid = tile_grid(walk, focus, prefix) if walk.kind == "flash" else ""
    return (f'<h2 class="steps-title">{_e(_WALK_TITLES[walk.kind])}</h2>{card}{grid}'
            + _steps(walk, focus, title=f"--walk {walk.kind}, one step at a time"))


def tile_grid(walk, focus: int | None = None, prefix: str = "") -> str:
    """The flash walk's tiles as a query x key grid: each cell coloured by its tile (computed in full,
    partial, skipped), masked cells of partial tiles hatched, tile edges drawn; each row ends with its
    running maximum, sum and log-sum-exp (head 0).

    Example:
        >>> from attnlab.lab.explain import trace
        >>> from attnlab.lab.walks import flash_walk
        >>> tile_grid(flash_walk(trace("The sun rises in the east", mode="causal"), tile=4)).count("<tr")
        7
    """
    tq, tk = len(walk.tokens), len(walk.context_tokens)
    cells = [["skipped"] * tk for _ in range(tq)]
    for t in walk.tiles:
        for i in range(t.qs, t.qe):
            for j in range(t.ks, t.ke):
                edges = (" left" if j == t.ks else "") + (" top" if i == t.qs else "")
                cells[i][j] = t.status + ("" if bool(walk.allowed[i, j]) else " masked") + edges
    head = "".join(f'<th title="{_e(w)}">{j}</th>' for j, w in enumerate(walk.context_tokens))
    rows = []
    for i, word in enumerate(walk.tokens):
        stats = "".join(f'<td class="stat">{_e(format_value(float(x)))}</td>' for x in walk.row_stats[i])
        tds = "".join(f'<td class="t {c}" title="{_e(word)} x {_e(walk.context_tokens[j])}"></td>'
                      for j, c in enumerate(cells[i]))
        hl = ' class="hl"' if i == focus else ""
        rows.append(f"<tr{hl}><th>{_e(word)}</th>{tds}{stats}</tr>")
    legend = ('<p class="legend"><span style="background:rgba(46,125,50,.55)"></span>computed, all '
              'allowed<span style="background:rgba(239,160,0,.55)"></span>partial (masked cells hatched)'
              '<span style="background:rgba(128,128,128,.12)"></span>skipped</p>')
    return (f'<section class="card step wide" id="{prefix}tile-grid">{_GRID_STYLE}<h2>Tiles of {walk.tile}</h2>'
            f'<p class="explain">Rows are queries, columns keys. {_e(walk.notes[0])}. The last three columns '
            f"are each row's running maximum m, sum l and lse = m + log l when its last tile is done.</p>{legend}"
            f'<div class="table-box"><table class="tilegrid"><thead><tr><th></th>{head}<th>m</th><th>l</th>'
            f'<th>lse</th></tr></thead><tbody>{"".join(rows)}</tbody></table></div></section>')


def fast_walk_view(walk, *, focus: int | None = None) -> str:
    """A fast walk as one inline view (a notebook output): its checks, tile grid and steps (head 0).

    Example:
        >>> from attnlab.lab.explain import trace
        >>> from attnlab.lab.walks import flash_walk
        >>> view = fast_walk_view(flash_walk(trace("The sun rises", mode="causal"), tile=2))
        >>> view.startswith('<div class="attnlab inline"'), 'class="tilegrid"' in view
        (True, True)
    """
    prefix = new_prefix()
    focus = walk.trace.query_index() if focus is None else focus
    return fragment(fast_walk_cards(walk, focus, prefix), prefix=prefix)
