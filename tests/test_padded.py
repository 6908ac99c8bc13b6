"""Padded batches: causal with a key mask, padding_mod and transformers' causal+padding mask run as
SDPA calls on each row's real keys (sdpa's "segments" source), exact against fp64 math in outputs
and gradients, with zero rows (and zero gradients) where a query has no real key to see."""

import copy

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import backends, masks
from attnlab.backends import _segments, build_call, dispatch
from attnlab.backends.rates import RATES
from attnlab.backends import sdpa as sdpa_module
from attnlab.backends.sdpa import sdpa_plan


def _fp64(q, k, v, allowed, scale=None):
    """softmax(q k^T * scale) v in fp64 over ``allowed`` (B, 1, Tq, Tk); rows with no key give 0."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    alive = allowed.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")).masked_fill(~alive, 0.0), dim=-1)
    return (weights * alive) @ v


def _real_keys(lengths, t, *, left):
    index = torch.arange(t)
    return index >= t - lengths[:, None] if left else index < lengths[:, None]  # (B, T)


@pytest.fixture
def counted(monkeypatch):
    """How many calls ran as segments (not the dense fallback); segments from 64 queries, so
    that small fp64-checked batches take them (the default starts at 512)."""
    monkeypatch.setitem(RATES["sdpa"], "segments_min_queries", 64)
    seen = []
    real = _segments.run_groups
    monkeypatch.setattr(_segments, "run_groups", lambda *args: seen.append(1) or real(*args))
    return seen


T = 160  # large enough that the segments' estimate beats a dense mask
LENGTHS = torch.tensor([0, 37, T, 100])  # an empty row, a short one, a full one


def _forms(lengths, *, left):
    keys = _real_keys(lengths, T, left=left)
    causal_keys = masks.causal_mask(T, T) & keys[:, None, :]  # (B, T, T)
    forms = {"key mask + causal": dict(mask=keys[:, None, None, :], causal=True),
             "transformers 4-D": dict(mask=causal_keys[:, None])}
    if not left:
        forms["padding_mod + causal"] = dict(mask=masks.padding_mod(lengths), causal=True)
        forms["padding_mod & causal_mod"] = dict(mask=masks.padding_mod(lengths) & masks.causal_mod(T, T))
    return forms, causal_keys[:, None]


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_every_padded_form_runs_as_segments_and_equals_fp64(left, counted):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, T, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(4, 2, T, 16, generator=gen, requires_grad=True) for _ in range(2))  # grouped heads
    forms, allowed = _forms(LENGTHS, left=left)
    grad_out = torch.randn(4, 4, T, 16, generator=gen)
    want = _fp64(q, k, v, allowed, scale=0.3)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out.double())
    for name, options in forms.items():
        call = build_call(q, k, v, scale=0.3, **options)
        assert sdpa_plan(call).mask_source == "segments" and backends.select(call).name == "sdpa", name
        assert "chosen (sdpa's rule claims padded batches)" in backends.why(q, k, v, scale=0.3, **options)
        before = len(counted)
        out = attnlab.attention(q, k, v, scale=0.3, **options)
        assert len(counted) == before + 1, name
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-4)
        dead = ~allowed.any(-1)[:, 0]  # (B, T): queries with no real key to see
        assert out[dead.nonzero(as_tuple=True)[0], :, dead.nonzero(as_tuple=True)[1]].abs().max() == 0
        assert grads[0][0].abs().max() == 0  # the empty row: zero gradient


def test_padding_mod_without_causal_sees_every_real_key(counted):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 2, T, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = attnlab.attention(q, k, v, mask=masks.padding_mod(LENGTHS))
    allowed = _real_keys(LENGTHS, T, left=False)[:, None, None, :].expand(4, 1, T, T)
    torch.testing.assert_close(out, _fp64(q, k, v, allowed))
    assert counted == [1]


def test_rows_with_equal_spans_run_as_one_call():
    groups = _segments.plan_bands([(0, 5), (0, 9), (0, 5), (2, 9)], causal=True, tq=9)
    assert [g.rows for g in groups] == [(0, 2), (1,), (3,)]
    assert groups[2].bands == (("zero", 0, 2, 0, 0), ("causal", 2, 9, 2, 9))
    assert groups[0].bands == (("causal", 0, 5, 0, 5), ("full", 5, 9, 0, 5))


def test_rows_are_returned_in_batch_order_when_groups_interleave():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 1, 6, 4, generator=gen, dtype=torch.float64)
    groups = _segments.plan_bands([(0, 4), (0, 6), (0, 4)], causal=True, tq=6)
    out = _segments.run_groups(q, q, q, [groups[1], groups[0]], {})  # the later group first
    allowed = masks.causal_mask(6, 6) & _real_keys(torch.tensor([4, 6, 4]), 6, left=False)[:, None, :]
    torch.testing.assert_close(out, _fp64(q, q, q, allowed[:, None]))


@pytest.fixture
def beside(monkeypatch):
    """How many calls ran as one fused op with the key mask beside is_causal."""
    seen = []
    real = sdpa_module._keys_beside_causal
    monkeypatch.setattr(sdpa_module, "_keys_beside_causal", lambda *args: seen.append(1) or real(*args))
    return seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_key_mask_beside_causal_is_one_fused_call_without_a_square_mask(beside, counted, dtype):
    """Holes in the keys (no spans), grouped heads, transposed views (MultiHeadAttention's
    layout), more keys than queries (top-left), an empty row: one call of the CPU flash op
    with its own is_causal and the keys as a (B, 1, 1, Tk) additive mask, exact with zero rows."""
    gen = torch.Generator().manual_seed(3)
    tq, tk = 48, 64
    q = torch.randn(3, tq, 4, 8, generator=gen).to(dtype).transpose(1, 2).requires_grad_(True)  # (B, H, T, D) view
    k, v = (torch.randn(3, 2, tk, 8, generator=gen).to(dtype).requires_grad_(True) for _ in range(2))
    holes = torch.rand(3, tk, generator=gen) > 0.3
    holes[2] = False  # a row with no key
    out = attnlab.attention(q, k, v, mask=holes[:, None, None, :], causal=True)
    allowed = (masks.causal_mask(tq, tk) & holes[:, None, :])[:, None]
    want = _fp64(q, k, v, allowed)
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out.double(), want, **tolerance)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for got, expected in zip(grads, torch.autograd.grad(want, (q, k, v), torch.ones_like(want))):
        torch.testing.assert_close(got.double(), expected.double(), **tolerance)
    assert out[2].abs().max() == 0 and grads[0][2].abs().max() == 0
    assert len(beside) == 1 and counted == []


def test_a_key_mask_with_holes_or_a_small_batch_takes_one_fused_call_and_stays_exact(counted, beside):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, T, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    holes = torch.rand(2, T, generator=gen) > 0.3
    out = attnlab.attention(q, k, v, mask=holes[:, None, None, :], causal=True)
    torch.testing.assert_close(out, _fp64(q, k, v, (masks.causal_mask(T, T) & holes[:, None, :])[:, None]))
    small = _real_keys(torch.tensor([3, 8]), 8, left=False)
    out = attnlab.attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], mask=small[:, None, None, :], causal=True)
    torch.testing.assert_close(out, _fp64(q[..., :8, :], k[..., :8, :], v[..., :8, :],
                                          (masks.causal_mask(8, 8) & small[:, None, :])[:, None]))
    assert counted == [] and len(beside) == 2  # both went to one fused call


def test_a_4d_mask_of_another_shape_is_passed_as_given(counted):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, T, 8, generator=gen) for _ in range(3))
    window = masks.sliding_window_mask(T, T, 16)[None, None]  # causal, but not causal AND one key run
    assert _segments.causal_key_mask(window) is None
    out = attnlab.attention(q, k, v, mask=window)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=window))
    assert counted == []


def test_an_all_empty_batch_gives_zeros_and_a_backward_that_runs():
    q = torch.randn(2, 2, T, 8, requires_grad=True)
    out = attnlab.attention(q, q, q, mask=masks.padding_mod(torch.tensor([0, 0])), causal=True)
    out.sum().backward()
    assert out.abs().max() == 0 and q.grad.abs().max() == 0


def test_padded_keys_are_never_read(counted, monkeypatch):
    """The segments see only real keys: a NaN in a padded key cannot reach any output."""
    monkeypatch.setattr(_segments, "cheaper_than_dense", lambda groups, **sizes: True)
    q, k, v = (torch.randn(2, 2, T, 8) for _ in range(3))
    k[1, :, 100:] = float("nan")
    v[1, :, 100:] = float("nan")
    out = attnlab.attention(q, k, v, mask=masks.padding_mod(torch.tensor([T, 100])), causal=True)
    assert counted == [1] and torch.isfinite(out).all()


def test_compiling_or_cuda_keeps_the_dense_mask():
    q = torch.randn(1, 1, 8, 4)
    call = build_call(q, q, q, mask=masks.padding_mod(torch.tensor([5])), causal=True)
    assert sdpa_plan(call).mask_source == "segments"
    meta = torch.empty(1, 1, 8, 4, device="meta")
    assert sdpa_plan(build_call(meta, meta, meta, mask=masks.padding_mod(torch.tensor([5])),
                                causal=True)).mask_source == "materialised"
    compiled = torch.compile(lambda q: attnlab.attention(q, q, q, mask=torch.ones(1, 1, 1, 8, dtype=torch.bool),
                                                         causal=True), fullgraph=True)
    torch.testing.assert_close(compiled(q), F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_transformers_padded_prefill_takes_the_segments(counted):
    transformers = pytest.importorskip("transformers")
    from attnlab.integrations import transformers as integration

    name = integration.register()
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    models = []
    for implementation in ("sdpa", name):
        own = copy.deepcopy(config)
        own._attn_implementation = implementation
        models.append(transformers.LlamaForCausalLM(own).eval())
    assert models[0].config._attn_implementation == "sdpa"
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(0, 50, (2, T))
    for side in ("left", "right"):
        attention_mask = torch.ones(2, T, dtype=torch.long)
        attention_mask[0, :60] = 0 if side == "left" else 1
        attention_mask[0, 100:] = 0 if side == "right" else 1
        with torch.no_grad():
            want, got = (model(ids, attention_mask=attention_mask).logits for model in models)
        real = attention_mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=2e-5)
    assert len(counted) == 2  # one layer, two batches


def test_the_estimate_prefers_one_dense_call_for_short_batches_and_segments_for_long_ones():
    sizes = dict(heads=8, dims=64)
    tiny = _segments.plan_bands([(0, 5), (0, 16)], causal=True, tq=16)
    assert not _segments.cheaper_than_dense(tiny, batch=2, tq=16, tk=16, dense_causal=True, **sizes)
    short = _segments.plan_bands([(0, 50), (0, 256)], causal=True, tq=256)  # one 512-key block: no skipping
    assert not _segments.cheaper_than_dense(short, batch=2, tq=256, tk=256, dense_causal=True, **sizes)
    long = _segments.plan_bands([(0, 400), (0, 2048)], causal=True, tq=2048)
    assert _segments.cheaper_than_dense(long, batch=2, tq=2048, tk=2048, dense_causal=True, **sizes)


def test_the_budget_is_part_of_the_route(monkeypatch):
    q = torch.randn(1, 2, 64, 8)
    window = masks.sliding_window_mod(64, 64, 8)
    previous = dispatch.set_memory_budget(None)
    try:
        attnlab.attention(q, q, q, mask=window)
        default_route = dispatch.remembered(dispatch.argument_key(
            q, q, q, mask=window, causal=False, align="top_left", scale=None, dropout_p=0.0, generator=None,
            backend="auto", return_weights=False))
        dispatch.set_memory_budget(0)
        attnlab.attention(q, q, q, mask=window)
        tight = dispatch.remembered(dispatch.argument_key(
            q, q, q, mask=window, causal=False, align="top_left", scale=None, dropout_p=0.0, generator=None,
            backend="auto", return_weights=False))
        assert default_route is not None and tight is not None
        assert backends.memory_class(tight.backend, build_call(q, q, q, mask=window)) == "linear"
    finally:
        dispatch.set_memory_budget(previous)


def test_gpt_takes_a_padding_mask_and_a_right_padded_row_gives_what_it_gives_alone():
    from attnlab.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=20, max_len=16, d_model=32, num_layers=2, num_heads=4).eval()
    ids = torch.randint(0, 20, (2, 12))
    real = torch.arange(12) < torch.tensor([7, 12])[:, None]
    with torch.no_grad():
        padded = model(ids, padding_mask=real)
        alone = model(ids[:1, :7])
    torch.testing.assert_close(padded[0, :7], alone[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"padding_mask must be \(B, T\) = \(2, 12\)"):
        model(ids, padding_mask=real[:, :5])
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor"):
        model(ids, padding_mask=real.long())
    with pytest.raises(ValueError, match="padding_mask is for a padded batch without caches or documents"):
        model(ids, padding_mask=real, document_ids=torch.zeros(12, dtype=torch.long))


def test_varlen_rows_run_as_segments_with_bottom_right_diagonals(counted):
    """varlen_causal_mod: fewer, as many and more queries than keys, and empty rows; padded
    queries are zeros; a row with more keys than queries aligns its diagonal bottom-right."""
    tq, tk = 150, 170
    q_lengths, k_lengths = torch.tensor([150, 40, 0, 120, 90]), torch.tensor([170, 100, 50, 120, 0])
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(5, 2, tq, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(5, 2, tk, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mod = masks.varlen_causal_mod(q_lengths, k_lengths)
    assert sdpa_plan(build_call(q, k, v, mask=mod)).mask_source == "segments"
    out = attnlab.attention(q, k, v, mask=mod)
    allowed = masks.materialize(mod, tq=tq, tk=tk, batch=5)  # (B, 1, Tq, Tk)
    want = _fp64(q, k, v, allowed)
    torch.testing.assert_close(out, want)
    grad_out = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(want, (q, k, v), grad_out)):
        torch.testing.assert_close(got, expected)
    assert counted == [1]
    assert out[1, :, 40:].abs().max() == 0 and out[2].abs().max() == 0  # padded queries, no keys


def test_a_mask_of_batch_one_holds_for_every_row(counted):
    """A key mask or 4-D mask of batch 1 broadcasts over the batch: every row gets its bands
    (a regression: the spans once covered row 0 only and the output lost the other rows)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 2, T, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    keys = _real_keys(torch.tensor([90]), T, left=False)  # (1, T)
    allowed = (masks.causal_mask(T, T) & keys[:, None, :])[:, None]  # (1, 1, T, T)
    for options in (dict(mask=keys[:, None, None, :], causal=True), dict(mask=allowed)):
        out = attnlab.attention(q, k, v, **options)
        torch.testing.assert_close(out, _fp64(q, k, v, allowed))
    assert len(counted) == 2


def test_under_vmap_a_batched_key_mask_keeps_the_dense_mask():
    """torch.func's wrappers hold no values to read spans from: a vmapped mask takes SDPA's mask."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 2, T, 8, generator=gen, dtype=torch.float64)
    keys = _real_keys(torch.tensor([40, 100, T]), T, left=False)  # (3, T), one per vmapped call
    out = torch.func.vmap(lambda qq, kk: attnlab.attention(qq[None], qq[None], qq[None], mask=kk[None, None, None],
                                                           causal=True)[0])(q, keys)
    torch.testing.assert_close(out, _fp64(q, q, q, (masks.causal_mask(T, T) & keys[:, None, :])[:, None]))


def test_flash_pairs_counts_whole_key_blocks_up_to_the_diagonal():
    assert _segments.flash_pairs(256, 256, causal=True) == 256 * 256  # one block of keys: no skipping
    assert _segments.flash_pairs(1024, 1024, causal=True) == 256 * (512 + 512 + 1024 + 1024)
    assert _segments.flash_pairs(100, 40, causal=False) == 4000


def test_a_4d_causal_mask_over_keys_with_holes_runs_as_the_keys_beside_causal(counted, beside):
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, T, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    holes = torch.rand(2, T, generator=gen) > 0.4
    allowed = (masks.causal_mask(T, T) & holes[:, None, :])[:, None]  # (B, 1, T, T): no one run of keys
    out = attnlab.attention(q, k, v, mask=allowed)
    torch.testing.assert_close(out, _fp64(q, k, v, allowed))
    assert counted == [] and beside == [1]


def test_a_remembered_padded_route_keeps_none_of_the_callers_tensors():
    """The route of a bool key mask with causal holds sdpa's prepared run for later calls: it must
    not hold the call (and so the first caller's q, k, v and mask)."""
    import gc
    import weakref

    dispatch.clear_plans()
    q = torch.randn(2, 2, 600, 8)
    keys = _real_keys(torch.tensor([300, 600]), 600, left=False)[:, None, None, :]
    attnlab.attention(q, q, q, mask=keys, causal=True)
    refs = [weakref.ref(q), weakref.ref(keys)]
    del q, keys
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
