"""``attnlab train``: train a small GPT on a task that needs attention, then name the heads that do it.

``--heads`` takes one count for every layer (``2``) or one per layer (``2,1``). Everything is
checked before anything is written: a bad ``--text`` file, ``--steps 0``, a ``--heads`` that is
not counts, has the wrong number of them or does not divide ``--d-model``, or an unwritable
``--out`` give one ``error:`` line (exit 2) and leave nothing behind, as does a model too big
for the device's memory (named by the option that makes it so, before anything is allocated).
Ctrl-C finishes the current step, saves a checkpoint and prints the command that resumes it
(exit 130); a second Ctrl-C stops at once.

``--kv-heads``, ``--layer-pattern``, ``--window``, ``--latent-dim``, ``--chunk``, ``--topk`` and
``--nsa-block`` train an attention variant (grouped-query heads; global, local, latent,
chunked-local, NoPE, differential, gated, sparse top-k and native sparse layers, see
:class:`attnlab.models.GPT`): a ``--kv-heads`` that does not divide every layer's heads, a pattern
with letters other than G, L, M, C, N, D, Q, T and S, a ``--window``, ``--latent-dim``, ``--chunk``,
``--topk`` or ``--nsa-block`` missing for the pattern's L, M, C, T or S layers, or given without
them, is one ``error:`` line naming the option.

``--rope-fraction F``, ``--qk-norm FORM``, ``--head-dim D``, ``--global-head-dim D`` and
``--nope-temperature FLOOR,SCALE`` set the GPT options of the same names (partial RoPE, the QK-norm
form, the multi-head layers' and the G layers' head width, Llama 4's temperature on the N layers):
a bad value, or one the layer pattern has no layers for, is one ``error:`` line naming the option.

``--context-parallel P`` shards every sequence over P ranks; each layer keeps its whole
attention (L layers their ``--window``, ``--softcap``, ``--sinks``, positions), and what cannot
run sharded (latent M layers, a sequence length or head count the method cannot split) is one
``error:`` line before any rank starts; a failure inside the ranks leaves no empty ``--out``.

``--resume DIR`` continues a checkpoint with its own options: an option given as well must say
what the checkpoint says (``--task recall`` on an induction checkpoint is refused, naming both),
and ``--steps`` below the checkpoint's step is refused; at the checkpoint's step there is nothing
to do. In each case nothing is written: the checkpoint's files stay as they were.

The options are declared here; what the command does with them is :mod:`attnlab.lab.cli._train_run`,
imported when the command runs (it brings the training, models and distributed modules).
"""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab.lab.cli._errors import MAX_SEED
from attnlab.lab.cli._help import command_class

DEFAULT_OUT = Path("attnlab-train")


def train(
    task: str = typer.Option(None, "--task", show_default=False, help="What the model learns."),
    layers: int = typer.Option(None, "--layers", help="Transformer layers."),
    heads: str = typer.Option(None, "--heads", help="Attention heads: one count for every layer (2) or one per "
                                                    "layer (2,1); each must divide --d-model."),
    d_model: int = typer.Option(None, "--d-model", help="Width of the residual stream."),
    attention_only: bool = typer.Option(None, "--attention-only/--mlp",
                                        help="Blocks without/with MLP."),
    steps: int = typer.Option(None, "--steps", help="Optimizer steps in all (with --resume: the new total)."),
    batch_size: int = typer.Option(None, "--batch-size", help="Sequences per step."),
    lr: float = typer.Option(None, "--lr", help="Peak learning rate (warm-up, then cosine decay)."),
    seed: int = typer.Option(None, "--seed", show_default=False,
                             help=f"Seed of the initial weights and the data, 0 to {MAX_SEED} (default 0)."),
    device: str = typer.Option("cpu", "--device", help="torch device (cpu, cuda, ...)."),
    positions: str = typer.Option(None, "--positions",
                                  help="How the model knows token order."),
    text: Path = typer.Option(None, "--text", help="--task text: the UTF-8 text file to model."),
    softcap: float = typer.Option(None, "--softcap", help="Cap every attention score with C*tanh(score/C) "
                                                          "(Gemma 2); C > 0."),
    sinks: bool = typer.Option(False, "--sinks", help="Give every head a learnable sink logit (gpt-oss); the "
                                                      "report then says each head's sink share."),
    threads: int = typer.Option(1, "--threads",
                                help="CPU threads; tiny models run fastest on one (threads mostly wait on each other)."),
    out: Path = typer.Option(None, "--out", help=f"Checkpoint and report folder (default {DEFAULT_OUT}; "
                                                 "with --resume: the resumed folder)."),
    resume: Path = typer.Option(None, "--resume", help="Continue the checkpoint in this folder at its step; "
                                                       "options given must agree with it, the others are its own."),
    context_parallel: int = typer.Option(None, "--context-parallel", show_default=False,
                                         help="Shard every sequence over P ranks: starts P local gloo processes, "
                                              "or joins the ranks torchrun started (P = WORLD_SIZE)."),
    cp_method: str = typer.Option(None, "--cp-method", show_default=False,
                                  help="With --context-parallel: ring (default), ulysses or hybrid."),
    cp_ulysses: int = typer.Option(None, "--cp-ulysses", show_default=False,
                                   help="With --cp-method hybrid: ranks per Ulysses group (must divide P)."),
    kv_heads: int = typer.Option(None, "--kv-heads", show_default=False,
                                 help="Grouped-query key/value heads; must divide every layer's --heads "
                                      "(default: one per head)."),
    layer_pattern: str = typer.Option(None, "--layer-pattern", show_default=False,
                                      help="Each layer's attention, tiled over --layers: G global, L local "
                                           "(sliding --window), M latent (MLA, --latent-dim), C chunked local "
                                           "(--chunk), N global without positions (NoPE), D differential, "
                                           "Q gated, T sparse top-k (DSA, --topk), S native sparse (NSA, "
                                           "--nsa-block), R Gated DeltaNet, K Kimi Delta Attention, A plain "
                                           "linear attention (linear, no positions), V compressed sparse (DeepSeek-V4 CSA: "
                                           "--compress-rate, --window, --topk), H heavily compressed "
                                           "(HCA: --compress-rate, --window); e.g. LLG, CCCN or RRRQ "
                                           "(default: all G)."),
    window: int = typer.Option(None, "--window", show_default=False,
                               help="Keys per query of the L layers' sliding window (and the V/H layers')."),
    latent_dim: int = typer.Option(None, "--latent-dim", show_default=False,
                                   help="Width of the M layers' key/value latent."),
    chunk: int = typer.Option(None, "--chunk", show_default=False,
                              help="Tokens per chunk of the C layers (a query sees its chunk's earlier keys)."),
    topk: int = typer.Option(None, "--topk", show_default=False,
                             help="Keys per query of the T layers (their lightning indexer picks them); "
                                  "compressed entries per query of the V layers."),
    nsa_block: int = typer.Option(None, "--nsa-block", show_default=False,
                                  help="Selection block of the S layers (a multiple of 4; the rest in the NSA "
                                       "paper's proportions)."),
    compress_rate: int = typer.Option(None, "--compress-rate", show_default=False,
                                      help="Tokens pooled into one compressed entry of the V/H layers "
                                           "(DeepSeek-V4: 4 for CSA, 128 for HCA)."),
    rope_fraction: float = typer.Option(None, "--rope-fraction", show_default=False,
                                        help="Partial RoPE (with --positions rope): rotate this fraction of each "
                                             "head (Qwen3.5: 0.25); it must give an even number of features."),
    qk_norm: str = typer.Option(None, "--qk-norm", show_default=False,
                                help="QK-norm of the multi-head layers: qwen3 (each head), gemma (each head, "
                                     "1 + weight) or olmo2 (the whole projection)."),
    head_dim: int = typer.Option(None, "--head-dim", show_default=False,
                                 help="Features per head of the multi-head layers (G, L, C, N; default "
                                      "--d-model / --heads); heads x head-dim need not be --d-model."),
    global_head_dim: int = typer.Option(None, "--global-head-dim", show_default=False,
                                        help="Features per head of the G layers, over --head-dim (Gemma 4: 512)."),
    nope_temperature: str = typer.Option(None, "--nope-temperature", show_default=False,
                                         help="FLOOR,SCALE: Llama 4's temperature on the N layers' queries, "
                                              "log(floor((p+1)/FLOOR)+1)*SCALE+1 at position p (Llama 4: 8192,0.1)."),
    kv_shared_layers: int = typer.Option(None, "--kv-shared-layers", show_default=False,
                                         help="Cross-layer KV sharing (Gemma 3n/4): the last N layers have no "
                                              "key/value projections and read the last earlier layer of their "
                                              "letter (G, L, C, N)."),
) -> None:
    """Train a GPT built from attnlab modules on a synthetic task (default: induction) on this
    machine, with a progress bar; evaluate on held-out data; write a checkpoint, config.json,
    metrics.json (loss, accuracy, per-head scores), curves and attention heatmaps into --out;
    and name the heads that do the task (previous-token and induction scores, head ablation)."""
    given = {name: value for name, value in dict(
        task=task, layers=layers, heads=heads, d_model=d_model, attention_only=attention_only, batch_size=batch_size,
        lr=lr, seed=seed, positions=positions, text=text, softcap=softcap, sinks=sinks or None, kv_heads=kv_heads,
        layer_pattern=layer_pattern, window=window, latent_dim=latent_dim, chunk=chunk, topk=topk,
        nsa_block=nsa_block, compress_rate=compress_rate, rope_fraction=rope_fraction, qk_norm=qk_norm,
        head_dim=head_dim, global_head_dim=global_head_dim, nope_temperature=nope_temperature,
        kv_shared_layers=kv_shared_layers).items()
        if value is not None}
    from attnlab.lab.cli import _train_run

    _train_run.run(given, steps=steps, threads=threads, device=device, resume=resume, out=out,
                   context_parallel=context_parallel, cp_method=cp_method, cp_ulysses=cp_ulysses)


def _help_defaults() -> dict[str, str]:
    """The defaults ``train --help`` shows: each task's, from :data:`attnlab.lab.train.TASK_DEFAULTS`."""
    from attnlab.lab import train as _train
    from attnlab.lab.cli._train_run import _shown
    from attnlab.models.gpt import POSITIONS

    shown = {"task": f"induction; the tasks: {', '.join(_train.TASKS)}"}
    for name in ("layers", "heads", "d_model", "attention_only", "steps", "batch_size", "lr", "positions"):
        by_task = {task: _shown(name, defaults[name]).split()[-1] for task, defaults in _train.TASK_DEFAULTS.items()}
        values = set(by_task.values())
        shown[name] = values.pop() if len(values) == 1 else ", ".join(f"{task} {v}" for task, v in by_task.items())
    shown["positions"] += f"; one of {', '.join(POSITIONS)}"
    return shown


def register(app: typer.Typer) -> None:
    """Add the ``train`` command to ``app``."""
    app.command("train", cls=command_class(_help_defaults))(train)
