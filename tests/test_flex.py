"""The flex backend: what it declines on CPU, its block-mask cache, and CUDA paths (skipped here)."""

import subprocess
import sys

import pytest
import torch

import attnlab
from attnlab import backends, masks, verify
from attnlab.backends import build_call

pytestmark = pytest.mark.skipif("flex" not in backends.available(), reason="no FlexAttention")
SHAPE = (1, 2, 128, 16)  # one shape for every CPU test here: flex compiles per shape
T = SHAPE[2]  # a whole 128-key block: on CPU flex declines partial key blocks


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
    mask = torch.rand(T, T, generator=torch.Generator().manual_seed(1)) > 0.3
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
    mod = attnlab.masks.sliding_window_mod(T, T, 4)
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
        other = torch.randn(1, 1, 128, 8)
        reasons = backends.reasons(build_call(other, other, other))["flex"]
        assert any("unfused with O(T^2) memory" in r for r in reasons)
        with pytest.raises(ValueError, match="shapes are compiled"):
            attnlab.attention(other, other, other, backend="flex")
        assert attnlab.backends.select(build_call(other, other, other)).name != "flex"


# ----------------------------------------------------------------------- exact or declined
def _reference(q, k, v, **options):
    mask = options.get("mask")
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        options = dict(options, mask=mask.double())
    return attnlab.attention(q.double(), k.double(), v.double(), backend="reference", **options)


@pytest.mark.parametrize("tq, tk", [(8, 8), (24, 24), (17, 8), (16, 8), (136, 136), (8, 1)])
def test_partial_key_blocks_are_declined_on_cpu(tq, tk):
    """torch's compiled CPU kernel is wrong (up to 2.2 abs, or NaN) at Tk = 8, 24, 136, ..."""
    q, k = torch.randn(1, 2, tq, 16), torch.randn(1, 2, tk, 16)
    with torch.no_grad():
        call = build_call(q, k, k, causal=True)
        assert any("multiple of its 128-key block" in r for r in backends.reasons(call)["flex"])
        assert backends.select(call).name != "flex"
        with pytest.raises(ValueError, match="128-key block"):
            attnlab.attention(q, k, k, causal=True, backend="flex")
        torch.testing.assert_close(attnlab.attention(q, k, k, causal=True).double(),
                                   _reference(q, k, k, causal=True), atol=1e-5, rtol=1e-5)


def test_whole_key_blocks_are_served_and_exact():
    q, k, v = _qkv()
    gen = torch.Generator().manual_seed(4)
    masks = [torch.rand(T, T, generator=gen) > 0.5, torch.randn(T, T, generator=gen),
             attnlab.masks.padding_mod(torch.tensor([70]))]
    with torch.no_grad():
        for mask in masks:
            for align in ("top_left", "bottom_right"):
                options = dict(mask=mask, causal=True, align=align)
                out = attnlab.attention(q, k, v, backend="flex", **options)
                torch.testing.assert_close(out.double(), _reference(q, k, v, **options),
                                           atol=1e-5, rtol=1e-5)


_EMPTY_SCRIPT = """
import torch, attnlab
from attnlab import backends
from attnlab.backends import build_call
q, k = torch.randn(1, 1, {tq}, 16), torch.randn(1, 1, {tk}, 16)
reasons = backends.reasons(build_call(q, k, k))["flex"]
assert any("empty sequence" in r for r in reasons), reasons
try:
    attnlab.attention(q, k, k, backend="flex")
except ValueError as error:
    assert "empty sequence" in str(error)
else:
    raise AssertionError("flex served an empty sequence")
print("declined")
"""


@pytest.mark.parametrize("tq, tk", [(0, 128), (128, 0), (0, 0)])
def test_empty_sequences_are_declined(tq, tk):
    """In a subprocess: the compiled CPU kernel dies of SIGFPE on Tq = 0 or Tk = 0."""
    done = subprocess.run([sys.executable, "-c", _EMPTY_SCRIPT.format(tq=tq, tk=tk)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "declined" in done.stdout, done.stderr[-2000:]


# ------------------------------------------------------------------------ block-mask cache
def test_cache_sees_a_padding_mod_edited_in_place():
    q, k, v = _qkv()
    mod = attnlab.masks.padding_mod(torch.tensor([100]))
    with torch.no_grad():
        attnlab.attention(q, k, v, mask=mod, backend="flex")
        mod.lengths[0] = 5  # same object, same id: only its contents changed
        out = attnlab.attention(q, k, v, mask=mod, backend="flex")
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask=mod), atol=1e-5, rtol=1e-5)


def test_cache_sees_a_changed_closure_variable():
    q, k, v = _qkv()
    width = [64]
    mod = lambda b, h, i, j: (i - j).abs() < width[0]  # noqa: E731
    with torch.no_grad():
        attnlab.attention(q, k, v, mask=mod, backend="flex")
        width[0] = 3
        out = attnlab.attention(q, k, v, mask=mod, backend="flex")
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask=mod), atol=1e-5, rtol=1e-5)


def test_cache_sees_a_tensor_written_through_data():
    """``.data`` and numpy writes keep ``_version``: the cache must compare contents."""
    q, k, v = _qkv()
    mask = torch.ones(T, T, dtype=torch.bool)
    with torch.no_grad():
        attnlab.attention(q, k, v, mask=mask, backend="flex")
        version = mask._version
        mask.data[:, 1:] = False
        assert mask._version == version
        out = attnlab.attention(q, k, v, mask=mask, backend="flex")
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask=mask), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- learnable float masks
def test_float_mask_that_requires_grad_is_declined_and_auto_differentiates():
    q, k, v = _qkv()
    bias = torch.randn(T, T, requires_grad=True)
    call = build_call(q, k, v, mask=bias)
    assert any("requires grad" in r for r in backends.reasons(call)["flex"])
    with pytest.raises(ValueError, match="requires grad"):
        attnlab.attention(q, k, v, mask=bias, backend="flex")
    out = attnlab.attention(q, k, v, mask=bias)  # auto: another backend
    (grad,) = torch.autograd.grad(out.sum(), bias)
    ref_bias = bias.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(_reference(q, k, v, mask=ref_bias).sum(), ref_bias)
    torch.testing.assert_close(grad.double(), want, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # no gradient wanted: flex serves it
        assert backends.reasons(build_call(q, k, v, mask=bias))["flex"] == []


# --------------------------------------------------------------- NaN/inf and half precision
def test_non_finite_inputs_are_declined_and_auto_keeps_the_nan_rule():
    """flex's kernel let NaN of masked keys leak and turned NaN rows into zeros; it now declines."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 128, 16, generator=gen) for _ in range(3))
    pad = masks.padding_mask(torch.tensor([128, 100]))
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, 110], v_bad[1, :, 110] = float("nan"), float("inf")
    q_bad = q.clone()
    q_bad[0, 1, 5, 2] = float("nan")
    with torch.no_grad():
        for args, options in (((q, k_bad, v_bad), dict(mask=pad)), ((q_bad, k, v), {})):
            with pytest.raises(ValueError, match="flex cannot keep the NaN/inf rule"):
                attnlab.attention(*args, backend="flex", **options)
        clean = attnlab.attention(q, k.masked_fill(~pad[:, :, 0, :, None], 0),
                                  v.masked_fill(~pad[:, :, 0, :, None], 0), mask=pad, backend="reference")
        torch.testing.assert_close(attnlab.attention(q, k_bad, v_bad, mask=pad), clean, rtol=0, atol=1e-6)
        assert attnlab.attention(q_bad, k, v)[0, 1, 5].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs_with_an_alibi_like_bias_keep_the_flash_attention_rule(dtype):
    """The dense bias was rounded to the half dtype: bf16 error 0.26 where plain PyTorch errs 0.006."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=gen) for _ in range(3))
    bias = -130.0 + torch.randn(128, 128, generator=gen)
    exact = attnlab.attention(q.double(), k.double(), v.double(), mask=bias.double(), backend="reference")
    low = [t.to(dtype) for t in (q, k, v)]
    scores = (low[0] @ low[1].transpose(-2, -1)).float() / 4.0 + bias  # plain PyTorch, fp32 softmax
    plain = torch.softmax(scores, dim=-1).to(dtype) @ low[2]
    with torch.no_grad():
        out = attnlab.attention(*low, mask=bias, backend="flex")
    err, plain_err = ((t.double() - exact).abs().max().item() for t in (out, plain))
    allowed = verify.allowed_error(plain_err, dtype, 1.0)
    assert err <= allowed, f"flex error {err:.3g} > {allowed:.3g} (plain PyTorch {plain_err:.3g})"
