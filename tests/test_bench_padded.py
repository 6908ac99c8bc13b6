"""``attnlab bench --suite padded`` on tiny sizes: the harness (baselines, the same function in
every row of a case, the busy core), never the speed."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab import masks
from attnlab.lab.bench import padded, suites
from attnlab.lab.cli import app

runner = CliRunner()


@pytest.fixture
def quick_timing(monkeypatch):
    real = padded.compare
    monkeypatch.setattr(padded, "compare", lambda candidates, **kw: real(candidates, rounds=1, min_run_time=0.001))


def _cases(rows):
    found = {}
    for row in rows:
        found.setdefault(row.case, []).append(row)
    return found


def test_the_combined_mask_is_causal_and_padding():
    lengths = padded.spread_lengths(4, 40)
    assert lengths.tolist() == [8, 19, 29, 40]
    want = masks.causal_mask(40, 40) & masks.padding_mask(lengths, 40)[:, 0]  # (B, T, T)
    assert torch.equal(padded.combined_mask(lengths, 40)[:, 0], want)


def test_attention_rows_time_the_same_function_against_sdpa(quick_timing):
    rows = padded.attention_rows(64, rounds=1)
    cases = _cases(rows)
    assert sorted(cases) == ["causal+padding fwd T=64", "causal+padding fwd+bwd T=64"]
    for case, found in cases.items():
        baseline = [row for row in found if row.name == "SDPA, combined mask"]
        assert len(found) == 3 and baseline[0].ratio == 1.0
        for row in found:
            assert row.ratio == pytest.approx(row.seconds / baseline[0].seconds)
            if row is not baseline[0]:
                assert float(row.note.split()[-1]) < 1e-5, row.note


def test_training_rows_compare_twins_with_the_same_weights(quick_timing):
    rows = padded.training_rows(32, rounds=1)
    assert sorted(_cases(rows)) == ["GPT step T=32", "MultiHeadAttention step T=32"]
    for row in rows:
        if row.note:
            assert float(row.note.split()[-1]) < 1e-4, (row.name, row.note)


def test_structured_rows_time_idle_and_busy_and_stop_the_spinner(quick_timing, monkeypatch):
    spinners = []
    real_popen = padded.subprocess.Popen
    monkeypatch.setattr(padded.subprocess, "Popen", lambda *a, **kw: spinners.append(real_popen(*a, **kw)) or spinners[-1])

    class Eager:  # compiled FlexAttention's stand-in: same masks, no compile in a unit test
        def __init__(self, mask_mod, q_len, kv_len):
            self.mask = masks.materialize(mask_mod, tq=q_len, tk=kv_len)

        def __call__(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)

    monkeypatch.setattr(padded, "CompiledFlex", Eager)
    rows = padded.structured_rows((128,), 128, rounds=1)
    assert sorted(_cases(rows)) == sorted(
        f"{name} {what}" for name in ("packed 8 docs", "window 256")
        for what in ("fwd T=128 idle", "fwd T=128 busy core", "fwd+bwd T=128"))
    assert len(spinners) == 2 and all(spinner.poll() is not None for spinner in spinners)


def test_bad_parts_are_refused():
    with pytest.raises(ValueError, match="parts must be among"):
        padded.padded_suite(parts=())


def test_the_cli_runs_the_suite_and_writes_json(monkeypatch, tmp_path, quick_timing):
    asked = {}

    def shrunk(progress, **kw):
        asked.update(kw)
        progress("padded: tiny")
        return padded.attention_rows(32, rounds=1)

    monkeypatch.setattr(padded, "padded_suite", shrunk)
    monkeypatch.setattr(suites, "padded", padded)
    out = tmp_path / "padded.json"
    result = runner.invoke(app, ["bench", "--suite", "padded", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert asked == {"quick": True}
    document = json.loads(out.read_text())
    assert document["header"]["suite"] == "padded"
    assert {row["implementation"] for row in document["rows"]} == {
        "SDPA, combined mask", "attnlab, padding_mask + causal", "attnlab, padding_mod + causal"}


def test_the_suite_says_what_it_times_before_each_part(quick_timing):
    said = []
    rows = padded.padded_suite(parts=("attention", "training"), attention_lengths=(32,), training_lengths=(16,),
                               progress=said.append)
    assert said == ["padded: causal+padding attention, T=32", "padded: MultiHeadAttention and GPT training steps, T=16"]
    assert {row.case for row in rows} == {"causal+padding fwd T=32", "causal+padding fwd+bwd T=32",
                                          "MultiHeadAttention step T=16", "GPT step T=16"}
