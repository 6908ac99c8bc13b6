"""benchmarks/bench_long_views.py builds a varied long text, not one word repeated."""

from __future__ import annotations

import importlib.util
import random
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_long_views.py"
WORDS = ["the", "chef", "made", "a", "meal", "and", "it", "was", "good", "wine", "with", "served"]  # _tiny_models'


def _bench():
    spec = importlib.util.spec_from_file_location("bench_long_views", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_long_text_is_varied_words_not_one_word_repeated():
    # Regression: the script seeded a fresh random.Random(n_tokens) per word, so every draw was the
    # same word: its "long text" was "the the the ..." and BENCHMARKS.md's figures were measured on it.
    bench = _bench()
    text = bench.long_text(12000, WORDS)
    seq = text.split()
    assert len(seq) == 12000 and set(seq) == set(WORDS)
    assert max(Counter(seq).values()) < 2 * 12000 / len(WORDS)
    assert len(set(zip(seq, seq[1:]))) == len(WORDS) ** 2  # every pair of words occurs somewhere
    bench.check_varied(text, WORDS)
    repeated = " ".join(random.Random(12000).choice(WORDS) for _ in range(12000))  # the old construction
    assert len(set(repeated.split())) == 1
    with pytest.raises(ValueError, match="not varied: 1 of 12 words"):
        bench.check_varied(repeated, WORDS)
