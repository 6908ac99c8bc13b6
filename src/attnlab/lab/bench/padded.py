"""The "padded" benchmark: what a decoder trained on padded batches runs, against what its user writes.

One table, every ratio measured side by side in one interleaved run (attnlab's time over the
baseline's; lower is better):

* **attention**: ``attention(q, k, v, mask=..., causal=True)`` with the padding as a bool key mask
  (``padding_mask(lengths)``) and as ``padding_mod(lengths)``, forward and forward+backward, at
  T = 256, 1024 and 4096 (quick: 256, 1024), B = 4, H = 8, D = 64, lengths spread evenly over
  20-100 % of T. Baseline: ``F.scaled_dot_product_attention`` given the combined ``(B, 1, T, T)``
  bool mask, built once outside the timing, as its user holds it. Target <= 1.10.
* **training step**: forward+backward of :class:`attnlab.nn.MultiHeadAttention` ``(causal=True)``
  with ``padding_mask``, and of a small :class:`attnlab.models.GPT` with ``padding_mask``,
  against the same weights whose attention is nanoGPT-style (one fused projection, SDPA given
  the combined mask: :class:`attnlab.lab.bench.competitors.NanoGPTAttention`). Target <= 1.05.
* **structured masks**: packed documents and a 256-key window, ``auto`` against
  ``torch.compile(flex_attention)`` with its own block mask (built, and compiled, before the
  timing), forward, at T = 2k, 8k and 32k (quick: 2k), idle and with one core kept busy by a
  spinning process; and forward+backward against SDPA with the dense mask at 8k (quick: 2k).
  Targets: >= 1.2x flex's speed idle, >= 1.0x busy; >= 3x SDPA's.

Example:
    >>> rows = padded_suite(quick=True, parts=("attention",), rounds=1)   # doctest: +SKIP
    >>> rows[0].suite                                                     # doctest: +SKIP
    'padded'
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import masks
from attnlab._flops import attention_flops
from attnlab.lab.bench.competitors import CompiledFlex, flex_mask_mods, sparse_cases
from attnlab.lab.bench.modules import nanogpt_twin
from attnlab.lab.bench.timing import BenchRow, compare
from attnlab.functional import attention
from attnlab.models import GPT
from attnlab.nn.multihead import MultiHeadAttention
from attnlab.nn.multihead import QKV, CallMask

__all__ = ["PARTS", "spread_lengths", "combined_mask", "padded_suite", "busy_core"]

PARTS = ("attention", "training", "structured")
HEADS, DIMS, BATCH = 8, 64, 4


def spread_lengths(batch: int, t: int) -> Tensor:
    """``batch`` lengths spread evenly over 20-100 % of ``t`` (the longest row is full).

    Example:
        >>> spread_lengths(4, 100).tolist()
        [20, 47, 73, 100]
    """
    return torch.linspace(0.2 * t, t, batch).round().long()


def combined_mask(lengths: Tensor, t: int) -> Tensor:
    """The ``(B, 1, T, T)`` bool mask an SDPA user builds for a right-padded causal batch.

    Example:
        >>> combined_mask(torch.tensor([1, 2]), 2)[:, 0].int().tolist()
        [[[1, 0], [1, 0]], [[1, 0], [1, 1]]]
    """
    real = torch.arange(t) < lengths[:, None]  # (B, T)
    return (torch.ones(t, t, dtype=torch.bool).tril() & real[:, None, :])[:, None]  # (B, 1, T, T)


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """One process spinning on a core for the duration (a machine shared with other work).

    Example:
        >>> with busy_core():   # doctest: +SKIP
        ...     pass
    """
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _timed(fn: Callable[[], Tensor], grad_out: Tensor | None, leaves: tuple[Tensor, ...]) -> Callable[[], None]:
    """A no-grad forward, or a forward and a backward to ``leaves``."""
    if grad_out is None:
        def forward() -> None:
            with torch.no_grad():
                fn()
        return forward

    def forward_backward() -> None:
        for leaf in leaves:
            leaf.grad = None
        fn().backward(grad_out)
    return forward_backward


def _ratio_rows(case: str, medians: dict[str, float], baseline: str, flops: float | None, t: int,
                notes: dict[str, str] | None = None) -> list[BenchRow]:
    """One row per candidate, ``ratio`` = its median over ``baseline``'s."""
    return [BenchRow("padded", case, name, seconds, flops, None, seconds / medians[baseline],
                     note=(notes or {}).get(name, ""), t=t)
            for name, seconds in medians.items()]


def attention_rows(t: int, *, rounds: int) -> list[BenchRow]:
    """Causal + padding (bool key mask and ``padding_mod``) against SDPA with the combined mask.

    Example:
        >>> rows = attention_rows(64, rounds=1)   # doctest: +SKIP
    """
    lengths = spread_lengths(BATCH, t)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, t, DIMS, generator=gen) for _ in range(3))
    combined, keys, mod = combined_mask(lengths, t), masks.padding_mask(lengths, t), masks.padding_mod(lengths)
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        grad = mode == "fwd+bwd"
        leaves = tuple(x.detach().requires_grad_(grad) for x in (q, k, v))
        grad_out = torch.randn(BATCH, HEADS, t, DIMS, generator=gen) if grad else None
        candidates = {
            "SDPA, combined mask": lambda: F.scaled_dot_product_attention(*leaves, attn_mask=combined),
            "attnlab, padding_mask + causal": lambda: attention(*leaves, mask=keys, causal=True),
            "attnlab, padding_mod + causal": lambda: attention(*leaves, mask=mod, causal=True),
        }
        notes = _differences(candidates, "SDPA, combined mask")
        medians = compare({name: _timed(fn, grad_out, leaves) for name, fn in candidates.items()},
                          rounds=rounds, min_run_time=0.2)
        flops = attention_flops(BATCH, HEADS, t, t, DIMS, DIMS, causal=True, mode=mode)
        rows += _ratio_rows(f"causal+padding {mode} T={t}", medians, "SDPA, combined mask", flops, t, notes)
    return rows


def _differences(candidates: dict[str, Callable[[], Tensor]], baseline: str,
                 where: Tensor | None = None) -> dict[str, str]:
    """Each candidate's largest difference from the baseline's output (at ``where``): every
    row of a case computes the same function."""
    with torch.no_grad():
        outs = {name: fn() for name, fn in candidates.items()}
    pick = (lambda t: t) if where is None else (lambda t: t[where])
    return {name: f"max |out - baseline| {(pick(out) - pick(outs[baseline])).abs().max().item():.1e}"
            for name, out in outs.items() if name != baseline}


class _MaskedTwin(nn.Module):
    """A block's attention as nanoGPT-style SDPA given a combined mask the caller set beforehand."""

    def __init__(self, twin: nn.Module):
        super().__init__()
        self.twin = twin
        self.combined: Tensor | None = None

    def forward(self, x: Tensor, *, mask: None = None, padding_mask: Tensor | None = None, cache: None = None,
                return_weights: bool = False, document_ids: None = None) -> Tensor:
        if mask is not None or cache is not None or return_weights or document_ids is not None:
            raise ValueError("the nanoGPT-style twin takes a padded batch only")
        return self.twin(x, attn_mask=self.combined)


def _gpt_pair(t: int) -> tuple[GPT, GPT, list[_MaskedTwin]]:
    """A small GPT and its copy whose attention layers are nanoGPT-style twins."""
    ours = GPT(vocab_size=512, max_len=t, d_model=256, num_layers=2, num_heads=HEADS // 2)
    theirs = GPT(vocab_size=512, max_len=t, d_model=256, num_layers=2, num_heads=HEADS // 2)
    theirs.load_state_dict(ours.state_dict())
    twins = []
    for block in theirs.blocks:
        twins.append(_MaskedTwin(nanogpt_twin(block.attn, num_heads=block.attn.num_heads)))
        block.attn = twins[-1]
    return ours, theirs, twins


def training_rows(t: int, *, rounds: int) -> list[BenchRow]:
    """Training steps on a padded batch: attnlab's module and GPT against nanoGPT-style twins.

    Example:
        >>> rows = training_rows(64, rounds=1)   # doctest: +SKIP
    """
    torch.manual_seed(0)
    lengths = spread_lengths(BATCH, t)
    real, combined = torch.arange(t) < lengths[:, None], combined_mask(lengths, t)
    d_model = HEADS * DIMS
    module = MultiHeadAttention(d_model, d_model, t, 0.0, HEADS, qkv=QKV(bias=True))
    twin = nanogpt_twin(module, num_heads=HEADS)
    x = torch.randn(BATCH, t, d_model, requires_grad=True)
    grad_out = torch.randn(BATCH, t, d_model)
    modules = {"nanoGPT-style, SDPA + combined mask": lambda: twin(x, attn_mask=combined),
               "attnlab MultiHeadAttention, padding": lambda: module(x, mask=CallMask(padding=real))}
    notes = _differences(modules, "nanoGPT-style, SDPA + combined mask", real)
    medians = compare({name: _timed(fn, grad_out, (x,)) for name, fn in modules.items()}, rounds=rounds,
                      min_run_time=0.2)
    rows = _ratio_rows(f"MultiHeadAttention step T={t}", medians, "nanoGPT-style, SDPA + combined mask", None, t,
                       notes)
    ours, theirs, twins = _gpt_pair(t)
    for layer in twins:
        layer.combined = combined
    ids = torch.randint(0, 512, (BATCH, t), generator=torch.Generator().manual_seed(1))
    models = {"GPT, nanoGPT-style attention": lambda: theirs(ids, padding_mask=real),
              "GPT, attnlab, padding_mask": lambda: ours(ids, padding_mask=real)}
    notes = _differences(models, "GPT, nanoGPT-style attention", real)
    steps = {name: (lambda model=model: model().logsumexp(-1)[real].mean().backward()) for name, model in models.items()}
    medians = compare(steps, rounds=rounds, min_run_time=0.2)
    return rows + _ratio_rows(f"GPT step T={t}", medians, "GPT, nanoGPT-style attention", None, t, notes)


def _structured_case(name: str, t: int, *, rounds: int, busy: bool) -> list[BenchRow]:
    """``auto`` against compiled FlexAttention, forward (compiled before the timing)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, t, DIMS, generator=gen) for _ in range(3))
    mask = sparse_cases(t)[name]
    flex = CompiledFlex(flex_mask_mods(t)[name], t, t)
    with torch.no_grad():
        flex(q, k, v)  # compile outside the timing
        attention(q, k, v, mask=mask)
        candidates = {"compiled FlexAttention": lambda: flex(q, k, v), "attnlab auto": lambda: attention(q, k, v, mask=mask)}
        with busy_core() if busy else contextlib.nullcontext():
            medians = compare(candidates, rounds=rounds, min_run_time=0.2)
    label = "busy core" if busy else "idle"
    return _ratio_rows(f"{name} fwd T={t} {label}", medians, "compiled FlexAttention", None, t)


def _structured_backward(name: str, t: int, *, rounds: int) -> list[BenchRow]:
    """``auto`` against SDPA with the dense mask, forward+backward."""
    gen = torch.Generator().manual_seed(0)
    leaves = tuple(torch.randn(1, HEADS, t, DIMS, generator=gen, requires_grad=True) for _ in range(3))
    mask = sparse_cases(t)[name]
    dense = masks.materialize(flex_mask_mods(t)[name], tq=t, tk=t)  # (1, 1, T, T)
    grad_out = torch.randn(1, HEADS, t, DIMS, generator=gen)
    candidates = {"SDPA, dense mask": lambda: F.scaled_dot_product_attention(*leaves, attn_mask=dense),
                  "attnlab auto": lambda: attention(*leaves, mask=mask)}
    medians = compare({n: _timed(fn, grad_out, leaves) for n, fn in candidates.items()}, rounds=rounds,
                      min_run_time=0.2)
    return _ratio_rows(f"{name} fwd+bwd T={t}", medians, "SDPA, dense mask", None, t)


def structured_rows(lengths: tuple[int, ...], backward_t: int, *, rounds: int) -> list[BenchRow]:
    """Packed documents and a 256-key window: against compiled Flex (idle, busy) and SDPA's dense mask.

    Example:
        >>> rows = structured_rows((2048,), 2048, rounds=1)   # doctest: +SKIP
    """
    rows = []
    for name in ("packed 8 docs", "window 256"):
        for t in lengths:
            for busy in (False, True):
                rows += _structured_case(name, t, rounds=rounds, busy=busy)
        rows += _structured_backward(name, backward_t, rounds=rounds)
    return rows


def padded_suite(*, quick: bool = False, parts: tuple[str, ...] = PARTS, rounds: int | None = None,
                 attention_lengths: tuple[int, ...] | None = None, training_lengths: tuple[int, ...] | None = None,
                 structured_lengths: tuple[int, ...] | None = None, backward_length: int | None = None,
                 progress: Callable[[str], object] | None = None) -> list[BenchRow]:
    """The padded suite's rows (see the module docstring); ``parts`` picks among :data:`PARTS`.

    Args:
        quick: smaller sizes: attention at T = 256 and 1024, training at 256, structured masks at 2k.
        parts: which of ``"attention"``, ``"training"``, ``"structured"`` to time.
        rounds: interleaved rounds per comparison (default 5, quick 3).
        attention_lengths, training_lengths, structured_lengths, backward_length: the sequence
            lengths of each part (default: the module docstring's).
        progress: called with one line before each group of timings (the whole suite takes
            about 15 minutes on 2 cores, most of it compiling and timing FlexAttention at 32k).

    Returns:
        :class:`attnlab.lab.bench.BenchRow` s; ``ratio`` is each row's median over its case's baseline.

    Example:
        >>> padded_suite(parts=("nope",))
        Traceback (most recent call last):
        ...
        ValueError: parts must be among ('attention', 'training', 'structured'), got ('nope',)
    """
    if not parts or any(part not in PARTS for part in parts):
        raise ValueError(f"parts must be among {PARTS}, got {parts!r}")
    rounds = (3 if quick else 5) if rounds is None else rounds
    say = progress or (lambda line: None)
    rows: list[BenchRow] = []
    if "attention" in parts:
        for t in attention_lengths or ((256, 1024) if quick else (256, 1024, 4096)):
            say(f"padded: causal+padding attention, T={t}")
            rows += attention_rows(t, rounds=rounds)
    if "training" in parts:
        for t in training_lengths or ((256,) if quick else (256, 1024)):
            say(f"padded: MultiHeadAttention and GPT training steps, T={t}")
            rows += training_rows(t, rounds=rounds)
    if "structured" in parts:
        lengths = structured_lengths or ((2048,) if quick else (2048, 8192, 32768))
        say(f"padded: documents and windows vs compiled FlexAttention (compiling), T={', '.join(map(str, lengths))}")
        rows += structured_rows(lengths, backward_length or (2048 if quick else 8192), rounds=rounds)
    return rows
