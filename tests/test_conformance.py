"""Every available backend against the fp64 reference (the rule of docs/contract.md), via attnlab.lab.verify.

The sweep logic (configurations, tolerance) lives in :mod:`attnlab.lab.verify` and is the same one
``attnlab verify`` runs. Each backend must *serve* at least 200 configurations per dtype;
flex serves forward only on CPU, is swept over a few fixed shapes (it compiles per shape) and
on CPU declines the ones with a partial 128-key block.
"""

import pytest
import torch

import attnlab

from attnlab import backends
from attnlab.lab import verify

N_CONFIGS = 220
FLEX_CONFIGS = 88
DTYPES = [torch.float32, torch.bfloat16]


def _backend_params():
    return [pytest.param(name, id=name) for name in backends.available()]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", _backend_params())
def test_backend_matches_fp64_reference(name, dtype):
    # flex compiles a kernel per variant (about 11 s each on a cold CPU): it takes the first 88 of
    # the draw, the fewest whose served configurations still hold every mask kind and every score
    # kind flex serves in each dtype (tested below); the other backends, and flex on CUDA, take 220.
    flex_n = None if torch.cuda.is_available() else FLEX_CONFIGS
    results = verify.sweep([name], [dtype], n=N_CONFIGS, seed=1, flex_n=flex_n)
    served = [r for r in results if r.served]
    failures = [r for r in served if not r.passed]
    assert not failures, "\n".join(
        f"{r.config}: errors {r.errors} allowed {r.allowed}" for r in failures[:10]
    )
    flex_on_cpu = name == "flex" and not torch.cuda.is_available()
    # 2 of the 5 flex shapes are whole key blocks: about 40 % of flex's draw is served on CPU
    wanted = FLEX_CONFIGS // 3 if flex_on_cpu else 200
    assert len(served) >= wanted, f"{name} served only {len(served)} of {len(results)} configurations"
    if flex_on_cpu:
        assert all("128-key block" in r.note for r in results if not r.served and not r.grad_mode)
    if name != "flex" or torch.cuda.is_available():
        assert sum(r.grad for r in served) >= 200, "backward must be checked on >= 200 configs"


LINEAR_CONFIGS = 72  # every rule with none, a state, documents and both, twice over


@pytest.mark.parametrize("dtype", verify.LINEAR_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", verify.linear_backends())
def test_linear_backend_matches_fp64_recurrence(name, dtype):
    """Every backend of attnlab.linear.BACKENDS (the oracle aside) against the fp64 recurrence:
    output, final state and every gradient (bf16 on tiny sizes; lengths up to 128)."""
    results = verify.sweep_linear([name], [dtype], n=LINEAR_CONFIGS, seed=1, small=True)
    failures = [r for r in results if not r.passed]
    assert not failures, "\n".join(f"{r.config}: {r.note}" for r in failures[:10])
    assert len(results) == LINEAR_CONFIGS and all(r.served and r.grad for r in results)


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
    lengths = {c.tq for c in cfgs} | {c.tk for c in cfgs}
    assert lengths >= {1, 2, 3, 8, 16, 17, 24, 113, 128, 1023}
    assert len(lengths & set(range(1, verify.SMALL_MAX + 1))) >= 30
    assert {c.head_dim for c in cfgs} == {1, 3, 8, 16, 40, 64, 111}
    assert {c.q_heads for c in cfgs} == {1, 2, 3, 4, 5}  # 2 and 4 from the layout configurations
    assert any(c.q_heads != c.kv_heads for c in cfgs)
    assert any(c.value_dim != c.head_dim for c in cfgs)
    assert any(c.tq != c.tk for c in cfgs)
    assert {c.mask for c in cfgs} == set(verify._MASKS)
    assert {(c.causal, c.align) for c in cfgs} >= {(True, "top_left"), (True, "bottom_right")}
    assert any(c.dead_rows for c in cfgs)
    assert sum(max(c.tq, c.tk) == 1023 for c in cfgs) <= 0.1 * len(cfgs)
    pairs = {(c.mask, c.causal, c.align) for c in cfgs}
    assert pairs == {(m, *c) for m in verify._MASKS for c in verify._CAUSAL}


def test_configs_draw_what_issue_30_found_bugs_with():
    """Compositions of mixed-dtype mods, values near 1 (learnable bf16 slopes), empty sizes and
    large logits: each drawn, and each served and exact where drawn."""
    cfgs = verify.configs(N_CONFIGS, seed=1)
    assert any(c.score == "mixed" for c in cfgs)
    assert any(c.values == "near_one" and "alibi" in c.score for c in cfgs)
    assert any(c.batch == 0 for c in cfgs) and any(c.tq == 0 for c in cfgs) and any(c.tk == 0 for c in cfgs)
    assert any(c.scale == 40.0 for c in cfgs)
    mixed = next(c for c in cfgs if c.score == "mixed" and min(c.batch, c.tq, c.tk) > 0)
    options, learned = verify._options(mixed, torch.float32, True)
    assert {t.dtype for t in learned} == {torch.bfloat16}  # held in another dtype than the call's
    for name, dtype in (("sdpa", torch.float32), ("chunked", torch.float64)):
        result = verify.check(name, mixed, dtype)
        assert result.served and result.passed, result


def test_quick_configs_cover_small_shapes_and_every_mask_kind():
    """What ``attnlab verify --quick`` draws (16 configurations, small)."""
    cfgs = verify.configs(16, small=True)
    assert {c.mask for c in cfgs} == set(verify._MASKS)
    assert {(c.causal, c.align) for c in cfgs} == set(verify._CAUSAL)
    assert sum(max(c.tq, c.tk) <= verify.SMALL_MAX for c in cfgs) >= 8
    assert any(c.tq != c.tk for c in cfgs) and any(c.q_heads != c.kv_heads for c in cfgs)
    assert any(c.tk % 8 == 0 and c.tk % 128 != 0 for c in cfgs)  # a partial vector tail
    flex = verify.configs(8, shapes=verify.FLEX_SHAPES, small=True)
    assert {(c.tq, c.tk) for c in flex} >= {(8, 8), (24, 17), (33, 128), (128, 128)}


def test_counts_must_be_positive():
    for n in (0, -1):
        with pytest.raises(ValueError, match="n must be a positive int"):
            verify.configs(n)
        with pytest.raises(ValueError, match="n must be a positive int"):
            verify.sweep(["reference"], [torch.float32], n=n)
    with pytest.raises(ValueError, match="flex_n must be a positive int"):
        verify.sweep(["reference"], [torch.float32], n=1, flex_n=-1)


class _WrongOnPartialTails(backends.Backend):
    """Wrong like flex on CPU: only where the key length is a multiple of 8 but not of 128."""

    name = "tails-test"
    memory = "quadratic"

    def forward(self, call):
        out = backends.get("reference").forward(call).out
        if call.tk % 8 == 0 and call.tk % 128 != 0:
            out = out * (1 + 1e-3)
        return backends.AttentionResult(out=out)


def test_quick_sweep_catches_a_backend_wrong_on_short_key_tails():
    backends.register(_WrongOnPartialTails())
    try:
        results = verify.sweep(["tails-test"], [torch.float32], n=16, small=True)  # --quick
    finally:
        backends.unregister("tails-test")
    assert any(not r.passed for r in results)


INJECTED = 1e-3  # far above any allowed error of these shapes in float32 (about 1e-5)


@pytest.mark.skipif("flex" not in backends.available(), reason="no FlexAttention")
def test_sweep_catches_flex_when_it_is_wrong(monkeypatch):
    """flex served wrong results (off by INJECTED) at a partial and a whole key block: the sweep
    must flag every one, by that amount. The wrong result is injected, so this holds on every
    CPU and torch, whether or not torch's own kernel is right there; the sweep's flex path
    (fixed shapes, decline, forward only on CPU) is the one ``attnlab verify`` runs."""
    flex, reference = backends.get("flex"), backends.get("reference")
    monkeypatch.setattr("attnlab.backends.flex._shape_limits", lambda call: [])  # serve Tk = 8 too
    monkeypatch.setattr(verify, "FLEX_SHAPES", ((1, 2, 2, 8, 8, 16, 16), (1, 2, 2, 128, 128, 16, 16)))
    for offset in (0.0, INJECTED):  # 0: the same sweep passes when nothing is injected
        seen = []

        def shifted_forward(call, offset=offset):
            seen.append(call.tk)
            return backends.AttentionResult(out=reference.forward(call).out + offset)

        monkeypatch.setattr(flex, "forward", shifted_forward)  # compiles nothing
        # The grad-mode crossings that need a backward are declined (flex has none on CPU).
        results = [r for r in verify.sweep(["flex"], [torch.float32], n=12, seed=3)
                   if not (r.grad_mode.startswith("grad,") and r.grad_mode != "grad, requires_grad: -")]
        assert all(r.served for r in results) and set(seen) == {8, 128}
        if offset == 0.0:
            assert all(r.passed for r in results)
            continue
        assert not any(r.passed for r in results)
        for r in results:
            assert r.errors[0] == pytest.approx(INJECTED, rel=1e-2), r.config


@pytest.mark.skipif("flex" not in backends.available(), reason="no FlexAttention")
def test_quick_sweep_does_not_compile_flex(monkeypatch):
    monkeypatch.setattr(verify, "FLEX_SHAPES", ((1, 1, 1, 5, 128, 8, 8),))  # compiled nowhere
    results = verify.sweep(["flex"], [torch.float32], n=4, small=True)
    assert not any(r.served for r in results)
    assert all("not compiled" in r.note for r in results)


# ----------------------------------------------------------------------------- every backend
def _dropout_backends():
    return [n for n in backends.available() if backends.get(n).dropout]  # as each backend declares


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


TK = 128  # one whole key block: flex on CPU declines partial ones


def _dead_row_inputs(requires_grad: bool, tq: int = 6):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, tq, 8, generator=gen, requires_grad=requires_grad)
    k = torch.randn(2, 3, TK, 8, generator=gen, requires_grad=requires_grad)
    v = torch.randn(2, 3, TK, 5, generator=gen, requires_grad=requires_grad)
    return q, k, v


_DEAD_MASKS = {
    "bool": lambda: torch.ones(6, TK, dtype=torch.bool).index_fill_(0, torch.tensor([1, 4]), False),
    "float": lambda: torch.zeros(6, TK).index_fill_(0, torch.tensor([0, 5]), float("-inf")),
    "padding": lambda: attnlab.masks.padding_mask(torch.tensor([0, 4]), TK),
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
    q, k, v = _dead_row_inputs(False, tq=TK + 3)  # Tq > Tk: the first 3 rows see nothing
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
    q, k, v = (torch.randn(2, 4, TK, 16, generator=gen) for _ in range(3))
    options = {
        "causal": dict(causal=True),
        "padding": dict(mask=attnlab.masks.padding_mask(torch.tensor([TK, 5]), TK)),
        "float": dict(mask=torch.randn(TK, TK, generator=gen)),
    }[mask_kind]
    with torch.no_grad():
        plain = attnlab.attention(q, k, v, backend=name, **options)
        out, weights = attnlab.attention(q, k, v, backend=name, return_weights=True, **options)
        _, want = attnlab.attention(q.double(), k.double(), v.double(), backend="reference",
                                    return_weights=True, **options)
    assert torch.equal(out, plain)  # bitwise: asking for weights does not change the kernel
    torch.testing.assert_close(weights.double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kinds", [verify.FLEX_SCORE_KINDS, verify.FLEX_HALF_SCORE_KINDS], ids=["fp32", "half"])
def test_the_flex_draw_covers_every_mask_score_and_causal_kind(kinds):
    draw = verify.configs(FLEX_CONFIGS, seed=1, shapes=verify.FLEX_SHAPES, scores=kinds)
    whole_blocks = [c for c in draw if c.tk % 128 == 0]  # what flex serves on CPU
    assert {c.score for c in whole_blocks} >= set(kinds)
    assert {c.mask for c in whole_blocks} == set(verify._MASKS)
    assert {(c.causal, c.align) for c in whole_blocks} == set(verify._CAUSAL)
