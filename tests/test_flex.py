"""The flex backend: what it declines on CPU, its block-mask cache, mask mods handed to the
kernel directly (O(T)), and CUDA paths (skipped here)."""

import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import attnlab
from attnlab import backends, masks, scores
from attnlab.lab import verify
from attnlab._memory import PeakMemory
from attnlab.backends import build_call
from attnlab.backends import flex as flex_module

pytestmark = pytest.mark.skipif("flex" not in backends.available(), reason="no FlexAttention")
SHAPE = (1, 2, 256, 16)  # one shape for every CPU test here: flex compiles per shape
T = SHAPE[2]  # two whole 128-key blocks (on CPU flex declines partial ones): block masks have
# empty, partial and full blocks


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


def test_block_masks_live_on_prepared_masks_and_dense_masks_are_built_per_call():
    q, k, v = _qkv()
    mask = torch.rand(T, T, generator=torch.Generator().manual_seed(1)) > 0.3
    prepared = masks.prepare(masks.sliding_window_mod(T, T, 64), tq=T, tk=T)
    with torch.no_grad():
        attnlab.attention(q, k, v, mask=mask, backend="flex")
        mask[0, 0] = not mask[0, 0]  # nothing was kept: the edit is seen
        changed = attnlab.attention(q, k, v, mask=mask, backend="flex")
        want = attnlab.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
        first = attnlab.attention(q, k, v, mask=prepared, backend="flex")
        held = [value for key, value in prepared.memo.items() if key[0] == "flex"]
        again = attnlab.attention(q, k, v, mask=prepared, backend="flex")
    torch.testing.assert_close(changed.double(), want, atol=1e-5, rtol=1e-5)
    assert len(held) == 1 and [value for key, value in prepared.memo.items() if key[0] == "flex"] == held
    assert torch.equal(first, again)
    _assert_conforms(first, q, k, v, mask=masks.sliding_window_mod(T, T, 64))


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


def test_a_new_shape_past_the_recompile_limit_is_served(monkeypatch):
    """Flex serves a call whatever the process compiled before: past Dynamo's recompile limit
    (64 for flex; 1 here) it drops its own compiled variants and compiles the call's. It
    declined the 65th shape instead, and clear_plans() did not give the budget back."""
    flex = backends.get("flex")
    q, k, v = _qkv()
    other = torch.randn(1, 1, 128, 8)
    with torch.no_grad():
        attnlab.attention(q, k, v, backend="flex")
        monkeypatch.setattr(flex_module, "_RECOMPILE_LIMIT", 1)
        assert backends.reasons(build_call(other, other, other))["flex"] == []
        out = attnlab.attention(other, other, other, backend="flex")
        again = attnlab.attention(q, k, v, backend="flex")  # dropped by the call before: compiled again
    _assert_conforms(out, other, other, other)
    _assert_conforms(again, q, k, v)
    assert flex.compiled_variants == 1 and flex.compiled(build_call(q, k, v))


# ----------------------------------------------------------------------- exact or declined
def _reference(q, k, v, **options):
    mask = options.get("mask")
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        options = dict(options, mask=mask.double())
    return attnlab.attention(q.double(), k.double(), v.double(), backend="reference", **options)


@pytest.mark.parametrize("tq, tk", [(8, 8), (24, 24), (17, 8), (16, 8), (136, 136), (8, 1)])
def test_partial_key_blocks_are_declined_on_cpu(tq, tk):
    """Declined on every CPU: torch's compiled CPU kernel built for AVX2 is wrong (up to 2.2 abs,
    or NaN) at Tk = 8, 24, 136, ...; this asserts the decline, not that torch is wrong."""
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
def test_a_nan_query_row_is_nan_and_finite_padding_has_no_influence():
    """flex's kernel turns a NaN query row into zeros; attnlab gives it back its NaN, without
    reading values. Finite values at padded keys have no influence (weight exactly 0)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 128, 16, generator=gen) for _ in range(3))
    pad = masks.padding_mask(torch.tensor([128, 100]))
    q_bad = q.clone()
    q_bad[0, 1, 5, 2] = float("nan")
    with torch.no_grad():
        out = attnlab.attention(q_bad, k, v, backend="flex")
        assert out[0, 1, 5].isnan().all() and out.isnan().sum() == out.shape[-1]
        garbage = [x.masked_fill(~pad[:, :, 0, :, None], 1e4) for x in (k, v)]
        clean = attnlab.attention(q, k, v, mask=pad, backend="reference")
        torch.testing.assert_close(attnlab.attention(q, *garbage, mask=pad, backend="flex"), clean,
                                   rtol=0, atol=1e-5)


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


# ---------------------------------------------------------- mask mods handed to the kernel
def _assert_conforms(out, q, k, v, **options):
    """attnlab's rule: at most 2x the fp32 reference's error vs fp64, plus the fp32 floor."""
    exact = _reference(q, k, v, **options)
    plain = attnlab.attention(q, k, v, backend="reference", **options)
    plain_err, err = ((t.double() - exact).abs().max().item() for t in (plain, out))
    allowed = verify.allowed_error(plain_err, q.dtype, exact.abs().max().item(),
                                   reduction=max(q.shape[-1], k.shape[-2]))
    assert err <= allowed, f"flex error {err:.3g} > {allowed:.3g} (reference fp32 {plain_err:.3g})"


def _no_dense_mask(monkeypatch):
    """Make every way to a dense (B, H, Tq, Tk) mask fail."""
    def refuse(*args, **kwargs):
        raise AssertionError("a dense mask was built for a mask-mod call")
    monkeypatch.setattr(flex_module, "_dense_bias", refuse)
    monkeypatch.setattr(attnlab._call.AttentionCall, "allowed", refuse)
    monkeypatch.setattr(masks, "materialize", refuse)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


# Structures that flex's row ranges cover (causal folds in as a CausalMod); one compilation for all.
MOD_CASES = {
    "window + causal": (lambda: masks.sliding_window_mod(T, T, 64), True),
    "documents + causal": (lambda: masks.document_mod(torch.arange(T) // 48, causal=False), True),
    "prefix-LM": (lambda: masks.prefix_lm_mod(T, T, 100), False),
    "chunked local": (lambda: masks.chunked_local_mod(T, T, 96, causal=False), False),
}


@pytest.mark.parametrize("case", list(MOD_CASES))
def test_mask_mods_reach_the_kernel_without_a_dense_mask(case, monkeypatch):
    make, causal = MOD_CASES[case]
    q, k, v = _qkv()
    flex, mod = backends.get("flex"), make()
    call = build_call(q, k, v, mask=mod, causal=causal)
    assert flex.memory_use(call).kind == "linear" and "from the mask mod" in flex.memory_use(call, words=True).note
    variants, graphs = len(flex._variants), _graphs()
    with torch.no_grad(), monkeypatch.context() as patch:
        _no_dense_mask(patch)
        out = attnlab.attention(q, k, v, mask=mod, causal=causal, backend="flex")
    _assert_conforms(out, q, k, v, mask=mod, causal=causal)
    # the variants flex counts against Dynamo's recompile limit are the graphs Dynamo compiles
    assert _graphs() - graphs == len(flex._variants) - variants <= 1


def test_every_direct_mod_of_a_shape_shares_one_compilation():
    """Dynamo guards on a mod's class and each int it reads; flex hands every direct mod over as
    one PreparedMask of tensors, so another class, window, prefix, document layout or a new
    instance compiles nothing and is still exact."""
    q, k, v = _qkv()
    with torch.no_grad():
        attnlab.attention(q, k, v, mask=masks.sliding_window_mod(T, T, 64), causal=True, backend="flex")
        graphs = _graphs()
        for mod, causal in ((masks.sliding_window_mod(T, T, 64), True), (masks.sliding_window_mod(T, T, 200), False),
                            (masks.document_mod(torch.arange(T) % 3), False),
                            (masks.document_mod(torch.arange(T) // 100, causal=False), True),
                            (masks.prefix_lm_mod(T, T, 7), True), (masks.chunked_local_mod(T, T, 5), False),
                            (None, True), (masks.padding_mod(torch.tensor([9])) & masks.causal_mod(T, T), False)):
            out = attnlab.attention(q, k, v, mask=mod, causal=causal, backend="flex")
            _assert_conforms(out, q, k, v, mask=mod, causal=causal)
    assert _graphs() == graphs


@pytest.mark.parametrize("tq, make", [
    (1024, lambda tq: masks.sliding_window_mod(tq, 1024, 200)),
    (1024, lambda tq: masks.document_mod(torch.tensor([0] * 300 + [1] * 500 + [2] * 224), causal=False)),
    (1000, lambda tq: masks.prefix_lm_mod(tq, 1024, 333, align="bottom_right")),
    (1024, lambda tq: masks.chunked_local_mod(tq, 1024, 256) & masks.padding_mod(torch.tensor([900, 40]))),
    (900, lambda tq: masks.varlen_causal_mod(torch.tensor([900, 17]), torch.tensor([1000, 600]), window=300)),
], ids=["window", "documents", "prefix, partial query block", "and of two", "varlen"])
def test_block_mask_from_a_mod_is_torchs_block_mask(tq, make):
    """The per-block build equals ``create_block_mask`` (which evaluates every (q, k) pair); no compile."""
    mod, batch = make(tq), 2
    call = build_call(torch.randn(batch, 1, tq, 8), torch.randn(batch, 1, 1024, 8), torch.randn(batch, 1, 1024, 8),
                      mask=mod)
    ours = flex_module._block_mask_of(masks.prepare(mod, tq=tq, tk=1024, batch=batch).rows(batch), call)
    torchs = flex_module._flex_module.create_block_mask(mod, batch, 1, tq, 1024, device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(torchs, name)), name
    assert torch.equal(ours.to_dense(), torchs.to_dense())


def test_block_mask_from_a_mod_holds_no_dense_mask():
    """T=8192: a (T, T) bool mask alone is 64 MiB; the per-block build holds ~B * 128 * span."""
    t = 8192
    q = torch.randn(1, 1, t, 8)
    call = build_call(q, q, q, mask=masks.sliding_window_mod(t, t, 256), causal=True)
    with PeakMemory() as meter:
        block_mask = flex_module._block_mask_of(masks.prepare(call.mask_mod(), tq=t, tk=t), call)
    assert meter.peak_bytes < 2**20, f"{meter.peak_bytes / 2**20:.1f} MiB"
    assert int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum()) == 3 * (t // 128) - 3


def test_a_prepared_mask_is_a_snapshot_and_an_unprepared_mod_is_read_each_call():
    """Editing a PaddingMod's lengths after preparing it does not reach the prepared mask (it
    owns copies); the mod itself, passed unprepared, is read afresh on each call."""
    q, k, v = _qkv()
    mod = masks.padding_mod(torch.tensor([200]))
    prepared = masks.prepare(mod, tq=T, tk=T)
    with torch.no_grad():
        out = attnlab.attention(q, k, v, mask=prepared, backend="flex")
        mod.lengths[0] = 3
        again = attnlab.attention(q, k, v, mask=prepared, backend="flex")
        edited = attnlab.attention(q, k, v, mask=mod, backend="flex")
    assert torch.equal(out, again)
    _assert_conforms(out, q, k, v, mask=masks.padding_mod(torch.tensor([200])))
    _assert_conforms(edited, q, k, v, mask=masks.padding_mod(torch.tensor([3])))


def test_user_mods_and_ors_take_the_dense_path():
    """A lambda or a subclass may hold Python flex cannot trace or ints it would recompile on."""
    class Shifted(masks.SlidingWindowMod):
        def __call__(self, b, h, q_idx, kv_idx):
            return super().__call__(b, h, q_idx, kv_idx + 1)

    q, _, _ = _qkv()
    flex = backends.get("flex")
    for mod in (lambda b, h, i, j: i >= j, Shifted(8), masks.causal_mod(T, T) & (lambda b, h, i, j: i >= j),
                masks.causal_mod(T, T) | masks.padding_mod(torch.tensor([3]))):  # an OR: not one interval
        call = build_call(q, q, q, mask=mod)
        assert flex.memory_use(call).kind == "quadratic" and "user's own" in flex.memory_use(call, words=True).note
    assert flex.memory_use(build_call(q, q, q, causal=True)).kind == "linear"
    assert flex.memory_use(build_call(q, q, q, mask=torch.ones(T, T, dtype=torch.bool))).kind == "quadratic"


# ------------------------------------------------------------- the benchmark's competitor
def test_flex_competitor_masks_equal_the_sparse_cases():
    """The plain functions compiled FlexAttention is timed with allow what attnlab's mods allow."""
    from attnlab.lab.bench.competitors import flex_mask_mods
    from attnlab.lab.bench.suites import sparse_cases

    t = 2048  # chunks of 1024, 8 documents of 256, a window of 256
    ours, theirs = sparse_cases(t), flex_mask_mods(t)
    assert set(ours) == set(theirs)
    for case, mod in ours.items():
        assert torch.equal(masks.materialize(theirs[case], tq=t, tk=t), masks.materialize(mod, tq=t, tk=t)), case


def test_compiled_flex_competitor_matches_the_flex_backend():
    from attnlab.lab.bench.competitors import CompiledFlex

    q, k, v = _qkv()
    competitor = CompiledFlex(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 64), T, T)
    with torch.no_grad():
        out = competitor(q, k, v)
    _assert_conforms(out, q, k, v, mask=masks.sliding_window_mod(T, T, 64))


def test_layouts_of_one_shape_share_one_compiled_kernel():
    """Regression: the kernel is compiled with static shapes, so Dynamo guarded on strides and
    compiled once per layout; a sweep over layouts passed recompile_limit and flex then ran
    unfused in bf16 (0.29 off where the rule allows 0.04). The backend now hands it standard
    strides: four layouts of one shape, one compiled graph, each equal to the reference."""
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(2, 128, 2, 16, generator=gen) for _ in range(3)]  # (B, T, H, D)
    layouts = [
        [t.transpose(1, 2) for t in base],  # (B, H, T, D) from (B, T, H, D)
        [t.transpose(1, 2).contiguous() for t in base],
        [torch.randn(2, 2, 128, 32, generator=gen)[..., :16] for _ in range(3)],  # sliced last dim
        [t.transpose(1, 2)[:1].expand(2, -1, -1, -1) for t in base],  # expanded batch
    ]
    with torch.no_grad():
        attnlab.attention(*layouts[1], backend="flex")  # compiled once here (or earlier)
        before = counters["stats"]["unique_graphs"]
        for q, k, v in layouts:
            got = attnlab.attention(q, k, v, backend="flex")
            want = attnlab.attention(q.double(), k.double(), v.double(), backend="reference")
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == before


# ----------------------------------------------------------------------------- score mods
def _wavy(score, b, h, q_idx, kv_idx):
    """A user's score mod written for FlexAttention (0-d indices under its vmap)."""
    return score * 0.75 + 0.5 * torch.sin((q_idx - kv_idx + h).to(score.dtype))


# One compilation per case (flex compiles per score-mod kind and mask path): each mod kind
# and each mask path appears once, with the composition carrying T5's bias and a tensor bias.
SCORE_CASES = {
    "softcap, window (block mask)": (lambda: scores.softcap(2.0),
                                     lambda: dict(mask=masks.sliding_window_mod(T, T, 64), causal=True)),
    "alibi, causal": (lambda: scores.alibi(SHAPE[1]), lambda: dict(causal=True)),
    "softcap + T5 bias + bias, bool mask (dense)": (
        lambda: (scores.softcap(3.0) + scores.relative_bias(torch.randn(8, SHAPE[1]), num_buckets=8,
                                                            max_distance=20, bidirectional=True)
                 + scores.bias(torch.randn(1, SHAPE[1], T, T))),
        lambda: dict(mask=torch.rand(T, T, generator=torch.Generator().manual_seed(3)) > 0.4)),
    "user function, no mask": (lambda: scores.function(_wavy), lambda: {}),
}


@pytest.mark.parametrize("case", sorted(SCORE_CASES))
def test_score_mods_are_flex_score_mods(case):
    """Each score mod reaches the kernel as its score_mod, combined with every mask path, and
    conforms to fp64 (the tiled backend's order: the mod first, then the mask)."""
    make_mod, make_options = SCORE_CASES[case]
    q, k, v = _qkv()
    mod, options = make_mod(), make_options()
    with torch.no_grad():
        out = attnlab.attention(q, k, v, score_mod=mod, backend="flex", **options)
    _assert_conforms(out, q, k, v, score_mod=mod, **options)
    assert not torch.allclose(out, attnlab.attention(q, k, v, backend="reference", **options), atol=1e-3)


def test_score_mod_in_bfloat16_keeps_the_conformance_rule():
    """Half inputs: the mod sees float32 scores (ALiBi's distances would lose their low bits in bf16)."""
    q, k, v = (t.bfloat16() for t in _qkv())
    mod = scores.alibi(SHAPE[1]) + scores.softcap(3.0)
    with torch.no_grad():
        out = attnlab.attention(q, k, v, score_mod=mod, causal=True, backend="flex")
    _assert_conforms(out, q, k, v, score_mod=mod, causal=True)


def test_a_new_score_mod_instance_compiles_nothing_and_its_signature_is_a_variant():
    """torch.compile guards on the mod's kind and settings, not on the instance or tensor values."""
    q, k, v = _qkv()
    flex = backends.get("flex")
    with torch.no_grad():
        attnlab.attention(q, k, v, score_mod=scores.alibi(SHAPE[1]), causal=True, backend="flex")
        graphs = _graphs()
        slopes = torch.rand(SHAPE[1])
        out = attnlab.attention(q, k, v, score_mod=scores.alibi(slopes), causal=True, backend="flex")
    assert _graphs() == graphs
    _assert_conforms(out, q, k, v, score_mod=scores.alibi(slopes), causal=True)
    call = build_call(q, k, v, score_mod=scores.softcap(7.0))
    assert not flex.compiled(call)  # another kind: another variant (and the estimate charges it)
    assert flex.compiled(build_call(q, k, v, score_mod=scores.alibi(torch.rand(SHAPE[1])), causal=True))


@pytest.mark.parametrize("options, words", [
    (dict(sinks=torch.zeros(SHAPE[1])), "returns no log-sum-exp"),
    (dict(score_mod=scores.alibi(torch.rand(SHAPE[1], requires_grad=True))), "cannot differentiate"),
    (dict(score_mod=scores.alibi(torch.rand(SHAPE[1], dtype=torch.float64))), "float64"),
])
def test_declines_sinks_and_mods_it_cannot_serve_exactly(options, words):
    q, k, v = _qkv()
    text = backends.reasons(build_call(q, k, v, **options))["flex"]
    assert any(words in reason for reason in text), text
    with pytest.raises(ValueError, match=words):
        attnlab.attention(q, k, v, backend="flex", **options)


def test_reset_compiled_gives_the_variant_budget_back():
    """A long-running process may drop every compiled kernel and compile afresh (exactly)."""
    q, k, v = _qkv()
    flex = backends.get("flex")
    with torch.no_grad():
        attnlab.attention(q, k, v, causal=True, backend="flex")
        assert flex.compiled_variants >= 1 and flex.compiled(build_call(q, k, v, causal=True))
        flex.reset_compiled()
        assert flex.compiled_variants == 0 and not flex.compiled(build_call(q, k, v, causal=True))
        out = attnlab.attention(q, k, v, causal=True, backend="flex")
    _assert_conforms(out, q, k, v, causal=True)
    assert flex.compiled_variants == 1


def test_a_forward_call_compiles_once_whatever_the_grad_mode():
    """Dynamo guards on the grad mode: a forward-only call made with grad enabled must reuse the
    kernel compiled under no_grad (it compiled a second one, which ran the budget out early)."""
    q, k, v = _qkv()
    mod = scores.softcap(4.0)
    with torch.no_grad():
        attnlab.attention(q, k, v, score_mod=mod, backend="flex")
    graphs = _graphs()
    out = attnlab.attention(q, k, v, score_mod=mod, backend="flex")  # grad enabled, nothing requires it
    assert _graphs() == graphs
    _assert_conforms(out, q, k, v, score_mod=mod)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_users_function_is_declined_in_half_precision_on_cpu(dtype):
    """torch's compiled CPU kernel computed ``(score + t[h]).to(score.dtype)`` off by 3.6 (bf16) and
    5.2 (fp16), exact in fp32: a user's function, alone or composed, goes to chunked there."""
    q, k, v = (t.to(dtype) for t in _qkv())
    slopes = torch.tensor([0.25, 3.0])
    fn = scores.function(lambda s, b, h, i, j: (s + slopes[h]).to(s.dtype))
    for mod in (fn, scores.softcap(3.0) + fn):
        why = backends.reasons(build_call(q, k, v, score_mod=mod))["flex"]
        assert any("half precision" in reason for reason in why), why
    assert not backends.reasons(build_call(q, k, v, score_mod=scores.alibi(slopes)))["flex"]
    with torch.no_grad():  # auto serves it exactly elsewhere
        out = attnlab.attention(q, k, v, score_mod=fn)
    _assert_conforms(out, q, k, v, score_mod=fn)


def test_a_score_mod_inductor_cannot_lower_is_declined_for_that_mod_only(monkeypatch):
    """A user's function Inductor could not lower (``torch.sort(t).values[q_idx]``) raised an
    InductorError, and flex then declined every call, plain causal included, until clear_plans().
    The kernel is stood in for here: a real failed lowering takes ~20 s to compile."""
    class InductorError(RuntimeError):
        pass

    real = flex_module.FlexBackend._kernel

    def kernel(self):
        compiled = real(self)

        def run(q, k, v, *, score_mod=None, **options):
            if getattr(getattr(score_mod, "score_mod", None), "user_function", False):
                raise InductorError("LoweringException: PendingUnbackedSymbolNotFound: u0, u1")
            return compiled(q, k, v, score_mod=score_mod, **options)
        return run

    monkeypatch.setattr(flex_module.FlexBackend, "_kernel", kernel)
    flex = backends.get("flex")
    q, k, v = _qkv()
    table = torch.randn(T)
    bad = scores.function(lambda s, b, h, i, j: s + torch.sort(table).values[i])
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match="could not lower the score mod function"):
                attnlab.attention(q, k, v, score_mod=bad, backend="flex")
            why = backends.reasons(build_call(q, k, v, score_mod=bad))["flex"]
            assert any("InductorError" in reason for reason in why), why
            assert backends.reasons(build_call(q, k, v, causal=True))["flex"] == []
            out = attnlab.attention(q, k, v, causal=True, backend="flex")  # still served
            _assert_conforms(out, q, k, v, causal=True)
            other = scores.function(lambda s, b, h, i, j: s * 0.5)
            assert backends.reasons(build_call(q, k, v, score_mod=other))["flex"] == []
            out = attnlab.attention(q, k, v, score_mod=bad)  # auto: served elsewhere
            _assert_conforms(out, q, k, v, score_mod=bad)
    finally:
        flex._mod_errors.clear()
