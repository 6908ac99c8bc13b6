"""``attnlab explain``: walk a sentence through attention step by step, then through a trained model.

Prints every intermediate (tokens, embeddings, W_q/W_k/W_v, queries, keys, values, scores,
mask, weights, context vectors) as labelled tables, says where the focused word attends most
and least, and writes heatmaps (PNG, SVG) and a self-contained HTML report. With the trained
MiniLM installed it ends with what that model's heads do with the same sentence.
``--model minilm`` (or a model directory) walks the trained model itself instead; a transformers
checkpoint directory of any other model type (GPT-2, Llama, Qwen2, ...) is opened with its attention
on attnlab and shown layer by layer and head by head (``--generate N``: where each head looked for
each generated token). ``--walk flash|sparse|linear`` computes the tutorial walk's attention the
fast ways instead (``attnlab.lab.cli._fast_walk``).

Bad input (an empty sentence, an unknown ``--query`` word, a bad ``--mode``, a malformed
option) is reported on ONE line starting with ``error:``, with exit status 2 and no traceback, and
leaves behind no ``--out`` folder the command created.
"""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab import scores
from attnlab._checks import finite_number, positive_int, positive_number, probability
from attnlab.lab.cli import _fast_walk as fast_walk
from attnlab.lab.cli import _kernel as kernel
from attnlab.lab.cli._fast_walk import DEFAULT_TILE, DEFAULT_TOPK, MAX_PAD
from attnlab.lab.cli._errors import MAX_SEED, at_most, check_seed, fail, option_errors, removed_on_failure
from attnlab.lab.cli._help import command_class

FORMATS = ("png", "svg", "html", "all")

TUTORIAL = "tutorial"
TERMINAL_MAX = 24  # rows/columns printed per table; the report has the rest
# explain is for reading every number: sizes past these print nothing more useful, and the
# 50 000-row embedding table alone grows by 200 KB per unit of --d-model.
MAX_SIZE = 1024
MAX_HEADS = 16
MAX_GENERATE = 256
MAX_WALK_TOKENS = 512  # the step-by-step walk's words (its report holds every T x T table)
MAX_TEXT_MB = 10  # --text-file: a few hundred thousand tokens, more than any view is useful for
MAX_MASK_SIZE = 131072  # --mask: the map is 1024 blocks a side at most
MASK_SIZE = 4096  # --mask's queries and keys unless --size says
TRAINED_ONLY = "a trained model (--model minilm or a model directory)"
WALK_ONLY = "the tutorial walk (--model tutorial)"
# The walk's options left out take trace's defaults (attnlab.lab.explain is their home); --help reads them there.
_TRACE_OPTIONS = {"mode": "mode", "d_model": "d_model", "d_kq": "d_kq", "d_v": "d_v", "seed": "seed",
                  "dropout": "dropout_p"}


def _refuse_unused(options: dict[str, object], purpose: str) -> None:
    """Refuse the first of ``options`` given (not None or False): each serves only ``purpose``."""
    for option, value in options.items():
        if value is not None and value is not False:
            fail(f"{option} is for {purpose}; it would do nothing here")


def _walk_options(given: dict) -> dict:
    """The walk's options (``_TRACE_OPTIONS``): those given, and trace's defaults for the others."""
    import inspect

    from attnlab.lab.explain import trace

    defaults = inspect.signature(trace).parameters
    return {name: defaults[argument].default if given[name] is None else given[name]
            for name, argument in _TRACE_OPTIONS.items()}


def _help_defaults() -> dict[str, str]:
    """The defaults ``explain --help`` shows: the sentence, and trace's for the walk's options."""
    from attnlab.lab.explain import DEFAULT_SENTENCE, MODES

    shown = {name: str(value) for name, value in _walk_options(dict.fromkeys(_TRACE_OPTIONS)).items()}
    shown["mode"] += f"; the modes: {', '.join(MODES)}"
    return {**shown, "sentence": DEFAULT_SENTENCE}


def explain(
    sentence: str = typer.Argument(None, show_default=False, help="The sentence to walk through."),
    sentence_option: str = typer.Option(None, "--sentence",
                                        help="The sentence, as an option (same as SENTENCE)."),
    text_file: Path = typer.Option(None, "--text-file",
                                   help="Read the text from this UTF-8 file instead (a long document for --model "
                                        f"DIR: views of any length; at most {MAX_TEXT_MB} MB)."),
    mode: str = typer.Option(None, "--mode", help="How the tokens attend."),
    context: str = typer.Option(None, "--context",
                                help="cross mode: the sentence keys and values come from "
                                     "(default: the second half of SENTENCE; queries use the first half)."),
    heads: int = typer.Option(None, "--heads", help=f"Number of heads (multihead; default 4; at most {MAX_HEADS})."),
    d_model: int = typer.Option(None, "--d-model", help=f"Embedding size (at most {MAX_SIZE})."),
    d_kq: int = typer.Option(None, "--d-kq", help=f"Query/key size per head (at most {MAX_SIZE})."),
    d_v: int = typer.Option(None, "--d-v", help=f"Value size per head (at most {MAX_SIZE})."),
    seed: int = typer.Option(None, "--seed",
                             help=f"Random seed for the embeddings and the weights, 0 to {MAX_SEED}."),
    causal: bool = typer.Option(False, "--causal", help="Mask future tokens (same as --mode causal)."),
    dropout: float = typer.Option(None, "--dropout",
                                  help="Dropout probability on the attention weights, in [0, 1)."),
    softcap: float = typer.Option(None, "--softcap",
                                  help="Cap the scaled scores with C*tanh(S/C) (Gemma 2) and show the weights "
                                       "before and after; C > 0."),
    alibi: bool = typer.Option(False, "--alibi", help="Add ALiBi's per-head distance penalty (BLOOM) and show "
                                                      "the weights before and after."),
    sinks: bool = typer.Option(False, "--sinks", help="Add a sink per head (gpt-oss): one more key of value 0; "
                                                      "its share of each query's attention is shown as a column."),
    sink_logit: float = typer.Option(None, "--sink-logit", help="With --sinks: the sink's logit (default 0)."),
    walk: str = typer.Option(None, "--walk", show_default="textbook",
                             help="How the attention is computed: textbook (the whole score matrix, softmax, "
                                  "weights), flash (FlashAttention's tiles and online softmax), sparse (a lightning "
                                  "indexer's top-k keys, DSA) or linear (a recurrent state instead of scores)."),
    tile: int = typer.Option(None, "--tile", show_default=str(DEFAULT_TILE),
                             help="--walk flash: queries and keys per tile."),
    window: int = typer.Option(None, "--window", help="--walk flash: a causal sliding window of N keys."),
    pad: int = typer.Option(None, "--pad", help=f"--walk flash: pad the keys with N masked zero vectors "
                                               f"(at most {MAX_PAD})."),
    backward: bool = typer.Option(False, "--backward", help="--walk flash: add the backward's D = rowsum(dO*O) "
                                                            "and dS = P(dP - D), beside autograd's."),
    topk: int = typer.Option(None, "--topk", show_default=str(DEFAULT_TOPK),
                             help="--walk sparse: keys each query keeps."),
    rule: str = typer.Option(None, "--rule", show_default="decay",
                             help="--walk linear: additive, decay, delta or gated-delta."),
    precision: str = typer.Option(None, "--precision", show_default="fp32",
                                  help="--walk flash|sparse|linear: fp32 or fp64 (fp64: equal to the textbook up "
                                       "to rounding)."),
    model: str = typer.Option(TUTORIAL, "--model",
                              help="'tutorial' (the step-by-step walk with seeded random weights), 'minilm' "
                                   "(the trained all-MiniLM-L6-v2), a BERT model directory, or any transformers "
                                   "checkpoint directory (GPT-2, Llama, Qwen2, ...: every layer and head)."),
    query: str = typer.Option(None, "--query", help="Word to focus on (default: 'it' if present, else the last word)."),
    layer: int = typer.Option(None, "--layer", help="Trained model: the layer of the head view "
                                                    "(default: the layer of the query word's strongest link)."),
    head: int = typer.Option(None, "--head", help="Trained model: draw only this head in the head view."),
    hide_special: bool = typer.Option(False, "--hide-special",
                                      help="Trained model: leave [CLS]/[SEP] out of the tables and lines."),
    truncate: bool = typer.Option(False, "--truncate",
                                  help="Trained model: cut a sentence longer than the model's positions."),
    generate: int = typer.Option(None, "--generate",
                                 help="A decoder checkpoint (transformers): generate N tokens and write "
                                      "generation.html, where each head looked for each of them."),
    mask: str = typer.Option(None, "--mask", help="Draw a mask's block map instead: causal, window:N, chunk:N, "
                                                  "prefix:N or document:L1,L2,... (joined by &); writes mask.html, .png, .svg "
                                                  "(--format)."),
    size: int = typer.Option(None, "--size", show_default=str(MASK_SIZE),
                             help=f"With --mask: queries and keys (at most {MAX_MASK_SIZE})."),
    out: Path = typer.Option(Path("attnlab-report"), "--out", help="Folder for the pictures and the report."),
    fmt: str = typer.Option("all", "--format", help="png, svg, html or all."),
    no_color: bool = typer.Option(False, "--no-color", help="Plain text output."),
) -> None:
    """Walk SENTENCE through attention, printing every step, and write heatmaps and an HTML report; then
    show what a trained model (all-MiniLM-L6-v2) does with it. --model minilm walks every layer and head
    of the trained model, with the head view."""
    with removed_on_failure(out):  # a refusal leaves no --out folder behind
        if sentence_option is not None:
            if sentence is not None and sentence != sentence_option:
                fail("give the sentence once: as SENTENCE or with --sentence, not two different ones")
            sentence = sentence_option
        if text_file is not None:
            if sentence is not None:
                fail("give the text once: as SENTENCE (or --sentence) or with --text-file, not both")
            sentence = read_text_file(text_file)
        if mask is not None:
            # --mask draws a mask alone: the walk's and the models' options would do nothing with it
            text_option = "--text-file" if text_file is not None else "SENTENCE"
            _refuse_unused({text_option: sentence, "--mode": mode, "--context": context, "--heads": heads,
                            "--d-model": d_model, "--d-kq": d_kq, "--d-v": d_v, "--seed": seed, "--causal": causal,
                            "--dropout": dropout, "--softcap": softcap, "--alibi": alibi, "--sinks": sinks,
                            "--sink-logit": sink_logit, "--walk": walk, "--tile": tile, "--window": window,
                            "--pad": pad, "--backward": backward, "--topk": topk, "--rule": rule,
                            "--precision": precision, "--query": query, "--layer": layer, "--head": head,
                            "--hide-special": hide_special, "--truncate": truncate, "--generate": generate,
                            "--model": None if model == TUTORIAL else model}, "a sentence's walk, not --mask")
            if fmt not in FORMATS:
                fail(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
            _explain_mask(mask, size=MASK_SIZE if size is None else size, out=out, fmt=fmt)
            return
        _refuse_unused({"--size": size}, "--mask")
        fast = {"--walk": walk, "--tile": tile, "--window": window, "--pad": pad, "--backward": backward,
                "--topk": topk, "--rule": rule, "--precision": precision}
        walk_only = {"--mode": mode, "--context": context, "--heads": heads, "--d-model": d_model, "--d-kq": d_kq,
                     "--d-v": d_v, "--seed": seed, "--causal": causal, "--dropout": dropout, "--softcap": softcap,
                     "--alibi": alibi, "--sinks": sinks, "--sink-logit": sink_logit, **fast}
        model_only = {"--layer": layer, "--head": head, "--hide-special": hide_special}
        if fmt not in FORMATS:
            fail(f"--format must be one of {', '.join(FORMATS)}; got {fmt!r}")
        if generate is not None:
            with option_errors():
                positive_int("--generate", generate)
            at_most("--generate", generate, MAX_GENERATE, "the generation view shows every step")
        if sentence is None:
            from attnlab.lab.explain import DEFAULT_SENTENCE

            sentence = DEFAULT_SENTENCE
        if model != TUTORIAL:
            from attnlab.lab.cli import _lens_walk as lens_walk

            _refuse_unused(walk_only, WALK_ONLY)
            if lens_walk.wants_lens(model):
                _refuse_unused(model_only, "a BERT or attnlab GPT model (--model minilm or its directory)")
                _explain_lens(sentence, model=model, query=query, truncate=truncate, generate=generate, out=out,
                              fmt=fmt, no_color=no_color)
                return
        if generate is not None:
            fail("--generate needs a decoder checkpoint directory of transformers (--model DIR)")
        if model != TUTORIAL:
            _explain_trained(sentence, model=model, query=query, layer=layer, head=head, hide_special=hide_special,
                             truncate=truncate, out=out, fmt=fmt, no_color=no_color)
            return
        _refuse_unused({**model_only, "--truncate": truncate}, TRAINED_ONLY)
        fast_options = fast_walk.check_options(walk, tile=tile, window=window, pad=pad, backward=backward, topk=topk,
                                       rule=rule, precision=precision, mode=mode or "self", causal=causal,
                                       plain={"--dropout": dropout, "--softcap": softcap, "--alibi": alibi,
                                              "--sinks": sinks, "--sink-logit": sink_logit})
        from attnlab.lab.explain import trace

        walk = _walk_options(dict(mode=mode, d_model=d_model, d_kq=d_kq, d_v=d_v, seed=seed, dropout=dropout))
        mode, d_model, d_kq, d_v, seed, dropout = (walk[name] for name in _TRACE_OPTIONS)
        _check_numbers(heads, d_model, d_kq, d_v, dropout)
        check_seed(seed)
        score_mod, sink_value = _score_options(softcap, alibi, sinks, sink_logit, mode, heads)
        with option_errors():  # trace refuses only bad options: an empty sentence, a bad mode, ...
            result = trace(sentence, mode=mode, context=context, heads=heads, d_model=d_model, d_kq=d_kq,
                           d_v=d_v, seed=seed, causal=causal, dropout_p=dropout, score_mod=score_mod, sinks=sink_value)
            focus = result.query_index(query)
        longest = max(len(result.tokens), len(result.context_tokens))
        at_most("the sentence's words", longest, MAX_WALK_TOKENS,
                "the walk prints and reports every number; --model DIR views a text of any length")
        from rich.console import Console

        if fast_options is not None:
            fast_walk.run(result, fast_options, focus=focus, out=out, fmt=fmt, no_color=no_color)
            return
        _make_out(out)
        console = Console(no_color=no_color, highlight=False, soft_wrap=False)
        _narrate(console, result, focus)
        kernel.narrate(console, result)  # the walk's call under the profiler, beside the prediction
        section = _trained_ending(console, result, focus)
        try:
            written = _write_files(result, focus, out, fmt, section)
        except OSError as err:
            fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")
        _print_written(console, written, out)


def read_text_file(path: Path) -> str:
    """The text of ``--text-file``: UTF-8, not empty, at most :data:`MAX_TEXT_MB` MB; else one ``error:`` line."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            fail(f"--text-file {str(path)!r} is not a file")
        if size > MAX_TEXT_MB * 1_000_000:
            fail(f"--text-file {str(path)!r} has {size / 1e6:.1f} MB; at most {MAX_TEXT_MB} MB is read")
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        fail(f"--text-file {str(path)!r} does not exist")
    except UnicodeDecodeError as err:
        fail(f"--text-file {str(path)!r} is not UTF-8 text (byte {err.start})")
    except OSError as err:
        fail(f"--text-file {str(path)!r} cannot be read: {err.strerror or err}")
    if not text.strip():
        fail(f"--text-file {str(path)!r} holds no text")
    return text.removeprefix("\ufeff").strip()


def _explain_mask(spec: str, *, size: int, out: Path, fmt: str = "all") -> None:
    """``--mask SPEC``: the mask's block map as ``mask.html``, ``mask.png`` and ``mask.svg`` (those
    ``--format`` names, ``all``: the three) and its counts on one line each."""
    from attnlab.lab.cli._trained_walk import view_formats
    from attnlab.lab.viz import maskview

    with option_errors():
        positive_int("--size", size)
    at_most("--size", size, MAX_MASK_SIZE, "the block map draws at most 1024 blocks a side")
    with option_errors():
        bmap = maskview.block_map(maskview.parse_mask(spec, size=size), size=(size, size))
    _make_out(out)
    view = maskview.map_view(bmap, title=f"--mask {spec} at {size} x {size}")
    try:
        paths = [view.save(out / f"mask.{ext}") for ext in view_formats(fmt)]
    except OSError as err:
        fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")
    counts = bmap.counts()
    print(f"mask {spec} at {size} x {size}, blocks of {bmap.block}: {counts['full']} full, {counts['partial']} partial, "
          f"{counts['empty']} empty")
    print(f"a block-sparse kernel visits {bmap.visited:.1%} of the blocks; {bmap.density:.1%} of the cells are allowed")
    for path in paths:
        print(f"wrote {path}")


def _print_written(console, written: list[Path], out: Path) -> None:
    console.print()
    console.print("[bold]Files written:[/bold]")
    for path in written:
        console.print(f"  {path}", soft_wrap=True, markup=False)
    pages = [p for p in written if p.suffix == ".html"]
    if pages:
        console.print(f"Open {pages[0]} in a browser: it works offline.", soft_wrap=True, markup=False)


def _make_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)  # fail before the walk-through, not after it
    except OSError as err:
        fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")


def _trained_ending(console, result, focus: int):
    """What the trained MiniLM does with the same sentence, or one line on how to get it."""
    from attnlab.lab.cli import _trained_walk as trained_walk
    from attnlab.lab.viz.html import TrainedSection

    console.print()
    console.rule("[bold]What a trained model does with this sentence[/bold]")
    try:
        encoder = trained_walk.BertEncoder.from_pretrained(trained_walk.DEFAULT_MODEL)
        view = trained_walk.trace_model(encoder, result.sentence, truncate=True)
    except (FileNotFoundError, ImportError):
        console.print(f"The trained view needs the MiniLM model: {trained_walk.INSTALL_LINE} "
                      f"(then run `attnlab explain --model minilm`).", markup=False, soft_wrap=True)
        return None
    text, link, query = trained_walk.summary(view, result.tokens[focus], model=trained_walk.DEFAULT_MODEL)
    console.print(text, markup=False, soft_wrap=True)
    console.print("[dim]The report shows its head view; `attnlab explain --model minilm` walks every layer "
                  "and head.[/dim]")
    return TrainedSection(trained_walk.display_name(trained_walk.DEFAULT_MODEL), view, focus=query,
                          layer=link.layer, heads=(link.head,), hide_special=True)


def _explain_trained(sentence: str, *, model: str, query, layer, head, hide_special: bool, truncate: bool,
                     out: Path, fmt: str, no_color: bool) -> None:
    """``--model minilm|DIR``: the trained model's walk, tables and pictures."""
    from rich.console import Console

    from attnlab.lab.cli import _trained_walk as trained_walk

    encoder = trained_walk.load(model)
    view, cut = trained_walk.view_for(encoder, sentence, truncate=truncate)
    trained_walk.check_ranges(view, layer, head)
    with option_errors():
        focus = view.index(query)
    top = trained_walk.strongest(view, focus, hide_special=hide_special)
    layer = top.layer if layer is None else layer
    trained_walk.check_ranges(view, layer, head)  # --head must be one of this layer's heads
    _make_out(out)
    console = Console(no_color=no_color, highlight=False, soft_wrap=False)
    if cut is not None:
        console.print(cut, markup=False, soft_wrap=True)
    trained_walk.narrate(console, view, focus, model=model, hide_special=hide_special, top=top)
    if trained_walk.has_sinks(encoder):
        trained_walk.narrate_sinks(console, view, focus)
    heads = trained_walk.head_view_heads(view, focus, layer, head)
    try:
        written = trained_walk.write_files(view, focus, model=model, layer=layer, heads=heads,
                                           hide_special=hide_special, out=out, fmt=fmt,
                                           sinks=trained_walk.has_sinks(encoder))
    except OSError as err:
        fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")
    _print_written(console, written, out)


def _explain_lens(text: str, *, model: str, query, truncate: bool, generate: int | None, out: Path, fmt: str,
                  no_color: bool) -> None:
    """``--model DIR`` of any transformers model type: every layer and head through attnlab, and generation."""
    from rich.console import Console

    from attnlab.lab.cli import _lens_walk as lens_walk

    lens = lens_walk.load(model)
    _make_out(out)
    console = Console(no_color=no_color, highlight=False, soft_wrap=False)
    written = lens_walk.walk(console, lens, text, query=query, truncate=truncate, generate=generate, out=out, fmt=fmt)
    _print_written(console, written, out)


def _score_options(softcap: float | None, alibi: bool, sinks: bool, sink_logit: float | None, mode: str,
                   heads: int | None):
    """``--softcap``, ``--alibi``, ``--sinks``, ``--sink-logit`` as trace's ``score_mod`` and ``sinks``."""
    parts = []
    with option_errors():
        if softcap is not None:
            parts.append(scores.softcap(positive_number("--softcap", softcap)))
        if sink_logit is not None:
            finite_number("--sink-logit", sink_logit)
    if sink_logit is not None and not sinks:
        fail("--sink-logit needs --sinks")
    if alibi:
        parts.append(scores.alibi(heads or (4 if mode == "multihead" else 1)))
    score_mod = scores.compose(*parts) if parts else None
    return score_mod, (sink_logit or 0.0) if sinks else None


def _check_numbers(heads: int | None, d_model: int, d_kq: int, d_v: int, dropout: float) -> None:
    """Refuse numbers by option name, and bound the sizes so a typo cannot exhaust the memory."""
    sizes = [("--d-model", d_model), ("--d-kq", d_kq), ("--d-v", d_v)]
    with option_errors():
        for option, value in sizes + ([("--heads", heads)] if heads is not None else []):
            positive_int(option, value)
        probability("--dropout", dropout)
    for option, value in sizes:
        at_most(option, value, MAX_SIZE, "explain prints every number")
    if heads is not None:
        at_most("--heads", heads, MAX_HEADS, "explain prints every head")


_KIND = {"self": "self-attention", "causal": "causal self-attention", "multihead": "multi-head attention",
         "cross": "cross-attention"}


def _narrate(console, result, focus: int) -> None:
    """The walk-through: every step of head 0 (and every head's weights), then the focus summary."""
    kind = _KIND[result.mode] + (" (causal)" if result.causal and result.mode == "multihead" else "")
    console.rule(f"[bold]attnlab explain[/bold]: {kind}, {result.heads} head(s), seed {result.seed}")
    if result.mode == "cross":
        console.print(f"Queries from:          {result.sentence!r}", markup=False)
        console.print(f"Keys and values from:  {result.context_sentence!r}", markup=False)
    else:
        console.print(f"Sentence: {result.sentence!r}", markup=False)
    console.print("[dim]Words are split off punctuation (which is dropped), case kept. The embeddings and "
                  "W_q/W_k/W_v are seeded random numbers (an untrained model), so the pattern is arbitrary.[/dim]")
    names = list(dict.fromkeys(s.name for s in result.steps))
    for number, name in enumerate(names, start=1):
        _print_step(console, number, result.step(name, 0), focus, result.heads)
    if result.heads > 1:
        with_sink = " (and with the sink)" if result.sinks is not None else ""
        console.print(f"\n[dim]Heads 1..{result.heads - 1} repeat steps 4-{names.index('context') + 1} with their "
                      f"own weights; their attention weights{with_sink}:[/dim]")
        shown = [name for name in ("weights", "sink_weights") if name in names]
        for h in range(1, result.heads):
            for name in shown:
                _print_step(console, names.index(name) + 1, result.step(name, h), focus, result.heads)
    _print_links(console, result, focus)


def _print_step(console, number: int, step, focus: int, heads: int) -> None:
    head = f", head {step.head}" if step.head is not None and heads > 1 else ""
    console.print()
    from rich.markup import escape

    console.print(f"[bold cyan]Step {number}[/bold cyan]  [bold]{escape(step.title)}[/bold]  "
                  f"[dim]shape {tuple(step.shape)}{head}[/dim]")
    console.print(f"[italic]{escape(step.explanation)}[/italic]")
    for table in _tables(console, step, focus):
        console.print(table)


def _tables(console, step, focus: int):
    """The step as rich tables with token labels, split into column chunks that fit the terminal."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from attnlab.lab.explain import format_value

    values = step.tensor.tolist()
    matrix = values if step.tensor.ndim == 2 else [values]
    rows = list(step.rows or [""])[:TERMINAL_MAX]
    cols = list(step.cols)[:TERMINAL_MAX]
    texts = [[format_value(v) for v in row[:TERMINAL_MAX]] for row in matrix[:TERMINAL_MAX]]
    label_w = max(len(r) for r in rows)
    cell_w = max([len(c) for c in cols] + [len(t) for row in texts for t in row])
    per_chunk = max(1, (console.width - label_w - 4) // (cell_w + 2))
    for start in range(0, len(cols), per_chunk):
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, pad_edge=False)
        table.add_column("", style="bold", no_wrap=True)
        for c in cols[start:start + per_chunk]:
            table.add_column(escape(c), justify="right", no_wrap=True)
        for i, row in enumerate(texts):
            token = None if step.first_row is None else step.first_row + i
            focused = step.rows is not None and token == focus and len(step.rows) == len(matrix)
            style = "bold yellow" if focused else None
            table.add_row(escape(rows[i]), *row[start:start + per_chunk], style=style)
        yield table
    if len(matrix) > TERMINAL_MAX or len(step.cols) > TERMINAL_MAX:
        yield f"[dim](first {TERMINAL_MAX} rows and columns shown; the HTML report has all of them)[/dim]"


def link_sentence(word: str, links) -> str:
    """``'it' attends most to 'meal' (0.3102) and least to 'a' (0.0247).``"""
    from attnlab.lab.explain import format_value

    top, low = links[0], links[-1]
    return (f"'{word}' attends most to '{top.key}' ({format_value(top.weight)}) "
            f"and least to '{low.key}' ({format_value(low.weight)}).")


def _print_links(console, result, focus: int) -> None:
    from attnlab.lab.explain import format_value

    word = result.tokens[focus]
    console.print()
    console.rule(f"[bold]Where '{word}' attends[/bold]")
    if result.heads == 1:
        links = result.links(focus)
        console.print(link_sentence(word, links), markup=False, soft_wrap=True)
        ranked = ", ".join(f"{link.key} {format_value(link.weight)}" for link in links[:5])
        console.print(f"[dim]Strongest first: {ranked}[/dim]", soft_wrap=True)
    else:
        for h in range(result.heads):
            console.print(f"head {h}: " + link_sentence(word, result.links(focus, head=h)), markup=False,
                          soft_wrap=True)
        console.print("mean of heads: " + link_sentence(word, result.links(focus)), markup=False, soft_wrap=True)
    shares = result.sink_shares()  # (H, Tq) or None
    if shares is not None:
        per_head = ", ".join(format_value(float(shares[h, focus])) + (f" (head {h})" if result.heads > 1 else "")
                             for h in range(result.heads))
        console.print(f"The sink takes {per_head} of the attention of '{word}'; the rest goes to the words.",
                      markup=False, soft_wrap=True)
    console.print("[dim]These weights are seeded random numbers (untrained), so the pattern is arbitrary.[/dim]")


def _write_files(result, focus: int, out: Path, fmt: str, section=None) -> list[Path]:
    written = []
    images = [f for f in ("png", "svg") if fmt in (f, "all")]
    if images:
        from attnlab.lab.viz.heatmap import heatmap, save_figure

        kind = _KIND[result.mode]
        text = result.sentence if len(result.sentence) <= 64 else result.sentence[:61] + "..."
        fig = heatmap(result.weights(), rows=result.tokens, cols=result.context_tokens, allowed=result.allowed(),
                      title=f"{kind}: \u201c{text}\u201d (seed {result.seed})")
        written += save_figure(fig, out / "attention", formats=images)
    if fmt in ("html", "all"):
        from attnlab.lab.viz.html import write_report

        written.append(write_report(result, out / "report.html", focus=focus, trained=section))
    return written


def register(app: typer.Typer) -> None:
    """Add the ``explain`` command to ``app``."""
    app.command("explain", cls=command_class(_help_defaults))(explain)
