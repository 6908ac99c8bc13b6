"""Empty batches and sequences (B, Tq or Tk of 0) on every backend and in the modules, with and
without sinks.

The fused CPU kernel that ``blocks`` calls divides by ``B * H``: an empty batch killed the
process with SIGFPE, which would also kill a pytest worker (so did the CPU flash op that sdpa
applies sinks through, on an empty sequence). Each backend's cases therefore run
in a subprocess, and a crash shows up as its exit signal.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import attnlab
from attnlab import backends
from attnlab.nn import CallMask

BACKENDS = ["auto", "reference", "sdpa", "chunked", "blocks", "flex"]

# Runs in a fresh interpreter with the backend name as argv[1]; prints one line per case.
SCRIPT = textwrap.dedent('''
    import sys, torch, attnlab
    from attnlab import masks

    def fp64(q, k, v, allowed):
        """softmax(q k^T / sqrt(D)) v in fp64, zero rows where nothing is allowed."""
        scores = (q.double() @ k.double().transpose(-2, -1)) / q.shape[-1] ** 0.5
        alive = allowed.any(dim=-1, keepdim=True)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")).masked_fill(~alive, 0.0), -1)
        return (weights * alive) @ v.double()

    def masks_for(b, tq, tk):
        ids = torch.arange(max(tq, tk)).div(7, rounding_mode="floor").expand(b, -1)
        return {
            "causal": (dict(causal=True), masks.causal_mask(tq, tk)),
            "window": (dict(mask=masks.sliding_window_mod(tq, tk, 2)), masks.sliding_window_mask(tq, tk, 2)),
            "documents": (dict(mask=masks.document_mod(ids)),
                          masks.materialize(masks.document_mod(ids), tq=tq, tk=tk, batch=b)),
            "none": ({}, torch.ones(tq, tk, dtype=torch.bool)),
        }

    backend = sys.argv[1]
    cases = [(b, tq, tk, sinks) for sinks in (None, "head", "query")
             for b, tq, tk in ((0, 300, 300), (0, 16, 16), (2, 0, 16), (2, 16, 0), (2, 0, 0))]
    for b, tq, tk, sinks in cases:  # every output is empty or zero, with sinks too (they take the mass)
        for name, (options, allowed) in masks_for(b, tq, tk).items():
            q = torch.randn(b, 2, tq, 8, requires_grad=True)
            k = torch.randn(b, 2, tk, 8, requires_grad=True)
            learnable = None
            if sinks:  # learnable, per head (2,) or per query (B, 2, Tq): a zero gradient
                learnable = torch.randn((2,) if sinks == "head" else (b, 2, tq), requires_grad=True)
                options = dict(options, sinks=learnable)
                name += "+sinks" if sinks == "head" else "+query_sinks"
            try:
                out = attnlab.attention(q, k, k, backend=backend, **options)
            except ValueError as err:
                assert "cannot serve" in str(err), err
                print(b, tq, tk, name, "declined")
                continue
            torch.testing.assert_close(out.double(), fp64(q, k, k, allowed), atol=1e-5, rtol=1e-5)
            out.sum().backward()
            assert q.grad.shape == q.shape and k.grad.shape == k.shape
            assert q.grad.eq(0).all() and k.grad.eq(0).all()  # every case here is empty
            if learnable is not None:  # sdpa's empty output was connected to no sinks: no grad
                assert learnable.grad is not None and learnable.grad.eq(0).all(), learnable.grad
            print(b, tq, tk, name, "ok")
''')


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sizes_on_every_backend_match_fp64(backend):
    if backend != "auto" and backend not in backends.available():
        pytest.skip(f"{backend} not available")
    done = subprocess.run([sys.executable, "-c", SCRIPT, backend], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()
    assert len(lines) == 3 * 5 * 4, done.stdout  # without sinks, with sinks per head and per query
    if backend in ("auto", "reference", "sdpa", "chunked"):
        assert all(line.endswith(" ok") for line in lines), done.stdout
    if backend == "blocks":  # blocks serves the masked calls with an empty batch
        assert all(line.endswith(" ok") for line in lines
                   if line.startswith("0 ") and "none" not in line and "sinks" not in line)


MODULES = textwrap.dedent('''
    import torch
    from attnlab.nn import CallMask, MultiHeadAttention
    from attnlab.models import BertEncoder, GPT
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 16, num_heads=2, positions="rope", backend="blocks")
    x = torch.randn(0, 300, 16, requires_grad=True)
    out = mha(x, mask=CallMask(documents=torch.zeros(0, 300, dtype=torch.long)))
    out.sum().backward()
    assert out.shape == (0, 300, 16) and x.grad.shape == x.shape
    out = MultiHeadAttention(16, 16, num_heads=2)(torch.randn(0, 300, 16))
    assert out.shape == (0, 300, 16)
    gpt = GPT(vocab_size=11, max_len=300, d_model=16, num_layers=2, num_heads=2)
    assert gpt(torch.zeros(0, 300, dtype=torch.long)).shape == (0, 300, 11)
    bert = BertEncoder(vocab_size=11, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    assert bert(torch.zeros(0, 7, dtype=torch.long), torch.zeros(0, 7, dtype=torch.long)).shape == (0, 7, 16)
    print("ok")
''')


def test_modules_with_an_empty_batch_return_empty_outputs():
    done = subprocess.run([sys.executable, "-c", MODULES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", f"exit {done.returncode}\n{done.stderr}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_heads_are_refused_by_name_on_every_backend(backend):
    q = torch.randn(1, 0, 4, 8)
    with pytest.raises(ValueError, match="at least one head"):
        attnlab.attention(q, q, q, causal=True, backend=backend)
