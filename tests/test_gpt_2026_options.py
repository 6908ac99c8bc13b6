"""GPT options of 2026 (issue 44, item 3): heads of their own width (``QKV(head_dim=)``, GPT
``head_dim``/``global_head_dim``, Gemma 4's 512-wide global heads), Llama 4's NoPE temperature
tuning (``QueryTemperature``, GPT ``nope_temperature``) and the QK-norm forms (``QKNorm(over="all")``,
GPT ``qk_norm="qwen3"|"olmo2"|"gemma"``), against transformers' Gemma 3, Llama 4 and OLMo-2
attention layers, fp64 definitions, and the full forward for cached decoding."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab.models.gpt import GPT
from attnlab.nn import QKV, MultiHeadAttention, QKNorm, QueryTemperature, TransformerBlock
from attnlab.nn.convert import to_torch
from attnlab.nn.positional import RotaryEmbedding


def _causal(T):
    return torch.full((T, T), -math.inf).triu(1)[None, None]  # (1, 1, T, T) additive


def _fused(theirs, bias=False):
    state = {"in_proj_weight": torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]),
             "out_proj.weight": theirs.o_proj.weight}
    if bias:
        state.update({"in_proj_bias": torch.cat([theirs.q_proj.bias, theirs.k_proj.bias, theirs.v_proj.bias]),
                      "out_proj.bias": theirs.o_proj.bias})
    return state


def _decoded(module, x, prefill, cache):
    """``module`` over ``x`` ``(B, T, d)``: a prefill of ``prefill`` tokens, then one token a step."""
    steps = [module(x[:, :prefill], cache=cache)]
    steps += [module(x[:, t : t + 1], cache=cache) for t in range(prefill, x.shape[1])]
    return torch.cat(steps, 1)


# ------------------------------------------------------------------ head_dim
def _gemma3_pair():
    mod = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    config = mod.Gemma3TextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=512,
                                  query_pre_attn_scalar=512, num_hidden_layers=1, layer_types=["full_attention"],
                                  vocab_size=16, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    torch.manual_seed(11)
    theirs = mod.Gemma3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        theirs.q_norm.weight.normal_(0.0, 0.5)
        theirs.k_norm.weight.normal_(0.0, 0.5)
    rope = RotaryEmbedding(512, base=config.rope_parameters["full_attention"]["rope_theta"])
    ours = MultiHeadAttention(64, 64, num_heads=2, positions=rope, qkv=QKV(
        num_kv_heads=1, head_dim=512, out_bias=False, qk_norm=QKNorm(eps=1e-6, unit_offset=True))).eval()
    ours.load_state_dict({**_fused(theirs), "q_norm.weight": theirs.q_norm.weight,
                          "k_norm.weight": theirs.k_norm.weight})
    return mod, config, theirs, ours


def test_head_dim_512_equals_gemma3_attention_and_decodes_equal_to_the_forward():
    """A Gemma 3 full-attention layer with Gemma 4's global head width: 2 heads of 512 on a
    64-wide model (q projects to 1024, o back to 64), its (1 + w) QK-norm, rotary over 512."""
    mod, config, theirs, ours = _gemma3_pair()
    assert ours.in_proj_weight.shape == (1024 + 2 * 512, 64) and ours.out_proj.weight.shape == (64, 1024)
    x = torch.randn(2, 7, 64)
    cos, sin = mod.Gemma3RotaryEmbedding(config)(x, torch.arange(7)[None], "full_attention")
    with torch.no_grad():
        expected, _ = theirs(x, (cos, sin), _causal(7))
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_decoded(ours, x, 3, ours.new_cache(2, 8)), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_decoded(ours, x, 3, ours.new_cache(2, 8, page_size=4)), expected,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "chunked", "blocks"])
def test_head_dim_512_runs_on_every_cpu_backend_as_the_fp64_definition(backend):
    torch.manual_seed(12)
    mha = MultiHeadAttention(32, 48, num_heads=2, qkv=QKV(num_kv_heads=1, head_dim=512), backend=backend)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        got = mha(x)
        w, b = mha.in_proj_weight.double(), mha.in_proj_bias
        q, k, v = F.linear(x.double(), w).split((1024, 512, 512), -1)
        q = q.view(2, 9, 2, 512).transpose(1, 2)  # (B, H, T, D)
        k, v = k.view(2, 9, 1, 512).transpose(1, 2), v.view(2, 9, 1, 512).transpose(1, 2)  # (B, 1, T, D)
        scores = q @ k.transpose(-1, -2) / math.sqrt(512) + _causal(9).double()
        heads = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 9, 1024)  # (B, T, H * D)
        want = F.linear(heads, mha.out_proj.weight.double(), mha.out_proj.bias.double())
    assert b is None and got.shape == (2, 9, 48)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_head_dim_keeps_the_default_layout_and_random_numbers_when_it_equals_d_out_over_heads():
    torch.manual_seed(13)
    plain = MultiHeadAttention(16, 16, num_heads=4)
    torch.manual_seed(13)
    sized = MultiHeadAttention(16, 16, num_heads=4, qkv=QKV(head_dim=4))
    assert torch.equal(plain.in_proj_weight, sized.in_proj_weight) and sized.qkv == plain.qkv
    narrow = MultiHeadAttention(16, 16, num_heads=3, qkv=QKV(head_dim=2))  # 3 heads need not divide 16
    assert narrow.out_proj.weight.shape == (16, 6) and narrow.qkv.head_dim == 2
    assert "head_dim=2" in repr(narrow)
    assert narrow(torch.randn(2, 0, 16)).shape == (2, 0, 16)  # empty sequences pass through


def _gemma4_like(**options):
    torch.manual_seed(14)
    return GPT(vocab_size=24, max_len=32, d_model=32, num_layers=4, num_heads=3, num_kv_heads=1,
               positions="rope", layer_pattern="LLLG", window=3, head_dim=8, global_head_dim=64,
               **options).double().eval()


def test_gpt_head_dim_and_global_head_dim_size_their_layers_and_decode_equal_to_the_forward(tmp_path):
    model = _gemma4_like(qk_norm="gemma")
    assert [block.attn.head_dim for block in model.blocks] == [8, 8, 8, 64]
    assert model.blocks[3].attn.out_proj.weight.shape == (32, 3 * 64)
    assert [cache.keys.shape[-1] for cache in model.new_cache(1)] == [8, 8, 8, 64]
    ids = torch.randint(0, 24, (2, 10))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_cache(2, 16)
        steps = [model(ids[:, :4], caches=caches)] + [model(ids[:, t : t + 1], caches=caches) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    assert torch.equal(model.generate(ids[:, :3], 5), model.generate(ids[:, :3], 5, use_cache=False))
    block = TransformerBlock(32, 3, num_kv_heads=1, positions="rope", head_dim=64, activation="gelu_tanh",
                             qk_norm=QKNorm(eps=1e-5, unit_offset=True)).double().eval()
    block.load_state_dict(model.blocks[3].state_dict())
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    torch.testing.assert_close(block(x), model.blocks[3](x), rtol=0, atol=0)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["head_dim"], config["global_head_dim"], config["qk_norm"]) == (8, 64, "gemma")
    with torch.no_grad():
        assert torch.equal(GPT.from_pretrained(tmp_path).double()(ids), full)


def test_gpt_configs_without_the_options_stay_as_they_were(tmp_path):
    GPT(vocab_size=8, max_len=8, d_model=8, num_heads=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert not {"head_dim", "global_head_dim", "nope_temperature", "qk_norm"} & set(config)


# ------------------------------------------------------------------ Llama 4's NoPE temperature
def test_query_temperature_is_llama4_formula_in_fp64():
    part = QueryTemperature(3, 0.25)
    positions = torch.arange(40)
    want = torch.tensor([math.log(math.floor((p + 1) / 3) + 1) * 0.25 + 1 for p in range(40)], dtype=torch.float64)
    torch.testing.assert_close(part.scales(positions, torch.float64), want, rtol=1e-12, atol=1e-12)
    assert torch.equal(part.scales(torch.arange(2)), torch.ones(2))  # below floor_scale - 1: no change
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(part.at(x, 7), x * want[7:12, None], rtol=1e-12, atol=1e-12)


def _llama4_pair():
    mod = pytest.importorskip("transformers.models.llama4.modeling_llama4")
    config = mod.Llama4TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_hidden_layers=4, floor_scale=2, attn_scale=0.5, attn_temperature_tuning=True,
                                  vocab_size=16, intermediate_size=32, intermediate_size_mlp=32)
    config._attn_implementation = "eager"
    assert config.no_rope_layers[3] == 0  # layer 3 is Llama 4's NoPE layer
    torch.manual_seed(15)
    theirs = mod.Llama4TextAttention(config, layer_idx=3).eval()
    assert not hasattr(theirs, "qk_norm")  # the NoPE layers have no QK-norm
    ours = MultiHeadAttention(64, 64, num_heads=4, qkv=QKV(num_kv_heads=2, out_bias=False),
                              positions=QueryTemperature(2, 0.5)).eval()
    ours.load_state_dict(_fused(theirs))
    return theirs, ours


def test_query_temperature_equals_llama4_nope_attention_and_decodes_equal_to_the_forward():
    theirs, ours = _llama4_pair()
    x = torch.randn(2, 9, 64)  # positions 0..8 with floor_scale 2: the scale steps four times
    unused = (torch.zeros(1), torch.zeros(1))  # a NoPE layer reads no position embeddings
    with torch.no_grad():
        expected, _ = theirs(x, unused, _causal(9))
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        plain = MultiHeadAttention(64, 64, num_heads=4, qkv=QKV(num_kv_heads=2, out_bias=False))
        plain.load_state_dict(ours.state_dict())
        assert not torch.allclose(plain(x), expected, atol=1e-3)  # the temperature changes the layer
        for cache in (ours.new_cache(2, 12), ours.new_cache(2, 12, page_size=4)):
            torch.testing.assert_close(_decoded(ours, x, 4, cache), expected, rtol=1e-5, atol=1e-5)


def _llama4_like(**options):
    torch.manual_seed(16)
    options = {"layer_pattern": "CCCN", "chunk": 4, **options}
    if "C" not in options["layer_pattern"]:
        options.pop("chunk")
    return GPT(vocab_size=24, max_len=32, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, positions="rope",
               **options).double().eval()


def test_gpt_nope_temperature_acts_on_the_n_layers_only_and_decodes_equal_to_the_forward(tmp_path):
    model = _llama4_like(nope_temperature=(2, 0.5))
    parts = [type(block.attn.positions).__name__ for block in model.blocks]
    assert parts == ["RotaryEmbedding"] * 3 + ["QueryTemperature"]
    ids = torch.randint(0, 24, (2, 11))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_cache(2, 16)
        steps = [model(ids[:, :5], caches=caches)] + [model(ids[:, t : t + 1], caches=caches) for t in range(5, 11)]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(_llama4_like()(ids), full)
        # packed documents restart positions, so the temperature too: a packed row is each document alone
        global_nope = _llama4_like(layer_pattern="GN", nope_temperature=(2, 0.5))
        packed = global_nope(ids[:1], document_ids=torch.tensor([0] * 6 + [1] * 5))
        torch.testing.assert_close(packed[:, 6:], global_nope(ids[:1, 6:]), rtol=1e-10, atol=1e-10)
    assert torch.equal(model.generate(ids[:, :3], 6), model.generate(ids[:, :3], 6, use_cache=False))
    block = TransformerBlock(32, 4, num_kv_heads=2, positions=QueryTemperature(2, 0.5),
                             activation="gelu_tanh").double().eval()
    block.load_state_dict(model.blocks[3].state_dict())
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(block(x), model.blocks[3](x), rtol=0, atol=0)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["nope_temperature"] == [2, 0.5]
    with torch.no_grad():
        assert torch.equal(GPT.from_pretrained(tmp_path).double()(ids), full)


# ------------------------------------------------------------------ QK-norm forms
def test_qk_norm_over_all_is_an_rms_norm_of_the_whole_projection_in_fp64():
    mha = MultiHeadAttention(16, 16, num_heads=4, qkv=QKV(num_kv_heads=2, qk_norm=QKNorm(eps=1e-5, over="all")))
    assert mha.q_norm.weight.shape == (16,) and mha.k_norm.weight.shape == (8,)
    with torch.no_grad():
        mha.q_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)  # (B, T, H, D)
    want = F.rms_norm(x.reshape(2, 3, 16), (16,), eps=1e-5) * mha.q_norm.weight.detach().double()
    torch.testing.assert_close(mha.q_norm(x), want.view(2, 3, 4, 4), rtol=1e-12, atol=1e-12)
    per_head = F.rms_norm(x, (4,), eps=1e-5) * mha.q_norm.weight.detach().double().view(4, 4)
    assert not torch.allclose(mha.q_norm(x), per_head)  # not the per-head norm
    half = mha.q_norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), want.view(2, 3, 4, 4), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bias", [False, True])
def test_qk_norm_over_all_equals_olmo2_attention_and_decodes_equal_to_the_forward(bias):
    mod = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    config = mod.Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                             attention_bias=bias, rms_norm_eps=1e-6, vocab_size=16)
    config._attn_implementation = "eager"
    torch.manual_seed(17)
    theirs = mod.Olmo2Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        theirs.q_norm.weight.uniform_(0.5, 1.5)
        theirs.k_norm.weight.uniform_(0.5, 1.5)
    ours = MultiHeadAttention(64, 64, num_heads=4, positions=RotaryEmbedding(16, base=config.rope_parameters[
        "rope_theta"]), qkv=QKV(num_kv_heads=2, bias=bias, out_bias=bias, qk_norm=QKNorm(eps=1e-6, over="all")))
    ours.load_state_dict({**_fused(theirs, bias), "q_norm.weight": theirs.q_norm.weight,
                          "k_norm.weight": theirs.k_norm.weight})
    ours.eval()
    x = torch.randn(2, 8, 64)
    cos, sin = mod.Olmo2RotaryEmbedding(config)(x, torch.arange(8)[None])
    with torch.no_grad():
        expected, _ = theirs(x, (cos, sin), _causal(8))
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_decoded(ours, x, 3, ours.new_cache(2, 8)), expected, rtol=1e-5, atol=1e-5)
        q, k, v = ours.project_qkv(x)  # the fused projection; cross-attention's are apart
        torch.testing.assert_close(ours.project_q(x), q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.cat(ours.project_kv(x)), torch.cat((k, v)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form, part", [(True, QKNorm(eps=1e-5)), ("qwen3", QKNorm(eps=1e-5)),
                                        ("olmo2", QKNorm(eps=1e-5, over="all")),
                                        ("gemma", QKNorm(eps=1e-5, unit_offset=True))])
def test_gpt_qk_norm_forms_build_the_matching_qk_norm(form, part):
    model = _llama4_like(qk_norm=form)
    assert all(block.attn.qk_norm == part for block in model.blocks)
    ids = torch.randint(0, 24, (1, 9))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_cache(1, 12)
        steps = [model(ids[:, :4], caches=caches)] + [model(ids[:, t : t + 1], caches=caches) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("make, error, words", [
    (lambda: QKV(head_dim=0), ValueError, "head_dim"),
    (lambda: QKV(head_dim=8.0), TypeError, "head_dim must be a positive int, got 8.0"),
    (lambda: QKNorm(over="heads"), ValueError, "QKNorm over must be one of 'head', 'all'; got 'heads'"),
    (lambda: QueryTemperature(0, 0.1), ValueError, "floor_scale"),
    (lambda: QueryTemperature(8192, math.nan), ValueError, "attn_scale must be a finite number >= 0, got nan"),
    (lambda: QueryTemperature(8192, -0.1), ValueError, "attn_scale must be a finite number >= 0, got -0.1"),
    (lambda: to_torch(MultiHeadAttention(8, 8, num_heads=2, pattern=None, qkv=QKV(head_dim=8))), ValueError,
     "head_dim=8 (num_heads * head_dim = 16, not d_out=8)"),
    (lambda: MultiHeadAttention(8, 8, num_heads=2, positions=QueryTemperature(2, 1.0))(
        torch.randn(1, 3, 8), context=torch.randn(1, 4, 8)), ValueError, "QueryTemperature applies to self-attention"),
    (lambda: TransformerBlock(8, 2, attn=torch.nn.Identity(), head_dim=8), ValueError,
     "head_dim=8 is an option of the block's own MultiHeadAttention"),
    (lambda: GPT(10, d_model=8, num_heads=2, num_layers=2, layer_pattern="GQ", head_dim=8), ValueError,
     "head_dim=8 sizes the heads of the multi-head layers (G, L, C, N), not of gated output (Qwen3-Next) layers"),
    (lambda: GPT(10, d_model=8, num_heads=2, layer_pattern="L", window=2, global_head_dim=8), ValueError,
     "global_head_dim=8 is for G layers, and layer_pattern 'L' has none"),
    (lambda: GPT(10, d_model=8, num_heads=2, head_dim=-1), ValueError, "head_dim"),
    (lambda: GPT(10, d_model=8, num_heads=2, head_dim=8, global_head_dim=16), ValueError,
     "head_dim=8 is for L, C, N and G layers (global_head_dim sizes the G ones), and layer_pattern None has none"),
    (lambda: GPT(10, d_model=8, num_heads=3), ValueError, "d_model"),  # no head_dim: heads still divide d_model
    (lambda: GPT(10, d_model=8, num_heads=3, num_layers=2, layer_pattern="LG", window=2, global_head_dim=4),
     ValueError, "d_model"),  # the L layer has no width of its own
    (lambda: GPT(10, d_model=8, num_heads=2, positions="rope", head_dim=8, rope_fraction=0.125), ValueError,
     "rope_fraction=0.125 of head_dim=8 is 1 features"),
    (lambda: GPT(10, d_model=8, num_heads=2, positions="rope", head_dim=5), ValueError, "head_dim must be even"),
    (lambda: GPT(10, d_model=8, num_heads=2, nope_temperature=(2, 0.5)), ValueError,
     "nope_temperature=(2, 0.5) scales the queries of N layers (NoPE), and layer_pattern None has none"),
    (lambda: GPT(10, d_model=8, num_heads=2, layer_pattern="N", nope_temperature=2), TypeError,
     "nope_temperature must be a pair (floor_scale, attn_scale)"),
    (lambda: GPT(10, d_model=8, num_heads=2, layer_pattern="N", nope_temperature=(2, 0.5, 1)), TypeError,
     "nope_temperature must be a pair"),
    (lambda: GPT(10, d_model=8, num_heads=2, layer_pattern="N", nope_temperature=(0, 0.5)), ValueError,
     "floor_scale"),
    (lambda: GPT(10, d_model=8, num_heads=2, qk_norm="olmo3"), ValueError,
     "qk_norm must be one of 'qwen3', 'olmo2', 'gemma'; got 'olmo3'"),
], ids=["qkv_zero", "qkv_float", "over", "floor_zero", "scale_nan", "scale_negative", "to_torch", "cross",
        "block_attn", "gpt_gated", "global_no_g", "gpt_negative", "head_dim_unused", "gpt_divide", "gpt_divide_local", "gpt_fraction",
        "gpt_odd_rope", "nope_no_n", "nope_int", "nope_three", "nope_floor", "qk_form"])
def test_bad_options_are_refused_naming_the_argument(make, error, words):
    with pytest.raises(error, match=re.escape(words)):
        make()


# ------------------------------------------------------------------ docs
def test_the_docs_examples_run():
    text = (Path(__file__).resolve().parents[1] / "docs" / "modules.md").read_text()
    section = text.split("## Head width, NoPE temperature and QK-norm forms")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    for code in blocks:
        exec(compile(code, "docs/modules.md", "exec"), {"attnlab": attnlab})
