"""No user tensor or object stays reachable from attnlab's module state once a call returns
(issue 31): the route cache keys mask mods by value only and a user's score mod by weak
reference, stays bounded, and is cleared by ``clear_plans()``."""

import gc
import weakref

import torch

import attnlab
from attnlab import masks
from attnlab.backends import dispatch


def _batch(step: int) -> dict:
    """One training step's user objects: fresh tensors, a document mask, a score-mod closure."""
    g = torch.Generator().manual_seed(step)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(3))
    ids = torch.randint(0, 3, (16,), generator=g).sort().values
    bias = torch.randn(16, 16, generator=g)
    return dict(q=q, k=k, v=v, ids=ids, bias=bias, doc=masks.document_mod(ids),
                score=lambda s, b, h, i, j: s + bias[i, j] * 0.1,
                floats=torch.randn(2, 1, 16, 16, generator=g), bools=torch.rand(2, 1, 16, 16, generator=g) > 0.3,
                sinks=torch.randn(2, generator=g))


def _calls(x: dict):
    q, k, v = x["q"], x["k"], x["v"]
    yield dict(mask=x["doc"])
    yield dict(mask=x["doc"], causal=True)
    yield dict(score_mod=x["score"], causal=True)
    yield dict(mask=x["floats"])
    yield dict(mask=x["bools"], sinks=x["sinks"])
    yield dict(causal=True, sinks=x["sinks"])
    yield dict(mask=masks.sliding_window_mod(16, 16, 4))  # held by value: remembered


def test_no_user_object_outlives_its_calls():
    dispatch.clear_plans()
    alive = []
    for step in range(600 // 6):  # 700 calls, 100 document masks and score closures
        x = _batch(step)
        for options in _calls(x):
            out = attnlab.attention(x["q"], x["k"], x["v"], **options)
            assert out.shape == (2, 2, 16, 8)
        alive += [weakref.ref(obj) for name, obj in x.items()]
        del x, options, out
    gc.collect()
    survivors = [ref() for ref in alive if ref() is not None]
    assert not survivors, f"{len(survivors)} user objects kept alive, e.g. {type(survivors[0]).__name__}"
    assert 0 < len(dispatch._ROUTES) <= dispatch.PLAN_CACHE_SIZE


def test_a_tensor_holding_mod_is_remembered_by_weak_identity_and_a_value_mod_by_value():
    dispatch.clear_plans()
    q = torch.randn(1, 2, 16, 8)
    documents = masks.document_mod(torch.tensor([0] * 8 + [1] * 8))
    attnlab.attention(q, q, q, mask=documents)
    key = dispatch.argument_key(q, q, q, mask=documents, causal=False, align="top_left", scale=None, dropout_p=0.0,
                                generator=None, backend="auto", return_weights=False)
    assert dispatch.remembered(key) is not None  # a held mod (or PreparedMask) skips dispatch
    ref = weakref.ref(documents)
    del documents
    gc.collect()
    assert ref() is None  # the key held it by weak reference only
    assert dispatch.remembered(key) is None  # and a dead mod matches nothing
    attnlab.attention(q, q, q, mask=masks.sliding_window_mod(16, 16, 4))
    attnlab.attention(q, q, q, mask=masks.sliding_window_mod(16, 16, 4))  # a new object, the same value
    assert len(dispatch._ROUTES) == 2


def test_a_remembered_score_function_is_found_while_it_lives():
    dispatch.clear_plans()
    q = torch.randn(1, 2, 16, 8)
    fn = lambda s, b, h, i, j: s * 0.5  # noqa: E731
    attnlab.attention(q, q, q, score_mod=fn)
    key = dispatch.argument_key(q, q, q, mask=None, causal=False, align="top_left", scale=None, dropout_p=0.0,
                                generator=None, backend="auto", return_weights=False, score_mod=fn)
    assert dispatch.remembered(key) is not None
    ref = weakref.ref(fn)
    del fn
    gc.collect()
    assert ref() is None  # the route's key held it by weak reference only
    assert dispatch.remembered(key) is None  # and a dead function matches nothing


def test_the_route_cache_stays_within_its_bound(monkeypatch):
    dispatch.clear_plans()
    monkeypatch.setattr(dispatch, "PLAN_CACHE_SIZE", 4)
    for t in range(1, 12):
        q = torch.randn(1, 1, t, 4)
        attnlab.attention(q, q, q, causal=True)
        assert len(dispatch._ROUTES) <= 4
    dispatch.clear_plans()
    assert not dispatch._ROUTES


def test_clear_plans_is_the_one_reset_and_reaches_every_backend():
    forgotten = []

    class Remembers(attnlab.backends.Backend):
        name = "remembers-test"

        def reset(self):
            forgotten.append(self.name)

    attnlab.backends.register(Remembers())
    try:
        q = torch.randn(1, 1, 4, 8)
        attnlab.attention(q, q, q, causal=True)
        dispatch.clear_plans()
        assert forgotten == ["remembers-test"] and not dispatch._ROUTES
    finally:
        attnlab.backends.unregister("remembers-test")
