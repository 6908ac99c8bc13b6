"""The dispatch plan cache: a repeated call signature skips the full dispatch, and every change
that can change the choice (shape, dtype, mask, options, grad mode, the registry, the values
a backend's limits read) gives the choice a fresh dispatch gives."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import backends, masks
from attnlab.backends import build_call, dispatch, select


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
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 32, 8)
    first = select(build_call(q, k, k))
    asked = counting.asked
    for _ in range(3):
        assert select(build_call(torch.randn(1, 4, 1, 8), k, k)) is first
    assert counting.asked == asked  # only the remembered backend was asked again


def _fresh(call):
    return dispatch._select(call, "auto")


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
def test_every_change_gets_the_choice_of_a_fresh_dispatch(counting, grad):
    with torch.set_grad_enabled(grad):
        for _ in range(2):  # the second round is all cache hits
            for args in _variants():
                call = build_call(args.pop("q"), args.pop("k"), args.pop("v"), **args)
                assert select(call) is _fresh(call), call


def test_grad_mode_change_is_seen():
    dispatch.clear_plans()
    q = torch.randn(1, 2, 512, 16, requires_grad=True)
    mod = masks.sliding_window_mod(512, 512, 8)
    with torch.no_grad():
        call = build_call(q, q, q, mask=mod)
        assert select(call) is _fresh(call)
    call = build_call(q, q, q, mask=mod)
    assert call.requires_grad and select(call) is _fresh(call)


def test_registering_a_backend_invalidates_the_plans(counting):
    q = torch.randn(1, 2, 16, 8)
    assert select(build_call(q, q, q)).name != "zero-cost-test"

    class ZeroCost(backends.Backend):
        name, memory = "zero-cost-test", "linear"

        def cost(self, call):
            return 0.0

        def forward(self, call):
            return backends.get("reference").forward(call)

    backends.register(ZeroCost())
    try:
        assert select(build_call(q, q, q)).name == "zero-cost-test"
    finally:
        backends.unregister("zero-cost-test")
    assert select(build_call(q, q, q)).name != "zero-cost-test"


def test_values_a_limit_reads_are_rechecked_on_a_hit():
    """blocks serves a long causal window; NaN in q then makes it decline: the hit must notice."""
    dispatch.clear_plans()
    q = torch.randn(1, 2, 2048, 16)
    mod = masks.sliding_window_mod(2048, 2048, 64)
    assert select(build_call(q, q, q, mask=mod)).name == "blocks"
    bad = q.clone()
    bad[0, 0, 100, 3] = float("nan")
    assert select(build_call(bad, q, q, mask=mod)).name != "blocks"
    out = attnlab.attention(bad, q, q, mask=mod)
    want = attnlab.attention(bad, q, q, mask=mod, backend="reference")
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.allclose(torch.nan_to_num(out), torch.nan_to_num(want), atol=1e-5)


def test_the_cache_is_bounded():
    dispatch.clear_plans()
    for t in range(1, dispatch.PLAN_CACHE_SIZE + 20):
        q = torch.randn(1, 1, 1, 4)
        select(build_call(q, torch.randn(1, 1, t, 4), torch.randn(1, 1, t, 4)))
    assert len(dispatch._PLANS) == dispatch.PLAN_CACHE_SIZE


# ------------------------------------------------------------ prepared runs (decoding steps)
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


def _prime(q, k, v, **options):
    """Call twice: a signature is prepared the second time it is seen."""
    for _ in range(2):
        attnlab.attention(q, k, v, **options)


def _decode_inputs(kv_heads=4):
    return torch.randn(1, 4, 1, 16), torch.randn(1, kv_heads, 40, 16), torch.randn(1, kv_heads, 40, 16)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_a_repeated_decoding_step_skips_validation_and_matches_the_full_path(counted_builds, kv_heads):
    for step in range(4):
        q, k, v = _decode_inputs(kv_heads)
        out = attnlab.attention(q, k, v, causal=True, align="bottom_right")
        want = attnlab.attention(q.double(), k.double(), v.double(), backend="reference")
        assert torch.allclose(out.double(), want, atol=1e-5)
    # the first two fp32 calls (the second prepares the run), then only the fp64 references
    assert len(counted_builds) == 2 + 4


def test_a_signature_seen_once_leaves_no_prepared_run(counted_builds):
    q = torch.randn(1, 4, 1, 16)
    for tk in range(20, 30):  # a decoding loop: Tk grows every step
        k = torch.randn(1, 4, tk, 16)
        attnlab.attention(q, k, k)
    assert not dispatch._RUNS and len(dispatch._SEEN) == 10


def test_a_prepared_run_keeps_the_nan_rule(counted_builds):
    q, k, v = _decode_inputs()
    _prime(q, k, v)
    q[0, 2, 0, 5] = float("nan")
    out = attnlab.attention(q, k, v)
    assert len(counted_builds) == 2  # served by the prepared run
    assert out[0, 2].isnan().all() and not out[0, [0, 1, 3]].isnan().any()


def test_every_change_of_signature_validates_again(counted_builds):
    q, k, v = _decode_inputs()
    _prime(q, k, v)
    changes = [
        dict(q=torch.randn(1, 4, 2, 16)), dict(k=torch.randn(1, 4, 41, 16), v=torch.randn(1, 4, 41, 16)),
        dict(q=q.double(), k=k.double(), v=v.double()), dict(causal=True), dict(scale=0.5),
        dict(backend="reference"), dict(q=q.clone().requires_grad_()),
        dict(mask=torch.ones(1, 40, dtype=torch.bool)), dict(mask=masks.sliding_window_mod(1, 40, 8)),
        dict(return_weights=True), dict(dropout_p=0.5),
    ]
    for change in changes:
        before = len(counted_builds)
        args = {"q": q, "k": k, "v": v, **change}
        attnlab.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        assert len(counted_builds) == before + 1, change
    with torch.no_grad():  # no gradient will be recorded: the first call's signature again
        before = len(counted_builds)
        attnlab.attention(q.clone().requires_grad_(), k, v)
        assert len(counted_builds) == before


def test_registering_a_backend_expires_prepared_runs(counted_builds):
    q, k, v = _decode_inputs()
    _prime(q, k, v)
    backends.register(backends.registry()["sdpa"])
    attnlab.attention(q, k, v)
    assert len(counted_builds) == 3


@pytest.mark.parametrize("bad", [dict(causal=1), dict(scale=True), dict(dropout_p=False),
                                 dict(scale=float("nan")), dict(align="middle")])
def test_bad_options_still_raise_after_a_prepared_run(counted_builds, bad):
    q, k, v = _decode_inputs()
    _prime(q, k, v, causal=bool(bad.get("causal", False)))
    with pytest.raises((TypeError, ValueError)):
        attnlab.attention(q, k, v, **bad)


def test_a_prepared_run_refuses_what_validation_refuses(counted_builds):
    q, k, v = _decode_inputs()
    _prime(q, k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        attnlab.attention(q, k.double(), v)
    with pytest.raises(ValueError, match="Tk"):
        attnlab.attention(q, k, v[:, :, :39])


def test_a_prepared_run_gives_gradients_as_the_full_path(counted_builds):
    q, k, v = (t.requires_grad_() for t in _decode_inputs())
    for _ in range(3):  # the third call is the prepared run
        q.grad = k.grad = v.grad = None
        attnlab.attention(q, k, v).square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    attnlab.attention(q, k, v, backend="reference").square().sum().backward()
    assert len(counted_builds) == 3
    for have, want in zip(got, (q.grad, k.grad, v.grad)):
        assert torch.allclose(have, want, atol=1e-5)


def test_a_kernel_that_hides_nan_rows_keeps_the_check(counted_builds, monkeypatch):
    """Some CPU builds' flash kernel returns zeros for a NaN query row: the probe sees it."""
    real = torch.nn.functional.scaled_dot_product_attention

    def hiding(q, k, v, **options):
        out = real(q, k, v, **options)
        return torch.where(q.isnan().any(dim=-1, keepdim=True), 0.0, out)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", hiding)
    q, k, v = _decode_inputs()
    _prime(q, k, v)
    q[0, 1, 0, 3] = float("nan")
    out = attnlab.attention(q, k, v)
    assert len(counted_builds) == 2  # the prepared run served it, with its own check
    assert out[0, 1].isnan().all() and not out[0, [0, 2, 3]].isnan().any()


@pytest.mark.parametrize("q_shape, k_shape", [((0, 2, 1, 8), (0, 2, 5, 8)), ((1, 2, 0, 8), (1, 2, 5, 8)),
                                              ((1, 2, 1, 8), (1, 2, 0, 8))])
def test_empty_batches_and_sequences_repeat_as_the_full_path_gives_them(counted_builds, q_shape, k_shape):
    """Regression: preparing a run for an empty batch indexed a query row that does not exist."""
    for _ in range(3):
        q, k = torch.randn(q_shape), torch.randn(k_shape)
        out = attnlab.attention(q, k, k)
        want = attnlab.attention(q.double(), k.double(), k.double(), backend="reference")
        assert out.shape == want.shape and torch.allclose(out.double(), want)
