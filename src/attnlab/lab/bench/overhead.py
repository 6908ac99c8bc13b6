"""The ``overhead`` suite: attnlab beside plain PyTorch on the calls real models make (issue 21's targets).

Each case times attnlab and the plain-PyTorch call a user would write instead, side by side in
the same interleaved rounds (:func:`attnlab.lab.bench.timing.compare`, median of each), and reports
their ratio ``attnlab / plain`` beside the target:

* ``decode`` -- one query over ``Tk`` cached keys, ``B=4 H=12 D=64`` fp32, **one thread**:
  ``attention(mask=(B,1,1,Tk) bool padding, align="bottom_right")`` vs ``F.sdpa`` with the same
  mask (target <= 1.15), and both unmasked (<= 1.10);
* ``prefill`` -- ``T`` queries with the ``(B,1,T,T)`` bool causal-and-left-padding mask
  transformers builds, vs ``F.sdpa`` with the same mask (<= 1.10);
* ``tiny Llama`` -- a randomly initialised 4-layer Llama (hidden 256, 8 heads, 2 KV heads) in
  transformers on a left-padded batch, ``attn_implementation="attnlab"`` vs ``"sdpa"``: forward
  and greedy generation, whose tokens must be identical (<= 1.05; skipped without transformers);
* ``MultiHeadAttention`` -- :class:`attnlab.nn.MultiHeadAttention` vs a nanoGPT-style module with
  the same weights, forward and forward+backward (<= 1.00);
* ``torch.compile`` -- ``torch.compile(fullgraph=True)`` of a function calling
  :func:`attnlab.attention` (unmasked, causal, bool mask, float mask, a mask mod): ``ok`` or the
  exception's first line, and when it compiles, compiled vs eager (ratio = compiled / eager).

Everything but the decode rows runs on the threads torch has when the suite starts; the thread
count is restored afterwards. Figures are forward passes under ``torch.no_grad()`` unless the case
says fwd+bwd.

Example:
    >>> row = OverheadRow("decode Tk=64", "attention", "F.sdpa", 3e-5, 2e-5, bound=1.15)
    >>> round(row.ratio, 2), [r.ratio for r in row.bench_rows()]
    (1.5, [1.5, 1.0])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import masks
from attnlab.lab.bench.modules import ModulesConfig, _step, nanogpt_twin
from attnlab.lab.bench.timing import BenchRow, compare
from attnlab.functional import attention
from attnlab.integrations import transformers as hf_integration
from attnlab.nn.multihead import MultiHeadAttention
from attnlab.nn.multihead import QKV

__all__ = ["OverheadSizes", "OverheadRow", "sizes_for", "overhead_suite", "legend", "print_overhead"]

SUITE = "overhead"


@dataclass(frozen=True)
class OverheadSizes:
    """The suite's shapes and rounds (defaults: issue 21's; :func:`sizes_for` gives the quick ones).

    Attributes:
        batch, heads, head_dim: the decode, prefill and compile calls' ``B``, ``H``, ``D``.
        decode_lengths: cached keys ``Tk`` of the decode rows.
        prefill_lengths: ``T`` of the prefill rows.
        llama: the tiny Llama's ``LlamaConfig`` keywords; llama_len, llama_new_tokens: its prompt
            length (batch ``batch``, left-padded) and greedy tokens.
        module: the MultiHeadAttention rows' sizes; module_rounds: their interleaved rounds.
        compile_len: ``T`` of the torch.compile rows.
        rounds, min_run_time: interleaved rounds and seconds per timing of the other rows.

    Example:
        >>> sizes_for(quick=True).module.seq_len < OverheadSizes().module.seq_len
        True
    """

    batch: int = 4
    heads: int = 12
    head_dim: int = 64
    decode_lengths: tuple[int, ...] = (64, 1024)
    prefill_lengths: tuple[int, ...] = (256, 1024)
    llama: dict = field(default_factory=lambda: dict(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2))
    llama_len: int = 256
    llama_new_tokens: int = 32
    module: ModulesConfig = ModulesConfig()
    module_rounds: int = 7
    compile_len: int = 256
    rounds: int = 5
    min_run_time: float = 0.2


def sizes_for(*, quick: bool) -> OverheadSizes:
    """Issue 21's sizes, or smaller ones and fewer rounds for ``--quick`` (about a minute on 2 cores).

    Example:
        >>> sizes_for(quick=False) == OverheadSizes()
        True
    """
    if not quick:
        return OverheadSizes()
    return OverheadSizes(prefill_lengths=(128, 256), llama_len=64, llama_new_tokens=8,
                         module=ModulesConfig.for_run(quick=True), module_rounds=3, compile_len=64,
                         rounds=3, min_run_time=0.05)


@dataclass
class OverheadRow:
    """One case: attnlab's call and the plain call it is measured against, both medians.

    Attributes:
        case: what was run, briefly (the sizes: :func:`legend`).
        name, baseline: attnlab's side and the plain side (compile rows: compiled and eager attnlab).
        seconds, baseline_seconds: their medians (None when not timed: skipped, failed to compile).
        bound: the target for :attr:`ratio` (None: no timing target).
        note: whether it compiled, whether tokens matched, why it was skipped.
        t: the sequence length (keys for decode), None when the case has no single one.

    Example:
        >>> OverheadRow("c", "a", "b", None, 1.0, note="skipped").ratio is None
        True
    """

    case: str
    name: str
    baseline: str
    seconds: float | None
    baseline_seconds: float | None
    bound: float | None = None
    note: str = ""
    t: int | None = None

    @property
    def ratio(self) -> float | None:
        """attnlab's median over the plain one's (None unless both were timed)."""
        if self.seconds is None or self.baseline_seconds is None:
            return None
        return self.seconds / self.baseline_seconds

    def bench_rows(self) -> list[BenchRow]:
        """The two sides as :class:`BenchRow` s of one case (attnlab's first); ratio over the plain side.

        Example:
            >>> [r.name for r in OverheadRow("c", "a", "b", 2.0, 1.0).bench_rows()]
            ['a', 'b']
        """
        target = "" if self.bound is None else f"target <= {self.bound:.2f}; "
        return [BenchRow(SUITE, self.case, self.name, self.seconds, ratio=self.ratio,
                         note=f"{target}ratio over {self.baseline}; {self.note}".rstrip("; "), t=self.t),
                BenchRow(SUITE, self.case, self.baseline, self.baseline_seconds,
                         ratio=None if self.baseline_seconds is None else 1.0, t=self.t)]


def _timed(case: str, name: str, baseline: str, ours: Callable[[], object], plain: Callable[[], object],
           sizes: OverheadSizes, *, rounds: int | None = None, **row) -> OverheadRow:
    """``ours`` and ``plain`` timed side by side (interleaved rounds, medians) as one row."""
    seconds = compare({name: ours, baseline: plain}, rounds=rounds or sizes.rounds,
                      min_run_time=sizes.min_run_time)
    return OverheadRow(case, name, baseline, seconds[name], seconds[baseline], **row)


def _no_grad(fn: Callable, *args, **kwargs) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return fn(*args, **kwargs)
    return run


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Run the block on ``count`` threads (None: as it is) and restore the thread count."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _inputs(sizes: OverheadSizes, tq: int, tk: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, h, d = sizes.batch, sizes.heads, sizes.head_dim
    q = torch.randn(b, h, tq, d, generator=gen)  # (B, H, Tq, D)
    k, v = (torch.randn(b, h, tk, d, generator=gen) for _ in range(2))  # (B, H, Tk, D)
    return q, k, v


def _lengths(batch: int, t: int) -> Tensor:
    """Real tokens per batch row: ``t``, then fewer (``t * (batch - i) / batch``), at least 1."""
    return torch.tensor([max(1, t * (batch - i) // batch) for i in range(batch)])


def _left_padded_mask(lengths: Tensor, t: int) -> Tensor:
    """transformers' ``(B, 1, T, T)`` bool mask (True = attend) of a left-padded causal batch."""
    real = torch.arange(t) >= (t - lengths)[:, None]  # (B, T): the last `length` positions are real
    causal = torch.ones(t, t, dtype=torch.bool).tril()  # (T, T)
    return causal[None, None] & real[:, None, None, :]  # (B, 1, T, T)


def decode_rows(sizes: OverheadSizes) -> list[OverheadRow]:
    """One decoding step on one thread: padded cache (bool ``(B,1,1,Tk)``) and unmasked, per ``Tk``."""
    rows = []
    with _threads(1):
        for tk in sizes.decode_lengths:
            q, k, v = _inputs(sizes, 1, tk)
            mask = masks.padding_mask(_lengths(sizes.batch, tk), tk)  # (B, 1, 1, Tk) bool
            rows.append(_timed(
                f"decode Tk={tk}, bool padding mask, 1 thread", "attention(mask, bottom_right)",
                "F.sdpa same mask", _no_grad(attention, q, k, v, mask=mask, align="bottom_right"),
                _no_grad(F.scaled_dot_product_attention, q, k, v, attn_mask=mask), sizes, bound=1.15, t=tk))
            rows.append(_timed(
                f"decode Tk={tk}, unmasked, 1 thread", "attention", "F.sdpa",
                _no_grad(attention, q, k, v), _no_grad(F.scaled_dot_product_attention, q, k, v), sizes,
                bound=1.10, t=tk))
    return rows


def prefill_rows(sizes: OverheadSizes) -> list[OverheadRow]:
    """Prefill with transformers' ``(B,1,T,T)`` causal-and-left-padding bool mask, per ``T``."""
    rows = []
    for t in sizes.prefill_lengths:
        q, k, v = _inputs(sizes, t, t)
        mask = _left_padded_mask(_lengths(sizes.batch, t), t)
        rows.append(_timed(
            f"prefill T={t}, bool (B,1,T,T) mask", "attention(mask)", "F.sdpa same mask",
            _no_grad(attention, q, k, v, mask=mask), _no_grad(F.scaled_dot_product_attention, q, k, v,
                                                              attn_mask=mask), sizes, bound=1.10, t=t))
    return rows


# ----------------------------------------------------------------------------- tiny Llama

LLAMA_BASELINE = "sdpa"


def _llama_models(sizes: OverheadSizes, name: str, seed: int = 0) -> dict[str, torch.nn.Module]:
    """The same randomly initialised Llama as ``attn_implementation=name`` and ``"sdpa"``, in memory."""
    import transformers

    def config():  # one config per model: from_config records the implementation on it
        return transformers.LlamaConfig(**sizes.llama, max_position_embeddings=sizes.llama_len + sizes.llama_new_tokens,
                                        bos_token_id=1, eos_token_id=None, pad_token_id=0)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        models = {impl: transformers.AutoModelForCausalLM.from_config(config(), attn_implementation=impl).eval()
                  for impl in (name, LLAMA_BASELINE)}
    models[name].load_state_dict(models[LLAMA_BASELINE].state_dict())
    return models


def _left_padded_prompt(sizes: OverheadSizes, vocab: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Token ids ``(B, T)`` and transformers' attention_mask ``(B, T)`` (1 = real), padded on the left."""
    t = sizes.llama_len
    gen = torch.Generator().manual_seed(seed)
    real = torch.arange(t) >= (t - _lengths(sizes.batch, t))[:, None]  # (B, T)
    ids = torch.randint(3, vocab, (sizes.batch, t), generator=gen).masked_fill(~real, 0)
    return ids, real.long()


def _greedy(model: torch.nn.Module, ids: Tensor, attention_mask: Tensor, new_tokens: int) -> Tensor:
    """The ``new_tokens`` greedy tokens ``(B, new_tokens)`` the model generates after ``ids``."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def _token_note(ours: Tensor, plain: Tensor) -> str:
    """Whether the two generations are the same tokens (a mismatch is reported, never raised)."""
    if ours.shape == plain.shape and torch.equal(ours, plain):
        return "identical tokens"
    differ = (ours != plain).sum().item() if ours.shape == plain.shape else "all"
    return f"TOKENS DIFFER: {differ} of {plain.numel()} new tokens"


def llama_rows(sizes: OverheadSizes) -> list[OverheadRow]:
    """The tiny Llama through transformers, ``"attnlab"`` vs ``"sdpa"``: forward and greedy generation."""
    t, new = sizes.llama_len, sizes.llama_new_tokens
    cases = (f"tiny Llama fwd T={t}", f"tiny Llama generate {new}, T={t}")
    try:
        name = hf_integration.register()  # imports transformers
    except ImportError as err:
        return [OverheadRow(case, '"attnlab"', f'"{LLAMA_BASELINE}"', None, None, bound=1.05,
                            note=f"skipped: {str(err).splitlines()[0]}", t=t) for case in cases]
    models = _llama_models(sizes, name)
    ids, attention_mask = _left_padded_prompt(sizes, sizes.llama["vocab_size"])
    forward = {impl: _no_grad(model, input_ids=ids, attention_mask=attention_mask, use_cache=False)
               for impl, model in models.items()}
    generate = {impl: (lambda model=model: _greedy(model, ids, attention_mask, new)) for impl, model in models.items()}
    note = _token_note(generate[name](), generate[LLAMA_BASELINE]())
    labels = (f'"{name}"', f'"{LLAMA_BASELINE}"')
    return [_timed(cases[0], *labels, forward[name], forward[LLAMA_BASELINE], sizes, bound=1.05, t=t),
            _timed(cases[1], *labels, generate[name], generate[LLAMA_BASELINE], sizes, bound=1.05, note=note, t=t)]


# ----------------------------------------------------------------------------- modules

def module_rows(sizes: OverheadSizes) -> list[OverheadRow]:
    """attnlab's MultiHeadAttention vs a nanoGPT-style module with its weights, fwd and fwd+bwd."""
    config = sizes.module
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ours = MultiHeadAttention(config.d_model, config.d_model, config.seq_len, 0.0, config.num_heads, qkv=QKV(bias=True))
        x = torch.randn(config.batch, config.seq_len, config.d_model)  # (B, T, C)
        grad_out = torch.randn_like(x)
    nano = nanogpt_twin(ours, num_heads=config.num_heads)
    rows = []
    for mode, grad in (("fwd", None), ("fwd+bwd", grad_out)):
        x_in = x if grad is None else x.clone().requires_grad_(True)
        rows.append(_timed(
            f"MultiHeadAttention {mode} T={config.seq_len}",
            "attnlab.nn.MultiHeadAttention", "nanoGPT-style", _step(ours, x_in, grad), _step(nano, x_in, grad),
            sizes, rounds=sizes.module_rounds, bound=1.00, t=config.seq_len))
    return rows


# ----------------------------------------------------------------------------- torch.compile

def compile_cases(sizes: OverheadSizes) -> dict[str, dict]:
    """The calls compiled: unmasked, causal, bool and float masks (transformers' prefill mask) and a mod.

    Example:
        >>> sorted(compile_cases(OverheadSizes(batch=2, compile_len=8)))
        ['bool mask', 'causal', 'float mask', 'mask mod (sliding window)', 'unmasked']
    """
    t = sizes.compile_len
    allowed = _left_padded_mask(_lengths(sizes.batch, t), t)  # (B, 1, T, T) bool
    return {
        "unmasked": {},
        "causal": dict(causal=True),
        "bool mask": dict(mask=allowed),
        "float mask": dict(mask=torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))),
        "mask mod (sliding window)": dict(mask=masks.sliding_window_mod(t, t, max(1, t // 4))),
    }


def _compile(fn: Callable) -> Callable:
    """``torch.compile(fn, fullgraph=True)``: a graph break is an error."""
    return torch.compile(fn, fullgraph=True)


def _first_line(err: BaseException, width: int = 100) -> str:
    """The exception's type and first line, cut to ``width`` characters (dynamo's run long)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0].strip() if lines else ''}".rstrip(": ")
    return text if len(text) <= width else text[:width - 1] + "…"


def _compile_row(case: str, options: dict, sizes: OverheadSizes) -> OverheadRow:
    """Compile ``attention(q, k, v, **options)``; its failure's first line, or compiled vs eager timed."""
    q, k, v = _inputs(sizes, sizes.compile_len, sizes.compile_len)

    def call(q, k, v):
        return attention(q, k, v, **options)

    name = f"compile {case}, T={sizes.compile_len}"
    labels = ("compiled attention", "eager attention")
    torch._dynamo.reset()  # each case compiles from scratch, whatever ran before
    try:
        compiled = _compile(call)
        with torch.no_grad():
            diff = (compiled(q, k, v) - call(q, k, v)).nan_to_num(nan=float("inf")).abs().max().item()
    except Exception as err:  # any failure to compile is the row's result, never the suite's end
        return OverheadRow(name, *labels, None, None, note=f"fails: {_first_line(err)}", t=sizes.compile_len)
    return _timed(name, *labels, _no_grad(compiled, q, k, v), _no_grad(call, q, k, v), sizes,
                  note=f"compiles: ok; max |compiled - eager| {diff:.1e}", t=sizes.compile_len)


def compile_rows(sizes: OverheadSizes) -> list[OverheadRow]:
    """:func:`_compile_row` for each of :func:`compile_cases`."""
    return [_compile_row(case, options, sizes) for case, options in compile_cases(sizes).items()]


# ----------------------------------------------------------------------------- the suite

def overhead_suite(*, quick: bool = False, sizes: OverheadSizes | None = None) -> list[OverheadRow]:
    """Every case of the suite, in the issue's order (decode on 1 thread, the rest on the current threads).

    Args:
        quick: the smaller sizes of :func:`sizes_for`.
        sizes: explicit sizes (overrides ``quick``).

    Example:
        >>> rows = overhead_suite(quick=True)  # doctest: +SKIP
    """
    sizes = sizes if sizes is not None else sizes_for(quick=quick)
    with _threads(None):  # whatever a case does, the thread count comes back
        return decode_rows(sizes) + prefill_rows(sizes) + llama_rows(sizes) + module_rows(sizes) + \
            compile_rows(sizes)


def legend(sizes: OverheadSizes, threads: int | None = None) -> list[str]:
    """What each group of rows runs, on which sizes and threads: the lines printed under the table.

    Example:
        >>> legend(OverheadSizes(), threads=2)[0].startswith("decode: B=4 H=12 D=64")
        True
    """
    threads = torch.get_num_threads() if threads is None else threads
    shape, llama, module = f"B={sizes.batch} H={sizes.heads} D={sizes.head_dim}", sizes.llama, sizes.module
    return [
        f"decode: {shape}, 1 query, fp32, 1 thread; attention(q, k, v, mask=(B,1,1,Tk) bool padding, "
        "align='bottom_right') vs F.scaled_dot_product_attention(attn_mask=the same), and both unmasked",
        f"prefill: {shape}, fp32, {threads} threads; transformers' (B,1,T,T) bool causal & left-padding mask, "
        "attention(mask=) vs F.scaled_dot_product_attention(attn_mask=)",
        f"tiny Llama: {llama['num_hidden_layers']} layers, hidden {llama['hidden_size']}, "
        f"{llama['num_attention_heads']} heads, {llama['num_key_value_heads']} KV heads, vocab "
        f"{llama['vocab_size']}, random weights (seed 0), left-padded B={sizes.batch}, {threads} threads; "
        'attn_implementation="attnlab" vs "sdpa": forward (no cache) and greedy generate',
        f"MultiHeadAttention: B={module.batch} C={module.d_model} H={module.num_heads} causal, {threads} threads, "
        f"{sizes.module_rounds} rounds; attnlab.nn.MultiHeadAttention vs a nanoGPT-style module, same weights",
        f"compile: {shape}, {threads} threads; torch.compile(fullgraph=True) of a function calling "
        "attention(...), compiled vs eager; the note says 'ok' or the exception's first line",
        f"median of {sizes.rounds} interleaved rounds (MultiHeadAttention: {sizes.module_rounds}), "
        "forward under no_grad unless fwd+bwd",
    ]


def print_overhead(rows: list[OverheadRow], *, title: str, sizes: OverheadSizes | None = None,
                   console=None) -> None:
    """The rows as one table (median ms of both sides, ratio attnlab / plain, target, note), then the legend.

    Example:
        >>> print_overhead([OverheadRow("c", "a", "b", 2e-3, 1e-3, bound=1.1)], title="t")  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table

    console = Console() if console is None else console
    table = Table(title=title)
    for column in ("case", "attnlab ms", "plain ms", "ratio", "target", "note"):
        table.add_column(column, justify="left" if column in ("case", "note") else "right")
    for row in rows:
        table.add_row(row.case, _ms(row.seconds), _ms(row.baseline_seconds),
                      "-" if row.ratio is None else f"{row.ratio:.2f}",
                      "-" if row.bound is None else f"<= {row.bound:.2f}", row.note)
    console.print(table)
    if sizes is not None:
        for line in legend(sizes):
            console.print(line, markup=False, soft_wrap=True)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"

