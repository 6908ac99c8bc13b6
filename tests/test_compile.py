"""attnlab under torch.compile: every call kind traces whole (0 graph breaks) and equals eager,
a compiled MultiHeadAttention has no graph break, and dispatch reads no tensor values (it runs
on meta tensors, which hold none, and chooses there what it chooses for real ones).

Dynamo is run with the "eager" backend (the traced graph is executed as is): whether the trace
is whole is what these tests prove; inductor's code generation is a benchmark's business.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import backends, masks
from attnlab.backends import build_call
from attnlab.nn import CallMask, MultiHeadAttention

B, H, T, D = 2, 4, 48, 16
_LENGTHS = torch.tensor([T, 30])


def _options(kind: str) -> dict:
    pad = masks.padding_mask(_LENGTHS, T)  # (B, 1, 1, T)
    return {
        "none": {},
        "causal": dict(causal=True),
        "bottom_right": dict(causal=True, align="bottom_right"),
        "bool": dict(mask=pad),
        "transformers_bool": dict(mask=pad & masks.causal_mask(T)),  # (B, 1, T, T)
        "float": dict(mask=torch.zeros(B, 1, 1, T).masked_fill(~pad, float("-inf"))),
        "window_mod": dict(mask=masks.sliding_window_mod(T, T, 8)),
        "padding_mod": dict(mask=masks.padding_mod(_LENGTHS)),
        "document_mod": dict(mask=masks.document_mod(torch.arange(T).div(20, rounding_mode="floor")[None])),
        "plain_function_mod": dict(mask=lambda b, h, i, j: (i - j).abs() <= 5),
        "gqa_causal": dict(causal=True),
    }[kind]


KINDS = ["none", "causal", "bottom_right", "bool", "transformers_bool", "float", "window_mod",
         "padding_mod", "document_mod", "plain_function_mod", "gqa_causal"]


def _qkv(kind: str):
    gen = torch.Generator().manual_seed(0)
    kv_heads = 2 if kind == "gqa_causal" else H
    q = torch.randn(B, H, T, D, generator=gen)
    k, v = (torch.randn(B, kv_heads, T, D, generator=gen) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kind", KINDS)
def test_every_call_kind_traces_whole_and_equals_eager(kind):
    options = _options(kind)
    q, k, v = _qkv(kind)

    def call(q, k, v):
        return attnlab.attention(q, k, v, **options)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(call)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(call, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(compiled, call(q, k, v), rtol=1e-5, atol=1e-5)
    want = attnlab.attention(q.double(), k.double(), v.double(), backend="reference", **options)
    torch.testing.assert_close(compiled.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "bool", "window_mod"])
def test_a_compiled_call_gives_the_eager_gradients(kind):
    options = _options(kind)
    leaves = [t.requires_grad_() for t in _qkv(kind)]

    def loss(q, k, v):
        return attnlab.attention(q, k, v, **options).square().sum()

    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="eager")(*leaves), leaves)
    eager = torch.autograd.grad(loss(*leaves), leaves)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_a_compiled_multihead_attention_has_no_graph_break(padded, train):
    module = MultiHeadAttention(32, 32, num_heads=4).train(train)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1))
    kwargs = dict(mask=CallMask(padding=masks.padding_mask(_LENGTHS, T)[:, 0, 0])) if padded else {}
    torch._dynamo.reset()
    explained = torch._dynamo.explain(module)(x, **kwargs)
    assert explained.graph_break_count == 0, explained.break_reasons
    if not train:
        compiled = torch.compile(module, fullgraph=True, backend="eager")(x, **kwargs)
        torch.testing.assert_close(compiled, module(x, **kwargs))


@pytest.mark.parametrize("kind", KINDS)
def test_dispatch_reads_no_values(kind):
    """Meta tensors hold no values (any read raises) and attention runs on them; fake CPU
    tensors hold none either and get the choice real CPU tensors get."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    options = _options(kind)
    real = _qkv(kind)
    moved = lambda to: {key: (to(val) if isinstance(val, torch.Tensor) else val)  # noqa: E731
                        for key, val in options.items()}
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            meta = [t.to("meta").requires_grad_(grad) for t in real]
            out = attnlab.attention(*meta, **moved(lambda t: t.to("meta")))
            assert out.device.type == "meta" and out.shape == (B, H, T, D)
            want = backends.select(build_call(*[t.detach().requires_grad_(grad) for t in real], **options))
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # mods keep their own tensors
                fake = [mode.from_tensor(t).requires_grad_(grad) for t in real]
                call = build_call(*fake, **moved(mode.from_tensor))
                assert backends.select(call).name == want.name


def test_backends_that_read_values_decline_while_compiling(monkeypatch):
    """blocks plans its pieces from the mask's values; while compiling it steps aside for sdpa."""
    q, k, v = _qkv("window_mod")
    call = build_call(q, k, v, **_options("window_mod"))
    assert backends.reasons(call)["blocks"] == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    call = build_call(q, k, v, **_options("window_mod"))
    found = backends.reasons(call)
    assert any("torch.compile cannot trace" in r for r in found["blocks"])
    assert found["sdpa"] == [] and found["reference"] == []
