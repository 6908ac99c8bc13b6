"""Every available backend against the fp64 reference (DESIGN.md's rule), via attnlab.verify.

The sweep logic (configurations, tolerance) lives in :mod:`attnlab.verify` and is the same one
``attnlab verify`` runs. Each backend must *serve* at least 200 configurations per dtype;
flex serves forward only on CPU and is swept at one fixed shape (it compiles per shape).
"""

import pytest
import torch

import attnlab

from attnlab import backends, verify

N_CONFIGS = 220
DTYPES = [torch.float32, torch.bfloat16]


def _backend_params():
    return [pytest.param(name, id=name) for name in backends.available()]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", _backend_params())
def test_backend_matches_fp64_reference(name, dtype):
    results = verify.sweep([name], [dtype], n=N_CONFIGS, seed=1)
    served = [r for r in results if r.served]
    failures = [r for r in served if not r.passed]
    assert not failures, "\n".join(
        f"{r.config}: errors {r.errors} allowed {r.allowed}" for r in failures[:10]
    )
    assert len(served) >= 200, f"{name} served only {len(served)} of {len(results)} configurations"
    if name != "flex" or torch.cuda.is_available():
        assert sum(r.grad for r in served) >= 200, "backward must be checked on >= 200 configs"


def test_sweep_catches_a_wrong_backend():
    """The tolerance rule is not vacuous: a backend off by one ulp-scale bias fails."""

    class Skewed(backends.Backend):
        name = "skewed-test"
        memory = "quadratic"

        def forward(self, call):
            result = backends.get("reference").forward(call)
            return backends.AttentionResult(out=result.out * (1 + 1e-3))

    backends.register(Skewed())
    try:
        results = verify.sweep(["skewed-test"], [torch.float32], n=10, seed=2, small=True)
    finally:
        backends.unregister("skewed-test")
    assert any(not r.passed for r in results)


def test_configs_cover_the_design_space():
    cfgs = verify.configs(N_CONFIGS, seed=1)
    assert {c.tq for c in cfgs} | {c.tk for c in cfgs} >= {1, 2, 3, 17, 113, 1023}
    assert {c.head_dim for c in cfgs} == {1, 3, 40, 64, 111}
    assert {c.q_heads for c in cfgs} == {1, 3, 5}
    assert any(c.q_heads != c.kv_heads for c in cfgs)
    assert any(c.value_dim != c.head_dim for c in cfgs)
    assert any(c.tq != c.tk for c in cfgs)
    assert {c.mask for c in cfgs} == set(verify._MASKS)
    assert {(c.causal, c.align) for c in cfgs} >= {(True, "top_left"), (True, "bottom_right")}
    assert any(c.dead_rows for c in cfgs)
    assert sum(max(c.tq, c.tk) == 1023 for c in cfgs) <= 0.1 * len(cfgs)


# ----------------------------------------------------------------------------- every backend
def _dropout_backends():
    return [n for n in backends.available() if n != "flex"]  # flex declines dropout


@pytest.mark.parametrize("name", _dropout_backends())
def test_dropout_same_seed_same_output_and_kept_fraction(name):
    p = 0.3
    tq, tk = 256, 256
    q = torch.zeros(1, 4, tq, 8)  # equal scores: every weight is 1 / tk
    k = torch.zeros(1, 4, tk, 8)
    v = torch.eye(tk).expand(1, 4, tk, tk)  # out[i, j] = weight[i, j] after dropout
    outs = [
        attnlab.attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(5),
                          backend=name)
        for _ in range(2)
    ]
    assert torch.equal(outs[0], outs[1])
    kept = outs[0] > 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    # kept weights are scaled by 1 / (1 - p)
    torch.testing.assert_close(outs[0][kept], torch.full_like(outs[0][kept], 1 / (tk * (1 - p))))
    other = attnlab.attention(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(6),
                              backend=name)
    assert not torch.equal(outs[0], other)


def _dead_row_inputs(requires_grad: bool):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 6, 8, generator=gen, requires_grad=requires_grad)
    k = torch.randn(2, 3, 9, 8, generator=gen, requires_grad=requires_grad)
    v = torch.randn(2, 3, 9, 5, generator=gen, requires_grad=requires_grad)
    return q, k, v


_DEAD_MASKS = {
    "bool": lambda: torch.tensor([True] * 9).expand(6, 9).clone().index_fill_(0, torch.tensor([1, 4]), False),
    "float": lambda: torch.zeros(6, 9).index_fill_(0, torch.tensor([0, 5]), float("-inf")),
    "padding": lambda: attnlab.masks.padding_mask(torch.tensor([0, 4]), 9),
    "mod": lambda: (lambda b, h, i, j: (i != 2) & (j >= 0)),
}


@pytest.mark.parametrize("kind", sorted(_DEAD_MASKS))
@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ["reference", "sdpa", "chunked", "flex"]])
def test_fully_masked_rows_are_zero_with_zero_grad(name, kind):
    if name not in backends.available():
        pytest.skip(f"{name} not available")
    mask = _DEAD_MASKS[kind]()
    with_grad = name != "flex" or torch.cuda.is_available()
    q, k, v = _dead_row_inputs(with_grad)
    with torch.set_grad_enabled(with_grad):
        out = attnlab.attention(q, k, v, mask=mask, backend=name)
        want = attnlab.attention(q, k, v, mask=mask, backend="reference")
    dead = want.detach().abs().sum(-1) == 0  # rows of the reference with nothing to attend
    assert dead.any()
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert not torch.isnan(out).any()
    if with_grad:
        (out * torch.randn_like(out)).sum().backward()
        assert torch.equal(q.grad[dead], torch.zeros_like(q.grad[dead]))
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_causal_bottom_right_dead_rows_every_backend():
    q, k, v = _dead_row_inputs(False)
    q = torch.cat([q, q], dim=2)  # Tq = 12 > Tk = 9: the first 3 rows see nothing
    with torch.no_grad():
        for name in backends.available():
            out = attnlab.attention(q, k, v, causal=True, align="bottom_right", backend=name)
            assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3])), name


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ["reference", "sdpa", "chunked", "flex"]])
@pytest.mark.parametrize("mask_kind", ["causal", "padding", "float"])
def test_return_weights_keeps_the_fast_path(name, mask_kind):
    if name not in backends.available():
        pytest.skip(f"{name} not available")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 17, 16, generator=gen) for _ in range(3))
    options = {
        "causal": dict(causal=True),
        "padding": dict(mask=attnlab.masks.padding_mask(torch.tensor([17, 5]), 17)),
        "float": dict(mask=torch.randn(17, 17, generator=gen)),
    }[mask_kind]
    with torch.no_grad():
        plain = attnlab.attention(q, k, v, backend=name, **options)
        out, weights = attnlab.attention(q, k, v, backend=name, return_weights=True, **options)
        _, want = attnlab.attention(q.double(), k.double(), v.double(), backend="reference",
                                    return_weights=True, **options)
    assert torch.equal(out, plain)  # bitwise: asking for weights does not change the kernel
    torch.testing.assert_close(weights.double(), want, atol=1e-6, rtol=1e-5)
