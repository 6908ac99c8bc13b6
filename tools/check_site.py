"""Check a built site (``make docs``): internal links resolve, and pages open in chromium cleanly.

Two checks, each a list of problems (empty: passed):

* :func:`broken_links` -- every ``href`` and ``src`` of every page that stays inside the site
  names an existing file, and its ``#anchor`` an ``id`` (or ``name``) of that page;
* :func:`browser_problems` -- each page given is opened in a headless chromium (driven by
  tests/_cdp.py over the DevTools protocol): an uncaught exception, a console error, an error
  log entry, a failed request, or an attnlab inline view (a notebook's output) that is empty or
  whose script did not finish drawing it is a problem.

Usage: ``python tools/check_site.py [SITE] [--no-browser]`` (SITE: docs/_build/html); it prints the
problems and exits 1 if there are any. The pages opened are :func:`pages_to_open`'s.
"""

from __future__ import annotations

import argparse
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
LINK_ATTRIBUTES = {"href", "src"}
SAMPLE_EVERY = 10  # the API pages opened in the browser: one in ten, in name order


class _Page(HTMLParser):
    """The ids and the internal links of one HTML page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value)
            elif name in LINK_ATTRIBUTES and tag != "link" or (tag == "link" and name == "href"):
                self.links.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def _is_external(link: str) -> bool:
    parts = urlsplit(link)
    return bool(parts.scheme or parts.netloc) or link.startswith(("mailto:", "javascript:", "data:"))


def site_pages(site: Path) -> list[Path]:
    """The pages of ``site``: its HTML files, less the theme's templates kept under _static."""
    return sorted(p for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts)


def broken_links(site: Path) -> list[str]:
    """``"page: link (why)"`` for each internal link of ``site``'s pages that does not resolve."""
    site = site.resolve()
    pages = {path: _parse(path) for path in site_pages(site)}
    problems = []
    for path, page in pages.items():
        for link in page.links:
            if _is_external(link):
                continue
            why = _why_broken(site, path, link, pages)
            if why:
                problems.append(f"{path.relative_to(site)}: {link} ({why})")
    return problems


def _why_broken(site: Path, page: Path, link: str, pages: dict[Path, _Page]) -> str | None:
    parts = urlsplit(link)
    target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
    if target.is_dir():
        target = target / "index.html"
    if site not in target.parents and target != site:
        return "outside the site"
    if not target.is_file():
        return "no such file"
    anchor = unquote(parts.fragment)
    if anchor and target.suffix == ".html":
        ids = pages[target].ids if target in pages else _parse(target).ids
        if anchor not in ids:
            return f"no id {anchor!r} in {target.relative_to(site)}"
    return None


def pages_to_open(site: Path) -> list[Path]:
    """The entry page, every guide and notebook page, the API index and the module pages (those with an
    autosummary table), the search and index pages, and one in SAMPLE_EVERY of the per-name API pages."""
    every = [p for p in site_pages(site) if not p.relative_to(site).parts[0].startswith("_")]
    named = [p for p in every if p.parent.name == "generated"]
    modules = [p for p in named if 'class="autosummary' in p.read_text(encoding="utf-8", errors="replace")
               or p.stem == "modules"]
    rest = [p for p in named if p not in modules]
    return [p for p in every if p not in named] + modules + rest[::SAMPLE_EVERY]


# attnlab's inline views on the page (a notebook's outputs): each must take room, and a walk, model or
# mask view must have finished drawing (its script sets walkReady / renderMs on the element of its role).
VIEWS_WORK = """[...document.querySelectorAll('div.attnlab.inline')].flatMap((root, i) => {
  const why = root.getBoundingClientRect().height > 0 ? [] : ['is empty'];
  for (const [role, mark] of [['walk', 'walkReady'], ['model', 'renderMs'], ['mask', 'renderMs']]) {
    const drawn = [root, ...root.querySelectorAll('*')].filter(e => e.hasAttribute('data-attnlab-' + role));
    if (drawn.some(e => !e.dataset[mark])) why.push(role + ' view not drawn');
  }
  return why.map(w => `inline view ${i + 1} ${w}`);
})"""


def browser_problems(pages: list[Path], *, browser_path: str | None = None, timeout: float = 30.0) -> list[str]:
    """``"page: problem"`` for each console error, exception or failed request in the pages opened."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _cdp import Browser, find_browser, open_page, page_errors  # noqa: E402 - the tests' client

    path = browser_path or find_browser()
    if path is None:
        return ["no chromium found (set ATTNLAB_CHROMIUM)"]
    problems = []
    with Browser(path, timeout=timeout) as browser:
        for page in pages:
            open_page(browser, page)
            problems += [f"{page}: {_describe(e)}" for e in page_errors(browser.events)]
            problems += [f"{page}: {why}" for why in browser.evaluate(VIEWS_WORK)]
            problems += [f"{page}: request failed: {e['params'].get('errorText')} ({_url(browser.events, e)})"
                         for e in browser.events if e.get("method") == "Network.loadingFailed"
                         and not e["params"].get("canceled")]
    return problems


def _describe(event: dict) -> str:
    params = event["params"]
    if event["method"] == "Runtime.exceptionThrown":
        details = params["exceptionDetails"]
        return f"exception: {details.get('exception', {}).get('description') or details.get('text')}"
    if event["method"] == "Log.entryAdded":
        return f"log error: {params['entry'].get('text')} {params['entry'].get('url', '')}"
    return "console error: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])


def _url(events: list[dict], failed: dict) -> str:
    request = failed["params"]["requestId"]
    return next((e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"
                 and e["params"]["requestId"] == request), "?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("site", nargs="?", default=str(ROOT / "docs" / "_build" / "html"), type=Path)
    parser.add_argument("--no-browser", action="store_true", help="check the links only")
    args = parser.parse_args(argv)
    args.site = args.site.resolve()
    if not (args.site / "index.html").is_file():
        print(f"check_site: no index.html in {args.site} (run make docs)", file=sys.stderr)
        return 2
    problems = broken_links(args.site)
    opened = [] if args.no_browser else pages_to_open(args.site)
    if opened:
        problems += browser_problems(opened)
    pages = len(site_pages(args.site))
    for problem in problems:
        print(problem)
    print(f"check_site: {pages} pages, links checked; {len(opened)} opened in chromium; {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
