"""Context-parallel attention on 2 and 4 local gloo processes against one process.

The jobs live in ``_distributed_jobs.py`` (spawned processes import them by name). Each
spawn costs a few seconds of start-up, so one spawn runs many cases.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.distributed import (ContextParallel, ShardedAttention, context_parallel, context_parallel_attention,
                                 layout as _layout)
from attnlab.distributed.launch import run_local
from attnlab.distributed.balance import balanced_layout, visited_pairs
from attnlab.distributed.ring import _plan_ring, ring_pieces, ring_plan
from attnlab.distributed.ulysses import HeadShiftedMod

import _distributed_jobs as jobs

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def _values(outcomes):
    failed = [f"rank {o.rank}: {o.error}\n{o.trace}" for o in outcomes if not o.ok]
    assert not failed, "\n".join(failed)
    return [o.value for o in outcomes]


# ----------------------------------------------------------------------------- layout, no processes
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_positions_partition_the_sequence_in_increasing_order(layout, world):
    T = 24
    parts = [_layout.positions(T, layout=layout, rank=r, world=world) for r in range(world)]
    assert sorted(torch.cat(parts).tolist()) == list(range(T))
    assert all(bool((p[1:] > p[:-1]).all()) for p in parts)  # local order is global order
    x = torch.arange(T) * 10
    rank_major = _layout.to_rank_major(x, dim=0, layout=layout, world=world)
    assert torch.equal(rank_major, torch.cat([x[p] for p in parts]))
    assert torch.equal(_layout.to_global_order(rank_major, dim=0, layout=layout, world=world), x)


def test_lengths_that_do_not_divide_are_refused_with_the_multiple():
    with pytest.raises(ValueError, match="multiple of 2 \\* world = 8"):
        _layout.check_length(12, layout="zigzag", world=4)
    with pytest.raises(ValueError, match="multiple of world = 4"):
        _layout.check_length(10, layout="contiguous", world=4)
    with pytest.raises(ValueError, match="layout"):
        _layout.chunk_ids("spiral", rank=0, world=2)
    with pytest.raises(ValueError, match="rank must be in"):
        _layout.chunk_ids("zigzag", rank=2, world=2)


def _covered(rank, world, layout, causal, chunk):
    """The (global query, global key) pairs rank ``rank`` computes over a whole ring, counted."""
    T = chunk * world * (2 if layout == "zigzag" else 1)
    count = torch.zeros(T, T, dtype=torch.int64)
    q_pos = _layout.positions(T, layout=layout, rank=rank, world=world)
    for source in range(world):
        k_pos = _layout.positions(T, layout=layout, rank=source, world=world)
        for rows, cols, diag in ring_pieces(rank=rank, source=source, world=world, layout=layout,
                                            causal=causal, chunk=chunk):
            block = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.int64)
            if diag:
                block = block.tril()
            count[q_pos[rows].unsqueeze(1), k_pos[cols].unsqueeze(0)] += block
    return count, q_pos


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_pieces_cover_exactly_the_mask_once(layout, causal, world):
    chunk = 3
    T = chunk * world * (2 if layout == "zigzag" else 1)
    full = torch.zeros(T, T, dtype=torch.int64)
    for rank in range(world):
        count, q_pos = _covered(rank, world, layout, causal, chunk)
        assert count[q_pos].sum() == count.sum()  # a rank computes only its own query rows
        full += count
    wanted = torch.ones(T, T, dtype=torch.int64)
    assert torch.equal(full, wanted.tril() if causal else wanted)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work_and_contiguous_does_not(world):
    work = {lay: [int(_covered(r, world, lay, True, 4)[0].sum()) for r in range(world)]
            for lay in ("zigzag", "contiguous")}
    assert len(set(work["zigzag"])) == 1
    assert work["contiguous"] == sorted(work["contiguous"]) and work["contiguous"][0] < work["contiguous"][-1]


def _ring_masks(T):
    ids = jobs.document_ids(T)
    return {
        "documents": (masks.document_mod(ids), 1),
        "window-narrow": (masks.sliding_window_mod(T, T, 3), 1),
        "window-wide": (masks.sliding_window_mod(T, T, 2 * T + 1), 1),
        "prefix": (masks.prefix_lm_mod(T, T, T // 2 + 1), 1),
        "varlen": (masks.varlen_causal_mod(torch.tensor([T, T // 2 + 1]), torch.tensor([T, T // 2 + 1])), 2),
        "documents-not-causal": (masks.document_mod(ids, causal=False), 1),
    }


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "balanced"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_masked_ring_pieces_cover_exactly_the_mask_once(layout, world):
    """Every rank's per-shard masks, put back at global positions, add up to the global mask:
    each allowed pair once, nothing else; the plan's pair counts are the masks' own."""
    T = 8 * world
    for name, (mod, batch) in _ring_masks(T).items():
        lay = balanced_layout(mod, length=T, world=world, chunks_per_rank=2, batch=batch) if layout == "balanced" else layout
        full = torch.zeros(batch, T, T, dtype=torch.int64)
        pos = [_layout.positions(T, layout=lay, rank=r, world=world) for r in range(world)]
        for rank in range(world):
            plan, pieces = _plan_ring(rank=rank, world=world, layout=lay, length=T, causal=False, mask=mod,
                                      batch=batch)
            for source, work in pieces.items():
                for rows, cols, _, local, pairs in work:
                    seen = masks.materialize(local, tq=T // world, tk=T // world, batch=batch)[:, 0].long()
                    assert int(seen.sum()) == pairs == plan.pairs[rank][source], name
                    full[:, pos[rank].view(-1, 1), pos[source].view(1, -1)] += seen
            assert all(plan.pairs[rank][s] == 0 for s in range(world) if s not in pieces or not pieces[s])
        want = masks.materialize(mod, tq=T, tk=T, batch=batch)[:, 0].long()
        assert torch.equal(full, want), (name, layout, world)


def test_a_window_narrower_than_a_shard_sends_one_hop_and_skips_the_rest():
    T = 32
    narrow = ring_plan(world=4, layout="contiguous", length=T, mask=masks.sliding_window_mod(T, T, 3))
    assert narrow.hops == (1, 1, 1, 0) and narrow.steps == 2 and narrow.sends == 3 and narrow.skipped == 9
    assert "rank 3 computes shard 2" in narrow.describe() and "9 of 12 key/value sends skipped" in narrow.describe()
    wide = ring_plan(world=4, layout="contiguous", length=T, mask=masks.sliding_window_mod(T, T, 2 * T))
    assert wide.hops == (3, 2, 1, 0)  # causal on contiguous shards: the last shard is never needed
    full = ring_plan(world=4, layout="zigzag", length=T, causal=True)
    assert full.hops == (3, 3, 3, 3) and full.skipped == 0
    docs = ring_plan(world=4, layout="contiguous", length=T,
                     mask=masks.document_mod(torch.repeat_interleave(torch.arange(4), 8)))
    assert docs.steps == 1 and docs.sends == 0  # one document per rank: nothing travels


def _random_documents(seed: int, T: int, count: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(T - 1, generator=g)[:count - 1] + 1).values.tolist()
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, T])]
    return torch.repeat_interleave(torch.arange(count), torch.tensor(lengths))


@pytest.mark.parametrize("seed", range(6))
def test_balanced_layout_evens_the_work_of_eight_random_documents_on_four_ranks(seed):
    """The acceptance bound: the most loaded rank visits <= 1.15x the mean (query, key) pairs."""
    T, world = 2048, 4
    mod = masks.document_mod(_random_documents(seed, T))
    before = visited_pairs(mod, length=T, layout="zigzag", world=world)
    layout = balanced_layout(mod, length=T, world=world)
    after = visited_pairs(mod, length=T, layout=layout, world=world)
    assert sum(after) == sum(before) == int(materialize_count(mod, T))  # the same work, dealt anew
    assert max(after) <= 1.15 * sum(after) / world, (before, after)
    assert max(after) <= max(before)


def materialize_count(mod, T):
    return masks.materialize(mod, tq=T, tk=T).sum()


def test_zigzag_is_unbalanced_for_documents_and_chunk_layouts_check_themselves():
    ratios = []
    for seed in range(6):
        mod = masks.document_mod(_random_documents(seed, 2048))
        before = visited_pairs(mod, length=2048, layout="zigzag", world=4)
        ratios.append(max(before) / (sum(before) / 4))
    assert max(ratios) > 1.5  # what balancing is for
    with pytest.raises(ValueError, match="ChunkLayout"):
        _layout.ChunkLayout(((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="for 2 ranks"):
        _layout.positions(16, layout=_layout.ChunkLayout(((0, 3), (1, 2))), rank=0, world=4)


def test_head_shifted_mod_keeps_bounds_and_shifts_heads():
    window = masks.sliding_window_mod(16, 16, window=4)
    shifted = HeadShiftedMod(window, offset=3)
    assert shifted.kv_bounds(8, 12) == window.kv_bounds(8, 12)
    seen = []
    probe = HeadShiftedMod(lambda b, h, q, k: seen.append(int(h)) or (k <= q), offset=2)
    masks.materialize(probe, tq=2, tk=2, heads=1)
    assert seen and all(h == 2 for h in seen)


def test_context_parallel_setting_checks_its_options():
    with pytest.raises(ValueError, match="method"):
        ContextParallel(method="allgather")
    with pytest.raises(ValueError, match="layout"):
        ContextParallel(layout="spiral")
    with pytest.raises(ValueError, match="ulysses"):
        ContextParallel(method="hybrid")
    with pytest.raises(ValueError, match="ulysses"):
        ContextParallel(method="ring", ulysses=2)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ring,ulysses", [(1, 2), (2, 2), (2, 3), (3, 2)])
def test_hybrid_layout_gives_each_ulysses_group_its_ring_shard_in_order(layout, ring, ulysses):
    """The all-to-all inside a group concatenates its ranks' tokens: that must be the ring
    shard ``layout`` gives the group's ring position, in increasing order."""
    world, T = ring * ulysses, 4 * ring * ulysses
    hybrid = _layout.hybrid_layout(layout, ring=ring, ulysses=ulysses)
    for j in range(ring):
        group = torch.cat([_layout.positions(T, layout=hybrid, rank=j * ulysses + u, world=world)
                           for u in range(ulysses)])
        assert torch.equal(group, _layout.positions(T, layout=layout, rank=j, world=ring))


def test_calls_without_a_process_group_say_how_to_start_one():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ContextParallel().attention(x, x, x)


# ----------------------------------------------------------------------------- processes
ALL_METHODS = ("ring", "ulysses", "hybrid")  # hybrid: Ulysses groups of 2 (at world 2, a ring of one)


@pytest.fixture(scope="module")
def two_ranks():
    return _values(run_local(jobs.conformance, world=2, args=(list(jobs.CASES), ALL_METHODS), timeout=120))


@pytest.fixture(scope="module")
def three_ranks():
    return _values(run_local(jobs.conformance, world=3, args=(list(jobs.MASKED_CASES), ("ring",)), timeout=120))


@pytest.mark.parametrize("name", list(jobs.MASKED_CASES))
def test_three_ranks_match_one_process_with_masks(three_ranks, name):
    for i, (error, limit) in enumerate(three_ranks[0][name]["checks"]):
        assert error <= limit, f"{name}: {('out', 'dq', 'dk', 'dv', 'dsinks')[i]} error {error:.2e} > {limit:.2e}"


def test_a_narrow_window_sends_only_what_the_next_rank_reaches(four_ranks):
    """Contiguous shards of 8, window 3, P=4: shard s goes one hop (forward, backward) and its
    gradient accumulator comes home; rank 3's shard never leaves it. fp64, B=1, Hkv=2, D=Dv=8."""
    shard = 2 * 8 * (8 + 8) * 8  # k and v (or dk and dv) of one rank
    sent = [r["ring-contiguous-window-narrow-fp64"]["bytes"] for r in four_ranks]
    assert sent == [3 * shard, 4 * shard, 4 * shard, shard], sent  # a full ring: 10 * shard each
    assert [r["ring-contiguous-window-narrow-fp64"]["skipped"] for r in four_ranks] == [4, 4, 4, 6]


@pytest.fixture(scope="module")
def four_ranks():
    return _values(run_local(jobs.conformance, world=4, args=(list(jobs.CASES), ALL_METHODS), timeout=180))


@pytest.mark.parametrize("name", list(jobs.CASES))
def test_two_ranks_match_one_process(two_ranks, name):
    for i, (error, limit) in enumerate(two_ranks[0][name]["checks"]):
        assert error <= limit, f"{name}: {('out', 'dq', 'dk', 'dv', 'dsinks')[i]} error {error:.2e} > {limit:.2e}"


@pytest.mark.parametrize("name", list(jobs.CASES))
def test_four_ranks_match_one_process(four_ranks, name):
    for i, (error, limit) in enumerate(four_ranks[0][name]["checks"]):
        assert error <= limit, f"{name}: {('out', 'dq', 'dk', 'dv', 'dsinks')[i]} error {error:.2e} > {limit:.2e}"


@pytest.mark.parametrize("ranks, methods", [("two_ranks", ALL_METHODS), ("three_ranks", ("ring",)),
                                            ("four_ranks", ALL_METHODS)])
def test_layers_keep_their_whole_attention_when_sharded(ranks, methods, request):
    """MultiHeadAttention with a window, softcap, ALiBi (causal and symmetric), RoPE, sinks and
    grouped-query heads: sharded output, input gradient and parameter gradients (summed over the
    ranks) equal the layer on the whole sequence in fp64. A window dropped under sharding (the
    layer's plain causal attention) was 0.4-1.0 away."""
    errors = request.getfixturevalue(ranks)[0]["modules"]
    assert sorted(errors) == sorted(f"{m}-{name}" for m in methods for name in jobs.MODULES)
    for name, error in errors.items():
        assert error < 1e-12, f"{name}: {error:.2e}"


def test_zigzag_ranks_compute_equal_scores_and_contiguous_ranks_do_not(four_ranks):
    zig = [r["ring-zigzag-causal-bf16"]["scores"]["forward"] for r in four_ranks]
    cont = [r["ring-contiguous-causal-fp64"]["scores"]["forward"] for r in four_ranks]
    assert len(set(zig)) == 1, zig
    assert cont == sorted(cont) and cont[0] < cont[-1], cont


def test_ring_sends_p_minus_1_kv_shards_forward_and_back(two_ranks):
    # fp64 case: B=2, Hkv=2, T_local=8, D=8, Dv=6. Forward: 1 shard of k and v; backward: k and
    # v again plus the fp64 gradient accumulators twice (P steps).
    kv_bytes = 2 * 2 * 8 * (8 + 6) * 8
    assert two_ranks[1]["ring-zigzag-causal-gqa-fp64"]["bytes"] == kv_bytes + kv_bytes + 2 * kv_bytes


def test_nan_key_poisons_the_same_rows_as_one_process():
    result = _values(run_local(jobs.nan_semantics, world=2, timeout=60))[0]
    assert result == [True, True, True]


def test_bad_calls_fail_alike_on_every_rank_and_leave_the_group_usable():
    ranks = _values(run_local(jobs.bad_calls, world=2, timeout=60))
    for messages in ranks:
        assert "multiple of 2 * world = 4" in messages[0]
        assert "q heads" in messages[1] and "world size" in messages[1]
        assert "the ring takes attnlab's mask mods" in messages[2] and "method='ulysses'" in messages[2]
        assert "method" in messages[3]
        assert "timeout must be a positive number" in messages[4]
        assert "same positions as q" in messages[5]
        assert messages[6].startswith("ValueError") and "disagree" in messages[6]
        assert "rank 0: q=(1, 2, 4, 8)" in messages[6] and "rank 1: q=(1, 2, 8, 8)" in messages[6]
        assert "disagree" in messages[7] and "float64" in messages[7]
        assert messages[8] == "finite"
        assert messages[9] == "TypeError: group must be a torch.distributed process group or None, got int"
        assert "sinks: context-parallel attention takes per-head sinks of shape (Hq,) = (2,)" in messages[10]
        assert "got shape (1, 2, 4)" in messages[10]
        assert messages[11].startswith("ValueError: score_mod:") and "require grad" in messages[11]


# Wall-clock bounds only rule out a hang (run_local's own limit is 60 s): on a loaded 2-core
# machine a rank can lose seconds to the scheduler, so "within timeout + 2 s" would be a timing test.
SLACK_S = 20.0


@pytest.mark.parametrize("how", ["exit", "raise", "stall"])
def test_a_failed_peer_fails_the_others_within_the_timeout(how):
    timeout = 3.0
    outcomes = run_local(jobs.peer_fails, world=2, args=(how, timeout), timeout=60)
    message, seconds = outcomes[0].value
    assert message.startswith("RuntimeError") and "rank 0 of 2" in message, message
    assert seconds < timeout + SLACK_S  # no hang; the message says which mechanism ended the wait
    if how == "stall":
        assert f"within {timeout:g} s" in message or "timed out" in message


def test_launcher_reports_each_rank():
    values = _values(run_local(jobs.worker_world, world=2, timeout=60))
    assert values == [(2, 0, "gloo"), (2, 1, "gloo")]


def test_a_peer_that_dies_inside_the_ring_fails_the_others():
    outcomes = run_local(jobs.peer_fails_mid_ring, world=2, args=(3.0,), timeout=60)
    message, seconds = outcomes[0].value
    assert "forward step 0: key/value exchange failed" in message, message
    assert seconds < 3.0 + SLACK_S  # no hang
    assert not outcomes[1].ok and "exited with code 4" in outcomes[1].error


@pytest.mark.parametrize("method,positions", [("ring", "rope"), ("ulysses", "learned")])
def test_gpt_trained_on_two_ranks_gives_the_single_process_losses(method, positions):
    single = jobs.gpt_training(0, 1, method, positions, steps=4)
    ranks = _values(run_local(jobs.gpt_training, world=2, args=(method, positions, 4), timeout=90))
    assert single[-1] < single[0]  # it trains
    for losses in ranks:
        assert losses == pytest.approx(single, rel=1e-10, abs=1e-12)


def test_trainer_on_two_ranks_gives_the_single_process_losses_in_fp64():
    """attnlab.lab.train's Trainer with context_parallel: the same losses and accuracies as one process."""
    methods = ["ring", "ulysses", "hybrid"]  # hybrid at world 2: Ulysses pairs, a ring of one
    single = jobs.trainer_losses(0, 1, methods, 3)
    ranks = _values(run_local(jobs.trainer_losses, world=2, args=(methods, 3), timeout=120))
    for method in methods:
        losses = [loss for loss, _ in single[method]]
        assert losses[-1] != losses[0]
        for rank in ranks:
            assert [loss for loss, _ in rank[method]] == pytest.approx(losses, rel=1e-10, abs=1e-12), method
            assert [acc for _, acc in rank[method]] == pytest.approx([acc for _, acc in single[method]], rel=1e-6)


def test_ring_in_head_chunks_is_exact_and_halves_the_per_rank_peak():
    """head_chunks: the ring runs once per chunk of key/value heads. fp64 results equal one process;
    at P=2 one chunk per head (8) brings a rank's peak tensor bytes (forward + backward, causal)
    to at most 0.6x of one process's (PyTorch's SDPA on the whole sequence); one chunk holds
    the shard in flight, the one arriving and the gradient accumulators at full size."""
    import attnlab
    from attnlab._memory import PeakMemory

    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 8, 256, 16, generator=g) for _ in range(4))
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    with PeakMemory() as meter:
        attnlab.attention(*x, causal=True, backend="sdpa").backward(d_out)
    ranks = _values(run_local(jobs.ring_head_chunks, world=2, args=([1, 2, 8],), timeout=120))
    for report in ranks:
        assert max(error for _, error in report.values()) < 1e-12, report
        peaks = [report[c][0] for c in (1, 2, 8)]
        assert peaks[0] > peaks[1] > peaks[2], peaks
        assert peaks[2] <= 0.6 * meter.peak_bytes, (peaks, meter.peak_bytes)


def test_modules_refuse_what_sharded_attention_cannot_do():
    from attnlab.nn import MultiHeadAttention

    mha = context_parallel(MultiHeadAttention(8, 8, num_heads=2, dropout_p=0.1), ContextParallel())
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="cannot take mask, cache, return_weights, attention dropout"):
        mha(x, mask=torch.ones(4, 4, dtype=torch.bool), cache=mha.new_cache(batch_size=1, max_len=8),
            return_weights=True)
    with pytest.raises(TypeError, match="setting must be a ContextParallel or None, got str"):
        context_parallel(MultiHeadAttention(8, 8, num_heads=2), "ring")
    with pytest.raises(TypeError, match="unexpected keyword argument 'context_parallel'"):
        MultiHeadAttention(8, 8, num_heads=2, context_parallel=ContextParallel())  # the wrapper replaces it


def test_context_parallel_wraps_every_self_attention_and_undoes_itself():
    """The wrapper swaps each self-attention's attention part (a block's cross-attention and a
    GPT's layers included or not as they should be), keeps the part it replaced, and None puts
    that part back, so the module computes exactly what it computed before."""
    from attnlab.models import GPT
    from attnlab.nn import MultiHeadAttention, TransformerBlock

    setting = ContextParallel(method="ulysses")
    mine = lambda q, k, v, **options: attnlab.attention(q, k, v, **options)  # noqa: E731 (a user's part)
    mha = MultiHeadAttention(8, 8, num_heads=2, attention=mine)
    assert context_parallel(mha, setting) is mha and isinstance(mha.attention, ShardedAttention)
    assert mha.attention.setting is setting and mha.attention.inner is mine
    context_parallel(mha, ContextParallel(method="ring"))  # a second setting replaces the first
    assert mha.attention.inner is mine and context_parallel(mha, None).attention is mine
    block = context_parallel(TransformerBlock(8, 2, cross_attention=True), setting)
    assert isinstance(block.attn.attention, ShardedAttention)
    assert block.cross_attn.attention is attnlab.attention  # cross-attention is never sharded
    gpt = GPT(vocab_size=5, max_len=8, d_model=8, num_layers=2, num_heads=2)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = gpt(ids)
    context_parallel(gpt, setting)
    assert all(isinstance(b.attn.attention, ShardedAttention) for b in gpt.blocks)
    torch.testing.assert_close(context_parallel(gpt, None)(ids), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="LatentAttention does not run context-parallel"):
        context_parallel(GPT(vocab_size=5, max_len=8, d_model=8, num_layers=1, num_heads=2, layer_pattern="M",
                             latent_dim=4), setting)
    with pytest.raises(ValueError, match="holds no MultiHeadAttention"):
        context_parallel(torch.nn.Linear(2, 2), setting)


@pytest.mark.parametrize("pattern, sizes, name", [
    ("GD", {}, "DifferentialAttention"), ("QG", {}, "GatedAttention"),
    ("GT", {"topk": 2}, "TopkAttention"), ("SG", {"nsa_block": 4}, "NativeSparseAttention"),
    ("RG", {}, "GatedDeltaNet"), ("KG", {}, "KimiDeltaAttention"),
    ("VG", {"window": 2, "topk": 2, "compress_rate": 2}, "CompressedAttention")])  # regression: V was left on shards  # regression: RRRG ran each shard from a zero state
def test_context_parallel_refuses_layers_that_would_attend_over_their_shard_only(pattern, sizes, name):
    """A layer that is not a MultiHeadAttention has no sharded part: left alone, it would attend
    over each rank's shard only, silently wrong. It is refused by name, and nothing is changed."""
    from attnlab.models import GPT

    gpt = GPT(vocab_size=5, max_len=8, d_model=8, num_layers=2, num_heads=2, layer_pattern=pattern, **sizes)
    with pytest.raises(ValueError, match=f"{name} does not run context-parallel"):
        context_parallel(gpt, ContextParallel(method="ring"))
    assert not any(isinstance(m, ShardedAttention) for m in gpt.modules())


# ----------------------------------------------------------------------------- command line
@pytest.mark.parametrize("args, option", [
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "65"], "--nproc"),
    (["--seq-len", "-4"], "--seq-len"),
    (["--seq-len", "6"], "--seq-len"),          # zigzag on 2 ranks needs a multiple of 4
    (["--heads", "0"], "--heads"),
    (["--heads", "4", "--kv-heads", "3"], "--kv-heads"),
    (["--heads", "3", "--seq-len", "8"], "Ulysses"),
    (["--dtype", "fp8"], "--dtype"),
    (["--layout", "spiral"], "--layout"),
    (["--method", "tree"], "--method"),
    (["--seed", "-1"], "--seed"),
    (["--bogus"], "--bogus"),
])
def test_context_parallel_command_refuses_bad_options(args, option):
    from typer.testing import CliRunner

    from attnlab.lab.cli import app
    from test_cli_errors import assert_one_error_line

    assert_one_error_line(CliRunner().invoke(app, ["context-parallel", *args]), option)


def test_check_module_runs_as_torchrun_would_and_reports_ok(tmp_path):
    """``python -m attnlab.lab.cli._cp_check`` under a launcher's environment (RANK etc. set)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    from attnlab.distributed.launch import _free_port

    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "attnlab.lab.cli._cp_check", "--seq-len", "32", "--heads", "2",
         "--head-dim", "8", "--dtype", "fp64"],
        env={**os.environ, "PYTHONPATH": str(src), "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    table = outputs[0][0]
    assert "P=2" in table and table.count(" ok") == 2 and "FAIL" not in table, table
    assert outputs[1][0].strip() == ""  # only rank 0 prints


def test_subgroups_of_the_world_each_run_their_own_ring():
    errors = _values(run_local(jobs.subgroups, world=4, timeout=120))
    assert max(errors) < 1e-12, errors


# ----------------------------------------------------------------------------- agreement check
@pytest.fixture(scope="module")
def disagreements():
    return _values(run_local(jobs.disagreements, world=2, timeout=120))


@pytest.mark.parametrize("case", list(jobs.DISAGREEMENT_OPTIONS))
def test_ranks_that_disagree_on_an_option_fail_alike_naming_it(disagreements, case):
    """Each option that changes the result (shapes, dtype, scale, causal, method, layout, the
    mask's kind, parameters and values, grad mode) is compared; both ranks raise one ValueError
    naming the option and each rank's value, before any attention work."""
    option = jobs.DISAGREEMENT_OPTIONS[case]
    messages = [rank[case] for rank in disagreements]
    assert messages[0] == messages[1], messages  # the same error on every rank
    message = messages[0]
    assert message.startswith("ValueError: context-parallel attention: the ranks disagree on "
                              f"{option} ("), message
    first = option.split(", ")[0]
    assert f"rank 0: {first}=" in message and f"rank 1: {first}=" in message, message


def test_disagreement_messages_show_each_ranks_value(disagreements):
    assert "rank 0: scale=0.125; rank 1: scale=0.5" in disagreements[0]["scale"]
    assert "rank 0: causal=True; rank 1: causal=False" in disagreements[0]["causal"]
    assert "rank 0: method='ring'; rank 1: method='ulysses'" in disagreements[0]["method"]
    assert "rank 0: dtype=float64; rank 1: dtype=float32" in disagreements[0]["dtype"]
    params = disagreements[0]["mask-mod-params"]
    assert "SlidingWindowMod(window=3" in params and "SlidingWindowMod(window=4" in params
    assert "rank 1: mask=None" in disagreements[0]["mask-kind"]


def test_ranks_that_agree_in_different_spellings_run(disagreements):
    """scale=None on one rank and 1/sqrt(D) on the other, equal masks built apart: no error."""
    assert all(rank["agreeing"] < 1e-12 for rank in disagreements)


# ----------------------------------------------------------------------------- argument kinds
@pytest.mark.parametrize("call, message", [
    (lambda x: context_parallel_attention(x, x, x, method=1), "method must be one of .*; got 1"),
    (lambda x: context_parallel_attention(x, x, x, layout=None), "layout must be one of .*; got None"),
    (lambda x: context_parallel_attention(x, x, x, scale="0.5"), "scale must be a float or None, got str"),
    (lambda x: context_parallel_attention(x, x, x, mask=1), "mask must be a tensor, a mask mod or None"),
    (lambda x: context_parallel_attention(x, x, x, stats={}), "stats must be a CommStats or None, got dict"),
    (lambda x: ContextParallel(method=2), "method must be one of .*; got 2"),
    (lambda x: ContextParallel(timeout="5"), "timeout must be a number, got str"),
    (lambda x: _layout.positions(8, layout=0, rank=0, world=2), "layout must be one of .*; got 0"),
    (lambda x: _layout.positions(8.0, layout="zigzag", rank=0, world=2), "sequence length must be an int"),
    (lambda x: _layout.chunk_ids("zigzag", rank=1.0, world=2), "rank must be a non-negative int, got 1.0"),
    (lambda x: _layout.chunk_ids("zigzag", rank=0, world="2"), "world must be a positive int, got '2'"),
    (lambda x: _layout.shard(x, dim="2"), "dim must be an int, got '2'"),
    (lambda x: ContextParallel().positions("4"), "local_len must be an int, got '4'"),
    (lambda x: ring_pieces(rank=0, source=0, world=2, layout="zigzag", causal=True, chunk=2.0),
     "chunk must be a positive int, got 2.0"),
    (lambda x: ring_pieces(rank=0, source=0, world=2, layout="zigzag", causal=1, chunk=2), "causal must be a bool"),
    (lambda x: run_local(jobs.worker_world, world="2"), "world must be a positive int, got '2'"),
    (lambda x: run_local(jobs.worker_world, world=2, timeout="60"), "timeout must be a number, got str"),
    (lambda x: run_local(jobs.worker_world, world=2, threads=1.5), "threads must be a positive int, got 1.5"),
    (lambda x: run_local(jobs.worker_world, world=2, args=[1]), "args must be a tuple, got list"),
])
def test_arguments_of_the_wrong_kind_raise_type_error(call, message):
    """A value of the wrong kind is a TypeError naming the argument (before any process group is
    needed); a bad value of the right kind stays a ValueError."""
    with pytest.raises(TypeError, match=message):
        call(torch.randn(1, 2, 4, 8))
