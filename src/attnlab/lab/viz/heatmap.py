"""Attention heatmaps with matplotlib (Agg, no pyplot state): one panel per head, labels on both axes.

* Rows are queries (the token that attends), columns are keys (the token attended to).
* Masked cells are hatched grey, so "not allowed" never looks like "allowed but 0". One hatched
  rectangle is drawn per run of consecutive masked cells in a row.
* Every head gets its own panel in a grid; all panels share one colour scale and one colour bar.
* Cross-attention is rectangular (Tq rows, Tk columns).
* Inputs longer than :data:`MAX_TOKENS` tokens are shown in blocks (see :func:`aggregate_blocks`).
* SVG output is byte-for-byte deterministic (fixed hash salt, fixed ids, no date).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # matplotlib is imported lazily: `attnlab` must import fast
    from matplotlib.figure import Figure

__all__ = ["MAX_TOKENS", "BLOCK_TARGET", "Blocks", "aggregate_blocks", "masked_runs", "heatmap", "save_figure"]

MAX_TOKENS = 256  # longer inputs are aggregated into blocks
BLOCK_TARGET = 64  # ... so that at most this many blocks remain per axis
CMAP = "viridis"
MASK_FACE, MASK_EDGE, MASK_HATCH = "#ececec", "#9a9a9a", "///"
SVG_SALT = "attnlab"


@dataclass(frozen=True)
class Blocks:
    """Weights ready to draw: per token, or per block of ``size`` consecutive tokens.

    Attributes:
        weights: ``(H, Rq, Rk)`` values to draw.
        allowed: ``(Rq, Rk)`` bool (False = masked) or None.
        rows, cols: one label per drawn row / column.
        size: tokens per block along (queries, keys); ``(1, 1)`` when not aggregated.

    Example:
        >>> b = aggregate_blocks(torch.full((1, 2, 2), 0.5), rows=["a", "b"], cols=["a", "b"])
        >>> b.size
        (1, 1)
    """

    weights: Tensor
    allowed: Tensor | None
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    size: tuple[int, int]


def _block_size(n: int, max_tokens: int, target: int) -> int:
    return 1 if n <= max_tokens else math.ceil(n / target)


def block_labels(labels, size: int) -> tuple[str, ...]:
    """Labels of blocks of ``size`` consecutive tokens: the tokens themselves when ``size`` is 1.

    Example:
        >>> block_labels(list("abcde"), 2)
        ('0–1', '2–3', '4–4')
    """
    if size == 1:
        return tuple(labels)
    return tuple(f"{i}\u2013{min(i + size, len(labels)) - 1}" for i in range(0, len(labels), size))


def aggregate_blocks(weights: Tensor, *, rows, cols, allowed: Tensor | None = None,
                     max_tokens: int = MAX_TOKENS, target: int = BLOCK_TARGET) -> Blocks:
    """Group long inputs into blocks of consecutive tokens so the picture stays readable.

    An axis longer than ``max_tokens`` is cut into blocks of ``ceil(T / target)`` tokens
    (the last block may be shorter), labelled by token positions (``"0–4"``). A cell is the
    total weight a block of queries gives a block of keys, averaged over the block's queries,
    so rows still sum to 1. A block cell is masked only when every cell in it is masked.

    Shapes:
        weights: ``(H, Tq, Tk)`` -> ``Blocks.weights`` ``(H, ceil(Tq/bq), ceil(Tk/bk))``.
        allowed: ``(Tq, Tk)`` bool or None.

    Example:
        >>> w = torch.softmax(torch.randn(1, 300, 300), dim=-1)
        >>> b = aggregate_blocks(w, rows=[str(i) for i in range(300)], cols=[str(i) for i in range(300)])
        >>> b.size, tuple(b.weights.shape), b.rows[0]
        ((5, 5), (1, 60, 60), '0–4')
    """
    if weights.ndim != 3:
        raise ValueError(f"weights must be (H, Tq, Tk); got shape {tuple(weights.shape)}")
    _, tq, tk = weights.shape
    if len(rows) != tq or len(cols) != tk:
        raise ValueError(f"got {len(rows)} row and {len(cols)} column labels for weights {tuple(weights.shape)}")
    bq, bk = _block_size(tq, max_tokens, target), _block_size(tk, max_tokens, target)
    if (bq, bk) == (1, 1):
        return Blocks(weights, allowed, tuple(rows), tuple(cols), (1, 1))
    nq, nk = math.ceil(tq / bq), math.ceil(tk / bk)
    q_index = torch.arange(tq) // bq  # block of each query
    k_index = torch.arange(tk) // bk
    blocked = _block_sum(weights, q_index, k_index, nq, nk)  # (H, nq, nk)
    rows_per_block = torch.bincount(q_index, minlength=nq).to(weights.dtype)  # (nq,)
    blocked = blocked / rows_per_block[None, :, None]
    blocked_allowed = None
    if allowed is not None:
        blocked_allowed = _block_sum(allowed[None].to(weights.dtype), q_index, k_index, nq, nk)[0] > 0
    return Blocks(blocked, blocked_allowed, block_labels(rows, bq), block_labels(cols, bk), (bq, bk))


def _block_sum(t: Tensor, q_index: Tensor, k_index: Tensor, nq: int, nk: int) -> Tensor:
    """Sum ``(H, Tq, Tk)`` over blocks: ``(H, nq, nk)``."""
    by_key = t.new_zeros(t.shape[0], t.shape[1], nk).index_add_(2, k_index, t)  # (H, Tq, nk)
    return t.new_zeros(t.shape[0], nq, nk).index_add_(1, q_index, by_key)  # (H, nq, nk)


def masked_runs(allowed: Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive masked cells, one ``(row, first_col, length)`` per run.

    Example:
        >>> masked_runs(torch.tensor([[True, False, False], [True, True, False]]))
        [(0, 1, 2), (1, 2, 1)]
    """
    runs = []
    for i, row in enumerate(allowed.tolist()):
        j = 0
        while j < len(row):
            if row[j]:
                j += 1
                continue
            start = j
            while j < len(row) and not row[j]:
                j += 1
            runs.append((i, start, j - start))
    return runs


def heatmap(weights: Tensor, *, rows, cols, allowed: Tensor | None = None, title: str | None = None,
            head_titles=None, value_label: str = "attention weight", annotate: bool | None = None,
            max_tokens: int = MAX_TOKENS) -> Figure:
    """Draw attention weights as a grid of heatmaps, one panel per head.

    Args:
        weights: ``(Tq, Tk)`` or ``(H, Tq, Tk)``; rows are queries, columns keys.
        rows: Tq labels (query tokens); cols: Tk labels (key tokens).
        allowed: ``(Tq, Tk)`` bool, False = masked (drawn hatched), or None.
        title: figure title; head_titles: one title per head (default ``"head h"``).
        value_label: colour bar label.
        annotate: print the value in every cell (default: up to 16 columns, 24 rows and 300 cells in all).
        max_tokens: longer inputs are drawn in blocks (see :func:`aggregate_blocks`).

    Returns:
        a matplotlib ``Figure`` (Agg); ``fig.axes[:H]`` are the heads, the last axes the colour bar.

    Example:
        >>> fig = heatmap(torch.tensor([[1.0, 0.0], [0.4, 0.6]]), rows=["a", "b"], cols=["a", "b"],
        ...               allowed=torch.tensor([[True, False], [True, True]]))
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['a', 'b']
    """
    from matplotlib.figure import Figure

    weights = weights.detach().float()
    weights = weights[None] if weights.ndim == 2 else weights  # (H, Tq, Tk)
    blocks = aggregate_blocks(weights, rows=rows, cols=cols, allowed=allowed, max_tokens=max_tokens)
    n_heads, n_rows, n_cols = blocks.weights.shape
    grid_cols = min(n_heads, 2 if n_heads == 4 else 3)
    grid_rows = math.ceil(n_heads / grid_cols)
    cell = min(0.5 if n_heads == 1 else 0.36, max(0.07, 7.0 / max(n_rows, n_cols)))  # inches per cell
    panel_w, panel_h = max(3.0, n_cols * cell) + 1.0, max(2.4, n_rows * cell) + 0.9
    fig = Figure(figsize=(grid_cols * panel_w + 1.0, grid_rows * panel_h + 0.6), layout="constrained", dpi=110)
    vmax = max(float(blocks.weights.max()), 1e-12)
    if annotate is None:  # numbers in cells help on small maps; hundreds of them cost seconds of text layout
        annotate = n_cols <= 16 and n_rows <= 24 and n_heads * n_rows * n_cols <= 300
    axes = [fig.add_subplot(grid_rows, grid_cols, h + 1) for h in range(n_heads)]
    for h, ax in enumerate(axes):
        image = _draw_panel(ax, blocks, h, vmax, annotate)
        ax.set_title(head_titles[h] if head_titles else (f"head {h}" if n_heads > 1 else "attention weights"),
                     fontsize=10)
    bar = fig.colorbar(image, ax=axes, shrink=0.85, pad=0.02)
    bar.set_label(value_label)
    if title:
        fig.suptitle(title, fontsize=11)
    if blocks.size != (1, 1):
        fig.text(0.01, 0.005, f"{len(rows)}x{len(cols)} tokens shown in blocks of {blocks.size[0]}x{blocks.size[1]}",
                 fontsize=8, color="#555555")
    return fig


def _draw_panel(ax, blocks: Blocks, h: int, vmax: float, annotate: bool):
    """One head: coloured cells, hatched masked runs, optional values, labelled axes."""
    import numpy as np
    from matplotlib.patches import Rectangle

    values = blocks.weights[h].numpy()
    masked = np.zeros_like(values, dtype=bool) if blocks.allowed is None else ~blocks.allowed.numpy()
    image = ax.imshow(np.ma.masked_array(values, masked), cmap=CMAP, vmin=0.0, vmax=vmax,
                      aspect="auto", interpolation="nearest")
    for row, start, length in masked_runs(~torch.from_numpy(masked)):
        ax.add_patch(Rectangle((start - 0.5, row - 0.5), length, 1.0, facecolor=MASK_FACE,
                               edgecolor=MASK_EDGE, hatch=MASK_HATCH, linewidth=0.0, gid="masked"))
    if annotate:
        for (i, j), value in np.ndenumerate(values):
            if not masked[i, j]:
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if value > 0.6 * vmax else "white", in_layout=False)
    small = 8 if len(blocks.cols) <= 24 else 6 if len(blocks.cols) <= 64 else 4
    ax.set_xticks(range(len(blocks.cols)), blocks.cols, rotation=60, ha="right", rotation_mode="anchor",
                  fontsize=small)
    ax.set_yticks(range(len(blocks.rows)), blocks.rows, fontsize=small)
    ax.set_xlabel("key (attended to)", fontsize=8)
    ax.set_ylabel("query (attending)", fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return image


def save_figure(fig: Figure, stem: str | Path, formats=("png", "svg")) -> list[Path]:
    """Save ``fig`` as ``stem.<format>`` for each format; SVG bytes are deterministic.

    Example:
        >>> import tempfile
        >>> fig = heatmap(torch.eye(2), rows=["a", "b"], cols=["a", "b"])
        >>> [p.suffix for p in save_figure(fig, Path(tempfile.mkdtemp()) / "w", formats=("svg",))]
        ['.svg']
    """
    import matplotlib

    paths = []
    engine = fig.get_layout_engine()
    for fmt in formats:
        path = Path(f"{stem}.{fmt}")
        metadata = {"Date": None, "Creator": "attnlab"} if fmt == "svg" else {"Software": "attnlab"}
        with matplotlib.rc_context({"svg.hashsalt": SVG_SALT, "svg.id": "attnlab", "svg.fonttype": "none"}):
            fig.savefig(path, format=fmt, metadata=metadata)
        fig.set_layout_engine("none")  # the layout is done: later formats reuse it (saves a pass)
        paths.append(path)
    fig.set_layout_engine(engine)
    return paths
