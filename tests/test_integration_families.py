"""Families a first sweep found different from eager, each on a tiny random model (nothing downloaded).

Each test runs ``attn_implementation="attnlab"`` against ``"eager"`` (``_pair``) within 1e-4 in fp32:
un-, right- and left-padded batches at the real tokens, weights, gradients, greedy generation where
eager can generate. Where attnlab and eager still differ, the difference is transformers' own (its
sdpa path differs the same way) and the test pins what does agree:

- AIMv2's text layers declare ``is_causal=False`` but build their mask with ``create_causal_mask``:
  eager is causal whenever a mask is passed, sdpa (and attnlab, with sdpa's masks) drops causality
  when the mask is all ones and sdpa's mask builder leaves the plain causal mask out.
- Left padding gives query rows with nothing to attend: eager spreads them uniformly over every key,
  sdpa and attnlab return zero rows, so padded positions differ (MetaCLIP 2, AIMv2, DiffusionGemma's
  decoder when it is not given ``decoder_attention_mask``).
- Granite-SWA's eager returns its weights without the sink's share (rows sum to 1).
"""

from __future__ import annotations

import pytest
import torch
from test_integration_keywords import IDS, NAME, _pair, _padding

from attnlab.integrations.transformers import recording

transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")

SIDES = ["none", "right", "left"]


def _largest(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor | None = None) -> float:
    """Largest difference, at the real tokens ``(B, T)`` when given."""
    diff = (a - b).abs()
    return (diff[real] if real is not None else diff).max().item()


def _weights_at_real_queries(mine, theirs, real: torch.Tensor) -> float:
    """Largest weight difference over layers, at the real queries (padded query rows are free)."""
    return max(((a - b) * real[:, None, :, None]).abs().max().item() for a, b in zip(mine, theirs))


def _gradients_agree(eager, ours, rtol: float = 1e-4) -> None:
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        if a.grad is not None:
            assert (a.grad - b.grad).abs().max() <= rtol * max(1.0, a.grad.abs().max().item()), name


# ------------------------------------------------------------------ DiffusionGemma
def _diffusion_gemma():
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=64, num_experts=2,
                top_k_experts=1, moe_intermediate_size=16, layer_types=["sliding_attention", "full_attention"])
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    config = transformers.DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=4)
    return _pair(transformers.DiffusionGemmaForBlockDiffusion, config)


def test_diffusion_gemma_encoder_and_bidirectional_decoder_equal_eager():
    """A causal, sliding-window encoder fills the cache; the decoder's canvas attends to it both ways.

    The padded cache entries are kept out by ``decoder_attention_mask``, as ``generate`` passes it.
    """
    eager, ours = _diffusion_gemma()
    canvas = IDS[:, :4]
    for side in SIDES:
        mask = _padding(side)
        decoder_mask = torch.nn.functional.pad(mask.bool(), (0, canvas.shape[1]), value=True)
        outputs = [m(input_ids=IDS, attention_mask=mask, decoder_input_ids=canvas, decoder_attention_mask=decoder_mask,
                     output_attentions=side == "left") for m in (eager, ours)]
        assert _largest(outputs[0].logits, outputs[1].logits) <= 1e-4, side
    assert len(outputs[1].attentions) == 2  # the decoder's, asked for by the left-padded pass
    assert max(_largest(a, b) for a, b in zip(outputs[0].attentions, outputs[1].attentions)) <= 1e-4
    for out in outputs:
        out.logits.square().mean().backward()
    _gradients_agree(eager, ours)


# ------------------------------------------------------------------ Mistral Large 4 (sparse top-k)
def test_mistral_large4_text_model_takes_its_top_k_indices_like_eager():
    """Eager folds the indexer's top-k keys (4 of 9) into the mask; attnlab gets ``indices=``; the
    middle layer reuses the first one's top-k ("shared")."""
    config = transformers.MistralLarge4TextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=4,
        index_head_dim=16, index_n_heads=2, max_position_embeddings=64, indexer_types=["full", "shared", "full"])
    eager, ours = _pair(transformers.MistralLarge4TextModel, config)
    for side in SIDES:
        mask = _padding(side)
        real = mask.bool()
        outputs = [m(IDS, attention_mask=mask, output_attentions=True) for m in (eager, ours)]
        assert _largest(outputs[0].last_hidden_state, outputs[1].last_hidden_state, real) <= 1e-4, side
        assert _weights_at_real_queries(outputs[1].attentions, outputs[0].attentions, real) <= 1e-4, side
    for out in outputs:
        out.last_hidden_state[real].square().mean().backward()
    _gradients_agree(eager, ours)


# ------------------------------------------------------------------ dual encoders, left padding
def _dual_encoder(family):
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8)
    config_class, model_class = {"metaclip_2": (transformers.MetaClip2Config, transformers.MetaClip2Model),
                                 "aimv2": (transformers.Aimv2Config, transformers.Aimv2Model)}[family]
    return _pair(model_class, config_class(text_config=text, vision_config=vision))


@pytest.mark.parametrize("family", ["metaclip_2", "aimv2"])
def test_dual_encoders_left_padded_equal_eager_at_real_tokens(family):
    """The text tower pools at its EOS token (id 2, a real token here). The padded rows differ as
    transformers' sdpa differs (module docstring); the real tokens and the logits agree."""
    eager, ours = _dual_encoder(family)
    ids = IDS.clone()
    ids[:, 6] = 2  # EOS
    mask = _padding("left")
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask, pixel_values=pixels) for m in (eager, ours))
    real = mask.bool()
    assert _largest(want.text_model_output.last_hidden_state, got.text_model_output.last_hidden_state, real) <= 1e-4
    assert _largest(want.logits_per_text, got.logits_per_text) <= 1e-4


# ------------------------------------------------------------------ PaliGemma
def test_paligemma_prefix_attends_both_ways_like_eager():
    """Image and prompt tokens (token type 0) attend to each other both ways, the suffix causally."""
    text = dict(model_type="gemma", vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=4, image_size=16, patch_size=8)
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=99,
                                          projection_dim=32)
    eager, ours = _pair(transformers.PaliGemmaForConditionalGeneration, config)
    ids = torch.cat([torch.full((2, 4), 99), IDS], dim=1)  # 4 image tokens, then the text
    types = torch.zeros_like(ids)
    types[:, -3:] = 1  # the suffix
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    for side in ("none", "right"):
        mask = torch.cat([torch.ones(2, 4, dtype=torch.long), _padding(side)], dim=1)
        with torch.no_grad():
            want, got = (m(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=types,
                           output_attentions=True) for m in (eager, ours))
        assert _largest(want.logits, got.logits, mask.bool()) <= 1e-4, side
        assert _weights_at_real_queries(got.attentions, want.attentions, mask.bool()) <= 1e-4, side
    prompt = dict(input_ids=ids, pixel_values=pixels, token_type_ids=torch.zeros_like(ids))
    generated = [m.generate(**prompt, max_new_tokens=4, do_sample=False) for m in (eager, ours)]
    assert torch.equal(*generated)


# ------------------------------------------------------------------ BridgeTower
def test_bridgetower_bidirectional_cross_layers_equal_eager_with_gradients():
    """Its cross-modal layers declare ``is_causal=True`` but eager always hands them a padding mask,
    so they attend both ways: without padding attnlab must not turn that into a causal pattern."""
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16)
    vision = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=16)
    config = transformers.BridgeTowerConfig(text_config=text, vision_config=vision, hidden_size=32,
                                            num_attention_heads=4, num_hidden_layers=2, intermediate_size=32,
                                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    eager, ours = _pair(transformers.BridgeTowerModel, config)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    for side in SIDES:
        mask = _padding(side)
        outputs = [m(input_ids=IDS, attention_mask=mask, pixel_values=pixels) for m in (eager, ours)]
        assert _largest(outputs[0].text_features, outputs[1].text_features, mask.bool()) <= 1e-4, side
        assert _largest(outputs[0].image_features, outputs[1].image_features) <= 1e-4, side
    for out in outputs:
        (out.text_features[mask.bool()].square().mean() + out.image_features.square().mean()).backward()
    _gradients_agree(eager, ours)


# ------------------------------------------------------------------ DeepSeek-V4
def test_deepseek_v4_compressor_bias_meets_a_float_mask_like_eager():
    """DeepSeek-V4 appends its compressor's float bias (-inf where a query may not read a compressed
    slot) to the mask it gets: attnlab gives it eager's float masks, so the bias keeps its meaning."""
    config = transformers.DeepseekV4Config(
        vocab_size=100, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        head_dim=8, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4, max_position_embeddings=64,
        sliding_window=4, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=8,
        index_topk=2, layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe"])
    eager, ours = _pair(transformers.DeepseekV4ForCausalLM, config)
    for side in SIDES:
        mask = _padding(side)
        with torch.no_grad():
            want, got = (m(IDS, attention_mask=mask, output_attentions=True) for m in (eager, ours))
        assert got.attentions[1].shape[-1] > IDS.shape[1]  # the compressed slots were attended
        assert _largest(want.logits, got.logits, mask.bool()) <= 1e-4, side
        assert _weights_at_real_queries(got.attentions, want.attentions, mask.bool()) <= 1e-4, side
    generated = [m.generate(IDS, attention_mask=_padding("left"), max_new_tokens=4, do_sample=False)
                 for m in (eager, ours)]
    assert torch.equal(*generated)
    for model in (eager, ours):
        model(IDS).logits.square().mean().backward()
    _gradients_agree(eager, ours)


# ------------------------------------------------------------------ Granite-SWA (sinks)
def test_granite_swa_outputs_equal_eager_and_weights_differ_by_the_sinks_share():
    """Eager returns the softmax over the keys alone and applies the sink afterwards; attnlab returns
    the weights with the sink's share taken out (as gpt-oss's eager does): the same up to row sums."""
    config = transformers.GraniteSWAConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
        layer_types=["full_attention", "sliding_attention"])
    eager, ours = _pair(transformers.GraniteSWAForCausalLM, config)
    mask = _padding("left")
    real = mask.bool()
    with torch.no_grad():
        want, got = (m(IDS, attention_mask=mask, output_attentions=True) for m in (eager, ours))
    assert _largest(want.logits, got.logits, real) <= 1e-4
    rescaled = [w / w.sum(-1, keepdim=True).clamp_min(1e-30) for w in got.attentions]
    assert _weights_at_real_queries(rescaled, want.attentions, real) <= 1e-5
    assert _weights_at_real_queries(got.attentions, want.attentions, real) > 1e-2  # the sink does take a share


# ------------------------------------------------------------------ Falcon (output_attentions kept by its layer)
def test_falcon_returns_eager_attentions_when_asked_and_none_otherwise():
    """Falcon's attention layer takes ``output_attentions`` itself and calls the attention function
    without it; its model still returns each layer's weights when asked."""
    config = transformers.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       new_decoder_architecture=True, num_kv_heads=2)
    eager, ours = _pair(transformers.FalconForCausalLM, config)
    mask = _padding("left")
    real = mask.bool()
    with torch.no_grad():
        want, got = (m(IDS, attention_mask=mask, output_attentions=True) for m in (eager, ours))
        plain = ours(IDS, attention_mask=mask)
    assert _largest(want.logits, got.logits, real) <= 1e-4
    assert len(got.attentions) == len(want.attentions) == 2
    assert _weights_at_real_queries(got.attentions, want.attentions, real) <= 1e-5
    assert plain.attentions is None and _largest(plain.logits, got.logits, real) <= 1e-6


# ------------------------------------------------------------------ keywords let through to the layers
def _llava_onevision():
    text = dict(model_type="qwen2", vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.LlavaOnevisionConfig(text_config=text, vision_config=vision, image_token_id=99,
                                               video_token_id=98)
    return _pair(transformers.LlavaOnevisionForConditionalGeneration, config), dict(input_ids=IDS, logits_to_keep=1)


def _whisper_decoder():
    config = transformers.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                        decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=16,
                                        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0)
    return _pair(transformers.WhisperForCausalLM, config), dict(input_ids=IDS[:, :5], decoder_input_ids=IDS[:, :5])


@pytest.mark.parametrize("make", [_llava_onevision, _whisper_decoder], ids=["logits_to_keep", "decoder_input_ids"])
def test_keywords_that_reach_the_layers_but_are_no_attention_option_are_ignored_like_eager(make):
    (eager, ours), inputs = make()
    with torch.no_grad():
        want, got = (m(**inputs).logits for m in (eager, ours))
    assert got.shape == want.shape and _largest(want, got) <= 1e-4


# ------------------------------------------------------------------ MiniMax-M3 (top-k key blocks)
def _minimax_m3(top_k_blocks: int):
    config = transformers.MiniMaxM3VLTextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_local_experts=2,
        num_experts_per_tok=1, index_n_heads=2, index_head_dim=8, index_block_size=2,
        index_topk_blocks=top_k_blocks, index_local_blocks=1, layer_types=["minimax_m3_sparse", "full_attention"])
    return _pair(transformers.MiniMaxM3VLForCausalLM, config)


@pytest.mark.parametrize("side", SIDES)
def test_minimax_m3_block_indices_select_keys_like_eager_with_gradients(side):
    """Each query attends to the keys of its top-k blocks (2 keys each) per key head, as eager's
    mask built from the same ``block_indices``; 3 blocks of 2 keys exceed a 5-token prefix."""
    eager, ours = _minimax_m3(3)
    mask = _padding(side)
    real = mask.bool()
    want, got = (m(IDS, attention_mask=mask, output_attentions=True) for m in (eager, ours))
    assert _largest(want.logits, got.logits, real) <= 1e-4
    assert _weights_at_real_queries(got.attentions, want.attentions, real) <= 1e-5
    projection = torch.randn(want.logits.shape, generator=torch.Generator().manual_seed(0)) * real[..., None]
    for out in (want, got):
        (out.logits * projection).sum().backward()
    _gradients_agree(eager, ours)
    with torch.no_grad():  # the selection matters here: all blocks kept gives other logits
        everything = _minimax_m3(16)[1](IDS, attention_mask=mask).logits
    assert _largest(everything, got.logits, real) > 1e-3


def test_minimax_m3_greedy_generation_equals_eager():
    eager, ours = _minimax_m3(2)
    with torch.no_grad():
        want, got = (m.generate(IDS[:1, :5], max_new_tokens=6, do_sample=False) for m in (eager, ours))
    assert torch.equal(want, got)


def test_granite_swa_weights_plus_the_sinks_share_sum_to_one():
    """The sink's share of each row, ``sigmoid(sink - logsumexp(scores))`` computed here in fp64 from
    the queries and keys each layer received and the keys eager let it see, is what the returned
    weights leave out."""
    config = transformers.GraniteSWAConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
        layer_types=["full_attention", "sliding_attention"])
    eager, ours = _pair(transformers.GraniteSWAForCausalLM, config)
    for layer in ours.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)  # zeros by default: a share, but a plain one
    eager.load_state_dict(ours.state_dict())
    seen = []
    with torch.no_grad(), recording(lambda module, q, k, v, **options: seen.append((q, k, options))):
        want, got = (m(IDS, output_attentions=True) for m in (eager, ours))
    for (q, k, options), theirs, mine in zip(seen, want.attentions, got.attentions):
        k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, Tk, D)
        scores = (q.double() @ k.transpose(-1, -2) * options["scale"]).masked_fill(theirs == 0, float("-inf"))
        share = torch.sigmoid(options["sinks"].double().view(1, -1, 1) - scores.logsumexp(-1))  # (B, H, Tq)
        assert (mine.double().sum(-1) + share - 1).abs().max().item() <= 1e-5
        assert share.min().item() > 1e-3  # the sink does take a share


# ------------------------------------------------------------------ nothing of attnlab's in a checkpoint
def test_a_saved_config_holds_nothing_of_attnlabs_and_reloads_equal_to_eager(tmp_path):
    """Gemma 2 gets eager's masks on attnlab; that choice was an attribute on its config, which
    save_pretrained wrote into config.json."""
    import json

    config = transformers.Gemma2Config(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                       attn_logit_softcapping=5.0, max_position_embeddings=64)
    eager, ours = _pair(transformers.Gemma2ForCausalLM, config)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not [key for key in saved if "attnlab" in key.lower()]
    reloaded = transformers.Gemma2ForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME).eval()
    mask = _padding("left")
    with torch.no_grad():
        want, got = (m(IDS, attention_mask=mask).logits for m in (eager, reloaded))
    assert _largest(want, got, mask.bool()) <= 1e-4


# ------------------------------------------------------------------ SAM3-Lite text (RepMixer blocks first and last)
@pytest.mark.parametrize("layers, calls", [(2, 0), (4, 2)])
def test_sam3_lite_text_reaches_attnlab_in_its_middle_layers_and_equals_eager(layers, calls):
    """Its first and last layers are convolutional RepMixer blocks: a 2-layer model (the zoo's tiny
    size) has no attention to run, while every deeper one (12 layers by default) calls attnlab in
    the layers between. So the family is not refused while it is built."""
    config = transformers.Sam3LiteTextTextConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
                                                 intermediate_size=32, projection_dim=16, vocab_size=100)
    eager, ours = _pair(transformers.Sam3LiteTextTextModel, config)
    seen = []
    with torch.no_grad(), recording(lambda module, q, k, v, **options: seen.append(type(module).__name__)):
        want, got = (m(input_ids=IDS).last_hidden_state for m in (eager, ours))
    assert len(seen) == calls and _largest(want, got) <= 1e-4
