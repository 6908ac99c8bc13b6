"""Partial RoPE (``RotaryEmbedding(rotary_dim=)``, GPT ``rope_fraction``) and QK-norm
(``MultiHeadAttention(qkv=QKV(qk_norm=QKNorm()))``, GPT ``qk_norm``) against transformers' Qwen3, Qwen3.5 and
Qwen3-Next code, an fp64 definition, and the full forward for cached decoding (issue 44, item 3)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.models.gpt import GPT
from attnlab.nn import QKV, MultiHeadAttention, QKNorm, TransformerBlock, Window
from attnlab.nn.convert import to_torch
from attnlab.nn.positional import RotaryEmbedding, apply_rotary


def _causal(T, dtype=torch.float32):
    return torch.full((T, T), -math.inf, dtype=dtype).triu(1)[None, None]  # (1, 1, T, T) additive


def _randomise_norms(mha, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in (mha.q_norm, mha.k_norm):
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)


# ------------------------------------------------------------------ partial RoPE
@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0])
def test_partial_rotation_equals_transformers_apply_rotary_pos_emb(factor):
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    config = mod.Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_hidden_layers=1)
    config.rope_parameters["partial_rotary_factor"] = factor
    rope = mod.Qwen3NextRotaryEmbedding(config)
    rotary = 2 * rope.inv_freq.numel()
    assert rotary == int(16 * factor)
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16)  # (B, H, T, D)
    positions = torch.arange(3, 10)[None].expand(2, 7)  # after 3 cached tokens
    cos, sin = rope(q, positions)
    want_q, want_k = mod.apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryEmbedding(16, rotary_dim=rotary, base=config.rope_parameters["rope_theta"])
    torch.testing.assert_close(ours(q, offset=3), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours(k, offset=3), want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.at(k, positions), want_k, rtol=1e-5, atol=1e-5)  # per-row positions
    assert torch.equal(ours(q, offset=3)[..., rotary:], q[..., rotary:])  # the rest passes unchanged


def test_partial_rotation_is_the_full_rotation_of_the_leading_features_in_fp64():
    x = torch.randn(2, 3, 6, 12, dtype=torch.float64)
    partial, narrow = RotaryEmbedding(12, rotary_dim=4), RotaryEmbedding(4)
    out = partial(x, offset=5)
    torch.testing.assert_close(out[..., :4], narrow(x[..., :4], offset=5), rtol=0, atol=0)
    assert torch.equal(out[..., 4:], x[..., 4:])
    # positions enter only through m - n in the rotated part: shifting both keeps every dot product
    q, k = partial(x, offset=0), partial(x, offset=9)
    torch.testing.assert_close(partial(x, offset=2) @ partial(x, offset=11).transpose(-1, -2),
                               q @ k.transpose(-1, -2), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ QK-norm
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_qk_norm_is_an_rms_norm_of_each_head(unit_offset, dtype):
    mha = MultiHeadAttention(16, 16, num_heads=2, qkv=QKV(qk_norm=QKNorm(eps=1e-5, unit_offset=unit_offset)))
    _randomise_norms(mha)
    x = torch.randn(2, 3, 4, 8, dtype=dtype)
    weight = mha.q_norm.weight.detach().double()
    scale = 1 + weight if unit_offset else weight
    want = F.rms_norm(x.double(), (8,), eps=1e-5) * scale
    got = mha.q_norm.to(dtype)(x) if unit_offset else mha.q_norm(x)  # Qwen3's form keeps the weight's dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_a_zero_head_stays_zero_and_nan_spreads_only_in_its_head():
    mha = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(qk_norm=QKNorm()))
    x = torch.zeros(1, 2, 3, 4)
    assert torch.equal(mha.q_norm(x), x)  # eps keeps 0 / sqrt(0 + eps) finite
    x[0, 0, 0, 1] = math.nan
    out = mha.k_norm(x)
    assert out[0, 0, 0].isnan().all() and not out[0, 1].isnan().any() and not out[0, 0, 1:].isnan().any()


def _qwen3_pair(bias):
    mod = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    config = mod.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             attention_bias=bias, num_hidden_layers=1, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    theirs = mod.Qwen3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        theirs.q_norm.weight.uniform_(0.5, 1.5)
        theirs.k_norm.weight.uniform_(0.5, 1.5)
    rope = RotaryEmbedding(16, base=config.rope_parameters["rope_theta"])
    ours = MultiHeadAttention(64, 64, num_heads=4, positions=rope, qkv=QKV(
        num_kv_heads=2, bias=bias, out_bias=bias, qk_norm=QKNorm(eps=config.rms_norm_eps))).eval()
    state = {"in_proj_weight": torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]),
             "out_proj.weight": theirs.o_proj.weight, "q_norm.weight": theirs.q_norm.weight,
             "k_norm.weight": theirs.k_norm.weight}
    if bias:
        state.update({"in_proj_bias": torch.cat([theirs.q_proj.bias, theirs.k_proj.bias, theirs.v_proj.bias]),
                      "out_proj.bias": theirs.o_proj.bias})
    ours.load_state_dict(state)
    return mod, config, theirs, ours


@pytest.mark.parametrize("bias", [False, True])
def test_multihead_with_qk_norm_equals_transformers_qwen3_attention(bias):
    mod, config, theirs, ours = _qwen3_pair(bias)
    x = torch.randn(2, 9, 64)
    cos, sin = mod.Qwen3RotaryEmbedding(config)(x, torch.arange(9)[None])
    with torch.no_grad():
        expected, _ = theirs(x, (cos, sin), _causal(9))
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        cache = ours.new_cache(2, 16)  # the decoding step path, one token at a time after a prefill
        steps = [ours(x[:, :4], cache=cache)] + [ours(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=1e-5, atol=1e-5)


def test_multihead_with_partial_rope_and_unit_offset_qk_norm_equals_qwen3_5_attention_gate_at_zero():
    """Qwen3.5's attention layer: QK-norm scaled by 1 + w, a quarter of each head rotated, an output
    gate. With the gate's rows of ``q_proj`` zero the gate is sigmoid(0) = 1/2 everywhere, so the
    layer is MultiHeadAttention with half of ``o_proj`` (the gate itself is GatedAttention's)."""
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    config = mod.Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   num_hidden_layers=1, vocab_size=16)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    theirs = mod.Qwen3_5Attention(config, layer_idx=0).eval()
    rows = theirs.q_proj.weight.view(4, 2, 16, 64)  # per head: 16 query rows, then 16 gate rows
    with torch.no_grad():
        rows[:, 1].zero_()
        theirs.q_norm.weight.normal_(0.0, 0.5)
        theirs.k_norm.weight.normal_(0.0, 0.5)
    rope = mod.Qwen3_5TextRotaryEmbedding(config)
    rotary = 2 * rope.inv_freq.numel()
    assert rotary == 4  # partial_rotary_factor 0.25 of 16
    norm = QKNorm(eps=config.rms_norm_eps, unit_offset=True)
    ours = MultiHeadAttention(64, 64, num_heads=4, qkv=QKV(num_kv_heads=2, out_bias=False, qk_norm=norm),
                              positions=RotaryEmbedding(16, rotary_dim=rotary,
                                                        base=config.rope_parameters["rope_theta"])).eval()
    ours.load_state_dict({"in_proj_weight": torch.cat([rows[:, 0].reshape(64, 64), theirs.k_proj.weight,
                                                       theirs.v_proj.weight]),
                          "out_proj.weight": 0.5 * theirs.o_proj.weight,
                          "q_norm.weight": theirs.q_norm.weight, "k_norm.weight": theirs.k_norm.weight})
    x = torch.randn(2, 8, 64)
    cos, sin = rope(x, torch.arange(8)[None].expand(2, 8))
    with torch.no_grad():
        expected, _ = theirs(x, (cos, sin), _causal(8))
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        cache = ours.new_cache(2, 8)
        steps = [ours(x[:, :3], cache=cache)] + [ours(x[:, t : t + 1], cache=cache) for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=1e-5, atol=1e-5)


def test_gradients_reach_the_norm_weights_and_match_finite_differences():
    torch.manual_seed(4)
    mha = MultiHeadAttention(8, 8, num_heads=2, positions=RotaryEmbedding(4, rotary_dim=2),
                             qkv=QKV(qk_norm=QKNorm())).double()
    _randomise_norms(mha)
    x = torch.randn(1, 4, 8, dtype=torch.float64, requires_grad=True)

    qw = mha.q_norm.weight.detach().clone().requires_grad_()
    kw = mha.k_norm.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, q, k: torch.func.functional_call(
        mha, {"q_norm.weight": q, "k_norm.weight": k}, (x,)), (x, qw, kw))


# ------------------------------------------------------------------ decoding, caches, GPT
@pytest.mark.parametrize("pattern", ["causal", Window(3)])
def test_multihead_cached_decoding_equals_the_full_forward(pattern):
    torch.manual_seed(5)
    mha = MultiHeadAttention(32, 32, num_heads=4, qkv=QKV(num_kv_heads=1, qk_norm=QKNorm()), pattern=pattern,
                             positions=RotaryEmbedding(8, rotary_dim=6)).double().eval()
    _randomise_norms(mha)
    x = torch.randn(3, 10, 32, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x)
        for cache in (mha.new_cache(3, 16), mha.new_cache(3, 16, page_size=4)):
            steps = [mha(x[:, :5], cache=cache)] + [mha(x[:, t : t + 1], cache=cache) for t in range(5, 10)]
            torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


def _gpt(**options):
    torch.manual_seed(6)
    model = GPT(vocab_size=24, max_len=32, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                positions="rope", layer_pattern="GLN", window=4, **options).double().eval()
    for block in model.blocks:
        if block.attn.q_norm is not None:
            _randomise_norms(block.attn, seed=len(block.attn.q_norm.weight))
    return model


def test_gpt_with_both_options_decodes_equal_to_its_full_forward():
    model = _gpt(rope_fraction=0.25, qk_norm=True)
    attn = model.blocks[0].attn
    assert attn.rope.rotary_dim == 2 and attn.qk_norm == QKNorm(eps=1e-5)
    assert model.blocks[2].attn.rope is None  # the NoPE layer stays NoPE
    ids = torch.randint(0, 24, (2, 11))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_cache(2, 16)
        steps = [model(ids[:, :6], caches=caches)] + [model(ids[:, t : t + 1], caches=caches) for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    greedy = model.generate(ids[:, :4], 5)
    assert torch.equal(greedy, model.generate(ids[:, :4], 5, use_cache=False))


def test_gpt_options_change_the_model_and_match_a_hand_built_block():
    plain, both = _gpt(), _gpt(rope_fraction=0.5, qk_norm=True)
    ids = torch.randint(0, 24, (1, 7))
    assert not torch.allclose(plain(ids), both(ids))
    block = TransformerBlock(32, 4, num_kv_heads=2, positions=RotaryEmbedding(8, rotary_dim=4),
                             qk_norm=QKNorm(eps=1e-5), activation="gelu_tanh").double().eval()
    block.load_state_dict(both.blocks[0].state_dict())
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(block(x), both.blocks[0](x), rtol=0, atol=0)


def test_state_dict_keys_are_unchanged_without_the_options_and_gain_the_norms_with_them():
    base = set(MultiHeadAttention(8, 8, num_heads=2, positions="rope").state_dict())
    assert base == {"in_proj_weight", "out_proj.weight", "out_proj.bias"}
    partial = MultiHeadAttention(8, 8, num_heads=2, positions=RotaryEmbedding(4, rotary_dim=2))
    assert set(partial.state_dict()) == base
    normed = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(qk_norm=QKNorm()))
    assert set(normed.state_dict()) == base | {"q_norm.weight", "k_norm.weight"}
    assert torch.equal(normed.q_norm.weight, torch.ones(4))
    assert torch.equal(MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(qk_norm=QKNorm(unit_offset=True))).k_norm.weight,
                       torch.zeros(4))
    # the options draw no random numbers: the projections are those of a module without them
    torch.manual_seed(7)
    a = MultiHeadAttention(8, 8, num_heads=2)
    torch.manual_seed(7)
    b = MultiHeadAttention(8, 8, num_heads=2, qkv=QKV(qk_norm=QKNorm()), positions=RotaryEmbedding(4, rotary_dim=2))
    assert torch.equal(a.in_proj_weight, b.in_proj_weight) and torch.equal(a.out_proj.weight, b.out_proj.weight)
    gpt_keys = set(_gpt().state_dict())
    assert not any("norm.weight" in key and ("q_norm" in key or "k_norm" in key) for key in gpt_keys)
    assert gpt_keys == set(_gpt(rope_fraction=0.5).state_dict())


def test_gpt_saves_and_loads_both_options(tmp_path):
    model = _gpt(rope_fraction=0.25, qk_norm=True)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_fraction"] == 0.25 and config["qk_norm"] is True
    loaded = GPT.from_pretrained(tmp_path).double().eval()
    ids = torch.randint(0, 24, (2, 9))
    assert torch.equal(loaded(ids), model(ids))
    _gpt().save_pretrained(tmp_path / "plain")  # configs without the options stay as they were
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "rope_fraction" not in plain and "qk_norm" not in plain


def test_empty_sequences_pass_through():
    mha = MultiHeadAttention(8, 8, num_heads=2, positions=RotaryEmbedding(4, rotary_dim=2), qkv=QKV(qk_norm=QKNorm()))
    assert mha(torch.randn(2, 0, 8)).shape == (2, 0, 8)
    assert RotaryEmbedding(4, rotary_dim=2)(torch.randn(1, 0, 4)).shape == (1, 0, 4)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("make, error, words", [
    (lambda: RotaryEmbedding(8, rotary_dim=3), ValueError,
     "rotary_dim must be an even int of at most head_dim=8, got 3"),
    (lambda: RotaryEmbedding(8, rotary_dim=10), ValueError,
     "rotary_dim must be an even int of at most head_dim=8, got 10"),
    (lambda: RotaryEmbedding(8, rotary_dim=0), ValueError, "rotary_dim"),
    (lambda: RotaryEmbedding(8, rotary_dim=2.0), TypeError, "rotary_dim must be a positive int, got 2.0"),
    (lambda: apply_rotary(torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(2, 3)), ValueError, "R/2 <= D/2"),
    (lambda: apply_rotary(torch.zeros(2, 4), torch.zeros(3, 1), torch.zeros(3, 1)), ValueError, "cos (3, 1)"),
    (lambda: apply_rotary(torch.zeros(2, 4), torch.zeros(2, 0), torch.zeros(2, 0)), ValueError, "1 <= R/2"),
    (lambda: QKNorm(eps=0), ValueError, "QKNorm eps must be a positive finite number, got 0"),
    (lambda: QKNorm(eps=math.nan), ValueError, "QKNorm eps"),
    (lambda: QKNorm(unit_offset=1), TypeError, "QKNorm unit_offset must be a bool, got int"),
    (lambda: QKV(qk_norm=True), TypeError, "qk_norm must be an attnlab.nn.QKNorm (or None), got bool"),
    (lambda: MultiHeadAttention(8, 8, num_heads=2, qk_norm=QKNorm()), TypeError, "qk_norm"),
    (lambda: MultiHeadAttention(8, 8, num_heads=2, positions=RotaryEmbedding(8, rotary_dim=4)), ValueError,
     "RotaryEmbedding(head_dim=4)"),
    (lambda: TransformerBlock(8, 2, attn=torch.nn.Identity(), qk_norm=QKNorm()), ValueError,
     "qk_norm=QKNorm(eps=1e-06, unit_offset=False, over='head') is an option of the block's own MultiHeadAttention"),
    (lambda: to_torch(MultiHeadAttention(8, 8, num_heads=2, pattern=None, qkv=QKV(qk_norm=QKNorm()))), ValueError,
     "qk_norm="),
    (lambda: _gpt(rope_fraction=0.3), ValueError, "rope_fraction=0.3 of head_dim=8 is 2.4 features"),
    (lambda: _gpt(rope_fraction=0.125), ValueError, "rope_fraction=0.125 of head_dim=8 is 1 features"),
    (lambda: _gpt(rope_fraction=0.0), ValueError, "rope_fraction must be a number in (0, 1], got 0.0"),
    (lambda: _gpt(rope_fraction=2), ValueError, "rope_fraction must be a number in (0, 1], got 2"),
    (lambda: _gpt(rope_fraction=math.nan), ValueError, "rope_fraction"),
    (lambda: _gpt(rope_fraction="1/4"), TypeError, "rope_fraction"),
    (lambda: _gpt(qk_norm="yes"), ValueError, "qk_norm must be one of 'qwen3', 'olmo2', 'gemma'; got 'yes'"),
    (lambda: _gpt(qk_norm=1), TypeError, "qk_norm must be a bool or one of 'qwen3', 'olmo2', 'gemma', got int"),
    (lambda: GPT(10, d_model=8, num_heads=2, rope_fraction=0.5), ValueError,
     "rope_fraction=0.5 needs positions='rope', got positions='learned'"),
    (lambda: GPT(10, d_model=8, num_heads=2, positions="rope", layer_pattern="GQ", qk_norm=True), ValueError,
     "qk_norm: options of the multi-head layers, not of gated output (Qwen3-Next) layers"),
    (lambda: GPT(10, d_model=8, num_heads=2, positions="rope", layer_pattern="GM", latent_dim=4,
                 rope_fraction=0.5), ValueError, "rope_fraction: options of the multi-head layers, not of latent"),
    (lambda: GPT(10, d_model=8, num_heads=2, num_layers=1, layer_pattern="R", qk_norm=True), ValueError,
     "has no multi-head layer"),
], ids=["rotary_odd", "rotary_wide", "rotary_zero", "rotary_float", "table_wide", "table_T", "table_empty",
        "eps_zero", "eps_nan", "unit_offset_int", "qk_norm_bool", "qk_norm_keyword", "rope_head_dim", "block_attn",
        "to_torch",
        "fraction_not_int", "fraction_odd", "fraction_zero", "fraction_big", "fraction_nan", "fraction_str",
        "gpt_qk_norm_str", "gpt_qk_norm_int", "fraction_learned", "gpt_gated", "gpt_latent", "gpt_linear_only"])
def test_bad_options_are_refused_naming_the_argument(make, error, words):
    with pytest.raises(error, match=re.escape(words)):
        make()


# ------------------------------------------------------------------ docs
def _doc_blocks():
    text = (Path(__file__).resolve().parents[1] / "docs" / "modules.md").read_text()
    section = text.split("## Partial RoPE and QK-norm")[1].split("\n## ")[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_docs_examples_run():
    blocks = _doc_blocks()
    assert len(blocks) == 2
    for code in blocks:
        exec(compile(code, "docs/modules.md", "exec"), {})
