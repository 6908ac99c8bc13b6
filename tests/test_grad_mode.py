"""Grad mode: every backend decides from what the call will need -- ``torch.is_grad_enabled()``
and each input's ``requires_grad`` -- and never accepts a call it then fails on."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import backends
from attnlab.lab import verify
from attnlab.backends import build_call


def _names():
    return [pytest.param(name, id=name) for name in backends.available()]


def _configs(name: str):
    """Two configurations the backend serves forward (flex: whole 128-key blocks, one shape)."""
    if name == "flex":
        return verify.configs(2, seed=1, shapes=(verify.FLEX_SHAPES[4],))
    bounded = getattr(backends.get(name), "needs_bounds", False)
    return verify.configs(2, seed=1, small=True, masks=verify.BOUNDED_MASKS if bounded else None)


@pytest.mark.parametrize("name", _names())
def test_every_grad_mode_is_served_right_or_declined(name):
    for config in _configs(name):
        for enabled, inputs in verify.GRAD_MODES:
            result = verify.check_grad_mode(name, config, torch.float32, grad_enabled=enabled, inputs=inputs)
            assert result.passed, f"{result.config}: {result.note} errors {result.errors} allowed {result.allowed}"
            if not result.served:
                assert result.note, "a decline gives its reason"


def test_flex_serves_no_grad_calls_whose_inputs_require_grad():
    """It accepted them and PyTorch's CPU kernel raised 'FlexAttention does not support backward on CPU'."""
    if "flex" not in backends.available():
        pytest.skip("flex cannot run here")
    B, Hq, _, T, _, D, _ = verify.FLEX_SHAPES[4]
    q, k, v = (torch.randn(B, Hq, T, D, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        out = attnlab.attention(q, k, v, causal=True, backend="flex")
    want = attnlab.attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    torch.testing.assert_close(out.double(), want.detach(), rtol=0, atol=1e-5)
    assert not out.requires_grad


def test_a_float_mask_that_requires_grad_needs_a_backward():
    q = torch.randn(1, 2, 4, 8)
    bias = torch.zeros(1, 2, 4, 4, requires_grad=True)
    assert build_call(q, q, q, mask=bias).requires_grad
    assert not build_call(q, q, q, mask=bias.detach()).requires_grad
    with torch.no_grad():
        assert not build_call(q, q, q, mask=bias).requires_grad


def test_the_sweep_crosses_grad_modes_and_catches_a_backend_that_fails_on_them():
    """A planted backend that serves no_grad calls but raises when an input requires grad
    (what flex did) fails the sweep; a correct one passes every grad mode."""

    class GradBlind(backends.Backend):
        name, memory, backward_devices = "grad-blind-test", "quadratic", ("cuda",)

        def forward(self, call):
            if any(t.requires_grad for t in (call.q, call.k, call.v)):
                raise NotImplementedError("no backward on CPU")
            return backends.get("reference").forward(call)

    backends.register(GradBlind())
    try:
        results = verify.sweep(["grad-blind-test", "sdpa"], [torch.float32], n=3, seed=2, small=True)
    finally:
        backends.unregister("grad-blind-test")
    crossed = {(r.backend, r.grad_mode) for r in results if r.grad_mode}
    for backend in ("grad-blind-test", "sdpa"):
        assert len({c for b, c in crossed if b == backend}) == len(verify.GRAD_MODES)
    failed = [r for r in results if not r.passed]
    assert failed and all(r.backend == "grad-blind-test" and r.grad_mode.startswith("no_grad") for r in failed)
