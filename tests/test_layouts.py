"""Every backend on every memory layout of q, k, v (and of the output gradient) against fp64.

The oracle is the reference backend in fp64 on contiguous copies of the same values. Layouts
come from :func:`attnlab.verify.relayout`, the one the conformance sweep draws from.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import masks
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


def _assert_close(got, want, atol=1e-4):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        err = float((a.double() - b).abs().max()) if a.numel() else 0.0
        assert err <= atol, f"{name}: max error {err:.3g}"


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
    setup = ring._Setup(None, layout="contiguous", causal=True, scale=0.3, stats=None)
    want = _oracle(q, k, v, d_out, causal=True, scale=0.3)
    out, lse = ring._piece_forward(setup, *permuted, True)
    grads = ring._piece_backward(setup, *permuted, True, out, lse, d_out)
    _assert_close([out, *grads], want)
