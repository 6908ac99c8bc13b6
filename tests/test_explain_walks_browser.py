"""A fast walk's report in a real headless chromium (tests/_cdp.py): no console errors, no network
request, the tile grid drawn cell by cell as the walk's tiles say, and the head selector switching
the walk's per-head steps with the textbook's. Skips (one line) without a chromium.
"""

from __future__ import annotations

import pytest

from _cdp import Browser, find_browser, open_page, page_errors, requested_urls
from attnlab.lab.cli._fast_walk import grid_rows
from attnlab.lab.explain import trace
from attnlab.lab.viz.html import write_report
from attnlab.lab.walks import flash_walk

pytestmark = pytest.mark.browser

BROWSER = find_browser()

GRID = """(() => {
  const rows = [...document.querySelectorAll('table.tilegrid tbody tr')];
  return rows.map(r => [...r.querySelectorAll('td.t')].map(td => {
    const box = td.getBoundingClientRect();
    const kind = td.classList.contains('skipped') ? '.' : td.classList.contains('masked') ? 'o' : '#';
    return [kind, box.width > 0 && box.height > 0, getComputedStyle(td).backgroundImage !== 'none'
            || getComputedStyle(td).backgroundColor];
  }));
})()"""

WALK_STEPS = """(() => [...new Set([...document.querySelectorAll('.step.per-head[data-step^="tile_"]')]
    .filter(s => !s.hidden).map(s => s.dataset.head))])()"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    t = trace(mode="multihead", heads=2, causal=True)
    walk = flash_walk(t, tile=4, window=3, pad=2)
    return walk, write_report(t, tmp_path_factory.mktemp("walk") / "report.html", walk=walk)


@pytest.fixture(scope="module")
def page(report):
    if BROWSER is None:
        pytest.skip("no chromium found (apt-get install -y chromium, or set ATTNLAB_CHROMIUM)")
    with Browser(BROWSER, timeout=20.0) as browser:
        open_page(browser, report[1])
        yield browser


def test_walk_report_loads_offline_without_errors(page, report):
    assert page_errors(page.events) == []
    assert requested_urls(page.events) == [report[1].as_uri()]


def test_tile_grid_is_drawn_as_the_walk_computed_it(page, report):
    walk, _ = report
    grid = page.evaluate(GRID)
    assert ["".join(kind for kind, _, _ in row) for row in grid] == grid_rows(walk)
    assert all(drawn for row in grid for _, drawn, _ in row)
    colours = {kind: {str(c) for k, _, c in (cell for row in grid for cell in row) if k == kind} for kind in "#."}
    assert not colours["#"] & colours["."]  # computed and skipped cells look different


def test_head_selector_switches_the_walks_steps_too(page, report):
    assert page.evaluate(WALK_STEPS) == ["0"]
    page.evaluate("(() => { const s = document.getElementById('head-select'); s.value = '1';"
                  " s.dispatchEvent(new Event('change')); })()")
    assert page.evaluate(WALK_STEPS) == ["1"]
