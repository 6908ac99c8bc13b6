"""attnlab.linear_attention: every rule, every backend, against the fp64 recurrence and transformers.

The oracle is :mod:`attnlab.linear.reference` (the recurrence, one step at a time, fp64); the
independent references are transformers' own pure-PyTorch Gated DeltaNet and KDA functions.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab.linear import BACKENDS, _choose
from attnlab.linear._call import linear_call
from attnlab.linear.chunked import _unit_lower_inverse, _UnitLowerInverse, run_chunked
from attnlab.linear.reference import run_reference

RULES = ["additive", "decay", "channel", "delta", "gated_delta", "kda"]
F64 = torch.float64


def inputs(rule, *, B=1, H=2, groups=2, T=21, Dk=8, Dv=5, dtype=F64, documents=None, seed=0, strength=1.0):
    """q, k, v, decay, beta, initial_state for ``rule`` (keys unit-norm: the delta rule's usual regime)."""
    gen = torch.Generator().manual_seed(seed)
    Hv = H * groups
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q, k, v = rand(B, H, T, Dk), F.normalize(rand(B, H, T, Dk), dim=-1), rand(B, Hv, T, Dv)
    decay = beta = None
    if rule in ("decay", "gated_delta"):
        decay = -torch.rand(B, Hv, T, generator=gen, dtype=F64) * strength
    if rule in ("channel", "kda"):
        decay = -torch.rand(B, Hv, T, Dk, generator=gen, dtype=F64) * strength
    if rule in ("delta", "gated_delta", "kda"):
        beta = torch.rand(B, Hv, T, generator=gen, dtype=F64)
    rows = B if documents is None else len(documents) - 1
    state = rand(rows, Hv, Dk, Dv)
    return [None if x is None else x.to(dtype) for x in (q, k, v, decay, beta, state)]


def run(fn, tensors, *, cu_seqlens=None, grads=True):
    """``fn(call) -> (out, state)`` on leaf copies of ``tensors``; returns out, state and every gradient."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(grads) for x in tensors]
    q, k, v, decay, beta, state = leaves
    call = linear_call(q, k, v, decay=decay, beta=beta, scale=None, initial_state=state, cu_seqlens=cu_seqlens)
    out, final = fn(call)
    if not grads:
        return [out, final]
    gen = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    w_state = torch.randn(final.shape, generator=gen, dtype=F64).to(final.dtype)
    loss = (out * w_out).sum() + (final * w_state).sum()
    present = [x for x in leaves if x is not None]
    return [out, final, *torch.autograd.grad(loss, present)]


@functools.lru_cache(maxsize=None)
def oracle(rule, T, B=1, documents=None, strength=1.0, grads=True):
    """The fp64 recurrence's outputs and gradients on ``inputs(...)``, computed once per test module."""
    tensors = inputs(rule, B=B, T=T, documents=documents, strength=strength)
    cu = None if documents is None else torch.tensor(documents)
    return run(run_reference, tensors, cu_seqlens=cu, grads=grads)


def chunked(size):
    return lambda call: run_chunked(call, chunk=size)


def worst(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


# Backends as run by the tests: the registered ones, and the chunked form at a few chunk sizes
# (8: several chunks of a short T, no sub-chunks; 32: sub-chunks of per-channel decays).
RUNS = {"recurrent": BACKENDS["recurrent"], "chunked": BACKENDS["chunked"], "chunked8": chunked(8),
        "chunked32": chunked(32)}


# ------------------------------------------------------------------ exactness in fp64


@pytest.mark.parametrize("backend", list(RUNS))
@pytest.mark.parametrize("rule", RULES)
def test_every_rule_equals_the_recurrence_in_fp64(rule, backend):
    tensors = inputs(rule, B=2, T=29)  # 29: not a multiple of any chunk
    assert worst(run(RUNS[backend], tensors), oracle(rule, 29, B=2)) <= 1e-9


@pytest.mark.parametrize("backend", list(RUNS))
@pytest.mark.parametrize("rule", RULES)
def test_packed_documents_with_an_empty_one(rule, backend):
    starts = (0, 7, 7, 20, 29)  # the second document is empty: its state passes through
    cu = torch.tensor(starts)
    tensors = inputs(rule, T=29, documents=starts)
    got = run(RUNS[backend], tensors, cu_seqlens=cu)
    assert worst(got, oracle(rule, 29, documents=starts)) <= 1e-9
    # Independently: each document alone, from its own initial state.
    q, k, v, decay, beta, state = tensors
    for d, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        part = lambda x: None if x is None else x[:, :, s:e]  # noqa: E731
        out, final = attnlab.linear_attention(part(q), part(k), part(v), decay=part(decay), beta=part(beta),
                                              initial_state=state[d:d + 1], return_state=True, backend="reference")
        assert (got[0][:, :, s:e] - out).abs().max().item() <= 1e-9 if e > s else True
        assert (got[1][d:d + 1] - final).abs().max().item() <= 1e-9
    # The empty document's final state is its initial state, with an identity gradient.
    assert torch.equal(got[1][1], state[1])


@pytest.mark.parametrize("backend", ["reference", "recurrent", "chunked"])
@pytest.mark.parametrize("rule", RULES)
def test_two_halves_chained_through_the_state_equal_one_call(rule, backend):
    q, k, v, decay, beta, state = inputs(rule, T=150)  # 70 + 80: neither half a multiple of a chunk
    kw = dict(initial_state=state, return_state=True, backend=backend)
    whole, whole_state = attnlab.linear_attention(q, k, v, decay=decay, beta=beta, **kw)
    half = lambda x, a, b: None if x is None else x[:, :, a:b]  # noqa: E731
    first, mid = attnlab.linear_attention(*(half(x, 0, 70) for x in (q, k, v)), decay=half(decay, 0, 70),
                                          beta=half(beta, 0, 70), **kw)
    kw["initial_state"] = mid
    second, end = attnlab.linear_attention(*(half(x, 70, 150) for x in (q, k, v)), decay=half(decay, 70, 150),
                                           beta=half(beta, 70, 150), **kw)
    assert (torch.cat([first, second], dim=2) - whole).abs().max().item() <= 1e-10
    assert (end - whole_state).abs().max().item() <= 1e-10


@pytest.mark.parametrize("backend", ["reference", "recurrent", "chunked"])
@pytest.mark.parametrize("rule", ["gated_delta", "kda"])
def test_one_token_and_no_tokens(rule, backend):
    q, k, v, decay, beta, state = inputs(rule, T=1)
    out, final = attnlab.linear_attention(q, k, v, decay=decay, beta=beta, initial_state=state,
                                          return_state=True, backend=backend)
    ref_out, ref_final = attnlab.linear_attention(q, k, v, decay=decay, beta=beta, initial_state=state,
                                                  return_state=True, backend="reference")
    assert (out - ref_out).abs().max() <= 1e-12 and (final - ref_final).abs().max() <= 1e-12
    empty = lambda x: None if x is None else x[:, :, :0]  # noqa: E731
    out, final = attnlab.linear_attention(empty(q), empty(k), empty(v), decay=empty(decay), beta=empty(beta),
                                          initial_state=state, return_state=True, backend=backend)
    assert out.shape == (1, 4, 0, 5) and torch.equal(final, state)


def test_per_channel_decays_as_low_as_minus_20_a_step_stay_finite_and_exact():
    # exp(+20 · 64) overflows: only exponents g_i - g_j with j <= i may be formed.
    for rule in ("channel", "kda", "gated_delta"):
        tensors = inputs(rule, T=70, strength=20.0)
        for fn in (BACKENDS["chunked"], chunked(32)):
            got = run(fn, tensors)
            assert all(bool(torch.isfinite(x).all()) for x in got)
            assert worst(got, oracle(rule, 70, strength=20.0)) <= 1e-9
        f32 = [None if x is None else x.float() for x in tensors]
        got = run(BACKENDS["chunked"], f32, grads=False)
        assert bool(torch.isfinite(got[0]).all())
        assert worst(got, oracle(rule, 70, strength=20.0)[:2]) <= 1e-4


def test_a_chunk_of_any_size_is_exact():
    # Chunks that are not powers of two (the inverse's odd base block) or not multiples of SUB.
    tensors = inputs("kda", T=29)
    ref = oracle("kda", 29)
    for size in (1, 3, 12, 48):
        assert worst(run(chunked(size), tensors), ref) <= 1e-9, size


def test_additive_rule_is_causal_linear_attention():
    # Independent of the recurrence: o = scale · tril(q kᵀ) v for the plain additive rule.
    q, k, v, *_ = inputs("additive", groups=1, T=33)
    out = attnlab.linear_attention(q, k, v, backend="chunked")
    expected = ((q @ k.mT).tril() @ v) * q.shape[-1] ** -0.5
    assert (out - expected).abs().max() <= 1e-12


@settings(max_examples=12)
@given(rule=st.sampled_from(RULES), T=st.integers(1, 40), chunk=st.sampled_from([2, 5, 16, 32]),
       groups=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_chunked_equals_the_recurrence_on_random_shapes(rule, T, chunk, groups, seed):
    tensors = inputs(rule, H=1, groups=groups, T=T, Dk=4, Dv=3, seed=seed)
    assert worst(run(chunked(chunk), tensors), run(run_reference, tensors)) <= 1e-9


# ------------------------------------------------------------------ fp32, bf16


@pytest.mark.parametrize("backend", ["recurrent", "chunked"])
@pytest.mark.parametrize("rule", RULES)
def test_fp32_within_1e_4_of_the_fp64_oracle(rule, backend):
    tensors = inputs(rule, B=2, T=29)
    got = run(BACKENDS[backend], [None if x is None else x.float() for x in tensors])
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert worst(got, oracle(rule, 29, B=2)) <= 1e-4


@pytest.mark.parametrize("rule", ["gated_delta", "kda"])
def test_bf16_in_bf16_out_state_fp32(rule):
    tensors = inputs(rule, T=40)
    low = [None if x is None else x.bfloat16() for x in tensors]
    out, final = run(BACKENDS["chunked"], low, grads=False)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    ref_out, ref_final = run(run_reference, [None if x is None else x.double() for x in low], grads=False)
    assert (out.double() - ref_out).abs().max() <= 0.05
    assert (final.double() - ref_final).abs().max() <= 1e-4


# ------------------------------------------------------------------ transformers, an independent reference


def _transformers(name):
    return pytest.importorskip(f"transformers.models.{name}.modeling_{name}")


@pytest.mark.parametrize("groups", [1, 2])
def test_gated_deltanet_equals_transformers_chunk_rule(groups):
    qwen = _transformers("qwen3_next")
    q, k, v, decay, beta, state = (x.float() for x in inputs("gated_delta", groups=groups, T=150, Dk=16, Dv=8))
    ours, ours_state = attnlab.linear_attention(q, k, v, decay=decay, beta=beta, initial_state=state,
                                                return_state=True, backend="chunked")
    bthd = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  (B, T, heads, ...)
    theirs, theirs_state = qwen.torch_chunk_gated_delta_rule(
        bthd(q), bthd(k), bthd(v), g=bthd(decay), beta=bthd(beta), initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=False)
    assert (ours - bthd(theirs)).abs().max() <= 1e-5
    assert (ours_state - theirs_state).abs().max() <= 1e-5


def test_kda_equals_transformers_recurrent_and_chunk_kda():
    kimi = _transformers("kimi_linear")
    q, k, v, decay, beta, state = (x.float() for x in inputs("kda", groups=1, T=70, Dk=16, Dv=8))
    ours, ours_state = attnlab.linear_attention(q, k, v, decay=decay, beta=beta, initial_state=state,
                                                return_state=True, backend="chunked")
    bthd = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    for fn in (kimi.recurrent_kimi_delta_attention, kimi.chunk_kimi_delta_attention):
        theirs, theirs_state = fn(bthd(q), bthd(k), bthd(v), g=bthd(decay), beta=bthd(beta), initial_state=state,
                                  output_final_state=True)
        assert (ours - bthd(theirs)).abs().max() <= 1e-5, fn.__name__
        assert (ours_state - theirs_state).abs().max() <= 1e-5, fn.__name__


# ------------------------------------------------------------------ the pieces


@pytest.mark.parametrize("size", [1, 12, 64])
def test_unit_lower_inverse(size):
    gen = torch.Generator().manual_seed(size)
    L = torch.randn(3, size, size, generator=gen, dtype=F64) * 0.3
    expected = torch.linalg.inv(torch.eye(size, dtype=F64) + L.tril(-1))
    assert (_unit_lower_inverse(L) - expected).abs().max() <= 1e-12  # L's diagonal and upper part not read


def test_unit_lower_inverse_gradient_is_torch_inverse_gradient():
    small = torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(3), dtype=F64).mul(0.3).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: _UnitLowerInverse.apply(x), (small,))
    # the gradient flows to the strictly lower part only, as torch.linalg.inv's through tril(-1)
    (mine,) = torch.autograd.grad(_UnitLowerInverse.apply(small).sum(), small)
    (theirs,) = torch.autograd.grad(torch.linalg.inv(torch.eye(6, dtype=F64) + small.tril(-1)).sum(), small)
    assert (mine - theirs).abs().max() <= 1e-12


def test_auto_picks_recurrent_for_a_few_tokens_and_chunked_beyond():
    def call(T):
        q = torch.zeros(1, 1, T, 2)
        return linear_call(q, q, q, decay=None, beta=None, scale=None, initial_state=None, cu_seqlens=None)
    assert _choose(call(1)) == "recurrent" and _choose(call(64)) == "chunked"


def test_gradients_only_where_asked():
    q, k, v, decay, beta, _ = inputs("gated_delta", T=40)
    v = v.clone().requires_grad_()
    out = attnlab.linear_attention(q, k, v, decay=decay, beta=beta, backend="chunked")
    (grad,) = torch.autograd.grad(out.sum(), v)
    ref = v.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(attnlab.linear_attention(q, k, ref, decay=decay, beta=beta,
                                                               backend="reference").sum(), ref)
    assert (grad - expected).abs().max() <= 1e-9


def test_large_finite_values_are_not_taken_for_overflow():
    # The finite check sums first; a sum past fp32's range must not refuse finite inputs.
    q = torch.full((1, 1, 4, 2), 3e38)
    linear_call(q, q, q, decay=None, beta=None, scale=None, initial_state=None, cu_seqlens=None)


# ------------------------------------------------------------------ hostile inputs


def _kw(**over):
    q, k, v, decay, beta, state = (x.float() for x in inputs("gated_delta", T=6))
    kw = dict(q=q, k=k, v=v, decay=decay, beta=beta, initial_state=state)
    kw.update(over)
    return kw


def _refused(error, words, **over):
    kw = _kw(**over)
    with pytest.raises(error) as info:
        attnlab.linear_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("name", ["q", "k", "v", "decay", "beta", "initial_state"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_are_refused_naming_the_argument(name, bad):
    x = _kw()[name].clone()
    x.view(-1)[3] = bad
    _refused(ValueError, [name, "NaN"], **{name: x})


def test_a_positive_decay_and_beta_outside_0_1_are_refused():
    _refused(ValueError, ["decay", "<= 0"], decay=_kw()["decay"].abs() + 0.1)
    _refused(ValueError, ["beta", "[0, 1]"], beta=_kw()["beta"] + 1.0)
    _refused(ValueError, ["beta", "[0, 1]"], beta=-_kw()["beta"] - 0.1)


def test_wrong_shapes_dtypes_and_devices_are_refused():
    kw = _kw()
    _refused(ValueError, ["k", "shape"], k=kw["k"][:, :, :5])
    _refused(ValueError, ["v", "multiple"], v=torch.randn(1, 3, 6, 5))
    _refused(ValueError, ["decay", "shape"], decay=kw["decay"][..., :5])
    _refused(ValueError, ["beta", "shape"], beta=kw["beta"][:, :1])
    _refused(ValueError, ["initial_state", "shape"], initial_state=kw["initial_state"][..., :2])
    _refused(TypeError, ["v", "dtype"], v=kw["v"].double())
    _refused(TypeError, ["q", "float"], q=kw["q"].long(), k=kw["k"].long(), v=kw["v"].long())
    _refused(TypeError, ["decay", "Tensor"], decay=[0.0])
    _refused(ValueError, ["beta", "device"], beta=kw["beta"].to("meta"))
    _refused(ValueError, ["initial_state", "device"], initial_state=kw["initial_state"].to("meta"))


def test_bad_cu_seqlens_and_backend_are_refused():
    _refused(ValueError, ["cu_seqlens", "rise"], cu_seqlens=torch.tensor([0, 4, 3, 6]), initial_state=None)
    _refused(ValueError, ["cu_seqlens", "T=6"], cu_seqlens=torch.tensor([0, 4]), initial_state=None)
    _refused(TypeError, ["cu_seqlens"], cu_seqlens=torch.tensor([0.0, 6.0]), initial_state=None)
    _refused(ValueError, ["initial_state", "N documents"], cu_seqlens=torch.tensor([0, 2, 6]),
             initial_state=torch.zeros(1, 4, 8, 5))
    _refused(ValueError, ["backend", "chunked"], backend="fast")
    kw = _kw(initial_state=None)
    with pytest.raises(ValueError, match="chunk"):
        run_chunked(linear_call(**kw, scale=None, cu_seqlens=None), chunk=0)

