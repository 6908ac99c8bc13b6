"""``attnlab bench --suite overhead`` on tiny sizes: the harness, never the speed.

Every row holds both sides' medians and their quotient, the decode rows run on one thread and the
thread count comes back, a failing ``torch.compile`` and a token mismatch in the Llama rows are
reported in the row (injected here) instead of ending the suite, and the CLI writes the rows as JSON.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab.lab.bench import overhead
from attnlab.lab.bench.modules import ModulesConfig
from attnlab.lab.cli import app

runner = CliRunner()

TINY = overhead.OverheadSizes(
    batch=2, heads=2, head_dim=8, decode_lengths=(8, 16), prefill_lengths=(8,),
    llama=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2),
    llama_len=8, llama_new_tokens=3, module=ModulesConfig(batch=1, seq_len=8, d_model=16, num_heads=2),
    module_rounds=2, compile_len=8, rounds=2, min_run_time=0.001)

# decode: 2 per Tk; prefill: 1 per T; Llama: 2; MultiHeadAttention: 2; compile: 5
CASES = 2 * len(TINY.decode_lengths) + len(TINY.prefill_lengths) + 2 + 2 + 5


def _identity_compile(fn):
    """A "compiler" that returns the function: the success path without minutes of inductor."""
    return fn


@pytest.fixture
def two_threads():
    """Two threads during the test (so that the decode rows' one thread is told apart), then as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


@pytest.fixture
def tiny(monkeypatch):
    """The CLI's sizes shrunk to TINY (recording the quick flag asked for); compiling is the identity."""
    asked = []
    monkeypatch.setattr(overhead, "sizes_for", lambda *, quick: asked.append(quick) or TINY)
    monkeypatch.setattr(overhead, "_compile", _identity_compile)
    return asked


def test_cli_writes_the_overhead_rows_as_json_in_pairs_with_their_ratio(tiny, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "overhead.json"
    result = runner.invoke(app, ["bench", "--suite", "overhead", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert tiny == [True]
    assert "ratio = attnlab / plain" in result.output and "decode: B=2 H=2 D=8" in result.output
    document = json.loads(out.read_text())
    assert document["header"]["suite"] == "overhead" and document["header"]["quick"] is True
    rows = document["rows"]
    assert len(rows) == 2 * CASES and all(row["suite"] == "overhead" for row in rows)
    for ours, plain in zip(rows[::2], rows[1::2]):
        assert ours["case"] == plain["case"]
        assert ours["seconds"] > 0 and plain["seconds"] > 0, ours
        assert ours["ratio"] == pytest.approx(ours["seconds"] / plain["seconds"]) and plain["ratio"] == 1.0
        assert f"ratio over {plain['implementation']}" in ours["note"]
    notes = {row["case"]: row["note"] for row in rows[::2]}
    assert "identical tokens" in notes[f"tiny Llama generate 3, T={TINY.llama_len}"]
    assert all("compiles: ok; max |compiled - eager| 0.0e+00" in note
               for case, note in notes.items() if case.startswith("compile "))


def test_each_row_holds_both_timings_and_their_quotient_on_the_right_threads(tiny, two_threads, monkeypatch):
    threads_seen = []
    real_compare = overhead.compare

    def recording(candidates, **kwargs):
        threads_seen.append((next(iter(candidates)), torch.get_num_threads()))
        return real_compare(candidates, **kwargs)

    monkeypatch.setattr(overhead, "compare", recording)
    sizes = overhead.sizes_for(quick=False)
    rows = overhead.decode_rows(sizes) + overhead.prefill_rows(sizes) + overhead.module_rows(sizes) + \
        overhead.compile_rows(sizes)
    assert torch.get_num_threads() == two_threads  # restored after the decode rows' one thread
    for row in rows:
        assert row.seconds > 0 and row.baseline_seconds > 0
        assert row.ratio == row.seconds / row.baseline_seconds
        ours, plain = row.bench_rows()
        assert (ours.seconds, plain.seconds, ours.ratio, plain.ratio) == (
            row.seconds, row.baseline_seconds, row.ratio, 1.0)
    decode = 2 * len(sizes.decode_lengths)
    assert [threads for _, threads in threads_seen] == [1] * decode + [two_threads] * (len(rows) - decode)


def test_a_failing_compile_is_the_rows_note_not_an_exception(monkeypatch):
    def failing(fn):
        def compiled(*args):
            raise RuntimeError("Could not guard on data-dependent expression Eq(u0, 1)\nfrom user code: ...")
        return compiled

    monkeypatch.setattr(overhead, "_compile", failing)
    rows = overhead.compile_rows(TINY)
    assert [row.case.split(",")[0] for row in rows] == [f"compile {case}" for case in overhead.compile_cases(TINY)]
    for row in rows:
        assert (row.seconds, row.baseline_seconds, row.ratio) == (None, None, None)
        assert row.note == "fails: RuntimeError: Could not guard on data-dependent expression Eq(u0, 1)"

    def refusing(fn):
        raise TypeError("cannot compile this")

    monkeypatch.setattr(overhead, "_compile", refusing)
    assert {row.note for row in overhead.compile_rows(TINY)} == {"fails: TypeError: cannot compile this"}


def test_the_real_fullgraph_compile_of_a_causal_call_reports_ok_or_its_first_line(monkeypatch):
    """Whatever dynamo says about attnlab today, the row says it (dynamo only: no inductor build)."""
    monkeypatch.setattr(overhead, "_compile", lambda fn: torch.compile(fn, fullgraph=True, backend="eager"))
    row = overhead._compile_row("causal", dict(causal=True), TINY)
    if row.note.startswith("fails: "):
        assert "\n" not in row.note and row.ratio is None
    else:
        assert row.note.startswith("compiles: ok") and row.ratio > 0


def test_a_token_mismatch_in_the_llama_rows_is_reported(monkeypatch):
    pytest.importorskip("transformers")
    real = overhead._greedy

    def wrong_for_attnlab(model, ids, attention_mask, new_tokens):
        tokens = real(model, ids, attention_mask, new_tokens)
        if model.config._attn_implementation != overhead.LLAMA_BASELINE:
            tokens = tokens.clone()
            tokens[0, -1] += 1  # one wrong token
        return tokens

    monkeypatch.setattr(overhead, "_greedy", wrong_for_attnlab)
    forward, generate = overhead.llama_rows(TINY)
    assert generate.note == f"TOKENS DIFFER: 1 of {TINY.batch * TINY.llama_new_tokens} new tokens"
    assert generate.ratio == generate.seconds / generate.baseline_seconds
    assert forward.ratio == forward.seconds / forward.baseline_seconds


def test_the_token_note_tells_equal_different_and_misshapen_generations_apart():
    tokens = torch.tensor([[5, 6], [7, 8]])
    assert overhead._token_note(tokens, tokens.clone()) == "identical tokens"
    assert overhead._token_note(tokens + 1, tokens) == "TOKENS DIFFER: 4 of 4 new tokens"
    assert overhead._token_note(tokens[:, :1], tokens) == "TOKENS DIFFER: all of 4 new tokens"


def test_without_transformers_the_llama_rows_are_skipped_with_a_note(monkeypatch):
    from attnlab.integrations import transformers as integration

    def missing(*args, **kwargs):
        raise ImportError("register needs transformers 5.x (tested 5.23.0): pip install 'attnlab[hf]'")

    monkeypatch.setattr(integration, "register", missing)
    rows = overhead.llama_rows(TINY)
    assert len(rows) == 2
    for row in rows:
        assert (row.seconds, row.baseline_seconds, row.ratio) == (None, None, None)
        assert row.note.startswith("skipped: register needs transformers 5.x")


def test_the_left_padded_mask_is_causal_and_hides_each_rows_padding():
    mask = overhead._left_padded_mask(torch.tensor([4, 2]), 4)  # (B, 1, T, T)
    q_idx, kv_idx = torch.arange(4)[:, None], torch.arange(4)
    for b, length in enumerate((4, 2)):
        expected = (kv_idx <= q_idx) & (kv_idx >= 4 - length)
        assert torch.equal(mask[b, 0], expected)
