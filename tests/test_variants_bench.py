"""`attnlab kv-memory` reproduces rasbt/LLMs-from-scratch ch04's figures; the variants suite, tiny."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import attnlab.lab.bench
from attnlab.lab.bench.variants import (VARIANTS, VariantRow, VariantSizes, kv_cache_bytes, plot_variants, tiny_corpus,
                                    variants_suite)
from attnlab.lab.cli import app
runner = CliRunner()


def assert_one_error_line(result, word: str) -> None:
    """Exit 2 after exactly one ``error:`` line naming ``word`` (the rule of tests/test_cli_errors.py)."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert word in lines[0] and "Traceback" not in result.output, result.output


def _figures(output: str) -> dict[str, str]:
    """Variant name -> its GB figure, from the command's lines."""
    rows = [line.split("  ") for line in output.splitlines()[1:]]
    return {cells[1].strip(): [c for c in cells if "GB" in c][0].strip() for cells in rows}


def test_kv_memory_reproduces_the_kv_sharing_figures():
    # ch04/10_kv-sharing: Gemma 4 E2B-like, 131k context, 37.58 GB MHA vs 2.01 GB GQA + sharing
    result = runner.invoke(app, ["kv-memory", "--layers", "35", "--heads", "8", "--kv-heads", "1", "--head-dim",
                                 "256", "--context", "131072", "--kv-layers", "15", "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    assert list(_figures(result.output).values()) == ["37.58 GB", "4.70 GB", "16.11 GB", "2.01 GB"]


def test_kv_memory_reproduces_the_mla_figures():
    # ch04/05_mla: 8k context, 48 layers, 24 heads (head_dim ceil(2048/24) = 86), latent 1024
    result = runner.invoke(app, ["kv-memory", "--layers", "48", "--heads", "24", "--kv-heads", "6", "--head-dim",
                                 "86", "--context", "8192", "--latent-dim", "1024"])
    assert result.exit_code == 0, result.output
    assert list(_figures(result.output).values()) == ["3.25 GB", "0.81 GB", "0.81 GB"]


def test_kv_cache_bytes_of_local_global_layers():
    # 5 local layers hold the window, 1 global layer the context: Gemma 3's pattern at 32k
    local, glob = 5 * 1024 * 2 * 4 * 128 * 2, 32768 * 2 * 4 * 128 * 2
    assert kv_cache_bytes(context=32768, layers=6, kv_heads=4, head_dim=128, pattern="LLLLLG", window=1024) \
        == local + glob


def test_kv_cache_bytes_of_chunked_nope_dsa_and_nsa_caches():
    per_token = 2 * 8 * 128 * 2  # a key and a value per KV head, bf16
    # Llama 4's pattern: three chunked-local layers hold their chunk, the NoPE layer the context
    assert kv_cache_bytes(context=131072, layers=48, kv_heads=8, head_dim=128, pattern="CCCN", chunk=8192) \
        == 12 * (3 * 8192 + 131072) * per_token
    # DSA: MLA's 576 numbers a token a layer, plus 128 fp8 index numbers
    assert kv_cache_bytes(context=4096, layers=61, pattern="M", latent_dim=512, rope_dim=64, index_dim=128) \
        == 61 * 4096 * (576 * 2 + 128)
    # NSA of block 64 (compressed blocks of 32 every 16, window 512): every key and value (selected),
    # the window's, the 32 of the block being compressed, and the 61 complete compressed blocks
    assert kv_cache_bytes(context=1000, layers=2, kv_heads=8, head_dim=128, pattern="S", nsa_block=64) \
        == 2 * (1000 + 512 + 32 + (1000 - 32) // 16 + 1) * per_token
    with pytest.raises(ValueError, match="nsa_block must be given"):
        kv_cache_bytes(context=10, layers=1, pattern="S")
    with pytest.raises(ValueError, match="chunk must be given"):
        kv_cache_bytes(context=10, layers=1, pattern="C")


def test_kv_memory_prints_the_2026_variants():
    result = runner.invoke(app, ["kv-memory", "--layers", "61", "--heads", "128", "--head-dim", "128", "--context",
                                 "131072", "--latent-dim", "512", "--latent-rope-dim", "64", "--index-dim", "128",
                                 "--kv-heads", "8", "--nsa-block", "64"])
    assert result.exit_code == 0, result.output
    figures = _figures(result.output)
    assert figures["DSA: MLA + 128 fp8 index numbers"] == "10.23 GB"
    nsa = 61 * (131072 + 512 + 32 + (131072 - 32) // 16 + 1) * 2 * 8 * 128 * 2  # block 64, 8 KV heads, bf16
    assert figures["NSA (block 64, 8 KV heads)"] == f"{nsa / 1e9:.2f} GB"
    result = runner.invoke(app, ["kv-memory", "--layers", "48", "--heads", "40", "--kv-heads", "8", "--head-dim",
                                 "128", "--context", "131072", "--layer-pattern", "CCCN", "--chunk", "8192"])
    assert _figures(result.output)["chunk 8192, pattern CCCN, 8 KV heads"] == "7.65 GB"


def test_kv_memory_prints_deepseek_v4s_compressed_layers():
    """V4-sized (head 512, window 128, 61 layers): CSA (V) and HCA (H) alternating at one rate, layer by
    layer against compressed_cache_bytes; a G layer beside them holds every token (and no index keys)."""
    from attnlab.nn.kv_memory import compressed_cache_bytes

    base = ["kv-memory", "--layers", "61", "--heads", "64", "--head-dim", "512", "--context", "1048576",
            "--kv-heads", "1", "--window", "128", "--compress-rate", "4"]
    layer = {kind: compressed_cache_bytes(context=2**20, head_dim=512, window=128, compress_rate=4, index_dim=index)
             for kind, index in (("V", 128), ("H", 0))}
    result = runner.invoke(app, [*base, "--layer-pattern", "VH", "--index-dim", "128"])
    assert result.exit_code == 0, result.output
    figures = _figures(result.output)
    assert figures["window 128, compress rate 4, pattern VH, 1 KV heads"] == f"{(31 * layer['V'] + 30 * layer['H']) / 1e9:,.2f} GB"
    result = runner.invoke(app, [*base, "--layer-pattern", "VG"])
    v_default = compressed_cache_bytes(context=2**20, head_dim=512, window=128, compress_rate=4, index_dim=512)
    assert _figures(result.output)["window 128, compress rate 4, pattern VG, 1 KV heads"] == \
        f"{(31 * v_default + 30 * 2**20 * 2 * 512 * 2) / 1e9:,.2f} GB"
    short = ["kv-memory", "--layers", "2", "--heads", "2", "--head-dim", "8", "--context", "16"]
    assert_one_error_line(runner.invoke(app, [*short, "--layer-pattern", "VH", "--window", "4"]), "--compress-rate")
    assert_one_error_line(runner.invoke(app, [*short, "--layer-pattern", "H", "--compress-rate", "4"]), "--window")
    assert_one_error_line(runner.invoke(app, [*short, "--compress-rate", "4"]), "--compress-rate 4 is for compressed")
    assert_one_error_line(runner.invoke(app, [*short, "--layer-pattern", "H", "--window", "4", "--compress-rate",
                                              "0"]), "--compress-rate")


@pytest.mark.parametrize("args, option", [
    (["--chunk", "8"], "--chunk 8 is for chunked-local layers"),
    (["--layer-pattern", "CN"], "give --chunk"),
    (["--chunk", "0", "--layer-pattern", "CN"], "--chunk"),
    (["--index-dim", "0"], "--index-dim"),
    (["--nsa-block", "-2"], "--nsa-block"),
    (["--nsa-block", "6"], "--nsa-block must be a multiple of 4"),
    (["--layers", "0"], "--layers"),
    (["--kv-heads", "3"], "--kv-heads"),
    (["--dtype", "fp64"], "--dtype"),
    (["--window", "0"], "--window"),
    (["--window", "8", "--layer-pattern", "LXG"], "--layer-pattern"),
    (["--layer-pattern", "LG"], "--window"),
    (["--kv-layers", "40"], "--kv-layers"),
    (["--latent-dim", "0"], "--latent-dim"),
    (["--latent-rope-dim", "-1"], "--latent-rope-dim"),
    (["--latent-rope-dim", "64"], "--latent-rope-dim 64 is for MLA: give --latent-dim"),  # was silently ignored
    (["--latent-rope-dim", "0"], "--latent-dim"),
    (["--latent-dim", str(2**40)], "--latent-dim must be at most"),
    (["--latent-dim", "8", "--latent-rope-dim", str(2**40)], "--latent-rope-dim must be at most"),
    (["--window", str(2**40)], "--window must be at most"),
    (["--context", "x"], "--context"),
])
def test_kv_memory_refuses_bad_options(args, option):
    base = {"--layers": "32", "--heads": "32", "--head-dim": "128", "--context": "1024"}
    given = dict(zip(args[::2], args[1::2]))
    line = [item for key, value in {**base, **given}.items() for item in (key, value)]
    assert_one_error_line(runner.invoke(app, ["kv-memory", *line]), option)


def test_bench_variants_plots_its_figures_as_bars(tmp_path, monkeypatch):
    found = [VariantRow(name, 100.0 * (i + 1), 90.0 * (i + 1), 2**20 * (i + 2), 50.0 + i, 3.0 - i / 10)
             for i, name in enumerate(VARIANTS)]
    monkeypatch.setattr(attnlab.lab.bench, "run_suite", lambda suite, **_: [row.bench_row() for row in found])
    target = tmp_path / "variants.png"
    result = runner.invoke(app, ["bench", "--suite", "variants", "--plot", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = plot_variants([row.bench_row() for row in found])
    kv, rate, peak, loss = fig.axes
    assert [tick.get_text() for tick in kv.get_xticklabels()] == list(VARIANTS)
    for ax, expected in ((kv, [r.kv_bytes_measured for r in found]), (rate, [r.tokens_per_s for r in found]),
                         (peak, [r.peak_bytes / 2**20 for r in found]), (loss, [r.held_out_loss for r in found])):
        assert [bar.get_height() for bar in ax.patches] == pytest.approx(expected)
    assert kv.collections[0].get_offsets()[:, 1].tolist() == pytest.approx([r.kv_bytes_formula for r in found])
    with pytest.raises(ValueError, match="rows: none is a row of the variants suite"):
        plot_variants([])


def test_variants_suite_tiny_measures_what_the_formula_says():
    sizes = VariantSizes(d_model=16, layers=2, heads=4, gqa_heads=2, window=4, latent_dim=4, rope_dim=2,
                         prompt_len=12, new_tokens=4, train_steps=1, batch_size=2, seq_len=16, corpus_sentences=40)
    rows = {row.name: row for row in variants_suite(sizes=sizes)}
    assert list(rows) == list(VARIANTS)
    for row in rows.values():
        assert row.kv_bytes_measured == row.kv_bytes_formula
        assert row.tokens_per_s > 0 and row.peak_bytes > 0 and row.held_out_loss > 0
    # fp32, per token over 16 positions: MHA 2 layers x 2 x 4 heads x 4; MLA 2 x (4 + 2); window 4 of 16
    assert rows["MHA"].kv_bytes_formula == 2 * 2 * 4 * 4 * 4
    assert rows["MLA"].kv_bytes_formula == 2 * 6 * 4
    assert rows["window"].kv_bytes_formula == rows["MHA"].kv_bytes_formula * 4 / 16
    # a chunked layer holds its chunk of 4, the NoPE layer every token; differential and gated layers
    # hold what their grouped-query layer holds
    mha_layer = rows["MHA"].kv_bytes_formula / 2
    assert rows["chunked/NoPE"].kv_bytes_formula == mha_layer * 4 / 16 + mha_layer
    assert rows["differential"].kv_bytes_formula == rows["gated"].kv_bytes_formula == rows["GQA"].kv_bytes_formula
    # a top-k layer holds the grouped-query layer's keys and values plus one index key of head_dim
    # (4) a token; NSA (block 4: window 32 > 16 tokens, compressed blocks of 2 every 1) holds each
    # branch's pairs: 16 selected + 16 window + 2 tail + 15 compressed, per 16 tokens
    assert rows["DSA top-k"].kv_bytes_formula == rows["GQA"].kv_bytes_formula + 2 * 4 * 4
    assert rows["NSA"].kv_bytes_formula == rows["GQA"].kv_bytes_formula * (16 + 16 + 2 + 15) / 16
    # recurrent layers: a state of 4 value heads of 4 x 4 (fp32) and a conv window of 3 x (2 x 2 x 4 + 4 x 4)
    # channels, per sequence: spread over 16 tokens; the hybrids add their attention layer's cache
    state = (4 * 4 * 4 + 3 * 32) * 4
    assert rows["Gated DeltaNet"].kv_bytes_formula == 2 * state / 16
    assert rows["Qwen3.5 hybrid"].kv_bytes_formula == state / 16 + rows["GQA"].kv_bytes_formula / 2
    kda_state = (4 * 4 * 4 + 3 * 48) * 4  # KDA's query/key heads are its 4 value heads: 3 x 4 x 4 channels
    assert rows["Kimi Linear hybrid"].kv_bytes_formula == kda_state / 16 + rows["MLA"].kv_bytes_formula / 2
    # DeepSeek-V4 (window 4, an entry per 4 tokens, head_dim 4, fp32): over 16 tokens each layer holds 3
    # window keys and 4 entries; CSA (V) also the closed window's first series and gates (2 x 4 x 4) and
    # its indexer's 4 keys and overlap (index_dim 4); HCA (H) nothing more (no token of an open window)
    csa, hca = (3 * 4 + 4 * 4 + 2 * 4 * 4) + (4 * 4 + 2 * 4 * 4), 3 * 4 + 4 * 4
    assert rows["DeepSeek-V4 CSA/HCA"].kv_bytes_formula == (csa + hca) * 4 / 16


def test_decoding_after_a_filled_context_reads_that_many_tokens():
    """The context rows fill every cache with ``context`` tokens (random keys, values and states) and
    decode after them: a softmax layer then holds context + steps keys, a recurrent layer the same bytes."""
    from attnlab.lab.bench.variants import ContextRow, _filled_caches, context_rates
    from attnlab.models import GPT
    from attnlab.nn.cache import RecurrentCache

    sizes = VariantSizes.for_run(quick=True)
    model = GPT(16, max_len=80, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, layer_pattern="RQ")
    caches = _filled_caches(model, 64, 4)
    assert [cache.length for cache in caches] == [64, 64]
    before = caches[0].nbytes
    model(torch.ones(1, 1, dtype=torch.long), caches=caches)
    assert [cache.length for cache in caches] == [65, 65] and caches[0].nbytes == before
    assert isinstance(caches[0], RecurrentCache)
    rows = context_rates(sizes, names=("MHA", "Gated DeltaNet"))
    assert [(r.name, r.context) for r in rows] == [(n, c) for n in ("MHA", "Gated DeltaNet") for c in sizes.contexts]
    assert all(isinstance(r, ContextRow) and r.tokens_per_s > 0 for r in rows)


def test_tiny_corpus_is_deterministic_and_repeats_its_names():
    text = tiny_corpus(3, seed=1)
    assert text == tiny_corpus(3, seed=1) and text != tiny_corpus(3, seed=2)
    first = text.split(". ")[0].split()
    assert f"{first[-1]} gave the" in text.split(". ")[1]


def test_a_hybrids_cache_is_the_attention_layers_kv_plus_a_constant_state_per_recurrent_layer():
    """The formula against the caches a GPT with R/K layers really allocates (fp32), at two contexts:
    the recurrent layers' bytes do not grow with the context."""
    from attnlab.models import GPT
    from attnlab.nn.kv_memory import recurrent_state_bytes

    for pattern in ("RRRG", "KKKG", "AAAG"):  # regression: kv-memory refused A (plain linear) layers
        gpt = GPT(vocab_size=8, max_len=256, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  layer_pattern=pattern)
        state = recurrent_state_bytes(value_heads=4, key_heads=2, head_dim=8, dtype_bytes=4)
        for context in (64, 256):
            held = sum(cache.nbytes for cache in gpt.new_cache(1, context))
            assert held == kv_cache_bytes(context=context, layers=4, kv_heads=2, head_dim=8, dtype_bytes=4,
                                          pattern=pattern, linear_state=state), (pattern, context)
        recurrent = [c.nbytes for c, kind in zip(gpt.new_cache(1, 256), gpt.layer_kinds) if kind in "RKA"]
        assert recurrent == [state] * 3 and state == sum(c.nbytes for c in gpt.new_cache(1, 64)[:1])
    with pytest.raises(ValueError, match="linear_state must be given"):
        kv_cache_bytes(context=8, layers=2, pattern="RG")


def test_kv_memory_prints_a_hybrid_row_and_refuses_missing_or_stray_linear_options():
    from attnlab.nn.kv_memory import recurrent_state_bytes

    result = runner.invoke(app, ["kv-memory", "--layers", "48", "--heads", "16", "--kv-heads", "2", "--head-dim",
                                 "256", "--context", "262144", "--layer-pattern", "RRRG", "--linear-heads", "32",
                                 "--linear-key-heads", "16", "--linear-head-dim", "128"])
    assert result.exit_code == 0, result.output
    state = recurrent_state_bytes(value_heads=32, key_heads=16, head_dim=128)  # Qwen3.5-sized, bf16: 2 MiB
    hybrid = 36 * state + 12 * 262144 * 2 * 2 * 256 * 2
    assert _figures(result.output)["pattern RRRG, 32 linear heads of 128, 2 KV heads"] == f"{hybrid / 1e9:,.2f} GB"
    plain = runner.invoke(app, ["kv-memory", "--layers", "48", "--heads", "16", "--kv-heads", "2", "--head-dim", "256",
                                "--context", "262144", "--layer-pattern", "AAAG", "--linear-heads", "32",
                                "--linear-key-heads", "16", "--linear-head-dim", "128"])
    assert _figures(plain.output)["pattern AAAG, 32 linear heads of 128, 2 KV heads"] == f"{hybrid / 1e9:,.2f} GB"
    base = ["kv-memory", "--layers", "4", "--heads", "4", "--head-dim", "8", "--context", "16"]
    assert_one_error_line(runner.invoke(app, base + ["--layer-pattern", "RG"]), "--linear-heads")
    assert_one_error_line(runner.invoke(app, base + ["--linear-heads", "2"]), "--layer-pattern")
    assert_one_error_line(runner.invoke(app, base + ["--layer-pattern", "KG", "--linear-heads", "4",
                                                     "--linear-key-heads", "3"]), "--linear-key-heads")
    assert_one_error_line(runner.invoke(app, base + ["--layer-pattern", "RG", "--linear-heads", "0"]),
                          "--linear-heads")
