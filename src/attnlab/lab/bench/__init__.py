"""Benchmarks behind ``attnlab bench``: timing primitives and the suites.

* :mod:`attnlab.lab.bench.timing` -- :func:`time_fn`, :func:`matmul_peak` (the one matmul peak
  measurement), :func:`compare` (interleaved rounds), :class:`BenchRow`, :func:`print_rows`.
* :mod:`attnlab.lab.bench.suites` -- the ``backends`` and ``memory`` suites and :func:`run_suite`.
* :mod:`attnlab.lab.bench.modules` -- the ``modules`` suite: attnlab's ``MultiHeadAttention``
  beside torch's, the tutorial's and nanoGPT's (:mod:`attnlab.lab.bench.competitors`).
* :mod:`attnlab.lab.bench.overhead` -- the ``overhead`` suite: attnlab beside plain PyTorch on
  decode, prefill with transformers' mask, a tiny Llama, MultiHeadAttention and torch.compile.
* :mod:`attnlab.lab.bench.report` -- the rows as JSON (:func:`bench_json`) and as a PNG of time and
  GFLOP/s vs T (:func:`plot_rows`), behind ``attnlab bench --json`` / ``--plot``.

FLOPs follow :func:`attnlab._flops.attention_flops`: forward ``4*B*H*Tq*Tk*D`` (with
``Dv != D``: ``2*B*H*Tq*Tk*(D + Dv)``), halved for causal; backward 2.5x forward.

Example:
    >>> attention_flops(1, 8, 1024, 1024, 64, causal=True) / 1e9
    1.073741824
"""

from __future__ import annotations

from attnlab._flops import attention_flops
from attnlab.lab.bench.modules import ModulesConfig, run_modules_suite
from attnlab.lab.bench.overhead import OverheadRow, overhead_suite
from attnlab.lab.bench.report import bench_json, plot_rows
from attnlab.lab.bench.suites import SUITES, backend_cases, backends_suite, memory_suite, run_suite
from attnlab.lab.bench.timing import BenchRow, compare, machine_line, matmul_peak, print_rows, time_fn

__all__ = [
    "attention_flops",
    "time_fn",
    "matmul_peak",
    "compare",
    "BenchRow",
    "print_rows",
    "machine_line",
    "run_suite",
    "SUITES",
    "backend_cases",
    "backends_suite",
    "memory_suite",
    "ModulesConfig",
    "run_modules_suite",
    "OverheadRow",
    "overhead_suite",
    "bench_json",
    "plot_rows",
]
