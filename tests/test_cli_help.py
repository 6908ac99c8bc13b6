"""The ``attnlab`` command line starts light, and its ``--help`` shows flags as flags and the defaults.

Start-up: ``import attnlab.lab.cli`` (what every command and ``attnlab --help`` pay) loads no lab tool,
no transformers or matplotlib and not torch's compiler; a command imports those when it runs.
The check is on the set of loaded modules in a fresh interpreter, never on a timing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnlab.lab.cli import app

runner = CliRunner()
SRC = Path(__file__).resolve().parents[1] / "src"
COMMANDS = ("explain", "train", "generate", "verify", "backends", "bench", "kv-memory", "context-parallel")
# Modules a command imports when it runs, never at start-up: the lab tools and their heavy dependencies.
HEAVY = ("transformers", "matplotlib", "torch._dynamo", "attnlab.lab.train", "attnlab.lab.trained", "attnlab.lab.verify",
         "attnlab.lab.zoo", "attnlab.lab.viz", "attnlab.lab.lens", "attnlab.lab.explain", "attnlab.lab.bench", "attnlab.lab.tutorial",
         "attnlab.lab.cli._lens_walk", "attnlab.lab.cli._trained_walk", "attnlab.distributed", "attnlab.models")


def _loaded_after(code: str) -> list[str]:
    script = f"import sys\n{code}\nprint(sorted(sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "120"})
    assert result.returncode == 0, result.stderr[-2000:]
    return eval(result.stdout.strip().splitlines()[-1])  # the printed list of module names


@pytest.mark.parametrize("code", [
    "import attnlab.lab.cli",
    "from attnlab.lab.cli import app\ntry:\n    app(['--help'])\nexcept SystemExit:\n    pass",
    "from attnlab.lab.cli import app\ntry:\n    app(['kv-memory', '--layers', '2', '--heads', '4', '--head-dim', '8', "
    "'--context', '16'])\nexcept SystemExit:\n    pass",
])
def test_the_command_line_starts_without_the_lab_tools(code):
    loaded = _loaded_after(code)
    assert "attnlab.lab.cli.train_cmd" in loaded and "torch" in loaded  # the commands are registered
    assert [m for m in loaded if m.startswith(HEAVY) and (m in HEAVY or m.startswith(tuple(h + "." for h in HEAVY)))] \
        == []


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_flags_as_flags(command):
    result = runner.invoke(app, [*([command] if command else []), "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    assert "--help" in result.output


def test_help_names_both_sides_of_a_two_way_flag():
    text = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert re.search(r"--attention-only\s+--mlp\s", text)


def _default_of(text: str, option: str) -> str:
    """The ``[default: ...]`` of ``option`` in rendered help (the box's rows flattened)."""
    rows = [re.sub(r"^[│ ]+|[│ ]+$", "", line) for line in text.splitlines()]
    start = next(i for i, row in enumerate(rows) if row.startswith(option + " "))
    block = " ".join(rows[start:start + 4])
    return re.search(r"\[default: \(?(.*?)\)?\]", block).group(1)


def test_train_help_shows_each_tasks_defaults():
    from attnlab.lab.train import TASK_DEFAULTS

    text = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "250"}).output
    steps = _default_of(text, "--steps")
    for task, defaults in TASK_DEFAULTS.items():
        assert f"{task} {defaults['steps']}" in steps, steps
    assert _default_of(text, "--batch-size") == str(TASK_DEFAULTS["induction"]["batch_size"])
    assert "induction" in _default_of(text, "--task")


def test_explain_help_shows_the_walks_defaults_from_trace():
    import inspect

    from attnlab.lab.explain import DEFAULT_SENTENCE, trace

    text = runner.invoke(app, ["explain", "--help"], env={"COLUMNS": "250"}).output
    defaults = inspect.signature(trace).parameters
    assert _default_of(text, "--d-model") == str(defaults["d_model"].default)
    assert _default_of(text, "--seed") == str(defaults["seed"].default)
    assert DEFAULT_SENTENCE in text
