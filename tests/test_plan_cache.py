"""The route cache, the one cache on the hot path: per argument signature it keeps the backend
dispatch chose and, for calls SDPA takes as given, the prepared run that goes straight to the
kernel. A repeated signature skips validation and dispatch; every change that can change a
decision (shape, dtype, mask, options, grad mode, the registry) is decided afresh; bad calls
still raise; the cache is bounded, safe to share between threads, and one reset clears it and
every backend's remembered state."""

from __future__ import annotations

import threading

import pytest
import torch

import attnlab
from attnlab import backends, masks
from attnlab.backends import build_call, dispatch, select


def _key(q, k, v, **options):
    full = dict(mask=None, causal=False, align="top_left", scale=None, dropout_p=0.0,
                generator=None, backend="auto", return_weights=False)
    return dispatch.argument_key(q, k, v, **{**full, **options})


@pytest.fixture
def counted_builds(monkeypatch):
    """Counts how often attention() validates and builds a call (a prepared run skips it)."""
    dispatch.clear_plans()
    built = []
    real = attnlab.functional.build_call

    def counting_build(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attnlab.functional, "build_call", counting_build)
    yield built
    dispatch.clear_plans()


class _Counting(backends.Backend):
    """Serves nothing; counts how often dispatch asks it."""

    name, memory = "counting-test", "linear"
    asked = 0

    def limits(self, call):
        type(self).asked += 1
        return ["never serves"]


@pytest.fixture
def counting():
    dispatch.clear_plans()
    backends.register(_Counting())
    _Counting.asked = 0
    yield _Counting
    backends.unregister("counting-test")
    dispatch.clear_plans()


def test_a_repeated_signature_skips_the_full_dispatch(counting):
    q = torch.randn(1, 4, 1, 8)
    for mask in (None, masks.sliding_window_mod(1, 32, 8)):  # a prepared run, and a remembered choice
        k = torch.randn(1, 4, 32, 8)
        attnlab.attention(q, k, k, mask=mask)
        asked = counting.asked
        for _ in range(3):
            attnlab.attention(torch.randn(1, 4, 1, 8), k, k, mask=mask)
        assert counting.asked == asked


def _variants():
    q = torch.randn(1, 2, 300, 16)
    window = masks.sliding_window_mod(300, 300, 16)
    yield dict(q=q, k=q, v=q)
    yield dict(q=q, k=q, v=q, causal=True)
    yield dict(q=q, k=q, v=q, mask=window)
    yield dict(q=q, k=q, v=q, mask=masks.sliding_window_mod(300, 300, 200))  # another mod object
    yield dict(q=q, k=q, v=q, mask=lambda b, h, i, j: i >= j)
    yield dict(q=q, k=q, v=q, mask=torch.rand(300, 300) > 0.5)
    yield dict(q=q, k=q, v=q, mask=torch.zeros(300, 300))
    yield dict(q=q, k=q, v=q, mask=window, dropout_p=0.1)
    yield dict(q=q.double(), k=q.double(), v=q.double(), mask=window)
    yield dict(q=q[:, :, :7], k=q, v=q, mask=window, align="bottom_right")
    yield dict(q=q.bfloat16(), k=q.bfloat16(), v=q.bfloat16(), causal=True)
    g = q.clone().requires_grad_()
    yield dict(q=g, k=g, v=g, mask=window)
    yield dict(q=g, k=g, v=g, mask=window, return_weights=True)


@pytest.mark.parametrize("grad", [False, True])
def test_every_change_gets_the_choice_of_a_fresh_dispatch(grad):
    dispatch.clear_plans()
    with torch.set_grad_enabled(grad):
        for _ in range(2):  # the second round is all cache hits
            for args in _variants():
                q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
                attnlab.attention(q, k, v, **args)
                route = dispatch.remembered(_key(q, k, v, **args))  # a lambda: by weak identity
                assert route is not None, args
                assert route.backend is select(build_call(q, k, v, **args)), args


def test_grad_mode_change_is_seen():
    dispatch.clear_plans()
    q = torch.randn(1, 2, 512, 16, requires_grad=True)
    mod = masks.sliding_window_mod(512, 512, 8)
    with torch.no_grad():
        attnlab.attention(q, q, q, mask=mod)
        assert dispatch.remembered(_key(q, q, q, mask=mod)).backend is select(build_call(q, q, q, mask=mod))
    assert dispatch.remembered(_key(q, q, q, mask=mod)) is None  # grad mode is in the key
    attnlab.attention(q, q, q, mask=mod)
    assert dispatch.remembered(_key(q, q, q, mask=mod)).backend is select(build_call(q, q, q, mask=mod))


def test_registering_a_backend_invalidates_the_routes():
    dispatch.clear_plans()
    q = torch.randn(1, 2, 16, 8)
    window = masks.sliding_window_mod(16, 16, 4)  # left to the cost model, not a rule

    class ZeroCost(backends.Backend):
        name, memory = "zero-cost-test", "linear"
        served = 0

        def cost(self, call):
            return 0.0

        def forward(self, call):
            type(self).served += 1
            return backends.get("reference").forward(call)

    attnlab.attention(q, q, q, mask=window)
    backends.register(ZeroCost())
    try:
        attnlab.attention(q, q, q, mask=window)
        assert ZeroCost.served == 1
    finally:
        backends.unregister("zero-cost-test")
    attnlab.attention(q, q, q, mask=window)
    assert ZeroCost.served == 1


def test_a_nan_query_on_a_remembered_blocks_choice_gives_a_nan_row():
    """The choice reads no values: blocks keeps a NaN query, and its row is NaN (not zeros)."""
    dispatch.clear_plans()
    q = torch.randn(1, 2, 2048, 16)
    mod = masks.sliding_window_mod(2048, 2048, 64)
    assert select(build_call(q, q, q, mask=mod)).name == "blocks"
    bad = q.clone()
    bad[0, 0, 100, 3] = float("nan")
    assert select(build_call(bad, q, q, mask=mod)).name == "blocks"
    out = attnlab.attention(bad, q, q, mask=mod)
    want = attnlab.attention(bad, q, q, mask=mod, backend="reference")
    assert out[0, 0, 100].isnan().all()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.allclose(torch.nan_to_num(out), torch.nan_to_num(want), atol=1e-5)


def test_the_cache_is_bounded():
    dispatch.clear_plans()
    q = torch.randn(1, 1, 2, 4)  # (one query is a decoding step, keyed by a class of lengths)
    for t in range(1, dispatch.PLAN_CACHE_SIZE + 20):
        attnlab.attention(q, torch.randn(1, 1, t, 4), torch.randn(1, 1, t, 4))
    assert len(dispatch._ROUTES) == dispatch.PLAN_CACHE_SIZE


def _decode_inputs(kv_heads=4):
    return torch.randn(1, 4, 1, 16), torch.randn(1, kv_heads, 40, 16), torch.randn(1, kv_heads, 40, 16)


@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_a_repeated_decoding_step_skips_validation_and_matches_the_full_path(counted_builds, kv_heads, mask):
    padding = masks.padding_mask(torch.tensor([33]), 40)  # (1, 1, 1, 40)
    options = {None: {}, "bool": dict(mask=padding),
               "float": dict(mask=torch.zeros(1, 1, 1, 40).masked_fill(~padding, float("-inf")))}[mask]
    for step in range(4):
        q, k, v = _decode_inputs(kv_heads)
        out = attnlab.attention(q, k, v, causal=True, align="bottom_right", **options)
        want = attnlab.attention(q.double(), k.double(), v.double(), backend="reference",
                                 **{key: val.double() if val.dtype != torch.bool else val for key, val in options.items()})
        assert torch.allclose(out.double(), want, atol=1e-5)
    # the first fp32 call and the first fp64 reference: every backend's run is prepared once
    assert len(counted_builds) == 2


def test_a_prepared_run_keeps_the_nan_rule(counted_builds):
    q, k, v = _decode_inputs()
    attnlab.attention(q, k, v)
    q[0, 2, 0, 5] = float("nan")
    out = attnlab.attention(q, k, v)
    assert len(counted_builds) == 1  # served by the prepared run
    assert out[0, 2].isnan().all() and not out[0, [0, 1, 3]].isnan().any()


def test_every_change_of_signature_validates_again(counted_builds):
    q, k, v = _decode_inputs()
    attnlab.attention(q, k, v)
    changes = [
        dict(q=torch.randn(1, 4, 2, 16)), dict(k=torch.randn(1, 4, 64, 16), v=torch.randn(1, 4, 64, 16)),
        dict(q=q.double(), k=k.double(), v=v.double()), dict(causal=True), dict(scale=0.5),
        dict(backend="reference"), dict(q=q.clone().requires_grad_()),
        dict(mask=torch.ones(1, 1, 1, 40, dtype=torch.bool)), dict(mask=torch.ones(1, 4, 1, 40, dtype=torch.bool)),
        dict(mask=masks.sliding_window_mod(1, 40, 8)), dict(return_weights=True), dict(dropout_p=0.5),
    ]
    for change in changes:
        before = len(counted_builds)
        args = {"q": q, "k": k, "v": v, **change}
        attnlab.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        assert len(counted_builds) == before + 1, change
    with torch.no_grad():  # no gradient will be recorded: requires_grad is another key, validated once
        before = len(counted_builds)
        for _ in range(3):
            attnlab.attention(q.clone().requires_grad_(), k, v)
        assert len(counted_builds) == before + 1


def test_registering_a_backend_expires_prepared_runs(counted_builds):
    q, k, v = _decode_inputs()
    attnlab.attention(q, k, v)
    backends.register(backends.registry()["sdpa"])
    attnlab.attention(q, k, v)
    assert len(counted_builds) == 2


@pytest.mark.parametrize("bad", [dict(causal=1), dict(scale=True), dict(dropout_p=False),
                                 dict(scale=float("nan")), dict(align="middle"), dict(backend="nope"),
                                 dict(mask=torch.ones(1, 1, 1, 39, dtype=torch.bool)),
                                 dict(mask=torch.ones(1, 1, 1, 40, dtype=torch.int64))])
def test_bad_arguments_still_raise_after_a_prepared_run(counted_builds, bad):
    q, k, v = _decode_inputs()
    for _ in range(2):
        attnlab.attention(q, k, v, causal=bool(bad.get("causal", False)))
    with pytest.raises((TypeError, ValueError)):
        attnlab.attention(q, k, v, **bad)


def test_a_prepared_run_refuses_what_validation_refuses(counted_builds):
    q, k, v = _decode_inputs()
    attnlab.attention(q, k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        attnlab.attention(q, k.double(), v)
    with pytest.raises(ValueError, match="Tk"):
        attnlab.attention(q, k, v[:, :, :39])


@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(scale=-0.3)], ids=["plain", "causal", "negative-scale"])
def test_a_prepared_run_gives_gradients_as_the_full_path(counted_builds, options):
    q, k, v = (torch.randn(1, 4, 6, 16).requires_grad_() for _ in range(3))
    for _ in range(3):  # the later calls are the prepared run
        q.grad = k.grad = v.grad = None
        attnlab.attention(q, k, v, **options).square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    attnlab.attention(q, k, v, backend="reference", **options).square().sum().backward()
    assert len(counted_builds) == 2
    for have, want in zip(got, (q.grad, k.grad, v.grad)):
        assert torch.allclose(have, want, atol=1e-5)


@pytest.mark.parametrize("q_shape, k_shape", [((0, 2, 1, 8), (0, 2, 5, 8)), ((1, 2, 0, 8), (1, 2, 5, 8)),
                                              ((1, 2, 1, 8), (1, 2, 0, 8))])
def test_empty_batches_and_sequences_repeat_as_the_first_call_gives_them(q_shape, k_shape):
    """Regression: a remembered choice for an empty batch once indexed a query row that does not exist."""
    for _ in range(3):
        q, k = torch.randn(q_shape), torch.randn(k_shape)
        out = attnlab.attention(q, k, k)
        want = attnlab.attention(q.double(), k.double(), k.double(), backend="reference")
        assert out.shape == want.shape and torch.allclose(out.double(), want)


def test_one_reset_clears_every_route_and_the_plans_they_hold():
    """The blocks' plan of a tensor-free mod lives on the prepared mask its route holds: no
    other store, and clear_plans forgets it."""
    q = torch.randn(1, 2, 512, 16)
    attnlab.attention(q, q, q, mask=masks.sliding_window_mod(512, 512, 16), backend="blocks")
    prepared = [r.mask for r in dispatch._ROUTES.values() if r.mask is not None]
    assert len(prepared) == 1 and any(key[0] == "blocks" for key in prepared[0].memo)
    dispatch.clear_plans()
    assert not dispatch._ROUTES


def test_a_new_tensor_free_mod_per_step_is_planned_once(monkeypatch):
    """A model building ``sliding_window_mod(T, T, 256)`` (or passing causal=True) on every step
    finds its route by value, and the plan on the route's prepared mask."""
    from attnlab.backends import blocks

    plans = []
    real = blocks._plan_runs
    monkeypatch.setattr(blocks, "_plan_runs", lambda *a: plans.append(1) or real(*a))
    dispatch.clear_plans()
    q = torch.randn(1, 2, 256, 8)
    want = attnlab.attention(q.double(), q.double(), q.double(), mask=masks.sliding_window_mod(256, 256, 32),
                             backend="reference")
    for _ in range(4):
        out = attnlab.attention(q, q, q, mask=masks.sliding_window_mod(256, 256, 32), backend="blocks")
        assert torch.allclose(out.double(), want, atol=1e-5)
    assert len(plans) == 1
    for _ in range(3):
        attnlab.attention(q, q, q, causal=True, backend="blocks")
    assert len(plans) == 2


def test_threads_sharing_the_cache_get_what_one_thread_gets():
    dispatch.clear_plans()
    gen = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(1, 2, t, 8, generator=gen), t % 3 == 0) for t in range(1, 40)]
    want = [attnlab.attention(x, x, x, causal=causal) for x, causal in inputs]
    errors = []

    def work(index):
        try:
            for _ in range(20):
                for i, (x, causal) in enumerate(inputs):
                    if not torch.equal(attnlab.attention(x, x, x, causal=causal), want[i]):
                        errors.append(f"thread {index} call {i}: a different result")
                    if i % 7 == index:
                        dispatch.clear_plans()  # resets racing lookups and stores
        except Exception as error:  # noqa: BLE001 -- any error is the failure
            errors.append(error)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("mask", [None, "bool"])
def test_a_repeated_sdpa_call_reaches_the_kernel_within_six_python_frames(monkeypatch, mask):
    """From attnlab.attention to F.scaled_dot_product_attention: the prepared run, nothing else."""
    import sys

    import torch.nn.functional as F

    dispatch.clear_plans()
    real, depths = F.scaled_dot_product_attention, []

    def counting(*args, **kwargs):
        frame, depth = sys._getframe(1), 1
        while frame is not None and not (frame.f_code.co_name == "attention"
                                         and frame.f_code.co_filename.endswith("functional.py")):
            frame, depth = frame.f_back, depth + 1
        depths.append(depth)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    q, k, v = _decode_inputs()
    options = dict(mask=masks.padding_mask(torch.tensor([30]), 40)) if mask else {}
    for _ in range(2):
        attnlab.attention(q, k, v, **options)
    assert depths[-1] <= 6, depths  # frames from attention (1) to the kernel's caller
    assert depths[-1] < depths[0]  # the first call went through validation and dispatch


@pytest.mark.parametrize("per_query", [False, True], ids=["per_head", "per_query"])
def test_a_repeated_call_with_sinks_takes_the_prepared_run_with_its_own_sinks(counted_builds, per_query):
    """Sinks applied through SDPA's lse need no mask rebuilt per call, so a repeated decode step
    goes to the prepared run; it applies the sinks it is handed, not the first call's, and
    differentiates them when they require grad (grad mode is in the key). Per-query sinks
    ``(B, 1, Tq)`` of a batch of 3 too."""
    q, k, v = (torch.randn(3, *t.shape[1:]) for t in _decode_inputs()) if per_query else _decode_inputs()
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(q.shape[0], 1, 1, k.shape[2], generator=gen) > 0.3  # a padded cache, bool
    shape = (q.shape[0], 1, q.shape[2]) if per_query else (q.shape[1],)
    all_sinks = [torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3)]
    wants = []
    for sinks in all_sinks:
        want = attnlab.attention(q.double(), k.double(), v.double(), mask=mask, sinks=sinks.double(),
                                 backend="reference")
        wants.append((want, torch.autograd.grad(want.sum(), sinks)[0]))
    counted_builds.clear()
    for sinks, (want, want_grad) in zip(all_sinks, wants):
        out = attnlab.attention(q, k, v, mask=mask, sinks=sinks)
        assert torch.allclose(out.double(), want, atol=1e-5)
        assert torch.allclose(torch.autograd.grad(out.sum(), sinks)[0], want_grad, atol=1e-4)
    assert len(counted_builds) == 1  # the first call; the others are the prepared run
