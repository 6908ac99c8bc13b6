"""Views of any length: weights recomputed from q, k and each row's log-sum-exp (attnlab.lab.viz.recompute),
the long model view's page (overview + zoom data), ModelLens.record on saved transformers models, and
``attnlab explain --model DIR --text-file``.

References are plain fp64 softmax written here, and transformers' own weights through the lens
(``output_attentions``) for real saved models.
"""

from __future__ import annotations

import base64
import json
import math
import re

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from attnlab import masks, scores
from attnlab.lab.cli import app
from attnlab.lab.viz import views
from attnlab.lab.viz.recompute import LazyWeights, interval_bounds, record, reduce_blocks
from attnlab.lab.viz.views import model_view, show


def _reference(q, k, *, allowed=None, scale=None, cap=None, sinks=None):
    """fp64 weights ``(H, T, Tk)``: softmax over allowed keys (and a sink), zero rows where nothing is allowed."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    s = q @ k.mT * (q.shape[-1] ** -0.5 if scale is None else scale)
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, s.shape[1], 1)], dim=-1)
    m = s.amax(-1, keepdim=True).clamp(min=-1e300)
    e = torch.exp(s - m)
    w = e / e.sum(-1, keepdim=True).clamp(min=1e-300)
    return w[..., :k.shape[1]] if sinks is not None else w


def _blocks(w, block, reduce):
    """fp64 overview written cell by cell."""
    h, t, tk = w.shape
    n_r, n_c = math.ceil(t / block), math.ceil(tk / block)
    out = torch.zeros(h, n_r, n_c, dtype=torch.float64)
    for i in range(n_r):
        for j in range(n_c):
            tile = w[:, i * block:(i + 1) * block, j * block:(j + 1) * block]
            out[:, i, j] = tile.sum(-1).mean(-1) if reduce == "mean" else tile.amax((-1, -2))
    return out


T = 203  # not a multiple of any block below: ragged last blocks in both directions
ROWS = torch.arange(T)[:, None]
COLS = torch.arange(T)[None, :]
CASES = {
    "full": (dict(), None, None),
    "causal": (dict(causal=True), COLS <= ROWS, None),
    "window+softcap": (dict(causal=True, mask=masks.sliding_window_mod(T, T, 17), score_mod=scores.softcap(1.5)),
                       (COLS <= ROWS) & (COLS > ROWS - 17), 1.5),
    "padded keys": (dict(mask=COLS < 150), (COLS < 150).expand(T, T), None),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_tiles_and_block_maps_equal_fp64_softmax(case, reduce):
    options, allowed, cap = CASES[case]
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, T, 8, generator=gen) * 2, torch.randn(2, T, 8, generator=gen) * 2  # grouped heads
    lazy = LazyWeights.from_qk(q, k, **options)
    expected = _reference(q, k, allowed=allowed, cap=cap)
    for head in range(4):
        tile = lazy.tile(0, head, rows=(37, 190), cols=(5, T))
        torch.testing.assert_close(tile.double(), expected[head, 37:190, 5:], atol=2e-6, rtol=1e-5)
    overview = lazy.block_map(0, cells=20, reduce=reduce)  # blocks of 11 tokens
    torch.testing.assert_close(overview.double(), _blocks(expected, 11, reduce), atol=2e-6, rtol=1e-5)
    if reduce == "mean":  # rows of the overview sum to 1 (every row attends something here)
        torch.testing.assert_close(overview.sum(-1).double(), torch.ones(4, 19, dtype=torch.float64), atol=1e-5, rtol=0)


def test_sinks_and_empty_rows():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 40, 4, generator=gen), torch.randn(2, 40, 4, generator=gen)
    allowed = torch.ones(40, 40, dtype=torch.bool)
    allowed[5] = False  # a query with nothing to attend: a zero row, not NaN
    sinks = torch.tensor([0.5, -1.0])
    lazy = LazyWeights.from_qk(q, k, mask=allowed, sinks=sinks)
    expected = _reference(q, k, allowed=allowed, sinks=sinks)
    expected[:, 5] = 0.0
    got = torch.stack([lazy.tile(0, h, rows=(0, 40), cols=(0, 40)) for h in range(2)])
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
    assert bool((lazy.block_map(0, cells=8)[:, 1].isfinite()).all())


def test_the_fused_log_sum_exp_equals_the_band_pass():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 300, 8, generator=gen)
    fused = LazyWeights.from_qk(q, q, causal=True)
    banded = LazyWeights.from_qk(q, q, mask=torch.ones(300, 300, dtype=torch.bool).tril())
    torch.testing.assert_close(fused.lse(0), banded.lse(0), atol=1e-5, rtol=1e-6)


def test_nan_rows_stay_nan_as_the_oracle_gives_them_and_empty_input_is_refused():
    from attnlab import attention_weights

    q, k = torch.randn(1, 10, 4), torch.randn(1, 10, 4)
    q[0, 3, 1] = float("nan")
    lazy = LazyWeights.from_qk(q, k, causal=True)
    oracle = attention_weights(q[None], k[None], causal=True)[0, 0]
    tile = lazy.tile(0, 0, rows=(0, 10), cols=(0, 10))
    assert torch.equal(tile.isnan(), oracle.isnan()) and bool(tile[3].isnan().all())
    torch.testing.assert_close(tile[4:], oracle[4:])
    assert bool(lazy.block_map(0, cells=5).isfinite().all())  # the overview draws such a row as 0
    with pytest.raises(ValueError, match="at least one token"):
        LazyWeights.from_qk(torch.randn(1, 0, 4), torch.randn(1, 0, 4))


def test_interval_bounds_accept_eager_masks_and_refuse_what_is_not_one_interval():
    eager = torch.zeros(1, 1, 4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    assert interval_bounds(tq=4, tk=4, mask=eager).tolist() == [[0, 1], [0, 2], [0, 3], [0, 4]]
    documents = masks.document_mod(torch.tensor([[0, 0, 1, 1, 0, 0]]), causal=False)
    with pytest.raises(ValueError, match="not one interval"):
        interval_bounds(tq=6, tk=6, mask=documents)
    with pytest.raises(ValueError, match="other than 0 and -inf"):
        interval_bounds(tq=2, tk=2, mask=torch.tensor([[0.0, -1.0], [0.0, 0.0]]))
    per_head = torch.stack([torch.ones(3, 3, dtype=torch.bool), torch.eye(3, dtype=torch.bool)])[None]
    with pytest.raises(ValueError, match="differs between heads"):
        interval_bounds(tq=3, tk=3, mask=per_head)


def test_record_refuses_batches_and_top_k():
    q = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match="batch 1"):
        record(q, q)
    with pytest.raises(ValueError, match="top-k"):
        record(q[:1], q[:1], indices=torch.zeros(1, 1, 4, 2, dtype=torch.long))


@pytest.mark.parametrize("bad", [dict(rows=(5, 5)), dict(rows=(0, 99)), dict(rows="ab"), dict(head=4), dict(layer=1)])
def test_bad_regions_name_the_argument(bad):
    lazy = LazyWeights.from_qk(torch.randn(4, 10, 2), torch.randn(4, 10, 2))
    args = dict(layer=0, head=0, rows=(0, 3), cols=(0, 10)) | bad
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"^{name} must"):
        lazy.tile(args.pop("layer"), args.pop("head"), **args)


class _LargestStorage(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_an_overview_of_16k_tokens_never_holds_t_squared():
    t = 16384
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, t, 4, generator=gen)
    lazy = LazyWeights.from_qk(q, q, causal=True)
    with _LargestStorage() as watch:
        overview = lazy.block_map(0, cells=64)
    assert overview.shape == (1, 64, 64)
    assert watch.largest <= 4 * t * 512, watch.largest  # a band of rows; T^2 would be 1 GiB
    torch.testing.assert_close(overview.sum(-1), torch.ones(1, 64), atol=1e-4, rtol=0)


def test_block_reduction_matches_the_dense_model_view_convention():
    w = torch.softmax(torch.randn(2, 300, 300), -1)
    torch.testing.assert_close(reduce_blocks(w, 7, "mean").double(), _blocks(w.double(), 7, "mean"))
    torch.testing.assert_close(reduce_blocks(w, 7, "max").double(), _blocks(w.double(), 7, "max"))


# ---- the page ---------------------------------------------------------------------------------------

def _data(page: str) -> dict:
    return json.loads(re.search(r'attnlab-model" type="application/json">(.*?)</script>', page).group(1))


def _array(text: str, kind: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=kind)


def _page_weights(data: dict, layer: int, head: int, rows, cols) -> np.ndarray:
    """What modelview.js computes for a zoomed region, written again with numpy from the page's data."""
    zoom, info = data["zoom"], data["zoom"]["layers"][layer]
    held = zoom["heads"][f"{layer}:{head}"]
    d = zoom["dim"]
    q = _array(held["q"], "<f2").astype(np.float64).reshape(-1, d)
    k = _array(zoom["keys"][f"{layer}:{head // info['group']}"], "<f2").astype(np.float64).reshape(-1, d)
    lse = _array(held["lse"], "<f4").astype(np.float64)
    bounds = _array(zoom["intervals"][info["bounds"]], "<i4").reshape(-1, 2)
    s = q[rows[0]:rows[1]] @ k[cols[0]:cols[1]].T * info["scale"]
    if info["softcap"] is not None:
        s = info["softcap"] * np.tanh(s / info["softcap"])
    j = np.arange(cols[0], cols[1])[None]
    inside = (j >= bounds[rows[0]:rows[1], :1]) & (j < bounds[rows[0]:rows[1], 1:])
    return np.where(inside, np.exp(s - lse[rows[0]:rows[1], None]), 0.0)


def test_a_long_view_carries_overviews_and_zoom_data_not_weights():
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 3000, 8, generator=gen), torch.randn(2, 2, 3000, 8, generator=gen)
    lazy = LazyWeights.from_qk(q, k, causal=True, score_mod=scores.softcap(3.0))
    page = model_view(lazy, layer=1, head=2)._repr_html_()
    data = _data(page)
    assert (data["n"], data["block"], data["heads"]) == (250, 12, [4, 4])
    cells = _array(data["data"], "<u2").astype(np.float64).reshape(2, 4, 250, 250) / 65535
    np.testing.assert_allclose(cells[1], lazy.block_map(1, cells=250).numpy(), atol=1e-5)
    assert set(data["zoom"]["heads"]) == {f"{l}:{h}" for l in range(2) for h in range(4)}
    assert len(data["zoom"]["intervals"]) == 1  # both layers causal: one copy
    expected = lazy.tile(1, 2, rows=(1000, 1064), cols=(950, 1014)).double().numpy()
    np.testing.assert_allclose(_page_weights(data, 1, 2, (1000, 1064), (950, 1014)), expected, atol=3e-3, rtol=2e-2)
    overviews, zoom = 2 * 8 * 250 ** 2, views.ZOOM_MB * 2 ** 20
    assert len(page) < 4 / 3 * (overviews + zoom) + 100_000  # base64 of overviews and the zoom budget, and the rest


def test_the_zoom_budget_keeps_the_enlarged_head_first_and_says_what_is_left_out():
    q = torch.randn(2, 3, 2000, 8)
    lazy = LazyWeights.from_qk(q, q, causal=True)
    data = _data(model_view(lazy, layer=1, head=1, zoom_mb=0.1)._repr_html_())
    assert list(data["zoom"]["heads"]) == ["1:1"]
    assert "1 of 6 heads (zoom_mb=0.1 MiB)" in model_view(lazy, zoom_mb=0.1)._repr_html_()
    scored = LazyWeights.from_qk(q, q, causal=True, score_mod=scores.alibi(torch.ones(3)))
    data = _data(model_view(scored)._repr_html_())
    assert data["zoom"]["heads"] == {} and "recomputed in Python only" in data["zoom"]["skipped"]["0"]


def test_show_takes_lazy_weights_and_options_are_checked():
    lazy = LazyWeights.from_qk(torch.randn(2, 500, 4), torch.randn(2, 500, 4), tokens=[f"w{i}" for i in range(500)])
    page = show(lazy, reduce="max")._repr_html_()
    assert '"reduce":"max"' in page and "block's largest weight" in page
    with pytest.raises(ValueError, match="reduce must be"):
        model_view(lazy, reduce="median")
    with pytest.raises(ValueError, match="zoom_mb must be"):
        model_view(lazy, zoom_mb=-1)
    with pytest.raises(ValueError, match="layer and head must name a head"):
        model_view(lazy, head=2)
    with pytest.raises(ValueError, match="tokens come with the LazyWeights"):
        model_view(lazy, ["x"] * 500)


def test_cells_per_axis_keeps_many_heads_within_the_overview_bytes():
    for heads in (1, 8, 72, 400):
        n = views.cells_per_axis(heads)
        assert 64 <= n <= views.GRID and (n == 64 or 2 * heads * n * n <= views.OVERVIEW_BYTES)


# ---- real saved models -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tiny_models = pytest.importorskip("_tiny_models")
    saved = {}
    old = dict(tiny_models.SIZES)
    tiny_models.SIZES["positions"] = 4096
    try:
        for kind in ("llama", "gpt2", "gemma2", "bert"):
            saved[kind] = tiny_models.save_tiny(kind, tmp_path_factory.mktemp(kind))
    finally:
        tiny_models.SIZES.update(old)
    return saved


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2", "bert"])
def test_record_recomputes_the_weights_transformers_returns(tiny, kind):
    from _tiny_models import WORDS

    from attnlab.lab.lens import open_model

    lens = open_model(tiny[kind])
    text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(30))
    lazy, dense = lens.record(text), lens.attention(text).weights
    n = len(lazy.tokens)
    for layer in range(2):
        for head in range(4):
            torch.testing.assert_close(lazy.tile(layer, head, rows=(0, n), cols=(0, n)), dense[layer, head],
                                       atol=1e-5, rtol=1e-4)


def test_attention_refuses_what_record_takes(tiny, monkeypatch):
    from attnlab.lab import lens as lens_module

    lens = lens_module.open_model(tiny["llama"])
    monkeypatch.setattr(lens_module, "DENSE_BYTES", 100)
    with pytest.raises(ValueError, match=r"use record\(\)"):
        lens.attention("the chef made a meal")
    assert len(lens.record("the chef made a meal").tokens) == 5


def test_explain_reads_a_long_text_file(tiny, tmp_path):
    from _tiny_models import WORDS

    text = " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(3000))
    source = tmp_path / "long.txt"
    source.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["explain", "--model", str(tiny["gpt2"]), "--text-file", str(source),
                                      "--out", str(out), "--format", "html", "--query", "chef"])
    assert result.exit_code == 0, result.output
    assert "Tokens (3000):" in result.output and "... 2952 more ..." in result.output
    assert "Which kernel ran" in result.output and "matches the prediction: 'sdpa'" in result.output
    data = _data((out / "model.html").read_text(encoding="utf-8"))
    assert len(data["tokens"]) == 3000 and data["block"] == 12 and data["zoom"]["heads"]


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"), (b"\xff\xfe\x00bad", "is not UTF-8"), (b"  \n ", "holds no text"), ("dir", "is not a file"),
])
def test_text_file_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "t.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    result = CliRunner().invoke(app, ["explain", "--text-file", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_text_file_and_a_sentence_are_refused_together(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the cat", encoding="utf-8")
    result = CliRunner().invoke(app, ["explain", "a dog", "--text-file", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "not both" in result.output


def test_the_step_by_step_walk_refuses_a_long_text_and_points_to_model_dir(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(" ".join(["word"] * 600), encoding="utf-8")
    result = CliRunner().invoke(app, ["explain", "--text-file", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "at most 512" in result.output and "--model DIR" in result.output
    assert not (tmp_path / "o").exists()
