"""The dispatch plan cache, the one cache on the hot path: a repeated call signature skips the
full dispatch, every change that can change the choice (shape, dtype, mask, options, grad mode,
the registry) gives the choice a fresh dispatch gives, it is bounded, safe to share between
threads, and one reset clears it and every backend's remembered state."""

from __future__ import annotations

import threading

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
    window = dict(mask=masks.sliding_window_mod(16, 16, 4))  # left to the cost model, not a rule
    assert select(build_call(q, q, q, **window)).name != "zero-cost-test"

    class ZeroCost(backends.Backend):
        name, memory = "zero-cost-test", "linear"

        def cost(self, call):
            return 0.0

        def forward(self, call):
            return backends.get("reference").forward(call)

    backends.register(ZeroCost())
    try:
        assert select(build_call(q, q, q, **window)).name == "zero-cost-test"
    finally:
        backends.unregister("zero-cost-test")
    assert select(build_call(q, q, q, **window)).name != "zero-cost-test"


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
    for t in range(1, dispatch.PLAN_CACHE_SIZE + 20):
        q = torch.randn(1, 1, 1, 4)
        select(build_call(q, torch.randn(1, 1, t, 4), torch.randn(1, 1, t, 4)))
    assert len(dispatch._PLANS) == dispatch.PLAN_CACHE_SIZE


@pytest.mark.parametrize("q_shape, k_shape", [((0, 2, 1, 8), (0, 2, 5, 8)), ((1, 2, 0, 8), (1, 2, 5, 8)),
                                              ((1, 2, 1, 8), (1, 2, 0, 8))])
def test_empty_batches_and_sequences_repeat_as_the_first_call_gives_them(q_shape, k_shape):
    """Regression: a remembered choice for an empty batch once indexed a query row that does not exist."""
    for _ in range(3):
        q, k = torch.randn(q_shape), torch.randn(k_shape)
        out = attnlab.attention(q, k, k)
        want = attnlab.attention(q.double(), k.double(), k.double(), backend="reference")
        assert out.shape == want.shape and torch.allclose(out.double(), want)


def test_one_reset_clears_dispatch_and_every_backend():
    from attnlab.backends import blocks
    q = torch.randn(1, 2, 512, 16)
    mod = masks.sliding_window_mod(512, 512, 16)
    attnlab.attention(q, q, q, mask=mod)
    assert dispatch._PLANS and blocks._PLANS
    dispatch.clear_plans()
    assert not dispatch._PLANS and not blocks._PLANS
    if "flex" in backends.registry():
        assert not backends.get("flex")._block_masks.entries


def test_threads_sharing_the_cache_get_the_choice_of_a_fresh_dispatch():
    dispatch.clear_plans()
    calls = [build_call(torch.randn(1, 2, t, 8), torch.randn(1, 2, t, 8), torch.randn(1, 2, t, 8),
                        causal=t % 2 == 0) for t in range(1, 40)]
    errors, chosen = [], {}

    def work(index):
        try:
            for _ in range(50):
                for i, call in enumerate(calls):
                    chosen.setdefault((index, i), set()).add(select(call).name)
                    if i % 7 == index:
                        dispatch.clear_plans()  # resets racing lookups
        except Exception as error:  # noqa: BLE001 -- any error is the failure
            errors.append(error)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (_, i), names in chosen.items():
        assert names == {_fresh(calls[i]).name}
