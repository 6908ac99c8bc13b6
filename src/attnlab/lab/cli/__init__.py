"""The ``attnlab`` command. Each sub-command lives in its own module with a ``register(app)``.

Errors are reported the same way by every command (one ``error:`` line, exit status 2): the
group class from :mod:`attnlab.lab.cli._errors` does it for all of them.
"""

from __future__ import annotations

import typer

from attnlab.lab.cli import (backends_cmd, bench_cmd, cp_cmd, explain_cmd, generate_cmd, kv_memory_cmd, train_cmd,
                         verify_cmd)
from attnlab.lab.cli._errors import OneLineErrorsGroup

HELP = """attnlab: attention mechanisms on PyTorch, readable, proven fast, and visible.

Start with `attnlab explain` to watch a sentence go through self-attention step by step
(it also writes heatmaps and an offline HTML report; `--walk flash` computes it tile by tile as
FlashAttention does), then see what a trained model's heads do with it (`attnlab explain --model
minilm`). `attnlab verify` checks every fast backend, and linear attention's, against the fp64
reference on this machine, `attnlab backends` says which backend
a call would use and why, and `attnlab bench` times them. `attnlab train` trains a small GPT
on your CPU and names the heads that learned the task; `attnlab generate` continues a prompt with it.
`attnlab context-parallel` runs ring and Ulysses attention across processes and checks them
against one process. `attnlab kv-memory` works out the KV-cache size of MHA, GQA, MLA,
sliding-window and compressed layers, and the constant state of recurrent (linear-attention)
hybrids, at a context length. `attnlab COMMAND --help` for more.
"""

app = typer.Typer(
    name="attnlab",
    cls=OneLineErrorsGroup,
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


@app.callback()
def _root() -> None:
    """Keep `attnlab` a group of commands (typer collapses a one-command app)."""


for _command in (explain_cmd, train_cmd, generate_cmd, verify_cmd, backends_cmd, bench_cmd, kv_memory_cmd, cp_cmd):
    _command.register(app)


def main() -> None:
    """Entry point of the ``attnlab`` console script."""
    app()
