"""``attnlab train``: train a small GPT on a task that needs attention, then name the heads that do it.

``--heads`` takes one count for every layer (``2``) or one per layer (``2,1``). Everything is
checked before anything is written: a bad ``--text`` file, ``--steps 0``, a ``--heads`` that is
not counts, has the wrong number of them or does not divide ``--d-model``, or an unwritable
``--out`` give one ``error:`` line (exit 2) and leave nothing behind. Ctrl-C finishes the
current step, saves a checkpoint and prints the command that resumes it (exit 130); a second
Ctrl-C stops at once.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch
import typer

from attnlab import io as _io
from attnlab import train as _train
from attnlab._checks import one_of, positive_int, positive_number
from attnlab.cli._errors import INTERRUPTED_EXIT, MAX_SEED, check_seed, fail, option_errors
from attnlab.trained import format_heads

DEFAULT_OUT = Path("attnlab-train")


def train(
    task: str = typer.Option("induction", "--task", help=f"{', '.join(_train.TASKS)}."),
    layers: int = typer.Option(None, "--layers", help="Transformer layers (induction: 2)."),
    heads: str = typer.Option(None, "--heads", help="Attention heads: one count for every layer (2) or one per "
                                                    "layer (2,1); each must divide --d-model (induction: 2,1)."),
    d_model: int = typer.Option(None, "--d-model", help="Width of the residual stream."),
    attention_only: bool = typer.Option(None, "--attention-only/--mlp",
                                        help="Blocks without/with MLP (induction and recall: attention-only)."),
    steps: int = typer.Option(None, "--steps", help="Optimizer steps in all (with --resume: the new total)."),
    batch_size: int = typer.Option(None, "--batch-size", help="Sequences per step."),
    lr: float = typer.Option(None, "--lr", help="Peak learning rate (warm-up, then cosine decay)."),
    seed: int = typer.Option(0, "--seed", help=f"Seed of the initial weights and the data, 0 to {MAX_SEED}."),
    device: str = typer.Option("cpu", "--device", help="torch device (cpu, cuda, ...)."),
    positions: str = typer.Option(None, "--positions", help="rope or learned (default: the task's)."),
    text: Path = typer.Option(None, "--text", help="--task text: the UTF-8 text file to model."),
    threads: int = typer.Option(1, "--threads",
                                help="CPU threads; tiny models run fastest on one (threads mostly wait on each other)."),
    out: Path = typer.Option(None, "--out", help=f"Checkpoint and report folder (default {DEFAULT_OUT}; "
                                                 "with --resume: the resumed folder)."),
    resume: Path = typer.Option(None, "--resume", help="Continue the checkpoint in this folder at its step."),
) -> None:
    """Train a GPT built from attnlab modules on a synthetic task (default: induction) on this
    machine, with a progress bar; evaluate on held-out data; write a checkpoint, config.json,
    metrics.json (loss, accuracy, per-head scores), curves and attention heatmaps into --out;
    and name the heads that do the task (previous-token and induction scores, head ablation)."""
    from rich.console import Console

    check_seed(seed)
    with option_errors():
        positive_int("--threads", threads)
        trainer = _make_trainer(task, layers, heads, d_model, attention_only, steps, batch_size, lr, seed,
                                device, positions, text, resume)
    out = out if out is not None else (resume if resume is not None else DEFAULT_OUT)
    _check_out(out)
    torch.set_num_threads(threads)
    console = Console(highlight=False)
    c = trainer.config
    console.print(f"attnlab train --task {c.task}: {c.layers} layer{'s' if c.layers != 1 else ''} x {format_heads(trainer.model.heads_per_layer)} "
                  f"heads, d_model {c.d_model}, "
                  f"{'attention-only' if c.attention_only else 'with MLP'}, {c.positions} positions; "
                  f"{c.steps} steps of {c.batch_size} x {trainer.task.seq_len} tokens, from step {trainer.step}",
                  markup=False, soft_wrap=True)
    result = _run(trainer, out, console)
    if result.interrupted:
        console.print(f"Interrupted at step {result.step} of {c.steps}; checkpoint saved in {out}. "
                      f"Resume with: attnlab train --resume {out}", markup=False, soft_wrap=True)
        raise typer.Exit(INTERRUPTED_EXIT)
    _finish(trainer, result, out, console)


def _make_trainer(task, layers, heads, d_model, attention_only, steps, batch_size, lr, seed, device,
                  positions, text, resume) -> _train.Trainer:
    """The trainer for the options (every ValueError names its option); nothing is written."""
    _check_device(device)
    if resume is not None:
        fixed = {"--layers": layers, "--heads": heads, "--d-model": d_model, "--attention-only/--mlp": attention_only,
                 "--batch-size": batch_size, "--lr": lr, "--positions": positions, "--text": text}
        given = [option for option, value in fixed.items() if value is not None]
        if given:
            fail(f"{', '.join(given)} cannot change on --resume (the checkpoint fixes them; only --steps, "
                 "--device, --threads and --out can)")
        if steps is not None:
            positive_int("--steps", steps)
        try:
            return _train.Trainer.resume(resume, steps=steps, device=device)
        except FileNotFoundError as err:
            fail(f"--resume {str(resume)!r}: {err}")
        except ValueError as err:
            fail(f"--resume {str(resume)!r}: {err}")
    named = {"--layers": layers, "--d-model": d_model, "--steps": steps, "--batch-size": batch_size}
    for option, value in named.items():
        if value is not None:
            positive_int(option, value)
    if lr is not None:
        positive_number("--lr", lr)
    if task != "text" and text is not None:
        fail(f"--text is only for --task text (got --task {task})")
    one_of("--task", task, _train.TASKS)
    counts = None if heads is None else _parse_heads(heads)
    _check_heads(task, counts, layers, d_model)
    config = _train.TrainConfig(task=task, layers=layers, heads=counts, d_model=d_model, attention_only=attention_only,
                                steps=steps, batch_size=batch_size, lr=lr, seed=seed, device=device,
                                positions=positions, text=None if text is None else str(text))
    return _train.Trainer(config)


def _parse_heads(text: str) -> int | tuple[int, ...]:
    """``--heads 2`` -> 2, ``--heads 2,1`` -> (2, 1); anything else is one error line."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        fail(f"--heads must be a head count or one count per layer separated by commas (e.g. 2 or 2,1), "
             f"got {text!r}")
    if min(counts) < 1:
        fail(f"--heads must be positive counts, got {text!r}")
    return counts[0] if len(counts) == 1 else counts


def _check_heads(task: str, heads: int | tuple[int, ...] | None, layers: int | None, d_model: int | None) -> None:
    """One count per layer (or one for all), each dividing --d-model; the task's defaults fill the gaps."""
    defaults = _train.TASK_DEFAULTS[task]
    layers, d_model = layers or defaults["layers"], d_model or defaults["d_model"]
    given = heads is not None
    heads = heads if given else _train.default_heads(task, layers)
    counts = heads if isinstance(heads, tuple) else (heads,)
    shown = f"--heads {','.join(map(str, counts))}" + ("" if given else " (the default)")
    if isinstance(heads, tuple) and len(heads) != layers:
        fail(f"{shown} gives {len(heads)} head counts for {layers} layer{'s' if layers > 1 else ''} "
             "(give one count, or one per layer)")
    bad = [count for count in counts if d_model % count]
    if bad:
        fail(f"{shown} must divide --d-model {d_model} ({bad[0]} does not; each head gets d_model / heads features)")


def _check_device(device: str) -> None:
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        fail(f"--device {device!r} cannot be used here: {str(err).splitlines()[0]}")


def _check_out(out: Path) -> None:
    """Create ``out`` and try a write there now, so an unwritable folder fails before training."""
    created = not out.exists()
    probe = out / ".attnlab-write-test"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")


def _run(trainer: _train.Trainer, out: Path, console) -> _train.TrainResult:
    """Train with a progress bar; the first Ctrl-C asks the loop to stop after the current step."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    stop = {"asked": False}

    def on_sigint(signum, frame):
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True

    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
               TimeElapsedColumn())
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task("train", total=trainer.config.steps, completed=trainer.step, stats="")

            def on_step(step, loss, accuracy, tokens_per_second):
                held = trainer.history["eval_accuracy"][-1] if trainer.history["eval_accuracy"] else float("nan")
                progress.update(bar, completed=step, stats=(
                    f"loss {loss:.3f}  acc {100 * accuracy:5.1f} %  held-out {100 * held:5.1f} %  "
                    f"{tokens_per_second:,.0f} tok/s"))

            return trainer.train(on_step=on_step, should_stop=lambda: stop["asked"], out=out)
    finally:
        signal.signal(signal.SIGINT, previous)


def _finish(trainer: _train.Trainer, result: _train.TrainResult, out: Path, console) -> None:
    """Scores, ablation, summary, figures; metrics.json gets the heads and the summary."""
    analysis = _train.analyze(trainer)
    metrics = {**result.metrics, **{k: analysis[k] for k in ("heads", "summary", "induction_heads_ablated")
                                     if k in analysis}}
    _io.write_atomically(json.dumps(metrics, indent=1) + "\n", out / _train.METRICS_FILE, what="the metrics")
    written = _train.write_figures(trainer, analysis, out)
    m = result.metrics
    console.print(f"Held-out: loss {m['loss']:.4f}, accuracy {100 * m['accuracy']:.2f} % after {m['steps']} steps "
                  f"({m['seconds']:.1f} s of training, {m['tokens_per_second'] or 0:,.0f} tokens/s).",
                  markup=False, soft_wrap=True)
    _print_heads(console, analysis["heads"])
    console.print(analysis["summary"], markup=False, soft_wrap=True)
    console.print("Files written:")
    for path in [out / "model.safetensors", out / "config.json", out / _train.METRICS_FILE, *written]:
        console.print(f"  {path}", markup=False, soft_wrap=True)
    console.print(f"See the heads with: attnlab explain --model {out}", markup=False, soft_wrap=True)


def _print_heads(console, heads: dict) -> None:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title="Per head (held-out data)", title_justify="left")
    for column in ("layer", "head", "previous-token", "induction", "accuracy ablated"):
        table.add_column(column, justify="right")
    for layer, row in enumerate(heads["previous_token"]):
        for head, previous in enumerate(row):
            table.add_row(str(layer), str(head), f"{previous:.3f}", f"{heads['induction'][layer][head]:.3f}",
                          f"{100 * heads['ablation_accuracy'][layer][head]:.1f} %")
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add the ``train`` command to ``app``."""
    app.command("train")(train)
