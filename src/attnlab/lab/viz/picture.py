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
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from attnlab.lab.viz.heatmap import aggregate_blocks

# viridis at 9 anchors: the page's colours (page.viridis, the scripts' tables) and the picture's
VIRIDIS = ("#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#fde725")

__all__ = ["VIRIDIS", "Panel", "Picture", "colours", "hex_rgb", "figure", "origins", "save_picture", "VECTOR_CELLS", "LABELS"]

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


_ANCHORS = torch.tensor([hex_rgb(c) for c in VIRIDIS], dtype=torch.float64)  # (9, 3)


def _viridis(t: Tensor) -> Tensor:
    """:func:`attnlab.lab.viz.page.viridis` of every value of ``t`` (..., ) -> uint8 ``(..., 3)``."""
    t = t.double().clamp(0, 1) * (len(VIRIDIS) - 1)
    i = t.floor().clamp(max=len(VIRIDIS) - 2).long()
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
    """One grid of cells: ``colours`` uint8 ``(R, C, 3)``, a label per row and column (or none), a title.

    Example:
        >>> Panel(colours(torch.eye(3), "viridis"), ("a", "b", "c"), ("a", "b", "c"), "head 0").colours.shape
        torch.Size([3, 3, 3])
    """

    colours: Tensor
    rows: tuple[str, ...] = ()
    cols: tuple[str, ...] = ()
    title: str = ""


@dataclass(frozen=True)
class Picture:
    """What a view draws as a picture: its title, panels (``columns`` to a line), a legend of
    ``(label, "#rrggbb")`` and a note under it.

    Example:
        >>> cells = Panel(colours(torch.rand(2, 2), "range"))
        >>> len(origins(Picture("two heads", (cells, cells), columns=1)))
        2
    """

    title: str
    panels: tuple[Panel, ...]
    columns: int = 0  # 0: up to 3 panels a line
    legend: tuple[tuple[str, str], ...] = ()
    note: str = ""

    def with_text(self, show) -> "Picture":
        """The picture with ``show`` applied to every text it draws (title, note, legend, labels).

        Example:
            >>> Picture("a\\x00", (Panel(torch.zeros(1, 1, 3, dtype=torch.uint8), ("b",)),)).with_text(str.upper).title
            'A\\x00'
        """
        panels = tuple(Panel(p.colours, tuple(map(show, p.rows)), tuple(map(show, p.cols)), show(p.title))
                       for p in self.panels)
        legend = tuple((show(label), colour) for label, colour in self.legend)
        return Picture(show(self.title), panels, self.columns, legend, show(self.note))


def _slots(picture: Picture) -> tuple[int, int, int, float]:
    """The grid every panel sits in: ``(columns, rows a slot, columns a slot, inches a cell)``."""
    n = len(picture.panels)
    rows = max(p.colours.shape[0] for p in picture.panels)
    cols = max(p.colours.shape[1] for p in picture.panels)
    side = 4.2 if n <= 4 else 2.6 if n <= 16 else 1.4  # inches of a panel's longer side
    return picture.columns or min(n, 3), rows, cols, side / max(rows, cols)


def origins(picture: Picture) -> list[tuple[float, float]]:
    """Where each panel's cell ``(0, 0)`` is centred in the figure's one axes: cell ``(r, c)`` of
    panel ``i`` is at data ``(x + c, y + r)`` with ``(x, y) = origins(picture)[i]`` (y grows down).

    Example:
        >>> pic = Picture("t", (Panel(torch.zeros(2, 3, 3, dtype=torch.uint8)),) * 2)
        >>> origins(pic)[0], origins(pic)[1][1]
        ((0.0, 0.0), 0.0)
    """
    columns, rows, cols, inch = _slots(picture)
    gap_x = 0.25 / inch  # a quarter inch between panels, a title's line more above each line of them
    gap_y = gap_x + (0.22 / inch if any(p.title for p in picture.panels) else 0.0)
    return [((i % columns) * (cols + gap_x), (i // columns) * (rows + gap_y)) for i in range(len(picture.panels))]


def figure(picture: Picture):
    """The picture as a matplotlib ``Figure`` (Agg, no pyplot) of one axes, ``fig.axes[0]``: every panel
    in a grid (:func:`origins`), its title above it; the first column's row labels on the left, each
    column's last panel's labels at the bottom (every k-th past :data:`LABELS`).

    Example:
        >>> pic = Picture("t", (Panel(colours(torch.eye(2), "viridis"), ("a", "b"), ("a", "b"), "head 0"),))
        >>> [t.get_text() for t in figure(pic).axes[0].get_xticklabels()]
        ['a', 'b']
    """
    from matplotlib.figure import Figure

    n = len(picture.panels)
    columns, rows, cols, inch = _slots(picture)
    places = origins(picture)
    lines = math.ceil(n / columns)
    width = places[min(n, columns) - 1][0] + cols
    height = places[-1][1] + rows
    size = 8 if max(rows, cols) <= 24 and n <= 4 else 6  # points, of the labels
    char = size * 0.62 / 72  # inches of a label's character
    note = textwrap.fill(picture.note, max(40, int((width * inch + 1.0) / 0.062))) if picture.note else ""
    longest = max((len(t) for p in picture.panels for t in p.rows), default=0)
    left = 0.2 + longest * char
    bottom = 0.2 + max((len(t) for p in picture.panels for t in p.cols), default=0) * char * 0.87 \
        + 0.14 * (note.count("\n") + 1 if note else 0)
    top = 0.45 + (0.3 if picture.legend else 0.0) + (0.22 if picture.panels[0].title else 0.0)
    axes_w, axes_h = width * inch, height * inch  # the cells' inches
    fig = Figure(figsize=(left + axes_w + 0.25, bottom + axes_h + top), dpi=100)
    fig_w, fig_h = fig.get_size_inches()
    ax = fig.add_axes((left / fig_w, bottom / fig_h, axes_w / fig_w, axes_h / fig_h))
    vector = sum(p.colours.shape[0] * p.colours.shape[1] for p in picture.panels) <= VECTOR_CELLS
    for index, (panel, (x, y)) in enumerate(zip(picture.panels, places)):
        _cells(ax, panel, index, x, y, vector=vector)
        if panel.title:
            ax.text(x - 0.5 + panel.colours.shape[1] / 2, y - 0.6, panel.title, ha="center", va="bottom",
                    fontsize=10 if n <= 4 else 7, parse_math=False)
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(height - 0.5, -0.5)
    yticks = [(places[line * columns][1] + r, panel.rows[r]) for line in range(lines)
              for panel in [picture.panels[line * columns]] for r in _every(len(panel.rows), n)]
    bottom = [max(range(c, n, columns)) for c in range(min(n, columns))]  # each column's last panel
    xticks = [(places[i][0] + c, picture.panels[i].cols[c]) for i in bottom for c in _every(len(picture.panels[i].cols), n)]
    # a token is text, never TeX: "$5" or "$x^$" print as written (parse_math=False everywhere)
    ax.set_yticks([t for t, _ in yticks], [t for _, t in yticks], fontsize=size, parse_math=False)
    ax.set_xticks([t for t, _ in xticks], [t for _, t in xticks], fontsize=size, rotation=60, ha="right",
                  rotation_mode="anchor", parse_math=False)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(picture.title, fontsize=11, pad=20 if picture.panels[0].title else 6, parse_math=False)
    if picture.legend:
        from matplotlib.patches import Patch

        handles = [Patch(facecolor=colour, edgecolor="#64748b", label=label) for label, colour in picture.legend]
        fig.legend(handles=handles, loc="upper center", ncols=min(5, len(handles)), fontsize=8, frameon=False)
    if note:
        fig.text(0.5, 0.02 / fig_h, note, ha="center", va="bottom", fontsize=7, color="#555555", parse_math=False)
    return fig


def _every(count: int, panels: int) -> range:
    """Which of ``count`` labels are drawn: all up to :data:`LABELS` (a quarter as many when many panels)."""
    return range(0, count, max(1, math.ceil(count / (LABELS // 4 if panels > 4 else LABELS)))) if count else range(0)


def _cells(ax, panel: Panel, index: int, x: float, y: float, *, vector: bool) -> None:
    """One panel's cells at ``(x, y)``: a path per cell (gid ``attnlab-cells-<index>``) or one image."""
    from matplotlib.collections import PolyCollection

    rgb = panel.colours.numpy()
    n_rows, n_cols = rgb.shape[:2]
    if vector:
        corners = [[(x + c - .5, y + r - .5), (x + c + .5, y + r - .5), (x + c + .5, y + r + .5), (x + c - .5, y + r + .5)]
                   for r in range(n_rows) for c in range(n_cols)]
        cells = PolyCollection(corners, facecolors=rgb.reshape(-1, 3) / 255, edgecolors="none", linewidths=0,
                               antialiaseds=False)
        cells.set_gid(f"attnlab-cells-{index}")
        ax.add_collection(cells)
    else:
        ax.imshow(rgb, interpolation="nearest", extent=(x - .5, x + n_cols - .5, y + n_rows - .5, y - .5),
                  gid=f"attnlab-image-{index}")


FORMATS = ("png", "svg")


def save_picture(picture: Picture, path: str | Path) -> Path:
    """Write ``picture`` to ``path`` as PNG or SVG, by its extension (SVG bytes deterministic).

    Example:
        >>> import tempfile
        >>> pic = Picture("t", (Panel(colours(torch.eye(2), "viridis")),))
        >>> save_picture(pic, Path(tempfile.mkdtemp()) / "t.png").read_bytes()[:4]
        b'\\x89PNG'
    """
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
    legend = [("0", VIRIDIS[0]), (f"{vmax:.2f}", VIRIDIS[-1])] + ([("masked", MASKED)] if allowed is not None else [])
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
    legend = (("0", VIRIDIS[0]), ("0.25", "#21918c"), ("1", VIRIDIS[-1]))  # sqrt scale: 0.25 sits mid-way
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
