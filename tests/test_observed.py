"""Which kernel ran (issue 33, item 5): a call under torch.profiler names the attnlab backend that
ran (the range dispatch opens only while a profiler is on) and PyTorch's kernel ops below it;
why(run=True) reports both beside its prediction and warns where they differ."""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import attnlab
from attnlab import functional, masks
from attnlab.backends import observed, why
from attnlab.backends.dispatch import clear_plans
from attnlab.backends.registry import get

verdicts = importlib.import_module("attnlab.backends.verdicts")  # (the package's `verdicts` is the function)
FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _qkv(t: int = 64, batch: int = 2):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, 2, t, 8, generator=gen) for _ in range(3))  # (B, H, T, D)


def _ops(ran: observed.Ran, backend: str | None) -> dict[str, int]:
    return {op: n for b, op, n in ran.kernels if b == backend}


@pytest.mark.parametrize("backend, want", [
    ("reference", {"aten::matmul": 2, "aten::softmax": 1}),  # the fp64 oracle's plain steps
    ("chunked", {"aten::matmul": 2, "aten::exp": 1}),        # its own tile (T=64 is one tile)
    ("blocks", {FLASH_CPU: 1}),                               # the dense kernel per block run
    ("sdpa", {FLASH_CPU: 1}),
])
def test_a_forced_backend_is_the_one_reported_with_its_kernels(backend, want):
    q, k, v = _qkv()
    clear_plans()
    for _ in range(2):  # a fresh route, then the remembered one (sdpa: its prepared run)
        out, ran = observed.observe(attnlab.attention, q, k, v, causal=True, backend=backend)
        assert ran.calls == ((backend, 1),) and _ops(ran, backend) == want, ran
        torch.testing.assert_close(out, attnlab.attention(q, k, v, causal=True, backend="reference"))


def test_sdpa_kernels_are_told_apart_flash_and_math():
    q, k, v = _qkv()
    _, flash = observed.observe(attnlab.attention, q, k, v)
    _, math = observed.observe(attnlab.attention, q, k, v, dropout_p=0.5)  # dropout: CPU runs math
    assert (flash.backend, flash.sdpa_kernel, math.backend, math.sdpa_kernel) == ("sdpa", "flash", "sdpa", "math")
    assert _ops(math, "sdpa") == {MATH: 1}  # the fallback's own matmuls and softmax are its parts


def test_a_padded_batch_runs_the_cpu_flash_kernel_once_per_band():
    q, k, v = _qkv(t=512)  # long enough for sdpa's segments path (segments_min_queries)
    pad = masks.padding_mask(torch.tensor([200, 512]), 512)  # (B, 1, 1, Tk)
    # Three bands: row 0's first 200 queries (causal over its 200 keys), its later queries (all
    # 200 keys, no causal part), row 1 (causal over every key): one kernel call each.
    _, ran = observed.observe(attnlab.attention, q, k, v, mask=pad, causal=True)
    assert ran.calls == (("sdpa", 1),) and _ops(ran, "sdpa") == {FLASH_CPU: 3}
    text = why(q, k, v, mask=pad, causal=True, run=True)
    assert f"flash kernel for CPU x3 [{FLASH_CPU}]" in text and "matches the prediction: 'sdpa'" in text


@pytest.mark.parametrize("options", [
    dict(causal=True),
    dict(mask=masks.sliding_window_mod(64, 64, 8)),
    dict(causal=True, score_mod=attnlab.scores.softcap(5.0)),
    dict(sinks=torch.zeros(2)),
    dict(causal=True, backend="blocks"),
    dict(mask=masks.padding_mask(torch.tensor([40, 64]), 64)),
], ids=["causal", "window_mod", "score_mod", "sinks", "blocks", "padded"])
def test_why_run_reports_what_attention_itself_runs(options):
    """why() walks attention's route steps itself (it sits below functional): both must agree."""
    q, k, v = _qkv()
    _, ran = observed.observe(attnlab.attention, q, k, v, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch warning
        text = why(q, k, v, run=True, **options)
    assert "\n".join(ran.lines()) in text and "matches the prediction" in text


def test_what_why_adds_is_its_own_lines_only():
    q, k, v = _qkv()
    plain = why(q, k, v, causal=True).splitlines()
    ran = why(q, k, v, causal=True, run=True).splitlines()
    assert ran[:len(plain)] == plain and [line.split(" ")[0] for line in ran[len(plain):]] == ["ran", "matches"]


def test_a_backend_mismatch_warns_and_says_so(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setattr(verdicts, "select", lambda call, name="auto": get("chunked"))  # a wrong prediction
    with pytest.warns(RuntimeWarning, match="predicted backend 'chunked', but 'sdpa' ran"):
        text = why(q, k, v, causal=True, run=True)
    assert text.splitlines()[-1] == "DIFFERS from the prediction: predicted backend 'chunked', but 'sdpa' ran"


def test_a_kernel_mismatch_warns(monkeypatch):
    q, k, v = _qkv()
    plan = verdicts.sdpa_plan
    monkeypatch.setattr(verdicts, "sdpa_plan", lambda call: dataclasses.replace(plan(call), kernel="efficient"))
    with pytest.warns(RuntimeWarning, match="predicted SDPA's efficient kernel, but its flash kernel ran"):
        why(q, k, v, run=True)


def test_no_profiler_is_left_running_after_an_exception():
    def fails(q):
        attnlab.attention(q, q, q)
        raise KeyError("inside the profiled call")

    with pytest.raises(KeyError):
        observed.observe(fails, _qkv()[0])
    assert not torch.autograd.profiler._is_profiler_enabled
    _, ran = observed.observe(attnlab.attention, *_qkv())  # a profiler starts again
    assert ran.backend == "sdpa"


def test_with_no_profiler_on_no_range_is_opened(monkeypatch):
    def refuse(*args):
        raise AssertionError("a range was opened with no profiler on")

    monkeypatch.setattr(functional, "labelled", refuse)
    q, k, v = _qkv()
    clear_plans()
    for backend in ("auto", "auto", "chunked"):  # fresh, remembered (prepared run), _run
        attnlab.attention(q, k, v, causal=True, backend=backend)
    attnlab.plan(q, k, v, causal=True)(q, k, v)


def test_under_compile_no_range_is_kept_and_a_profiler_causes_no_recompile():
    q, k, v = _qkv()
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attnlab.attention(q, k, v, causal=True), backend=counter, fullgraph=True)
    compiled(q, k, v)
    _, ran = observed.observe(compiled, q, k, v)
    compiled(q, k, v)
    assert counter.frame_count == 1  # the profiler flag is not read while compiling: no guard on it
    assert ran.backend is None and ran.sdpa_kernel == "flash" and ran.lines()[0].startswith("ran outside any")
    assert observed.mismatch(ran, "sdpa", "flash") is None  # nothing labelled: nothing to compare


# ------------------------------------------------------------------ the commands
def test_explain_prints_the_walks_kernel_beside_the_prediction(tmp_path):
    from typer.testing import CliRunner

    from attnlab.lab.cli import app

    result = CliRunner().invoke(app, ["explain", "--mode", "multihead", "--heads", "2", "--causal", "--d-kq", "4",
                                      "--d-v", "4", "--format", "png", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    section = result.output.split("Which kernel ran")[1].splitlines()[1:4]
    assert section[0].startswith("predicted: 'sdpa', chosen")
    assert section[1] == f"ran 'sdpa' (1 call): SDPA's flash kernel for CPU x1 [{FLASH_CPU}]"  # D == Dv: flash
    assert section[2] == "matches the prediction: 'sdpa', SDPA's flash kernel"


def test_the_walks_call_is_the_walks_computation_and_a_mismatch_warns(monkeypatch):
    from attnlab.lab.cli import _kernel
    from attnlab.lab.explain import trace

    result = trace("The chef made a meal", mode="multihead", heads=2, causal=True, sinks=0.5)
    q, k, v, options = _kernel.walk_call(result)
    out = attnlab.attention(q, k, v, backend="reference", **options)  # (1, H, T, Dv)
    torch.testing.assert_close(out[0].transpose(0, 1).flatten(1), result.output)  # the heads side by side
    chunked = [verdicts.Verdict("chunked", True, True, "linear", 0, 0.0, "stand-in")]
    monkeypatch.setattr(_kernel, "verdicts", lambda call: chunked)
    with pytest.warns(RuntimeWarning, match="predicted backend 'chunked', but 'sdpa' ran"):
        lines = _kernel.kernel_lines(q, k, v, options)
    assert lines[-1].startswith("DIFFERS from the prediction")


def test_backends_run_adds_what_ran_and_nothing_of_the_profiler_reaches_the_terminal():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("KINETO_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-m", "attnlab", "backends", "--tq", "64", "--causal", "--run"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [f"ran 'sdpa' (1 call): SDPA's flash kernel for CPU x1 [{FLASH_CPU}]",
                                             "matches the prediction: 'sdpa', SDPA's flash kernel"]
    assert "profiler" not in done.stderr and "USDT" not in done.stderr, done.stderr
