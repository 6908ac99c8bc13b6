"""The notebooks in notebooks/ run: each executed top to bottom by nbclient on an ipykernel of the venv.

A cell that raises fails its test (CellExecutionError, shown with the cell and its traceback); so does a
reproduced number that drifts from the tutorial's (every ``compare_printed`` output must say it
matches). Each notebook runs under NOTEBOOK_SECONDS; the set is sized to run within 2 minutes on 2
cores. The notebooks are stored without outputs, one per tutorial, named by its title, plus
"Attention in a real model".
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from _notebooks import CellExecutionError, execute, nbformat

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
TUTORIALS = ("The Clear Tutorial for Attention Mechanism in Transformers", "Attention for your Transformers",
             "Causal Self Attention", "Mathematical trick in self-attention",
             "Self-Attention and Multi-head Attention Mechanism")
NOTEBOOK_SECONDS = 60  # one notebook, kernel start included (alone: 6-8 s a tutorial, 17-25 s the real model)


def test_one_notebook_per_tutorial_and_the_real_model():
    titles = [nbformat.read(path, as_version=4).cells[0].source.splitlines()[0].removeprefix("# ")
              for path in NOTEBOOKS]
    assert titles == [*TUTORIALS, "Attention in a real model"]
    assert [path.stem.split(" ", 1)[1] for path in NOTEBOOKS] == titles


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem.split(" ", 1)[0])
def test_notebooks_are_stored_without_outputs(path):
    node = nbformat.read(path, as_version=4)
    nbformat.validate(node)
    code = [cell for cell in node.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem.split(" ", 1)[0])
def test_notebook_runs(path, tmp_path):
    started = time.perf_counter()
    node = execute(path, timeout=NOTEBOOK_SECONDS, cwd=tmp_path)
    seconds = time.perf_counter() - started
    assert seconds <= NOTEBOOK_SECONDS, f"{path.name} took {seconds:.1f} s"
    texts = ["".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
             for cell in node.cells if cell.cell_type == "code" for output in cell.outputs]
    compared = [text for text in texts if "max |difference|" in text]
    assert all("matches" in text and "DOES NOT MATCH" not in text for text in compared), compared
    if not path.stem.endswith("real model"):
        assert compared, "a tutorial notebook shows the tutorial's printed numbers next to attnlab's"


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
