"""``attnlab backends``: which backend runs a call of a given shape, and why the others do not."""

from __future__ import annotations

import typer

from attnlab._checks import divisible, non_negative_int, one_of, positive_int, probability
from attnlab.cli._errors import fail, option_errors
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
    window: int = typer.Option(0, "--window", show_default=False,
                               help="A causal sliding-window mask mod of this many keys."),
    documents: int = typer.Option(0, "--documents", show_default=False,
                                  help="This many equal packed documents (causal document mask mod)."),
    prefix: int = typer.Option(0, "--prefix", show_default=False,
                               help="A prefix-LM mask mod with this many prefix keys."),
    chunk: int = typer.Option(0, "--chunk", show_default=False,
                              help="A chunked-local mask mod with chunks of this many keys."),
    plain_mod: bool = typer.Option(False, "--plain-mod",
                                   help="A plain mask function (i >= j) that declares no key bounds."),
) -> None:
    """Explain which backend attnlab.attention runs for a call of this shape, and why each other
    backend was passed over (cannot serve / O(T^2) memory where O(T) serves / slower)."""
    from attnlab import backends

    tk, kv_heads = _check_options(dtype, align, tq, tk, d, heads, kv_heads, batch, dropout, device)
    q, k, v, mask = _placeholders(dtype, device, batch, heads, kv_heads, tq, tk, d, grad, padding)
    structured = _structured_mask(tq, tk, align, window, documents, prefix, chunk, plain_mod)
    if structured is not None:
        if mask is not None:
            fail("--padding cannot be combined with --window/--documents/--prefix/--chunk/--plain-mod")
        mask = structured
    options = dict(causal=causal, align=align, dropout_p=dropout)
    if mask is not None:
        options["mask"] = mask
    with option_errors():  # anything dispatch still refuses is a bad combination of options
        text = backends.why(q, k, v, **options)
    typer.echo(f"backends available here: {', '.join(backends.available())}")
    typer.echo(text)


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


def _structured_mask(tq, tk, align, window, documents, prefix, chunk, plain_mod):
    """The one mask mod the structured-mask options ask for (None when none is given)."""
    import torch

    from attnlab import masks

    given = {"--window": window, "--documents": documents, "--prefix": prefix, "--chunk": chunk}
    with option_errors():
        for option, value in given.items():
            non_negative_int(option, value)
    chosen = [option for option, value in given.items() if value] + (["--plain-mod"] if plain_mod else [])
    if len(chosen) > 1:
        fail(f"give at most one structured mask; got {' and '.join(chosen)}")
    if window:
        return masks.sliding_window_mod(tq, tk, window, align=align)
    if documents:
        length = max(tq, tk)
        return masks.document_mod(torch.arange(length) * documents // length)
    if prefix:
        return masks.prefix_lm_mod(tq, tk, prefix, align=align)
    if chunk:
        return masks.chunked_local_mod(tq, tk, chunk, align=align)
    if plain_mod:
        return lambda b, h, i, j: i >= j
    return None


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
    app.command("backends")(backends_command)
