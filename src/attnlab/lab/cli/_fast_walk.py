"""``attnlab explain --walk flash|sparse|linear``: the sentence's attention walked the fast ways.

``--mode`` says how the tokens attend (self, causal, multihead, cross); ``--walk`` says how the
attention is computed (textbook, flash, sparse, linear): the two are independent questions, so
each keeps its own option. Every walk-specific option is refused, on one ``error:`` line, where it
would do nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

from attnlab._checks import non_negative_int, positive_int
from attnlab.lab.cli._errors import at_most, fail, option_errors

DEFAULT_TILE = 4
DEFAULT_TOPK = 4
MAX_PAD = 64
MAX_TILE = 512  # the walk's longest sentence (explain's MAX_WALK_TOKENS): one tile holds it all
MAX_TILES = 1024  # tiles of one flash walk: each prints two tables
_FOR = {"--tile": "flash", "--window": "flash", "--pad": "flash", "--backward": "flash", "--topk": "sparse",
        "--rule": "linear"}
_GRID_CHARS = {"allowed": "#", "masked": "o", "skipped": "."}


def check_options(walk: str | None, *, tile, window, pad, backward: bool, topk, rule, precision, mode: str,
                  causal: bool, plain: dict) -> dict | None:
    """The walk to run as ``{"kind": ..., options}``, or None for the textbook walk; refuses bad combinations."""
    from attnlab.lab.walks import LINEAR_RULES, PRECISIONS, WALKS

    if walk is not None and walk not in WALKS:
        fail(f"--walk must be one of {', '.join(WALKS)}; got {walk!r}")
    kind = walk or "textbook"
    given = {"--tile": tile, "--window": window, "--pad": pad, "--backward": backward or None, "--topk": topk,
             "--rule": rule}
    for option, value in given.items():
        if value is not None and _FOR[option] != kind:
            fail(f"{option} is for --walk {_FOR[option]}; it would do nothing with --walk {kind}")
    if kind == "textbook":
        if precision is not None:
            fail("--precision is for --walk flash, sparse or linear; the textbook walk is the tutorial's fp32")
        return None
    for option, value in plain.items():
        if value is not None and value is not False:
            fail(f"--walk {kind} redoes plain attention; {option} is for the textbook walk (--walk textbook)")
    if precision is not None and precision not in PRECISIONS:
        fail(f"--precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if kind in ("sparse", "linear") and mode == "cross":
        fail(f"--walk {kind} is self-attention over one sequence; --mode cross has two")
    options = {"kind": kind, "precision": precision or "fp32"}
    with option_errors():
        if kind == "flash":
            options["tile"] = positive_int("--tile", DEFAULT_TILE if tile is None else tile)
            options["window"] = None if window is None else positive_int("--window", window)
            options["pad"] = non_negative_int("--pad", 0 if pad is None else pad)
            options["backward"] = backward
        if kind == "sparse":
            options["topk"] = positive_int("--topk", DEFAULT_TOPK if topk is None else topk)
    if kind == "flash":
        at_most("--tile", options["tile"], MAX_TILE, "one tile already holds the longest sentence the walk takes")
        at_most("--pad", options["pad"], MAX_PAD, "the walk prints every padded row")
    if kind == "sparse":
        at_most("--topk", options["topk"], MAX_TILE, "a query has at most that many keys")
    if kind == "linear":
        if rule is not None and rule not in LINEAR_RULES:
            fail(f"--rule must be one of {', '.join(LINEAR_RULES)}; got {rule!r}")
        options["rule"] = rule or "decay"
    return options


def build(result, options: dict):
    """The :class:`attnlab.lab.walks.Walk` the options ask for, of ``result`` (a trace)."""
    from attnlab.lab import walks

    kind, rest = options["kind"], {k: v for k, v in options.items() if k != "kind"}
    function = {"flash": walks.flash_walk, "sparse": walks.sparse_walk, "linear": walks.linear_walk}[kind]
    with option_errors():
        return function(result, **rest)


def run(result, options: dict, *, focus: int, out: Path, fmt: str, no_color: bool) -> None:
    """Walk ``result``'s attention the fast way: print the steps and checks, write the report."""
    from rich.console import Console

    from attnlab.lab.cli.explain_cmd import _make_out, _print_written

    if fmt in ("png", "svg"):
        fail(f"--walk {options['kind']} draws its pictures in the HTML report: use --format html or all, "
             f"not {fmt}")
    if options["kind"] == "flash":
        tq, tk = len(result.tokens) + options["pad"], len(result.context_tokens) + options["pad"]
        tiles = math.ceil(tq / options["tile"]) * math.ceil(tk / options["tile"])
        at_most(f"the tiles of --tile {options['tile']} on {tq} x {tk} positions", tiles, MAX_TILES,
                "the walk prints every tile: raise --tile")
    walk = build(result, options)
    _make_out(out)
    console = Console(no_color=no_color, highlight=False, soft_wrap=False)
    narrate(console, walk, focus)
    from attnlab.lab.viz.html import write_report

    try:
        written = [write_report(result, out / "report.html", focus=focus, walk=walk)]
    except OSError as err:
        fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")
    _print_written(console, written, out)


_TITLES = {"flash": "FlashAttention's way: tiles and an online softmax",
           "sparse": "DSA's way: each query reads only its top-k keys",
           "linear": "linear attention's way: a state instead of a score matrix"}


def narrate(console, walk, focus: int) -> None:
    """Every step of head 0 in order, the tile grid (flash), then the checks beside the textbook."""
    from attnlab.lab.cli.explain_cmd import _print_step

    trace = walk.trace
    extra = f", tiles of {walk.tile}" if walk.kind == "flash" else ""
    console.rule(f"[bold]attnlab explain --walk {walk.kind}[/bold]: {trace.mode}, {trace.heads} head(s), "
                 f"seed {trace.seed}{extra}")
    console.print(f"Sentence: {trace.sentence!r}", markup=False)
    console.print(f"[dim]{_TITLES[walk.kind]}. The queries, keys and values are the textbook walk's "
                  f"(`attnlab explain` without --walk prints how they are made).[/dim]")
    if walk.heads > 1:
        console.print(f"[dim]Head 0's steps are printed; the report has all {walk.heads} heads'.[/dim]")
    if walk.kind == "flash":
        print_grid(console, walk)
    for number, step in enumerate((s for s in walk.steps if s.head in (None, 0)), start=1):
        _print_step(console, number, step, focus, walk.heads)
    console.print()
    console.rule("[bold]Beside the textbook[/bold]" if walk.kind != "linear" else "[bold]Checks[/bold]")
    for note in walk.notes:
        console.print(note, markup=False, soft_wrap=True)
    for name, value in walk.checks.items():
        console.print(f"max |difference|, {name}: {value:.3g}", markup=False, soft_wrap=True)
    console.print(f"[dim](largest |output|: {float(walk.output.abs().max()) if walk.output.numel() else 0.0:.4g}; "
                  f"{'fp64' if walk.dtype.itemsize == 8 else 'fp32'} rounds at about "
                  f"{torch_eps(walk.dtype):.1e} of it)[/dim]")


def torch_eps(dtype) -> float:
    """The relative rounding step of ``dtype``.

    Example:
        >>> import torch
        >>> torch_eps(torch.float32) < 1.2e-7 < torch_eps(torch.float16)
        True
    """
    import torch

    return torch.finfo(dtype).eps


def grid_rows(walk) -> list[str]:
    """The flash walk's tile map, one string per query: ``#`` computed and allowed, ``o`` computed but
    masked (a partial tile's -inf), ``.`` skipped (never computed).

    Example:
        >>> from attnlab.lab.explain import trace
        >>> from attnlab.lab.walks import flash_walk
        >>> grid_rows(flash_walk(trace("a b c d", mode="causal"), tile=2))
        ['#o..', '##..', '###o', '####']
    """
    tq, tk = len(walk.tokens), len(walk.context_tokens)
    cells = [["skipped"] * tk for _ in range(tq)]
    for t in walk.tiles:
        for i in range(t.qs, t.qe):
            for j in range(t.ks, t.ke):
                cells[i][j] = "allowed" if bool(walk.allowed[i, j]) else "masked"
    return ["".join(_GRID_CHARS[c] for c in row) for row in cells]


def print_grid(console, walk) -> None:
    """The tile map with each row's final running statistics (head 0)."""
    from attnlab.lab.explain import format_value

    console.print()
    console.print("[bold]Tiles[/bold]  [dim]# computed, o computed but masked (-inf), . skipped; "
                  "m, l, lse: each row's running maximum, sum and log-sum-exp at the end (head 0)[/dim]")
    width = max(len(t) for t in walk.tokens)
    starts = {(t.qs, t.ks) for t in walk.tiles}
    for i, row in enumerate(grid_rows(walk)):
        m, l, lse = (format_value(float(x)) for x in walk.row_stats[i])
        tile_row = any(qs == i for qs, _ in starts)
        console.print(f"{walk.tokens[i]:>{width}} {row}  m={m} l={l} lse={lse}" + ("  <- new query tile"
                      if tile_row else ""), markup=False, soft_wrap=True)
    tk = len(walk.context_tokens)
    for qs, qe, lo, hi in walk.spans:
        never = [f"{a}-{b - 1}" for a, b in ((0, lo), (hi, tk)) if b > a]
        console.print(f"  queries {qs}-{qe - 1} reach keys {lo}-{hi - 1}" if hi > lo else
                      f"  queries {qs}-{qe - 1} reach no key", markup=False, end="")
        console.print(f" (keys {' and '.join(never)} skipped: never read)" if never else "", markup=False)
        for t in sorted((t for t in walk.tiles + walk.empty_tiles if t.qs == qs), key=lambda t: t.ks):
            what = "skipped (its mask allows nothing)" if t.status == "empty" else t.status
            console.print(f"    keys {t.ks}-{t.ke - 1}: {what}", markup=False)
