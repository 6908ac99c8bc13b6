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


def assert_one_error_line(result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], result.output
    return lines[0]


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


def test_variant_options_reach_the_model_and_the_banner(tmp_path, small_eval):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--steps", "1", *TINY, "--kv-heads", "1", "--layer-pattern", "LM",
                                 "--window", "4", "--latent-dim", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 kv heads, layers LM (window 4, latent 8)" in result.output
    model = GPT.from_pretrained(out)
    assert model.layer_kinds == ("L", "M") and model.blocks[0].attn.window == 4
    assert (model.config["num_kv_heads"], model.blocks[1].attn.latent_dim) == (1, 8)


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


@pytest.mark.parametrize("args, option", [
    (["--task", "nope"], "--task"),
    (["--layers", "0"], "--layers"), (["--layers", "-2"], "--layers"), (["--layers", "1.5"], "--layers"),
    (["--heads", "0"], "--heads"), (["--heads", "-1"], "--heads"), (["--heads", "x"], "--heads"),
    (["--d-model", "0"], "--d-model"), (["--d-model", "-8"], "--d-model"), (["--d-model", "x"], "--d-model"),
    (["--steps", "0"], "--steps"), (["--steps", "-1"], "--steps"), (["--steps", "1e3"], "--steps"),
    (["--batch-size", "0"], "--batch-size"), (["--batch-size", "x"], "--batch-size"),
    (["--lr", "0"], "--lr"), (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"),
    (["--lr", "x"], "--lr"),
    (["--seed", "-1"], "--seed"), (["--seed", str(2**40)], "--seed"), (["--seed", "x"], "--seed"),
    (["--device", "nonsense"], "--device"),
    (["--positions", "alibi"], "--positions"), (["--positions", ""], "--positions"),
    (["--task", "text", "--text", "missing.txt"], "--text"), (["--text", "notes.txt"], "--text"),
    (["--threads", "0"], "--threads"), (["--threads", str(10**8)], "--threads"), (["--threads", "x"], "--threads"),
    (["--resume", "no-such-folder"], "--resume"),
    (["--kv-heads", "0"], "--kv-heads"), (["--kv-heads", "x"], "--kv-heads"), (["--kv-heads", "3"], "--kv-heads"),
    (["--layer-pattern", "LXG", "--window", "2"], "--layer-pattern"), (["--layer-pattern", ""], "--layer-pattern"),
    (["--layer-pattern", "L"], "--window"), (["--window", "0", "--layer-pattern", "L"], "--window"),
    (["--window", "3"], "--window"), (["--window", "x"], "--window"),
    (["--layer-pattern", "GM"], "--latent-dim"), (["--latent-dim", "0", "--layer-pattern", "M"], "--latent-dim"),
    (["--latent-dim", "4", "--layer-pattern", "G"], "--latent-dim"),
])
def test_every_bad_train_option_is_refused_by_its_flag_name(tmp_path, args, option):
    """The error names the option as typed on the command line (--d-model), never the Python
    parameter behind it (d_model, positions), and nothing is written."""
    out = tmp_path / "out"
    line = assert_one_error_line(runner.invoke(app, ["train", *args, "--out", str(out)]), option)
    bare = option.lstrip("-")
    assert not re.search(rf"(?<![-\w]){bare} must", line), line  # "positions must be one of ..."
    assert "_" not in bare.replace("-", "_") or bare.replace("-", "_") not in line, line  # "d_model", "batch_size"
    assert not out.exists()


@pytest.mark.parametrize("args, option", [
    (["--d-model", "10000000"], "--d-model 10000000"),
    (["--layers", str(10**11)], "--layers 100000000000"),
    (["--batch-size", str(10**17)], f"--batch-size {10**17}"),
    (["--heads", "4", "--d-model", "4000000", "--layers", "3"], "--d-model 4000000"),
    (["--task", "recall", "--heads", str(10**6), "--d-model", str(10**6)], "--d-model 1000000 and --heads 1000000"),
])
def test_a_model_too_big_for_memory_is_refused_by_name_before_anything_is_built(tmp_path, monkeypatch, args, option):
    """The estimate comes from the options: no model, optimizer or tensor of that size is made."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before its size was checked")

    monkeypatch.setattr(_train, "GPT", no_model)
    out = tmp_path / "out"
    line = assert_one_error_line(runner.invoke(app, ["train", *args, "--out", str(out)]), option, "would take about",
                                 "of memory")
    assert line.endswith("choose a smaller " + " and ".join(part.split()[0] for part in option.split(" and ")))
    assert not out.exists()


def test_the_memory_limit_is_the_devices_and_names_the_option_that_dominates(tmp_path, monkeypatch, small_eval):
    """With a 2 GB machine, d_model 4096 (a 4 GB model with its optimizer state) is refused by
    --d-model, not by --batch-size; the same options fit a machine with 16 GB."""
    from attnlab.cli import _memory

    args = ["train", "--d-model", "4096", "--heads", "2", "--layers", "4", "--batch-size", "4", "--steps", "1"]
    monkeypatch.setattr(_memory, "total_memory", lambda device: 2 * 10**9)
    assert_one_error_line(runner.invoke(app, [*args, "--out", str(tmp_path / "a")]), "--d-model 4096:",
                          "2.0 GB of memory")
    class Built(Exception):
        pass

    def trainer(config, *, task):
        raise Built(config.d_model)

    monkeypatch.setattr(_memory, "total_memory", lambda device: 16 * 10**9)
    monkeypatch.setattr(_train, "Trainer", trainer)  # refused or not is all this test needs to know
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert isinstance(result.exception, Built) and result.exception.args == (4096,), result.output


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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A finished 6-step induction run: d_model 16, 2 heads in each layer, batch 4."""
    out = tmp_path_factory.mktemp("checkpoint")
    with pytest.MonkeyPatch.context() as patch:  # small_eval, for a module-scoped fixture
        for task, defaults in _train.TASK_DEFAULTS.items():
            patch.setitem(_train.TASK_DEFAULTS, task, {**defaults, "eval_sequences": 16})
        result = runner.invoke(app, ["train", "--steps", "6", *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("args, given, saved", [
    (["--task", "recall"], "--task recall", "--task induction"),
    (["--layers", "3"], "--layers 3", "--layers 2"),
    (["--heads", "2,1"], "--heads 2,1", "--heads 2"),
    (["--d-model", "32"], "--d-model 32", "--d-model 16"),
    (["--mlp"], "--mlp", "--attention-only"),
    (["--batch-size", "8"], "--batch-size 8", "--batch-size 4"),
    (["--lr", "0.1"], "--lr 0.1", "--lr 0.003"),
    (["--seed", "3"], "--seed 3", "--seed 0"),
    (["--positions", "learned"], "--positions learned", "--positions rope"),
    (["--text", "notes.txt"], "--text notes.txt", "no --text"),
])
def test_resume_refuses_an_option_that_conflicts_with_the_checkpoint_and_writes_nothing(checkpoint, args, given,
                                                                                        saved):
    before = _files(checkpoint)
    result = runner.invoke(app, ["train", "--resume", str(checkpoint), "--steps", "8", *args])
    assert_one_error_line(result, f"{given} conflicts with the checkpoint", f"trained with {saved}")
    assert _files(checkpoint) == before


def test_resume_takes_options_that_agree_with_the_checkpoint(checkpoint, tmp_path, small_eval):
    out = tmp_path / "more"
    result = runner.invoke(app, ["train", "--resume", str(checkpoint), "--steps", "7", "--out", str(out), "--task",
                                 "induction", "--heads", "2,2", "--d-model", "16", "--attention-only", "--seed", "0",
                                 "--lr", "0.003"])
    assert result.exit_code == 0, result.output
    assert "from step 6" in result.output and json.loads((out / "metrics.json").read_text())["steps"] == 7


def test_resume_refuses_steps_below_the_checkpoints_step_and_leaves_its_files_as_they_were(checkpoint):
    before = _files(checkpoint)
    result = runner.invoke(app, ["train", "--resume", str(checkpoint), "--steps", "3"])
    assert_one_error_line(result, "--steps 3", "step 6 of the checkpoint")
    assert _files(checkpoint) == before


@pytest.mark.parametrize("args", [[], ["--steps", "6"]])
def test_resuming_a_checkpoint_at_its_last_step_has_nothing_to_do(checkpoint, args):
    before = _files(checkpoint)
    result = runner.invoke(app, ["train", "--resume", str(checkpoint), *args])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Nothing to do") and "already at step 6" in result.output
    assert _files(checkpoint) == before


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
