"""Bench results as files: every row as JSON with a header, and a PNG of time and GFLOP/s vs T.

* :func:`bench_json` -- ``{"header": {...}, "rows": [...]}``: the header says where and when the
  figures were measured (machine, torch, date, threads, the suite, quick) and how to read them
  (the FLOP convention, what ``ratio`` divides by, that sparse FLOPs count only visible pairs);
  each row has suite, case, implementation, T, seconds, FLOPs, GFLOP/s, the matmul rate and the
  fraction of it, ratio and note (``null`` where a row has no such figure).
* :func:`plot_rows` -- one line of two panels per case family (the case without its ``T=``):
  median ms (log scale) and GFLOP/s against T, one line per implementation.
* :func:`figure_png` -- a figure's PNG bytes, to hand to :func:`attnlab.io.write_atomically`.

Example:
    >>> rows = [BenchRow("decode", "decode Tk=64", "auto", 1e-5, 1e5, 1e11, 1.0, t=64)]
    >>> json.loads(bench_json(rows, suite="decode", quick=True))["rows"][0]["gflops"]
    10.0
"""

from __future__ import annotations

import io
import json
import re
from collections import defaultdict
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import torch

from attnlab.lab.bench.timing import BenchRow, machine_line

if TYPE_CHECKING:  # matplotlib is imported lazily: `attnlab` must import fast
    from matplotlib.figure import Figure

__all__ = ["FLOPS_NOTE", "SPARSE_FLOPS_NOTE", "LINEAR_FLOPS_NOTE", "RATIO_NOTE", "row_record", "bench_json", "bench_markdown",
           "case_family", "plot_rows", "figure_png"]

FLOPS_NOTE = ("forward 2*B*H*Tq*Tk*(D+Dv), halved for causal; backward 2.5x forward (docs/contract.md); "
              "modules add their projections; peak_fraction = GFLOP/s over the same-dtype matmul rate "
              "measured in the same rounds")
SPARSE_FLOPS_NOTE = "sparse rows count only the visible (query, key) pairs of their mask, not Tq*Tk"
LINEAR_FLOPS_NOTE = ("linear rows count the chunked form's matmuls at C=64 (attnlab._flops.linear_attention_flops), "
                     "whatever an implementation runs; their peak_fraction is over a (B*H, T, Dk) @ (Dk, Dv) matmul")
RATIO_NOTE = ("seconds over the fastest in the same case (modules: over the fastest non-attnlab module; "
              "decode-model: KV-cache tokens/s over the row's, the plain PyTorch loop's row noting GPT.generate's "
              "per-token ratio to it; overhead: attnlab's seconds over the plain "
              "PyTorch call's in the same case, compile rows compiled over eager; linear: over transformers' "
              "torch_chunk_gated_delta_rule in the same case)")

_T_IN_CASE = re.compile(r"\s*\bT[kq]?=\d+")


def row_record(row: BenchRow) -> dict[str, object]:
    """One row as a JSON-ready dict; figures a row does not have are ``None``.

    Example:
        >>> row_record(BenchRow("s", "c T=8", "auto", 0.5, 1e9, 1e10, 1.0, t=8))["peak_fraction"]
        0.2
    """
    return {
        "suite": row.suite, "case": row.case, "implementation": row.name, "T": row.t,
        "seconds": row.seconds, "flops": row.flops, "gflops": row.gflops,
        "matmul_gflops": None if row.peak is None else row.peak / 1e9,
        "peak_fraction": row.peak_fraction, "ratio": row.ratio, "note": row.note,
    }


def bench_json(rows: list[BenchRow], *, suite: str, quick: bool) -> str:
    """The rows of one ``attnlab bench`` run and a header, as indented JSON text.

    Args:
        rows: the run's rows (:func:`attnlab.lab.bench.run_suite`).
        suite: the suite that was run (or ``"all"``).
        quick: whether the run used the quick sizes.

    Example:
        >>> header = json.loads(bench_json([], suite="sparse", quick=True))["header"]
        >>> header["quick"], "visible" in header["sparse_flops"]
        (True, True)
    """
    header = {
        "machine": machine_line(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "suite": suite, "quick": quick,
        "flops": FLOPS_NOTE, "sparse_flops": SPARSE_FLOPS_NOTE,
        "linear_flops": LINEAR_FLOPS_NOTE, "ratio": RATIO_NOTE,
    }
    return json.dumps({"header": header, "rows": [row_record(row) for row in rows]}, indent=2) + "\n"


def bench_markdown(data: dict, *, command: str) -> str:
    """One ``attnlab bench`` run (its :func:`bench_json` data) as Markdown: a line naming the
    machine, torch, date and the command that reproduces it, then one table per suite with the
    columns the terminal table shows.

    Args:
        data: ``{"header": ..., "rows": [...]}`` as :func:`bench_json` writes it.
        command: the command line that produced the run, shown above the tables.

    Example:
        >>> data = json.loads(bench_json([BenchRow("sparse", "c T=8", "auto", 2e-3, 1e8, 1e11, 1.0, t=8)],
        ...                              suite="sparse", quick=True))
        >>> print(bench_markdown(data, command="attnlab bench --suite sparse").splitlines()[-1])
        | c T=8 | auto | 2.00 | 50.0 | 50.0% | 1.00 |  |
    """
    header = data["header"]
    lines = [f"Machine: {header['machine']}; {header['date'][:10]}; "
             f"{'quick sizes, one round; ' if header.get('quick') else ''}`{command}`"]
    suites: dict[str, list[dict]] = {}
    for row in data["rows"]:
        suites.setdefault(row["suite"], []).append(row)
    for suite, rows in suites.items():
        lines += ["", f"**{suite}**", "",
                  "| case | implementation | median ms | GFLOP/s | % of matmul | ratio | note |",
                  "|---|---|--:|--:|--:|--:|---|"]
        for row in rows:
            figures = [_figure(row["seconds"], 1e3, "{:.2f}" if (row["seconds"] or 1) >= 1e-3 else "{:.3f}"),
                       _figure(row["gflops"], 1, "{:.1f}"), _figure(row["peak_fraction"], 100, "{:.1f}%"),
                       _figure(row["ratio"], 1, "{:.2f}")]
            cells = [row["case"], row["implementation"], *figures, (row["note"] or "").replace("|", "\\|")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _figure(value: float | None, factor: float, form: str) -> str:
    return "-" if value is None else form.format(value * factor)


def case_family(case: str) -> str:
    """``case`` without its sequence length: the rows one plot draws against T.

    Example:
        >>> case_family("window 256 fwd T=2048"), case_family("decode Tk=64")
        ('window 256 fwd', 'decode')
    """
    return _T_IN_CASE.sub("", case).strip()


def _families(rows: list[BenchRow]) -> dict[str, dict[str, list[BenchRow]]]:
    """Timed rows with a T, as ``{"suite: family": {implementation: its rows sorted by T}}``."""
    grouped: dict[str, dict[str, list[BenchRow]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.t is not None and row.seconds is not None:
            family = case_family(row.case)
            grouped[row.suite if family == row.suite else f"{row.suite}: {family}"][row.name].append(row)
    return {family: {name: sorted(found, key=lambda r: r.t) for name, found in lines.items()}
            for family, lines in grouped.items()}


def plot_rows(rows: list[BenchRow], *, caption: str | None = None) -> Figure:
    """Median ms (log y) and GFLOP/s against T, one line per implementation, two panels per case family.

    Args:
        rows: bench rows; only those with a ``t`` and a time are drawn.
        caption: the title's second line (default: :func:`attnlab.lab.bench.timing.machine_line`).

    Returns:
        a matplotlib ``Figure`` (no pyplot state); row ``i`` of its axes is family ``i``, the
        time panel first. Each line's label is its implementation.

    Raises:
        ValueError: naming ``rows`` when none has both a sequence length and a time.

    Example:
        >>> fig = plot_rows([BenchRow("decode", f"decode Tk={t}", "auto", t * 1e-6, t * 1e3, t=t) for t in (8, 16)])
        >>> len(fig.axes), len(fig.axes[0].lines)
        (2, 1)
    """
    from matplotlib.figure import Figure

    families = _families(rows)
    if not families:
        raise ValueError("rows: none has both a sequence length (t) and a time to plot")
    fig = Figure(figsize=(12, 3.4 * len(families) + 0.6), layout="constrained")
    axes = fig.subplots(len(families), 2, squeeze=False)
    for (family, lines), (time_ax, rate_ax) in zip(families.items(), axes):
        for index, (name, found) in enumerate(lines.items()):
            ts, style = [row.t for row in found], dict(marker="o", label=name, color=f"C{index % 10}")
            time_ax.plot(ts, [row.seconds * 1e3 for row in found], **style)
            if all(row.gflops is not None for row in found):
                rate_ax.plot(ts, [row.gflops for row in found], **style)
        _label(time_ax, f"{family}: median time", "ms (log scale)", log=True)
        _label(rate_ax, f"{family}: GFLOP/s", "GFLOP/s", log=False)
        time_ax.legend(fontsize="small")
    caption = caption if caption is not None else f"machine: {machine_line()}"
    fig.suptitle(f"attnlab bench: time and GFLOP/s vs sequence length\n{caption}")
    return fig


def _label(ax, title: str, ylabel: str, *, log: bool) -> None:
    from matplotlib.ticker import ScalarFormatter

    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("T (sequence length; keys for a decoding step)")
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())  # 1024, not 2^10
    if log:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def figure_png(fig: Figure) -> bytes:
    """``fig`` rendered as PNG bytes (Agg), so that the file can be written atomically.

    Example:
        >>> from matplotlib.figure import Figure
        >>> figure_png(Figure(figsize=(1, 1)))[:8]
        b'\\x89PNG\\r\\n\\x1a\\n'
    """
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
