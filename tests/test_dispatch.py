"""Dispatch: named backends that cannot serve raise with reasons; auto respects memory class;
``why`` explains the choice."""

import pytest
import torch

import attnlab
from attnlab import backends
from attnlab.backends import build_call, dispatch
from attnlab.backends.sdpa import kernel_for as sdpa_kernel_for


def _qkv(t=64, d=16, heads=2, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, t, d, generator=gen, requires_grad=requires_grad) for _ in range(3)]


def test_named_backend_that_cannot_serve_raises_with_reasons():
    q, k, v = _qkv(requires_grad=True)
    with pytest.raises(ValueError, match="flex.*no backward on CPU"):
        attnlab.attention(q, k, v, backend="flex")
    with pytest.raises(ValueError, match="no dropout"):
        with torch.no_grad():
            attnlab.attention(q, k, v, dropout_p=0.1, backend="flex")


def test_unknown_backend_lists_names():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sdpa"):
        attnlab.attention(q, k, v, backend="nope")


_CALLS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "bottom_right": dict(causal=True, align="bottom_right"),
    "padding": dict(mask=attnlab.masks.padding_mask(torch.tensor([40]), 64)),
    "dense_bool": dict(mask=torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) > 0.5),
    "mask_mod": dict(mask=attnlab.masks.sliding_window_mod(64, 64, 8)),
    "causal_padding": dict(causal=True, mask=attnlab.masks.padding_mask(torch.tensor([40]), 64)),
    "dropout": dict(dropout_p=0.2),
}


@pytest.fixture
def budget():
    """Set the memory budget for one test (restored after)."""
    previous = dispatch.set_memory_budget(None)
    yield dispatch.set_memory_budget
    dispatch.set_memory_budget(previous)


@pytest.mark.parametrize("limit", [0, None], ids=["budget0", "default_budget"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", sorted(_CALLS))
def test_auto_chooses_within_the_memory_budget_then_by_time(case, grad, limit, budget):
    budget(limit)
    q, k, v = _qkv(requires_grad=grad)
    q = torch.cat([q, q[:, :, :1]], dim=2) if case == "bottom_right" else q  # Tq != Tk
    with torch.set_grad_enabled(grad):
        call = build_call(q, k, v, **_CALLS[case])
        chosen = backends.select(call, "auto")
        serving = [backends.get(n) for n, why in backends.reasons(call).items() if not why]
    allowed = dispatch.memory_budget(call)
    assert allowed == (0 if limit == 0 else dispatch.default_memory_budget(call))
    fits = [b for b in serving if b.memory_use(call).nbytes <= allowed]
    if fits:
        assert chosen in fits
    if limit == 0 and any(backends.memory_class(b, call) == "linear" for b in serving):
        assert backends.memory_class(chosen, call) == "linear"  # no O(T^2) path when an O(T) one serves
    preferred = [b for b in fits if dispatch.claimed(b, call)]
    if preferred:  # a fixed rule wins over the cost estimates (sdpa on the mask the caller holds)
        assert chosen is preferred[0]
    else:
        linear = [b for b in serving if backends.memory_class(b, call) == "linear"]
        assert chosen.cost(call) == min(b.cost(call) for b in (fits or linear or serving))
    # sdpa takes every call whose mask reaches it as the caller holds it, and padded causal
    # batches (one call per run of real keys), on every machine
    if case in ("plain", "causal", "padding", "dense_bool", "causal_padding"):
        assert chosen.name == "sdpa" and backends.memory_class(chosen, call) == "linear"


def test_a_materialised_mask_is_taken_only_within_the_budget_and_when_faster(budget):
    """At T=64 a sliding window's dense mask (4 KiB) costs less than blocks' per-block calls:
    auto builds it; with a budget below those 4 KiB it keeps to an O(T) path."""
    q, k, v = _qkv()
    call = build_call(q, k, v, **_CALLS["mask_mod"])
    sdpa = backends.get("sdpa")
    assert sdpa.memory_use(call).nbytes == 64 * 64  # one bool (1, 1, 64, 64) mask
    cheapest = min((backends.get(n) for n, why in backends.reasons(call).items() if not why), key=lambda b: b.cost(call))
    assert backends.select(call, "auto") is cheapest
    budget(64 * 64 - 1)
    assert backends.memory_class(backends.select(call, "auto"), call) == "linear"
    text = backends.why(q, k, v, **_CALLS["mask_mod"])
    assert "memory budget 0.0 MiB (set by attnlab.backends.set_memory_budget)" in text
    assert "  sdpa: over the memory budget: O(T^2) memory, 4.0 KiB" in text


def test_set_memory_budget_refuses_bad_values_and_forgets_routes(budget):
    with pytest.raises(ValueError, match="nbytes must be a non-negative int, got -1"):
        budget(-1)
    with pytest.raises(TypeError, match="nbytes must be a non-negative int, got 1.5"):
        budget(1.5)
    q = torch.randn(1, 2, 64, 8)
    attnlab.attention(q, q, q, mask=attnlab.masks.sliding_window_mod(64, 64, 8))
    assert dispatch._ROUTES
    budget(0)
    assert not dispatch._ROUTES


def test_the_default_budget_grows_with_the_tensors_and_stays_under_an_eighth_of_memory():
    small, large = torch.randn(1, 1, 8, 4), torch.empty(64, 32, 4096, 128, device="meta")
    assert dispatch.default_memory_budget(build_call(small, small, small)) == 64 * 2**20
    large_call = build_call(large, large, large)
    total = dispatch._device_memory(torch.device("cpu"))
    expected = 4 * backends.base.io_bytes(large_call)
    assert dispatch.default_memory_budget(large_call) == expected  # meta: no device memory to cap by
    if total is not None:
        assert dispatch.default_memory_budget(build_call(large.to("cpu") if False else small, small, small)) <= max(total // 8, 64 * 2**20)


def test_sdpa_memory_class_follows_the_call():
    q, k, v = _qkv()
    sdpa = backends.get("sdpa")
    assert backends.memory_class(sdpa, build_call(q, k, v, causal=True)) == "linear"
    assert backends.memory_class(sdpa, build_call(q, k, v, **_CALLS["padding"])) == "linear"
    assert backends.memory_class(sdpa, build_call(q, k, v, **_CALLS["mask_mod"])) == "quadratic"
    # a dense mask the caller holds does not make sdpa worse: its additive copy is that mask's size
    assert backends.memory_class(sdpa, build_call(q, k, v, **_CALLS["dense_bool"])) == "linear"
    assert backends.memory_class(sdpa, build_call(q, k, v[..., :8])) == "quadratic"  # math kernel


def test_why_names_the_chosen_backend_and_every_other_reason():
    q, k, v = _qkv(requires_grad=True)
    text = backends.why(q, k, v, causal=True, dropout_p=0.1)
    chosen = backends.select(build_call(q, k, v, causal=True, dropout_p=0.1)).name
    assert f"runs on {chosen!r}" in text
    others = [n for n in backends.registry() if n != chosen]
    for name in others:
        assert f"  {name}: " in text
    assert "no backward on CPU" in text or "no dropout" in text  # flex's reasons
    assert any(word in text for word in ("slower", "over the memory budget", "passed over"))  # the reference


def test_why_reports_slower_backends_with_costs():
    q, k, v = _qkv(t=256)
    table = backends.verdicts(build_call(q, k, v, causal=True))
    chosen = next(v for v in table if v.chosen)
    slower = [v for v in table if v.reason.startswith("slower")]
    for verdict in slower:
        assert verdict.cost_s >= chosen.cost_s
        assert verdict.memory_bytes <= dispatch.memory_budget(build_call(q, k, v, causal=True))


def test_why_for_a_named_backend_and_echo(capsys):
    q, k, v = _qkv()
    text = backends.why(q, k, v, backend="reference", echo=True)
    assert "runs on 'reference'" in text and "named explicitly" in text
    assert capsys.readouterr().out.strip() == text


def test_auto_asks_only_the_preferred_backend_when_its_rule_claims_the_call(monkeypatch):
    asked = []
    real = dispatch.reasons_of
    monkeypatch.setattr(dispatch, "reasons_of", lambda backend, call, **named: asked.append(backend.name) or real(backend, call, **named))
    q = torch.randn(1, 2, 64, 8)
    for options in (dict(), dict(causal=True), dict(mask=torch.rand(64, 64) > 0.5), dict(mask=torch.zeros(64, 64))):
        asked.clear()
        assert backends.select(build_call(q, q, q, **options), "auto").name == "sdpa"
        assert asked == ["sdpa"], options
    asked.clear()
    assert backends.select(build_call(q, q, q, causal=True), "chunked").name == "chunked"
    assert asked == ["chunked"]  # a named backend: its own reasons only
    asked.clear()
    backends.select(build_call(q, q, q, mask=attnlab.masks.sliding_window_mod(64, 64, 8)), "auto")
    assert sorted(asked) == sorted(backends.names())  # a mask mod: every backend, then the cost model


def test_auto_leaves_sdpa_when_its_math_kernel_would_run():
    """Value features unlike the keys' (MLA, differential attention) send CPU SDPA to its math
    kernel, which builds the (Tq, Tk) scores: auto must pick an O(T) backend instead, exactly."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 512, 8), torch.randn(1, 2, 512, 8), torch.randn(1, 2, 512, 16)
    call = build_call(q, k, v, causal=True)
    assert sdpa_kernel_for(call) == "math"
    chosen = dispatch.select(call)
    assert chosen.name != "sdpa" and chosen.memory_use(call).kind == "linear"
    expected = attnlab.attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    torch.testing.assert_close(attnlab.attention(q, k, v, causal=True).double(), expected, atol=1e-5, rtol=1e-5)
    same = build_call(q, k, v[..., :8], causal=True)  # equal features: SDPA's fused kernel, still preferred
    assert dispatch.select(same).name == "sdpa"


def test_under_no_grad_the_key_leaves_out_requires_grad_and_the_route_is_shared():
    """Under no_grad no input's requires_grad changes the call: the key does not read them (a decoding
    step saves the reads) and one route serves both; with grad on they are part of the key."""
    from attnlab.backends.dispatch import argument_key

    q = torch.randn(1, 2, 1, 8)
    wanting = q.clone().requires_grad_()
    options = dict(mask=None, causal=False, align="top_left", scale=None, dropout_p=0.0, generator=None,
                   backend="auto", return_weights=False)
    with torch.no_grad():
        assert argument_key(q, q, q, **options) == argument_key(wanting, q, wanting, **options)
        torch.testing.assert_close(attnlab.attention(wanting, q, q), attnlab.attention(q, q, q), rtol=0, atol=0)
    assert argument_key(q, q, q, **options) != argument_key(wanting, q, q, **options)
    out = attnlab.attention(wanting, q, q)
    assert out.requires_grad  # the route with grad on was made for a call that wants one
