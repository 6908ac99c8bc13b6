"""attnlab.lab.train: the tasks' data, deterministic training and resume, head scores and ablation."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from attnlab import io
from attnlab.models import GPT
from attnlab.lab.trained import pad_heads
from attnlab.lab.train import (IGNORE, TextTask, TrainConfig, Trainer, ablate_heads, analyze, evaluate,
                           head_scores, make_task, memory_estimate, read_checkpoint, summarize, write_figures)

TINY = dict(d_model=16, heads=2, batch_size=4, eval_sequences=16, eval_every=2)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: a second thread only waits (and on a shared 2-core machine, much longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- data
def test_induction_batches_repeat_a_segment_of_distinct_tokens_and_score_its_continuation():
    task = make_task("induction")
    inputs, targets = task.batch(16, generator())
    for row, target in zip(inputs.tolist(), targets.tolist()):
        scored = [t for t, y in enumerate(target) if y != IGNORE]
        assert task.min_segment - 1 <= len(scored) <= task.max_segment - 1
        for t in scored:
            earlier = [j for j in range(t) if row[j] == row[t]]
            assert len(earlier) == 1  # the current token occurred exactly once before
            assert target[t] == row[earlier[0] + 1]  # and the answer is what followed it
            assert target[t] == row[t + 1]


def test_recall_reverse_and_sort_targets_follow_their_definitions():
    recall = make_task("recall")
    n = recall.pairs
    inputs, targets = recall.batch(8, generator())
    for row, target in zip(inputs.tolist(), targets.tolist()):
        pairs = dict(zip(row[0:2 * n:2], row[1:2 * n:2]))
        assert len(pairs) == n and all(k < recall.num_keys <= v for k, v in pairs.items())  # distinct keys
        assert row[2 * n] == recall.vocab_size - 1  # the separator
        asked = [row[t] for t, y in enumerate(target) if y != IGNORE]
        assert len(asked) == len(set(asked)) == recall.queries  # each key asked once: no answer to copy
        for t, y in enumerate(target):
            if y != IGNORE:
                assert t > 2 * n and y == pairs[row[t]]
    for name, reference in (("reverse", lambda x: x[::-1]), ("sort", sorted)):
        task = make_task(name)
        inputs, targets = task.batch(8, generator())
        for row, target in zip(inputs.tolist(), targets.tolist()):
            n = task.length
            assert row[n] == task.num_symbols  # the separator
            assert [y for y in target if y != IGNORE] == list(reference(row[:n]))


def test_recall_never_shows_the_queried_values():
    # Regression: each query was followed by its answer, so a model could rule out the values
    # already given and guess among the rest; it sat at that level (16-42 %) and never learned
    # to look the key up. After the separator only keys may appear.
    task = make_task("recall")
    inputs, _ = task.batch(64, generator())
    assert bool((inputs[:, 2 * task.pairs + 1:] < task.num_keys).all())


@pytest.mark.parametrize("options, name", [(dict(pairs=4, queries=5), "queries"),
                                           (dict(num_keys=4, pairs=5, queries=5), "pairs")])
def test_recall_sizes_that_cannot_work_are_refused_by_name(options, name):
    from attnlab.lab.train import RecallTask

    with pytest.raises(ValueError, match=rf"^{name} "):
        RecallTask(**options)


def test_text_task_splits_and_refuses_bad_files(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld " * 60, encoding="utf-8")
    task = TextTask.from_file(path, seq_len=16)
    inputs, targets = task.batch(4, generator())
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert "".join(task.chars[i] for i in task.encode("wörld").tolist()) == "wörld"
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1") * 100)
    for name, match in (("empty.txt", "is empty"), ("latin1.txt", "not UTF-8"), ("missing.txt", "cannot be read")):
        with pytest.raises(ValueError, match=match) as info:
            TextTask.from_file(tmp_path / name)
        assert name in str(info.value)


def test_training_batches_depend_only_on_seed_and_step_and_never_match_held_out_data():
    a, b = Trainer(TrainConfig(**TINY)), Trainer(TrainConfig(**TINY))
    assert torch.equal(a.train_batch(7)[0], b.train_batch(7)[0])
    assert not torch.equal(a.train_batch(7)[0], a.train_batch(8)[0])
    held_out = {tuple(r) for r in a.eval_set()[0].tolist()}
    assert not held_out & {tuple(r) for s in range(20) for r in a.train_batch(s)[0].tolist()}


# ------------------------------------------------------------------------- config
@pytest.mark.parametrize("heads, layers, match", [
    ((2, 1), 3, r"heads must have one entry per layer \(3\), got 2"),
    ((2, 0), 2, r"heads\[1\] must be a positive int, got 0"),
    ((2, 3), 2, r"d_model \(16\) must be a multiple of heads\[1\] \(3\)"),
    (3, 2, r"d_model \(16\) must be a multiple of heads \(3\)"),
    ("2,1", 2, r"heads must be a positive int or one per layer"),
])
def test_bad_head_counts_are_refused_naming_heads(heads, layers, match):
    error = TypeError if isinstance(heads, str) else ValueError  # a wrong kind is a TypeError
    with pytest.raises(error, match=match):
        TrainConfig(**{**TINY, "heads": heads, "layers": layers}).resolved()


def test_a_per_layer_default_fits_its_depth_and_gives_other_depths_its_first_count():
    assert TrainConfig().resolved().heads == (2, 1)
    assert TrainConfig(layers=1).resolved().heads == 2  # the one-layer control keeps two heads
    assert TrainConfig(layers=3).resolved().heads == 2
    assert TrainConfig(layers=1, heads=(1,)).resolved().heads == (1,)  # given: used as given
    assert TrainConfig(heads=[4, 2]).resolved().heads == (4, 2)  # a list read back from config.json
    assert Trainer(TrainConfig(layers=1, d_model=16, eval_sequences=4)).model.heads_per_layer == (2,)
    assert Trainer(TrainConfig(d_model=16, eval_sequences=4)).model.heads_per_layer == (2, 1)


# ----------------------------------------------------------------------- training
def test_loss_goes_down():
    run = Trainer(TrainConfig(task="sort", steps=40, lr=1e-2, **TINY))
    run.train()
    first, last = run.history["train_loss"][0], sum(run.history["train_loss"][-5:]) / 5
    assert last < 0.8 * first


def test_same_seed_same_run_and_another_seed_another():
    runs = [Trainer(TrainConfig(task="sort", steps=5, seed=s, **TINY)) for s in (1, 1, 2)]
    for run in runs:
        run.train()
    assert runs[0].history["train_loss"] == runs[1].history["train_loss"]
    assert runs[0].history["train_loss"] != runs[2].history["train_loss"]


def test_checkpoint_round_trip_is_bitwise(tmp_path):
    run = Trainer(TrainConfig(task="recall", steps=3, **TINY))
    run.train(out=tmp_path)
    again = Trainer.resume(tmp_path)
    assert again.step == 3
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(tensor, again.model.state_dict()[name]), name
    saved, loaded = run.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for index in saved:
        for key in saved[index]:
            assert torch.equal(saved[index][key], loaded[index][key]), (index, key)


@pytest.mark.parametrize("task, heads", [("induction", 2), ("sort", 2), ("induction", (2, 1))])
def test_resume_continues_at_the_same_step_with_the_same_losses_as_an_uninterrupted_run(tmp_path, task, heads):
    options = {**TINY, "heads": heads}
    whole = Trainer(TrainConfig(task=task, steps=6, **options))
    whole.train()
    part = Trainer(TrainConfig(task=task, steps=6, **options))
    result = part.train(should_stop=lambda: part.step == 3, out=tmp_path)
    assert result.interrupted and result.step == 3 and not result.metrics["finished"]
    resumed = Trainer.resume(tmp_path)
    assert resumed.step == 3 and resumed.config.heads == heads
    resumed.train()
    assert resumed.history["train_loss"] == whole.history["train_loss"]  # exactly, every step
    assert resumed.history["eval_accuracy"][-1] == whole.history["eval_accuracy"][-1]
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


@pytest.mark.parametrize("pattern", ["RG", "KG"])
def test_a_hybrid_of_recurrent_and_softmax_layers_trains_and_resumes_as_an_uninterrupted_run(tmp_path, pattern):
    """Gated DeltaNet (R) and KDA (K) layers beside a global one: the checkpoint holds their weights and
    optimizer state, and a resumed run's losses equal an uninterrupted one's, step by step."""
    options = {**TINY, "layers": 2, "layer_pattern": pattern}
    whole = Trainer(TrainConfig(task="induction", steps=4, **options))
    whole.train()
    part = Trainer(TrainConfig(task="induction", steps=4, **options))
    part.train(should_stop=lambda: part.step == 2, out=tmp_path)
    resumed = Trainer.resume(tmp_path)
    assert resumed.step == 2 and resumed.model.layer_kinds == tuple(pattern)
    resumed.train()
    assert resumed.history["train_loss"] == whole.history["train_loss"]
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


def test_evaluate_scores_only_the_scored_positions():
    torch.manual_seed(0)
    model = GPT(vocab_size=6, max_len=5, d_model=8, num_layers=1, num_heads=2).eval()
    inputs = torch.randint(0, 6, (3, 5))
    targets = torch.full((3, 5), IGNORE)
    targets[:, 2] = 1
    with torch.no_grad():
        logits = model(inputs)[:, 2]  # (3, V)
    expected_loss = torch.nn.functional.cross_entropy(logits, torch.ones(3, dtype=torch.long)).item()
    loss, accuracy = evaluate(model, inputs, targets)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert accuracy == pytest.approx((logits.argmax(-1) == 1).float().mean().item())


# --------------------------------------------------------------------- the circuit
def _brute_force_scores(weights, inputs):
    """The definitions, one query at a time."""
    L, H = weights.shape[1:3]
    previous = torch.zeros(L, H)
    induction = torch.zeros(L, H)
    B, T = inputs.shape
    n_prev = n_ind = 0
    for b in range(B):
        for t in range(1, T):
            previous += weights[b, :, :, t, t - 1]
            n_prev += 1
            earlier = [j for j in range(t - 1) if inputs[b, j] == inputs[b, t]]
            if earlier:
                induction += weights[b, :, :, t, earlier[-1] + 1]
                n_ind += 1
    return previous / n_prev, induction / n_ind


def test_head_scores_match_their_definitions():
    torch.manual_seed(0)
    model = GPT(vocab_size=5, max_len=12, d_model=16, num_layers=2, num_heads=4).eval()
    inputs = torch.randint(0, 5, (3, 12))
    scores = head_scores(model, inputs)
    with torch.no_grad():
        weights = torch.stack(model(inputs, return_weights=True)[1], dim=1)  # (B, L, H, T, T)
    previous, induction = _brute_force_scores(weights, inputs)
    torch.testing.assert_close(scores["previous_token"], previous)
    torch.testing.assert_close(scores["induction"], induction)


def test_head_scores_of_layers_with_different_head_counts_match_their_definitions():
    torch.manual_seed(0)
    model = GPT(vocab_size=5, max_len=12, d_model=16, num_layers=3, num_heads=(4, 1, 2)).eval()
    inputs = torch.randint(0, 5, (3, 12))
    scores = head_scores(model, inputs)
    with torch.no_grad():
        weights = model(inputs, return_weights=True)[1]  # L x (B, H_l, T, T)
    assert scores["induction"].shape == scores["previous_token"].shape == (3, 4)
    for layer, w in enumerate(weights):
        count = w.shape[1]
        previous, induction = _brute_force_scores(w[:, None], inputs)  # (1, H_l)
        torch.testing.assert_close(scores["previous_token"][layer, :count], previous[0])
        torch.testing.assert_close(scores["induction"][layer, :count], induction[0])
        torch.testing.assert_close(scores["weights"][layer, :count], w[0])
        for name in ("previous_token", "induction", "weights"):  # a missing head is NaN, never a score
            assert bool(scores[name][layer, count:].isnan().all()), (name, layer)


@pytest.mark.parametrize("heads", [4, (4, 2)])
def test_head_ablation_equals_zeroing_that_heads_columns_of_out_proj(heads):
    torch.manual_seed(0)
    model = GPT(vocab_size=7, max_len=10, d_model=16, num_layers=2, num_heads=heads).eval()
    inputs = torch.randint(0, 7, (32, 10))
    with torch.no_grad():  # the model's own predictions: every prediction an ablation changes counts
        targets = model(inputs).argmax(-1)
    ablated = ablate_heads(model, inputs, targets)
    for layer, count in enumerate(model.heads_per_layer):
        width = 16 // count  # this layer's head_dim
        for head in range(count):
            copy_ = copy.deepcopy(model)
            with torch.no_grad():  # the head's context vector only reaches the output through these columns
                copy_.blocks[layer].attn.out_proj.weight[:, head * width:(head + 1) * width] = 0
            assert float(ablated[layer, head]) == pytest.approx(evaluate(copy_, inputs, targets)[1])
        assert bool(ablated[layer, count:].isnan().all())
    assert bool((ablated < 1).any())  # the ablations do change predictions
    # hooks removed: nothing left behind
    torch.testing.assert_close(ablate_heads(model, inputs, targets), ablated, rtol=0, atol=0, equal_nan=True)


def test_summary_names_the_induction_and_previous_token_heads_only_when_they_score():
    scores = {"previous_token": torch.tensor([[0.1, 0.92], [0.0, 0.0]]),
              "induction": torch.tensor([[0.0, 0.0], [0.85, 0.2]])}
    text = summarize("induction", 0.995, scores, torch.tensor([[0.9, 0.05], [0.12, 0.99]]))
    assert "Layer 1 head 0 is an induction head (induction score 0.85; accuracy left without it: 12.0 %)" in text
    assert "Layer 0 head 1 is a previous-token head (previous-token score 0.92" in text
    weak = summarize("induction", 0.02, {k: v / 10 for k, v in scores.items()}, torch.zeros(2, 2))
    assert "No head is an induction head yet" in weak


def test_summary_of_layers_with_different_head_counts_never_names_a_missing_head():
    # torch.argmax over layer 1's (0.85, NaN) would pick the missing head 1
    scores = {"previous_token": pad_heads([torch.tensor([0.1, 0.9]), torch.tensor([0.2])]),
              "induction": pad_heads([torch.tensor([0.0, 0.1]), torch.tensor([0.85])])}
    ablated = pad_heads([torch.tensor([0.97, 0.2]), torch.tensor([0.1])])
    text = summarize("induction", 0.99, scores, ablated)
    assert "Layer 1 head 0 is an induction head (induction score 0.85; accuracy left without it: 10.0 %)" in text
    assert "Layer 0 head 1 is a previous-token head (previous-token score 0.90; accuracy left without it: 20.0 %)" in text
    assert "without L0H1 it is 20.0 % (L0H1 is a previous-token head" in text and "nan" not in text
    assert "without L1H0 it is 10.0 % (L1H0 is an induction head" in text


def test_the_ablation_sentence_says_the_accuracy_left_and_what_each_costly_head_does():
    # Regression: "Heads whose ablation costs more than 5 points: L0H0 (6.7 %), L0H1 (4.0 %), L1H0 (3.5 %)"
    # read as costs of 6.7 points where 6.7 % is the accuracy LEFT (of 100 %), and L0H1, which the task
    # needs as much, was never explained. The figures are the notebook's trained GPT's.
    scores = {"previous_token": torch.tensor([[0.9713, 0.0073], [0.1064, float("nan")]]),
              "current_token": torch.tensor([[0.0287, 0.9927], [0.05, float("nan")]]),
              "induction": torch.tensor([[0.0374, 0.0001], [0.9624, float("nan")]])}
    ablated = torch.tensor([[0.067, 0.0396], [0.0347, float("nan")]])
    text = summarize("induction", 1.0, scores, ablated)
    sentence = text[text.index("Ablating one head"):]
    assert sentence.startswith("Ablating one head at a time (its output zeroed) and measuring the accuracy left, "
                               "against the full model's 100.0 %: without L0H0 it is 6.7 % (L0H0 is a previous-token "
                               "head, score 0.97")
    assert "without L0H1 it is 4.0 % (L0H1 is a current-token head, score 0.99: it attends to the token itself" in text
    assert "without L1H0 it is 3.5 % (L1H0 is an induction head, score 0.96" in text
    figures = [float(x) for x in re.findall(r"without L\dH\d it is ([\d.]+) %", sentence)]
    assert figures == [round(100 * float(a), 1) for a in (ablated[0, 0], ablated[0, 1], ablated[1, 0])]
    assert "costs more than 5 points:" not in text
    unknown = summarize("induction", 1.0, {k: v * 0.1 for k, v in scores.items()}, ablated)
    assert "(L0H1 is none of these roles: previous-token score 0.00, induction score 0.00, current-token score 0.10)" \
        in unknown


def test_head_scores_give_the_weight_each_query_puts_on_itself():
    model = GPT(vocab_size=5, max_len=6, d_model=8, num_layers=2, num_heads=(2, 1))
    inputs = torch.tensor([[1, 2, 3, 1, 2, 3], [0, 4, 4, 0, 1, 2]])
    with torch.no_grad():
        _, weights = model(inputs, return_weights=True)
    scores = head_scores(model, inputs)
    for layer, w in enumerate(weights):  # (B, H, T, T): the diagonal, averaged over batch rows and queries
        expected = torch.stack([w[:, h].double().diagonal(dim1=-2, dim2=-1).mean() for h in range(w.shape[1])])
        torch.testing.assert_close(scores["current_token"][layer, :w.shape[1]].double(), expected, atol=1e-6, rtol=0)
    assert bool(scores["current_token"][1, 1].isnan())


@pytest.mark.parametrize("induction, names", [([[0.9, 0.0], [0.6, 0.7]], "L1H0, L1H1"),
                                               ([[0.0, 0.0], [0.1, 0.8]], "L1H1")])
def test_analysis_ablates_the_later_layers_induction_heads_together(monkeypatch, induction, names):
    import attnlab.lab.train.analysis as train_module  # analyze reads head_scores here

    run = Trainer(TrainConfig(steps=3, **TINY))
    run.train()
    scores = head_scores(run.model, run.eval_set()[0][:4])
    scores["induction"] = torch.tensor(induction)  # a layer-0 head is never counted
    monkeypatch.setattr(train_module, "head_scores", lambda model, inputs: scores)
    analysis = analyze(run)
    assert analysis["induction_heads_ablated"]["heads"] == names
    zeroed = copy.deepcopy(run.model)
    with torch.no_grad():
        for head in (0, 1) if "," in names else (1,):
            zeroed.blocks[1].attn.out_proj.weight[:, head * 8:(head + 1) * 8] = 0
    inputs, targets = run.eval_set()
    assert analysis["induction_heads_ablated"]["accuracy"] == pytest.approx(evaluate(zeroed, inputs, targets)[1],
                                                                            abs=1e-4)
    alone = [100 * a for a in analysis["heads"]["ablation_accuracy"][1]]
    shared = f"ablating one alone leaves {min(alone):.1f}-{max(alone):.1f} %"
    assert (shared in analysis["summary"]) == ("," in names)


def test_analysis_and_figures_of_a_tiny_run(tmp_path):
    run = Trainer(TrainConfig(steps=2, **TINY))
    run.train()
    analysis = analyze(run, sequences=4)
    assert len(analysis["heads"]["induction"]) == 2 and len(analysis["heads"]["induction"][0]) == 2
    names = [p.name for p in write_figures(run, analysis, tmp_path)]
    assert names == ["curves.png", "heads.png", "attention-layer0.png", "attention-layer1.png"]
    assert all((tmp_path / n).read_bytes()[:4] == b"\x89PNG" for n in names)


def test_analysis_and_figures_of_a_tiny_run_with_a_head_count_per_layer(tmp_path):
    run = Trainer(TrainConfig(steps=2, **{**TINY, "heads": (2, 1)}))
    run.train()
    analysis = analyze(run, sequences=4)
    heads = analysis["heads"]
    json.dumps(heads, allow_nan=False)  # raises on NaN
    assert all([len(row) for row in heads[name]] == [2, 1] for name in heads)
    scores = head_scores(run.model, run.eval_set()[0][:4])
    assert heads["induction"] == [[round(float(v), 4) for v in row[:n]] for row, n in zip(scores["induction"], (2, 1))]
    inputs, targets = run.eval_set()
    for layer, head, width in ((0, 1, 8), (1, 0, 16)):
        zeroed = copy.deepcopy(run.model)
        with torch.no_grad():
            zeroed.blocks[layer].attn.out_proj.weight[:, head * width:(head + 1) * width] = 0
        assert heads["ablation_accuracy"][layer][head] == pytest.approx(evaluate(zeroed, inputs, targets)[1], abs=1e-4)
    assert "L1H1" not in analysis["summary"] and "head 1 is an induction" not in analysis["summary"]
    names = [p.name for p in write_figures(run, analysis, tmp_path)]
    assert names == ["curves.png", "heads.png", "attention-layer0.png", "attention-layer1.png"]


def test_saved_checkpoint_is_a_loadable_gpt(tmp_path):
    run = Trainer(TrainConfig(task="reverse", steps=1, **TINY))
    run.train(out=tmp_path)
    model = GPT.from_pretrained(tmp_path)
    assert model.extra["task"] == "reverse" and model.extra["step"] == 1
    io.check_safetensors(tmp_path / "optimizer.safetensors")
    inputs = run.eval_set()[0][:2]
    with torch.no_grad():
        assert torch.equal(model(inputs), run.model.eval()(inputs))


def test_a_checkpoint_whose_header_length_ends_in_0x80_still_loads(tmp_path):
    # Regression: attnlab.io took a safetensors file whose first byte (the header length's low
    # byte) is 0x80 for a pickle; the optimizer file of one training run had that header length.
    import safetensors.torch

    tensors = {"w": torch.zeros(1)}
    pad = next(p for p in range(256) if safetensors.torch.save(tensors, metadata={"p": "x" * p})[:1] == b"\x80")
    path = tmp_path / "a.safetensors"
    path.write_bytes(safetensors.torch.save(tensors, metadata={"p": "x" * pad}))
    assert path.read_bytes()[:1] == b"\x80"
    assert torch.equal(io.load_state_dict(path)["w"], tensors["w"])


def _png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]  # PNG signature, IHDR length and type, then width and height
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_heads_figure_labels_every_real_head_with_its_role_score_and_ablation(tmp_path, monkeypatch):
    """heads.png: one panel per real head (ragged layers: none for a missing head), each titled
    with its head, its role and score from the analysis and its ablation figure; a colour bar;
    a size a person can read."""
    import attnlab.lab.train.report as train_module  # write_figures reads save_figure here

    run = Trainer(TrainConfig(steps=2, **{**TINY, "heads": (2, 1)}))
    run.train()
    analysis = analyze(run, sequences=4)
    # Scores injected so that every kind of caption shows: a previous-token head, a head with
    # no role (whose best score is an induction score, below the threshold), an induction head.
    analysis["heads"] = {"previous_token": [[0.91, 0.12], [0.3]], "induction": [[0.02, 0.34], [0.87]],
                         "ablation_accuracy": [[0.25, 0.5], [0.125]]}
    figures, real_save = {}, train_module.save_figure

    def keep_and_save(fig, path, **options):
        figures[path.name] = fig
        return real_save(fig, path, **options)

    monkeypatch.setattr(train_module, "save_figure", keep_and_save)
    write_figures(run, analysis, tmp_path)
    fig = figures["heads"]
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 3  # 2 + 1 real heads, no empty panel
    titles = [ax.get_title() for ax in panels]
    assert titles == ["head 0\nprevious-token 0.91\naccuracy if ablated: 25.0 %",
                      "head 1\nno role (prev 0.12, ind 0.34)\naccuracy if ablated: 50.0 %",
                      "head 0\ninduction 0.87\naccuracy if ablated: 12.5 %"]
    assert [ax.get_ylabel() for ax in panels if ax.get_ylabel()] == ["layer 0\n(2 heads)", "layer 1\n(1 head)"]
    bars = [ax for ax in fig.axes if ax.get_label() == "colour bar"]
    assert len(bars) == 1 and "attention weight" in bars[0].get_ylabel()
    assert "induction" in fig._suptitle.get_text() and f"step {run.step}" in fig._suptitle.get_text()
    width, height = _png_size(tmp_path / "heads.png")
    assert width >= 500 and height >= 400, (width, height)


@pytest.mark.parametrize("task, options", [
    ("induction", dict(heads=(2, 1))), ("recall", dict(layers=3, heads=4, d_model=32)),
    ("reverse", dict(positions="learned")), ("sort", dict(attention_only=True, heads=(4, 2))),
])
def test_memory_estimate_counts_the_models_real_parameters(task, options):
    """The estimate's parameter part is 16 bytes (weights, gradients, AdamW's two moments in fp32)
    per parameter of the GPT the trainer really builds; the activations grow with the batch."""
    config = TrainConfig(task=task, eval_sequences=4, **options)
    run = Trainer(config)
    parts = memory_estimate(config, vocab_size=run.task.vocab_size, seq_len=run.task.seq_len)
    assert parts["parameters"] == 16 * sum(p.numel() for p in run.model.parameters())
    bigger = memory_estimate(TrainConfig(task=task, batch_size=2 * run.config.batch_size, **options),
                             vocab_size=run.task.vocab_size, seq_len=run.task.seq_len)
    assert bigger["parameters"] == parts["parameters"] and bigger["activations"] == 2 * parts["activations"]


def test_memory_estimate_of_every_tasks_default_model_is_small():
    """Normal sizes are never refused: every task's default needs well under 1 GB."""
    for task in ("induction", "recall", "reverse", "sort"):
        t = make_task(task)
        assert sum(memory_estimate(TrainConfig(task=task), vocab_size=t.vocab_size, seq_len=t.seq_len).values()) < 1e9
    assert sum(memory_estimate(TrainConfig(task="text"), vocab_size=200, seq_len=128).values()) < 1e9


def test_resume_refuses_a_total_below_the_checkpoints_step_and_writes_nothing(tmp_path):
    run = Trainer(TrainConfig(steps=4, **TINY))
    run.train(out=tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"steps \(3\) must be at least the checkpoint's step \(4\)"):
        Trainer.resume(tmp_path, steps=3)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    config, step, chars = read_checkpoint(tmp_path)
    assert (config, step, chars) == (run.config, 4, None)
