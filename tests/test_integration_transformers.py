"""attnlab.integrations.transformers.register: transformers models run on attnlab.attention.

References are transformers' own "eager" and "sdpa" implementations on the same weights:
the real all-MiniLM-L6-v2 (bidirectional, padded batch) and tiny randomly initialised causal
LMs (GPT-2; Llama with grouped-query heads; Mistral with a sliding window) saved as safetensors
in tmp_path. Skips without transformers (``pip install 'attnlab[hf]'``). Nothing is downloaded.
"""

from __future__ import annotations

import os

import pytest
import torch

from attnlab.integrations.transformers import attention_forward, register
from attnlab.models import _hub

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")

NAME = register()
TEXTS = ["Hi there", "A considerably longer sentence, with punctuation and more words!", "Ça va?"]


@pytest.fixture(scope="module")
def minilm_dir():
    try:
        return str(_hub.model_dir("minilm"))
    except FileNotFoundError as exc:
        pytest.skip(f"MiniLM is not installed ({exc})")


@pytest.fixture(scope="module")
def padded_batch(minilm_dir):
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].bool().all()
    return batch


def _bert(minilm_dir, implementation):
    return transformers.AutoModel.from_pretrained(minilm_dir, attn_implementation=implementation).eval()


def test_minilm_attnlab_equals_eager_on_a_padded_batch(minilm_dir, padded_batch):
    with torch.no_grad():
        ref = _bert(minilm_dir, "eager")(**padded_batch, output_attentions=True)
        ours = _bert(minilm_dir, NAME)(**padded_batch, output_attentions=True)
    real = padded_batch["attention_mask"].bool()
    assert (ours.last_hidden_state - ref.last_hidden_state)[real].abs().max().item() <= 1e-5
    assert len(ours.attentions) == len(ref.attentions) == 6
    for mine, theirs in zip(ours.attentions, ref.attentions):
        assert mine.shape == theirs.shape
        assert (mine - theirs).abs().max().item() <= 1e-5


def test_output_attentions_does_not_change_the_output(minilm_dir, padded_batch):
    model = _bert(minilm_dir, NAME)
    with torch.no_grad():
        plain = model(**padded_batch).last_hidden_state
        with_weights = model(**padded_batch, output_attentions=True)
    assert with_weights.attentions is not None
    assert torch.equal(plain, with_weights.last_hidden_state)


def test_without_the_mask_function_padding_would_leak(minilm_dir, padded_batch):
    """Why register() also registers a mask function: without it transformers passes no mask."""
    transformers.AttentionInterface.register("attnlab_no_mask", attention_forward)
    with torch.no_grad():
        ref = _bert(minilm_dir, "eager")(**padded_batch).last_hidden_state
        leaky = _bert(minilm_dir, "attnlab_no_mask")(**padded_batch).last_hidden_state
    real = padded_batch["attention_mask"].bool()
    short = real.sum(1).argmin()
    assert (leaky - ref)[short][real[short]].abs().max().item() > 1e-3


# ------------------------------------------------------------------ tiny causal LMs
def _gpt2():
    return transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama():
    return transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _mistral():
    return transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                      sliding_window=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="module", params=[_gpt2, _llama, _mistral], ids=["gpt2", "llama-gqa", "mistral-window"])
def causal_lm_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(request.param())
    path = tmp_path_factory.mktemp(request.param.__name__.strip("_"))
    model.save_pretrained(path, safe_serialization=True)
    assert (path / "model.safetensors").exists()
    return path


def _load(path, implementation):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation).eval()


def _padded(side: str):
    """Two prompts of lengths 9 and 4, padded on ``side`` with token 0."""
    torch.manual_seed(1)
    rows = [torch.randint(3, 97, (9,)), torch.randint(3, 97, (4,))]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(0, len(row)) if side == "right" else slice(9 - len(row), 9)
        ids[i, cols], mask[i, cols] = row, 1
    return ids, mask


@pytest.mark.parametrize("side", ["right", "left"])
def test_causal_lm_logits_equal_sdpa_with_padding(causal_lm_dir, side):
    ids, mask = _padded(side)
    with torch.no_grad():
        ref = _load(causal_lm_dir, "sdpa")(input_ids=ids, attention_mask=mask).logits
        ours = _load(causal_lm_dir, NAME)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()  # padded positions' logits are meaningless in both
    assert (ours - ref)[real].abs().max().item() <= 1e-5


def test_causal_lm_greedy_generation_equals_sdpa(causal_lm_dir):
    ids, mask = _padded("left")
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ref = _load(causal_lm_dir, "sdpa").generate(input_ids=ids, attention_mask=mask, **options)
        ours = _load(causal_lm_dir, NAME).generate(input_ids=ids, attention_mask=mask, **options)
    assert ref.shape == (2, 19)
    assert torch.equal(ours, ref)


def test_causal_lm_output_attentions_equal_eager(causal_lm_dir):
    ids, mask = _padded("right")
    with torch.no_grad():
        ref = _load(causal_lm_dir, "eager")(input_ids=ids, attention_mask=mask, output_attentions=True)
        ours = _load(causal_lm_dir, NAME)(input_ids=ids, attention_mask=mask, output_attentions=True)
    real_queries = mask.bool()[:, None, :, None]  # (B, 1, T, 1): rows of real queries
    assert len(ours.attentions) == len(ref.attentions) == 2  # one per layer (GPT-2 pops the keyword)
    for mine, theirs in zip(ours.attentions, ref.attentions):
        assert mine.shape == theirs.shape
        assert ((mine - theirs) * real_queries).abs().max().item() <= 1e-5


# ------------------------------------------------------------------- the function itself
def test_attention_forward_float_mask_gqa_and_dropout():
    layer = torch.nn.Module()
    layer.is_causal = False
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    additive = torch.zeros(2, 1, 5, 5)
    additive[1, ..., 3:] = torch.finfo(torch.float32).min
    out, weights = attention_forward(layer, q, k, v, additive, scaling=0.3, output_attentions=True)
    k_rep, v_rep = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    expected_w = torch.softmax(q @ k_rep.transpose(-1, -2) * 0.3 + additive, dim=-1)
    assert torch.allclose(weights, expected_w, atol=1e-6)
    assert torch.allclose(out, (expected_w @ v_rep).transpose(1, 2), atol=1e-5)
    eval_out, _ = attention_forward(layer, q, k, v, None, dropout=0.5)
    layer.train()
    train_out, _ = attention_forward(layer, q, k, v, None, dropout=0.5)
    assert not torch.allclose(eval_out, train_out)


def test_reserved_names_are_refused():
    with pytest.raises(ValueError, match="name must be a non-empty string other than eager, sdpa"):
        register("sdpa")


def _tiny(kind):
    """A tiny random model with a score mod or sinks, from its config class (nothing downloaded)."""
    common = dict(vocab_size=100, num_hidden_layers=2, num_attention_heads=4, head_dim=8)
    if kind == "gpt-oss":  # learnable sinks (s_aux), a sliding layer and a full one
        return transformers.GptOssForCausalLM, transformers.GptOssConfig(
            hidden_size=32, intermediate_size=32, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            **common)
    if kind in ("gemma2", "gemma3"):  # softcap with a sliding window
        config_class, model_class = ((transformers.Gemma2Config, transformers.Gemma2ForCausalLM) if kind == "gemma2"
                                     else (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM))
        return model_class, config_class(hidden_size=32, intermediate_size=32, num_key_value_heads=2,
                                         sliding_window=4, attn_logit_softcapping=5.0, **common)
    return transformers.T5ForConditionalGeneration, transformers.T5Config(  # relative position bias
        vocab_size=100, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_heads=4, dropout_rate=0.0,
        relative_attention_num_buckets=8, relative_attention_max_distance=16)


def _pair(kind):
    import copy
    model_class, config = _tiny(kind)
    torch.manual_seed(0)
    models = []
    for implementation in ("eager", NAME):
        c = copy.deepcopy(config)
        c._attn_implementation = implementation
        models.append(model_class(c))
    models[1].load_state_dict(models[0].state_dict())
    assert models[1].config._attn_implementation == NAME
    return models


@pytest.mark.parametrize("kind", ["gpt-oss", "gemma2", "gemma3", "t5"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_score_mod_models_equal_eager(kind, side):
    """softcap, s_aux and position_bias: outputs, greedy tokens and training gradients as "eager"."""
    eager, ours = _pair(kind)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 9, dtype=torch.long)
    real[0, :3] = 0 if side == "left" else 1
    real[0, 6:] = 0 if side == "right" else 1
    inputs = dict(input_ids=ids, attention_mask=real)
    keep = real.bool()
    if kind == "t5":  # encoder padded; the decoder attends the encoder across (cross-attention)
        inputs["decoder_input_ids"] = ids[:, :5]
        keep = torch.ones(2, 5, dtype=torch.bool)
    with torch.no_grad():
        want, got = (m.eval()(**inputs).logits for m in (eager, ours))
    assert (want - got)[keep].abs().max().item() <= 1e-5
    generate = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    if kind == "t5":
        generate = dict(max_new_tokens=4, do_sample=False, decoder_start_token_id=0)
    prompt = {k: v for k, v in inputs.items() if not k.startswith("decoder")}
    assert torch.equal(eager.generate(**prompt, **generate), ours.generate(**prompt, **generate))
    for model in (eager, ours):
        model.train().zero_grad()
        model(**inputs).logits[keep].square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), ours.parameters()):
        if a.grad is not None:
            assert (a.grad - b.grad).abs().max().item() <= 1e-5, name
    if kind == "gpt-oss":
        assert eager.model.layers[0].self_attn.sinks.grad.abs().max() > 0


@pytest.mark.parametrize("call, message", [
    (lambda q: register(123), "name must be a str, got int"),
    (lambda q: attention_forward("layer", q, q, q, None), "module must be the calling torch.nn.Module, got str"),
    (lambda q: attention_forward(torch.nn.Module(), q.tolist(), q, q, None), "query must be a torch.Tensor, got list"),
    (lambda q: attention_forward(torch.nn.Module(), q, q, q, [[True]]), "attention_mask must be a torch.Tensor"),
])
def test_arguments_of_the_wrong_kind_raise_type_error(call, message):
    with pytest.raises(TypeError, match=message):
        call(torch.randn(1, 1, 2, 4))


def _spy():
    """Register attention_forward under another name, recording whether each call returned weights."""
    returned = []

    def spy(*args, **kwargs):
        out, weights = attention_forward(*args, **kwargs)
        returned.append(weights is not None)
        return out, weights

    transformers.AttentionInterface.register("attnlab_spy", spy)
    transformers.masking_utils.AttentionMaskInterface.register(
        "attnlab_spy", transformers.masking_utils.sdpa_mask)
    return returned


def test_causal_lm_computes_weights_only_when_they_are_recorded(causal_lm_dir):
    """Weights are computed exactly when the model will return them, whether it hands the layers
    the keyword (Llama) or pops it and records with hooks (GPT-2)."""
    returned = _spy()
    ids, mask = _padded("right")
    model = _load(causal_lm_dir, "attnlab_spy")
    with torch.no_grad():
        for options, wanted in [({"output_attentions": False}, False), ({"output_hidden_states": True}, False),
                                ({"output_attentions": True}, True), ({}, False)]:
            returned.clear()
            result = model(input_ids=ids, attention_mask=mask, **options)
            assert returned == [wanted, wanted], options
            assert (result.attentions is not None) == wanted, options


# ------------------------------------------------------------------- sliding windows
WINDOW = 4


def _window_allowed(tq: int, tk: int, window: int) -> torch.Tensor:
    """transformers' sliding window (``kv_idx > q_idx - window``, causal) for the last ``tq`` of
    ``tk`` positions: ``(tq, tk)`` bool, True = attend."""
    q_pos = torch.arange(tk - tq, tk)[:, None]
    kv_pos = torch.arange(tk)[None, :]
    return (kv_pos <= q_pos) & (kv_pos > q_pos - window)


def _fp64_attention(q, k, v, allowed, scale):
    """Softmax attention in fp64 over ``allowed`` ``(B|1, 1, Tq, Tk)``; GQA by repeating heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, Tq, H, D)


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "prepared-mask"])
@pytest.mark.parametrize("tk", [3, WINDOW, WINDOW + 5], ids=["tk<W", "tk=W", "tk>W"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_attention_forward_sliding_window_equals_fp64(decode, tk, with_mask):
    """One decoding query or a prefill (Tq = Tk), with no mask (the window comes from the
    ``sliding_window`` keyword) or transformers' prepared bool mask (window and padding in it)."""
    layer = torch.nn.Module()
    layer.is_causal = True
    tq = 1 if decode else tk
    g = torch.Generator().manual_seed(tk)
    q = torch.randn(2, 4, tq, 8, generator=g)
    k, v = torch.randn(2, 2, tk, 8, generator=g), torch.randn(2, 2, tk, 8, generator=g)
    allowed = _window_allowed(tq, tk, WINDOW)[None, None].expand(2, 1, tq, tk).clone()  # (B, 1, Tq, Tk)
    if with_mask:
        allowed[1, ..., 0] = False  # row 1 is left-padded by one key
    out, _ = attention_forward(layer, q, k, v, allowed if with_mask else None, scaling=0.3,
                               sliding_window=WINDOW)
    expected = _fp64_attention(q, k, v, allowed, 0.3).nan_to_num(0.0)  # a row with no key gives zeros
    assert (out.double() - expected).abs().max().item() <= 1e-5


def test_attention_forward_refuses_a_window_of_the_wrong_kind_or_size():
    layer = torch.nn.Module()
    q = torch.randn(1, 1, 1, 4)
    with pytest.raises(TypeError, match="sliding_window must be an int, got str"):
        attention_forward(layer, q, q, q, None, sliding_window="4")
    with pytest.raises(ValueError, match="sliding_window must be a positive int, got 0"):
        attention_forward(layer, q, q, q, None, sliding_window=0)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = _mistral()
    config.sliding_window = WINDOW
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = tmp_path_factory.mktemp("mistral-window")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padded"])
def test_sliding_window_model_decodes_past_the_window_like_eager(mistral_dir, padded):
    """Prefill of 2 tokens, then 9 decoding steps: the keys grow from below the window to
    past it; every step's logits equal transformers' eager implementation."""
    torch.manual_seed(2)
    ids = torch.randint(3, 97, (2, 3))
    mask = torch.ones_like(ids)
    if padded:
        ids[1, 0], mask[1, 0] = 0, 0
    options = dict(max_new_tokens=9, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                   return_dict_in_generate=True, attention_mask=mask)
    with torch.no_grad():
        ref = _load(mistral_dir, "eager").generate(input_ids=ids, **options)
        ours = _load(mistral_dir, NAME).generate(input_ids=ids, **options)
    assert torch.equal(ours.sequences, ref.sequences)
    for step, (mine, theirs) in enumerate(zip(ours.logits, ref.logits)):
        assert (mine - theirs).abs().max().item() <= 1e-5, step
