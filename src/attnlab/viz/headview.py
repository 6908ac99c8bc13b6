"""Pictures of a trained model's attention: the head view and the layers x heads grid.

* :func:`head_view` -- the figure style of "Attention Is All You Need" (its figures of layer 5 of
  6) and of bertviz: the tokens in two columns, queries on the left and keys on the right, and a
  line from a query to each key whose opacity is the weight; one colour per head, one layer.
* :func:`head_grid` -- one small heatmap per (layer, head), to see at a glance which heads are
  diagonal, previous-token, "attend to [SEP]" or broad.

Both take plain tensors, so any model's weights can be drawn; matplotlib is imported only when a
picture is drawn, and :func:`attnlab.viz.heatmap.save_figure` writes deterministic SVG.

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

from attnlab.trained import count_heads

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


def head_grid(weights: Tensor, tokens, *, title: str | None = None, max_labels: int = 24) -> Figure:
    """One small heatmap per layer and head: ``weights`` ``(L, H, T, T)`` -> an L x H grid.

    Args:
        weights: per-layer attention weights, rows are queries. A layer with fewer heads than
            ``H`` holds NaN for the heads it lacks (:func:`attnlab.trained.pad_heads`); their
            cells stay empty.
        tokens: ``T`` labels; drawn on the first column and last row when ``T <= max_labels``.
        title: figure title.
        max_labels: longer inputs get no tick labels (they would not be readable at this size).

    Example:
        >>> import torch
        >>> fig = head_grid(torch.softmax(torch.randn(2, 3, 4, 4), dim=-1), list("abcd"))
        >>> len(fig.axes)                                   # 2 layers x 3 heads
        6
        >>> from attnlab.trained import pad_heads
        >>> ragged = pad_heads([torch.full((2, 4, 4), 0.25), torch.full((1, 4, 4), 0.25)])
        >>> len(head_grid(ragged, list("abcd")).axes)       # 2 + 1 heads: no panel for the missing one
        3
    """
    from matplotlib.figure import Figure

    if not isinstance(weights, Tensor) or weights.ndim != 4:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a (L, H, T, T) tensor, got {shape}")
    n_layers, n_heads, n_tokens, _ = weights.shape
    _check_weights(weights[0], tokens)
    weights = weights.detach().float().cpu()
    panel = 1.1 if n_tokens <= max_labels else 0.9
    # A fixed layout: the constrained engine costs seconds on a 6 x 12 grid of panels.
    fig = Figure(figsize=(0.9 + panel * n_heads, 0.7 + panel * n_layers), dpi=110)
    fig.subplots_adjust(left=0.9 / (0.9 + panel * n_heads), right=0.99, bottom=0.7 / (0.7 + panel * n_layers),
                        top=0.93, wspace=0.08, hspace=0.12)
    labelled = n_tokens <= max_labels
    counts = count_heads(weights)
    for layer in range(n_layers):
        for h in range(counts[layer]):
            ax = fig.add_subplot(n_layers, n_heads, layer * n_heads + h + 1)
            ax.imshow(weights[layer, h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == min(l for l, count in enumerate(counts) if count > h):  # the column's top panel
                ax.set_title(f"head {h}", fontsize=7)
            if h == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=7)
            if labelled and h == 0 and layer == n_layers - 1:
                ax.set_yticks(range(n_tokens), tokens, fontsize=4)
                ax.set_xticks(range(n_tokens), tokens, fontsize=4, rotation=90)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
