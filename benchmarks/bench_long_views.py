"""Views of long inputs: build time, page size, and open/zoom/hover times in a headless chromium.

Run: ``.venv/bin/python benchmarks/bench_long_views.py [--tokens 12000,32000] [--models llama,gpt2]``

For each model and length: a tiny random transformers checkpoint (2 layers x 4 heads, head size 8,
32768 positions, the suite's word-level tokenizer) saved to a temporary directory, a text of that
many words (:func:`long_text`: sentences of 4 to 12 words drawn by one seeded RNG from the
tokenizer's 12 words, checked varied by :func:`check_varied`), ``lens.record(text)`` (one forward on attnlab, queries and keys kept), then
``model_view(lazy)`` (every head's overview, the zoom data within ``zoom_mb``) saved as a page and
opened in chromium (tests/_cdp.py): the time to the first painted frame, a click on the enlarged
head (a zoom recomputed in the page) and a hover over the overview, measured in the page.
Needs a chromium (``ATTNLAB_CHROMIUM`` or on PATH) for the browser columns.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

ZOOM = """(() => { const r = document.querySelector('[data-attnlab-model]'), big = r.querySelector('canvas.mv-big');
  const box = big.getBoundingClientRect(), t0 = performance.now();
  big.dispatchEvent(new MouseEvent('click', {clientX: box.left + box.width * 0.5, clientY: box.top + box.height * 0.7}));
  const zoom = performance.now() - t0, t1 = performance.now();
  big.dispatchEvent(new MouseEvent('mousemove', {clientX: box.left + 10, clientY: box.top + box.height * 0.7}));
  return {zoom, hover: performance.now() - t1}; })()"""


def long_text(n_words: int, words: list[str], *, seed: int = 0) -> str:
    """``n_words`` words in sentences of 4 to 12, each word drawn from ``words`` by one RNG.

    One ``random.Random`` for the whole text: seeding a fresh one per word (as this script once did)
    drew the same word every time, and the figures were measured on "the the the ...".
    """
    rng, out = random.Random(seed), []
    while len(out) < n_words:
        out += [rng.choice(words) for _ in range(rng.randint(4, 12))]
    return " ".join(out[:n_words])


def check_varied(text: str, words: list[str]) -> None:
    """Refuse a text that is not varied: every word of ``words`` used, none over twice its fair share,
    and at least half of the possible word pairs seen (a long text, at least 8 words a word)."""
    seq = text.split()
    counts = Counter(seq)
    pairs = len(set(zip(seq, seq[1:])))
    fair = len(seq) / len(words)
    if (set(counts) != set(words) or max(counts.values()) > 2 * fair
            or (len(seq) >= 8 * len(words) and pairs < len(words) ** 2 // 2)):
        raise ValueError(f"the benchmark text is not varied: {len(counts)} of {len(words)} words, the commonest "
                         f"{counts.most_common(1)} of {len(seq)}, {pairs} distinct word pairs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="12000,32000", help="comma-separated lengths")
    parser.add_argument("--models", default="llama,gpt2", help="comma-separated kinds of tests/_tiny_models.py")
    parser.add_argument("--zoom-mb", type=float, default=None, help="the view's zoom budget (default: the view's)")
    args = parser.parse_args()
    import _tiny_models
    from _cdp import Browser, find_browser, open_page
    from transformers.utils import logging

    from attnlab.lab.lens import open_model
    from attnlab.lab.viz import views

    logging.set_verbosity_error()
    _tiny_models.SIZES["positions"] = 32768
    browser_path = find_browser()
    print("| model | T | record | overview + page | page | heads zoomable | open | zoom | hover |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.models.split(","):
            lens = open_model(_tiny_models.save_tiny(kind, Path(folder) / kind))
            for n_tokens in map(int, args.tokens.split(",")):
                text = long_text(n_tokens, _tiny_models.WORDS)
                check_varied(text, _tiny_models.WORDS)
                started = time.perf_counter()
                lazy = lens.record(text)
                recorded = time.perf_counter()
                options = {} if args.zoom_mb is None else {"zoom_mb": args.zoom_mb}
                view = views.model_view(lazy, **options)
                built = time.perf_counter()
                path = view.save(Path(folder) / f"{kind}-{n_tokens}.html")
                data = json.loads(path.read_text().split('type="application/json">')[1].split("</script>")[0])
                opened, timed = float("nan"), {"zoom": float("nan"), "hover": float("nan")}
                if browser_path:
                    with Browser(browser_path, timeout=60.0) as browser:
                        opened = open_page(browser, path)
                        timed = browser.evaluate(ZOOM)
                print(f"| {kind} | {n_tokens} | {recorded - started:.1f} s | {built - recorded:.1f} s | "
                      f"{path.stat().st_size / 1e6:.1f} MB | {len(data['zoom']['heads'])} / {sum(data['heads'])} | "
                      f"{opened:.2f} s | {timed['zoom']:.0f} ms | {timed['hover']:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
