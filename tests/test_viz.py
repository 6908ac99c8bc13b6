"""Heatmaps (matplotlib figures and SVG text) and the HTML report's content, checked for what is drawn."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
import torch

from attnlab.lab.explain import trace
from attnlab.lab.viz import aggregate_blocks, heatmap, save_figure
from attnlab.lab.viz.html import build_report


def _tick_labels(ax):
    return [t.get_text() for t in ax.get_xticklabels()], [t.get_text() for t in ax.get_yticklabels()]


def _hatched(ax):
    return [p for p in ax.patches if p.get_hatch()]


def _covered_cells(ax):
    """(row, col) cells covered by the hatched rectangles."""
    cells = set()
    for patch in _hatched(ax):
        x0, y0 = patch.get_x() + 0.5, patch.get_y() + 0.5
        cells |= {(round(y0), round(x0) + k) for k in range(round(patch.get_width()))}
    return cells


@pytest.fixture(scope="module")
def causal_trace():
    return trace(mode="multihead", heads=4, causal=True)


def test_one_labelled_tick_per_token_on_both_axes(causal_trace):
    t = causal_trace
    fig = heatmap(t.weights(), rows=t.tokens, cols=t.context_tokens, allowed=t.allowed())
    assert len(fig.axes) == 4 + 1  # a grid of 4 heads and one colour bar
    for ax in fig.axes[:4]:
        assert _tick_labels(ax) == (t.tokens, t.tokens)


def test_cross_attention_is_rectangular():
    t = trace(mode="cross", context="A glass of red wine from the valley")
    fig = heatmap(t.weights(), rows=t.tokens, cols=t.context_tokens)
    xs, ys = _tick_labels(fig.axes[0])
    assert xs == ["A", "glass", "of", "red", "wine", "from", "the", "valley"] and ys == t.tokens
    assert fig.axes[0].images[0].get_array().shape == (len(ys), len(xs))
    assert not _hatched(fig.axes[0])


def test_masked_cells_are_hatched_exactly(causal_trace):
    t = causal_trace
    fig = heatmap(t.weights(), rows=t.tokens, cols=t.tokens, allowed=t.allowed())
    n = len(t.tokens)
    expected = {(i, j) for i in range(n) for j in range(n) if j > i}  # above the diagonal
    for ax in fig.axes[:4]:
        assert _covered_cells(ax) == expected
        assert sum(round(p.get_width()) for p in _hatched(ax)) == len(expected) == n * (n - 1) // 2
        image = ax.images[0].get_array()
        assert image.mask.sum() == len(expected)  # masked cells are not coloured as 0 either


def test_svg_uses_the_hatch_pattern_once_per_masked_run_and_has_every_label(tmp_path):
    t = trace("one two three four five", mode="causal")
    fig = heatmap(t.weights(), rows=t.tokens, cols=t.tokens, allowed=t.allowed(), annotate=False)
    (svg_path,) = save_figure(fig, tmp_path / "w", formats=("svg",))
    svg = svg_path.read_text()
    patterns = re.findall(r'<pattern id="([^"]+)"', svg)
    assert len(patterns) == 1
    uses = svg.count(f"url(#{patterns[0]})")
    assert uses == len(t.tokens) - 1  # rows 0..3 each have one run of masked cells
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    for token in t.tokens:
        assert texts.count(token) == 2  # an x tick and a y tick


def test_svg_is_byte_identical_across_runs(tmp_path):
    t = trace(mode="causal")
    paths = []
    for run in range(2):
        fig = heatmap(t.weights(), rows=t.tokens, cols=t.tokens, allowed=t.allowed(), title="same")
        paths += save_figure(fig, tmp_path / f"run{run}", formats=("svg",))
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_long_inputs_are_drawn_in_blocks_that_keep_rows_summing_to_one():
    n, h = 300, 2
    gen = torch.Generator().manual_seed(0)
    allowed = torch.ones(n, n).tril().bool()
    weights = torch.softmax(torch.randn(h, n, n, generator=gen).masked_fill(~allowed, float("-inf")), dim=-1)
    labels = [f"t{i}" for i in range(n)]
    fig = heatmap(weights, rows=labels, cols=labels, allowed=allowed)
    xs, ys = _tick_labels(fig.axes[0])
    assert len(xs) == len(ys) == 60 and xs[0] == "0\u20134" and xs[-1] == "295\u2013299"
    blocks = aggregate_blocks(weights, rows=labels, cols=labels, allowed=allowed)
    expected = weights.double().reshape(h, 60, 5, 60, 5).sum(dim=4).mean(dim=2)  # independent block mean
    torch.testing.assert_close(blocks.weights.double(), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(blocks.weights.sum(-1), torch.ones(h, 60), atol=1e-5, rtol=0)
    assert torch.equal(blocks.allowed, torch.ones(60, 60).tril().bool())  # diagonal blocks are partly allowed
    assert _covered_cells(fig.axes[0]) == {(i, j) for i in range(60) for j in range(60) if j > i}


class _Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.cells, self.urls = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "rect" and "cell" in attrs.get("class", ""):
            self.cells.append(attrs)
        for name in ("src", "href"):
            if name in attrs:
                self.urls.append(attrs[name])


@pytest.mark.parametrize("mode", ["causal", "multihead", "cross"])
def test_report_cells_carry_the_trace_weights(mode):
    t = trace(mode=mode)
    page = build_report(t)
    parser = _Cells()
    parser.feed(page)
    weights, allowed = t.weights(), t.allowed()
    assert len(parser.cells) == weights.numel()
    for cell in parser.cells:
        h, i, j = int(cell["data-head"]), int(cell["data-row"]), int(cell["data-col"])
        assert float(cell["data-value"]) == pytest.approx(float(weights[h, i, j]), abs=5e-5)
        assert (cell["data-masked"] == "true") == (allowed is not None and not bool(allowed[i, j]))
    assert parser.urls == [] and "http" not in page and "@import" not in page and "url(" not in page.replace(
        "url(#hatch-", "")


def test_report_shows_every_step_with_the_terminal_numbers():
    t = trace(mode="causal")
    page = build_report(t)
    for step in t.steps:
        assert f'data-step="{step.name}"' in page
    it = t.tokens.index("it")
    assert f">{float(t.weights()[0, it, 3]):.4f}<" in page  # 4 decimals, as the terminal prints
    assert ">-inf<" in page  # masked scores


def test_report_of_a_long_input_draws_blocks():
    t = trace(" ".join(f"w{i}" for i in range(300)), mode="causal")
    parser = _Cells()
    parser.feed(build_report(t))
    assert len(parser.cells) == 60 * 60
    expected = t.weights().double().reshape(60, 5, 60, 5).sum(dim=3).mean(dim=1)
    got = torch.zeros(60, 60, dtype=torch.float64)
    for cell in parser.cells:
        got[int(cell["data-row"]), int(cell["data-col"])] = float(cell["data-value"])
    torch.testing.assert_close(got, expected, atol=5e-5, rtol=0)
