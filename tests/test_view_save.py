"""Every view saves by its extension: the page as HTML, a picture of what the page shows as PNG or SVG.

The picture is checked against independent references: the page's own HTML (the walk's SVG cell
fills, the score mod's table cells), the page's script (the mask map's state colours read from
maskview.js), the weights themselves (each SVG cell's fill read back through the page's colour
map), and, where chromium is installed, the page as the browser draws it: same grid, same labels,
each cell's colour sampled at its centre in a screenshot and in the PNG.
"""

from __future__ import annotations

import base64
import io
import re
import xml.etree.ElementTree as ET

import pytest
import torch

import attnlab
from attnlab import masks, scores
from attnlab.lab.explain import trace
from attnlab.lab.viz import maskview, views
from attnlab.lab.viz.page import View, asset, viridis
from attnlab.lab.viz.picture import figure, origins
from attnlab.lab.viz.recompute import LazyWeights

SVG = "{http://www.w3.org/2000/svg}"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENS = ["the", "cat", "sat", "down", "here"]


def _weights(heads=2, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(heads, n, n, generator=gen) * 2, dim=-1)  # (H, T, T)


def _q(layers, heads, n, seed=1):
    return torch.randn(layers, heads, n, 8, generator=torch.Generator().manual_seed(seed))  # (L, H, T, D)


KINDS = {  # every View constructor of attnlab.lab.viz, small
    "show weights (walk)": lambda: attnlab.show(_weights(), TOKENS),
    "show 2-D weights": lambda: attnlab.show(_weights(1)[0], TOKENS),
    "show cross-attention": lambda: attnlab.show(torch.softmax(torch.randn(2, 3), -1), ["a", "b"],
                                                 context_tokens=["x", "y", "z"]),
    "show a trace": lambda: attnlab.show(trace("The sun rises")),
    "word attention (head view)": lambda: views.word_attention_view(
        attnlab.lab.trained.WordAttention.from_pieces(_weights(2, 3)[None], ["a", "b", "[SEP]"], [0, 1, None])),
    "model view": lambda: views.model_view(torch.softmax(torch.randn(2, 2, 6, 6), -1)),
    "model view, long (blocks)": lambda: views.model_view(torch.softmax(torch.randn(1, 1, 300, 300), -1)),
    "model view, LazyWeights": lambda: views.model_view(LazyWeights.from_qk(_q(1, 1, 300), _q(1, 1, 300, 2),
                                                                            causal=True)),
    "generation view": lambda: views.generation_view(torch.tril(torch.ones(1, 2, 5, 5)) / torch.arange(1, 6)[:, None],
                                                     TOKENS, prompt_length=3),
    "mask view": lambda: attnlab.show(masks.causal_mod(64, 64), size=(64, 64), block=16),
    "mask view of a tensor": lambda: maskview.mask_view(torch.rand(20, 20) > 0.5, block=4),
    "mask difference": lambda: attnlab.show(masks.causal_mod(8, 8), masks.sliding_window_mod(8, 8, 2), size=(8, 8),
                                            block=2),
    "score mod": lambda: attnlab.show(scores.alibi(4), head=2, size=(4, 5)),
}


def _svg_cells(svg_text: str) -> list[list[str]]:
    """Each vector panel's cell fills, ``#rrggbb``, row by row."""
    root = ET.fromstring(svg_text)
    groups = sorted((g for g in root.iter(f"{SVG}g") if (g.get("id") or "").startswith("attnlab-cells-")),
                    key=lambda g: int(g.get("id").rsplit("-", 1)[1]))
    return [[re.search(r"fill: (#[0-9a-f]{6})", p.get("style")).group(1) for p in g.iter(f"{SVG}path")]
            for g in groups]


def _svg_texts(svg_text: str) -> list[str]:
    return [t.text for t in ET.fromstring(svg_text).iter(f"{SVG}text")]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_view_saves_a_valid_png_svg_and_page(kind, tmp_path):
    view = KINDS[kind]()
    png, svg, page = (view.save(tmp_path / f"v.{ext}") for ext in ("png", "svg", "html"))
    assert png.read_bytes()[:8] == PNG_MAGIC
    root = ET.fromstring(svg.read_text(encoding="utf-8"))  # parses as XML
    assert root.tag == f"{SVG}svg"
    assert view.title in _svg_texts(svg.read_text(encoding="utf-8"))
    picture = view.picture()
    cells = _svg_cells(svg.read_text(encoding="utf-8"))
    images = [e for e in root.iter(f"{SVG}image")]
    expected = [p.colours.shape[0] * p.colours.shape[1] for p in picture.panels]
    if cells:  # small pictures: one path per cell, in each panel
        assert [len(c) for c in cells] == expected
    else:  # large ones: an image per panel
        assert len(images) == len(picture.panels)
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert png.read_bytes() != page.read_bytes()[:len(png.read_bytes())]


def test_the_html_suffixes_and_upper_case_are_accepted(tmp_path):
    view = KINDS["show weights (walk)"]()
    assert view.save(tmp_path / "a.htm").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert view.save(tmp_path / "a.PNG").read_bytes()[:8] == PNG_MAGIC
    assert ET.fromstring(view.save(str(tmp_path / "a.Svg")).read_text(encoding="utf-8")).tag == f"{SVG}svg"


@pytest.mark.parametrize("name", ["x.txt", "x", "x.pdf", "x.png.bak", ".png", "x.jpg"])
def test_other_extensions_are_refused_naming_the_path_and_writing_nothing(name, tmp_path):
    view = KINDS["mask difference"]()
    with pytest.raises(ValueError, match=r"\.html, \.htm, \.png, \.svg") as error:
        view.save(tmp_path / name)
    assert str(tmp_path / name) in str(error.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ext", ["html", "png", "svg"])
def test_a_missing_folder_is_a_clear_error(ext, tmp_path):
    target = tmp_path / "nope" / f"v.{ext}"
    with pytest.raises(FileNotFoundError, match="nope"):
        KINDS["show weights (walk)"]().save(target)
    assert not (tmp_path / "nope").exists()


def test_a_view_without_a_picture_says_to_save_html(tmp_path):
    view = View(lambda: "<p>hi</p>", title="toy")
    with pytest.raises(ValueError, match="no picture.*html"):
        view.save(tmp_path / "toy.png")
    assert list(tmp_path.iterdir()) == []
    assert view.save(tmp_path / "toy.html").exists()


_TABLE = [(i / 2000, [int(viridis(i / 2000)[k:k + 2], 16) for k in (1, 3, 5)]) for i in range(2001)]


def _read_back(fill: str, vmax: float) -> float:
    """The value whose page colour (viridis of value / vmax) is nearest ``fill``."""
    target = [int(fill[k:k + 2], 16) for k in (1, 3, 5)]
    best = min(_TABLE, key=lambda entry: sum((a - b) ** 2 for a, b in zip(entry[1], target)))
    return best[0] * vmax


def test_the_svg_cells_are_the_weights_through_the_pages_colour_map(tmp_path):
    weights = _weights(2, 4)
    svg = attnlab.show(weights, TOKENS[:4]).save(tmp_path / "w.svg").read_text(encoding="utf-8")
    vmax = float(weights.max())
    cells = _svg_cells(svg)
    got = torch.tensor([[_read_back(f, vmax) for f in head] for head in cells], dtype=torch.float64)
    assert torch.allclose(got, weights.reshape(2, -1).double(), atol=0.01 * vmax)
    texts = _svg_texts(svg)
    assert all(texts.count(t) == 3 for t in TOKENS[:4])  # the rows once on the left, the columns under each head
    assert "head 0" in texts and "head 1" in texts


def test_the_walks_picture_has_the_pages_cell_colours_and_masked_cells(tmp_path):
    trace_ = trace("The cat sat", causal=True)
    view = attnlab.show(trace_)
    page = view.save(tmp_path / "t.html").read_text(encoding="utf-8")
    page_fills = re.findall(r'<rect class="cell[^"]*" data-head="(\d+)"[^>]*fill="([^"]+)"', page)
    cells = _svg_cells(view.save(tmp_path / "t.svg").read_text(encoding="utf-8"))
    for head, panel in enumerate(cells):
        theirs = [f if f.startswith("#") else "#eceff3" for h, f in page_fills if int(h) == head]  # hatch: its grey
        assert panel == theirs
    assert "#eceff3" in cells[0]  # the causal mask's hidden future


def test_the_score_mods_picture_has_the_pages_table_colours(tmp_path):
    view = attnlab.show(scores.softcap(1.5), size=(3, 4))
    page = view.save(tmp_path / "s.html").read_text(encoding="utf-8")
    tables = re.findall(r'<table class="sm-grid".*?</table>', page)
    cells = _svg_cells(view.save(tmp_path / "s.svg").read_text(encoding="utf-8"))
    assert len(tables) == len(cells) == 6
    for table, panel in zip(tables, cells):
        theirs = re.findall(r'background:([^"]+)"', table)
        as_hex = [c if c.startswith("#") else "#{:02x}{:02x}{:02x}".format(*map(int, re.findall(r"\d+", c)))
                  for c in theirs]
        assert panel == as_hex


def _script_colours(name: str) -> list[list[int]]:
    """The state colours maskview.js paints the block map with (its ``STATE`` array)."""
    line = re.search(rf"var {name} = (\[\[.*?\]\]);", asset("maskview.js")).group(1)
    return [[int(x) for x in re.findall(r"\d+", triple)] for triple in re.findall(r"\[[\d, ]+\]", line[1:-1])]


def test_the_mask_pictures_blocks_are_the_maps_states_in_the_scripts_colours(tmp_path):
    bmap = maskview.block_map(masks.sliding_window_mod(40, 40, 17), size=(40, 40), block=4)
    cells = _svg_cells(maskview.map_view(bmap).save(tmp_path / "m.svg").read_text(encoding="utf-8"))
    state = _script_colours("STATE")
    expected = ["#{:02x}{:02x}{:02x}".format(*state[s]) for s in bmap.states.reshape(-1).tolist()]
    assert cells == [expected]
    assert len(set(expected)) == 3  # empty, partial and full blocks all present


def test_the_model_pictures_cells_are_the_pages_square_root_scale(tmp_path):
    weights = torch.softmax(torch.randn(1, 2, 5, 5) * 3, -1)  # (L, H, T, T)
    cells = _svg_cells(views.model_view(weights).save(tmp_path / "m.svg").read_text(encoding="utf-8"))
    fixed = (weights[0].clamp(0, 1) * 65535).round() / 65535  # what the page decodes
    index = (fixed.double().sqrt() * 255).round()  # modelview.js's paint(): its 256-colour table
    expected = [[viridis(float(i) / 255) for i in head.reshape(-1)] for head in index]
    assert cells == expected


def test_svg_bytes_are_deterministic(tmp_path):
    view = KINDS["mask difference"]()
    assert view.save(tmp_path / "a.svg").read_bytes() == view.save(tmp_path / "b.svg").read_bytes()


def test_save_still_returns_the_path_and_the_page_is_self_contained(tmp_path):
    path = KINDS["mask view"]().save(tmp_path / "m.html")
    assert path == tmp_path / "m.html"
    assert "http://" not in path.read_text(encoding="utf-8").replace("http://www.w3.org", "")


# ---- the page as chromium draws it against the PNG -------------------------------------------------

from _cdp import Browser, find_browser, open_page, page_errors  # noqa: E402

BROWSER = find_browser()


def _png_pixels(data: bytes):
    from matplotlib.image import imread

    return (imread(io.BytesIO(data), format="png")[..., :3] * 255).round().astype(int)  # (H, W, 3)


def _picture_centres(view) -> tuple[list, tuple[int, int]]:
    """For each panel, the PNG pixel at each cell's centre, ``(row, col) -> (x, y)``; and the PNG's size."""
    fig = figure(view.picture())
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": "attnlab"})
    width, height = fig.canvas.get_width_height()
    out, ax, picture = [], fig.axes[0], view.picture()
    for panel, (x, y) in zip(picture.panels, origins(picture)):
        rows, cols = panel.colours.shape[:2]
        out.append({(r, c): tuple(ax.transData.transform((x + c, y + r))) for r in range(rows) for c in range(cols)})
    return [{k: (round(x), round(height - y)) for k, (x, y) in p.items()} for p in out], (width, height)


def _screenshot(browser) -> list:
    shot = browser.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    return _png_pixels(base64.b64decode(shot["data"]))


CELLS_JS = {  # per view kind: each drawn cell's [panel, row, col, x, y] centre in CSS pixels
    "walk": """[...document.querySelectorAll('rect.cell')].filter(r => r.getBoundingClientRect().width > 0)
        .map(r => { const b = r.getBoundingClientRect();
        return [+r.dataset.head, +r.dataset.row, +r.dataset.col, b.left + b.width / 2, b.top + b.height / 2]; })""",
    "model": """[...document.querySelectorAll('canvas.mv-thumb')].flatMap((c, i) => { const b = c.getBoundingClientRect();
        const n = c.width, out = []; for (let r = 0; r < n; r++) for (let k = 0; k < n; k++)
        out.push([i, r, k, b.left + (k + .5) * b.width / n, b.top + (r + .5) * b.height / n]); return out; })""",
    "mask": """[...document.querySelectorAll('canvas.mk-map')].flatMap((c, i) => { const b = c.getBoundingClientRect();
        const out = []; for (let r = 0; r < c.height; r++) for (let k = 0; k < c.width; k++)
        out.push([i, r, k, b.left + (k + .5) * b.width / c.width, b.top + (r + .5) * b.height / c.height]); return out; })""",
}
LABELS_JS = {
    "walk": "[...document.querySelectorAll('svg.heatmap')[0].querySelectorAll('text.row-label')].map(t => t.textContent)",
    "model": "[...document.querySelectorAll('canvas.mv-thumb')].map(c => c.title)",
    "mask": "[...document.querySelectorAll('.card h2')].map(h => h.textContent)",
}
BROWSER_VIEWS = {
    "walk": lambda: attnlab.show(_weights(1, 5), TOKENS, title="five tokens"),
    "model": lambda: views.model_view(torch.softmax(torch.randn(2, 2, 6, 6) * 2, -1), list("abcdef"), title="two layers"),
    "mask": lambda: attnlab.show(masks.sliding_window_mod(48, 48, 9), size=(48, 48), block=8),
}


@pytest.mark.browser
@pytest.mark.parametrize("kind", sorted(BROWSER_VIEWS))
def test_the_png_matches_the_page_chromium_draws(kind, tmp_path):
    if BROWSER is None:
        pytest.skip("no chromium found (apt-get install -y chromium, or set ATTNLAB_CHROMIUM)")
    view = BROWSER_VIEWS[kind]()
    page, png = view.save(tmp_path / "v.html"), view.save(tmp_path / "v.png")
    centres, size = _picture_centres(view)
    picture_pixels = _png_pixels(png.read_bytes())
    assert picture_pixels.shape[:2] == (size[1], size[0])
    with Browser(BROWSER, timeout=30.0) as browser:
        browser.send("Emulation.setDeviceMetricsOverride", width=1400, height=2400, deviceScaleFactor=1, mobile=False)
        open_page(browser, page)
        assert page_errors(browser.events) == []
        cells = browser.evaluate(CELLS_JS[kind])
        labels = browser.evaluate(LABELS_JS[kind])
        title = browser.evaluate("document.title")
        shot = _screenshot(browser)
    picture = view.picture()
    assert title == view.title == picture.title
    grids = [(p.colours.shape[0], p.colours.shape[1]) for p in picture.panels if p.title]
    page_grids = {}
    for panel, row, col, _, _ in cells:
        page_grids[panel] = (max(page_grids.get(panel, (0, 0))[0], row + 1), max(page_grids.get(panel, (0, 0))[1], col + 1))
    assert [page_grids[p] for p in sorted(page_grids)] == grids[:len(page_grids)] and len(page_grids) >= 1
    if kind == "walk":
        assert labels == list(picture.panels[0].rows) == TOKENS
    elif kind == "model":
        assert labels == [p.title for p in picture.panels if p.title]
    else:
        assert labels == [picture.title]
    worst = 0
    for panel, row, col, x, y in cells:
        seen = shot[round(y - 0.5), round(x - 0.5)]
        px, py = centres[panel][(row, col)]
        drawn = picture_pixels[py, px]
        worst = max(worst, int(abs(seen - drawn).max()))
    assert worst <= 6, f"a cell's colour differs by {worst} of 255 between the page and the PNG"


# ---- the command line and the docs -----------------------------------------------------------------

def _explain_mask(tmp_path, *extra):
    from typer.testing import CliRunner

    from attnlab.lab.cli import app

    return CliRunner().invoke(app, ["explain", "--mask", "causal&window:64", "--size", "512", "--out",
                                    str(tmp_path), *extra])


@pytest.mark.parametrize("fmt", ["png", "svg", "html"])
def test_explain_mask_writes_the_format_asked_for_only(fmt, tmp_path):
    result = _explain_mask(tmp_path, "--format", fmt)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"mask.{fmt}"]
    data = (tmp_path / f"mask.{fmt}").read_bytes()
    if fmt == "png":
        assert data[:8] == PNG_MAGIC
    elif fmt == "svg":
        assert len(_svg_cells(data.decode("utf-8"))[0]) == 16  # 4 x 4 blocks of 128
    else:
        assert b"data-attnlab-mask" in data
    assert f"wrote {tmp_path / f'mask.{fmt}'}" in result.output


def test_explain_mask_writes_all_three_by_default_and_refuses_another_format(tmp_path):
    result = _explain_mask(tmp_path / "all")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["mask.html", "mask.png", "mask.svg"]
    result = _explain_mask(tmp_path / "bad", "--format", "jpg")
    assert result.exit_code == 2 and "--format must be one of" in result.output
    assert not (tmp_path / "bad").exists()


def test_the_docs_example_saves_every_view_kind(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "explain.md").read_text(encoding="utf-8")
    start = text.index("### Keeping a view")
    section = text[start:text.index("\n## ", start)]
    code = section.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/explain.md", "exec"), {})
    assert capsys.readouterr().out.strip() == str(sorted(
        ["alibi.png", "diff.svg", "generation.svg", "mask.png", "model.png", "walk.svg", "weights.html", "weights.png"]))


def test_a_model_of_ragged_layers_leaves_the_missing_heads_blank(tmp_path):
    weights = torch.softmax(torch.randn(2, 2, 4, 4), -1)
    weights[1, 1] = float("nan")  # layer 1 has one head (attnlab.lab.trained.pad_heads)
    view = views.model_view(weights)
    picture = view.picture()
    assert [p.title for p in picture.panels] == ["layer 0, head 0", "layer 0, head 1", "layer 1, head 0", ""]
    assert bool((picture.panels[3].colours == 255).all())
    svg = view.save(tmp_path / "r.svg").read_text(encoding="utf-8")
    assert "layer 1, head 1" not in svg and len(_svg_cells(svg)) == 4


def test_an_unknown_colour_scale_is_refused_by_name():
    from attnlab.lab.viz.picture import colours

    with pytest.raises(ValueError, match="scale must be one of .*'log'"):
        colours(torch.zeros(2, 2), "log")


@pytest.mark.filterwarnings("ignore:Glyph 9216")  # DejaVu Sans has no U+2400: the PNG shows a box there
def test_tokens_are_text_not_tex_and_control_characters_do_not_break_the_svg(tmp_path):
    tokens = ["$x^$", "cost $5", "a\\b", "\x00nul"]
    view = attnlab.show(_weights(1, 4), tokens, title="$ money $")
    assert view.save(tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    texts = _svg_texts(view.save(tmp_path / "t.svg").read_text(encoding="utf-8"))
    assert "$ money $" in texts and "$x^$" in texts and "cost $5" in texts and "a\\b" in texts
    assert "\u2400nul" in texts  # a NUL (not XML) as its control picture, as the page shows it
