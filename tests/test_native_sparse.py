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

from attnlab._memory import PeakMemory
from attnlab.nn import NativeSparseAttention

CASES = {  # sizes, heads, T: overlapping MLP blocks; mean pooling with l' > l; l' < l; T < l
    "mlp": dict(sizes=dict(compress_block=4, compress_stride=2, select_block=4, select_count=3, select_local=1,
                           window=5), heads=(4, 2), T=21),
    "mean": dict(sizes=dict(compress_block=4, compress_stride=4, select_block=8, select_count=2, select_local=1,
                            window=3, compress="mean", bias=True), heads=(2, 1), T=19),
    "small-select": dict(sizes=dict(compress_block=6, compress_stride=2, select_block=2, select_count=4,
                                    select_local=2, window=4), heads=(2, 2), T=17),
    "short": dict(sizes=dict(compress_block=4, compress_stride=2, select_block=4, select_count=2, select_local=1,
                             window=2), heads=(2, 1), T=3),
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


def reference(m, x):
    """(compressed, selected, window, gates, out, chosen blocks) by loops, in x's dtype."""
    B, T, _ = x.shape
    Hq, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    l, d, ls, group = m.compress_block, m.compress_stride, m.select_block, Hq // Hkv
    q = _linear(x, m.q_proj).view(B, T, Hq, D)
    kv = _linear(x, m.kv_proj).view(B, T, 3, 2, Hkv, D)
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
