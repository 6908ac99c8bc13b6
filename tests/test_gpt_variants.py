"""GPT's differential (D) and gated (Q) layers: built with nn.DifferentialAttention / nn.GatedAttention,
decoding with their caches equals the full forward, options they cannot honour are refused, and
`attnlab train` trains and resumes such a model."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab.cli import app
from attnlab.models import GPT
from attnlab.nn import DifferentialAttention, GatedAttention
from attnlab.nn.differential import lambda_init_for


def _gpt(pattern: str, **options) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=23, max_len=40, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, positions="rope",
               layer_pattern=pattern, **options).eval()


def test_layers_are_the_differential_and_gated_modules_with_the_layers_lambda():
    model = _gpt("DQGN")
    assert [type(block.attn) for block in model.blocks[:2]] == [DifferentialAttention, GatedAttention]
    layer = model.blocks[0].attn
    expected = lambda_init_for(0)  # DiffLlama's lambda_init of layer 0 (0-based, as transformers)
    assert abs(float(getattr(layer, "lambda_init")) - expected) < 1e-12


@pytest.mark.parametrize("pattern", ["DG", "QN", "DQCN"])
def test_cached_decoding_equals_the_full_forward(pattern):
    model = _gpt(pattern, chunk=4 if "C" in pattern else None)
    x = torch.randint(0, 23, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        caches = model.new_cache(2, 40)
        parts = [model(x[:, :6], caches=caches)] + [model(x[:, i:i + 1], caches=caches) for i in range(6, 13)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert model.generate(x[:1, :5], 5).tolist() == model.generate(x[:1, :5], 5, use_cache=False).tolist()


def test_options_these_layers_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="dropout_p=0.1: differential"):
        _gpt("D", dropout_p=0.1)
    with pytest.raises(ValueError, match="softcap: not available on gated"):
        _gpt("Q", softcap=5.0)
    with pytest.raises(ValueError, match="sinks: not available on differential"):
        _gpt("DG", sinks=True)
    with pytest.raises(ValueError, match="^return_weights: differential"):
        _gpt("DG")(torch.tensor([[1, 2, 3]]), return_weights=True)


def test_config_round_trips(tmp_path):
    model = _gpt("DQ")
    model.save_pretrained(tmp_path / "m")
    loaded = GPT.from_pretrained(tmp_path / "m").eval()
    x = torch.tensor([[1, 2, 3, 4, 5]])
    assert json.loads((tmp_path / "m" / "config.json").read_text())["layer_pattern"] == "DQ"
    torch.testing.assert_close(loaded(x), model(x))


def test_train_cli_trains_a_differential_and_gated_model(tmp_path):
    from attnlab.bench.variants import tiny_corpus

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(tiny_corpus(200), encoding="utf-8")
    args = ["train", "--task", "text", "--text", str(corpus), "--steps", "4", "--layers", "2", "--d-model", "16",
            "--heads", "2", "--positions", "rope", "--layer-pattern", "DQ", "--out", str(tmp_path / "run")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "No head scores or ablation" in result.output and (tmp_path / "run" / "curves.png").is_file()
    generated = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "run"), "--prompt", "sam gave",
                                         "--max-new-tokens", "3"])
    assert generated.exit_code == 0, generated.output
