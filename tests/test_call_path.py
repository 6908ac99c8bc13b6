"""The call path (issue 31): a call's derived fields are computed once, and a first call walks
a short path (counted in attnlab Python calls, a figure that does not depend on the machine)."""

import collections
import dataclasses
import os
import sys

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab._call import build_call
from attnlab.backends import dispatch

_PACKAGE = os.path.dirname(attnlab.__file__)


def _attnlab_calls(fn) -> collections.Counter:
    calls = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_derived_fields_are_plain_and_follow_replace():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8)
    call = build_call(q, k, k, causal=True, align="bottom_right")
    assert (call.batch, call.q_heads, call.kv_heads, call.tq, call.tk, call.head_dim, call.value_dim) == (2, 4, 2, 3, 5, 8, 8)
    assert (call.mask_kind, call.causal_offset, call.dtype, call.device.type) == ("causal", 2, torch.float32, "cpu")
    derived = {"batch", "q_heads", "kv_heads", "tq", "tk", "head_dim", "value_dim", "dtype", "device",
               "requires_grad", "mask_kind", "causal_offset"}
    assert derived <= {f.name for f in dataclasses.fields(call)}  # fields, not properties recomputed per read
    floats = dataclasses.replace(call, mask=torch.zeros(1, 1, 3, 5, requires_grad=True), _memo={})
    assert floats.mask_kind == "float" and floats.requires_grad
    with torch.no_grad():
        assert not build_call(q.requires_grad_(), k, k).requires_grad


def test_a_first_call_walks_a_short_path():
    q = torch.randn(2, 4, 16, 8)
    dispatch.clear_plans()
    first = _attnlab_calls(lambda: attnlab.attention(q, q, q, causal=True))
    assert sum(first.values()) <= 100, first.most_common(10)
    assert "cost" not in first and first["reasons_of"] == 1  # sdpa claims it: no one else is asked
    warm = _attnlab_calls(lambda: attnlab.attention(torch.randn(2, 4, 16, 8), q, q, causal=True))
    assert sum(warm.values()) <= 5, warm
    bools = torch.rand(2, 1, 16, 16) > 0.5
    assert sum(_attnlab_calls(lambda: attnlab.attention(q, q, q, mask=bools)).values()) <= 100
    planned = attnlab.plan(q, q, q, causal=True)
    assert sum(_attnlab_calls(lambda: planned(q, q, q)).values()) <= 3


def test_the_mask_is_one_value_normalised_at_the_entry():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    window = masks.sliding_window_mod(4, 6, window=2)
    kinds = {
        "none": build_call(q, k, k),
        "causal": build_call(q, k, k, causal=True),
        "bool": build_call(q, k, k, mask=torch.rand(1, 1, 4, 6) > 0.3, causal=True),
        "float": build_call(q, k, k, mask=torch.zeros(1, 1, 1, 6)),
        "mod": build_call(q, k, k, mask=window, causal=True, align="bottom_right"),
        "prepared": build_call(q, k, k, mask=masks.prepare(window, tq=4, tk=6)),
    }
    assert {name: call.mask_kind for name, call in kinds.items()} == {name: name for name in kinds}
    assert [kinds[n].causal_offset for n in ("none", "causal", "bool", "float")] == [None, 0, 0, None]
    # causal is ANDed into a mod once, at the entry: the mod is the whole mask (offset Tk - Tq = 2)
    mod = kinds["mod"]
    want = masks.materialize(window, tq=4, tk=6) & masks.causal_mask(4, 6, align="bottom_right")
    assert mod.causal_offset == 2 and torch.equal(masks.materialize(mod.mask, tq=4, tk=6), want)
    assert mod.mask_mod() is mod.mask and torch.equal(mod.allowed()[0, 0], want[0, 0])
    # a causal mask that blocks no key is no causal part
    assert build_call(q[:, :, :1], k, k, causal=True, align="bottom_right").mask_kind == "none"


def test_backends_decide_from_the_mask_kind():
    from attnlab.backends import flex, sdpa

    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    window = masks.sliding_window_mod(4, 6, window=2)
    pad = torch.rand(1, 1, 1, 6) > 0.3
    cases = {  # options: (sdpa's mask source, flex's mask path)
        (): ("none", None),
        (("causal", True),): ("is_causal", "rows"),
        (("causal", True), ("align", "bottom_right")): ("materialised", "rows"),
        (("mask", pad),): ("user", "dense"),
        (("mask", pad), ("causal", True)): ("segments", "dense"),  # a padded batch: calls on its real keys
        (("mask", window),): ("materialised", "rows"),
        (("mask", window), ("causal", True)): ("materialised", "rows"),
        (("mask", lambda b, h, i, j: i >= j),): ("materialised", "dense"),
        (("mask", masks.prepare(window, tq=4, tk=6)),): ("materialised", "rows"),
    }
    for options, want in cases.items():
        call = build_call(q, k, k, **dict(options))
        assert (sdpa.sdpa_plan(call).mask_source, flex._mask_path(call)) == want, (options, call.mask_kind)


# ----------------------------------------------------------------------------- prepared runs
# Counting rule. The figures count every attnlab frame entered. A backend's kernel (the
# chunked tile loop, online-softmax steps, a mask evaluated on a tile, the blocks' runs) is
# work, not overhead: the *path* counts every frame outside a prepared run plus the run's own
# entry; the frames inside the run are the *kernel*'s, reported apart. What must never run
# inside the kernel on a warm or held call is the work of deciding: checks, layout, mask
# classification, planning, dispatch (the names below).
_DECIDING = {"build_call", "_check_qkv", "_check_tensor", "_check_options", "_check_sizes", "_normalize_mask",
             "_check_score_mod", "check_sinks", "value_only_key", "prepare", "plan", "select", "reasons",
             "reasons_of", "route", "fresh_route", "prepared_run", "prepared_mask", "_planned_runs", "_plan_runs",
             "_plan_of", "_source_of", "_segments_kind", "sdpa_plan", "_runner", "memory_bytes", "cost",
             "__post_init__", "mask_is_fixed", "call_template"}


def _path_and_kernel(fn) -> tuple[collections.Counter, collections.Counter]:
    """attnlab frames of ``fn()``: those on the path (a prepared run's entry included) and those
    inside prepared runs (the generic one of backends/base.py and sdpa's)."""
    path, kernel = collections.Counter(), collections.Counter()
    depth = [0]  # > 0 while inside a run

    def profile(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(_PACKAGE):
            return
        is_run = code.co_name == "run" and code.co_filename.endswith(("base.py", "sdpa.py"))
        if event == "call":
            (kernel if depth[0] else path)[code.co_name] += 1
            depth[0] += is_run
        elif event == "return" and is_run:
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return path, kernel


def _cases():
    window = masks.sliding_window_mod(16, 16, window=4)
    return {
        "chunked causal": dict(causal=True, backend="chunked"),
        "blocks window": dict(mask=window, backend="blocks"),
        "auto window": dict(mask=window),
        "reference causal": dict(causal=True, backend="reference"),
        "softcap (auto)": dict(causal=True, score_mod=attnlab.scores.softcap(20.0)),
        "sinks (auto)": dict(causal=True, sinks=torch.zeros(4)),
        "sdpa causal": dict(causal=True),
    }


def test_every_backend_runs_a_prepared_run_warm_and_held():
    """Warm attention() <= 10 path frames, a held plan <= 3, on every backend; nothing of
    checking or planning runs inside the kernel; the output is the full path's (reference, fp64)."""
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    backends_seen = set()
    for name, options in _cases().items():
        dispatch.clear_plans()
        options = {**options, **({"sinks": options["sinks"].double()} if "sinks" in options else {})}
        attnlab.attention(q, q, q, **options)
        k, v = torch.randn_like(q), torch.randn_like(q)
        warm_out = []
        path, kernel = _path_and_kernel(lambda: warm_out.append(attnlab.attention(q, k, v, **options)))
        assert sum(path.values()) <= 10, (name, path)
        assert not (set(kernel) & _DECIDING), (name, kernel)
        held = attnlab.plan(q, q, q, **options)
        backends_seen.add(held.backend)
        held(q, k, v)
        held_out = []
        path, kernel = _path_and_kernel(lambda: held_out.append(held(q, k, v)))
        assert sum(path.values()) <= 3, (name, path)
        assert not (set(kernel) & _DECIDING), (name, kernel)
        want = attnlab.attention(q, k, v, **{**options, "backend": "reference"})
        torch.testing.assert_close(warm_out[0], want)
        torch.testing.assert_close(held_out[0], want)
    assert backends_seen >= {"chunked", "blocks", "reference", "sdpa"}


def test_a_first_causal_call_walks_at_most_60_frames():
    q = torch.randn(2, 4, 16, 8)
    dispatch.clear_plans()
    first = _attnlab_calls(lambda: attnlab.attention(q, q, q, causal=True))
    assert sum(first.values()) <= 60, first.most_common(10)


def test_a_mod_that_holds_tensors_is_planned_per_call_and_a_mod_by_value_once():
    """A document mod (keyed by weak identity) gets no run: each call is built and planned, so a
    new batch's ids are read; a window mod by value is planned once per route."""
    q = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    for backend in ("chunked", "blocks", "reference"):
        dispatch.clear_plans()
        for step in range(2):
            ids = torch.tensor([0] * (5 + 3 * step) + [1] * (11 - 3 * step))
            mod = masks.document_mod(ids)
            out = attnlab.attention(q, q, q, mask=mod, backend=backend)
            dense = masks.materialize(mod, tq=16, tk=16)
            want = attnlab.attention(q, q, q, mask=dense, backend="reference")
            torch.testing.assert_close(out, want)
        window = masks.sliding_window_mod(16, 16, window=3)
        attnlab.attention(q, q, q, mask=window, backend=backend)
        calls = _attnlab_calls(lambda: attnlab.attention(q, q, q, mask=masks.sliding_window_mod(16, 16, window=3),
                                                         backend=backend))
        assert calls["build_call"] == 0 and calls["prepare"] == 0 and calls["_planned_runs"] == 0, (backend, calls)


def test_a_route_holds_no_tensor_of_the_caller():
    """The runs keep none of the caller's tensors nor mask mods (tests/test_state.py's rule)."""
    import gc
    import weakref

    refs = []
    for options in _cases().values():
        dispatch.clear_plans()
        q = torch.randn(2, 4, 16, 8)
        sinks = options.get("sinks")
        options = {**options, **({"sinks": torch.zeros(4)} if sinks is not None else {})}
        attnlab.attention(q, q, q, **options)
        refs.append(weakref.ref(q))
        if "sinks" in options:
            refs.append(weakref.ref(options["sinks"]))
        del q, options
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_a_decoding_step_is_prepared_once_per_class_of_cache_lengths():
    """Tk grows by one a step: one route per class (bit length) of Tk, no validation between;
    the output is the full path's; bad input (k and v of other lengths, a mask of another
    length) is still refused with the same errors."""
    from attnlab import functional

    dispatch.clear_plans()
    q = torch.randn(2, 4, 1, 8)
    cache = torch.randn(2, 4, 80, 8)
    keep = torch.ones(2, 1, 1, 80, dtype=torch.bool)
    keep[1, ..., :7] = False  # a left-padded row
    builds = []
    real = functional.build_call
    functional.build_call = lambda *a, **kw: builds.append(1) or real(*a, **kw)
    try:
        for t in range(33, 64):
            k, v = cache[:, :, :t], cache[:, :, :t] * 2
            for mask in (None, keep[..., :t]):
                out = attnlab.attention(q, k, v, causal=True, align="bottom_right", mask=mask)
                want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                          attn_mask=mask)
                torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    finally:
        functional.build_call = real
    assert len(builds) == 2  # one route per mask kind for every Tk of 32..63
    k = cache[:, :, :40]
    with pytest.raises(ValueError, match="Tk"):
        attnlab.attention(q, k, cache[:, :, :41], causal=True, align="bottom_right")
    with pytest.raises(ValueError, match="does not broadcast"):
        attnlab.attention(q, k, k, causal=True, align="bottom_right", mask=keep[..., :41])
    warm = _attnlab_calls(lambda: attnlab.attention(q, k, k, causal=True, align="bottom_right", mask=keep[..., :40]))
    assert sum(warm.values()) <= 5, warm


def test_a_prepared_dropout_run_draws_one_seed_per_call():
    """Regression: chunked's run drew a second dropout seed when its plan already held one. A
    remembered route draws exactly one per call, as the full path does: same seed, same output."""
    from attnlab.backends.chunked import chunked_attention

    q = torch.randn(1, 2, 24, 8)
    dispatch.clear_plans()
    outs = []
    for _ in range(3):  # the first call makes the route, the others run it
        torch.manual_seed(7)
        outs.append(attnlab.attention(q, q, q, causal=True, dropout_p=0.3, backend="chunked"))
        after = torch.rand(2)
    torch.manual_seed(7)
    want = chunked_attention(build_call(q, q, q, causal=True, dropout_p=0.3)).out
    assert torch.equal(torch.rand(2), after)  # the global generator moved by one draw, as there
    for out in outs:
        assert torch.equal(out, want)


def test_a_plain_sdpa_run_passes_sdpa_no_keyword_it_would_default():
    """Each keyword SDPA parses costs a decoding step time: options equal to SDPA's defaults
    (dropout 0, is_causal off, the scale 1/sqrt(D) it computes itself) stay out of the bound run,
    and a scale of its own stays in (and gives the reference's result)."""
    from attnlab.backends.registry import get

    q, k = torch.randn(2, 4, 1, 48), torch.randn(2, 4, 9, 48)
    keys = torch.rand(2, 1, 1, 9) > 0.3
    keys[:, ..., 0] = True
    run = get("sdpa").prepare(build_call(q, k, k, mask=keys, causal=True, align="bottom_right"))
    assert run.keywords == {}
    scaled = get("sdpa").prepare(build_call(q, k, k, mask=keys, scale=0.3))
    assert scaled.keywords == {"scale": 0.3}
    want = attnlab.attention(q.double(), k.double(), k.double(), mask=keys, scale=0.3, backend="reference")
    assert torch.allclose(scaled(q, k, k, keys).double(), want, atol=1e-5)


def test_a_warm_call_keys_its_tensors_as_given_and_mixed_ranks_are_aligned_first():
    """The common call skips sdpa_aligned (its key is the tensors' as given); tensors that need
    aligning (mixed ranks, one query head over several key heads) are aligned, keyed, remembered
    and computed as the reference computes them."""
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    attnlab.attention(q, k, k, causal=True)
    assert "sdpa_aligned" not in _attnlab_calls(lambda: attnlab.attention(q, k, k, causal=True))
    options = (None, True, "top_left", None, 0.0, None, "auto", False, None, None)
    for q_mixed in (torch.randn(16, 8), torch.randn(2, 1, 16, 8)):  # rank 2 against rank 4; 1 head over 4
        assert dispatch.key_of(q_mixed, k, k, *options, True) is None
        want = attnlab.attention(q_mixed.double(), k.double(), k.double(), causal=True, backend="reference")
        for _ in range(2):  # a fresh route, then the remembered one
            torch.testing.assert_close(attnlab.attention(q_mixed, k, k, causal=True).double(), want, atol=1e-5, rtol=1e-5)
        aligned = attnlab._call.sdpa_aligned(q_mixed, k, k)
        assert dispatch.lookup(dispatch.key_of(*aligned, *options, False)) is not None
