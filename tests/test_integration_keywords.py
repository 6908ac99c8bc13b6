"""The transformers integration honours or refuses every keyword and every model, never drops one.

Each honoured keyword changes the result as transformers' eager code does (compared with plain
fp64 math written here); each ignored keyword changes nothing; any other keyword is refused naming
the module's class and the keyword. Families fixed in the integration run against
``attn_implementation="eager"`` on tiny random models built from their config classes (nothing
downloaded): Splinter (bidirectional layers without ``is_causal``), NLLB-MoE (a decoder whose
``is_causal`` is False), BigBird-Pegasus (adds the mask to its scores), Voxtral's encoder (passes
``output_attentions=False`` itself); BLOOM and GIT are refused while they are built.
"""

from __future__ import annotations

import copy

import pytest
import torch

from attnlab.integrations.transformers import (
    HONOURED_KEYWORDS, IGNORED_KEYWORDS, REFUSAL, attention_forward, register,
)

transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")
NAME = register()


class Layer(torch.nn.Module):
    """An attention layer as transformers' modules look to attention_forward."""

    is_causal = True


def _qkv(tq=5, tk=5):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, tq, 8, generator=g), torch.randn(2, 2, tk, 8, generator=g),
            torch.randn(2, 2, tk, 8, generator=g))


def _eager(q, k, v, *, allowed=None, softcap=None, bias=None, sinks=None, scale=0.3):
    """transformers' eager attention in fp64: softcap, bias, mask, softmax (with a sink column dropped)."""
    k, v = (t.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.double()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = (sinks.double().view(1, -1, 1, 1) if sinks.ndim == 1 else sinks.double()).expand(*scores.shape[:-1], 1)
        weights = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return (weights @ v).transpose(1, 2), weights  # (B, Tq, H, D), (B, H, Tq, Tk)


def _causal(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)


g = torch.Generator().manual_seed(3)
SINKS = torch.randn(4, generator=g)
BIAS = torch.randn(1, 4, 5, 5, generator=g)
window = torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.ones(5, 5, dtype=torch.bool).tril(-2)
QUERY_SINKS = torch.randn(2, 4, 5, 1, generator=g)  # (B, H, Tq, 1), as Inkling2's sink projection
TOPK = torch.randint(0, 5, (2, 5, 2), generator=g, dtype=torch.int32)  # (B, Tq, k), as DeepSeek-V3.2's indexer
TOPK[..., 0] = torch.arange(5)  # each query lists itself, so no row is empty (eager would give NaN)
SELECTED = torch.zeros(2, 1, 5, 5, dtype=torch.bool).scatter(-1, TOPK.long().unsqueeze(1), True)
# keyword -> (value, what eager computes with it, what it computes without it), Layer.is_causal = True
HONOURED_CASES = {
    "is_causal": (False, dict(), dict(allowed=_causal(5, 5))),
    "sliding_window": (2, dict(allowed=window), dict(allowed=_causal(5, 5))),
    "softcap": (0.5, dict(softcap=0.5, allowed=_causal(5, 5)), dict(allowed=_causal(5, 5))),
    "s_aux": (SINKS, dict(sinks=SINKS, allowed=_causal(5, 5)), dict(allowed=_causal(5, 5))),
    "position_bias": (BIAS, dict(bias=BIAS, allowed=_causal(5, 5)), dict(allowed=_causal(5, 5))),
    "sinks": (QUERY_SINKS, dict(sinks=QUERY_SINKS, allowed=_causal(5, 5)), dict(allowed=_causal(5, 5))),
    "indices": (TOPK, dict(allowed=SELECTED & _causal(5, 5)), dict(allowed=_causal(5, 5))),
}


def test_every_honoured_keyword_has_a_case():
    packed = {"cu_seq_lens_q", "cu_seq_lens_k", "position_ids"}  # test_integration_packed.py
    packed |= {"output_attentions", "block_indices"}  # tested on their own below, on MiniMax-M3
    assert set(HONOURED_KEYWORDS) == set(HONOURED_CASES) | packed
    assert not set(HONOURED_KEYWORDS) & set(IGNORED_KEYWORDS)


@pytest.mark.parametrize("keyword", list(HONOURED_CASES))
def test_each_honoured_keyword_changes_the_result_as_eager_does(keyword):
    q, k, v = _qkv()
    value, with_it, without_it = HONOURED_CASES[keyword]
    out, weights = attention_forward(Layer(), q, k, v, None, scaling=0.3, output_attentions=True,
                                     **{keyword: value})
    want, want_weights = _eager(q, k, v, **with_it)
    assert (out.double() - want).abs().max().item() <= 1e-5
    assert (weights.double() - want_weights).abs().max().item() <= 1e-5
    assert (_eager(q, k, v, **without_it)[0] - want).abs().max().item() > 1e-3  # it did change something


@pytest.mark.parametrize("keyword", IGNORED_KEYWORDS)
def test_each_ignored_keyword_changes_nothing(keyword):
    q, k, v = _qkv()
    plain, _ = attention_forward(Layer(), q, k, v, None)
    out, _ = attention_forward(Layer(), q, k, v, None, **{keyword: torch.arange(5)})
    assert torch.equal(out, plain)


def test_output_attentions_returns_the_weights_only_when_asked():
    q, k, v = _qkv()
    assert attention_forward(Layer(), q, k, v, None, output_attentions=False)[1] is None
    weights = attention_forward(Layer(), q, k, v, None, scaling=0.3, output_attentions=True)[1]
    assert (weights.double() - _eager(q, k, v, allowed=_causal(5, 5))[1]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("keyword", ["band_mask", "anything_else"])
def test_an_unknown_keyword_is_refused_naming_module_and_keyword(keyword):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"^Layer {REFUSAL}: it passes the keyword {keyword}, which attnlab"):
        attention_forward(Layer(), q, k, v, None, **{keyword: torch.zeros(2, 4, 5, 1)})
    out, _ = attention_forward(Layer(), q, k, v, None, **{keyword: None})  # a None changes nothing
    assert torch.equal(out, attention_forward(Layer(), q, k, v, None)[0])


# ------------------------------------------------------------------ models, against eager
def _pair(model_class, config):
    torch.manual_seed(0)
    models = []
    for implementation in ("eager", NAME):
        c = copy.deepcopy(config)
        c._attn_implementation = implementation
        models.append(model_class(c).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models


IDS = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(1))


def _padding(side):
    mask = torch.ones(2, 9, dtype=torch.long)
    if side == "right":
        mask[0, 6:] = 0
    elif side == "left":
        mask[0, :3] = 0
    return mask


def _seq2seq(config_class, model_class, **extra):
    return model_class, config_class(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.0,
                                     attention_dropout=0.0, **extra)


SEQ2SEQ = {  # eager masks: NLLB-MoE's and Pegasus-X's decoders have is_causal False; BigBird-Pegasus adds its mask
    "nllb-moe": lambda: _seq2seq(transformers.NllbMoeConfig, transformers.NllbMoeForConditionalGeneration,
                                 num_experts=4, expert_capacity=8, decoder_sparse_step=2, encoder_sparse_step=2),
    "bigbird-pegasus": lambda: _seq2seq(transformers.BigBirdPegasusConfig,
                                        transformers.BigBirdPegasusForConditionalGeneration,
                                        attention_type="original_full"),
    "pegasus-x": lambda: _seq2seq(transformers.PegasusXConfig, transformers.PegasusXForConditionalGeneration,
                                  block_size=4, num_global_tokens=2),  # its encoder's attention is its own
}


@pytest.mark.parametrize("side", ["none", "right", "left"])
@pytest.mark.parametrize("family", list(SEQ2SEQ))
def test_seq2seq_without_sdpa_equals_eager(family, side):
    """Teacher-forced logits (the decoder must not see later tokens), then greedy tokens."""
    eager, ours = _pair(*SEQ2SEQ[family]())
    inputs = dict(input_ids=IDS, attention_mask=_padding(side), decoder_input_ids=IDS[:, :5])
    with torch.no_grad():
        want, got = (m(**inputs).logits for m in (eager, ours))
    assert (want - got).abs().max().item() <= 1e-4
    options = dict(max_new_tokens=4, do_sample=False, decoder_start_token_id=2, pad_token_id=0)
    prompt = dict(input_ids=IDS, attention_mask=_padding(side))
    assert torch.equal(eager.generate(**prompt, **options), ours.generate(**prompt, **options))


@pytest.mark.parametrize("side", ["none", "right", "left"])
def test_splinter_bidirectional_layers_equal_eager_with_gradients(side):
    """Splinter's layers declare no is_causal: without padding they get no mask and attend both ways."""
    config = transformers.SplinterConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=32, max_position_embeddings=32, question_token_id=5,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    eager, ours = _pair(transformers.SplinterModel, config)
    mask = _padding(side)
    real = mask.bool()
    outputs = [m(input_ids=IDS, attention_mask=mask, output_attentions=True) for m in (eager, ours)]
    assert (outputs[0].last_hidden_state - outputs[1].last_hidden_state)[real].abs().max().item() <= 1e-4
    for mine, theirs in zip(outputs[1].attentions, outputs[0].attentions):
        assert ((mine - theirs) * real[:, None, :, None]).abs().max().item() <= 1e-4
    for out in outputs:
        out.last_hidden_state[real].square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        if a.grad is not None:
            assert (a.grad - b.grad).abs().max().item() <= 1e-4, name


def test_voxtral_encoder_returns_attentions_like_eager():
    """Voxtral's encoder layers pass output_attentions=False themselves; its collector asks for them."""
    config = transformers.VoxtralEncoderConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, num_mel_bins=8, max_source_positions=8)
    eager, ours = _pair(transformers.VoxtralEncoder, config)
    features = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = (m(features, output_attentions=True) for m in (eager, ours))
    assert (want.last_hidden_state - got.last_hidden_state).abs().max().item() <= 1e-4
    assert got.attentions is not None and len(got.attentions) == len(want.attentions) == 2
    for mine, theirs in zip(got.attentions, want.attentions):
        assert (mine - theirs).abs().max().item() <= 1e-4


# ------------------------------------------------------------------ models refused while built
def _deepseek_v32():
    return transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config(
        vocab_size=100, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=2,
        first_k_dense_replace=1, max_position_embeddings=64)


def _inkling2():
    return transformers.Inkling2ForCausalLM, transformers.Inkling2TextConfig(
        vocab_size=100, unpadded_vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=4, d_rel=4, rel_extent=8, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, n_layers_per_attn_res_block=1, eos_token_id=99,
        pad_token_id=0, layer_types=["hybrid_sliding", "hybrid"])


# Families whose layers pass keywords that were once dropped: DeepSeek-V3.2's top-k ``indices``
# (eager folds them into the mask; 4 of 9 keys per query) and Inkling2's per-query ``sinks``.
KEYWORD_FAMILIES = {"deepseek_v32": _deepseek_v32, "inkling2": _inkling2}


@pytest.mark.parametrize("side", ["none", "right", "left"])
@pytest.mark.parametrize("family", list(KEYWORD_FAMILIES))
def test_a_family_passing_indices_or_sinks_equals_eager(family, side):
    eager, ours = _pair(*KEYWORD_FAMILIES[family]())
    mask = _padding(side)
    keep = mask.bool()
    assert (eager(IDS, attention_mask=mask).logits - ours(IDS, attention_mask=mask).logits)[keep].abs().max() <= 1e-4
    generated = [m.generate(IDS[:1], max_new_tokens=5, do_sample=False) for m in (eager, ours)]
    assert torch.equal(*generated)


@pytest.mark.parametrize("family", list(KEYWORD_FAMILIES))
def test_a_family_passing_indices_or_sinks_has_eager_gradients(family):
    eager, ours = _pair(*KEYWORD_FAMILIES[family]())
    for model in (eager, ours):
        model.train()
        model(IDS).logits.square().sum().backward()
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        if a.grad is not None:
            assert (a.grad - b.grad).abs().max() <= 1e-4, name


def _bloom():
    return transformers.BloomForCausalLM, transformers.BloomConfig(vocab_size=100, hidden_size=32, n_layer=1, n_head=4)


def _git():
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32, image_size=32,
                  patch_size=16)
    return transformers.GitForCausalLM, transformers.GitConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
        bos_token_id=1, eos_token_id=2, vision_config=vision)


@pytest.mark.parametrize("make, reason", [
    (_bloom, "computes attention in its own layers, not through transformers' attention interface"),
    (_git, "picks attention classes from a table keyed by the implementation's name"),
], ids=["bloom", "git"])
def test_a_model_bypassing_the_attention_interface_is_refused_while_built(make, reason, tmp_path):
    model_class, config = make()
    with pytest.raises(ValueError, match=f"^{model_class.__name__} {REFUSAL}: it {reason}"):
        model_class._from_config(config, attn_implementation=NAME)
    model_class, config = make()  # _from_config wrote its name into the config
    model_class(config).save_pretrained(tmp_path)  # eager builds, and from_pretrained refuses alike
    with pytest.raises(ValueError, match=f"^{model_class.__name__} {REFUSAL}: it {reason}"):
        model_class.from_pretrained(tmp_path, attn_implementation=NAME)
