"""The blocks backend against the fp64 reference: forward, gradients, lse, declines, dispatch.

The oracle is the reference backend in fp64 (explicit softmax over the full score matrix with the
materialised mask). The blocks backend also runs in fp64 here, so the two agree to rounding
(1e-10); tiny block sizes make every configuration span several query blocks.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.lab import verify
from attnlab.backends import build_call, dispatch, get, reasons, select
from attnlab.backends.blocks import block_spans, blocks_attention, visited_fraction


def _inputs(b, hq, hkv, tq, tk, d, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, dv, generator=gen, dtype=torch.float64)
    d_out = torch.randn(b, hq, tq, dv, generator=gen, dtype=torch.float64)
    return q, k, v, d_out


def _mod(kind, b, tq, tk, align, gen):
    """A mask mod with bounds of the given kind (windows wider than T included)."""
    if kind == "causal":
        return None
    if kind == "window":
        return masks.sliding_window_mod(tq, tk, int(torch.randint(1, 2 * max(tq, tk) + 2, (), generator=gen)),
                                        align=align)
    if kind == "window_padding":  # padding of length 0 leaves whole rows dead
        window = masks.sliding_window_mod(tq, tk, int(torch.randint(1, 9, (), generator=gen)), align=align)
        return masks.and_masks(window, masks.padding_mod(torch.randint(0, tk + 1, (b,), generator=gen)))
    if kind == "lambda_and_causal":  # a bounds-less part ANDed with causal keeps causal's bounds
        return lambda bb, h, i, j: (i + j) % 3 != 1
    if kind == "prefix":
        return masks.prefix_lm_mod(tq, tk, int(torch.randint(0, tk + 1, (), generator=gen)), align=align)
    if kind == "chunked":
        return masks.chunked_local_mod(tq, tk, int(torch.randint(1, 12, (), generator=gen)), align=align)
    if kind == "document":
        ids = torch.sort(torch.randint(0, 4, (b, max(tq, tk)), generator=gen), dim=1).values
        return masks.document_mod(ids, causal=bool(torch.randint(0, 2, (), generator=gen)))
    raise AssertionError(kind)


KINDS = ("causal", "window", "window_padding", "lambda_and_causal", "prefix", "chunked", "document")


def _config(seed):
    gen = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(0, len(options), (), generator=gen))]  # noqa: E731
    hkv, groups = pick((1, 2, 3)), pick((1, 1, 2))
    tq, tk = int(torch.randint(1, 40, (), generator=gen)), int(torch.randint(1, 40, (), generator=gen))
    if seed % 3 == 0:
        tk = tq
    kind = KINDS[seed % len(KINDS)]
    align = pick(("top_left", "bottom_right"))
    d = pick((1, 3, 8, 16))
    dv = d if seed % 2 else pick((2, 5, 8))
    b = pick((1, 2))
    mod = _mod(kind, b, tq, tk, align, gen)
    causal = kind in ("causal", "lambda_and_causal") or bool(torch.randint(0, 2, (), generator=gen))
    block = pick((1, 4, 7, 16, 256))
    return dict(shape=(b, hkv * groups, hkv, tq, tk, d, dv), mask=mod, causal=causal, align=align,
                block=block, kind=kind)


def _run(cfg, backend, seed):
    q, k, v, d_out = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_inputs(*cfg["shape"], seed)))
    call = build_call(q, k, v, mask=cfg["mask"], causal=cfg["causal"], align=cfg["align"])
    if backend == "blocks":
        result = blocks_attention(call, block=cfg["block"])
        out, lse = result.out, result.lse
    else:
        out, lse = get("reference").forward(call).out, None
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v), allow_unused=True)
    return [out.detach(), *(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))], lse


@pytest.mark.parametrize("split", [False, True], ids=["whole-spans", "split-spans"])
@pytest.mark.parametrize("seed", range(60))
def test_forward_and_gradients_match_the_fp64_reference(seed, split, monkeypatch):
    """split: every run of fully visible keys gets its own kernel call (merged by lse)."""
    if split:
        monkeypatch.setattr("attnlab.backends.blocks._MIN_FULL_RUN", 1)
    cfg = _config(seed)
    call = build_call(*_inputs(*cfg["shape"], seed)[:3], mask=cfg["mask"], causal=cfg["causal"],
                      align=cfg["align"])
    assert reasons(call)["blocks"] == [], cfg["kind"]  # every kind here has bounds
    want, _ = _run(cfg, "reference", seed)
    have, _ = _run(cfg, "blocks", seed)
    for name, w, h in zip(("out", "dq", "dk", "dv"), want, have):
        assert torch.allclose(h, w, atol=1e-10, rtol=0), (name, cfg["kind"], cfg["shape"])


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_lse_is_the_log_sum_exp_of_the_masked_scores(seed, monkeypatch):
    monkeypatch.setattr("attnlab.backends.blocks._MIN_FULL_RUN", 1 + seed % 2)
    cfg = _config(seed)
    q, k, v, _ = _inputs(*cfg["shape"], seed)
    call = build_call(q, k, v, mask=cfg["mask"], causal=cfg["causal"], align=cfg["align"])
    scores = attnlab._math.masked_scores(call, q, attnlab._math.repeat_kv(k, call.q_heads))
    lse = blocks_attention(call, block=cfg["block"]).lse
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), atol=1e-10, rtol=0)


def test_fully_masked_rows_are_zero_with_zero_gradient():
    q, k, v, d_out = _inputs(2, 2, 1, 9, 9, 4, 4, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mod = masks.and_masks(masks.sliding_window_mod(9, 9, 3), masks.padding_mod(torch.tensor([0, 9])))
    out = attnlab.attention(q, k, v, mask=mod, backend="blocks")
    (out * d_out).sum().backward()
    assert out[0].abs().sum() == 0 and q.grad[0].abs().sum() == 0
    assert k.grad[0].abs().sum() == 0 and v.grad[0].abs().sum() == 0
    assert out[1].abs().sum() > 0


def test_return_weights_match_the_reference():
    q, k, v, _ = _inputs(1, 2, 2, 21, 21, 8, 8, seed=4)
    mod = masks.sliding_window_mod(21, 21, 5)
    _, have = attnlab.attention(q, k, v, mask=mod, backend="blocks", return_weights=True)
    _, want = attnlab.attention(q, k, v, mask=mod, backend="reference", return_weights=True)
    assert torch.allclose(have, want, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conformance_rule_in_low_precision(dtype):
    results = [verify.check("blocks", c, dtype) for c in verify.configs(40, seed=5, small=True)]
    served = [r for r in results if r.served]
    assert served and all(r.passed for r in served), [r for r in served if not r.passed][:3]


def test_verify_sweep_serves_blocks_on_most_configs_forward_and_backward():
    results = verify.sweep(["blocks"], [torch.float32], n=24, seed=1, small=True)
    served = [r for r in results if r.served and not r.grad_mode]  # grad-mode crossings: some forward only
    assert len(served) >= 20 and all(r.grad for r in served)
    assert all(r.passed for r in served)


def test_skips_blocks_outside_the_bounds():
    spans = block_spans(masks.sliding_window_mod(1000, 1000, 10), 1000, 1000, 100)
    assert all(hi - lo <= 100 + 9 for _, _, lo, hi in spans)
    q = torch.randn(1, 1, 1024, 4)
    mod = masks.sliding_window_mod(1024, 1024, 256)
    dense = masks.materialize(mod, tq=1024, tk=1024)[0, 0]
    visited = 0  # brute force: each 256-query block spans its first to its last attended key
    for qs in range(0, 1024, 256):
        cols = dense[qs:qs + 256].any(dim=0).nonzero()
        visited += 256 * int(cols.max() - cols.min() + 1)
    assert visited_fraction(build_call(q, q, q, mask=mod), block=256) == visited / 1024**2


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(mask=torch.zeros(6, 6)), "dense float mask"),
        (dict(causal=True, dropout_p=0.1), "no dropout"),
    ],
)
def test_declines_what_it_cannot_keep_exact(options, words):
    q = torch.randn(1, 1, 6, 4)
    why_not = reasons(build_call(q, q, q, **options))["blocks"]
    assert any(words in reason for reason in why_not), why_not
    with pytest.raises(ValueError, match="cannot serve"):
        attnlab.attention(q, q, q, backend="blocks", **options)


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(mask=torch.tensor([[True, False, True, True, False, True]] * 6)), "dense bool mask"),
        (dict(), "nothing to skip"),
        (dict(mask=lambda b, h, i, j: i >= j), "declares no kv_bounds"),
        (dict(mask=masks.or_masks(masks.causal_mod(6, 6), lambda b, h, i, j: i == j)), "declares no kv_bounds"),
    ],
)
def test_auto_passes_over_what_it_cannot_skip_but_named_it_serves_it(options, words):
    """Nothing to skip is a reason auto prefers another backend, not a refusal: named, blocks
    computes the call exactly (a module's decoding step; tests/test_module_backends.py)."""
    q, k, v, _ = _inputs(1, 2, 2, 6, 6, 4, 4, seed=3)
    why_not = reasons(build_call(q, k, v, **options))["blocks"]
    assert any(words in reason for reason in why_not), why_not
    got = attnlab.attention(q, k, v, backend="blocks", **options)
    want = attnlab.attention(q, k, v, backend="reference", **options)
    assert torch.allclose(got, want, atol=1e-10)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_serves_nan_inputs_and_keeps_the_nan_rule(where):
    """Dispatch reads no values: blocks serves NaN inputs and gives the reference's NaN rows."""
    q, k, v, _ = _inputs(1, 1, 1, 8, 8, 4, 4, seed=6)
    {"q": q, "k": k, "v": v}[where][0, 0, 5, 1] = float("nan")
    call = build_call(q, k, v, causal=True)
    assert reasons(call)["blocks"] == []
    out = attnlab.attention(q, k, v, causal=True, backend="blocks")
    want = attnlab.attention(q, k, v, causal=True, backend="reference")
    assert torch.equal(out.isnan(), want.isnan())


def test_auto_picks_blocks_where_it_skips_most_and_sdpa_for_dense_calls():
    q = torch.randn(1, 8, 8192, 64)
    window = build_call(q, q, q, mask=masks.sliding_window_mod(8192, 8192, 256))
    assert select(window).name == "blocks"
    assert "visits" in get("blocks").memory_use(window, words=True).note
    assert select(build_call(q, q, q)).name == "sdpa"
    short = torch.randn(1, 1, 16, 8)
    assert select(build_call(short, short, short, causal=True)).name == "sdpa"


def test_why_says_why_a_bounds_less_mod_cannot_be_skipped():
    q = torch.randn(1, 1, 6, 4)
    text = attnlab.backends.why(q, q, q, mask=lambda b, h, i, j: i >= j)
    assert "blocks: cannot serve: blocks cannot skip: the mask mod declares no kv_bounds" in text


# ----------------------------------------------------------------------------- CLI and suites
def test_backends_cli_explains_structured_masks():
    from typer.testing import CliRunner

    from attnlab.lab.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["backends", "--window", "256", "--tq", "8192"])
    q = torch.zeros(1, 8, 8192, 64)
    share = visited_fraction(build_call(q, q, q, mask=masks.sliding_window_mod(8192, 8192, 256)))
    assert result.exit_code == 0 and "runs on 'blocks'" in result.output
    assert f"visits {share:.0%}" in result.output
    result = runner.invoke(app, ["backends", "--plain-mod", "--tq", "64"])
    assert "blocks: cannot serve: blocks cannot skip" in result.output
    result = runner.invoke(app, ["backends", "--window", "3", "--documents", "2"])
    assert result.exit_code == 2 and "at most one structured mask" in result.output


def test_sparse_and_backends_suites_run_on_tiny_shapes():
    """Regression: suites.py used fill_ratios without importing it (NameError)."""
    from attnlab.lab.bench import suites

    rows = suites.sparse_suite(quick=True, lengths=(64,), rounds=1)
    assert {r.name for r in rows} >= {"auto", "blocks", "sdpa dense mask"}
    assert all(r.ratio is not None for r in rows)
    assert suites.backends_suite(quick=True, t=32, rounds=1)


# ------------------------------------------------------------------ batched kernel calls
def _counting(monkeypatch):
    """Count the fused kernel's forward and backward calls made by the blocks backend."""
    from attnlab.backends import blocks

    counts = {"forward": 0, "backward": 0}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(blocks, "_FLASH", wrap("forward", blocks._FLASH))
    monkeypatch.setattr(blocks, "_FLASH_BACKWARD", wrap("backward", blocks._FLASH_BACKWARD))
    return counts


BATCHED_CASES = {
    # name: (B, Hq, Hkv, T, D, Dv, mask mod builder, causal); T=203 is no multiple of the block
    "window": (1, 2, 2, 203, 8, 8, lambda t, b: masks.sliding_window_mod(t, t, 24), False),
    "window_gqa_dv": (2, 4, 2, 203, 8, 5, lambda t, b: masks.sliding_window_mod(t, t, 9), False),
    "chunked": (2, 2, 1, 203, 4, 4, lambda t, b: masks.chunked_local_mod(t, t, 32), False),
    "chunked_bidirectional": (1, 3, 3, 160, 8, 8,
                              lambda t, b: masks.chunked_local_mod(t, t, 48, causal=False), False),
    "causal": (2, 2, 2, 203, 8, 8, lambda t, b: None, True),
    "documents": (2, 4, 1, 203, 8, 6,
                  lambda t, b: masks.document_mod(torch.arange(t).repeat(b, 1) // 40), False),
    "window_padding": (2, 2, 2, 203, 8, 8, lambda t, b: masks.and_masks(
        masks.sliding_window_mod(t, t, 20), masks.padding_mod(torch.tensor([150, 0]))), False),
}


@pytest.mark.parametrize("name", sorted(BATCHED_CASES))
def test_batched_calls_equal_one_call_per_piece_and_the_fp64_reference(name, monkeypatch):
    """Grouping same-shaped pieces into one kernel call changes nothing but the call count."""
    from attnlab.backends import blocks

    b, hq, hkv, t, d, dv, make_mod, causal = BATCHED_CASES[name]
    cfg = dict(shape=(b, hq, hkv, t, t, d, dv), mask=make_mod(t, b), causal=causal, align="top_left",
               block=16)
    counts = _counting(monkeypatch)
    batched, _ = _run(cfg, "blocks", seed=7)
    batched_calls = dict(counts)
    monkeypatch.setattr("attnlab.backends.blocks._progressions", lambda pieces: [[p] for p in pieces])
    dispatch.clear_plans()  # plan afresh: the routes hold the plans of tensor-free mods
    counts.update(forward=0, backward=0)
    per_piece, _ = _run(cfg, "blocks", seed=7)
    want, _ = _run(cfg, "reference", seed=7)
    # it did batch (causal alone is one causal square: one call either way)
    assert batched_calls["forward"] < counts["forward"] or counts["forward"] == 1, (batched_calls, counts)
    assert batched_calls["backward"] == batched_calls["forward"]
    for label, w, p, h in zip(("out", "dq", "dk", "dv"), want, per_piece, batched):
        assert torch.allclose(h, p, atol=1e-12, rtol=0), (name, label)
        assert torch.allclose(h, w, atol=1e-10, rtol=0), (name, label)


def test_a_sliding_window_makes_the_same_few_kernel_calls_at_any_length(monkeypatch):
    """O(1) calls, not O(T / block): the interior blocks of a window share one call."""
    counts = _counting(monkeypatch)
    calls = {}
    for t in (2048, 4096):
        q = torch.randn(1, 1, t, 8, requires_grad=True)
        out = attnlab.attention(q, q, q, mask=masks.sliding_window_mod(t, t, 256), backend="blocks")
        out.sum().backward()
        calls[t] = dict(counts)
        counts.update(forward=0, backward=0)
    assert calls[2048] == calls[4096], calls
    assert calls[4096]["forward"] <= 6 and calls[4096]["backward"] <= 6, calls


def test_a_mask_written_through_numpy_gets_a_new_plan():
    """Regression: plans were keyed on the tensors' ``_version``, which a numpy write keeps."""
    q, k, v, _ = _inputs(2, 2, 2, 40, 40, 4, 4, seed=9)
    lengths = torch.tensor([40, 30])
    mod = masks.and_masks(masks.sliding_window_mod(40, 40, 8), masks.padding_mod(lengths))
    blocks_attention(build_call(q, k, v, mask=mod), block=8)
    lengths.numpy()[1] = 5  # _version unchanged
    have = blocks_attention(build_call(q, k, v, mask=mod), block=8).out
    want = get("reference").forward(build_call(q, k, v, mask=mod)).out
    assert torch.allclose(have, want, atol=1e-10)


def test_a_prepared_mask_is_planned_once_and_is_a_snapshot(monkeypatch):
    """A prepared mask keeps its plan (planned on the first call only); an unprepared mod with
    tensors is planned on every call, so editing its ids in place is seen; editing them after
    preparing changes nothing the prepared mask computes."""
    from attnlab.backends import blocks

    plans = []
    real = blocks._plan_runs
    monkeypatch.setattr(blocks, "_plan_runs", lambda *a: plans.append(1) or real(*a))
    q, k, v, _ = _inputs(1, 2, 2, 40, 40, 4, 4, seed=8)
    ids = torch.arange(40) // 10
    mod = masks.document_mod(ids)
    prepared = masks.prepare(mod, tq=40, tk=40)
    first = blocks_attention(build_call(q, k, v, mask=prepared), block=8).out
    again = blocks_attention(build_call(q, k, v, mask=prepared), block=8).out
    assert len(plans) == 1 and torch.equal(first, again)
    want = get("reference").forward(build_call(q, k, v, mask=masks.document_mod(ids.clone()))).out
    assert torch.allclose(first, want, atol=1e-10)
    ids[15:] = 9  # documents 1-3 become one document: the mod's bounds follow the edit
    assert torch.equal(blocks_attention(build_call(q, k, v, mask=prepared), block=8).out, first)  # a snapshot
    have = blocks_attention(build_call(q, k, v, mask=mod), block=8).out
    edited = get("reference").forward(build_call(q, k, v, mask=mod)).out
    assert torch.allclose(have, edited, atol=1e-10) and not torch.allclose(have, first)
    assert len(plans) == 2  # the prepared mask's plan kept; the mod planned afresh
    blocks_attention(build_call(q, k, v, mask=masks.and_masks(mod, lambda b, h, i, j: i >= j)), block=8)
    assert len(plans) == 3  # a user's function is planned on every call


def test_block_size_follows_the_cost_model_and_auto_keeps_plain_causal_on_sdpa():
    from attnlab.backends.blocks import choose_block

    for grad in (False, True):
        q = torch.randn(1, 8, 8192, 64, requires_grad=grad)
        window = build_call(q, q, q, mask=masks.sliding_window_mod(8192, 8192, 256))
        causal = build_call(q, q, q, causal=True)
        assert select(window).name == "blocks" and select(causal).name == "sdpa"
        assert choose_block(window) == (128 if grad else 32)  # short spans: small blocks
        assert choose_block(causal) == 256


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_nan_scan_is_exact_when_the_sum_of_finite_values_overflows(dtype):
    """The ring's fused-piece check reads a sum first; finite values whose sum overflows are finite."""
    from attnlab.distributed.ring import _all_finite
    big = torch.full((1, 1, 4, 4), torch.finfo(dtype).max / 2, dtype=dtype)
    assert _all_finite(big)
    for bad_value in (float("inf"), float("-inf"), float("nan")):
        bad = big.clone()
        bad[0, 0, 2, 3] = bad_value
        assert not _all_finite(bad)


# ------------------------------------------------------------------ causal squares
SQUARE_CASES = {
    # name: (T, mask mod builder, align, forward calls); block 16 throughout
    "equal documents": (240, lambda t: masks.document_mod(torch.arange(t) // 48), "top_left", 1),
    "two document lengths": (240, lambda t: masks.document_mod(
        torch.repeat_interleave(torch.arange(6), torch.tensor([48, 32, 48, 32, 48, 32]))), "top_left", 2),
    "chunks": (256, lambda t: masks.chunked_local_mod(t, t, 64), "top_left", 1),
    "prefix-LM": (256, lambda t: masks.prefix_lm_mod(t, t, 64), "top_left", 3),
    "window": (256, lambda t: masks.sliding_window_mod(t, t, 64), "top_left", 2),
    "causal, Tq < Tk": (96, lambda t: masks.causal_mod(t, t + 64, align="bottom_right"), "bottom_right", 2),
}


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("name", sorted(SQUARE_CASES))
def test_query_blocks_that_see_keys_from_one_start_to_the_diagonal_run_as_one_causal_call(name, kv_heads,
                                                                                          monkeypatch):
    """A document, a chunk, the rows after a prefix or a window's first rows: one causal square
    (and at most one fully visible run before it), the same shapes stacked, exact in fp64, with
    grouped heads (blocks on the kernel's batch axis) and without (on its head axis; one run
    over every row is the output and the gradients as the kernel wrote them)."""
    t, make_mod, align, calls = SQUARE_CASES[name]
    tk = t + 64 if align == "bottom_right" else t
    cfg = dict(shape=(2, 4, kv_heads, t, tk, 8, 8), mask=make_mod(t), causal=False, align=align, block=16)
    counts = _counting(monkeypatch)
    have, _ = _run(cfg, "blocks", seed=11)
    want, _ = _run(cfg, "reference", seed=11)
    assert counts == {"forward": calls, "backward": calls}, counts
    for label, w, h in zip(("out", "dq", "dk", "dv"), want, have):
        assert torch.allclose(h, w, atol=1e-10, rtol=0), (name, label)


def test_nan_query_rows_stay_nan_through_dead_pieces_and_merges():
    """Without an output pass: a NaN query row is NaN in every run reading it and in the merge
    (padding leaves rows dead in some pieces; a window splits rows over several pieces)."""
    q, k, v, _ = _inputs(2, 2, 1, 300, 300, 16, 16, seed=5)
    rows = [0, 3, 63, 64, 100, 129, 200]
    q[1, 1, rows, 5] = float("nan")
    q[0, 0, 77, 2] = float("inf")
    mod = masks.and_masks(masks.sliding_window_mod(300, 300, 40), masks.padding_mod(torch.tensor([300, 250])))
    for dtype in (torch.float32, torch.bfloat16):
        out = attnlab.attention(*(t.to(dtype) for t in (q, k, v)), mask=mod, backend="blocks")
        assert out[1, 1, rows].isnan().all() and out[0, 0, 77].isnan().all()
        assert not out[0, 1].isnan().any() and not out[1, 0].isnan().any()
