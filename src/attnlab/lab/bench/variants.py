"""The ``variants`` suite, beside the KV-cache arithmetic of :mod:`attnlab.nn.kv_memory`.

:func:`kv_cache_bytes` (from :mod:`attnlab.nn.kv_memory`) is the formula. :func:`variants_suite`
builds the same small GPT with each attention variant (MHA, GQA, MQA, MLA, sliding window,
local/global, chunked/NoPE, differential, gated, sparse top-k, native sparse, Gated DeltaNet, the
Qwen3.5 and Kimi Linear hybrids and DeepSeek-V4's compressed CSA/HCA layers) and measures, side by side:
KV-cache bytes per token (what the caches hold after decoding, and the formula; a recurrent
layer's constant state counted in), peak tensor memory and tokens/s while decoding after a long
prompt, and the held-out loss after the same short training run on :func:`tiny_corpus`, a text
the suite writes itself. :func:`context_rates` decodes softmax, hybrid (Qwen3.5's 3:1) and
recurrent-only models again after contexts of growing length (1k and 16k tokens).

Example:
    >>> kv_cache_bytes(context=131072, layers=35, kv_heads=8, head_dim=256, dtype_bytes=2) / 1e9
    37.58096384
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from attnlab._checks import non_negative_int, positive_int
from attnlab._memory import PeakMemory
from attnlab.lab.bench.timing import BenchRow, machine_line
from attnlab.models import GPT
from attnlab.nn.cache import KVCache, RecurrentCache
from attnlab.nn.kv_memory import DTYPE_BYTES, kv_cache_bytes, layer_bytes_per_token, recurrent_state_bytes
from attnlab.lab.train import TextTask, TrainConfig, Trainer

__all__ = ["DTYPE_BYTES", "kv_cache_bytes", "layer_bytes_per_token", "VariantSizes", "VARIANTS", "VariantRow",
           "tiny_corpus", "variants_suite", "print_variants", "plot_variants", "CONTEXT_VARIANTS", "ContextRow",
           "context_rates", "print_context_rates"]


@dataclass
class VariantSizes:
    """The suite's model and runs (the same for every variant).

    Example:
        >>> VariantSizes.for_run(quick=True).prompt_len
        64
    """

    d_model: int = 128
    layers: int = 4
    heads: int = 8
    gqa_heads: int = 4
    window: int = 64
    latent_dim: int = 24
    rope_dim: int = 8
    prompt_len: int = 1024
    new_tokens: int = 512
    train_steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    corpus_sentences: int = 4000
    contexts: tuple[int, ...] = (1024, 16384)
    context_steps: int = 32

    @classmethod
    def for_run(cls, *, quick: bool) -> "VariantSizes":
        if not quick:
            return cls()
        return cls(d_model=32, layers=2, heads=4, gqa_heads=2, window=16, latent_dim=8, rope_dim=4, prompt_len=64,
                   new_tokens=16, train_steps=5, batch_size=4, seq_len=32, corpus_sentences=300,
                   contexts=(64, 256), context_steps=4)


# name -> the GPT options that make the variant (given the sizes)
VARIANTS = {
    "MHA": lambda s: dict(),
    "GQA": lambda s: dict(num_kv_heads=s.gqa_heads),
    "MQA": lambda s: dict(num_kv_heads=1),
    "MLA": lambda s: dict(layer_pattern="M", latent_dim=s.latent_dim, latent_rope_dim=s.rope_dim),
    "window": lambda s: dict(layer_pattern="L", window=s.window),
    "local/global": lambda s: dict(layer_pattern="L" * max(1, min(3, s.layers - 1)) + "G", window=s.window),
    "chunked/NoPE": lambda s: dict(layer_pattern="C" * max(1, min(3, s.layers - 1)) + "N", chunk=s.window),
    "differential": lambda s: dict(layer_pattern="D", num_kv_heads=s.gqa_heads),
    "gated": lambda s: dict(layer_pattern="Q", num_kv_heads=s.gqa_heads),
    "DSA top-k": lambda s: dict(layer_pattern="T", num_kv_heads=s.gqa_heads, topk=s.window),
    "NSA": lambda s: dict(layer_pattern="S", num_kv_heads=s.gqa_heads, nsa_block=max(4, s.window // 16 * 4)),
    # Recurrent layers (attnlab.nn.GatedDeltaNet "R", KimiDeltaAttention "K"): a constant state each.
    "Gated DeltaNet": lambda s: dict(layer_pattern="R", num_kv_heads=s.gqa_heads),
    "Qwen3.5 hybrid": lambda s: dict(layer_pattern="R" * max(1, min(3, s.layers - 1)) + "Q", num_kv_heads=s.gqa_heads),
    "Kimi Linear hybrid": lambda s: dict(layer_pattern="K" * max(1, min(3, s.layers - 1)) + "M", latent_dim=s.latent_dim,
                                         latent_rope_dim=s.rope_dim),
    # DeepSeek-V4's compressed layers (attnlab.nn.CompressedAttention): a window, one entry per 4 tokens
    # (CSA "V": the indexer's best window/4; HCA "H": every entry), V4's CSA/HCA alternation.
    "DeepSeek-V4 CSA/HCA": lambda s: dict(layer_pattern="VH", window=s.window, topk=max(1, s.window // 4),
                                          compress_rate=4),
}
# The variants decoded again after contexts of growing length (VariantSizes.contexts): softmax layers
# read every cached token a step, recurrent ones a state of constant size.
CONTEXT_VARIANTS = ("MHA", "Qwen3.5 hybrid", "Gated DeltaNet")


def _train_options(options: dict) -> dict:
    names = {"num_kv_heads": "kv_heads", "layer_pattern": "layer_pattern", "window": "window",
             "latent_dim": "latent_dim", "chunk": "chunk", "topk": "topk", "nsa_block": "nsa_block",
             "compress_rate": "compress_rate"}
    return {names[k]: v for k, v in options.items() if k in names}


@dataclass
class VariantRow:
    """One variant's figures.

    Example:
        >>> VariantRow("MHA", 512, 512, 1e6, 100.0, 2.5).bench_row().name
        'MHA'
    """

    name: str
    kv_bytes_measured: float
    kv_bytes_formula: float
    peak_bytes: int
    tokens_per_s: float
    held_out_loss: float

    def bench_row(self) -> BenchRow:
        values = {name: float(getattr(self, name)) for name in _PLOTTED}
        return BenchRow("variants", "decode", self.name, 1.0 / self.tokens_per_s, values=values, note=(
            f"KV {self.kv_bytes_measured:.0f} B/token (formula {self.kv_bytes_formula:.0f}), peak "
            f"{self.peak_bytes / 2**20:.1f} MiB, {self.tokens_per_s:.0f} tokens/s, held-out loss "
            f"{self.held_out_loss:.3f}"))


# VariantRow figures the suite's plot draws (BenchRow.values), one panel each but the formula,
# drawn as a mark on the measured bytes' bars.
_PLOTTED = ("kv_bytes_measured", "kv_bytes_formula", "peak_bytes", "tokens_per_s", "held_out_loss")
_PANELS = {"kv_bytes_measured": ("KV cache bytes per token", "bytes (bars: measured, -: formula)", 1),
           "tokens_per_s": ("decoding speed", "tokens/s", 1),
           "peak_bytes": ("peak memory while decoding", "MiB", 2**20),
           "held_out_loss": ("quality after the same training", "held-out loss (lower is better)", 1)}


def tiny_corpus(sentences: int = 4000, *, seed: int = 0) -> str:
    """A small English-like text written from a seeded grammar: who gave what to whom, and later
    the same two names again, so that predicting the second mention needs attention to the first.

    Example:
        >>> tiny_corpus(2)[:30]
        'sam gave the new book to gus. '
    """
    positive_int("sentences", sentences)
    rng = random.Random(seed)
    names = ["ada", "ben", "cleo", "dan", "eve", "finn", "gus", "hana", "ivy", "jon", "kai", "lea", "max", "sam"]
    things = ["book", "lamp", "coin", "map", "cup", "key", "hat", "box", "pen", "drum"]
    adjectives = ["red", "old", "small", "new", "odd", "blue"]
    lines = []
    for _ in range(sentences):
        a, b = rng.sample(names, 2)
        thing = rng.choice(things) if rng.random() < 0.5 else f"{rng.choice(adjectives)} {rng.choice(things)}"
        lines.append(f"{a} gave the {thing} to {b}. later {b} gave the {thing} back to {a}.")
    return " ".join(lines) + "\n"


def _measured_kv(model: GPT, prompt: torch.Tensor, new_tokens: int) -> float:
    """Bytes per token the caches hold after the prompt and ``new_tokens`` steps (batch 1)."""
    caches = model.new_cache(1, prompt.shape[1] + new_tokens)
    with torch.no_grad():
        model(prompt, caches=caches)
        token = prompt[:, -1:]
        for _ in range(new_tokens):
            token = model(token, caches=caches)[:, -1].argmax(-1, keepdim=True)
    return sum(cache.nbytes for cache in caches) / (prompt.shape[1] + new_tokens)


def _decode_rate(model: GPT, prompt: torch.Tensor, new_tokens: int) -> float:
    """Tokens/s of the decoding steps (the prompt's prefill, which gives the first token, excluded)."""
    stream = model.stream(prompt, new_tokens)
    next(stream)
    start = time.perf_counter()
    count = sum(1 for _ in stream)
    return count / (time.perf_counter() - start)


def _one_variant(name: str, sizes: VariantSizes, corpus: TextTask, seed: int) -> VariantRow:
    options = VARIANTS[name](sizes)
    total = sizes.prompt_len + sizes.new_tokens
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(corpus.vocab_size, max_len=total, d_model=sizes.d_model, num_layers=sizes.layers,
                    num_heads=sizes.heads, positions="rope", **options).eval()
        prompt = torch.randint(0, corpus.vocab_size, (1, sizes.prompt_len))
    head_dim = sizes.d_model // sizes.heads
    kv_heads = options.get("num_kv_heads", sizes.heads)
    formula = kv_cache_bytes(context=total, layers=sizes.layers, kv_heads=kv_heads,
                             head_dim=head_dim, dtype_bytes=4, pattern=options.get("layer_pattern", "G"),
                             window=options.get("window"), chunk=options.get("chunk"), latent_dim=sizes.latent_dim,
                             rope_dim=sizes.rope_dim, nsa_block=options.get("nsa_block"), index_bytes=4,
                             index_dim=head_dim if "topk" in options else 0,  # T's and V's index keys: head_dim
                             compress_rate=options.get("compress_rate"),
                             linear_state=recurrent_state_bytes(value_heads=sizes.heads, key_heads=kv_heads,
                                                                head_dim=head_dim, dtype_bytes=4))
    measured = _measured_kv(model, prompt, sizes.new_tokens)
    model.generate(prompt[:, :8], 2)  # warm-up
    rate = _decode_rate(model, prompt, sizes.new_tokens)
    with PeakMemory() as meter:
        model.generate(prompt, sizes.new_tokens)
    config = TrainConfig(task="text", layers=sizes.layers, heads=sizes.heads, d_model=sizes.d_model,
                         steps=sizes.train_steps, batch_size=sizes.batch_size, positions="rope", seed=seed,
                         eval_every=sizes.train_steps, eval_sequences=32, **_train_options(options))
    trainer = Trainer(config, task=corpus)
    trainer.train()
    loss, _ = trainer.evaluate()
    return VariantRow(name, measured, formula / total, meter.peak_bytes, rate, loss)


@dataclass
class ContextRow:
    """One variant's decoding speed after ``context`` cached tokens.

    Example:
        >>> ContextRow("MHA", 1024, 250.0).bench_row().case
        'decode after 1024 tokens'
    """

    name: str
    context: int
    tokens_per_s: float

    def bench_row(self) -> BenchRow:
        return BenchRow("variants", f"decode after {self.context} tokens", self.name, 1.0 / self.tokens_per_s,
                        values={"tokens_per_s": self.tokens_per_s, "context": float(self.context)},
                        note=f"{self.tokens_per_s:.0f} tokens/s after {self.context} cached tokens")


def _filled_caches(model: GPT, context: int, steps: int) -> list:
    """Caches that hold ``context`` tokens, filled with random keys, values and states instead of a
    prefill (a decoding step's cost does not depend on the values; a 16k prefill of every softmax
    layer would cost minutes)."""
    caches = model.new_cache(1, context + steps)
    for cache in caches:
        if isinstance(cache, RecurrentCache):
            cache.advance(torch.randn_like(cache.conv), torch.randn_like(cache.state) * 0.1, num_new=context)
        elif isinstance(cache, KVCache):
            shape = (1, cache.num_kv_heads, context)
            cache.update(torch.randn(*shape, cache.head_dim), torch.randn(*shape, cache.value_dim))
        else:
            raise TypeError(f"the context rows fill KVCache and RecurrentCache only, got {type(cache).__name__}")
    return caches


def context_rates(sizes: VariantSizes, *, seed: int = 0, names: tuple[str, ...] = CONTEXT_VARIANTS) -> list[ContextRow]:
    """Tokens/s of ``sizes.context_steps`` decoding steps after each of ``sizes.contexts`` cached tokens.

    Example:
        >>> rows = context_rates(VariantSizes.for_run(quick=True), names=("Gated DeltaNet",))
        >>> [row.context for row in rows]
        [64, 256]
    """
    rows = []
    for name in names:
        options = VARIANTS[name](sizes)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT(256, max_len=max(sizes.contexts) + sizes.context_steps, d_model=sizes.d_model,
                        num_layers=sizes.layers, num_heads=sizes.heads, positions="rope", **options).eval()
            for context in sizes.contexts:
                caches = _filled_caches(model, context, sizes.context_steps)
                token = torch.ones(1, 1, dtype=torch.long)
                with torch.no_grad():
                    model(token, caches=caches)  # warm-up: the step's route is planned once
                    start = time.perf_counter()
                    for _ in range(sizes.context_steps - 1):
                        model(token, caches=caches)
                rows.append(ContextRow(name, context, (sizes.context_steps - 1) / (time.perf_counter() - start)))
    return rows


def variants_suite(*, quick: bool = False, sizes: VariantSizes | None = None, seed: int = 0) -> list[VariantRow]:
    """Every variant of :data:`VARIANTS` at the same size, measured as the module docstring says.

    Example:
        >>> rows = variants_suite(quick=True)  # doctest: +SKIP
    """
    sizes = VariantSizes.for_run(quick=quick) if sizes is None else sizes
    non_negative_int("seed", seed)
    corpus = TextTask(tiny_corpus(sizes.corpus_sentences, seed=seed), seq_len=sizes.seq_len)
    return [_one_variant(name, sizes, corpus, seed) for name in VARIANTS]


def plot_variants(rows: list[BenchRow], *, caption: str | None = None):
    """The suite as bars, one per variant: KV bytes per token (the formula marked on each bar),
    tokens/s, peak memory and held-out loss (``attnlab bench --suite variants --plot``).

    Args:
        rows: the suite's rows (:meth:`VariantRow.bench_row`); others are ignored.
        caption: the title's second line (default: :func:`attnlab.lab.bench.timing.machine_line`).

    Returns:
        a matplotlib ``Figure`` (no pyplot state), one panel per figure in that order.

    Raises:
        ValueError: naming ``rows`` when none is a variants row.

    Example:
        >>> fig = plot_variants([VariantRow(n, 512, 512, 2**20, 100.0, 2.5).bench_row() for n in ("MHA", "MQA")])
        >>> len(fig.axes), len(fig.axes[0].patches)
        (4, 2)
    """
    from matplotlib.figure import Figure

    rows = [row for row in rows if row.suite == "variants" and set(_PLOTTED) <= set(row.values)]
    if not rows:
        raise ValueError("rows: none is a row of the variants suite (with its figures) to plot")
    names = [row.name for row in rows]
    fig = Figure(figsize=(3.2 * len(_PANELS), 4.2), layout="constrained")
    for ax, (key, (title, unit, factor)) in zip(fig.subplots(1, len(_PANELS)), _PANELS.items()):
        heights = [row.values[key] / factor for row in rows]
        ax.bar(names, heights, color=[f"C{i % 10}" for i in range(len(rows))])
        if key == "kv_bytes_measured":
            ax.scatter(names, [row.values["kv_bytes_formula"] for row in rows], marker="_", s=400, color="black",
                       zorder=3, label="formula")
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel(unit)
        ax.tick_params(axis="x", labelrotation=45)
        ax.grid(True, axis="y", alpha=0.3)
    caption = caption if caption is not None else f"machine: {machine_line()}"
    fig.suptitle(f"attnlab bench --suite variants: attention variants at one model size\n{caption}")
    return fig


def print_variants(rows: list[VariantRow], sizes: VariantSizes, *, console=None) -> None:
    """Print the suite's table.

    Example:
        >>> print_variants([VariantRow("MHA", 512, 512, 2**20, 100.0, 2.5)], VariantSizes())  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table

    console = Console() if console is None else console
    table = Table(title=(f"attention variants: GPT {sizes.layers} layers, d_model {sizes.d_model}, {sizes.heads} "
                         f"heads, fp32; decoding {sizes.new_tokens} tokens after {sizes.prompt_len}; loss after "
                         f"{sizes.train_steps} steps on tiny_corpus; {machine_line()}"))
    for column in ("variant", "KV B/token measured", "KV B/token formula", "peak MiB", "tokens/s", "held-out loss"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for row in rows:
        table.add_row(row.name, f"{row.kv_bytes_measured:.0f}", f"{row.kv_bytes_formula:.0f}",
                      f"{row.peak_bytes / 2**20:.1f}", f"{row.tokens_per_s:.0f}", f"{row.held_out_loss:.3f}")
    console.print(table)


def print_context_rates(rows: list[ContextRow], sizes: VariantSizes, *, console=None) -> None:
    """Print decoding tokens/s per variant (rows) and context (columns), and the longest over the shortest.

    Example:
        >>> print_context_rates([ContextRow("MHA", 64, 200.0), ContextRow("MHA", 256, 100.0)],
        ...                     VariantSizes.for_run(quick=True))  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table

    console = Console() if console is None else console
    table = Table(title=(f"decoding after a long context: tokens/s of {sizes.context_steps - 1} steps, GPT "
                         f"{sizes.layers} layers, d_model {sizes.d_model}, fp32; {machine_line()}"))
    table.add_column("variant")
    for context in sizes.contexts:
        table.add_column(f"after {context}", justify="right")
    table.add_column(f"{max(sizes.contexts)} / {min(sizes.contexts)}", justify="right")
    for name in dict.fromkeys(row.name for row in rows):
        rate = {row.context: row.tokens_per_s for row in rows if row.name == name}
        table.add_row(name, *(f"{rate[c]:.0f}" for c in sizes.contexts),
                      f"{rate[max(sizes.contexts)] / rate[min(sizes.contexts)]:.2f}")
    console.print(table)
