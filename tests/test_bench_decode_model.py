"""The ``decode-model`` bench suite at a tiny size: the token check and the ratio, no timing assertions."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from attnlab.lab.bench import suites
from attnlab.lab.bench.suites import GenerationTiming, decode_model_suite, report_generation
from attnlab.lab.cli import app
from attnlab.models import GPT

TINY = dict(layers=1, d_model=16, heads=2, vocab_size=32, prompt_len=8, new_tokens=5, rounds=1)


def test_tiny_suite_reports_identical_tokens_and_the_ratio_of_the_two_rates():
    timing = decode_model_suite(**TINY)
    assert timing.identical and timing.new_tokens == 5
    assert timing.cached_rate == pytest.approx(5 / timing.cached_seconds)
    assert timing.recompute_rate == pytest.approx(5 / timing.recompute_seconds)
    assert timing.speedup == pytest.approx(timing.cached_rate / timing.recompute_rate)
    cached, recompute, plain = timing.rows("case")
    assert (cached.name, recompute.name, plain.name) == ("KV cache", "recompute", "plain PyTorch loop")
    assert timing.plain_identical and timing.per_token_ratio > 0
    assert plain.ratio == pytest.approx(timing.cached_rate / (5 / timing.plain_seconds))
    assert f"per token {timing.per_token_ratio:.2f}x this loop's, tokens match" in plain.note
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


@pytest.mark.parametrize("options", [dict(positions="rope"), dict(num_kv_heads=1), dict(bias=False)],
                         ids=["rope", "mqa", "no_bias"])
def test_the_plain_loop_generates_the_models_tokens(options):
    """plain_generate reads the GPT's own weights and gives GPT.generate's greedy tokens (the
    suite's check) for rotary positions, grouped heads and no biases too."""
    torch.manual_seed(2)
    model = GPT(vocab_size=13, max_len=20, d_model=16, num_layers=2, num_heads=4, **options).eval()
    prompt = torch.randint(0, 13, (2, 9))
    assert torch.equal(suites.plain_generate(model, prompt, 8), model.generate(prompt, 8)[:, 9:])


def test_the_plain_loop_refuses_what_it_does_not_compute():
    model = GPT(vocab_size=13, max_len=20, d_model=16, num_layers=2, num_heads=4, layer_pattern="LG", window=4)
    with pytest.raises(ValueError, match="plain_generate serves G layers"):
        suites.plain_generate(model, torch.zeros(1, 3, dtype=torch.long), 2)


def test_the_suite_sees_when_the_plain_loop_disagrees(monkeypatch):
    real = suites.plain_generate
    monkeypatch.setattr(suites, "plain_generate", lambda model, prompt, n: (real(model, prompt, n) + 1) % 32)
    timing = decode_model_suite(**TINY)
    assert timing.identical and timing.plain_identical is False
    with pytest.raises(RuntimeError, match="GPT.generate and the plain PyTorch loop generated different"):
        report_generation(timing, console=Console(file=open("/dev/null", "w")))
