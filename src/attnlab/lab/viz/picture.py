"""A view as a picture (PNG or SVG): the cells a page draws, in the page's own colours, with matplotlib.

Every view keeps the data it renders; for a picture it gives a :class:`Picture`: panels of cells,
each cell's colour computed in Python by the same rule the page uses (:func:`viridis` of the
weight over the largest one for the walk's heatmap, of its square root for the model view, the
block map's three states, the score mod's diverging scale), and the panels' labels. One renderer,
:func:`figure`, draws any picture: so a saved PNG shows what the page shows, cell for cell.

In SVG each panel's cells are one group ``<g id="attnlab-cells-<panel>">`` of one path per cell
(row by row, its fill the cell's colour) up to :data:`VECTOR_CELLS` cells in a picture; a larger
picture's cells are an embedded image per panel (``attnlab-image-<panel>``). Labels are ``<text>``.
Bytes are deterministic (fixed hash salt and ids, no date).

Example:
    >>> import torch, tempfile
    >>> from pathlib import Path
    >>> pic = Picture("toy", (Panel(colours(torch.tensor([[0.0, 1.0]]), "viridis"), ("q",), ("a", "b")),))
    >>> path = save_picture(pic, Path(tempfile.mkdtemp()) / "toy.svg")
    >>> path.read_text().count('id="attnlab-cells-0"')
    1
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from attnlab.lab.viz.page import _VIRIDIS

__all__ = ["Panel", "Picture", "colours", "hex_rgb", "figure", "save_picture", "VECTOR_CELLS", "LABELS"]

VECTOR_CELLS = 20_000  # cells drawn as SVG paths (one each); a larger picture embeds an image per panel
LABELS = 64  # the most labels an axis gets (every one up to this many rows or columns, else every k-th)
MASKED = "#eceff3"  # the walk's hatch background: a masked cell


def hex_rgb(colour: str) -> tuple[int, int, int]:
    """``"#rrggbb"`` as an ``(r, g, b)`` triple of ints.

    Example:
        >>> hex_rgb("#440154")
        (68, 1, 84)
    """
    return tuple(int(colour[k:k + 2], 16) for k in (1, 3, 5))


_ANCHORS = torch.tensor([hex_rgb(c) for c in _VIRIDIS], dtype=torch.float64)  # (9, 3)


def _viridis(t: Tensor) -> Tensor:
    """:func:`attnlab.lab.viz.page.viridis` of every value of ``t`` (..., ) -> uint8 ``(..., 3)``."""
    t = t.double().clamp(0, 1) * (len(_VIRIDIS) - 1)
    i = t.floor().clamp(max=len(_VIRIDIS) - 2).long()
    f = (t - i)[..., None]
    return (_ANCHORS[i] * (1 - f) + _ANCHORS[i + 1] * f).round().to(torch.uint8)


def colours(values: Tensor, scale: str, *, vmax: float | None = None) -> Tensor:
    """Each value's colour as its page draws it, uint8 ``(R, C, 3)`` from ``values`` ``(R, C)``.

    Args:
        scale: ``"viridis"``: viridis of ``value / vmax`` (the walk's heatmap; ``vmax`` default the
            largest value); ``"sqrt"``: the model view's canvas, viridis of the 256-step
            ``round(sqrt(w) * 255) / 255``; ``"range"``: viridis over ``[min, max]`` (a score mod's
            panel; all equal -> the middle); ``"signed"``: white at 0, blue up and red down over
            ``max |value|`` (a score mod's change).

    Example:
        >>> colours(torch.tensor([[0.0, 0.5, 1.0]]), "viridis")[0].tolist()
        [[68, 1, 84], [38, 130, 142], [253, 231, 37]]
    """
    values = values.detach().double().cpu()
    if scale == "viridis":
        top = max(float(values.max()), 1e-12) if vmax is None else vmax
        return _viridis(values / top)
    if scale == "sqrt":
        return _viridis((values.clamp(0, 1).sqrt() * 255).round().clamp(max=255) / 255)
    if scale == "range":
        lo, hi = float(values.min()), float(values.max())
        return _viridis((values - lo) / (hi - lo) if hi > lo else torch.full_like(values, 0.5))
    if scale == "signed":
        t = values / (float(values.abs().max()) or 1.0)
        up, down = t.clamp(min=0), (-t).clamp(min=0)
        rgb = torch.stack([255 - (up * 200).round(), 255 - (t.abs() * 170).round(), 255 - (down * 200).round()], -1)
        return rgb.to(torch.uint8)
    raise ValueError(f"scale must be one of ('viridis', 'sqrt', 'range', 'signed'), got {scale!r}")


@dataclass(frozen=True)
class Panel:
    """One grid of cells: ``colours`` uint8 ``(R, C, 3)``, a label per row and column (or none), a title."""

    colours: Tensor
    rows: tuple[str, ...] = ()
    cols: tuple[str, ...] = ()
    title: str = ""


@dataclass(frozen=True)
class Picture:
    """What a view draws as a picture: its title, panels (``columns`` to a line), a legend of
    ``(label, "#rrggbb")`` and a note under it."""

    title: str
    panels: tuple[Panel, ...]
    columns: int = 0  # 0: up to 3 panels a line
    legend: tuple[tuple[str, str], ...] = ()
    note: str = ""


def figure(picture: Picture):
    """The picture as a matplotlib ``Figure`` (Agg, no pyplot): ``fig.axes[i]`` draws panel ``i``,
    cell ``(r, c)`` centred at data coordinates ``(c, r)`` (row 0 on top).

    Example:
        >>> pic = Picture("t", (Panel(colours(torch.eye(2), "viridis"), ("a", "b"), ("a", "b"), "head 0"),))
        >>> [t.get_text() for t in figure(pic).axes[0].get_xticklabels()]
        ['a', 'b']
    """
    from matplotlib.figure import Figure

    n = len(picture.panels)
    columns = picture.columns or min(n, 3)
    lines = math.ceil(n / columns)
    side = 4.2 if n <= 4 else 2.6 if n <= 16 else 1.6  # inches of a panel's longer side
    extra = 0.5 + 0.25 * math.ceil(len(picture.legend) / 4) + (0.3 if picture.note else 0)
    fig = Figure(figsize=(columns * (side + 1.2), lines * (side + 1.1) + extra), layout="constrained", dpi=100)
    vector = sum(p.colours.shape[0] * p.colours.shape[1] for p in picture.panels) <= VECTOR_CELLS
    for index, panel in enumerate(picture.panels):
        _draw(fig.add_subplot(lines, columns, index + 1), panel, index, vector=vector, small=n > 4)
    fig.suptitle(picture.title, fontsize=11)
    if picture.legend or picture.note:
        _legend(fig, picture)
    return fig


def _draw(ax, panel: Panel, index: int, *, vector: bool, small: bool) -> None:
    """One panel: its cells (paths, or one image), its labels every k-th past :data:`LABELS`, its title."""
    from matplotlib.collections import PolyCollection

    rgb = panel.colours.numpy()
    n_rows, n_cols = rgb.shape[:2]
    if vector:
        corners = [[(c - .5, r - .5), (c + .5, r - .5), (c + .5, r + .5), (c - .5, r + .5)]
                   for r in range(n_rows) for c in range(n_cols)]
        cells = PolyCollection(corners, facecolors=rgb.reshape(-1, 3) / 255, edgecolors="none", linewidths=0,
                               antialiaseds=False)
        cells.set_gid(f"attnlab-cells-{index}")
        ax.add_collection(cells)
    else:
        ax.imshow(rgb, interpolation="nearest", aspect="auto", gid=f"attnlab-image-{index}")
    ax.set_xlim(-0.5, n_cols - 0.5)
    ax.set_ylim(n_rows - 0.5, -0.5)
    ax.set_aspect("equal" if max(n_rows, n_cols) <= 4 * min(n_rows, n_cols) else "auto")
    size = 6 if small else 8 if max(n_rows, n_cols) <= 24 else 6
    for labels, count, setter, rotate in ((panel.rows, n_rows, ax.set_yticks, 0),
                                          (panel.cols, n_cols, ax.set_xticks, 60)):
        step = max(1, math.ceil(count / (LABELS // 4 if small else LABELS))) if labels else 0
        ticks = list(range(0, count, step)) if step else []
        extra = {"rotation": rotate, "ha": "right", "rotation_mode": "anchor"} if rotate else {}
        setter(ticks, [labels[i] for i in ticks], fontsize=size, **extra)
    ax.set_title(panel.title, fontsize=8 if small else 10)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _legend(fig, picture: Picture) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colour, edgecolor="#64748b", label=label) for label, colour in picture.legend]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(handles)), fontsize=8, frameon=False)
    if picture.note:
        fig.text(0.01, 0.005, picture.note, fontsize=7, color="#555555")


FORMATS = ("png", "svg")


def save_picture(picture: Picture, path: str | Path) -> Path:
    """Write ``picture`` to ``path`` as PNG or SVG, by its extension (SVG bytes deterministic)."""
    import matplotlib

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ValueError(f"path must end in .png or .svg for a picture, got {str(path)!r}")
    fig = figure(picture)
    metadata = {"Date": None, "Creator": "attnlab"} if fmt == "svg" else {"Software": "attnlab"}
    with matplotlib.rc_context({"svg.hashsalt": "attnlab", "svg.id": "attnlab", "svg.fonttype": "none"}):
        fig.savefig(path, format=fmt, metadata=metadata)
    return path


def heatmap_picture(weights: Tensor, rows, cols, *, allowed: Tensor | None = None, title: str,
                    head_titles=None, note: str = "") -> Picture:
    """The walk's heatmap card as a picture: a panel per head, viridis of ``w / max`` over every head,
    masked cells in the hatch's grey, long inputs in the card's blocks (:func:`aggregate_blocks`).

    Shapes:
        weights: ``(H, Tq, Tk)``; allowed: ``(Tq, Tk)`` bool or None.

    Example:
        >>> pic = heatmap_picture(torch.tensor([[[1.0, 0.0], [0.5, 0.5]]]), ["a", "b"], ["a", "b"], title="t",
        ...                       allowed=torch.tensor([[True, False], [True, True]]))
        >>> pic.panels[0].colours[0].tolist()
        [[253, 231, 37], [236, 239, 243]]
    """
    from attnlab.lab.viz.heatmap import aggregate_blocks

    blocks = aggregate_blocks(weights.detach().float().cpu(), rows=list(rows), cols=list(cols), allowed=allowed)
    vmax = max(float(blocks.weights.max()), 1e-12)
    heads = blocks.weights.shape[0]
    panels = []
    for h in range(heads):
        rgb = colours(blocks.weights[h], "viridis", vmax=vmax)  # (R, C, 3)
        if blocks.allowed is not None:
            rgb[~blocks.allowed] = torch.tensor(hex_rgb(MASKED), dtype=torch.uint8)
        name = head_titles[h] if head_titles else (f"head {h}" if heads > 1 else "attention weights")
        panels.append(Panel(rgb, blocks.rows, blocks.cols, name))
    legend = [("0", _VIRIDIS[0]), (f"{vmax:.2f}", _VIRIDIS[-1])] + ([("masked", MASKED)] if allowed is not None else [])
    if blocks.size != (1, 1):
        note = (note + " " if note else "") + (f"{len(rows)} x {len(cols)} tokens drawn in blocks of "
                                               f"{blocks.size[0]} x {blocks.size[1]}")
    return Picture(title, tuple(panels), legend=tuple(legend), note=note)


def grid_picture(values: Tensor, heads, rows, *, title: str, note: str = "") -> Picture:
    """The model view's thumbnails as a picture: a line per layer, a panel per head, the page's
    square-root colour scale (:func:`colours` ``"sqrt"``).

    Shapes:
        values: ``(sum(heads), n, n)`` in [0, 1], layer by layer; rows: ``n`` labels.

    Example:
        >>> grid_picture(torch.rand(3, 4, 4), [2, 1], list("abcd"), title="t").panels[2].title
        'layer 1, head 0'
    """
    names = [f"layer {layer}, head {h}" for layer, count in enumerate(heads) for h in range(count)]
    panels, at = [], 0
    for layer, count in enumerate(heads):
        for h in range(max(heads)):
            cells = values[at + h] if h < count else None
            panels.append(Panel(colours(cells, "sqrt") if cells is not None else
                                torch.full((values.shape[1], values.shape[2], 3), 255, dtype=torch.uint8),
                                tuple(rows), tuple(rows), names[at + h] if h < count else ""))
        at += count
    legend = (("0", _VIRIDIS[0]), ("0.25", "#21918c"), ("1", _VIRIDIS[-1]))  # sqrt scale: 0.25 sits mid-way
    return Picture(title, tuple(panels), columns=max(heads), legend=legend,
                   note=(note + " " if note else "") + "Row = query, column = key; square-root colour scale.")


STATES = ("#f1f5f9", "#93c5fd", "#1d4ed8")  # EMPTY, PARTIAL, FULL: maskview.js's STATE
DIFF = {"none": "#f1f5f9", "same": "#94a3b8", "a": "#2563eb", "b": "#ea580c", "ab": "#9333ea"}  # maskview.js's DIFF


def block_picture(states: Tensor, *, diff: bool, title: str, note: str = "") -> Picture:
    """A mask's block map as a picture: each block in the page's colour of its state (``diff``: its
    bits, 1 = allowed in both, 2 = only in a, 4 = only in b).

    Shapes:
        states: ``(nq, nk)`` uint8.

    Example:
        >>> block_picture(torch.tensor([[2, 0], [1, 2]], dtype=torch.uint8), diff=False, title="t").panels[0].colours[1, 0].tolist()
        [147, 197, 253]
    """
    if diff:
        bits = states.long()
        key = torch.where((bits & 2 > 0) & (bits & 4 > 0), 4, torch.where(bits & 2 > 0, 2, torch.where(
            bits & 4 > 0, 3, torch.where(bits & 1 > 0, 1, 0))))
        table, legend = list(DIFF.values()), (("in neither", DIFF["none"]), ("same in both", DIFF["same"]),
                                              ("only in a", DIFF["a"]), ("only in b", DIFF["b"]),
                                              ("both differ", DIFF["ab"]))
    else:
        key, table = states.long(), list(STATES)
        legend = (("empty", STATES[0]), ("partial", STATES[1]), ("full", STATES[2]))
    lut = torch.tensor([hex_rgb(c) for c in table], dtype=torch.uint8)
    nq, nk = states.shape
    panel = Panel(lut[key], tuple(f"q block {i}" for i in range(nq)), tuple(f"k block {j}" for j in range(nk)),
                  "row = query block, column = key block")
    return Picture(title, (panel,), legend=legend, note=note)
