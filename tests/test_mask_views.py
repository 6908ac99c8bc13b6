"""Mask and score-mod views (attnlab.lab.viz.maskview): block maps, zoom data, differences, score mods, the CLI.

Every block state and count is checked against a dense mask written with plain index math (or the
mod's own ``__call__`` through ``materialize`` for combinations); score mods against fp64 formulas.
"""

from __future__ import annotations

import base64
import math
import re

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

import attnlab
from attnlab import masks, scores
from attnlab.lab.cli import app
from attnlab.lab.viz import maskview
from attnlab.lab.viz.page import asset, to_json


def _dense_patterns(tq: int, tk: int) -> dict:
    """Plain index math, independent of the mods' intervals: (mod, dense (Tq, Tk) bool)."""
    q, k = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    ids = torch.arange(tk) * 3 // tk  # three documents
    return {
        "causal": (masks.causal_mod(tq, tk), k <= q),
        "bottom_right": (masks.causal_mod(tq, tk, align="bottom_right"), k <= q + tk - tq),
        "window": (masks.sliding_window_mod(tq, tk, 13), (k <= q) & (k > q - 13)),
        "chunk": (masks.chunked_local_mod(tq, tk, 20), (k // 20 == q // 20) & (k <= q)),
        "prefix": (masks.prefix_lm_mod(tq, tk, 9), (k < 9) | (k <= q)),
        "documents": (masks.document_mod(ids), (ids[:tq, None] == ids[None, :]) & (k <= q)),
        "or": (masks.causal_mod(tq, tk) | masks.sliding_window_mod(tq, tk, 3, align="bottom_right"),
               (k <= q) | ((k <= q + tk - tq) & (k > q + tk - tq - 3))),
        "function": (lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 == 0, (q + k) % 3 == 0),
    }


def _dense_states(dense: torch.Tensor, block: int) -> torch.Tensor:
    nq, nk = -(-dense.shape[0] // block), -(-dense.shape[1] // block)
    states = torch.zeros(nq, nk, dtype=torch.uint8)
    for i in range(nq):
        for j in range(nk):
            tile = dense[i * block:(i + 1) * block, j * block:(j + 1) * block]
            states[i, j] = 2 if bool(tile.all()) else 1 if bool(tile.any()) else 0
    return states


@pytest.mark.parametrize("name", list(_dense_patterns(1, 1)))
@pytest.mark.parametrize("tq,tk,block", [(70, 70, 16), (45, 70, 8), (70, 70, 128)])
def test_block_states_and_counts_equal_a_dense_evaluation(name, tq, tk, block):
    if name == "documents" and tq != tk:
        tq = tk  # a document mod states its own size
    mod, dense = _dense_patterns(tq, tk)[name]
    bmap = maskview.block_map(mod, size=(tq, tk), block=block)
    assert torch.equal(bmap.states, _dense_states(dense, block))
    assert bmap.allowed == int(dense.sum())
    from_tensor = maskview.block_map(dense, block=block)  # a bool tensor: the evaluated path
    assert torch.equal(from_tensor.states, bmap.states) and from_tensor.allowed == bmap.allowed


def _decode(text: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype)


def _cells_from_page_data(side: dict, n, block: int, tq: int, tk: int) -> torch.Tensor:
    """Every cell as maskview.js reads it: the block state, then intervals or a partial block's bits."""
    states = _decode(side["states"], np.uint8).reshape(n)
    out = torch.zeros(tq, tk, dtype=torch.bool)
    tile_bytes = -(-block * block // 8)
    for i, j in np.ndindex(*n):
        rows, cols = slice(i * block, min(tq, (i + 1) * block)), slice(j * block, min(tk, (j + 1) * block))
        if states[i, j] == 2:
            out[rows, cols] = True
        elif states[i, j] == 1 and "lo" in side:
            lo, hi = (torch.from_numpy(_decode(side[x], "<i4").astype(np.int64)) for x in ("lo", "hi"))
            qseg = torch.from_numpy(_decode(side["qseg"], "<i4").astype(np.int64)) if "qseg" in side else torch.zeros(tq)
            kseg = torch.from_numpy(_decode(side["kseg"], "<i4").astype(np.int64)) if "kseg" in side else torch.zeros(tk)
            q, k = torch.arange(tq)[rows, None], torch.arange(tk)[None, cols]
            out[rows, cols] = (k >= lo[rows, None]) & (k <= hi[rows, None]) & (qseg[rows, None] == kseg[None, cols])
        elif states[i, j] == 1:
            at = side["tiles"].index(i * n[1] + j) * tile_bytes
            bits = np.unpackbits(np.frombuffer(base64.b64decode(side["bits"]), np.uint8)[at:at + tile_bytes],
                                 bitorder="little")[: block * block].reshape(block, block)
            out[rows, cols] = torch.from_numpy(bits[: rows.stop - rows.start, : cols.stop - cols.start].astype(bool))
    return out


@pytest.mark.parametrize("name", ["causal", "documents", "or", "function"])
def test_the_zoom_data_in_the_page_gives_every_cell_of_the_materialised_mask(name):
    mod, dense = _dense_patterns(70, 70)[name]
    bmap = maskview.block_map(mod, size=(70, 70), block=16)
    side = maskview._side(bmap)
    assert ("lo" in side) == masks.has_row_ranges(mod)  # intervals where the mask has them, else bit tiles
    assert torch.equal(_cells_from_page_data(side, list(bmap.states.shape), 16, 70, 70), dense)
    assert torch.equal(masks.materialize(mod, tq=70, tk=70)[0, 0], dense)


def test_bit_tiles_stop_at_the_budget_and_the_rest_are_counted():
    dense = _dense_patterns(64, 64)["causal"][1]
    bmap = maskview.block_map(dense, block=16, budget=2 * 32)  # two 16 x 16 tiles of 32 bytes
    assert len(bmap.tiles) == 2 and bmap.dropped == 2 and sorted(bmap.tiles) == [0, 5]


def test_a_4d_bool_tensor_shows_the_chosen_batch_row_and_head():
    full = torch.zeros(2, 3, 8, 8, dtype=torch.bool)
    full[1, 2, :, :4] = True
    assert maskview.block_map(full, block=4, batch=1, head=2).states.tolist() == [[2, 0], [2, 0]]
    assert maskview.block_map(full, block=4).allowed == 0
    broadcast = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    assert maskview.block_map(broadcast, block=4, batch=1, head=2).allowed == 64
    with pytest.raises(ValueError, match="head must be in"):
        maskview.block_map(full, head=3)


def test_padding_rows_come_from_the_mods_lengths():
    mod = masks.padding_mod(torch.tensor([3, 7]))
    bmap = maskview.block_map(mod, size=(8, 8), block=4, batch=1)
    assert bmap.states.tolist() == [[2, 1], [2, 1]] and bmap.allowed == 8 * 7


class _NoLargeStorage(TorchDispatchMode):
    """Fail when any op's output storage exceeds ``limit`` bytes (the T^2 mask would be 1 GiB)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.largest = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.limit:
                nbytes = t.untyped_storage().nbytes()  # an expanded view holds less
                self.largest = max(self.largest, nbytes)
                assert nbytes <= self.limit, f"{func} made {nbytes} bytes"
        return out


@pytest.mark.parametrize("t,mod", [(32768, masks.causal_mod(1, 1)), (32768, masks.sliding_window_mod(1, 1, 256)),
                                   (8192, masks.causal_mod(1, 1) | masks.sliding_window_mod(1, 1, 64))],
                         ids=["causal", "window", "or-evaluated"])
def test_a_long_mask_builds_in_o_t_times_block_memory(t, mod):
    block = 128
    guard = _NoLargeStorage(limit=8 * t * block)  # a band of int64s; T^2 bools is 1 GiB
    with guard:
        bmap = maskview.block_map(mod, size=(t, t), block=block, budget=1 << 16)
    if masks.has_row_ranges(mod):
        window = isinstance(mod, masks.SlidingWindowMod)
        assert bmap.allowed == (256 * t - 256 * 255 // 2 if window else t * (t + 1) // 2)
        assert bmap.counts()["partial"] == (2 * (t // block) - 2 if window else t // block)  # diagonal (+ two back)
    page = maskview.map_view(bmap)._repr_html_()
    assert len(page) < 2_000_000


def _dense_diff_counts(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"both": int((a & b).sum()), "only_a": int((a & ~b).sum()), "only_b": int((b & ~a).sum())}


@pytest.mark.parametrize("block", [8, 16])
def test_a_difference_equals_the_dense_one(block):
    pats = _dense_patterns(70, 70)
    (mod_a, a), (mod_b, b) = pats["causal"], pats["chunk"]
    view = maskview.mask_diff_view(mod_a, mod_b, size=(70, 70), block=block)
    page = view._repr_html_()
    assert to_json(_dense_diff_counts(a, b)) in page
    src_a, src_b = (maskview._source(m, size=(70, 70), batch=0, head=0) for m in (mod_a, mod_b))
    bits, counts = maskview._diff_states(maskview._build(src_a, block, 1 << 20), maskview._build(src_b, block, 1 << 20))
    assert counts == _dense_diff_counts(a, b)
    for i, j in np.ndindex(*bits.shape):
        ta, tb = (x[i * block:(i + 1) * block, j * block:(j + 1) * block] for x in (a, b))
        want = bool((ta & tb).any()) * 1 + bool((ta & ~tb).any()) * 2 + bool((tb & ~ta).any()) * 4
        assert int(bits[i, j]) == want, (i, j)


def test_a_difference_of_a_tensor_and_a_mod_through_show():
    dense = _dense_patterns(40, 40)["window"][1]
    view = attnlab.show(dense, masks.causal_mod(40, 40), block=8)
    assert view.title.startswith("mask difference") and '"only_b":' in view._repr_html_()
    with pytest.raises(ValueError, match="mask_b"):
        attnlab.show(dense, torch.ones(40, 41, dtype=torch.bool))


def _fp64_scores(seed=0, tq=8, tk=8, d=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(tk, d, generator=gen, dtype=torch.float64)
    return q, k, (q @ k.T) / math.sqrt(d)


@pytest.mark.parametrize("which", ["softcap", "alibi", "function"])
def test_score_mod_values_equal_plain_fp64_math(which):
    q, k, s = _fp64_scores()
    i, j = torch.arange(8.0, dtype=torch.float64)[:, None], torch.arange(8.0, dtype=torch.float64)[None, :]
    mod, want = {
        "softcap": (scores.softcap(2.0), 2.0 * torch.tanh(s / 2.0)),
        "alibi": (scores.alibi(4), s - float(scores.alibi_slopes(4)[2]) * (i - j)),
        "function": (lambda score, b, h, q_idx, kv_idx: score * (h + 1) - (q_idx == kv_idx) * 1.0, s * 3 - (i == j) * 1.0),
    }[which]
    values = maskview.score_mod_values(mod, head=2)
    assert torch.allclose(values["scores"], s, atol=1e-12)
    assert torch.allclose(values["modded"], want, atol=1e-6)
    assert torch.allclose(values["weights"], torch.softmax(s, -1), atol=1e-12)
    assert torch.allclose(values["modded_weights"], torch.exp(want) / torch.exp(want).sum(-1, keepdim=True), atol=1e-6)
    given = maskview.score_mod_values(mod, q=q[:5], k=k[:6], head=2)
    assert torch.allclose(given["modded"], want[:5, :6], atol=1e-6)


def test_show_of_a_score_mod_states_its_change():
    view = attnlab.show(scores.softcap(1.0), size=(4, 6))
    page = view._repr_html_()
    assert "data-attnlab-scoremod" in page and "softcap(1) on head 0: scores change by up to" in page
    assert page.count("<table") == 6 and page.count("<td") == 6 * 4 * 6


@pytest.mark.parametrize("kwargs,match", [
    ({"q": torch.zeros(3, 4)}, "q and k must be given together"),
    ({"q": torch.zeros(3, 4), "k": torch.zeros(3, 5)}, "k must have q's head size 4"),
    ({"size": (65, 4)}, "at most 64 rows"),
    ({"size": (0, 4)}, "size must be"),
    ({"head_dim": 0}, "head_dim must be"),
    ({"head": -1}, "head must be"),
])
def test_score_mod_view_refuses_bad_options_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        maskview.score_mod_view(scores.softcap(5.0), **kwargs)


def test_show_routes_masks_and_keeps_float_tensors_as_weights():
    assert "data-attnlab-mask" in attnlab.show(torch.ones(4, 4, dtype=torch.bool))._repr_html_()
    assert "data-attnlab-mask" not in attnlab.show(torch.full((4, 4), 0.25))._repr_html_()
    assert "data-attnlab-mask" in attnlab.show(masks.prepare(masks.causal_mod(8, 8), tq=8, tk=8), block=4)._repr_html_()
    with pytest.raises(TypeError, match="options"):
        attnlab.show(torch.full((4, 4), 0.25), block=2)
    with pytest.raises(ValueError, match=r"size: mask CausalMod\(offset=0\) does not know its sizes"):
        attnlab.show(masks.causal_mod(8, 8))
    with pytest.raises(ValueError, match="size .* does not match"):
        attnlab.show(masks.prepare(masks.causal_mod(8, 8), tq=8, tk=8), size=(4, 4))
    with pytest.raises(ValueError, match="block 1 cuts"):
        attnlab.show(masks.causal_mod(8, 8), size=(4096, 4096), block=1)


runner = CliRunner()


def test_explain_mask_writes_the_page_and_prints_the_counts(tmp_path):
    result = runner.invoke(app, ["explain", "--mask", "causal&window:256", "--size", "4096", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    bmap = maskview.block_map(masks.causal_mod(4096, 4096) & masks.sliding_window_mod(4096, 4096, 256),
                              size=(4096, 4096))
    c = bmap.counts()
    assert f"{c['full']} full, {c['partial']} partial, {c['empty']} empty" in result.output
    assert f"visits {bmap.visited:.1%} of the blocks" in result.output
    assert "data-attnlab-mask" in (tmp_path / "mask.html").read_text()


def test_explain_mask_with_documents(tmp_path):
    result = runner.invoke(app, ["explain", "--mask", "document:100,28", "--size", "128", "--out", str(tmp_path)])
    assert result.exit_code == 0 and "1 partial" in result.output  # one 128-block, mixed documents


@pytest.mark.parametrize("args,message", [
    (["--mask", "diagonal"], "--mask must be causal, window:N"),
    (["--mask", "window:x"], "'x' is not a number"),
    (["--mask", "window:0"], "give one positive number"),
    (["--mask", "document:1,2", "--size", "16"], "sum to 3, not --size 16"),
    (["--mask", "causal", "--size", "0"], "--size must be a positive int"),
    (["--mask", "causal", "--size", "999999999"], "--size must be at most"),
])
def test_explain_mask_refuses_bad_specs_on_one_line(tmp_path, args, message):
    out = tmp_path / "new"
    result = runner.invoke(app, ["explain", *args, "--out", str(out)])
    text = result.output.strip()
    assert result.exit_code == 2 and text.startswith("error:") and message in text and "\n" not in text
    assert not out.exists()


def test_a_mask_mod_too_large_to_evaluate_is_refused_before_any_work():
    # Regression: show(fn, size=(100000, 100000)) evaluated 10^10 cells of a plain function, band by
    # band, for minutes with no progress and no bound.
    calls = []

    def fn(b, h, q_idx, kv_idx):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("the view evaluated the mod instead of refusing the size")
        return q_idx >= kv_idx

    limit = f"at most {maskview.MAX_EVALUATED:,}"
    for make in (lambda: attnlab.show(fn, size=(100000, 100000)),
                 lambda: attnlab.show(fn, masks.causal_mod(100000, 100000), size=(100000, 100000))):
        with pytest.raises(ValueError, match=rf"^size \(100000, 100000\): .*{limit}"):
            make()
    assert not calls
    # what the limit counts is the cells the mod's bounds let a band reach: an OR of attnlab mods at
    # 8192 (test_a_long_mask_builds_in_o_t_times_block_memory) reaches half of them and is drawn
    src = maskview._source(masks.causal_mod(1, 1) | masks.sliding_window_mod(1, 1, 64), size=(8192, 8192),
                           batch=0, head=0)
    assert maskview._evaluated_cells(src, 128) == sum(128 * min(8192, (i + 1) * 128) for i in range(64))


def test_the_legend_swatches_have_a_size_and_the_map_a_readable_width():
    # Regression: .mk-key had no CSS rule, so every swatch was 0 px wide; a 4096-token map was 128 px.
    css = re.search(r"\.attnlab \.mk-key \{([^}]*)\}", asset("report.css"))
    assert css and re.search(r"width: *1[0-9]px", css.group(1)) and "inline-block" in css.group(1)
    page = maskview.mask_view(masks.causal_mod(4096, 4096), size=(4096, 4096))._repr_html_()
    assert page.count('class="mk-key"') == 3 and 'class="mk-mark"' in page
    width = int(re.search(r'class="mk-map"[^>]*style="width:(\d+)px"', page).group(1))
    assert width == 512 and width % 32 == 0  # 32 blocks of 16 px
    assert maskview.map_width(782, 782) == 782 and maskview.map_width(16, 32) == 512  # a pixel a block at least
