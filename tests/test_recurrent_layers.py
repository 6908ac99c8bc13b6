"""GatedDeltaNet and KimiDeltaAttention against transformers' layers, their caches against the full
forward, and the GPT letters R and K (Qwen3.5's "RRRQ", Kimi Linear's "KKKM")."""

from __future__ import annotations

import tempfile

import pytest
import torch

from attnlab import linear as _linear
from attnlab.models import GPT
from attnlab.nn import DecayedLinearAttention, GatedDeltaNet, KimiDeltaAttention, KVCache, RecurrentCache

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextGatedDeltaNet  # noqa: E402

D_MODEL = 24


def _perturb(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere (norm weights and biases off their ones/zeros), so a misplaced tensor shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5))
            elif name.endswith("dt_bias") or name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("norm.weight") else 0.0))
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    return layer


def _qwen_config(config_class, H, Hv, Dk, Dv, K):
    return config_class(hidden_size=D_MODEL, linear_num_key_heads=H, linear_num_value_heads=Hv, linear_key_head_dim=Dk,
                        linear_value_head_dim=Dv, linear_conv_kernel_dim=K, num_hidden_layers=1,
                        layer_types=["linear_attention"])


def qwen3_next(seed=0, H=2, Hv=4, Dk=8, Dv=6, K=4):
    return _perturb(Qwen3NextGatedDeltaNet(_qwen_config(transformers.Qwen3NextConfig, H, Hv, Dk, Dv, K), 0), seed)


def qwen3_5(seed=0, H=2, Hv=4, Dk=8, Dv=6, K=4):
    return _perturb(Qwen3_5GatedDeltaNet(_qwen_config(transformers.Qwen3_5TextConfig, H, Hv, Dk, Dv, K), 0), seed)


def kimi(seed=0, heads=3, dim=8, K=4):
    config = transformers.KimiLinearConfig(hidden_size=D_MODEL, num_hidden_layers=1, layer_types=["linear_attention"],
                                           linear_attn_config={"head_dim": dim, "num_heads": heads,
                                                               "short_conv_kernel_size": K})
    return _perturb(KimiLinearDeltaAttention(config, 0), seed)


# Shapes: Hv > H (grouped value heads), Dk != Dv, another kernel; for Kimi its heads, width and kernel.
QWEN_SHAPES = [dict(H=2, Hv=4, Dk=8, Dv=6, K=4), dict(H=1, Hv=3, Dk=4, Dv=8, K=2), dict(H=3, Hv=3, Dk=6, Dv=6, K=3)]
LAYERS = [pytest.param(lambda seed, s: (qwen3_next(seed, **s), GatedDeltaNet), id="qwen3_next"),
          pytest.param(lambda seed, s: (qwen3_5(seed, **s), GatedDeltaNet), id="qwen3_5")]
KIMI_SHAPES = [dict(heads=3, dim=8, K=4), dict(heads=2, dim=4, K=2)]


def _x(B, T, seed=1, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.randn(B, T, D_MODEL, dtype=dtype)


# ------------------------------------------------------------------------- parity with transformers
@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize("seed, shape", list(enumerate(QWEN_SHAPES)))
def test_gated_deltanet_equals_transformers(make, shape, seed):
    theirs, cls = make(seed, shape)
    x = _x(2, 9, seed)
    with torch.no_grad():
        expected = theirs(x)
        ours = cls.from_transformers(theirs)
        assert ours.num_heads == shape["Hv"] and ours.num_key_heads == shape["H"]
        torch.testing.assert_close(ours(x), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.double()(x.double()).float(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed, shape", list(enumerate(KIMI_SHAPES)))
def test_kimi_delta_attention_equals_transformers(shape, seed):
    theirs = kimi(seed, **shape)
    x = _x(2, 9, seed)
    with torch.no_grad():
        expected = theirs(x)
        ours = KimiDeltaAttention.from_transformers(theirs)
        torch.testing.assert_close(ours(x), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.double()(x.double()).float(), expected, atol=1e-4, rtol=1e-4)


def test_qwen3_next_and_qwen3_5_layouts_give_one_layer():
    """Qwen3-Next's fused, per-key-head-grouped in_proj_qkvz / in_proj_ba unfused into Qwen3.5's four
    projections: our state dict (Qwen3.5's names) loads into a Qwen3.5 layer that equals the Qwen3-Next one."""
    a = qwen3_next(3)
    b = Qwen3_5GatedDeltaNet(_qwen_config(transformers.Qwen3_5TextConfig, 2, 4, 8, 6, 4), 0)
    b.load_state_dict(GatedDeltaNet.from_transformers(a).state_dict())
    x = _x(1, 7)
    with torch.no_grad():
        torch.testing.assert_close(b(x), a(x), atol=1e-5, rtol=1e-5)


def test_from_transformers_keeps_the_layers_dtype():
    theirs = qwen3_5(4).to(torch.bfloat16)
    ours = GatedDeltaNet.from_transformers(theirs)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    x = _x(1, 6, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=0.05, rtol=0.05)


def test_from_transformers_refuses_other_classes():
    config = _qwen_config(transformers.Qwen3NextConfig, 2, 4, 8, 8, 4)
    config.layer_types = ["full_attention"]
    with pytest.raises(TypeError, match="Qwen3NextAttention"):
        GatedDeltaNet.from_transformers(Qwen3NextAttention(config, 0))
    with pytest.raises(TypeError, match="KimiLinearDeltaAttention"):
        GatedDeltaNet.from_transformers(kimi())
    with pytest.raises(TypeError, match="Qwen3_5GatedDeltaNet"):
        KimiDeltaAttention.from_transformers(qwen3_5())
    with pytest.raises(TypeError, match="GatedDeltaNet"):  # ours is not transformers'
        KimiDeltaAttention.from_transformers(GatedDeltaNet(D_MODEL, 2))
    theirs = qwen3_5()
    theirs.activation = "gelu"
    with pytest.raises(ValueError, match="SiLU"):
        GatedDeltaNet.from_transformers(theirs)


def test_backend_option_reaches_linear_attention(monkeypatch):
    """The layer's core is one attnlab.linear_attention call with the layer's backend."""
    seen = []

    def spy(call):
        seen.append((call.rule, tuple(call.q.shape), tuple(call.v.shape)))
        return _linear.BACKENDS["reference"](call)

    monkeypatch.setitem(_linear.BACKENDS, "spy", spy)
    gdn, kda = GatedDeltaNet(D_MODEL, 4, num_key_heads=2, backend="spy"), KimiDeltaAttention(D_MODEL, 3, backend="spy")
    gdn(_x(1, 5)), kda(_x(1, 5))
    assert seen == [("gated_delta", (1, 2, 5, 6), (1, 4, 5, 6)), ("kda", (1, 3, 5, 8), (1, 3, 5, 8))]
    with pytest.raises(ValueError, match="backend"):
        GatedDeltaNet(D_MODEL, 4, backend="flash")


# ------------------------------------------------------------------------- cache
def _layers(dtype=torch.float64):
    return [GatedDeltaNet.from_transformers(qwen3_next(5)).to(dtype),
            KimiDeltaAttention.from_transformers(kimi(5)).to(dtype)]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("index", [0, 1], ids=["gated_deltanet", "kda"])
def test_prefill_then_decode_equals_full_forward(index, dtype, tol):
    layer = _layers(dtype)[index]
    x = _x(2, 11, dtype=dtype)
    cache = layer.new_cache(2)
    bytes_at_start = cache.nbytes
    with torch.no_grad():
        full = layer(x)
        parts = [layer(x[:, :5], cache=cache)]
        parts += [layer(x[:, t:t + 1], cache=cache) for t in range(5, 8)]
        parts.append(layer(x[:, 8:], cache=cache))  # a multi-token continuation
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=tol, rtol=tol)
    assert cache.length == 11 and cache.row_lengths == (11, 11)
    assert cache.nbytes == bytes_at_start  # constant in T
    assert cache.state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("index", [0, 1], ids=["gated_deltanet", "kda"])
def test_gradients_flow_through_the_cache_as_through_one_call(index):
    """Under autograd a cache carries the state's graph: two calls through it give the whole call's gradients."""
    layer = _layers()[index]
    x = _x(1, 7, dtype=torch.float64).requires_grad_()
    whole = torch.autograd.grad(layer(x).square().sum(), [x, *layer.parameters()])
    cache = layer.new_cache(1)
    assert isinstance(cache, RecurrentCache)
    out = torch.cat([layer(x[:, :4], cache=cache), layer(x[:, 4:], cache=cache)], dim=1)
    split = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    for a, b in zip(whole, split):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)


def test_cache_bytes_are_the_window_and_the_state():
    layer = GatedDeltaNet(D_MODEL, 4, num_key_heads=2, head_dim=8, value_dim=6, kernel_size=4).to(torch.bfloat16)
    cache = layer.new_cache(3, max_len=100)
    channels = 2 * 2 * 8 + 4 * 6
    assert cache.nbytes == 3 * channels * 3 * 2 + 3 * 4 * 8 * 6 * 4  # bf16 window, fp32 state
    with torch.no_grad():
        layer(_x(3, 40, dtype=torch.bfloat16), cache=cache)
    assert cache.nbytes == 3 * channels * 3 * 2 + 3 * 4 * 8 * 6 * 4 and cache.state.dtype == torch.float32
    # what it keeps alive too: the window is not a view of the 40 tokens' inputs
    assert cache.conv.untyped_storage().nbytes() + cache.state.untyped_storage().nbytes() == cache.nbytes


def _same_cache(cache, before):
    conv, state, length = before
    return torch.equal(cache.conv, conv) and torch.equal(cache.state, state) and cache.length == length


@pytest.mark.parametrize("index", [0, 1], ids=["gated_deltanet", "kda"])
def test_cache_errors_leave_it_unchanged(index):
    layer = _layers()[index]
    cache = layer.new_cache(2)
    with torch.no_grad():
        layer(_x(2, 3, dtype=torch.float64), cache=cache)
    before = (cache.conv.clone(), cache.state.clone(), cache.length)
    with pytest.raises(ValueError, match="batch"):
        layer(_x(1, 1, dtype=torch.float64), cache=cache)
    with pytest.raises(TypeError, match="float32"):
        layer.float()(_x(2, 1), cache=cache)
    layer.double()
    with pytest.raises(TypeError, match="RecurrentCache"):
        layer(_x(2, 1, dtype=torch.float64), cache=KVCache(2, 1, 4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="kernel_size"):
        layer(_x(2, 1, dtype=torch.float64), cache=GatedDeltaNet(D_MODEL, 2).double().new_cache(2))
    bad = _x(2, 2, dtype=torch.float64)
    bad[0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="x has NaN"):
        layer(bad, cache=cache)
    weight = (layer.in_proj_qkv if index == 0 else layer.q_proj).weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0] = float("inf")  # a weight gone bad fails inside linear_attention, after the projections
    with pytest.raises(ValueError, match="NaN"):
        layer(_x(2, 2, dtype=torch.float64), cache=cache)
    with torch.no_grad():
        weight.copy_(kept)
    with pytest.raises(ValueError, match="padding_mask"):
        layer(_x(2, 1, dtype=torch.float64), cache=cache, padding_mask=torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="document_ids"):
        layer(_x(2, 1, dtype=torch.float64), cache=cache, document_ids=torch.zeros(1, dtype=torch.long))
    assert _same_cache(cache, before)
    with torch.no_grad():  # an empty step changes nothing and returns nothing
        assert layer(_x(2, 0, dtype=torch.float64), cache=cache).shape == (2, 0, D_MODEL)
    assert _same_cache(cache, before)


def test_a_model_failing_in_a_later_layer_puts_the_recurrent_cache_back():
    model = GPT(vocab_size=11, max_len=16, d_model=16, num_layers=2, num_heads=2, layer_pattern="RQ").eval()
    caches = model.new_cache(1, max_len=3)  # the Q layer's KVCache holds 3 tokens
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), caches=caches)
        before = (caches[0].conv.clone(), caches[0].state.clone(), caches[0].length)
        with pytest.raises(ValueError, match="overflow"):
            model(torch.tensor([[3, 4]]), caches=caches)  # R advances, then Q overflows
    assert _same_cache(caches[0], before) and caches[1].length == 2


def test_reset_and_refusals():
    layer = KimiDeltaAttention(D_MODEL, 3)
    cache = layer.new_cache(1)
    with torch.no_grad():
        layer(_x(1, 4), cache=cache)
    cache.reset()
    fresh = layer.new_cache(1)
    assert _same_cache(cache, (fresh.conv, fresh.state, 0))
    with pytest.raises(ValueError, match="page_size"):
        layer.new_cache(1, 8, page_size=-1)
    with pytest.raises(ValueError, match="mask"):
        layer(_x(1, 2), mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="not keys"):
        cache.attend(None, None, None, None)
    with pytest.raises(ValueError, match="num_key_heads"):
        GatedDeltaNet(D_MODEL, 4, num_key_heads=3)
    with pytest.raises(ValueError, match="d_model"):
        GatedDeltaNet(D_MODEL, 5)
    with pytest.raises(ValueError, match="x"):
        layer(torch.randn(1, 2, D_MODEL + 1))


# ------------------------------------------------------------------------- padding and documents
def _biased_layers():
    """Our own layers with biases in every projection (a padded token still contributes nothing)."""
    torch.manual_seed(6)
    layers = [GatedDeltaNet(D_MODEL, 4, num_key_heads=2, bias=True), KimiDeltaAttention(D_MODEL, 3, bias=True)]
    for layer in layers:
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
    return [layer.double() for layer in layers]


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("index", [0, 1], ids=["gated_deltanet", "kda"])
def test_padded_rows_equal_each_row_alone(index, biased):
    layer = (_biased_layers() if biased else _layers())[index]
    a, b = _x(1, 6, seed=2, dtype=torch.float64), _x(1, 3, seed=3, dtype=torch.float64)
    junk = torch.full((1, 3, D_MODEL), 7.0, dtype=torch.float64)
    with torch.no_grad():
        alone_a, alone_b = layer(a), layer(b)
        right = layer(torch.cat([a, torch.cat([b, junk], 1)]),
                      padding_mask=torch.tensor([[True] * 6, [True] * 3 + [False] * 3]))
        left = layer(torch.cat([a, torch.cat([junk, b], 1)]),
                     padding_mask=torch.tensor([[True] * 6, [False] * 3 + [True] * 3]))
    torch.testing.assert_close(right[0], alone_a[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(right[1, :3], alone_b[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(left[1, 3:], alone_b[0], atol=1e-12, rtol=0)
    with pytest.raises(TypeError, match="padding_mask"):
        layer(a, padding_mask=torch.ones(1, 6))
    with pytest.raises(ValueError, match="padding_mask"):
        layer(a, padding_mask=torch.ones(1, 5, dtype=torch.bool))


@pytest.mark.parametrize("index", [0, 1], ids=["gated_deltanet", "kda"])
def test_packed_documents_equal_each_document_alone(index):
    layer = _layers()[index]
    x = _x(2, 9, seed=4, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 6, 6]])
    with torch.no_grad():
        packed = layer(x, document_ids=ids)
        for row in range(2):
            for doc in ids[row].unique():
                where = (ids[row] == doc).nonzero().flatten()
                alone = layer(x[row:row + 1, where])
                torch.testing.assert_close(packed[row, where], alone[0], atol=1e-12, rtol=0)
        empty = layer(x[:, :0], document_ids=ids[:, :0])
        assert empty.shape == (2, 0, D_MODEL)
        shared = layer(x, document_ids=ids[0])  # (T,): every row the same documents
        torch.testing.assert_close(shared[1, 4:6], layer(x[1:, 4:6])[0], atol=1e-12, rtol=0)


# ------------------------------------------------------------------------- GPT letters
PATTERNS = [dict(layer_pattern="RRRQ", num_kv_heads=2), dict(layer_pattern="KKKM", latent_dim=8),
            dict(layer_pattern="AAAG", num_kv_heads=2)]


def _gpt(**options):
    torch.manual_seed(0)
    return GPT(vocab_size=13, max_len=24, d_model=16, num_layers=4, num_heads=4, positions="rope", **options)


@pytest.mark.parametrize("options", PATTERNS, ids=lambda o: o["layer_pattern"])
def test_gpt_hybrid_trains_generates_and_round_trips(options):
    model = _gpt(**options)
    kinds = {"R": GatedDeltaNet, "K": KimiDeltaAttention, "A": DecayedLinearAttention}
    letter = options["layer_pattern"][0]
    assert [type(b.attn) for b in model.blocks[:3]] == [kinds[letter]] * 3
    if letter == "A":  # plain linear attention: no decay (so no A_log to learn), no delta rule
        assert model.blocks[0].attn.decay == "none" and not hasattr(model.blocks[0].attn, "A_log")
    assert model.blocks[0].attn.num_key_heads == options.get("num_kv_heads", 4)
    assert model.blocks[0].attn.out_proj.bias is not None  # GPT's bias=True reaches every projection
    assert GPT(vocab_size=13, max_len=8, d_model=16, num_layers=4, num_heads=4, bias=False,
               **options).blocks[0].attn.out_proj.bias is None
    ids = torch.randint(0, 13, (2, 6))
    model(ids).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert letter == "A" or any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "A_log" in n)
    generated = model.generate(ids, 7)
    assert torch.equal(generated, model.generate(ids, 7, use_cache=False))
    # the cached path's logits are the full forward's, step by step (a stronger check than argmax)
    model.double().eval()
    caches = model.new_cache(2)
    with torch.no_grad():
        steps = [model(generated[:, :6], caches=caches)]
        steps += [model._step_logits(generated[:, t:t + 1], caches)[:, None] for t in range(6, 12)]
        torch.testing.assert_close(torch.cat(steps, 1)[:, 5:], model(generated[:, :12])[:, 5:], atol=1e-10, rtol=0)
    model.float()
    folder = model.save_pretrained(tempfile.mkdtemp())
    loaded = GPT.from_pretrained(folder)
    assert loaded.config["layer_pattern"] == options["layer_pattern"]
    assert torch.equal(loaded(ids), model(ids))


def test_gpt_refuses_what_linear_layers_lack():
    with pytest.raises(ValueError, match="return_weights"):
        _gpt(layer_pattern="RG")(torch.tensor([[1, 2]]), return_weights=True)
    with pytest.raises(ValueError, match="dropout_p"):
        _gpt(layer_pattern="KG", dropout_p=0.1)
    with pytest.raises(ValueError, match="softcap"):
        _gpt(layer_pattern="RG", softcap=30.0)
    with pytest.raises(ValueError, match="page_size"):
        _gpt(layer_pattern="KG").new_cache(1, page_size=0)
    assert _gpt(layer_pattern="RN").blocks[0].attn.extra_repr().startswith("d_model=16")


@pytest.mark.parametrize("options", PATTERNS, ids=lambda o: o["layer_pattern"])
def test_gpt_prompts_of_different_lengths_each_get_what_they_get_alone(options):
    """A list of prompts: paged caches for the attention layers, each row's own state for the linear ones."""
    model = _gpt(**options).eval()
    prompts = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6]), torch.tensor([7, 8, 9])]
    together = model.generate(prompts, 5, page_size=2)
    for prompt, got in zip(prompts, together):
        assert torch.equal(got, model.generate(prompt[None], 5)[0])
    assert torch.equal(model.generate(torch.tensor([[1, 2, 3]]), 4, page_size=2),
                       model.generate(torch.tensor([[1, 2, 3]]), 4))


def test_selected_rows_read_and_advance_the_whole_cache():
    layer = GatedDeltaNet(D_MODEL, 4, num_key_heads=2).double()
    x = _x(2, 5, dtype=torch.float64)
    cache = layer.new_cache(2)
    with torch.no_grad():
        first = layer(x[1:, :3], cache=cache.select([1]))  # row 1 alone, 3 tokens
        assert cache.row_lengths == (0, 3) and not cache.state[0].any()
        layer(x[:1, :1], cache=cache.select([0]))
        both = layer(torch.cat([x[:1, 1:2], x[1:, 3:4]]), cache=cache)  # one step of rows at lengths 1 and 3
        assert cache.row_lengths == (2, 4)
        torch.testing.assert_close(first, layer(x[1:, :3])[:, :3], atol=1e-12, rtol=0)
        torch.testing.assert_close(both[0], layer(x[:1, :2])[0, 1:], atol=1e-12, rtol=0)
        torch.testing.assert_close(both[1], layer(torch.cat([x[1:, :3], x[1:, 3:4]], 1))[0, 3:], atol=1e-12, rtol=0)
    assert "row_lengths=(2, 4)" in repr(cache)
    cache.select([0]).reset()
    assert cache.row_lengths == (0, 4) and not cache.state[0].any() and cache.state[1].any()
    for bad, error in (([], ValueError), ([2], ValueError), ([0, 0], ValueError), ("0", TypeError)):
        with pytest.raises(error, match="rows"):
            cache.select(bad)


def test_gpt_padded_and_packed_batches_with_linear_layers():
    model = _gpt(layer_pattern="RRRQ", num_kv_heads=2).double().eval()
    a, b = torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[6, 7, 8]])
    with torch.no_grad():
        padded = model(torch.cat([a, torch.cat([b, torch.zeros(1, 2, dtype=torch.long)], 1)]),
                       padding_mask=torch.tensor([[True] * 5, [True] * 3 + [False] * 2]))
        torch.testing.assert_close(padded[1, :3], model(b)[0], atol=1e-10, rtol=0)
        packed = model(torch.cat([a, b], 1), document_ids=torch.tensor([0] * 5 + [1] * 3))
        torch.testing.assert_close(packed[0, 5:], model(b)[0], atol=1e-10, rtol=0)


def test_the_short_convolution_is_the_same_by_products_and_by_conv1d():
    """Decoding-sized inputs take K products and a sum (PyTorch's depthwise conv1d costs ms a call on a
    CPU for one token), longer ones conv1d: both equal F.conv1d over the same window, in fp64."""
    import torch.nn.functional as F

    from attnlab.nn.recurrent import _TAPS_UP_TO

    layer = GatedDeltaNet(D_MODEL, 2).double()
    for T in (1, 3, _TAPS_UP_TO, _TAPS_UP_TO + 1, 40):
        full = torch.randn(2, layer.channels, layer.kernel_size - 1 + T, dtype=torch.float64)
        want = F.conv1d(full, layer.conv1d.weight, groups=layer.channels)
        torch.testing.assert_close(layer._conv(full, None), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("decay", ["data", "fixed", "none"])
def test_decayed_linear_attention_is_the_quadratic_causal_form_and_decodes_as_it_runs_whole(decay, monkeypatch):
    """Mamba-2's, RetNet's and plain linear attention's rule: what the layer hands linear_attention
    gives o_t = scale Σ_{j<=t} exp(G_t - G_j) (q_t·k_j) v_j (G the summed log-decays), written here as
    one masked matrix product in fp64; decoding token by token equals the whole forward."""
    import attnlab.linear as linear
    from attnlab.nn import DecayedLinearAttention

    torch.manual_seed(0)
    layer = DecayedLinearAttention(D_MODEL, 4, num_key_heads=2, decay=decay).double()
    seen = {}
    run = linear._run

    def spy(q, k, v, **options):
        seen.update(q=q, k=k, v=v, decay=options["decay"], beta=options["beta"])
        seen["out"] = run(q, k, v, **options)[0]
        return run(q, k, v, **options)

    monkeypatch.setattr(linear, "_run", spy)
    x = _x(2, 9, dtype=torch.float64)
    whole = layer(x)
    q, k, v = (seen[n] for n in ("q", "k", "v"))
    assert seen["beta"] is None
    q, k = q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1)  # (B, Hv, T, Dk)
    G = torch.zeros(v.shape[:3], dtype=torch.float64) if seen["decay"] is None else seen["decay"].cumsum(-1)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    weights = (q @ k.mT) * (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    torch.testing.assert_close(seen["out"], q.shape[-1] ** -0.5 * weights @ v, rtol=0, atol=1e-12)
    if decay == "fixed":
        gammas = 1 - 2.0 ** (-5 - torch.arange(4, dtype=torch.float64))
        torch.testing.assert_close(seen["decay"][0, :, 0].exp(), gammas, rtol=0, atol=1e-6)
    monkeypatch.undo()
    cache = layer.new_cache(2)
    with torch.no_grad():
        steps = torch.cat([layer(x[:, :4], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(4, 9)], 1)
    torch.testing.assert_close(steps, whole.detach(), rtol=0, atol=1e-10)


def test_decayed_linear_attention_refuses_an_unknown_decay_and_learns_no_unused_parameter():
    from attnlab.nn import DecayedLinearAttention

    with pytest.raises(ValueError, match="decay"):
        DecayedLinearAttention(D_MODEL, 4, decay="retnet")
    names = {n for n, _ in DecayedLinearAttention(D_MODEL, 4, decay="fixed").named_parameters()}
    assert not names & {"A_log", "dt_bias", "in_proj_a.weight"}
    assert {"A_log", "dt_bias", "in_proj_a.weight"} <= {n for n, _ in DecayedLinearAttention(D_MODEL, 4).named_parameters()}
