"""``attnlab train`` and ``attnlab generate``: outputs, Ctrl-C and resume, and one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch
from typer.testing import CliRunner

from attnlab import train as _train
from attnlab.cli import app
from attnlab.models import GPT

runner = CliRunner()
TINY = ["--d-model", "16", "--heads", "2", "--batch-size", "4"]


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()  # the command sets --threads (default 1) for the process
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def small_eval(monkeypatch):
    """Held-out sets of 16 sequences, so a test run evaluates in milliseconds."""
    for task, defaults in _train.TASK_DEFAULTS.items():
        monkeypatch.setitem(_train.TASK_DEFAULTS, task, {**defaults, "eval_sequences": 16})


def assert_one_error_line(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], result.output


def test_train_writes_checkpoint_metrics_curves_and_heatmaps(tmp_path, small_eval):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--steps", "3", *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("model.safetensors", "config.json", "metrics.json", "optimizer.safetensors", "curves.png",
                 "heads.png", "attention-layer0.png", "attention-layer1.png"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "induction" and metrics["steps"] == 3 and metrics["seconds"] > 0
    assert 0 <= metrics["accuracy"] <= 1 and metrics["loss"] > 0
    assert len(metrics["heads"]["induction"]) == 2 and len(metrics["heads"]["ablation_accuracy"][1]) == 2
    assert metrics["summary"].startswith(f"Held-out accuracy {100 * metrics['accuracy']:.1f} %")
    assert metrics["summary"].split(". ")[0] in result.output
    assert GPT.from_pretrained(out).config["num_heads"] == 2
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_ctrl_c_saves_a_checkpoint_says_how_to_resume_and_resume_matches_an_uninterrupted_run(
        tmp_path, small_eval, monkeypatch):
    whole = tmp_path / "whole"
    assert runner.invoke(app, ["train", "--task", "sort", "--steps", "6", *TINY, "--out", str(whole)]).exit_code == 0
    original = _train.Trainer.train_step

    def interrupting_step(self):
        result = original(self)
        if self.step == 2:  # Ctrl-C arrives during step 2
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(_train.Trainer, "train_step", interrupting_step)
    part = tmp_path / "part"
    result = runner.invoke(app, ["train", "--task", "sort", "--steps", "6", *TINY, "--out", str(part)])
    assert result.exit_code == 130, result.output
    assert f"attnlab train --resume {part}" in result.output.replace("\n", "")
    assert json.loads((part / "config.json").read_text())["step"] == 2
    monkeypatch.setattr(_train.Trainer, "train_step", original)
    result = runner.invoke(app, ["train", "--resume", str(part)])
    assert result.exit_code == 0, result.output
    assert "from step 2" in result.output
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (whole, part))
    assert a["history"]["train_loss"] == b["history"]["train_loss"] and a["loss"] == b["loss"]


def test_a_head_count_per_layer_reaches_the_model_the_banner_the_table_and_metrics(tmp_path, small_eval):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--steps", "2", "--d-model", "16", "--heads", "2,1", "--batch-size", "4",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 layers x 2,1 heads" in result.output
    table = [line.split()[:2] for line in result.output.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d\.\d{3}\s", line)]
    assert table == [["0", "0"], ["0", "1"], ["1", "0"]]  # one row per head that exists
    metrics = json.loads((out / "metrics.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert all([len(row) for row in metrics["heads"][name]] == [2, 1] for name in metrics["heads"])
    assert json.loads((out / "config.json").read_text())["num_heads"] == [2, 1]
    assert GPT.from_pretrained(out).heads_per_layer == (2, 1)


def test_the_one_layer_control_gives_its_layer_the_defaults_first_head_count(tmp_path, small_eval):
    out = tmp_path / "control"
    result = runner.invoke(app, ["train", "--layers", "1", "--steps", "1", "--d-model", "16", "--batch-size", "4",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 layer x 2 heads" in result.output
    assert json.loads((out / "config.json").read_text())["num_heads"] == 2


@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], ["--steps", "positive"]),
    (["--heads", "3", "--d-model", "16"], ["--heads 3", "--d-model 16"]),
    (["--heads", "0"], ["--heads", "positive", "'0'"]),
    (["--heads", "2,x"], ["--heads", "'2,x'", "e.g. 2 or 2,1"]),
    (["--heads", "2,"], ["--heads", "'2,'"]),
    (["--heads", "2,1,1"], ["--heads 2,1,1", "3 head counts for 2 layers"]),
    (["--layers", "1", "--heads", "2,1"], ["--heads 2,1", "2 head counts for 1 layer "]),
    (["--heads", "2,3", "--d-model", "16"], ["--heads 2,3", "--d-model 16", "3 does not"]),
    (["--d-model", "9"], ["--heads 2,1 (the default)", "--d-model 9"]),
    (["--task", "text"], ["--text"]),
    (["--task", "nope"], ["task", "nope"]),
    (["--seed", "-1"], ["--seed"]),
    (["--lr", "0"], ["--lr"]),
])
def test_bad_options_give_one_error_line_and_write_nothing(tmp_path, args, words):
    out = tmp_path / "out"
    assert_one_error_line(runner.invoke(app, ["train", *args, "--out", str(out)]), *words)
    assert not out.exists()


@pytest.mark.parametrize("name, content, words", [
    ("missing.txt", None, ["missing.txt", "cannot be read"]),
    ("empty.txt", b"", ["empty.txt", "is empty"]),
    ("latin1.txt", "café".encode("latin-1") * 50, ["latin1.txt", "not UTF-8"]),
])
def test_bad_text_files_give_one_error_line_and_write_nothing(tmp_path, name, content, words):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    out = tmp_path / "out"
    result = runner.invoke(app, ["train", "--task", "text", "--text", str(tmp_path / name), "--out", str(out)])
    assert_one_error_line(result, *words)
    assert not out.exists()


def test_unwritable_out_gives_one_error_line_and_leaves_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert_one_error_line(runner.invoke(app, ["train", "--out", str(blocker / "sub")]), "--out", "a-file")
    assert blocker.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_resume_of_a_folder_that_is_not_a_checkpoint_is_one_error_line(tmp_path):
    assert_one_error_line(runner.invoke(app, ["train", "--resume", str(tmp_path / "none")]), "--resume", "none")


def test_resume_refuses_options_the_checkpoint_fixes(tmp_path):
    result = runner.invoke(app, ["train", "--resume", str(tmp_path), "--heads", "4", "--lr", "0.1"])
    assert_one_error_line(result, "--heads, --lr cannot change on --resume")


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """One tiny text model trained through the CLI, shared by the generate tests (it is only read)."""
    tmp_path = tmp_path_factory.mktemp("text")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 80, encoding="utf-8")
    out = tmp_path / "text-run"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_train.TASK_DEFAULTS, "text", {**_train.TASK_DEFAULTS["text"], "layers": 1,
                                                      "eval_sequences": 16})
        result = runner.invoke(app, ["train", "--task", "text", "--text", str(corpus), "--steps", "2", *TINY,
                                     "--out", str(out)])
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return out


def test_generate_prints_the_prompt_continued_and_tokens_per_second(text_checkpoint):
    result = runner.invoke(app, ["generate", "--model", str(text_checkpoint), "--prompt", "the c",
                                 "--max-new-tokens", "12", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("the c") and len(first) == 5 + 12
    assert "12 tokens in" in result.output and "tokens/s" in result.output
    model = GPT.from_pretrained(text_checkpoint)  # the same greedy continuation from the library
    index = {c: i for i, c in enumerate(model.extra["chars"])}
    ids = model.generate(torch.tensor([[index[c] for c in "the c"]]), 12)[0].tolist()
    assert first == "".join(model.extra["chars"][i] for i in ids)
    uncached = runner.invoke(app, ["generate", "--model", str(text_checkpoint), "--prompt", "the c",
                                   "--max-new-tokens", "12", "--temperature", "0", "--no-cache"])
    assert uncached.output.splitlines()[0] == first


@pytest.mark.parametrize("args, words", [
    (["--prompt", "the zebra"], ["never saw", "z"]),
    (["--prompt", "the", "--max-new-tokens", "1000"], ["--max-new-tokens 1000", "at most 125"]),
    (["--prompt", "the", "--temperature", "-1"], ["--temperature"]),
    (["--prompt", "the", "--top-k", "0"], ["--top-k"]),
])
def test_generate_refuses_bad_options_in_one_line(text_checkpoint, args, words):
    assert_one_error_line(runner.invoke(app, ["generate", "--model", str(text_checkpoint), *args]), *words)


def test_generate_with_a_missing_model_is_one_error_line(tmp_path):
    assert_one_error_line(runner.invoke(app, ["generate", "--model", str(tmp_path / "x"), "--prompt", "a"]),
                          "--model", "does not exist")


def test_explain_opens_a_trained_gpt_checkpoint_with_head_grid_and_head_view(tmp_path, small_eval):
    run = tmp_path / "run"
    assert runner.invoke(app, ["train", "--steps", "2", *TINY, "--out", str(run)]).exit_code == 0
    out = tmp_path / "explain"
    result = runner.invoke(app, ["explain", "--model", str(run), "3 17 5 9 3 17", "--query", "17",
                                 "--out", str(out), "--format", "png"])
    assert result.exit_code == 0, result.output
    assert "2 layers x 2 heads" in result.output
    assert "[CLS]" not in result.output  # BERT's special-token note is not for a GPT checkpoint
    assert (out / "heads.png").is_file() and list(out.glob("headview-layer*.png"))
    bad = runner.invoke(app, ["explain", "--model", str(run), "not ids", "--out", str(out)])
    assert_one_error_line(bad, "token ids in 0..63")
