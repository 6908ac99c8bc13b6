"""What ``attnlab train`` does once :mod:`attnlab.lab.cli.train_cmd` has parsed its options: every check
(nothing written before all pass), the trainer new or resumed, one process or context-parallel
ranks, the progress bar, Ctrl-C's checkpoint, and the report (see that module for the rules).
The command imports this module when it runs, so the command line starts without the lab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
import typer
from rich.console import Console

from attnlab import io as _io
from attnlab.lab import train as _train
from attnlab._checks import one_of, per_layer, positive_int, positive_number
from attnlab.lab.cli._errors import INTERRUPTED_EXIT, at_most, check_seed, fail, option_errors
from attnlab.lab.cli._memory import refuse_if_too_big
from attnlab.lab.cli.train_cmd import DEFAULT_OUT
from attnlab.distributed import METHODS, sequence_layout
from attnlab.distributed import launch  # launch.run_local read at the call: tests stand in for the ranks
from attnlab.distributed.layout import check_length
from attnlab.models.gpt import GPT, LAYER_KINDS, LAYER_TABLE, QK_NORMS, option_letters
from attnlab.nn.native_sparse import paper_sizes
from attnlab.lab.trained import format_heads

_MAX_LOCAL_RANKS = 64  # local processes; more belong on a real cluster under torchrun
_RANK_TIMEOUT = 7 * 24 * 3600.0  # seconds the launcher waits for its ranks (a training run may be long)


def run(given: dict, *, steps: int | None, threads: int, device: str, resume: Path | None, out: Path | None,
        context_parallel: int | None, cp_method: str | None, cp_ulysses: int | None) -> None:
    """Check, train and report: ``given`` holds the options set (by ``TrainConfig`` field name)."""
    _check_options(given, steps, threads)
    sharding = _check_sharding(context_parallel, cp_method, cp_ulysses, device)
    _check_device(device)
    if resume is not None:
        trainer = _resumed_trainer(resume, given, steps, device)
    else:
        trainer = _new_trainer(given, steps, device)
    if sharding is not None:
        _check_shardable(trainer, sharding)
    out = out if out is not None else (resume if resume is not None else DEFAULT_OUT)
    created = not out.exists()
    _check_out(out)
    torch.set_num_threads(threads)
    console = Console(highlight=False)
    c = trainer.config
    if sharding is None or sharding.rank == 0:
        console.print(f"attnlab train --task {c.task}: {c.layers} layer{'s' if c.layers != 1 else ''} x "
                      f"{format_heads(trainer.model.heads_per_layer)} heads, d_model {c.d_model}, "
                      f"{'attention-only' if c.attention_only else 'with MLP'}, {c.positions} positions"
                      f"{f', softcap {c.softcap:g}' if c.softcap is not None else ''}{', sinks' if c.sinks else ''}"
                      f"{_variant_banner(c)}; "
                      f"{c.steps} steps of {c.batch_size} x {trainer.task.seq_len} tokens, from step {trainer.step}"
                      + ("" if sharding is None else f"; {sharding.describe()}"), markup=False, soft_wrap=True)
    if sharding is None:
        result = _run(trainer, out, console)
    else:
        with _removed_if_left_empty(out, created):
            result, trainer = _run_sharded(trainer, sharding, resume=resume, steps=steps, out=out, threads=threads)
        if result is None:  # a rank other than torchrun's rank 0: rank 0 reports
            return
    if result.interrupted:
        again = "" if sharding is None else f" {sharding.options()}"
        console.print(f"Interrupted at step {result.step} of {c.steps}; checkpoint saved in {out}. "
                      f"Resume with: attnlab train --resume {out}{again}", markup=False, soft_wrap=True)
        raise typer.Exit(INTERRUPTED_EXIT)
    _finish(trainer, result, out, console)


# The command line's name of each TrainConfig field an option sets.
FLAGS = {"task": "--task", "layers": "--layers", "heads": "--heads", "d_model": "--d-model",
         "attention_only": "--attention-only/--mlp", "steps": "--steps", "batch_size": "--batch-size", "lr": "--lr",
         "seed": "--seed", "positions": "--positions", "text": "--text", "softcap": "--softcap", "sinks": "--sinks",
         "kv_heads": "--kv-heads", "layer_pattern": "--layer-pattern", "window": "--window",
         "latent_dim": "--latent-dim", "chunk": "--chunk", "topk": "--topk", "nsa_block": "--nsa-block",
         "compress_rate": "--compress-rate", "rope_fraction": "--rope-fraction", "qk_norm": "--qk-norm",
         "head_dim": "--head-dim", "global_head_dim": "--global-head-dim", "nope_temperature": "--nope-temperature",
         "kv_shared_layers": "--kv-shared-layers"}
# The options that size the model and its batch, in the order a refusal for memory considers them.
SIZES = ("d_model", "layers", "heads", "batch_size")


def _shown(name: str, value) -> str:
    """An option as the user would type it: ``--heads 2,1``, ``--mlp``; ``no --text`` for None."""
    if value is None:
        return f"no {FLAGS[name]}"
    if name == "attention_only":
        return "--attention-only" if value else "--mlp"
    if name == "sinks":
        return "--sinks" if value else "no --sinks"
    if name == "heads":
        return f"--heads {format_heads(value if isinstance(value, tuple) else (value,))}"
    if name == "nope_temperature":
        return f"--nope-temperature {','.join(f'{part:g}' for part in value)}"
    return f"{FLAGS[name]} {value}"


def _check_options(given: dict, steps: int | None, threads: int) -> None:
    """Check every value on its own, naming its option; parse ``--heads`` in place. Nothing is read or written."""
    if "seed" in given:
        check_seed(given["seed"])
    with option_errors():
        positive_int("--threads", threads)
        if "task" in given:
            one_of("--task", given["task"], _train.TASKS)
        for name, value in (*given.items(), ("steps", steps)):
            if name in ("layers", "d_model", "batch_size", "steps", "kv_heads", "window", "latent_dim", "chunk",
                        "topk", "nsa_block", "compress_rate", "head_dim", "global_head_dim") \
                    and value is not None:
                positive_int(FLAGS[name], value)
        if given.get("kv_shared_layers", 0) < 0:
            raise ValueError(f"--kv-shared-layers must be >= 0, got {given['kv_shared_layers']}")
        if "lr" in given:
            positive_number("--lr", given["lr"])
        if "positions" in given:
            one_of("--positions", given["positions"], _train.POSITIONS)
        if "softcap" in given:
            positive_number("--softcap", given["softcap"])
        if "rope_fraction" in given and not 0 < positive_number("--rope-fraction", given["rope_fraction"]) <= 1:
            raise ValueError(f"--rope-fraction must be a number in (0, 1], got {given['rope_fraction']}")
        if "qk_norm" in given:
            one_of("--qk-norm", given["qk_norm"], QK_NORMS)
    at_most("--threads", threads, os.cpu_count() or 1, "this machine's CPUs")
    if "heads" in given:
        given["heads"] = _parse_heads(given["heads"])
    if "nope_temperature" in given:
        given["nope_temperature"] = _parse_temperature(given["nope_temperature"])


def _new_trainer(given: dict, steps: int | None, device: str) -> _train.Trainer:
    """The trainer of a new run (every refusal names its option); nothing is written."""
    task_name = given.get("task", "induction")
    if task_name != "text" and "text" in given:
        fail(f"--text is only for --task text (got --task {task_name})")
    if "head_dim" not in given and "global_head_dim" not in given:  # else GPT's check, in _check_model
        _check_heads(task_name, given.get("heads"), given.get("layers"), given.get("d_model"))
    _check_variant(task_name, given)
    options = {name: value for name, value in given.items() if name != "text"}
    config = _train.TrainConfig(**{**options, "task": task_name}, steps=steps, device=device,
                                text=None if "text" not in given else str(given["text"]))
    with option_errors():  # the options are checked above: what is left is the --text file
        task = _train.make_task(config.task, text=config.text)
    _check_memory(config, task, given, device)  # before resolving: --layers 10**11 would build a 10**11-tuple
    _check_model(config, task)
    if "kv_shared_layers" in given:
        _check_sharing(config.resolved())
    return _train.Trainer(config.resolved(), task=task)


# GPT's parameter names in its refusals -> the options that set them.
_GPT_NAMES = {"rope_fraction": "--rope-fraction", "qk_norm": "--qk-norm", "global_head_dim": "--global-head-dim",
              "head_dim": "--head-dim", "nope_temperature": "--nope-temperature", "num_heads": "--heads",
              "d_model": "--d-model", "layer_pattern": "--layer-pattern", "floor_scale": "--nope-temperature FLOOR",
              "attn_scale": "--nope-temperature SCALE"}


def _check_model(config: _train.TrainConfig, task: _train.Task) -> None:
    """Build the model on the meta device (no memory): a refusal of GPT's, with its parameters
    named by their options, for what the options' own checks cannot see (each layer's head width)."""
    if not any(getattr(config, name) is not None for name in
               ("rope_fraction", "qk_norm", "head_dim", "global_head_dim", "nope_temperature")):
        return
    try:
        with torch.device("meta"):
            GPT(task.vocab_size, max_len=task.seq_len, **config.resolved().model_options())
    except (ValueError, TypeError) as err:
        message = str(err).replace(" of head_dim=", " of heads of width ")  # a width --head-dim may not have set
        for name, flag in _GPT_NAMES.items():
            message = re.sub(rf"(?<![\w-]){name}=(\S+?)(?=[\s,;:)]|$)", rf"{flag} \1", message)
            message = re.sub(rf"(?<![\w-]){name}(?!\w)", flag, message)
        fail(message)


def _parse_temperature(text: str) -> tuple[float, float]:
    """``--nope-temperature 8192,0.1`` -> ``(8192.0, 0.1)``; anything else is one error line."""
    parts = text.split(",")
    try:
        pair = tuple(float(part) for part in parts)
    except ValueError:
        pair = ()
    if len(pair) != 2 or not all(math.isfinite(part) for part in pair) or pair[0] <= 0 or pair[1] < 0:
        fail(f"--nope-temperature must be FLOOR,SCALE with FLOOR > 0 and SCALE >= 0 (Llama 4: 8192,0.1), "
             f"got {text!r}")
    return pair


def _check_sharing(config: _train.TrainConfig) -> None:
    """--kv-shared-layers: Gemma's plan over the model's layers (their letters and heads), as the GPT checks it."""
    from attnlab.nn.kv_sharing import kv_sharing_plan

    pattern = config.layer_pattern or "G"
    kinds = [pattern[layer % len(pattern)] for layer in range(config.layers)]
    with option_errors():
        kv_sharing_plan(kinds, config.kv_shared_layers, heads=per_layer("heads", config.heads, config.layers),
                        shareable="".join(k for k, row in LAYER_TABLE.items() if not row.module),
                        name="--kv-shared-layers")


def _check_memory(config: _train.TrainConfig, task: _train.Task, given: dict, device: str) -> None:
    """Refuse, naming the options to lower, a model whose training cannot fit in the device's memory."""
    field = {FLAGS[name]: name for name in SIZES}

    def need(sizes: dict) -> int:
        c = dataclasses.replace(config, **{field[flag]: value for flag, value in sizes.items()})
        return sum(_train.memory_estimate(c, vocab_size=task.vocab_size, seq_len=task.seq_len).values())

    sizes = {flag: given.get(name) for flag, name in field.items()}  # None: the task's default
    refuse_if_too_big(need, sizes, dict.fromkeys(sizes), device=device, what="training this model",
                      shown=lambda flag, value: _shown(field[flag], value))


def _resumed_trainer(resume: Path, given: dict, steps: int | None, device: str) -> _train.Trainer:
    """The trainer continuing ``resume``: options given must agree with the checkpoint's; nothing is written."""
    try:
        config, step, _ = _train.read_checkpoint(resume)
    except (FileNotFoundError, ValueError, KeyError) as err:
        fail(f"--resume {str(resume)!r}: {err}")
    for name, value in given.items():
        saved = getattr(config, name)
        if not _agrees(name, value, saved, config.layers):
            fail(f"{_shown(name, value)} conflicts with the checkpoint in {str(resume)!r}, which was trained with "
                 f"{_shown(name, saved)}; a resumed run keeps its checkpoint's options (leave {FLAGS[name]} out, "
                 "or start a new run with another --out)")
    target = config.steps if steps is None else steps
    if target < step:
        fail(f"--steps {target} is below the step {step} of the checkpoint in {str(resume)!r}: a resumed run can "
             f"only go on (give --steps above {step})")
    if target == step:
        typer.echo(f"Nothing to do: the checkpoint in {str(resume)!r} is already at step {step} of {target}; "
                   f"give --steps above {step} to train it further. Nothing was written.")
        raise typer.Exit(0)
    with option_errors():
        return _train.Trainer.resume(resume, steps=steps, device=device)


def _agrees(name: str, given, saved, layers: int) -> bool:
    """Whether an option given on ``--resume`` says what the checkpoint says (``--heads 2`` = ``2,2``)."""
    if name == "heads":
        try:
            return per_layer("heads", given, layers) == per_layer("heads", saved, layers)
        except ValueError:  # a count per layer for another depth
            return False
    if name == "text":
        return saved is not None and (Path(given) == Path(saved) or _same_file(Path(given), Path(saved)))
    return given == saved


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


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


def _check_variant(task: str, given: dict) -> None:
    """--kv-heads divides every layer's heads; --layer-pattern's letters, with --window, --latent-dim,
    --chunk, --topk, --nsa-block and --compress-rate for its L, M, C, T, S, V and H layers, none without them
    (over --layers)."""
    layers = given.get("layers") or _train.TASK_DEFAULTS[task]["layers"]
    pattern = given.get("layer_pattern")
    if pattern is not None:
        unknown = "".join(sorted(set(pattern) - set(LAYER_KINDS)))
        if not pattern or unknown:
            fail(f"--layer-pattern must be letters of {', '.join(f'{k} ({v})' for k, v in LAYER_KINDS.items())}, "
                 f"got {pattern!r}" + (f" with unknown {unknown!r}" if unknown else ""))
    kinds = set((pattern or "G")[:layers])  # the letters the tiled pattern uses (--layers may be huge)
    shown = f"--layer-pattern {pattern}" if pattern is not None else "no --layer-pattern (every layer G)"
    for name, letters in option_letters().items():
        present = [letter for letter in letters if letter in kinds]
        if present and name not in given:
            fail(f"{shown} has {LAYER_KINDS[present[0]]} layers: give {FLAGS[name]}")
        if not present and name in given:
            others = "".join(f" and {letter} ({LAYER_KINDS[letter]})" for letter in letters[1:])
            fail(f"{_shown(name, given[name])} is for {letters[0]} layers ({LAYER_KINDS[letters[0]]}){others}, "
                 f"and {shown} has none over {layers} layer{'s' if layers > 1 else ''}")
    _check_layer_options(kinds, shown, given)
    _check_head_options(kinds, shown, given, given.get("positions") or _train.TASK_DEFAULTS[task]["positions"])
    if "kv_heads" in given:
        heads = given.get("heads", _train.default_heads(task, layers))
        counts = heads if isinstance(heads, tuple) else (heads,)
        bad = [count for count in counts if count % given["kv_heads"]]
        if bad:
            fail(f"{_shown('kv_heads', given['kv_heads'])} must divide every layer's head count "
                 f"({_shown('heads', heads)}{'' if 'heads' in given else ' (the default)'}: {bad[0]} is not a multiple)")


def _check_layer_options(kinds: set[str], shown: str, given: dict) -> None:
    """--sinks, --softcap and --positions alibi are options of the multi-head layers: the layers
    built with their own module (latent, differential, gated, sparse) take none, and local layers'
    windowed cache does not keep keys in ALiBi's order; --nsa-block is a multiple of 4."""
    alibi = given.get("positions") == "alibi"
    used = [flag for flag, on in (("--positions alibi", alibi), ("--softcap", "softcap" in given),
                                  ("--sinks", given.get("sinks", False))) if on]
    own = sorted(letter for letter in kinds if LAYER_TABLE[letter].module)
    if used and own:
        fail(f"{', '.join(used)}: not available on {', '.join(LAYER_KINDS[k] for k in own)} layers, and {shown} "
             f"has some; use a --layer-pattern without {', '.join(own)}")
    if "nsa_block" in given:
        with option_errors():
            paper_sizes(given["nsa_block"], name="--nsa-block")
    for letter in ("L", "C"):
        if alibi and letter in kinds:
            fail(f"--positions alibi: not available on {LAYER_KINDS[letter]} layers (their cache does not keep "
                 f"keys from position 0), and {shown} has some; use --positions rope or learned")


def _check_head_options(kinds: set[str], shown: str, given: dict, positions: str) -> None:
    """--head-dim, --qk-norm and --rope-fraction size or normalise the multi-head layers (G, L, C, N),
    --global-head-dim the G layers, --nope-temperature the N layers: each refused without its layers,
    and the first three with layers of their own module."""
    own = sorted(letter for letter in kinds if LAYER_TABLE[letter].module)
    multi_head = [flag for flag, name in (("--head-dim", "head_dim"), ("--global-head-dim", "global_head_dim"),
                                          ("--qk-norm", "qk_norm")) if name in given]
    if multi_head and own:
        fail(f"{', '.join(multi_head)}: options of the multi-head layers (G, L, C, N), not of "
             f"{', '.join(LAYER_KINDS[k] for k in own)} layers, and {shown} has some; use a --layer-pattern "
             f"without {', '.join(own)}")
    for name, letter in (("global_head_dim", "G"), ("nope_temperature", "N")):
        if name in given and letter not in kinds:
            fail(f"{_shown(name, given[name])} is for {letter} layers ({LAYER_KINDS[letter]}), and {shown} has none")
    if "rope_fraction" in given and positions != "rope":
        fail(f"{_shown('rope_fraction', given['rope_fraction'])} needs --positions rope, got "
             f"{_shown('positions', positions)}{'' if 'positions' in given else ' (the default)'}")


def _variant_banner(config: _train.TrainConfig) -> str:
    """``, GQA 2 kv heads, layers LLG (window 8)`` for a variant; empty for plain multi-head attention."""
    parts = [f"{config.kv_heads} kv heads"] if config.kv_heads is not None else []
    if config.layer_pattern is not None:
        sizes = [f"{name} {value}" for name, value in (("window", config.window), ("latent", config.latent_dim),
                                                        ("chunk", config.chunk), ("topk", config.topk),
                                                        ("nsa block", config.nsa_block),
                                                        ("compress rate", config.compress_rate)) if value is not None]
        parts.append(f"layers {config.layer_pattern}" + (f" ({', '.join(sizes)})" if sizes else ""))
    parts += [f"{label} {value}" for label, value in (
        ("head dim", config.head_dim), ("global head dim", config.global_head_dim),
        ("rope fraction", config.rope_fraction), ("qk-norm", config.qk_norm),
        ("NoPE temperature", None if config.nope_temperature is None else
         ",".join(f"{part:g}" for part in config.nope_temperature))) if value is not None]
    if config.kv_shared_layers:
        parts.append(f"last {config.kv_shared_layers} layers sharing K/V")
    return "".join(f", {part}" for part in parts)


def _check_device(device: str) -> None:
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        fail(f"--device {device!r} cannot be used here: {str(err).splitlines()[0]}")


def _check_out(out: Path) -> None:
    """Create ``out`` and try a write there now, so an unwritable folder fails before training."""
    created = not out.exists()
    probe = out / f".attnlab-write-test-{os.getpid()}"  # one per process: torchrun's ranks check at once
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        fail(f"cannot write to --out {str(out)!r}: {err.strerror or err}")


@contextlib.contextmanager
def _removed_if_left_empty(out: Path, created: bool) -> Iterator[None]:
    """On failure, remove ``out`` if this command created it and nothing was written there: a
    rank that refuses or fails leaves no empty folder behind."""
    try:
        yield
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


@dataclasses.dataclass(frozen=True)
class _Sharding:
    """The checked ``--context-parallel`` options, and where this process stands."""

    world: int
    method: str
    ulysses: int | None
    torchrun: bool  # this process is one of the ranks torchrun started
    rank: int = 0  # under torchrun: this process's rank; else the launcher's (it reports)

    def describe(self) -> str:
        how = f"{self.method}" + (f", Ulysses groups of {self.ulysses}" if self.ulysses else "")
        where = "torchrun's ranks" if self.torchrun else "local gloo processes"
        return f"context parallel over {self.world} ranks ({how}; {where})"

    def options(self) -> str:
        """The options that shard a run this way, as typed."""
        text = f"--context-parallel {self.world} --cp-method {self.method}"
        return text + (f" --cp-ulysses {self.ulysses}" if self.ulysses else "")


def _under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _check_sharding(world: int | None, method: str | None, ulysses: int | None, device: str) -> _Sharding | None:
    """The ``--context-parallel`` options checked on their own (None without them); nothing starts."""
    if world is None:
        for flag, value in (("--cp-method", method), ("--cp-ulysses", ulysses)):
            if value is not None:
                fail(f"{flag} needs --context-parallel P (the ranks to shard each sequence over)")
        return None
    method = "ring" if method is None else method
    with option_errors():
        positive_int("--context-parallel", world)
        one_of("--cp-method", method, METHODS)
        if ulysses is not None:
            positive_int("--cp-ulysses", ulysses)
    torchrun = _under_torchrun()
    if torchrun and world != int(os.environ["WORLD_SIZE"]):
        fail(f"--context-parallel {world} disagrees with torchrun's WORLD_SIZE={os.environ['WORLD_SIZE']} "
             "(under torchrun, give the number of ranks it started)")
    if not torchrun:
        at_most("--context-parallel", world, _MAX_LOCAL_RANKS, "local processes; use torchrun on a cluster")
    if method == "hybrid" and ulysses is None:
        fail("--cp-method hybrid needs --cp-ulysses U, the ranks of each Ulysses group (U divides P)")
    if method != "hybrid" and ulysses is not None:
        fail(f"--cp-ulysses is only for --cp-method hybrid (got --cp-method {method})")
    if ulysses is not None and world % ulysses:
        fail(f"--cp-ulysses {ulysses} must divide --context-parallel {world} (the ring runs across P / U groups)")
    if torch.device(device).type != "cpu":
        fail(f"--context-parallel runs its ranks on the CPU with gloo (got --device {device}); "
             "GPU ranks (NCCL) are not supported by attnlab train yet")
    return _Sharding(world, method, ulysses, torchrun, int(os.environ["RANK"]) if torchrun else 0)


def _check_shardable(trainer: _train.Trainer, sharding: _Sharding) -> None:
    """Refuse, before any rank starts, a model or task the sharding cannot split. Every layer
    runs its whole attention sharded (global and local layers: window, softcap, sinks, ALiBi,
    RoPE); latent (MLA) layers do not run context-parallel."""
    c = trainer.config
    if c.kv_shared_layers:
        fail(f"--context-parallel {sharding.world}: --kv-shared-layers {c.kv_shared_layers} does not run "
             "context-parallel (a shared layer reads its source's keys of one process); train on one process")
    if "M" in trainer.model.layer_kinds:
        fail(f"--context-parallel {sharding.world}: --layer-pattern {c.layer_pattern} has latent (M) layers, which "
             "do not run context-parallel; use G and L layers, or train on one process")
    layout = sequence_layout("zigzag", method=sharding.method, ulysses=sharding.ulysses, world=sharding.world)
    seq_len = trainer.task.seq_len
    try:
        check_length(seq_len, layout=layout, world=sharding.world, name="the task's sequence length")
    except ValueError as err:
        fail(f"--context-parallel {sharding.world}: {err}")
    split = {"ulysses": sharding.world, "hybrid": sharding.ulysses}.get(sharding.method)
    if split is None:
        return
    flag = "--context-parallel" if sharding.method == "ulysses" else "--cp-ulysses"
    counts = trainer.model.heads_per_layer + ((trainer.config.kv_heads,) if trainer.config.kv_heads else ())
    if any(count % split for count in counts):
        fail(f"--cp-method {sharding.method} splits the heads over {flag} {split} ranks: every layer's head count "
             f"must be a multiple of {split}, got --heads {format_heads(trainer.model.heads_per_layer)} "
             "(or use --cp-method ring)")


def _run_sharded(trainer: _train.Trainer, sharding: _Sharding, *, resume: Path | None, steps: int | None,
                 out: Path, threads: int) -> tuple[_train.TrainResult | None, _train.Trainer]:
    """Train on ``sharding.world`` ranks; rank 0 writes the checkpoint. Returns rank 0's result and,
    in the reporting process, the trained model read back from the checkpoint (else ``None``)."""
    run = _train.ShardedRun(config=None if resume is not None else trainer.config,
                            resume=None if resume is None else str(resume), steps=steps, method=sharding.method,
                            ulysses=sharding.ulysses, out=str(out), threads=threads, stop_on_interrupt=True)
    if sharding.torchrun:
        values = _inline_rank(run)
    else:
        values = _local_ranks(run, sharding.world)
    if values is None:
        return None, trainer
    first = values[0]
    result = _train.TrainResult(step=first["step"], interrupted=first["interrupted"], metrics=first["metrics"])
    return result, _train.Trainer.resume(out)


def _local_ranks(run: _train.ShardedRun, world: int) -> list[dict]:
    """Start ``world`` local gloo processes; one ``error:`` line naming the ranks that failed.

    The launcher ignores Ctrl-C while they train: the ranks get it too, agree to stop after the
    same step, and rank 0 saves the checkpoint."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        outcomes = launch.run_local(_train.train_sharded, world=world, args=(run,), threads=run.threads,
                             timeout=_RANK_TIMEOUT)
    finally:
        signal.signal(signal.SIGINT, previous)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        fail("; ".join(f"rank {o.rank}: {o.error}" for o in failed))
    return [o.value for o in outcomes]


def _inline_rank(run: _train.ShardedRun) -> list[dict] | None:
    """This process is one of torchrun's ranks: join the group, train, and gather the results on
    rank 0 (None on the other ranks)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    value = _train.train_sharded(dist.get_rank(), dist.get_world_size(), run)
    values = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, values, dst=0)
    return values


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
    if not math.isfinite(result.metrics["loss"]):  # the weights hold inf or NaN: nothing left to analyse
        fail(f"training diverged: the held-out loss is {result.metrics['loss']} after {result.metrics['steps']} "
             f"steps (checkpoint in {str(out)!r}); try a smaller --lr than {trainer.config.lr:g}")
    analysis = _train.analyze(trainer)
    metrics = {**result.metrics, **{k: analysis[k] for k in ("heads", "summary", "induction_heads_ablated")
                                     if k in analysis}}
    _io.write_atomically(json.dumps(metrics, indent=1) + "\n", out / _train.METRICS_FILE, what="the metrics")
    written = _train.write_figures(trainer, analysis, out)
    m = result.metrics
    console.print(f"Held-out: loss {m['loss']:.4f}, accuracy {100 * m['accuracy']:.2f} % after {m['steps']} steps "
                  f"({m['seconds']:.1f} s of training, {m['tokens_per_second'] or 0:,.0f} tokens/s).",
                  markup=False, soft_wrap=True)
    if analysis["heads"]:
        _print_heads(console, analysis["heads"])
    console.print(analysis["summary"], markup=False, soft_wrap=True)
    console.print("Files written:")
    for path in [out / "model.safetensors", out / "config.json", out / _train.METRICS_FILE, *written]:
        console.print(f"  {path}", markup=False, soft_wrap=True)
    if analysis["heads"]:
        console.print(f"See the heads with: attnlab explain --model {out}", markup=False, soft_wrap=True)


def _print_heads(console, heads: dict) -> None:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title="Per head (held-out data)", title_justify="left")
    sinks = heads.get("sink_share")  # only a model trained with --sinks has one
    for column in ("layer", "head", "previous-token", "induction", "accuracy ablated") + (("sink share",) if sinks else ()):
        table.add_column(column, justify="right")
    for layer, row in enumerate(heads["previous_token"]):
        for head, previous in enumerate(row):
            table.add_row(str(layer), str(head), f"{previous:.3f}", f"{heads['induction'][layer][head]:.3f}",
                          f"{100 * heads['ablation_accuracy'][layer][head]:.1f} %",
                          *([f"{sinks[layer][head]:.3f}"] if sinks else []))
    console.print(table)
