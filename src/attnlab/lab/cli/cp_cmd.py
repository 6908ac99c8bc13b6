"""``attnlab context-parallel``: ring and Ulysses attention on several processes, checked and timed."""

from __future__ import annotations

import os

import typer

from attnlab._checks import divisible, one_of, positive_int
from attnlab.lab.cli._errors import at_most, check_seed, fail, option_errors
from attnlab.lab.cli._help import HelpCommand

_MAX_PROCESSES = 64  # local processes; more belong on a real cluster under torchrun


def context_parallel(
    nproc: int = typer.Option(2, "--nproc", help="Local processes to start (ignored under torchrun)."),
    seq_len: int = typer.Option(1024, "--seq-len", help="Global sequence length T (a multiple of 2*P for zigzag)."),
    batch: int = typer.Option(1, "--batch", help="Batch size B."),
    heads: int = typer.Option(4, "--heads", help="Query heads (Ulysses needs a multiple of P)."),
    kv_heads: int = typer.Option(None, "--kv-heads", show_default=False,
                                 help="Key/value heads for grouped-query attention (default: --heads)."),
    head_dim: int = typer.Option(64, "--head-dim", help="Head size D."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, fp64 or bf16."),
    causal: bool = typer.Option(True, "--causal/--no-causal", help="Causal mask over global positions."),
    layout: str = typer.Option("zigzag", "--layout", help="zigzag or contiguous."),
    method: str = typer.Option("both", "--method", help="ring, ulysses or both."),
    backward: bool = typer.Option(True, "--backward/--no-backward", help="Also run and check the backward pass."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random problem."),
) -> None:
    """Shard a random problem across processes, run ring and Ulysses attention forward and
    backward, gather the results and compare them with single-process attention on the whole
    sequence (error vs fp64 within attnlab's tolerance rule). Prints, per method and rank, the
    time, bytes sent and peak tensor memory. Runs `--nproc` local processes with gloo, or the
    ranks `torchrun --nproc-per-node P -m attnlab.lab.cli._cp_check` started (NCCL on GPUs).
    Exits 1 when a result is outside the rule."""
    from attnlab.lab.bench import context_parallel as _cp
    from attnlab.distributed import LAYOUTS

    checked = ("ring", "ulysses")  # the methods this check runs (hybrid needs a 2-D grid of ranks)

    with option_errors():
        for name, value in (("--nproc", nproc), ("--seq-len", seq_len), ("--batch", batch),
                            ("--heads", heads), ("--head-dim", head_dim)):
            positive_int(name, value)
        if kv_heads is not None:
            positive_int("--kv-heads", kv_heads)
            divisible("--heads", heads, "--kv-heads", kv_heads)
        one_of("--dtype", dtype, tuple(_cp.DTYPES))
        one_of("--layout", layout, LAYOUTS)
        one_of("--method", method, checked + ("both",))
    at_most("--nproc", nproc, _MAX_PROCESSES, "local processes; use torchrun on a cluster")
    check_seed(seed)
    world = _world(nproc, _cp.under_torchrun())
    pieces = world * (2 if layout == "zigzag" else 1)
    if seq_len % pieces:
        fail(f"--seq-len must be a multiple of {pieces} (P={world} ranks, layout {layout}), got {seq_len}")
    if method in ("ulysses", "both") and (heads % world or (kv_heads or heads) % world):
        fail(f"Ulysses needs --heads and --kv-heads divisible by P={world}; got {heads} and {kv_heads or heads}"
             " (or use --method ring)")
    spec = _cp.CheckSpec(seq_len=seq_len, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         dtype=dtype, causal=causal, layout=layout, backward=backward, seed=seed,
                         methods=checked if method == "both" else (method,))
    try:
        rows = _cp.run_check(spec, nproc=nproc)
    except RuntimeError as error:
        fail(str(error))
    if _print(rows, spec) is False:
        raise typer.Exit(code=1)


def _world(nproc: int, torchrun: bool) -> int:
    return int(os.environ["WORLD_SIZE"]) if torchrun else nproc


def _print(rows: list[dict], spec) -> bool | None:
    """Print the table on rank 0 (or the launching process); False when a check failed."""
    import torch.distributed as dist
    from rich.console import Console
    from rich.table import Table

    from attnlab.lab.bench.timing import machine_line

    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    console = Console(width=max(140, Console().width))
    world = rows[0]["world"]
    table = Table(title=f"context-parallel attention, P={world}, T={spec.seq_len}, B={spec.batch}, "
                        f"H={spec.heads}/{spec.kv_heads or spec.heads}, D={spec.head_dim}, {spec.dtype}, "
                        f"{'causal' if spec.causal else 'no mask'}, {spec.layout}")
    for column in ("method", "rank", "fwd ms", "bwd ms", "MiB sent", "peak MiB", "scores fwd/bwd",
                   "max error out / dq / dk / dv vs fp64"):
        table.add_column(column, justify="left" if column in ("method",) else "right")
    ok = True
    for row in rows:
        errors = "-"
        if "error_out" in row:
            names = ("out", "dq", "dk", "dv") if spec.backward else ("out",)
            errors = " / ".join(f"{row['error_' + n]:.1e}" for n in names)
            errors += " [green]ok[/green]" if row["ok"] else " [red]FAIL[/red]"
            ok = ok and row["ok"]
        table.add_row(row["method"], str(row["rank"]), f"{row['forward_s'] * 1e3:.1f}",
                      f"{row['backward_s'] * 1e3:.1f}" if spec.backward else "-",
                      f"{row['bytes_sent'] / 2**20:.2f}", f"{row['peak_bytes'] / 2**20:.1f}",
                      f"{row['scores']['forward'] / 1e6:.3g}M/{row['scores']['backward'] / 1e6:.3g}M" if row["method"] == "ring" else "-",
                      errors)
    console.print(table)
    model, _threads, device, version = machine_line().rsplit(", ", 3)  # this process's threads are not a rank's
    console.print(f"machine: {model}; {rows[0]['threads']} thread(s) per rank; {device}, {version}")
    return ok


def register(app: typer.Typer) -> None:
    """Add the ``context-parallel`` command to ``app``."""
    app.command("context-parallel", cls=HelpCommand)(context_parallel)
