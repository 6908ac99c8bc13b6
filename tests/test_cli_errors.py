"""Every ``attnlab`` command refuses a bad command line with ONE ``error:`` line and exit 2.

No traceback, no usage block, no boxed panel: the line names the option that was wrong. The
cases run in-process through typer's CliRunner; one runs the real entry point in a subprocess to
show the same holds outside the runner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from attnlab.lab.cli import app

runner = CliRunner()
SRC = Path(__file__).resolve().parents[1] / "src"


def assert_one_error_line(result, *words: str, code: int = 2) -> str:
    """The run exited ``code`` after printing exactly one ``error:`` line that contains ``words``."""
    output = result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        f"escaped exception {result.exception!r}\n{output}"
    assert result.exit_code == code, output
    assert "Traceback" not in output and "\u256d" not in output and "Usage:" not in output, output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    for word in words:
        assert word in lines[0], output
    return lines[0]


@pytest.mark.parametrize("args, option", [
    (["--heads", "0"], "--heads"),
    (["--heads", "-1"], "--heads"),
    (["--d", "0"], "--d "),
    (["--tq", "-5"], "--tq"),
    (["--tk", "-5"], "--tk"),
    (["--batch", "0"], "--batch"),
    (["--kv-heads", "-1"], "--kv-heads"),
    (["--heads", "8", "--kv-heads", "3"], "--kv-heads"),
    (["--device", "foo"], "--device"),
    (["--dtype", "foo"], "--dtype"),
    (["--dropout", "1.5"], "--dropout"),
    (["--dropout", "-0.1"], "--dropout"),
    (["--dropout", "nan"], "--dropout"),
    (["--align", "sideways"], "--align"),
    (["--heads", "x"], "--heads"),
    (["--bogus"], "--bogus"),
    (["--memory-budget", "-1"], "--memory-budget"),
    (["--memory-budget", "nan"], "--memory-budget"),
    (["--memory-budget", "inf"], "--memory-budget"),
    (["--memory-budget", "lots"], "--memory-budget"),
    (["--memory-budget", "1e30"], "--memory-budget"),  # past int64 bytes: was a traceback
    (["--memory-budget", str(10**30)], "--memory-budget"),
    (["--memory-budget", str(2**42 + 1)], "--memory-budget"),
])
def test_backends_refuses_bad_options(args, option):
    assert_one_error_line(runner.invoke(app, ["backends", *args]), option)


@pytest.mark.parametrize("args, words", [
    # zero: the library refuses a window or chunk of 0 keys; 0 documents hold no position
    (["--window", "0"], ["--window must be a positive int, got 0"]),
    (["--chunk", "0"], ["--chunk must be a positive int, got 0"]),
    (["--documents", "0"], ["--documents must be a positive int, got 0"]),
    # negative
    (["--window", "-1"], ["--window", "-1"]), (["--chunk", "-4"], ["--chunk", "-4"]),
    (["--documents", "-2"], ["--documents", "-2"]), (["--prefix", "-1"], ["--prefix", "-1"]),
    # huge: past the key length (the sequence length for documents) a size means nothing more
    (["--window", "99999999999"], ["--window must be at most 1024", "99999999999"]),
    (["--chunk", str(2**70)], ["--chunk must be at most 2**62"]),  # past int64 before any size
    (["--prefix", "5000"], ["--prefix must be at most 1024"]),
    (["--tq", "100", "--tk", "50", "--window", "60"], ["--window must be at most 50"]),
    (["--documents", "5000"], ["--documents must be at most 1024"]),
    (["--tq", str(10**11)], [f"--tq {10**11}:", "would take about", "choose a smaller --tq"]),
    (["--d", str(10**9)], [f"--d {10**9}:", "choose a smaller --d"]),
    (["--batch", str(10**12)], [f"--batch {10**12}:", "choose a smaller --batch"]),
    (["--heads", str(10**8), "--tq", str(10**5)], [f"--heads {10**8}:", "choose a smaller --heads"]),
    (["--heads", "8", "--kv-heads", str(10**9)], ["--kv-heads"]),
    (["--tk", str(10**12)], [f"--tk {10**12}:", "choose a smaller --tk"]),
    # not an integer
    (["--window", "1.5"], ["--window"]), (["--prefix", "x"], ["--prefix"]), (["--documents", "2.5"], ["--documents"]),
    (["--chunk", ""], ["--chunk"]), (["--tq", "1e3"], ["--tq"]), (["--batch", "x"], ["--batch"]),
    # combinations
    (["--window", "4", "--chunk", "4"], ["at most one structured mask", "--window and --chunk"]),
    (["--padding", "--prefix", "0"], ["--padding cannot be combined with --prefix"]),
])
def test_backends_refuses_bad_mask_and_size_values_by_name(args, words):
    assert_one_error_line(runner.invoke(app, ["backends", *args]), *words)


def _explained(args):
    result = runner.invoke(app, ["backends", *args])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_backends_prefix_0_is_plain_causal_and_says_so():
    lines = _explained(["--prefix", "0", "--tq", "256"])
    assert "mask: --prefix 0: no prefix keys, so plain causal attention" in lines[1]
    causal = _explained(["--causal", "--tq", "256"])
    assert lines[2:] == causal[1:]  # the call and every backend's verdict: exactly those of causal=True
    assert "causal (top_left)" in lines[2] and "mask=none" in lines[2]


@pytest.mark.parametrize("option, value", [("--window", "64"), ("--documents", "4"), ("--prefix", "16"),
                                           ("--chunk", "128"), ("--prefix", "256")])
def test_backends_explains_the_masked_call_each_structured_option_asks_for(option, value):
    lines = _explained([option, value, "--tq", "256"])
    assert lines[1].startswith(f"mask: {option} {value}:")
    assert "mask=mod" in lines[2] and "causal" not in lines[2].split("mask=")[1]


def test_backends_refuses_cuda_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_error_line(runner.invoke(app, ["backends", "--device", "cuda"]), "--device",
                          "CUDA is not available here")


@pytest.mark.parametrize("args, option", [
    (["--backend", "foo"], "--backend"),
    (["--configs", "-1"], "--configs"),
    (["--quick", "--configs", "0"], "--configs"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**70)], "--seed"),
    (["--configs", "x"], "--configs"),
    (["--bogus"], "--bogus"),
])
def test_verify_refuses_bad_options(args, option):
    assert_one_error_line(runner.invoke(app, ["verify", *args]), option)


def test_verify_names_a_registered_backend_that_cannot_run_here(monkeypatch):
    from attnlab import backends

    monkeypatch.setattr(backends.get("flex"), "unavailable_reason", lambda: "no compiler here")
    assert_one_error_line(runner.invoke(app, ["verify", "--backend", "flex"]), "--backend", "no compiler here")


@pytest.mark.parametrize("args, option", [
    (["--suite", "foo"], "--suite"),
    (["--bogus"], "--bogus"),
])
def test_bench_refuses_bad_options(args, option):
    assert_one_error_line(runner.invoke(app, ["bench", *args]), option)


@pytest.mark.parametrize("args, word", [
    (["frobnicate"], "frobnicate"),
    (["--bogus"], "--bogus"),
])
def test_unknown_command_or_root_option_is_one_line(args, word):
    assert_one_error_line(runner.invoke(app, args), word)


@pytest.mark.parametrize("args, option, cap", [
    (["--d-model", "10000000"], "--d-model", "at most"),
    (["--d-kq", "10000000"], "--d-kq", "at most"),
    (["--d-v", "10000000"], "--d-v", "at most"),
    (["--mode", "multihead", "--heads", "100000"], "--heads", "at most"),
    (["--d-model", "0"], "--d-model", "positive"),
    (["--heads", "0"], "--heads", "positive"),
    (["--seed", str(2**70)], "--seed", "at most"),
    (["--seed", "-1"], "--seed", "non-negative"),
    (["--dropout", "1.5"], "--dropout", "[0, 1)"),
    (["--bogus"], "--bogus", "--bogus"),
])
def test_explain_bounds_its_sizes(args, option, cap, tmp_path):
    assert_one_error_line(runner.invoke(app, ["explain", *args, "--out", str(tmp_path)]), option, cap)


@pytest.mark.parametrize("error", [
    MemoryError(),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory"),
])
def test_out_of_memory_becomes_one_line(error, monkeypatch, tmp_path):
    import functools

    from attnlab.lab import explain

    @functools.wraps(explain.trace)  # its signature: the command reads the walk's defaults there
    def trace(*args, **kwargs):
        raise error

    monkeypatch.setattr(explain, "trace", trace)  # the command imports it when it runs
    assert_one_error_line(runner.invoke(app, ["explain", "--out", str(tmp_path)]), "out of memory",
                          "smaller sizes")


def test_other_runtime_errors_are_not_hidden(monkeypatch):
    """A bug is not a bad option: it must stay visible as an exception."""
    from attnlab.lab import bench

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(bench, "run_suite", broken)
    result = runner.invoke(app, ["bench", "--suite", "backends"])
    assert isinstance(result.exception, RuntimeError) and "a bug" in str(result.exception)


def test_ctrl_c_exits_130_with_one_line(monkeypatch):
    from attnlab.lab import bench

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_suite", interrupted)
    assert_one_error_line(runner.invoke(app, ["bench", "--suite", "backends"]), "interrupted", code=130)


def test_help_still_explains_itself():
    for args in ([], ["--help"], ["backends", "--help"], ["verify", "--help"], ["bench", "--help"],
                 ["explain", "--help"]):
        result = runner.invoke(app, args)
        assert "Usage:" in result.output and "error:" not in result.output, (args, result.output)
        assert result.exit_code == (2 if not args else 0), (args, result.output)


def test_real_entry_point_prints_one_line():
    """Outside CliRunner too: the console script's stderr is the one line, stdout is empty."""
    done = subprocess.run([sys.executable, "-m", "attnlab", "frobnicate"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and done.stderr.startswith("error: "), \
        done.stderr
    assert "frobnicate" in done.stderr


def test_backends_memory_budget_changes_the_choice_and_is_restored():
    from attnlab import backends

    before = backends.dispatch._BUDGET[0]
    roomy = runner.invoke(app, ["backends", "--tq", "64", "--window", "8"])
    tight = runner.invoke(app, ["backends", "--tq", "64", "--window", "8", "--memory-budget", "0"])
    assert roomy.exit_code == tight.exit_code == 0, (roomy.output, tight.output)
    assert "memory budget 64.0 MiB (default" in roomy.output
    assert "memory budget 0.0 MiB (set by" in tight.output and "sdpa: over the memory budget" in tight.output
    assert backends.dispatch._BUDGET[0] == before


@pytest.mark.parametrize("args, words", [
    (["--layer", "1"], ["--layer is for a trained model"]),
    (["--head", "0"], ["--head is for a trained model"]),
    (["--hide-special"], ["--hide-special is for a trained model"]),
    (["--truncate"], ["--truncate is for a trained model"]),
    (["--size", "64"], ["--size is for --mask"]),
    (["--model", "minilm", "--d-model", "8"], ["--d-model is for the tutorial walk"]),
    (["--model", "minilm", "--causal"], ["--causal is for the tutorial walk"]),
    (["--model", "minilm", "--seed", "5"], ["--seed is for the tutorial walk"]),
])
def test_explain_refuses_an_option_that_would_do_nothing(args, words, tmp_path):
    """Each of these was accepted and ignored (exit 0): an option is honoured or refused."""
    out = tmp_path / "out"
    assert_one_error_line(runner.invoke(app, ["explain", *args, "--out", str(out)]), *words)
    assert not out.exists()
