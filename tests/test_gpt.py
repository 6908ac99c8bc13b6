"""attnlab.models.GPT: forward, KV-cache generation, save/load, and parity with transformers' GPT-2."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from attnlab.models import GPT
from attnlab.nn import TransformerBlock
from _alloc_guard import forbid_large_allocations


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
    blocks = [TransformerBlock(16, h, causal=True, positions="rope", mlp=False, activation="gelu_tanh").eval()
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
    error = TypeError if isinstance(heads, str) else ValueError  # a wrong kind is a TypeError
    with pytest.raises(error, match=match):
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


# ------------------------------------------- config checked against the weights' header (issue 18)
def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("key, value, tensor, shape", [
    ("vocab_size", 10**11, "tok_emb.weight", (31, 8)),
    ("d_model", 10**7, "tok_emb.weight", (31, 8)),
    ("max_len", 10**11, "pos_emb.embedding.weight", (12, 8)),
    ("d_ff", 10**10, "blocks.0.mlp.fc_in.weight", (32, 8)),
])
def test_attnlab_config_sizes_are_checked_against_the_header_before_allocating(tmp_path, monkeypatch, key, value,
                                                                                tensor, shape):
    folder = GPT(vocab_size=31, max_len=12, d_model=8, num_layers=2, num_heads=2, d_ff=32).save_pretrained(tmp_path)
    _edit_config(folder, **{key: value})
    forbid_large_allocations(monkeypatch)
    with pytest.raises(ValueError) as info:
        GPT.from_pretrained(folder)
    message = str(info.value)
    assert f"config.json': {key}={value} does not match the weights: {tensor} in " in message
    assert f"model.safetensors' has shape {shape}" in message


def test_attnlab_layer_count_and_unheld_sizes_are_refused_before_allocating(tmp_path, monkeypatch):
    folder = GPT(vocab_size=31, max_len=12, d_model=8, num_layers=2, num_heads=2,
                 positions="rope").save_pretrained(tmp_path)
    forbid_large_allocations(monkeypatch)
    _edit_config(folder, num_layers=10**8)
    with pytest.raises(ValueError, match=r"num_layers=100000000 does not match the weights: .*model\.safetensors' "
                                         r"holds 2 layer\(s\) named blocks\.<i>"):
        GPT.from_pretrained(folder)
    _edit_config(folder, num_layers=2, max_len=2**40)  # rotary positions: no tensor holds max_len
    with pytest.raises(ValueError, match=r"config\.json': max_len=1099511627776 is absurdly large \(at most 2147483647\)"):
        GPT.from_pretrained(folder)
    _edit_config(folder, max_len=True)
    with pytest.raises(ValueError, match=r"config\.json': max_len must be a positive int, got True"):
        GPT.from_pretrained(folder)


def _gpt2_config_edits(folder, **changes):
    original = (folder / "config.json").read_text()
    for key, value in changes.items():
        (folder / "config.json").write_text(original)
        _edit_config(folder, **{key: value})
        with pytest.raises(ValueError) as info:
            GPT.from_pretrained(folder)
        yield key, value, str(info.value)


def test_gpt2_config_sizes_are_checked_against_the_header_before_allocating(hf_gpt2, monkeypatch):
    _, folder = hf_gpt2
    forbid_large_allocations(monkeypatch)
    held = {"vocab_size": "wte.weight in .* has shape \\(61, 32\\)", "n_embd": "wte.weight in .* has shape \\(61, 32\\)",
            "n_positions": "wpe.weight in .* has shape \\(40, 32\\)",
            "n_inner": "h.0.mlp.c_fc.weight in .* has shape \\(32, 128\\)",
            "n_layer": ".*model.safetensors' holds 2 layer\\(s\\) named h\\.<i>"}
    huge = {"vocab_size": 10**11, "n_embd": 10**7, "n_positions": 10**11, "n_inner": 10**10, "n_layer": 10**9}
    for key, value, message in _gpt2_config_edits(folder, **huge):
        assert re.search(rf"config\.json': {key}={value} does not match the weights: {held[key]}", message), message


def test_gpt2_unexpected_tensors_and_integer_weights_are_refused(hf_gpt2):
    import safetensors.torch

    _, folder = hf_gpt2
    path = os.fspath(folder / "model.safetensors")
    state = safetensors.torch.load_file(path)
    safetensors.torch.save_file({**state, "transformer.h.0.attn.rel_bias": torch.zeros(4)}, path)
    with pytest.raises(ValueError, match=r"has 1 unexpected GPT-2 tensor\(s\) that config\.json does not account "
                                         r"for: h\.0\.attn\.rel_bias"):
        GPT.from_pretrained(folder)
    safetensors.torch.save_file({**state, "transformer.wpe.weight": torch.zeros(40, 32, dtype=torch.int32)}, path)
    with pytest.raises(ValueError, match=r"wpe\.weight has dtype I32; weights must be floating point"):
        GPT.from_pretrained(folder)
    old_buffers = {"transformer.h.0.attn.bias": torch.ones(1, 1, 40, 40, dtype=torch.bool)}
    safetensors.torch.save_file({**state, **old_buffers}, path)  # older transformers saved the causal mask
    assert GPT.from_pretrained(folder).config["vocab_size"] == 61


# ------------------------------------------------------------- ids outside the vocabulary (issue 18)
def test_ids_outside_the_vocabulary_are_refused_with_the_bert_wording():
    with pytest.raises(ValueError, match=r"^input_ids must be in 0\.\.22 \(vocab_size=23\), got values -1\.\.2$"):
        tiny()(torch.tensor([[-1, 2]]))


def test_ids_are_not_read_on_the_meta_device():
    with torch.device("meta"):  # a model on meta, as transformers builds one before loading
        model = tiny()
    assert model._check_ids(torch.zeros(2, 5, dtype=torch.long, device="meta"), None) == 0


def test_a_non_bool_bias_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="bias must be a bool, got str"):
        GPT(vocab_size=5, max_len=4, d_model=8, num_layers=1, num_heads=2, bias="no")


def test_gpt2_flags_must_be_json_booleans(hf_gpt2):
    _, folder = hf_gpt2
    _edit_config(folder, tie_word_embeddings="false")  # truthy: would tie and ignore lm_head.weight
    with pytest.raises(ValueError, match=r"config\.json': tie_word_embeddings must be true or false, got 'false'"):
        GPT.from_pretrained(folder)
