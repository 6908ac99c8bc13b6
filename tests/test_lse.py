"""The log-sum-exp algebra (attnlab.backends._lse) against plain fp64 softmax math."""

from __future__ import annotations

import pytest
import torch

from attnlab.backends import _lse
from attnlab.scores import sink_logits

F64 = torch.float64
INF = float("inf")


def _scores_values(B=2, H=3, T=5, K=9, Dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, K, generator=g, dtype=F64), torch.randn(B, H, K, Dv, generator=g, dtype=F64)


def _partial(s, v):
    """(out, lse) of scores ``s`` (B, H, T, k) over values ``v`` (B, H, k, Dv), written plainly;
    a row of -inf scores is empty: out 0, lse -inf."""
    lse = torch.logsumexp(s, dim=-1)
    weights = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)), nan=0.0)
    return weights @ v, lse


def _whole(s, v):
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("cut", [1, 4, 8])
def test_merge_of_two_halves_is_the_softmax_over_the_whole(cut):
    s, v = _scores_values()
    halves = [_partial(s[..., :cut], v[..., :cut, :]), _partial(s[..., cut:], v[..., cut:, :])]
    want_out, want_lse = _whole(s, v)
    out, lse = _lse.merge(halves)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    out_, lse_ = (t.clone() for t in halves[0])
    _lse.merge_(out_, lse_, *(t.clone() for t in halves[1]))
    torch.testing.assert_close(out_, want_out)
    torch.testing.assert_close(lse_, want_lse)


def test_merge_of_many_parts_in_any_order():
    s, v = _scores_values(K=12)
    parts = [_partial(s[..., i:i + 3], v[..., i:i + 3, :]) for i in range(0, 12, 3)]
    want_out, want_lse = _whole(s, v)
    for order in (parts, parts[::-1]):
        out, lse = _lse.merge(order)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)


def test_merge_is_stable_at_huge_lse():
    """Max-shifted: partials of lse 1e4 (exp overflows fp64) still merge."""
    s, v = _scores_values()
    s = s + 1e4
    out, lse = _lse.merge([_partial(s[..., :4], v[..., :4, :]), _partial(s[..., 4:], v[..., 4:, :])])
    want_out, want_lse = _whole(s, v)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def test_empty_rows_stay_zero_and_never_nan():
    s, v = _scores_values()
    s[0, 1, 2] = -INF  # row empty in both halves
    s[1, 0, 3, :4] = -INF  # row empty in the first half only
    halves = [_partial(s[..., :4], v[..., :4, :]), _partial(s[..., 4:], v[..., 4:, :])]
    out, lse = _lse.merge(halves)
    assert out[0, 1, 2].eq(0).all() and lse[0, 1, 2] == -INF and not out.isnan().any()
    want_out, _ = _whole(s[1:, :1, 3:4], v[1:, :1])
    torch.testing.assert_close(out[1:, :1, 3:4], want_out)
    out_, lse_ = (t.clone() for t in halves[0])
    _lse.merge_(out_, lse_, *(t.clone() for t in halves[1]))
    assert out_[0, 1, 2].eq(0).all() and lse_[0, 1, 2] == -INF and not out_.isnan().any()
    torch.testing.assert_close(out_, out)


def test_sinks_fold_equals_an_extra_key_of_value_zero():
    s, v = _scores_values()
    sinks = torch.randn(3, dtype=F64)  # (Hq,)
    per_query = torch.randn(2, 1, 5, dtype=F64)  # (B, 1, Tq)
    for sink in (sinks, per_query):
        logits = sink_logits(sink, F64)  # (B|1, Hq|1, Tq|1)
        out, lse = _lse.fold_sinks(*_partial(s, v), logits)
        column = logits.unsqueeze(-1).expand(2, 3, 5, 1)
        want_out, want_lse = _whole(torch.cat([s, column], -1), torch.cat([v, v.new_zeros(2, 3, 1, 4)], -2))
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)


def test_infinite_sinks_take_all_or_none_of_the_mass():
    s, v = _scores_values()
    s[0, 0, 0] = -INF  # an empty row (under the +inf sink)
    out, lse = _partial(s, v)
    sinks = torch.tensor([INF, -INF, 0.0], dtype=F64)
    folded, total = _lse.fold_sinks(out, lse, sink_logits(sinks, F64))
    assert folded[:, 0].eq(0).all()  # +inf: all the mass
    torch.testing.assert_close(folded[:, 1], out[:, 1])  # -inf: no sink
    torch.testing.assert_close(total[:, 1], lse[:, 1])
    assert not folded.isnan().any() and not total.isnan().any()
    out[0, 1, 0], lse[0, 1, 0] = 0.0, -INF  # an empty row under the -inf sink: still 0, never NaN
    folded, total = _lse.fold_sinks(out, lse, sink_logits(sinks, F64))
    assert folded[0, 1, 0].eq(0).all() and total[0, 1, 0] == -sink_logits(sinks, F64)[0, 0, 0]


def test_sinks_gradient_is_autograds_through_the_fold():
    s, v = _scores_values()
    out, lse = _partial(s, v)
    for sinks in (torch.randn(3, dtype=F64), torch.randn(1, 3, 5, dtype=F64)):
        sinks = sinks.requires_grad_()
        d_out = torch.randn(2, 3, 5, 4, dtype=F64)
        folded, total = _lse.fold_sinks(out, lse, sink_logits(sinks, F64))
        want = torch.autograd.grad(folded, sinks, d_out)[0]
        got = _lse.sinks_gradient(sinks, sink_logits(sinks.detach(), F64), total,
                                  _lse.row_delta(d_out, folded.detach(), F64))
        torch.testing.assert_close(got, want)


def test_gradcheck_of_merge_and_fold():
    s, v = _scores_values(B=1, H=2, T=3, K=4, Dv=2)
    parts = [tuple(t.detach().requires_grad_() for t in _partial(s[..., i:i + 2], v[..., i:i + 2, :]))
             for i in (0, 2)]
    leaves = [t for part in parts for t in part]
    assert torch.autograd.gradcheck(lambda a, b, c, d: _lse.merge([(a, b), (c, d)]), leaves)
    logits = torch.randn(1, 2, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(_lse.fold_sinks, (*parts[0], logits))


def test_merge_gradient_of_an_empty_row_is_zero_not_nan():
    out = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    lse = torch.full((1,), -INF, dtype=F64, requires_grad=True)
    merged, total = _lse.merge([(out, lse), (out, lse)])
    grads = torch.autograd.grad(merged.sum() + total.exp().sum(), (out, lse))
    assert all(g.isfinite().all() for g in grads)


def test_online_softmax_tile_by_tile_is_the_softmax():
    s, v = _scores_values(K=10)
    s[0, 0, 1] = -INF  # an empty row
    state = _lse.online_start((2, 3, 5), 4, F64, torch.device("cpu"))
    for i in range(0, 10, 3):
        state = _lse.online_step(state, s[..., i:i + 3].clone(), v[..., i:i + 3, :])
    out, lse, parts = _lse.online_finish(state)
    want_out, want_lse = _partial(s, v)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    shift, rest = _lse.row_parts(parts, 0, 5)
    torch.testing.assert_close(torch.exp(s - shift - rest), torch.nan_to_num(torch.exp(s - want_lse[..., None])))


def test_score_gradient_is_softmax_backward():
    s, v = _scores_values()
    s.requires_grad_()
    d_out = torch.randn(2, 3, 5, 4, dtype=F64)
    out = torch.softmax(s, -1) @ v
    want = torch.autograd.grad(out, s, d_out)[0]
    probs = torch.softmax(s.detach(), -1)
    delta = _lse.row_delta(d_out, out.detach(), F64).unsqueeze(-1)
    torch.testing.assert_close(_lse.score_gradient_(probs, d_out @ v.transpose(-2, -1), delta), want)


def test_kernel_function_gradients_and_vmap():
    def forward(plan, x, w):
        return x * w * plan, (x * w).sum(-1)

    def gradients(plan, needs, d_out, tensors, outputs):
        x, w = tensors
        return (d_out * w * plan if 0 in needs else None), (d_out * x * plan if 1 in needs else None)

    Kernel = _lse.kernel_function("demo", forward, gradients)
    x, w = torch.randn(3, 4, dtype=F64, requires_grad=True), torch.randn(4, dtype=F64)
    assert torch.autograd.gradcheck(lambda x: Kernel.apply(2.0, x, w)[0], (x,))
    got = torch.func.vmap(lambda x: Kernel.apply(2.0, x, w)[0])(x)
    torch.testing.assert_close(got, x * w * 2.0)
    per_row = torch.func.vmap(torch.func.grad(lambda x: Kernel.apply(2.0, x, w)[0].sum()))(x)
    torch.testing.assert_close(per_row, (w * 2.0).expand(3, 4))
