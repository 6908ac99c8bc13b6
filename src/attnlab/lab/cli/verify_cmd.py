"""``attnlab verify``: every available backend against the fp64 reference on this machine."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import typer

from attnlab._checks import one_of, positive_int
from attnlab._checks import positive_number
from attnlab.lab.cli._errors import MAX_SEED, check_seed, fail, option_errors
from attnlab.lab.cli._help import HelpCommand
from attnlab.lab.cli.bench_cmd import _check_writable, _write

ZOO_COMMAND = "OMP_NUM_THREADS=1 attnlab verify --transformers --markdown FILE.md"
MAX_TIME_LIMIT = 7 * 24 * 3600  # seconds one family may take, at most


def verify(
    quick: bool = typer.Option(False, "--quick", help="A short sweep (well under a minute)."),
    backend: list[str] = typer.Option(None, "--backend",
                                      help="Check only this backend (repeatable): an attention backend, or "
                                           "linear:NAME for one of linear_attention's (linear:recurrent)."),
    configs: int = typer.Option(None, "--configs", show_default=False,
                                help="Configurations per dtype, at least 1 (default 200, quick 16)."),
    seed: int = typer.Option(0, "--seed", help=f"Seed of the configuration draw, 0 to {MAX_SEED}."),
    transformers: bool = typer.Option(False, "--transformers",
                                      help="Instead: every transformers model family on attnlab against eager."),
    family: list[str] = typer.Option(None, "--family", metavar="NAME",
                                     help="With --transformers: only this family (repeatable, or a comma list)."),
    json_out: Path = typer.Option(None, "--json", metavar="FILE",
                                  help="With --transformers: write the per-family results as JSON ('-': "
                                       "stdout, the tables then go to stderr)."),
    markdown: Path = typer.Option(None, "--markdown", metavar="FILE.md",
                                  help="With --transformers: write the per-family status table (markdown)."),
    time_limit: float = typer.Option(None, "--time-limit", metavar="SECONDS", show_default=False,
                                     help="With --transformers: seconds one family may take (default 300)."),
) -> None:
    """Sweep seeded configurations (odd sizes, GQA, masks, causal alignments, fully masked rows)
    through every backend, forward and backward, in fp32 and bf16, and compare with the fp64
    reference: error <= 2x the same-dtype reference error + floor (gradients 3x). The backends of
    linear_attention (linear:recurrent, ...) are swept the same way against its fp64 recurrence:
    every rule (additive, decay, per-channel decay, delta, gated delta, KDA), initial states and
    packed documents, the output, the final state and the gradients of q, k, v, decay, beta and
    the initial state, in fp64, fp32 and (tiny sizes) bf16. Exits 1 on any failure.

    With --transformers: build every model family of the installed transformers tiny and compare
    attn_implementation="attnlab" with "eager" (padded batches, generation, gradients, weights);
    exits 1 when a family is different or crashed."""
    zoo_options = {"--family": family, "--json": json_out, "--markdown": markdown, "--time-limit": time_limit}
    if transformers:
        for option, value in {"--quick": quick or None, "--backend": backend, "--configs": configs}.items():
            if value:
                fail(f"{option} does not apply to --transformers")
        _verify_transformers(family, json_out, markdown, 300.0 if time_limit is None else time_limit)
        return
    for option, value in zoo_options.items():
        if value:
            fail(f"{option} needs --transformers")
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from attnlab.lab import verify as _verify

    names, linear_names = _check_backends(backend)
    n = (16 if quick else 200) if configs is None else configs
    with option_errors():
        positive_int("--configs", n)
    check_seed(seed)
    console = Console(width=max(120, Console().width))  # the table needs ~110 columns
    flex_n = min(n, 8) if quick else n
    dtypes = [torch.float32, torch.bfloat16]
    crossed = _verify.GRAD_MODE_CONFIGS * len(_verify.GRAD_MODES)  # at most, per backend and dtype
    total = (sum((flex_n if name == "flex" else n) + crossed for name in names) * len(dtypes)
             + n * len(linear_names) * len(_verify.LINEAR_DTYPES))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("verifying", total=total)
        results = _verify.sweep(names, dtypes, n=n, seed=seed, small=quick, flex_n=flex_n,
                                progress=lambda r: progress.advance(task)) if names else []
        if linear_names:
            results += _verify.sweep_linear(linear_names, _verify.LINEAR_DTYPES, n=n, seed=seed, small=quick,
                                            progress=lambda r: progress.advance(task))
    failed = _print_summary(console, results, names, dtypes, linear=linear_names)
    if failed:
        for result in [r for r in results if r.served and not r.passed][:10]:
            console.print(f"[red]FAIL[/red] {result.backend} {result.dtype} {result.config}: "
                          f"errors {['%.2e' % e for e in result.errors]} allowed "
                          f"{['%.2e' % a for a in result.allowed]}" + (f" ({result.note})" if result.note else ""))
        raise typer.Exit(code=1)
    console.print("[green]all backends conform[/green]")


def _verify_transformers(family: list[str] | None, json_out: Path | None, markdown: Path | None,
                         time_limit: float) -> None:
    """``--transformers``: every family (or the named ones) against eager, a summary, exit 1 on a bug."""
    with option_errors():
        positive_number("--time-limit", time_limit)
    if time_limit > MAX_TIME_LIMIT:  # the family's alarm cannot be set that far: it crashed every family
        fail(f"--time-limit must be at most {MAX_TIME_LIMIT} seconds (a week), got {time_limit:g}")
    if markdown is not None and markdown.suffix != ".md":
        fail(f"--markdown writes Markdown: give a file name ending in .md, got {str(markdown)!r}")
    for option, path in (("--json", json_out), ("--markdown", markdown)):
        if path is not None and str(path) != "-":
            _check_writable(option, path)
    try:
        from attnlab.lab import zoo
    except ImportError as exc:
        fail(f"--transformers needs transformers 5.x (pip install 'attnlab[hf]'): {exc}")
    names = _check_families(family, zoo.families())
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # With --json -, stdout holds the JSON document alone: the progress and the tables go to stderr.
    console = Console(width=max(120, Console().width), stderr=json_out is not None and str(json_out) == "-")
    start, results = time.perf_counter(), []
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("families", total=len(names))
        for name in names:
            progress.update(task, description=name)
            results.append(zoo.run_family(name, time_limit=time_limit))
            progress.advance(task)
    seconds = time.perf_counter() - start
    if json_out is not None:
        _write("--json", str(json_out), json.dumps({"transformers": zoo.transformers.__version__,
                                                    "seconds": round(seconds, 1),
                                                    "families": [r.to_dict() for r in results]}, indent=1) + "\n")
    if markdown is not None:
        _write("--markdown", str(markdown), f"Regenerate with `{ZOO_COMMAND}` "
               f"(transformers {zoo.transformers.__version__}).\n\n{zoo.markdown_table(results)}\n")
    if _print_zoo(console, zoo, results, seconds):
        raise typer.Exit(code=1)


def _check_families(requested: list[str] | None, known: list[str]) -> list[str]:
    """The families to run: every one, or those named (repeatable, comma lists), each known."""
    if not requested:
        return known
    names = [name.strip() for item in requested for name in item.split(",")]
    for name in names:
        if name not in known:
            fail(f"--family {name!r} is not a model family of the installed transformers "
                 f"(a model_type such as llama, bert, t5)")
    return list(dict.fromkeys(names))


def _print_zoo(console, zoo, results, seconds: float) -> bool:
    """The summary: counts by status, then one row per family that is not equal; True on a bug."""
    from rich.markup import escape
    from rich.table import Table

    counted = zoo.counts(results)
    table = Table(title=f"transformers families on attnlab vs eager ({len(results)} in {seconds:.0f} s)")
    for status in zoo.STATUSES:
        table.add_column(status)
    table.add_row(*(str(counted[s]) for s in zoo.STATUSES))
    console.print(table)
    notable = [r for r in results if r.status in ("different", "crashed", "refused")]
    if notable or len(results) <= 20:
        detail = Table()
        for column in ("family", "status", "model", "why"):
            detail.add_column(column, overflow="fold")
        for r in notable if len(results) > 20 else results:
            detail.add_row(r.family, r.status, r.model_class, escape(r.reason))
        console.print(detail)
    bug = counted["different"] + counted["crashed"] > 0
    console.print("[red]some families differ or crash[/red]" if bug else "[green]no family differs or crashes[/green]")
    return bug


def _check_backends(requested: list[str] | None) -> tuple[list[str], list[str]]:
    """The attention backends and the linear ones (``linear:NAME``) to check: every available
    one, or the requested ones if each can run here."""
    from attnlab import backends
    from attnlab.lab.verify import LINEAR_PREFIX, linear_backends

    if not requested:
        return backends.available(), linear_backends()
    for name in requested:
        if name.startswith(LINEAR_PREFIX):
            with option_errors():
                one_of("--backend", name, linear_backends())
            continue
        with option_errors():
            one_of("--backend", name, [*backends.names(), *linear_backends()])
        reason = backends.get(name).unavailable_reason()
        if reason is not None:
            fail(f"--backend {name!r} cannot run here: {reason}")
    requested = list(dict.fromkeys(requested))
    return ([name for name in requested if not name.startswith(LINEAR_PREFIX)],
            [name for name in requested if name.startswith(LINEAR_PREFIX)])


def _print_summary(console, results, names, dtypes, *, linear=()) -> bool:
    """One row per (backend, dtype): attention backends in ``dtypes``, linear ones in
    :data:`attnlab.lab.verify.LINEAR_DTYPES`; True when a check failed."""
    from rich.markup import escape
    from rich.table import Table

    from attnlab.lab.verify import LINEAR_DTYPES

    table = Table(title="conformance vs the fp64 reference (error / allowed)")
    for column in ("backend", "dtype", "served", "declined", "fwd err", "allowed", "worst err/allowed",
                   "checked", "result"):
        table.add_column(column)
    any_failed, unchecked = False, []
    pairs = [(name, dtype) for name in names for dtype in dtypes]
    pairs += [(name, dtype) for name in linear for dtype in LINEAR_DTYPES]
    for name, dtype in pairs:
        dname = str(dtype).replace("torch.", "")
        group = [r for r in results if r.backend == name and r.dtype == dname]
        served = [r for r in group if r.served]
        failed = [r for r in served if not r.passed]
        any_failed |= bool(failed)
        # A check that crashed has no errors to show (its note says why): the worst is one that ran.
        worst = max((r for r in served if r.errors), key=lambda r: r.worst_ratio(), default=None)
        if not served:
            # One line per kind of reason: the same refusal at several lengths is said once.
            unchecked.append((name, dname, sorted({re.sub(r" \(Tk=\d+\)", "", r.note) for r in group if r.note})))
        table.add_row(
            name, dname, str(len(served)), str(len(group) - len(served)),
            "-" if worst is None else f"{worst.errors[0]:.2e}",
            "-" if worst is None else f"{worst.allowed[0]:.2e}",
            "-" if worst is None else f"{worst.worst_ratio():.2f}",
            "fwd+bwd" if any(r.grad for r in served) else "fwd",
            "[red]FAIL[/red]" if failed else ("[green]pass[/green]" if served else "[yellow]not checked[/yellow]"),
        )
    console.print(table)
    for name, dname, notes in unchecked:
        console.print(f"[yellow]{name} {dname}: nothing checked[/yellow]; it declined every configuration: "
                      + escape("; ".join(notes) or "no reason given")
                      + ". A full `attnlab verify` sweeps the shapes it serves.", soft_wrap=True)
    return any_failed


def register(app: typer.Typer) -> None:
    """Add the ``verify`` command to ``app``."""
    app.command("verify", cls=HelpCommand)(verify)
