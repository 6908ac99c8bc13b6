"""Packed documents: a packed batch equals running each document alone (outputs and gradients).

The independent reference is the definition itself: each document run through the same module
on its own, with positions starting at 0, in fp64.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.backends import build_call, select
from attnlab.backends.blocks import choose_block
from attnlab.nn import MultiHeadAttention, TransformerBlock
from attnlab.nn import QKV, CallMask

LENGTHS = (5, 1, 7, 3)  # a one-token document, odd lengths


def _ids(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def _grads(module, x):
    return {name: p.grad.clone() for name, p in module.named_parameters()} | {"x": x.grad.clone()}


def _packed_vs_alone(module, lengths, forward, seed=0):
    """Outputs and gradients of the packed run and of each document alone (summed)."""
    gen = torch.Generator().manual_seed(seed)
    T, width = sum(lengths), module_width(module)
    x = torch.randn(1, T, width, generator=gen, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn(1, T, width, generator=gen, dtype=torch.float64)
    packed = forward(module, x, _ids(lengths))
    (packed * d_out).sum().backward()
    want_grads = _grads(module, x)
    module.zero_grad()
    x.grad = None
    alone, start = [], 0
    for n in lengths:
        alone.append(forward(module, x[:, start:start + n], None))
        start += n
    alone = torch.cat(alone, dim=1)
    (alone * d_out).sum().backward()
    return packed, alone, want_grads, _grads(module, x)


def module_width(module):
    return module.d_in if isinstance(module, MultiHeadAttention) else module.norm_attn.normalized_shape[0]


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_multihead_equals_each_document_alone(rope, causal, kv_heads):
    torch.manual_seed(1)
    mha = MultiHeadAttention(16, 16, num_heads=4, positions="rope" if rope else None, qkv=QKV(num_kv_heads=kv_heads), pattern=("causal" if causal else None)).double()
    packed, alone, g_packed, g_alone = _packed_vs_alone(
        mha, LENGTHS, lambda m, x, ids: m(x, mask=CallMask(documents=ids)))
    assert torch.allclose(packed, alone, atol=1e-12)
    for name in g_alone:
        assert torch.allclose(g_packed[name], g_alone[name], atol=1e-12), name


@pytest.mark.parametrize("rope", [False, True])
def test_packed_transformer_block_equals_each_document_alone(rope):
    torch.manual_seed(2)
    block = TransformerBlock(16, 2, causal=True, positions="rope" if rope else None).double()
    packed, alone, g_packed, g_alone = _packed_vs_alone(
        block, LENGTHS, lambda m, x, ids: m(x, document_ids=ids))
    assert torch.allclose(packed, alone, atol=1e-12)
    for name in g_alone:
        assert torch.allclose(g_packed[name], g_alone[name], atol=1e-12), name


def test_packed_batch_rows_have_their_own_documents():
    torch.manual_seed(3)
    mha = MultiHeadAttention(8, 8, num_heads=2, positions="rope").double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 2]])
    out = mha(x, mask=CallMask(documents=ids))
    assert torch.allclose(out[0, 3:], mha(x[:1, 3:]), atol=1e-12)
    assert torch.allclose(out[1, 1:5], mha(x[1:, 1:5]), atol=1e-12)


def test_packed_with_a_dense_mask_and_a_mod_mask():
    torch.manual_seed(4)
    mha = MultiHeadAttention(8, 8, num_heads=2, pattern=None).double()
    x = torch.randn(1, 7, 8, dtype=torch.float64)
    ids = _ids((3, 4))
    keep = torch.rand(7, 7) > 0.3
    keep.fill_diagonal_(True)
    dense = mha(x, mask=CallMask(keep, documents=ids))
    as_mod = mha(x, mask=CallMask(lambda b, h, i, j: keep[i, j], documents=ids))
    alone = torch.cat([mha(x[:, :3], mask=keep[:3, :3]), mha(x[:, 3:], mask=keep[3:, 3:])], dim=1)
    assert torch.allclose(dense, alone, atol=1e-12) and torch.allclose(as_mod, alone, atol=1e-12)


def test_document_ids_are_checked():
    mha = MultiHeadAttention(8, 8, num_heads=2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"documents \(CallMask\(documents=...\)\) must be an integer tensor"):
        mha(x, mask=CallMask(documents=torch.zeros(4, dtype=torch.long)))
    with pytest.raises(TypeError, match=r"documents \(CallMask\(documents=...\)\) must have an integer dtype, got torch.float32"):
        mha(x, mask=CallMask(documents=torch.zeros(5)))
    with pytest.raises(TypeError, match=r"documents \(CallMask\(documents=...\)\) must have an integer dtype, got torch.bool"):
        mha(x, mask=CallMask(documents=torch.zeros(5, dtype=torch.bool)))
    with pytest.raises(ValueError, match="cannot be combined"):
        mha(x, mask=CallMask(documents=torch.zeros(5, dtype=torch.long)), cache=mha.new_cache(2, 8))


def test_document_mod_bounds_cover_every_attended_key():
    """Brute force: every key a query block attends lies inside the block's kv_bounds."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(20):
        ids = torch.randint(0, 4, (2, 23), generator=gen)
        if trial % 2:
            ids = ids.sort(dim=1).values  # contiguous documents; unsorted: split documents
        for causal in (True, False):
            mod = masks.document_mod(ids, causal=causal)
            dense = masks.materialize(mod, tq=23, tk=23, batch=2)
            for qs in range(0, 23, 5):
                lo, hi = mod.kv_bounds(qs, min(qs + 5, 23))
                cols = dense[:, :, qs:qs + 5].any(dim=(0, 1, 2)).nonzero().flatten()
                assert cols.numel() == 0 or (lo <= int(cols.min()) and int(cols.max()) < hi)


def test_document_positions_restart_at_each_document():
    ids = torch.tensor([[4, 4, 9, 9, 9, 4]])
    assert masks.document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0]]


def test_packed_attention_runs_on_blocks_and_visits_only_the_diagonal():
    T = 4096
    q = torch.randn(1, 2, T, 16)
    mod = masks.document_mod(torch.arange(T) // (T // 8))
    call = build_call(q, q, q, mask=mod)
    assert select(call).name == "blocks"
    # 8 causal documents of 512 keys; query block j of a document spans (j + 1) * block keys
    block = choose_block(call)
    share = 8 * sum(block * (j + 1) * block for j in range(512 // block)) / T**2
    assert f"visits {share:.0%}" in attnlab.backends.get("blocks").memory_use(call, words=True).note
