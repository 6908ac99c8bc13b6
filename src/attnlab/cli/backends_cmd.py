"""``attnlab backends``: which backend runs a call of a given shape, and why the others do not."""

from __future__ import annotations

import typer

_DTYPES = ("float32", "bfloat16", "float16", "float64")


def backends_command(
    dtype: str = typer.Option("float32", "--dtype", help=f"One of {', '.join(_DTYPES)}."),
    causal: bool = typer.Option(False, "--causal", help="Causal mask."),
    align: str = typer.Option("top_left", "--align", help="Causal alignment: top_left or bottom_right."),
    padding: bool = typer.Option(False, "--padding", help="A key-padding mask (the last quarter padded)."),
    tq: int = typer.Option(1024, "--tq", help="Query length."),
    tk: int = typer.Option(0, "--tk", help="Key length (default: --tq)."),
    d: int = typer.Option(64, "--d", help="Head dim."),
    heads: int = typer.Option(8, "--heads", help="Query heads."),
    kv_heads: int = typer.Option(0, "--kv-heads", help="Key/value heads (default: --heads)."),
    batch: int = typer.Option(1, "--batch", help="Batch size."),
    dropout: float = typer.Option(0.0, "--dropout", help="Dropout probability."),
    grad: bool = typer.Option(False, "--grad", help="The call needs gradients (training)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
) -> None:
    """Explain which backend attnlab.attention runs for a call of this shape, and why each other
    backend was passed over (cannot serve / O(T^2) memory where O(T) serves / slower)."""
    import torch

    from attnlab import backends, masks

    if dtype not in _DTYPES:
        raise typer.BadParameter(f"must be one of {_DTYPES}, got {dtype!r}", param_hint="--dtype")
    tk = tk or tq
    kv_heads = kv_heads or heads
    torch_dtype = getattr(torch, dtype)
    # Only shapes, dtypes and flags matter to dispatch: uninitialised tensors are enough.
    q = torch.empty(batch, heads, tq, d, dtype=torch_dtype, device=device, requires_grad=grad)
    k = torch.empty(batch, kv_heads, tk, d, dtype=torch_dtype, device=device, requires_grad=grad)
    v = torch.empty(batch, kv_heads, tk, d, dtype=torch_dtype, device=device, requires_grad=grad)
    options = dict(causal=causal, align=align, dropout_p=dropout)
    if padding:
        lengths = torch.full((batch,), max(1, (3 * tk) // 4), device=device)
        options["mask"] = masks.padding_mask(lengths, tk)
    try:
        text = backends.why(q, k, v, **options)
    except (ValueError, TypeError) as error:
        raise typer.BadParameter(str(error)) from error
    typer.echo(f"backends available here: {', '.join(backends.available())}")
    typer.echo(text)


def register(app: typer.Typer) -> None:
    """Add the ``backends`` command to ``app``."""
    app.command("backends")(backends_command)
