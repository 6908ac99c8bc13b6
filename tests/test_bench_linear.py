"""``attnlab bench --suite linear`` at tiny sizes: the harness (the same problem to every row, the
ratio to transformers from the two timings, FLOPs from the stated convention, the decode rows),
never the speed."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from attnlab import linear
from attnlab._flops import LINEAR_CHUNK, linear_attention_flops
from attnlab.lab.bench import linear as bench_linear
from attnlab.lab.bench import suites
from attnlab.lab.cli import app
from attnlab.linear.reference import run_reference

runner = CliRunner()
pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.fixture
def quick_timing(monkeypatch):
    real = bench_linear.compare
    monkeypatch.setattr(bench_linear, "compare", lambda candidates, **kw: real(candidates, rounds=1, min_run_time=0.001))


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_rows_time_every_backend_beside_transformers_on_the_same_problem(quick_timing, mode):
    rows = bench_linear.gated_delta_rows(24, mode)
    by_name = {row.name: row for row in rows}
    backends = [f"attnlab {name}" for name in linear.BACKENDS if name != "reference"]
    assert sorted(by_name) == sorted([*backends, bench_linear.TRANSFORMERS])
    theirs = by_name[bench_linear.TRANSFORMERS]
    flops = linear_attention_flops(1, bench_linear.HEADS, 24, bench_linear.DIM, delta=True, mode=mode)
    for row in rows:
        assert row.case == f"gated delta {mode} T=24" and row.t == 24
        assert row.seconds > 0 and row.peak > 0 and row.flops == flops
        assert row.ratio == pytest.approx(row.seconds / theirs.seconds)  # computed from the two timings
        assert row.gflops == pytest.approx(flops / row.seconds / 1e9)
    for name in backends:  # the same inputs reached both: the outputs agree
        note = by_name[name].note
        assert float(note.split()[-1]) < 1e-5, note
        assert note.startswith(f"{theirs.seconds / by_name[name].seconds:.2f}x")


def test_a_registered_backend_is_timed_and_its_difference_shown(quick_timing, monkeypatch):
    def off(call):
        out, state = run_reference(call, dtype=call.state_dtype)
        return out + 0.5, state

    monkeypatch.setitem(linear.BACKENDS, "off-test", off)
    rows = {row.name: row for row in bench_linear.gated_delta_rows(16, "fwd")}
    assert rows["attnlab off-test"].seconds > 0
    assert float(rows["attnlab off-test"].note.split()[-1]) == pytest.approx(0.5, rel=1e-5)


def test_without_transformers_the_row_says_so(quick_timing, monkeypatch):
    monkeypatch.setattr(bench_linear, "transformers_rule", lambda: (None, "transformers' Qwen3-Next is not installed"))
    rows = bench_linear.gated_delta_rows(16, "fwd")
    missing = [row for row in rows if row.name == bench_linear.TRANSFORMERS]
    assert len(missing) == 1 and missing[0].seconds is None and "not installed" in missing[0].note
    assert all(row.ratio is None for row in rows)
    assert all(row.seconds > 0 for row in rows if row is not missing[0])


def test_the_recurrent_backend_is_left_out_above_its_length(quick_timing, monkeypatch):
    monkeypatch.setitem(bench_linear.RECURRENT_MAX, "fwd", 8)
    rows = {row.name: row for row in bench_linear.gated_delta_rows(16, "fwd")}
    assert rows["attnlab recurrent"].seconds is None and "not timed above T=8" in rows["attnlab recurrent"].note
    with pytest.raises(ValueError, match="mode must be one of"):
        bench_linear.gated_delta_rows(16, "bwd")


def test_decode_rows_keep_one_state_while_the_cache_grows(quick_timing, monkeypatch):
    threads, seen = torch.get_num_threads(), []
    real = bench_linear.compare
    monkeypatch.setattr(bench_linear, "compare", lambda candidates, **kw: seen.append(torch.get_num_threads())
                        or real(candidates, rounds=1, min_run_time=0.001))
    short, long = bench_linear.decode_rows(64), bench_linear.decode_rows(512)
    assert seen == [1, 1] and torch.get_num_threads() == threads  # timed on one thread, the count restored
    for rows, context in ((short, 64), (long, 512)):
        for row in rows:
            assert row.seconds > 0 and row.values["tokens/s"] == pytest.approx(1 / row.seconds) and row.t == context
    kept = {(row.name, row.t): row.values["state bytes"] for row in short + long}
    softmax = "softmax attention, KV cache"
    state = 4 * bench_linear.HEADS * bench_linear.DIM**2  # fp32 (B, H, Dk, Dv)
    assert kept[("attnlab recurrent, one step", 64)] == kept[("attnlab recurrent, one step", 512)] == state
    assert kept[(softmax, 512)] == 8 * kept[(softmax, 64)] == 8 * 2 * 4 * 64 * bench_linear.HEADS * bench_linear.DIM


def _chunked_form_flops(t: int, d: int, *, delta: bool) -> float:
    """FLOPs torch counts for the matmuls of the chunked form written out (one head), plus the
    triangular inverse's C³/3 multiply-adds per chunk (a solve, which torch does not count)."""
    c = LINEAR_CHUNK
    q, k, v = (torch.randn(t, d, dtype=torch.float64) for _ in range(3))
    beta = torch.rand(t, 1, dtype=torch.float64)
    state = torch.zeros(d, d, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        for s in range(0, t, c):
            Q, K, V, Bt = q[s:s + c], k[s:s + c], v[s:s + c], beta[s:s + c]
            if delta:
                T = torch.eye(c, dtype=torch.float64) + (Bt * (K @ K.T)).tril(-1)  # (I + A), inverted below
                W, U = T @ (Bt * K), T @ (Bt * V)  # (a product stands in for the solve: same shapes)
                V = U - W @ state
            out = (Q @ K.T).tril() @ V + Q @ state
            state = state + K.T @ V
    del out
    return counter.get_total_flops() + (t // c) * (2 * c**3 / 3 if delta else 0)


@pytest.mark.parametrize("delta", [False, True])
def test_the_flop_convention_counts_the_chunked_forms_matmuls(delta):
    t, d = 4 * LINEAR_CHUNK, 16
    assert linear_attention_flops(1, 1, t, d, delta=delta) == pytest.approx(_chunked_form_flops(t, d, delta=delta))
    assert linear_attention_flops(2, 3, t, d, delta=delta, mode="fwd+bwd") == pytest.approx(
        2 * 3 * 3.5 * _chunked_form_flops(t, d, delta=delta))
    with pytest.raises(ValueError, match="mode must be one of"):
        linear_attention_flops(1, 1, t, d, mode="both")


def test_the_cli_runs_the_suite_and_writes_json(monkeypatch, tmp_path, quick_timing):
    asked, real = {}, bench_linear.linear_suite

    def shrunk(progress, **kw):
        asked.update(kw)
        return real(lengths=(16,), contexts=(32,), rounds=1, progress=progress)

    monkeypatch.setattr(bench_linear, "linear_suite", shrunk)
    out = tmp_path / "linear.json"
    result = runner.invoke(app, ["bench", "--suite", "linear", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert asked == {"quick": True}
    assert "chunked form's matmuls at C=64" in result.output
    document = json.loads(out.read_text())
    assert document["header"]["suite"] == "linear" and "C=64" in document["header"]["linear_flops"]
    cases = {row["case"] for row in document["rows"]}
    assert cases == {"gated delta fwd T=16", "gated delta fwd+bwd T=16", "decode step, context 32"}
    assert "linear" in suites.SUITES
