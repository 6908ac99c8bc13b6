"""Mask mods written for FlexAttention (one position at a time, vmapped) run unchanged.

The mods below port patterns from attention-gym (pytorch-labs/attention-gym, the FlexAttention
examples), written the way that repository writes them: for 0-d indices, with Python indexing
of captured tensors, so they cannot be called on whole index grids. Each is checked against a
mask built by a Python loop that calls the mod once per position (FlexAttention's definition
of a mod) and against torch's own ``create_mask``, then on every backend, forward and backward,
against an fp64 computation written in this file.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import attnlab
from attnlab import masks

B, H, T, D = 2, 2, 20, 8

# Flamingo-style vision cross-attention (attention-gym): image i is seen by the text queries
# in intervals[i] = [start, end); each key (an image token) belongs to image image_of[kv].
INTERVALS = torch.tensor([[0, 7], [5, 14], [12, 20]])
IMAGE_OF = torch.tensor([0] * 6 + [1] * 8 + [2] * 6)
DOCS = torch.tensor([0] * 5 + [1] * 9 + [2] * 6)
PREFIX = torch.tensor([3, 8])  # per batch row
WINDOW = 4
TAGS = torch.rand(T, 5, generator=torch.Generator().manual_seed(3)) < 0.3  # (T, tags)


def flamingo(b, h, q_idx, kv_idx):
    interval = INTERVALS[IMAGE_OF[kv_idx]]
    return (q_idx >= interval[0]) & (q_idx < interval[1])


def document(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx]


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX[b]) | (kv_idx <= q_idx)


def sliding_window(b, h, q_idx, kv_idx):
    return torch.where(kv_idx <= q_idx, q_idx - kv_idx < WINDOW, False)


def shared_tag(b, h, q_idx, kv_idx):
    """Attend a key that shares a tag with the query. On a whole index grid ``.any()`` reduces
    over every position at once: one bool, broadcast silently into an all-True (or all-False)
    mask -- what attnlab gave before it evaluated plain mods as FlexAttention does."""
    return (TAGS[q_idx] & TAGS[kv_idx]).any() | (q_idx == kv_idx)


MODS = {
    "flamingo": flamingo,
    "document": document,
    "prefix_lm": prefix_lm,
    "sliding_window": sliding_window,
    "shared_tag": shared_tag,
    "and": masks.and_masks(document, sliding_window),
    "or": masks.or_masks(flamingo, prefix_lm),
}


def _mask_by_loop(mod, *, batch=B, heads=H, tq=T, tk=T) -> torch.Tensor:
    """The mod called once per position on 0-d indices: what a mask mod means."""
    out = torch.zeros(batch, heads, tq, tk, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for i in range(tq):
                for j in range(tk):
                    out[b, h, i, j] = bool(mod(*map(torch.tensor, (b, h, i, j))))
    return out


def _attention_fp64(q, k, v, allowed):
    """softmax(q k^T / sqrt(D), masked) v in fp64; a row that attends nothing gives zeros."""
    scores = (q.double() @ k.double().transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    live = allowed.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~live, 0.0), dim=-1) * live
    return weights @ v.double()


@pytest.mark.parametrize("name", MODS)
def test_the_mask_is_the_one_flex_attention_builds(name):
    mod = MODS[name]
    expected = _mask_by_loop(mod)
    assert torch.equal(masks.materialize(mod, tq=T, tk=T, batch=B, heads=H), expected)
    assert torch.equal(create_mask(mod, B, H, T, T, device="cpu"), expected)


def _inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=generator, requires_grad=True) for _ in range(3)]


def _check_forward_backward(mod, backend, *, causal):
    q, k, v = _inputs(7)
    allowed = _mask_by_loop(mod)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool).tril()
    out = attnlab.attention(q, k, v, mask=mod, causal=causal, backend=backend)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    expected = _attention_fp64(qd, kd, vd, allowed)
    expected_grads = torch.autograd.grad(expected, (qd, kd, vd), grad_out.double())
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), want, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked"])
@pytest.mark.parametrize("name", MODS)
def test_every_backend_forward_and_backward(name, backend):
    _check_forward_backward(MODS[name], backend, causal=False)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked", "blocks"])
@pytest.mark.parametrize("name", ["flamingo", "shared_tag", "or"])
def test_with_causal_on_every_backend_blocks_included(name, backend):
    """causal=True ANDs a CausalMod, whose bounds let blocks serve; the plain part is vmapped."""
    _check_forward_backward(MODS[name], backend, causal=True)


class FlamingoWithBounds(masks.MaskMod):
    """A Flex-style mod (scalar indexing) that declares key bounds, so blocks serves it."""

    broadcasts = False  # its __call__ is written for one position

    def __call__(self, b, h, q_idx, kv_idx):
        return flamingo(b, h, q_idx, kv_idx)

    def kv_bounds(self, q_start, q_end):
        seen = (INTERVALS[:, 0] < q_end) & (INTERVALS[:, 1] > q_start)  # images these queries see
        keys = seen[IMAGE_OF].nonzero().flatten()
        return (0, 0) if keys.numel() == 0 else (int(keys[0]), int(keys[-1]) + 1)


@pytest.mark.parametrize("backend", ["reference", "chunked", "blocks"])
def test_a_mask_mod_subclass_written_for_one_position(backend):
    _check_forward_backward(FlamingoWithBounds(), backend, causal=False)


def test_flex_backend_serves_a_flex_style_mod_on_cpu():
    """Compiles once: 128 keys (flex declines partial key blocks on CPU), forward only."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=generator) for _ in range(3))
    image_of = torch.arange(128) // 40
    intervals = torch.tensor([[0, 50], [30, 100], [90, 128], [100, 128]])

    def cross(b, h, q_idx, kv_idx):
        interval = intervals[image_of[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    with torch.no_grad():
        out = attnlab.attention(q, k, v, mask=cross, backend="flex")
    allowed = _mask_by_loop(cross, batch=1, heads=1, tq=128, tk=128)
    torch.testing.assert_close(out.double(), _attention_fp64(q, k, v, allowed), atol=2e-5, rtol=2e-5)


def test_a_mod_vmap_refuses_but_the_grid_evaluates_still_runs():
    """Grid-only code (numpy) written for attnlab before keeps working."""
    table = (torch.arange(T)[:, None] % 3 != torch.arange(T) % 2).numpy()  # (T, T)

    def from_numpy(b, h, q_idx, kv_idx):
        return torch.from_numpy(table[q_idx.numpy(), kv_idx.numpy()])

    expected = torch.from_numpy(table).expand(1, 1, T, T)
    assert torch.equal(masks.materialize(from_numpy, tq=T, tk=T), expected)


def branching(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:  # Python control flow on index values: neither vmap nor a grid can run it
        return torch.tensor(True)
    return torch.tensor(False)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked", "blocks"])
def test_a_mod_that_cannot_be_evaluated_gets_one_clear_error(backend):
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(TypeError) as caught:
        attnlab.attention(q, q, q, mask=branching, causal=backend == "blocks", backend=backend)
    message = str(caught.value)
    assert message.startswith("mask: the mask mod branching cannot be evaluated")
    assert "torch.vmap" in message and "Python if/while" in message
    assert "data-dependent control flow" in message  # vmap's reason
    assert "ambiguous" in message  # the grid's reason


def test_head_shifted_mod_evaluates_a_plain_mod_per_position():
    """distributed's head shard wraps the user's mod; the plain mod inside is still vmapped."""
    from attnlab.distributed.ulysses import HeadShiftedMod

    per_head = lambda b, h, q_idx, kv_idx: INTERVALS[h][0] <= kv_idx  # noqa: E731
    shifted = HeadShiftedMod(per_head, offset=1)
    expected = _mask_by_loop(per_head, batch=1, heads=3)[:, 1:]
    assert torch.equal(masks.materialize(shifted, tq=T, tk=T, heads=2), expected)


def test_docs_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "sparse.md").read_text()
    section = text.split("## Mask mods of your own, written as for FlexAttention", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/sparse.md", "exec"), {})


def test_an_error_the_mod_raises_itself_reaches_the_user_as_it_is():
    def refusing(b, h, q_idx, kv_idx):
        raise LookupError("no table for this model")

    with pytest.raises(LookupError, match="no table for this model"):
        masks.materialize(refusing, tq=4, tk=4)


def test_a_mod_returning_several_values_per_position_is_refused():
    lengths = torch.tensor([3, 5])

    def whole_rows(b, h, q_idx, kv_idx):  # ignores the indices: a (B, 1, 1, Tk) mask
        return (torch.arange(T) < lengths[:, None])[:, None, None, :]

    with pytest.raises(TypeError, match=r"mask: the mask mod .*whole_rows returned shape \(2, 1, 1, 20\) "
                                        r"for one position"):
        masks.materialize(whole_rows, tq=T, tk=T, batch=2)
