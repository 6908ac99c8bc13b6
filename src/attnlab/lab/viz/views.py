"""Views that render where a learner works: ``attnlab.show`` and the model and generation views.

Each function here returns a :class:`View`: a notebook shows it inline (``_repr_html_``: one
``<div>`` with the report's CSS and scripts, no network, ids of its own so several views share a
page), and :meth:`View.save` writes it as a page of its own.

* :func:`show` -- any weights with their tokens: ``(Tq, Tk)`` or ``(H, Tq, Tk)`` of up to
  :data:`WALK_TOKENS` tokens get the walk's cards (head selector, heatmap, where a token attends);
  longer inputs and ``(L, H, T, T)`` get the model view. A trace or a trained model's
  :class:`~attnlab.lab.trained.WordAttention` gets its own view.
* :func:`word_attention_view` -- a trained model's head view of one sentence, opened on its most
  informative head (:meth:`~attnlab.lab.trained.WordAttention.informative_head`).
* :func:`model_view` -- every layer x head as a thumbnail; click one to enlarge it, hover a row of
  the enlarged one (or a token) to read where that query looks. Inputs longer than
  :data:`GRID` tokens are drawn in blocks of consecutive tokens (a cell is the block's total weight
  averaged over its queries, or its largest weight), so 2048 tokens draw as 256 x 256 cells on a
  canvas. Given :class:`~attnlab.lab.viz.recompute.LazyWeights` (any length: no ``T x T`` anywhere),
  a click on the enlarged head zooms into a region at full resolution, recomputed in the page.
* :func:`generation_view` -- for each generated token, where every head of every layer looked
  when the model produced it.

Weights travel as 16-bit fixed point (``round(w * 65535)``, base64): a cell is read back within
1e-5, and a 2048-token head costs 128 KiB.

Example:
    >>> import torch
    >>> view = show(torch.softmax(torch.randn(2, 3, 4, 4), dim=-1), list("abcd"))
    >>> type(view).__name__, "data-attnlab-model" in view._repr_html_()
    ('View', True)
"""

from __future__ import annotations

import base64
import math

import torch
from torch import Tensor

from attnlab.lab.trained import WordAttention, count_heads
from attnlab.lab.viz import html
from attnlab.lab.viz import maskview
from attnlab.lab.viz import picture as picture_
from attnlab.lab.viz.heatmap import block_labels
from attnlab.lab.viz.page import View, asset, escape, fragment, new_prefix, to_json
from attnlab.lab.viz.recompute import REDUCTIONS, LazyWeights, reduce_blocks

__all__ = ["View", "show", "word_attention_view", "model_view", "generation_view", "encode_weights", "GRID", "WALK_TOKENS"]

GRID = 256  # the most cells per axis a head is drawn with; longer inputs are drawn in blocks
OVERVIEW_BYTES = 4 << 20  # every head's overview together; a model of many heads draws fewer cells
ZOOM_TOKENS = 64  # a zoomed region is at least this many tokens a side (one overview cell when larger)
ZOOM_MB = 3.0  # a long view's queries, keys and log-sum-exps for zooming, in MiB (before base64)
WALK_TOKENS = 64  # up to this many tokens, (H, T, T) weights get the walk's cards (SVG cells, labels)


def show(weights, tokens=None, *, context_tokens=None, layer: int | None = None, head: int | None = None,
         row: int | None = None, title: str | None = None, **options) -> View:
    """Show any attention weights with their tokens, inline in a notebook.

    Shapes:
        weights: ``(Tq, Tk)`` or ``(H, Tq, Tk)`` (one layer) or ``(L, H, T, T)`` (a model; a layer
        with fewer heads holds NaN for the heads it lacks, as :func:`attnlab.lab.trained.pad_heads`);
        or an :class:`attnlab.lab.explain.Trace`, or a :class:`attnlab.lab.trained.WordAttention`; a bool
        mask, mask mod or score mod (and ``options``) goes to :func:`attnlab.lab.viz.maskview.show`;
        :class:`~attnlab.lab.viz.recompute.LazyWeights` of any length (``options``: ``reduce``,
        ``zoom_mb``, ``progress``) to :func:`model_view`.

    Args:
        tokens: ``Tq`` labels (default: positions); context_tokens: ``Tk`` labels when the keys are
            another sequence (cross-attention).
        layer, head: the head enlarged first in the model view (default layer 0, head 0), or the
            head view's layer and head (default :meth:`~attnlab.lab.trained.WordAttention.informative_head`:
            the head whose words look at other words most, not at [CLS], [SEP] or themselves).
        row: the query (a token position) whose weights are read out when the view opens: the
            model view's focused row, the walk's or the head view's focus word (default: none, the
            last token, and :meth:`~attnlab.lab.trained.WordAttention.index` of None, e.g. "it").
        title: shown above the view and as the saved page's title.

    Raises:
        ValueError: ``weights`` is empty, of another rank, not square without ``context_tokens``,
            or (one layer) not finite; labels that do not match its sizes.

    Example:
        >>> import torch
        >>> w = torch.softmax(torch.randn(2, 4, 4), dim=-1)                  # (H, T, T)
        >>> "data-attnlab-walk" in show(w, ["the", "cat", "sat", "down"])._repr_html_()
        True
    """
    if isinstance(weights, LazyWeights):
        return model_view(weights, tokens, layer=layer or 0, head=head or 0, row=row, title=title, **options)
    if isinstance(weights, WordAttention):
        if tokens is not None:
            raise ValueError("tokens come with the WordAttention (its .words); pass tokens=None")
        return word_attention_view(weights, layer=layer, head=head, row=row, title=title)
    if row is not None and (maskview.shows(weights) or options or hasattr(weights, "steps")):
        raise ValueError(f"row is for weights, a WordAttention or LazyWeights, not {type(weights).__name__}")
    if maskview.shows(weights) or options:  # a mask (two: their difference) or a score mod; options are theirs
        return maskview.show(weights, tokens, title=title, head=head or 0, **options)
    if hasattr(weights, "steps") and hasattr(weights, "_repr_html_"):  # an explain trace
        title = title or f"attnlab explain: {weights.sentence}"
        return View(weights._repr_html_, title=title, picture=lambda: _weights_picture(html._of_trace(weights), title))
    if not isinstance(weights, Tensor):
        raise TypeError(f"weights must be a torch.Tensor, a Trace or a WordAttention, got {type(weights).__name__}")
    _check_not_empty(weights)
    for name, labels in (("tokens", tokens), ("context_tokens", context_tokens)):
        if labels is not None and not (hasattr(labels, "__len__") and hasattr(labels, "__iter__")):
            raise TypeError(f"{name} must be a list of labels, got {type(labels).__name__}")
    layer, head = layer or 0, head or 0
    if weights.ndim == 4:
        return model_view(weights, tokens, layer=layer, head=head, row=row, title=title)
    rows_labelled = tokens is None or len(tokens) == weights.shape[-2]  # else Weights.of names tokens
    if weights.ndim in (2, 3) and context_tokens is None and weights.shape[-2] != weights.shape[-1] and rows_labelled:
        raise ValueError(f"weights of shape {tuple(weights.shape)} have {weights.shape[-2]} queries and "
                         f"{weights.shape[-1]} keys: give context_tokens, the keys' labels (cross-attention)")
    if weights.ndim in (2, 3) and not bool(torch.isfinite(weights).all()):
        raise ValueError("weights must be finite (a masked weight is 0), got NaN or inf")
    n_tokens = weights.shape[-2] if weights.ndim >= 2 else 0
    tokens = [str(i) for i in range(n_tokens)] if tokens is None else tokens
    view = html.Weights.of(weights, tokens, context_tokens=context_tokens)
    if row is not None and not (isinstance(row, int) and not isinstance(row, bool) and 0 <= row < len(view.tokens)):
        raise ValueError(f"row must be a query position in [0, {len(view.tokens)}), got {row!r}")
    if max(len(view.tokens), len(view.context_tokens)) <= WALK_TOKENS:
        return View(lambda: _titled(title, html.heads_view(view, focus=row)), title=title or "attention weights",
                    picture=lambda: _weights_picture(view, title or "attention weights"))
    if view.mode == "cross":
        raise ValueError(f"cross-attention weights are shown up to {WALK_TOKENS} tokens a side, "
                         f"got {tuple(view.weights.shape[1:])}")
    return model_view(view.weights[None], view.tokens, layer=0, head=head, row=row, title=title)


def word_attention_view(words: WordAttention, *, layer: int | None = None, head: int | None = None, row: int | None = None,
              title: str | None = None) -> View:
    """A trained model's head view, opened on ``layer``/``head`` and the query word ``row``.

    By default it opens on :meth:`~attnlab.lab.trained.WordAttention.informative_head` (the head
    whose words look at other words most: not one parked on [CLS]/[SEP] or on each word itself; the
    best head of ``layer`` when only the layer is given), from the word
    :meth:`~attnlab.lab.trained.WordAttention.index` picks ("it" when present, else the last word).

    Example:
        >>> import torch
        >>> w = torch.tensor([[[[.1, .8, .1], [.1, .1, .8], [.8, .1, .1]],     # head 0: to the next unit
        ...                    [[.1, .1, .8], [.1, .1, .8], [.1, .1, .8]]]])   # head 1: to [SEP]
        >>> page = word_attention_view(WordAttention.from_pieces(w, ["a", "b", "[SEP]"], [0, 1, None]))._repr_html_()
        >>> '"layer":0' in page and 'value="0" checked' in page and '"focus":1' in page
        True
    """
    counts = words.heads_per_layer
    for name, value in (("layer", layer), ("head", head), ("row", row)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if layer is not None and not 0 <= layer < len(counts):
        raise ValueError(f"layer must be in [0, {len(counts)}), got {layer}")
    if layer is None:
        layer = words.informative_head()[0] if head is None else 0
    if head is None:
        head = int(words.word_shares()[layer, :counts[layer]].argmax())
    if not 0 <= head < counts[layer]:
        raise ValueError(f"head must be in [0, {counts[layer]}) for layer {layer}, got {head}")
    focus = words.index(None) if row is None else row
    if not 0 <= focus < len(words.words):
        raise ValueError(f"row must be a word position in [0, {len(words.words)}), got {focus}")
    section = html.TrainedSection(title or "model", words, focus=focus, layer=layer, heads=(head,))

    def picture():  # the head as a heatmap: the page draws the same weights as lines
        return picture_.heatmap_picture(words.weights[layer, head:head + 1], words.words, words.words,
                                        title=title or "head view", head_titles=[f"layer {layer}, head {head}"],
                                        note="The page draws these weights as lines between the words.")

    return View(lambda: html.trained_view(section), title=title or "head view", picture=picture)


def _check_not_empty(weights: Tensor) -> None:
    """A view draws at least one head, query and key: an empty size is refused naming ``weights``."""
    if weights.numel() == 0:
        raise ValueError(f"weights must hold at least one head, query and key, got shape {tuple(weights.shape)}")


def _weights_picture(view: html.Weights, title: str) -> picture_.Picture:
    """The walk's heatmap card of ``view`` as a picture (every head a panel)."""
    return picture_.heatmap_picture(view.weights, view.tokens, view.context_tokens, allowed=view.allowed, title=title)


def decode_weights(text: str, shape) -> Tensor:
    """What :func:`encode_weights` wrote, read back as the page's scripts do (``uint16 / 65535``).

    Example:
        >>> [round(w, 4) for w in decode_weights(encode_weights(torch.tensor([0.25, 1.0])), (2,)).tolist()]
        [0.25, 1.0]
    """
    raw = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.int16).to(torch.int32) & 0xFFFF
    return (raw.double() / 65535).reshape(shape)


def _grid_picture(data: dict, title: str, *, note: str = "") -> picture_.Picture:
    """The model view's thumbnails (``data`` of :func:`_model_data`) as a picture."""
    values = decode_weights(data["data"], (sum(data["heads"]), data["n"], data["n"]))  # (heads, n, n)
    if data["block"] > 1:
        note = (note + " " if note else "") + f"{len(data['tokens'])} tokens in blocks of {data['block']}."
    return picture_.grid_picture(values, data["heads"], data["rows"], title=title, note=note)


def _titled(title: str | None, view: str) -> str:
    """The view with ``title`` as a heading above its cards."""
    return view.replace("</style>", f"</style><h3>{escape(title)}</h3>", 1) if title else view


def encode_weights(weights: Tensor) -> str:
    """Weights in [0, 1] as base64 of little-endian uint16 ``round(w * 65535)`` (what the scripts decode).

    Example:
        >>> encode_weights(torch.tensor([0.0, 1.0]))
        'AAD//w=='
    """
    fixed = (weights.detach().float().clamp(0, 1) * 65535).round().to(torch.int32).cpu()
    return base64.b64encode(fixed.to(torch.int16).numpy().astype("<u2").tobytes()).decode("ascii")


def cells_per_axis(heads: int) -> int:
    """Cells per axis of each head's overview: :data:`GRID`, fewer when ``heads`` overviews of
    16-bit cells would pass :data:`OVERVIEW_BYTES` (at least 64).

    Example:
        >>> cells_per_axis(8), cells_per_axis(72)
        (256, 170)
    """
    return max(64, min(GRID, math.isqrt(OVERVIEW_BYTES // (2 * max(1, heads)))))


def _model_data(weights, tokens, *, reduce: str = "mean", zoom_mb: float = ZOOM_MB, focus=(0, 0),
                progress=None) -> dict:
    """The model view's data: every real head's overview in blocks of at most GRID cells per axis;
    for :class:`LazyWeights`, also the queries and keys the page zooms with."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if isinstance(weights, LazyWeights):
        if tokens is not None:
            raise ValueError("tokens come with the LazyWeights (its .tokens); pass tokens=None")
        return _lazy_data(weights, reduce=reduce, zoom_mb=zoom_mb, focus=focus, progress=progress)
    if not isinstance(weights, Tensor) or weights.ndim != 4 or weights.shape[-1] != weights.shape[-2]:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a (L, H, T, T) tensor or LazyWeights, got {shape}")
    _check_not_empty(weights)
    n_tokens = weights.shape[-1]
    tokens = _labels(tokens, n_tokens)
    weights = weights.detach().float().cpu()
    counts = count_heads(weights)
    block = _block(n_tokens, sum(counts))
    maps = [reduce_blocks(weights[layer, :count], block, reduce) for layer, count in enumerate(counts)]
    return _overview(tokens, counts, block, maps, reduce)


def _labels(tokens, n_tokens: int) -> list[str]:
    tokens = [str(i) for i in range(n_tokens)] if tokens is None else [str(t) for t in tokens]
    if len(tokens) != n_tokens:
        raise ValueError(f"tokens must have one label per position ({n_tokens}), got {len(tokens)}")
    return tokens


def _block(n_tokens: int, heads: int) -> int:
    """Tokens per overview cell: 1 while the input fits the cells, else ``ceil(T / cells)``."""
    cells = cells_per_axis(heads)
    return 1 if n_tokens <= cells else math.ceil(n_tokens / cells)


def overview_block(lazy: LazyWeights) -> int:
    """Tokens per cell of a long input's overview in the model view (its cached block maps use it).

    Example:
        >>> overview_block(LazyWeights.from_qk(torch.randn(2, 1000, 4), torch.randn(2, 1000, 4)))
        4
    """
    return _block(len(lazy.tokens), sum(lazy.heads))


def _overview(tokens: list[str], counts, block: int, maps: list[Tensor], reduce: str) -> dict:
    cells = torch.cat([m.reshape(-1) for m in maps])  # layer by layer, head by head
    return {"tokens": tokens, "heads": list(counts), "n": maps[0].shape[-1], "block": block, "reduce": reduce,
            "rows": list(block_labels(tokens, block)), "data": encode_weights(cells)}


def _lazy_data(lazy: LazyWeights, *, reduce: str, zoom_mb: float, focus, progress) -> dict:
    counts, n_tokens = lazy.heads, len(lazy.tokens)
    block = overview_block(lazy)
    maps = []
    for layer in range(len(counts)):
        maps.append(lazy.block_map(layer, cells=math.ceil(n_tokens / block), reduce=reduce))
        if progress is not None:
            progress(layer + 1, len(counts))
    data = _overview(lazy.tokens, counts, block, maps, reduce)
    data["zoom"] = _zoom_data(lazy, budget=_budget(zoom_mb), focus=focus)
    return data


def _budget(zoom_mb) -> int:
    if isinstance(zoom_mb, bool) or not isinstance(zoom_mb, (int, float)) or not 0 <= zoom_mb < 1e6:
        raise ValueError(f"zoom_mb must be a number of MiB >= 0, got {zoom_mb!r}")
    return int(zoom_mb * (1 << 20))


def _b64(t: Tensor, kind: str) -> str:
    """A tensor's values as base64 little-endian ``kind`` (``<f2``, ``<f4``, ``<i4``), what the script decodes."""
    return base64.b64encode(t.contiguous().numpy().astype(kind).tobytes()).decode("ascii")


def _zoom_data(lazy: LazyWeights, *, budget: int, focus) -> dict:
    """What a page zooms with: per layer its scale, soft-cap and key intervals; per head, within
    ``budget`` bytes (the focused head first), its fp16 queries and fp32 row log-sum-exps; the
    fp16 keys of each key head a kept head reads."""
    n_tokens = len(lazy.tokens)
    intervals, layers, skipped = [], [], {}
    for layer, recorded in enumerate(lazy.layers):
        packed = _b64(recorded.bounds.to(torch.int32).reshape(-1), "<i4")
        if packed not in intervals:
            intervals.append(packed)
        layers.append({"scale": recorded.scale, "softcap": recorded.softcap(), "bounds": intervals.index(packed),
                       "group": recorded.heads // recorded.k.shape[0]})
        if recorded.score_mod is not None and recorded.softcap() is None:
            skipped[layer] = f"its score mod {recorded.score_mod!r} is recomputed in Python only (LazyWeights.tile)"
        elif max(float(recorded.q.abs().max()), float(recorded.k.abs().max())) > 6e4:
            skipped[layer] = "its queries or keys pass fp16's range"
    order = [(layer, head) for layer, count in enumerate(lazy.heads) for head in range(count)]
    order.sort(key=lambda lh: lh != tuple(focus))
    heads, keys, used = {}, {}, 0
    for layer, head in order:
        recorded = lazy.layers[layer]
        if layer in skipped:
            continue
        group = head // layers[layer]["group"]
        cost = n_tokens * (2 * recorded.q.shape[-1] + 4) + (0 if f"{layer}:{group}" in keys else
                                                            2 * n_tokens * recorded.k.shape[-1])
        if used + cost > budget:
            break
        used += cost
        heads[f"{layer}:{head}"] = {"q": _b64(recorded.q[head].half(), "<f2"), "lse": _b64(lazy.lse(layer)[head], "<f4")}
        keys.setdefault(f"{layer}:{group}", _b64(recorded.k[group].half(), "<f2"))
    return {"dim": lazy.layers[0].q.shape[-1], "tokens": ZOOM_TOKENS, "layers": layers, "intervals": intervals,
            "heads": heads, "keys": keys, "budget_mb": round(budget / (1 << 20), 3),
            "skipped": {str(layer): reason for layer, reason in skipped.items()}}


def model_view(weights: Tensor | LazyWeights, tokens=None, *, layer: int = 0, head: int = 0, row: int | None = None,
               title: str | None = None, reduce: str = "mean", zoom_mb: float = ZOOM_MB, progress=None) -> View:
    """Every layer x head of a model as a thumbnail; click one to enlarge it (bertviz's model view).

    A long input is drawn as a block map (a cell per block of tokens: ``reduce="mean"``, the
    block's total weight averaged over its queries, or ``"max"``, its largest weight). Given
    :class:`~attnlab.lab.viz.recompute.LazyWeights`, the page holds no ``T x T`` weights: the
    overview is computed a band of rows at a time, and clicking the enlarged head zooms into that
    region at full resolution, recomputed in the page from the fp16 queries and keys and each
    row's log-sum-exp of the heads that fit ``zoom_mb`` MiB (the enlarged head first).

    Shapes:
        weights: ``(L, H, T, T)``, rows are queries; NaN heads (:func:`attnlab.lab.trained.pad_heads`) are
        left out. Or :class:`~attnlab.lab.viz.recompute.LazyWeights` (its own tokens).

    Args:
        row: the query position whose row is read out when the page opens (its block past
            :data:`GRID` tokens), as a hover would: "Layer 3, head 1: 'it' looks most at 'meal'".
        progress: called as ``progress(layers_done, layers)`` while a LazyWeights overview is computed.

    Example:
        >>> import torch
        >>> page = model_view(torch.softmax(torch.randn(2, 2, 300, 300), dim=-1))._repr_html_()
        >>> page.count('class="mv-thumb'), '"n":150' in page          # 300 tokens in blocks of 2
        (4, True)
        >>> from attnlab.lab.viz.recompute import LazyWeights
        >>> q = torch.randn(2, 2, 1000, 8)                                 # (L, H, T, D)
        >>> page = model_view(LazyWeights.from_qk(q, q, causal=True))._repr_html_()
        >>> '"zoom":' in page and '"block":4' in page
        True
    """
    _check_focus(weights, layer, head)
    data = _model_data(weights, tokens, reduce=reduce, zoom_mb=zoom_mb, focus=(layer, head), progress=progress)
    if row is not None and (isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(data["tokens"])):
        raise ValueError(f"row must be a query position in [0, {len(data['tokens'])}), got {row!r}")
    data.update(layer=layer, head=head, row=None if row is None else row // data["block"])
    title = title or f"{len(data['heads'])} layers x {max(data['heads'])} heads, {len(data['tokens'])} tokens"
    return View(lambda: _model_fragment(data, title, roles=("model",)), title=title,
                picture=lambda: _grid_picture(data, title))


def _check_focus(weights, layer: int, head: int) -> None:
    """``layer`` and ``head`` must name a head of the model (checked before any work)."""
    heads = weights.heads if isinstance(weights, LazyWeights) else \
        count_heads(weights) if isinstance(weights, Tensor) and weights.ndim == 4 and weights.numel() else None
    if heads is None:
        return  # _model_data names what is wrong with weights
    for name, value in (("layer", layer), ("head", head)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if not 0 <= layer < len(heads) or not 0 <= head < heads[layer]:
        raise ValueError(f"layer and head must name a head of the model {list(heads)}, got ({layer}, {head})")


def generation_view(weights: Tensor, tokens, *, prompt_length: int, title: str | None = None) -> View:
    """Where every head looked when each generated token was produced.

    The token at position ``p`` is produced by the query at ``p - 1`` (a decoder predicts the next
    token), so the view shows, for the generated token chosen, row ``p - 1`` of every layer and
    head: one strip per layer, a row per head, a column per earlier token (in blocks past
    :data:`GRID`). The model view of the whole sequence sits under it.

    Shapes:
        weights: ``(L, H, T, T)`` of the prompt and the generated tokens (causal), ``T = len(tokens)``.

    Example:
        >>> import torch
        >>> w = torch.tril(torch.ones(1, 2, 5, 5)); w = w / w.sum(-1, keepdim=True)
        >>> page = generation_view(w, ["a", "b", "c", "d", "e"], prompt_length=3)._repr_html_()
        >>> '"prompt":3' in page and "data-attnlab-generation" in page
        True
    """
    data = _model_data(weights, tokens)
    if not 1 <= prompt_length < len(data["tokens"]):
        raise ValueError(f"prompt_length must be in [1, {len(data['tokens'])}), got {prompt_length}")
    data.update(layer=0, head=0, prompt=prompt_length)
    title = title or f"{len(data['tokens']) - prompt_length} generated tokens"
    return View(lambda: _model_fragment(data, title, roles=("model", "generation")), title=title,
                picture=lambda: _grid_picture(data, title, note=f"Tokens 0-{prompt_length - 1} are the prompt."))


def _zoom_box(data: dict, prefix: str) -> str:
    """The zoom panel of a long view: a canvas for one region at full resolution and its reading."""
    if "zoom" not in data:
        return ""
    zoom = data["zoom"]
    kept = len(zoom["heads"])
    total = sum(data["heads"])
    held = "every head" if kept == total else f"{kept} of {total} heads (zoom_mb={zoom['budget_mb']:g} MiB)"
    return (f'<div class="mv-zoom-box"><h3>Zoom</h3><p class="muted">Click the enlarged head to see that region '
            f"at full resolution: each weight recomputed here as exp(score - the row's log-sum-exp) from fp16 "
            f"queries and keys ({held}), coloured on the overview's scale (0 dark, 1 bright). Hover a cell to read it.</p>"
            f'<canvas class="mv-zoom" id="{prefix}mv-zoom" width="1" height="1"></canvas>'
            f'<p class="summary" id="{prefix}mv-zoom-summary">Nothing zoomed yet.</p></div>')


def _model_fragment(data: dict, title: str, *, roles) -> str:
    prefix = new_prefix()
    layers = len(data["heads"])
    widest = max(data["heads"])
    options = "".join(f'<option value="{layer}">layer {layer}</option>' for layer in range(layers))
    heads = "".join(f'<option value="{h}">head {h}</option>' for h in range(widest))
    grid = [f'<div class="mv-grid" style="grid-template-columns: auto repeat({widest}, 68px)"><span></span>']
    grid += [f'<span class="mv-col">head {h}</span>' for h in range(widest)]
    for layer, count in enumerate(data["heads"]):
        grid.append(f'<span class="mv-label">layer {layer}</span>')
        grid += [f'<canvas class="mv-thumb" data-layer="{layer}" data-head="{h}" width="{data["n"]}" '
                 f'height="{data["n"]}" title="layer {layer}, head {h}"></canvas>' for h in range(count)]
        grid += ["<span></span>"] * (widest - count)
    grid.append("</div>")
    note = ""
    if data["block"] > 1:
        cell = ("block's total weight, averaged over its queries" if data["reduce"] == "mean"
                else "block's largest weight")
        note = (f'<p class="note">{len(data["tokens"])} tokens are drawn in blocks of {data["block"]}: a cell is a '
                f"{cell}. Hover a row of the enlarged head to read it.</p>")
    generation = ""
    if "generation" in roles:
        generation = (
            '<section class="card"><h2>Where each head looked while generating</h2>'
            '<p class="muted">Click a generated token (outlined). Each strip is one layer: a row per head, a column '
            "per earlier token; bright = looked there. The prompt is plain, generated tokens are outlined.</p>"
            f'<p class="summary" id="{prefix}gv-summary"></p>'
            f'<div class="mv-tokens" id="{prefix}gv-tokens"></div>'
            f'<div class="gv-layers" id="{prefix}gv-layers"></div></section>')
    body = (
        f'{generation}<section class="card"><h2>{escape(title)}</h2>'
        '<p class="muted">Every layer and head; click a thumbnail to enlarge it. Row = query, column = key; '
        "square-root colour scale (faint weights stay visible).</p>"
        f'{"".join(grid)}<div class="mv-main"><canvas class="mv-big" id="{prefix}mv-big" width="{data["n"]}" '
        f'height="{data["n"]}"></canvas><div class="mv-side"><div class="controls">'
        f'<div><label for="{prefix}mv-layer">Layer</label><select id="{prefix}mv-layer">{options}</select></div>'
        f'<div><label for="{prefix}mv-head">Head</label><select id="{prefix}mv-head">{heads}</select></div></div>'
        f'<p class="summary" id="{prefix}mv-summary">Hover the enlarged head or a token.</p>'
        f'<div class="mv-tokens" id="{prefix}mv-tokens"></div></div></div>{note}{_zoom_box(data, prefix)}</section>'
    )
    scripts = (f'<script id="{prefix}attnlab-model" type="application/json">{to_json(data)}</script>'
               f"<script>{asset('modelview.js')}</script>")
    return fragment(body, prefix=prefix, roles=roles, scripts=scripts)
