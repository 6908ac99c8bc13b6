"""attnlab.lab.zoo and ``attnlab verify --transformers``: transformers families on attnlab against eager.

One family per attention code path runs whole (tiny, random, nothing downloaded); wrong, crashing
and refusing attention functions registered under other names show that the zoo classifies each
outcome; the command's options are refused with one ``error:`` line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import pytest
import torch
from typer.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="pip install 'attnlab[hf]'")

from attnlab.lab import zoo  # noqa: E402
from attnlab.lab.cli import app  # noqa: E402
from attnlab.integrations.transformers import attention_forward, register  # noqa: E402
from test_cli_errors import assert_one_error_line  # noqa: E402

runner = CliRunner()
ALL_CHECKS = {"forward", "right-padded", "left-padded", "generate", "gradients", "attentions"}

# One family per path through attention_forward, and the checks each must have run.
PATHS = {
    "llama": ALL_CHECKS,  # decoder, grouped-query heads, rotary
    "bert": ALL_CHECKS,  # bidirectional encoder (built as BertLMHeadModel: a causal LM head)
    "t5": ALL_CHECKS,  # encoder-decoder with position_bias (T5's relative bias), cross-attention cache
    "bart": ALL_CHECKS,  # encoder-decoder family (built as BartForCausalLM)
    "vit": {"forward", "gradients", "attentions"},  # vision encoder: no text, no padding
    "mistral": ALL_CHECKS,  # sliding window (tiny: 4 keys, shorter than the batch)
    "gemma2": ALL_CHECKS,  # logit softcap, alternating sliding and full layers
    "gpt_oss": ALL_CHECKS,  # per-head sinks (s_aux)
    "deepseek_v3": ALL_CHECKS,  # multi-head latent attention: keys 24 wide, values 16
}

# Two of the 2026 flagships the zoo once called not applicable: per-layer configs with head_dim 512
# on global layers inside a multimodal wrapper (Gemma 4), more layer kinds than the cut's two layers
# (LFM3: convolutions). Qwen3.5 (a nested text config) and Gemma 3n (KV shared across layers) take
# 30 s each here (Qwen3.5's Gated DeltaNet runs transformers' CPU fallback): their configs are
# checked below and their runs are in the sweep (docs/models.md).
FLAGSHIPS = ("gemma4", "lfm3")


def _wrong_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """attnlab's attention with every score scaled 1.5x too much: a bug the zoo must catch."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return attention_forward(module, query, key, value, attention_mask, scaling=1.5 * scaling, **kwargs)


def _crashing_attention(module, query, key, value, attention_mask, **kwargs):
    raise RuntimeError("kernel exploded")


def _hanging_attention(module, query, key, value, attention_mask, **kwargs):
    time.sleep(60)


def _refusing_attention(module, query, key, value, attention_mask, **kwargs):
    return attention_forward(module, query[0], key, value, attention_mask)  # attnlab's check refuses rank 3


@pytest.fixture(scope="module")
def implementations():
    """Test attention functions registered with transformers' mask function, as register() does."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, function in (("zoo-wrong", _wrong_attention), ("zoo-crash", _crashing_attention),
                           ("zoo-refuse", _refusing_attention), ("zoo-hang", _hanging_attention)):
        transformers.AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    register()


@pytest.mark.parametrize("family", sorted(PATHS))
def test_each_attention_path_equals_eager(family):
    result = zoo.run_family(family)
    assert result.status == "equal", result
    assert set(result.checks) == PATHS[family], result.checks
    assert result.calls > 0 and all(d <= zoo.TOLERANCE for d in result.checks.values())


@pytest.mark.parametrize("family", FLAGSHIPS)
def test_each_2026_flagship_equals_eager(family):
    result = zoo.run_family(family)
    assert result.status == "equal", result
    assert {"forward", "left-padded", "gradients"} <= set(result.checks), result.checks
    assert result.calls > 0 and all(d <= zoo.TOLERANCE for d in result.checks.values())


def test_a_cut_model_keeps_each_layer_kind_and_its_per_layer_settings():
    config = zoo.tiny_config("gemma4").text_config
    assert config.layer_types == ["sliding_attention", "full_attention"]
    per_layer = {int(i): v for i, v in config.to_dict()["per_layer_config"].items()}
    assert per_layer == {1: {"head_dim": 512}}  # upstream layer 5 (the first full layer), renumbered
    lfm = zoo.tiny_config("lfm3")  # three kinds (convolution, full, sliding) survive a cut to two layers
    assert lfm.num_hidden_layers == 3 and set(lfm.layer_types) == set(transformers.Lfm3Config().layer_types)


def test_a_cut_model_with_shared_kv_keeps_one_sharing_layer_of_each_kind():
    config = zoo.tiny_config("gemma3n_text")
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config.num_kv_shared_layers == 2  # the last two read the first two's caches
    assert zoo._kept_layers(["a", "a", "b", "a", "b"], 5, 2, sharing=True) == ([0, 2, 1, 4], 2)


def test_a_cut_that_keeps_a_moe_layer_shrinks_its_expert_groups():
    """Regression: keeping each layer kind kept bailing_hybrid's MoE layer, whose 8 expert groups
    over 4 experts made its router view (-1, 8, 0) and eager fail."""
    config = zoo.tiny_config("bailing_hybrid")
    assert "sparse" in config.mlp_layer_types and config.num_experts % config.num_expert_group == 0


def test_a_composite_config_gives_the_text_part_to_a_text_model():
    assert type(zoo.model_config(transformers.Qwen3_5ForCausalLM, "qwen3_5")).__name__ == "Qwen3_5TextConfig"
    assert type(zoo.model_config(transformers.LlamaForCausalLM, "llama")).__name__ == "LlamaConfig"


def test_a_model_that_draws_random_numbers_in_eval_draws_alike_on_both_sides():
    """ViTMAE masks random patches in every forward: unseeded, eager and attnlab saw different
    patches and the zoo reported a difference of 1.4 that was no attention's."""
    result = zoo.run_family("vit_mae")
    assert result.status == "equal", result


def test_a_family_that_does_not_route_attention_is_not_applicable():
    result = zoo.run_family("bloom")  # ALiBi computed inside BloomAttention
    assert result.status == "not applicable" and "does not route attention" in result.reason
    assert zoo.routes_attention("bloom") is not None and zoo.routes_attention("llama") is None


def test_a_wrong_attention_function_is_reported_different(implementations):
    result = zoo.run_family("llama", implementation="zoo-wrong")
    assert result.status == "different", result
    assert result.checks["forward"] > 1e-3 and "forward" in result.reason
    assert result.sdpa_checks and all(d <= zoo.TOLERANCE for d in result.sdpa_checks.values())


def test_a_crash_is_recorded_and_a_refusal_keeps_attnlabs_message(implementations):
    crashed = zoo.run_family("llama", implementation="zoo-crash")
    assert crashed.status == "crashed" and "RuntimeError: kernel exploded" in crashed.reason
    refused = zoo.run_family("llama", implementation="zoo-refuse")
    assert refused.status == "refused" and "ValueError" in refused.reason and "query" in refused.reason


def test_a_family_past_its_time_limit_is_crashed_and_the_next_one_runs(implementations):
    hung = zoo.run_family("llama", implementation="zoo-hang", time_limit=8)  # eager takes < 1 s
    assert hung.status == "crashed" and "timed out after 8 s" in hung.reason and hung.seconds < 30
    eager_too_slow = zoo.run_family("llama", time_limit=1e-3)  # before attnlab ran: not its failure
    assert eager_too_slow.status == "not applicable" and "timed out" in eager_too_slow.reason
    assert zoo.run_family("gpt2").status == "equal"


def test_a_time_limit_that_fires_before_the_eager_model_is_built_is_not_attnlabs_failure(monkeypatch):
    real_quiet = zoo._quiet

    @contextlib.contextmanager
    def slow_quiet():  # the alarm fires while the run is still being set up (a busy machine)
        time.sleep(0.05)
        with real_quiet():
            yield

    monkeypatch.setattr(zoo, "_quiet", slow_quiet)
    result = zoo.run_family("llama", time_limit=1e-3)
    assert result.status == "not applicable" and "the eager model alone timed out" in result.reason


def test_tiny_config_shrinks_sizes_and_keeps_every_layer_type():
    config = zoo.tiny_config("gemma3_text")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 128)
    assert sorted(config.layer_types) == ["full_attention", "sliding_attention"]  # 5:1 upstream
    assert config.sliding_window == 4
    assert max(config.pad_token_id, config.eos_token_id, config.bos_token_id) < config.vocab_size


def test_tiny_llama4_keeps_a_chunked_and_a_nope_layer_with_a_short_chunk():
    """Regression: the cut model had a chunk of 8192 (no chunking at 7 tokens) and no NoPE layer."""
    config = zoo.tiny_config("llama4_text")
    assert config.attention_chunk_size == 4 and config.num_hidden_layers == 2
    assert sorted(config.no_rope_layers) == [0, 1]  # one NoPE layer (0) beside one rotary, chunked layer (1)


def test_difference_masks_padding_and_flags_one_sided_nan():
    a = torch.zeros(2, 3, 4)
    b = a.clone()
    b[1, 0] = 5.0  # a padded position
    real = torch.tensor([[True, True, True], [False, True, True]])
    assert zoo._difference({"x": a}, {"x": b}, real) == 0.0
    assert zoo._difference({"x": a}, {"x": b}, None) == 5.0
    b[0, 0, 0] = float("nan")
    assert zoo._difference({"x": a}, {"x": b}, real) == math.inf
    assert zoo._difference({"x": a}, {"y": a}, None) == math.inf


def test_markdown_and_counts():
    results = [zoo.FamilyResult("a", "equal"), zoo.FamilyResult("b", "different", reason="forward 1|2")]
    assert zoo.counts(results) == {"equal": 1, "refused": 0, "not applicable": 0, "different": 1, "crashed": 0}
    assert "| b | different |  | forward 1/2 |" in zoo.markdown_table(results)


# ------------------------------------------------------------------ the command
def test_command_writes_json_and_markdown(tmp_path):
    out, md = tmp_path / "zoo.json", tmp_path / "zoo.md"
    result = runner.invoke(app, ["verify", "--transformers", "--family", "bloom,vit", "--json", str(out),
                                 "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    assert "no family differs or crashes" in result.output
    data = json.loads(out.read_text())
    assert [(f["family"], f["status"]) for f in data["families"]] == [("bloom", "not applicable"), ("vit", "equal")]
    assert "| vit | equal | ViTModel |" in md.read_text() and "attnlab verify --transformers" in md.read_text()


def test_command_exits_1_when_a_family_differs(monkeypatch):
    monkeypatch.setattr(zoo, "run_family",
                        lambda name, **_: zoo.FamilyResult(name, "different", reason="forward 3.0e-01"))
    result = runner.invoke(app, ["verify", "--transformers", "--family", "llama"])
    assert result.exit_code == 1, result.output
    assert "different" in result.output and "forward 3.0e-01" in result.output


@pytest.mark.parametrize("args, words", [
    (["--transformers", "--family", "no_such_family"], ["--family 'no_such_family'"]),
    (["--transformers", "--family", "llama,"], ["--family ''"]),
    (["--family", "llama"], ["--family needs --transformers"]),
    (["--json", "x.json"], ["--json needs --transformers"]),
    (["--transformers", "--backend", "sdpa"], ["--backend does not apply to --transformers"]),
    (["--transformers", "--quick"], ["--quick does not apply to --transformers"]),
    (["--transformers", "--time-limit", "0"], ["--time-limit", "0"]),
    (["--transformers", "--time-limit", "nan"], ["--time-limit", "nan"]),
    (["--transformers", "--json", "/no/such/folder/zoo.json"], ["--json", "does not exist"]),
    (["--transformers", "--markdown", "zoo.txt"], ["--markdown", ".md"]),
])
def test_command_refuses_bad_options(args, words):
    assert_one_error_line(runner.invoke(app, ["verify", *args]), *words)
