"""Windowed and paged KV caches equal the full recomputation token for token; GPT layer patterns."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
import attnlab.nn.multihead as multihead
from attnlab.models import GPT
from attnlab.nn import BranchCache, KVCache, MultiHeadAttention, PagedKVCache, WindowedKVCache
from attnlab.nn.cache import _restore_on_error
from attnlab.nn import CallMask, QKV, Window
from attnlab.nn.multihead import pattern_of

F64 = torch.float64


def _mha(window=None, num_kv_heads=2, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(24, 24, num_heads=4, positions="rope", qkv=QKV(num_kv_heads=num_kv_heads, bias=True), pattern=Window(window) if window else "causal").double().eval()


def _naive_window(module, x, window):
    """Sliding-window attention written out: a (T, T) band mask, softmax per head."""
    q, k, v = module.project_qkv(x)
    q, k = module.rope(q), module.rope(k)
    rep = module.num_heads // module.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = x.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    band = (j <= i) & (j > i - window)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(module.head_dim)
    out = scores.masked_fill(~band, -math.inf).softmax(-1) @ v  # (B, H, T, hd)
    return module.out_proj(out.transpose(1, 2).reshape(x.shape[0], T, -1))


@pytest.mark.parametrize("chunks", [(5, 1), (3, 7)], ids=["prefill_then_steps", "chunks_longer_than_window"])
def test_windowed_cache_equals_full_window_attention_at_any_length(chunks):
    window, total = 4, 29
    module = _mha(window)
    x = torch.randn(2, total, 24, dtype=F64)
    with torch.no_grad():
        full = module(x)
        cache = module.new_cache(2, total)
        assert isinstance(cache, WindowedKVCache) and cache.window == window
        size = cache.nbytes
        first, step = chunks
        parts, t = [module(x[:, :first], cache=cache)], first
        while t < total:
            parts.append(module(x[:, t : t + step], cache=cache))
            t += step
    assert cache.length == total and cache.nbytes == size  # memory flat in the generated length
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(full, _naive_window(module, x, window), rtol=0, atol=1e-12)


@pytest.mark.parametrize("windowed", [True, False], ids=["ring", "contiguous"])
def test_window_decoding_step_reads_the_window_only_and_unmasked(monkeypatch, windowed):
    module, window = _mha(4), 4
    x = torch.randn(1, 12, 24, dtype=F64)
    cache = module.new_cache(1, 12, windowed=windowed)
    calls = []
    real = multihead.attention
    monkeypatch.setattr(module, "attention", lambda q, k, v, **kw: calls.append((k.shape[-2], kw["mask"]))
                        or real(q, k, v, **kw))
    with torch.no_grad():
        module(x[:, :11], cache=cache)
        calls.clear()
        step = module(x[:, 11:], cache=cache)
        seen = list(calls)
        full = module(x)
    assert seen == [(window, None)]  # no band to build or plan: sdpa's plain decoding call
    torch.testing.assert_close(step, full[:, 11:], rtol=0, atol=1e-12)


def test_windowed_cache_refuses_layers_it_cannot_serve_and_bad_windows():
    with pytest.raises(ValueError, match="window"):
        _mha()(torch.randn(1, 2, 24, dtype=F64), cache=WindowedKVCache(1, 2, 4, 6, dtype=F64))
    with pytest.raises(ValueError, match="window"):
        _mha(8)(torch.randn(1, 2, 24, dtype=F64), cache=WindowedKVCache(1, 2, 4, 6, dtype=F64))
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        WindowedKVCache(1, 1, 0, 2)
    with pytest.raises(ValueError, match="window must be a positive int"):
        MultiHeadAttention(8, 8, num_heads=2, pattern=Window(0))
    with pytest.raises(ValueError, match="causal=True"):
        pattern_of(False, 3)  # a block's causal=False with a window


def test_windowed_cache_failed_call_changes_nothing():
    module = _mha(3)
    cache = module.new_cache(1, 10)
    with torch.no_grad():
        module(torch.randn(1, 5, 24, dtype=F64), cache=cache)
        before = cache.keys.clone(), cache.values.clone()
        with pytest.raises(ValueError, match=r"a mask or padding \(padding_mask, CallMask\(padding=...\)\) goes with a KVCache"):
            module(torch.randn(1, 1, 24, dtype=F64), cache=cache, mask=CallMask(padding=torch.ones(1, 6, dtype=torch.bool)))
        with pytest.raises(RuntimeError, match="boom"):
            with multihead._restore_on_error([cache], 2):
                module(torch.randn(1, 2, 24, dtype=F64), cache=cache)
                raise RuntimeError("boom")
    assert cache.length == 5
    assert torch.equal(cache.keys, before[0]) and torch.equal(cache.values, before[1])


def test_paged_rows_of_different_lengths_equal_each_row_alone(monkeypatch):
    module, lengths, steps = _mha(), [7, 2, 12], 6
    xs = [torch.randn(1, n + steps, 24, dtype=F64) for n in lengths]
    cache = PagedKVCache(3, 2, 48, 6, page_size=4, dtype=F64)
    seen = []
    real = multihead.attention
    monkeypatch.setattr(module, "attention", lambda q, k, v, **kw: seen.append((k.shape[0], k.shape[-2]))
                        or real(q, k, v, **kw))
    with torch.no_grad():
        for b, n in enumerate(lengths):
            module(xs[b][:, :n], cache=cache.select([b]))
        seen.clear()
        paged = [module(torch.cat([x[:, n + s : n + s + 1] for x, n in zip(xs, lengths)]), cache=cache)
                 for s in range(steps)]  # each (3, 1, 24)
        calls = list(seen)
        alone = [module(x) for x in xs]
    assert calls == [(3, max(lengths) + s + 1) for s in range(steps)]  # one call per step for the whole batch
    for b, n in enumerate(lengths):
        got = torch.cat([step[b] for step in paged])  # (steps, 24)
        torch.testing.assert_close(got, alone[b][0, n:], rtol=0, atol=1e-12)
    assert cache.row_lengths == tuple(n + steps for n in lengths)
    assert [len(t) for t in cache.block_tables] == [math.ceil((n + steps) / 4) for n in lengths]


@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None)])
def test_lengths_mask_is_the_varlen_rule(causal, window):
    lengths, tq, tk = torch.tensor([7, 2, 12, 3]), 2, 12
    got = multihead.lengths_mask(lengths, tq=tq, tk=tk, causal=causal, window=window)
    if causal:
        mod = attnlab.masks.varlen_causal_mod(torch.full((4,), tq), lengths, window=window)
    else:
        mod = attnlab.masks.padding_mod(lengths)
    expected = attnlab.masks.materialize(mod, tq=tq, tk=tk, batch=4)
    assert torch.equal(got.expand_as(expected), expected)


def test_paged_batch_decodes_in_one_sdpa_call_reading_only_its_own_slots(monkeypatch):
    module, lengths = _mha(window=5), [7, 4, 12]  # rows 1 and 2 take a fresh page at the step
    xs = [torch.randn(1, n + 1, 24, dtype=F64) for n in lengths]
    cache = PagedKVCache(3, 2, 64, 6, page_size=4, dtype=F64)
    calls = []
    real = multihead.attention
    monkeypatch.setattr(module, "attention", lambda q, k, v, **kw: calls.append((q, k, v, kw)) or real(q, k, v, **kw))
    with torch.no_grad():
        for b, n in enumerate(lengths):
            module(xs[b][:, :n], cache=cache.select([b]))
        free = (torch.tensor(cache.pool.free)[:, None] * 4 + torch.arange(4)).flatten()  # slots of free pages
        cache.pool.keys[free], cache.pool.values[free] = math.nan, math.nan  # what a released row left there
        calls.clear()
        step = module(torch.cat([x[:, n:] for x, n in zip(xs, lengths)]), cache=cache)
        (q, k, v, options), = calls
        alone = [module(x)[0, -1] for x in xs]
    assert k.shape[:3] == (3, 2, max(lengths) + 1)
    assert "runs on 'sdpa'" in attnlab.backends.why(q, k, v, **options)
    torch.testing.assert_close(step[:, 0], torch.stack(alone), rtol=0, atol=1e-12)


def test_paged_pages_are_freed_and_reused_and_overflow_changes_nothing():
    cache = PagedKVCache(2, 1, 16, 2, page_size=4, dtype=F64)
    ones = lambda b, t: torch.ones(b, 1, t, 2, dtype=F64)  # noqa: E731
    cache.select([0]).update(ones(1, 9), ones(1, 9))  # 3 pages
    cache.select([1]).update(ones(1, 3), ones(1, 3))  # 1 page
    assert cache.block_tables == [[0, 1, 2], [3]] and cache.free_pages == 0
    pool, tables = cache.pool.keys.clone(), cache.block_tables
    with pytest.raises(ValueError, match="overflow.*0 free"):
        cache.update(ones(2, 2), ones(2, 2))  # row 1 fits its page, row 0 needs a 4th page
    assert cache.block_tables == tables and cache.row_lengths == (9, 3) and torch.equal(cache.pool.keys, pool)
    cache.release(0)
    assert cache.free_pages == 3 and cache.row_lengths == (0, 3)
    k = torch.arange(10.0, dtype=F64).view(1, 1, 5, 2)
    (got, _), = cache.select([1]).update(k, k)
    assert cache.block_tables[1] == [3, 0]  # the freed pages serve the other row
    torch.testing.assert_close(got[0, 0, 3:], k[0, 0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"capacity \(10\) must be a multiple of page_size \(4\)"):
        PagedKVCache(1, 1, 10, 2, page_size=4)
    with pytest.raises(ValueError, match="row must be below"):
        cache.select([2])


def test_paged_select_refuses_a_repeated_row():
    # A repeated row made two rows of the view one sequence: one update appended both rows' keys to it.
    cache = PagedKVCache(2, 1, 16, 2, page_size=4, dtype=F64)
    with pytest.raises(ValueError, match=r"rows must name at least one row and repeat none.*\[1, 1\]"):
        cache.select([1, 1])
    with pytest.raises(ValueError, match="repeat none"):
        cache.select(iter([0, 1, 0]))
    with pytest.raises(ValueError, match=r"rows must name at least one row.*\[\]"):
        cache.select([])
    for rows in (1, None, "01", torch.tensor([0, 1])):
        with pytest.raises(TypeError, match="rows must be a list of row indices"):
            cache.select(rows)
    assert cache.select([1, 0]).batch_size == 2 and cache.row_lengths == (0, 0)


def _gpt(**options):
    torch.manual_seed(0)
    config = dict(vocab_size=23, max_len=64, d_model=24, num_layers=3, num_heads=4, num_kv_heads=2)
    return GPT(**{**config, **options}).double().eval()


@pytest.mark.parametrize("options", [dict(), dict(positions="rope", layer_pattern="LGM", window=5, latent_dim=8)],
                         ids=["mha", "local_global_latent"])
def test_generate_ragged_prompts_paged_equals_each_alone(options):
    model = _gpt(**options)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 23, (n,), generator=gen) for n in (9, 1, 17, 4)]
    together = model.generate(prompts, 12, page_size=4)
    for prompt, sequence in zip(prompts, together):
        assert torch.equal(sequence, model.generate(prompt[None], 12)[0])


def test_ragged_paged_caches_hold_no_padding():
    model = _gpt(num_layers=2, layer_pattern="GM", latent_dim=8)
    lengths, page = (3, 11, 6), 4
    caches = model.new_cache(3, 16, page_size=page)
    with torch.no_grad():
        for b, n in enumerate(lengths):
            model(torch.randint(0, 23, (1, n)), caches=[c.select([b]) for c in caches])
        model(torch.randint(0, 23, (3, 1)), caches=caches)
    pages = sum(math.ceil((n + 1) / page) for n in lengths)
    mha, mla = caches
    assert mha.nbytes == pages * page * 2 * 2 * 6 * 8  # keys + values, 2 kv heads of 6, fp64
    assert mla.nbytes == pages * page * (8 + 2) * 8  # latent 8 + rope key 2, no values


def test_layer_pattern_tiles_and_local_layers_use_the_window():
    model = _gpt(num_layers=6, layer_pattern="LLG", window=3)
    assert model.layer_kinds == ("L", "L", "G", "L", "L", "G")
    assert [b.attn.window for b in model.blocks] == [3, 3, None, 3, 3, None]
    ids = torch.randint(0, 23, (2, 20))
    with torch.no_grad():
        logits = model(ids)
        caches = model.new_cache(2, 20)
        steps = [model(ids[:, :4], caches=caches)] + [model(ids[:, t : t + 1], caches=caches) for t in range(4, 20)]
    assert [type(c) for c in caches[:3]] == [WindowedKVCache, WindowedKVCache, KVCache]
    torch.testing.assert_close(torch.cat(steps, 1), logits, rtol=0, atol=1e-12)


def test_a_window_wider_than_max_len_does_not_size_the_cache():
    # Regression: window=10**9 sized each local layer's ring at 10**9 slots (generate asked for 64 GB).
    model = _gpt(max_len=16, layer_pattern="LG", window=10**9)
    assert [type(c) for c in model.new_cache(1)] == [KVCache] * 3  # layers L, G, L
    assert all(c.nbytes <= 16 * 2 * 2 * 6 * 8 for c in model.new_cache(1))  # max_len slots, k + v, fp64
    ids = torch.randint(0, 23, (1, 6))
    out = model.generate(ids, 10)
    assert torch.equal(out, model.generate(ids, 10, use_cache=False))
    mha = MultiHeadAttention(8, 8, num_heads=2, pattern=Window(16))
    assert type(mha.new_cache(1, 16)) is WindowedKVCache and mha.new_cache(1, 16).window == 16
    assert type(mha.new_cache(1, 15)) is KVCache and mha.new_cache(1, 15, windowed=True).window == 16


@pytest.mark.parametrize("options, match", [
    (dict(layer_pattern="LXG", window=2), "unknown 'X'"),
    (dict(layer_pattern="", window=2), "non-empty"),
    (dict(layer_pattern="LG"), "give window"),
    (dict(layer_pattern="LG", window=0), "window must be a positive int, got 0"),
    (dict(window=4), "window=4 is for L layers"),
    (dict(layer_pattern="M"), "give latent_dim"),
    (dict(layer_pattern=5), "layer_pattern must be a string"),
    (dict(layer_pattern="M", latent_dim=8, latent_rope_dim=3), "latent_rope_dim must be even.*got 3"),
    (dict(layer_pattern="M", latent_dim=8, latent_rope_dim=0), "latent_rope_dim must be a positive int"),
])
def test_bad_layer_patterns_are_one_clear_error(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _gpt(**options)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_packed_documents_equal_each_document_alone(positions):
    model = _gpt(positions=positions, layer_pattern="LGM", window=3, latent_dim=8)
    docs = [torch.randint(0, 23, (n,)) for n in (5, 8, 3)]
    ids = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])
    with torch.no_grad():
        packed = model(ids, document_ids=document_ids)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)


def test_mixed_model_saves_and_loads(tmp_path):
    model = _gpt(layer_pattern="LGM", window=4, latent_dim=8, latent_rope_dim=4)
    loaded = GPT.from_pretrained(model.save_pretrained(tmp_path)).double()
    ids = torch.randint(0, 23, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    assert loaded.layer_kinds == ("L", "G", "M") and loaded.blocks[2].attn.rope_dim == 4


def test_alibi_is_refused_where_keys_are_not_in_position_order():
    """ALiBi's distances index keys in position order: a paged or windowed cache, and GPT's
    local (windowed-cache) and latent layers, are refused by name, and the cache is unchanged."""
    from attnlab.models import GPT
    from attnlab.nn import MultiHeadAttention

    mha = MultiHeadAttention(8, 8, num_heads=2, positions="alibi")
    paged = mha.new_cache(1, 16, page_size=4)
    with pytest.raises(ValueError, match="positions='alibi' needs a KVCache"):
        mha(torch.randn(1, 3, 8), cache=paged)
    assert paged.row_lengths == (0,)
    kv = mha.new_cache(1, 16)
    full = mha(torch.randn(1, 5, 8))
    assert full.shape == (1, 5, 8) and kv.length == 0
    for options in (dict(layer_pattern="GL", window=4), dict(layer_pattern="GM", latent_dim=8, latent_rope_dim=4)):
        with pytest.raises(ValueError, match="positions='alibi'"):
            GPT(vocab_size=11, max_len=16, d_model=16, num_layers=2, num_heads=2, positions="alibi", **options)


def test_alibi_with_a_window_decodes_over_a_kv_cache_as_the_full_forward():
    """Regression: the window's key cut shifted ALiBi's distances; with a score mod every key stays."""
    from attnlab.nn import MultiHeadAttention

    torch.manual_seed(3)
    mha = MultiHeadAttention(8, 8, num_heads=2, positions="alibi", pattern=Window(3)).double().eval()
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    full = mha(x)
    cache = mha.new_cache(1, 16, windowed=False)
    steps = [mha(x[:, :5], cache=cache)] + [mha(x[:, t:t + 1], cache=cache) for t in range(5, 9)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-12)


# ------------------------------------------------------------------ BranchCache
def test_branch_cache_counts_positions_by_its_first_part_and_sums_bytes():
    keys, index = KVCache(2, 2, 6, 4), KVCache(2, 1, 6, 3, value_dim=0)
    cache = BranchCache(keys=keys, index=index)
    keys.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    assert cache.row_lengths == (3, 3) and cache.length == 3
    assert (cache.batch_size, cache.num_kv_heads, cache.head_dim) == (2, 2, 4)
    assert cache.nbytes == keys.nbytes + index.nbytes == 2 * 2 * 6 * 4 * 4 * 2 + 2 * 6 * 3 * 4
    with pytest.raises(ValueError, match="overflow"):
        cache.check_room(4)
    cache.reset()
    assert keys.length == index.length == 0


def test_branch_cache_restores_every_part_after_a_failing_call():
    keys, window = KVCache(1, 1, 8, 2), WindowedKVCache(1, 1, 2, 2)
    cache = BranchCache(keys=keys, window=window)
    for part in (keys, window):
        part.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    before = [t.clone() for t in (keys.keys, window.keys, window.values)]
    with pytest.raises(RuntimeError, match="boom"):
        with _restore_on_error([cache], 2):
            for part in (keys, window):
                part.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
            raise RuntimeError("boom")
    assert (keys.length, window.length) == (3, 3)
    for old, new in zip(before, (keys.keys, window.keys, window.values)):
        assert torch.equal(old, new)


def test_branch_cache_refuses_bad_parts_and_direct_writes():
    with pytest.raises(ValueError, match="at least one part"):
        BranchCache()
    with pytest.raises(TypeError, match="index"):
        BranchCache(keys=KVCache(1, 1, 4, 2), index="not a cache")
    with pytest.raises(ValueError, match="part 'index'"):
        BranchCache(keys=KVCache(1, 1, 4, 2), index=KVCache(2, 1, 4, 2))
    cache = BranchCache(keys=KVCache(1, 1, 4, 2))
    with pytest.raises(TypeError, match=r"cache\[name\]\.update"):
        cache.extend(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    with pytest.raises(KeyError, match="no part 'values'"):
        cache["values"]
