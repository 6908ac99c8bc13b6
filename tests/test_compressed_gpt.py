"""GPT's DeepSeek-V4 letters: V (compressed sparse, CSA) and H (heavily compressed, HCA) layers.

Decoding with their CompressedCache against the full forward, generate's fast step, save/load,
training and resuming (Trainer and ``attnlab train``), the refusals, and the cache's bytes against
the kv-memory formula at two contexts.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab.lab import train as _train
from attnlab.lab.cli import app
from attnlab.lab.train import TrainConfig, Trainer
from attnlab.models import GPT
from attnlab.nn import CompressedAttention, CompressedCache
from attnlab.nn.compressed import model_sizes
from attnlab.nn.kv_memory import compressed_cache_bytes, kv_cache_bytes

runner = CliRunner()
OPTIONS = dict(window=4, topk=2, compress_rate=2)


def tiny(pattern="VH", *, layers=2, positions="rope", **more) -> GPT:
    torch.manual_seed(0)
    options = {**OPTIONS, **more}
    if "V" not in pattern:
        options.pop("topk")
    return GPT(vocab_size=17, max_len=32, d_model=16, num_layers=layers, num_heads=2, layer_pattern=pattern,
               positions=positions, **options).eval()


def _noisy(model: GPT) -> GPT:
    """Non-zero sinks and position biases (they start at 0), so that every parameter counts."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                param.normal_()
    return model


def test_v_and_h_layers_are_compressed_attention_sized_from_the_model():
    model = tiny("VHG", layers=3, num_kv_heads=1)
    csa, hca = model.blocks[0].attn, model.blocks[1].attn
    assert type(csa) is CompressedAttention and type(hca) is CompressedAttention
    assert (csa.kind, hca.kind, csa.window, hca.window, csa.compress_rate, csa.indexer.topk) == ("csa", "hca", 4, 4, 2, 2)
    sizes = model_sizes(16, 2, kind="csa")
    assert (csa.head_dim, csa.rope_dim, csa.o_groups, csa.o_rank) == (8, 4, 2, 8) == tuple(
        sizes[k] for k in ("head_dim", "rope_dim", "o_groups", "o_rank"))
    assert (csa.indexer.heads, csa.indexer.dim, csa.q_a_proj.out_features) == (2, 8, 8)
    assert hca.indexer is None and model.heads_per_layer == (2, 2, 2)
    assert [type(c).__name__ for c in model.new_cache(1)] == ["CompressedCache", "CompressedCache", "KVCache"]
    assert all(p.bias is None for m in (csa, hca) for p in m.modules() if isinstance(p, torch.nn.Linear))


@pytest.mark.parametrize("pattern, positions", [("VH", "rope"), ("GVH", "rope"), ("HV", "learned")])
def test_decoding_token_by_token_gives_the_full_forwards_logits(pattern, positions):
    """A prefill then one token at a time through every cache equals one forward over all 13 tokens
    (windows of 2 close at odd positions, the window of 4 slides, the indexer picks 2 of up to 6)."""
    model = _noisy(tiny(pattern, layers=3, positions=positions))
    ids = torch.randint(0, 17, (2, 13))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_cache(2, 13)
        steps = [model(ids[:, :5], caches=caches)] + [model(ids[:, t:t + 1], caches=caches) for t in range(5, 13)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert {c.row_lengths for c in caches} == {(13, 13)}
    assert caches[pattern.index("V")].entries.shape == (2, 6, 8)


@pytest.mark.parametrize("pattern", ["VH", "GV"])
def test_generate_equals_the_uncached_greedy_path_and_takes_the_fast_step(pattern):
    model = _noisy(tiny(pattern))
    prompt = torch.randint(0, 17, (2, 5))
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    cached = model.generate(prompt, 12)
    fast_calls = len(calls)
    hook.remove()
    assert torch.equal(cached, model.generate(prompt, 12, use_cache=False))
    # every step after the prefill is generate's fast step (block.decode_step), never GPT.forward
    assert fast_calls == 1
    tokens = cached[:, 5:]
    with torch.no_grad():
        reference = model(cached[:, :-1])[:, 4:].argmax(-1)  # the greedy choice at every generated position
    assert torch.equal(tokens, reference)


def test_save_and_load_round_trip(tmp_path):
    model = _noisy(tiny("VHG", layers=3))
    loaded = GPT.from_pretrained(model.save_pretrained(tmp_path / "m"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["layer_pattern"], config["compress_rate"], config["window"], config["topk"]) == ("VHG", 2, 4, 2)
    assert loaded.layer_kinds == ("V", "H", "G")
    ids = torch.randint(0, 17, (1, 11))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert "compress_rate" not in GPT(vocab_size=9, max_len=8, d_model=8, num_layers=1, num_heads=2).config


@pytest.mark.parametrize("options, words", [
    (dict(layer_pattern="V", window=4, topk=2), "layer_pattern 'V' has V layers: give compress_rate"),
    (dict(layer_pattern="H", compress_rate=2), "give window"),
    (dict(layer_pattern="VG", compress_rate=2, window=4), "give topk"),
    (dict(layer_pattern="G", compress_rate=2), "compress_rate=2 is for V layers (and H layers)"),
    (dict(layer_pattern="H", compress_rate=2, window=4, topk=2), "topk=2 is for T layers (and V layers)"),
    (dict(layer_pattern="G", window=4), "window=4 is for L layers (and V, H layers)"),
    (dict(layer_pattern="H", compress_rate=0, window=4), "compress_rate"),
    (dict(layer_pattern="H", compress_rate=2, window=4, sinks=True), "sinks: not available"),
    (dict(layer_pattern="H", compress_rate=2, window=4, softcap=5.0), "softcap: not available"),
    (dict(layer_pattern="H", compress_rate=2, window=4, positions="alibi"), "positions='alibi'"),
    (dict(layer_pattern="H", compress_rate=2, window=4, dropout_p=0.1), "dropout_p=0.1"),
    (dict(layer_pattern="H", compress_rate=2, window=4, d_model=4, num_heads=4), "head_dim = d_model / num_heads >= 2"),
])
def test_bad_options_are_refused_by_name(options, words):
    base = dict(vocab_size=9, max_len=16, d_model=16, num_layers=2, num_heads=2)
    with pytest.raises(ValueError) as err:
        GPT(**{**base, **options})
    assert words in str(err.value)


def test_what_the_layers_cannot_do_is_refused_at_the_call():
    model = tiny("VH")
    ids = torch.randint(0, 17, (2, 6))
    with pytest.raises(ValueError, match="return_weights"):
        model(ids, return_weights=True)
    with pytest.raises(ValueError, match="padding_mask is not supported by CompressedAttention"):
        model(ids, padding_mask=torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="document_ids is not supported by CompressedAttention"):
        model(ids, document_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    with pytest.raises(ValueError, match="page_size=16: a CompressedCache has no pages"):
        model.generate([torch.tensor([1, 2, 3]), torch.tensor([4])], 2)
    with pytest.raises(ValueError, match="page_size=4"):
        model.generate(ids, 2, page_size=4)
    with pytest.raises(ValueError, match="max_len"):
        model.blocks[0].attn.new_cache(1, 0)
    # a refused call leaves the caches as they were
    caches = model.new_cache(2)
    with torch.no_grad():
        model(ids, caches=caches)
        with pytest.raises(ValueError, match="exceed"):
            model(torch.randint(0, 17, (2, 27)), caches=caches)
    assert {c.row_lengths for c in caches} == {(6, 6)}


def test_the_language_model_loss_trains_every_parameter_but_the_indexers():
    """The indexer's choice is discrete: the loss reaches no indexer weight (V4 trains it apart); every
    other parameter of the V and H layers gets a gradient."""
    model = _noisy(tiny("VH")).train()
    ids = torch.randint(0, 17, (2, 12))
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    for name, param in model.named_parameters():
        if ".indexer." in name:
            assert param.grad is None, name
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_trainer_trains_and_resumes_as_an_uninterrupted_run(tmp_path):
    options = dict(d_model=16, heads=2, batch_size=4, eval_sequences=16, eval_every=2, layers=2,
                   layer_pattern="VH", window=4, topk=2, compress_rate=2)
    whole = Trainer(TrainConfig(task="induction", steps=4, **options))
    whole.train()
    part = Trainer(TrainConfig(task="induction", steps=4, **options))
    part.train(should_stop=lambda: part.step == 2, out=tmp_path)
    resumed = Trainer.resume(tmp_path)
    assert resumed.step == 2 and resumed.model.layer_kinds == ("V", "H")
    resumed.train()
    assert resumed.history["train_loss"] == whole.history["train_loss"]
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


def test_attnlab_train_with_compressed_layers_trains_and_resumes(tmp_path, monkeypatch):
    for task, defaults in _train.TASK_DEFAULTS.items():
        monkeypatch.setitem(_train.TASK_DEFAULTS, task, {**defaults, "eval_sequences": 8})
    out = tmp_path / "run"
    tiny_args = ["--d-model", "16", "--heads", "2", "--batch-size", "4", "--layers", "2"]
    result = runner.invoke(app, ["train", "--steps", "2", *tiny_args, "--layer-pattern", "VH", "--window", "4",
                                 "--topk", "2", "--compress-rate", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "layers VH (window 4, topk 2, compress rate 2)" in result.output
    model = GPT.from_pretrained(out)
    assert model.layer_kinds == ("V", "H") and model.blocks[1].attn.compress_rate == 2
    result = runner.invoke(app, ["train", "--resume", str(out), "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "from step 2" in result.output and json.loads((out / "metrics.json").read_text())["steps"] == 3
    result = runner.invoke(app, ["train", "--resume", str(out), "--steps", "4", "--compress-rate", "4"])
    assert result.exit_code == 2 and "--compress-rate 4 conflicts with the checkpoint" in result.output


@pytest.mark.parametrize("args, words", [
    (["--layer-pattern", "VH", "--window", "4", "--topk", "2"], ["--layer-pattern VH", "--compress-rate"]),
    (["--layer-pattern", "H", "--compress-rate", "2"], ["--layer-pattern H", "--window"]),
    (["--layer-pattern", "H", "--compress-rate", "2", "--window", "4", "--topk", "2"], ["--topk 2", "T layers"]),
    (["--compress-rate", "2"], ["--compress-rate 2", "V layers", "H ("]),
    (["--layer-pattern", "H", "--compress-rate", "0", "--window", "4"], ["--compress-rate", "positive"]),
])
def test_train_refuses_bad_compressed_options_in_one_error_line(args, words, tmp_path):
    result = runner.invoke(app, ["train", "--steps", "1", "--d-model", "16", "--heads", "2", *args,
                                 "--out", str(tmp_path / "x")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_compressed_cache_bytes_is_what_a_layers_cache_holds(kind):
    """The formula against a real layer's CompressedCache.nbytes, fp32 and fp64, at contexts shorter than
    the window, between closing windows and at a closing one."""
    options = dict(compress_rate=3, topk=2, index_heads=2, index_dim=6) if kind == "csa" else dict(compress_rate=3)
    layer = CompressedAttention(16, 2, head_dim=8, rope_dim=4, q_rank=8, o_groups=1, o_rank=8, window=5, kind=kind,
                                **options)
    for dtype in (torch.float32, torch.float64):
        layer.to(dtype)
        for context in (2, 13, 42):
            cache = layer.new_cache(1)
            with torch.no_grad():
                layer(torch.randn(1, context - 1, 16, dtype=dtype), cache=cache)
                layer(torch.randn(1, 1, 16, dtype=dtype), cache=cache)  # the last token as a decoding step
            assert cache.nbytes == compressed_cache_bytes(
                context=context, head_dim=8, window=5, compress_rate=3, index_dim=6 if kind == "csa" else 0,
                dtype_bytes=dtype.itemsize), (kind, dtype, context)


def test_kv_cache_bytes_of_a_gpts_compressed_layers_at_two_contexts():
    model = tiny("VH", layers=4)
    for context in (9, 30):
        caches = model.new_cache(1, context)
        with torch.no_grad():
            model(torch.randint(0, 17, (1, context)), caches=caches)
        assert all(type(c) is CompressedCache for c in caches)
        assert sum(c.nbytes for c in caches) == kv_cache_bytes(
            context=context, layers=4, head_dim=8, dtype_bytes=4, pattern="VH", window=4, compress_rate=2,
            index_dim=8), context
    with pytest.raises(ValueError, match="compress_rate must be given"):
        kv_cache_bytes(context=8, layers=1, pattern="H", window=4)
    with pytest.raises(ValueError, match="window must be given"):
        kv_cache_bytes(context=8, layers=1, pattern="V", compress_rate=4)
    with pytest.raises(ValueError, match="index_dim must be >= 0"):
        compressed_cache_bytes(context=8, head_dim=4, window=2, compress_rate=2, index_dim=-1)


def test_empty_input_and_bfloat16_decode_like_the_full_forward():
    """No tokens: no logits and the caches untouched; in bf16 the caches hold bf16 and decoding step by
    step stays within bf16's rounding of the full forward (the same ops on the same rows)."""
    model = _noisy(tiny("VH"))
    caches = model.new_cache(2)
    with torch.no_grad():
        assert model(torch.zeros(2, 0, dtype=torch.long), caches=caches).shape == (2, 0, 17)
    assert {c.row_lengths for c in caches} == {(0, 0)} and all(c.nbytes == 0 for c in caches)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 17, (1, 9))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_cache(1)
        steps = torch.cat([model(ids[:, :4], caches=caches)] + [model(ids[:, t:t + 1], caches=caches)
                                                                 for t in range(4, 9)], 1)
    assert steps.dtype == torch.bfloat16 and caches[0].entries.dtype == torch.bfloat16
    torch.testing.assert_close(steps.float(), full.float(), atol=0.05, rtol=0.02)
