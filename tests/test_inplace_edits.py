"""A mask mod holding tensors, edited in place between calls, is seen by every backend and by
``attnlab.plan`` (docs/contract.md, "Masks as prepared values": nothing is keyed on tensor
contents, so an in-place edit is always seen). The reference is the fp64 oracle on a fresh mod
built from a copy of the edited tensors."""

import pytest
import torch

import attnlab
from attnlab import masks

T = 256  # auto chooses blocks for a document mask here


def _documents(dtype):
    ids = torch.zeros(1, T, dtype=dtype)
    ids[:, T // 2:] = 1
    return (ids,), masks.document_mod, lambda t: t[:, T // 4:].fill_(2)  # one document grows backwards


def _padding(dtype):
    return (torch.tensor([T // 2], dtype=dtype),), masks.padding_mod, lambda t: t.fill_(T - 7)


def _varlen(dtype):
    lengths = (torch.tensor([T // 2], dtype=dtype), torch.tensor([T // 2], dtype=dtype))
    return lengths, masks.varlen_causal_mod, lambda q_len, k_len: (q_len.fill_(T - 3), k_len.fill_(T - 3))


def _documents_and_window(dtype):
    ids, make, edit = _documents(dtype)
    return ids, lambda t: make(t) & masks.sliding_window_mod(T, T, 100), edit


CASES = {"documents": _documents, "padding": _padding, "varlen": _varlen, "documents_window": _documents_and_window}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, T, 8, generator=g) for _ in range(3)]


def _oracle(q, k, v, make, tensors):
    fresh = make(*(t.clone() for t in tensors))
    out = attnlab.attention(q.double(), k.double(), v.double(), mask=fresh, backend="reference")
    return out.float()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["auto", "blocks", "chunked", "reference", "plan"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_an_in_place_edit_of_a_held_mods_tensors_is_seen(case, backend, dtype):
    tensors, make, edit = CASES[case](dtype)
    mod = make(*tensors)
    q, k, v = _inputs()
    if backend == "plan":
        planned = attnlab.plan(q, k, v, mask=mod)
        run = lambda: planned(q, k, v)  # noqa: E731
    else:
        run = lambda: attnlab.attention(q, k, v, mask=mod, backend=backend)  # noqa: E731
    before = run()
    assert (before - _oracle(q, k, v, make, tensors)).abs().max() < 1e-5
    edit(*tensors)
    after, want = run(), _oracle(q, k, v, make, tensors)
    assert (want - before).abs().max() > 0.1  # the edit changes the answer
    assert (after - want).abs().max() < 1e-5
