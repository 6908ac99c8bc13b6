"""The run's pictures: the curves and every head's attention as PNG (:func:`write_figures`), and
:class:`LiveProgress`, the progress bar and curves drawn in a notebook while a model trains.

Example:
    >>> [round(y, 2) for _, y in _averaged([1, 2, 3, 4], [1.0, 3.0, 5.0, 7.0], 2)]
    [2.0, 6.0]
"""

from __future__ import annotations

import html
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnlab._checks import positive_number
from attnlab.lab.trained import head_roles, pad_heads, unpad_heads
from attnlab.lab.viz.headview import head_grid
from attnlab.lab.viz.heatmap import heatmap, save_figure
from attnlab.lab.train.loop import Trainer


def write_figures(trainer: Trainer, analysis: dict, directory: str | os.PathLike) -> list[Path]:
    """The loss/accuracy curves and every layer's and head's attention on a held-out example (PNG).

    Example:
        >>> import tempfile
        >>> from attnlab.lab.train import TrainConfig, analyze
        >>> run = Trainer(TrainConfig(steps=2, batch_size=2, d_model=8, heads=2, eval_sequences=4))
        >>> _ = run.train()
        >>> [p.name for p in write_figures(run, analyze(run), tempfile.mkdtemp())][:2]
        ['curves.png', 'heads.png']
    """
    directory = Path(directory)
    written = save_figure(_curves(trainer), directory / "curves", formats=("png",))
    if "weights" not in analysis:  # a model whose layers return no weights: the curves only
        return written
    labels = trainer.task.labels(analysis["example"])
    weights = analysis["weights"]  # (L, H, T, T)
    name = f"{trainer.config.task}, step {trainer.step}"
    accuracy = 100 * trainer.history["eval_accuracy"][-1]
    grid = head_grid(weights, labels, captions=_head_captions(analysis["heads"]),
                     title=f"{trainer.config.task}: every head on a held-out example\n"
                           f"step {trainer.step}, held-out accuracy {accuracy:.1f} %")
    written += save_figure(grid, directory / "heads", formats=("png",))
    for layer, layer_weights in enumerate(unpad_heads(weights)):  # (H_layer, T, T) each
        figure = heatmap(layer_weights, rows=labels, cols=labels, title=f"{name}: layer {layer}",
                         annotate=False)
        written += save_figure(figure, directory / f"attention-layer{layer}", formats=("png",))
    return written


def _head_captions(heads: dict) -> list[list[str]]:
    """Per layer, per head: its role and score (:func:`attnlab.lab.trained.head_roles`) and its ablation figure."""
    previous = pad_heads([torch.tensor(row) for row in heads["previous_token"]])  # (L, H), NaN: missing
    induction = pad_heads([torch.tensor(row) for row in heads["induction"]])
    captions = []
    for layer, roles in enumerate(head_roles(previous, induction)):
        row = []
        for head, (role, score) in enumerate(roles):
            named = (f"{role} {score:.2f}" if role else
                     f"no role (prev {previous[layer, head]:.2f}, ind {induction[layer, head]:.2f})")
            row.append(f"{named}\naccuracy if ablated: {100 * heads['ablation_accuracy'][layer][head]:.1f} %")
        captions.append(row)
    return captions


def _curves(trainer: Trainer):
    """Training and held-out loss (left) and held-out accuracy (right) against the step."""
    from matplotlib.figure import Figure

    h = trainer.history
    fig = Figure(figsize=(9, 3.4), dpi=110, layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(h["step"], h["train_loss"], lw=0.8, alpha=0.6, label="training batch")
    loss_ax.plot(h["eval_step"], h["eval_loss"], lw=1.6, label="held out")
    loss_ax.set(xlabel="step", ylabel="loss (scored positions)", yscale="log")
    loss_ax.legend(fontsize=8)
    acc_ax.plot(h["eval_step"], [100 * a for a in h["eval_accuracy"]], lw=1.6, color="C1")
    acc_ax.set(xlabel="step", ylabel="held-out accuracy (%)", ylim=(0, 101))
    fig.suptitle(f"attnlab train --task {trainer.config.task}", fontsize=11)
    return fig


_CURVE_POINTS = 200  # the training loss is averaged into at most this many points per frame


_PANEL = dict(width=300, height=150, left=44, right=8, top=18, bottom=26)  # one panel of the SVG, in px


_BATCH, _HELD_OUT = "#3b78c2", "#e07b00"  # the colours of the training-batch and held-out curves


class LiveProgress:
    """An ``on_step`` for :meth:`Trainer.train`: a progress bar and the loss and accuracy curves,
    drawn while the model trains and replaced in place a few times a second.

    In a notebook the frame is one HTML output (a bar and an inline SVG: no widget, no script, no
    stderr), shown by ``IPython.display.display(..., display_id=True)`` and replaced through its
    handle. Elsewhere (no IPython, or no running shell) each frame prints as one line. A frame is
    drawn at the first step, then at most once every ``interval`` seconds, and at the last step.

    Args:
        trainer: the run drawn: its ``config.steps`` and its ``history`` (held-out points included).
        interval: the fewest seconds between two frames.
        clock: the time in seconds, for the interval (default ``time.monotonic``; a test passes its own).

    Example:
        >>> from attnlab.lab.train import TrainConfig
        >>> run = Trainer(TrainConfig(steps=3, batch_size=2, d_model=8, heads=2, eval_sequences=4))
        >>> live = LiveProgress(run, interval=60.0)
        >>> _ = run.train(on_step=live)  # doctest: +ELLIPSIS
        induction: step 1 / 3, ...
        induction: step 3 / 3, ... held-out accuracy ...
        >>> live.frames, "<svg" in live.frame()._repr_html_()
        (2, True)
    """

    def __init__(self, trainer: Trainer, *, interval: float = 0.25, clock: Callable[[], float] = time.monotonic):
        self.trainer = trainer
        self.interval = positive_number("interval", interval)
        self.clock = clock
        self.frames = 0
        self._handle = None
        self._last: float | None = None
        self._batch_accuracy: list[tuple[int, float]] = []

    def __call__(self, step: int, loss: float, accuracy: float, tokens_per_second: float) -> None:
        now = self.clock()
        self._batch_accuracy.append((step, accuracy))
        last = step >= self.trainer.config.steps
        if self._last is None or last or now - self._last >= self.interval:
            self._last = now
            self.draw()

    def draw(self) -> None:
        """Show the current frame now (the first call displays it, later ones replace it)."""
        frame = self.frame()
        self.frames += 1
        if self._handle is not None:
            self._handle.update(frame)
            return
        try:
            from IPython.display import display  # optional: only a notebook draws the frame
        except ImportError:
            print(frame)
            return
        self._handle = display(frame, display_id=True)  # None outside a running IPython: it printed

    def frame(self) -> "_Frame":
        """The frame for the run as it stands: HTML for a notebook, one line of text otherwise."""
        t, c, h = self.trainer, self.trainer.config, self.trainer.history
        status = f"{c.task}: step {t.step} / {c.steps}, {t.seconds:.1f} s"  # training time, as metrics()
        if h["train_loss"]:
            status += f", training loss {h['train_loss'][-1]:.3g}"
        if h["eval_accuracy"]:
            status += f", held-out accuracy {100 * h['eval_accuracy'][-1]:.1f} % (step {h['eval_step'][-1]})"
        width = 2 * _PANEL["width"]
        bar = (f'<div style="width:{width}px;height:8px;background:#e4e4e4;border-radius:4px">'
               f'<div style="width:{100 * min(1.0, t.step / c.steps):.1f}%;height:8px;background:{_BATCH};'
               f'border-radius:4px"></div></div>')
        batch_accuracy = [(s, 100 * a) for s, a in _averaged(*zip(*self._batch_accuracy), _CURVE_POINTS)] \
            if self._batch_accuracy else []
        loss = _svg_panel(0, "loss (log scale)", [(_averaged(h["step"], h["train_loss"], _CURVE_POINTS), _BATCH, 0.7),
                                                  (list(zip(h["eval_step"], h["eval_loss"])), _HELD_OUT, 1.0)],
                          x_max=c.steps, log=True)
        accuracy = _svg_panel(_PANEL["width"], "accuracy (%)", [
            (batch_accuracy, _BATCH, 0.7), ([(s, 100 * a) for s, a in zip(h["eval_step"], h["eval_accuracy"])],
                                            _HELD_OUT, 1.0)], x_max=c.steps, y_range=(0.0, 100.0))
        svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{_PANEL["height"]}" '
               f'font-family="sans-serif" font-size="10">{loss}{accuracy}</svg>')
        legend = (f'<span style="color:{_BATCH}">training batch</span> · '
                  f'<span style="color:{_HELD_OUT}">held out</span>')
        return _Frame(f'<div class="attnlab-train-progress" style="font-family:sans-serif;font-size:12px">'
                      f'<div>{html.escape(status)}</div>{bar}{svg}<div>{legend}</div></div>', status)


class _Frame:
    """One frame of :class:`LiveProgress`: HTML for a notebook, its status line as text."""

    def __init__(self, html_text: str, text: str):
        self.html_text, self.text = html_text, text

    def _repr_html_(self) -> str:
        return self.html_text

    def __repr__(self) -> str:
        return self.text


def _averaged(xs, ys, points: int) -> list[tuple[float, float]]:
    """``(x, y)`` pairs averaged in consecutive groups so that at most ``points`` remain."""
    xs, ys = list(xs), list(ys)
    size = max(1, math.ceil(len(xs) / points))
    return [(sum(xs[i:i + size]) / len(xs[i:i + size]), sum(ys[i:i + size]) / len(ys[i:i + size]))
            for i in range(0, len(xs), size)]


def _svg_panel(x0: float, title: str, series: list, *, x_max: int, log: bool = False,
               y_range: tuple[float, float] | None = None) -> str:
    """One plot of the SVG, ``x0`` px from its left: steps 0 to ``x_max`` across, each series
    ``(points, colour, opacity)`` one polyline; ``log``: a log scale from power of ten to power of ten."""
    p = _PANEL
    if y_range is None:
        values = [y for points, _, _ in series for _, y in points if y > 0] or [0.1, 10.0]
        y_range = (10 ** math.floor(math.log10(min(values))), 10 ** math.ceil(math.log10(max(values))))
    to_axis = (lambda y: math.log10(max(y, y_range[0]))) if log else (lambda y: y)
    lo, hi = to_axis(y_range[0]), to_axis(y_range[1])
    hi = hi if hi > lo else lo + 1
    left, width, height = x0 + p["left"], p["width"] - p["left"] - p["right"], p["height"] - p["top"] - p["bottom"]

    def px(x: float) -> float:
        return left + width * x / max(x_max, 1)

    def py(y: float) -> float:
        return p["top"] + height * (hi - to_axis(y)) / (hi - lo)

    ticks = ([10 ** e for e in range(round(lo), round(hi) + 1)] if log else
             [y_range[0] + (y_range[1] - y_range[0]) * i / 4 for i in range(5)])
    parts = [f'<text x="{left}" y="12">{html.escape(title)}</text>',
             f'<rect x="{left}" y="{p["top"]}" width="{width}" height="{height}" fill="none" stroke="#999"/>']
    parts += [f'<text x="{left - 4}" y="{py(tick) + 3:.1f}" text-anchor="end">{tick:g}</text>' for tick in ticks]
    parts += [f'<text x="{px(step):.1f}" y="{p["height"] - 12}" text-anchor="middle">{step}</text>'
              for step in (0, x_max)]
    parts.append(f'<text x="{left + width / 2:.1f}" y="{p["height"] - 2}" text-anchor="middle">step</text>')
    for points, colour, opacity in series:
        if points:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-opacity="{opacity}"/>')
    return "".join(parts)
