"""Per-query sinks ``(B|1, Hq|1, Tq)`` and infinite sinks on every backend that serves sinks.

The oracle is written here in fp64 as models write it (gpt-oss's and Inkling2's eager): the
sink as one more logit column per row, softmax, the column dropped. Forward and every gradient
(q, k, v and the sinks, a broadcast dim's summed) are compared on reference, sdpa (through the
kernel's lse and as a sink column), chunked (several query tiles) and blocks (several runs).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab._call import build_call
from attnlab.backends.blocks import blocks_attention
from attnlab.backends.chunked import chunked_attention
from attnlab.backends.sdpa import sinks_through_lse

F64 = torch.float64
INF = float("inf")
B, HQ, HKV, T, D = 2, 4, 2, 12, 8


def _qkv(seed=0, *, b=B, tq=T, tk=T):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=F64).requires_grad_()  # noqa: E731
    return make(b, HQ, tq, D), make(b, HKV, tk, D), make(b, HKV, tk, D)


def _eager(q, k, v, sinks, allowed=None):
    """fp64 textbook attention with the sinks as one more logit column per row (dropped after
    the softmax); a row whose every logit is -inf gives zeros."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # (B, Hq, Tk, D)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, Hq, Tq, Tk)
    if allowed is not None:
        s = s.masked_fill(~allowed, -INF)
    rows = sinks.view(1, -1, 1) if sinks.ndim == 1 else sinks  # (B|1, Hq|1, Tq|1)
    s = torch.cat([s, rows.unsqueeze(-1).expand(*s.shape[:-1], 1)], dim=-1)  # (B, Hq, Tq, Tk + 1)
    dead = (s == -INF).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return p[..., :-1] @ v


def _window():
    return masks.sliding_window_mod(T, T, 4)


def _empty_rows():
    """A bool (T, T) mask whose rows 2 and 7 see no key; the window elsewhere."""
    allowed = masks.materialize(_window(), tq=T, tk=T, batch=1, device="cpu")[0, 0]
    allowed[2] = allowed[7] = False
    return allowed


def _run(backend, q, k, v, sinks, *, mask=None):
    """``attention`` on ``backend``; chunked with 4-query tiles and blocks with 4-query blocks,
    so that the sinks are cut per tile and per run."""
    if backend == "chunked":
        return chunked_attention(build_call(q, k, v, mask=mask, sinks=sinks), q_block=4, kv_block=8).out
    if backend == "blocks":
        return blocks_attention(build_call(q, k, v, mask=mask, sinks=sinks), block=4).out
    return attnlab.attention(q, k, v, mask=mask, sinks=sinks, backend=backend)


CASES = ("reference", "sdpa_lse", "sdpa_column", "chunked", "blocks")


def _case(name):
    """The backend a case runs on and the mask it gets: rows 2 and 7 see no key, the others a
    window. sdpa takes the sink column path for a learnable float mask, else its lse path;
    blocks needs the window as a mask mod."""
    backend = name.split("_")[0]
    if name == "blocks":
        rows = (torch.arange(T) != 2) & (torch.arange(T) != 7)
        return backend, masks.and_masks(_window(), lambda b, h, i, j: rows[i])
    if name == "sdpa_column":
        return backend, torch.zeros(T, T, dtype=F64).masked_fill(~_empty_rows(), -INF).requires_grad_()
    return backend, _empty_rows()


def _compare(name, sinks, seed=0):
    backend, mask = _case(name)
    q, k, v = _qkv(seed)
    allowed = _empty_rows()
    if name == "sdpa_column":  # a learnable float mask takes the sink column path
        assert not sinks_through_lse(build_call(q, k, v, mask=mask, sinks=sinks))
    if name == "sdpa_lse":
        assert sinks_through_lse(build_call(q, k, v, mask=mask, sinks=sinks))
    out = _run(backend, q, k, v, sinks, mask=mask)
    want = _eager(q, k, v, sinks, allowed)
    leaves = [q, k, v, sinks]
    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    got = torch.autograd.grad(out, leaves, grad_out)
    wants = torch.autograd.grad(want, leaves, grad_out)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    for g, w, what in zip(got, wants, "q k v sinks".split()):
        assert g.shape == w.shape, what
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10, msg=lambda m: f"{name} d{what}: {m}")
    return out, got


@pytest.mark.parametrize("shape", [(B, HQ, T), (1, HQ, T), (B, 1, T), (1, 1, T)], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_per_query_sinks_match_the_eager_column(name, shape):
    """Each query's own sink logit, broadcasting over batch and heads, with GQA and rows that
    see no key: forward and every gradient equal fp64 eager (a broadcast dim's gradient summed)."""
    sinks = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=F64).mul_(2).requires_grad_()
    out, _ = _compare(name, sinks)
    assert out[:, :, [2, 7]].eq(0).all()  # no key: the sink takes the mass


@pytest.mark.parametrize("name", CASES)
def test_per_head_sinks_still_match(name):
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(6), dtype=F64).requires_grad_()
    _compare(name, sinks)


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_per_query_sinks_gradcheck(backend):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(1, 2, 5, generator=g, dtype=F64, requires_grad=True)

    def f(q, k, v, sinks):
        return attnlab.attention(q, k, v, causal=True, sinks=sinks, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), check_batched_grad=True)


def _infinite_sinks():
    """Per query: +inf on rows 0 and 7 (7 sees no key), -inf on rows 1 and 2 (2 sees no key)."""
    sinks = torch.randn(1, HQ, T, generator=torch.Generator().manual_seed(7), dtype=F64)
    sinks[..., [0, 7]], sinks[..., [1, 2]] = INF, -INF
    return sinks


@pytest.mark.parametrize("name", CASES)
def test_infinite_sinks_follow_one_rule(name):
    """+inf takes all the mass (a zero row, zero gradients, the sink's own included: the limit
    of a growing sink), -inf is no sink; no NaN anywhere, the same on every backend."""
    backend, mask = _case(name)
    q, k, v = _qkv(3)
    sinks = _infinite_sinks().requires_grad_()
    out = _run(backend, q, k, v, sinks, mask=mask)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    dq, dk, dv, d_sinks = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    # the limit, written with finite stand-ins: exp(-1e4) is 0 in fp64
    stand_in = _infinite_sinks().clamp(-1e4, 1e4).requires_grad_()
    want = _eager(q, k, v, stand_in, _empty_rows())
    wants = torch.autograd.grad(want, (q, k, v, stand_in), grad_out)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    for got, w in zip((dq, dk, dv, d_sinks), wants):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, w, atol=1e-12, rtol=1e-10)
    assert out[:, :, [0, 7]].eq(0).all() and dq[:, :, [0, 7]].eq(0).all()
    assert d_sinks[..., [0, 1, 2, 7]].eq(0).all()
    no_sink = _eager(q, k, v, torch.full((HQ,), -INF, dtype=F64), _empty_rows())  # -inf: no sink
    torch.testing.assert_close(out[:, :, 1], no_sink[:, :, 1], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked", "blocks"])
@pytest.mark.parametrize("value", [INF, -INF])
def test_infinite_per_head_sinks_give_no_nan(backend, value):
    """Regression: +inf gave NaN on reference and a NaN sink gradient on chunked and blocks;
    -inf a NaN sink gradient on blocks for a row with no key (exp(-inf - -inf))."""
    q, k, v = _qkv(8, tq=T, tk=T - 3)  # bottom-right causal: the first 3 queries see no key
    sinks = torch.tensor([value, 0.5, value, -1.0], dtype=F64, requires_grad=True)
    out = attnlab.attention(q, k, v, causal=True, align="bottom_right", sinks=sinks, backend=backend)
    grads = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert grads[3][[0, 2]].eq(0).all()
    if value == INF:
        assert out[:, [0, 2]].eq(0).all()


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked", "blocks"])
@pytest.mark.parametrize("per_query", [False, True], ids=["per_head", "per_query"])
def test_empty_batch_with_learnable_sinks_gives_them_a_zero_gradient(backend, per_query):
    """Regression: sdpa's output of an empty batch was connected to no input, so backward with
    only the sinks learning raised."""
    q = torch.randn(0, HQ, T, D)
    sinks = torch.randn((0, HQ, T) if per_query else (HQ,), requires_grad=True)
    out = attnlab.attention(q, q, q, causal=True, sinks=sinks, backend=backend)
    assert out.shape == q.shape
    (grad,) = torch.autograd.grad(out.sum(), sinks)
    assert grad.shape == sinks.shape and grad.eq(0).all()


def test_weights_leave_out_each_querys_sink_share():
    q, k, _ = _qkv(9)
    sinks = _infinite_sinks()
    weights = attnlab.attention_weights(q.detach(), k.detach(), mask=_empty_rows(), sinks=sinks)
    share = 1 - weights.sum(-1)  # (B, Hq, Tq)
    assert share[:, :, [0, 2, 7]].eq(1).all()  # +inf, or no key: the sink takes everything
    assert share[:, :, 1].abs().max() < 1e-12  # -inf: no sink
    logits = sinks[..., 3:7]
    s = (q.detach() @ k.detach().repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(D))[:, :, 3:7]
    s = s.masked_fill(~_empty_rows()[3:7], -INF)
    want = torch.sigmoid(logits - s.logsumexp(-1))  # exp(sink) / (exp(sink) + sum exp(s))
    torch.testing.assert_close(share[:, :, 3:7], want, atol=1e-12, rtol=1e-10)


def test_rank5_and_rank3_inputs_take_per_query_sinks():
    """The sinks' batch is the flattened batch (A*B for rank 5); rank 3 has one head."""
    g = torch.Generator().manual_seed(10)
    q5 = torch.randn(2, 3, 2, 5, 4, generator=g, dtype=F64)
    sinks = torch.randn(6, 1, 5, generator=g, dtype=F64)
    out = attnlab.attention(q5, q5, q5, sinks=sinks, backend="sdpa")
    want = _eager(q5.flatten(0, 1), q5.flatten(0, 1), q5.flatten(0, 1), sinks).view(2, 3, 2, 5, 4)
    torch.testing.assert_close(out, want)
    q3 = torch.randn(3, 5, 4, generator=g, dtype=F64)
    sinks3 = torch.randn(3, 1, 5, generator=g, dtype=F64)
    out3 = attnlab.attention(q3, q3, q3, causal=True, sinks=sinks3, backend="chunked")
    want3 = _eager(q3[:, None], q3[:, None], q3[:, None], sinks3, torch.ones(5, 5, dtype=torch.bool).tril())
    torch.testing.assert_close(out3, want3[:, 0])


@pytest.mark.parametrize("shape, words", [
    ((HQ + 1,), "(Hq,) = (4,)"),
    ((B, HQ, T + 1), "(B|1, Hq|1, Tq) with (B, Hq, Tq) = (2, 4, 12)"),
    ((3, HQ, T), "got (3, 4, 12)"),
    ((B, 2, T), "got (2, 2, 12)"),
    ((B, HQ, T, 1), "got (2, 4, 12, 1)"),
    ((HQ, T), "got (4, 12)"),
], ids=str)
def test_bad_sink_shapes_are_refused_naming_sinks(shape, words):
    q, k, v = (t.detach() for t in _qkv())
    with pytest.raises(ValueError, match=r"^sinks ") as info:
        attnlab.attention(q, k, v, sinks=torch.zeros(shape, dtype=F64))
    assert words in str(info.value)


def test_flex_declines_per_query_sinks_with_the_reason():
    if "flex" not in attnlab.backends.names():
        pytest.skip("flex is not registered")
    q, k, v = (t.detach() for t in _qkv())
    with pytest.raises(ValueError, match="flex does not apply sinks"):
        attnlab.attention(q, k, v, causal=True, sinks=torch.zeros(1, HQ, T, dtype=F64), backend="flex")


def test_topk_takes_per_query_and_infinite_sinks():
    """attention(indices=...) over each query's listed keys, the mask ANDed in, with per-query
    sinks broadcasting over heads, some infinite: forward and every gradient equal eager."""
    q, k, v = _qkv(12)
    g = torch.Generator().manual_seed(13)
    indices = torch.randint(-1, T, (B, HKV, T, 5), generator=g)  # -1: no key
    listed = torch.zeros(B, HKV, T, T + 1, dtype=torch.bool).scatter_(-1, indices % (T + 1), True)[..., :T]
    allowed = listed.repeat_interleave(HQ // HKV, 1) & _empty_rows()  # (B, Hq, Tq, Tk)
    sinks = _infinite_sinks()[:, :1].expand(B, 1, T).clone().requires_grad_()  # (B, 1, Tq)
    out = attnlab.attention(q, k, v, mask=_empty_rows(), indices=indices, sinks=sinks)
    stand_in = sinks.detach().clamp(-1e4, 1e4).requires_grad_()
    want = _eager(q, k, v, stand_in, allowed)
    grad_out = torch.randn(out.shape, generator=g, dtype=F64)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    for got, w in zip(torch.autograd.grad(out, (q, k, v, sinks), grad_out),
                      torch.autograd.grad(want, (q, k, v, stand_in), grad_out)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, w, atol=1e-12, rtol=1e-10)
