"""attnlab.nn.MultiHeadAttention: seed layout, grouped-query, cross-attention, masks, weights."""

from __future__ import annotations

import pytest
import torch

import attnlab.backends
from attnlab import masks
from attnlab.nn import QKV, CallMask, MultiHeadAttention, Window, alibi_bias
from attnlab.lab.bench.competitors import SeedMultiHeadAttention  # the tutorial's module, as written
from attnlab.lab.tutorial import load_tutorial_state_dict

BACKENDS = ["reference", "sdpa", "chunked", "flex"]


def test_seed_initialisation_and_state_dict_layout_match_the_document():
    torch.manual_seed(1240)
    doc = SeedMultiHeadAttention(3, 4, 12, 0.0, 2, qkv_bias=True)
    torch.manual_seed(1240)
    ours = MultiHeadAttention(3, 4, 12, 0.0, 2, qkv=QKV(bias=True))
    for part in ("query", "key", "value"):
        weight, bias = ours.projection(part)
        assert torch.equal(weight, getattr(doc, f"W_{part}").weight)
        assert torch.equal(bias, getattr(doc, f"W_{part}").bias)
    x = torch.rand(2, 12, 3)
    torch.testing.assert_close(ours(x), doc(x), rtol=0, atol=1e-6)
    fresh = MultiHeadAttention(3, 4, 12, 0.0, 2, qkv=QKV(bias=True))
    load_tutorial_state_dict(fresh, doc.state_dict())  # the document's W_query.weight ... keys
    torch.testing.assert_close(fresh(x), doc(x), rtol=0, atol=1e-6)


def test_projection_names_its_part_and_views_the_fused_rows():
    mha = MultiHeadAttention(4, 6, num_heads=2, qkv=QKV(num_kv_heads=1, bias=True))
    weight, bias = mha.projection("value")
    assert weight.data_ptr() == mha.in_proj_weight[9:].data_ptr() and bias.shape == (3,)
    with pytest.raises(ValueError, match="part must be one of 'query', 'key', 'value'; got 'W_key'"):
        mha.projection("W_key")


def _repeat_rows(weight, groups, head_dim):
    """(Hkv*hd, ...) -> (Hkv*groups*hd, ...): K/V head h serves query heads h*groups ..."""
    rows = weight.view(-1, head_dim, *weight.shape[1:])  # (Hkv, hd, ...)
    return rows.repeat_interleave(groups, dim=0).reshape(-1, *weight.shape[1:])


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_grouped_query_equals_mha_with_repeated_kv_heads(num_kv_heads):
    torch.manual_seed(num_kv_heads)
    H, hd, d = 4, 5, 12
    gqa = MultiHeadAttention(d, H * hd, num_heads=H, qkv=QKV(num_kv_heads=num_kv_heads, bias=True)).double()
    mha = MultiHeadAttention(d, H * hd, num_heads=H, qkv=QKV(bias=True)).double()
    groups = H // num_kv_heads
    with torch.no_grad():
        for part in ("query", "key", "value"):
            src, dst = gqa.projection(part), mha.projection(part)
            repeat = (lambda t: t) if part == "query" else (lambda t: _repeat_rows(t, groups, hd))
            for src_tensor, dst_tensor in zip(src, dst):  # weight, bias
                dst_tensor.copy_(repeat(src_tensor))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(3, 9, d, dtype=torch.float64)
    real = torch.ones(3, 9, dtype=torch.bool)
    real[2, 6:] = False
    torch.testing.assert_close(gqa(x, mask=CallMask(padding=real)), mha(x, mask=CallMask(padding=real)), rtol=0, atol=1e-12)


def test_cross_attention_padding_and_fully_padded_row():
    torch.manual_seed(5)
    mod = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(kdim=6, out_bias=False, bias=True))
    x = torch.randn(3, 4, 8, requires_grad=True)
    context = torch.randn(3, 7, 6, requires_grad=True)
    real = torch.ones(3, 7, dtype=torch.bool)
    real[1, 3:] = False
    real[2] = False  # nothing to attend to
    out, weights = mod(x, context=context, mask=CallMask(padding=real), return_weights=True)
    assert out.shape == (3, 4, 8) and weights.shape == (3, 2, 4, 7)
    assert torch.equal(out[2], torch.zeros(4, 8))
    assert weights[1, :, :, 3:].eq(0).all()
    # Row 1 equals attending to its 3 real context tokens only (causal is ignored for context).
    alone = mod(x[1:2], context=context[1:2, :3])
    torch.testing.assert_close(out[1:2], alone, rtol=0, atol=1e-6)
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(context.grad).all()
    assert context.grad[2].eq(0).all() and context.grad[1, 3:].eq(0).all()


def test_unbatched_equals_batched_and_mask_forms():
    torch.manual_seed(6)
    mod = MultiHeadAttention(8, 8, num_heads=2, pattern=None)
    x = torch.randn(5, 8)
    bias = alibi_bias(2, 5)
    torch.testing.assert_close(mod(x, mask=bias[0]), mod(x[None], mask=bias)[0], rtol=0, atol=1e-6)
    real = torch.tensor([True, True, False, True, False])
    mod_mask = masks.padding_mod(torch.tensor([3]))
    via_mod = mod(x[None], mask=CallMask(mod_mask, padding=real[None]))
    via_tensor = mod(x[None], mask=CallMask(padding=(real & (torch.arange(5) < 3))[None]))
    torch.testing.assert_close(via_mod, via_tensor, rtol=0, atol=1e-6)


def test_float_mask_is_added_to_scores():
    torch.manual_seed(7)
    mod = MultiHeadAttention(6, 6, num_heads=3).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    bias = alibi_bias(3, 5, dtype=torch.float64)
    _, weights = mod(x, mask=bias, return_weights=True)
    q, k, _ = mod.project_qkv(x)
    scores = q @ k.transpose(-2, -1) / 2**0.5 + bias  # head_dim 2
    scores = scores.masked_fill(~masks.causal_mask(5), float("-inf"))
    torch.testing.assert_close(weights, torch.softmax(scores, -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_weights_does_not_change_output(backend):
    if backend not in attnlab.backends.available():
        pytest.skip(f"backend {backend} is not available here")
    torch.manual_seed(8)
    mod = MultiHeadAttention(16, 16, num_heads=4, backend=backend, qkv=QKV(num_kv_heads=2)).eval()
    x = torch.randn(2, 128, 16)  # flex on CPU serves whole 128-key blocks only
    real = torch.ones(2, 128, dtype=torch.bool)
    real[1, 20:] = False
    with torch.no_grad():  # inference: some backends (flex on CPU) have no backward
        out = mod(x, mask=CallMask(padding=real))
        out_w, weights = mod(x, mask=CallMask(padding=real), return_weights=True)
        reference = MultiHeadAttention(16, 16, num_heads=4, backend="reference", qkv=QKV(num_kv_heads=2)).eval()
        reference.load_state_dict(mod.state_dict())
        expected = reference(x, mask=CallMask(padding=real), return_weights=True)[1]
    assert torch.equal(out, out_w)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)


def test_dropout_only_in_training():
    torch.manual_seed(9)
    mod = MultiHeadAttention(8, 8, num_heads=2, dropout_p=0.5)
    plain = MultiHeadAttention(8, 8, num_heads=2)
    plain.load_state_dict(mod.state_dict())
    x = torch.randn(2, 6, 8)
    assert not torch.allclose(mod.train()(x), plain(x))
    assert torch.equal(mod.eval()(x), plain.eval()(x))


def test_errors_name_the_argument():
    mod = MultiHeadAttention(8, 8, context_length=4, num_heads=2)
    with pytest.raises(ValueError, match="context_length=4"):
        mod(torch.randn(1, 5, 8))
    with pytest.raises(TypeError, match="key_padding_mask"):
        mod(torch.randn(1, 3, 8), mask=CallMask(padding=torch.ones(1, 3)))
    with pytest.raises(ValueError, match="padding must be"):
        mod(torch.randn(1, 3, 8), mask=CallMask(padding=torch.ones(1, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="3-D mask"):
        mod(torch.randn(2, 3, 8), mask=torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(8, 8, num_heads=4, qkv=QKV(num_kv_heads=3))
    with pytest.raises(ValueError, match="backend"):
        MultiHeadAttention(8, 8, backend="nope")


def test_benchmark_contenders_compute_the_same_function():
    from attnlab.lab.bench.modules import ModulesConfig, build_modules

    modules = build_modules(ModulesConfig(batch=2, seq_len=9, d_model=24, num_heads=3, dtype=torch.float64))
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    with torch.no_grad():
        outs = {name: module(x) for name, module in modules.items()}
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["seed document"], rtol=0, atol=1e-12, msg=name)


def test_a_warm_forward_goes_straight_to_its_attention_part(monkeypatch):
    """The common call (self-attention, causal, no cache or mask) checks once, projects, calls the
    attention part and out-projects: at most 10 attnlab Python calls and 3 attnlab frames on the
    stack when the kernel runs (26 calls and 6 frames before), with and without grad."""
    import os
    import sys

    import torch.nn.functional as F

    from attnlab.backends import dispatch

    package = os.path.dirname(attnlab.__file__)
    kernel, depths, calls = F.scaled_dot_product_attention, [], [0]

    def spy(*args, **kwargs):  # bound by the prepared run, so wrapped before the first call
        frame, depth = sys._getframe(1), 0
        while frame is not None:
            depth += frame.f_code.co_filename.startswith(package)
            frame = frame.f_back
        depths.append(depth)
        return kernel(*args, **kwargs)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[0] += 1

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    dispatch.clear_plans()  # no run prepared with the unwrapped kernel
    mha, x = MultiHeadAttention(32, 32, num_heads=4, backend="sdpa"), torch.randn(2, 16, 32)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            mha(x), mha(x)  # warm
            depths.clear()
            calls[0] = 0
            sys.setprofile(profile)
            try:
                mha(x)
            finally:
                sys.setprofile(None)
        assert calls[0] <= 10 and depths and max(depths) <= 3, (grad, calls, depths)


def test_the_attention_part_is_injected_and_sees_the_modules_rule():
    """A part with attnlab.attention's signature replaces it on every path (common call, cache,
    window) and the module computes what the default part computes."""
    seen = []

    def part(q, k, v, **options):
        seen.append(sorted(options))
        return attnlab.attention(q, k, v, **options)

    torch.manual_seed(0)
    plain = MultiHeadAttention(16, 16, num_heads=4, pattern=Window(3)).double()
    torch.manual_seed(0)
    mine = MultiHeadAttention(16, 16, num_heads=4, attention=part, pattern=Window(3)).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    torch.testing.assert_close(mine(x), plain(x), rtol=0, atol=1e-12)
    cache = mine.new_cache(2, 8)
    torch.testing.assert_close(mine(x[:, :5], cache=cache), plain(x[:, :5]), rtol=0, atol=1e-12)
    assert len(seen) == 2 and "causal" in seen[0]
    torch.manual_seed(0)
    fast = MultiHeadAttention(16, 16, num_heads=4, attention=part)
    fast(torch.randn(1, 3, 16))
    assert seen[-1] == ["backend", "causal", "dropout_p", "sinks"]  # the common call's options
    with pytest.raises(TypeError, match="attention must be a function with attnlab.attention's signature, got str"):
        MultiHeadAttention(16, 16, num_heads=4, attention="sdpa")


@pytest.mark.parametrize("options, keys", [
    (dict(), ["in_proj_weight", "out_proj.weight", "out_proj.bias"]),
    (dict(qkv=QKV(num_kv_heads=2, bias=True)), ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]),
    (dict(qkv=QKV(kdim=5, vdim=7, out_bias=False)), ["q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"]),
    (dict(positions="rope", qkv=QKV(num_kv_heads=2)), ["in_proj_weight", "out_proj.weight", "out_proj.bias"]),
    (dict(pattern=Window(3), sinks=True), ["in_proj_weight", "sinks", "out_proj.weight", "out_proj.bias"]),
    (dict(positions="alibi"), ["in_proj_weight", "out_proj.weight", "out_proj.bias"]),
], ids=["fused", "gqa", "cross", "rope", "window", "alibi"])
def test_parts_keep_the_state_dict_keys(options, keys):
    """The positions part adds no key: a checkpoint saved before the parts loads (keys listed from
    the module as it was)."""
    assert list(MultiHeadAttention(16, 16, num_heads=4, **options).state_dict()) == keys


def test_the_positions_part_is_injected():
    """A RotaryEmbedding or ALiBi given as positions= is the module's part, and computes what the
    named part computes; a part of the wrong size is refused with its expected size."""
    from attnlab.nn import ALiBi, RotaryEmbedding

    x = torch.randn(2, 5, 16, dtype=torch.float64)
    for name, part in (("rope", RotaryEmbedding(4)), ("alibi", ALiBi(4))):
        torch.manual_seed(0)
        named = MultiHeadAttention(16, 16, num_heads=4, positions=name).double()
        torch.manual_seed(0)
        given = MultiHeadAttention(16, 16, num_heads=4, positions=part).double()
        assert given.positions is part
        torch.testing.assert_close(given(x), named(x), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"ALiBi\(num_heads=4\); got ALiBi\(num_heads=2\)"):
        MultiHeadAttention(16, 16, num_heads=4, positions=ALiBi(2))


def _module_frames_and_calls(monkeypatch, run):
    """(most attnlab frames on the stack at the kernel, of them in attnlab.nn, attnlab calls) of
    ``run()``, warm."""
    import os
    import sys

    import torch.nn.functional as F

    from attnlab.backends import dispatch

    package = os.path.dirname(attnlab.__file__)
    kernel, stacks, calls = F.scaled_dot_product_attention, [], [0]

    def spy(*args, **kwargs):
        frame, names = sys._getframe(1), []
        while frame is not None:
            if frame.f_code.co_filename.startswith(package):
                names.append(os.path.relpath(frame.f_code.co_filename, package))
            frame = frame.f_back
        stacks.append(names)
        return kernel(*args, **kwargs)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[0] += 1

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    dispatch.clear_plans()
    with torch.no_grad():
        run(), run()
        stacks.clear()
        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(None)
    assert stacks, "the kernel was not reached"
    deepest = max(stacks, key=len)
    return len(deepest), sum(name.startswith("nn") for name in deepest), calls[0]


def test_rope_window_and_cached_forwards_call_the_part_from_forward(monkeypatch):
    """RoPE, a sliding window and a cached decoding step compute their rule before the call, so the
    attention part runs right below forward: one attnlab.nn frame on the stack at the kernel (RoPE
    went through _attend -> attend -> attend_heads -> attend_causal before). A warm RoPE forward
    takes the common call's path, and a windowed decoding step reaches the kernel 2 frames deep."""
    x = torch.randn(2, 16, 32)
    rope = MultiHeadAttention(32, 32, num_heads=4, positions="rope", backend="sdpa")
    depth, module_frames, calls = _module_frames_and_calls(monkeypatch, lambda: rope(x))
    assert depth <= 2 and module_frames == 1 and calls <= 20, (depth, calls)
    window = MultiHeadAttention(32, 32, num_heads=4, backend="sdpa", pattern=Window(4))
    depth, module_frames, _ = _module_frames_and_calls(monkeypatch, lambda: window(x))
    assert module_frames == 1, depth
    for mha in (MultiHeadAttention(32, 32, num_heads=4, backend="sdpa", pattern=Window(4)).eval(),
                MultiHeadAttention(32, 32, num_heads=4, positions="rope", backend="sdpa").eval()):
        cache = mha.new_cache(2, 64)
        with torch.no_grad():
            mha(x, cache=cache)
        depth, module_frames, _ = _module_frames_and_calls(monkeypatch, lambda: mha(x[:, :1], cache=cache))
        assert module_frames == 1, (mha, depth)
        if mha.window is not None:
            assert depth <= 2, depth


def test_load_tutorial_state_dict_refuses_what_is_not_a_state_dict():
    mha = MultiHeadAttention(4, 4, num_heads=2)
    before = {k: v.clone() for k, v in mha.state_dict().items()}
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        load_tutorial_state_dict(mha, 5)
    assert all(torch.equal(before[k], v) for k, v in mha.state_dict().items())  # nothing changed


# ------------------------------------------------------------- the module of parts (issue 41)
_BEFORE_PARTS = "35e6171"  # the last commit whose MultiHeadAttention took 18 constructor parameters


def _module_before_parts(tmp_path):
    """The MultiHeadAttention class as it was before the parts, from git, imported from a tmp copy."""
    import importlib.util
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        source = subprocess.run(["git", "show", f"{_BEFORE_PARTS}:src/attnlab/nn/multihead.py"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"git history with {_BEFORE_PARTS} is not available: {err}")
    path = tmp_path / "multihead_before_parts.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("multihead_before_parts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MultiHeadAttention


@pytest.mark.parametrize("old, new, call", [
    (dict(qkv_bias=True), dict(qkv=QKV(bias=True)), "padding"),
    (dict(num_kv_heads=2, positions="rope"), dict(qkv=QKV(num_kv_heads=2), positions="rope"), "documents"),
    (dict(kdim=5, vdim=7, out_bias=False, causal=False), dict(qkv=QKV(kdim=5, vdim=7, out_bias=False), pattern=None),
     "cross"),
    (dict(window=3, sinks=True, qkv_bias=True), dict(pattern=Window(3), sinks=True, qkv=QKV(bias=True)), "cache"),
    (dict(chunk=2, softcap=5.0), dict(pattern=__import__("attnlab").nn.Chunk(2), softcap=5.0), "cache"),
    (dict(positions="alibi", causal=False), dict(positions="alibi", pattern=None), "padding"),
], ids=["bias", "gqa_rope", "cross", "window_sinks", "chunk_softcap", "alibi_bidirectional"])
def test_a_state_dict_saved_before_the_parts_loads_and_computes_the_same(tmp_path, old, new, call):
    """The old module (git) and the new one: same state-dict keys and shapes, the old weights load
    strictly into the new module, and the outputs of the old call spelling equal the new one's."""
    Before = _module_before_parts(tmp_path)
    torch.manual_seed(3)
    before = Before(8, 8, None, 0.0, 4, **old).double().eval()
    after = MultiHeadAttention(8, 8, None, 0.0, 4, **new).double()
    after.load_state_dict(before.state_dict(), strict=True)  # the weights differ until loaded
    after.eval()
    assert list(after.state_dict()) == list(before.state_dict())
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    real = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    if call == "padding":
        pairs = [(before(x, padding_mask=real), after(x, mask=CallMask(padding=real))),
                 (before(x, padding_mask=real), after(x, mask=masks.padding_mod(torch.tensor([6, 4]))))]
    elif call == "documents":
        ids = torch.tensor([0, 0, 0, 1, 1, 2])
        pairs = [(before(x, document_ids=ids), after(x, mask=CallMask(documents=ids))),
                 (before(x, document_ids=ids), after(x, mask=masks.document_mod(ids, causal=True)))]
    elif call == "cross":
        context, values = torch.randn(2, 4, 5, dtype=torch.float64), torch.randn(2, 4, 7, dtype=torch.float64)
        pairs = [(before(x, context=context, value_input=values, padding_mask=real[:, :4]),
                  after(x, context=context, value_input=values, mask=CallMask(padding=real[:, :4])))]
    else:
        old_cache, new_cache = before.new_cache(2, 8), after.new_cache(2, 8)
        with torch.no_grad():
            pairs = [(before(x[:, :5], cache=old_cache), after(x[:, :5], cache=new_cache)),
                     (before(x[:, 5:], cache=old_cache), after(x[:, 5:], cache=new_cache))]
    if call != "cross":
        pairs.append((before(x), after(x)))
    for want, got in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_at_most_twelve_constructor_parameters_and_the_tutorials_five_first():
    import inspect

    parameters = list(inspect.signature(MultiHeadAttention.__init__).parameters)[1:]
    assert len(parameters) <= 12, parameters
    assert parameters[:5] == ["d_in", "d_out", "context_length", "dropout_p", "num_heads"]
    assert list(inspect.signature(MultiHeadAttention.forward).parameters)[1:] == [
        "x", "context", "mask", "cache", "return_weights", "value_input", "kv"]  # kv: cross-layer KV sharing


@pytest.mark.parametrize("old, new", [
    (dict(qkv_bias=True), r"qkv_bias= is now qkv=QKV\(bias=...\)"),
    (dict(num_kv_heads=2, kdim=4), r"num_kv_heads= is now qkv=QKV\(num_kv_heads=...\); kdim= is now qkv=QKV\(kdim"),
    (dict(vdim=4), r"vdim= is now qkv=QKV\(vdim=...\)"),
    (dict(out_bias=False), r"out_bias= is now qkv=QKV\(out_bias=...\)"),
    (dict(causal=False), r"causal= is now pattern='causal' \(the default\) or pattern=None"),
    (dict(window=3), r"window= is now pattern=Window\(size\)"),
    (dict(chunk=3), r"chunk= is now pattern=Chunk\(size\)"),
])
def test_the_removed_keywords_are_refused_with_their_new_spelling(old, new):
    with pytest.raises(TypeError, match="MultiHeadAttention no longer takes .*" + new):
        MultiHeadAttention(8, 8, None, 0.0, 2, **old)


def test_forward_keywords_of_before_are_refused_naming_them():
    """forward's padding_mask= and document_ids= are gone: Python's TypeError names the keyword
    (README's table gives the new spelling); nothing is swallowed."""
    mha = MultiHeadAttention(8, 8, num_heads=2)
    for name in ("padding_mask", "document_ids"):
        with pytest.raises(TypeError, match=name):
            mha(torch.randn(1, 3, 8), **{name: torch.ones(1, 3, dtype=torch.bool)})


def test_bad_parts_and_masks_are_refused():
    with pytest.raises(ValueError, match="pattern must be 'causal', None .*got 'window'"):
        MultiHeadAttention(8, 8, num_heads=2, pattern="window")
    with pytest.raises(TypeError, match="qkv must be an attnlab.nn.QKV"):
        MultiHeadAttention(8, 8, num_heads=2, qkv=dict(bias=True))
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        QKV(num_kv_heads=0)
    with pytest.raises(TypeError, match="bias must be a bool"):
        QKV(bias=1)
    with pytest.raises(ValueError, match="window must be a positive int"):
        Window(-1)
    mha = MultiHeadAttention(8, 8, num_heads=2)
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"document_mod\(causal=False\) on a module with pattern causal"):
        mha(x, mask=masks.document_mod(torch.tensor([0, 0, 1, 1]), causal=False))
    with pytest.raises(ValueError, match=r"padding_mod's lengths must be \(B,\) = \(2,\)"):
        mha(x, mask=masks.padding_mod(torch.tensor([4, 4, 4])))
    with pytest.raises(TypeError, match=r"padding \(CallMask\(padding=...\)\) must be a bool tensor"):
        mha(x, mask=CallMask(padding=torch.ones(2, 4)))
    assert mha.qkv == QKV(num_kv_heads=2, kdim=8, vdim=8, bias=False, out_bias=True)


def test_padding_mod_with_a_cache_covers_every_key():
    """padding_mod's lengths count cached + new keys, as CallMask(padding=) does (fp64, same output)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 8, num_heads=2, positions="rope").double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    lengths = torch.tensor([5, 3])
    outs = []
    for step_mask in (lambda t: masks.padding_mod(lengths), lambda t: CallMask(padding=torch.arange(t) < lengths[:, None])):
        cache = mha.new_cache(2, 8)
        with torch.no_grad():
            first = mha(x[:, :3], cache=cache, mask=step_mask(3))
            second = mha(x[:, 3:], cache=cache, mask=step_mask(5))
        outs.append(torch.cat([first, second], dim=1))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][:, 3:], mha(x, mask=CallMask(padding=torch.arange(5) < lengths[:, None]))[:, 3:],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", [dict(), dict(positions="rope", qkv=QKV(num_kv_heads=2, bias=True)),
                                     dict(sinks=True, positions="rope")], ids=["plain", "gqa_rope", "sinks"])
def test_a_decoding_step_equals_the_general_path_and_the_full_forward(options):
    """The decoding step (one token over a KVCache) computes what the general path computes (an
    all-True mask sends the same call there) and what the whole sequence gives (fp64)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 16, num_heads=4, **options).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    fast, general = mha.new_cache(2, 8), mha.new_cache(2, 8)
    steps = []
    with torch.no_grad():
        mha(x[:, :4], cache=fast), mha(x[:, :4], cache=general)
        for t in range(4, 7):
            got = mha(x[:, t:t + 1], cache=fast)
            want = mha(x[:, t:t + 1], cache=general, mask=torch.ones(1, t + 1, dtype=torch.bool))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            steps.append(got)
        full = mha(x)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], rtol=1e-10, atol=1e-10)
    assert fast.length == general.length == 7 and torch.equal(fast.keys, general.keys)


def test_a_decoding_step_that_cannot_take_the_step_is_checked_as_before():
    """Whatever the step does not serve goes the general way, which refuses it, cache unchanged."""
    mha = MultiHeadAttention(8, 8, num_heads=2, context_length=3).eval()
    cache = mha.new_cache(1, 8)
    with torch.no_grad():
        mha(torch.randn(1, 3, 8), cache=cache)
        with pytest.raises(ValueError, match="exceed context_length=3"):
            mha(torch.randn(1, 1, 8), cache=cache)
        with pytest.raises(TypeError, match="x has dtype torch.float64"):
            mha(torch.randn(1, 1, 8, dtype=torch.float64), cache=cache)
        with pytest.raises(ValueError, match="cache holds batch 1"):
            mha(torch.randn(2, 1, 8), cache=cache)
        with pytest.raises(ValueError, match=r"self-attention needs x \(B, T, 8\)"):
            mha(torch.randn(1, 1, 7), cache=cache)
        full = MultiHeadAttention(8, 8, num_heads=2).eval()
        small = full.new_cache(1, 1)
        full(torch.randn(1, 1, 8), cache=small)
        with pytest.raises(ValueError, match="overflow"):
            full(torch.randn(1, 1, 8), cache=small)
    assert cache.length == 3 and small.length == 1
