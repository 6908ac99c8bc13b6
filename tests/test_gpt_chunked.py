"""GPT's chunked-local (``C``) and NoPE (``N``) layers: fp64 references, caches, configs, training."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from attnlab.lab import train as _train
from attnlab.lab.cli import app
from attnlab.models import GPT
from attnlab.nn import ChunkedKVCache, MultiHeadAttention, WindowedKVCache
from attnlab.nn.positional import apply_rotary
from attnlab.nn import CallMask, Chunk, Window
from attnlab.nn.multihead import pattern_of

runner = CliRunner()


def chunked_causal(tq: int, tk: int, chunk: int) -> torch.Tensor:
    """``(Tq, Tk)`` bool, written out: query ``i`` (position ``tk - tq + i``) sees key ``j`` when
    ``j <= i`` and both lie in the same block of ``chunk`` positions."""
    allowed = torch.zeros(tq, tk, dtype=torch.bool)
    for i in range(tq):
        p = tk - tq + i
        for j in range(tk):
            allowed[i, j] = j <= p and j // chunk == p // chunk
    return allowed


def reference_layer(mha: MultiHeadAttention, x: torch.Tensor, allowed: torch.Tensor, *, rotate: bool) -> torch.Tensor:
    """The module's self-attention in plain fp64 math: project, rotate, scores, masked softmax, out."""
    B, T, _ = x.shape
    H, Hkv, D = mha.num_heads, mha.num_kv_heads, mha.head_dim
    q, k, v = torch.nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias).split(
        (H * D, Hkv * D, Hkv * D), dim=-1)
    q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
    k = k.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, T, D)
    v = v.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    if rotate:
        cos, sin = mha.rope.cos_sin(T, dtype=x.dtype, device=x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (B, H, T, T)
    weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(B, T, H * D)  # (B, T, d)
    return mha.out_proj(out)


@pytest.mark.parametrize("T, chunk", [(11, 4), (8, 8), (6, 1), (5, 9)])
def test_a_chunked_layer_equals_fp64_attention_with_the_chunked_causal_mask_forward_and_backward(T, chunk):
    torch.manual_seed(T * 10 + chunk)
    model = GPT(vocab_size=7, max_len=16, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                positions="rope", layer_pattern="C", chunk=chunk).double()
    mha = model.blocks[0].attn
    assert mha.chunk == chunk and mha.rope is not None
    x = torch.randn(2, T, 16, dtype=torch.float64, requires_grad=True)
    out = mha(x)
    expected = reference_layer(mha, x, chunked_causal(T, T, chunk), rotate=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, mha.in_proj_weight), grad)
    want = torch.autograd.grad(expected, (x, mha.in_proj_weight), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_nope_layer_is_the_same_layer_without_rotation_while_the_others_rotate():
    torch.manual_seed(1)
    nope = GPT(vocab_size=9, max_len=16, d_model=16, num_layers=2, num_heads=2, positions="rope",
               layer_pattern="GN").double()
    assert nope.layer_kinds == ("G", "N")
    assert nope.blocks[0].attn.rope is not None and nope.blocks[1].attn.positions is None
    rotated = GPT(vocab_size=9, max_len=16, d_model=16, num_layers=2, num_heads=2, positions="rope").double()
    rotated.load_state_dict(nope.state_dict())
    ids = torch.randint(0, 9, (2, 10))
    assert not torch.allclose(rotated(ids), nope(ids))  # the rotation matters
    rotated.blocks[1].attn.positions = None  # the same layer, unrotated
    torch.testing.assert_close(rotated(ids), nope(ids), rtol=0, atol=0)
    x = torch.randn(2, 10, 16, dtype=torch.float64)  # and that layer is plain causal attention in fp64
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    torch.testing.assert_close(nope.blocks[1].attn(x), reference_layer(nope.blocks[1].attn, x, causal, rotate=False),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pattern, page_size", [("CCCN", None), ("CNLG", None), ("GCNC", None), ("CNLG", 4)])
def test_cached_decoding_equals_the_full_forward_for_patterns_mixing_c_n_l_g(pattern, page_size):
    torch.manual_seed(len(pattern) + (page_size or 0))
    model = GPT(vocab_size=13, max_len=40, d_model=16, num_layers=4, num_heads=2, positions="rope",
                layer_pattern=pattern, chunk=5, window=3 if "L" in pattern else None).double().eval()
    ids = torch.randint(0, 13, (2, 23))
    full = model(ids)
    caches = model.new_cache(2, page_size=page_size)
    # a prefill ending mid-chunk, steps crossing chunk boundaries, then a block crossing several
    pieces = [ids[:, :7], *(ids[:, t:t + 1] for t in range(7, 12)), ids[:, 12:14], ids[:, 14:]]
    with torch.no_grad():
        logits = torch.cat([model(piece, caches=caches) for piece in pieces], dim=1)
    torch.testing.assert_close(logits, full, rtol=1e-10, atol=1e-10)
    prompt = ids[:, :4]
    assert torch.equal(model.generate(prompt, 20, page_size=page_size), model.generate(prompt, 20, use_cache=False))


def test_ragged_prompts_decode_through_chunked_layers_as_each_prompt_alone():
    torch.manual_seed(2)
    model = GPT(vocab_size=11, max_len=32, d_model=16, num_layers=4, num_heads=2, positions="rope",
                layer_pattern="CCCN", chunk=3).eval()
    prompts = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([7]), torch.tensor([3] * 8)]
    for got, prompt in zip(model.generate(prompts, 9), prompts):
        assert torch.equal(got, model.generate(prompt[None], 9, use_cache=False)[0])


def test_a_chunked_cache_holds_only_the_current_chunk_at_any_length():
    model = GPT(vocab_size=11, max_len=64, d_model=16, num_layers=2, num_heads=2, layer_pattern="CN", chunk=4)
    caches = model.new_cache(1)
    assert isinstance(caches[0], ChunkedKVCache) and caches[0].keys.shape[2] == 4
    before = caches[0].nbytes
    with torch.no_grad():
        model.generate(torch.tensor([[1, 2, 3]]), 40)
        for t in range(30):
            model(torch.tensor([[t % 11]]), caches=caches)
    assert caches[0].nbytes == before and caches[0].length == 30
    assert caches[1].keys.shape[2] == 64  # the NoPE layer is global: every position


def test_chunked_cache_update_returns_the_keys_from_the_first_new_positions_chunk():
    cache = ChunkedKVCache(1, 1, 3, 1)
    positions = torch.arange(11.0)
    seen = []
    for start, stop in ((0, 2), (2, 3), (3, 7), (7, 8), (8, 11)):
        k = positions[start:stop].view(1, 1, -1, 1)
        seen.append(cache.update(k, k)[0].flatten().tolist())
    assert seen == [[0, 1], [0, 1, 2], [3, 4, 5, 6], [6, 7], [6, 7, 8, 9, 10]]
    assert cache.length == 11 and cache.keys.flatten()[:2].tolist() == [9, 10]


def test_a_failing_call_leaves_a_chunked_cache_as_it_was():
    mha = MultiHeadAttention(8, 8, num_heads=2, pattern=Chunk(3))
    cache = mha.new_cache(1, 16)
    with torch.no_grad():
        mha(torch.randn(1, 4, 8), cache=cache)
    keys, length = cache.keys.clone(), cache.length
    with pytest.raises(ValueError, match="cache holds batch"):
        mha(torch.randn(2, 1, 8), cache=cache)
    assert cache.length == length and torch.equal(cache.keys, keys)


@pytest.mark.parametrize("options, words", [
    (dict(layer_pattern="CN", chunk=0), "chunk"),
    (dict(layer_pattern="CN", chunk=-2), "chunk"),
    (dict(layer_pattern="CN", chunk=2.5), "chunk"),
    (dict(layer_pattern="CN"), "give chunk"),
    (dict(layer_pattern="GN", chunk=4), "chunk=4 is for C layers"),
    (dict(layer_pattern="CX", chunk=4), "unknown 'X'"),
    (dict(layer_pattern="C", chunk=4, positions="alibi"), "positions='alibi'"),
])
def test_bad_chunk_values_are_one_error_naming_the_argument(options, words):
    with pytest.raises((ValueError, TypeError), match=words):
        GPT(vocab_size=5, max_len=8, d_model=8, num_layers=2, num_heads=2, **options)


def test_a_module_refuses_chunk_with_a_window_non_causal_a_wrong_cache_or_documents():
    with pytest.raises(ValueError, match="chunk=2 with window=3"):
        pattern_of(True, 3, 2)  # a block's flags; a pattern is one of them by construction
    with pytest.raises(ValueError, match="chunk=2 .*causal=True"):
        pattern_of(False, None, 2)
    mha = MultiHeadAttention(8, 8, num_heads=2, pattern=Chunk(2))
    with pytest.raises(ValueError, match="WindowedKVCache"):
        mha(torch.randn(1, 3, 8), cache=WindowedKVCache(1, 2, 2, 4))
    with pytest.raises(ValueError, match="ChunkedKVCache of chunk 3"):
        mha(torch.randn(1, 3, 8), cache=ChunkedKVCache(1, 2, 3, 4))
    with pytest.raises(ValueError, match="ChunkedKVCache of chunk 2"):
        MultiHeadAttention(8, 8, num_heads=2)(torch.randn(1, 3, 8), cache=ChunkedKVCache(1, 2, 2, 4))
    with pytest.raises(ValueError, match=r"documents with pattern=Chunk\(2\)"):
        mha(torch.randn(1, 4, 8), mask=CallMask(documents=torch.tensor([0, 0, 1, 1])))


def test_a_saved_chunked_nope_model_loads_with_its_config_and_logits(tmp_path):
    torch.manual_seed(4)
    model = GPT(vocab_size=9, max_len=16, d_model=16, num_layers=4, num_heads=2, positions="rope",
                layer_pattern="CCCN", chunk=3).eval()
    folder = model.save_pretrained(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    assert (config["layer_pattern"], config["chunk"]) == ("CCCN", 3)
    loaded = GPT.from_pretrained(folder)
    assert loaded.config == model.config and loaded.layer_kinds == ("C", "C", "C", "N")
    ids = torch.randint(0, 9, (1, 12))
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    plain = GPT(vocab_size=9, max_len=16, d_model=16, num_layers=1, num_heads=2)
    assert "chunk" not in plain.config  # configs without C layers stay as they were


def test_attnlab_train_with_chunked_and_nope_layers_trains_and_resumes(tmp_path, monkeypatch):
    for task, defaults in _train.TASK_DEFAULTS.items():
        monkeypatch.setitem(_train.TASK_DEFAULTS, task, {**defaults, "eval_sequences": 8})
    out = tmp_path / "run"
    tiny = ["--d-model", "16", "--heads", "2", "--batch-size", "4", "--layers", "4", "--positions", "rope"]
    result = runner.invoke(app, ["train", "--steps", "2", *tiny, "--layer-pattern", "CCCN", "--chunk", "8",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "layers CCCN (chunk 8)" in result.output
    model = GPT.from_pretrained(out)
    assert model.layer_kinds == ("C", "C", "C", "N") and model.blocks[0].attn.chunk == 8
    assert model.blocks[3].attn.positions is None
    result = runner.invoke(app, ["train", "--resume", str(out), "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "from step 2" in result.output and json.loads((out / "metrics.json").read_text())["steps"] == 3
    result = runner.invoke(app, ["train", "--resume", str(out), "--steps", "4", "--chunk", "4"])
    assert result.exit_code == 2 and "--chunk 4 conflicts with the checkpoint" in result.output


@pytest.mark.parametrize("args, words", [
    (["--layer-pattern", "CN"], ["--layer-pattern CN", "--chunk"]),
    (["--layer-pattern", "GN", "--chunk", "4"], ["--chunk 4", "C layers"]),
    (["--layer-pattern", "CN", "--chunk", "0"], ["--chunk", "positive"]),
])
def test_train_refuses_bad_chunk_options_in_one_error_line(args, words, tmp_path):
    result = runner.invoke(app, ["train", "--steps", "1", "--d-model", "16", "--heads", "2", *args,
                                 "--out", str(tmp_path / "x")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), result.output
    assert not (tmp_path / "x").exists()
