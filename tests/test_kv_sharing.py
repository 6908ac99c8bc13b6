"""Cross-layer KV sharing (GPT ``num_kv_shared_layers``, Gemma 3n / Gemma 4): the plan and the shared
layers' attention against transformers' Gemma 4, cached decoding against the full forward, the shared
layers against attention computed by hand (fp64) from their source's keys and values, the cache bytes
against the tensors ``new_cache`` allocates, the refusals, saving and the parameter count.

Whole Gemma 4 models are not compared: their decoder layers have parts attnlab's GPT lacks (sandwich
RMSNorms, gated MLPs, scaled embeddings, a weightless value norm, per-layer inputs). What is compared
is the sharing itself: which layer each shared layer reads (``kv_sharing_modes`` of Gemma 4 and Gemma 3n) and
a shared layer's attention output given its source's keys and values (transformers'
``Gemma4TextAttention`` with ``shared_kv_states``).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import attnlab
from attnlab.models import GPT
from attnlab.nn import QKV, KVShare, MultiHeadAttention, QKNorm, SharedKVAttention, TransformerBlock, Window
from attnlab.nn.kv_memory import kv_cache_bytes
from attnlab.nn.kv_sharing import kv_sharing_plan
from attnlab.nn.positional import RotaryEmbedding


def tiny(pattern="LG", num_layers=5, shared=2, **options):
    sizes = {"window": 3} if "L" in pattern else {"chunk": 4} if "C" in pattern else {}
    torch.manual_seed(0)
    return GPT(vocab_size=13, max_len=24, d_model=16, num_layers=num_layers, num_heads=4, num_kv_heads=2,
               layer_pattern=pattern, positions="rope", num_kv_shared_layers=shared, **{**sizes, **options}).eval()


# ----------------------------------------------------------------- (a) transformers' Gemma 4
transformers = pytest.importorskip("transformers")
_TYPES = {"sliding_attention": "L", "full_attention": "G"}


def _gemma4(layer_types, shared):
    config = transformers.Gemma4TextConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8, sliding_window=3,
        layer_types=list(layer_types), num_kv_shared_layers=shared, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=40, attn_implementation="eager",
        rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in _TYPES})
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # q_norm starts at ones: random weights test it
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    return config, model


@pytest.mark.parametrize("family", ["gemma4", "gemma3n"])
@pytest.mark.parametrize("layer_types, shared", [
    (("sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"), 3),
    (("sliding_attention",) * 3 + ("full_attention",) + ("sliding_attention",) * 3 + ("full_attention",), 4),
    (("sliding_attention",) * 4 + ("full_attention",) + ("sliding_attention",) * 4 + ("full_attention",), 4),
])
def test_plan_is_transformers_kv_sharing_modes(family, layer_types, shared):
    if family == "gemma4":
        config = transformers.Gemma4TextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                                               num_kv_shared_layers=shared)
    else:
        config = transformers.Gemma3nTextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                                                num_kv_shared_layers=shared,
                                                activation_sparsity_pattern=[0.0] * len(layer_types))
    modes = config.kv_sharing_modes
    stores = {layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    expected = tuple(stores[kind] if mode == "reuse" else None for kind, mode in zip(layer_types, modes))
    assert kv_sharing_plan([_TYPES[k] for k in layer_types], shared) == expected


def test_shared_layer_equals_gemma4_attention_given_its_source_keys():
    layer_types = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention")
    config, model = _gemma4(layer_types, 3)
    seen = {}

    def keep(layer, module, args, kwargs, output):
        seen[layer] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0], output[0])

    for i in (2, 3, 4):
        model.model.layers[i].self_attn.register_forward_hook(functools.partial(keep, i), with_kwargs=True)
    ids = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        states = model(ids, return_shared_kv_states=True).shared_kv_states
    plan = kv_sharing_plan([_TYPES[k] for k in layer_types], 3)
    for i in (2, 3, 4):
        hf = model.model.layers[i].self_attn
        ours = SharedKVAttention(32, 32, num_heads=4, qkv=QKV(num_kv_heads=2, qk_norm=QKNorm(eps=config.rms_norm_eps),
                                                                out_bias=False),
                                 pattern=Window(3) if hf.is_sliding else "causal", positions=RotaryEmbedding(8),
                                 attention=functools.partial(attnlab.attention, scale=hf.scaling))  # Gemma 4: 1.0
        with torch.no_grad():
            ours.in_proj_weight.copy_(hf.q_proj.weight)
            ours.q_norm.weight.copy_(hf.q_norm.weight)
            ours.out_proj.weight.copy_(hf.o_proj.weight)
            keys, values = states[layer_types[plan[i]]]  # the source layer's, (B, Hkv, T, hd)
            out = ours(seen[i][0], kv=KVShare(keys=keys, values=values))
        torch.testing.assert_close(out, seen[i][1], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- (b) decoding equals the full forward
@pytest.mark.parametrize("pattern", ["LG", "G", "CN", "LLG"])
def test_cached_decoding_equals_full_forward(pattern):
    model = tiny(pattern, num_layers=6, shared=3 if pattern != "LLG" else 3)
    ids = torch.randint(0, 13, (2, 6))
    tokens = model.generate(ids, 10)
    assert torch.equal(tokens, model.generate(ids, 10, use_cache=False))
    caches = model.new_cache(2)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :6], caches=caches)] + [model(tokens[:, t:t + 1], caches=caches)
                                                         for t in range(6, tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert all(c.length == tokens.shape[1] for c in caches)  # appended once per step, by the source


def test_ragged_prompts_and_padding_and_documents():
    model = tiny("LG", num_layers=4, shared=2)
    prompts = [torch.tensor([1, 2, 3, 4]), torch.tensor([5])]
    both = model.generate(prompts, 5)  # paged caches: rows of their own lengths
    for row, prompt in zip(both, prompts):
        assert torch.equal(row, model.generate(prompt[None], 5)[0])
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    real = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with torch.no_grad():
        padded = model(ids, padding_mask=real)
        torch.testing.assert_close(padded[1, :3], model(ids[1:, :3])[0], atol=1e-5, rtol=1e-5)
        packed = model(ids[:1], document_ids=torch.tensor([0, 0, 1, 1, 1]))
        torch.testing.assert_close(packed[0, 2:], model(ids[:1, 2:])[0], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- (c) shared layers against hand math
def _by_hand(q, k, v, window):
    """fp64 causal (windowed) attention of (B, H, T, D) queries over (B, Hkv, T, D) keys."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    T = q.shape[-2]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    allowed = (j <= i) & ((i - j < window) if window else True)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, -math.inf)
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("pattern", ["LG", "G"])
def test_shared_layer_is_attention_over_its_source_keys(pattern):
    model = tiny(pattern, num_layers=5, shared=2, qk_norm=True)
    inputs, outputs = {}, {}
    for i, block in enumerate(model.blocks):
        block.norm_attn.register_forward_hook(lambda m, a, out, i=i: inputs.__setitem__(i, out))
        block.attn.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
    ids = torch.randint(0, 13, (2, 7))
    with torch.no_grad():
        model(ids)
        for layer, source in enumerate(model.kv_sources):
            if source is None:
                continue
            src, attn = model.blocks[source].attn, model.blocks[layer].attn
            k, v = src.project_kv(inputs[source])  # the source's own projections, normed keys
            q = attn.project_q(inputs[layer])
            q, k = attn.rope.at(q, 0), src.rope.at(k, 0)
            heads = _by_hand(q, k, v, attn.window)  # (B, H, T, D)
            expected = torch.nn.functional.linear(heads.transpose(1, 2).reshape(2, 7, 16),
                                                  attn.out_proj.weight.double(), attn.out_proj.bias.double())
            torch.testing.assert_close(outputs[layer].double(), expected, atol=1e-5, rtol=1e-5)
            assert model.layer_kinds[layer] == model.layer_kinds[source]
        _, weights = model(ids, return_weights=True)
        for layer, source in enumerate(model.kv_sources):
            if source is not None:  # the shared layer's weights: its queries over its source's keys
                attn = model.blocks[layer].attn
                q = attn.rope.at(attn.project_q(inputs[layer]), 0).double()
                k = model.blocks[source].attn.project_kv(inputs[source])[0]
                k = model.blocks[source].attn.rope.at(k, 0).double().repeat_interleave(2, 1)
                scores = q @ k.transpose(-1, -2) / 2.0  # head_dim 4
                T = scores.shape[-1]
                i, j = torch.arange(T)[:, None], torch.arange(T)[None]
                allowed = (j <= i) & ((i - j < attn.window) if attn.window else True)
                expected = scores.masked_fill(~allowed, -math.inf).softmax(-1)
                torch.testing.assert_close(weights[layer].double(), expected, atol=1e-5, rtol=1e-5)


# With head options too. Regression (the merge of sharing with the head options): a shared layer's query
# rows were d_out wide whatever its head width, and a shared NoPE layer skipped Llama 4's temperature.
@pytest.mark.parametrize("pattern, options", [
    ("G", {}), ("G", dict(head_dim=6)), ("G", dict(qk_norm="olmo2")), ("N", dict(nope_temperature=(2, 0.5)))])
def test_no_sharing_model_with_copied_projections_matches_when_inputs_match(pattern, options):
    """The same weights without sharing: a shared layer's own projections set to its source's give
    the same output when it attends over the same input (the source's), with its letter's options."""
    shared = tiny(pattern, num_layers=3, shared=1, **options)
    plain = tiny(pattern, num_layers=3, shared=0, **options)
    width = shared.blocks[2].attn.d_q  # the query rows; the source's key/value rows follow them
    state = {k: v for k, v in shared.state_dict().items() if not k.startswith("blocks.2.attn.in_proj")}
    state["blocks.2.attn.in_proj_weight"] = torch.cat([shared.blocks[2].attn.in_proj_weight,
                                                       shared.blocks[1].attn.in_proj_weight[width:]])
    state["blocks.2.attn.in_proj_bias"] = torch.cat([shared.blocks[2].attn.in_proj_bias,
                                                     shared.blocks[1].attn.in_proj_bias[width:]])
    if "blocks.2.attn.k_norm.weight" in plain.state_dict():  # the keys come normed by the source's k_norm
        state["blocks.2.attn.k_norm.weight"] = shared.state_dict()["blocks.1.attn.k_norm.weight"]
    plain.load_state_dict(state)
    x = torch.randn(2, 7, 16)
    share = KVShare()
    with torch.no_grad():
        shared.blocks[1].attn(x, kv=share)
        torch.testing.assert_close(shared.blocks[2].attn(x, kv=share), plain.blocks[2].attn(x), atol=1e-6, rtol=1e-6)
    ids = torch.randint(0, 13, (2, 5))
    assert torch.equal(shared.generate(ids, 6), shared.generate(ids, 6, use_cache=False))


def test_a_source_fills_the_same_share_on_its_fast_and_general_paths():
    """The common call and the KVCache decoding step (fast paths) hand over what the general path does."""
    from attnlab.nn import CallMask

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 16, num_heads=4, qkv=QKV(num_kv_heads=2), positions="rope").eval()
    x = torch.randn(2, 5, 16)
    fast, general = KVShare(), KVShare()
    with torch.no_grad():
        mha(x, kv=fast)
        mha(x, mask=CallMask(padding=torch.ones(2, 5, dtype=torch.bool)), kv=general)
        assert (fast.positions, general.positions) == (0, 0)
        torch.testing.assert_close((fast.keys, fast.values), (general.keys, general.values), atol=0, rtol=0)
        caches = [mha.new_cache(2, 8), mha.new_cache(2, 8)]
        for cache in caches:
            mha(x[:, :4], cache=cache)
        mha(x[:, 4:], cache=caches[0], kv=fast)  # the decoding step
        mha(x[:, 4:], cache=caches[1], kv=general, return_weights=True)  # weights: the general path
        assert fast.positions == general.positions == 4
        torch.testing.assert_close((fast.keys, fast.values), (general.keys, general.values), atol=0, rtol=0)


# ----------------------------------------------------------------- (d) bytes against the allocated caches
@pytest.mark.parametrize("pattern, shared", [("G", 3), ("LLG", 3), ("CN", 2)])
def test_kv_memory_counts_the_allocated_caches(pattern, shared):
    sharing, plain = tiny(pattern, num_layers=6, shared=shared), tiny(pattern, num_layers=6, shared=0)
    caches, unshared = sharing.new_cache(2), plain.new_cache(2)
    held = {id(c): c for c in caches}
    allocated = sum(c.nbytes for c in held.values())
    assert len(held) == 6 - shared
    assert allocated == sum(c.nbytes for c in unshared) - sum(c.nbytes for c in unshared[6 - shared:])
    sizes = dict(context=24, layers=6, kv_heads=2, head_dim=4, dtype_bytes=4, batch=2, pattern=pattern,
                 window=3 if "L" in pattern else None, chunk=4 if "C" in pattern else None)
    assert kv_cache_bytes(**sizes, kv_shared_layers=shared) == allocated
    assert kv_cache_bytes(**sizes) == sum(c.nbytes for c in unshared)


def test_kv_memory_cli_reports_the_layers_holding_a_cache():
    from typer.testing import CliRunner

    from attnlab.lab.cli import app

    result = CliRunner().invoke(app, ["kv-memory", "--layers", "12", "--heads", "8", "--head-dim", "64", "--context",
                                      "4096", "--window", "512", "--layer-pattern", "LLLLLG", "--kv-shared-layers", "6"])
    assert result.exit_code == 0, result.output
    expected = kv_cache_bytes(context=4096, layers=12, kv_heads=8, head_dim=64, pattern="LLLLLG", window=512,
                              kv_shared_layers=6)
    assert f"{expected / 4096:12,.0f} B/token" in result.output
    assert "layers holding a cache: 6 of 12" in result.output
    refused = CliRunner().invoke(app, ["kv-memory", "--layers", "12", "--heads", "8", "--head-dim", "64", "--context",
                                       "4096", "--window", "512", "--layer-pattern", "LLLLLG", "--kv-shared-layers", "8"])
    assert refused.exit_code != 0 and "no earlier 'G' layer" in refused.output
    both = CliRunner().invoke(app, ["kv-memory", "--layers", "12", "--heads", "8", "--head-dim", "64", "--context",
                                    "4096", "--kv-layers", "6", "--kv-shared-layers", "6"])
    assert both.exit_code != 0 and "give one" in both.output
    with pytest.raises(ValueError, match="give one"):
        kv_cache_bytes(context=8, layers=4, kv_layers=2, kv_shared_layers=2)


# ----------------------------------------------------------------- (e) refusals, saving, parameters
@pytest.mark.parametrize("options, message", [
    (dict(shared=5), r"\[0, 4\]"), (dict(shared=-1), r"\[0, 4\]"), (dict(shared=True), "must be an int"),
    (dict(shared=2.0), "must be an int"), (dict(pattern="GGGGL", shared=1, window=2), "no earlier 'L' layer"),
    (dict(pattern="MG", shared=1, latent_dim=4), "'M', whose keys"),
    (dict(pattern="G", shared=1, num_heads=(4, 4, 4, 4, 2)), "2 heads and its source layer 3 4"),
])
def test_refusals(options, message):
    options = dict(options)
    pattern, shared = options.pop("pattern", "G"), options.pop("shared")
    with pytest.raises((ValueError, TypeError), match=message):
        GPT(vocab_size=5, max_len=8, d_model=16, num_layers=5, num_heads=options.pop("num_heads", 4),
            layer_pattern=pattern, num_kv_shared_layers=shared, **options)


def test_refusals_of_the_calls():
    model = tiny("G", num_layers=3, shared=1)
    caches = model.new_cache(1)
    caches[2] = model.blocks[0].attn.new_cache(1, 24)  # a cache of its own for the shared layer
    with pytest.raises(ValueError, match=r"caches\[2\] must be caches\[1\]"):
        model(torch.tensor([[1, 2]]), caches=caches)
    reader = model.blocks[2].attn
    with pytest.raises(ValueError, match="KVShare its source layer filled"):
        reader(torch.randn(1, 2, 16), kv=KVShare())
    with pytest.raises(ValueError, match="no cache"):
        reader.new_cache(1, 4)
    with pytest.raises(ValueError, match="no key/value projections"):
        reader.projection("value")
    with pytest.raises(TypeError, match="kv must be"):
        MultiHeadAttention(16, 16, num_heads=4)(torch.randn(1, 2, 16), kv={"keys": None})
    with pytest.raises(ValueError, match="for self-attention"):
        MultiHeadAttention(16, 16, num_heads=4)(torch.randn(1, 2, 16), context=torch.randn(1, 3, 16), kv=KVShare())
    sharded = functools.partial(attnlab.attention)
    sharded.shards = True
    with pytest.raises(ValueError, match="sharded"):
        SharedKVAttention(16, 16, num_heads=4, attention=sharded)(torch.randn(1, 2, 16), kv=KVShare())
    with pytest.raises(ValueError, match="unsharded attention part; got the sharded part"):  # context parallelism
        MultiHeadAttention(16, 16, num_heads=4, attention=sharded)(torch.randn(1, 2, 16), kv=KVShare())
    with pytest.raises(ValueError, match="cannot express shared keys and values"):
        attnlab.nn.to_torch(SharedKVAttention(16, 16, num_heads=4, pattern=None))
    with pytest.raises(ValueError, match="shared_kv=True is an option"):
        TransformerBlock(16, 4, attn=MultiHeadAttention(16, 16, num_heads=4), shared_kv=True)
    share = KVShare()
    with torch.no_grad():
        model.blocks[0].attn(torch.randn(1, 3, 16), kv=share)
    with pytest.raises(ValueError, match=r"kv holds keys \(1, 2, 3, 4\)"):
        reader(torch.randn(2, 3, 16), kv=share)  # another batch than the source's


def test_save_load_round_trip_and_config(tmp_path):
    model = tiny("LG", num_layers=5, shared=2)
    folder = model.save_pretrained(tmp_path / "m")
    loaded = GPT.from_pretrained(folder)
    assert loaded.config["num_kv_shared_layers"] == 2 and loaded.kv_sources == model.kv_sources
    ids = torch.randint(0, 13, (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert "num_kv_shared_layers" not in tiny("LG", shared=0).config  # older configs stay as they were


def test_parameter_count_drops_by_the_key_value_projections():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    d_kv = 2 * 4  # num_kv_heads * head_dim
    for qk_norm in (False, True):
        shared, plain = tiny("LG", shared=2, qk_norm=qk_norm), tiny("LG", shared=0, qk_norm=qk_norm)
        per_layer = 2 * (d_kv * 16 + d_kv) + (4 if qk_norm else 0)  # k, v weights and biases, k_norm
        assert count(plain) - count(shared) == 2 * per_layer
        assert all(b.attn.k_norm is None for b in shared.blocks[3:])


def test_the_docs_example_runs_and_prints_what_it_says(capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "modules.md").read_text()
    section = text.split("## Cross-layer KV sharing (Gemma 3n, Gemma 4)")[1].split("\n## ")[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    exec(compile(code, "docs/modules.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    said = [line.split("#")[1].split(":")[0].strip() for line in code.splitlines() if line.startswith("print(")]
    assert printed == said


def test_train_builds_and_checks_the_option(tmp_path):
    from typer.testing import CliRunner

    from attnlab.lab import train as _train
    from attnlab.lab.cli import app

    trainer = _train.Trainer(_train.TrainConfig(task="induction", layers=3, heads=2, kv_shared_layers=1, steps=1))
    assert trainer.model.kv_sources == (None, None, 1)
    refused = CliRunner().invoke(app, ["train", "--layers", "2", "--kv-shared-layers", "1"])  # heads (2, 1)
    assert refused.exit_code != 0 and "--kv-shared-layers=1: layer 1 has 1 heads" in refused.output
    refused = CliRunner().invoke(app, ["train", "--kv-shared-layers", "-1"])
    assert refused.exit_code != 0 and "--kv-shared-layers must be >= 0" in refused.output
    refused = CliRunner().invoke(app, ["train", "--layers", "2", "--heads", "2", "--kv-shared-layers", "1",
                                       "--context-parallel", "2", "--out", str(tmp_path / "cp")])
    assert refused.exit_code != 0 and "does not run context-parallel" in refused.output
    assert not (tmp_path / "cp").exists()
