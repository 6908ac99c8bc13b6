"""Every backend on every memory layout of q, k, v (and of the output gradient) against fp64.

The oracle is the reference backend in fp64 on contiguous copies of the same values. Layouts
come from :func:`attnlab.lab.verify.relayout`, the one the conformance sweep draws from.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.lab import verify
from attnlab.backends import blocks as blocks_backend


def _oracle(q, k, v, d_out, **options):
    """fp64 reference output and q/k/v gradients on contiguous copies."""
    leaves = [t.detach().double().contiguous().requires_grad_() for t in (q, k, v)]
    out = attnlab.attention(*leaves, backend="reference", **options)
    return [out.detach(), *torch.autograd.grad(out, leaves, d_out.double())]


def _run(backend, q, k, v, d_out, **options):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attnlab.attention(*leaves, backend=backend, **options)
    return [out.detach(), *torch.autograd.grad(out, leaves, d_out)]


def _assert_close(got, want, rtol=1e-4, label=""):
    """Max error of each of out, dq, dk, dv within ``rtol`` of the largest fp64 value (fp32
    rounding is ~1e-6 there; a misread block is off by O(1))."""
    magnitude = max(1.0, *(float(t.abs().max()) for t in want if t.numel()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, f"{label} {name}"
        err = float((a.double() - b).abs().max()) if a.numel() else 0.0
        assert err <= rtol * magnitude, f"{label} {name}: max error {err:.3g}"


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, T, D)`` laid out as a projection makes it: ``(B, T, H, D)`` transposed."""
    return x.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


@pytest.mark.parametrize("backend", ["blocks", "auto", "sdpa", "chunked", "reference"])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_multi_query_keys_transposed_from_projection(backend, align):
    """Issue 20's repro: one key/value head projected to (B, T, 1, D) and transposed; blocks
    read batch b's keys at offset b*stride(1) (stride(0) == H*stride(1) is not promised)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 32, generator=gen)
    k, v = (torch.randn(2, 300, 1, 32, generator=gen).transpose(1, 2) for _ in range(2))  # (B, 1, T, D)
    assert k.is_contiguous() and k.stride(0) != k.shape[1] * k.stride(1)
    d_out = torch.randn(2, 4, 300, 32, generator=gen)
    got = _run(backend, q, k, v, d_out, causal=True, align=align)
    _assert_close(got, _oracle(q, k, v, d_out, causal=True, align=align))


def test_blocks_reads_the_multi_query_layout_in_place():
    """The fix keeps the no-copy path on the layout transformers' multi-query models produce."""
    k = torch.randn(2, 300, 1, 32).transpose(1, 2)
    assert blocks_backend._kernel_layout(k) is k
    bthd = _transposed(torch.randn(1, 4, 300, 32))  # one batch element: heads merge in place
    assert blocks_backend._kernel_layout(bthd) is bthd
    sliced = torch.randn(2, 4, 300, 40)[..., :32]  # the kernel misreads a strided last dim
    assert blocks_backend._kernel_layout(sliced).stride(-1) == 1


def test_rank3_permuted_query_of_one_row_and_one_column():
    """A raw ``setStorage ... out of bounds`` from blocks: rank-3 q permuted with Tq = D = 1
    is "contiguous", and its inserted head axis got a stride past the storage's end."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 3, generator=gen).permute(2, 0, 1)  # (3, 1, 1), strides (1, 3, 3)
    k, v = (torch.randn(3, 5, 1, generator=gen) for _ in range(2))
    d_out = torch.randn(3, 1, 1, generator=gen)
    mod = masks.document_mod(torch.tensor([[0, 0, 1, 1, 1]] * 3))
    _assert_close(_run("blocks", q, k, v, d_out, mask=mod), _oracle(q, k, v, d_out, mask=mod))


def test_ring_pieces_read_a_permuted_last_dim_correctly():
    """The fused kernel misreads a last dim whose stride is not 1; ring attention's pieces
    call it directly, so a permuted q/k/v must reach it copied."""
    from attnlab.distributed import ring

    gen = torch.Generator().manual_seed(2)
    q, k, v, d_out = (torch.randn(2, 3, 40, 8, generator=gen) for _ in range(4))
    permuted = [t.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0) for t in (q, k, v)]  # D outermost
    assert permuted[0].stride(-1) != 1
    setup = ring._Setup(None, plan=None, pieces={}, scale=0.3, stats=None, shapes=permuted[1:])
    want = _oracle(q, k, v, d_out, causal=True, scale=0.3)
    out, lse = ring._piece_forward(setup, *permuted, True, None)
    grads = ring._piece_backward(setup, *permuted, True, None, out, lse, d_out)
    _assert_close([out, *grads], want)


# ----------------------------------------------------------------------------- the sweep draws layouts
def _old_blocks(t, start, step, n, length):
    """``blocks._blocks`` before issue 20: the batch-head axis stepped by stride(1) always."""
    s = t.stride()
    return t.as_strided((n, t.shape[0] * t.shape[1], length, *t.shape[3:]),
                        (step * s[2], s[1], s[2], *s[3:]), t.storage_offset() + start * s[2])


def test_sweep_catches_the_planted_stride_assumption(monkeypatch):
    """Plant the old ``as_strided`` assumption back: the quick sweep of blocks fails."""
    monkeypatch.setattr(blocks_backend, "_blocks", _old_blocks)
    results = verify.sweep(["blocks"], [torch.float32], n=12, seed=1, small=True)
    assert any(r.served and not r.passed for r in results)


def test_sweep_draws_every_layout_with_one_two_and_all_kv_heads():
    cfgs = verify.configs(220, seed=1)  # what tests/test_conformance.py sweeps
    kv = {(c.kv_layout, c.kv_heads == 1, c.kv_heads == c.q_heads, c.batch > 1) for c in cfgs}
    for layout in verify.LAYOUTS:
        assert (layout, True, False, True) in kv  # one kv head shared by several query heads, B >= 2
        assert (layout, False, True, True) in kv  # as many kv heads as query heads
        assert (layout, False, False, True) in kv  # two kv heads, grouped
        assert any(c.kv_layout == layout and c.batch == 1 for c in cfgs)
    assert {c.q_layout for c in cfgs} == set(verify.LAYOUTS)
    first = verify.configs(12, seed=1, small=True, masks=verify.BOUNDED_MASKS)  # the planted test's
    assert any(c.kv_layout == "transposed" and c.kv_heads == 1 and c.batch > 1 for c in first)


@pytest.mark.parametrize("layout", verify.LAYOUTS)
def test_relayout_keeps_the_values(layout):
    t = verify.broadcastable(torch.randn(2, 3, 5, 4, dtype=torch.float64), layout)
    laid = verify.relayout(t, layout)
    assert torch.equal(laid, t)
    assert layout == "contiguous" or laid.stride() != t.stride()


# ----------------------------------------------------------------------------- acceptance matrix
BACKENDS = ("reference", "sdpa", "chunked", "blocks")
MASKS = ("causal", "causal_bottom_right", "window", "document", "padding")
TQ, TK, HQ, D = 100, 139, 4, 8  # two 64-query blocks and several key spans for blocks


def _options(kind, batch, gen):
    """Keyword arguments of one mask kind, all served by every backend of :data:`BACKENDS`."""
    if kind == "causal":
        return dict(causal=True)
    if kind == "causal_bottom_right":
        return dict(causal=True, align="bottom_right")
    if kind == "window":
        return dict(mask=masks.sliding_window_mod(TQ, TK, 40, align="bottom_right"))
    if kind == "document":
        ids = torch.randint(0, 3, (batch, TK), generator=gen).sort(dim=1).values
        return dict(mask=masks.document_mod(ids, causal=True))
    lengths = torch.randint(1, TK + 1, (batch,), generator=gen)  # padding, with causal for bounds
    return dict(mask=masks.padding_mod(lengths), causal=True, align="bottom_right")


def _matrix_inputs(batch, kv_heads, q_layout, kv_layout, gen):
    shapes = ((batch, HQ, TQ, D), (batch, kv_heads, TK, D), (batch, kv_heads, TK, D), (batch, HQ, TQ, D))
    q, k, v, d_out = (torch.randn(*shape, generator=gen) for shape in shapes)
    q, d_out = (verify.broadcastable(t, q_layout) for t in (q, d_out))
    k, v = (verify.broadcastable(t, kv_layout) for t in (k, v))
    laid = [verify.relayout(t, layout) for t, layout in ((q, q_layout), (k, kv_layout), (v, kv_layout),
                                                           (d_out, q_layout))]
    return (q, k, v, d_out), laid


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("layout", verify.LAYOUTS)
def test_every_backend_on_every_layout(layout, kind):
    """k/v in ``layout``, q (and the output gradient) in another; two of the nine pairs of
    B in {1, 2, 3} and Hkv in {1, 2, Hq} per mask kind, so that each layout meets all nine."""
    i, m = verify.LAYOUTS.index(layout), MASKS.index(kind)
    q_layout = verify.LAYOUTS[(i + 3 + m) % len(verify.LAYOUTS)]
    gen = torch.Generator().manual_seed(100 * i + m)
    for pair in (2 * m + i) % 9, (2 * m + i + 1) % 9:
        batch, kv_heads = (1, 2, 3)[pair // 3], (1, 2, HQ)[pair % 3]
        (q, k, v, d_out), laid = _matrix_inputs(batch, kv_heads, q_layout, layout, gen)
        options = _options(kind, batch, gen)
        want = _oracle(q, k, v, d_out, **options)
        call = attnlab.backends.build_call(*laid[:3], **options)
        declined = {name: why for name, why in attnlab.backends.reasons(call).items()
                    if name in BACKENDS and why}
        assert not declined, declined
        for name in BACKENDS:
            _assert_close(_run(name, *laid, **options), want,
                          label=f"{name} B{batch} Hkv{kv_heads} q:{q_layout} kv:{layout}")


# ----------------------------------------------------------------------------- batch broadcasting
def _sdpa64(q, k, v, d_out, causal):
    """fp64 ``F.scaled_dot_product_attention`` (which broadcasts batch dims) and its gradients."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gqa = q.ndim >= 4 and q.shape[-3] != k.shape[-3]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    return [out.detach(), *torch.autograd.grad(out, leaves, d_out.double())]


BROADCASTS = (  # q shape, k/v shape, out shape
    ((3, 4, 150, 8), (1, 4, 150, 8), (3, 4, 150, 8)),  # a shared prompt's keys for a batch
    ((3, 4, 150, 8), (1, 2, 150, 8), (3, 4, 150, 8)),  # ... grouped
    ((2, 4, 150, 8), (1, 1, 150, 8), (2, 4, 150, 8)),  # ... multi-query
    ((1, 4, 150, 8), (3, 1, 150, 8), (3, 4, 150, 8)),  # one query sequence, three key sets
    ((3, 150, 8), (1, 150, 8), (3, 150, 8)),
    ((2, 3, 4, 150, 8), (1, 3, 2, 150, 8), (2, 3, 4, 150, 8)),  # rank 5 stays rank 5
    ((2, 3, 4, 150, 8), (2, 1, 4, 150, 8), (2, 3, 4, 150, 8)),
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", BROADCASTS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_batch_dims_broadcast_as_sdpa(shapes, backend):
    """Same output and gradients as SDPA; the broadcast k/v gradient is summed over the batch."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, d_out = (torch.randn(*shape, generator=gen) for shape in (shapes[0], shapes[1], shapes[1], shapes[2]))
    got = _run(backend, q, k, v, d_out, causal=True)
    assert got[0].shape == shapes[2] and got[2].shape == k.shape
    _assert_close(got, _sdpa64(q, k, v, d_out, causal=True))


# Ranks that differ, aligned from the right as SDPA aligns them; the first is the broadcast sample
# of PyTorch's own SDPA op tests (q (H, Tq, D) against k/v (B, H, Tk, D)).
MIXED_RANKS = (  # q shape, k shape, v shape, out shape
    ((8, 3, 4), (4, 8, 2, 4), (4, 8, 2, 4), (4, 8, 3, 4)),
    ((3, 4), (2, 2, 7, 4), (2, 2, 7, 4), (2, 2, 3, 4)),
    ((2, 3, 4), (7, 4), (7, 4), (2, 3, 4)),
    ((2, 4, 8, 3, 4), (8, 2, 4), (8, 2, 4), (2, 4, 8, 3, 4)),
    ((4, 8, 3, 4), (4, 8, 2, 4), (8, 2, 5), (4, 8, 3, 5)),  # k and v of different ranks
    ((2, 1, 5, 4), (2, 3, 6, 4), (2, 3, 6, 4), (2, 3, 5, 4)),  # one query head, three kv heads
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", MIXED_RANKS, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_mixed_ranks_broadcast_as_sdpa(shapes, backend):
    """Refused before (same rank required); SDPA takes them, and so does attnlab, with the same
    output and gradients (a broadcast input's gradient sums over what it served)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, d_out = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*leaves)
    want_grads = torch.autograd.grad(want, leaves, d_out)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    try:
        out = attnlab.attention(*mine, backend=backend)
    except ValueError as error:  # a backend that declines says so; auto and sdpa always serve
        assert backend not in ("auto", "sdpa", "reference"), str(error)
        return
    assert out.shape == shapes[3]
    torch.testing.assert_close(out, want)
    for got, exact in zip(torch.autograd.grad(out, mine, d_out), want_grads):
        torch.testing.assert_close(got, exact)


def test_broadcast_keys_are_read_in_place():
    """Broadcast keys reach the backends as stride-0 views of the user's tensor: blocks (one
    key/value head) and chunked read them without a copy."""
    q, k = torch.randn(3, 4, 150, 8), torch.randn(1, 1, 150, 8)
    call = attnlab.backends.build_call(q, k, k, causal=True)
    assert call.k.shape == (3, 1, 150, 8) and call.k.stride(0) == 0
    assert call.k.data_ptr() == k.data_ptr()
    assert blocks_backend._kernel_layout(call.k) is call.k


@pytest.mark.parametrize("q_shape, kv_shape", [
    ((2, 4, 5, 8), (3, 4, 5, 8)),
    ((2, 5, 8), (3, 5, 8)),
    ((2, 3, 4, 5, 8), (2, 2, 4, 5, 8)),
])
def test_batch_dims_that_do_not_broadcast_are_refused(q_shape, kv_shape):
    q, k = torch.randn(*q_shape), torch.randn(*kv_shape)
    with pytest.raises(ValueError, match=r"batch dims of q and k/v must be equal or 1.*got q"):
        attnlab.attention(q, k, k)


def test_rank5_mask_broadcasts_over_both_batch_dims():
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 3, 2, 6, 4, generator=gen), torch.randn(1, 3, 2, 7, 4, generator=gen)
    mask = torch.rand(2, 1, 1, 6, 7, generator=gen) < 0.6
    got = attnlab.attention(q, k, k, mask=mask, backend="chunked")
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), k.double(), attn_mask=mask)
    rows = mask.any(-1, keepdim=True)  # SDPA gives NaN on a row with nothing to attend, attnlab 0
    assert torch.allclose(got.double(), want.where(rows, 0.0), atol=1e-5)


@pytest.mark.skipif("flex" not in attnlab.backends.available(), reason="no FlexAttention")
def test_flex_on_the_multi_query_layout():
    """flex compiles per layout (slow on CPU), so one case: the repro's layout, forward."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 128, 16, generator=gen)
    k, v = (verify.relayout(torch.randn(2, 1, 128, 16, generator=gen), "transposed") for _ in range(2))
    with torch.no_grad():
        out = attnlab.attention(q, k, v, causal=True, backend="flex")
    want = attnlab.attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    assert float((out.double() - want).abs().max()) <= 1e-5
