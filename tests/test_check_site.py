"""tools/check_site.py, the check `make docs` runs on the built site, on tiny sites written here:
a broken link, a missing anchor, a console error and a failed request must each be reported, and a
clean site must pass. (The real site needs Sphinx and is checked by `make docs`, not by the suite.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from _cdp import find_browser

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_site", ROOT / "tools" / "check_site.py")
check_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_site)


def _write(site: Path, pages: dict[str, str]) -> Path:
    for name, body in pages.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>t</title></head>"
                        f"<body>{body}</body></html>")
    return site


def test_a_clean_site_has_no_broken_link(tmp_path):
    site = _write(tmp_path, {
        "index.html": '<a href="guide/a.html#part">a</a> <a href="guide/">dir</a> <a href="#top" id="top">top</a>'
                      '<a href="https://example.org/x.html#y">out</a> <a href="mailto:x@y">mail</a>',
        "guide/a.html": '<h2 id="part">part</h2><a href="../index.html">up</a><img src="../pic%20one.png">',
        "guide/index.html": "<p>dir page</p>",
        "pic one.png": "",
    })
    assert check_site.broken_links(site) == []


def test_broken_links_and_anchors_are_reported(tmp_path):
    site = _write(tmp_path, {
        "index.html": '<a href="missing.html">m</a> <a href="a.html#nope">n</a> <a href="a.html#yes">y</a>'
                      '<script src="_static/gone.js"></script> <a href="../outside.html">o</a>',
        "a.html": '<p id="yes">here</p>',
        "_static/template.html": '<a href="{{ pathto(x) }}">a theme template, not a page</a>',
    })
    (tmp_path.parent / "outside.html").write_text("<p>outside</p>")
    assert sorted(check_site.broken_links(site)) == sorted([
        "index.html: missing.html (no such file)",
        "index.html: a.html#nope (no id 'nope' in a.html)",
        "index.html: _static/gone.js (no such file)",
        "index.html: ../outside.html (outside the site)",
    ])


def test_main_fails_on_a_broken_link_and_passes_a_clean_site(tmp_path, capsys):
    good = _write(tmp_path / "good", {"index.html": '<a href="#x" id="x">x</a>'})
    bad = _write(tmp_path / "bad", {"index.html": '<a href="nowhere.html">x</a>'})
    assert check_site.main([str(good), "--no-browser"]) == 0
    assert check_site.main([str(bad), "--no-browser"]) == 1
    assert "nowhere.html (no such file)" in capsys.readouterr().out
    assert check_site.main([str(tmp_path / "empty"), "--no-browser"]) == 2


@pytest.mark.browser
@pytest.mark.skipif(find_browser() is None, reason="no chromium")
def test_console_errors_and_failed_requests_are_reported(tmp_path):
    site = _write(tmp_path, {
        "clean.html": "<p>fine</p><script>console.log('only a log')</script>",
        "noisy.html": "<script>console.error('boom')</script><img src='absent.png'>",
        "throws.html": "<script>undefinedFunction()</script>",
    })
    problems = check_site.browser_problems([site / "clean.html", site / "noisy.html", site / "throws.html"])
    assert not [p for p in problems if "clean.html" in p]
    noisy = [p for p in problems if "noisy.html" in p]
    assert any("console error: boom" in p for p in noisy)
    assert any("request failed" in p and "absent.png" in p for p in noisy)
    assert any("exception" in p and "undefinedFunction" in p for p in problems if "throws.html" in p)


@pytest.mark.browser
@pytest.mark.skipif(find_browser() is None, reason="no chromium")
def test_an_inline_view_left_undrawn_is_reported(tmp_path):
    """A notebook output's view: drawn (its script marked it) passes; empty, or never drawn, is reported."""
    site = _write(tmp_path, {
        "drawn.html": "<div class='attnlab inline' data-attnlab-walk><p>view</p></div>"
                      "<script>document.querySelector('[data-attnlab-walk]').dataset.walkReady = '1'</script>",
        "undrawn.html": "<div class='attnlab inline' data-attnlab-model><p>view</p></div>"
                        "<div class='attnlab inline'></div>",
    })
    problems = check_site.browser_problems([site / "drawn.html", site / "undrawn.html"])
    assert sorted(p.split(": ", 1)[1] for p in problems) == ["inline view 1 model view not drawn",
                                                             "inline view 2 is empty"]
    assert all("undrawn.html" in p for p in problems)
