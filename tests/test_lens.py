"""Any transformers model's heads through attnlab (attnlab.lab.lens and ``attnlab explain --model DIR``).

Tiny random GPT-2, Llama (grouped-query), BERT and Gemma 2 checkpoints are built from their config
classes and saved to a temporary directory (tests/_tiny_models.py; no hub). The weights attnlab's
fast path returns are compared with transformers' own eager attention of the same model (an
independent implementation), greedy generation with eager's, and every refusal is one line, exit 2.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from _tiny_models import save_tiny, transformers
from attnlab.lab.cli import app
from attnlab.lab.lens import open_model
from test_cli_errors import assert_one_error_line
from test_explain_trained import needs_model

TEXT = "the chef made a meal and it was good"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: save_tiny(kind, root / kind) for kind in ("gpt2", "llama", "bert", "roberta", "gemma2", "bloom")}


def _eager_weights(directory, ids):
    config = transformers.AutoConfig.from_pretrained(directory)
    loader = transformers.AutoModel if config.model_type in ("bert", "roberta") else transformers.AutoModelForCausalLM
    model = loader.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    return model, torch.stack([w[0] for w in out.attentions]).double()  # (L, H, T, T)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "gemma2"])
def test_weights_from_the_fast_path_equal_transformers_eager_attention(tiny, kind):
    lens = open_model(tiny[kind])
    result = lens.attention(TEXT)
    assert result.tokens[-1] == "[SEP]" if kind == "bert" else result.tokens == TEXT.split()
    _, eager = _eager_weights(tiny[kind], result.ids)
    assert result.weights.shape == eager.shape == (2, 4, len(result.ids), len(result.ids))
    torch.testing.assert_close(result.weights.double(), eager, atol=1e-5, rtol=0)
    assert lens.decoder == (kind != "bert")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generation_matches_eager_greedy_generation(tiny, kind):
    lens = open_model(tiny[kind])
    result, prompt = lens.generate("the chef made", 4)
    model, _ = _eager_weights(tiny[kind], [5])
    ids = torch.tensor([lens.ids("the chef made")])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                              do_sample=False, pad_token_id=0)[0].tolist()
    assert prompt == 3 and result.ids == expected and result.weights.shape[-1] == 7
    causal = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)
    assert float(result.weights[..., causal].abs().max()) == 0.0  # nothing looked ahead


def _explain(*args, tmp_path):
    from typer.testing import CliRunner

    return CliRunner().invoke(app, ["explain", *args, "--out", str(tmp_path)])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_explain_a_decoder_writes_the_model_and_generation_views(tiny, kind, tmp_path):
    result = _explain("--model", str(tiny[kind]), TEXT, "--query", "meal", "--generate", "3", "--format", "html",
                      tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    assert "2 layers x 4 heads" in result.output and "every weight below comes from attnlab.attention" in result.output
    assert "Where 'meal' looks" in result.output and "Generated (3):" in result.output
    page = (tmp_path / "generation.html").read_text()
    data = json.loads(re.search(r'attnlab-model" type="application/json">(.*?)</script>', page).group(1))
    assert data["prompt"] == 9 and len(data["tokens"]) == 12 and data["tokens"][:9] == TEXT.split()
    assert "data-attnlab-model" in (tmp_path / "model.html").read_text()


def test_explain_a_bert_directory_walks_it_with_the_model_view(tiny, tmp_path):
    result = _explain("--model", str(tiny["bert"]), TEXT, "--format", "html", tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    assert "The word 'it' attends to most" in result.output
    assert {"report.html", "model.html"} <= {p.name for p in tmp_path.iterdir()}


@needs_model
def test_explain_minilm_writes_every_layer_and_head(tmp_path):
    result = _explain("--model", "minilm", TEXT, "--format", "html", tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    page = (tmp_path / "model.html").read_text()
    data = json.loads(re.search(r'attnlab-model" type="application/json">(.*?)</script>', page).group(1))
    assert data["heads"] == [12] * 6 and data["tokens"][0] == "[CLS]"


@pytest.mark.parametrize("make_args, words", [
    (lambda t, p: ["--model", str(p / "plain")], ["config.json"]),  # a directory, but not a model
    (lambda t, p: ["--model", str(p / "empty")], ["transformers cannot open it"]),  # a config, no weights
    (lambda t, p: ["--model", str(t["bloom"])], ["cannot run on attnlab", "its own layers"]),
    (lambda t, p: ["--model", str(t["llama"]), "the " * 70], ["70 tokens", "64 positions", "--truncate"]),
    (lambda t, p: ["--model", str(t["llama"]), "--generate", "0"], ["--generate must be a positive"]),
    (lambda t, p: ["--model", str(t["llama"]), "the chef", "--generate", "63"], ["exceed", "64 positions"]),
    (lambda t, p: ["--model", str(t["llama"]), "--query", "pizza"], ["--query 'pizza' is not a token"]),
    (lambda t, p: ["--model", "minilm", "--generate", "3"], ["--generate needs a decoder"]),
])
def test_bad_input_is_one_line(tiny, make_args, words, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "llama"}')
    args = make_args(tiny, tmp_path)
    assert_one_error_line(_explain(*args, tmp_path=tmp_path / "out" / "nested"), *words)
    assert not (tmp_path / "out").exists()  # regression: the walk's refusals left an empty --out behind


def test_a_refusal_keeps_an_out_folder_the_user_had(tiny, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    assert_one_error_line(_explain("--model", str(tiny["llama"]), "--query", "pizza", tmp_path=tmp_path / "mine"),
                          "--query")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert_one_error_line(_explain("--model", str(tiny["llama"]), "--query", "pizza", tmp_path=tmp_path / "mine" / "a"),
                          "--query")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_truncate_cuts_an_input_longer_than_the_model(tiny, tmp_path):
    result = _explain("--model", str(tiny["llama"]), "the " * 70, "--truncate", "--format", "html", tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    assert "Tokens (64):" in result.output
    # and says what it cut (it was silent): 70 tokens, 64 positions
    assert "--truncate kept the first 64 of 70 tokens; dropped 6: " in result.output


def test_a_roberta_takes_its_positions_less_the_padding_offset(tiny, tmp_path):
    # Regression: RoBERTa's positions start at padding_idx + 1, so 64 rows take 63 tokens: 64 crashed
    # with an IndexError inside the model, and --truncate cut to 64 and crashed the same way.
    lens = open_model(tiny["roberta"])
    assert lens.max_positions == 63
    longest = lens.attention("the " * 61)  # [CLS] + 61 + [SEP]
    _, eager = _eager_weights(tiny["roberta"], longest.ids)
    assert len(longest.ids) == 63 and longest.tokens[0] == "[CLS]"
    torch.testing.assert_close(longest.weights.double(), eager, atol=1e-5, rtol=0)
    assert_one_error_line(_explain("--model", str(tiny["roberta"]), "the " * 62, tmp_path=tmp_path / "no"),
                          "64 tokens", "63 positions", "--truncate")
    cut = _explain("--model", str(tiny["roberta"]), "the " * 70, "--truncate", "--format", "html", tmp_path=tmp_path)
    assert cut.exit_code == 0, cut.output
    assert "Tokens (63):" in cut.output
    assert "--truncate kept the first 63 of 72 tokens; dropped 9: " in cut.output  # [CLS] + 70 + [SEP]


@pytest.mark.parametrize("damage", ["truncated", "empty", "header"])
def test_a_damaged_weights_file_is_one_line_naming_it(tiny, tmp_path, damage):
    # Regression: transformers let safetensors' own SafetensorError through, as a traceback.
    import shutil

    model = shutil.copytree(tiny["roberta"], tmp_path / "model")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[:3000], "empty": b"", "header": data[:8] + b"\xff" * 40 + data[48:]}[damage])
    line = assert_one_error_line(_explain("--model", str(model), TEXT, tmp_path=tmp_path / "out"),
                                 "truncated or corrupted")
    assert str(weights) in line


def test_open_model_refuses_a_directory_without_a_config(tmp_path):
    with pytest.raises(ValueError, match="not a model directory: it has no config.json"):
        open_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON config"):
        open_model(tmp_path)
