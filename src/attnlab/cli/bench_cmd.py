"""``attnlab bench``: GFLOP/s, fraction of the measured matmul peak, and ratios on this machine."""

from __future__ import annotations

import typer

from attnlab._checks import one_of
from attnlab.cli._errors import option_errors


def bench(
    suite: str = typer.Option("backends", "--suite", help="backends, memory, modules, sparse, decode, decode-model or all."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes, one round."),
) -> None:
    """Time attnlab's implementations side by side on this machine and print GFLOP/s, the
    fraction of the same-dtype matrix-multiply rate measured in the same run, and ratios to the
    fastest. FLOPs follow docs/design.md (forward 4·B·H·Tq·Tk·D, halved for causal)."""
    from attnlab import bench as _bench

    with option_errors():
        one_of("--suite", suite, _bench.SUITES + ("all",))
    _bench.run_suite(suite, quick=quick)


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to ``app``."""
    app.command("bench")(bench)
