"""attnlab.lab.explain.trace and the `attnlab explain` command.

References: "Clear Tutorial"'s printed numbers, the tutorial modules run on their own,
and fp64 recomputations from the trace's recorded inputs.
"""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from attnlab.lab.cli import app
from attnlab.lab.explain import DEFAULT_SENTENCE, split_for_cross, tokenize, trace
from attnlab.lab import tutorial

DOC_SENTENCE = "The sun rises in the east"

# "Clear Tutorial", printed tensors (4 decimals).
DOC_DICT = {"The": 0, "east": 1, "in": 2, "rises": 3, "sun": 4, "the": 5}
DOC_IDS = [0, 4, 3, 2, 5, 1]
DOC_EMBEDDED = [[0.3374, -0.1778, -0.3035], [0.1794, 1.8951, 0.4954], [-1.1925, 0.6984, -1.4097],
                [-0.2196, -0.3792, 0.7671], [0.2692, -0.0770, -1.0205], [-0.5880, 0.3486, 0.6603]]
DOC_SCORES_ROW3 = [0.4344, -2.5037, 0.9265, -0.3509, 1.0740, -0.9315]
DOC_WEIGHTS = [[0.1772, 0.1326, 0.1831, 0.1645, 0.1879, 0.1547], [0.0386, 0.6870, 0.0229, 0.0840, 0.0204, 0.1470],
               [0.1973, 0.0247, 0.2794, 0.1132, 0.3102, 0.0751], [0.1505, 0.2187, 0.1463, 0.1651, 0.1401, 0.1793],
               [0.1965, 0.0618, 0.2312, 0.1452, 0.2506, 0.1146], [0.1347, 0.2758, 0.1231, 0.1621, 0.1162, 0.1881]]
DOC_CAUSAL = [[1.0, 0, 0, 0, 0, 0], [0.0532, 0.9468, 0, 0, 0, 0], [0.3935, 0.0493, 0.5572, 0, 0, 0],
              [0.2211, 0.3213, 0.2149, 0.2426, 0, 0], [0.2220, 0.0698, 0.2612, 0.1640, 0.2831, 0],
              [0.1347, 0.2758, 0.1231, 0.1621, 0.1162, 0.1881]]
DOC_CONTEXT = [[-0.1564, 0.1028, -0.0763, -0.0764], [0.5313, 1.3607, 0.7891, 1.3110],
               [-0.5296, -0.2799, -0.4107, -0.6006], [0.0071, 0.3345, 0.0969, 0.1998],
               [-0.3542, -0.1234, -0.2626, -0.3706], [0.1008, 0.4780, 0.2021, 0.3674]]
DOC_MHA_COLUMN = [-0.0185, 0.4003, -0.1827, 0.0668, -0.1103, 0.1180,  # head 0 (doc's rows 0-5)
                  0.0170, 1.7137, -0.2060, 0.3534, -0.1609, 0.6949]  # head 1 (doc's rows 6-11)


def _close(actual, expected, atol=6e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# --- the tutorial's numbers -------------------------------------------------------------

def test_trace_reproduces_document_000_self_attention():
    t = trace(DOC_SENTENCE, mode="self", seed=123, d_model=3, d_kq=2, d_v=4)
    assert t.vocabulary == DOC_DICT
    assert t.step("ids").tensor.tolist() == DOC_IDS
    _close(t.step("embeddings").tensor, DOC_EMBEDDED)
    _close(t.step("scores").tensor[2], DOC_SCORES_ROW3)
    _close(t.step("weights").tensor, DOC_WEIGHTS)
    _close(t.output, DOC_CONTEXT)


def test_trace_reproduces_document_000_causal_and_multihead():
    _close(trace(DOC_SENTENCE, mode="causal", seed=123).step("weights").tensor, DOC_CAUSAL)
    t = trace(DOC_SENTENCE, mode="multihead", heads=4, d_v=1, seed=123)
    _close(torch.cat([t.output[:, 0], t.output[:, 1]]), DOC_MHA_COLUMN)
    masked = trace(DOC_SENTENCE, mode="causal", seed=123).step("masked_scores").tensor
    assert torch.isinf(masked).eq(torch.ones(6, 6).triu(1).bool()).all()


# --- trace output == the module's own output ---------------------------------------------------

def _embeddings(t, name="embeddings"):
    return t.step(name).tensor


@pytest.mark.parametrize("sentence", [DEFAULT_SENTENCE, DOC_SENTENCE])
def test_self_trace_equals_self_attention_module(sentence):
    t = trace(sentence, mode="self", seed=7, d_model=4, d_kq=3, d_v=5)
    torch.manual_seed(7)
    module = tutorial.SelfAttention(4, 3, 5, init="uniform")
    torch.testing.assert_close(t.output, module(_embeddings(t)).detach(), atol=1e-6, rtol=1e-6)


def test_causal_trace_equals_causal_attention_module():
    t = trace(mode="causal", seed=5, d_kq=2, d_v=2)
    torch.manual_seed(5)
    module = tutorial.CausalAttention(3, 2, context_length=12, init="uniform")
    torch.testing.assert_close(t.output, module(_embeddings(t)).detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_trace_equals_wrapper_module(causal):
    t = trace(mode="multihead", heads=3, causal=causal, seed=11, d_kq=2, d_v=2)
    torch.manual_seed(11)
    module = tutorial.MultiHeadAttentionWrapper(3, 2, 2, 3, causal=causal, init="uniform")
    out, weights = module(_embeddings(t), return_weights=True)
    torch.testing.assert_close(t.output, out.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(t.weights(), weights.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("context", [None, "A glass of red wine"])
def test_cross_trace_equals_cross_attention_module(context):
    t = trace(DEFAULT_SENTENCE, mode="cross", context=context, seed=3)
    torch.manual_seed(3)
    module = tutorial.CrossAttention(3, 2, 4, init="uniform")
    expected = module(_embeddings(t), _embeddings(t, "context_embeddings")).detach()
    torch.testing.assert_close(t.output, expected, atol=1e-6, rtol=1e-6)
    first, second = split_for_cross(DEFAULT_SENTENCE) if context is None else (DEFAULT_SENTENCE, context)
    assert t.tokens == tokenize(first) and t.context_tokens == tokenize(second)
    assert t.weights().shape == (1, len(t.tokens), len(t.context_tokens))


def test_dropout_trace_equals_module_in_training_mode():
    t = trace(mode="causal", dropout_p=0.5, seed=9, d_kq=2, d_v=2)
    torch.manual_seed(9)
    module = tutorial.CausalAttention(3, 2, context_length=12, dropout_p=0.5, init="uniform").train()
    torch.manual_seed(9)  # the module draws dropout from the global generator
    torch.testing.assert_close(t.output, module(_embeddings(t)).detach(), atol=1e-6, rtol=1e-6)
    keep = t.step("dropout_mask").tensor
    assert set(keep.unique().tolist()) == {0.0, 2.0}


def test_every_intermediate_matches_fp64_recomputation():
    t = trace(mode="multihead", heads=2, causal=True, seed=1)
    x = _embeddings(t).double()
    allowed = torch.ones(12, 12).tril().bool()
    for h in range(2):
        wq, wk, wv = (t.step(n, h).tensor.double() for n in ("W_q", "W_k", "W_v"))
        scores = (x @ wq) @ (x @ wk).T
        weights = torch.softmax((scores / 2**0.5).masked_fill(~allowed, float("-inf")), dim=-1)
        torch.testing.assert_close(t.step("scores", h).tensor.double(), scores, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(t.step("weights", h).tensor.double(), weights, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(t.step("context", h).tensor.double(), weights @ (x @ wv), atol=1e-5, rtol=1e-5)


def test_steps_have_labels_shapes_and_explanations():
    t = trace(mode="causal")
    names = [s.name for s in t.steps]
    assert names == ["vocabulary", "ids", "embeddings", "W_q", "queries", "W_k", "keys", "W_v", "values",
                     "scores", "scaled_scores", "mask", "masked_scores", "weights", "context"]
    for step in t.steps:
        assert step.explanation.endswith(".") and len(step.cols) == step.tensor.shape[-1]
        assert step.rows is None or len(step.rows) == step.tensor.shape[0]
    assert t.step("weights").rows == tuple(t.tokens)


# --- tokens and focus ---------------------------------------------------------------------------

def test_tokenizer_strips_punctuation_and_keeps_case():
    assert tokenize(DEFAULT_SENTENCE) == ["The", "chef", "prepared", "a", "delicious", "meal", "and", "it", "was",
                                          "served", "with", "wine"]
    assert tokenize("Don't stop -- now!") == ["Don't", "stop", "now"]


def test_query_index_defaults_and_errors():
    t = trace()
    assert t.tokens[t.query_index()] == "it"
    assert t.query_index("MEAL") == 5
    assert trace(DOC_SENTENCE).query_index() == 5  # no "it": the last token
    with pytest.raises(ValueError, match="'pizza' is not a token"):
        t.query_index("pizza")


@pytest.mark.parametrize("kwargs, message", [
    (dict(sentence=" ,. "), "no words"),
    (dict(mode="bogus"), "mode must be one of"),
    (dict(mode="self", heads=2), "use --mode multihead"),
    (dict(mode="cross", causal=True), "cross mode"),
    (dict(d_kq=0), "d_kq must be a positive integer"),
])
def test_trace_rejects_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        trace(**kwargs)


# --- the command ---------------------------------------------------------------------------------

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["explain", *args])


_LINK = re.compile(r"'(?P<word>[^']+)' attends most to '(?P<top>[^']+)' \((?P<tw>[0-9.]+)\) "
                   r"and least to '(?P<low>[^']+)' \((?P<lw>[0-9.]+)\)")


@pytest.mark.parametrize("mode", ["self", "causal", "multihead", "cross"])
def test_each_mode_of_the_command_works(mode, tmp_path):
    result = _run("--mode", mode, "--out", str(tmp_path), "--format", "html", "--no-color")
    assert result.exit_code == 0, result.output
    assert "Step 1" in result.output and "Attention weights" in result.output
    assert "X = E[ids]" in result.output  # titles are printed literally, not read as rich markup
    assert "Files written" in result.output and str(tmp_path / "report.html") in result.output
    assert (tmp_path / "report.html").stat().st_size > 1000
    assert _LINK.search(result.output)


def test_causal_flag_equals_causal_mode(tmp_path):
    flag = _run("--causal", "--out", str(tmp_path), "--format", "html", "--no-color").output
    mode = _run("--mode", "causal", "--out", str(tmp_path), "--format", "html", "--no-color").output
    assert "Causal mask" in flag and flag == mode


def test_sentence_option_equals_sentence_argument(tmp_path):
    common = ("--out", str(tmp_path), "--format", "html", "--no-color")
    by_option = _run("--sentence", "The sun rises in the east", *common)
    by_argument = _run("The sun rises in the east", *common)
    assert by_option.exit_code == 0 and "'east'" in by_option.output
    assert by_option.output == by_argument.output
    both = _run("The cat sat", "--sentence", "The dog ran", *common)
    assert both.exit_code != 0 and both.output.strip().startswith("error: give the sentence once")


@pytest.mark.parametrize("args, word, mode", [
    ((), "it", "self"),
    (("--query", "meal"), "meal", "self"),
    (("--query", "chef", "--mode", "causal"), "chef", "causal"),
    (("--query", "delicious", "--mode", "causal", "--seed", "4"), "delicious", "causal"),
])
def test_query_focus_names_the_right_words(args, word, mode, tmp_path):
    result = _run(*args, "--out", str(tmp_path), "--format", "html", "--no-color")
    assert result.exit_code == 0, result.output
    t = trace(mode=mode, seed=4 if "--seed" in args else 123)
    i = t.tokens.index(word)
    row = t.weights()[0, i].double()
    visible = torch.arange(len(t.tokens)) <= i if mode == "causal" else torch.ones(len(t.tokens), dtype=torch.bool)
    top = int(torch.where(visible, row, -1.0).argmax())
    low = int(torch.where(visible, row, 2.0).argmin())
    match = _LINK.search(result.output)
    assert match["word"] == word and match["top"] == t.tokens[top] and match["low"] == t.tokens[low]
    assert float(match["tw"]) == pytest.approx(float(row[top]), abs=5e-5)
    assert float(match["lw"]) == pytest.approx(float(row[low]), abs=5e-5)


def test_command_writes_png_svg_and_html(tmp_path):
    result = _run("--mode", "multihead", "--heads", "2", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "attention.svg").read_text().lstrip().startswith("<?xml")
    assert "head-select" in (tmp_path / "report.html").read_text()
    assert "head 1: 'it' attends most to" in result.output


@pytest.mark.parametrize("args, message", [
    (("",), "no words"),
    (("--query", "pizza"), "'pizza' is not a token"),
    (("--mode", "bogus"), "mode must be one of"),
    (("--heads", "x"), "--heads"),
    (("--model", "gpt2"), "model directory 'gpt2' does not exist"),
    (("--format", "jpg"), "--format must be one of"),
    (("--mode", "cross", "--heads", "2"), "cross mode"),
    (("--context", "hello there"), "--context is for cross mode only"),
])
def test_errors_are_one_line_without_traceback(args, message, tmp_path):
    result = _run(*args, "--out", str(tmp_path))
    assert result.exit_code != 0
    text = result.output.strip()
    assert "Traceback" not in text and "\n" not in text, text
    assert text.startswith("error:") and message in text
