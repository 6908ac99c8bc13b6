"""attnlab.masks against explicit index formulas, and the mask mods' key bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import masks

sizes = st.integers(1, 12)


def explicit(tq, tk, rule):
    """Dense (tq, tk) bool mask from a Python rule(i, j), element by element."""
    return torch.tensor([[bool(rule(i, j)) for j in range(tk)] for i in range(tq)]).view(tq, tk)


# ----------------------------------------------------------------------------- dense masks


@given(sizes, sizes)
def test_causal_mask_top_left(tq, tk):
    assert torch.equal(masks.causal_mask(tq, tk), explicit(tq, tk, lambda i, j: j <= i))


@given(sizes, sizes)
def test_causal_mask_bottom_right(tq, tk):
    expected = explicit(tq, tk, lambda i, j: j <= i + (tk - tq))
    assert torch.equal(masks.causal_mask(tq, tk, align="bottom_right"), expected)
    if tq <= tk:
        assert masks.causal_mask(tq, tk, align="bottom_right")[-1].all()  # last query sees all


def test_causal_mask_square_is_lower_triangle():
    assert torch.equal(masks.causal_mask(6), torch.ones(6, 6, dtype=torch.bool).tril())


@given(sizes, sizes, st.integers(1, 6), st.sampled_from(masks.ALIGNMENTS))
def test_sliding_window_mask(tq, tk, window, align):
    offset = 0 if align == "top_left" else tk - tq
    expected = explicit(tq, tk, lambda i, j: i + offset - window < j <= i + offset)
    assert torch.equal(masks.sliding_window_mask(tq, tk, window, align=align), expected)


@given(st.lists(st.integers(0, 7), min_size=1, max_size=4), st.integers(0, 3))
def test_padding_mask(lengths, extra):
    max_len = max(lengths) + extra
    dense = masks.padding_mask(torch.tensor(lengths), max_len)
    assert dense.shape == (len(lengths), 1, 1, max_len)
    for b, n in enumerate(lengths):
        assert dense[b, 0, 0].tolist() == [j < n for j in range(max_len)]


def test_padding_mask_default_length_and_bad_lengths():
    assert masks.padding_mask(torch.tensor([2, 4])).shape == (2, 1, 1, 4)
    with pytest.raises(ValueError, match="lengths"):
        masks.padding_mask(torch.tensor([[1, 2]]))


def test_bad_align_and_window():
    with pytest.raises(ValueError, match="align"):
        masks.causal_mask(3, align="top")
    with pytest.raises(ValueError, match="window"):
        masks.sliding_window_mod(3, 3, 0)


# ----------------------------------------------------------------------------- combinators


def _random_bool(seed, shape=(5, 6)):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.5


@given(st.integers(0, 1000), st.integers(0, 1000))
def test_and_or_bool_masks(seed_a, seed_b):
    a, b = _random_bool(seed_a), _random_bool(seed_b)
    assert torch.equal(masks.and_masks(a, b), a & b)
    assert torch.equal(masks.or_masks(a, b), a | b)
    assert torch.equal(masks.and_masks(a, None), a)
    assert masks.and_masks(None, None) is None


def test_and_masks_float_and_bool_add_biases():
    bias = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    allowed = torch.tensor([[True, False], [True, True]])
    combined = masks.and_masks(bias, allowed, bias)
    expected = torch.tensor([[1.0, float("-inf")], [4.0, 0.0]])
    assert torch.equal(combined, expected)


def test_or_masks_rejects_float_and_mixing_rejects_mods_with_tensors():
    with pytest.raises(TypeError, match="or_masks"):
        masks.or_masks(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="materialize"):
        masks.and_masks(masks.causal_mod(2, 2), torch.ones(2, 2, dtype=torch.bool))


@given(sizes, sizes, st.integers(1, 5))
def test_and_or_mask_mods_match_dense(tq, tk, window):
    causal, sliding = masks.causal_mod(tq, tk), masks.sliding_window_mod(tq, tk, window)
    even = lambda b, h, qi, ki: ki % 2 == 0  # noqa: E731  (a plain callable mod)
    dense_causal = explicit(tq, tk, lambda i, j: j <= i)
    dense_even = explicit(tq, tk, lambda i, j: j % 2 == 0)
    dense_sliding = masks.sliding_window_mask(tq, tk, window)
    anded = masks.materialize(masks.and_masks(causal, even), tq=tq, tk=tk)[0, 0]
    ored = masks.materialize(masks.or_masks(sliding, even), tq=tq, tk=tk)[0, 0]
    assert torch.equal(anded, dense_causal & dense_even)
    assert torch.equal(ored, dense_sliding | dense_even)
    assert torch.equal(masks.materialize(causal & sliding, tq=tq, tk=tk)[0, 0], dense_sliding)


# ----------------------------------------------------------------------------- materialize


@given(sizes, sizes, st.integers(1, 5), st.sampled_from(masks.ALIGNMENTS))
def test_materialize_each_mod_equals_dense(tq, tk, window, align):
    causal = masks.materialize(masks.causal_mod(tq, tk, align=align), tq=tq, tk=tk)
    assert causal.shape == (1, 1, tq, tk)
    assert torch.equal(causal[0, 0], masks.causal_mask(tq, tk, align=align))
    sliding = masks.materialize(masks.sliding_window_mod(tq, tk, window, align=align), tq=tq, tk=tk)
    assert torch.equal(sliding[0, 0], masks.sliding_window_mask(tq, tk, window, align=align))


@given(st.lists(st.integers(0, 9), min_size=1, max_size=3), sizes)
def test_materialize_padding_mod_equals_padding_mask(lengths, tq):
    lengths_t = torch.tensor(lengths)
    tk = max(lengths) + 1
    dense = masks.materialize(masks.padding_mod(lengths_t), tq=tq, tk=tk, batch=len(lengths), heads=2)
    assert dense.shape == (len(lengths), 2, tq, tk)
    expected = masks.padding_mask(lengths_t, tk)  # (B, 1, 1, Tk)
    assert torch.equal(dense, expected.expand(len(lengths), 2, tq, tk))


def test_materialize_rejects_non_bool_mod():
    with pytest.raises(TypeError, match="bool"):
        masks.materialize(lambda b, h, qi, ki: qi + ki, tq=2, tk=2)


# ----------------------------------------------------------------------------- kv_bounds


def _mods(tq, tk, window, align):
    causal = masks.causal_mod(tq, tk, align=align)
    sliding = masks.sliding_window_mod(tq, tk, window, align=align)
    return {
        "causal": causal,
        "sliding": sliding,
        "causal_and_sliding": causal & sliding,
        "causal_or_sliding": causal | sliding,
        "and_with_plain_callable": masks.and_masks(sliding, lambda b, h, qi, ki: ki >= 0),
        "prefix": masks.prefix_lm_mod(tq, tk, window, align=align),
        "chunked": masks.chunked_local_mod(tq, tk, window, align=align),
        "chunked_bidirectional": masks.chunked_local_mod(tq, tk, window, causal=False, align=align),
        "prefix_or_chunked": masks.prefix_lm_mod(tq, tk, window) | masks.chunked_local_mod(tq, tk, 2),
        "document": masks.document_mod(torch.arange(max(tq, tk)) // window),
        "document_split": masks.document_mod(torch.arange(max(tq, tk)) % window, causal=False),
    }


@given(sizes, sizes, st.integers(1, 5), st.sampled_from(masks.ALIGNMENTS), st.data())
def test_kv_bounds_are_conservative(tq, tk, window, align, data):
    q_start = data.draw(st.integers(0, tq - 1))
    q_end = data.draw(st.integers(q_start + 1, tq))
    for name, mod in _mods(tq, tk, window, align).items():
        bounds = mod.kv_bounds(q_start, q_end)
        if bounds is None:
            continue  # "cannot tell" is always conservative
        lo, hi = bounds
        assert lo <= hi, name
        allowed = masks.materialize(mod, tq=tq, tk=tk)[0, 0, q_start:q_end]  # (q_end-q_start, Tk)
        reachable = allowed.any(dim=0).nonzero().flatten().tolist()
        assert all(lo <= j < hi for j in reachable), (name, bounds, reachable)


def test_kv_bounds_are_tight_for_causal_and_sliding():
    assert masks.causal_mod(8, 8).kv_bounds(2, 5) == (0, 5)
    assert masks.sliding_window_mod(8, 8, 3).kv_bounds(4, 6) == (2, 6)
    assert masks.causal_mod(2, 8, align="bottom_right").kv_bounds(0, 1) == (0, 7)
    assert masks.padding_mod(torch.tensor([3])).kv_bounds(0, 4) is None


@given(sizes, sizes, st.integers(0, 6), st.sampled_from(masks.ALIGNMENTS))
def test_prefix_lm_mod_matches_its_definition(tq, tk, prefix, align):
    offset = masks.causal_offset(tq, tk, align)
    got = masks.materialize(masks.prefix_lm_mod(tq, tk, prefix, align=align), tq=tq, tk=tk)[0, 0]
    want = [[j < prefix or j <= i + offset for j in range(tk)] for i in range(tq)]
    assert got.tolist() == want


@given(sizes, sizes, st.integers(1, 6), st.booleans(), st.sampled_from(masks.ALIGNMENTS))
def test_chunked_local_mod_matches_its_definition(tq, tk, chunk, causal, align):
    offset = masks.causal_offset(tq, tk, align)
    mod = masks.chunked_local_mod(tq, tk, chunk, causal=causal, align=align)
    got = masks.materialize(mod, tq=tq, tk=tk)[0, 0]
    want = [[j // chunk == (i + offset) // chunk and (not causal or j <= i + offset)
             for j in range(tk)] for i in range(tq)]
    assert got.tolist() == want


def test_document_mod_matches_its_definition_and_checks_sizes():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 6, 6]])
    got = masks.materialize(masks.document_mod(ids), tq=6, tk=6, batch=2)
    want = [[[ids[b, i] == ids[b, j] and j <= i for j in range(6)] for i in range(6)] for b in range(2)]
    assert got[:, 0].tolist() == want
    with pytest.raises(ValueError, match="DocumentMod has document ids for 6 positions"):
        masks.document_mod(ids).check_sizes(batch=2, heads=1, tq=7, tk=7)
    with pytest.raises(ValueError, match="2 rows of document ids but the batch has 3"):
        masks.document_mod(ids).check_sizes(batch=3, heads=1, tq=6, tk=6)
    with pytest.raises(TypeError, match="document_ids must have an integer dtype, got torch.float32"):
        masks.document_mod(torch.zeros(3))


def test_or_combination_bounds_are_the_union_and_bounds_less_parts_give_none():
    both = masks.prefix_lm_mod(16, 16, 2) | masks.chunked_local_mod(16, 16, 4)
    assert both.kv_bounds(8, 12) == (0, 12)
    assert (masks.causal_mod(16, 16) | (lambda b, h, i, j: i == j)).kv_bounds(0, 4) is None


# ------------------------------------------------------------------ prepared masks


def _sweep_mods(count: int, seed: int):
    """(mod with the call's causal folded in, config) for the conformance sweep's mods with row ranges."""
    from attnlab.lab import verify
    from attnlab._call import build_call

    for config in verify.configs(count, seed=seed):
        mask = verify._inputs(config)[4]
        if min(config.tq, config.tk) == 0:
            continue
        q = torch.randn(config.batch, config.q_heads, config.tq, 4)
        k = torch.randn(config.batch, config.kv_heads, config.tk, 4)
        call = build_call(q, k, k, mask=mask, causal=config.causal, align=config.align)
        mod = call.mask_mod()
        if mod is not None and masks.has_row_ranges(mod):
            yield mod, config


def test_each_mods_three_descriptions_agree_over_the_conformance_sweep():
    """``__call__`` (the definition), ``row_ranges`` (through prepare) and ``kv_bounds`` describe
    one mask: the prepared mask allows exactly what the mod allows, and neither mod's bounds miss
    a key any query of a block may attend."""
    checked = 0
    for mod, config in _sweep_mods(300, seed=5):
        sizes = dict(tq=config.tq, tk=config.tk, batch=config.batch)
        prepared = masks.prepare(mod, **sizes)
        dense = masks.materialize(mod, **sizes)  # (B, 1, Tq, Tk)
        assert torch.equal(masks.materialize(prepared, **sizes), dense), config.label()
        for start in range(0, config.tq, 16):
            stop = min(config.tq, start + 16)
            used = dense[:, :, start:stop].any(dim=(0, 1, 2)).nonzero().flatten()
            if used.numel() == 0:
                continue
            for bounded in (mod, prepared):
                lo, hi = masks.kv_range(bounded, start, stop, config.tk)
                assert lo <= int(used[0]) and int(used[-1]) < hi, (config.label(), bounded)
        checked += 1
    assert checked >= 150


def test_prepared_bounds_are_tight_for_documents_and_windows():
    ids = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
    prepared = masks.prepare(masks.document_mod(ids), tq=16, tk=16)
    assert prepared.kv_bounds(5, 12) == (5, 12) and prepared.kv_bounds(12, 14) == (12, 14)
    window = masks.prepare(masks.sliding_window_mod(16, 16, 3), tq=16, tk=16)
    assert window.kv_bounds(8, 10) == (6, 10)
    empty = masks.prepare(masks.varlen_causal_mod(torch.tensor([2]), torch.tensor([3])), tq=4, tk=4)
    assert empty.kv_bounds(2, 4) == (0, 0)  # padded queries see nothing


def test_prepare_refuses_what_it_cannot_prepare_and_checks_sizes():
    with pytest.raises(ValueError, match="mask: prepare takes"):
        masks.prepare(lambda b, h, i, j: i >= j, tq=4, tk=4)
    with pytest.raises(ValueError, match="mask: prepare takes"):
        masks.prepare(masks.causal_mod(4, 4) | masks.sliding_window_mod(4, 4, 2), tq=4, tk=4)
    with pytest.raises(ValueError, match="PaddingMod has 1 lengths but the batch has 2"):
        masks.prepare(masks.padding_mod(torch.tensor([3])), tq=4, tk=4, batch=2)
    with pytest.raises(ValueError, match="tq"):
        masks.prepare(masks.causal_mod(4, 4), tq=-1, tk=4)
    prepared = masks.prepare(masks.causal_mod(4, 4), tq=4, tk=4)
    assert masks.prepare(prepared, tq=4, tk=4) is prepared
    q = torch.randn(1, 1, 5, 4)
    with pytest.raises(ValueError, match="prepared for Tq=4, Tk=4 but the call has Tq=5, Tk=5"):
        import attnlab
        attnlab.attention(q, q, q, mask=prepared)


def test_prepare_for_a_meta_device_keeps_the_bounds_read_on_the_cpu():
    """Regression: preparing for device='meta' read the bounds from the meta tensors and failed."""
    prepared = masks.prepare(masks.sliding_window_mod(8, 8, 2), tq=8, tk=8, device="meta")
    assert prepared.lo.device.type == "meta" and prepared.kv_bounds(4, 6) == (3, 6)
    assert prepared.rows(3).kv_bounds(4, 6) == (3, 6)
    lo = torch.zeros(1, 4, dtype=torch.int64, device="meta")
    assert masks.PreparedMask(lo, lo, lo, lo).kv_bounds(0, 4) is None  # no values to bound by


# ----------------------------------------------------------------------------- the package's names

# Every name attnlab.masks exported when it was one module, and the private ones other modules import.
NAMES_BEFORE_THE_SPLIT = (
    "ALIGNMENTS", "MaskMod", "causal_mod", "sliding_window_mod", "padding_mod", "DocumentMod", "PrefixLMMod",
    "ChunkedLocalMod", "document_mod", "document_positions", "prefix_lm_mod", "chunked_local_mod",
    "VarlenCausalMod", "varlen_causal_mod", "and_masks", "or_masks", "materialize", "evaluate", "apply_mod",
    "mod_tensors", "value_only_key", "has_row_ranges", "PreparedMask", "prepare", "kv_range", "causal_mask",
    "sliding_window_mask", "padding_mask", "causal_offset", "CausalMod", "SlidingWindowMod", "PaddingMod",
    "CombinedMod", "check_align", "_IndexWithTensors", "_first_line", "_unevaluable", "_occurrence_bounds",
)


def test_every_name_of_the_single_module_still_resolves():
    assert [name for name in NAMES_BEFORE_THE_SPLIT if not hasattr(masks, name)] == []
    assert all(hasattr(masks, name) for name in masks.__all__)


def test_all_lists_one_constructor_per_pattern_and_no_pattern_class():
    """The functions construct; the classes they return are types (isinstance), not in __all__."""
    classes = [name for name in masks.__all__ if isinstance(getattr(masks, name), type)]
    assert classes == ["MaskMod"]  # the base class a user subclasses
    assert isinstance(masks.document_mod(torch.tensor([0, 1])), masks.DocumentMod)
    assert isinstance(masks.prepare(masks.causal_mod(2, 2), tq=2, tk=2), masks.PreparedMask)


def test_value_only_key_is_the_masks_identity_by_value():
    window = masks.sliding_window_mod(8, 8, 3)
    assert masks.value_only_key(window) == masks.value_only_key(masks.sliding_window_mod(4, 4, 3))
    assert masks.value_only_key(window) != masks.value_only_key(masks.sliding_window_mod(8, 8, 2))
    assert masks.value_only_key(masks.causal_mod(2, 4, align="bottom_right")) == ("CausalMod", ("offset", 2))
    both = masks.causal_mod(8, 8) & window
    assert masks.value_only_key(both) == ("CombinedMod", "and", ("CausalMod", ("offset", 0)),
                                          ("SlidingWindowMod", ("offset", 0), ("window", 3)))

    class Shifted(masks.SlidingWindowMod):  # a subclass may hold state no key sees
        pass

    unkeyed = [masks.padding_mod(torch.tensor([2])), window & masks.padding_mod(torch.tensor([2])),
               masks.prepare(window, tq=8, tk=8), Shifted(2), lambda b, h, q, kv: kv <= q, window | (lambda *i: True)]
    assert [masks.value_only_key(mod) for mod in unkeyed] == [None] * len(unkeyed)


def test_document_mod_refuses_a_non_tensor_naming_the_argument():
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        masks.document_mod("abc")
