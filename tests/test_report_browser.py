"""The HTML report in a real headless chromium, driven over the DevTools protocol (tests/_cdp.py).

Checks: no console errors or exceptions, no network request other than the file itself, the head
selector switches heads, hovering a word re-targets the "where it attends" panel, and the drawn
cells carry the trace's weights. Skips (one line) without a chromium.
"""

from __future__ import annotations

import pytest

from _cdp import Browser, find_browser, open_page, page_errors, requested_urls
from attnlab.lab.explain import trace
from attnlab.lab.viz.html import write_report

pytestmark = pytest.mark.browser

BROWSER = find_browser()

VISIBLE_CELLS = """(() => {
  const boxes = [...document.querySelectorAll('.per-head.heatmap-box')].filter(b => !b.hidden);
  const steps = [...document.querySelectorAll('.step.per-head')].filter(s => !s.hidden).map(s => s.dataset.head);
  const cells = [...boxes[0].querySelectorAll('rect.cell')].map(c => {
    const r = c.getBoundingClientRect();
    return [+c.dataset.row, +c.dataset.col, c.dataset.value, c.dataset.masked, r.width > 0 && r.height > 0];
  });
  return {heads: boxes.map(b => b.dataset.head), steps: [...new Set(steps)], cells: cells};
})()"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    t = trace(mode="multihead", heads=4, causal=True)
    return t, write_report(t, tmp_path_factory.mktemp("report") / "report.html")


def _open(path):
    """A headless chromium showing ``path``, recording console, log and network events."""
    if BROWSER is None:
        pytest.skip("no chromium found (apt-get install -y chromium, or set ATTNLAB_CHROMIUM)")
    browser = Browser(BROWSER, timeout=20.0)
    open_page(browser, path)
    return browser


@pytest.fixture(scope="module")
def page(report):
    with _open(report[1]) as browser:
        yield browser


def _check_cells(t, head, cells):
    weights, allowed = t.weights()[head], t.allowed()
    assert len(cells) == weights.numel()
    for row, col, value, masked, drawn in cells:
        assert drawn, f"cell ({row}, {col}) has no size"
        assert float(value) == pytest.approx(float(weights[row, col]), abs=5e-5)
        assert (masked == "true") == (not bool(allowed[row, col]))


def test_page_loads_offline_without_errors(page, report):
    _, path = report
    assert page_errors(page.events) == []
    assert requested_urls(page.events) == [path.as_uri()]


def test_first_head_is_shown_with_the_trace_values(page, report):
    t, _ = report
    shown = page.evaluate(VISIBLE_CELLS)
    assert shown["heads"] == ["0"] and shown["steps"] == ["0"]
    _check_cells(t, 0, shown["cells"])


def test_selector_switches_heads(page, report):
    t, _ = report
    page.evaluate("(() => { const s = document.getElementById('head-select'); s.value = '2';"
                  " s.dispatchEvent(new Event('change')); })()")
    shown = page.evaluate(VISIBLE_CELLS)
    assert shown["heads"] == ["2"] and shown["steps"] == ["2"]
    _check_cells(t, 2, shown["cells"])


def test_hovering_a_word_shows_where_it_attends(page, report):
    t, _ = report
    head = int(page.evaluate("document.getElementById('head-select').value"))
    meal = t.tokens.index("meal")
    page.evaluate(f"document.querySelector('.token.q[data-index=\"{meal}\"]')"
                  ".dispatchEvent(new MouseEvent('mouseenter'))")
    top = t.links(meal, head=head)[0]
    assert page.evaluate("document.getElementById('links-word').textContent") == "meal"
    summary = page.evaluate("document.getElementById('links-summary').textContent")
    assert f"attends most to \u2018{top.key}\u2019 ({top.weight:.4f})" in summary
    highlighted = page.evaluate("[...document.querySelectorAll('.per-head:not([hidden]) rect.cell.hl')]"
                                ".map(c => +c.dataset.row)")
    assert highlighted and set(highlighted) == {meal}


# --------------------------------------------------------------------------- trained-model head view
LINES = """[...document.querySelectorAll('#hv-lines line.hv-line')].map(l => [+l.dataset.layer, +l.dataset.head,
  +l.dataset.query, +l.dataset.key, +l.dataset.weight, +l.getAttribute('stroke-opacity'), l.getAttribute('stroke')])"""


@pytest.fixture(scope="module")
def trained_report(tmp_path_factory):
    import torch

    from attnlab.lab.trained import WordAttention
    from attnlab.lab.viz.headview import head_color
    from attnlab.lab.viz.html import TrainedSection

    pieces = ["[CLS]", "the", "chef", "made", "a", "meal", "and", "it", "was", "good", "[SEP]"]
    word_ids = [None, 0, 1, 2, 3, 4, 5, 6, 7, 8, None]
    gen = torch.Generator().manual_seed(5)
    weights = torch.softmax(4 * torch.randn(3, 4, 11, 11, generator=gen), dim=-1)  # (L, H, T, T)
    view = WordAttention.from_pieces(weights, pieces, word_ids)
    section = TrainedSection("toy-model", view, focus=view.index("it"), layer=1, heads=(0, 2), hide_special=True)
    path = write_report(trace(), tmp_path_factory.mktemp("trained") / "report.html", trained=section)
    return section, path, head_color


@pytest.fixture(scope="module")
def trained_page(trained_report):
    with _open(trained_report[1]) as browser:
        yield browser


def _check_lines(section, head_color, lines, *, layer, heads, query):
    view = section.view
    expected = {(h, k) for h in heads for k in range(len(view.words))
                if not view.special[k] and float(view.weights[layer, h, query, k]) / len(heads) ** 0.5 >= 0.02}
    assert {(h, k) for _, h, _, k, _, _, _ in lines} == expected
    for line_layer, h, q, k, weight, opacity, stroke in lines:
        assert (line_layer, q) == (layer, query)
        assert weight == pytest.approx(float(view.weights[layer, h, q, k]), abs=5e-5)
        assert opacity == pytest.approx(weight / len(heads) ** 0.5, abs=1e-3)
        assert stroke == head_color(h)


def test_trained_section_loads_offline_without_errors(trained_page, trained_report):
    _, path, _ = trained_report
    assert page_errors(trained_page.events) == []
    assert requested_urls(trained_page.events) == [path.as_uri()]


def test_head_view_draws_the_selected_layer_and_heads(trained_page, trained_report):
    section, _, head_color = trained_report
    _check_lines(section, head_color, trained_page.evaluate(LINES), layer=1, heads=[0, 2], query=section.focus)


def test_switching_layer_and_heads_redraws_the_right_values(trained_page, trained_report):
    section, _, head_color = trained_report
    trained_page.evaluate("(() => { const s = document.getElementById('hv-layer'); s.value = '2';"
                          " s.dispatchEvent(new Event('change')); })()")
    _check_lines(section, head_color, trained_page.evaluate(LINES), layer=2, heads=[0, 2], query=section.focus)
    trained_page.evaluate("(() => { const c = document.querySelector('input.hv-head[value=\"3\"]'); c.checked = true;"
                          " c.dispatchEvent(new Event('change')); })()")
    _check_lines(section, head_color, trained_page.evaluate(LINES), layer=2, heads=[0, 2, 3], query=section.focus)


def test_hovering_a_word_shows_its_lines(trained_page, trained_report):
    section, _, head_color = trained_report
    layer = int(trained_page.evaluate("document.getElementById('hv-layer').value"))
    heads = trained_page.evaluate("[...document.querySelectorAll('input.hv-head:checked')].map(c => +c.value)")
    meal = section.view.index("meal")
    trained_page.evaluate(f"document.querySelector('.hv-word.q[data-index=\"{meal}\"]')"
                          ".dispatchEvent(new MouseEvent('mouseenter'))")
    _check_lines(section, head_color, trained_page.evaluate(LINES), layer=layer, heads=heads, query=meal)
    assert "\u2018meal\u2019 is linked most strongly to" in trained_page.evaluate(
        "document.getElementById('hv-best').textContent")


@pytest.fixture(scope="module")
def ragged_page(tmp_path_factory):
    """A head view of a model with 2 heads in layer 0 and 1 in layer 1 (NaN pads the missing head)."""
    import torch

    from attnlab.lab.trained import WordAttention
    from attnlab.lab.viz.html import TrainedSection

    pieces = ["the", "chef", "made", "a", "meal"]
    weights = torch.softmax(torch.randn(2, 2, 5, 5, generator=torch.Generator().manual_seed(1)), dim=-1)
    weights[1, 1] = float("nan")  # (L, H, T, T): layer 1 has one head
    view = WordAttention.from_pieces(weights, pieces, list(range(5)))
    section = TrainedSection("ragged", view, focus=1, layer=0, heads=(0, 1), hide_special=False)
    path = write_report(trace(), tmp_path_factory.mktemp("ragged") / "report.html", trained=section)
    with _open(path) as browser:
        yield browser


SHOWN_TOGGLES = "[...document.querySelectorAll('input.hv-head')].filter(c => !c.parentNode.hidden).map(c => +c.value)"


def test_a_layer_with_fewer_heads_hides_the_toggles_it_lacks(ragged_page):
    assert ragged_page.evaluate(SHOWN_TOGGLES) == [0, 1]
    ragged_page.evaluate("(() => { const s = document.getElementById('hv-layer'); s.value = '1';"
                         " s.dispatchEvent(new Event('change')); })()")
    assert ragged_page.evaluate(SHOWN_TOGGLES) == [0]
    assert {line[1] for line in ragged_page.evaluate(LINES)} == {0}  # only the head that exists is drawn
    ragged_page.evaluate("(() => { const s = document.getElementById('hv-layer'); s.value = '0';"
                         " s.dispatchEvent(new Event('change')); })()")
    assert ragged_page.evaluate(SHOWN_TOGGLES) == [0, 1]
