"""``attnlab verify``: every available backend against the fp64 reference on this machine."""

from __future__ import annotations

import re

import typer

from attnlab._checks import one_of, positive_int
from attnlab.cli._errors import MAX_SEED, check_seed, fail, option_errors


def verify(
    quick: bool = typer.Option(False, "--quick", help="A short sweep (well under a minute)."),
    backend: list[str] = typer.Option(None, "--backend", help="Check only this backend (repeatable)."),
    configs: int = typer.Option(None, "--configs", show_default=False,
                                help="Configurations per dtype, at least 1 (default 200, quick 16)."),
    seed: int = typer.Option(0, "--seed", help=f"Seed of the configuration draw, 0 to {MAX_SEED}."),
) -> None:
    """Sweep seeded configurations (odd sizes, GQA, masks, causal alignments, fully masked rows)
    through every backend, forward and backward, in fp32 and bf16, and compare with the fp64
    reference: error <= 2x the same-dtype reference error + floor (gradients 3x). Exits 1 on
    any failure."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from attnlab import verify as _verify

    names = _check_backends(backend)
    n = (16 if quick else 200) if configs is None else configs
    with option_errors():
        positive_int("--configs", n)
    check_seed(seed)
    console = Console(width=max(120, Console().width))  # the table needs ~110 columns
    flex_n = min(n, 8) if quick else n
    dtypes = [torch.float32, torch.bfloat16]
    crossed = _verify.GRAD_MODE_CONFIGS * len(_verify.GRAD_MODES)  # at most, per backend and dtype
    total = sum((flex_n if name == "flex" else n) + crossed for name in names) * len(dtypes)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("verifying", total=total)
        results = _verify.sweep(names, dtypes, n=n, seed=seed, small=quick, flex_n=flex_n,
                                progress=lambda r: progress.advance(task))
    failed = _print_summary(console, results, names, dtypes)
    if failed:
        for result in [r for r in results if r.served and not r.passed][:10]:
            console.print(f"[red]FAIL[/red] {result.backend} {result.dtype} {result.config}: "
                          f"errors {['%.2e' % e for e in result.errors]} allowed "
                          f"{['%.2e' % a for a in result.allowed]}")
        raise typer.Exit(code=1)
    console.print("[green]all backends conform[/green]")


def _check_backends(requested: list[str] | None) -> list[str]:
    """The backends to check: every available one, or the requested ones if each can run here."""
    from attnlab import backends

    if not requested:
        return backends.available()
    for name in requested:
        with option_errors():
            one_of("--backend", name, backends.names())
        reason = backends.get(name).unavailable_reason()
        if reason is not None:
            fail(f"--backend {name!r} cannot run here: {reason}")
    return list(requested)


def _print_summary(console, results, names, dtypes) -> bool:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="conformance vs the fp64 reference (error / allowed)")
    for column in ("backend", "dtype", "served", "declined", "fwd err", "allowed", "worst err/allowed",
                   "checked", "result"):
        table.add_column(column)
    any_failed, unchecked = False, []
    for name in names:
        for dtype in dtypes:
            dname = str(dtype).replace("torch.", "")
            group = [r for r in results if r.backend == name and r.dtype == dname]
            served = [r for r in group if r.served]
            failed = [r for r in served if not r.passed]
            any_failed |= bool(failed)
            worst = max(served, key=lambda r: r.worst_ratio(), default=None)
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
    app.command("verify")(verify)
