"""Dispatch: named backends that cannot serve raise with reasons; auto respects memory class;
``why`` explains the choice."""

import pytest
import torch

import attnlab
from attnlab import backends
from attnlab.backends import build_call, dispatch


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


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", sorted(_CALLS))
def test_auto_never_picks_quadratic_when_linear_serves(case, grad):
    q, k, v = _qkv(requires_grad=grad)
    q = torch.cat([q, q[:, :, :1]], dim=2) if case == "bottom_right" else q  # Tq != Tk
    with torch.set_grad_enabled(grad):
        call = build_call(q, k, v, **_CALLS[case])
        chosen = backends.select(call, "auto")
        serving = [backends.get(n) for n, why in backends.reasons(call).items() if not why]
    classes = {backends.memory_class(b, call) for b in serving}
    if "linear" in classes:
        assert backends.memory_class(chosen, call) == "linear"
    same_class = [b for b in serving if backends.memory_class(b, call) == backends.memory_class(chosen, call)]
    preferred = [b for b in same_class if dispatch.claimed(b, call)]
    if preferred:  # a fixed rule wins over the cost estimates (sdpa on the mask the caller holds)
        assert chosen is preferred[0]
    else:
        assert chosen.cost(call) == min(b.cost(call) for b in same_class)
    # sdpa takes every call whose mask reaches it as the caller holds it, on every machine
    assert (chosen.name == "sdpa") == (case in ("plain", "causal", "padding", "dense_bool", "causal_padding")
                                       and backends.memory_class(backends.get("sdpa"), call) == "linear")


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
    assert "O(T^2) memory where an O(T) path serves" in text  # the reference


def test_why_reports_slower_backends_with_costs():
    q, k, v = _qkv(t=256)
    table = backends.verdicts(build_call(q, k, v, causal=True))
    chosen = next(v for v in table if v.chosen)
    slower = [v for v in table if v.reason.startswith("slower")]
    for verdict in slower:
        assert verdict.cost_s >= chosen.cost_s
        assert verdict.memory == chosen.memory


def test_why_for_a_named_backend_and_echo(capsys):
    q, k, v = _qkv()
    text = backends.why(q, k, v, backend="reference", echo=True)
    assert "runs on 'reference'" in text and "named explicitly" in text
    assert capsys.readouterr().out.strip() == text


def test_auto_asks_only_the_preferred_backend_when_its_rule_claims_the_call(monkeypatch):
    asked = []
    real = dispatch.reasons_of
    monkeypatch.setattr(dispatch, "reasons_of", lambda backend, call: asked.append(backend.name) or real(backend, call))
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
