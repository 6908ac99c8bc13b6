"""attnlab.models.GPT: forward, KV-cache generation, save/load, and parity with transformers' GPT-2."""

from __future__ import annotations

import json
import os

import pytest
import torch

from attnlab.models import GPT
from attnlab.nn import TransformerBlock


def tiny(**options) -> GPT:
    torch.manual_seed(0)
    sizes = dict(vocab_size=23, max_len=24, d_model=16, num_layers=2, num_heads=4)
    return GPT(**{**sizes, **options}).eval()


def test_attention_only_block_has_no_mlp_and_is_attention_plus_residual():
    torch.manual_seed(0)
    block = TransformerBlock(8, 2, mlp=False).eval()
    x = torch.randn(2, 5, 8)
    expected = x + block.attn(block.norm_attn(x))  # the definition of a pre-norm attention-only layer
    assert block.mlp is None and block.norm_mlp is None
    torch.testing.assert_close(block(x), expected, rtol=0, atol=0)
    assert not any("mlp" in name for name, _ in block.named_parameters())


def test_attention_only_gpt_has_no_mlp_parameters_and_ties_the_output_layer():
    model = tiny(attention_only=True)
    assert not any(".mlp." in name for name, _ in model.named_parameters())
    assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize("options", [{}, {"positions": "rope"}, {"num_kv_heads": 2}, {"attention_only": True}])
def test_logits_do_not_depend_on_later_tokens(options):
    model = tiny(**options)
    ids = torch.randint(0, 23, (2, 10))
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 23
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :6], model(changed)[:, :6])


@pytest.mark.parametrize("options", [{}, {"positions": "rope", "num_kv_heads": 1},
                                     {"positions": "rope", "num_heads": (4, 1)}])
def test_cached_step_logits_match_the_full_forward(options):
    model = tiny(**options)
    ids = torch.randint(0, 23, (3, 12))
    caches = model.new_cache(3)
    with torch.no_grad():
        full = model(ids)
        prefill = model(ids[:, :7], caches=caches)
        steps = [model(ids[:, t:t + 1], caches=caches) for t in range(7, 12)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"positions": "rope", "num_kv_heads": 2},
                                     {"positions": "rope", "num_heads": [2, 4], "num_kv_heads": 2}])
def test_cached_and_recomputed_greedy_generation_give_identical_tokens(options):
    model = tiny(**options)
    prompt = torch.randint(0, 23, (2, 5))
    cached = model.generate(prompt, 15)
    assert cached.shape == (2, 20) and torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, model.generate(prompt, 15, use_cache=False))


def test_greedy_generation_is_the_argmax_of_the_full_forward_at_each_step():
    model = tiny()
    sequence = torch.randint(0, 23, (1, 4))
    out = model.generate(sequence, 6)
    for _ in range(6):  # the definition of greedy decoding, step by step, without any cache
        with torch.no_grad():
            sequence = torch.cat([sequence, model(sequence)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, sequence)


def test_sampling_is_reproducible_with_a_generator_and_top_k_1_is_greedy():
    model = tiny()
    prompt = torch.randint(0, 23, (2, 3))
    a = model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert torch.equal(model.generate(prompt, 8, temperature=0.7, top_k=1), model.generate(prompt, 8))


def test_generate_refuses_to_overflow_max_len_before_generating_anything():
    model = tiny()
    with pytest.raises(ValueError, match=r"max_len=24; ask for at most 4 new tokens"):
        model.generate(torch.zeros(1, 20, dtype=torch.long), 5)
    assert model.generate(torch.zeros(1, 20, dtype=torch.long), 4).shape == (1, 24)


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"), (dict(input_ids=torch.tensor([[0, 99]])), "0..22"),
    (dict(input_ids=torch.zeros(1, 3)), "integer tensor"),
])
def test_generate_names_bad_arguments(bad, match):
    args = {"input_ids": torch.tensor([[1, 2]]), "max_new_tokens": 3, **bad}
    with pytest.raises(ValueError, match=match):
        tiny().generate(args.pop("input_ids"), args.pop("max_new_tokens"), **args)


def test_generation_restores_training_mode():
    model = tiny().train()
    model.generate(torch.tensor([[1]]), 2)
    assert model.training


def test_a_failing_forward_leaves_the_caches_unchanged():
    model = tiny()
    caches = model.new_cache(1)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), caches=caches)
        with pytest.raises(ValueError, match="exceed the model's max_len"):
            model(torch.zeros(1, 22, dtype=torch.long), caches=caches)
    assert [c.length for c in caches] == [3, 3]


@pytest.mark.parametrize("options", [{}, {"attention_only": True, "positions": "rope", "num_kv_heads": 2},
                                     {"attention_only": True, "positions": "rope", "num_heads": [4, 1]}])
def test_save_and_load_round_trip_is_bitwise(tmp_path, options):
    model = tiny(**options)
    model.save_pretrained(tmp_path, extra={"tokens": ["a", "b"]})
    loaded = GPT.from_pretrained(tmp_path)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert loaded.config == model.config and loaded.extra == {"tokens": ["a", "b"]}
    assert loaded.lm_head.weight is loaded.tok_emb.weight
    ids = torch.randint(0, 23, (1, 9))
    assert torch.equal(model.generate(ids, 5), loaded.generate(ids, 5))


# ------------------------------------------------------------------ heads per layer
def test_per_layer_heads_equal_blocks_built_by_hand_with_those_heads():
    torch.manual_seed(0)
    model = GPT(vocab_size=11, max_len=9, d_model=16, num_layers=3, num_heads=(4, 2, 1), attention_only=True,
                positions="rope").eval()
    # The parameters have the same shapes whatever the head count, so blocks with the wrong
    # counts would load these weights without complaint and compute something else.
    blocks = [TransformerBlock(16, h, causal=True, rope=True, mlp=False, activation="gelu_tanh").eval()
              for h in (4, 2, 1)]
    for block, theirs in zip(blocks, model.blocks):
        block.load_state_dict(theirs.state_dict())
    ids = torch.randint(0, 11, (2, 9))
    with torch.no_grad():
        logits, weights = model(ids, return_weights=True)
        x = model.tok_emb(ids)  # (B, T, d_model): rotary positions live in the attention
        for block in blocks:
            x = block(x)
        expected = model.lm_head(model.norm(x))  # (B, T, vocab)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert [w.shape for w in weights] == [(2, h, 9, 9) for h in (4, 2, 1)]
    assert model.heads_per_layer == (4, 2, 1) and model.config["num_heads"] == [4, 2, 1]


@pytest.mark.parametrize("heads, kv, match", [
    ((2, 1), None, r"num_heads must have one entry per layer \(3\), got 2"),
    ((2, 0, 1), None, r"num_heads\[1\] must be a positive int, got 0"),
    ((2, 3, 1), None, r"d_model \(16\) must be a multiple of num_heads\[1\] \(3\)"),
    (3, None, r"d_model \(16\) must be a multiple of num_heads \(3\)"),
    ((4, 2, 1), 2, r"num_heads\[2\] \(1\) must be a multiple of num_kv_heads \(2\)"),
    ("2,1", None, "num_heads must be a positive int or one per layer"),
])
def test_bad_head_counts_are_refused_naming_num_heads(heads, kv, match):
    with pytest.raises(ValueError, match=match):
        GPT(vocab_size=5, max_len=4, d_model=16, num_layers=3, num_heads=heads, num_kv_heads=kv)


def test_config_json_keeps_an_int_for_uniform_heads_and_a_list_for_per_layer_heads(tmp_path):
    for heads, saved in ((2, 2), ((2, 1), [2, 1]), ([2, 2], [2, 2])):
        folder = GPT(vocab_size=5, max_len=4, d_model=8, num_layers=2, num_heads=heads).save_pretrained(
            tmp_path / str(heads))
        written = json.loads((folder / "config.json").read_text())["num_heads"]
        assert written == saved and type(written) is type(saved)
        assert GPT.from_pretrained(folder).heads_per_layer == ((2, 2) if heads == 2 else tuple(heads))


def test_loading_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GPT.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is not a GPT"):
        GPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "attnlab-gpt", "vocab_size": 5}))
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        GPT.from_pretrained(tmp_path)


# ----------------------------------------------------------------- transformers GPT-2 parity
@pytest.fixture
def hf_gpt2(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=61, n_positions=40, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # GPT-2's init leaves biases and LayerNorms at 0/1: randomise them all
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    return model, tmp_path / "gpt2"


def test_gpt2_checkpoint_loads_with_equal_logits_and_the_same_greedy_tokens(hf_gpt2):
    reference, folder = hf_gpt2
    assert (folder / "model.safetensors").is_file()
    ours = GPT.from_pretrained(folder)
    ids = torch.randint(0, 61, (2, 17))
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(ours(ids), expected, rtol=0, atol=1e-4)
    prompt = ids[:1, :6]
    theirs = reference.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 20), theirs)


def test_gpt2_checkpoint_saved_by_attnlab_loads_back_identically(hf_gpt2, tmp_path):
    _, folder = hf_gpt2
    ours = GPT.from_pretrained(folder)
    ours.save_pretrained(tmp_path / "ours")
    again = GPT.from_pretrained(tmp_path / "ours")
    ids = torch.randint(0, 61, (1, 12))
    assert torch.equal(ours(ids), again(ids))


def test_gpt2_checkpoint_with_a_missing_tensor_is_named(hf_gpt2):
    import safetensors.torch

    _, folder = hf_gpt2
    state = safetensors.torch.load_file(os.fspath(folder / "model.safetensors"))
    del state["transformer.h.1.attn.c_proj.weight"]
    safetensors.torch.save_file(state, os.fspath(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 GPT-2 tensor\(s\): h.1.attn.c_proj.weight"):
        GPT.from_pretrained(folder)
