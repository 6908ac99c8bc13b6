"""``attnlab bench --json / --plot / --quick`` and the report helpers, on tiny sizes (the harness, not the speed)."""

from __future__ import annotations

import functools
import io
import json
import os

import pytest
from typer.testing import CliRunner

from attnlab.lab import bench
from attnlab.lab.bench import report, suites
from attnlab.lab.bench.timing import BenchRow, fill_ratios
from attnlab.lab.cli import app
from test_cli_errors import assert_one_error_line

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROW_FIELDS = {"suite", "case", "implementation", "T", "seconds", "flops", "gflops", "matmul_gflops",
              "peak_fraction", "ratio", "note"}


@pytest.fixture
def tiny(monkeypatch):
    """Real timing with a 64x64 matmul peak and ~1 ms per candidate; records what the CLI asked each suite."""
    asked: dict[str, dict] = {}
    real_compare = suites.compare
    monkeypatch.setattr(suites, "matmul_candidate", functools.partial(suites.matmul_candidate, n=64))
    monkeypatch.setattr(suites, "compare", lambda candidates, **kw: real_compare(
        candidates, rounds=1, min_run_time=0.001))
    for name, sizes in (("sparse_suite", dict(lengths=(64,))), ("decode_suite", dict(lengths=(16, 32)))):
        def shrunk(real=getattr(suites, name), name=name, sizes=sizes, **kw):
            asked[name] = kw
            return real(**kw, **sizes)
        monkeypatch.setattr(suites, name, shrunk)
    return asked


def _check_rows(document: dict, suite: str) -> None:
    header, rows = document["header"], document["rows"]
    assert {"machine", "torch", "date", "threads", "quick", "suite", "flops", "sparse_flops"} <= set(header)
    assert header["quick"] is True and header["suite"] == suite and "visible" in header["sparse_flops"]
    assert rows and all(set(row) == ROW_FIELDS and row["suite"] == suite for row in rows)
    for row in rows:
        assert row["gflops"] == pytest.approx(row["flops"] / row["seconds"] / 1e9)
        assert row["peak_fraction"] == pytest.approx(row["gflops"] / row["matmul_gflops"])
        assert f"T={row['T']}" in row["case"] or f"Tk={row['T']}" in row["case"]
    for case in {row["case"] for row in rows}:
        ratios = [row["ratio"] for row in rows if row["case"] == case]
        assert min(ratios) == 1.0 and all(r >= 1.0 for r in ratios), (case, ratios)


def test_sparse_quick_writes_json_with_a_header_and_consistent_rows(tiny, tmp_path):
    out = tmp_path / "sparse.json"
    result = runner.invoke(app, ["bench", "--suite", "sparse", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert tiny["sparse_suite"] == {"quick": True, "with_flex": False}
    document = json.loads(out.read_text())
    _check_rows(document, "sparse")
    assert {row["implementation"] for row in document["rows"]} >= {"auto", "sdpa dense mask"}
    assert [p.name for p in tmp_path.iterdir()] == ["sparse.json"]  # no temporary file left


def test_sparse_quick_markdown_holds_every_json_row_under_the_command(tiny, tmp_path):
    out, md = tmp_path / "sparse.json", tmp_path / "sparse.md"
    result = runner.invoke(app, ["bench", "--suite", "sparse", "--quick", "--json", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    rows, text = json.loads(out.read_text())["rows"], md.read_text()
    first, *rest = text.splitlines()
    assert "`attnlab bench --suite sparse --quick`" in first and "quick sizes" in first
    table = [line for line in rest if line.startswith("| ") and not line.startswith("| case")]
    assert len(table) == len(rows)
    for line, row in zip(table, rows):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[:2] == [row["case"], row["implementation"]]
        assert float(cells[2]) == pytest.approx(row["seconds"] * 1e3, rel=0.01, abs=0.006)
        assert float(cells[5]) == pytest.approx(row["ratio"], abs=0.006)


def test_decode_quick_json_to_stdout_and_plot(tiny, tmp_path):
    png = tmp_path / "decode.png"
    result = runner.invoke(app, ["bench", "--suite", "decode", "--quick", "--json", "-", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert tiny["decode_suite"] == {"quick": True}
    document = json.loads(result.stdout)  # the tables went to stderr
    _check_rows(document, "decode")
    assert sorted({row["T"] for row in document["rows"]}) == [16, 32]
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_decode_quick_uses_smaller_lengths_and_one_round(monkeypatch):
    calls = []
    monkeypatch.setattr(suites, "matmul_candidate", functools.partial(suites.matmul_candidate, n=8))
    monkeypatch.setattr(suites, "compare", lambda candidates, **kw: calls.append(kw) or dict.fromkeys(candidates, 1e-3))
    rows = suites.decode_suite(quick=True)
    assert sorted({row.t for row in rows}) == [64, 1024]
    assert all(kw["rounds"] == 1 for kw in calls)


def _rows() -> list[BenchRow]:
    """Two case families, three implementations, two lengths, plus rows a plot cannot draw."""
    rows = [BenchRow("backends", f"{case} T={t}", name, t * speed * 1e-6, t * 1e3, 1e11, t=t)
            for case in ("causal", "none") for t in (64, 128) for name, speed in (("a", 1), ("b", 2), ("c", 3))]
    rows.append(BenchRow("memory", "causal fwd+bwd T=64", "sdpa", None, note="peak 1 MiB", t=64))
    rows.append(BenchRow("decode-model", "32 new tokens", "KV cache", 1.0, ratio=1.0))
    return fill_ratios(rows)


def test_plot_has_two_panels_per_family_and_a_line_per_implementation():
    fig = report.plot_rows(_rows(), caption="machine: test")
    assert len(fig.axes) == 4  # 2 families x (time, GFLOP/s)
    for ax in fig.axes:
        assert sorted(line.get_label() for line in ax.lines) == ["a", "b", "c"]
        assert ax.get_xlabel().startswith("T") and ax.get_ylabel() and ax.get_title().startswith("backends: ")
    assert fig.axes[0].get_yscale() == "log" and "machine: test" in fig._suptitle.get_text()
    assert [list(line.get_xdata()) for line in fig.axes[0].lines] == [[64, 128]] * 3
    assert report.figure_png(fig)[:8] == PNG_MAGIC


def test_plot_refuses_rows_without_a_length_naming_the_argument():
    with pytest.raises(ValueError, match="rows"):
        report.plot_rows([BenchRow("memory", "m", "sdpa", None, t=64)])


def test_json_rows_keep_rows_without_figures_as_null():
    document = json.loads(report.bench_json(_rows(), suite="all", quick=False))
    memory = next(row for row in document["rows"] if row["suite"] == "memory")
    assert memory["seconds"] is None and memory["gflops"] is None and memory["note"] == "peak 1 MiB"
    assert document["header"]["quick"] is False and len(document["rows"]) == len(_rows())


@pytest.fixture
def must_not_run(monkeypatch):
    def run_suite(*args, **kwargs):
        raise AssertionError("the benchmarks ran before the paths were checked")
    monkeypatch.setattr(bench, "run_suite", run_suite)


@pytest.mark.parametrize("args, words", [
    (["--json", "{tmp}/missing/out.json"], ["--json", "does not exist"]),
    (["--json", "{tmp}"], ["--json", "folder"]),
    (["--json", "{tmp}/file.txt/out.json"], ["--json", "not a folder"]),
    (["--plot", "{tmp}/out.svg"], ["--plot", ".png"]),
    (["--plot", "{tmp}/missing/out.png"], ["--plot", "does not exist"]),
    (["--suite", "memory", "--plot", "{tmp}/out.png"], ["--plot", "memory"]),
    (["--markdown", "{tmp}/out.txt"], ["--markdown", ".md"]),
    (["--markdown", "{tmp}/missing/out.md"], ["--markdown", "does not exist"]),
    (["--markdown", "{tmp}/file.txt/out.md"], ["--markdown", "not a folder"]),
])
def test_bad_output_paths_are_refused_before_running(args, words, tmp_path, must_not_run):
    (tmp_path / "file.txt").write_text("")
    args = [arg.format(tmp=tmp_path) for arg in args]
    assert_one_error_line(runner.invoke(app, ["bench", *args]), *words)
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_with_flex_reaches_the_sparse_suite_and_nothing_else(monkeypatch, must_not_run):
    assert_one_error_line(runner.invoke(app, ["bench", "--suite", "decode", "--with-flex"]), "--with-flex", "decode")
    seen = []
    monkeypatch.setattr(bench, "run_suite", lambda name, **kw: seen.append((name, kw["with_flex"])) or [])
    assert runner.invoke(app, ["bench", "--suite", "sparse", "--with-flex"]).exit_code == 0
    assert runner.invoke(app, ["bench", "--suite", "sparse", "--quick"]).exit_code == 0
    assert seen == [("sparse", True), ("sparse", False)]


def test_a_failed_write_is_one_line_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "run_suite", lambda *a, **k: _rows())

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    out = tmp_path / "out.json"
    assert_one_error_line(runner.invoke(app, ["bench", "--json", str(out)]), "--json", "No space left")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, suite", [([], "backends"), (["--quick"], "all"),
                                         (["--quick", "--suite", "sparse"], "sparse")])
def test_quick_alone_runs_every_suite(args, suite, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run_suite", lambda name, **kw: seen.append((name, kw["quick"])) or [])
    assert runner.invoke(app, ["bench", *args]).exit_code == 0
    assert seen == [(suite, "--quick" in args)]


def test_run_suite_returns_the_modules_rows(monkeypatch):
    row = BenchRow("modules", "fwd T=8", "attnlab", 1.0, t=8)
    monkeypatch.setattr(suites, "run_modules_suite", lambda **kw: [row])
    assert suites.run_suite("modules", quick=True, console=_quiet()) == [row]


def _quiet():
    from rich.console import Console

    return Console(file=io.StringIO())
