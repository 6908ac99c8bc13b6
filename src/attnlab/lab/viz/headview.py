"""Pictures of a trained model's attention: the head view and the layers x heads grid.

* :func:`head_view` -- the figure style of "Attention Is All You Need" (its figures of layer 5 of
  6) and of bertviz: the tokens in two columns, queries on the left and keys on the right, and a
  line from a query to each key whose opacity is the weight; one colour per head, one layer.
* :func:`head_grid` -- one small heatmap per (layer, head), to see at a glance which heads are
  diagonal, previous-token, "attend to [SEP]" or broad.

Both take plain tensors, so any model's weights can be drawn; matplotlib is imported only when a
picture is drawn, and :func:`attnlab.lab.viz.heatmap.save_figure` writes deterministic SVG.

Example:
    >>> import torch
    >>> weights = torch.softmax(torch.randn(2, 3, 3), dim=-1)     # (H, T, T)
    >>> fig = head_view(weights, ["the", "cat", "sat"], focus=1)
    >>> len(fig.axes)
    1
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from attnlab.lab.trained import count_heads

if TYPE_CHECKING:  # matplotlib is imported lazily: `attnlab` must import fast
    from matplotlib.figure import Figure

__all__ = ["HEAD_COLORS", "head_color", "head_view", "head_grid", "line_alpha"]

# Twelve distinct colours (tab10 plus two), one per head; heads past twelve reuse them in order.
HEAD_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
               "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a")
MIN_ALPHA = 0.02  # lines fainter than this are not drawn: they would be invisible and cost time


def head_color(head: int) -> str:
    """The colour of ``head`` in every head view and report, as ``#rrggbb``.

    Example:
        >>> head_color(0), head_color(12)
        ('#1f77b4', '#1f77b4')
    """
    return HEAD_COLORS[head % len(HEAD_COLORS)]


def line_alpha(weight: float, *, heads_shown: int) -> float:
    """Opacity of one line: the weight, shared out among the heads drawn on top of each other.

    With several heads overlaid, a weight of 1 in every head would paint an opaque block; dividing
    by the square root of the number of heads keeps strong links visible and overlaps readable.

    Example:
        >>> line_alpha(1.0, heads_shown=1), line_alpha(1.0, heads_shown=4)
        (1.0, 0.5)
    """
    return max(0.0, min(1.0, float(weight))) / max(1, heads_shown) ** 0.5


def _check_weights(weights: Tensor, tokens) -> Tensor:
    if not isinstance(weights, Tensor) or weights.ndim != 3 or weights.shape[1] != weights.shape[2]:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a (H, T, T) tensor, got {shape}")
    if len(tokens) != weights.shape[1]:
        raise ValueError(f"tokens must have one label per position ({weights.shape[1]}), got {len(tokens)}")
    return weights.detach().float().cpu()


def head_view(weights: Tensor, tokens, *, heads=None, focus: int | None = None, title: str | None = None,
              hidden=()) -> Figure:
    """The head view of one layer: queries left, keys right, a line per (query, key) per head.

    Args:
        weights: ``(H, T, T)`` attention weights of one layer (rows are queries).
        tokens: ``T`` labels, the same on both sides (self-attention).
        heads: the heads to draw (default all), each in its :func:`head_color`.
        focus: draw only the lines from this query position (the others are drawn faintly when None).
        title: figure title.
        hidden: positions whose lines are not drawn (e.g. ``[CLS]``/``[SEP]``); their labels stay, greyed.

    Returns:
        a matplotlib ``Figure`` with one axes; each line is a ``Line2D`` whose ``gid`` is
        ``"h{head}-q{query}-k{key}"`` and whose alpha is :func:`line_alpha` of the weight.

    Example:
        >>> import torch
        >>> w = torch.tensor([[[0.9, 0.1], [0.5, 0.5]]])            # (1, 2, 2)
        >>> fig = head_view(w, ["a", "b"], focus=0)
        >>> sorted(line.get_gid() for line in fig.axes[0].lines)
        ['h0-q0-k0', 'h0-q0-k1']
    """
    from matplotlib.figure import Figure

    weights = _check_weights(weights, tokens)
    n_heads, n_tokens, _ = weights.shape
    heads = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    if any(not 0 <= h < n_heads for h in heads):
        raise ValueError(f"heads must be in [0, {n_heads}), got {heads}")
    if focus is not None and not 0 <= focus < n_tokens:
        raise ValueError(f"focus must be in [0, {n_tokens}), got {focus}")
    hidden = set(hidden)
    fig = Figure(figsize=(4.2, 0.8 + 0.28 * n_tokens), dpi=110, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    queries = [focus] if focus is not None else range(n_tokens)
    dim = 1.0 if focus is not None else 0.5  # without a focus every query's lines overlap
    for h in heads:
        for i in queries:
            for j in range(n_tokens):
                if i in hidden or j in hidden:
                    continue
                alpha = dim * line_alpha(weights[h, i, j], heads_shown=len(heads))
                if alpha >= MIN_ALPHA:
                    ax.plot([0.0, 1.0], [-i, -j], color=head_color(h), alpha=alpha, linewidth=2.0,
                            solid_capstyle="butt", gid=f"h{h}-q{i}-k{j}")
    for position, token in enumerate(tokens):
        color = "#9a9a9a" if position in hidden else ("#000000" if position == focus else "#333333")
        weight = "bold" if position == focus else "normal"
        ax.text(-0.04, -position, token, ha="right", va="center", fontsize=9, color=color, fontweight=weight)
        ax.text(1.04, -position, token, ha="left", va="center", fontsize=9, color=color)
    ax.set_xlim(-0.9, 1.9)
    ax.set_ylim(-n_tokens + 0.5, 0.5)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# head_grid's layout, in inches: fixed margins keep the title, the panel titles, the row labels
# and the colour bar apart at every grid size (the constrained engine costs seconds on 6 x 12).
_PANEL = {True: 1.9, False: 1.3}  # side of a panel, few heads (<= 4 per layer) or many
_GAP = 0.12  # between panels of a row
_LINE = 0.17  # one line of a panel's title
_CHAR = 0.062  # the most one character of a panel's title takes (8 pt): a panel is as wide as its title
_MARGIN = dict(left=0.85, right=1.0, bottom=0.45, top=0.2, title=0.25, labels=0.35, positions=0.15)  # title: per line


def head_grid(weights: Tensor, tokens, *, title: str | None = None, captions=None, max_labels: int = 24) -> Figure:
    r"""One heatmap per layer and head: ``weights`` ``(L, H, T, T)`` -> a grid, a row per layer.

    Each panel is titled with its head (and its caption); each row is labelled with its layer; one
    colour bar (attention weight, 0 to 1) serves every panel.

    Args:
        weights: per-layer attention weights, rows are queries. A layer with fewer heads than
            ``H`` holds NaN for the heads it lacks (:func:`attnlab.lab.trained.pad_heads`): they get
            no panel, and the layer's row label says how many heads it has.
        tokens: ``T`` labels; drawn on the first column and last row when ``T <= max_labels``.
        title: figure title.
        captions: per layer, one text per head that layer has (its role and score, say), shown
            under the panel's title; ``\n`` starts another line.
        max_labels: longer inputs get no tick labels (they would not be readable at this size).

    Returns:
        a matplotlib ``Figure``: one axes per real head, in order of (layer, head), then the colour bar's.

    Example:
        >>> import torch
        >>> fig = head_grid(torch.softmax(torch.randn(2, 3, 4, 4), dim=-1), list("abcd"))
        >>> len(fig.axes)                                   # 2 layers x 3 heads, and the colour bar
        7
        >>> from attnlab.lab.trained import pad_heads
        >>> ragged = pad_heads([torch.full((2, 4, 4), 0.25), torch.full((1, 4, 4), 0.25)])
        >>> fig = head_grid(ragged, list("abcd"), captions=[["prev", "-"], ["induction"]])
        >>> [ax.get_title() for ax in fig.axes[:-1]]      # 2 + 1 heads: no panel for the missing one
        ['head 0\nprev', 'head 1\n-', 'head 0\ninduction']
    """
    from matplotlib.colors import PowerNorm

    if not isinstance(weights, Tensor) or weights.ndim != 4:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a (L, H, T, T) tensor, got {shape}")
    n_layers, n_heads, n_tokens, _ = weights.shape
    _check_weights(weights[0], tokens)
    weights = weights.detach().float().cpu()
    counts = count_heads(weights)
    captions = _check_captions(captions, counts)
    labelled = n_tokens <= max_labels
    caption_lines = [caption.split("\n") for row in captions for caption in row]
    lines = 1 + max(map(len, caption_lines), default=0)
    widest = max((len(line) for caption in caption_lines for line in caption), default=0)
    title_lines = title.count("\n") + 1 if title else 0
    fig, grid, bar = _grid_layout(n_layers, n_heads, lines, widest, labelled, title_lines)
    # A square-root scale: a head spread over T keys puts ~1/T on each, which a linear scale paints
    # as black as a weight of zero; sharp heads (weights near 1) stay as bright either way.
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    image = None
    for layer in range(n_layers):
        for h in range(counts[layer]):
            ax = fig.add_subplot(grid[layer, h])
            image = ax.imshow(weights[layer, h].numpy(), cmap="viridis", norm=norm, interpolation="nearest",
                              aspect="auto")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title("\n".join([f"head {h}", *captions[layer][h:h + 1]]), fontsize=8, linespacing=1.15)
            if h == 0:  # the row's label; when layers differ, with its head count (why the row is short)
                count = counts[layer]
                heads_here = "" if len(set(counts)) == 1 else f"\n({count} head{'s' if count > 1 else ''})"
                ax.set_ylabel(f"layer {layer}{heads_here}", fontsize=9, fontweight="bold")
            if h == 0 and layer == n_layers - 1:  # the bottom-left panel: tokens, or a few positions
                ticks = range(n_tokens) if labelled else sorted({0, n_tokens // 2, n_tokens - 1})
                names = tokens if labelled else [str(t) for t in ticks]
                ax.set_yticks(ticks, names, fontsize=6)
                ax.set_xticks(ticks, names, fontsize=6, rotation=90 if labelled else 0)
    _label_figure(fig, image, bar, title)
    return fig


def _label_figure(fig: Figure, image, bar: tuple[float, float, float], title: str | None) -> None:
    """The colour bar of ``image`` at ``bar`` (left, bottom, top), the axis names and the title."""
    if image is not None:
        left, bottom, top = bar
        cax = fig.add_axes((left, bottom, 0.12 / fig.get_figwidth(), top - bottom), label="colour bar")
        fig.colorbar(image, cax=cax).set_label("attention weight (square-root scale; each query row sums to 1)",
                                               fontsize=8)
        cax.tick_params(labelsize=7)
    fig.supxlabel("key position (attended to)", fontsize=8, y=0.08 / fig.get_figheight())
    fig.supylabel("query position", fontsize=8, x=0.08 / fig.get_figwidth())
    if title:
        fig.suptitle(title, fontsize=11, y=1 - 0.1 / fig.get_figheight(), va="top")


def _check_captions(captions, counts: tuple[int, ...]) -> list[list[str]]:
    """``captions`` as lists of strings, one per real head of each layer (empty lists when None)."""
    if captions is None:
        return [[] for _ in counts]
    shape = [len(row) for row in captions]
    if shape != list(counts):
        raise ValueError(f"captions must give one text per head of each layer {list(counts)}, got {shape}")
    return [[str(caption) for caption in row] for row in captions]


def _grid_layout(n_layers: int, n_heads: int, lines: int, widest: int, labelled: bool, title_lines: int):
    """The figure, its ``(L, H)`` grid of panels and the colour bar's (left, bottom, top) in figure fractions.

    ``lines``: the most lines of a panel's title; ``widest``: the characters of its longest line.
    """
    from matplotlib.figure import Figure

    panel = max(_PANEL[n_heads <= 4], _CHAR * widest)
    head = _LINE * lines + 0.1  # above each panel: its title
    m = _MARGIN
    ticks = m["labels"] if labelled else m["positions"]  # the bottom-left panel's tick labels
    left, bottom = m["left"] + ticks, m["bottom"] + ticks
    top = m["top"] + m["title"] * title_lines
    width = left + n_heads * panel + (n_heads - 1) * _GAP + m["right"]
    height = bottom + n_layers * (panel + head) + top
    fig = Figure(figsize=(width, height), dpi=110)
    grid = fig.add_gridspec(n_layers, n_heads, left=left / width, right=(width - m["right"]) / width,
                            bottom=bottom / height, top=(height - top - head) / height,
                            wspace=_GAP / panel, hspace=head / panel)
    bar_left = (width - m["right"] + 0.25) / width
    return fig, grid, (bar_left, bottom / height, (height - top - head) / height)
