"""PeakMemory against allocations whose sizes are known exactly."""

from __future__ import annotations

import torch

from attnlab._memory import PeakMemory

MIB = 2**20


def test_one_allocation_raises_the_peak_by_its_size():
    with PeakMemory() as meter:
        x = torch.empty(1024, 1024)  # fp32: 4 MiB
    assert meter.peak_bytes == 4 * MIB
    assert meter.current_bytes == 4 * MIB
    del x
    assert meter.current_bytes == 0 and meter.peak_bytes == 4 * MIB


def test_freed_tensors_leave_the_live_total_and_the_peak_remembers():
    with PeakMemory() as meter:
        a = torch.ones(1024, 1024, dtype=torch.float64)  # 8 MiB
        b = torch.ones(512, 1024)  # 2 MiB
        del a
        c = torch.ones(1024, 1024)  # 4 MiB, after the 8 MiB was freed
    assert meter.peak_bytes == 10 * MIB
    assert meter.current_bytes == 6 * MIB
    del b, c


def test_views_and_in_place_ops_allocate_nothing():
    with PeakMemory() as meter:
        x = torch.zeros(1024, 1024)
        view = x[::2].t()
        x.add_(1.0).mul_(view.t().sum())  # the sum allocates a 4-byte scalar
    assert meter.peak_bytes == 4 * MIB + 4


def test_tensors_created_before_the_block_are_not_counted():
    outside = torch.ones(2048, 1024)  # 8 MiB, not counted
    with PeakMemory() as meter:
        doubled = outside * 2  # 8 MiB, counted
    assert meter.peak_bytes == 8 * MIB
    del outside, doubled


def test_out_arguments_that_resize_a_storage_are_counted():
    a = torch.ones(1024, 1024)
    with PeakMemory() as meter:
        out = torch.empty(0)
        torch.add(a, a, out=out)  # out's storage grows from 0 to 4 MiB
    assert meter.peak_bytes == 4 * MIB
    del out


def test_backward_allocations_are_seen():
    x = torch.ones(1024, 1024, requires_grad=True)
    with PeakMemory() as meter:
        loss = (x * 3.0).sum()  # the product (4 MiB) is freed once the sum exists
        loss.backward()  # x.grad: a new 4 MiB storage
    assert torch.equal(x.grad, torch.full((1024, 1024), 3.0))
    assert meter.current_bytes == 4 * MIB + loss.untyped_storage().nbytes()
    assert 4 * MIB <= meter.peak_bytes <= 8 * MIB + 64


def test_a_materialised_score_matrix_shows_in_the_peak():
    q = torch.randn(2048, 16)
    with PeakMemory() as meter:
        torch.softmax(q @ q.T, dim=-1)  # two (T, T) fp32 matrices live at the softmax
    assert meter.peak_bytes >= 2 * 2048 * 2048 * 4


def test_views_of_tensors_from_before_the_block_are_not_counted():
    x = torch.ones(256, 1024)  # 1 MiB, made outside
    with PeakMemory() as meter:
        same = x.to(torch.float32)  # no copy: an alias of x's storage
        rows = x[:128]  # a view
        alias = torch.ops.aten.alias.default(x)
    assert same.data_ptr() == x.data_ptr() and rows.data_ptr() == x.data_ptr() == alias.data_ptr()
    assert meter.peak_bytes == 0
