"""attnlab.plan: one attention signature decided once, held by the caller (issue 31)."""

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.backends import dispatch


def _qkv(*shape, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = (*shape[:-3], kv_heads or shape[-3], *shape[-2:]) if len(shape) >= 4 else shape
    return torch.randn(*shape, generator=g), torch.randn(*kv, generator=g), torch.randn(*kv, generator=g)


_CASES = {
    "causal": dict(causal=True),
    "bottom_right": dict(causal=True, align="bottom_right"),
    "bool": dict(mask=torch.rand(2, 1, 12, 12) > 0.3),
    "float": dict(mask=torch.randn(1, 1, 12, 12)),
    "window_mod": dict(mask=masks.sliding_window_mod(12, 12, 4)),
    "document_mod": dict(mask=masks.document_mod(torch.tensor([0] * 5 + [1] * 7))),
    "sinks": dict(causal=True, sinks=torch.randn(4)),
    "score_fn": dict(score_mod=lambda s, b, h, i, j: s - (i - j).abs() * 0.1),
    "weights": dict(causal=True, return_weights=True),
}


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_a_plan_computes_what_attention_computes(case, gqa):
    options = _CASES[case]
    planned = attnlab.plan(*_qkv(2, 4, 12, 8, kv_heads=2 if gqa else None), **options)
    for seed in range(1, 4):  # other tensors of the same signature
        q, k, v = _qkv(2, 4, 12, 8, kv_heads=2 if gqa else None, seed=seed)
        want = attnlab.attention(q, k, v, **options)
        got = planned(q, k, v)
        for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_a_plan_takes_each_batch_its_own_mask():
    q, k, v = _qkv(2, 4, 12, 8)
    padded = attnlab.plan(q, k, v, mask=torch.ones(2, 1, 1, 12, dtype=torch.bool))
    docs = attnlab.plan(q, k, v, mask=masks.document_mod(torch.zeros(12, dtype=torch.long)))
    for seed in range(3):
        keep = torch.rand(2, 1, 1, 12, generator=torch.Generator().manual_seed(seed)) > 0.4
        torch.testing.assert_close(padded(q, k, v, mask=keep), attnlab.attention(q, k, v, mask=keep))
        doc = masks.document_mod(torch.arange(12) // (seed + 3))
        torch.testing.assert_close(docs(q, k, v, mask=doc), attnlab.attention(q, k, v, mask=doc))


def test_a_plan_gives_attention_s_gradients():
    sinks = torch.randn(4, requires_grad=True)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 4, 12, 8, kv_heads=2))
    planned = attnlab.plan(q, k, v, causal=True, sinks=sinks)
    planned(q, k, v).square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    attnlab.attention(q, k, v, causal=True, sinks=sinks).square().sum().backward()
    for g, t in zip(got, (q, k, v, sinks)):
        torch.testing.assert_close(g, t.grad)
    with torch.no_grad():  # another grad setting, decided on its first call
        torch.testing.assert_close(planned(q, k, v), attnlab.attention(q, k, v, causal=True, sinks=sinks))


def test_a_plan_of_lower_rank_returns_that_rank():
    q, k, v = _qkv(3, 10, 8)  # (B, T, D)
    planned = attnlab.plan(q, k, v, causal=True)
    assert planned(q, k, v).shape == (3, 10, 8)
    torch.testing.assert_close(planned(q, k, v), attnlab.attention(q, k, v, causal=True))


def test_a_plan_names_its_backend_and_leaves_no_module_state():
    dispatch.clear_plans()
    q, k, v = _qkv(1, 2, 64, 8)
    assert attnlab.plan(q, k, v, causal=True).backend == "sdpa"
    assert attnlab.plan(q, k, v, causal=True, backend="chunked").backend == "chunked"
    assert attnlab.plan(q, k, v, mask=masks.sliding_window_mod(64, 64, 8)).backend == \
        attnlab.backends.select(attnlab.backends.build_call(q, k, v, mask=masks.sliding_window_mod(64, 64, 8))).name
    assert not dispatch._ROUTES


def test_a_plan_refuses_another_signature_by_name():
    q, k, v = _qkv(2, 4, 12, 8)
    planned = attnlab.plan(q, k, v, mask=torch.ones(12, 12, dtype=torch.bool), sinks=torch.zeros(4))
    with pytest.raises(ValueError, match=r"^q: the plan was made for shape \(2, 4, 12, 8\)"):
        planned(q[:, :, :11], k, v)
    with pytest.raises(ValueError, match=r"^k: .* float32 on cpu, got shape \(2, 4, 12, 8\) float64"):
        planned(q, k.double(), v)
    with pytest.raises(ValueError, match=r"^v: "):
        planned(q, k, v[:1])
    with pytest.raises(ValueError, match=r"^mask: the plan was made for shape \(12, 12\) bool"):
        planned(q, k, v, mask=torch.ones(1, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^mask: the plan was made with a tensor"):
        planned(q, k, v, mask=masks.sliding_window_mod(12, 12, 2))
    with pytest.raises(ValueError, match=r"^sinks: "):
        planned(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match=r"^mask: the plan was made with none"):
        attnlab.plan(q, k, v)(q, k, v, mask=torch.ones(12, 12, dtype=torch.bool))
    with pytest.raises(TypeError, match="^k must be a torch.Tensor, got list"):
        planned(q, [1.0], v)
    with pytest.raises(ValueError, match="backend 'flex' cannot serve"):
        attnlab.plan(q, k, v, dropout_p=0.5, backend="flex")


def test_a_plan_tells_a_parameter_mask_that_wants_a_gradient_from_one_that_does_not():
    """Regression: the held plan's grad setting read ``type(mask) is Tensor``, so an
    ``nn.Parameter`` mask that came to want a gradient reused the route planned without one
    (sdpa's sinks through the CPU kernel's lse, which refuses a mask gradient): it must get its
    own route and the reference's gradient."""
    q = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    bias = torch.nn.Parameter(torch.zeros(1, 2, 8, 8, dtype=torch.float64), requires_grad=False)
    sinks = torch.zeros(2, dtype=torch.float64)
    held = attnlab.plan(q, q, q, mask=bias, sinks=sinks)
    with torch.no_grad():
        held(q, q, q)
    bias.requires_grad_(True)
    held(q, q, q, mask=bias).sum().backward()
    want = torch.zeros(1, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    attnlab.attention(q, q, q, mask=want, sinks=sinks, backend="reference").sum().backward()
    torch.testing.assert_close(bias.grad, want.grad)
