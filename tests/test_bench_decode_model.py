"""The ``decode-model`` bench suite at a tiny size: the token check and the ratio, no timing assertions."""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from attnlab.lab.bench import suites
from attnlab.lab.bench.suites import GenerationTiming, decode_model_suite, report_generation
from attnlab.lab.cli import app
from attnlab.models import GPT

TINY = dict(layers=1, d_model=16, heads=2, vocab_size=32, prompt_len=8, new_tokens=5)


def test_tiny_suite_reports_identical_tokens_and_the_ratio_of_the_two_rates():
    timing = decode_model_suite(**TINY)
    assert timing.identical and timing.new_tokens == 5
    assert timing.cached_rate == pytest.approx(5 / timing.cached_seconds)
    assert timing.recompute_rate == pytest.approx(5 / timing.recompute_seconds)
    assert timing.speedup == pytest.approx(timing.cached_rate / timing.recompute_rate)
    cached, recompute = timing.rows("case")
    assert (cached.name, recompute.name) == ("KV cache", "recompute")
    assert cached.ratio == pytest.approx(1.0)
    assert recompute.ratio == pytest.approx(timing.speedup)
    assert f"{timing.cached_rate:.1f} tokens/s" in cached.note


def test_the_suite_sees_when_the_two_runs_disagree(monkeypatch):
    real = GPT.generate

    def broken_recompute(self, input_ids, max_new_tokens, *, use_cache=True, **options):
        tokens = real(self, input_ids, max_new_tokens, use_cache=use_cache, **options)
        if not use_cache:
            tokens = tokens.clone()
            tokens[:, -1] = (tokens[:, -1] + 1) % self.config["vocab_size"]
        return tokens

    monkeypatch.setattr(GPT, "generate", broken_recompute)
    timing = decode_model_suite(**TINY)
    assert not timing.identical
    with pytest.raises(RuntimeError, match="different greedy tokens"):
        report_generation(timing, console=Console(file=open("/dev/null", "w")))


def test_the_ratio_follows_the_rates_not_the_order_of_the_rows():
    slow_cache = GenerationTiming(new_tokens=10, cached_seconds=2.0, recompute_seconds=1.0, identical=True)
    assert slow_cache.speedup == pytest.approx(0.5)
    assert [row.ratio for row in slow_cache.rows("c")] == pytest.approx([1.0, 0.5])


def test_bench_cli_runs_the_decode_model_suite(monkeypatch):
    seen = {}

    def tiny(**sizes):
        seen.update(sizes)
        return decode_model_suite(**TINY)

    monkeypatch.setattr(suites, "decode_model_suite", tiny)
    result = CliRunner().invoke(app, ["bench", "--suite", "decode-model", "--quick"])
    assert result.exit_code == 0, result.output
    assert "identical greedy tokens: yes" in result.output
    assert seen == {"prompt_len": 128, "new_tokens": 32}


@pytest.mark.parametrize("name", ["layers", "prompt_len", "new_tokens"])
def test_bad_sizes_name_the_argument(name):
    with pytest.raises(ValueError, match=name):
        decode_model_suite(**{**TINY, name: 0})
