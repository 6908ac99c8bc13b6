"""attnlab.lab.walks and ``attnlab explain --walk flash|sparse|linear``.

References, independent of the walks: fp64 softmax attention over a mask built here with
torch.tril/triu, ``attnlab.attention(..., backend="reference")``, the chunked backend's own tile
hook and :func:`attnlab.masks.block_spans` (what the library skips), torch.topk over the
indexer's scores, the parallel form of linear attention written here, and
:func:`attnlab.linear_attention`'s fp64 oracle.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from typer.testing import CliRunner

import attnlab
from attnlab import masks
from attnlab.backends import build_call
from attnlab.backends.blocks import visited_fraction
from attnlab.backends.chunked import chunked_attention
from attnlab.lab.cli import app
from attnlab.lab.cli._fast_walk import grid_rows
from attnlab.lab.explain import trace
from attnlab.lab.viz.html import build_report
from attnlab.lab.walks import blocks_share, flash_mask, flash_walk, linear_walk, sparse_walk
from attnlab.nn import LightningIndexer
from test_cli_errors import assert_one_error_line

runner = CliRunner()
SHORT = "The sun rises in the east"

# (mode, window, pad, tile): causal, windowed and padded inputs, and their mixes.
FLASH_CASES = [
    ("self", None, 0, 4), ("causal", None, 0, 4), ("causal", None, 0, 5), ("self", 3, 0, 4), ("causal", 2, 0, 3),
    ("self", None, 3, 4), ("causal", None, 2, 3), ("self", 5, 2, 4), ("multihead", 2, 1, 3), ("cross", None, 2, 2),
    ("causal", None, 0, 1), ("causal", None, 0, 64),
]


def _allowed(t, window, pad) -> torch.Tensor:
    """The walk's mask, built by hand: causal band (tril/triu), then the padded keys cut off."""
    self_like = t.mode != "cross"
    tq, tk = len(t.tokens) + (pad if self_like else 0), len(t.context_tokens) + pad
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if window is not None:
        allowed = allowed.tril() & allowed.triu(-(window - 1))
    elif t.causal:
        allowed = allowed.tril()
    allowed[:, len(t.context_tokens):] = False
    return allowed


def _reference(t, h, window, pad, dtype=torch.float64):
    """Head ``h`` by attnlab's reference backend in ``dtype``, from the trace's q, k, v, zero-padded."""
    allowed = _allowed(t, window, pad)
    tq, tk = allowed.shape
    q, k, v = (t.step(n, h).tensor.to(dtype) for n in ("queries", "keys", "values"))
    q = torch.cat([q, q.new_zeros(tq - q.shape[0], q.shape[1])])
    k, v = (torch.cat([x, x.new_zeros(tk - x.shape[0], x.shape[1])]) for x in (k, v))
    out = attnlab.attention(q[None, None], k[None, None], v[None, None], mask=allowed, backend="reference")[0, 0]
    scores = (q @ k.T / math.sqrt(k.shape[-1])).masked_fill(~allowed, float("-inf"))
    return out, torch.logsumexp(scores, -1), scores


def _chunked_visits(tq, tk, mod, tile):
    seen = []
    q, k = torch.randn(1, 1, tq, 4), torch.randn(1, 1, tk, 4)
    chunked_attention(build_call(q, k, k, mask=mod), q_block=tile, kv_block=tile,
                      tile_hook=lambda stage, qs, ks: seen.append((qs, ks)))
    return seen


# ----------------------------------------------------------------------------- flash: numbers
@pytest.mark.parametrize("mode, window, pad, tile", FLASH_CASES)
def test_flash_walk_equals_fp64_reference_within_1e6_in_fp32(mode, window, pad, tile):
    t = trace(mode=mode)
    walk = flash_walk(t, tile=tile, window=window, pad=pad)
    assert walk.output.dtype == torch.float32
    for h in range(t.heads):
        out, lse, _ = _reference(t, h, window, pad)
        d_v = t.d_v
        assert (walk.output[:, h * d_v:(h + 1) * d_v].double() - out).abs().max() <= 1e-6
        walk_lse = [s for s in walk.steps if s.name == "flash_lse" and s.head == h][0].tensor
        assert ((walk_lse.double() - lse).abs() / lse.abs().clamp_min(1.0)).max() <= 1e-6  # fp32's relative step
    largest_lse = float(walk.row_stats[:, 2][torch.isfinite(walk.row_stats[:, 2])].abs().max())
    assert walk.checks["output vs textbook"] <= 1e-6
    assert walk.checks["lse vs textbook"] <= 1e-6 * max(1.0, largest_lse)  # lse rounds relative to its size


@pytest.mark.parametrize("mode", ["self", "causal", "multihead", "cross"])
def test_flash_walk_equals_the_textbook_trace_output(mode):
    t = trace(mode=mode)
    walk = flash_walk(t, tile=5)
    assert (walk.output - t.output).abs().max() <= 1e-6


@pytest.mark.parametrize("mode, window, pad, tile", FLASH_CASES)
def test_flash_walk_in_fp64_is_exact_to_rounding(mode, window, pad, tile):
    t = trace(mode=mode)
    walk = flash_walk(t, tile=tile, window=window, pad=pad, precision="fp64")
    assert walk.output.dtype == torch.float64
    out, _, _ = _reference(t, 0, window, pad)
    assert (walk.output[:, :t.d_v] - out).abs().max() <= 1e-13
    assert walk.checks["output vs textbook"] <= 1e-13 and walk.checks["lse vs textbook"] <= 1e-13


def test_running_statistics_are_the_online_softmax():
    t = trace(mode="causal")
    walk = flash_walk(t, tile=3, precision="fp64")
    _, _, scores = _reference(t, 0, None, 0)
    for tile in walk.tiles:
        stats = [s for s in walk.steps if s.name == f"tile_{tile.qs}_{tile.ks}_stats" and s.head == 0][0].tensor
        m_old, m_new, rescale, _, l = stats[:, :5].unbind(-1)
        seen = scores[tile.qs:tile.qe, :tile.ke]  # every key up to this tile's last
        assert torch.allclose(m_new, seen.max(-1).values, atol=1e-14, rtol=0)
        assert torch.allclose(l, torch.exp(seen - m_new[:, None]).sum(-1), atol=1e-13, rtol=0)
        started = torch.isfinite(m_old)
        assert torch.allclose(rescale[started], torch.exp(m_old - m_new)[started], atol=0, rtol=1e-15)
        assert bool((rescale[~started] == 0).all()) and bool((rescale <= 1).all())
    m, l, lse = walk.row_stats.unbind(-1)
    assert torch.allclose(m, scores.max(-1).values, atol=1e-14, rtol=0)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-13, rtol=0)


def test_a_tile_that_raises_the_maximum_rescales_by_less_than_one():
    walk = flash_walk(trace(mode="causal"), tile=2, precision="fp64")
    rescales = torch.cat([s.tensor[:, 2] for s in walk.steps if s.name.endswith("_stats") and s.head == 0])
    assert bool(((rescales > 0) & (rescales < 1)).any())  # the sentence's maxima move: the rescale is needed


# ----------------------------------------------------------------------------- flash: skipping
@pytest.mark.parametrize("mode, window, pad, tile", FLASH_CASES)
def test_flash_walk_visits_and_skips_what_chunked_does(mode, window, pad, tile):
    t = trace(mode=mode)
    walk = flash_walk(t, tile=tile, window=window, pad=pad)
    tq, tk = len(walk.tokens), len(walk.context_tokens)
    mod = flash_mask(t, window=window, pad=pad)
    masked, dense = _chunked_visits(tq, tk, mod, tile), _chunked_visits(tq, tk, None, tile)
    assert sorted(masked) == sorted((x.qs, x.ks) for x in walk.tiles)
    assert walk.skipped == len(dense) - len(masked)
    assert walk.visited + walk.skipped == len(dense)
    assert walk.spans == masks.block_spans(mod, tq, tk, tile)
    for empty in walk.empty_tiles:  # inside a span, nothing allowed: chunked ran no such tile either
        assert not bool(_allowed(t, window, pad)[empty.qs:empty.qe, empty.ks:empty.ke].any())
        assert (empty.qs, empty.ks) not in masked


@pytest.mark.parametrize("mode, window, tile", [("causal", None, 4), ("causal", None, 5), ("self", 3, 4),
                                                 ("causal", 2, 3), ("self", 7, 2), ("self", None, 4)])
def test_skipped_tiles_follow_block_spans(mode, window, tile):
    t = trace(mode=mode)
    walk = flash_walk(t, tile=tile, window=window)
    n = len(t.tokens)
    spans = masks.block_spans(flash_mask(t, window=window), n, n, tile)
    assert walk.skipped == sum(math.ceil(n / tile) - math.ceil((hi - lo) / tile) for _, _, lo, hi in spans)
    assert sum(x.cells for x in walk.tiles) == sum((qe - qs) * (hi - lo) for qs, qe, lo, hi in spans)
    # the blocks backend's own share of the score matrix it computes for the same call and block
    x = torch.zeros(1, 1, n, 4)
    call = build_call(x, x, x, mask=flash_mask(t, window=window))
    assert sum(x.cells for x in walk.tiles) / (n * n) == pytest.approx(visited_fraction(call, block=tile), abs=1e-12)
    assert blocks_share(walk) == visited_fraction(call, block=tile)


def test_tile_status_and_grid_agree_with_the_mask():
    t = trace(SHORT, mode="causal")
    walk = flash_walk(t, tile=2, pad=1)
    rows = grid_rows(walk)
    allowed = _allowed(t, None, 1)
    for tile in walk.tiles:
        cut = allowed[tile.qs:tile.qe, tile.ks:tile.ke]
        assert tile.status == ("full" if bool(cut.all()) else "partial") and bool(cut.any())
    for i, row in enumerate(rows):
        assert [c == "#" for c in row] == allowed[i].tolist()  # every allowed pair is computed
    assert sum(row.count(".") for row in rows) == len(walk.tokens) * len(walk.context_tokens) - sum(
        x.cells for x in walk.tiles)


# ----------------------------------------------------------------------------- flash: backward
@pytest.mark.parametrize("mode, window, pad", [("causal", None, 0), ("self", 3, 2), ("multihead", None, 1)])
def test_backward_step_equals_autograd(mode, window, pad):
    t = trace(mode=mode)
    walk = flash_walk(t, tile=4, window=window, pad=pad, backward=True, precision="fp64")
    assert walk.checks["dS vs autograd"] <= 1e-13
    for h in range(t.heads):
        out, _, scores = _reference(t, h, window, pad)
        d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(t.seed + h), dtype=torch.float64)
        leaf = scores.clone().requires_grad_()
        (torch.softmax(leaf, -1).nan_to_num(0.0) @ _reference_values(t, h, pad)).backward(d_out)
        d_s = [s for s in walk.steps if s.name == "backward_dS" and s.head == h][0].tensor
        delta = [s for s in walk.steps if s.name == "backward_delta" and s.head == h][0].tensor
        assert torch.allclose(d_s, leaf.grad.nan_to_num(0.0), atol=1e-13, rtol=0)
        assert torch.allclose(delta, (d_out * out).sum(-1), atol=1e-13, rtol=0)


def _reference_values(t, h, pad):
    v = t.step("values", h).tensor.double()
    return torch.cat([v, v.new_zeros(pad, v.shape[1])])


# ----------------------------------------------------------------------------- sparse
@pytest.mark.parametrize("mode, topk", [("causal", 3), ("self", 4), ("multihead", 2), ("causal", 50)])
def test_sparse_walk_keeps_the_indexers_topk_and_attends_over_them(mode, topk):
    t = trace(mode=mode)
    walk = sparse_walk(t, topk=topk, precision="fp64")
    n = len(t.tokens)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(t.seed)
        indexer = LightningIndexer(t.d_model, heads=2, head_dim=4, topk=topk).double()
    scores = indexer.scores(t.step("embeddings").tensor.double()[None])[0].detach()  # (T, T)
    visible = torch.ones(n, n, dtype=torch.bool).tril() if t.causal else torch.ones(n, n, dtype=torch.bool)
    for i in range(n):
        k = min(topk, int(visible[i].sum()))
        best = set(torch.topk(scores[i].masked_fill(~visible[i], float("-inf")), k).indices.tolist())
        assert set(torch.nonzero(walk.kept[i]).flatten().tolist()) == best or _ties(scores[i], best, walk.kept[i])
    for h in range(t.heads):
        q, k, v = (t.step(name, h).tensor.double() for name in ("queries", "keys", "values"))
        s = (q @ k.T / math.sqrt(k.shape[-1])).masked_fill(~walk.kept, float("-inf"))
        expected = torch.softmax(s, -1) @ v
        assert torch.allclose(walk.output[:, h * t.d_v:(h + 1) * t.d_v], expected, atol=1e-12, rtol=0)
    assert walk.checks["output vs attnlab.attention(indices=)"] <= 1e-12
    dense_differs = walk.checks["output vs dense (what top-k changes)"]
    assert (dense_differs <= 1e-12) == bool(walk.kept.sum() == visible.sum())


def _ties(row, best, kept) -> bool:
    """Equal scores may pick either key: the kept set then has the same scores as topk's."""
    chosen = torch.nonzero(kept).flatten().tolist()
    return sorted(row[chosen].tolist()) == sorted(row[list(best)].tolist())


def test_sparse_walk_fp32_equals_the_library_within_1e6():
    walk = sparse_walk(trace(mode="causal"), topk=3)
    assert walk.checks["output vs attnlab.attention(indices=)"] <= 1e-6


# ----------------------------------------------------------------------------- linear
def _parallel(q, k, v, log_decay):
    """o_t = sum_{s<=t} (prod_{r=s+1..t} g_r) (q_t . k_s) v_s / sqrt(d), written as loops."""
    n = q.shape[0]
    out = torch.zeros(n, v.shape[1], dtype=q.dtype)
    for i in range(n):
        for j in range(i + 1):
            gate = 1.0 if log_decay is None else math.exp(float(log_decay[j + 1:i + 1].sum()))
            out[i] += gate * float(q[i] @ k[j]) * v[j]
    return out / math.sqrt(k.shape[-1])


def _seeded_gates(t):
    generator = torch.Generator().manual_seed(t.seed)
    log_decay = -(0.05 + 0.45 * torch.rand(t.heads, len(t.tokens), generator=generator, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(t.heads, len(t.tokens), generator=generator, dtype=torch.float64))
    return log_decay, beta


@pytest.mark.parametrize("rule", ["additive", "decay"])
@pytest.mark.parametrize("mode", ["self", "multihead"])
def test_linear_walk_equals_the_parallel_form(rule, mode):
    t = trace(mode=mode)
    walk = linear_walk(t, rule=rule, precision="fp64")
    log_decay, _ = _seeded_gates(t)
    for h in range(t.heads):
        q, k, v = (t.step(name, h).tensor.double() for name in ("queries", "keys", "values"))
        expected = _parallel(q, k, v, log_decay[h] if rule == "decay" else None)
        assert torch.allclose(walk.output[:, h * t.d_v:(h + 1) * t.d_v], expected, atol=1e-12, rtol=0)
    assert walk.checks["output vs parallel form"] <= 1e-12
    fp32 = linear_walk(t, rule=rule)
    assert fp32.checks["output vs parallel form"] <= 1e-6 * max(1.0, float(fp32.output.abs().max()))  # relative


@pytest.mark.parametrize("rule", ["additive", "decay", "delta", "gated-delta"])
def test_linear_walk_equals_linear_attention_and_its_final_state(rule):
    t = trace(mode="multihead", heads=2)
    walk = linear_walk(t, rule=rule, precision="fp64")
    log_decay, beta = _seeded_gates(t)
    delta, decays = "delta" in rule, rule in ("decay", "gated-delta")
    for h in range(t.heads):
        q, k, v = (t.step(name, h).tensor.double() for name in ("queries", "keys", "values"))
        if delta:
            q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        out, state = attnlab.linear_attention(q[None, None], k[None, None], v[None, None], return_state=True,
                                              decay=log_decay[h][None, None] if decays else None,
                                              beta=beta[h][None, None] if delta else None, backend="reference")
        assert torch.allclose(walk.output[:, h * t.d_v:(h + 1) * t.d_v], out[0, 0], atol=1e-12, rtol=0)
        last = [s for s in walk.steps if s.name == "state" and s.head == h][-1].tensor
        assert torch.allclose(last, state[0, 0], atol=1e-12, rtol=0)
    assert walk.checks["output vs attnlab.linear_attention"] <= 1e-12


def test_delta_rule_corrections_are_what_the_state_mispredicts():
    t = trace(SHORT)
    walk = linear_walk(t, rule="delta", precision="fp64")
    states = [s.tensor for s in walk.steps if s.name == "state"]
    corrections = [s for s in walk.steps if s.name == "corrections"][0].tensor
    k = t.step("keys").tensor.double()
    k = k / k.norm(dim=-1, keepdim=True)
    v = t.step("values").tensor.double()
    previous = [torch.zeros_like(states[0])] + states[:-1]
    for i in range(len(t.tokens)):
        assert torch.allclose(corrections[i], v[i] - previous[i].T @ k[i], atol=1e-13, rtol=0)


# ----------------------------------------------------------------------------- refusals (API)
@pytest.mark.parametrize("call, error, words", [
    (lambda: flash_walk("not a trace"), TypeError, "Trace"),
    (lambda: flash_walk(trace(SHORT), tile=0), ValueError, "tile"),
    (lambda: flash_walk(trace(SHORT), tile=True), TypeError, "tile"),
    (lambda: flash_walk(trace(SHORT), tile=2.5), TypeError, "tile"),
    (lambda: flash_walk(trace(SHORT), pad=1.0), TypeError, "pad"),
    (lambda: sparse_walk(trace(SHORT), topk=None), TypeError, "topk"),
    (lambda: flash_walk(trace(SHORT), window=0), ValueError, "window"),
    (lambda: flash_walk(trace(SHORT), pad=-1), ValueError, "pad"),
    (lambda: flash_walk(trace(SHORT), precision="fp16"), ValueError, "precision"),
    (lambda: flash_walk(trace(SHORT, dropout_p=0.5)), ValueError, "dropout"),
    (lambda: flash_walk(trace(SHORT, sinks=0.0)), ValueError, "sinks"),
    (lambda: sparse_walk(trace(SHORT), topk=0), ValueError, "topk"),
    (lambda: sparse_walk(trace(SHORT, mode="cross")), ValueError, "cross"),
    (lambda: linear_walk(trace(SHORT), rule="mamba"), ValueError, "rule"),
    (lambda: blocks_share(linear_walk(trace(SHORT))), ValueError, "flash walk"),
    (lambda: linear_walk(trace(SHORT, mode="cross")), ValueError, "cross"),
])
def test_walks_refuse_bad_inputs(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_a_one_word_sentence_is_one_tile():
    walk = flash_walk(trace("Hello", mode="causal"), tile=4)
    assert walk.visited == 1 and walk.skipped == 0 and walk.checks["output vs textbook"] <= 1e-6
    assert linear_walk(trace("Hello")).checks["output vs parallel form"] <= 1e-6


# ----------------------------------------------------------------------------- the report
def test_report_draws_the_tile_grid_and_the_walk_steps():
    t = trace(SHORT, mode="causal")
    walk = flash_walk(t, tile=2)
    page = build_report(t, walk=walk)
    assert 'class="tilegrid"' in page and "Beside the textbook" in page
    cells = page.count('class="t ')
    assert cells == len(walk.tokens) * len(walk.context_tokens)
    assert page.count('class="t skipped') == sum(row.count(".") for row in grid_rows(walk))
    assert 'data-step="tile_4_2_stats"' in page and "http" not in page
    sparse = build_report(t, walk=sparse_walk(t, topk=2))
    assert 'data-step="kept"' in sparse and "tilegrid" not in sparse


# ----------------------------------------------------------------------------- the command
def _run(*args):
    return runner.invoke(app, ["explain", *args])


def test_flash_command_prints_the_walk_and_the_skipped_count_of_chunked(tmp_path):
    result = _run("--walk", "flash", "--mode", "causal", "--tile", "4", "--window", "3", "--pad", "2",
                  "--out", str(tmp_path), "--no-color")
    assert result.exit_code == 0, result.output
    t = trace(mode="causal")
    n = len(t.tokens) + 2
    mod = flash_mask(t, window=3, pad=2)
    skipped = len(_chunked_visits(n, n, None, 4)) - len(_chunked_visits(n, n, mod, 4))
    assert re.search(rf"tiles of 4: \d+ of 16 computed \(\d+ partial\), {skipped} skipped", result.output)
    differences = [float(x) for x in re.findall(r"output vs textbook: (\S+)", result.output)]
    assert differences and differences[0] <= 1e-6
    assert "Tile scores" in result.output and "m_new" in result.output and "<pad>" in result.output
    assert "queries 12-13 reach keys 10-13 (keys 0-9 skipped: never read)" in result.output
    assert 'class="tilegrid"' in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize("args, words", [
    (("--walk", "sparse", "--topk", "3", "--mode", "causal"), ("Kept keys", "attnlab.attention(indices=)")),
    (("--walk", "linear", "--rule", "gated-delta"), ("State  S_0", "correction", "linear_attention")),
    (("--walk", "flash", "--backward", "--precision", "fp64"), ("dS = P", "dS vs autograd")),
    (("--walk", "flash", "--tile", "4", "--pad", "2"), ("queries 12-13 reach keys 0-13\n",
                                                        "keys 12-13: skipped (its mask allows nothing)")),
])
def test_each_walk_runs_from_the_command(args, words, tmp_path):
    result = _run(*args, "--out", str(tmp_path), "--no-color", "--format", "html")
    assert result.exit_code == 0, result.output
    for word in words:
        assert word in result.output
    assert (tmp_path / "report.html").stat().st_size > 1000


def test_textbook_walk_is_the_default(tmp_path):
    plain = _run("--out", str(tmp_path), "--format", "html", "--no-color").output
    named = _run("--walk", "textbook", "--out", str(tmp_path), "--format", "html", "--no-color").output
    assert plain == named and "Attention weights" in plain


@pytest.mark.parametrize("args, words", [
    (("--walk", "fast"), ("--walk must be one of", "'fast'")),
    (("--walk", "flash", "--tile", "0"), ("--tile",)),
    (("--walk", "flash", "--tile", "x"), ("--tile",)),
    (("--walk", "flash", "--tile", "100000"), ("--tile",)),
    (("--walk", "flash", "--window", "0"), ("--window",)),
    (("--walk", "flash", "--pad", "-1"), ("--pad",)),
    (("--walk", "flash", "--pad", "1000"), ("--pad",)),
    (("--walk", "sparse", "--topk", "0"), ("--topk",)),
    (("--walk", "linear", "--rule", "mamba"), ("--rule must be one of", "'mamba'")),
    (("--walk", "flash", "--precision", "fp16"), ("--precision must be one of",)),
    (("--tile", "4"), ("--tile is for --walk flash",)),
    (("--window", "4"), ("--window is for --walk flash",)),
    (("--pad", "1"), ("--pad is for --walk flash",)),
    (("--backward",), ("--backward is for --walk flash",)),
    (("--walk", "flash", "--topk", "3"), ("--topk is for --walk sparse",)),
    (("--walk", "sparse", "--rule", "delta"), ("--rule is for --walk linear",)),
    (("--walk", "linear", "--tile", "2"), ("--tile is for --walk flash",)),
    (("--precision", "fp64"), ("--precision is for --walk",)),
    (("--walk", "flash", "--dropout", "0.1"), ("--walk flash redoes plain attention", "--dropout")),
    (("--walk", "sparse", "--softcap", "5"), ("--softcap",)),
    (("--walk", "linear", "--sinks"), ("--sinks",)),
    (("--walk", "sparse", "--mode", "cross"), ("--walk sparse", "cross")),
    (("--walk", "linear", "--mode", "cross"), ("--walk linear", "cross")),
    (("--walk", "flash", "--model", "minilm"), ("--walk is for the tutorial walk",)),
    (("--walk", "flash", "--format", "png"), ("--format html or all",)),
    (("--walk", "linear", "--format", "svg"), ("--format html or all",)),
    (("--walk", "flash", "--tile", "1", "--text-file", "MANY"), ("tiles of --tile 1", "at most 1024")),
    # regression: --mask drew its map and silently ignored the walk's options
    (("--mask", "causal", "--size", "64", "--walk", "flash"), ("--walk is for a sentence's walk, not --mask",)),
    (("--mask", "causal", "--size", "64", "--heads", "2"), ("--heads is for a sentence's walk",)),
    (("--mask", "causal", "--size", "64", "--tile", "4"), ("--tile is for a sentence's walk",)),
    (("--mask", "causal", "--size", "64", "--model", "minilm"), ("--model is for a sentence's walk",)),
    (("The cat sat", "--mask", "causal", "--size", "64"), ("SENTENCE is for a sentence's walk",)),
])
def test_every_walk_option_refuses_a_bad_value_on_one_line(args, words, tmp_path):
    out = tmp_path / "report"
    if "MANY" in args:  # 40 words: 1600 tiles of one
        (tmp_path / "many.txt").write_text(" ".join(f"w{i}" for i in range(40)))
        args = tuple(str(tmp_path / "many.txt") if a == "MANY" else a for a in args)
    assert_one_error_line(_run(*args, "--out", str(out)), *words)
    assert not out.exists()


# ----------------------------------------------------------------------------- the docs
def test_the_docs_python_example_runs_and_prints_what_it_says(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "explain.md").read_text()
    section = text[text.index("## The fast paths"):text.index("## In a notebook")]
    code = section.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/explain.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "tiles of 4: 6 of 16 computed (6 partial), 10 skipped"
    assert printed[1] == "True"
    assert printed[2].startswith("[(0, 0, 'partial'), (4, 2, 'partial'), ")
    assert printed[3].startswith("[1, 2, 3, 3, ")
    assert printed[4].startswith("{'output vs attnlab.linear_attention': ")
    assert 'class="tilegrid"' in (tmp_path / "report.html").read_text()


# ----------------------------------------------------------------------------- highlighting the focus
def _highlighted_rows(page: str, step: str) -> list[str]:
    card = page.split(f'data-step="{step}"')[1].split("</section>")[0]
    return re.findall(r'<tr(?: data-row="\d+")? class="hl"><th>([^<]*)</th>', card)


def test_the_focused_token_is_highlighted_in_its_own_row_of_a_tile():
    t = trace(SHORT, mode="causal")
    walk = flash_walk(t, tile=2)
    page = build_report(t, focus=3, walk=walk)  # "in": row 1 of the tiles of queries 2-3
    assert _highlighted_rows(page, "tile_2_0_scores") == ["in"]
    assert _highlighted_rows(page, "tile_0_0_scores") == []  # queries 0-1: not the focus
    assert 'data-row="3"' in page.split('data-step="tile_2_2_stats"')[1].split("</section>")[0]


def test_weight_matrices_and_states_highlight_no_row():
    """Regression: W_q's rows are embedding features, yet the row of the focus's index was highlighted."""
    t = trace(SHORT)
    page = build_report(t, focus=1)
    assert _highlighted_rows(page, "W_q") == [] and _highlighted_rows(page, "queries") == ["sun"]
    linear = build_report(t, focus=1, walk=linear_walk(t))
    assert _highlighted_rows(linear.split("--walk linear")[-1], "state") == []


def test_a_walk_shows_itself_in_a_notebook_with_ids_of_its_own():
    walk = flash_walk(trace(SHORT, mode="causal"), tile=2)
    a, b = walk._repr_html_(), walk._repr_html_()
    assert a.startswith('<div class="attnlab inline"') and 'class="tilegrid"' in a
    ids = lambda page: set(re.findall(r' id="([^"]+)"', page))  # noqa: E731
    assert ids(a) and not ids(a) & ids(b)
