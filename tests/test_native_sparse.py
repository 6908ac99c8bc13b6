"""Native Sparse Attention against fp64 math written plainly: one query, one head at a time.

The oracle compresses each block with the module's own parameters (MLP or mean written out),
scores the selection blocks by counting the stride chunks each visible compressed block covers,
picks block 0, the local blocks and the best others by sorting Python numbers, and attends over
explicit key lists. The module does none of that with loops: it unfolds, pads and sums, and runs
the selected branch as top-k indices (never a (T, T) tensor: the memory test).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnlab.nn.native_sparse as nsa_module
from attnlab._memory import PeakMemory
from attnlab.nn import BranchCache, KVCache, NativeSparseAttention, TransformerBlock

CASES = {  # sizes, heads, T: overlapping MLP blocks; mean pooling with l' > l; l' < l; T < l; rotary positions
    "mlp": dict(sizes=dict(compress_block=4, compress_stride=2, select_block=4, select_count=3, select_local=1,
                           window=5), heads=(4, 2), T=21),
    "mean": dict(sizes=dict(compress_block=4, compress_stride=4, select_block=8, select_count=2, select_local=1,
                            window=3, compress="mean", bias=True), heads=(2, 1), T=19),
    "small-select": dict(sizes=dict(compress_block=6, compress_stride=2, select_block=2, select_count=4,
                                    select_local=2, window=4), heads=(2, 2), T=17),
    "short": dict(sizes=dict(compress_block=4, compress_stride=2, select_block=4, select_count=2, select_local=1,
                             window=2), heads=(2, 1), T=3),
    "rope": dict(sizes=dict(compress_block=4, compress_stride=2, select_block=2, select_count=3, select_local=2,
                            window=3, positions="rope", rope_base=100.0), heads=(4, 1), T=19),
}


def _linear(x, layer):
    return x @ layer.weight.T + (0 if layer.bias is None else layer.bias)


def _phi(block, phi):
    """One compressed vector from a block (l, D), written out."""
    if phi.kind == "mean":
        return phi.proj.weight @ block.mean(0) + phi.proj.bias
    first, second = phi.mlp[0], phi.mlp[2]
    hidden = first.weight @ (block + phi.pos).reshape(-1) + first.bias
    return second.weight @ (0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))) + second.bias


def _attend(q, keys, values):
    """softmax(q k / sqrt(D)) v over explicit lists; zeros when there is no key."""
    if not keys:
        return torch.zeros_like(q), None
    scores = torch.stack([q @ k for k in keys]) / math.sqrt(q.shape[0])
    return (torch.softmax(scores, 0)[:, None] * torch.stack(values)).sum(0), torch.softmax(scores, 0)


def _chunks_covered(i, j, m):
    """Stride chunks of selection block j lying inside compressed block i."""
    l, d, ls = m.compress_block, m.compress_stride, m.select_block
    return sum(1 for c in range(j * ls // d, (j + 1) * ls // d) if i * d <= c * d and c * d + d <= i * d + l)


def _rotated(t, base):
    """t (B, T, ..., D) with pair (i, i + D/2) at position p turned by p * base**(-2i/D)."""
    T, D = t.shape[1], t.shape[-1]
    angles = torch.arange(T, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = angles.view(T, *(1,) * (t.ndim - 3), D // 2).to(t.dtype)
    a, b = t[..., :D // 2], t[..., D // 2:]
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1)


def reference(m, x):
    """(compressed, selected, window, gates, out, chosen blocks) by loops, in x's dtype."""
    B, T, _ = x.shape
    Hq, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    l, d, ls, group = m.compress_block, m.compress_stride, m.select_block, Hq // Hkv
    q = _linear(x, m.q_proj).view(B, T, Hq, D)
    kv = _linear(x, m.kv_proj).view(B, T, 3, 2, Hkv, D)
    if m.positions == "rope":  # queries and every branch's keys, never the values
        q = _rotated(q, m.rope.base)
        kv = torch.stack([_rotated(kv[:, :, :, 0], m.rope.base), kv[:, :, :, 1]], dim=3)
    gates = torch.sigmoid(_linear(x, m.gate_proj)).view(B, T, Hq, 3)
    nc = (T - l) // d + 1 if T >= l else 0
    outs = {name: torch.zeros(B, Hq, T, D, dtype=x.dtype) for name in ("cmp", "slc", "win")}
    chosen = {}
    for b in range(B):
        for g in range(Hkv):
            k = {br: kv[b, :, br, 0, g] for br in range(3)}
            v = {br: kv[b, :, br, 1, g] for br in range(3)}
            kc = [_phi(k[0][i * d:i * d + l], m.compress_k) for i in range(nc)]
            vc = [_phi(v[0][i * d:i * d + l], m.compress_v) for i in range(nc)]
            for t in range(T):
                visible = [i for i in range(nc) if i * d + l - 1 <= t]
                probs = {}
                for h in range(g * group, (g + 1) * group):
                    if visible:
                        outs["cmp"][b, h, t], p = _attend(q[b, t, h], [kc[i] for i in visible],
                                                          [vc[i] for i in visible])
                        for i, pi in zip(visible, p.tolist()):
                            probs[i] = probs.get(i, 0.0) + pi
                current = t // ls
                score = {j: sum(p * _chunks_covered(i, j, m) for i, p in probs.items()) for j in range(current + 1)}
                forced = {j for j in score if j == 0 or j > current - m.select_local}
                others = sorted((j for j in score if j not in forced), key=lambda j: (-score[j], j))
                blocks = forced | set(others[:m.select_count - len(forced)])
                chosen[b, g, t] = blocks
                selected = [s for j in sorted(blocks) for s in range(j * ls, (j + 1) * ls) if s <= t]
                window = range(max(0, t - m.window + 1), t + 1)
                for h in range(g * group, (g + 1) * group):
                    outs["slc"][b, h, t] = _attend(q[b, t, h], [k[1][s] for s in selected],
                                                   [v[1][s] for s in selected])[0]
                    outs["win"][b, h, t] = _attend(q[b, t, h], [k[2][s] for s in window],
                                                   [v[2][s] for s in window])[0]
    gates = gates.permute(0, 2, 1, 3)  # (B, Hq, T, 3)
    mixed = sum(gates[..., i, None] * outs[name] for i, name in enumerate(("cmp", "slc", "win")))
    out = _linear(mixed.permute(0, 2, 1, 3).reshape(B, T, Hq * D), m.out_proj)
    return outs["cmp"], outs["slc"], outs["win"], gates, out, chosen


def _module(case, seed=0):
    torch.manual_seed(seed)
    Hq, Hkv = CASES[case]["heads"]
    return NativeSparseAttention(8 * Hq, Hq, num_kv_heads=Hkv, **CASES[case]["sizes"]).double()


def _grads(module, x, loss):
    module.zero_grad()
    x.grad = None
    loss.backward()
    named = [("x", x)] + list(module.named_parameters())
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in named}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_branch_and_the_module_match_fp64_loops(case):
    m = _module(case)
    x = torch.randn(2, CASES[case]["T"], m.d_model, dtype=torch.float64, requires_grad=True)
    parts = m.branches(x)
    cmp, slc, win, gates, out, chosen = reference(m, x)
    for got, want in ((parts.compressed, cmp), (parts.selected, slc), (parts.window, win), (parts.gates, gates),
                      (m(x), out)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    ls = m.select_block
    for (b, g, t), blocks in chosen.items():  # the valid blocks chosen are the oracle's
        assert {j for j in parts.blocks[b, g, t].tolist() if j * ls <= t} == blocks, (b, g, t)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_of_input_and_every_parameter_match(case):
    """Selection is not differentiable (both sides): gradients flow through the attention and gates."""
    m = _module(case, seed=1)
    x = torch.randn(2, CASES[case]["T"], m.d_model, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, CASES[case]["T"], m.d_model, dtype=torch.float64)
    got = _grads(m, x, (m(x) * weight).sum())
    want = _grads(m, x, (reference(m, x)[4] * weight).sum())
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-11, msg=name)
    assert got["kv_proj.weight"].abs().sum() > 0 and got["gate_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("shape", [(2, 0), (0, 5), (2, 1)])
def test_empty_and_one_token_inputs(shape):
    """T=0 and B=0 give empty outputs; T=1 attends only itself (window and selected branch)."""
    m = _module("mlp")
    x = torch.randn(*shape, m.d_model, dtype=torch.float64, requires_grad=True)
    out = m(x)
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape
    if x.numel():
        torch.testing.assert_close(out, reference(m, x)[4], rtol=1e-10, atol=1e-12)


def test_float32_matches_fp64():
    m = _module("mlp")
    x = torch.randn(2, 21, m.d_model, dtype=torch.float64)
    want = m(x)
    got = m.float()(x.float())
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


def test_selection_reaches_beyond_the_window_and_local_blocks():
    """A key far back that the compressed branch favours is selected and changes the output."""
    m = _module("mlp").eval()
    x = torch.randn(1, 21, m.d_model, dtype=torch.float64)
    blocks = m.branches(x).blocks[0, :, 20]  # (Hkv, n) for query 20: current block 5, window keys 16..20
    assert all(any(0 < j < 4 for j in group) for group in blocks.tolist()), blocks


class LargestTensor(TorchDispatchMode):
    """The largest storage (bytes) of any tensor an op returns inside the block (a stride-0
    expand of a small tensor is small)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                self.largest = max(self.largest, value.untyped_storage().nbytes())
        return result


def test_no_t_by_t_tensor_at_t_4096():
    """Forward and backward at T=4096 create no storage of a quarter (T, T) float (the largest is
    the compressed probabilities, T * T/d per head), and the peak stays under one (T, T) float."""
    T = 4096
    torch.manual_seed(0)
    m = NativeSparseAttention(32, 2, num_kv_heads=1, compress_block=32, compress_stride=16, select_block=32,
                              select_count=2, select_local=1, window=32)
    x = torch.randn(1, T, 32, requires_grad=True)
    with LargestTensor() as largest, PeakMemory() as meter:
        m(x).sum().backward()
    assert largest.largest < T * T, largest.largest  # bytes: a quarter of T * T * 4
    assert meter.peak_bytes < T * T * 4, meter.peak_bytes
    assert x.grad.isfinite().all()


@pytest.mark.parametrize("changes, error, words", [
    (dict(compress_block=6, compress_stride=4), ValueError, "compress_block (6) must be a multiple of compress_stride (4)"),
    (dict(select_block=6, compress_stride=4), ValueError, "select_block (6) must be a multiple of compress_stride (4)"),
    (dict(select_count=0), ValueError, "select_count must be a positive int, got 0"),
    (dict(window=0), ValueError, "window must be a positive int, got 0"),
    (dict(compress_stride=1.5), TypeError, "compress_stride must be a positive int, got 1.5"),
    (dict(select_local=-1), ValueError, "select_local must be a non-negative int, got -1"),
    (dict(select_count=2, select_local=2), ValueError, "select_count (2) must hold block 0 and the select_local (2)"),
    (dict(compress="max"), ValueError, "compress must be one of 'mlp', 'mean'; got 'max'"),
    (dict(num_kv_heads=3), ValueError, "num_heads (4) must be a multiple of num_kv_heads (3)"),
])
def test_bad_sizes_name_the_argument(changes, error, words):
    sizes = dict(compress_block=4, compress_stride=2, select_block=4, select_count=3, window=4) | changes
    with pytest.raises(error) as info:
        NativeSparseAttention(16, 4, **sizes)
    assert words in str(info.value)


def test_bad_input_names_x():
    m = NativeSparseAttention(16, 4, compress_block=4, compress_stride=2, select_block=4, select_count=3, window=4)
    with pytest.raises(ValueError, match=r"x must be \(B, T, 16\), got shape \(2, 5, 8\)"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(TypeError, match="x must have a floating-point dtype"):
        m(torch.zeros(2, 5, 16, dtype=torch.long))


def test_block_scores_follow_equation_9():
    """l = 2d, l' = 2d: block j sums p_cmp[2j + m - n] for m < 2, n < 2 (the chunks each block covers)."""
    m = NativeSparseAttention(8, 1, compress_block=2, compress_stride=1, select_block=2, select_count=2,
                              select_local=1, window=2)
    p = torch.arange(1.0, 6.0).view(1, 1, 1, 5)  # Nc = 5 for T = 6
    scores = m.block_scores(p, 6)
    want = [sum(p[0, 0, 0, 2 * j + a - n].item() for a in range(2) for n in range(2) if 0 <= 2 * j + a - n < 5)
            for j in range(3)]
    assert scores.flatten().tolist() == want


# ---------------------------------------------------------------- decoding with the cache

def _decode(m, x, schedule, **cache_options):
    """The branches of x fed to one cache in chunks of the given sizes, joined along T."""
    cache = m.new_cache(x.shape[0], x.shape[1], **cache_options)
    parts, start = [], 0
    with torch.no_grad():
        for size in schedule:
            parts.append(m.branches(x[:, start:start + size], cache=cache))
            start += size
    assert start == x.shape[1] and cache.length == start
    return [torch.cat([p[i] for p in parts], dim=2) for i in range(4)], [p.blocks for p in parts], cache


SCHEDULES = {  # prefill then steps; chunks where blocks complete mid-chunk; steps from the first token
    "prefill-steps": lambda T: [T // 2] + [1] * (T - T // 2),
    "chunks": lambda T: [3, 1, 5, 2] + [1] * max(0, T - 11) if T > 11 else [T],
    "steps": lambda T: [1] * T,
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_decoding_with_the_cache_equals_the_whole_sequence(case, schedule):
    """Every branch, the gates and the module's output of each new token equal the no-cache
    forward over the whole sequence and the fp64 loops (GQA, l > d, select_local > 1, T < l, rope)."""
    m = _module(case, seed=2)
    T = CASES[case]["T"]
    x = torch.randn(2, T, m.d_model, dtype=torch.float64)
    got, blocks, _ = _decode(m, x, SCHEDULES[schedule](T))
    with torch.no_grad():
        whole = m.branches(x)
        want = reference(m, x)
    for name, g, w, r in zip(("compressed", "selected", "window", "gates"), got, whole, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=name)
    start, ls = 0, m.select_block
    for chunk in blocks:  # the valid blocks chosen for each new query are the oracle's
        for (b, g, t), chosen in want[5].items():
            if start <= t < start + chunk.shape[2]:
                assert {j for j in chunk[b, g, t - start].tolist() if j * ls <= t} == chosen, (b, g, t)
        start += chunk.shape[2]
    cache = m.new_cache(2, T)
    with torch.no_grad():
        out = torch.cat([m(x[:, t:t + 1], cache=cache) for t in range(T)], dim=1)
    torch.testing.assert_close(out, want[4], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("windowed", [True, False])
def test_window_part_as_ring_or_contiguous(windowed):
    """windowed=True keeps a ring of `window` slots, False a KVCache of max_len: both exact."""
    m = _module("mlp", seed=3)
    x = torch.randn(1, 21, m.d_model, dtype=torch.float64)
    got, _, cache = _decode(m, x, SCHEDULES["prefill-steps"](21), windowed=windowed)
    assert type(cache["window"]).__name__ == ("WindowedKVCache" if windowed else "KVCache")
    with torch.no_grad():
        torch.testing.assert_close(got[2], m.branches(x).window, rtol=1e-10, atol=1e-12)


def test_a_decoding_step_computes_only_the_new_query(monkeypatch):
    """After a prefill of 64, one step: every attention call has one query, the compressed branch
    reads Nc compressed keys, the window at most `window` keys, and phi compresses one block at
    most (never the prefix again)."""
    m = _module("mlp", seed=4)
    x = torch.randn(1, 66, m.d_model, dtype=torch.float64)
    cache = m.new_cache(1, 66)
    calls, windows, compressed = [], [], []
    with torch.no_grad():
        m(x[:, :64], cache=cache)

        def spy(q, k, v, **options):
            calls.append((q.shape[2], k.shape[2], "indices" in options))
            return nsa_module.attention.__wrapped__(q, k, v, **options)

        def window_spy(q, k, v, **options):
            windows.append((q.shape[2], k.shape[2]))
            return attend(q, k, v, **options)
        attend, spy.__wrapped__ = nsa_module.attend_causal, nsa_module.attention
        monkeypatch.setattr(nsa_module, "attention", spy)
        monkeypatch.setattr(nsa_module, "attend_causal", window_spy)
        hook = m.compress_k.register_forward_hook(lambda mod, args, out: compressed.append(out.shape[2]))
        for t in (64, 65):  # position 65 completes block 31, position 64 none
            m(x[:, t:t + 1], cache=cache)
        hook.remove()
    assert compressed == [0, 1], compressed
    assert all(tq == 1 for tq, _, _ in calls) and windows == [(1, m.window)] * 2, (calls, windows)
    assert [tk for tq, tk, topk in calls if not topk] == [31, 32], calls  # (T - l) // d + 1 blocks
    assert cache.length == 66 and cache["compressed"].length == 32


def _state(cache):
    return {name: (cache[name].length, cache[name].keys.clone(), cache[name].values.clone()) for name in cache.names}


def _same_state(cache, before):
    for name, (length, keys, values) in before.items():
        assert cache[name].length == length, name
        assert torch.equal(cache[name].keys, keys) and torch.equal(cache[name].values, values), name


@pytest.mark.parametrize("name", ["mask", "padding_mask", "document_ids"])
def test_masks_and_documents_are_refused_by_name(name):
    m = _module("mlp")
    x = torch.randn(1, 5, m.d_model, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"{name} must be None for NativeSparseAttention"):
        m(x, **{name: torch.ones(1, 5, dtype=torch.bool)})


def test_bad_caches_name_the_problem_and_change_nothing():
    m = _module("mlp")
    x = torch.randn(2, 4, m.d_model, dtype=torch.float64)
    cache = m.new_cache(2, 6)
    with torch.no_grad():
        m(x, cache=cache)
    before = _state(cache)
    other = NativeSparseAttention(m.d_model, 4, num_kv_heads=2, compress_block=6, compress_stride=2, select_block=4,
                                  select_count=3, select_local=1, window=5).double()  # another compress_block
    bad = [
        (KVCache(2, 2, 6, 8, dtype=torch.float64), TypeError, "cache must be a BranchCache"),
        (other.new_cache(2, 6), ValueError, "cache must come from this module's new_cache"),
        (BranchCache(selected=KVCache(2, 2, 6, 8, dtype=torch.float64)), ValueError, "cache must come from"),
        (m.new_cache(1, 6), ValueError, "cache holds batch 1; x has batch 2"),
        (m.float().new_cache(2, 6), TypeError, "cache holds torch.float32 .* but x is torch.float64"),
    ]
    m.double()
    for wrong, error, words in bad:
        with pytest.raises(error, match=words):
            m(x[:, :1], cache=wrong)
    with torch.no_grad(), pytest.raises(ValueError, match=r"KV cache overflow: 4 positions cached \+ 3 new > max_len=6"):
        m(x[:, :3], cache=cache)
    _same_state(cache, before)
    with pytest.raises(ValueError, match="page_size must be None for NativeSparseAttention"):
        m.new_cache(1, 8, page_size=4)
    with pytest.raises(TypeError, match="windowed must be a bool or None"):
        m.new_cache(1, 8, windowed="yes")


def test_a_failing_call_puts_every_part_back(monkeypatch):
    """The window branch fails after the selected, raw and compressed parts were written: all
    four parts are restored, and the next call continues exactly."""
    m = _module("mlp", seed=5)
    x = torch.randn(1, 12, m.d_model, dtype=torch.float64)
    cache = m.new_cache(1, 12)
    with torch.no_grad():
        m(x[:, :7], cache=cache)
        before = _state(cache)

        def fail(*args, **kwargs):
            raise RuntimeError("boom")
        with monkeypatch.context() as patch:
            patch.setattr(nsa_module, "attend_causal", fail)
            with pytest.raises(RuntimeError, match="boom"):
                m(x[:, 7:10], cache=cache)  # completes block 3 (ends at 9): a compressed write
        _same_state(cache, before)
        rest = m(x[:, 7:], cache=cache)
        torch.testing.assert_close(rest, m(x)[:, 7:], rtol=1e-10, atol=1e-12)


def test_positions_must_be_rope_or_none():
    with pytest.raises(ValueError, match="positions must be one of 'rope'"):
        NativeSparseAttention(16, 2, compress_block=4, compress_stride=2, select_block=4, select_count=3,
                              window=4, positions="alibi")
    plain = NativeSparseAttention(16, 2, compress_block=4, compress_stride=2, select_block=4, select_count=3, window=4)
    assert plain.rope is None and not any("rope" in key for key in plain.state_dict())


def test_a_transformer_block_decodes_with_nsa_as_its_attention():
    """The block passes mask=None, padding_mask=None, cache=, document_ids=None: NSA serves it."""
    torch.manual_seed(6)
    nsa = NativeSparseAttention(16, 2, compress_block=4, compress_stride=2, select_block=4, select_count=3,
                                window=4, positions="rope")
    block = TransformerBlock(16, 2, attn=nsa).double().eval()
    x = torch.randn(1, 13, 16, dtype=torch.float64)
    cache = nsa.new_cache(1, 13, dtype=torch.float64)
    with torch.no_grad():
        steps = [block(x[:, :6], cache=cache)] + [block(x[:, t:t + 1], cache=cache) for t in range(6, 13)]
        torch.testing.assert_close(torch.cat(steps, dim=1), block(x), rtol=1e-10, atol=1e-12)
