"""``attnlab bench``: GFLOP/s, fraction of the measured matmul peak, and ratios on this machine.

``--json FILE`` (``-``: stdout, the tables then go to stderr), ``--markdown FILE.md`` and
``--plot FILE.png`` are checked before any benchmark runs (one ``error:`` line, exit 2) and
written atomically after the run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer

from attnlab._checks import one_of
from attnlab.lab.cli._errors import fail, option_errors
from attnlab.lab.cli._help import HelpCommand

# Suites whose rows have no time and sequence length for --plot to draw (variants has its own chart).
_UNPLOTTABLE = ("memory", "decode-model")


def bench(
    suite: str = typer.Option(None, "--suite", show_default=False,
                              help="backends, memory, modules, sparse, decode, decode-model, overhead, variants, padded, "
                                   "linear or all [default: backends; all with --quick]."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes, one round (every suite: under 3 minutes "
                                                      "on 2 cores)."),
    json_out: str = typer.Option(None, "--json", metavar="FILE",
                                 help="Also write every row and a header as JSON to FILE ('-': stdout, "
                                      "tables to stderr)."),
    markdown: str = typer.Option(None, "--markdown", metavar="FILE.md",
                                 help="Also write the tables as Markdown to FILE.md, headed by the machine "
                                      "and this command (what BENCHMARKS.md holds)."),
    plot: Path = typer.Option(None, "--plot", metavar="FILE.png",
                              help="Also draw median time and GFLOP/s vs T, one line per implementation "
                                   "(variants: bars of KV bytes/token, tokens/s, peak memory, held-out loss)."),
    with_flex: bool = typer.Option(False, "--with-flex",
                                   help="Sparse suite: also time the flex backend and compiled FlexAttention "
                                        "with its own block mask, forward (compiles for minutes on CPU)."),
) -> None:
    """Time attnlab's implementations side by side on this machine and print GFLOP/s, the
    fraction of the same-dtype matrix-multiply rate measured in the same run, and ratios to the
    fastest. FLOPs follow docs/contract.md (forward 4·B·H·Tq·Tk·D, halved for causal); sparse
    FLOPs count only the visible (query, key) pairs."""
    from rich.console import Console

    from attnlab.lab import bench as _bench

    suite = suite if suite is not None else ("all" if quick else "backends")
    with option_errors():
        one_of("--suite", suite, _bench.SUITES + ("all",))
    _check_outputs(suite, json_out, markdown, plot)
    if with_flex and suite not in ("sparse", "all"):
        fail(f"--with-flex adds rows to the sparse suite; --suite {suite} has none")
    console = Console(stderr=True) if json_out == "-" else None
    rows = _bench.run_suite(suite, quick=quick, console=console, with_flex=with_flex)
    document = _bench.bench_json(rows, suite=suite, quick=quick) if json_out or markdown else None
    if json_out is not None:
        _write("--json", json_out, document)
    if markdown is not None:
        from attnlab.lab.bench.report import bench_markdown

        command = " ".join(["attnlab bench", f"--suite {suite}", *(["--quick"] if quick else []),
                            *(["--with-flex"] if with_flex else [])])
        _write("--markdown", markdown, bench_markdown(json.loads(document), command=command))
    if plot is not None:
        _write_plot(plot, rows, suite)


def _check_outputs(suite: str, json_out: str | None, markdown: str | None, plot: Path | None) -> None:
    """Refuse unusable output paths now, before minutes of benchmarks."""
    if json_out is not None and json_out != "-":
        _check_writable("--json", Path(json_out))
    if markdown is not None:
        if not markdown.endswith(".md"):
            fail(f"--markdown writes Markdown: give a file name ending in .md, got {markdown!r}")
        _check_writable("--markdown", Path(markdown))
    if plot is None:
        return
    if plot.suffix.lower() != ".png":
        fail(f"--plot writes a PNG: give a file name ending in .png, got {str(plot)!r}")
    if suite in _UNPLOTTABLE:
        fail(f"--plot draws timed rows against T; --suite {suite} has none (use --json)")
    _check_writable("--plot", plot)


def _check_writable(option: str, path: Path) -> None:
    """Fail unless a file can be created beside ``path`` (which must not be a folder)."""
    if path.is_dir():
        fail(f"{option} {str(path)!r} is a folder: give a file name")
    folder = path.parent
    if not folder.is_dir():
        why = "is not a folder" if folder.exists() else "does not exist"
        fail(f"cannot write {option} {str(path)!r}: {str(folder)!r} {why}")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        fail(f"cannot write {option} {str(path)!r}: {err.strerror or err}")


def _write(option: str, path: str, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (``-``: stdout); an OS error is one ``error:`` line."""
    from attnlab.io import write_atomically

    if path == "-":
        typer.echo(data, nl=False)
        return
    try:
        write_atomically(data, path, what=f"{option} output")
    except OSError as err:
        fail(f"cannot write {option} {path!r}: {err.strerror or err}")


def _write_plot(plot: Path, rows, suite: str) -> None:
    from attnlab.lab.bench.report import figure_png, plot_rows
    from attnlab.lab.bench.variants import plot_variants

    with option_errors():
        figure = plot_variants(rows) if suite == "variants" else plot_rows(rows)
    _write("--plot", str(plot), figure_png(figure))


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to ``app``."""
    app.command("bench", cls=HelpCommand)(bench)
