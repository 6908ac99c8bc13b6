"""attnlab.lab.train.LiveProgress: the progress bar and curves a notebook shows while a model trains.

Checked without a kernel: a fake clock decides when frames are drawn, a fake ``IPython.display``
records what a notebook would receive (one display, then updates through its handle), and each
frame parses as XML with the curves it should hold. tests/test_notebooks.py checks the real thing
in an executed notebook.
"""

from __future__ import annotations

import sys
import types
import xml.etree.ElementTree as ET

import pytest

from attnlab.lab.train import LiveProgress, TrainConfig, Trainer


def _run(steps: int = 12, eval_every: int = 4) -> Trainer:
    return Trainer(TrainConfig(steps=steps, batch_size=2, d_model=8, heads=2, eval_sequences=4, eval_every=eval_every))


class _Clock:
    """A clock that :func:`_train` moves ``tick`` seconds forward before each step hook."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        return self.now


class _FakeDisplay:
    """What ``IPython.display`` gives a notebook: ``display(obj, display_id=True)`` returns a handle."""

    def __init__(self):
        self.shown, self.updates = [], []

    def display(self, obj, *, display_id=None):
        assert display_id is True
        self.shown.append(obj)
        return types.SimpleNamespace(update=self.updates.append)


@pytest.fixture
def fake_ipython(monkeypatch):
    fake = _FakeDisplay()
    module = types.ModuleType("IPython.display")
    module.display = fake.display
    monkeypatch.setitem(sys.modules, "IPython.display", module)
    return fake


def _train(run: Trainer, live: LiveProgress, clock: _Clock) -> None:
    def on_step(*args):
        clock.now += clock.tick
        live(*args)

    run.train(on_step=on_step)


def test_one_display_then_updates_in_place_at_most_every_interval(fake_ipython):
    run, clock = _run(steps=20), _Clock(0.1)
    live = LiveProgress(run, interval=0.25, clock=clock)
    _train(run, live, clock)
    # the first step, then every third step (0.3 s >= 0.25 s apart): 4, 7, ..., 19, and the last step
    assert len(fake_ipython.shown) == 1
    assert len(fake_ipython.updates) == live.frames - 1 == len(range(4, 20, 3)) + 1
    assert "step 1 / 20" in repr(fake_ipython.shown[0])
    assert repr(fake_ipython.updates[-1]).startswith("induction: step 20 / 20, ")


def test_the_last_frame_holds_the_whole_run(fake_ipython):
    run, clock = _run(steps=12, eval_every=4), _Clock(0.01)
    live = LiveProgress(run, interval=100.0, clock=clock)
    _train(run, live, clock)
    assert live.frames == 2  # the first step and the last: the interval never passed
    frame = fake_ipython.updates[-1]
    root = ET.fromstring(frame._repr_html_())  # well-formed: one div, the bar, an SVG
    svg = root.find("{http://www.w3.org/2000/svg}svg")
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    held_out = [line for line in lines if line.get("stroke") == "#e07b00"]
    assert len(lines) == 4 and len(held_out) == 2  # loss and accuracy, training batch and held out
    assert [len(line.get("points").split()) for line in held_out] == [3, 3]  # steps 4, 8, 12
    accuracy = 100 * run.history["eval_accuracy"][-1]
    assert f"held-out accuracy {accuracy:.1f} % (step 12)" in repr(frame)
    bar = root.findall("div")[1][0]
    assert bar.get("style").startswith("width:100.0%")


def test_a_long_run_draws_a_bounded_number_of_points(fake_ipython):
    run, clock = _run(steps=450, eval_every=1000), _Clock(0.0)
    live = LiveProgress(run, interval=1.0, clock=clock)
    _train(run, live, clock)
    svg = ET.fromstring(fake_ipython.updates[-1]._repr_html_()).find("{http://www.w3.org/2000/svg}svg")
    counts = [len(line.get("points").split()) for line in svg.iter("{http://www.w3.org/2000/svg}polyline")]
    assert counts == [150, 1, 150, 1]  # 450 steps averaged in threes: at most 200 points a curve


def test_without_ipython_each_frame_prints_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "IPython.display", None)  # import fails as if IPython were absent
    run, clock = _run(steps=3), _Clock(1.0)
    live = LiveProgress(run, interval=0.5, clock=clock)
    _train(run, live, clock)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == ["induction: step 1 / 3", "induction: step 2 / 3",
                                                      "induction: step 3 / 3"]
    assert "held-out accuracy" in lines[-1] and "<" not in "".join(lines)


@pytest.mark.parametrize("interval", [0, -1.0, float("nan")])
def test_a_bad_interval_is_refused_by_name(interval):
    with pytest.raises(ValueError, match="interval"):
        LiveProgress(_run(), interval=interval)


@pytest.mark.browser
def test_the_frame_renders_offline_in_chromium(fake_ipython, tmp_path):
    """The last frame in a real headless chromium: no console error, no request but the page, both
    panels drawn with their curves inside their frames, the bar full."""
    from _cdp import Browser, find_browser, open_page, page_errors, requested_urls

    browser_path = find_browser()
    if browser_path is None:
        pytest.skip("no chromium found (apt-get install -y chromium, or set ATTNLAB_CHROMIUM)")
    run, clock = _run(steps=30, eval_every=10), _Clock(0.1)
    live = LiveProgress(run, clock=clock)
    _train(run, live, clock)
    path = tmp_path / "frame.html"
    path.write_text("<!DOCTYPE html><html><head><meta charset=\"utf-8\"></head><body>"
                    + fake_ipython.updates[-1]._repr_html_() + "</body></html>", encoding="utf-8")
    with Browser(browser_path, timeout=30.0) as browser:
        open_page(browser, path)
        drawn = browser.evaluate("""(() => {
          const svg = document.querySelector('.attnlab-train-progress svg').getBoundingClientRect();
          const inside = [...document.querySelectorAll('polyline')].map(p => {
            const r = p.getBoundingClientRect();
            return r.width > 0 && r.left >= svg.left && r.right <= svg.right + 1 && r.bottom <= svg.bottom; });
          const bar = document.querySelectorAll('.attnlab-train-progress > div')[1];
          return {inside, bar: bar.firstChild.getBoundingClientRect().width / bar.getBoundingClientRect().width};
        })()""")
        events = list(browser.events)
    assert page_errors(events) == []
    assert requested_urls(events) == [path.as_uri()]
    assert drawn == {"inside": [True] * 4, "bar": 1.0}
