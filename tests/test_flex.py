"""The flex backend: what it declines on CPU, its block-mask cache, and CUDA paths (skipped here)."""

import pytest
import torch

import attnlab
from attnlab import backends
from attnlab.backends import build_call

pytestmark = pytest.mark.skipif("flex" not in backends.available(), reason="no FlexAttention")
SHAPE = (2, 3, 17, 40)  # one shape for every CPU test here: flex compiles per shape


def _qkv(requires_grad=False, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    B, H, T, D = SHAPE
    return [torch.randn(B, H, T, D, generator=gen).to(device).requires_grad_(requires_grad)
            for _ in range(3)]


def test_cpu_declines_backward_and_dropout():
    q, k, v = _qkv(requires_grad=True)
    reasons = backends.reasons(build_call(q, k, v, dropout_p=0.1))["flex"]
    assert any("no dropout" in r for r in reasons)
    if not q.is_cuda:
        assert any("no backward on CPU" in r for r in reasons)
    with torch.no_grad():
        assert backends.reasons(build_call(q, k, v))["flex"] == []


def test_block_mask_is_cached_per_mask_identity():
    cache = backends.get("flex")._block_masks
    q, k, v = _qkv()
    mask = torch.rand(17, 17, generator=torch.Generator().manual_seed(1)) > 0.3
    with torch.no_grad():
        first = attnlab.attention(q, k, v, mask=mask, backend="flex")
        cached = cache.get(build_call(q, k, v, mask=mask))
        again = attnlab.attention(q, k, v, mask=mask, backend="flex")
        assert cached is not None and cache.get(build_call(q, k, v, mask=mask)) is cached
        assert cache.get(build_call(q, k, v, mask=mask.clone())) is None  # another tensor
        mask[0, 0] = not mask[0, 0]  # an in-place edit bumps the version: not the cached one
        assert cache.get(build_call(q, k, v, mask=mask)) is None
        changed = attnlab.attention(q, k, v, mask=mask, backend="flex")
        want = attnlab.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert torch.equal(first, again)
    torch.testing.assert_close(changed.double(), want, atol=1e-5, rtol=1e-5)


def test_mask_mod_and_causal_forward_on_cpu():
    q, k, v = _qkv()
    mod = attnlab.masks.sliding_window_mod(17, 17, 4)
    with torch.no_grad():
        out = attnlab.attention(q, k, v, mask=mod, causal=True, backend="flex")
        want = attnlab.attention(q.double(), k.double(), v.double(), mask=mod, causal=True,
                                 backend="reference")
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_uncompiled_variant_costs_compilation_time():
    flex = backends.get("flex")
    q = torch.randn(1, 1, 5, 7)  # a shape no test compiles
    assert flex.cost(build_call(q, q, q)) >= 4.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_backward_and_lse():
    q, k, v = _qkv(requires_grad=True, device="cuda")
    out, weights = attnlab.attention(q, k, v, causal=True, backend="flex", return_weights=True)
    out.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, want_weights = attnlab.attention(*ref, causal=True, backend="reference", return_weights=True)
    want.sum().backward()
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(weights.double(), want_weights, atol=1e-4, rtol=1e-4)
    for got, exp in zip((q, k, v), ref):
        torch.testing.assert_close(got.grad.double(), exp.grad, atol=1e-3, rtol=1e-3)


def test_declines_a_new_shape_past_its_compile_bound(monkeypatch):
    """Past Dynamo's recompile limit flex would run unfused (O(T^2)); it must decline instead."""
    flex = backends.get("flex")
    q, k, v = _qkv()
    with torch.no_grad():
        attnlab.attention(q, k, v, backend="flex")  # compiled: this variant stays served
        monkeypatch.setattr("attnlab.backends.flex._MAX_VARIANTS", len(flex._variants))
        assert backends.reasons(build_call(q, k, v))["flex"] == []
        other = torch.randn(1, 1, 5, 40)
        reasons = backends.reasons(build_call(other, other, other))["flex"]
        assert any("unfused with O(T^2) memory" in r for r in reasons)
        with pytest.raises(ValueError, match="shapes are compiled"):
            attnlab.attention(other, other, other, backend="flex")
        assert attnlab.backends.select(build_call(other, other, other)).name != "flex"
