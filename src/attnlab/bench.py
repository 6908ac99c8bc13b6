"""Benchmark utilities and the suites behind ``attnlab bench``.

API (for suites written elsewhere, e.g. :mod:`attnlab.nn.benchmark`):

* :func:`attention_flops` -- DESIGN.md's FLOP convention: forward ``4*B*H*Tq*Tk*D`` (with
  ``Dv != D``: ``2*B*H*Tq*Tk*(D + Dv)``), halved for causal; backward 2.5x forward;
  forward+backward 3.5x.
* :func:`time_fn` -- median seconds of one callable via ``torch.utils.benchmark`` with
  ``num_threads=torch.get_num_threads()``.
* :func:`matmul_peak` -- the machine's square matrix-multiply rate for a dtype and device,
  **in FLOP/s** (divide by 1e9 for GFLOP/s), measured now, so that every figure can be
  quoted as a fraction of a peak measured in the same run.
* :func:`compare` -- side-by-side timing of several candidates, interleaved round by round
  (so that a load change on a shared machine hits every candidate alike), median per candidate.
* :class:`BenchRow` and :func:`print_rows` -- one result line and a rich table of them
  (GFLOP/s, fraction of the matmul peak, ratio to the fastest in the same case).
* :func:`run_suite` -- ``"backends"`` (each backend and ``auto`` on causal / padding-masked /
  unmasked calls), ``"memory"`` (peak memory of the reference vs the O(T) backends as T grows,
  via :class:`attnlab._memory.PeakMemory`), ``"modules"`` (delegates to
  ``attnlab.nn.benchmark.run_modules_suite``) or ``"all"``.

Example:
    >>> attention_flops(1, 8, 1024, 1024, 64, causal=True) / 1e9
    1.073741824
    >>> seconds = compare({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))},
    ...                   rounds=1, min_run_time=0.01)
    >>> sorted(seconds)
    ['a', 'b']
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "attention_flops",
    "time_fn",
    "matmul_peak",
    "compare",
    "BenchRow",
    "print_rows",
    "run_suite",
    "SUITES",
]

_MODES = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
SUITES = ("backends", "memory", "modules")


def attention_flops(b: int, h: int, tq: int, tk: int, d: int, dv: int | None = None, *,
                    causal: bool = False, mode: str = "fwd") -> float:
    """FLOPs of one attention call under DESIGN.md's convention.

    Args:
        b, h, tq, tk, d: batch, query heads, query/key lengths, head dim.
        dv: value head dim (defaults to ``d``).
        causal: halve the count (half the score matrix is skipped).
        mode: ``"fwd"``, ``"bwd"`` (2.5x forward) or ``"fwd+bwd"`` (3.5x).

    Example:
        >>> attention_flops(1, 1, 2, 2, 4, mode="fwd+bwd")
        224.0
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    dv = d if dv is None else dv
    forward = 2.0 * b * h * tq * tk * (d + dv)
    if causal:
        forward /= 2
    return forward * _MODES[mode]


def time_fn(fn: Callable[[], object], *, min_run_time: float = 0.5) -> float:
    """Median seconds per call of ``fn`` (``torch.utils.benchmark``, all current threads).

    Example:
        >>> time_fn(lambda: torch.ones(8) * 2, min_run_time=0.01) > 0
        True
    """
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def matmul_peak(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *,
                n: int = 2048, min_run_time: float = 0.3) -> float:
    """Measured ``n x n`` matrix-multiply rate in FLOP/s for ``dtype`` on ``device``.

    Example:
        >>> matmul_peak(torch.float32, n=128, min_run_time=0.01) > 1e6
        True
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def matmul():
        a @ b
        sync()

    matmul()
    return 2.0 * n**3 / time_fn(matmul, min_run_time=min_run_time)


def compare(candidates: dict[str, Callable[[], object]], *, rounds: int = 3,
            min_run_time: float = 0.2) -> dict[str, float]:
    """Median seconds per candidate, timed side by side: each round times every candidate once.

    Each candidate runs once untimed first (warm-up, compilation). The result is the median
    over rounds of each round's median.

    Example:
        >>> sorted(compare({"x": lambda: None}, rounds=2, min_run_time=0.01))
        ['x']
    """
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            times[name].append(time_fn(fn, min_run_time=min_run_time))
    return {name: statistics.median(values) for name, values in times.items()}


@dataclass
class BenchRow:
    """One benchmark line.

    Attributes:
        suite, case, name: what was measured (``case`` groups rows compared with each other).
        seconds: median seconds (None when not timed).
        flops: FLOPs of one run under :func:`attention_flops` (None when not applicable).
        peak: the matmul rate in FLOP/s measured in the same run (None if not measured).
        ratio: seconds / fastest seconds in the same case.
        note: anything else (memory, the backend auto chose, ...).

    Example:
        >>> BenchRow("backends", "causal", "sdpa", 0.5, 1e9, 1e10).gflops
        2.0
    """

    suite: str
    case: str
    name: str
    seconds: float | None
    flops: float | None = None
    peak: float | None = None
    ratio: float | None = None
    note: str = ""

    @property
    def gflops(self) -> float | None:
        return None if not (self.flops and self.seconds) else self.flops / self.seconds / 1e9

    @property
    def peak_fraction(self) -> float | None:
        return None if not (self.gflops and self.peak) else self.gflops * 1e9 / self.peak


def _fill_ratios(rows: list[BenchRow]) -> list[BenchRow]:
    best: dict[str, float] = {}
    for row in rows:
        if row.seconds is not None:
            best[row.case] = min(best.get(row.case, row.seconds), row.seconds)
    for row in rows:
        if row.seconds is not None:
            row.ratio = row.seconds / best[row.case]
    return rows


def print_rows(rows: list[BenchRow], *, title: str, console=None) -> None:
    """Print rows as a rich table: median ms, GFLOP/s, % of matmul peak, ratio, note.

    Example:
        >>> print_rows([BenchRow("s", "c", "n", 0.001, 1e6, 1e9, 1.0)], title="t")  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table

    console = Console() if console is None else console
    table = Table(title=title)
    for column in ("case", "implementation", "median ms", "GFLOP/s", "% of matmul", "ratio", "note"):
        table.add_column(column, justify="left" if column in ("case", "implementation", "note") else "right")
    for row in rows:
        table.add_row(
            row.case, row.name,
            "-" if row.seconds is None else f"{row.seconds * 1e3:.2f}",
            "-" if row.gflops is None else f"{row.gflops:.1f}",
            "-" if row.peak_fraction is None else f"{100 * row.peak_fraction:.1f}%",
            "-" if row.ratio is None else f"{row.ratio:.2f}",
            row.note,
        )
    console.print(table)


def machine_line() -> str:
    """CPU model, thread count and torch version, for every printed figure.

    Example:
        >>> "torch" in machine_line()
        True
    """
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{model}, {torch.get_num_threads()} threads, {device}, torch {torch.__version__}"


# ----------------------------------------------------------------------------- suites
def _attention_inputs(b, h, t, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]


def backend_cases(t: int, *, batch: int = 1) -> dict[str, dict]:
    """The calls the backends suite times: causal, padding-masked (3/4 real keys), unmasked.

    Example:
        >>> sorted(backend_cases(8))
        ['causal', 'none', 'padding']
    """
    from attnlab import masks

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
    from attnlab import attention, backends

    t = t if t is not None else (512 if quick else 4096)
    rounds = rounds if rounds is not None else (1 if quick else 3)
    min_run = 0.05 if quick else 0.3
    b, h, d = 1, 8, 64
    q, k, v = _attention_inputs(b, h, t, d, dtype, device)
    matmul, matmul_flops = _matmul_candidate(dtype, device)
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
        candidates[_PEAK] = matmul  # timed in the same rounds: same load as the candidates
        seconds = compare(candidates, rounds=rounds, min_run_time=min_run)
        peak = matmul_flops / seconds.pop(_PEAK)
        flops = attention_flops(b, h, t, t, d, causal=case == "causal")
        for name, sec in seconds.items():
            note = f"auto -> {chosen}" if name == "auto" else ""
            rows.append(BenchRow("backends", f"{case} T={t}", name, sec, flops, peak, note=note))
    return _fill_ratios(rows)


_PEAK = "matmul (peak)"


def _matmul_candidate(dtype: torch.dtype, device: str, n: int = 2048):
    """A square matmul to time beside the candidates, and its FLOPs."""
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(n, n, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    return (lambda: a @ b), 2.0 * n**3


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
    from attnlab import attention, backends
    from attnlab._memory import PeakMemory

    lengths = (256, 1024) if quick else (1024, 2048, 4096)
    names = [n for n in ("reference", "chunked", "sdpa") if n in backends.available()]
    rows = []
    for t in lengths:
        for name in names:
            q, k, v = (x.requires_grad_() for x in _attention_inputs(1, 4, t, 64, torch.float32, "cpu"))
            with PeakMemory() as meter:
                attention(q, k, v, causal=True, backend=name).sum().backward()
            rows.append(BenchRow("memory", f"causal fwd+bwd T={t}", name, None,
                                 note=f"peak {meter.peak_bytes / 2**20:.1f} MiB"))
    return rows


def run_suite(name: str, *, quick: bool = False, console=None) -> list[BenchRow]:
    """Run one suite (``backends``, ``memory``, ``modules``) or ``all`` and print its tables.

    Example:
        >>> run_suite("nope")
        Traceback (most recent call last):
        ...
        ValueError: suite must be one of ('backends', 'memory', 'modules', 'all'), got 'nope'
    """
    if name not in SUITES + ("all",):
        raise ValueError(f"suite must be one of {SUITES + ('all',)}, got {name!r}")
    from rich.console import Console

    console = Console() if console is None else console
    console.print(f"machine: {machine_line()}")
    console.print("FLOPs: forward 2*B*H*Tq*Tk*(D+Dv), halved for causal (DESIGN.md); "
                  "% of matmul = GFLOP/s over the same-dtype matmul rate measured in this run")
    rows: list[BenchRow] = []
    for suite in (SUITES if name == "all" else (name,)):
        if suite == "backends":
            rows += (found := backends_suite(quick=quick))
            print_rows(found, title="backends, forward, B=1 H=8 D=64 fp32", console=console)
        elif suite == "memory":
            rows += (found := memory_suite(quick=quick))
            print_rows(found, title="peak memory, causal forward+backward, B=1 H=4 D=64", console=console)
        else:
            _modules_suite(quick, console)
    return rows


def _modules_suite(quick: bool, console) -> None:
    try:
        from attnlab.nn.benchmark import run_modules_suite
    except ImportError as error:
        console.print(f"modules suite not available: {error}")
        return
    run_modules_suite(quick=quick, console=console)
