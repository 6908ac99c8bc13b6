"""``attnlab backends``: which backend runs a call of a given shape, and why the others do not."""

from __future__ import annotations

import typer

from attnlab._checks import divisible, non_negative_int, one_of, positive_int, probability
from attnlab.lab.cli._errors import at_most, fail, option_errors
from attnlab.lab.cli._help import HelpCommand
from attnlab.lab.cli._memory import refuse_if_too_big
from attnlab.masks import ALIGNMENTS

DTYPES = ("float32", "bfloat16", "float16", "float64")
DEVICES = ("cpu", "cuda")


def backends_command(
    dtype: str = typer.Option("float32", "--dtype", help=f"One of {', '.join(DTYPES)}."),
    causal: bool = typer.Option(False, "--causal", help="Causal mask."),
    align: str = typer.Option("top_left", "--align", help=f"Causal alignment: {' or '.join(ALIGNMENTS)}."),
    padding: bool = typer.Option(False, "--padding", help="A key-padding mask (the last quarter padded)."),
    tq: int = typer.Option(1024, "--tq", help="Query length."),
    tk: int = typer.Option(0, "--tk", show_default=False, help="Key length (default: --tq)."),
    d: int = typer.Option(64, "--d", help="Head dim."),
    heads: int = typer.Option(8, "--heads", help="Query heads."),
    kv_heads: int = typer.Option(0, "--kv-heads", show_default=False,
                                 help="Key/value heads, dividing --heads (default: --heads)."),
    batch: int = typer.Option(1, "--batch", help="Batch size."),
    dropout: float = typer.Option(0.0, "--dropout", help="Dropout probability, in [0, 1)."),
    grad: bool = typer.Option(False, "--grad", help="The call needs gradients (training)."),
    device: str = typer.Option("cpu", "--device", help=f"Where the call runs: {' or '.join(DEVICES)}."),
    window: int = typer.Option(None, "--window", show_default=False,
                               help="A causal sliding-window mask mod of this many keys (1 to --tk)."),
    documents: int = typer.Option(None, "--documents", show_default=False,
                                  help="This many equal packed documents (causal document mask mod; 1 to the "
                                       "sequence length)."),
    prefix: int = typer.Option(None, "--prefix", show_default=False,
                               help="A prefix-LM mask mod with this many prefix keys (0 to --tk; 0 is plain causal)."),
    chunk: int = typer.Option(None, "--chunk", show_default=False,
                              help="A chunked-local mask mod with chunks of this many keys (1 to --tk)."),
    plain_mod: bool = typer.Option(False, "--plain-mod",
                                   help="A plain mask function (i >= j) that declares no key bounds."),
    memory_budget: float = typer.Option(None, "--memory-budget", metavar="MIB", show_default=False,
                                        help="MiB auto may spend beyond the call's tensors (a dense mask, "
                                             "scores) [default: 4x the tensors, 64 MiB to 1/8 of memory]."),
    run: bool = typer.Option(False, "--run", help="Also run the call once under torch.profiler and say which "
                                                  "backend and kernel actually ran (warning on a mismatch)."),
) -> None:
    """Explain which backend attnlab.attention runs for a call of this shape, and why each other
    backend was passed over (cannot serve / over the memory budget / slower)."""
    from attnlab import backends

    tk, kv_heads = _check_options(dtype, align, tq, tk, d, heads, kv_heads, batch, dropout, device)
    given = {option: value for option, value in (("--window", window), ("--documents", documents),
                                                 ("--prefix", prefix), ("--chunk", chunk)) if value is not None}
    if plain_mod:
        given["--plain-mod"] = True
    _check_structured(given, tq, tk)
    if padding and given:
        fail(f"--padding cannot be combined with {' or '.join(given)}")
    _check_memory(dtype, device, batch, heads, kv_heads, tq, tk, d)
    q, k, v, mask = _placeholders(dtype, device, batch, heads, kv_heads, tq, tk, d, grad, padding)
    structured, described = _structured_mask(tq, tk, align, given)
    options = dict(causal=causal or given.get("--prefix") == 0, align=align, dropout_p=dropout)
    mask = structured if structured is not None else mask
    if mask is not None:
        options["mask"] = mask
    budget = _budget_bytes(memory_budget)
    previous = backends.set_memory_budget(budget) if budget is not None else None
    try:
        with option_errors():  # anything dispatch still refuses is a bad combination of options
            text = backends.why(q, k, v, run=run, **options)
    finally:
        if budget is not None:
            backends.set_memory_budget(previous)
    typer.echo(f"backends available here: {', '.join(backends.available())}")
    if described:
        typer.echo(f"mask: {described}")
    typer.echo(text)


_MAX_BUDGET_MIB = 2**42  # 2**62 bytes: the largest budget dispatch takes (sizes are int64)


def _budget_bytes(mib: float | None) -> int | None:
    """``--memory-budget`` in bytes (None: the default); refused unless a finite number >= 0 that
    dispatch can hold (at most 2**62 bytes, as every size it reads is an int64)."""
    if mib is None:
        return None
    if not mib >= 0 or mib == float("inf"):
        fail(f"--memory-budget must be a finite number of MiB >= 0, got {mib}")
    if mib > _MAX_BUDGET_MIB:
        fail(f"--memory-budget must be at most {_MAX_BUDGET_MIB} MiB (2**62 bytes), got {mib:g}")
    return int(mib * 2**20)


def _check_options(dtype, align, tq, tk, d, heads, kv_heads, batch, dropout, device) -> tuple[int, int]:
    """Refuse bad values by option name before any tensor exists; return (tk, kv_heads) resolved."""
    with option_errors():
        one_of("--dtype", dtype, DTYPES)
        one_of("--device", device, DEVICES)
        one_of("--align", align, ALIGNMENTS)
        for option, value in (("--tq", tq), ("--d", d), ("--heads", heads), ("--batch", batch)):
            positive_int(option, value)
        non_negative_int("--tk", tk)  # 0 means "same as --tq"
        non_negative_int("--kv-heads", kv_heads)  # 0 means "same as --heads"
        probability("--dropout", dropout)
        divisible("--heads", heads, "--kv-heads", kv_heads or heads)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("--device cuda: CUDA is not available here")
    return tk or tq, kv_heads or heads


def _check_structured(given: dict, tq: int, tk: int) -> None:
    """Refuse, by name, a structured-mask size the library refuses or that cannot mean anything.

    A window or chunk of 0 keys would leave every query with nothing to attend (the library
    refuses it), as would 0 documents; a prefix of 0 keys is plain causal attention. Past the key
    length (the sequence length, for documents) a size means nothing more: it is refused rather
    than silently taken as the key length.
    """
    if len(given) > 1:
        fail(f"give at most one structured mask; got {' and '.join(given)}")
    length = max(tq, tk)
    caps = {"--window": (tk, "a window of every key is plain causal attention"),
            "--chunk": (tk, "one chunk of every key is plain causal attention"),
            "--prefix": (tk, "a prefix of every key is full attention"),
            "--documents": (length, "each document needs a position")}
    for option, value in given.items():
        if option == "--plain-mod":
            continue
        with option_errors():
            (non_negative_int if option == "--prefix" else positive_int)(option, value)
        cap, why = caps[option]
        at_most(option, value, cap, f"{'the sequence length' if option == '--documents' else '--tk'}: {why}")


def _structured_mask(tq: int, tk: int, align: str, given: dict):
    """The mask mod the structured-mask options ask for (None when none is given, or for plain
    causal) and one line describing it (empty when none is given)."""
    import torch

    from attnlab import masks

    if not given:
        return None, ""
    option, value = next(iter(given.items()))
    if option == "--window":
        return masks.sliding_window_mod(tq, tk, value, align=align), (
            f"--window {value}: causal sliding window, each query sees its last {value} keys (a mask mod)")
    if option == "--documents":
        length = max(tq, tk)
        ids = torch.arange(length) * value // length  # (T,): `value` runs of equal length
        return masks.document_mod(ids), (f"--documents {value}: {value} packed documents of ~{length // value} "
                                         "positions, causal within each (a mask mod)")
    if option == "--prefix" and value == 0:
        return None, "--prefix 0: no prefix keys, so plain causal attention (causal=True)"
    if option == "--prefix":
        return masks.prefix_lm_mod(tq, tk, value, align=align), (
            f"--prefix {value}: every query sees the first {value} keys, the rest causally (a mask mod)")
    if option == "--chunk":
        return masks.chunked_local_mod(tq, tk, value, align=align), (
            f"--chunk {value}: each query sees the earlier keys of its own {value}-key chunk (a mask mod)")
    return (lambda b, h, i, j: i >= j), "--plain-mod: a plain function i >= j that declares no key bounds"


def _check_memory(dtype: str, device: str, batch: int, heads: int, kv_heads: int, tq: int, tk: int, d: int) -> None:
    """Refuse, naming the sizes to lower, a call whose q, k and v cannot fit in the device's memory."""
    import torch

    item = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    defaults = {"--batch": 1, "--heads": 8, "--kv-heads": 0, "--tq": 1024, "--tk": 0, "--d": 64}

    def need(o: dict) -> int:
        tq_, heads_ = o["--tq"], o["--heads"]
        tk_, kv_ = o["--tk"] or tq_, o["--kv-heads"] or heads_  # 0: the same as --tq / --heads
        return item * o["--batch"] * o["--d"] * (heads_ * tq_ + 2 * kv_ * tk_)  # q, k and v

    options = {"--batch": batch, "--heads": heads, "--kv-heads": kv_heads if kv_heads != heads else 0, "--tq": tq,
               "--tk": tk if tk != tq else 0, "--d": d}
    refuse_if_too_big(need, options, defaults, device=device, what="the call's q, k and v tensors")


def _placeholders(dtype, device, batch, heads, kv_heads, tq, tk, d, grad, padding):
    """q, k, v (and the padding mask, or None) of the described call."""
    import torch

    from attnlab import masks

    torch_dtype = getattr(torch, dtype)
    # Dispatch reads shapes, dtypes and flags, and some backends scan the values for NaN/inf:
    # zeros (not uninitialised memory, which may hold NaN) keep the answer deterministic.
    q = torch.zeros(batch, heads, tq, d, dtype=torch_dtype, device=device, requires_grad=grad)
    k = torch.zeros(batch, kv_heads, tk, d, dtype=torch_dtype, device=device, requires_grad=grad)
    v = torch.zeros(batch, kv_heads, tk, d, dtype=torch_dtype, device=device, requires_grad=grad)
    mask = None
    if padding:
        lengths = torch.full((batch,), max(1, (3 * tk) // 4), device=device)
        mask = masks.padding_mask(lengths, tk)
    return q, k, v, mask


def register(app: typer.Typer) -> None:
    """Add the ``backends`` command to ``app``."""
    app.command("backends", cls=HelpCommand)(backends_command)
