"""The notebooks in notebooks/ run: each executed top to bottom by nbclient on an ipykernel of the venv.

A cell that raises fails its test (CellExecutionError, shown with the cell and its traceback); so does a
reproduced number that drifts from the tutorial's (every ``compare_printed`` output must say it
matches). Each notebook runs under NOTEBOOK_SECONDS; the set is sized to run within 2 minutes on 2
cores. The notebooks are stored without outputs, one per tutorial, named by its title, plus
"Attention in a real model".

Outputs are clean: no cell writes to stderr and no output holds warning text. "Attention in a real
model" trains its GPT for as many steps as its cell tagged "parameters" says (``steps = None``: the
full run a learner gets); the suite rewrites that cell to a short run and checks its outputs. The
full run is checked by an opt-in test (``ATTNLAB_FULL_NOTEBOOK=1``; about a minute).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from _notebooks import CellExecutionError, execute, nbformat

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
TUTORIALS = ("The Clear Tutorial for Attention Mechanism in Transformers", "Attention for your Transformers",
             "Causal Self Attention", "Mathematical trick in self-attention",
             "Self-Attention and Multi-head Attention Mechanism")
NOTEBOOK_SECONDS = 60  # one notebook, kernel start included (alone: 6-8 s a tutorial, 17-25 s the real model)
SHORT_STEPS = 100  # the suite's run of the real-model notebook's GPT (the learner's: its full default)
# Warning text in an output: a Python warning's category (UserWarning, TqdmWarning, ...) or "warning:" /
# "WARNING" as loggers write it.
WARNING_TEXT = re.compile(r"\w*Warning\b|\bwarning:|\bWARNING\b")


LESSONS = ("Attention in a real model", "From attention to FlashAttention", "Attention in 2026 models")


def test_one_notebook_per_tutorial_and_the_lessons():
    titles = [nbformat.read(path, as_version=4).cells[0].source.splitlines()[0].removeprefix("# ")
              for path in NOTEBOOKS]
    assert titles == [*TUTORIALS, *LESSONS]
    assert [path.stem.split(" ", 1)[1] for path in NOTEBOOKS] == titles


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem.split(" ", 1)[0])
def test_notebooks_are_stored_without_outputs(path):
    node = nbformat.read(path, as_version=4)
    nbformat.validate(node)
    code = [cell for cell in node.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)


@pytest.mark.parametrize("title", ["real model", "2026 models"])
def test_the_learner_gets_the_full_run(title):
    """A stored notebook that trains runs its full run: one "parameters" cell, ``steps = None``, and no
    environment variable that could choose another."""
    node = nbformat.read(next(path for path in NOTEBOOKS if path.stem.endswith(title)), as_version=4)
    tagged = [cell.source for cell in node.cells if "parameters" in cell.metadata.get("tags", [])]
    assert tagged == ["steps = None  # None: the full run"]
    assert not any("environ" in cell.source or "ATTNLAB_" in cell.source for cell in node.cells)


def _with_steps(path: Path, steps: int | None):
    """The notebook at ``path``, its cell tagged "parameters" (if any) set to ``steps = <steps>``."""
    node = nbformat.read(path, as_version=4)
    for cell in node.cells:
        if "parameters" in cell.metadata.get("tags", []):
            assert cell.source.startswith("steps = None"), cell.source  # the learner's full run
            cell.source = f"steps = {steps}  # the test suite's short run"
    return node


def _texts(cell) -> list[str]:
    """Every output of a code cell as text: streams, plain text and HTML."""
    return ["".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
            + "".join(output.get("data", {}).get("text/html", "")) for output in cell.outputs]


def _dirty_outputs(path: Path, node) -> list[str]:
    """``'<notebook> cell <n>: ...'`` for each output written to stderr or holding warning text."""
    found = []
    for number, cell in enumerate(node.cells):
        if cell.cell_type != "code":
            continue
        for output, text in zip(cell.outputs, _texts(cell)):
            if output.get("name") == "stderr":
                found.append(f"{path.name} cell {number}: stderr {text[:300]!r}")
            elif WARNING_TEXT.search(text):
                found.append(f"{path.name} cell {number}: warning text {WARNING_TEXT.search(text).group()!r} "
                             f"in {text[:300]!r}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem.split(" ", 1)[0])
def test_notebook_runs(path, tmp_path):
    started = time.perf_counter()
    node = execute(_with_steps(path, SHORT_STEPS), timeout=NOTEBOOK_SECONDS, cwd=tmp_path)
    seconds = time.perf_counter() - started
    assert seconds <= NOTEBOOK_SECONDS, f"{path.name} took {seconds:.1f} s"
    assert not _dirty_outputs(path, node), "\n".join(_dirty_outputs(path, node))
    texts = [text for cell in node.cells if cell.cell_type == "code" for text in _texts(cell)]
    # comparisons as printed or displayed; a fast walk's view shows its differences in a table of its own
    compared = [text for text in texts if "max |difference|" in text and not text.startswith("<Walk:")]
    assert all("matches" in text and "DOES NOT MATCH" not in text for text in compared), compared
    if path.stem.endswith("FlashAttention"):
        return _check_the_flash_notebook(texts, compared)
    if path.stem.endswith("2026 models"):
        return _check_the_2026_notebook(texts)
    if not path.stem.endswith("real model"):
        assert compared, "a tutorial notebook shows the tutorial's printed numbers next to attnlab's"
        return
    progress = [text for text in texts if "attnlab-train-progress" in text]
    assert len(progress) == 1, "one progress display, updated in place"
    assert f"step {SHORT_STEPS} / {SHORT_STEPS}" in progress[0] and "<svg" in progress[0]
    assert any(re.match(rf"{SHORT_STEPS} steps in [\d.]+ s, held-out accuracy [\d.]+ %", text) for text in texts)
    assert any(text.startswith("Held-out accuracy") for text in texts), "the analysis' summary"
    _check_the_ablation_summary(texts)


def _check_the_flash_notebook(texts: list[str], compared: list[str]) -> None:
    """The online softmax, the flash walks and the four backends each printed as matching; the tile counts
    are the causal grid's (6 tokens, tiles of 2: the 3 tiles above the diagonal skipped) and the window's."""
    joined = "\n".join(texts)
    assert re.search(r"online softmax vs textbook \(fp64\): max \|difference\| [\d.e-]+ matches", joined)
    assert "tile 2: 6 tiles computed, 3 skipped of 9" in joined
    assert "window 3: 5 tiles computed, 4 skipped" in joined
    backends = re.findall(r"^ *(reference|chunked|blocks|sdpa): +[\d.]+ ms .* matches$", joined, flags=re.M)
    assert backends == ["reference", "chunked", "blocks", "sdpa"], joined
    assert sum(text.count(" matches") for text in compared) == 10  # online, 2 walks, 3 backward checks, 4 backends


def _check_the_2026_notebook(texts: list[str]) -> None:
    """The cache table's growth (a global layer's cache x4 from 512 to 2048 tokens; a window's and a linear
    state's x1; the compressed layers' in between), every decode rate printed, and the three recall runs."""
    joined = "\n".join(texts)
    growth = dict(re.findall(r"^(\w+) +[\d.]+ K +[\d.]+ K +([\d.]+)x$", joined, flags=re.M))
    assert growth["G"] == "4.00" and growth["L"] == "1.00" and growth["R"] == "1.00", growth
    assert 1.0 < float(growth["VH"]) < 4.0 and 1.0 < float(growth["RG"]) < 4.0, growth
    rates = re.findall(r"^(G|L|R|RG|VH) +(\d+) +(\d+) +([\d.]+)$", joined, flags=re.M)
    assert [row[0] for row in rates] == ["G", "L", "R", "RG", "VH"], joined
    assert all(abs(int(long) / int(short) - float(kept)) < 0.01 + 1 / int(short) for _, short, long, kept in rates)
    assert list(_recall_runs(texts, SHORT_STEPS)) == ["softmax", "linear", "hybrid"], joined[-2000:]


def _recall_runs(texts: list[str], steps: int) -> dict[str, float]:
    """The 2026 notebook's recall runs: model -> held-out accuracy (%), in the order printed."""
    found = re.findall(rf"^(softmax|linear|hybrid) \((?:LG|LA|AG)\): {steps} steps in [\d.]+ s, held-out accuracy "
                       r"([\d.]+) %$", "\n".join(texts), flags=re.M)
    return {name: float(accuracy) for name, accuracy in found}


def _check_the_ablation_summary(texts: list[str]) -> None:
    """The summary's ablation figures are the printed table's (the accuracy LEFT after ablating a head),
    set beside the full model's accuracy, and every head it names is said what it does."""
    # Regression: "Heads whose ablation costs more than 5 points: L0H0 (6.7 %), L0H1 (4.0 %)" gave the
    # accuracy left as if it were the cost, and never said what L0H1 does.
    summary = next(text for text in texts if text.startswith("Held-out accuracy"))
    table = next(text for text in texts if "ablation_accuracy:" in text)
    row = re.search(r"ablation_accuracy: (.*)", table).group(1)
    left = {(int(layer), h): float(v) for layer, values in re.findall(r"layer (\d+) ([\d. ]+)", row)
            for h, v in enumerate(values.split())}
    accuracy = float(re.match(r"Held-out accuracy ([\d.]+) %", summary).group(1))
    named = re.findall(r"without L(\d)H(\d) it is ([\d.]+) % \(L\1H\2 is ([^)]*)\)", summary)
    costly = {key for key, value in left.items() if accuracy - 100 * value > 5 + 0.5}  # the table has 2 decimals
    assert {(int(l), int(h)) for l, h, _, _ in named} >= costly, summary
    for layer, head, figure, role in named:
        assert abs(float(figure) / 100 - left[int(layer), int(head)]) <= 0.0051, (figure, left)
        assert role.startswith(("an induction head", "a previous-token head", "a current-token head", "none of")), role
    if named:
        assert f"against the full model's {accuracy:.1f} %" in summary
    else:
        assert f"No single head's ablation costs more than 5 points of the full model's {accuracy:.1f} %" in summary
    assert "costs more than 5 points:" not in summary


def _accuracy(texts: list[str]) -> float:
    return float(next(re.search(r"held-out accuracy ([\d.]+) %", t).group(1) for t in texts if " steps in " in t))


def _full_run(title: str, cwd: Path, *, timeout: int) -> list[str]:
    """The learner's run of the notebook whose title ends with ``title``, as stored: its outputs as text,
    after checking that none went to stderr or holds warning text."""
    path = next(path for path in NOTEBOOKS if path.stem.endswith(title))
    started = time.perf_counter()
    node = execute(path, timeout=timeout, cwd=cwd)
    print(f"{path.name}: {time.perf_counter() - started:.1f} s in all")
    assert not _dirty_outputs(path, node), "\n".join(_dirty_outputs(path, node))
    return [text for cell in node.cells if cell.cell_type == "code" for text in _texts(cell)]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ATTNLAB_FULL_NOTEBOOK") != "1",
                    reason="the full run of the real-model notebook: set ATTNLAB_FULL_NOTEBOOK=1 (about a minute)")
def test_the_real_model_notebook_forms_the_induction_head_by_default(tmp_path):
    """The learner's run, as stored: the accuracy, both heads named, and the ablation's drop."""
    texts = _full_run("real model", tmp_path, timeout=180)
    assert _accuracy(texts) >= 90.0
    summary = next(text for text in texts if text.startswith("Held-out accuracy"))
    assert re.search(r"Layer 0 head \d is a previous-token head", summary), summary
    induction = re.search(r"Layer 1 head 0 is an induction head \(induction score [\d.]+; accuracy left without it: "
                          r"([\d.]+) %\)", summary)
    assert induction and float(induction.group(1)) < 30.0, summary
    _check_the_ablation_summary(texts)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ATTNLAB_FULL_NOTEBOOK") != "1",
                    reason="the full run of the 2026 notebook: set ATTNLAB_FULL_NOTEBOOK=1 (about three minutes)")
def test_the_2026_notebook_shows_linear_attention_failing_recall_by_default(tmp_path):
    """The learner's run, as stored: softmax recalls (>= 95 %), linear attention of the same size falls
    clearly below it, and the hybrid (one softmax layer on top of a linear one) recovers part of the gap
    in the same steps (30 % against 4 % when measured; it climbs further with more steps)."""
    texts = _full_run("2026 models", tmp_path, timeout=600)
    steps = int(re.search(r"^softmax \(LG\): (\d+) steps", "\n".join(texts), flags=re.M).group(1))
    runs = _recall_runs(texts, steps)
    print("\n".join(line for text in texts for line in text.splitlines() if " steps in " in line))
    assert runs["softmax"] >= 95.0 and runs["linear"] <= runs["softmax"] - 20.0 and runs["hybrid"] >= runs["linear"] + 10.0, runs


def test_the_kernel_is_this_python_with_the_attnlab_under_test(tmp_path):
    import sys

    import attnlab

    cell = nbformat.v4.new_code_cell("import sys, attnlab\nprint(sys.executable)\nprint(attnlab.__file__)")
    node = execute(nbformat.v4.new_notebook(cells=[cell]), timeout=NOTEBOOK_SECONDS, cwd=tmp_path)
    assert node.cells[0].outputs[0]["text"].split() == [sys.executable, attnlab.__file__]


def test_a_broken_cell_fails_the_run(tmp_path):
    """A copy of a notebook with one cell that raises: the run stops there with the cell's error."""
    node = nbformat.read(NOTEBOOKS[0], as_version=4)
    node.cells = node.cells[:2] + [nbformat.v4.new_code_cell("raise RuntimeError('a deliberately broken cell')")]
    copy = tmp_path / "broken.ipynb"
    nbformat.write(node, copy)
    with pytest.raises(CellExecutionError, match="a deliberately broken cell"):
        execute(copy, timeout=NOTEBOOK_SECONDS, cwd=tmp_path)
