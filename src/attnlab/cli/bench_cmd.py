"""``attnlab bench``: GFLOP/s, fraction of the measured matmul peak, and ratios on this machine."""

from __future__ import annotations

import typer


def bench(
    suite: str = typer.Option("backends", "--suite", help="backends, memory, modules or all."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes, one round."),
) -> None:
    """Time attnlab's implementations side by side on this machine and print GFLOP/s, the
    fraction of the same-dtype matrix-multiply rate measured in the same run, and ratios to the
    fastest. FLOPs follow DESIGN.md (forward 4·B·H·Tq·Tk·D, halved for causal)."""
    from attnlab import bench as _bench

    if suite not in _bench.SUITES + ("all",):
        raise typer.BadParameter(f"must be one of {_bench.SUITES + ('all',)}, got {suite!r}",
                                 param_hint="--suite")
    _bench.run_suite(suite, quick=quick)


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to ``app``."""
    app.command("bench")(bench)
