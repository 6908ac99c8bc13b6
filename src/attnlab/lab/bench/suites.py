"""The ``backends`` and ``memory`` suites behind ``attnlab bench``, and :func:`run_suite`.

* ``backends`` -- each backend and ``auto`` on causal / padding-masked / unmasked calls;
* ``memory`` -- peak memory of the reference vs the O(T) backends as T grows, via
  :class:`attnlab._memory.PeakMemory`;
* ``modules`` -- :func:`attnlab.lab.bench.modules.run_modules_suite`;
* ``sparse`` -- masks with structure (sliding window, packed documents, prefix-LM, chunked
  local): ``auto``, every serving backend and SDPA given the equivalent dense mask, forward and
  forward+backward; FLOPs count only the visible (query, key) pairs; ``with_flex`` adds the flex
  backend and compiled FlexAttention with its own block mask (forward; compiles for minutes);
* ``decode`` -- one decoding step (1 query over a KV cache) through ``auto`` vs raw SDPA;
* ``overhead`` -- attnlab beside plain PyTorch on the calls real models make (decode, prefill
  with transformers' mask, a tiny Llama, MultiHeadAttention, torch.compile):
  :func:`attnlab.lab.bench.overhead.overhead_suite`;
* ``decode-model`` -- a 6-layer, d_model=384 GPT generating 256 tokens after a 512-token
  prompt with the KV cache and by recomputing every step: tokens/s of each, their ratio, and
  whether the two greedy outputs are the same tokens (:func:`decode_model_suite`);
* ``variants`` -- MHA, GQA, MQA, MLA, sliding window and local/global layers at one size: KV
  bytes per token, peak memory, decoding tokens/s, held-out loss
  (:func:`attnlab.lab.bench.variants.variants_suite`).

Example:
    >>> sorted(backend_cases(64))
    ['causal', 'none', 'padding']
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnlab import backends, masks
from attnlab._checks import positive_int
from attnlab._flops import attention_flops
from attnlab._memory import PeakMemory
from attnlab.lab.bench.competitors import CompiledFlex, flex_mask_mods, sparse_cases
from attnlab.lab.bench.modules import run_modules_suite
from attnlab.lab.bench import overhead, padded, variants
from attnlab.lab.bench.timing import BenchRow, fill_ratios, compare, machine_line, matmul_candidate, print_rows
from attnlab.functional import attention
from attnlab.models import GPT

__all__ = ["SUITES", "backend_cases", "backends_suite", "memory_suite", "run_suite",
           "sparse_cases", "sparse_suite", "decode_suite", "GenerationTiming", "decode_model_suite"]

SUITES = ("backends", "memory", "modules", "sparse", "decode", "decode-model", "overhead", "variants", "padded")


def _attention_inputs(b, h, t, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]


def backend_cases(t: int, *, batch: int = 1) -> dict[str, dict]:
    """The calls the backends suite times: causal, padding-masked (3/4 real keys), unmasked.

    Example:
        >>> sorted(backend_cases(8))
        ['causal', 'none', 'padding']
    """

    lengths = torch.full((batch,), (3 * t) // 4)
    return {
        "causal": dict(causal=True),
        "padding": dict(mask=masks.padding_mask(lengths, t)),
        "none": dict(),
    }


def backends_suite(*, quick: bool = False, t: int | None = None, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", rounds: int | None = None) -> list[BenchRow]:
    """Time every available backend and ``auto`` side by side on causal/padding/unmasked calls.

    Forward only, under ``torch.no_grad()`` (flex's CPU kernel is inference only). B=1, H=8,
    D=64; T=4096 (quick: 512). The note says which backend ``auto`` picked. The matmul peak
    is timed as one more candidate in the same interleaved rounds, so that load from other
    jobs on a shared machine depresses the peak and the candidates alike.

    Example:
        >>> rows = backends_suite(quick=True, t=32, rounds=1)  # doctest: +SKIP
    """

    t = t if t is not None else (512 if quick else 4096)
    rounds = rounds if rounds is not None else (1 if quick else 3)
    min_run = 0.05 if quick else 0.3
    b, h, d = 1, 8, 64
    q, k, v = _attention_inputs(b, h, t, d, dtype, device)
    rows: list[BenchRow] = []
    for case, options in backend_cases(t, batch=b).items():
        options = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in options.items()}
        with torch.no_grad():
            call = backends.build_call(q, k, v, **options)
            chosen = backends.select(call).name
            names = [n for n, why in backends.reasons(call).items() if not why]
        candidates = {n: _no_grad(attention, q, k, v, backend=n, **options) for n in names}
        candidates["auto"] = _no_grad(attention, q, k, v, backend="auto", **options)
        if not quick and t >= 4096:
            candidates.pop("reference", None)  # O(T^2): minutes at T=4096 on 2 cores
        seconds, peak = _compare_with_peak(candidates, dtype=dtype, device=device, rounds=rounds,
                                           min_run_time=min_run)
        flops = attention_flops(b, h, t, t, d, causal=case == "causal")
        for name, sec in seconds.items():
            note = f"auto -> {chosen}" if name == "auto" else ""
            rows.append(BenchRow("backends", f"{case} T={t}", name, sec, flops, peak, note=note, t=t))
    return fill_ratios(rows)


_PEAK = "matmul (peak)"


def _compare_with_peak(candidates: dict[str, Callable[[], object]], *, dtype: torch.dtype = torch.float32,
                       device: str = "cpu", rounds: int, min_run_time: float) -> tuple[dict[str, float], float]:
    """:func:`compare` with the matmul as one more candidate: (seconds per candidate, peak FLOP/s).

    The peak is timed in the same interleaved rounds, so that load from other jobs on a shared
    machine depresses the peak and the candidates alike.
    """
    matmul, matmul_flops = matmul_candidate(dtype, device)
    seconds = compare({**candidates, _PEAK: matmul}, rounds=rounds, min_run_time=min_run_time)
    return seconds, matmul_flops / seconds.pop(_PEAK)


def _no_grad(fn, *args, **kwargs):
    def run():
        with torch.no_grad():
            return fn(*args, **kwargs)
    return run


def memory_suite(*, quick: bool = False) -> list[BenchRow]:
    """Peak tensor memory (forward+backward, causal) of the reference vs the O(T) backends.

    Measured with :class:`attnlab._memory.PeakMemory` (storages created during the call).

    Example:
        >>> rows = memory_suite(quick=True)  # doctest: +SKIP
    """

    lengths = (256, 1024) if quick else (1024, 2048, 4096)
    names = [n for n in ("reference", "chunked", "sdpa") if n in backends.available()]
    rows = []
    for t in lengths:
        for name in names:
            q, k, v = (x.requires_grad_() for x in _attention_inputs(1, 4, t, 64, torch.float32, "cpu"))
            with PeakMemory() as meter:
                attention(q, k, v, causal=True, backend=name).sum().backward()
            rows.append(BenchRow("memory", f"causal fwd+bwd T={t}", name, None,
                                 note=f"peak {meter.peak_bytes / 2**20:.1f} MiB", t=t))
    return rows


def _run_once(mask, q, k, v, backend: str, grad: bool) -> Callable[[], None]:
    """One forward (no_grad) or forward+backward of ``attention`` as a candidate."""
    def run():
        with torch.set_grad_enabled(grad):
            out = attention(q, k, v, mask=mask, backend=backend)
            if grad:
                out.sum().backward()
    return run


def _sparse_backends(call, *, t: int, quick: bool, with_flex: bool = False) -> list[str]:
    """The backends the sparse suite times: every one that serves ``call``, less flex unless
    ``with_flex`` (its CPU compile takes seconds to minutes per shape), the O(T^2) reference from
    T=4096, and with ``quick`` the reference and chunked (seconds per call at T=2048 on 2 cores;
    ``--quick`` checks the harness)."""
    left_out = (set() if with_flex else {"flex"}) | ({"reference"} if t >= 4096 else set()) | (
        {"reference", "chunked"} if quick else set())
    return [n for n, why in backends.reasons(call).items() if not why and n not in left_out]


FLEX_OWN = "flex compiled (own block mask)"


def _flex_own(case: str, t: int, q, k, v) -> Callable[[], None]:
    """Compiled FlexAttention given the case's mask as a plain function and its own block mask
    (:class:`attnlab.lab.bench.competitors.CompiledFlex`), forward."""
    flex = CompiledFlex(flex_mask_mods(t)[case], t, t)
    return _no_grad(flex, q, k, v)


def sparse_suite(*, quick: bool = False, lengths: tuple[int, ...] | None = None,
                 rounds: int | None = None, with_flex: bool = False,
                 cases: tuple[str, ...] | None = None) -> list[BenchRow]:
    """Structured masks at ``T`` in (2048, 8192) (quick: 1024), B=1 H=8 D=64 fp32.

    Candidates: ``auto``, the backends of :func:`_sparse_backends`, and
    ``sdpa dense mask``: SDPA handed the same mask materialised as a dense bool tensor. With
    ``with_flex``, forward rows also time the flex backend and :data:`FLEX_OWN`: compiled
    ``flex_attention`` with the block mask ``create_block_mask`` builds from the same mask written
    as a plain function (what a FlexAttention user writes; block mask and compilation untimed).
    FLOPs count only the visible pairs: ``2*B*H*visible*(D+Dv)`` forward, 3.5x with backward.

    Args:
        quick, lengths, rounds: sizes and rounds (see above).
        with_flex: add the flex rows (compiling takes seconds to minutes per shape and mask).
        cases: the names of :func:`sparse_cases` to time (default: all).

    Example:
        >>> rows = sparse_suite(quick=True, lengths=(256,), rounds=1)  # doctest: +SKIP
    """
    lengths = lengths or ((1024,) if quick else (2048, 8192))
    rounds = rounds if rounds is not None else (1 if quick else 3)
    b, h, d = 1, 8, 64
    rows: list[BenchRow] = []
    for t in lengths:
        q, k, v = _attention_inputs(b, h, t, d, torch.float32, "cpu")
        for case, mod in sparse_cases(t).items():
            if cases is not None and case not in cases:
                continue
            dense = masks.materialize(mod, tq=t, tk=t)  # (1, 1, T, T) bool
            visible = int(dense.sum())
            for grad in (False, True):
                x = [t_.detach().requires_grad_(grad) for t_ in (q, k, v)]
                with torch.set_grad_enabled(grad):
                    call = backends.build_call(*x, mask=mod)
                    chosen = backends.select(call).name
                    names = _sparse_backends(call, t=t, quick=quick, with_flex=with_flex)
                candidates = {n: _run_once(mod, *x, n, grad) for n in names}
                candidates["auto"] = _run_once(mod, *x, "auto", grad)
                candidates["sdpa dense mask"] = _run_once(dense, *x, "sdpa", grad)
                if with_flex and not grad:
                    candidates[FLEX_OWN] = _flex_own(case, t, *x)
                seconds, peak = _compare_with_peak(candidates, rounds=rounds,
                                                   min_run_time=0.05 if quick else 0.2)
                mode = "fwd+bwd" if grad else "fwd"
                flops = attention_flops(b, h, 1, visible, d, mode=mode)  # the visible pairs as Tq x Tk
                for name, sec in seconds.items():
                    note = f"auto -> {chosen}" if name == "auto" else ""
                    rows.append(BenchRow("sparse", f"{case} {mode} T={t}", name, sec, flops, peak, note=note, t=t))
    return fill_ratios(rows)


def decode_suite(*, quick: bool = False, lengths: tuple[int, ...] | None = None,
                 rounds: int | None = None) -> list[BenchRow]:
    """One decoding step, B=1 H=12 D=64, 1 query over ``Tk`` cached keys, one thread:
    ``attnlab.attention(backend="auto")`` vs raw ``scaled_dot_product_attention``.

    ``Tk`` in (64, 1024, 4096), 3 rounds (quick: (64, 1024), 1 round). The fp32 matmul rate is
    measured on the same one thread, in the same rounds.

    Example:
        >>> rows = decode_suite(lengths=(16,), rounds=1)  # doctest: +SKIP
    """
    lengths = lengths or ((64, 1024) if quick else (64, 1024, 4096))
    rounds = rounds if rounds is not None else (1 if quick else 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: list[BenchRow] = []
    try:
        for tk in lengths:
            q = torch.randn(1, 12, 1, 64)
            k, v = torch.randn(1, 12, tk, 64), torch.randn(1, 12, tk, 64)
            candidates = {
                "raw sdpa": _no_grad(torch.nn.functional.scaled_dot_product_attention, q, k, v),
                "auto": _no_grad(attention, q, k, v),
            }
            seconds, peak = _compare_with_peak(candidates, rounds=rounds, min_run_time=0.05 if quick else 0.2)
            flops = attention_flops(1, 12, 1, tk, 64)
            for name, sec in seconds.items():
                rows.append(BenchRow("decode", f"decode Tk={tk}", name, sec, flops, peak, t=tk))
    finally:
        torch.set_num_threads(threads)
    return fill_ratios(rows)


@dataclass
class GenerationTiming:
    """Greedy generation of one prompt with the KV cache and by recomputing every step.

    Attributes:
        new_tokens: tokens generated by each run.
        cached_seconds, recompute_seconds: wall seconds of each run (the prompt's prefill included).
        identical: whether the two runs produced the same tokens.
        setup: what was generated, for titles.

    Example:
        >>> timing = GenerationTiming(new_tokens=100, cached_seconds=1.0, recompute_seconds=4.0, identical=True)
        >>> timing.cached_rate, timing.recompute_rate, timing.speedup
        (100.0, 25.0, 4.0)
    """

    new_tokens: int
    cached_seconds: float
    recompute_seconds: float
    identical: bool
    setup: str = ""

    @property
    def cached_rate(self) -> float:
        """Tokens per second with the KV cache."""
        return self.new_tokens / self.cached_seconds

    @property
    def recompute_rate(self) -> float:
        """Tokens per second recomputing the whole sequence every step."""
        return self.new_tokens / self.recompute_seconds

    @property
    def speedup(self) -> float:
        """The cached rate over the recompute rate."""
        return self.cached_rate / self.recompute_rate

    def rows(self, case: str) -> list[BenchRow]:
        """The two runs as :class:`BenchRow` s of ``case``; ratio = cached rate / this run's rate.

        Example:
            >>> timing = GenerationTiming(new_tokens=8, cached_seconds=0.5, recompute_seconds=2.0, identical=True)
            >>> [(row.name, row.ratio) for row in timing.rows("c")]
            [('KV cache', 1.0), ('recompute', 4.0)]
        """
        return [BenchRow("decode-model", case, name, seconds, ratio=self.cached_rate / rate,
                         note=f"{rate:.1f} tokens/s")
                for name, seconds, rate in (("KV cache", self.cached_seconds, self.cached_rate),
                                            ("recompute", self.recompute_seconds, self.recompute_rate))]


def decode_model_suite(*, layers: int = 6, d_model: int = 384, heads: int = 6, vocab_size: int = 512,
                       prompt_len: int = 512, new_tokens: int = 256, seed: int = 0) -> GenerationTiming:
    """A randomly initialised GPT (fp32) generating greedily after a random prompt, timed both ways.

    Both runs decode the same prompt with the same model: one feeds a token per step and reads
    earlier keys/values from the KV cache, the other recomputes the whole sequence every step.
    The prefill of the prompt is inside both times, as a user waiting for the text sees it.

    Args:
        layers, d_model, heads, vocab_size: the model's size.
        prompt_len, new_tokens: the prompt's length and the tokens to generate.
        seed: seed of the weights and the prompt.

    Example:
        >>> timing = decode_model_suite(layers=1, d_model=16, heads=2, vocab_size=32, prompt_len=8,
        ...                             new_tokens=4)
        >>> timing.identical, timing.new_tokens
        (True, 4)
    """
    for name, value in (("layers", layers), ("d_model", d_model), ("heads", heads), ("vocab_size", vocab_size),
                        ("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        positive_int(name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(vocab_size, max_len=prompt_len + new_tokens, d_model=d_model, num_layers=layers,
                    num_heads=heads).eval()
        prompt = torch.randint(0, vocab_size, (1, prompt_len))
    model.generate(prompt[:, :16], 2)  # warm-up
    seconds, tokens = {}, {}
    for use_cache in (True, False):
        start = time.perf_counter()
        tokens[use_cache] = model.generate(prompt, new_tokens, use_cache=use_cache)
        seconds[use_cache] = time.perf_counter() - start
    setup = (f"GPT {layers} layers, d_model {d_model}, {heads} heads, vocab {vocab_size}: {new_tokens} greedy tokens "
             f"after {prompt_len}, fp32, {torch.get_num_threads()} threads")
    return GenerationTiming(new_tokens, seconds[True], seconds[False], torch.equal(tokens[True], tokens[False]),
                            setup)


def report_generation(timing: GenerationTiming, *, console=None) -> None:
    """Print ``timing`` as a table and its ratio; a token mismatch raises ``RuntimeError`` after printing.

    Example:
        >>> report_generation(GenerationTiming(8, 0.5, 2.0, identical=False))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: the KV-cache and the recomputing runs generated different greedy tokens
    """
    from rich.console import Console

    console = Console() if console is None else console
    title = f"{timing.setup} (ratio: KV-cache rate / the row's rate)"
    print_rows(timing.rows(f"{timing.new_tokens} new tokens"), title=title, console=console)
    console.print(f"KV cache {timing.cached_rate:.1f} tokens/s, recompute {timing.recompute_rate:.1f} tokens/s: "
                  f"{timing.speedup:.1f}x; identical greedy tokens: {'yes' if timing.identical else 'NO'}",
                  markup=False, soft_wrap=True)
    if not timing.identical:
        raise RuntimeError("the KV-cache and the recomputing runs generated different greedy tokens")


def run_suite(name: str, *, quick: bool = False, console=None, with_flex: bool = False) -> list[BenchRow]:
    """Run one suite (``backends``, ``memory``, ``modules``, ``sparse``, ``decode``, ``decode-model``,
    ``overhead``, ``variants``, ``padded``) or ``all``.

    ``with_flex`` adds FlexAttention's rows to the sparse suite (see :func:`sparse_suite`).

    Example:
        >>> run_suite("nope")
        Traceback (most recent call last):
        ...
        ValueError: suite must be one of ('backends', 'memory', 'modules', 'sparse', 'decode', 'decode-model', 'overhead', 'variants', 'padded', 'all'), got 'nope'
    """
    if name not in SUITES + ("all",):
        raise ValueError(f"suite must be one of {SUITES + ('all',)}, got {name!r}")
    from rich.console import Console

    console = Console() if console is None else console
    console.print(f"machine: {machine_line()}")
    if name != "overhead":  # the overhead suite reports ratios to plain PyTorch, no FLOPs
        console.print("FLOPs: forward 2*B*H*Tq*Tk*(D+Dv), halved for causal (docs/contract.md); "
                      "% of matmul = GFLOP/s over the same-dtype matmul rate measured in this run")
    rows: list[BenchRow] = []
    for suite in (SUITES if name == "all" else (name,)):
        if suite == "backends":
            rows += (found := backends_suite(quick=quick))
            print_rows(found, title="backends, forward, B=1 H=8 D=64 fp32", console=console)
        elif suite == "memory":
            rows += (found := memory_suite(quick=quick))
            print_rows(found, title="peak memory, causal forward+backward, B=1 H=4 D=64", console=console)
        elif suite == "sparse":
            rows += (found := sparse_suite(quick=quick, with_flex=with_flex))
            print_rows(found, title="structured masks, B=1 H=8 D=64 fp32 (FLOPs: visible pairs only)",
                       console=console)
        elif suite == "decode":
            rows += (found := decode_suite(quick=quick))
            print_rows(found, title="one decoding step, B=1 H=12 D=64, 1 thread", console=console)
        elif suite == "decode-model":
            sizes = dict(prompt_len=128, new_tokens=32) if quick else {}
            timing = decode_model_suite(**sizes)
            rows += timing.rows(f"{timing.new_tokens} new tokens")
            report_generation(timing, console=console)
        elif suite == "overhead":
            found = overhead.overhead_suite(sizes=(sizes := overhead.sizes_for(quick=quick)))
            rows += [row for case in found for row in case.bench_rows()]
            overhead.print_overhead(found, title="overhead: attnlab vs plain PyTorch (ratio = attnlab / plain; "
                                        "compile: compiled / eager)", sizes=sizes, console=console)
        elif suite == "padded":
            with console.status("padded suite") as status:
                found = padded.padded_suite(quick=quick, progress=status.update)
            rows += found
            print_rows(found, title="padded batches and structured masks, B=4 H=8 D=64 fp32 (ratio = time over the "
                       "case's baseline: SDPA + combined mask / nanoGPT-style / compiled flex / SDPA + dense mask)",
                       console=console)
        elif suite == "variants":
            found = variants.variants_suite(sizes=(sizes := variants.VariantSizes.for_run(quick=quick)))
            rows += [row.bench_row() for row in found]
            variants.print_variants(found, sizes, console=console)
        else:
            rows += run_modules_suite(quick=quick, console=console)
    return rows
