"""Timing primitives: median of a callable, the matmul peak, interleaved comparisons, result rows.

* :func:`time_fn` -- median seconds of one callable via ``torch.utils.benchmark`` with
  ``num_threads=torch.get_num_threads()``.
* :func:`matmul_peak` -- the machine's square matrix-multiply rate for a dtype and device,
  **in FLOP/s**, measured now, so that every figure can be quoted as a fraction of a peak
  measured in the same run. It is the one peak measurement of attnlab: every suite calls it.
* :func:`compare` -- side-by-side timing of several candidates, interleaved round by round
  (so that a load change on a shared machine hits every candidate alike), median per candidate.
* :class:`BenchRow` and :func:`print_rows` -- one result line and a rich table of them.

Example:
    >>> seconds = compare({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))},
    ...                   rounds=1, min_run_time=0.01)
    >>> sorted(seconds)
    ['a', 'b']
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["time_fn", "matmul_candidate", "matmul_peak", "compare", "BenchRow", "fill_ratios", "print_rows",
           "machine_line"]


def time_fn(fn: Callable[[], object], *, min_run_time: float = 0.5) -> float:
    """Median seconds per call of ``fn`` (``torch.utils.benchmark``, all current threads).

    Example:
        >>> time_fn(lambda: torch.ones(8) * 2, min_run_time=0.01) > 0
        True
    """
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def matmul_candidate(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *,
                     n: int = 2048) -> tuple[Callable[[], None], float]:
    """An ``n x n`` matrix multiply to time (synchronised on CUDA), and its FLOPs.

    Time it alone (:func:`matmul_peak`) or as one more candidate of :func:`compare`, so that the
    rate is measured under the same load as the figures it is quoted beside.

    Example:
        >>> run, flops = matmul_candidate(n=64)
        >>> run(); flops
        524288.0
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def matmul() -> None:
        a @ b
        sync()

    return matmul, 2.0 * n**3


def matmul_peak(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *,
                n: int = 2048, min_run_time: float = 0.3) -> float:
    """Measured ``n x n`` matrix-multiply rate in FLOP/s for ``dtype`` on ``device``.

    Example:
        >>> matmul_peak(torch.float32, n=128, min_run_time=0.01) > 1e6
        True
    """
    matmul, flops = matmul_candidate(dtype, device, n=n)
    matmul()  # warm-up
    return flops / time_fn(matmul, min_run_time=min_run_time)


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
        flops: FLOPs of one run under :func:`attnlab._flops.attention_flops` (None when not applicable).
        peak: the matmul rate in FLOP/s measured in the same run (None if not measured).
        ratio: seconds / fastest seconds in the same case.
        note: anything else (memory, the backend auto chose, ...).
        t: the sequence length the row was measured at (keys for a decoding step), None when the
            row has no single one; ``attnlab bench --plot`` draws rows against it.
        values: other figures of the row by name (the variants suite's KV bytes per token, peak
            memory, held-out loss), what a suite's own plot draws.

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
    t: int | None = None
    values: dict[str, float] = field(default_factory=dict)

    @property
    def gflops(self) -> float | None:
        return None if not (self.flops and self.seconds) else self.flops / self.seconds / 1e9

    @property
    def peak_fraction(self) -> float | None:
        return None if not (self.gflops and self.peak) else self.gflops * 1e9 / self.peak


def fill_ratios(rows: list[BenchRow]) -> list[BenchRow]:
    """Set each row's ``ratio``: its time over the fastest time in the same ``case`` (in place).

    Example:
        >>> rows = fill_ratios([BenchRow("s", "c", "a", 2.0, None, None), BenchRow("s", "c", "b", 1.0, None, None)])
        >>> [row.ratio for row in rows]
        [2.0, 1.0]
    """
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
