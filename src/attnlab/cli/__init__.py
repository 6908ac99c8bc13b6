"""The ``attnlab`` command. Each sub-command lives in its own module with a ``register(app)``."""

from __future__ import annotations

import typer

from attnlab.cli import explain_cmd
from attnlab.cli import verify_cmd, backends_cmd, bench_cmd  # noqa: E401

app = typer.Typer(
    name="attnlab",
    help=(
        "attnlab: attention mechanisms on PyTorch.\n\n"
        "Start with `attnlab explain` to watch a sentence go through self-attention step by step."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """attnlab: attention mechanisms on PyTorch."""


explain_cmd.register(app)
for _command in (verify_cmd, backends_cmd, bench_cmd):
    _command.register(app)


def main() -> None:
    """Entry point of the ``attnlab`` console script."""
    app()
