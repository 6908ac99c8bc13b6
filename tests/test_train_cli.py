"""``attnlab train`` and ``attnlab generate``: outputs, Ctrl-C and resume, and one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch
from typer.testing import CliRunner

from attnlab.lab import train as _train
from attnlab.lab.cli import app
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
    (["--positions", "sinusoidal"], "--positions"), (["--positions", ""], "--positions"),
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

    monkeypatch.setattr(_train.loop, "GPT", no_model)  # the Trainer builds its model in attnlab.lab.train.loop
    out = tmp_path / "out"
    line = assert_one_error_line(runner.invoke(app, ["train", *args, "--out", str(out)]), option, "would take about",
                                 "of memory")
    assert line.endswith("choose a smaller " + " and ".join(part.split()[0] for part in option.split(" and ")))
    assert not out.exists()


def test_the_memory_limit_is_the_devices_and_names_the_option_that_dominates(tmp_path, monkeypatch, small_eval):
    """With a 2 GB machine, d_model 4096 (a 4 GB model with its optimizer state) is refused by
    --d-model, not by --batch-size; the same options fit a machine with 16 GB."""
    from attnlab.lab.cli import _memory

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


# --- sinks and softcap: training with them, and where the mass goes --------------------------------

@pytest.fixture(scope="module")
def sinks_checkpoint(tmp_path_factory):
    """A 2-step induction run with sinks and a softcap (d_model 16, 2 heads per layer)."""
    out = tmp_path_factory.mktemp("sinks")
    with pytest.MonkeyPatch.context() as patch:
        for task, defaults in _train.TASK_DEFAULTS.items():
            patch.setitem(_train.TASK_DEFAULTS, task, {**defaults, "eval_sequences": 16})
        result = runner.invoke(app, ["train", "--steps", "2", *TINY, "--sinks", "--softcap", "20", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def _sink_share_fp64(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """``(H, T)`` sink shares of a one-layer attention-only GPT on ``ids`` ``(T,)``, from its own
    weights and sink logits, in fp64 (softcap 20, causal, the sink as one more softmax column)."""
    (block,) = model.blocks  # one layer: its input is the embeddings
    attn, norm, T = block.attn, block.norm_attn, len(ids)
    x = model.tok_emb.weight[ids].double() + model.pos_emb.embedding.weight[:T].double()  # (T, d)
    h = torch.nn.functional.layer_norm(x, x.shape[-1:], norm.weight.double(), norm.bias.double(), norm.eps)
    qkv = h @ attn.in_proj_weight.double().T + attn.in_proj_bias.double()  # (T, 3d)
    q, k, _ = qkv.split(qkv.shape[-1] // 3, dim=-1)
    q, k = (t.view(T, attn.num_heads, -1).transpose(0, 1) for t in (q, k))  # (H, T, Dh)
    s = 20.0 * torch.tanh(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 / 20.0)  # (H, T, T)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    sink = attn.sinks.detach().double().view(-1, 1, 1).expand(-1, T, 1)  # (H, T, 1)
    return torch.softmax(torch.cat([s, sink], -1), -1)[..., -1].detach()  # (H, T)


def test_train_with_sinks_and_softcap_reports_each_heads_sink_share(sinks_checkpoint):
    out, output = sinks_checkpoint
    assert "positions, softcap 20, sinks;" in output and "sink share" in output
    model = GPT.from_pretrained(out)
    assert model.config["sinks"] is True and model.config["softcap"] == 20.0
    assert all(tuple(block.attn.sinks.shape) == (2,) for block in model.blocks)
    trained = torch.stack([block.attn.sinks.detach() for block in model.blocks])
    assert not torch.equal(trained, torch.zeros_like(trained))  # the sink logits learned something
    metrics = json.loads((out / "metrics.json").read_text())
    shares = torch.tensor(metrics["heads"]["sink_share"])  # (L, H)
    assert shares.shape == (2, 2) and bool(((shares > 0.001) & (shares < 1)).all())
    assert "The sink takes on average" in metrics["summary"]
    for layer, row in enumerate(metrics["heads"]["sink_share"]):
        for head, share in enumerate(row):
            assert re.search(rf"\n\s+{layer}\s+{head}\s.*\s{share:.3f}\s", output), (layer, head, share)


def test_head_scores_sink_share_equals_the_fp64_softmax_with_the_sink_column():
    torch.manual_seed(0)
    model = GPT(vocab_size=7, max_len=8, d_model=8, num_layers=1, num_heads=2, attention_only=True, sinks=True,
                softcap=20.0)
    with torch.no_grad():
        model.blocks[0].attn.sinks.copy_(torch.tensor([1.5, -0.5]))
    ids = torch.tensor([3, 1, 4, 1, 5, 6, 2, 0])
    expected = _sink_share_fp64(model, ids).mean(-1)  # (H,): mean over queries
    got = _train.head_scores(model, ids[None])["sink_share"]  # (L, H)
    torch.testing.assert_close(got[0].double(), expected, atol=1e-6, rtol=1e-6)
    assert float(expected.min()) > 0.05  # the sinks take a real share here


def test_explain_of_a_gpt_with_sinks_prints_the_sink_share_per_head(sinks_checkpoint, tmp_path):
    run, _ = sinks_checkpoint
    result = runner.invoke(app, ["explain", "--model", str(run), "3 17 5 9 3 17", "--query", "5",
                                 "--out", str(tmp_path), "--format", "html", "--no-color"])
    assert result.exit_code == 0, result.output
    assert "Sink share of '5'" in result.output
    model = GPT.from_pretrained(run).eval()
    with torch.no_grad():
        _, weights = model(torch.tensor([[3, 17, 5, 9, 3, 17]]), return_weights=True)
    rows = {int(m[1]): m.groups()[1:] for m in re.finditer(r"\n\s+(\d)\s+([0-9.]+) \(([0-9.]+)\)\s+([0-9.]+) \(([0-9.]+)\)",
                                                  result.output)}
    for layer, w in enumerate(weights):  # (1, H, T, T): the real keys' weights
        share = 1 - w[0].double().sum(-1)  # (H, T)
        for head in range(2):
            printed_query, printed_mean = float(rows[head][2 * layer]), float(rows[head][2 * layer + 1])
            assert printed_query == pytest.approx(float(share[head, 2]), abs=5e-4)
            assert printed_mean == pytest.approx(float(share[head].mean()), abs=5e-4)
    # The report holds the same table: head rows, layer columns, the query's share (the mean).
    page = (tmp_path / "report.html").read_text()
    assert "Where the mass goes: the sink" in page
    cells = re.findall(r'<td style="background: [^"]+">([0-9.]+) <span class="muted">\(([0-9.]+)\)</span></td>', page)
    assert len(cells) == 4  # 2 heads x 2 layers, row by row
    for (head, layer), (query, mean) in zip([(h, l) for h in range(2) for l in range(2)], cells):
        assert (query, mean) == rows[head][2 * layer: 2 * layer + 2]
    plain = runner.invoke(app, ["train", "--steps", "1", *TINY, "--out", str(tmp_path / "plain")])
    assert plain.exit_code == 0 and "sink share" not in plain.output


@pytest.mark.parametrize("args, words", [
    (["--softcap", "0"], ("--softcap must be a positive finite number", "0")),
    (["--softcap", "-3"], ("--softcap must be a positive finite number",)),
    (["--softcap", "nan"], ("--softcap must be a finite number",)),
    (["--softcap", "inf"], ("--softcap must be a finite number",)),
    (["--softcap", "big"], ("--softcap",)),
    (["--sinks", "--positions", "sideways"], ("--positions",)),
    # Regression: the latent and local layers' refusals came from the model, as a traceback.
    (["--sinks", "--layer-pattern", "GM", "--latent-dim", "8"], ("--sinks: not available on latent", "GM")),
    (["--softcap", "5", "--layer-pattern", "M", "--latent-dim", "8"], ("--softcap: not available on latent",)),
    (["--positions", "alibi", "--layer-pattern", "MG", "--latent-dim", "8", "--sinks"],
     ("--positions alibi, --sinks: not available on latent",)),
    (["--positions", "alibi", "--layer-pattern", "GL", "--window", "4"], ("--positions alibi", "local", "GL")),
])
def test_bad_softcap_and_sinks_options_are_one_error_line_and_write_nothing(tmp_path, args, words):
    out = tmp_path / "run"
    assert_one_error_line(runner.invoke(app, ["train", "--steps", "1", *TINY, *args, "--out", str(out)]), *words)
    assert not out.exists()


@pytest.mark.parametrize("args, given, saved", [
    (["--sinks"], "--sinks", "no --sinks"),
    (["--softcap", "30"], "--softcap 30.0", "no --softcap"),
])
def test_resume_refuses_sinks_or_softcap_the_checkpoint_was_not_trained_with(checkpoint, args, given, saved):
    before = _files(checkpoint)
    result = runner.invoke(app, ["train", "--resume", str(checkpoint), "--steps", "8", *args])
    assert_one_error_line(result, f"{given} conflicts with the checkpoint", f"trained with {saved}")
    assert _files(checkpoint) == before


# ----------------------------------------------------------------------------- across ranks
@pytest.mark.parametrize("args, words", [
    (["--context-parallel", "0"], ["--context-parallel", "positive"]),
    (["--context-parallel", "65"], ["--context-parallel", "at most 64"]),
    (["--context-parallel", "x"], ["--context-parallel"]),
    (["--cp-method", "ring"], ["--cp-method needs --context-parallel"]),
    (["--cp-ulysses", "2"], ["--cp-ulysses needs --context-parallel"]),
    (["--context-parallel", "2", "--cp-method", "tree"], ["--cp-method", "tree"]),
    (["--context-parallel", "2", "--cp-method", "hybrid"], ["--cp-method hybrid needs --cp-ulysses"]),
    (["--context-parallel", "2", "--cp-ulysses", "2"], ["--cp-ulysses is only for --cp-method hybrid"]),
    (["--context-parallel", "4", "--cp-method", "hybrid", "--cp-ulysses", "3"], ["--cp-ulysses 3", "divide"]),
    (["--context-parallel", "2", "--cp-method", "hybrid", "--cp-ulysses", "0"], ["--cp-ulysses", "positive"]),
    (["--context-parallel", "3"], ["--context-parallel 3", "sequence length 64", "multiple of 2 * world = 6"]),
    (["--context-parallel", "2", "--cp-method", "ulysses"], ["--heads 2,1", "multiple of 2", "--cp-method ring"]),
    (["--context-parallel", "4", "--cp-method", "hybrid", "--cp-ulysses", "2", "--heads", "2,1"],
     ["--cp-ulysses 2", "--heads 2,1"]),
    (["--context-parallel", "2", "--device", "meta"], ["--device meta", "gloo"]),
    (["--context-parallel", "2", "--layer-pattern", "GM", "--latent-dim", "4"],
     ["--context-parallel 2", "--layer-pattern GM", "latent (M) layers", "do not run context-parallel"]),
])
def test_bad_context_parallel_options_are_refused_before_any_rank_starts(tmp_path, monkeypatch, args, words):
    started = []
    monkeypatch.setattr("attnlab.distributed.launch.run_local", lambda *a, **k: started.append(a))
    out = tmp_path / "out"
    assert_one_error_line(runner.invoke(app, ["train", *args, "--out", str(out)]), *words)
    assert not started and not out.exists()


def test_a_rank_that_fails_leaves_no_empty_out_folder(tmp_path, monkeypatch):
    """A refusal raised inside the ranks (after --out was checked) is one error line, and the
    folder this command created for --out is gone again; a folder that existed stays."""
    from attnlab.distributed.launch import Outcome

    failed = [Outcome(rank=r, error="ValueError: refused on purpose", trace="") for r in range(2)]
    monkeypatch.setattr("attnlab.distributed.launch.run_local", lambda *a, **k: failed)
    out = tmp_path / "new" / "out"
    result = runner.invoke(app, ["train", "--context-parallel", "2", *TINY, "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.splitlines()[-1].startswith("error: rank 0: ValueError: refused on purpose")  # after the banner
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert runner.invoke(app, ["train", "--context-parallel", "2", *TINY, "--out", str(kept)]).exit_code == 2
    assert kept.is_dir() and not any(kept.iterdir())


def test_context_parallel_under_torchrun_must_name_its_world(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    result = runner.invoke(app, ["train", "--context-parallel", "2", "--out", str(tmp_path / "out")])
    assert_one_error_line(result, "--context-parallel 2", "WORLD_SIZE=4")


def test_each_rank_of_a_sharded_run_takes_the_single_process_steps_in_fp64():
    """What every rank of ``attnlab train --context-parallel 2`` runs, in fp64: the same losses as
    one process to 1e-10, on every rank, with a local layer (its window kept when sharded; it was
    trained as a global layer before), softcap and sinks."""
    from attnlab.distributed.launch import run_local

    config = _train.TrainConfig(task="induction", steps=3, batch_size=2, d_model=16, heads=2, eval_sequences=4,
                                warmup=2, layer_pattern="LG", window=2, softcap=5.0, sinks=True).resolved()
    single = _train.Trainer(config)
    single.model.double()
    want = [single.train_step()[0] for _ in range(3)]
    run = _train.ShardedRun(config=config, dtype="float64")
    outcomes = run_local(_train.train_sharded, world=2, args=(run,), timeout=120)
    assert all(o.ok for o in outcomes), [o.trace for o in outcomes]
    assert want[-1] != want[0]
    for outcome in outcomes:
        assert outcome.value["step"] == 3 and not outcome.value["interrupted"]
        assert outcome.value["train_loss"] == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_train_on_two_ranks_resumes_a_checkpoint_writes_it_once_and_matches_one_process(tmp_path, small_eval):
    """A checkpoint continued on two ranks (the sharding is not part of it) gives, in fp32, the
    losses of one process within float rounding; rank 0 alone writes the checkpoint back (the
    same files, nothing stray). The new-run path of each rank is the fp64 test above."""
    import shutil

    one, two = tmp_path / "one", tmp_path / "two"
    assert runner.invoke(app, ["train", "--steps", "2", *TINY, "--out", str(one)]).exit_code == 0
    shutil.copytree(one, two)
    for out, sharded in ((one, []), (two, ["--context-parallel", "2"])):
        result = runner.invoke(app, ["train", "--resume", str(out), "--steps", "4", *sharded])
        assert result.exit_code == 0, result.output
        assert "from step 2" in result.output
    assert "context parallel over 2 ranks (ring; local gloo processes)" in result.output.replace("\n", "")
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    assert len(b["history"]["train_loss"]) == 4 and b["steps"] == 4
    assert b["history"]["train_loss"] == pytest.approx(a["history"]["train_loss"], rel=1e-5)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


@pytest.mark.parametrize("lr", ["1e30", str(10**30)])
def test_a_learning_rate_that_diverges_is_one_error_line(tmp_path, small_eval, lr):
    """One step at lr 1e30 leaves NaN weights: the head analysis crashed with a traceback (exit 1)."""
    out = tmp_path / "out"
    result = runner.invoke(app, ["train", *TINY, "--steps", "1", "--lr", lr, "--out", str(out)])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: training diverged") and "smaller --lr" in last, result.output
    assert "Traceback" not in result.output


# ------------------------------------------------------------------ GPT options of 2026 (issue 44, item 3)
HEAD_OPTIONS = ["--layer-pattern", "GN", "--head-dim", "4", "--global-head-dim", "16", "--rope-fraction", "0.5",
                "--qk-norm", "olmo2", "--nope-temperature", "4,0.1"]


@pytest.fixture(scope="module")
def head_checkpoint(tmp_path_factory):
    """A 2-step run with every head option: heads of 4 (G: 16) features on a 16-wide model, half
    of each head rotated, OLMo-2's QK-norm, Llama 4's temperature on the N layer."""
    out = tmp_path_factory.mktemp("heads")
    with pytest.MonkeyPatch.context() as patch:
        for task, defaults in _train.TASK_DEFAULTS.items():
            patch.setitem(_train.TASK_DEFAULTS, task, {**defaults, "eval_sequences": 16})
        result = runner.invoke(app, ["train", "--steps", "2", *TINY, "--heads", "3", *HEAD_OPTIONS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_head_options_reach_the_model_and_the_banner(head_checkpoint):
    out, output = head_checkpoint
    assert ("layers GN, head dim 4, global head dim 16, rope fraction 0.5, qk-norm olmo2, NoPE temperature 4,0.1"
            in output), output
    model = GPT.from_pretrained(out)
    g, n = (block.attn for block in model.blocks)
    assert (g.head_dim, n.head_dim, g.num_heads) == (16, 4, 3)  # 3 heads need not divide --d-model 16
    assert g.rope.rotary_dim == 8 and g.q_norm.weight.shape == (48,) and n.k_norm.weight.shape == (12,)
    assert (type(n.positions).__name__, n.positions.floor_scale, n.positions.attn_scale) == ("QueryTemperature", 4, 0.1)
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["nope_temperature"] == [4, 0.1] and saved["qk_norm"] == "olmo2"


def test_resume_takes_the_head_options_it_was_trained_with_and_refuses_others(head_checkpoint, tmp_path,
                                                                              small_eval):
    out, _ = head_checkpoint
    more = tmp_path / "more"
    result = runner.invoke(app, ["train", "--resume", str(out), "--steps", "3", *HEAD_OPTIONS, "--out", str(more)])
    assert result.exit_code == 0, result.output
    before = _files(out)
    for args, given, saved in ((["--head-dim", "8"], "--head-dim 8", "--head-dim 4"),
                               (["--qk-norm", "gemma"], "--qk-norm gemma", "--qk-norm olmo2"),
                               (["--nope-temperature", "8,0.1"], "--nope-temperature 8,0.1",
                                "--nope-temperature 4,0.1")):
        result = runner.invoke(app, ["train", "--resume", str(out), "--steps", "3", *args])
        assert_one_error_line(result, f"{given} conflicts with the checkpoint", f"trained with {saved}")
    assert _files(out) == before


def test_resume_of_a_checkpoint_without_the_head_options_refuses_them(checkpoint):
    result = runner.invoke(app, ["train", "--resume", str(checkpoint), "--steps", "8", "--head-dim", "8"])
    assert_one_error_line(result, "--head-dim 8 conflicts with the checkpoint", "trained with no --head-dim")


@pytest.mark.parametrize("args, option, words", [
    (["--rope-fraction", "0.3"], "--rope-fraction", "0.3 of heads of width 8 is 2.4 features"),
    (["--rope-fraction", "0"], "--rope-fraction", "positive"),
    (["--rope-fraction", "1.5"], "--rope-fraction", "(0, 1]"),
    (["--rope-fraction", "nan"], "--rope-fraction", ""),
    (["--rope-fraction", "0.5", "--positions", "learned"], "--rope-fraction", "needs --positions rope"),
    (["--qk-norm", "olmo3"], "--qk-norm", "'qwen3', 'olmo2', 'gemma'"),
    (["--head-dim", "0"], "--head-dim", "positive"),
    (["--head-dim", "x"], "--head-dim", ""),
    (["--head-dim", "5"], "--head-dim", "even for rotary"),
    (["--head-dim", "8", "--layer-pattern", "GQ"], "--head-dim", "not of gated output"),
    (["--qk-norm", "gemma", "--layer-pattern", "GD"], "--qk-norm", "not of differential"),
    (["--global-head-dim", "8", "--layer-pattern", "L", "--window", "2"], "--global-head-dim", "G layers"),
    (["--global-head-dim", "-8"], "--global-head-dim", "positive"),
    (["--heads", "3", "--global-head-dim", "8", "--layer-pattern", "LG", "--window", "2"], "--heads",
     "--d-model (16) must be a multiple of --heads (3)"),
    (["--nope-temperature", "4"], "--nope-temperature", "FLOOR,SCALE"),
    (["--nope-temperature", "4,x"], "--nope-temperature", "FLOOR,SCALE"),
    (["--nope-temperature", "0,0.1", "--layer-pattern", "N"], "--nope-temperature", "FLOOR > 0"),
    (["--nope-temperature", "4,inf", "--layer-pattern", "N"], "--nope-temperature", "FLOOR,SCALE"),
    (["--nope-temperature", "4,0.1"], "--nope-temperature", "N layers"),
])
def test_bad_head_options_are_refused_by_their_flag_names(tmp_path, args, option, words):
    out = tmp_path / "out"
    line = assert_one_error_line(runner.invoke(app, ["train", *TINY, *args, "--out", str(out)]), option, words)
    for name in ("rope_fraction", "qk_norm", "head_dim", "nope_temperature", "num_heads", "d_model", "positions="):
        assert name not in line, line
    assert not out.exists()


def test_train_help_names_every_layer_pattern_letter_gpt_accepts():
    import inspect

    from attnlab.lab.cli.train_cmd import train
    from attnlab.models.gpt import LAYER_TABLE

    text = inspect.signature(train).parameters["layer_pattern"].default.help
    missing = [letter for letter in LAYER_TABLE if not re.search(rf"(: |, ){letter} ", text)]
    assert missing == [], text
