"""The HTML report in a real headless chromium, driven over the DevTools protocol (tests/_cdp.py).

Checks: no console errors or exceptions, no network request other than the file itself, the head
selector switches heads, hovering a word re-targets the "where it attends" panel, and the drawn
cells carry the trace's weights. Skips (one line) without a chromium.
"""

from __future__ import annotations

import pytest

from _cdp import Browser, find_browser
from attnlab.explain import trace
from attnlab.viz.html import write_report

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


@pytest.fixture(scope="module")
def page(report):
    if BROWSER is None:
        pytest.skip("no chromium found (apt-get install -y chromium, or set ATTNLAB_CHROMIUM)")
    _, path = report
    with Browser(BROWSER, timeout=20.0) as browser:
        for domain in ("Runtime", "Log", "Network", "Page"):
            browser.send(f"{domain}.enable")
        browser.events.clear()
        browser.send("Page.navigate", url=path.as_uri())
        browser.wait_for("Page.loadEventFired")
        browser.evaluate("new Promise(r => requestAnimationFrame(() => r(true)))")
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
    errors = [e for e in page.events if e.get("method") == "Runtime.exceptionThrown"
              or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
              or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
    assert errors == []
    requested = [e["params"]["request"]["url"] for e in page.events if e.get("method") == "Network.requestWillBeSent"]
    assert requested == [path.as_uri()]


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
